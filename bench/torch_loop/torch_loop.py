"""bench/run torch_loop [--json]: torch.distributed on Troupe's backend (troupe.dist) against gloo,
side by side in the same ranks (processes on this machine): each rank's default group is
"troupe" and a gloo group spans the same ranks, so both run on the same inputs in one invocation.

  allreduce_vs_gloo  dist.all_reduce of 64 MB float32 at 2 ranks: Troupe's bus bandwidth / gloo's
                     (target >= 2)
  ddp_step_vs_gloo   step time (forward, backward with DDP's gradient all-reduce, SGD step) of a
                     50M-parameter MLP, Troupe / gloo, at 2 and 4 ranks (target <= 0.8); batch 1
                     per rank (--batch N), beside the same step without DDP (no communication)

Method: warm-up iterations, then per iteration a barrier and the timed call; an iteration's time
is its slowest rank's (an all-reduce of the times with MAX), the median over iterations is
reported, backends alternate per iteration so drift hits both. busbw = bytes / time * 2 (n - 1) / n.
With --json one JSON object on the last line: {"allreduce_vs_gloo", "allreduce": {...},
"ddp_step_vs_gloo": [{"world_size", "troupe_ms", "gloo_ms", "ratio"}, ...]}.
"""
import argparse
import json
import os
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
    os._exit(0)


# ---- The driver ----

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
    args = parser.parse_args()
    if args.serve:
        args.what = args.serve
        return serve(args)

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
    print("ddp_step_vs_gloo: troupe / gloo step time   (target <= 0.8); no comm: the same step without DDP")
    if args.json:
        print(json.dumps({"allreduce_vs_gloo": ratio, "allreduce": ar, "ddp_step_vs_gloo": rows}))


if __name__ == "__main__":
    main()
