"""remote(): actor classes, their handles and method calls, cpp_actor(), kill() and
get_actor(). Built on the session (troupe._session) and refs (troupe._refs)."""
from __future__ import annotations

import inspect
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, Callable, NoReturn, TypeVar

from . import _objects, _serialization, _session
from ._checks import _check_call, _check_int, _check_name, _check_resources, _check_retry_exceptions, _check_runtime_env
from ._refs import (ObjectRef, _ExceptionRetry, _keeping, _split, _StoredRef, _submit, _top_level_args, put)
from ._session import (_auto_init, _current_namespace, _job_id, _scoped_name, _worker_context,
                       runtime, runtime_call)
from .exceptions import (ActorExit, ActorNotFoundError, AlreadyExistsError, ArgumentTypeError, InvalidArgumentError,
                         NotFoundError)

F = TypeVar("F", bound=Callable[..., Any])
# Tasks (troupe._tasks) are built on these actors and troupe._refs' refs, and register themselves here
# when imported (the package's __init__ does): remote() on a function makes their
# RemoteFunction, and option checks know their options.
_task_layer: Any = None


_shipped = {}  # local path -> (name, digest, ref) of its packed copy in the object store


_SHIP_MAX_BYTES = 256 << 20


def _ship_modules(env):
    """The runtime_env as workers get it: each py_modules path packed once per driver (a zip of
    the package or file, without __pycache__) into the object store, so a worker on any node
    pulls it (troupe._worker unpacks it into its node's temporary directory)."""
    if not env or not env.get("py_modules"):
        return env
    import hashlib
    import io
    import zipfile

    packed = []
    for path in env["py_modules"]:
        if isinstance(path, tuple):
            packed.append(path)
            continue
        if path not in _shipped:
            buffer = io.BytesIO()
            with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
                if os.path.isfile(path):
                    z.write(path, os.path.basename(path))
                else:
                    root = os.path.dirname(path)
                    for folder, dirs, files in os.walk(path):
                        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
                        for f in sorted(files):
                            full = os.path.join(folder, f)
                            z.write(full, os.path.relpath(full, root))
            data = buffer.getvalue()
            if len(data) > _SHIP_MAX_BYTES:
                raise InvalidArgumentError(f"runtime_env['py_modules']: {path} packs to {len(data)} bytes, over the "
                                 f"{_SHIP_MAX_BYTES >> 20} MiB a module may take")
            _shipped[path] = (os.path.basename(path), hashlib.sha256(data).hexdigest()[:32], put(data))
        packed.append(_shipped[path])
    return {**env, "py_modules": packed}


_OPTION_NAMES = {"num_cpus", "num_gpus", "memory", "resources", "name", "namespace", "max_restarts",
                 "max_task_retries", "max_concurrency", "lifetime", "placement_group", "bundle_index",
                 "placement_group_bundle_index", "scheduling_strategy", "get_if_exists", "runtime_env",
                 "placement_group_capture_child_tasks", "concurrency_groups",
                 "_task_worker"}  # internal: the actor is a task pool's worker (_tasks.py)


def _check_options(options, what="actor", internal_name=False):
    known = _OPTION_NAMES if what == "actor" else _tasks_option_names()
    unknown = set(options) - known
    if unknown:
        raise ArgumentTypeError(f"unknown {what} option(s) {sorted(unknown)}; known: {sorted(known)}")
    lifetime = options.get("lifetime")
    if lifetime not in (None, "detached", "non_detached"):
        raise InvalidArgumentError(f"lifetime must be None, 'detached' or 'non_detached', not {lifetime!r}")
    for key in ("num_cpus", "num_gpus", "memory"):
        value = options.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise InvalidArgumentError(f"{key} must be a number >= 0, not {value!r}")
    resources = options.get("resources")
    if resources is not None:
        if not isinstance(resources, dict):
            raise ArgumentTypeError(f"resources must be a dict, not {type(resources).__name__}")
        for k in ("CPU", "GPU"):
            if k in resources:
                raise InvalidArgumentError(f"use num_{k.lower()}s= rather than resources={{'{k}': ...}}")
    for key in ("max_restarts", "max_task_retries", "max_retries", "num_returns"):
        _check_int(options.get(key), key, -1)
    _check_int(options.get("max_concurrency"), "max_concurrency", 1)
    if options.get("concurrency_groups"):
        raise InvalidArgumentError("concurrency_groups are not supported by Troupe; use max_concurrency")
    if "runtime_env" in options:
        options["runtime_env"] = _check_runtime_env(options["runtime_env"])
    name = options.get("name")
    if name is not None and not internal_name:
        _check_name(name)
    if options.get("namespace") is not None:
        _check_name(options["namespace"], "namespace")


