"""Failures, as Ray's test_actor_failures.py exercises them: calls keep their order across a
restart, a constructor that raises ends the actor, Ctrl-C interrupts a get(), and init()'s
keywords are honoured or refused clearly."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from troupe_testing import PYTHON_PACKAGE, cluster_fixture, eventually, import_troupe, run_driver

troupe = import_troupe()

pytestmark = pytest.mark.timeout(150)


cluster = cluster_fixture(num_cpus=2)


@troupe.remote(max_restarts=-1, max_task_retries=-1)
class Journal:
    """Appends each call's number to a file that outlives its incarnations."""

    def __init__(self, path):
        self.path = path

    def record(self, i, hold_first=None):
        if hold_first and not os.path.exists(hold_first):
            open(hold_first, "w").write(str(os.getpid()))
            time.sleep(60)  # killed while it sleeps
        with open(self.path, "a") as f:
            f.write(f"{i}\n")
        return i


def test_calls_keep_their_order_across_a_restart(tmp_path):
    journal, marker = tmp_path / "journal", tmp_path / "started"
    j = Journal.remote(str(journal))
    refs = [j.record.remote(0, str(marker))] + [j.record.remote(i) for i in range(1, 100)]
    eventually(lambda: marker.exists() and marker.read_text(), 60, "the first call to start")
    os.kill(int(marker.read_text()), signal.SIGKILL)
    assert troupe.get(refs, timeout=90) == list(range(100))
    assert journal.read_text().split() == [str(i) for i in range(100)]  # retried in the order sent


@troupe.remote(max_restarts=-1)
class BadInit:
    def __init__(self):
        raise RuntimeError("no config file")

    def ping(self):
        return "never"


def test_a_constructor_that_raises_ends_the_actor_with_its_error():
    b = BadInit.remote()
    with pytest.raises(troupe.ActorDiedError, match="constructor raised.*no config file"):
        troupe.get(b.ping.remote(), timeout=60)
    info = troupe._api.runtime().actor_info(b.actor_id)
    assert info["state"] == "DEAD" and info["restarts"] == 0


