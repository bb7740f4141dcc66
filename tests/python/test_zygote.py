"""Python workers forked by the node's zygote (python/troupe/_zygote.py, services/python_zygote.h):
they behave as spawned ones (calls, environment, logs, death reasons), a kill of the zygote leaves
them running and the node forks the next ones from a new zygote, and TROUPE_PYTHON_ZYGOTE=0 spawns
each worker as a new process."""
import json
import os
import random
import re
import signal
import sys
from pathlib import Path

import pytest

from troupe_testing import eventually, free_port, import_troupe, local_cluster, processes_under, run_driver

troupe = import_troupe()

pytestmark = pytest.mark.timeout(150)


def open_fds(pid="self"):
    found = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            pass  # the directory listing's own descriptor
    return found


@troupe.remote(num_cpus=0)
class Probe:
    def __init__(self, tag=""):
        # What the worker holds before its runtime opens anything: no socket of the zygote's.
        self.sockets_at_start = [target for target in open_fds().values() if target.startswith("socket:")]
        self.parent_at_start = os.getppid()
        print(f"probe {tag} out", flush=True)
        print(f"probe {tag} err", file=sys.stderr, flush=True)

    def facts(self):
        return {"pid": os.getpid(), "parent_at_start": self.parent_at_start, "parent": os.getppid(),
                "sockets_at_start": self.sockets_at_start, "env": dict(os.environ), "random": random.random(),
                "argv": sys.argv, "pgid": os.getpgid(0), "sid": os.getsid(0), "cwd": os.getcwd(),
                "nofile": open("/proc/self/limits").read().split("Max open files")[1].split()[:2]}

    def add(self, a, b):
        return a + b

    def exit(self, code):
        print("leaving now", file=sys.stderr, flush=True)
        os._exit(code)


def zygote_pids():
    """Live zygotes, from their node agent's log (the workers they fork keep their command line)."""
    said = re.findall(r"Python zygote ready \(pid (\d+)\)", "".join(p.read_text() for p in log_dir().glob("node-*.log")))
    live = {pid for pid, _ in processes_under(troupe._session.current.run_root)}
    return [int(pid) for pid in said if int(pid) in live]


def log_dir():
    return Path(troupe._session.current.run_root) / "latest" / "logs"


@pytest.fixture
def cluster():
    yield from local_cluster(num_cpus=2)


def node():
    (only,) = troupe.nodes()
    return only


def test_forked_workers_behave_as_spawned_ones(cluster):
    env = {"ZYGOTE_TEST_VALUE": "from the job"}
    a = Probe.options(runtime_env={"env_vars": env}).remote("a")
    b = Probe.remote("b")
    fa, fb = troupe.get([a.facts.remote(), b.facts.remote()])
    zygote = int(fa["env"]["TROUPE_WORKER_FORKED_BY"])
    assert zygote_pids() == [zygote]  # the zygote path was taken, and there is one zygote
    assert fb["env"]["TROUPE_WORKER_FORKED_BY"] == str(zygote)
    agent = node()["pid"]
    assert len(os.listdir(f"/proc/{zygote}/task")) == 1  # it forks with one thread only
    zygote_fds = open_fds(zygote)
    control = zygote_fds[3]
    for facts in (fa, fb):
        # The node agent is its parent from its first line on, as for a spawned worker.
        assert facts["parent_at_start"] == agent and facts["parent"] == agent
        # Neither the zygote's control socket nor the worker's start line is left open in it (what
        # both inherited from the agent stays, as in a spawned worker).
        assert control not in facts["sockets_at_start"]
        assert set(facts["sockets_at_start"]) <= set(zygote_fds.values())
        # The agent's process group, session, working directory and limits, as a spawned worker's.
        assert (facts["pgid"], facts["sid"]) == (os.getpgid(agent), os.getsid(agent))
        assert facts["cwd"] == os.readlink(f"/proc/{agent}/cwd")
        assert facts["nofile"] == open(f"/proc/{agent}/limits").read().split("Max open files")[1].split()[:2]
        assert facts["argv"][1:3] == ["--actor-id", facts["env"]["TROUPE_ACTOR_ID"]]
        e = facts["env"]
        assert e["TROUPE_NODE_ID"] == node()["id"] and e["PYTHONUNBUFFERED"] == "1"
        assert e["TROUPE_METRICS_FILE"].endswith(f"actor-{e['TROUPE_ACTOR_ID']}.1") and e["TROUPE_TOKEN"]
    assert fa["env"]["ZYGOTE_TEST_VALUE"] == "from the job" and "ZYGOTE_TEST_VALUE" not in fb["env"]
    assert fa["random"] != fb["random"]  # reseeded in each worker
    # Each worker publishes its counters in its own file (made on first use, after the fork).
    for facts in (fa, fb):
        assert Path(facts["env"]["TROUPE_METRICS_FILE"]).exists()
    assert fa["pid"] != fb["pid"] and troupe.get(a.add.remote(2, 3)) == 5
    # Each worker's output is in its own files, none in the zygote's.
    for handle, tag in ((a, "a"), (b, "b")):
        out, err = (log_dir() / f"actor-{handle._id}.{s}" for s in ("out", "err"))
        eventually(lambda: f"probe {tag} out" in out.read_text() and f"probe {tag} err" in err.read_text(), 10,
                   f"probe {tag}'s output in its log files")
    zygote_logs = "".join(p.read_text() for p in log_dir().glob("python-zygote-*"))
    assert "probe" not in zygote_logs


