"""Reference counting with borrowers, as Ray's: an object whose ref was sent to other processes
lives while any of them (or its owner) keeps a ref, and is freed once the last one is dropped
(its file leaves the node's object directory); a borrower killed with -9 does not keep it; refs
inside results and inside other put() values count too; a ref pickled out of band (by the user,
or in a task function's closure) stays while its pickler lives. Ray's test_reference_counting.py
public cases, rewritten."""
import os
import signal
import time

import numpy as np
import pytest

from troupe_testing import cluster_fixture, eventually, import_troupe

troupe = import_troupe()

pytestmark = pytest.mark.timeout(120)

cluster = cluster_fixture(num_cpus=2)


def stored(ref):
    """Whether a put() object's file is in the node's object directory (or spilled)."""
    from troupe import _objects

    return _objects.store().exists(ref.hex())


def freed(name, what):
    from troupe import _objects

    store = _objects.store()
    eventually(lambda: not store.exists(name) and not os.path.exists(os.path.join(store.refs, name)), 30, what)


@troupe.remote
class Keeper:
    def keep(self, box):
        self.ref = box[0]  # nested: stays a ref
        return True

    def read(self):
        return float(troupe.get(self.ref)[0])

    def drop(self):
        self.ref = None
        return True

    def pass_on(self, other):
        return troupe.get(other.keep.remote([self.ref]))

    def make(self, n):
        self.mine = troupe.put(np.full(n, 5.0))
        return [self.mine]

    def forget(self):
        self.mine = None
        return True

    def pid(self):
        return os.getpid()


@troupe.remote
def first(box):
    return float(troupe.get(box[0])[0])


def test_an_object_lent_to_an_actor_lives_until_the_actor_drops_it():
    keeper = Keeper.remote()
    ref = troupe.put(np.full(1000, 3.0))
    name = ref.hex()
    assert troupe.get(keeper.keep.remote([ref]))
    del ref  # the owner's last ref: the actor still has one
    assert troupe.get(keeper.read.remote()) == 3.0
    assert troupe.get(keeper.drop.remote())
    freed(name, "the object freed once its borrower dropped it")
    troupe.kill(keeper)


def test_a_ref_passed_on_from_borrower_to_borrower_is_freed_when_the_last_drops_it():
    a, b = Keeper.remote(), Keeper.remote()
    ref = troupe.put(np.full(10, 7.0))
    name = ref.hex()
    troupe.get(a.keep.remote([ref]))
    assert troupe.get(a.pass_on.remote(b))
    del ref
    troupe.get(a.drop.remote())
    assert troupe.get(b.read.remote()) == 7.0  # A and the owner dropped theirs: B's keeps it
    troupe.get(b.drop.remote())
    freed(name, "the object freed once the last borrower dropped it")
    for k in (a, b):
        troupe.kill(k)


def test_a_borrower_killed_with_minus_9_does_not_keep_the_object():
    keeper = Keeper.remote()
    ref = troupe.put(np.full(10, 1.0))
    name = ref.hex()
    troupe.get(keeper.keep.remote([ref]))
    del ref
    os.kill(troupe.get(keeper.pid.remote()), signal.SIGKILL)
    freed(name, "the node agent to drop the dead borrower's hold and free the object")


def test_a_task_argument_is_freed_after_the_task_when_the_caller_dropped_it():
    ref = troupe.put(np.full(10, 2.0))
    name = ref.hex()
    result = first.remote([ref])
    del ref
    assert troupe.get(result) == 2.0
    freed(name, "the argument freed after the task")


def test_a_ref_in_a_result_is_borrowed_by_the_caller():
    keeper = Keeper.remote()
    (ref,) = troupe.get(keeper.make.remote(100))
    name = ref.hex()
    troupe.get(keeper.forget.remote())  # the owner's own ref goes: the driver's keeps it
    assert troupe.get(ref)[0] == 5.0
    assert stored(ref)
    del ref
    freed(name, "the object freed once the caller dropped the ref it got in a result")
    troupe.kill(keeper)


def test_a_ref_inside_a_put_value_lives_as_long_as_the_value():
    inner = troupe.put(np.full(10, 9.0))
    name = inner.hex()
    outer = troupe.put({"inner": inner})
    del inner
    for _ in range(2):  # each get() of the value finds the inner object
        assert troupe.get(troupe.get(outer)["inner"])[0] == 9.0
    assert troupe.get(first.remote([troupe.get(outer)["inner"]])) == 9.0
    del outer
    freed(name, "the inner object freed with the value that held its ref")


def test_an_object_never_lent_is_freed_at_once():
    ref = troupe.put(np.full(10, 1.0))
    name = ref.hex()
    del ref
    from troupe import _objects

    assert not os.path.exists(_objects.store().path(name))


def test_a_ref_pickled_out_of_band_stays_loadable_while_its_pickler_lives():
    # pickle.dumps by the user (to a file, a queue): nothing can count where the bytes go, so
    # the object stays while the process that pickled it lives, as Ray pins it.
    import pickle

    ref = troupe.put(np.full(10, 4.0))
    name = ref.hex()
    blob = pickle.dumps(ref)
    del ref
    for _ in range(2):  # loaded twice, the first copy dropped in between
        again = pickle.loads(blob)
        assert troupe.get(again)[0] == 4.0
        del again
    assert troupe.get(first.remote([pickle.loads(blob)])) == 4.0
    from troupe import _objects

    assert _objects.store().exists(name)