def test_ctrl_c_interrupts_a_get_waiting_on_a_pending_actor():
    code = (
        "import troupe, sys\n"
        "troupe.init(num_cpus=1)\n"
        "@troupe.remote(num_cpus=1)\n"
        "class A:\n"
        "    def f(self): return 1\n"
        "a, b = A.remote(), A.remote()\n"
        "troupe.get(a.f.remote())\n"
        "try:\n"
        "    print('waiting', flush=True)\n"
        "    troupe.get(b.f.remote())\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
        "    sys.exit(3)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(PYTHON_PACKAGE))
    p = subprocess.Popen([sys.executable if sys.executable.startswith("/usr/bin") else "/usr/bin/python3", "-c", code],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "waiting"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 3 and "interrupted" in out, err


def test_init_refuses_what_it_cannot_honour():
    with pytest.raises(TypeError, match="does not support \\['_system_config'\\]"):
        troupe.init(_system_config={})
    with pytest.raises(ValueError, match="at least 8 MiB"):
        troupe.init(object_store_memory=10)
    with pytest.raises(ValueError, match="runtime_env keys \\['pip'\\]"):
        troupe.init(runtime_env={"pip": ["requests"]})
    with pytest.raises(ValueError, match="working_dir"):
        troupe.init(runtime_env={"working_dir": "s3://bucket/code.zip"})
    with pytest.raises(ValueError, match="namespace"):
        troupe.init(namespace="a/b")
    with pytest.raises(TypeError, match="namespace must be a string, not 123"):  # Ray's TypeError
        troupe.init(namespace=123)


def test_remote_refuses_an_async_function_at_decoration():
    async def fetch():
        return 1

    for decorate in (troupe.remote, troupe.remote(num_cpus=1)):
        with pytest.raises(ValueError, match="cannot make a task of the async function .*fetch"):
            decorate(fetch)


def test_runtime_env_reaches_actors_and_tasks(tmp_path):
    (tmp_path / "helper_mod.py").write_text("VALUE = 'from working_dir'\n")
    (tmp_path / "top_mod.py").write_text("NAME = 'imported at the top'\n")
    code = (
        "import troupe, os, json, sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "import top_mod\n"  # the class refers to it: the worker must find it to unpickle the class
        "@troupe.remote\n"
        "class Top:\n"
        "    def name(self):\n"
        "        return top_mod.NAME\n"
        f"troupe.init(num_cpus=1, runtime_env={{'env_vars': {{'MY_FLAG': 'on'}}, 'working_dir': {str(tmp_path)!r}}})\n"
        "@troupe.remote\n"
        "class Probe:\n"
        "    def look(self):\n"
        "        import helper_mod\n"
        "        return os.environ.get('MY_FLAG'), helper_mod.VALUE, os.getcwd()\n"
        "@troupe.remote\n"
        "def task():\n"
        "    return os.environ.get('MY_FLAG')\n"
        "print(json.dumps([troupe.get(Probe.remote().look.remote()), troupe.get(task.remote()),\n"
        "                  troupe.get(Top.remote().name.remote())]))\n"
    )
    p = run_driver(code, timeout=90)
    assert p.returncode == 0, p.stderr
    (flag, value, cwd), task_flag, top = json.loads(p.stdout.strip().splitlines()[-1])
    assert (flag, value, cwd, task_flag, top) == ("on", "from working_dir", str(tmp_path), "on", "imported at the top")


def test_a_first_remote_before_init_initialises_as_rays_does():
    code = (
        "import troupe\n"
        "@troupe.remote\n"
        "def square(x):\n"
        "    return x * x\n"
        "print('RESULT', troupe.get(square.remote(7)), troupe.is_initialized())\n"
    )
    p = run_driver(code, timeout=90)
    assert p.returncode == 0, p.stderr
    assert "RESULT 49 True" in p.stdout
    assert "init() was not called" in p.stderr  # said once, not silently


def test_py_modules_are_shipped_to_the_workers(tmp_path):
    """runtime_env py_modules: a local package and a .py file, which the workers' sys.path does not
    reach, travel through the object store and are imported from the copy unpacked on the node."""
    (tmp_path / "shipped_pkg").mkdir()
    (tmp_path / "shipped_pkg" / "__init__.py").write_text("from .inner import WORD\n")
    (tmp_path / "shipped_pkg" / "inner.py").write_text("WORD = 'packaged'\n")
    (tmp_path / "shipped_one.py").write_text("WORD = 'single file'\n")
    modules = [str(tmp_path / "shipped_pkg"), str(tmp_path / "shipped_one.py")]
    code = (
        "import troupe, json\n"
        f"troupe.init(num_cpus=1, runtime_env={{'py_modules': {modules!r}}})\n"
        "@troupe.remote\n"
        "class Probe:\n"
        "    def look(self):\n"
        "        import shipped_pkg, shipped_one\n"
        "        return shipped_pkg.WORD, shipped_one.WORD, shipped_pkg.__file__\n"
        "@troupe.remote\n"
        "def task():\n"
        "    import shipped_pkg\n"
        "    return shipped_pkg.WORD\n"
        "print(json.dumps([troupe.get(Probe.remote().look.remote()), troupe.get(task.remote())]))\n"
    )
    p = run_driver(code, timeout=90)
    assert p.returncode == 0, p.stderr
    (word, one, where), task_word = json.loads(p.stdout.strip().splitlines()[-1])
    assert (word, one, task_word) == ("packaged", "single file", "packaged")
    assert "troupe-py-modules-" in where and str(tmp_path) not in where  # the shipped copy, not the source
    with pytest.raises(ValueError, match="neither a directory nor a .py file"):
        troupe.init(runtime_env={"py_modules": [str(tmp_path / "missing")]})


def test_workers_import_from_the_drivers_pythonpath_after_troupe(tmp_path):
    (tmp_path / "user_mod.py").write_text("def hello():\n    return 'hello from PYTHONPATH'\n")
    code = (
        f"import sys; sys.path.insert(0, {str(PYTHON_PACKAGE)!r})\n"
        "import troupe\n"
        "troupe.init(num_cpus=1)\n"
        "@troupe.remote\n"
        "class A:\n"
        "    def f(self):\n"
        "        import user_mod\n"
        "        return user_mod.hello()\n"
        "print(troupe.get(A.remote().f.remote()))\n"
    )
    # The driver's PYTHONPATH names only the user's directory, not troupe's.
    p = run_driver(code, env={"PYTHONPATH": str(tmp_path)}, timeout=90)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "hello from PYTHONPATH"


@troupe.remote(max_task_retries=3)
class Flaky:
    def __init__(self):
        self.calls = 0

    @troupe.method(retry_exceptions=[ConnectionError])
    def fetch(self, fail_times):
        self.calls += 1
        if self.calls <= fail_times:
            raise ConnectionError(f"attempt {self.calls}")
        return self.calls

    def plain(self):
        self.calls += 1
        raise ConnectionError("not retried")


def test_actor_methods_retry_the_exceptions_they_name_within_max_task_retries():
    f = Flaky.remote()
    assert troupe.get(f.fetch.remote(2)) == 3
    with pytest.raises(ConnectionError, match="not retried"):
        troupe.get(f.plain.remote())
    g = Flaky.remote()
    with pytest.raises(ConnectionError, match="attempt 4"):  # the first try and three retries
        troupe.get(g.fetch.remote(10))
    with pytest.raises(TypeError, match="retry_exceptions"):
        f.fetch.options(retry_exceptions="yes")
