#!/usr/bin/python3
"""bench/run optimizer_step [--json]: one optimizer step over 100M float32 parameters.

Troupe's fused AdamW and AGD against torch.optim.AdamW(foreach=True), in the same process on the
same parameters and gradients, interleaved round by round (median of --repeats). Both sides get
every usable CPU: Troupe's kernels by default, torch through torch.set_num_threads (LibTorch may
detect fewer cores than are usable; its default is shown too). With --json the last line is one
JSON object: params, troupe_adamw_ms, troupe_agd_ms, torch_adamw_ms (and the ratios).
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

    opts = {
        "torch_adamw": torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, foreach=True),
        "troupe_adamw": optim.AdamW(params, lr=1e-3, weight_decay=1e-2),
        "troupe_agd": optim.AGD(params, lr=1e-4, delta=1e-14, weight_decay=1e-2),
    }
    for opt in opts.values():  # allocates the state (first touch of fresh pages is slow)
        opt.step()
    times = {name: [] for name in opts}
    for _ in range(args.repeats):
        for name, opt in opts.items():
            start = time.perf_counter()
            opt.step()
            times[name].append((time.perf_counter() - start) * 1e3)
    ms = {name: statistics.median(t) for name, t in times.items()}

    # The peer as it runs out of the box, when LibTorch picked fewer threads.
    default_ms = None
    if torch_default_threads != cpus:
        torch.set_num_threads(torch_default_threads)
        runs = []
        for _ in range(max(2, args.repeats // 2)):
            start = time.perf_counter()
            opts["torch_adamw"].step()
            runs.append((time.perf_counter() - start) * 1e3)
        default_ms = statistics.median(runs)
        torch.set_num_threads(cpus)

    base = ms["torch_adamw"]
    rows = [
        ["torch.optim.AdamW(foreach=True)", f"{base:.1f}", "1.00x", f"{cpus}"],
        ["troupe.optim.AdamW", f"{ms['troupe_adamw']:.1f}", f"{base / ms['troupe_adamw']:.2f}x", f"{cpus}"],
        ["troupe.optim.AGD", f"{ms['troupe_agd']:.1f}", f"{base / ms['troupe_agd']:.2f}x", f"{cpus}"],
    ]
    if default_ms is not None:
        rows.append([f"torch.optim.AdamW (torch default threads)", f"{default_ms:.1f}", f"{base / default_ms:.2f}x",
                     f"{torch_default_threads}"])
    print_table(f"optimizer step: {n:,} float32 parameters in {args.tensors} tensors, median of {args.repeats} "
                f"(speed-up vs torch.optim.AdamW foreach; target >= 1.5x)",
                ["optimizer", "ms/step", "speed-up", "threads"], rows)
    result = {
        "params": n,
        "troupe_adamw_ms": round(ms["troupe_adamw"], 2),
        "troupe_agd_ms": round(ms["troupe_agd"], 2),
        "torch_adamw_ms": round(base, 2),
        "adamw_speedup": round(base / ms["troupe_adamw"], 3),
        "agd_speedup": round(base / ms["troupe_agd"], 3),
        "threads": cpus,
        "torch_default_threads": torch_default_threads,
    }
    if default_ms is not None:
        result["torch_adamw_default_threads_ms"] = round(default_ms, 2)
    emit_json(args.json, result)


if __name__ == "__main__":
    main()
