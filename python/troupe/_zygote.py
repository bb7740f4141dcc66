"""The node's Python fork server: a process that has imported troupe once and forks a new Python
worker on each request of its node agent, so a Python actor starts without paying for the
interpreter and the imports (services/python_zygote.h is the agent's side; docs/design/python.md,
"Python workers started by the zygote").

Started by the agent as `python3 -m troupe._zygote --log-dir DIR --parent-pid PID` with its end of a socketpair as
fd 3. Messages both ways are a 4-byte little-endian length and that many bytes:
- zygote -> agent, once: b"ready <pid>";
- agent -> zygote: b"\\0"-separated fields: output path, error path (may be empty), the number of
  worker arguments, the arguments (what follows `python3 -m troupe._worker`), then NAME=value
  environment entries. File descriptors ride with it (SCM_RIGHTS): the worker's start line and,
  when the agent reads the worker's output through pipes, the write ends of its stdout and stderr
  (which the worker takes instead of opening the paths);
- zygote -> agent: b"ok <pid of the middle process>", or b"error <why>".

Each worker is forked twice (zygote -> a short-lived middle process -> worker) so that when the
middle process exits at once, the worker is reparented to the node agent (a child subreaper),
which watches it, and learns its exit status, exactly as it does a worker it spawned itself. A
kill of the zygote therefore leaves its workers running. The middle process sends the worker's
pid (4 bytes, little-endian) to the agent on the start line and ends; the zygote answers at once
and forks the next one meanwhile. The worker waits for one byte on its start line before it does
anything: the agent sends it after it has recorded the pid, and closes the line instead when it
has given up on this fork (then the worker leaves without a trace). Then it waits for the middle
process to end (so that its parent is the agent) and becomes the worker.

The zygote serves one request at a time and starts no thread: forking a process with threads
copies locks that no thread will ever release. It checks that before each fork and exits when it
finds one (the agent restarts it).
"""
import array
import os
import select
import socket
import struct
import sys
import threading

# What a worker imports before it serves (troupe and its imports, the _core extension), loaded
# once here; each forked worker shares these pages with the zygote until it writes to them.
import troupe  # noqa: F401
from troupe import _core, _files, _serialization, _worker  # noqa: F401
from troupe.exceptions import InvalidArgumentError

CONTROL_FD = 3
MAX_MESSAGE = 1 << 20  # a request is a few hundred bytes; anything near this is not the agent's


def _send(sock, body):
    sock.sendall(struct.pack("<I", len(body)) + body)


def _receive(sock):
    """(body, [fds]) of the next request; None when the agent has gone."""
    header, fds = b"", []
    while len(header) < 4:
        data, ancdata, _, _ = sock.recvmsg(4 - len(header), socket.CMSG_SPACE(4 * 4))
        if not data:
            return None
        header += data
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received = array.array("i")
                received.frombytes(payload[:len(payload) - len(payload) % received.itemsize])
                fds.extend(received)
    (size,) = struct.unpack("<I", header)
    if size > MAX_MESSAGE:
        raise InvalidArgumentError(f"a request of {size} bytes (the limit is {MAX_MESSAGE})")
    body = b""
    while len(body) < size:
        data = sock.recv(size - len(body))
        if not data:
            return None
        body += data
    return body, fds


class _Request:
    """One worker to fork, decoded and checked."""

    def __init__(self, body, start_fd, log_fds=()):
        fields = [f.decode() for f in body.split(b"\0")]
        if len(fields) < 3 or not fields[2].isdigit():
            raise InvalidArgumentError("a request without its output paths and argument count")
        argc = int(fields[2])
        if len(fields) < 3 + argc:
            raise InvalidArgumentError(f"a request announcing {argc} arguments holds {len(fields) - 3}")
        self.output, self.error = fields[0], fields[1]
        self.argv = fields[3:3 + argc]
        self.env = {}
        for entry in fields[3 + argc:]:
            name, eq, value = entry.partition("=")
            if not name or not eq:
                raise InvalidArgumentError(f"an environment entry without '=': {entry[:40]!r}")
            self.env[name] = value
        if not self.output:
            raise InvalidArgumentError("a request without an output path")
        self.start_fd = start_fd
        self.log_fds = list(log_fds)  # [stdout, stderr] pipes, or empty: open the paths


def _read_at_start(name):
    """Variables the interpreter (or ld.so) reads when it starts, or troupe._core when it is loaded: a forked
    worker has the zygote's values, so they must be the ones the worker asks for."""
    return name.startswith("PYTHON") or name in ("TROUPE_TLS", "GLIBC_TUNABLES")


def _threads():
    return len(os.listdir("/proc/self/task"))


