"""ZeRO-sharded elastic groups end to end: real clusters and C++ trainers with zero=1 or 2 train
bit for bit as data parallel does through resizes, a node lost under ZeRO-2 shrinks the group
from 4 to 3 ranks with the shards re-assembled from the old ranks' snapshots (the lost one's from
its replica), and a persisted ZeRO step loads whole."""
import json
import os
import signal

from train_testing import events, make, needs_trainers, troupe
from troupe_testing import free_port

troupe_api = troupe  # for the test whose `troupe` is the CLI fixture

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")

pytestmark = needs_trainers


def test_zero_groups_train_bitwise_as_data_parallel_through_resizes_and_persist_loadable_whole(cluster, tmp_path):
    """World 2 and 1 with micro-batches of 4: the same float additions in any sharding."""
    runs = {}
    for zero in (0, 1, 2):
        ckpt = tmp_path / f"zero{zero}"
        with make(zero=zero, checkpoint={"snapshot_every": 1, "dir": str(ckpt), "persist_every": 1}) as t:
            t.fit(3)
            t.resize(1)
            t.fit(2)
            t.resize(2)
            t.fit(2)
            hashes = t.parameter_hash()
            assert len(set(hashes)) == 1, "the ranks hold different models"
            assert [row["world_size"] for row in t.history] == [2, 2, 2, 1, 1, 2, 2]
            resharded = [e for e in events(t) if "re-sharded" in e]
            # Data parallel never re-shards; ZeRO does at each of the two resizes.
            assert len(resharded) == (2 if zero else 0), events(t)
            runs[zero] = (hashes[0], [row["loss"] for row in t.history])
    assert runs[1] == runs[0]
    assert runs[2] == runs[0]

    import torch

    from troupe import checkpoint

    plain, info = checkpoint.load(tmp_path / "zero0", with_metadata=True)
    for zero in (1, 2):
        whole, other = checkpoint.load(tmp_path / f"zero{zero}", with_metadata=True)
        assert other["step"] == info["step"]
        assert sorted(whole) == sorted(plain), set(whole) ^ set(plain)
        for name, value in plain.items():
            assert torch.equal(whole[name], value), name
    assert any(name.startswith("optim/") and name.endswith("/exp_avg") for name in plain)

    # Into plain PyTorch: the same tinylm as a torch module (the train_step benchmark's peer) and
    # torch.optim.AdamW take the ZeRO-2 step whole, and train on from it.
    import importlib.util

    spec = importlib.util.spec_from_file_location("torch_peer", os.path.join(BENCH, "train", "torch_peer.py"))
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    model = peer.TinyLm(256, 32, 64, 2, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    checkpoint.load_into(whole, model, optimizer)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), whole["param/" + name]), name
        assert torch.equal(optimizer.state[p]["exp_avg"], whole[f"optim/{name}/exp_avg"]), name
        assert int(optimizer.state[p]["step"]) == info["step"]
    tokens = torch.randint(0, 256, (2, 33))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.nn.functional.cross_entropy(model(tokens[:, :-1]).reshape(-1, 256), tokens[:, 1:].reshape(-1)).backward()
    optimizer.step()
    assert all(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters() if p.grad is not None)


def test_zero2_losing_a_node_shrinks_four_ranks_to_three_as_a_resize_would(troupe):  # noqa: F811 (the CLI fixture)
    """A head of 3 CPUs and a node of 1: four ZeRO-2 trainers. The node's agent is killed (its
    trainer dies with it) and there is no room to replace it: the three survivors re-assemble
    their new shards from the four old ranks' snapshots of step 3, the lost rank's from its
    replica on the head, and train on. The loss curve equals that of a run resized from 4 to 3
    at step 3."""
    port = free_port()
    troupe.run("start", "--head", "--port", str(port), "--num-cpus", "3")
    troupe.run("start", "--address", f"127.0.0.1:{port}", "--num-cpus", "1")
    cluster = json.loads((troupe.run_dir() / "cluster.json").read_text())
    troupe_api.init(cluster["controller_address"], token=cluster["token"])
    options = dict(zero=2, min_workers=3, max_workers=4, global_batch_size=12, max_micro_batch=3,
                   replace_timeout=6.0)
    try:
        with make(**options) as resized:
            resized.fit(3)
            resized.resize(3)
            resized.fit(3)
            expected = {row["step"]: row["loss"] for row in resized.history}
        with make(**options) as t:
            assert len(set(t._pg["bundle_nodes"])) == 2, "the four trainers should span the two nodes"
            t.fit(3)
            second = [n for n in troupe.status()["nodes"] if not n["is_head"]][0]
            os.kill(second["pid"], signal.SIGKILL)  # the node agent; its workers die with it
            t.fit(3)
            assert t.step == 6 and len(t.trainers) == 3, t.events
            assert [row["world_size"] for row in t.history] == [4, 4, 4, 3, 3, 3]
            assert [r["step"] for r in t.recoveries] == [3], t.events
            assert len(set(t.parameter_hash())) == 1
            assert any("re-sharded the optimizer state of step 3" in e for e in events(t)), events(t)
            got = {row["step"]: row["loss"] for row in t.history}
    finally:
        troupe_api.shutdown()
    assert sorted(got) == sorted(expected)
    worst = max(abs(got[s] - expected[s]) for s in expected)
    assert worst <= 1e-5, f"loss curves differ by up to {worst}"


def test_a_persisted_zero2_step_resumes_a_new_group_of_another_size(cluster, tmp_path):
    """Two ZeRO-2 trainers persist every step; a new group of one trainer resumes from the newest
    complete step on disk (both ranks' shards put together) and ends bit for bit where a group
    resized from 2 to 1 at that step does (world 2 and 1 add the same floats here)."""
    ckpt = str(tmp_path / "ckpt")
    with make(zero=2, checkpoint={"snapshot_every": 1, "dir": ckpt, "persist_every": 1}) as first:
        first.fit(4)
    with make(zero=2, min_workers=1, max_workers=1, checkpoint={"dir": ckpt, "resume": True}) as resumed:
        start = resumed.step
        assert start >= 1, resumed.events
        assert any(f"resumed at step {start}" in e for e in events(resumed)), events(resumed)
        resumed.fit(6 - start)
        got = resumed.parameter_hash()
    with make(zero=2) as resized:
        resized.fit(start)
        resized.resize(1)
        resized.fit(6 - start)
        expected = resized.parameter_hash()
    assert got == expected
