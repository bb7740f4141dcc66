"""One rank of a tests/dist scenario (a real process; test_process_group.py starts world_size of
them): dist_rank.py SCENARIO RANK WORLD INIT_METHOD OUT_DIR. The default process group is
"troupe"; a gloo group over the same ranks gives the reference results on the same inputs.
Each rank writes OUT_DIR/rank<R>.json ({"ok": true, ...} or {"ok": false, "error": ...}).
"""
import json
import os
import sys
import time
import traceback

BUILD = os.environ["TROUPE_BUILD_DIR"]
sys.path.insert(0, os.path.join(BUILD, "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import troupe.dist  # noqa: E402,F401 (registers the backend)

DTYPES = [torch.float32, torch.float64, torch.int64]
SIZES = [1, 7, 1 << 20]


def inputs(rank, n, dtype, salt=0):
    g = torch.Generator().manual_seed(1000 * rank + 17 * n + salt)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(0, 1000, (n,), generator=g, dtype=dtype)


def same(got, want, world, what, exact):
    if exact or world == 2 or not got.dtype.is_floating_point:
        ok = torch.equal(got, want)
    else:  # world 3: the two backends may add in another order
        ok = torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    if not ok:
        diff = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else "shape"
        raise AssertionError(f"{what}: troupe differs from gloo (max abs diff {diff})")


def ops(rank, world, gloo):
    checked = 0
    for dtype in DTYPES:
        for n in SIZES:
            x = inputs(rank, n, dtype)
            tag = f"{dtype} n={n}"
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX):
                a, b = x.clone(), x.clone()
                dist.all_reduce(a, op=op)
                dist.all_reduce(b, op=op, group=gloo)
                same(a, b, world, f"all_reduce {op} {tag}", exact=op != dist.ReduceOp.SUM)
            # AVG: gloo has none; its sum divided by the world size.
            a, b = x.clone(), x.clone()
            dist.all_reduce(a, op=dist.ReduceOp.AVG)
            dist.all_reduce(b, group=gloo)
            want = b / world if dtype.is_floating_point else torch.div(b, world, rounding_mode="trunc")
            if dtype.is_floating_point:
                assert torch.allclose(a, want, rtol=1e-6), f"all_reduce AVG {tag}"
            else:
                assert torch.equal(a, want), f"all_reduce AVG {tag}"
            # async: the Work's future carries the result.
            a = x.clone()
            work = dist.all_reduce(a, async_op=True)
            (res,) = work.get_future().wait()
            assert work.wait() and work.is_completed() and work.is_success()
            assert torch.equal(work.result()[0], res)
            b = x.clone()
            dist.all_reduce(b, group=gloo)
            same(res, b, world, f"all_reduce future {tag}", exact=False)

            for root in range(world):
                a, b = x.clone(), x.clone()
                dist.broadcast(a, src=root)
                dist.broadcast(b, src=root, group=gloo)
                same(a, b, world, f"broadcast root {root} {tag}", exact=True)

            outs_t = [torch.empty_like(x) for _ in range(world)]
            outs_g = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(outs_t, x)
            dist.all_gather(outs_g, x, group=gloo)
            for r in range(world):
                same(outs_t[r], outs_g[r], world, f"all_gather part {r} {tag}", exact=True)
            whole = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(whole, x)
            same(whole, torch.cat(outs_g), world, f"all_gather_into_tensor {tag}", exact=True)

            # reduce_scatter: gloo has none; its all_reduce of the whole, this rank's part.
            parts = [inputs(rank, n, dtype, salt=r + 1) for r in range(world)]
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter(out, [p.clone() for p in parts])
            ref = torch.cat(parts)
            dist.all_reduce(ref, group=gloo)
            same(out, ref[rank * n:(rank + 1) * n], world, f"reduce_scatter {tag}", exact=False)
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, torch.cat(parts))
            same(out, ref[rank * n:(rank + 1) * n], world, f"reduce_scatter_tensor {tag}", exact=False)
            checked += 1

    # Uneven splits (torch lets reduce_scatter's parts differ in size): shardOf's layout
    # (the first ranks one longer) and an arbitrary one.
    for sizes in ([3] + [2] * (world - 1), [1] + [5] * (world - 2) + [2]):
        for dtype in DTYPES:
            parts = [inputs(rank, s, dtype, salt=i) for i, s in enumerate(sizes)]
            out = torch.empty(sizes[rank], dtype=dtype)
            dist.reduce_scatter(out, [p.clone() for p in parts])
            ref = torch.cat(parts)
            dist.all_reduce(ref, group=gloo)
            start = sum(sizes[:rank])
            same(out, ref[start:start + sizes[rank]], world, f"reduce_scatter uneven {sizes} {dtype}", exact=False)
    # all_gather with a size per rank (gloo refuses it: expected values are computed here).
    for dtype in DTYPES:
        outs = [torch.empty(r + 1, dtype=dtype) for r in range(world)]
        dist.all_gather(outs, inputs(rank, rank + 1, dtype))
        for r in range(world):
            assert torch.equal(outs[r], inputs(r, r + 1, dtype)), f"all_gather uneven part {r} {dtype}"
    # dtypes collectives do not carry reduce but move: objects (uint8) and bools.
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "odd": "x" * (rank + 3)})
    assert objs == [{"rank": r, "odd": "x" * (r + 3)} for r in range(world)], objs
    flags = torch.tensor([rank % 2 == 0, True, False])
    dist.broadcast(flags, src=world - 1)
    assert flags.tolist() == [(world - 1) % 2 == 0, True, False]
    # Non-contiguous tensors are staged and copied back.
    m = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    dist.all_reduce(m)
    assert torch.equal(m, world * torch.arange(12, dtype=torch.float32).reshape(3, 4).t())

    # send/recv around the ring, then barrier.
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for dtype in DTYPES:
        buf = torch.empty(1001, dtype=dtype)
        if rank % 2 == 0:
            dist.send(inputs(rank, 1001, dtype), dst=nxt)
            dist.recv(buf, src=prv)
        else:
            dist.recv(buf, src=prv)
            dist.send(inputs(rank, 1001, dtype), dst=nxt)
        assert torch.equal(buf, inputs(prv, 1001, dtype)), f"recv {dtype}"
    dist.barrier()

    # Unsupported ops and reduce ops: a clear error naming them.
    errors = {}
    for name, call in [("reduce", lambda: dist.reduce(torch.ones(2), dst=0)),
                       ("scatter", lambda: dist.scatter(torch.ones(2), [torch.ones(2)] * world if rank == 0 else None)),
                       ("PRODUCT", lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.PRODUCT))]:
        try:
            call()
            errors[name] = None
        except RuntimeError as e:
            errors[name] = str(e)
    assert troupe.dist.health() == "OK", troupe.dist.health()
    dist.barrier()  # the group still works after refused calls
    return {"checked": checked, "errors": errors}


