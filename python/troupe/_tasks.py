"""Remote functions (tasks): `@troupe.remote def f`, `f.remote(...)` -> ObjectRef.

Tasks run on pooled, reused task workers: Python actors of the job, found by name so that every
process of the job (the driver, its actors, tasks submitting tasks) shares them. A pool per
resource shape:
- CPU-only tasks share one pool of as many workers as the cluster has CPUs; a worker runs the
  tasks it is sent on a pool of threads, so a task blocked in get() on a nested task never holds
  up the one it waits for (Ray frees the blocked task's CPU for the same reason). The submitter
  sends each task to the worker with the fewest of its own tasks in flight.
- Tasks that need other resources (GPU, custom, memory) run one at a time on workers that hold
  that demand, as many as the cluster can hold at once.
- Tasks in a placement group bundle run on a worker in that bundle.
A task whose worker dies is sent again (to a restarted or another worker) up to max_retries
times (default 3, as Ray's), then raises WorkerCrashedError with the death reason; an exception
the task raises is retried only with retry_exceptions.
"""
from __future__ import annotations

import hashlib
import inspect
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import cloudpickle

from . import _checks, _objects, _refs, _remote, _serialization, _session
from .exceptions import ArgumentTypeError, InvalidArgumentError, TroupeError

OPTION_NAMES = {"num_cpus", "num_gpus", "memory", "resources", "num_returns", "max_retries", "retry_exceptions",
                "name", "placement_group", "placement_group_bundle_index", "scheduling_strategy", "runtime_env",
                "placement_group_capture_child_tasks"}
DEFAULT_MAX_RETRIES = 3
MAX_POOL = 32  # workers in the CPU pool, whatever the cluster's CPU count
THREADS_PER_WORKER = 256

_lock = threading.Lock()
_pools: dict[tuple[Any, ...], _Pool] = {}
_generation = 0  # bumped by reset(): pools cached on RemoteFunctions are stale


class RemoteFunction:
    """A function made remote with @troupe.remote: `f.remote(*args)` runs it as a task."""

    def __init__(self, fn: Callable[..., Any], options: Mapping[str, Any]) -> None:
        _remote._check_options(options, "task")
        if options.get("num_returns") == "dynamic" or options.get("num_returns") == "streaming":
            raise InvalidArgumentError("num_returns='dynamic' and 'streaming' are not supported by Troupe")
        self._fn = fn
        self._options = dict(options)
        self.__name__ = getattr(fn, "__name__", "task")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__module__ = getattr(fn, "__module__", None) or __name__
        self.__wrapped__ = fn
        self._blob: bytes | None = None
        self._key: str | None = None
        try:
            self._signature: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):
            self._signature = None

    def options(self, **options: Any) -> RemoteFunction:
        merged = dict(self._options)
        merged.update(options)
        twin = RemoteFunction(self._fn, merged)
        twin._blob, twin._key = self._blob, self._key
        return twin

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Submits a call; its ObjectRef (a list of them with num_returns > 1)."""
        _checks._check_call(self._signature, args, kwargs, f"{self.__name__}.remote()")
        _session._auto_init()
        return submit(self, args, kwargs)

    def bind(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError("Ray DAGs (bind) are not supported by Troupe")

    def __call__(self, *args, **kwargs):
        raise ArgumentTypeError(f"Remote functions cannot be called directly. Instead of running '{self.__name__}()', "
                        f"try '{self.__name__}.remote()'.")

    def __reduce__(self):
        return RemoteFunction, (self._fn, self._options)

    def _pickled(self):
        if self._blob is None:
            module = getattr(self._fn, "__module__", None)
            holder = type("Holder", (), {"__module__": module}) if module else None
            if holder is not None:
                _remote._by_value(holder)
            self._blob = cloudpickle.dumps(self._fn)
            self._key = hashlib.blake2b(self._blob, digest_size=12).hexdigest()
        return self._key, self._blob


class _TaskWorker:
    """The actor a pool's workers host: runs functions it is sent, keeping them decoded."""

    def __init__(self):
        self._fns = {}

    def run(self, key, blob, args, kwargs):
        fn = self._fns.get(key)
        if fn is None:
            if len(self._fns) >= 1024:
                self._fns.clear()
            fn = self._fns[key] = cloudpickle.loads(blob)
        from ._worker import _resolve_args  # the worker's module, loaded by then

        args, kwargs = _resolve_args(args, kwargs)  # the task's own top-level refs
        return fn(*args, **kwargs)


class _Pool:
    def __init__(self, key, size, options):
        self.names = [f"__troupe_tasks__/{_session._job_id()}/{key}/{i}" for i in range(size)]
        self.handles = [None] * size
        self.inflight = [0] * size
        self.options = options
        self.lock = threading.Lock()

    def pick(self):
        with self.lock:
            i = min(range(len(self.inflight)), key=self.inflight.__getitem__)
            self.inflight[i] += 1
        return i

    def done(self, i):
        with self.lock:
            self.inflight[i] -= 1

    def handle(self, i):
        h = self.handles[i]
        if h is None:
            cls = _remote.ActorClass(_TaskWorker, dict(self.options, name=self.names[i], get_if_exists=True,
                                                    namespace=_session.DEFAULT_NAMESPACE, max_restarts=-1))
            h = self.handles[i] = cls.remote()
        return h


