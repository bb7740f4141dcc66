"""Objects: put/get, refs as arguments (resolved at the top level, kept as refs when nested),
results passed between calls, zero-copy arrays, freeing, owners that die, corrupt objects."""
import os
import signal

import numpy as np
import pytest

from troupe_testing import cluster_fixture, eventually, import_troupe

troupe = import_troupe()

pytestmark = pytest.mark.timeout(120)


cluster = cluster_fixture(num_cpus=2)


def store_dir():
    from troupe import _objects

    return _objects.store().root


@troupe.remote
def total(x):
    return float(np.asarray(x).sum())


@troupe.remote
def describe(arg):
    return [type(v).__name__ for v in arg]


@troupe.remote
def fetch_nested(arg):
    return [troupe.get(v) for v in arg]


@troupe.remote
class Holder:
    def put_array(self, n):
        return troupe.put(np.full(n, 2.0))

    def big(self, n):
        return np.ones(n)

    def pid(self):
        return os.getpid()

    def add(self, a, b):
        return a + b


def test_put_get_is_zero_copy_and_read_only():
    x = np.arange(1_000_000, dtype=np.float64)
    ref = troupe.put(x)
    y = troupe.get(ref)
    assert np.array_equal(x, y)
    assert not y.flags.writeable  # mapped from shared memory, as Ray's plasma gives it
    assert troupe.get(troupe.put({"a": [1, 2], "b": "text"})) == {"a": [1, 2], "b": "text"}
    with pytest.raises(TypeError):
        troupe.put(ref)


def test_refs_as_arguments_top_level_resolved_nested_kept():
    ref = troupe.put(np.ones(1000))
    assert troupe.get(total.remote(ref)) == 1000.0
    assert troupe.get(describe.remote([ref, 1])) == ["_StoredRef", "int"]
    assert troupe.get(fetch_nested.remote([troupe.put("deep")])) == ["deep"]
    # The result of one call as the argument of the next, without a get() in between.
    h = Holder.remote()
    first = h.add.remote(1, 2)
    second = h.add.remote(first, 10)
    assert troupe.get(total.remote(second)) == 13.0
    assert troupe.get(fetch_nested.remote([first])) == [3]


@troupe.remote
class Gate:
    """A call that ends only once the test opens the gate: its result is pending until then."""

    def __init__(self):
        import threading

        self.open = threading.Event()

    def wait(self, value):
        assert self.open.wait(60)
        return value

    def release(self):
        self.open.set()


@troupe.remote
class Journal:
    def __init__(self):
        self.seen = []

    def add(self, x):
        self.seen.append(x)
        return x

    def entries(self):
        return self.seen


def test_a_pending_ref_argument_does_not_block_remote_and_calls_keep_their_order():
    gate = Gate.options(max_concurrency=4).remote()
    pending = gate.wait.remote("first")
    nested = gate.wait.remote("nested")
    journal = Journal.remote()
    # Each .remote() returns while its argument is still pending (the gate is shut: get() would hang).
    a = journal.add.remote(pending)
    b = journal.add.remote("second")  # ready, but after `a` from this caller
    c = journal.add.remote([nested])  # a pending ref inside a container
    d = total.remote(pending)  # a task waits the same way
    ready, waiting = troupe.wait([a, b, c], num_returns=1, timeout=0.2)
    assert ready == [] and len(waiting) == 3
    troupe.get(gate.release.remote())
    assert troupe.get([a, b]) == ["first", "second"]
    assert troupe.get(troupe.get(c)[0]) == "nested"
    assert troupe.get(journal.entries.remote())[:2] == ["first", "second"]
    with pytest.raises(troupe.TaskError):
        troupe.get(d)  # total("first") fails in the task, after its argument came


def test_a_failed_argument_fails_the_call_waiting_for_it():
    failed = fails.remote()
    with pytest.raises(troupe.TaskError, match="on purpose"):
        troupe.get(total.remote(failed))


@troupe.remote
def fails():
    raise ValueError("on purpose")


@troupe.remote
def keyword_total(*, x):
    return float(np.asarray(x).sum())


def test_large_results_and_arguments_move_through_shared_memory():
    h = Holder.remote()
    big = troupe.get(h.big.remote(10_000_000))  # 80 MB: more than one RPC message may carry
    assert big.shape == (10_000_000,) and big[-1] == 1.0
    assert troupe.get(total.remote(troupe.put(np.ones(10_000_000)))) == 1e7
    before = set(os.listdir(store_dir()))
    assert troupe.get(total.remote(np.ones(10_000_000))) == 1e7  # an 80 MB argument, by value
    assert troupe.get(h.add.remote(np.ones(10_000_000), 1.0))[-1] == 2.0
    assert troupe.get(keyword_total.remote(x=h.big.remote(10_000_000))) == 1e7  # a keyword's ref is resolved
    assert set(os.listdir(store_dir())) <= before  # the argument files are gone once the calls are over


