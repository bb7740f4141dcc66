"""A bounded object store, as Ray's: past init(object_store_memory=...) the oldest objects spill
to the node's spill directory on disk and come back on get(); a put that cannot fit fails with
ObjectStoreFullError and leaves the store working; a flash checkpoint taken meanwhile is not
starved; freeing a spilled object deletes its spilled copy."""
import os
import shutil
import stat
import tempfile

import numpy as np
import pytest

from troupe_testing import cluster_fixture, eventually, import_troupe

troupe = import_troupe()

pytestmark = pytest.mark.timeout(180)

LIMIT = 64 << 20
OBJECT = 10 << 20

cluster = cluster_fixture(num_cpus=2, object_store_memory=LIMIT)


def node_store():
    """The node's object store, as its agent reports it (`troupe status` asks the same)."""
    session = troupe._session.current
    head = next(n for n in session.runtime.nodes() if n["is_head"])
    return session.runtime.object_store(head["address"])


def block(i):
    return np.full(OBJECT // 8, float(i))


@troupe.remote
def first_and_last(x):
    return float(x[0]), float(x[-1]), len(x)


@troupe.remote
class Putter:
    def put_many(self, n):
        return [troupe.put(block(1000 + i)) for i in range(n)]


@pytest.fixture
def shm_dir():
    d = tempfile.mkdtemp(prefix="troupe_spill_test_", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_puts_past_the_limit_spill_to_disk_and_come_back_on_get(shm_dir):
    from troupe.checkpoint import FlashCheckpoint

    store = node_store()
    assert store["limit"] == LIMIT
    spill = store["spill_directory"]
    assert stat.S_IMODE(os.stat(spill).st_mode) == 0o700 and os.stat(spill).st_uid == os.getuid()

    refs = []
    weights = np.arange(4 << 20, dtype=np.float32)  # 16 MiB, beside objects that fill the store
    for i in range(2 * LIMIT // OBJECT):  # twice the limit, every ref kept
        refs.append(troupe.put(block(i)))
        if i == LIMIT // OBJECT:
            with FlashCheckpoint(segment="troupe_ckpt.spill.n.r0", shm_dir=shm_dir) as ckpt:
                ckpt.save(7, {"w": weights})
                restored = ckpt.restore_step(7, as_numpy=True)
                assert np.array_equal(restored.state_dict["w"], weights)

    store = node_store()
    assert store["bytes"] <= LIMIT, store
    assert store["spilled_objects"] >= len(refs) - LIMIT // OBJECT, store
    assert len(os.listdir(spill)) == store["spilled_objects"]

    for i, ref in enumerate(refs):  # the first ones come back from disk
        value = troupe.get(ref)
        assert value.shape == (OBJECT // 8,) and value[0] == i and value[-1] == i
    # A worker of the node reads a spilled object too (it was passed by ref).
    assert troupe.get(first_and_last.remote(refs[0])) == (0.0, 0.0, OBJECT // 8)

    value = ref = None
    del refs
    # Freed objects go from memory and from disk.
    eventually(lambda: node_store()["spilled_objects"] == 0 and not os.listdir(spill), 30, "the spilled copies deleted")


def test_a_put_larger_than_the_store_fails_clearly_and_the_store_keeps_working():
    from troupe.exceptions import ObjectStoreFullError

    with pytest.raises(ObjectStoreFullError, match=f"limit is {LIMIT} bytes"):
        troupe.put(np.zeros(LIMIT // 8 + 1))
    ref = troupe.put(block(3))
    assert troupe.get(ref)[0] == 3.0


def test_a_workers_puts_spill_under_the_nodes_limit_too():
    putter = Putter.remote()
    refs = troupe.get(putter.put_many.remote(2 * LIMIT // OBJECT))
    assert node_store()["spilled_objects"] >= len(refs) - LIMIT // OBJECT
    for i, ref in enumerate(refs):
        assert troupe.get(ref)[5] == 1000 + i
    troupe.kill(putter)
