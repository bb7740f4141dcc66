"""A task worker's queue (one worker: a 1-CPU cluster): a task that blocks in get() or runs long
does not hold up the tasks queued behind it."""
import os
import time

import pytest

from troupe_testing import cluster_fixture, import_troupe

troupe = import_troupe()

pytestmark = pytest.mark.timeout(120)

cluster = cluster_fixture(num_cpus=1)


@troupe.remote
def double(x):
    return 2 * x


@troupe.remote
def pid():
    return os.getpid()



@troupe.remote
def hold_until(path):
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    return "released"


@troupe.remote
def via_nested(task, *args):
    return troupe.get(task.remote(*args))


def test_a_long_task_does_not_hold_up_short_ones_queued_behind_it(tmp_path):
    # One worker: the long tasks and the short one meet in its queue. Each submitter spreads
    # tasks by what it has in flight itself, so on a larger pool a nested submitter can send a
    # short task to a worker busy with a long one just the same.
    assert len(set(troupe.get([pid.remote() for _ in range(20)]))) == 1
    marker = tmp_path / "release"
    long_ones = [via_nested.remote(hold_until, str(marker)) for _ in range(2)]
    assert troupe.get(via_nested.remote(double, 21), timeout=30) == 42
    assert troupe.wait(long_ones, num_returns=2, timeout=0)[0] == []  # still held: it really overlapped
    marker.touch()
    assert troupe.get(long_ones, timeout=60) == ["released"] * 2


def test_calls_queued_before_the_runner_starts_still_wake_the_watchdog():
    # Two calls arrive before the queue's first runner has started (the drain is only submitted);
    # the first runs long. The second must still be handed to a new runner, though no dispatch
    # came after the long one started to wake the watchdog.
    import threading
    from troupe import _refs, _worker

    release, second_ran = threading.Event(), threading.Event()

    def execute(method, payload):
        if method == "long":
            release.wait(30)
        return method

    hook = _refs._blocking_hook
    drainer = _worker._Drainer(execute, 8)
    _refs._blocking_hook = hook
    held, pool = [], drainer.pool

    class Deferred:
        def submit(self, fn):
            held.append(fn)

    drainer.pool = Deferred()
    drainer.dispatch("long", b"", lambda _: None)
    drainer.dispatch("short", b"", lambda _: second_ran.set())
    assert len(held) == 1  # one drain submitted, not yet running
    drainer.pool = pool
    pool.submit(held[0])
    try:
        assert second_ran.wait(10), "the call behind a long one was never handed to a new runner"
    finally:
        release.set()
