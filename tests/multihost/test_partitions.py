"""Partitions on three hosts (network namespaces) started with the head's defaults: the default
heartbeat TTL (3 s) and a driver that follows its actors' output (log_to_driver on). A cut link is
never healed unless the test says so: no call, get() or shutdown may wait for it.

Each driver runs in a host of the bed and reports with JSON lines; times are CLOCK_MONOTONIC,
which every namespace shares, so the test compares them with the moment it cut the link."""
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from torch_driver import TORCH_LOOP  # noqa: E402
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
rt = _api.runtime()

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


# The user's own PyTorch loop (TorchTrainer), one rank per host; host 2 is cut while it trains.
# Each step sleeps 0.1 s (its compute), so the cut lands in the middle of the run.
TORCH_TRAIN_DURING_CUT = "STEP_PAUSE = 0.1\n" + TORCH_LOOP + """
t = TorchTrainer(loop, data=data, global_batch_size=12, steps_per_call=2, progress=False,
                 scaling=ScalingConfig(min_workers=1, max_workers=3))

def where():
    nodes = {n["id"]: n["address"].rsplit(":", 1)[0] for n in _api.nodes()}
    return {nodes.get(rt.actor_info(x._id)["node_id"]): m["pid"]
            for x, m in zip(t.trainers, [m for m in t.members() if m["kind"] == "trainer"])}

t.fit(4)
say(where=where(), step=t.step)
hear()
t.fit(60)  # the cut comes while this runs
say(world=len(t.trainers), where=where(), step=t.step, hashes=t.parameter_hash(), recoveries=t.recoveries,
    steps=[r["step"] for r in t.history])
hear()
t.close()
troupe.shutdown()
"""


@pytest.mark.skipif(not list((BUILD / "python" / "troupe").glob("_dist.*.so")), reason="built without troupe._dist")
def test_a_torch_trainer_loop_goes_on_without_a_cut_host_and_its_survivors_keep_their_processes(testbed3):
    bed = testbed3
    controller, token = start_cluster(bed.hosts)
    victim = bed.hosts[2]
    d = Driver(bed.hosts[0], controller, token, TORCH_TRAIN_DURING_CUT)
    r = d.hear(240)
    before = r["where"]
    assert sorted(before) == sorted(h.address for h in bed.hosts), r  # one rank per host
    step_before = r["step"]
    d.tell(go=True)
    eventually(lambda: any(g["step"] >= step_before + 4 for g in status(bed.hosts[0], controller, token)["groups"]),
               120, "training to be under way")
    victim.cut()
    r = d.hear(300)
    print("after the cut:", r)
    # The group re-formed without the cut host (its node is declared dead after the TTL: no
    # collective waited on it longer), the survivors in the processes they had, every step once.
    assert r["world"] == 2 and victim.address not in r["where"], r
    assert all(before[ip] == pid for ip, pid in r["where"].items()), (before, r)
    assert len(r["recoveries"]) >= 1 and len(set(r["hashes"])) == 1, r
    assert r["step"] == step_before + 60 and r["steps"] == list(range(1, r["step"] + 1)), r
    d.tell(go=True)
    assert d.exit_code(60) == 0
    assert victim.is_cut


# An actor on host 1 that calls one on host 2: calls that never touch the head.
ASKER_AND_ECHO = """
@troupe.remote(num_cpus=0, resources={"host1": 1})
class Asker:
    def ask(self, peer, n):
        return troupe.get(peer.echo.remote(n), timeout=10)

@troupe.remote(num_cpus=0, resources={"host2": 1})
class Echo:
    def echo(self, n):
        return n

a, b = Asker.remote(), Echo.remote()
"""

PEERS_DURING_HEAD_CUT = ASKER_AND_ECHO + """assert troupe.get(a.ask.remote(b, 0), timeout=60) == 0  # A has found B before the cut
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

RECOVERED = ASKER_AND_ECHO + """
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
        # No pid file: the stale agent has exited already (it removes its own on the way out).
        for agent in [int(f.read_text()) for f in pids.glob("node-*.pid")]:
            eventually(lambda: not os.path.exists(f"/proc/{agent}") or
                       open(f"/proc/{agent}/stat").read().split(")")[1].split()[0] == "Z", 30,
                       f"{host}'s stale agent to exit")
    for host in bed.hosts[1:]:
        join(host, controller, token)
    d = Driver(bed.hosts[2], controller, token, RECOVERED)
    assert d.hear(120)["answer"] == 7
    assert d.exit_code(30) == 0


