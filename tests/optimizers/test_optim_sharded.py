"""Sharded (ZeRO-style) groups: members holding halves of every tensor, with norm_reduce summing
their squared norms, take the same steps as one optimizer holding whole tensors. First with two
threads in this process, then with two real processes over torch.distributed's gloo on loopback
(troupe.optim.all_reduce_sum / all_reduce_mean)."""
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from optim_testing import BUILD, optim, torch

SHAPES = [(37, 29), (29,), (70001,)]
STEPS = 3


def whole_problem():
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, dtype=torch.float64, generator=g) for s in SHAPES]
    params[1].zero_()  # norm 0 on the first step: trust ratio 1
    grads = [[torch.randn(s, dtype=torch.float64, generator=g) for s in SHAPES] for _ in range(STEPS)]
    return params, grads


def halves(t, rank):
    flat = t.reshape(-1)
    half = flat.numel() // 2
    return (flat[:half] if rank == 0 else flat[half:]).clone()


MAKERS = {
    "lamb": lambda ps, reduce: optim.LAMB(ps, lr=1e-2, weight_decay=0.01, bias_correction=True, norm_reduce=reduce),
    "lars": lambda ps, reduce: optim.LARS(ps, lr=0.5, momentum=0.9, eeta=0.01, weight_decay=1e-3,
                                          norm_reduce=reduce),
}


def run_whole(name):
    params, grads = whole_problem()
    params = [torch.nn.Parameter(p) for p in params]
    opt = MAKERS[name](params, None)
    for step in range(STEPS):
        for p, g in zip(params, grads[step]):
            p.grad = g.clone()
        opt.step()
    return [p.detach().reshape(-1) for p in params]


class ThreadAllReduce:
    """Sums a tensor across `ranks` threads, like an all-reduce (SUM) in a shard group."""

    def __init__(self, ranks):
        self.parts = [None] * ranks
        self.barrier = threading.Barrier(ranks, timeout=30)
        self.calls = 0

    def for_rank(self, rank):
        def reduce(t):
            self.parts[rank] = t.clone()
            self.barrier.wait()
            total = sum(self.parts[1:], self.parts[0].clone())
            self.barrier.wait()
            t.copy_(total)
            self.calls += 1
        return reduce


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_sharded_threads_match_whole_tensors(name):
    expected = run_whole(name)
    params, grads = whole_problem()
    shards = [[torch.nn.Parameter(halves(p, r)) for p in params] for r in range(2)]
    reduce = ThreadAllReduce(2)
    errors = []

    def rank_main(rank):
        try:
            opt = MAKERS[name](shards[rank], reduce.for_rank(rank))
            for step in range(STEPS):
                for p, g in zip(shards[rank], grads[step]):
                    p.grad = halves(g, rank)
                opt.step()
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert reduce.calls == 2 * STEPS  # one reduction per rank and step, for every tensor at once
    for i, whole in enumerate(expected):
        joined = torch.cat([shards[0][i].detach(), shards[1][i].detach()])
        assert torch.allclose(joined, whole, rtol=1e-12, atol=1e-14)


def test_sharded_trust_ratio_differs_without_the_reducer():
    """The reducer matters: shards that use their own norms take different steps."""
    expected = run_whole("lamb")
    params, grads = whole_problem()
    shard = [torch.nn.Parameter(halves(p, 0)) for p in params]
    opt = MAKERS["lamb"](shard, None)
    for step in range(STEPS):
        for p, g in zip(shard, grads[step]):
            p.grad = halves(g, 0)
        opt.step()
    half = expected[2].numel() // 2
    assert not torch.allclose(shard[2].detach(), expected[2][:half], rtol=1e-6)


GLOO_RANK = r'''
import os, sys
import torch
import torch.distributed as dist
sys.path.insert(0, os.environ["TEST_DIR"])
import test_optim_sharded as t
from optim_testing import optim

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
# LAMB over shards, norms summed with all_reduce_sum.
params, grads = t.whole_problem()
shard = [torch.nn.Parameter(t.halves(p, rank)) for p in params]
opt = optim.LAMB(shard, lr=1e-2, weight_decay=0.01, bias_correction=True, norm_reduce=optim.all_reduce_sum())
for step in range(t.STEPS):
    for p, g in zip(shard, grads[step]):
        p.grad = t.halves(g, rank)
    opt.step()
# WSAM with data parallelism: each rank has its own data; all_reduce_mean averages gradients.
torch.manual_seed(0)
model = torch.nn.Linear(8, 1).double()
wsam = optim.WSAM(model.parameters(), torch.optim.SGD, lr=0.1, grad_reduce=optim.all_reduce_mean())
x = torch.randn(16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + rank))
def closure():
    loss = (model(x) ** 2).mean()
    loss.backward()
    return loss
wsam.zero_grad()
closure()
wsam.step(closure)
torch.save({"lamb": [p.detach() for p in shard], "wsam": [p.detach() for p in model.parameters()]},
           os.environ["OUT"])
dist.destroy_process_group()
'''


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sharded_over_gloo_processes(tmp_path):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               TEST_DIR=str(Path(__file__).parent), PYTHONPATH=str(BUILD / "python"), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", GLOO_RANK],
                              env=dict(env, RANK=str(r), OUT=str(tmp_path / f"{r}.pt")),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out.decode(errors="replace")
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]

    expected = run_whole("lamb")
    for i, whole in enumerate(expected):
        joined = torch.cat([results[0]["lamb"][i], results[1]["lamb"][i]])
        assert torch.allclose(joined, whole, rtol=1e-12, atol=1e-14)

    # WSAM: both ranks applied the same update, and it is the rule with data parallelism: each
    # rank perturbs by its own e_r (from its local gradient); g0 and g1 are means over ranks.
    for a, b in zip(results[0]["wsam"], results[1]["wsam"]):
        assert torch.equal(a, b)
    torch.manual_seed(0)
    w = [p.detach() for p in torch.nn.Linear(8, 1).double().parameters()]
    xs = [torch.randn(16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + r)) for r in range(2)]

    def grads(weights, x):
        weights = [v.clone().requires_grad_(True) for v in weights]
        loss = ((x @ weights[0].t() + weights[1]) ** 2).mean()
        return torch.autograd.grad(loss, weights)

    rho, gamma, lr = 0.05, 0.9, 0.1
    alpha = gamma / (1 - gamma)
    g_local = [grads(w, x) for x in xs]
    e = []
    for g in g_local:
        n = torch.sqrt(sum((gi ** 2).sum() for gi in g))
        e.append([gi * rho / (n + 1e-12) for gi in g])
    g0 = [(a + b) / 2 for a, b in zip(*g_local)]
    g1_local = [grads([wi + ei for wi, ei in zip(w, e[r])], xs[r]) for r in range(2)]
    g1 = [(a + b) / 2 for a, b in zip(*g1_local)]
    expected_w = [wi - lr * a - lr * alpha * (b - a) for wi, a, b in zip(w, g0, g1)]
    for got, want in zip(results[0]["wsam"], expected_w):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)