def small(rank, world, gloo):
    """A few ops against gloo (for runs whose transport differs: TLS)."""
    for dtype in DTYPES:
        for n in (5, 300001):
            x = inputs(rank, n, dtype)
            a, b = x.clone(), x.clone()
            dist.all_reduce(a)
            dist.all_reduce(b, group=gloo)
            same(a, b, world, f"all_reduce {dtype} n={n}", exact=False)
            outs_t = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(outs_t, x)
            for r in range(world):
                assert torch.equal(outs_t[r], inputs(r, n, dtype)), f"all_gather {dtype} n={n}"
            a = x.clone()
            dist.broadcast(a, src=world - 1)
            assert torch.equal(a, inputs(world - 1, n, dtype)), f"broadcast {dtype} n={n}"
    # The root's last broadcast returns once its bytes are handed to the transport: no rank
    # exits (os._exit, without destroying the group) before every rank has them.
    dist.barrier(group=gloo)
    return {}


def mlp(width=64, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 10))


def ddp_run(rank, group, steps=5):
    model = torch.nn.parallel.DistributedDataParallel(mlp(seed=1), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [p.detach().clone() for p in model.parameters()], losses


def zero_run(rank, group, steps=4):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    model = mlp(seed=2)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01,
                                  process_group=group)
    for step in range(steps):
        g = torch.Generator().manual_seed(7 * step + rank)
        x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # the same gradients on every rank, as after DDP
            dist.all_reduce(p.grad, group=group)
        opt.step()
    opt.consolidate_state_dict(to=0)
    state = opt.state_dict() if rank == 0 else None
    return [p.detach().clone() for p in model.parameters()], state


