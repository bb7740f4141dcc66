#!/usr/bin/env python3
"""One rank of the PyTorch peer of bench/run train_step: the same tinylm (pre-LayerNorm GPT
blocks, causal attention, learned positions, untied head), the same global batch split into the
same micro-batches, DistributedDataParallel over gloo (bucket_cap_mb 25, no_sync for all but the
last micro-batch) and torch.optim.AdamW, one intra-op thread, on the same token file. Started by
train_step_bench, not by torchrun (Debian's torch 1.13 torchrun fails on Python 3.11).

Prints one line: RESULT {"step_s", "cpu_s" (process CPU time per step), "loss"} (rank 0; the slowest
rank's medians).
Times cover forward, backward, all-reduce and optimizer step; batches are built before the timer,
as the Troupe side times TrainerEngine::step only.
"""
import argparse
import json
import math
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x, mask):
        b, t, c = x.shape
        dh = c // self.heads
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, dh).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(dh))
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLm(nn.Module):
    def __init__(self, vocab, context, d, layers, heads):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Parameter(torch.randn(context, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        # A plain attribute, not a buffer: DDP would broadcast it, and gloo carries no bool.
        self.causal = torch.ones(context, context, dtype=torch.bool).triu(1)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.tok_emb(tokens) + self.pos_emb[:t]
        mask = self.causal[:t, :t]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def rank_slice(global_batch, world, rank):
    base, extra = divmod(global_batch, world)
    begin = rank * base + min(rank, extra)
    return begin, begin + base + (1 if rank < extra else 0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--tokens", required=True)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    a = p.parse_args()

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank,
                                world_size=a.world)
    model = TinyLm(256, a.context, a.d_model, a.layers, a.heads)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25) if a.world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    tokens = np.fromfile(a.tokens, dtype=np.uint16).astype(np.int64)
    t = a.context
    samples = (len(tokens) - 1) // t
    begin, end = rank_slice(a.global_batch, a.world, a.rank)

    def batch(step):
        ids = [((step * a.global_batch + i) * 7919) % samples for i in range(begin, end)]
        windows = np.stack([tokens[i * t:i * t + t + 1] for i in ids])
        return torch.from_numpy(windows[:, :-1].copy()), torch.from_numpy(windows[:, 1:].copy())

    times, cpu, loss_value = [], [], 0.0
    for step in range(a.warmup + a.steps):
        x, y = batch(step)
        start = time.perf_counter()
        cpu_start = time.process_time()
        total = 0.0
        chunks = list(range(0, x.shape[0], a.micro))
        for k, c in enumerate(chunks):
            xs, ys = x[c:c + a.micro], y[c:c + a.micro]
            last = k + 1 == len(chunks)
            ctx = ddp.no_sync() if (a.world > 1 and not last) else torch.enable_grad()
            with ctx:
                logits = ddp(xs)
                loss_sum = F.cross_entropy(logits.reshape(-1, 256), ys.reshape(-1), reduction="sum") / t
                (loss_sum / a.global_batch).backward()
            total += loss_sum.item()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if step >= a.warmup:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
        loss_value = total
    m = torch.tensor([statistics.median(times), statistics.median(cpu)], dtype=torch.float64)
    if a.world > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        dist.destroy_process_group()
    if a.rank == 0:
        print("RESULT " + json.dumps({"step_s": m[0].item(), "cpu_s": m[1].item(),
                                      "loss": loss_value / a.global_batch}), flush=True)


if __name__ == "__main__":
    main()