# A job (`troupe job submit`) whose driver follows an actor on a host that is then cut. The job's
# supervisor (0 CPUs) is placed on the node with the most free CPUs: HOLD_CPUS takes every other
# host's one CPU while the job is submitted, so the test chooses where the job's driver runs.
HOLD_CPUS = """
@troupe.remote(num_cpus=1)
class Hold:
    def ok(self):
        return True

holds = [Hold.options(resources={h: 1}).remote() for h in hear()["hosts"]]
troupe.get([h.ok.remote() for h in holds], timeout=60)
say(held=True)
hear()  # the job is placed
troupe.shutdown()
"""

JOB_WITH_A_CUT_ACTOR = """
import os, sys, time
import troupe

troupe.init()  # TROUPE_ADDRESS, as every job's driver; log_to_driver on

@troupe.remote(num_cpus=0, resources={sys.argv[1]: 1})
class Sleeper:
    def node(self):
        return os.environ["TROUPE_NODE_ID"]

    def block(self):
        print("blocking on", os.environ["TROUPE_NODE_IP"], flush=True)
        time.sleep(3600)

s = Sleeper.remote()
print("driver on", os.environ.get("TROUPE_NODE_IP"), "actor on node", troupe.get(s.node.remote(), timeout=60), flush=True)
ref = s.block.remote()
try:
    troupe.get(ref, timeout=120)
    print("the call returned", flush=True)
except Exception as e:
    print(f"failed_at={time.monotonic()} {type(e).__name__}: {e}", flush=True)
    troupe.shutdown()
    print(f"shut_at={time.monotonic()}", flush=True)
    raise SystemExit(f"the job's actor died: {type(e).__name__}")
"""


def job(host, controller, token, *args, timeout=30, check=True):
    """`troupe job ARGS` on `host`; the process and its time in seconds."""
    t0 = time.monotonic()
    p = host.troupe("job", "--address", controller, *args, env={"TROUPE_TOKEN": token}, timeout=timeout, check=check)
    return p, time.monotonic() - t0


def submit_job_on(bed, controller, token, where, script, name, args):
    """Submits `script` from the head with every host but `where` holding its CPU, so the job's
    supervisor and driver run on `where`; returns the job's status."""
    others = [f"host{h.index}" for h in bed.hosts if h is not where]
    hold = Driver(bed.hosts[0], controller, token, HOLD_CPUS)
    hold.tell(hosts=others)
    assert hold.hear(120)["held"]
    job(bed.hosts[0], controller, token, "submit", str(script), "--name", name, "--", *args, timeout=90)
    hold.tell(go=True)
    assert hold.exit_code(30) == 0
    p, _ = job(bed.hosts[0], controller, token, "status", name)
    return p.stdout


def job_logs(bed, controller, token, name, text, timeout):
    """The job's output once it holds `text` (asked with `troupe job logs`, with a deadline)."""
    return eventually(lambda: (lambda out: out if text in out else None)(
        job(bed.hosts[0], controller, token, "logs", name)[0].stdout), timeout, f"{text!r} in the job's output")


@pytest.fixture
def job_name():
    """A job name of this test alone; the job's directory (made by its supervisor in /tmp, which
    every host of the bed shares) goes with the bed's processes, so it is removed here."""
    name = f"cut-{os.urandom(3).hex()}"
    yield name
    for path in Path(tempfile.gettempdir()).glob(f"troupe-job-{name}-*"):
        shutil.rmtree(path, ignore_errors=True)