def ddp(rank, world, gloo):
    troupe_params, troupe_losses = ddp_run(rank, None)
    gloo_params, gloo_losses = ddp_run(rank, gloo)
    assert troupe_losses == gloo_losses, (troupe_losses, gloo_losses)
    for a, b in zip(troupe_params, gloo_params):
        assert torch.equal(a, b), "DDP over troupe is not bitwise equal to DDP over gloo"
    zt, state_t = zero_run(rank, None)
    zg, state_g = zero_run(rank, gloo)
    for a, b in zip(zt, zg):
        assert torch.equal(a, b), "ZeroRedundancyOptimizer over troupe differs from over gloo"
    if rank == 0:
        assert len(state_t["state"]) == len(state_g["state"]) == len(list(mlp().parameters()))
    return {"losses": troupe_losses}


def kill(rank, world, gloo):
    """Rank 1 is SIGKILLed while the others wait in an all_reduce it never joins."""
    dist.all_reduce(torch.ones(4))  # everyone connected and working
    # Every rank has finished that all_reduce before rank 1 dies (its death is seen within a
    # millisecond: it would fail one still finishing).
    dist.barrier(group=gloo)
    if rank == 1:
        os.kill(os.getpid(), 9)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1 << 20))
        return {"error": None}
    except RuntimeError as e:
        failed_after = time.monotonic() - start
        error = str(e)
    # Later ops fail at once with the same error.
    try:
        dist.all_reduce(torch.ones(1))
        later = None
    except RuntimeError as e2:
        later = str(e2)
    # The survivor that failed through the other's ABORT sees the death itself a moment later.
    deadline = time.monotonic() + 10
    while not troupe.dist.dead_peers() and time.monotonic() < deadline:
        time.sleep(0.001)  # polls the condition, with the deadline
    return {"error": error, "failed_after_s": failed_after, "later": later, "health": troupe.dist.health(),
            "dead_peers": troupe.dist.dead_peers()}


def destroy(rank, world, gloo):
    """Destroying a group while an op is pending fails the op; a Python callback on its future
    (which needs the GIL the destroying thread holds) runs, and destroy returns."""
    group = dist.new_group(backend="troupe")
    seen = {}
    if rank == 0:
        work = dist.all_reduce(torch.ones(4), group=group, async_op=True)  # rank 1 never joins it

        def callback(fut):
            try:
                fut.value()
                seen["error"] = None
            except RuntimeError as e:
                seen["error"] = str(e)
        chained = work.get_future().then(callback)
        dist.destroy_process_group(group)
        del group, work
        seen["done_after_destroy"] = chained.done()
    dist.barrier(group=gloo)  # rank 1 keeps its end open until rank 0 is through
    return seen


def main():
    scenario, rank, world, init_method, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    try:
        dist.init_process_group("troupe", init_method=init_method, rank=rank, world_size=world)
        gloo = dist.new_group(backend="gloo")
        result = {"ok": True, **globals()[scenario](rank, world, gloo)}
    except Exception:
        result = {"ok": False, "error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)  # a peer may be dead: skip destroying groups that would wait for it


if __name__ == "__main__":
    main()