def _tasks_option_names():
    return _task_layer.OPTION_NAMES


def _demand(options):
    # Ray's rule is "1 CPU to place, 0 while alive"; Troupe places a default actor on the node
    # with the most free CPU and holds nothing (docs/ray_differences.md).
    resources = {"CPU": float(options.get("num_cpus") or 0)}
    if options.get("num_gpus"):
        resources["GPU"] = float(options["num_gpus"])
    if options.get("memory"):
        resources["memory"] = float(options["memory"])
    resources.update({k: float(v) for k, v in (options.get("resources") or {}).items()})
    _check_resources(resources, "actor options")
    return resources


def _placement(options):
    """(placement group id, bundle index) from Ray's or Troupe's spelling of the options."""
    strategy = options.get("scheduling_strategy")
    pg = options.get("placement_group")
    index = options.get("placement_group_bundle_index", options.get("bundle_index", -1))
    if strategy is not None and not isinstance(strategy, str):
        pg = getattr(strategy, "placement_group", pg)
        index = getattr(strategy, "placement_group_bundle_index", index)
    elif strategy not in (None, "DEFAULT", "SPREAD"):
        raise InvalidArgumentError(f"scheduling_strategy {strategy!r} is not supported (DEFAULT, SPREAD, or a "
                         "PlacementGroupSchedulingStrategy)")
    if pg is not None and pg != "default":
        pg = getattr(pg, "id", pg)
        if index is None or index < 0:
            index = 0
        return pg, int(index)
    return "", -1


def _create(type_name, init_args, options):
    rt = runtime()
    pg, index = _placement(options)
    name = _scoped_name(options["name"], options.get("namespace")) if options.get("name") else ""
    args = (type_name, name, _demand(options), int(options.get("max_restarts") or 0),
            int(options.get("max_task_retries") or 0), options.get("lifetime") == "detached", init_args, pg, index)
    try:
        return runtime_call(rt.create_actor, *args)
    except AlreadyExistsError:
        if not options.get("get_if_exists"):
            raise
        return runtime_call(rt.get_actor, name)[0]


def _by_value(cls):
    """Pickles the class's module by value unless workers can import it (e.g. a test module)."""
    import cloudpickle

    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", "") or ""
    if module is not None and cls.__module__ != "__main__" and "dist-packages" not in path \
            and "site-packages" not in path and not cls.__module__.startswith("troupe"):
        try:
            cloudpickle.register_pickle_by_value(module)
        except ValueError:
            pass


def method(*, num_returns: int | None = None, retry_exceptions: bool | list[type[BaseException]] | None = None,
           max_task_retries: int | None = None, concurrency_group: str | None = None,
           **others: Any) -> Callable[[F], F]:
    """@troupe.method(num_returns=N, retry_exceptions=..., max_task_retries=M) on an actor method:
    its calls return N ObjectRefs; a call lost with its worker is sent again to the restarted
    actor, and an exception it raises (True: any; a list: those types) retried, up to M times
    (-1: no limit; default: the actor's max_task_retries)."""
    if others:
        raise ArgumentTypeError(f"@troupe.method takes num_returns, retry_exceptions and max_task_retries, not "
                        f"{sorted(others)}")
    if num_returns is not None and (not isinstance(num_returns, int) or num_returns < 0):
        raise InvalidArgumentError(f"num_returns must be an integer >= 0, not {num_returns!r}")
    _check_retry_exceptions(retry_exceptions)
    _check_int(max_task_retries, "max_task_retries", -1)

    def mark(fn):
        fn.__troupe_method__ = (1 if num_returns is None else num_returns, retry_exceptions, max_task_retries)
        return fn

    return mark


