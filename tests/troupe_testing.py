"""Helpers for Troupe's end-to-end tests: they drive the real `troupe` CLI, real daemons and a
real redis-server on 127.0.0.1, each test in its own TROUPE_TEMP_DIR. (A module of its own,
not conftest.py: several test folders have a conftest.py, and only one can be imported by that
name.)"""
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUILD = Path(os.environ.get("TROUPE_BUILD_DIR", REPO / "build")).resolve()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def eventually(cond, timeout, what):
    """Waits for cond() with a deadline (short back-off between checks); returns its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def processes_under(root):
    """Live (non-zombie) processes whose command line or working directory is under root."""
    found = []
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            stat = (pid_dir / "stat").read_text()
            if stat[stat.rfind(")") + 2] in "ZX":
                continue
            cmd = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(pid_dir / "cwd")
        except (OSError, IndexError):
            continue
        if str(root) in cmd or cwd.startswith(str(root)):
            found.append((int(pid_dir.name), cmd))
    return found


class Troupe:
    """Runs the CLI against one private run root."""

    def __init__(self, root):
        self.root = root
        self.env = dict(os.environ, TROUPE_TEMP_DIR=str(root))
        self.env.pop("TROUPE_TOKEN", None)

    def run(self, *args, timeout=30, check=True):
        started = time.monotonic()
        p = subprocess.run([str(BUILD / "troupe"), *args], env=self.env, capture_output=True, text=True,
                           timeout=timeout)
        p.seconds = time.monotonic() - started
        if check and p.returncode != 0:
            raise AssertionError(f"troupe {' '.join(args)} failed ({p.returncode}): {p.stderr}")
        return p

    def status(self, *args):
        return json.loads(self.run("status", "--json", *args).stdout)

    def run_dir(self):
        return (self.root / "latest").resolve()

    def pid_of(self, name):
        return int((self.run_dir() / "pids" / f"{name}.pid").read_text())


def start_redis(data_dir, password=None):
    """A real redis-server on a free loopback port, returned once it accepts connections."""
    port = free_port()
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(data_dir)]
    if password:
        args += ["--requirepass", password]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)

    def listening():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    eventually(listening, 10, "redis-server to listen")
    return proc, port


PYTHON_PACKAGE = BUILD / "python"


def import_troupe():
    """The troupe package from the build tree (make build puts it in build/python)."""
    import sys

    if str(PYTHON_PACKAGE) not in sys.path:
        sys.path.insert(0, str(PYTHON_PACKAGE))
    import troupe

    return troupe


def run_driver(code, env=None, timeout=60):
    """Runs a driver script in a fresh /usr/bin/python3 with the build's troupe package."""
    full_env = dict(os.environ, PYTHONPATH=str(PYTHON_PACKAGE))
    full_env.update(env or {})
    return subprocess.run(["/usr/bin/python3", "-c", code], env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def one_line_error(p):
    """The CLI failed with exactly one line, `troupe: error: ...`; returns it."""
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("troupe: error:"), p.stderr
    return lines[0]


def local_cluster(**init_kwargs):
    """troupe.init(**init_kwargs) on this machine (log_to_driver on, as a user's driver has it);
    yields the run root; checks that shutdown() leaves no process behind."""
    troupe = import_troupe()
    troupe.init(**init_kwargs)
    root = troupe._session.current.run_root
    yield root
    troupe.shutdown()
    assert processes_under(root) == [], "shutdown() left processes behind"


def cluster_fixture(**init_kwargs):
    """A module-scoped, autouse fixture: one embedded cluster (troupe.init(**init_kwargs)) shared
    by every test of the module. Use as `cluster = cluster_fixture(num_cpus=2)`."""

    @pytest.fixture(scope="module", autouse=True)
    def cluster():
        troupe = import_troupe()
        troupe.init(**init_kwargs)
        yield
        troupe.shutdown()

    return cluster
