"""A Python worker process: hosts one Python actor (or a pool's task worker) for a node agent.

Started as `python3 -m troupe._worker` with the same flags as troupe-worker, or forked by the node's
zygote (_zygote.py), which has imported this module already and calls main() with those flags. The actor's class,
arguments, keyword arguments and context (job, namespace, runtime_env, concurrency) arrive
cloudpickled in --args-file.

How calls run:
- inline (the default): on the RPC loop's thread, one at a time in arrival order;
- threaded (max_concurrency > 1): on a pool of that many threads;
- async (the class has `async def` methods): as tasks on one asyncio loop, at most
  max_concurrency (default 1000) at once; plain methods run on that loop too.
An actor that calls other actors or tasks connects to the cluster on first use (troupe.get works
inside methods). Exit codes 75 and 76 tell the controller not to restart the actor: it ended
itself (exit_actor, a graceful terminate), or its constructor raised.
"""
import argparse
import asyncio
import contextlib
import atexit
import collections
import inspect
import os
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

from troupe import _serialization
from troupe.exceptions import ActorExit

EXIT_ACTOR_ENDED = 75  # runtime/rpc/include/troupe/runtime/actor.h kExitActorEnded
EXIT_INIT_FAILED = 76  # kExitInitFailed

TERMINATE_METHODS = ("__troupe_terminate__", "__ray_terminate__")


def _end(code):
    """Leaves the process now: atexit handlers run, output is flushed, nothing restarts it."""
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve_context(context):
    from . import _session

    env = (context.get("runtime_env") or {})
    os.environ.update({str(k): str(v) for k, v in (env.get("env_vars") or {}).items()})
    if env.get("working_dir"):
        os.chdir(env["working_dir"])
        sys.path.insert(0, env["working_dir"])
    for name, digest, ref in env.get("py_modules") or ():
        sys.path.insert(0, _unpack_module(name, digest, ref))
    _session._worker_context.update(context)


def _unpack_module(name, digest, ref):
    """A py_modules entry unpacked once per node (the worker's TMPDIR, which its node agent makes
    per run); returns the directory that goes on sys.path."""
    import hashlib
    import io
    import tempfile
    import zipfile

    from . import _refs

    where = os.path.join(tempfile.gettempdir(), f"troupe-py-modules-{digest}")
    if os.path.isdir(where):
        return where
    data = _refs.get(ref)
    if hashlib.sha256(data).hexdigest()[:32] != digest:
        raise RuntimeError(f"runtime_env py_modules {name!r}: the packed copy does not match its digest")
    part = tempfile.mkdtemp(prefix=f"troupe-py-modules-{digest}.", dir=tempfile.gettempdir())
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for member in z.namelist():
            target = os.path.realpath(os.path.join(part, member))
            if not target.startswith(os.path.realpath(part) + os.sep):
                raise RuntimeError(f"runtime_env py_modules {name!r}: {member!r} would land outside its directory")
        z.extractall(part)
    try:
        os.rename(part, where)
    except OSError:  # another worker of this node unpacked it first
        import shutil

        shutil.rmtree(part, ignore_errors=True)
    return where


def main(argv=None):
    """Serves the actor named by argv (default: sys.argv[1:]); the exit code."""
    from troupe import _core, _serialization

    _core.die_with_parent()  # never outlive the node agent
    parser = argparse.ArgumentParser(prog="troupe._worker")
    parser.add_argument("--actor-id", required=True)
    parser.add_argument("--type", required=True)
    parser.add_argument("--incarnation", type=int, required=True)
    parser.add_argument("--controller", required=True)
    parser.add_argument("--node-ip-address", default="127.0.0.1")
    parser.add_argument("--args-file", required=True)
    parser.add_argument("--parent-pid", type=int, default=0)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    if args.parent_pid and os.getppid() != args.parent_pid:
        return 1  # the node agent died before die_with_parent took effect
    with open(args.args_file, "rb") as f:
        init = f.read()
    os.unlink(args.args_file)
    os.environ["TROUPE_ACTOR_ID"] = args.actor_id
    os.environ["TROUPE_ADDRESS"] = args.controller  # troupe.init() here, or in a process it starts
    context, created = _serialization.loads(init)
    try:
        _serve_context(context)
        cls, cargs, ckwargs = _serialization.loads(created)
        instance = cls(*cargs, **ckwargs)
    except BaseException:
        print(f"troupe-worker: creating {args.type[3:]} raised:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        return EXIT_INIT_FAILED

    # Node agents start workers with PYTHONUNBUFFERED=1, so output reaches the log files as it is
    # written; flushing after every call would only cost time (two calls per actor call).
    buffered = not os.environ.get("PYTHONUNBUFFERED")
    is_async = any(inspect.iscoroutinefunction(m) for _, m in inspect.getmembers(cls, inspect.isfunction))
    concurrency = int(context.get("max_concurrency") or (1000 if is_async else 1))

    def execute(method, payload):
        """Runs one call; the reply bytes (the value, or the exception with its traceback)."""
        try:
            if method in TERMINATE_METHODS:
                raise ActorExit()
            result, caller_host = _invoke(instance, method, payload)
            return _serialization.dump_reply(result, caller_host)
        except ActorExit:
            _end(EXIT_ACTOR_ENDED)
        except BaseException as exc:  # the caller re-raises it
            _core.count_call_error()
            return _serialization.dump_exception(exc, traceback.format_exc())
        finally:
            if buffered:
                sys.stdout.flush()
                sys.stderr.flush()

    if is_async:
        dispatch = _async_dispatch(instance, concurrency, buffered)
    elif context.get("task_worker"):
        dispatch = _Drainer(execute, concurrency).dispatch
    elif concurrency > 1:
        pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="troupe-call")

        def dispatch(method, payload, reply):
            pool.submit(lambda: reply(execute(method, payload)))
    else:
        dispatch = execute
    _core.serve_actor(args.actor_id, args.incarnation, args.controller, args.node_ip_address,
                      os.environ["TROUPE_TOKEN"], dispatch, concurrent=dispatch is not execute, type=args.type)
    return 0


