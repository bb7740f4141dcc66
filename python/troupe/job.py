"""Jobs: a driver script run on the cluster by a supervisor, as `ray job submit` does, so the
machine (or notebook) that submitted it may disconnect or crash and the job goes on. A training
job's coordinator (ElasticTrainer) runs in the job's driver; `ElasticTrainer.attach(name)` from
any driver shows its progress and can resize or stop it.

    troupe job submit train.py [--name NAME] [--max-restarts N] [-- ARGS...]
    troupe job list
    troupe job status NAME
    troupe job logs NAME [--follow]
    troupe job stop NAME

The supervisor is a detached actor named "job:NAME" (0 CPUs). It keeps the script (sent with
the submission, so any node can run it) and the driver's output in a private directory under its
node's run directory (`troupe stop` removes it); the output is capped like an actor's log: over
TROUPE_LOG_MAX_BYTES, driver.log is renamed to driver.log.1 and started anew. It runs
the driver with this cluster's address in TROUPE_ADDRESS (troupe.init() connects to it), and
starts it again, up to --max-restarts times, if it dies by a signal or a non-zero exit. A
script that should continue where a dead incarnation stopped creates its ElasticTrainer with
detached=True and a name, and trains with fit(until=N): the new incarnation adopts the group.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any, cast

from . import _api
from .exceptions import AlreadyExistsError, NotFoundError, TroupeError

__all__ = ["submit", "status", "logs", "stop", "list_jobs", "JobError"]

MAX_SCRIPT_BYTES = 16 << 20
MAX_LOG_READ = 1 << 20
STOP_GRACE_S = 5.0
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class JobError(TroupeError):
    """A job request that cannot be carried out (unknown job, bad name, duplicate name)."""


def _die_with_parent():
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@_api.remote(num_cpus=0)
class _JobSupervisor:
    """Runs one job's driver; its methods answer status, logs and stop."""

    def __init__(self, name, script_name, script, args, max_restarts):
        self.name, self.args, self.max_restarts = name, list(args), int(max_restarts)
        self.dir = self._make_dir(name)
        self.script = os.path.join(self.dir, os.path.basename(script_name) or "job.py")
        fd = os.open(self.script, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(script)
        self.log = os.path.join(self.dir, "driver.log")
        self.log_fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND, 0o600)
        # Offsets count every byte the driver wrote; the files hold the last ones: driver.log.1
        # from rotated_at (None: no such file), driver.log from current_at, to written.
        self.max_log = _log_cap()
        self.written, self.current_at, self.rotated_at = 0, 0, None
        self.log_lock = threading.Lock()
        self.state, self.restarts, self.returncode, self.message = "PENDING", 0, None, ""
        self.started, self.ended, self.proc = time.time(), None, None
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        threading.Thread(target=self._supervise, daemon=True, name="job-driver").start()

    @staticmethod
    def _make_dir(name):
        """A 0700 directory for the job under $TROUPE_JOBS_DIR (the node's run directory's jobs/,
        which `troupe stop` removes), or in the temporary directory on an agent that names none."""
        root = os.environ.get("TROUPE_JOBS_DIR")
        if root:
            try:
                os.mkdir(root, 0o700)
            except FileExistsError:
                pass
            st = os.lstat(root)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise JobError(f"{root} is not a private directory of this user: remove it")
        return tempfile.mkdtemp(prefix=f"troupe-job-{name}-", dir=root or None)  # 0700

    def _append(self, data):
        """Appends to the driver's log within its cap: a log that would pass it is renamed to
        driver.log.1 (replacing the older one) and started anew."""
        with self.log_lock:
            while data:
                if self.written - self.current_at >= self.max_log:
                    os.replace(self.log, self.log + ".1")
                    os.close(self.log_fd)
                    self.log_fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND,
                                          0o600)
                    self.rotated_at, self.current_at = self.current_at, self.written
                piece = data[:self.max_log - (self.written - self.current_at)]
                try:
                    n = os.write(self.log_fd, piece)
                except OSError:
                    return  # a full disk: the output is dropped rather than the driver held
                self.written += n
                data = data[n:]

    def _pump(self, pipe):
        """Copies the driver's output (a pipe: a flood waits while its bytes are written) to its log."""
        with pipe:
            while True:
                data = os.read(pipe.fileno(), 1 << 16)
                if not data:
                    return
                self._append(data)

    def _read(self, offset, limit):
        """Up to `limit` bytes of the output from `offset` (moved up to the oldest byte kept)."""
        with self.log_lock:
            oldest = self.current_at if self.rotated_at is None else self.rotated_at
            offset = max(oldest, min(int(offset), self.written))
            parts, start = [], offset
            for path, begin, end in ((self.log + ".1", self.rotated_at, self.current_at),
                                     (self.log, self.current_at, self.written)):
                if begin is None or start >= end or limit <= 0:
                    continue
                with open(path, "rb") as f:
                    f.seek(start - begin)
                    data = f.read(min(limit, end - start))
                parts.append(data)
                start += len(data)
                limit -= len(data)
            return b"".join(parts), start

    def _spawn(self):
        env = dict(os.environ, TROUPE_JOB_NAME=self.name, PYTHONUNBUFFERED="1")
        env.pop("TROUPE_ACTOR_ID", None)
        env.pop("TROUPE_JOBS_DIR", None)
        self._append(f"--- troupe job {self.name}: driver incarnation {self.restarts} starts at "
                     f"{time.strftime('%H:%M:%S')}\n".encode())
        proc = subprocess.Popen([sys.executable, self.script, *self.args], cwd=self.dir, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, preexec_fn=_die_with_parent)
        proc.pump = threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True, name="job-output")
        proc.pump.start()
        return proc

    def _supervise(self):
        while True:
            with self.lock:
                if self.stopping.is_set():
                    break
                self.proc = self._spawn()
                self.state = "RUNNING"
            rc = self.proc.wait()
            self.proc.pump.join(timeout=5)  # its last lines (a process it left may hold the pipe)
            with self.lock:
                self.returncode = rc
                if self.stopping.is_set():
                    self.state, self.message = "STOPPED", "stopped by `troupe job stop`"
                elif rc == 0:
                    self.state, self.message = "SUCCEEDED", ""
                elif self.restarts < self.max_restarts:
                    self.restarts += 1
                    self.state = "RESTARTING"
                    self._note(f"driver ended with {self._how(rc)}; restarting it "
                               f"({self.restarts} of {self.max_restarts})")
                    continue
                else:
                    self.state = "FAILED"
                    self.message = f"driver ended with {self._how(rc)}; last output: {self._tail(600)}"
                self.ended = time.time()
                return
        with self.lock:
            self.state, self.ended = "STOPPED", time.time()

    @staticmethod
    def _how(rc):
        return f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"

    def _note(self, text):
        self._append(f"--- troupe job {self.name}: {text}\n".encode())

    def _tail(self, n):
        return self._read(self.written - n, n)[0].decode(errors="replace").strip()

    def status(self):
        with self.lock:
            return {"name": self.name, "state": self.state, "restarts": self.restarts,
                    "max_restarts": self.max_restarts, "returncode": self.returncode, "message": self.message,
                    "pid": self.proc.pid if self.proc and self.state == "RUNNING" else None,
                    "node_ip": os.environ.get("TROUPE_NODE_IP", ""), "started": self.started, "ended": self.ended,
                    "log_bytes": self.written}

    def logs(self, offset=0, limit=MAX_LOG_READ):
        """Up to `limit` bytes of the driver's output from `offset`; (bytes, next offset). Bytes
        older than the log's cap are gone: an offset before them reads from the oldest kept."""
        return self._read(offset, max(0, min(int(limit), MAX_LOG_READ)))

    def stop(self):
        """SIGTERM to the driver's process group, SIGKILL after a grace period."""
        with self.lock:
            self.stopping.set()
            proc = self.proc
        if proc is None or proc.poll() is not None:
            return self.status()
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 5
        while self.status()["state"] not in ("STOPPED", "SUCCEEDED", "FAILED") and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.status()

    def remove(self):
        shutil.rmtree(self.dir, ignore_errors=True)


