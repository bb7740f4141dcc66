"""The Python driver API against real clusters: embedded, attached with "auto" and by address."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from troupe_testing import PYTHON_PACKAGE, eventually, free_port, import_troupe, processes_under, run_driver

troupe = import_troupe()


@troupe.remote(num_cpus=1)
class Counter:
    def __init__(self, start=0):
        self.n = start

    def add(self, k=1):
        self.n += k
        return self.n

    def pid(self):
        return os.getpid()

    def fail(self, message):
        raise ValueError(message)

    def custom(self):
        raise LookupError("not here")

    def exit(self, code):
        os._exit(code)

    def segfault(self):
        import ctypes
        sys.stderr.write("about to read address 0\n")
        sys.stderr.flush()
        ctypes.string_at(0)

    def sleep(self, seconds):
        time.sleep(seconds)
        return seconds

    def double(self, value):
        return value * 2

    def touch(self, path):
        open(path, "w").close()


@pytest.fixture
def embedded():
    troupe.init(num_cpus=4)
    root = troupe._session.current.run_root
    yield root
    troupe.shutdown()
    assert processes_under(root) == [], "shutdown() left processes behind"


def test_calls_get_wait_and_ordering(embedded):
    c = Counter.remote(10)
    assert troupe.get(c.add.remote(5)) == 15
    refs = [c.add.remote() for _ in range(200)]
    assert troupe.get(refs) == list(range(16, 216))  # in submission order
    ready, not_ready = troupe.wait([c.add.remote(), c.sleep.remote(3)], num_returns=1, timeout=2)
    assert len(ready) == 1 and len(not_ready) == 1
    assert troupe.get(ready[0]) == 216
    assert isinstance(c, troupe.ActorHandle)


def test_threads_share_the_runtime_while_one_waits_long(embedded):
    """A thread blocked in a long get() (it runs the event loop) must not hold up another thread's
    calls, and a call nobody waits for still runs once the caller goes idle."""
    import threading

    slow, fast = Counter.remote(), Counter.remote()
    troupe.get([slow.pid.remote(), fast.pid.remote()])
    started = threading.Event()
    results = {}

    def long_wait():
        started.set()
        results["slow"] = troupe.get(slow.sleep.remote(3.0), timeout=30)

    t = threading.Thread(target=long_wait)
    t.start()
    started.wait()
    t0 = time.monotonic()
    for i in range(50):
        assert troupe.get(fast.add.remote(1), timeout=10) == i + 1
    assert time.monotonic() - t0 < 2.5, "another thread's long get() stalled these calls"
    t.join()
    assert results["slow"] == 3.0
    # Fire and forget: the second call is queued behind the first, and the driver then stays out
    # of the runtime; the background thread must take the loop back and send it.
    marker = os.path.join(embedded, "fired")
    fast.sleep.remote(0.1)
    fast.touch.remote(marker)
    eventually(lambda: os.path.exists(marker), 10, "the queued call to run without a get()")


def test_exceptions_keep_their_type_and_remote_traceback(embedded):
    c = Counter.remote()
    with pytest.raises(ValueError) as info:
        troupe.get(c.fail.remote("bad input 42"))
    assert isinstance(info.value, troupe.ActorError)
    assert "bad input 42" in str(info.value)
    assert "Traceback" in info.value.remote_traceback and "in fail" in info.value.remote_traceback
    with pytest.raises(LookupError):
        troupe.get(c.custom.remote())
    assert troupe.get(c.add.remote(1)) == 1  # the actor survived its exceptions


def test_get_timeout(embedded):
    c = Counter.remote()
    started = time.monotonic()
    with pytest.raises(troupe.GetTimeoutError):
        troupe.get(c.sleep.remote(3), timeout=0.3)
    assert time.monotonic() - started < 2


def test_death_reasons_restarts_and_kill(embedded):
    c = Counter.remote()
    with pytest.raises(troupe.ActorDiedError, match="exited with code 3"):
        troupe.get(c.exit.remote(3))
    with pytest.raises(troupe.ActorDiedError, match="exited with code 3"):
        troupe.get(c.add.remote())  # later calls carry the same reason

    crashy = Counter.options(max_restarts=1).remote(100)
    first = troupe.get(crashy.pid.remote())
    with pytest.raises(troupe.ActorDiedError) as info:
        troupe.get(crashy.segfault.remote())
    assert "SIGSEGV" in str(info.value) and "about to read address 0" in str(info.value)
    assert troupe.get(crashy.pid.remote()) != first  # restarted, same handle
    assert troupe.get(crashy.add.remote()) == 101  # __init__ ran again

    troupe.kill(crashy)
    with pytest.raises(troupe.ActorDiedError, match="killed"):
        troupe.get(crashy.add.remote())


def test_numpy_and_tensor_arguments(embedded):
    c = Counter.remote()
    big = np.arange(1 << 20, dtype=np.float32)
    out = troupe.get(c.double.remote(big))
    np.testing.assert_array_equal(out, big * 2)
    torch = pytest.importorskip("torch")
    t = torch.ones(1000, 10)
    assert torch.equal(troupe.get(c.double.remote(t)), t * 2)


def test_named_actors_nodes_resources_and_cpp_actors(embedded):
    Counter.options(name="shared").remote(5)
    same = troupe.get_actor("shared")
    assert troupe.get(same.add.remote(1)) == 6
    with pytest.raises(troupe.TroupeError, match="no live actor"):
        troupe.get_actor("nobody")
    nodes = troupe.nodes()
    assert len(nodes) == 1 and nodes[0]["state"] == "ALIVE"
    assert troupe.cluster_resources()["CPU"] == 4
    cpp = troupe.cpp_actor("Counter", init_args='{"start": 7}', name="cpp-counter")
    assert troupe.get(cpp.add.remote("3")) == b"10"
    assert troupe.get(troupe.get_actor("cpp-counter").get.remote()) == b"10"
    # A C++ actor's status code reaches Python: an ActorError that is also the code's type.
    with pytest.raises(troupe.ActorError) as caught:
        troupe.get(cpp.add.remote("x"))
    assert isinstance(caught.value, troupe.exceptions.InvalidArgumentError) and isinstance(caught.value, ValueError)
    assert caught.value.code == "INVALID_ARGUMENT" and "the delta must be an integer" in str(caught.value)
    with pytest.raises(troupe.TroupeError, match="infeasible"):
        Counter.options(num_cpus=64).remote()
    with pytest.raises(TypeError, match="unknown actor option"):
        Counter.options(colour="red")


def test_cpp_actor_init_args_are_checked_against_their_schema_in_the_driver(embedded):
    # Encoded in the driver (actors/schema/init_args.capnp): a bad field fails here, and no actor
    # is submitted, so no worker starts.
    for bad, why in [({"strat": 1}, 'unknown field "strat" (CounterArgs has: start)'),
                     ('{"start": "1"}', '"start" must be an integer, got a string'),
                     ("7", "must be an object of the fields of CounterArgs, got a number")]:
        with pytest.raises(troupe.exceptions.InvalidArgumentError, match="Counter init args") as caught:
            troupe.cpp_actor("Counter", init_args=bad, name="bad-counter")
        assert why in str(caught.value)
    with pytest.raises(troupe.exceptions.InvalidArgumentError, match='"engine.learning_rate"'):
        troupe.cpp_actor("Trainer", init_args=json.dumps({"engine": {"learning_rate": 0.1}}))
    with pytest.raises(troupe.exceptions.ArgumentTypeError, match="must be bytes or str"):
        troupe.cpp_actor("Echo", init_args={"x": 1})
    assert troupe.actors() == []
    # A dict is encoded like its JSON text.
    cpp = troupe.cpp_actor("Counter", init_args={"start": 40})
    assert troupe.get(cpp.add.remote("2")) == b"42"


def test_attach_auto_and_by_address_across_two_drivers(troupe_cli_cluster):
    address, token, env = troupe_cli_cluster
    # Driver 1 (another process) leaves a detached named actor behind.
    first = run_driver(
        "import troupe\n"
        "troupe.init('auto', namespace='shelf')\n"
        "@troupe.remote\n"
        "class Box:\n"
        "    def __init__(self): self.items = []\n"
        "    def put(self, x): self.items.append(x); return len(self.items)\n"
        "b = Box.options(name='box', lifetime='detached').remote()\n"
        "print(troupe.get(b.put.remote('from driver 1')))\n", env=env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == "1"
    # Driver 2 attaches by address and token.
    second = run_driver(
        "import troupe\n"
        f"troupe.init('{address}', token='{token}', namespace='shelf')\n"
        "print(troupe.get(troupe.get_actor('box').put.remote('from driver 2')))\n", env=env)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "2"


def test_init_against_an_unreachable_address_fails_fast():
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="cannot reach"):
        troupe.init(f"127.0.0.1:{free_port()}", token="x" * 32)
    assert time.monotonic() - started < 10
    assert not troupe.is_initialized()


def test_embedded_cluster_is_cleaned_up_when_the_driver_is_killed(tmp_path):
    driver = subprocess.Popen(
        ["/usr/bin/python3", "-c",
         "import troupe, time\n"
         "troupe.init(num_cpus=2)\n"
         "@troupe.remote\n"
         "class A:\n"
         "    def f(self): return 1\n"
         "a = A.remote(); troupe.get(a.f.remote())\n"
         "print(troupe._session.current.run_root, flush=True)\n"
         "time.sleep(600)\n"],
        env=dict(os.environ, PYTHONPATH=str(PYTHON_PACKAGE)), stdout=subprocess.PIPE, text=True)
    root = driver.stdout.readline().strip()
    assert root and processes_under(root), "the embedded cluster did not start"
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    eventually(lambda: processes_under(root) == [], 15, "the orphaned cluster to stop")


@pytest.fixture
def troupe_cli_cluster(troupe):
    """A cluster started with the CLI; drivers attach to it with "auto" or its address."""
    port = free_port()
    troupe.run("start", "--head", "--port", str(port))
    import json
    cluster = json.loads((troupe.run_dir() / "cluster.json").read_text())
    yield cluster["controller_address"], cluster["token"], troupe.env


def test_actor_output_is_streamed_with_a_prefix_and_rate_limited():
    code = (
        "import troupe\n"
        "troupe.init(num_cpus=2)\n"
        "@troupe.remote\n"
        "class Chatty:\n"
        "    def say(self, text, times=1):\n"
        "        for i in range(times): print(f'{text} {i}', flush=True)\n"
        "        return times\n"
        "c = Chatty.remote()\n"
        "troupe.get(c.say.remote('hello from the actor'))\n"
        "troupe.get(c.say.remote('flood', 5000))\n"
        "troupe.shutdown()\n")  # shutdown prints what is left, so nothing is lost
    done = run_driver(code)
    assert done.returncode == 0, done.stderr
    assert "(Chatty pid=" in done.stdout
    assert done.stdout.count("hello from the actor 0") == 1  # once: never lost, never repeated
    flood = [line for line in done.stdout.splitlines() if " flood " in line]
    assert 0 < len(flood) < 5000  # rate-limited...
    assert "line(s) of actor output dropped" in done.stderr  # ...and it says so


def test_quickstart_notebook_runs_against_a_cluster(troupe_cli_cluster, tmp_path):
    """examples/notebooks/quickstart.ipynb, executed by jupyter nbconvert as a user would."""
    from troupe_testing import BUILD, REPO

    _, _, env = troupe_cli_cluster
    notebook = REPO / "examples" / "notebooks" / "quickstart.ipynb"
    out = tmp_path / "executed.ipynb"
    done = subprocess.run(["jupyter", "nbconvert", "--to", "notebook", "--execute", "--output", str(out),
                           "--ExecutePreprocessor.timeout=60", str(notebook)],
                          env=dict(env, TROUPE_BUILD_DIR=str(BUILD)), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    text = out.read_text()
    assert '"15"' in text and "the actor raised a TypeError: True" in text and "'done'" in text
    assert "counter is now 15" in text  # the actor's print reached the notebook
