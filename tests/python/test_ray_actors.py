"""Ray's actor API, as Ray's own test_actor.py and test_actor_advanced.py exercise it, on a real
embedded cluster (2 CPUs, like the machine): arguments, attributes, names and namespaces,
actors inside actors, num_returns, threaded and async actors, ending actors."""
import os
import subprocess
import threading
import time

import pytest

from troupe_testing import BUILD, cluster_fixture, eventually, import_troupe, run_driver

troupe = import_troupe()

pytestmark = pytest.mark.timeout(120)


cluster = cluster_fixture(num_cpus=2)


def state_of(handle):
    return troupe._api.runtime().actor_info(handle.actor_id)["state"]


@troupe.remote
class Keywords:
    def __init__(self, a, b=2, *rest, c=3, **more):
        self.init = (a, b, rest, c, more)

    def seen(self):
        return self.init

    def echo(self, x, y=10, *, z=100):
        return x, y, z


def test_positional_and_keyword_arguments_reach_init_and_methods():
    k = Keywords.remote(1, c=4, d=5)
    assert troupe.get(k.seen.remote()) == (1, 2, (), 4, {"d": 5})
    assert troupe.get(k.echo.remote(1)) == (1, 10, 100)
    assert troupe.get(k.echo.remote(1, z=3, y=2)) == (1, 2, 3)
    with pytest.raises(TypeError, match="unexpected keyword"):
        troupe.get(k.echo.remote(1, w=0))
    # Wrong arguments fail where the call is made, checked against the signature (as in Ray).
    with pytest.raises(TypeError, match="Keywords.remote\\(\\): missing a required argument: 'a'"):
        Keywords.remote()
    with pytest.raises(TypeError, match="multiple values for argument 'x'"):
        k.echo.remote(1, x=2)
    # A handle from elsewhere knows no signature: the actor's own TypeError comes back.
    with pytest.raises(TypeError, match="unexpected keyword"):
        troupe.get(troupe.ActorHandle(k.actor_id, k._type).echo.remote(1, w=0))


class Base:
    kind = "base"

    def who(self):
        return self.kind


@troupe.remote
class Derived(Base):
    kind = "derived"
    count = 0

    def __init__(self):
        type(self).count += 1

    def bump(self):
        type(self).count += 1
        return type(self).count

    @staticmethod
    def static(x):
        return x * 3

    @classmethod
    def cls_name(cls):
        return cls.__name__


def test_class_and_static_attributes_behave_as_in_ray():
    d = Derived.remote()
    assert troupe.get(d.who.remote()) == "derived"  # inherited methods, class attributes
    assert troupe.get(d.bump.remote()) == 2  # class attributes live in the actor's process
    assert troupe.get(d.static.remote(2)) == 6
    assert troupe.get(d.cls_name.remote()) == "Derived"
    with pytest.raises(AttributeError, match="no method 'kind'"):
        d.kind  # a class attribute is not reachable through the handle, as in Ray
    with pytest.raises(AttributeError):
        d.missing.remote()
    with pytest.raises(TypeError, match="cannot be instantiated directly"):
        Derived()
    assert Derived.kind == "derived"  # class attributes and static methods through the class, as in Ray
    assert Derived.static(5) == 15
    with pytest.raises(TypeError, match="Inheriting from actor classes is not currently supported"):
        class Again(Derived):
            pass
    with pytest.raises(TypeError, match=r"try 'object.who.remote\(\)'"):
        d.who()


@troupe.remote
class Counter:
    def __init__(self, start=0):
        self.n = start

    def add(self, k=1):
        self.n += k
        return self.n

    def pid(self):
        return os.getpid()


def test_more_default_actors_than_cpus_all_run():
    # Default actors hold no CPU while alive (Ray: 1 CPU to place, 0 held): 6 fit on 2 CPUs.
    actors = [Counter.remote(i) for i in range(6)]
    assert troupe.get([a.add.remote() for a in actors], timeout=60) == [1, 2, 3, 4, 5, 6]
    # An explicit num_cpus holds what it says: the third 1-CPU actor waits, and get() says why.
    held = [Counter.options(num_cpus=1).remote() for _ in range(2)]
    troupe.get([h.add.remote() for h in held], timeout=60)
    third = Counter.options(num_cpus=1).remote()
    with pytest.raises(troupe.GetTimeoutError, match="PENDING"):
        troupe.get(third.add.remote(), timeout=1)
    with pytest.raises(troupe.exceptions.ResourceExhaustedError, match="infeasible: the request needs CPU 64"):
        Counter.options(num_cpus=64).remote()
    for h in held:
        troupe.kill(h)
    assert troupe.get(third.add.remote(), timeout=60) == 2  # the call that timed out ran first
    troupe.kill(third)


