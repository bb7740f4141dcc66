"""Partitions on three hosts (network namespaces) started with the head's defaults: the default
heartbeat TTL (3 s) and a driver that follows its actors' output (log_to_driver on). A cut link is
never healed unless the test says so: no call, get() or shutdown may wait for it.

Each driver runs in a host of the bed and reports with JSON lines; times are CLOCK_MONOTONIC,
which every namespace shares, so the test compares them with the moment it cut the link."""
import json
import os
import queue
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from troupe_testing import BUILD, eventually  # noqa: E402

TTL_S = 3.0  # the controller's default (--heartbeat-ttl-ms 3000): the tests start no other
PORT = 6380


def start_cluster(hosts):
    """The head on hosts[0] with its defaults (one CPU and a resource naming each host), the others
    joined. Returns (controller, token)."""
    head = hosts[0]
    head.troupe("start", "--head", "--node-ip-address", head.address, "--port", str(PORT), "--num-cpus", "1",
                "--resources", "host0=1")
    controller = f"{head.address}:{PORT}"
    token = json.loads((Path(head.env["TROUPE_TEMP_DIR"]) / "latest" / "cluster.json").read_text())["token"]
    for host in hosts[1:]:
        join(host, controller, token)
    return controller, token


def join(host, controller, token):
    p = host.troupe("start", "--address", controller, "--num-cpus", "1", "--resources", f"host{host.index}=1",
                    env={"TROUPE_TOKEN": token})
    assert f"({host.address}) joined" in p.stdout, p.stdout


def status(host, controller, token, timeout=60):
    return json.loads(host.troupe("status", "--json", "--address", controller, env={"TROUPE_TOKEN": token},
                                  timeout=timeout).stdout)


def node_of(host, controller, token, target):
    nodes = status(host, controller, token)["nodes"]
    return next(n for n in nodes if n["address"].startswith(target.address + ":") and n["state"] == "ALIVE")


class Driver:
    """A Python driver on `host` (troupe.init with the defaults, log_to_driver on), running `code`
    after init; it talks to the test one JSON line at a time (say() / hear())."""

    PRELUDE = textwrap.dedent("""
        import json, os, sys, time
        sys.path.insert(0, %(pkg)r)
        import troupe
        def say(**kw):
            print("@" + json.dumps(kw), flush=True)
        _heard = 0
        def hear():  # the test's next message: a file (a thread blocked reading stdin held back the printer's output)
            global _heard
            _heard += 1
            path = os.path.join(%(inbox)r, str(_heard))
            while not os.path.exists(path):
                time.sleep(0.02)
            return json.loads(open(path).read())
        troupe.init(%(controller)r, token=%(token)r)
    """)

    def __init__(self, host, controller, token, code):
        self.inbox = tempfile.mkdtemp(prefix="troupe-partition-driver-")
        script = self.PRELUDE % {"pkg": str(BUILD / "python"), "controller": controller, "token": token,
                                 "inbox": self.inbox}
        self.proc = host.popen(["/usr/bin/python3", "-c", script + textwrap.dedent(code)], stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        self.output = []  # every line it printed, its actors' followed output included
        self.told = 0
        self.lines = queue.Queue()  # read by a thread: select() cannot see what a reader buffered
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.proc.stdout], daemon=True).start()

    def tell(self, **msg):
        self.told += 1
        path = os.path.join(self.inbox, str(self.told))
        with open(path + ".tmp", "w") as f:
            f.write(json.dumps(msg))
        os.rename(path + ".tmp", path)

    def _next_line(self, deadline):
        try:
            return self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return ""

    def hear(self, timeout):
        """The driver's next report (its other lines are kept in self.output)."""
        deadline = time.monotonic() + timeout
        while True:
            line = self._next_line(deadline)
            if not line:
                self.proc.kill()
                raise AssertionError(f"the driver said nothing in {timeout} s; its output:\n" + "".join(self.output)
                                     + "\nstderr:\n" + self.proc.stderr.read()[-4000:])
            if line.startswith("@"):
                return json.loads(line[1:])
            self.output.append(line)

    def wait_output(self, text, timeout):
        """Reads the driver's lines until one contains `text`."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.output):
            line = self._next_line(deadline)
            if not line:
                raise AssertionError(f"no {text!r} from the driver in {timeout} s:\n" + "".join(self.output))
            self.output.append(line)

    def exit_code(self, timeout):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"the driver did not exit within {timeout} s; stderr:\n"
                                 + self.proc.stderr.read()[-4000:])


CALL_DURING_CUT = """
import socket
from troupe import exceptions