def _log_cap():
    try:
        cap = int(os.environ.get("TROUPE_LOG_MAX_BYTES", ""))
    except ValueError:
        cap = 0
    return cap if cap > 0 else 256 << 20


def _handle(name):
    try:
        return _api.get_actor(f"job:{name}", namespace=_api.DEFAULT_NAMESPACE)
    except NotFoundError:
        raise JobError(f"no job named {name!r} (see `troupe job list`)") from None


def submit(script: str | os.PathLike[str], args: Sequence[str] = (), name: str | None = None,
           max_restarts: int = 0) -> str:
    """Starts `script` (a path on this machine) as a job on the cluster; returns its name."""
    name = name or f"{os.path.splitext(os.path.basename(script))[0]}-{os.urandom(3).hex()}"
    if not _NAME.match(name):
        raise JobError(f"job name {name!r}: use 1-64 characters of [A-Za-z0-9_.-]")
    if max_restarts < 0:
        raise JobError(f"max_restarts must be >= 0, not {max_restarts}")
    size = os.path.getsize(script)
    if size > MAX_SCRIPT_BYTES:
        raise JobError(f"{script} is {size} bytes; a job script is at most {MAX_SCRIPT_BYTES} bytes")
    with open(script, "rb") as f:
        code = f.read()
    try:
        handle = cast(Any, _JobSupervisor).options(name=f"job:{name}", namespace=_api.DEFAULT_NAMESPACE, lifetime="detached").remote(
            name, os.path.basename(script), code, list(args), max_restarts)
    except AlreadyExistsError:
        raise JobError(f"a job named {name!r} exists already; pick another --name") from None
    _api.get(handle.status.remote(), timeout=60)  # the supervisor is up and the driver started
    return name


