"""Remote functions (Ray's test_basic*.py behaviours): tasks on pooled workers, options, nested
tasks, tasks and actors calling each other, errors, retries, resources and placement groups."""
import os
import signal
import time

import pytest

from troupe_testing import cluster_fixture, eventually, import_troupe

troupe = import_troupe()

pytestmark = pytest.mark.timeout(120)


cluster = cluster_fixture(num_cpus=2, resources={"slot": 2})


@troupe.remote
def double(x):
    return 2 * x


@troupe.remote
def pid():
    return os.getpid()


@troupe.remote
def kw(a, b=1, *rest, c=2, **more):
    return a, b, rest, c, more


@troupe.remote(num_returns=2)
def split(x):
    return x, -x


@troupe.remote
def fib(n):
    if n < 2:
        return n
    return sum(troupe.get([fib.remote(n - 1), fib.remote(n - 2)]))


@troupe.remote
def boom(message):
    raise KeyError(message)


def test_tasks_run_on_reused_workers():
    assert troupe.get(double.remote(21)) == 42
    assert troupe.get([double.remote(i) for i in range(100)]) == [2 * i for i in range(100)]
    pids = set(troupe.get([pid.remote() for _ in range(50)]))
    assert 1 <= len(pids) <= 2  # the pool: one worker per CPU, not a process per task
    assert os.getpid() not in pids
    assert troupe.get(kw.remote(0, c=5, z=1)) == (0, 1, (), 5, {"z": 1})
    with pytest.raises(TypeError, match="Remote functions cannot be called directly"):
        double(1)


def test_num_returns_options_and_names():
    a, b = split.remote(3)
    assert troupe.get([a, b]) == [3, -3]
    refs = troupe.remote(num_returns=3)(lambda: (1, 2, 3)).remote()
    assert troupe.get(refs) == [1, 2, 3]
    assert double.options(name="named-double").remote(1) is not None
    with pytest.raises(TypeError, match="unknown task option"):
        double.options(lifetime_x=1)
    with pytest.raises(ValueError, match="infeasible"):
        double.options(num_cpus=16).remote(1)
    with pytest.raises(ValueError, match="infeasible"):
        double.options(resources={"nothing-here": 1}).remote(1)


def test_nested_tasks_do_not_deadlock_on_two_cpus():
    assert troupe.get(fib.remote(7), timeout=90) == 13


def test_task_exceptions_keep_their_type_and_traceback():
    with pytest.raises(KeyError) as info:
        troupe.get(boom.remote("missing"))
    assert isinstance(info.value, troupe.TaskError)
    assert "boom raised KeyError" in str(info.value) and "raise KeyError(message)" in str(info.value)


@troupe.remote
class Registry:
    def __init__(self):
        self.items = []

    def add(self, x):
        self.items.append(x)
        return len(self.items)

    def run_task(self, x):
        return troupe.get(double.remote(x))

    def items_(self):
        return self.items


@troupe.remote
def call_actor(handle, x):
    return troupe.get(handle.add.remote(x))


@troupe.remote
def make_actor():
    r = Registry.options(name="made-by-task", lifetime="detached").remote()
    troupe.get(r.add.remote("from task"))
    return r


def test_tasks_call_actors_and_actors_call_tasks():
    r = Registry.remote()
    assert sorted(troupe.get([call_actor.remote(r, i) for i in range(3)])) == [1, 2, 3]
    assert sorted(troupe.get(r.items_.remote())) == [0, 1, 2]
    assert troupe.get(r.run_task.remote(5)) == 10
    made = troupe.get(make_actor.remote())
    assert troupe.get(made.items_.remote()) == ["from task"]
    troupe.kill(made)


@troupe.remote(max_retries=2)
def die_once(marker):
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return "survived"


@troupe.remote(max_retries=0)
def die_always():
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_task_whose_worker_dies_is_retried_then_fails_with_the_reason(tmp_path):
    assert troupe.get(die_once.remote(str(tmp_path / "m")), timeout=90) == "survived"
    with pytest.raises(troupe.WorkerCrashedError, match="SIGKILL"):
        troupe.get(die_always.remote(), timeout=90)


@troupe.remote(max_retries=3, retry_exceptions=[ValueError])
def flaky(path):
    n = int(open(path).read()) if os.path.exists(path) else 0
    open(path, "w").write(str(n + 1))
    if n < 2:
        raise ValueError(f"attempt {n}")
    return n


def test_retry_exceptions(tmp_path):
    assert troupe.get(flaky.remote(str(tmp_path / "n"))) == 2
    with pytest.raises(KeyError):  # not listed: not retried
        troupe.get(boom.options(max_retries=3, retry_exceptions=[ValueError]).remote("x"))


@troupe.remote(resources={"slot": 1})
def slot_pid():
    time.sleep(0.3)
    return os.getpid()


def test_tasks_with_custom_resources_run_on_workers_holding_them():
    pids = troupe.get([slot_pid.remote() for _ in range(4)], timeout=60)
    assert len(set(pids)) == 2  # two slots: two workers, each running one task at a time


def test_placement_groups_from_python():
    from troupe.util import PlacementGroupSchedulingStrategy, placement_group, remove_placement_group

    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK")
    assert troupe.get(pg.ready(), timeout=30) == pg
    assert pg.wait(5)
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=1)
    r = Registry.options(scheduling_strategy=strategy, num_cpus=1).remote()
    assert troupe.get(r.add.remote(1)) == 1
    assert troupe.get(double.options(scheduling_strategy=strategy).remote(4)) == 8
    assert troupe.get(double.options(placement_group=pg, placement_group_bundle_index=0).remote(5)) == 10
    with pytest.raises(ValueError, match="strategy"):
        placement_group([{"CPU": 1}], strategy="ANYWHERE")
    big = placement_group([{"CPU": 2}])  # cannot be placed while pg holds both CPUs
    assert not big.wait(0.5)
    remove_placement_group(pg)
    eventually(lambda: troupe._api.runtime().actor_info(r.actor_id)["state"] == "DEAD", 30,
               "the actor in the removed group to end")
    assert big.wait(30)
    remove_placement_group(big)

