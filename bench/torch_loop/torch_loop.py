"""bench/run torch_loop [--json]: a user's own PyTorch loop on Troupe against PyTorch's own tools,
side by side in one invocation (issue 32).

torch.distributed on Troupe's backend (troupe.dist) against gloo, in the same ranks (processes on
this machine): each rank's default group is "troupe" and a gloo group spans the same ranks, so
both run on the same inputs.

  allreduce_vs_gloo  dist.all_reduce of 64 MB float32 at 2 ranks: Troupe's bus bandwidth / gloo's
                     (target >= 2)
  ddp_step_vs_gloo   step time (forward, backward with DDP's gradient all-reduce, SGD step) of a
                     50M-parameter MLP, Troupe / gloo, at 2 and 4 ranks (target <= 0.8); batch 1
                     per rank (--batch N), beside the same step without DDP (no communication)

Recovery from a kill -9 of one of 2 ranks, training a 100.7M-parameter MLP (6 Linear(4096, 4096)
and a Linear(4096, 10)) with AdamW on the same 256 fixed random samples, global batch 8, each rank
one process with one thread; rank 1's process is SIGKILLed once step 6 is done, and the figure is
the time from the kill to the end of the first step completed after it:

  recovery_s           troupe.train.TorchTrainer, 2 trainers (min_workers 1, max_workers 2: the
                       elasticity of torchrun's --nnodes=1:2) on an embedded local cluster of 2
                       CPUs, its defaults (snapshots in shared memory, as often as costs < 5% of a
                       step; the survivor trains on alone while the killed rank's new process
                       starts, and takes it back once it is ready), the loop written as the docs
                       advise (ctx.prepare(big_mlp): a survivor keeps its model), one step per
                       coordinator call; the kill from a thread watching the group's step, the
                       end of each step from the wall time its report() carries (the issue's
                       target: < 2 s at 100M parameters). Also said: the kill to the survivor's
                       loop ready to train again (resumed), and to the first step the group
                       trained with both ranks again (whole again)
  torchrun_recovery_s  torchrun --nnodes=1:2 --nproc_per_node=2 --max_restarts=3 (c10d
                       rendezvous) running the same model over gloo DDP, torch.save of model and
                       optimizer every 5 steps (fsynced, renamed into place), loaded on start;
                       its agent restarts both workers (new processes, rendezvous, load). Its
                       defaults: monitor interval 5 s, and the rendezvous' 30 s last call (the
                       group may grow to 2 nodes). The time to a step printed after the kill
  recovery_vs_torchrun torchrun_recovery_s / recovery_s (target >= 10)
  params               the model's parameters

  snapshot_vs_torch_save  the blocking time of a Troupe snapshot of that model's and AdamW's
                       state (1.2 GB, after one step) into /dev/shm (FlashCheckpoint.save of
                       pack_tracked({"model": ..., "opt": ...}), what TorchTrainer does) / torch.save
                       of the same dict to a file under /var/tmp and fsync; median of 5 each,
                       alternating, after a first snapshot that lays out the segment (target <= 0.05)

Method (collectives): warm-up iterations, then per iteration a barrier and the timed call; an
iteration's time is its slowest rank's (an all-reduce of the times with MAX), the median over
iterations is reported, backends alternate per iteration so drift hits both.
busbw = bytes / time * 2 (n - 1) / n. Each recovery is one kill (about 30 s for Troupe's side,
80 s for torchrun's, most of it the rendezvous' last call at its start and after the kill); the
whole bench takes about 3 minutes. Progress lines go to stderr. With --json one JSON object on the
last line: {"allreduce_vs_gloo", "allreduce": {...}, "ddp_step_vs_gloo": [{"world_size",
"troupe_ms", "gloo_ms", "ratio"}, ...], "recovery_s", "torchrun_recovery_s", "recovery_vs_torchrun",
"params", "recovery": {"troupe": {..., "breakdown_s"}, "torchrun": {..., "breakdown_s"}},
"snapshot_vs_torch_save", "snapshot": {"bytes", "snapshot_s", "torch_save_s", ...}}.
"""
import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("TROUPE_BIN_DIR", REPO / "build")).resolve()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- One rank ----