def test_names_conflicts_get_if_exists_and_namespaces():
    a = Counter.options(name="shared").remote(7)
    with pytest.raises(troupe.TroupeError, match="already exists"):
        Counter.options(name="shared").remote()
    same = Counter.options(name="shared", get_if_exists=True).remote(100)
    assert same.actor_id == a.actor_id
    assert troupe.get(troupe.get_actor("shared").add.remote()) == 8
    other = Counter.options(name="shared", namespace="team").remote(50)
    assert other.actor_id != a.actor_id
    assert troupe.get(troupe.get_actor("shared", namespace="team").add.remote()) == 51
    with pytest.raises(ValueError, match="Failed to look up actor with name 'nobody'"):
        troupe.get_actor("nobody")
    with pytest.raises(ValueError):
        troupe.get_actor("")
    troupe.kill(a)
    troupe.kill(other)
    # The name is free again once its actor is DEAD.
    eventually(lambda: state_of(a) == "DEAD", 30, "the named actor to be DEAD")
    b = Counter.options(name="shared").remote(1)
    assert troupe.get(b.add.remote()) == 2
    troupe.kill(b)


def test_namespace_of_a_driver_scopes_its_names():
    address = troupe._session.current.address
    cluster_file = os.path.join(troupe._session.current.run_root, "latest", "cluster.json")
    import json

    tok = json.load(open(cluster_file))["token"]
    Counter.options(name="ns-probe", namespace="alpha", lifetime="detached").remote(3)
    code = (
        "import troupe\n"
        f"troupe.init({address!r}, token={tok!r}, namespace='alpha')\n"
        "print(troupe.get(troupe.get_actor('ns-probe').add.remote()))\n"
        "try:\n"
        "    troupe.get_actor('ns-probe', namespace='beta')\n"
        "except ValueError as e:\n"
        "    print('beta:', e)\n"
        "print(troupe.get_runtime_context().namespace)\n"
    )
    p = run_driver(code, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "4"
    assert "namespace 'beta'" in lines[1]
    assert lines[2] == "alpha"
    troupe.kill(troupe.get_actor("ns-probe", namespace="alpha"))


def test_each_driver_has_an_anonymous_namespace_its_actors_and_tasks_share():
    # Ray's rule: without init(namespace=...), one driver's names are not another's.
    address = troupe._session.current.address
    import json

    tok = json.load(open(os.path.join(troupe._session.current.run_root, "latest", "cluster.json")))["token"]
    mine = troupe.get_runtime_context().namespace
    assert mine.startswith("anonymous-")
    here = Counter.options(name="mine-only", lifetime="detached").remote(1)

    @troupe.remote
    def made_by_a_task():  # a task runs in its driver's namespace: the name lands there
        c = Counter.options(name="from-a-task", lifetime="detached").remote(5)
        return troupe.get(c.add.remote()), troupe.get_runtime_context().namespace

    assert troupe.get(made_by_a_task.remote()) == (6, mine)
    assert troupe.get(troupe.get_actor("from-a-task").add.remote()) == 7
    code = (
        "import troupe\n"
        f"troupe.init({address!r}, token={tok!r})\n"
        "print(troupe.get_runtime_context().namespace)\n"
        "try:\n"
        "    troupe.get_actor('mine-only')\n"
        "except ValueError as e:\n"
        "    print('not found')\n"
        f"print(troupe.get(troupe.get_actor('mine-only', namespace={mine!r}).add.remote()))\n"
        "print('mine-only' in troupe.util.list_named_actors())\n"
    )
    p = run_driver(code, timeout=60)
    assert p.returncode == 0, p.stderr
    theirs, missing, added, listed = p.stdout.splitlines()
    assert theirs.startswith("anonymous-") and theirs != mine
    assert missing == "not found" and added == "2" and listed == "False"
    # The CLI finds a name that only one namespace has, as a user types it.
    cli = [str(BUILD / "troupe"), "logs", "mine-only", "--address", address]
    logs = subprocess.run(cli, env=dict(os.environ, TROUPE_TOKEN=tok), capture_output=True, text=True, timeout=30)
    assert logs.returncode == 0 and here.actor_id in logs.stdout, logs.stderr
    troupe.kill(here)
    troupe.kill(troupe.get_actor("from-a-task"))


def test_list_named_actors_in_this_namespace_or_all():
    here = Counter.options(name="listed-here").remote(1)
    there = Counter.options(name="listed-there", namespace="elsewhere").remote(1)
    unnamed = Counter.remote(1)
    troupe.get([here.add.remote(), there.add.remote(), unnamed.add.remote()])
    names = troupe.util.list_named_actors()
    assert "listed-here" in names and "listed-there" not in names
    everywhere = troupe.util.list_named_actors(all_namespaces=True)
    assert {"name": "listed-here", "namespace": troupe.get_runtime_context().namespace} in everywhere
    assert {"name": "listed-there", "namespace": "elsewhere"} in everywhere
    troupe.kill(here)
    eventually(lambda: "listed-here" not in troupe.util.list_named_actors(), 30, "a killed actor to leave the list")
    troupe.kill(there)
    troupe.kill(unnamed)


def test_get_placement_group_by_name_and_the_runtime_context():
    pg = troupe.util.placement_group([{"CPU": 0.5}], name="found-by-name")
    assert troupe.util.get_placement_group("found-by-name") == pg
    assert troupe.util.get_placement_group("found-by-name").bundle_count == 1
    with pytest.raises(ValueError, match="Failed to look up placement group with name: nope"):
        troupe.util.get_placement_group("nope")
    troupe.util.remove_placement_group(pg)
    eventually(lambda: _no_group_named("found-by-name"), 30, "the removed group to be gone by name")

    @troupe.remote
    class Where:
        def context(self):
            return troupe.get_runtime_context().get()

    w = Where.remote()
    ctx = troupe.get(w.context.remote())
    assert ctx["actor_id"] == w.actor_id and ctx["namespace"] == troupe.get_runtime_context().namespace
    assert ctx["node_id"] in {n["id"] for n in troupe.nodes()}
    assert troupe.get_runtime_context().get()["node_id"] is None  # a driver is no node's process
    troupe.kill(w)


def _no_group_named(name):
    try:
        troupe.util.get_placement_group(name)
    except ValueError:
        return True
    return False


@troupe.remote
class Parent:
    def __init__(self):
        self.children = []

    def spawn(self, n):
        self.children += [Counter.remote(10 * i) for i in range(n)]
        return troupe.get([c.add.remote() for c in self.children])

    def child_handles(self):
        return self.children

    def use(self, handle, times):
        return [troupe.get(handle.add.remote()) for _ in range(times)]

    def define_inside(self):
        @troupe.remote
        class Inner:
            def hello(self):
                return "inner"

        return troupe.get(Inner.remote().hello.remote())

    def kill_child(self, handle):
        troupe.kill(handle)
        return True


def test_actors_create_call_pass_and_kill_actors_inside_actors():
    p = Parent.remote()
    assert troupe.get(p.spawn.remote(2)) == [1, 11]
    assert troupe.get(p.define_inside.remote()) == "inner"
    # Handles made inside an actor come back to the driver and work here.
    children = troupe.get(p.child_handles.remote())
    assert troupe.get(children[1].add.remote(5)) == 16
    # A handle passed into an actor is used there again and again (Ray's pickled-handle tests).
    mine = Counter.remote(100)
    assert troupe.get(p.use.remote(mine, 3)) == [101, 102, 103]
    assert troupe.get(p.use.remote(mine, 2)) == [104, 105]
    assert troupe.get(mine.add.remote()) == 106
    assert troupe.get(p.kill_child.remote(children[0]))
    with pytest.raises(troupe.ActorDiedError):
        troupe.get(children[0].add.remote(), timeout=30)
    # The children end with the actor that created them (they are not detached).
    troupe.kill(p)
    eventually(lambda: state_of(children[1]) == "DEAD", 30, "a child to end with its parent")


@troupe.remote
class Returns:
    @troupe.method(num_returns=3)
    def three(self):
        return 1, 2, 3

    @troupe.method(num_returns=0)
    def nothing(self):
        return None

    def pair(self):
        return "a", "b"

    @troupe.method(num_returns=2)
    def wrong(self):
        return 1


def test_num_returns_on_methods_and_options():
    r = Returns.remote()
    refs = r.three.remote()
    assert len(refs) == 3 and troupe.get(refs) == [1, 2, 3]
    assert troupe.get(refs[2]) == 3
    assert r.nothing.remote() is None
    a, b = r.pair.options(num_returns=2).remote()
    assert troupe.get(b) == "b" and troupe.get(a) == "a"
    ready, _ = troupe.wait(list(r.three.remote()), num_returns=3, timeout=30)
    assert len(ready) == 3
    with pytest.raises(troupe.ActorError, match="num_returns=2"):
        troupe.get(r.wrong.remote()[0])


@troupe.remote
class Meeting:
    """N calls can only finish together: proof that they run at the same time."""

    def __init__(self, n):
        self.barrier = threading.Barrier(n, timeout=20)

    def meet(self):
        self.barrier.wait()
        return threading.get_ident()


def test_max_concurrency_runs_calls_on_threads():
    m = Meeting.options(max_concurrency=4).remote(4)
    idents = troupe.get([m.meet.remote() for _ in range(4)], timeout=60)
    assert len(set(idents)) == 4
    with pytest.raises(ValueError, match="max_concurrency"):
        Meeting.options(max_concurrency=0)


@troupe.remote
class AsyncActor:
    def __init__(self):
        import asyncio

        self.event = asyncio.Event()
        self.waiting = 0

    async def wait_for_all(self, n):
        self.waiting += 1
        if self.waiting == n:
            self.event.set()
        await self.event.wait()
        return self.waiting

    def plain(self):
        return "plain"


def test_async_actor_runs_coroutines_concurrently():
    a = AsyncActor.remote()
    assert troupe.get([a.wait_for_all.remote(5) for _ in range(5)], timeout=60) == [5] * 5
    assert troupe.get(a.plain.remote()) == "plain"


@troupe.remote
class Gate:
    """A call that returns once open() was called: its ref is not ready until then."""

    def __init__(self):
        import threading

        self.opened = threading.Event()

    def wait_open(self):
        self.opened.wait(60)
        return "opened"

    def open(self):
        self.opened.set()

    def fail(self):
        raise KeyError("from the gate")


Gate = Gate.options(max_concurrency=2)


@troupe.remote
class Awaiter:
    async def await_gate(self, gate):
        return await gate.wait_open.remote()

    async def ping(self):
        return "pong"


def test_await_ref_in_an_async_actor_leaves_its_loop_free_for_other_calls():
    gate, awaiter = Gate.remote(), Awaiter.remote()
    waiting = awaiter.await_gate.remote(gate)
    # Its loop answers while the await is pending (a blocking get would hold the loop).
    assert troupe.get(awaiter.ping.remote(), timeout=30) == "pong"
    assert troupe.wait([waiting], timeout=0.2)[0] == []
    gate.open.remote()
    assert troupe.get(waiting, timeout=60) == "opened"


def test_await_ref_and_as_future_in_an_asyncio_driver_and_future():
    import asyncio

    gate = Gate.remote()

    async def main():
        slow = gate.wait_open.remote()
        pending = asyncio.ensure_future(slow.as_future())
        await asyncio.sleep(0)  # the driver's loop runs on while the call is pending
        assert not pending.done()
        gate.open.remote()
        assert await pending == "opened"
        assert await gate.wait_open.remote() == "opened"
        with pytest.raises(troupe.ActorError, match="from the gate"):
            await gate.fail.remote()

    asyncio.run(main())
    assert gate.wait_open.remote().future().result(timeout=30) == "opened"
    with pytest.raises(troupe.ActorError, match="from the gate"):
        gate.fail.remote().future().result(timeout=30)


@troupe.remote(max_restarts=-1)
class Ender:
    def __init__(self, path):
        import atexit

        self.path = path
        atexit.register(lambda: open(path, "w").write("atexit ran"))

    def end(self):
        troupe.exit_actor()

    def slow(self, t):
        time.sleep(t)
        return t


def test_exit_actor_ends_it_for_good_after_running_atexit(tmp_path):
    e = Ender.remote(str(tmp_path / "e1"))
    with pytest.raises(troupe.ActorDiedError, match="ended itself"):
        troupe.get(e.end.remote(), timeout=60)
    assert (tmp_path / "e1").read_text() == "atexit ran"
    info = troupe._api.runtime().actor_info(e.actor_id)
    assert info["state"] == "DEAD" and info["restarts"] == 0  # max_restarts=-1, yet no restart


def test_terminate_runs_after_the_calls_already_sent(tmp_path):
    e = Ender.remote(str(tmp_path / "e2"))
    pending = [e.slow.remote(0.2) for _ in range(3)]
    e.__ray_terminate__.remote()
    assert troupe.get(pending, timeout=60) == [0.2] * 3
    eventually(lambda: state_of(e) == "DEAD", 30, "the terminated actor to be DEAD")
    assert (tmp_path / "e2").read_text() == "atexit ran"


def test_dropping_the_last_handle_ends_an_unnamed_actor():
    c = Counter.remote()
    actor_id = c.actor_id
    assert troupe.get(c.add.remote()) == 1
    named = Counter.options(name="kept").remote()
    troupe.get(named.add.remote())
    copy = c
    del c
    assert state_of(copy) == "ALIVE"  # one handle is left
    del copy, named
    rt = troupe._api.runtime()
    eventually(lambda: rt.actor_info(actor_id)["state"] == "DEAD", 30, "the unreferenced actor to end")
    assert state_of(troupe.get_actor("kept")) == "ALIVE"  # named actors live on
    troupe.kill(troupe.get_actor("kept"))


def test_decorator_and_option_arguments_are_checked():
    with pytest.raises(TypeError, match="unknown actor option"):
        Counter.options(num_cpu=1)
    with pytest.raises(ValueError, match="num_cpus"):
        Counter.options(num_cpus=-1)
    with pytest.raises(ValueError, match="max_restarts"):
        Counter.options(max_restarts=-2)
    with pytest.raises(ValueError, match="lifetime"):
        Counter.options(lifetime="forever")
    with pytest.raises(TypeError, match="decorates a class or function directly"):
        troupe.remote(1, 2)
    with pytest.raises(TypeError, match=r"not @troupe.remote\(\)"):
        troupe.remote()
    with pytest.raises(ValueError, match="num_returns"):
        troupe.method(num_returns=-1)
    with pytest.raises(ValueError, match="kill\\(\\) takes an ActorHandle"):
        troupe.kill("not an actor handle")
    assert troupe.wait([]) == ([], [])


@troupe.remote(num_cpus=0)
class Mirror:
    def echo(self, data):
        return data


def test_arguments_and_results_over_64_mib_travel_whole():
    # Cap'n Proto refuses messages over 64 MiB by default; calls carry up to 1 GiB.
    data = bytes(range(256)) * ((100 << 20) // 256) + b"tail"
    m = Mirror.remote()
    assert troupe.get(m.echo.remote(data)) == data
    troupe.kill(m)


@troupe.remote(max_restarts=-1)
class DiesOnce:
    @troupe.method(max_task_retries=2)
    def retried(self, marker):
        if not os.path.exists(marker):  # the first try kills the worker
            open(marker, "w").close()
            os._exit(1)
        return "ok"

    def not_retried(self, marker):
        if not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)
        return "ok"

    def comm(self):
        with open("/proc/self/comm") as f:
            return f.read().strip()


def test_a_methods_own_max_task_retries_outranks_the_actors(tmp_path):
    a = DiesOnce.remote()
    assert troupe.get(a.retried.remote(str(tmp_path / "one")), timeout=60) == "ok"  # sent again after the restart
    with pytest.raises(troupe.ActorDiedError, match="max_task_retries=0"):
        troupe.get(a.not_retried.remote(str(tmp_path / "two")), timeout=60)  # the actor's own: 0
    with pytest.raises(ValueError, match="max_task_retries"):
        troupe.method(max_task_retries=-2)


def test_a_call_named_with_options_sets_the_process_title_while_it_runs():
    a = DiesOnce.remote()
    assert troupe.get(a.comm.options(name="fetch").remote()) == "troupe::fetch"
    assert troupe.get(a.comm.remote()) != "troupe::fetch"  # back once it returned
