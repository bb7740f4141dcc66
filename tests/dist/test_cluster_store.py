"""troupe.dist.ClusterStore: a torch.distributed Store over the cluster's store, used from two
Troupe worker processes (actors) of a real local cluster with its real redis-server: its
operations seen from both, a wait that times out naming the missing keys, a group epoch's store
that refuses an ended epoch and stops waiting when the group moves on, and gloo, "troupe" and
NCCL (skipped without a GPU) process groups initialised through it."""
import datetime
import os
import time

import pytest

from troupe_testing import BUILD, import_troupe, local_cluster

torch = pytest.importorskip("torch", reason="the store tests need Debian's python3-torch")
if not list((BUILD / "python" / "troupe").glob("_dist.*.so")):
    pytest.skip(f"troupe._dist is not built under {BUILD / 'python'}; run `make build`", allow_module_level=True)

troupe = import_troupe()


@pytest.fixture(scope="module", autouse=True)
def cluster():
    yield from local_cluster(num_cpus=2)


@troupe.remote(num_cpus=0, max_concurrency=4)
class Rank:
    """One worker process; each method opens the store of `prefix` (as a rank would)."""

    def __init__(self):
        self.stores = {}

    def _store(self, prefix, timeout_s=20.0):
        import troupe.dist

        key = (prefix, timeout_s)
        if key not in self.stores:
            self.stores[key] = troupe.dist.ClusterStore(prefix, timeout=datetime.timedelta(seconds=timeout_s))
        return self.stores[key]

    def pid(self):
        return os.getpid()

    def set(self, prefix, key, value):
        self._store(prefix).set(key, value)

    def get(self, prefix, key):
        return self._store(prefix).get(key)

    def add(self, prefix, key, amount, times):
        return [self._store(prefix).add(key, amount) for _ in range(times)]

    def compare_set(self, prefix, key, expected, desired):
        return self._store(prefix).compare_set(key, expected, desired)

    def delete_key(self, prefix, key):
        return self._store(prefix).delete_key(key)

    def num_keys(self, prefix):
        return self._store(prefix).num_keys()

    def wait(self, prefix, keys, timeout_s=None, store_timeout_s=20.0):
        store = self._store(prefix, store_timeout_s)
        started = time.monotonic()
        try:
            if timeout_s is None:
                store.wait(keys)
            else:
                store.wait(keys, datetime.timedelta(seconds=timeout_s))
            return {"ok": True, "s": time.monotonic() - started}
        except RuntimeError as e:
            return {"ok": False, "error": str(e), "s": time.monotonic() - started}

    def group_store_get(self, group, epoch, key, timeout_s):
        import troupe.dist

        started = time.monotonic()
        try:
            store = troupe.dist.group_store(group, epoch, timeout=datetime.timedelta(seconds=timeout_s))
            return {"ok": True, "value": store.get(key), "s": time.monotonic() - started}
        except RuntimeError as e:
            return {"ok": False, "error": str(e), "s": time.monotonic() - started}

    def group_store_set(self, group, epoch, key, value):
        import troupe.dist

        troupe.dist.group_store(group, epoch).set(key, value)

    def all_reduce(self, backend, prefix, rank, world, device="cpu"):
        """Initialises `backend` through the store, all-reduces [rank + 1] * 4 and destroys the group."""
        import torch.distributed as dist

        import troupe.dist

        store = troupe.dist.ClusterStore(prefix, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        try:
            if device == "cuda":
                torch.cuda.set_device(rank % torch.cuda.device_count())
                t = torch.full((4,), float(rank + 1), device="cuda")
            else:
                t = torch.full((4,), float(rank + 1))
            dist.all_reduce(t)
            dist.barrier()
            return {"sum": t.cpu().tolist(), "backend": dist.get_backend(), "keys": store.num_keys()}
        finally:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(cluster):
    pair = [Rank.remote(), Rank.remote()]
    pids = troupe.get([r.pid.remote() for r in pair], timeout=60)
    assert pids[0] != pids[1]  # two worker processes
    yield pair
    for r in pair:
        troupe.kill(r)


def test_operations_from_two_worker_processes(ranks):
    a, b = ranks
    prefix = "test-ops"
    # b waits for a key that a sets after b's get has started: get blocks until it exists.
    pending = b.get.remote(prefix, "greeting")
    assert troupe.wait([pending], timeout=0.3)[0] == []  # still waiting for it
    troupe.get(a.set.remote(prefix, "greeting", b"from a \x00\xff"), timeout=30)
    assert troupe.get(pending, timeout=30) == b"from a \x00\xff"

    # Adds from both processes, interleaved: every one counted once.
    sums = troupe.get([a.add.remote(prefix, "count", 1, 20), b.add.remote(prefix, "count", 1, 20)], timeout=30)
    assert max(sums[0] + sums[1]) == 40
    assert sorted(sums[0] + sums[1]) == list(range(1, 41))
    assert troupe.get(b.get.remote(prefix, "count"), timeout=30) == b"40"  # decimal text, as torch's stores

    # compare_set: absent with an empty expectation sets; a mismatch returns the value held.
    assert troupe.get(a.compare_set.remote(prefix, "leader", "", "a"), timeout=30) == b"a"
    assert troupe.get(b.compare_set.remote(prefix, "leader", "", "b"), timeout=30) == b"a"
    assert troupe.get(b.compare_set.remote(prefix, "leader", "a", "b"), timeout=30) == b"b"

    assert troupe.get(a.num_keys.remote(prefix), timeout=30) == 3
    assert troupe.get(b.delete_key.remote(prefix, "leader"), timeout=30) is True
    assert troupe.get(a.delete_key.remote(prefix, "leader"), timeout=30) is False
    assert troupe.get(a.num_keys.remote(prefix), timeout=30) == 2

    # Another prefix sees none of it.
    assert troupe.get(b.num_keys.remote("test-ops-other"), timeout=30) == 0
    waited = troupe.get(b.wait.remote("test-ops-other", ["greeting"], 0.3), timeout=30)
    assert not waited["ok"], waited

    # wait() returns once a key set from the other process exists.
    pending = a.wait.remote(prefix, ["late-1", "late-2"])
    troupe.get([b.set.remote(prefix, "late-1", b"1"), b.set.remote(prefix, "late-2", b"2")], timeout=30)
    assert troupe.get(pending, timeout=30)["ok"]


def test_a_wait_that_times_out_names_the_missing_keys(ranks):
    a, b = ranks
    troupe.get(a.set.remote("test-timeout", "here", b"1"), timeout=30)
    waited = troupe.get(b.wait.remote("test-timeout", ["here", "missing-1", "missing-2"], 0.5), timeout=30)
    assert not waited["ok"]
    assert 0.5 <= waited["s"] < 5, waited
    error = waited["error"]
    assert "troupe.dist.ClusterStore 'test-timeout'" in error, error
    assert "timed out after 0.500 s" in error, error
    assert "missing 2 of 3 key(s): 'missing-1', 'missing-2'" in error, error
    # The store's own timeout bounds get() and wait() without one.
    waited = troupe.get(b.wait.remote("test-timeout", ["never"], store_timeout_s=1.0), timeout=60)
    assert not waited["ok"] and 1.0 <= waited["s"] < 10 and "timed out after 1.000 s" in waited["error"], waited
    assert "missing 1 of 1 key(s): 'never'" in waited["error"], waited


def test_a_group_epoch_store_refuses_an_ended_epoch_and_stops_waiting_when_the_group_moves_on(ranks):
    a, b = ranks
    group = "test-group-epochs"
    troupe.get(a.group_store_set.remote(group, 3, "k", b"epoch 3"), timeout=30)
    joined = troupe.get(b.group_store_get.remote(group, 3, "k", 5.0), timeout=30)
    assert joined == {"ok": True, "value": b"epoch 3", "s": joined["s"]}
    # Epoch 4's keys are its own.
    pending = b.group_store_get.remote(group, 4, "k", 30.0)
    assert troupe.wait([pending], timeout=0.3)[0] == []
    # The group moves to epoch 5: the wait in epoch 4 ends at once, not at its 30 s timeout.
    troupe.get(a.group_store_set.remote(group, 5, "other", b"x"), timeout=30)
    waited = troupe.get(pending, timeout=30)
    assert not waited["ok"] and waited["s"] < 10, waited
    assert "group 'test-group-epochs' is already at epoch 5: epoch 4 is over" in waited["error"], waited
    assert "'k'" in waited["error"], waited
    late = troupe.get(b.group_store_get.remote(group, 3, "k", 5.0), timeout=30)
    assert not late["ok"] and "epoch 3 is over; join epoch 5" in late["error"], late


@pytest.mark.parametrize("backend", ["gloo", "troupe"])
def test_a_process_group_initialised_through_the_store_all_reduces(ranks, backend):
    a, b = ranks
    prefix = f"test-pg-{backend}"
    results = troupe.get([a.all_reduce.remote(backend, prefix, 0, 2), b.all_reduce.remote(backend, prefix, 1, 2)],
                         timeout=120)
    for result in results:
        assert result["sum"] == [3.0] * 4, results
        assert result["backend"] == backend
        assert result["keys"] > 0  # its rendezvous went through this store


def test_nccl_initialised_through_the_store_all_reduces():
    import torch.distributed as dist

    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        pytest.skip("no CUDA device (or no NCCL in this torch): the NCCL backend cannot run here")
    world = 2 if torch.cuda.device_count() >= 2 else 1  # NCCL refuses two ranks on one device
    pair = [Rank.remote() for _ in range(world)]
    try:
        results = troupe.get([r.all_reduce.remote("nccl", "test-pg-nccl", i, world, device="cuda")
                              for i, r in enumerate(pair)], timeout=180)
    finally:
        for r in pair:
            troupe.kill(r)
    want = float(sum(range(1, world + 1)))
    for result in results:
        assert result["sum"] == [want] * 4, results
        assert result["backend"] == "nccl"