def test_death_reasons_of_forked_workers(cluster):
    a = Probe.remote()
    assert "TROUPE_WORKER_FORKED_BY" in troupe.get(a.facts.remote())["env"]
    with pytest.raises(troupe.ActorDiedError, match="exited with code 7.*leaving now"):
        troupe.get(a.exit.remote(7))

    b = Probe.remote()
    facts = troupe.get(b.facts.remote())
    assert "TROUPE_WORKER_FORKED_BY" in facts["env"]
    os.kill(facts["pid"], signal.SIGKILL)
    reason = eventually(lambda: next((x["death_reason"] for x in troupe.actors()
                                      if x["id"] == b._id and x["state"] == "DEAD"), None), 20, "the killed actor DEAD")
    assert "signal 9" in reason and "SIGKILL" in reason, reason


def test_a_killed_zygote_leaves_its_workers_running_and_is_replaced(cluster):
    first = Probe.remote()
    facts = troupe.get(first.facts.remote())
    old = int(facts["env"]["TROUPE_WORKER_FORKED_BY"])
    os.kill(old, signal.SIGKILL)
    eventually(lambda: old not in zygote_pids(), 10, "the zygote to be gone")
    # Its worker runs on, and the next actor starts (a new process, or forked by a new zygote).
    assert troupe.get(first.add.remote(1, 1)) == 2
    assert troupe.get(Probe.remote().add.remote(2, 2)) == 4

    def forked_by_a_new_zygote():
        env = troupe.get(Probe.remote().facts.remote())["env"]
        return env.get("TROUPE_WORKER_FORKED_BY") not in (None, str(old))

    eventually(forked_by_a_new_zygote, 30, "an actor forked by a restarted zygote")
    assert troupe.get(first.add.remote(3, 3)) == 6
    # Killing the old zygote's worker is still seen by its node agent, with the signal.
    os.kill(facts["pid"], signal.SIGKILL)
    reason = eventually(lambda: next((x["death_reason"] for x in troupe.actors()
                                      if x["id"] == first._id and x["state"] == "DEAD"), None), 20,
                        "the first actor DEAD")
    assert "SIGKILL" in reason, reason
    agent_log = "".join(p.read_text() for p in log_dir().glob("node-*.log"))
    assert agent_log.count(f"the Python zygote (pid {old}) ended with signal 9") == 1, agent_log


def test_without_the_zygote_each_worker_is_a_new_process(monkeypatch):
    monkeypatch.setenv("TROUPE_PYTHON_ZYGOTE", "0")
    troupe.init(num_cpus=2)
    root = troupe._session.current.run_root
    try:
        a = Probe.remote()
        facts = troupe.get(a.facts.remote())
        assert "TROUPE_WORKER_FORKED_BY" not in facts["env"]
        assert facts["parent_at_start"] == node()["pid"]
        assert zygote_pids() == []
    finally:
        troupe.shutdown()
    assert processes_under(root) == []


def test_a_tls_cluster_forks_workers_that_speak_tls(troupe):
    """The zygote's interpreter starts with TROUPE_TLS=1 (troupe._core reads it when loaded)."""
    troupe.run("start", "--head", "--tls", "--port", str(free_port()))
    code = (
        "import json, os, troupe\n"
        "troupe.init('auto')\n"
        "@troupe.remote(num_cpus=0)\n"
        "class Env:\n"
        "    def get(self): return dict(os.environ)\n"
        "print(json.dumps(troupe.get(Env.remote().get.remote())))\n"
        "troupe.shutdown()\n")
    done = run_driver(code, env=troupe.env)
    assert done.returncode == 0, done.stderr
    env = json.loads(done.stdout.strip().splitlines()[-1])
    zygote = int(env["TROUPE_WORKER_FORKED_BY"])
    assert env["TROUPE_TLS"] == "1"
    assert b"TROUPE_TLS=1" in Path(f"/proc/{zygote}/environ").read_bytes().split(b"\0")