def test_an_object_is_freed_when_its_last_ref_is_gone():
    ref = troupe.put(np.zeros(1000))
    path = os.path.join(store_dir(), ref.hex())
    assert os.path.exists(path)
    copy = ref
    del ref
    assert os.path.exists(path)
    del copy
    assert not os.path.exists(path)


def test_a_get_of_an_object_whose_owner_died_says_so():
    h = Holder.remote()
    inner = troupe.get(h.put_array.remote(10))  # the actor owns it; we borrow the ref
    assert list(troupe.get(inner)) == [2.0] * 10
    os.kill(troupe.get(h.pid.remote()), signal.SIGKILL)
    eventually(lambda: troupe._api.runtime().actor_info(h.actor_id)["state"] == "DEAD", 30, "the owner to die")
    with pytest.raises(troupe.ObjectLostError, match="owner .* died"):
        troupe.get(inner)


def test_a_corrupt_object_file_is_an_error_not_a_crash():
    ref = troupe.put(np.arange(100))
    path = os.path.join(store_dir(), ref.hex())
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"\xff" * 8)  # the pickle's length now runs past the end
    with pytest.raises(troupe.ObjectLostError, match="corrupt"):
        troupe.get(ref)


def test_the_object_directory_is_private():
    st = os.stat(store_dir())
    assert st.st_mode & 0o777 == 0o700
    ref = troupe.put(b"secret")
    assert os.stat(os.path.join(store_dir(), ref.hex())).st_mode & 0o777 == 0o600


def test_a_freed_object_file_is_reused_only_when_no_value_maps_it():
    x = np.arange(1 << 18, dtype=np.float64)  # 2 MB: files this large are kept for reuse
    ref = troupe.put(x)
    held = troupe.get(ref)  # a live value maps the file
    path = os.path.join(store_dir(), ref.hex())
    del ref
    assert not os.path.exists(path)
    again = troupe.put(np.zeros_like(x))
    assert np.array_equal(held, x)  # not written over: its file was not reused
    del held
    ref2 = troupe.put(x)
    del ref2, again  # nothing maps these: their files are kept...
    third = troupe.put(np.ones_like(x))  # ...and one is written over by the next put
    assert np.array_equal(troupe.get(third), np.ones_like(x))
    kept = [n for n in os.listdir(store_dir()) if n.startswith(f"{os.getpid()}-free-")]
    assert kept, "no freed file was kept for reuse"


def test_a_put_into_a_reused_file_writes_through_its_kept_mapping_and_reads_back_exactly():
    from troupe import _objects

    store = _objects.store()
    mine = f"{os.getpid()}-free-"
    a = np.arange(3 << 17, dtype=np.float64)  # 3 MB
    ref = troupe.put(a)
    del ref  # its file is kept
    b = -a
    ref = troupe.put(b)  # reuses it, mapped for writing
    assert ref.hex() in store.writers
    assert np.array_equal(troupe.get(ref), b)
    del ref  # the file goes back with its mapping
    assert any(writer is not None for _, _, writer in store.free)
    c = np.full(2 << 17, 7.0)  # 2 MB: the 3 MB file is reused and cut to size
    ref = troupe.put(c)
    assert ref.hex() in store.writers
    assert os.path.getsize(os.path.join(store_dir(), ref.hex())) < a.nbytes
    assert np.array_equal(troupe.get(ref), c)
    del ref
    # Another process making room deletes this one's kept files: the next put writes a new
    # file, and the mapping that kept the deleted one's pages goes.
    for name in os.listdir(store_dir()):
        if name.startswith(mine):
            os.unlink(os.path.join(store_dir(), name))
    ref = troupe.put(c)
    assert np.array_equal(troupe.get(ref), c)
    assert ref.hex() not in store.writers
    assert not any(writer is not None for _, _, writer in store.free) and store.writer_bytes == 0


@troupe.remote
def checksum(x):
    return float(np.asarray(x).sum())


def test_a_call_argument_written_into_a_kept_file_with_a_mapping_leaves_it_closed():
    from troupe import _objects

    store = _objects.store()
    a = np.arange(7 << 20, dtype=np.float64)  # 56 MB: arguments of 48 MB or more travel in object files
    ref = troupe.put(a)
    del ref
    ref = troupe.put(-a)  # reuses the kept file and maps it for writing
    del ref  # the file goes back to the free list with its mapping
    assert any(writer is not None for _, _, writer in store.free)
    # A slightly smaller argument reuses that file. Its file leaves this process (the worker
    # reads it, the call deletes it): it is written through the kept mapping, which then closes.
    arg = a[:-4096] + 1
    assert troupe.get(checksum.remote(arg)) == float(arg.sum())
    assert not any(writer is not None for _, _, writer in store.free)