def test_copies_of_a_ref_are_one_ref():
    import copy

    ref = troupe.put(np.full(10, 2.0))
    name = ref.hex()
    same, deep = copy.copy(ref), copy.deepcopy([ref])[0]
    assert same is ref and deep is ref
    del ref, same, deep
    freed(name, "the object freed once its one ref (and its copies) went")


def _reader_of(ref):
    @troupe.remote
    def read_captured(_):
        return float(troupe.get(ref)[0])  # `ref` is in the function's closure

    return read_captured


@troupe.remote
def wait_for(path):
    while not os.path.exists(path):
        time.sleep(0.01)
    return True


def test_a_ref_captured_by_a_task_s_function_lives_with_the_function(tmp_path):
    # The calls wait for a pending argument: their workers unpickle the function (and the ref in
    # it) after the driver dropped both.
    captured = troupe.put(np.full(10, 6.0))
    name = captured.hex()
    reader = _reader_of(captured)
    gate = wait_for.remote(str(tmp_path / "go"))
    results = [reader.remote(gate) for _ in range(4)]
    del captured, reader
    import gc

    gc.collect()
    (tmp_path / "go").touch()
    assert troupe.get(results, timeout=60) == [6.0] * 4
    assert stored_name(name)


def stored_name(name):
    from troupe import _objects

    return _objects.store().exists(name)


@troupe.remote
def down_the_chain(box, depth):
    value = float(troupe.get(box[0])[0])
    return value if depth == 0 else down_the_chain.remote(box, depth - 1)


def test_a_ref_passed_down_a_chain_of_tasks_is_freed_after_the_last():
    ref = troupe.put(np.full(10, 8.0))
    name = ref.hex()
    tail = down_the_chain.remote([ref], 4)
    del ref
    for _ in range(4):  # each task returns the next one's ref
        tail = troupe.get(tail)
    assert troupe.get(tail) == 8.0
    del tail
    freed(name, "the object freed once the chain's last task was done with it")


@troupe.remote
class TwoSlots:
    def set(self, slot, box):
        setattr(self, slot, box[0])
        return True

    def clear(self, slot):
        setattr(self, slot, None)
        return True

    def read(self, slot):
        return float(troupe.get(getattr(self, slot))[0])


def test_an_actor_holding_two_copies_of_a_ref_keeps_the_object_until_both_go():
    actor = TwoSlots.remote()
    ref = troupe.put(np.full(10, 1.0))
    name = ref.hex()
    actor.set.remote("a", [ref])
    assert troupe.get(actor.set.remote("b", [ref]))
    del ref
    assert troupe.get(actor.clear.remote("a"))
    assert troupe.get(actor.read.remote("b")) == 1.0 and stored_name(name)
    assert troupe.get(actor.clear.remote("b"))
    freed(name, "the object freed once the actor dropped its second copy")
    ref = troupe.put(np.full(10, 1.0))
    name = ref.hex()
    assert troupe.get(actor.set.remote("a", [ref]))
    del ref
    troupe.kill(actor)
    freed(name, "the object freed once the actor holding it was killed")


@troupe.remote(max_retries=1)
def crash_once(box, flag):
    troupe.get(box[0])
    if not os.path.exists(flag):
        open(flag, "w").close()
        os._exit(1)  # the worker dies holding the borrowed ref; the retry gets it again
    return float(troupe.get(box[0])[0])


def test_a_retried_task_gets_its_borrowed_ref_again_and_it_is_freed_after(tmp_path):
    ref = troupe.put(np.full(10, 3.0))
    name = ref.hex()
    result = crash_once.remote([ref], str(tmp_path / "crashed"))
    del ref
    assert troupe.get(result, timeout=60) == 3.0
    freed(name, "the object freed after the retried task")


@troupe.remote
class Counter:
    def __init__(self):
        self.n = 0

    def add(self):
        self.n += 1
        return self.n


@troupe.remote
class HandleKeeper:
    def keep(self, box):
        self.handle = box[0]
        return True

    def use(self):
        return troupe.get(self.handle.add.remote())

    def drop(self):
        self.handle = None
        return True

    def pid(self):
        return os.getpid()


def actor_state(actor_id):
    return troupe._api.runtime().actor_info(actor_id)["state"]


def test_an_actor_whose_handle_was_passed_ends_when_the_last_handle_anywhere_goes():
    counter, keeper = Counter.remote(), HandleKeeper.remote()
    actor_id = counter.actor_id
    assert troupe.get(keeper.keep.remote([counter]))
    del counter  # the owner's last handle: the keeper's keeps the actor
    assert troupe.get(keeper.use.remote()) == 1
    assert actor_state(actor_id) == "ALIVE"
    assert troupe.get(keeper.drop.remote())
    eventually(lambda: actor_state(actor_id) == "DEAD", 30, "the actor to end once no handle is left")
    troupe.kill(keeper)


def test_an_actor_whose_handle_holder_was_killed_ends():
    counter, keeper = Counter.remote(), HandleKeeper.remote()
    actor_id = counter.actor_id
    assert troupe.get(keeper.keep.remote([counter]))
    del counter
    os.kill(troupe.get(keeper.pid.remote()), signal.SIGKILL)
    eventually(lambda: actor_state(actor_id) == "DEAD", 30, "the actor to end once its last holder died")
