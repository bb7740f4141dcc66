#!/usr/bin/env python3
"""One rank of the torch.distributed gloo all-reduce sweep (the peer bench/allreduce compares
against). Started by hand, not by torchrun (Debian's torch 1.13 torchrun fails on Python 3.11):
MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE come from the environment.

Usage: gloo_peer.py SIZE_BYTES:ITERS [SIZE_BYTES:ITERS ...]
Rank 0 prints one JSON line per size: {"bytes", "world_size", "ms", "min_ms", "max_ms"}: the
median, fastest and slowest of ITERS timed all-reduces (float32, sum) after warm-up, each preceded
by a barrier so every rank starts together and each timed as its slowest rank, as the Troupe side
measures.
"""
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def main():
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for spec in sys.argv[1:]:
        size, iters = (int(x) for x in spec.split(":"))
        tensor = torch.ones(size // 4, dtype=torch.float32)
        for _ in range(2):  # warm-up: connections, first-touch of buffers
            dist.all_reduce(tensor)
        times = []
        for _ in range(iters):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            times.append((time.perf_counter() - start) * 1e3)
        # Each iteration's slowest rank: an all-reduce is done when every rank is.
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        slowest = slowest.tolist()
        if rank == 0:
            print(json.dumps({"bytes": size, "world_size": world, "ms": statistics.median(slowest),
                              "min_ms": min(slowest), "max_ms": max(slowest)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