def _fork_worker(request):
    """Forks a middle process, which forks the worker, sends the worker's pid to the agent on the
    start line, and ends. Returns the middle's pid here, None in the worker."""
    middle = os.fork()
    if middle != 0:
        return middle
    worker = -1
    try:
        worker = os.fork()
        if worker == 0:
            return None
        os.write(request.start_fd, struct.pack("<i", worker))
    finally:
        if worker != 0:
            os._exit(0)  # the middle ends here: the worker is reparented to the agent


def _reap_middles():
    """The zygote's only children are middle processes, which end at once: reaped here, before
    each request, rather than waited for (the zygote answers the next request meanwhile)."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] != 0:
            pass
    except ChildProcessError:
        pass


def serve(control, log_dir):
    """Answers requests until the agent goes; in a forked worker, returns its request."""
    _send(control, f"ready {os.getpid()}".encode())
    while True:
        message = _receive(control)
        if message is None:
            return None
        _reap_middles()
        body, fds = message
        try:
            if len(fds) not in (1, 3):
                raise InvalidArgumentError(f"a request with {len(fds)} file descriptors (expected the start line, "
                                 f"and maybe stdout and stderr)")
            request = _Request(body, fds[0], fds[1:])
            for path in (request.output, request.error):
                if path and os.path.dirname(os.path.realpath(path)) != log_dir:
                    raise InvalidArgumentError(f"an output path outside {log_dir}: {path}")
            for name, value in request.env.items():
                if _read_at_start(name) and os.environ.get(name) != value:
                    raise InvalidArgumentError(f"the worker needs {name}={value!r}, which this zygote's interpreter and "
                                     f"imports did not start with ({os.environ.get(name)!r})")
            if threading.active_count() != 1 or _threads() != 1:
                # Not safe to fork any more, nor to go on: the agent restarts a fresh zygote.
                _send(control, f"error the zygote has {_threads()} threads; it cannot fork".encode())
                sys.exit(1)
            sys.stdout.flush()
            sys.stderr.flush()
            middle = _fork_worker(request)
        except (OSError, ValueError, UnicodeDecodeError) as e:
            for fd in fds:
                os.close(fd)
            _send(control, f"error {e}".encode())
            continue
        if middle is None:
            return request
        for fd in fds:
            os.close(fd)
        _send(control, f"ok {middle}".encode())


def _wait_for_adoption(agent):
    """Returns once the middle process has ended, so this worker's parent is the agent (a child
    subreaper) or, if the agent has gone, whoever adopted it (main() then sees that and leaves)."""
    parent = os.getppid()
    if parent == agent:
        return
    try:
        middle = os.pidfd_open(parent)
    except OSError:
        return  # it has ended already
    try:
        poller = select.poll()
        poller.register(middle, select.POLLIN)
        poller.poll(10_000)  # readable once it has ended (and its children were reparented)
    finally:
        os.close(middle)


def _become_worker(control, request):
    """In the forked worker: waits for the agent's go, then takes the worker's files and
    environment and runs it as `python3 -m troupe._worker ARGS` would."""
    control.close()
    go = b""
    try:
        go = os.read(request.start_fd, 1)
    except OSError:
        pass
    os.close(request.start_fd)
    if go != b"1":
        os._exit(0)  # the agent gave up on this fork: nothing was started
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if request.log_fds:
        for fd, target in zip(request.log_fds, (1, 2)):
            os.dup2(fd, target)
            os.close(fd)
    else:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        # Not a plain open: a FIFO an actor put at its log's path would hold this worker forever.
        out = _files.open_regular(request.output, flags)
        os.dup2(out, 1)
        os.close(out)
        if request.error:
            err = _files.open_regular(request.error, flags)
            os.dup2(err, 2)
            os.close(err)
        else:
            os.dup2(1, 2)
    _wait_for_adoption(_agent_pid)
    os.environ.update(request.env)
    # What the worker can read of where it came from; tests check it to see this path was taken.
    os.environ["TROUPE_WORKER_FORKED_BY"] = str(_zygote_pid)
    sys.argv = [_worker.__file__] + request.argv
    return _worker.main(request.argv)


_zygote_pid = 0
_agent_pid = 0


def main():
    global _zygote_pid, _agent_pid
    import argparse

    parser = argparse.ArgumentParser(prog="troupe._zygote")
    parser.add_argument("--log-dir", required=True)  # where every worker's output goes, and nowhere else
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args()
    _core.die_with_parent()  # never outlive the node agent
    if os.getppid() != args.parent_pid:
        return 1  # the agent died before die_with_parent took effect
    _zygote_pid, _agent_pid = os.getpid(), args.parent_pid
    control = socket.socket(fileno=CONTROL_FD)
    os.set_inheritable(CONTROL_FD, False)
    import gc
    gc.freeze()  # what is imported now stays out of the workers' collections: fewer copied pages
    request = serve(control, os.path.realpath(args.log_dir))
    if request is None:
        return 0
    return _become_worker(control, request)


if __name__ == "__main__":
    sys.exit(main())