def test_a_job_whose_actor_is_on_a_cut_host_fails_with_the_nodes_death_and_its_driver_shuts_down(testbed3, tmp_path,
                                                                                                 job_name):
    bed = testbed3
    controller, token = start_cluster(bed.hosts)
    driver_host, victim = bed.hosts[1], bed.hosts[2]
    script = tmp_path / "cut_actor.py"
    script.write_text(JOB_WITH_A_CUT_ACTOR)
    assert "RUNNING" in submit_job_on(bed, controller, token, driver_host, script, job_name, [f"host{victim.index}"])
    # The actor's output reaches the job's log through the driver's follower, which reads from
    # the victim's agent: the connection the cut leaves waiting.
    out = job_logs(bed, controller, token, job_name, "blocking on", 120)
    assert f"driver on {driver_host.address}" in out, out
    node = out.split("actor on node ")[1].split()[0]
    assert node == node_of(bed.hosts[0], controller, token, victim)["id"]

    cut_at = time.monotonic()
    victim.cut()
    # status and logs answer from the head while the host is not yet declared DEAD, and after.
    p, status_s = job(bed.hosts[0], controller, token, "status", job_name, timeout=TTL_S + 2)
    assert f"{job_name}: " in p.stdout, p.stdout
    out = job_logs(bed, controller, token, job_name, "shut_at=", TTL_S + 10)
    failed_s = float(out.split("failed_at=")[1].split()[0]) - cut_at
    shut_s = float(out.split("shut_at=")[1].split()[0]) - cut_at
    eventually(lambda: "FAILED" in job(bed.hosts[0], controller, token, "status", job_name)[0].stdout, 10,
               "the job to end")
    ended_s = time.monotonic() - cut_at
    p, logs_s = job(bed.hosts[0], controller, token, "logs", job_name)
    print(f"job status answered in {status_s:.2f} s; the actor's call failed {failed_s:.2f} s after the cut, the "
          f"driver's shutdown returned at {shut_s:.2f} s, the job was FAILED by {ended_s:.2f} s; logs took "
          f"{logs_s:.2f} s")
    line = next(x for x in p.stdout.splitlines() if "failed_at=" in x)
    assert "ActorDiedError" in line and node in line and ("declared DEAD" in line or "its node" in line), line
    assert failed_s <= TTL_S + 2 and shut_s <= TTL_S + 2, (failed_s, shut_s)
    status_line = job(bed.hosts[0], controller, token, "status", job_name)[0].stdout
    assert "exit code 1" in status_line and "the job's actor died: ActorDiedError" in status_line, status_line
    assert job_name in job(bed.hosts[0], controller, token, "list")[0].stdout
    assert victim.is_cut


def test_a_job_whose_driver_is_on_a_cut_host_is_answered_for_and_its_actor_elsewhere_ends(testbed3, tmp_path,
                                                                                        job_name):
    bed = testbed3
    controller, token = start_cluster(bed.hosts)
    head, other, victim = bed.hosts
    script = tmp_path / "cut_driver.py"
    script.write_text(JOB_WITH_A_CUT_ACTOR)
    assert "RUNNING" in submit_job_on(bed, controller, token, victim, script, job_name, [f"host{other.index}"])
    out = job_logs(bed, controller, token, job_name, "blocking on", 120)
    assert f"driver on {victim.address}" in out and f"blocking on {other.address}" in out, out

    cut_at = time.monotonic()
    victim.cut()
    # The job's record is its supervisor, on the cut host: asked at once, status answers with the
    # supervisor's death by its node (a connect to its worker is cut short at TTL + 1 s), and
    # once that death is known the job is no longer there to ask.
    p, status_s = job(head, controller, token, "status", job_name, timeout=TTL_S + 2, check=False)
    assert p.returncode != 0 and ("its node" in p.stderr or "no job named" in p.stderr), p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]  # one line saying why, not Python's insides
    p, logs_s = job(head, controller, token, "logs", job_name, timeout=TTL_S + 2, check=False)
    assert p.returncode != 0 and ("its node" in p.stderr or "no job named" in p.stderr), p.stderr[-2000:]
    p, list_s = job(head, controller, token, "list", timeout=TTL_S + 2)
    # The cut driver's session ends with its connection to the controller: its actor on the
    # other host is not left running for a driver that cannot reach it.
    sleeper = lambda: next(a for a in status(head, controller, token)["actors"] if a["type"] == "py:Sleeper")  # noqa: E731
    eventually(lambda: sleeper()["state"] == "DEAD", 2 * TTL_S + 2, "the cut driver's actor to end")
    ended_s = time.monotonic() - cut_at
    print(f"job status answered in {status_s:.2f} s, logs {logs_s:.2f} s, list {list_s:.2f} s; the cut driver's "
          f"actor on another host ended {ended_s:.2f} s after the cut ({sleeper()['death_reason']})")
    assert ended_s <= 2 * TTL_S + 2, ended_s  # its connection ends within TTL + 1 s, then the kill
    assert victim.is_cut
