#!/usr/bin/env python3
"""bench/run chaos: an elastic group of 2 tinylm trainers on an embedded multi-node cluster (a
head with no CPUs for trainers, two trainer nodes and a spare), trained for --duration seconds
while a killer SIGKILLs, at random every --min-gap to --max-gap seconds, one of: a trainer, a
dataloader, a checkpoint actor, a trainer node's agent (a fresh spare node then joins), the
controller or Redis (the head restarts both), or cuts a trainer node's host off for 10 s (then it
comes back). The nodes share one machine and its loopback, but each has a shared-memory directory
of its own (TROUPE_SHM_DIR), as each host has its own /dev/shm: a cut host's stopped processes
hold nothing its replacement uses. A host cut is made through the same seam as the kills, signals: the node's agent and every process under it (its workers) are
SIGSTOPped for 10 s, then SIGCONTinued. As with a link taken down and up, nothing of that host
answers or resets a connection meanwhile, it is declared DEAD after its heartbeat TTL (its members
restart on a fresh spare node), and when it comes back its stale agent exits with its workers. It
reports each fault and its recovery time (kill
to the next step completed), goodput (time in steps that count / wall time), and checks:
- bitwise_equal: the final parameters equal those of a fault-free run of the same steps
  (snapshots every step, so no step is lost or trained twice);
- exactly_once: every sample was trained on exactly once per epoch (counts differ by at most
  one across samples: the last epoch is partial).

    bench/run chaos [--duration 600] [--min-gap 20] [--max-gap 60] [--seed 1] [--kinds trainer,host_cut,...]
                    [--keep-logs DIR] [--json]
"""
import argparse
import collections
import glob
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time

