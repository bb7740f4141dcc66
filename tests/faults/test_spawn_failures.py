"""A spawn that fails on its node fails that actor alone: the controller keeps its connection to
the node's agent, and the other spawns in flight on it go on (before: any failed spawn dropped
the connection, and every other spawn on it failed with "RpcSystem was destroyed")."""
import os
import signal
from pathlib import Path

import pytest

from troupe_testing import eventually, import_troupe, processes_under

troupe = import_troupe()

pytestmark = pytest.mark.timeout(120)


@troupe.remote(num_cpus=0)
class Probe:
    def facts(self):
        return {"pid": os.getpid(), "zygote": int(os.environ.get("TROUPE_WORKER_FORKED_BY", "0"))}


@pytest.fixture
def cluster():
    troupe.init(num_cpus=2)  # log_to_driver on, as a user runs it
    root = troupe._session.current.run_root
    yield Path(root) / "latest" / "logs"
    troupe.shutdown()
    assert processes_under(root) == [], "shutdown() left processes behind"


def state(handle):
    return troupe._api.runtime().actor_info(handle._id)


def test_an_application_error_of_one_spawn_fails_only_that_actor(cluster):
    logs = cluster
    first = troupe.get(Probe.remote().facts.remote(), timeout=60)  # the node's zygote is up
    zygote = first["zygote"]
    assert zygote > 0, "the Python zygote did not fork the first worker"
    doomed = Probe.options(max_restarts=1).remote()
    doomed_pid = troupe.get(doomed.facts.remote(), timeout=60)["pid"]
    # The seam: the agent cannot make its next incarnation's arguments file (a directory is in
    # its place), so that spawn fails with an application error from the agent.
    (logs / f"actor-{doomed._id}.2.args").mkdir()

    # The other spawns stay in flight on the controller's connection to the agent until the
    # zygote answers (it is stopped; the agent waits 10 s for a fork).
    os.kill(zygote, signal.SIGSTOP)
    try:
        others = [Probe.remote() for _ in range(4)]
        eventually(lambda: all((logs / f"actor-{o._id}.1.args").exists() for o in others), 8,
                   "the agent to receive the other spawns")
        os.kill(doomed_pid, signal.SIGKILL)  # its restart's spawn fails
        eventually(lambda: state(doomed)["state"] == "DEAD", 8, "the failed spawn's actor to end")
        reason = state(doomed)["death_reason"]
        assert "could not start its worker" in reason and f"actor-{doomed._id}.2.args" in reason, reason
        for o in others:
            assert state(o)["state"] != "DEAD", state(o)
    finally:
        os.kill(zygote, signal.SIGCONT)
    facts = troupe.get([o.facts.remote() for o in others], timeout=30)
    assert len({f["pid"] for f in facts}) == len(others)
