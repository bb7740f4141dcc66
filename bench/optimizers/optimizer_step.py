#!/usr/bin/python3
"""bench/run optimizer_step [--json]: one optimizer step over 100M float32 parameters.

Troupe's fused AdamW and AGD against torch.optim.AdamW(foreach=True), in the same process on the
same parameters and gradients, interleaved round by round (median of --repeats). Troupe's kernels
use every usable CPU; torch runs with as many threads and, when LibTorch's own default differs (it
picks 1 on this 2-core machine), with that too: torch_adamw_ms is the faster of the two. With
--json the last line is one JSON object: params, troupe_adamw_ms, troupe_agd_ms, torch_adamw_ms
(and the ratios).
"""
import argparse
import statistics
import time

import torch

from common import emit_json, import_troupe_optim, print_table, usable_cpus


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--params", type=int, default=100_000_000, help="total parameters (float32)")
    ap.add_argument("--tensors", type=int, default=100, help="split into this many equal tensors")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    optim = import_troupe_optim()

    torch_default_threads = torch.get_num_threads()
    cpus = usable_cpus()
    torch.set_num_threads(cpus)
    torch.manual_seed(0)
    size = args.params // args.tensors
    params = [torch.nn.Parameter(torch.randn(size)) for _ in range(args.tensors)]
    for p in params:
        p.grad = torch.randn(size)
    n = sum(p.numel() for p in params)

    torch_opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, foreach=True)
    # (label, optimizer, torch threads): torch runs with every usable CPU and, when LibTorch
    # picked fewer, also with its own default; the ratio uses whichever torch run was faster.
    runs = [(f"torch.optim.AdamW(foreach=True), {cpus} threads", torch_opt, cpus)]
    if torch_default_threads != cpus:
        runs.append((f"torch.optim.AdamW(foreach=True), {torch_default_threads} thread(s) (torch default)", torch_opt,
                     torch_default_threads))
    runs += [
        (f"troupe.optim.AdamW, {cpus} threads", optim.AdamW(params, lr=1e-3, weight_decay=1e-2), cpus),
        (f"troupe.optim.AGD, {cpus} threads", optim.AGD(params, lr=1e-4, delta=1e-14, weight_decay=1e-2), cpus),
    ]
    for _, opt, threads in runs:  # allocates the state (first touch of fresh pages is slow)
        torch.set_num_threads(threads)
        opt.step()
    times = [[] for _ in runs]
    for _ in range(args.repeats):  # interleaved, so load from elsewhere falls on every run alike
        for i, (_, opt, threads) in enumerate(runs):
            torch.set_num_threads(threads)
            start = time.perf_counter()
            opt.step()
            times[i].append((time.perf_counter() - start) * 1e3)
    ms = [statistics.median(t) for t in times]
    torch_runs = [i for i, (_, opt, _) in enumerate(runs) if opt is torch_opt]
    torch_ms = min(ms[i] for i in torch_runs)
    adamw_ms, agd_ms = ms[-2], ms[-1]

    rows = [[label, f"{m:.1f}", f"{torch_ms / m:.2f}x"] for (label, _, _), m in zip(runs, ms)]
    print_table(f"optimizer step: {n:,} float32 parameters in {args.tensors} tensors, median of {args.repeats} "
                f"(speed-up vs the faster torch run; target >= 1.5x)", ["optimizer", "ms/step", "speed-up"], rows)
    result = {
        "params": n,
        "troupe_adamw_ms": round(adamw_ms, 2),
        "troupe_agd_ms": round(agd_ms, 2),
        "torch_adamw_ms": round(torch_ms, 2),
        "adamw_speedup": round(torch_ms / adamw_ms, 3),
        "agd_speedup": round(torch_ms / agd_ms, 3),
        "threads": cpus,
        "torch_adamw_ms_by_threads": {str(runs[i][2]): round(ms[i], 2) for i in torch_runs},
    }
    emit_json(args.json, result)


if __name__ == "__main__":
    main()