def _pool_for(options):
    """The pool for a task's resource shape (and placement), made on first use."""
    shape = {k: float(v) for k, v in (options.get("resources") or {}).items()}
    if options.get("num_gpus"):
        shape["GPU"] = float(options["num_gpus"])
    if options.get("memory"):
        shape["memory"] = float(options["memory"])
    cpus = float(options["num_cpus"]) if options.get("num_cpus") is not None else 1.0
    pg, index = _remote._placement(options)
    runtime_env = options.get("runtime_env")
    key = (tuple(sorted(shape.items())), pg, index, repr(runtime_env))
    pool = _pools.get(key)
    if pool is None:
        with _lock:
            pool = _pools.get(key)
            if pool is None:
                pool = _pools[key] = _make_pool(shape, pg, index, runtime_env)
    if cpus > pool.cpus and not pg:
        raise InvalidArgumentError(f"infeasible task: it needs {cpus:g} CPU but the cluster has {pool.cpus:g}")
    return pool


def _make_pool(shape, pg, index, runtime_env):
    """A pool for one shape: its size from the cluster's resources now."""
    total = _session.cluster_resources()
    worker = {"max_restarts": -1}
    if runtime_env:
        worker["runtime_env"] = runtime_env
    if pg:
        worker.update(placement_group=pg, placement_group_bundle_index=index, max_concurrency=THREADS_PER_WORKER,
                      _task_worker=True,
                      resources={k: v for k, v in shape.items() if k not in ("GPU", "memory")},
                      num_gpus=shape.get("GPU", 0) or None, memory=shape.get("memory"))
        size, name = 1, f"pg-{pg}-{index}"
    elif shape:
        fits = [int(total.get(k, 0.0) // v) for k, v in shape.items() if v > 0]
        size = min(fits) if fits else 1
        if size < 1:
            raise InvalidArgumentError(f"infeasible task: it needs {shape} but the cluster has {total}")
        # No more workers than fit in what is free now: a worker that cannot be placed (actors
        # hold the rest) would take its share of the tasks and hold them until it could.
        free = _session.available_resources()
        fits_free = [int(free.get(k, 0.0) // v) for k, v in shape.items() if v > 0]
        size = min(size, MAX_POOL, max(1, min(fits_free, default=1)))
        worker.update(num_gpus=shape.get("GPU") or None, memory=shape.get("memory"),
                      resources={k: v for k, v in shape.items() if k not in ("GPU", "memory")})
        name = "-".join(f"{k}={v:g}" for k, v in sorted(shape.items()))
    else:
        size = max(1, min(MAX_POOL, int(total.get("CPU", 1.0))))
        worker.update(num_cpus=0, max_concurrency=THREADS_PER_WORKER, _task_worker=True)
        name = "cpu"
    if runtime_env:
        name += "-env" + hashlib.blake2b(repr(runtime_env).encode(), digest_size=4).hexdigest()
    pool = _Pool(name, size, {k: v for k, v in worker.items() if v is not None})
    pool.cpus = total.get("CPU", 0.0)
    return pool


class _Retry:
    """A task's retry policy; sends it again on the pool when its worker died (or it raised an
    exception listed in retry_exceptions) while attempts are left."""

    def __init__(self, send, pool, index, retries, retry_exceptions):
        self.send, self.pool, self.index = send, pool, index
        self.left = retries
        self.retry_exceptions = retry_exceptions
        self.ref = None

    def _again(self):
        if self.left == 0:
            return False
        if self.left > 0:
            self.left -= 1
        self.pool.done(self.index)
        self.pool.handles[self.index] = None  # looked up again: a dead worker's name is taken anew
        self.index = self.pool.pick()
        self.ref._ref = self.send(self.index)
        return True

    def died(self, message):
        return self._again()

    def exception(self, exc):
        return _refs._wants_retry(exc, self.retry_exceptions) and self._again()

    def finished(self):
        self.pool.done(self.index)


def submit(rf, args, kwargs):
    options = rf._options
    cached = rf.__dict__.get("_pool_cache")
    if cached is not None and cached[0] == _generation:
        pool = cached[1]
    else:
        pool = _pool_for(options)
        rf._pool_cache = (_generation, pool)
    key, blob = rf._pickled()
    retries = options.get("max_retries")
    retry = _Retry(None, pool, None, DEFAULT_MAX_RETRIES if retries is None else retries,
                   options.get("retry_exceptions"))
    ref = _refs.ObjectRef(None, None, options.get("name") or rf.__name__, retry)
    retry.ref = ref

    def send():
        a, k = _refs._top_level_args(args, kwargs)
        plain = _serialization._plain(a) and _serialization._plain(k)
        files = []
        with _refs._keeping(ref):
            payload = _serialization.dumps_call(((key, blob, a, k), {}, _objects.host_id()), plain, files)
        runtime = _session.runtime()

        def to(i):
            return _session.runtime_call(runtime.submit, pool.handle(i)._id, "run", payload)

        index = pool.pick()
        try:
            ref._ref = to(index)
        except BaseException:
            pool.done(index)
            raise
        retry.send, retry.index = to, index
        ref._files = files or None

    _refs._submit(("task", id(ref)), ref, send)  # tasks keep no order among themselves
    num_returns = options.get("num_returns")
    return _refs._split(ref, 1 if num_returns is None else num_returns)


def reset():
    """Forgets the pools (at shutdown: their workers end with this process's session)."""
    global _generation
    with _lock:
        _pools.clear()
        _generation += 1


__all__ = ["RemoteFunction", "TroupeError"]

_remote._task_layer = sys.modules[__name__]  # see troupe._remote: this layer sits above it
_session.on_shutdown.append(reset)
