"""Python workers serve their actor with the server C++ workers use (runtime/rpc/include/troupe/runtime/actor_server.h): one
caller's calls run in the order it sent them, also when they go out as one batch, when one takes a
while and while another caller's calls interleave; an async actor's calls start in that order."""
import asyncio
import time

import pytest

from troupe_testing import cluster_fixture, import_troupe

troupe = import_troupe()

pytestmark = pytest.mark.timeout(120)

cluster = cluster_fixture(num_cpus=2)


@troupe.remote
class Journal:
    def __init__(self):
        self.log = []
        self.running = 0
        self.overlapped = False

    def note(self, caller, i, pause=0.0):
        self.running += 1
        self.overlapped |= self.running > 1
        self.log.append((caller, i))
        if pause:
            time.sleep(pause)  # the calls sent after this one arrive while it runs
        self.running -= 1
        return i

    def seen(self):
        return self.log, self.overlapped


@troupe.remote
class Caller:
    def send(self, journal, name, n):
        return troupe.get([journal.note.remote(name, i) for i in range(n)])


@troupe.remote
class AsyncJournal:
    def __init__(self):
        self.log = []

    async def note(self, i):
        self.log.append(i)  # before its first await: the order the calls started in
        await asyncio.sleep(0)
        return i

    def seen(self):
        return self.log


def test_a_default_actor_runs_one_callers_calls_one_at_a_time_in_the_order_sent():
    j = Journal.remote()
    refs = [j.note.remote("driver", 0, 0.2)] + [j.note.remote("driver", i) for i in range(1, 300)]
    assert troupe.get(refs, timeout=60) == list(range(300))
    log, overlapped = troupe.get(j.seen.remote())
    assert log == [("driver", i) for i in range(300)]
    assert not overlapped


def test_each_callers_calls_keep_their_order_while_another_callers_interleave():
    j = Journal.remote()
    other = Caller.remote()
    theirs = other.send.remote(j, "actor", 300)
    mine = [j.note.remote("driver", i) for i in range(300)]
    assert troupe.get(mine, timeout=60) == list(range(300))
    assert troupe.get(theirs, timeout=60) == list(range(300))
    log, overlapped = troupe.get(j.seen.remote())
    for caller in ("driver", "actor"):
        assert [i for c, i in log if c == caller] == list(range(300))
    assert not overlapped


def test_an_async_actors_calls_start_in_the_order_sent():
    a = AsyncJournal.remote()
    assert troupe.get([a.note.remote(i) for i in range(300)], timeout=60) == list(range(300))
    assert troupe.get(a.seen.remote()) == list(range(300))