class _Drainer:
    """Runs a task worker's calls in arrival order on one thread at a time (cheap for bursts of
    small tasks), except that the queue moves to a new thread when the running task blocks in
    get() (so a nested task queued behind it still runs, as Ray lends a blocked task's CPU) or has
    run for HANDOVER_S while calls wait (so a long task does not hold up short ones sent here by
    a submitter that cannot see it is busy). A watchdog thread looks for the second case."""

    HANDOVER_S = 0.01

    def __init__(self, execute, threads):
        from . import _refs

        self.execute = execute
        self.pending = collections.deque()
        self.lock = threading.Lock()
        self.backlog = threading.Condition(self.lock)  # calls wait behind a busy runner
        self.runner = None  # the thread draining the queue now
        self.started = 0.0  # when the runner's current call started
        self.starting = False
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="troupe-task")
        threading.Thread(target=self.watch, name="troupe-task-watchdog", daemon=True).start()
        _refs._blocking_hook = self.blocking

    def dispatch(self, method, payload, reply):
        with self.lock:
            self.pending.append((method, payload, reply))
            if self.starting:
                return
            if self.runner is not None:
                self.backlog.notify()
                return
            self.starting = True
        self.pool.submit(self.drain)

    def drain(self):
        me = threading.current_thread()
        with self.lock:
            self.starting = False
            if self.runner is not None:
                return
            self.runner = me
        execute, pending, lock, clock = self.execute, self.pending, self.lock, time.monotonic
        while True:
            with lock:
                if self.runner is not me:
                    return  # it blocked or ran long meanwhile: the queue has a new runner
                if not pending:
                    self.runner = None
                    return
                method, payload, reply = pending.popleft()
                self.started = clock()
                if pending:  # calls queued while no runner was set woke no watchdog
                    self.backlog.notify()
            reply(execute(method, payload))

    def hand_over(self):
        """Gives the queue to a new runner (caller holds the lock); False if none is needed."""
        self.runner = None
        if not self.pending or self.starting:
            return False
        self.starting = True
        return True

    def blocking(self):
        """Called by get()/wait() before they wait: a runner gives the queue up."""
        with self.lock:
            if self.runner is not threading.current_thread() or not self.hand_over():
                return
        self.pool.submit(self.drain)

    def watch(self):
        while True:
            with self.lock:
                while not (self.pending and self.runner is not None):
                    self.backlog.wait()
                runner, started = self.runner, self.started
            time.sleep(self.HANDOVER_S)
            with self.lock:
                stuck = self.runner is runner and self.started == started and self.pending
                if not stuck or not self.hand_over():
                    continue
            self.pool.submit(self.drain)


def _invoke(instance, method, payload):
    """Decodes a call and runs the method: (its result, the caller's host id or None)."""
    call_args, call_kwargs, *meta = _serialization.loads(payload)
    call_args, call_kwargs = _resolve_args(call_args, call_kwargs)
    if len(meta) > 1:  # .options(name=...): the process's title while it runs, as Ray's ray::<name>
        with _titled(f"troupe::{meta[1]}"):
            return getattr(instance, method)(*call_args, **call_kwargs), meta[0]
    return getattr(instance, method)(*call_args, **call_kwargs), (meta[0] if meta else None)


@contextlib.contextmanager
def _titled(title):
    """Sets the process's name (/proc/<pid>/comm: what ps and top show; 15 bytes) meanwhile."""
    try:
        with open("/proc/self/comm") as f:
            before = f.read().strip()
        with open("/proc/self/comm", "w") as f:
            f.write(title[:15])
    except OSError:
        yield
        return
    try:
        yield
    finally:
        try:
            with open("/proc/self/comm", "w") as f:
                f.write(before)
        except OSError:
            pass


def _resolve_args(call_args, call_kwargs):
    """Top-level ObjectRef arguments become their values (put() objects are mapped here)."""
    from . import _refs

    ref = _refs.ObjectRef
    if any(isinstance(a, ref) for a in call_args):
        call_args = tuple(_refs.get(a) if isinstance(a, ref) else a for a in call_args)
    if any(isinstance(v, ref) for v in call_kwargs.values()):
        call_kwargs = {k: _refs.get(v) if isinstance(v, ref) else v for k, v in call_kwargs.items()}
    return call_args, call_kwargs


def _async_dispatch(instance, concurrency, buffered):
    """Calls of an async actor run as tasks of one asyncio loop in its own thread."""
    from troupe import _core, _serialization

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="troupe-asyncio", daemon=True).start()
    limit = asyncio.Semaphore(concurrency, **({"loop": loop} if sys.version_info < (3, 10) else {}))

    async def run(method, payload, reply):
        async with limit:
            try:
                if method in TERMINATE_METHODS:
                    raise ActorExit()
                result, caller_host = _invoke(instance, method, payload)
                if inspect.isawaitable(result):
                    result = await result
                data = _serialization.dump_reply(result, caller_host)
            except ActorExit:
                _end(EXIT_ACTOR_ENDED)
            except BaseException as exc:
                _core.count_call_error()
                data = _serialization.dump_exception(exc, traceback.format_exc())
            if buffered:
                sys.stdout.flush()
                sys.stderr.flush()
        reply(data)

    def dispatch(method, payload, reply):
        loop.call_soon_threadsafe(lambda: loop.create_task(run(method, payload, reply)))

    return dispatch


if __name__ == "__main__":
    sys.exit(main())