@troupe.remote(num_cpus=0, resources={"host2": 1})
class Sleeper:
    def __init__(self):
        print("sleeper up on", os.environ["TROUPE_NODE_IP"], flush=True)

    def node(self):
        return os.environ["TROUPE_NODE_ID"]

    def block(self):
        print("blocking", flush=True)
        time.sleep(3600)

s = Sleeper.remote()
node = troupe.get(s.node.remote(), timeout=60)
ref = s.block.remote()
say(node=node)
hear()  # the link is cut now
try:
    troupe.get(ref, timeout=120)
    say(error="the call returned")
except Exception as e:
    say(failed_at=time.monotonic(), kind=type(e).__name__, message=str(e))
hear()
troupe.shutdown()
say(shut_at=time.monotonic())
"""


def test_a_call_to_a_cut_host_fails_with_its_death_and_shutdown_returns(testbed3):
    bed = testbed3
    controller, token = start_cluster(bed.hosts)
    victim = bed.hosts[2]
    d = Driver(bed.hosts[1], controller, token, CALL_DURING_CUT)
    node = d.hear(120)["node"]
    assert node == node_of(bed.hosts[0], controller, token, victim)["id"]
    # The actor's output reaches the driver: its follower reads from the victim's agent.
    d.wait_output("blocking", 30)

    cut_at = time.monotonic()
    victim.cut()
    d.tell(go=True)
    # status from a third host answers while the cut host is not yet declared dead, and after.
    t0 = time.monotonic()
    status(bed.hosts[0], controller, token, timeout=TTL_S + 2)
    status_s = time.monotonic() - t0
    r = d.hear(TTL_S + 10)
    failed_s = r.get("failed_at", 1e9) - cut_at
    print(f"call failed {failed_s:.2f} s after the cut ({r}); status took {status_s:.2f} s")
    assert "failed_at" in r, r
    assert failed_s <= TTL_S + 2, f"the call failed {failed_s:.2f} s after the cut: later than TTL + 2 s"
    assert r["kind"] == "ActorDiedError", r
    # Broken by the node's death ("node N was declared DEAD: its host stopped answering"), or, when
    # keepalive ended the connection first, the controller's verdict ("its node N died").
    assert node in r["message"] and ("declared DEAD" in r["message"] or "its node" in r["message"]), r

    d.tell(go=True)
    r = d.hear(TTL_S + 10)
    shut_s = r["shut_at"] - cut_at
    print(f"troupe.shutdown() returned {shut_s:.2f} s after the cut")
    assert shut_s <= TTL_S + 2, f"shutdown returned {shut_s:.2f} s after the cut: later than TTL + 2 s"
    assert d.exit_code(TTL_S) == 0
    assert victim.is_cut  # never healed


TRAIN_DURING_CUT = """
from troupe import _api
from troupe.train import ElasticTrainer
t = ElasticTrainer(model="tinylm", data="/usr/share/common-licenses/GPL-3", optimizer={"name": "adamw", "lr": 3e-3},
                   global_batch_size=12, max_micro_batch=4, min_workers=1, max_workers=3, context=32,
                   steps_per_call=2, progress=False, seed=7, checkpoint={"snapshot_every": 1}, recovery_timeout=60.0)
rt = _api._runtime()

def where():
    nodes = {n["id"]: n["address"].rsplit(":", 1)[0] for n in _api.nodes()}
    return [nodes.get(rt.actor_info(x._id)["node_id"]) for x in t.trainers]