def _methods_of(cls):
    """{method name: (num_returns, retry_exceptions, max_task_retries)} of an actor class: what its
    handles expose."""
    out = {}
    for name in dir(cls):
        if name.startswith("__") and name.endswith("__"):
            continue
        member = inspect.getattr_static(cls, name, None)
        fn = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
        if callable(fn):
            out[name] = getattr(fn, "__troupe_method__", (1, None, None))
    return out


def _signatures_of(cls):
    """{method name: signature as the caller sees it (no self)}: calls are checked against them
    at .remote(), as Ray does, so a wrong call fails where it is made."""
    out = {}
    for name in dir(cls):
        if name.startswith("__") and name.endswith("__"):
            continue
        member = inspect.getattr_static(cls, name, None)
        try:
            if isinstance(member, (staticmethod, classmethod)):
                out[name] = inspect.signature(getattr(cls, name))
            elif inspect.isfunction(member):
                sig = inspect.signature(member)
                out[name] = sig.replace(parameters=list(sig.parameters.values())[1:])
        except (TypeError, ValueError):
            pass
    return out


class ActorClass:
    """A class made remote with @troupe.remote. `Cls.remote(*args)` starts an actor."""

    def __init__(self, cls: type, options: Mapping[str, Any]) -> None:
        # The task pools' workers (troupe._tasks) are named by the runtime: "__troupe_tasks__/JOB/SHAPE/I".
        _check_options(options, internal_name=cls.__module__ == "troupe._tasks")
        self._cls = cls
        self._options = dict(options)
        try:
            self._init_signature: inspect.Signature | None = inspect.signature(cls)
        except (TypeError, ValueError):
            self._init_signature = None
        self._signatures = None
        self.__name__ = cls.__name__
        self.__qualname__ = cls.__qualname__
        self.__doc__ = cls.__doc__
        self.__module__ = cls.__module__

    def options(self, **options: Any) -> ActorClass:
        merged = dict(self._options)
        merged.update(options)
        return ActorClass(self._cls, merged)

    def remote(self, *args: Any, **kwargs: Any) -> ActorHandle:
        _auto_init()
        _check_call(self._init_signature, args, kwargs, f"{self.__name__}.remote()")
        _by_value(self._cls)
        options = self._options
        session_env = (_session.current.runtime_env if _session.current is not None else _worker_context.get("runtime_env"))
        context = {
            "job_id": _job_id(),
            "namespace": _current_namespace(),  # the job's, as in Ray: options' only scopes the name
            "runtime_env": _ship_modules(options.get("runtime_env") or session_env),
            "max_concurrency": options.get("max_concurrency"),
            "task_worker": bool(options.get("_task_worker")),
        }
        # The context is read first: its runtime_env (working_dir on sys.path) may be what makes
        # the class's own imports work when the worker unpickles it.
        init_args = _serialization.dumps((context, _serialization.dumps((self._cls, args, kwargs))))
        actor_id = _create("py:" + self._cls.__qualname__, init_args, options)
        # Ray ends an unnamed, non-detached actor once no handle to it is left.
        owned = not options.get("name") and options.get("lifetime") != "detached"
        if self._signatures is None:
            self._signatures = _signatures_of(self._cls)
        handle = ActorHandle(actor_id, "py:" + self._cls.__qualname__, _methods_of(self._cls), owned=owned,
                             max_task_retries=int(options.get("max_task_retries") or 0))
        handle._signatures = self._signatures
        return handle

    def bind(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError("Ray DAGs (bind) are not supported by Troupe")

    def __call__(self, *args, **kwargs):
        raise ArgumentTypeError(f"Actors cannot be instantiated directly. Instead of '{self.__name__}()', use "
                        f"'{self.__name__}.remote()'.")

    def __getattr__(self, name):
        if name.startswith("__") or name == "_cls":
            raise AttributeError(name)
        return getattr(self._cls, name)  # class attributes and static methods, as in Ray

    def __mro_entries__(self, bases):
        raise ArgumentTypeError("Inheriting from actor classes is not currently supported. Inherit from the plain "
                        "class and decorate the subclass with @troupe.remote.")


_REMOTE_KEYS = None


def remote(*args: Any, **options: Any) -> Any:
    """@troupe.remote, or @troupe.remote(options...) on a class (an actor) or a function (a task).
    Actor options: num_cpus, num_gpus, memory, resources, name, namespace, lifetime, max_restarts,
    max_task_retries, max_concurrency, get_if_exists, placement_group, placement_group_bundle_index,
    scheduling_strategy, runtime_env. Task options: num_cpus, num_gpus, memory, resources,
    num_returns, max_retries, retry_exceptions, name, placement_group, scheduling_strategy."""

    def task(target, options):
        import inspect

        if inspect.iscoroutinefunction(target):  # Ray refuses it too: a task's result is a value
            raise InvalidArgumentError(f"@troupe.remote cannot make a task of the async function {target.__qualname__}: "
                             f"a task returns a value, not a coroutine; wrap it in a plain function that "
                             f"runs it (asyncio.run(...)), or make it a method of an async actor")
        return _task_layer.RemoteFunction(target, options)

    if len(args) == 1 and not options and (isinstance(args[0], type) or callable(args[0])):
        target = args[0]
        return ActorClass(target, {}) if isinstance(target, type) else task(target, {})
    if args or not options:
        raise ArgumentTypeError("@troupe.remote decorates a class or function directly (@troupe.remote), or takes "
                        "keyword options (@troupe.remote(num_cpus=1)); not @troupe.remote() or positional arguments")

    def wrap(target):
        if isinstance(target, type):
            return ActorClass(target, options)
        if callable(target):
            return task(target, options)
        raise ArgumentTypeError(f"@troupe.remote decorates a class or a function, not {type(target).__name__}")

    return wrap


def cpp_actor(type_name: str, init_args: bytes | str | Mapping[str, Any] = b"", **options: Any) -> ActorHandle:
    """Starts a built-in C++ actor (e.g. "Counter", "Echo"); its methods take and return bytes.
    The init args of Trainer, Dataloader, Checkpoint, Counter and Crasher are a dict, or its
    JSON text, checked here against their struct in actors/schema/init_args.capnp (an unknown
    key or a wrong value raises InvalidArgumentError before anything starts); other types take
    bytes as they are."""
    _check_options(options)
    if "num_cpus" not in options:
        options["num_cpus"] = 1  # C++ actors keep holding a CPU by default (the training actors)
    return ActorHandle(_create(type_name, init_args, options), type_name)


# Live handles per owned actor in this process; at zero the actor is asked to end (after the
# calls already sent). A handle passed to another process carries a token, a put() object of
# this process held by every process that has handles (troupe._objects: holds): the actor ends
# once the last holder lets go of it (a thread here watches for its file to go).
_handle_counts: dict[str, float] = {}


_handle_tokens: dict[str, _StoredRef] = {}  # actor id -> this process's ref to its token


_handle_watch: dict[str, str] = {}  # actor id -> its token's object id, held elsewhere once no handle is left here


_handle_lock = threading.Lock()


class ActorHandle:
    """A handle to an actor: `handle.method.remote(*args)` returns an ObjectRef. Handles can be
    passed to other actors and tasks, and survive restarts."""

    def __init__(self, actor_id: str, type_name: str, methods: Mapping[str, Any] | None = None, owned: bool = False,
                 max_task_retries: int = 0) -> None:
        self._id = actor_id
        self._type = type_name
        self._methods = methods
        self._owned = owned
        self._max_task_retries = max_task_retries
        self._signatures = None  # set where the class is known (not on handles passed here)
        if owned:
            with _handle_lock:
                _handle_counts[actor_id] = _handle_counts.get(actor_id, 0) + 1

    @property
    def actor_id(self) -> str:
        return self._id

    @property
    def _actor_id(self):
        return _Id(self._id)

    @property
    def _is_python(self):
        return self._type.startswith("py:")

    def __getattr__(self, name):
        if name in ("__troupe_terminate__", "__ray_terminate__"):
            return ActorMethod(self, "__troupe_terminate__")
        if name.startswith("_"):
            raise AttributeError(name)
        if self._methods is not None and name not in self._methods:
            raise AttributeError(f"actor {self._type[3:] if self._is_python else self._type} has no method "
                                 f"{name!r}")
        num_returns, retry_exceptions, retries = (self._methods.get(name, (1, None, None)) if self._methods
                                                  else (1, None, None))
        method = ActorMethod(self, name, num_returns, retry_exceptions, retries)
        if self._signatures is not None:
            method._signature = self._signatures.get(name)
        return method

    def __reduce__(self):
        token = getattr(self, "_token", None) or _lend(self._id)
        return ActorHandle._arrive, (self._id, self._type, self._methods, self._max_task_retries, token)

    @classmethod
    def _arrive(cls, actor_id, type_name, methods, max_task_retries, token):
        handle = cls(actor_id, type_name, methods, False, max_task_retries)
        handle._token = token  # held while this handle lives
        return handle

    def __del__(self):
        if not self._owned:
            return
        try:
            with _handle_lock:
                left = _handle_counts.get(self._id, 0) - 1
                if left > 0:
                    _handle_counts[self._id] = left
                    return
                _handle_counts.pop(self._id, None)
                token = _handle_tokens.pop(self._id, None)
            if token is not None:
                name, store = token.hex(), _objects.store()
                del token  # this process's hold goes: the last holder deletes the token
                if store.exists(name):
                    _watch_handles(self._id, name)
                    return
            _terminate(self._id)
        except Exception:  # at interpreter exit, or a closed session: the owner's exit ends it
            pass

    def __eq__(self, other):
        return isinstance(other, ActorHandle) and other._id == self._id

    def __hash__(self):
        return hash(self._id)

    def __repr__(self):
        return f"ActorHandle({self._type}, {self._id})"


def _lend(actor_id):
    """The token of an owned actor's handles, made when one is first passed on (None: not owned
    here, or this process's objects are not held, so the actor lives until this process exits)."""
    with _handle_lock:
        if actor_id not in _handle_counts:
            return None
        token = _handle_tokens.get(actor_id)
    if token is None:
        token = _StoredRef._from_value(None)
        if not _objects._held_kind(token.hex(), token._host):
            with _handle_lock:
                _handle_counts[actor_id] = float("inf")
            return None
        with _handle_lock:
            token = _handle_tokens.setdefault(actor_id, token)
    return token


def _terminate(actor_id):
    if _session.current is not None:
        _session.current.runtime.submit(actor_id, "__troupe_terminate__", _serialization.dumps(((), {})))


def _watch_handles(actor_id, token_id):
    """Ends the actor once its token is gone: the last process holding handles dropped them."""
    with _handle_lock:
        first = not _handle_watch
        _handle_watch[actor_id] = token_id
    if first:
        threading.Thread(target=_handle_watcher, name="troupe-handle-watch", daemon=True).start()


def _handle_watcher():
    while True:
        time.sleep(0.2)
        store = _objects.store()
        with _handle_lock:
            gone = [a for a, token in _handle_watch.items() if not store.exists(token)]
            for actor_id in gone:
                del _handle_watch[actor_id]
            done = not _handle_watch
        for actor_id in gone:
            try:
                _terminate(actor_id)
            except Exception:  # the session closed: its end ends the actor
                pass
        if done:
            with _handle_lock:  # another watch may have come meanwhile
                if not _handle_watch:
                    return


class _Id(str):
    """An id that also answers .hex(), as Ray's ids do."""

    def hex(self):
        return str(self)


class ActorMethod:
    def __init__(self, handle, name, num_returns=1, retry_exceptions=None, max_task_retries=None, call_name=None):
        self._handle = handle
        self._name = name
        self._num_returns = num_returns
        self._retry_exceptions = retry_exceptions
        self._max_task_retries = max_task_retries  # None: the actor's
        self._call_name = call_name
        self._signature = None

    def options(self, num_returns: int | None = None, retry_exceptions: bool | list[type[BaseException]] | None = None,
                name: str | None = None, **others: Any) -> ActorMethod:
        """num_returns, retry_exceptions; name: the worker's process title (/proc/<pid>/comm) while
        the call runs, as Ray's (ray::<name>)."""
        if others:
            raise ArgumentTypeError(f"actor method options take num_returns, retry_exceptions and name, not {sorted(others)}")
        _check_retry_exceptions(retry_exceptions)
        _check_int(num_returns, "num_returns", 0)
        if name is not None and not isinstance(name, str):
            raise ArgumentTypeError(f"name must be a string, not {name!r}")
        method = ActorMethod(self._handle, self._name, self._num_returns if num_returns is None else num_returns,
                             self._retry_exceptions if retry_exceptions is None else retry_exceptions,
                             self._max_task_retries, self._call_name if name is None else name)
        method._signature = self._signature
        return method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        h = self._handle
        _check_call(self._signature, args, kwargs, f"{h._type[3:] if h._is_python else h._type}.{self._name}")
        if not h._is_python and (kwargs or len(args) > 1):
            raise ArgumentTypeError(f"{h._type}.{self._name} is a C++ actor method: pass one bytes or str payload")
        name, retry_exceptions, call_name = self._name, self._retry_exceptions, self._call_name
        retries = h._max_task_retries if self._max_task_retries is None else self._max_task_retries
        per_call = -2 if self._max_task_retries is None else self._max_task_retries  # -2: the actor's
        ref = ObjectRef(None, h, name)

        def send():
            files = []
            if h._is_python:
                a, k = _top_level_args(args, kwargs)
                plain = _serialization._plain(a) and _serialization._plain(k)
                call = (a, k, _objects.host_id(), call_name) if call_name else (a, k, _objects.host_id())
                with _keeping(ref):
                    payload = _serialization.dumps_call(call, plain, files)
            else:
                payload = args[0] if args else b""
                if isinstance(payload, str):
                    payload = payload.encode()
            rt = runtime()
            ref._ref = runtime_call(rt.submit, h._id, name, payload, per_call)
            ref._files = files or None
            if retry_exceptions and retries != 0:
                ref._retry = _ExceptionRetry(lambda: runtime_call(rt.submit, h._id, name, payload, per_call), ref,
                                             retries, retry_exceptions)

        _submit(h._id, ref, send)
        return _split(ref, self._num_returns)

    def __call__(self, *args, **kwargs):
        raise ArgumentTypeError(f"Actor methods cannot be called directly. Instead of running "
                        f"'object.{self._name}()', try 'object.{self._name}.remote()'.")


def kill(handle: ActorHandle, no_restart: bool = True) -> None:
    """Kills the actor's worker; with no_restart it is DEAD afterwards."""
    if not isinstance(handle, ActorHandle):
        raise InvalidArgumentError(f"kill() takes an ActorHandle, not {type(handle).__name__}")
    runtime_call(runtime().kill, handle._id, bool(no_restart))


def exit_actor() -> None:
    """Ends the calling actor once this call returns (atexit handlers run; no restart)."""
    if not os.environ.get("TROUPE_ACTOR_ID"):
        raise ArgumentTypeError("exit_actor() called outside an actor")
    raise ActorExit()


def get_actor(name: str, namespace: str | None = None) -> ActorHandle:
    """The handle of the live actor named `name` in `namespace` (default: this job's)."""
    _check_name(name)
    if namespace is not None:
        _check_name(namespace, "namespace")
    try:
        actor_id, type_name = runtime_call(runtime().get_actor, _scoped_name(name, namespace))
    except NotFoundError as e:
        error = ActorNotFoundError(f"Failed to look up actor with name '{name}' in namespace "
                                   f"'{namespace or _current_namespace()}': {e}")
        error.code = "NOT_FOUND"
        raise error from None
    return ActorHandle(actor_id, type_name)


_session.on_shutdown.append(_shipped.clear)