BUILD = os.environ.get("TROUPE_BIN_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))
import troupe  # noqa: E402
from troupe.cluster_utils import Cluster  # noqa: E402
from troupe import _typed  # noqa: E402
from troupe.train import ElasticTrainer  # noqa: E402

KINDS = ["trainer", "dataloader", "checkpoint", "node_agent", "host_cut", "controller", "redis"]
CUT_S = 10.0  # how long a cut host stays cut off
DATA = "/usr/share/common-licenses/GPL-3"


def make_trainer(name):
    return ElasticTrainer(model="tinylm", data=DATA, optimizer="adamw", global_batch_size=8, max_micro_batch=8,
                          context=32, min_workers=2, max_workers=2, steps_per_call=2, progress=False, seed=0,
                          checkpoint={"snapshot_every": 1}, name=name, replace_timeout=20.0, recovery_timeout=60.0)


def sweep_stale_hosts():
    """Removes the shared-memory directories of chaos runs that were killed (their `owner` pid is
    gone): a run that ends removes its own, one killed midway cannot."""
    for path in glob.glob("/dev/shm/troupe-chaos-shm-*"):
        try:
            with open(os.path.join(path, "owner")) as f:
                pid = int(f.read())
        except (OSError, ValueError):
            continue  # not one this bench marked: not ours to judge
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass


def add_host(cluster):
    """A node with a shared-memory directory of its own (its host's /dev/shm)."""
    shm = tempfile.mkdtemp(prefix="troupe-chaos-shm-", dir="/dev/shm")
    with open(os.path.join(shm, "owner"), "w") as f:
        f.write(str(os.getpid()))
    base = cluster._env
    cluster._env = dict(base, TROUPE_SHM_DIR=shm)
    try:
        cluster.add_node(num_cpus=1)
    finally:
        cluster._env = base
    SHM_DIRS.append(shm)


SHM_DIRS = []


class Chaos:
    """Kills one component at a time and measures how long training takes to move again."""

    def __init__(self, cluster, trainer, rng, min_gap, max_gap, kinds=KINDS):
        self.cluster, self.t, self.rng, self.kinds = cluster, trainer, rng, kinds
        self.min_gap, self.max_gap = min_gap, max_gap
        self.faults = []
        self.stale_agents = []  # cut hosts' agents that did not exit once back
        self.stop = threading.Event()
        self.progress = []  # (monotonic time, step) whenever the step advances

    def run_dir(self):
        return os.path.realpath(os.path.join(self.cluster.temp_dir, "latest"))

    def pid_file(self, name, timeout=30.0):
        # A daemon the head's supervisors are starting again has no pid file for a moment.
        path = os.path.join(self.run_dir(), "pids", f"{name}.pid")
        deadline = time.monotonic() + timeout
        while True:
            try:
                with open(path) as f:
                    return int(f.read().strip())
            except (FileNotFoundError, ValueError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def actor_pid(self, type_name):
        trainer_nodes = {self.t._pg["bundle_nodes"][b] for b in self.t._bundles}
        live = [a for a in troupe.actors() if a["state"] == "ALIVE" and a["type"] == type_name
                and a["node_id"] in trainer_nodes]
        return self.rng.choice(live)["pid"] if live else None

    def victim(self, kind):
        if kind == "trainer":
            return self.actor_pid("Trainer")
        if kind == "dataloader":
            return self.actor_pid("Dataloader")
        if kind == "checkpoint":
            return self.actor_pid("Checkpoint")
        if kind in ("node_agent", "host_cut"):
            busy = {self.t._pg["bundle_nodes"][b] for b in self.t._bundles}
            nodes = [n for n in troupe.nodes() if n["state"] == "ALIVE" and not n["is_head"] and n["id"] in busy]
            return self.rng.choice(nodes)["pid"] if nodes else None
        return self.pid_file(kind)

    def watch(self):
        while not self.stop.is_set():
            self.note_progress()
            time.sleep(0.02)

    def note_progress(self):
        step = self.t.step
        if not self.progress or self.progress[-1][1] != step:
            self.progress.append((time.monotonic(), step))

    def killer(self):
        while not self.stop.wait(self.rng.uniform(self.min_gap, self.max_gap)):
            kind = self.rng.choice(self.kinds)
            pid = self.victim(kind)
            if pid is None:
                continue
            step = self.t.step
            at = time.monotonic()
            if kind == "host_cut":
                self.cut_host(pid, step, at)
                continue
            os.kill(pid, signal.SIGKILL)
            self.faults.append({"kind": kind, "pid": pid, "at": at, "step": step})
            print(f"chaos: killed {kind} (pid {pid}) at step {step}", flush=True)
            if kind == "node_agent":
                add_host(self.cluster)  # the spare for the next node fault

    def cut_host(self, agent, step, at):
        """The node of `agent` falls silent for CUT_S seconds: it and every process under it stop,
        then go on. Afterwards its agent, declared DEAD meanwhile, must exit."""
        frozen = [agent]
        try:
            os.kill(agent, signal.SIGSTOP)  # first, so it starts nothing more
            for pid in descendants(agent):
                try:
                    os.kill(pid, signal.SIGSTOP)
                    frozen.append(pid)
                except ProcessLookupError:
                    pass
            self.faults.append({"kind": "host_cut", "pid": agent, "at": at, "step": step})
            print(f"chaos: cut host of node agent {agent} ({len(frozen)} processes) off at step {step}", flush=True)
            add_host(self.cluster)  # the spare its members move to, as for a lost node
            time.sleep(max(0.0, at + CUT_S - time.monotonic()))  # the fault's length, not a wait for a condition
        finally:
            for pid in frozen:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        gone = wait_until(lambda: not os.path.exists(f"/proc/{agent}") or zombie(agent), 30)
        print(f"chaos: host of node agent {agent} back after {time.monotonic() - at:.1f} s; its stale agent "
              f"{'exited' if gone else 'is STILL RUNNING after 30 s'}", flush=True)
        if not gone:
            self.stale_agents.append(agent)

    def recovery_times(self):
        for f in self.faults:
            later = [t for t, step in self.progress if t > f["at"] and step > f["step"]]
            f["recovery_s"] = round(later[0] - f["at"], 3) if later else None
        return [{"kind": f["kind"], "step": f["step"], "recovery_s": f["recovery_s"]} for f in self.faults]


def descendants(pid):
    """Every process under `pid`, read from /proc (children first found, then theirs)."""
    children = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children[ppid].append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def wait_until(condition, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def exactly_once(history, steps, plan):
    """Every sample trained on exactly once per epoch, over steps 1..steps. A step that the ranks
    finished inside a chunk that then failed has no row in the history of C++ trainers (their
    replies were lost; TorchTrainer's survivors give theirs) but counts (the group restores it);
    its samples are the plan's (`plan(step)`), checked against the history wherever it has the
    step. Returns (verdict, steps taken from the plan)."""
    rows = {r["step"]: sorted(r["sample_ids"]) for r in history}
    if not rows:
        return False, 0
    for step in list(rows)[:50]:  # the plan is what the trainers took
        if sorted(plan(step)) != rows[step]:
            return False, 0
    missing = [s for s in range(1, steps + 1) if s not in rows]
    for s in missing:
        rows[s] = plan(s)
    counts = collections.Counter(x for s in range(1, steps + 1) for x in rows[s])
    return max(counts.values()) - min(counts.values()) <= 1, len(missing)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--min-gap", type=float, default=20.0)
    parser.add_argument("--max-gap", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"the faults to draw from (default: all of {KINDS})")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep-logs", metavar="DIR", help="run the cluster in DIR and keep its logs afterwards")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    sweep_stale_hosts()
    kinds = args.kinds.split(",")
    if not kinds or set(kinds) - set(KINDS):
        parser.error(f"--kinds: choose among {KINDS}")

    cluster = Cluster(initialize_head=True, connect=True, head_node_args={"num_cpus": 0}, temp_dir=args.keep_logs)
    try:
        for _ in range(3):  # two trainer nodes and a spare
            add_host(cluster)
        t = make_trainer("chaos")
        t.fit(4)  # warm-up: the first steps compile and fill caches
        chaos = Chaos(cluster, t, rng, args.min_gap, args.max_gap, kinds)
        threading.Thread(target=chaos.watch, daemon=True).start()
        killer = threading.Thread(target=chaos.killer, daemon=True)
        killer.start()
        history_from = len(t.history)
        t0 = time.monotonic()
        failure = None
        try:
            while time.monotonic() - t0 < args.duration:
                t.fit(2)
        except Exception as e:  # the run ended: report what happened up to here
            failure = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        wall = time.monotonic() - t0
        chaos.note_progress()  # the last chunk's steps, which the watcher may not have seen before it stops
        chaos.stop.set()
        killer.join()  # a host cut under way ends (its processes go on) before anything else is asked of them
        steps = t.step
        useful = sum(r["step_s"] for r in t.history[history_from:])
        faults = chaos.recovery_times()
        def plan(step):  # the samples of the step that ends at `step` (the dataloader's step - 1)
            loader = next(iter(t._node_services.values()))[0]
            return _typed.get(loader, "Dataloader", "stepSamples", step=step - 1)["ids"]

        try:
            once, from_plan = exactly_once(t.history, steps, plan)
        except Exception as e:  # no dataloader answers: the run failed
            once, from_plan = False, 0
            failure = failure or f"exactly_once check: {type(e).__name__}: {e}"

        bitwise = False
        if failure is None:
            chaos_hash = t.parameter_hash()
            t.close()
            # The same steps without faults, on the same cluster.
            ref = make_trainer("reference")
            ref.fit(steps)
            ref_hash = ref.parameter_hash()
            ref.close()
            bitwise = len(set(chaos_hash)) == 1 and chaos_hash[0] == ref_hash[0]
    finally:
        troupe.shutdown()
        cluster.shutdown()
        for shm in SHM_DIRS:
            shutil.rmtree(shm, ignore_errors=True)

    result = {"duration_s": round(wall, 1), "steps": steps, "faults": faults,
              "goodput": round(useful / wall, 3) if wall > 0 else 0.0,
              "bitwise_equal": bitwise, "exactly_once": once, "steps_from_plan": from_plan, "failure": failure,
              "max_recovery_s": max((f["recovery_s"] or 1e9) for f in faults) if faults else 0.0}
    print(f"{'fault':<12} {'step':>6} {'recovery s':>11}")
    for f in faults:
        print(f"{f['kind']:<12} {f['step']:>6} {f['recovery_s'] if f['recovery_s'] is not None else 'never':>11}")
    print(f"steps {steps} in {wall:.0f} s, goodput {result['goodput']:.3f}, bitwise_equal {bitwise}, "
          f"exactly_once {once} ({result['steps_from_plan']} step(s) of failed chunks taken from the plan)")
    if chaos.stale_agents:
        print(f"stale agents of cut hosts still running after they came back: {chaos.stale_agents}")
    if failure:
        print(f"the run ended early: {failure}")
    if args.json:
        print(json.dumps(result))
    ok = (failure is None and bitwise and once and all(f["recovery_s"] is not None for f in faults)
          and not chaos.stale_agents)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