t.fit(4)
say(where=where(), step=t.step)
hear()
t.fit(40)  # the cut comes while this runs
say(world=len(t.trainers), where=where(), step=t.step, hashes=t.parameter_hash(), recoveries=t.recoveries)
hear()
t0 = time.monotonic()
t.close()
troupe.shutdown()
say(shut_s=time.monotonic() - t0, shut_at=time.monotonic())
"""


@pytest.mark.skipif(not list(BUILD.glob("actors/libtroupe_train_actors.a")), reason="built without LibTorch")
def test_an_elastic_group_recovers_from_a_cut_host_and_the_driver_shuts_down(testbed3):
    bed = testbed3
    controller, token = start_cluster(bed.hosts)
    victim = bed.hosts[2]
    d = Driver(bed.hosts[0], controller, token, TRAIN_DURING_CUT)
    r = d.hear(240)
    assert sorted(r["where"]) == sorted(h.address for h in bed.hosts), r  # one trainer per host
    step_before = r["step"]
    d.tell(go=True)
    eventually(lambda: any(g["step"] >= step_before + 2 for g in status(bed.hosts[0], controller, token)["groups"]),
               120, "training to be under way")
    cut_at = time.monotonic()
    victim.cut()
    r = d.hear(300)
    print("after the cut:", r)
    assert r["world"] == 2 and victim.address not in r["where"], r
    assert len(set(r["hashes"])) == 1 and r["step"] == step_before + 40, r
    d.tell(go=True)
    r = d.hear(60)
    print(f"close + shutdown took {r['shut_s']:.2f} s ({r['shut_at'] - cut_at:.1f} s after the cut)")
    assert r["shut_s"] <= TTL_S + 2, r
    assert d.exit_code(TTL_S) == 0
    assert victim.is_cut


PEERS_DURING_HEAD_CUT = """
@troupe.remote(num_cpus=0, resources={"host1": 1})
class Asker:
    def ask(self, peer, n):
        return troupe.get(peer.echo.remote(n), timeout=10)

@troupe.remote(num_cpus=0, resources={"host2": 1})
class Echo:
    def echo(self, n):
        return n

a, b = Asker.remote(), Echo.remote()
assert troupe.get(a.ask.remote(b, 0), timeout=60) == 0  # A has found B before the cut
say(ready=True)
hear()  # the head is cut now
answers = []
n = 1
deadline = time.monotonic() + 2 * 3.0 + 1
while time.monotonic() < deadline:
    t0 = time.monotonic()
    assert troupe.get(a.ask.remote(b, n), timeout=5) == n
    answers.append(time.monotonic() - t0)
    n += 1
say(answers=len(answers), slowest=max(answers))
os._exit(0)  # its controller is cut off: this driver leaves without a goodbye
"""

RECOVERED = """
@troupe.remote(num_cpus=0, resources={"host1": 1})
class Asker:
    def ask(self, peer, n):
        return troupe.get(peer.echo.remote(n), timeout=10)

@troupe.remote(num_cpus=0, resources={"host2": 1})
class Echo:
    def echo(self, n):
        return n

a, b = Asker.remote(), Echo.remote()
say(answer=troupe.get(a.ask.remote(b, 7), timeout=60))
troupe.shutdown()
"""


def test_actors_on_the_other_hosts_answer_each_other_while_the_head_is_cut(testbed3):
    bed = testbed3
    controller, token = start_cluster(bed.hosts)
    head = bed.hosts[0]
    d = Driver(bed.hosts[1], controller, token, PEERS_DURING_HEAD_CUT)
    assert d.hear(120)["ready"]
    head.cut()
    d.tell(go=True)
    r = d.hear(2 * TTL_S + 1 + 15)
    print("while the head was cut:", r)
    assert r["answers"] >= 5 and r["slowest"] < 5, r
    assert d.exit_code(10) == 0
    # The head heals: the stale agents learn they were declared dead and exit; started again,
    # the hosts join, and actors on them answer each other as before.
    head.heal()
    for host in bed.hosts[1:]:
        pids = Path(host.env["TROUPE_TEMP_DIR"]) / "latest" / "pids"
        agent = int(next(pids.glob("node-*.pid")).read_text())
        eventually(lambda: not os.path.exists(f"/proc/{agent}") or
                   open(f"/proc/{agent}/stat").read().split(")")[1].split()[0] == "Z", 30,
                   f"{host}'s stale agent to exit")
    for host in bed.hosts[1:]:
        join(host, controller, token)
    d = Driver(bed.hosts[2], controller, token, RECOVERED)
    assert d.hear(120)["answer"] == 7
    assert d.exit_code(30) == 0