def timed(dist, runs, warmup, iterations):
    """runs: name -> (group, call). Median of the slowest rank's time per iteration, per name."""
    import torch
    for group, call in runs.values():
        for _ in range(warmup):
            call()
    times = {name: [] for name in runs}
    for _ in range(iterations):
        for name, (group, call) in runs.items():
            dist.barrier(group=group)
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    result = {}
    for name, (group, _) in runs.items():
        t = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        result[name] = {"median_ms": 1000 * statistics.median(t.tolist()),
                        "min_ms": 1000 * min(t.tolist()), "max_ms": 1000 * max(t.tolist())}
    return result


def mlp():
    import torch
    # 2048*4096 + 2 * 4096*4096 + 4096*2048 weights (+ biases): 50.3M parameters.
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                               torch.nn.ReLU(), torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
                               torch.nn.Linear(4096, 2048))


def serve(args):
    import torch
    import torch.distributed as dist
    sys.path.insert(0, str(BUILD / "python"))
    import troupe.dist  # noqa: F401
    torch.set_num_threads(1)
    rank, world = args.rank, args.world
    dist.init_process_group("troupe", init_method=args.init, rank=rank, world_size=world)
    groups = {"troupe": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    out = {}
    if args.what == "allreduce":
        nbytes = 64 << 20
        buf = torch.ones(nbytes // 4)
        runs = {name: (g, lambda g=g: dist.all_reduce(buf, group=g)) for name, g in groups.items()}
        times = timed(dist, runs, 2, args.iterations)
        for name, t in times.items():
            t["busbw_gbps"] = nbytes / (t["median_ms"] / 1000) * 2 * (world - 1) / world / 1e9
        out = {"bytes": nbytes, "world_size": world, **times}
    else:
        # "local": the same step without DDP (no communication), the floor both backends share.
        models = {name: torch.nn.parallel.DistributedDataParallel(mlp(), process_group=g)
                  for name, g in groups.items()}
        models["local"] = mlp()
        opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(args.batch, 2048, generator=g), torch.randn(args.batch, 2048, generator=g)

        def step(name):
            loss = torch.nn.functional.mse_loss(models[name](x), y)
            opts[name].zero_grad()
            loss.backward()
            opts[name].step()

        runs = {name: (groups.get(name, dist.group.WORLD), lambda name=name: step(name)) for name in models}
        params = sum(p.numel() for p in models["local"].parameters())
        out = {"world_size": world, "parameters": params, **timed(dist, runs, 2, args.iterations)}
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.barrier()
    # A rank's os._exit with its troupe group open is a crash to its host mates, seen at once
    # through its life lock: no rank leaves before every rank is through the troupe barrier.
    dist.barrier(group=groups["gloo"])
    os._exit(0)


# ---- Recovery after a kill -9 and the blocking snapshot (issue 32's other figures) ----

# The recovery's model: 6 Linear(4096, 4096) and a Linear(4096, 10), 100.7M parameters (the
# issue's size), trained with AdamW (its state is twice the parameters: 1.2 GB per rank in all)
# on RECOVERY_SAMPLES fixed random samples, RECOVERY_BATCH per step over 2 ranks.
RECOVERY_DIM, RECOVERY_LAYERS, RECOVERY_CLASSES = 4096, 6, 10
RECOVERY_SAMPLES, RECOVERY_BATCH = 256, 8
KILL_AT_STEP = 6  # rank 1 is SIGKILLed once step KILL_AT_STEP is done (while step 7 runs)
TORCHRUN_SAVE_EVERY = 5  # the torchrun script's torch.save of model + optimizer, every 5 steps


def big_mlp():
    import torch
    torch.manual_seed(0)
    layers = []
    for _ in range(RECOVERY_LAYERS):
        layers += [torch.nn.Linear(RECOVERY_DIM, RECOVERY_DIM), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(RECOVERY_DIM, RECOVERY_CLASSES))


def recovery_data():
    import torch
    g = torch.Generator().manual_seed(1)
    return (torch.randn(RECOVERY_SAMPLES, RECOVERY_DIM, generator=g),
            torch.randint(0, RECOVERY_CLASSES, (RECOVERY_SAMPLES,), generator=g))


def note(text):
    print(f"bench torch_loop: {text}", file=sys.stderr, flush=True)


def troupe_loop(ctx):
    """The user's loop in the TorchTrainer: each report() carries the wall time its step ended,
    and when this entry of the loop began, had its model wrapped in DDP (every rank built it)
    and had its state loaded."""
    import torch
    entered = time.time()
    torch.set_num_threads(1)
    model = ctx.prepare(big_mlp)
    wrapped = time.time()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ctx.track(model=model, opt=opt)
    ready = time.time()
    for x, y in ctx.batches():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.report(loss=loss.item(), t=time.time(), entered=entered, wrapped=wrapped, ready=ready, pid=os.getpid())


def serve_troupe_recovery(args):
    """A TorchTrainer of 2 trainers on an embedded local cluster of 2 CPUs; rank 1's process is
    SIGKILLed from a thread once the group's step reaches KILL_AT_STEP; prints the time from the
    kill to the end of the first step completed after it (the rows' report() times)."""
    import signal
    import threading
    sys.path.insert(0, str(BUILD / "python"))
    import troupe
    from troupe.train import ScalingConfig, TorchTrainer

    t_start = time.monotonic()
    troupe.init(num_cpus=2, log_to_driver=False)
    try:
        with TorchTrainer(troupe_loop, data=list(zip(*recovery_data())), global_batch_size=RECOVERY_BATCH,
                          scaling=ScalingConfig(min_workers=1, max_workers=2), steps_per_call=1,
                          progress=False) as trainer:
            victim = next(m for m in trainer.members() if m["kind"] == "trainer" and m["rank"] == 1)
            kill, done = {}, threading.Event()

            def killer():
                while trainer.step < KILL_AT_STEP and not done.is_set():
                    time.sleep(0.005)
                if not done.is_set():
                    kill["step"], kill["t"] = trainer.step, time.time()
                    os.kill(victim["pid"], signal.SIGKILL)
                    note(f"troupe: SIGKILL of rank 1 (pid {victim['pid']}) after step {kill['step']} at {kill['t']:.3f}")

            thread = threading.Thread(target=killer, daemon=True)
            thread.start()
            after = []
            try:  # until a step after the kill was trained by both ranks again
                while trainer.step < KILL_AT_STEP + 30 and not any(r["world_size"] == 2 for r in after):
                    trainer.fit(steps=1)
                    if trainer.step <= 3 or trainer.step == KILL_AT_STEP:
                        note(f"troupe: step {trainer.step} ({trainer.history[-1]['step_s']:.2f} s)")
                    after = [r for r in trainer.history if "t" in kill and r["metrics"]["t"] > kill["t"]]
            finally:
                done.set()
                thread.join()
            if not after:
                raise SystemExit("bench torch_loop: the TorchTrainer completed no step after the kill")
            first = min(after, key=lambda r: r["metrics"]["t"])
            whole = min((r for r in after if r["world_size"] == 2), key=lambda r: r["metrics"]["t"], default=None)

            def since_kill(text):
                return next((e["time"] - kill["t"] for e in trainer.events
                             if e["time"] > kill["t"] and text in e["text"]), None)

            now = {m["rank"]: m["pid"] for m in trainer.members() if m["kind"] == "trainer"}
            steady = [r["step_s"] for r in trainer.history if r["step"] <= KILL_AT_STEP][1:]
            out = {"params": sum(p.numel() for p in big_mlp().parameters()),
                   "recovery_s": first["metrics"]["t"] - kill["t"],
                   "killed_after_step": kill["step"], "first_step_after": first["step"],
                   "first_step_world_size": first["world_size"],
                   "resumed_s": first["metrics"]["ready"] - kill["t"],
                   "whole_again_s": whole["metrics"]["t"] - kill["t"] if whole else None,
                   "whole_again_step": whole["step"] if whole else None,
                   # kill -> the coordinator's failure event (the chunk's calls ended), -> the group
                   # re-formed and restored, -> rank 0's loop entered again, -> its model built
                   # and wrapped in DDP (with rank 1's), -> its state loaded (ctx.track)
                   "breakdown_s": {"failure_seen": since_kill("failure at step"),
                                   "regrouped": since_kill("recovered in"),
                                   "taken_back": since_kill("back: grew"),
                                   **{f"loop_{k}": first["metrics"][k] - kill["t"]
                                      for k in ("entered", "wrapped", "ready")}},
                   "step_s": statistics.median(steady),
                   "rank1_new_process": now.get(1) != victim["pid"],
                   "events": [e["text"] for e in trainer.events if "snapshots every" in e["text"]
                              or "recovered" in e["text"] or "back: grew" in e["text"]],
                   "wall_s": time.monotonic() - t_start}
    finally:
        troupe.shutdown()
    print(json.dumps(out), flush=True)


def emit(record):
    """One JSON line in one write: the workers share torchrun's stdout, and a print() of the text
    and then its newline could interleave with another worker's."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def serve_torchrun_worker(args):
    """One worker under torchrun: gloo DDP of the same model on the same data; loads
    args.ckpt if it exists (the step, model and optimizer), torch.save's it every
    TORCHRUN_SAVE_EVERY steps (rank 0, written aside, fsynced, renamed), prints a JSON line per
    step with its end time."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    emit({"event": "start", "rank": rank, "pid": os.getpid(), "t": time.time()})
    model = torch.nn.parallel.DistributedDataParallel(big_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    start = 0
    if os.path.exists(args.ckpt):
        state = torch.load(args.ckpt)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    if rank == 0:
        emit({"event": "loaded", "step": start, "t": time.time()})
    x, y = recovery_data()
    per_rank = RECOVERY_BATCH // world
    for step in range(start, args.steps):
        order = torch.randperm(RECOVERY_SAMPLES, generator=torch.Generator().manual_seed(step))
        ids = order[:RECOVERY_BATCH][rank * per_rank:(rank + 1) * per_rank]
        loss = torch.nn.functional.cross_entropy(model(x[ids]), y[ids])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            emit({"event": "step", "step": step + 1, "t": time.time(), "pid": os.getpid(), "from": start})
            if (step + 1) % TORCHRUN_SAVE_EVERY == 0:
                tmp = args.ckpt + ".tmp"
                with open(tmp, "wb") as f:
                    torch.save({"step": step + 1, "model": model.module.state_dict(), "opt": opt.state_dict()}, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, args.ckpt)
    dist.destroy_process_group()


def _records(decoder, line):
    """The JSON objects on a line (more than one if two workers' writes still met)."""
    line, at = line.strip(), 0
    while at < len(line):
        record, at = decoder.raw_decode(line, at)
        yield record
        while at < len(line) and line[at] in " \t":
            at += 1


def torchrun_recovery():
    """torchrun (elastic agent, c10d rendezvous, restarts) running serve_torchrun_worker at 2
    workers; rank 1 SIGKILLed once step KILL_AT_STEP is printed; the time from the kill to the
    first step printed after it (by the restarted workers)."""
    import signal
    import tempfile
    import threading
    work = Path(tempfile.mkdtemp(prefix="troupe-bench-torchrun-", dir="/var/tmp"))
    ckpt, log = work / "ckpt.pt", work / "torchrun.log"
    # --redirects/--tee name no local rank, which is their default (no redirection): Debian's torch
    # 1.13 on Python 3.11 parses the default "0" as None (3.11's Flag iteration skips the 0 member)
    # and its agent fails at the first start.
    cmd = ["/usr/bin/torchrun", "--nnodes=1:2", "--nproc_per_node=2", "--max_restarts=3", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--redirects=9:1", "--tee=9:1",
           __file__, "--serve", "torchrun_worker", "--ckpt", str(ckpt), "--steps", str(KILL_AT_STEP + 20)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    t_start = time.monotonic()
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    lines = []
    kill, first = {}, None
    timer = threading.Timer(300, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    try:
        pids = {}
        decoder = json.JSONDecoder()
        for row in (r for line in proc.stdout if line.startswith("{") for r in _records(decoder, line)):
            lines.append(row)
            if row["event"] == "start":
                pids[row["rank"]] = row["pid"]
            elif row["event"] != "step":
                continue
            elif "t" not in kill:
                if row["step"] <= 3 or row["step"] == KILL_AT_STEP:
                    note(f"torchrun: step {row['step']}")
                if row["step"] >= KILL_AT_STEP:
                    kill["step"], kill["t"] = row["step"], time.time()
                    os.kill(pids[1], signal.SIGKILL)
                    note(f"torchrun: SIGKILL of rank 1 (pid {pids[1]}) after step {kill['step']}")
            elif row["t"] > kill["t"]:
                first = row
                break
    finally:
        timer.cancel()
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        text = log.read_text(errors="replace")
        shutil.rmtree(work, ignore_errors=True)
    if first is None:
        raise SystemExit(f"bench torch_loop: torchrun printed no step after the kill; its log ends:\n{text[-3000:]}")
    steps = [r["t"] for r in lines if r["event"] == "step" and r["t"] < kill["t"]]

    def since_kill(event):
        return next((r["t"] - kill["t"] for r in lines if r["event"] == event and r["t"] > kill["t"]), None)

    return {"recovery_s": first["t"] - kill["t"], "killed_after_step": kill["step"], "first_step_after": first["step"],
            # kill -> the new workers' process group initialized (the agent saw the failure, stopped
            # the survivor, rendezvoused again and started both), -> rank 0 loaded the checkpoint
            "breakdown_s": {"workers_started": since_kill("start"), "checkpoint_loaded": since_kill("loaded")},
            "restored_step": first["from"], "step_s": statistics.median(b - a for a, b in zip(steps[1:], steps[2:])),
            "save_every": TORCHRUN_SAVE_EVERY, "monitor_interval_s": 5.0, "wall_s": time.monotonic() - t_start}


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def serve_snapshot(args):
    """The blocking time of a Troupe snapshot of the recovery model's and AdamW's state (after
    one step, so the optimizer holds its moments) against torch.save of the same state to a file
    and fsync: medians over SNAPSHOT_RUNS each, alternating."""
    import tempfile
    import torch
    sys.path.insert(0, str(BUILD / "python"))
    from troupe import checkpoint as ckpt
    torch.set_num_threads(1)
    model = big_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = recovery_data()
    torch.nn.functional.cross_entropy(model(x[:4]), y[:4]).backward()
    opt.step()
    shm = Path(tempfile.mkdtemp(prefix="troupe-bench-torch-loop-", dir="/dev/shm"))
    work = Path(tempfile.mkdtemp(prefix="troupe-bench-torch-loop-", dir="/var/tmp"))
    flash = ckpt.FlashCheckpoint(group="bench-torch-loop", node="local", shm_dir=shm)
    snapshot, torch_save = [], []

    def save_flash(step):
        tensors, metadata = ckpt.pack_tracked({"model": model.state_dict(), "opt": opt.state_dict()})
        flash.save(step, tensors, metadata)

    def save_torch():
        path = work / "state.pt"
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(work)

    try:
        t0 = time.perf_counter()
        save_flash(1)  # lays out and pre-faults the segment: once per trainer process
        first = time.perf_counter() - t0
        for run in range(SNAPSHOT_RUNS):
            t0 = time.perf_counter()
            save_flash(run + 2)
            snapshot.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            save_torch()
            torch_save.append(time.perf_counter() - t0)
        nbytes = sum(t.numel() * t.element_size() for t in ckpt.pack_tracked(
            {"model": model.state_dict(), "opt": opt.state_dict()})[0].values())
    finally:
        flash.close()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"bytes": nbytes, "snapshot_s": statistics.median(snapshot), "torch_save_s":
                      statistics.median(torch_save), "snapshot_runs_s": snapshot, "torch_save_runs_s": torch_save,
                      "first_snapshot_s": first}), flush=True)


SNAPSHOT_RUNS = 5


# ---- The driver ----

def served_json(what, timeout):
    """Runs `--serve what` in a process of its own; its last stdout line, a JSON object."""
    proc = subprocess.run([sys.executable, __file__, "--serve", what], env={**os.environ, "OMP_NUM_THREADS": "1"},
                          stdout=subprocess.PIPE, text=True, timeout=timeout)
    if proc.returncode:
        raise SystemExit(f"bench torch_loop: {what} failed (exit status {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# One sample per rank: the step's compute is small beside its 200 MB gradient all-reduce, so the
# step measures the backend, not this machine's cores (at --batch 8 a 2-core machine's forward and
# backward are most of both backends' step; bench/run torch_loop --batch 8 shows it).
BATCH = 1


def run(what, world, iterations, batch=BATCH):
    init = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--serve", what, "--rank", str(r), "--world", str(world),
                               "--init", init, "--iterations", str(iterations), "--batch", str(batch)],
                              env=env, stdout=subprocess.PIPE, text=True) for r in range(world)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"bench torch_loop: a rank of {what} at world {world} failed")
    return json.loads(outs[0].strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world", type=int)
    parser.add_argument("--init")
    parser.add_argument("--iterations", type=int, default=0)
    parser.add_argument("--batch", type=int, default=BATCH, help=f"DDP step: samples per rank (default {BATCH})")
    parser.add_argument("--ckpt")
    parser.add_argument("--steps", type=int, default=0)
    args = parser.parse_args()
    if args.serve:
        args.what = args.serve
        served = {"troupe_recovery": serve_troupe_recovery, "torchrun_worker": serve_torchrun_worker,
                  "snapshot": serve_snapshot}
        return served.get(args.serve, serve)(args)

    ar = run("allreduce", 2, 7)
    ratio = ar["troupe"]["busbw_gbps"] / ar["gloo"]["busbw_gbps"]
    print("dist.all_reduce, 64 MB float32, 2 ranks")
    print(f"{'backend':<8} {'median ms':>10} {'min..max ms':>16} {'busbw GB/s':>11}")
    for name in ("troupe", "gloo"):
        t = ar[name]
        print(f"{name:<8} {t['median_ms']:>10.1f} {t['min_ms']:>7.1f}..{t['max_ms']:<7.1f} {t['busbw_gbps']:>11.2f}")
    print(f"allreduce_vs_gloo (busbw troupe / gloo): {ratio:.2f}   (target >= 2)\n")

    rows = []
    print(f"DDP step of a 50M-parameter MLP (batch {args.batch} per rank, SGD)")
    print(f"{'ranks':>5} {'troupe ms':>10} {'gloo ms':>10} {'troupe/gloo':>12} {'no comm ms':>11}")
    for world in (2, 4):
        d = run("ddp", world, 5, args.batch)
        row = {"world_size": world, "parameters": d["parameters"], "troupe_ms": d["troupe"]["median_ms"],
               "gloo_ms": d["gloo"]["median_ms"], "troupe_spread_ms": [d["troupe"]["min_ms"], d["troupe"]["max_ms"]],
               "gloo_spread_ms": [d["gloo"]["min_ms"], d["gloo"]["max_ms"]],
               "no_communication_ms": d["local"]["median_ms"]}
        row["ratio"] = row["troupe_ms"] / row["gloo_ms"]
        rows.append(row)
        print(f"{world:>5} {row['troupe_ms']:>10.1f} {row['gloo_ms']:>10.1f} {row['ratio']:>12.2f} "
              f"{row['no_communication_ms']:>11.1f}")
    print("ddp_step_vs_gloo: troupe / gloo step time   (target <= 0.8); no comm: the same step without DDP\n")

    note("recovery: TorchTrainer (2 trainers, embedded local cluster)")
    ours = served_json("troupe_recovery", timeout=600)
    note(f"recovery: torchrun (2 workers, c10d rendezvous, --max_restarts=3) after {ours['wall_s']:.0f} s")
    theirs = torchrun_recovery()
    recovery_ratio = theirs["recovery_s"] / ours["recovery_s"]
    print(f"kill -9 of rank 1 -> next step completed, {ours['params'] / 1e6:.1f}M-parameter MLP, AdamW, "
          f"2 ranks, global batch {RECOVERY_BATCH}")
    print(f"{'':<12} {'recovery s':>10} {'killed after':>13} {'next step':>10} {'step s':>7}")
    for name, r in (("troupe", ours), ("torchrun", theirs)):
        print(f"{name:<12} {r['recovery_s']:>10.2f} {r['killed_after_step']:>13} {r['first_step_after']:>10} "
              f"{r['step_s']:>7.2f}")
    print(f"recovery_vs_torchrun (torchrun / troupe): {recovery_ratio:.1f}   (target >= 10; the issue's target "
          f"for troupe: < 2 s at 100M parameters)")
    b = ours["breakdown_s"]
    print(f"  troupe: failure seen {b['failure_seen']:.2f} s, group re-formed (world {ours['first_step_world_size']}) "
          f"and restored {b['regrouped']:.2f} s; rank 0's loop entered again {b['loop_entered']:.2f} s, model in "
          f"DDP {b['loop_wrapped']:.2f} s, state loaded (training resumed) {b['loop_ready']:.2f} s after the kill")
    if ours["whole_again_s"] is not None:
        print(f"  troupe: rank 1's new process taken back {b['taken_back']:.2f} s after the kill; step "
              f"{ours['whole_again_step']}, the first trained by both ranks again, done {ours['whole_again_s']:.2f} s "
              f"after it")
    b = theirs["breakdown_s"]
    print(f"  torchrun: new workers' process group up {b['workers_started']:.2f} s, checkpoint of step "
          f"{theirs['restored_step']} loaded {b['checkpoint_loaded']:.2f} s after the kill (torch.save every "
          f"{theirs['save_every']} steps; agent monitor interval {theirs['monitor_interval_s']:.0f} s and, with "
          f"--nnodes=1:2, the rendezvous' 30 s last call: torchrun's defaults)\n")

    note("snapshot: FlashCheckpoint.save vs torch.save + fsync")
    snap = served_json("snapshot", timeout=600)
    snapshot_ratio = snap["snapshot_s"] / snap["torch_save_s"]
    print(f"blocking save of the model + AdamW state ({snap['bytes'] / 1e9:.2f} GB), median of {SNAPSHOT_RUNS}")
    print(f"  troupe snapshot to /dev/shm {snap['snapshot_s']:.3f} s   torch.save + fsync {snap['torch_save_s']:.3f} s")
    print(f"snapshot_vs_torch_save (troupe / torch.save): {snapshot_ratio:.3f}   (target <= 0.05)")
    if args.json:
        print(json.dumps({"allreduce_vs_gloo": ratio, "allreduce": ar, "ddp_step_vs_gloo": rows,
                          "recovery_s": ours["recovery_s"], "torchrun_recovery_s": theirs["recovery_s"],
                          "recovery_vs_torchrun": recovery_ratio, "params": ours["params"],
                          "recovery": {"troupe": ours, "torchrun": theirs},
                          "snapshot_vs_torch_save": snapshot_ratio, "snapshot": snap}))


if __name__ == "__main__":
    main()