def status(name: str) -> dict[str, Any]:
    """The job's state (RUNNING, SUCCEEDED, FAILED, STOPPED, ...), restarts, return code, pid and
    output size."""
    return _api.get(_handle(name).status.remote(), timeout=30)


def logs(name: str, offset: int = 0) -> tuple[bytes, int]:
    """(bytes, next offset) of the job's driver output."""
    return _api.get(_handle(name).logs.remote(offset), timeout=30)


def stop(name: str) -> dict[str, Any]:
    """Stops the job's driver (SIGTERM, SIGKILL after a grace period); returns its status."""
    return _api.get(_handle(name).stop.remote(), timeout=30)


def list_jobs() -> list[dict[str, Any]]:
    """The status of every job of the cluster that is not gone."""
    out = []
    for a in _api.actors():
        if (a.get("name") or "").startswith("job:") and a["state"] != "DEAD":
            try:
                out.append(status(a["name"][4:]))
            except Exception as e:  # a supervisor that is restarting or gone: say so, do not fail the list
                out.append({"name": a["name"][4:], "state": f"UNKNOWN ({e})"})
    return out


def _main(argv=None):
    p = argparse.ArgumentParser(prog="troupe job", description="Run driver scripts on the cluster",
                                epilog="submit SCRIPT [options] -- ARGS: ARGS go to the script")
    p.add_argument("--address", default=os.environ.get("TROUPE_ADDRESS", "auto"),
                   help="controller HOST:PORT (default: this machine's cluster)")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("submit", help="run a script on the cluster")
    s.add_argument("script")
    s.add_argument("--name")
    s.add_argument("--max-restarts", type=int, default=0, help="start the driver again this often if it dies")
    s.add_argument("--wait", action="store_true", help="follow its output until it ends; exit with its outcome")
    sub.add_parser("list", help="the jobs")
    for cmd in ("status", "stop"):
        sub.add_parser(cmd).add_argument("name")
    lg = sub.add_parser("logs", help="the driver's output")
    lg.add_argument("name")
    lg.add_argument("--follow", "-f", action="store_true")
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = argv[argv.index("--") + 1:] if "--" in argv else []  # the script's own arguments
    argv = argv[:argv.index("--")] if "--" in argv else argv
    a = p.parse_args(argv)
    try:
        _api.init(address=a.address, log_to_driver=False)
    except (ConnectionError, ValueError, _api.TroupeError) as e:
        print(f"troupe job: {e}", file=sys.stderr)
        return 1
    try:
        if a.cmd == "submit":
            if not os.path.isfile(a.script):
                print(f"troupe job: no such script: {a.script}", file=sys.stderr)
                return 2
            name = submit(a.script, script_args, a.name, a.max_restarts)
            print(f"job {name} submitted: `troupe job logs {name} --follow` shows its output, "
                  f"`troupe job stop {name}` stops it", flush=True)
            return _follow(name) if a.wait else 0
        if a.cmd == "list":
            for j in list_jobs():
                print(f"{j['name']:24} {j['state']:10} restarts {j.get('restarts', '?')}")
            return 0
        if a.cmd == "status":
            j = status(a.name)
            print(f"{j['name']}: {j['state']}" + (f" ({j['message']})" if j["message"] else "")
                  + f", restarts {j['restarts']}/{j['max_restarts']}")
            return 0
        if a.cmd == "stop":
            print(f"{a.name}: {stop(a.name)['state']}")
            return 0
        if a.cmd == "logs":
            return _follow(a.name) if a.follow else _print_logs(a.name)
    except JobError as e:
        print(f"troupe job: {e}", file=sys.stderr)
        return 1
    except _api.TroupeError as e:  # the job's supervisor died (its node did) or cannot be reached
        name = getattr(a, "name", None)
        print(f"troupe job: {f'job {name!r}: ' if name else ''}its supervisor cannot answer: {e}", file=sys.stderr)
        return 1
    finally:
        _api.shutdown()
    return 2


def _print_logs(name, offset=0):
    while True:
        data, offset = logs(name, offset)
        sys.stdout.buffer.write(data)
        if len(data) < MAX_LOG_READ:
            sys.stdout.flush()
            return 0


def _follow(name):
    offset = 0
    while True:
        data, offset = logs(name, offset)
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        if not data:
            j = status(name)
            if j["state"] in ("SUCCEEDED", "FAILED", "STOPPED"):
                data, offset = logs(name, offset)
                sys.stdout.buffer.write(data)
                sys.stdout.flush()
                print(f"--- job {name}: {j['state']}" + (f" ({j['message']})" if j["message"] else ""))
                return 0 if j["state"] == "SUCCEEDED" else 1
            time.sleep(0.25)


if __name__ == "__main__":
    sys.exit(_main())
