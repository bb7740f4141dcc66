"""The driver API: init/shutdown, @remote actors, get/wait/kill, named actors, cluster views."""
from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import json
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import inspect
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any, Callable, NoReturn, TypeVar, overload

from . import _objects, _serialization
from .exceptions import (ActorDiedError, ActorError, ActorExit, ActorNotFoundError, AlreadyExistsError, ArgumentTypeError,
                         GetTimeoutError, InvalidArgumentError, NotFoundError, ObjectLostError, TaskError, TroupeError,
                         UnauthenticatedError, UnavailableError, WorkerCrashedError)

_lock = threading.RLock()
_session: _Session | None = None
# What a worker process knows of the job that started it (set by troupe._worker).
_worker_context: dict[str, Any] = {}
DEFAULT_NAMESPACE = "default"
# Tasks (troupe._tasks) are built on this module's actors and refs, and register themselves here
# when imported (the package's __init__ does): remote() on a function makes their
# RemoteFunction, shutdown() resets their pools, option checks know their options.
_task_layer: Any = None
T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


class _Session:
    """One driver's connection, and the embedded cluster it owns, if any."""

    def __init__(self, runtime, address, cluster_process=None, run_root=None, log_to_driver=True, job_id="",
                 namespace=None, runtime_env=None):
        self.runtime = runtime
        self.address = address
        self.cluster_process = cluster_process
        self.run_root = run_root
        self.job_id = job_id  # names the job's task pools; actors and tasks it starts inherit it
        # Ray's rule: a driver without namespace= gets an anonymous one of its own, so its
        # actors' names do not meet another driver's.
        self.namespace = namespace or f"anonymous-{secrets.token_hex(8)}"
        self.runtime_env = runtime_env
        self.cluster_tag: str | None = None  # _tag_of(token): refs of another cluster are refused
        self.closing = threading.Event()
        self.printer = None
        self.output = _OutputPrinter()
        self.ipython = None
        if log_to_driver:
            self.printer = threading.Thread(target=_print_actor_output, args=(self,), daemon=True,
                                            name="troupe-actor-output")
            self.printer.start()
            self._follow_cells()

    def _follow_cells(self):
        """In a notebook, a cell's actor output is printed before the cell ends: a thread's output
        that arrives after that belongs to no cell and is lost by front ends such as nbclient."""
        shell = sys.modules.get("IPython")
        shell = shell.get_ipython() if shell is not None and hasattr(shell, "get_ipython") else None
        if shell is None or not hasattr(shell, "events"):
            return
        self.ipython = shell
        shell.events.register("post_execute", self._flush_cell_output)

    def _flush_cell_output(self):
        if self.closing.is_set():
            return
        try:
            self.output.write(self.runtime.flush_output())
        except Exception:  # the periodic thread prints it later; never fail the user's cell
            pass

    def close(self):
        self.closing.set()
        if self.ipython is not None:
            try:
                self.ipython.events.unregister("post_execute", self._flush_cell_output)
            except ValueError:
                pass
        if self.printer is not None:
            self.printer.join(timeout=5)
            try:  # what the actors printed just before shutdown is shown, not lost
                self.output.write(self.runtime.flush_output())
                self.output.tick(force=True)
            except Exception as e:  # never block shutdown; say what was missed
                print(f"(troupe) could not read the actors' last output: {e}", file=sys.stderr, flush=True)
        try:
            self.runtime.close()
        finally:
            if self.cluster_process is not None:
                _stop_embedded(self.cluster_process)
            if self.run_root:
                shutil.rmtree(self.run_root, ignore_errors=True)


# A chatty actor must not freeze a notebook: at most this many lines per second are printed;
# the rest are counted and reported once a second.
MAX_OUTPUT_LINES_PER_SECOND = 100


class _OutputPrinter:
    """Prints actor output lines with their prefix, at most MAX_OUTPUT_LINES_PER_SECOND."""

    def __init__(self):
        self.window_start, self.printed, self.dropped = time.monotonic(), 0, 0

    def tick(self, force=False):
        now = time.monotonic()
        if force or now - self.window_start >= 1.0:
            if self.dropped:
                print(f"(troupe) {self.dropped} line(s) of actor output dropped: more than "
                      f"{MAX_OUTPUT_LINES_PER_SECOND} lines/s (see `troupe logs ACTOR`)", file=sys.stderr, flush=True)
            self.window_start, self.printed, self.dropped = now, 0, 0

    def write(self, lines):
        for label, stream, line in lines:
            if self.printed >= MAX_OUTPUT_LINES_PER_SECOND:
                self.dropped += 1
                continue
            self.printed += 1
            print(f"{label} {line}", file=sys.stderr if stream == "stderr" else sys.stdout, flush=True)


def _print_actor_output(session):
    printer = session.output
    while not session.closing.is_set():
        lines = session.runtime.poll_output(0.2)
        printer.tick()
        printer.write(lines)


def _package_dir():
    return os.path.dirname(os.path.abspath(__file__))


def _troupe_binary():
    candidates = []
    if os.environ.get("TROUPE_BIN_DIR"):
        candidates.append(os.path.join(os.environ["TROUPE_BIN_DIR"], "troupe"))
    # The build tree: build/python/troupe/ -> build/troupe
    candidates.append(os.path.join(_package_dir(), os.pardir, os.pardir, "troupe"))
    found = shutil.which("troupe")
    if found:
        candidates.append(found)
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return os.path.abspath(c)
    raise TroupeError("cannot find the `troupe` executable: build it (make build) or put it on PATH")


def _read_cluster_file(run_root: str) -> dict[str, Any]:
    """The cluster file of run_root's newest run, as a dict (with its "run_dir"). The C++ owner-and-
    mode checks apply (the CLI's own): a root, `latest` link, run directory or cluster.json that is
    not this user's and private raises FailedPreconditionError instead of being trusted; none
    raises NotFoundError. A --tls cluster's file makes this process speak TLS from the start."""
    from . import _core

    cluster = _core.read_cluster_file(run_root)
    if cluster["tls"]:
        _core.require_tls()
    return cluster


def default_run_root() -> str:
    """$TROUPE_TEMP_DIR, else this user's own /tmp/troupe-<uid> (as the CLI's)."""
    return os.environ.get("TROUPE_TEMP_DIR") or f"/tmp/troupe-{os.geteuid()}"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_embedded(num_cpus, resources, object_store_memory=None):
    run_root = tempfile.mkdtemp(prefix="troupe-driver-")
    env = dict(os.environ, TROUPE_TEMP_DIR=run_root,
               TROUPE_PYTHONPATH=os.path.dirname(_package_dir()))
    args = [_troupe_binary(), "start", "--head", "--block", "--port", str(_free_port()),
            "--watch-pid", str(os.getpid())]
    _check_resources(dict(resources or {}, **({"CPU": float(num_cpus)} if num_cpus is not None else {})), "init")
    if num_cpus is not None:
        args += ["--num-cpus", str(num_cpus)]
    if resources:
        args += ["--resources", ",".join(f"{k}={v}" for k, v in resources.items())]
    if object_store_memory is not None:
        args += ["--object-store-memory", str(object_store_memory)]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines = []
    while True:  # the CLI prints this line once the head and its node are up
        line = proc.stdout.readline()
        if not line:
            err = proc.stderr.read().strip()
            shutil.rmtree(run_root, ignore_errors=True)
            raise TroupeError(f"could not start a local cluster: {err or ''.join(lines)}")
        lines.append(line)
        if "Running in the foreground" in line:
            break
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe drained
    return proc, run_root


def _stop_embedded(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# Keywords of ray.init() that init() takes without a use here (the logging ones style the driver's
# own logging, which Troupe leaves to the user).
_INIT_NOOPS = {"logging_format", "configure_logging", "log_to_driver"}


def _check_runtime_env(runtime_env):
    if runtime_env is None:
        return None
    if not isinstance(runtime_env, dict):
        raise ArgumentTypeError(f"runtime_env must be a dict, not {type(runtime_env).__name__}")
    unknown = set(runtime_env) - {"env_vars", "working_dir", "py_modules"}
    if unknown:
        raise InvalidArgumentError(f"runtime_env keys {sorted(unknown)} are not supported: Troupe honours env_vars, a "
                         "local working_dir (a directory on the machines of the cluster) and py_modules")
    env_vars = runtime_env.get("env_vars") or {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()):
        raise ArgumentTypeError("runtime_env['env_vars'] must map str to str")
    wd = runtime_env.get("working_dir")
    if wd is not None:
        if not isinstance(wd, str) or "://" in wd or not os.path.isdir(wd):
            raise InvalidArgumentError(f"runtime_env['working_dir'] must be a local directory, not {wd!r}")
        wd = os.path.abspath(wd)
    modules = runtime_env.get("py_modules")
    if modules is not None:
        if not isinstance(modules, (list, tuple)):
            raise ArgumentTypeError(f"runtime_env['py_modules'] must be a list, not {type(modules).__name__}")
        modules = [_module_path(m) for m in modules]
    return {"env_vars": dict(env_vars), **({"working_dir": wd} if wd else {}),
            **({"py_modules": modules} if modules else {})}


def _module_path(module):
    """A py_modules entry as a local path: a package's directory, a module's .py file, or one of
    them given as a path (a packed entry from a worker's own context stays as it is)."""
    if isinstance(module, tuple) and len(module) == 3:
        return module
    if inspect.ismodule(module):
        path = getattr(module, "__file__", None)
        if path is None:
            raise InvalidArgumentError(f"runtime_env['py_modules']: module {module.__name__} has no file to ship")
        module = os.path.dirname(path) if os.path.basename(path) == "__init__.py" else path
    if not isinstance(module, str) or "://" in module:
        raise InvalidArgumentError(f"runtime_env['py_modules'] entries are local packages, .py files or modules, not {module!r}")
    path = os.path.abspath(module)
    if not (os.path.isdir(path) or (os.path.isfile(path) and path.endswith(".py"))):
        raise InvalidArgumentError(f"runtime_env['py_modules']: {module!r} is neither a directory nor a .py file")
    return path


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


def init(address: str | None = None, *, token: str | None = None, num_cpus: float | None = None,
         num_gpus: float | None = None, resources: Mapping[str, float] | None = None, namespace: str | None = None,
         runtime_env: Mapping[str, Any] | None = None, ignore_reinit_error: bool = False, log_to_driver: bool = True,
         logging_level: Any = None, include_dashboard: bool | None = None, object_store_memory: int | None = None,
         **unsupported: Any) -> None:
    """Connects this driver to a cluster.

    address=None starts an embedded local cluster owned by this driver (stopped by shutdown()
    or at exit), unless TROUPE_ADDRESS names a cluster (a job's driver runs with it set); "auto" attaches to the cluster started by `troupe start --head` on this
    machine; "HOST:PORT" attaches to that controller (token from `token=`, TROUPE_TOKEN, or
    this machine's run directory). Fails within 10 s with ConnectionError if unreachable.
    With log_to_driver, the output of the actors this driver creates is printed here,
    prefixed with "(Class pid=N)".

    Also from ray.init(): namespace= (where actor names live; default: an anonymous namespace of
    this driver's own, which its actors and tasks share; "default" is the one `troupe` and C++
    actors use),
    runtime_env={"env_vars": {...}, "working_dir": DIR} (applied in every worker of this job),
    num_gpus=, logging_level= (the runtime's log level), object_store_memory= (bytes of shared memory
    the local cluster's objects may hold before they spill to disk; default 30% of RAM). Other
    keywords raise TypeError.
    """
    global _session
    from . import _core

    unknown = set(unsupported) - _INIT_NOOPS
    if unknown:
        raise ArgumentTypeError(f"init() does not support {sorted(unknown)}; it takes address, token, num_cpus, num_gpus, "
                        "resources, namespace, runtime_env (env_vars, working_dir, py_modules), ignore_reinit_error, "
                        "log_to_driver, logging_level, object_store_memory")
    if include_dashboard:
        raise InvalidArgumentError("include_dashboard=True: Troupe has no dashboard yet (`troupe status` shows the cluster)")
    if namespace is not None:
        _check_name(namespace, "namespace")
    if object_store_memory is not None and (isinstance(object_store_memory, bool) or
                                            not isinstance(object_store_memory, int) or object_store_memory < 8 << 20):
        raise InvalidArgumentError(f"object_store_memory={object_store_memory!r}: a whole number of bytes, at least 8 MiB")
    runtime_env = _check_runtime_env(runtime_env)
    if num_gpus is not None:
        resources = dict(resources or {}, GPU=float(num_gpus))
    if logging_level is not None:
        os.environ["TROUPE_LOG_LEVEL"] = str(logging_level).lower()
    with _lock:
        if _session is not None:
            if ignore_reinit_error:
                return
            raise TroupeError("troupe.init() was already called; call troupe.shutdown() first")
        proc = run_root = None
        if address is None and os.environ.get("TROUPE_ADDRESS"):
            address = os.environ["TROUPE_ADDRESS"]  # a job's driver, or a user's choice, as RAY_ADDRESS
        if address is None:
            proc, run_root = _start_embedded(num_cpus, resources, object_store_memory)
            cluster = _read_cluster_file(run_root)
            address, token = cluster["controller_address"], cluster["token"]
        else:
            if object_store_memory is not None:  # as Ray's: the cluster's nodes were started with theirs
                raise InvalidArgumentError("object_store_memory= applies to a cluster init() starts; when connecting to an "
                                 "existing cluster, give it to `troupe start --object-store-memory` instead")
            root = default_run_root()
            local = local_error = None
            try:
                local = _read_cluster_file(root)
            except NotFoundError:
                pass
            except TroupeError as e:  # another user's, or open to others: never trusted
                local_error = e
            if address == "auto":
                if local_error is not None:
                    raise local_error
                if local is None:
                    raise ConnectionError(f"no running Troupe cluster found under {root}; start one with "
                                          "`troupe start --head` or pass an address")
                address = local["controller_address"]
            token = token or os.environ.get("TROUPE_TOKEN")
            if not token and local and local["controller_address"] == address:
                token = local["token"]
            if not token:
                raise InvalidArgumentError(f"no cluster token for {address}: pass token= or set TROUPE_TOKEN")
        try:
            rt = _core.Runtime(str(address), str(token))
        except UnauthenticatedError:  # reached, but the token is not this cluster's (a PermissionError)
            if proc is not None:
                _stop_embedded(proc)
            raise
        except (ValueError, TroupeError) as e:
            if proc is not None:
                _stop_embedded(proc)
            raise UnavailableError(f"cannot reach the Troupe cluster at {address}: {e}") from None
        ctx = _worker_context  # in a worker: the job that started it
        _session = _Session(rt, address, proc, run_root, log_to_driver, ctx.get("job_id") or secrets.token_hex(8),
                            namespace or ctx.get("namespace"),
                            runtime_env if runtime_env is not None else ctx.get("runtime_env"))
        _session.cluster_tag = _tag_of(token)
        _use_local_node(rt, address)


def _use_local_node(rt, address):
    """A driver's put() objects go to the directory of the node on its machine (the alive node at
    the address this process reaches the controller from; the head first), which that node's
    agent serves to other nodes. Workers have their node's in their environment."""
    if os.environ.get("TROUPE_OBJECT_DIR") and os.environ.get("TROUPE_NODE_ID"):
        return
    host = address.rpartition(":")[0].strip("[]")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # routes only: a datagram socket sends nothing on connect
            local = probe.getsockname()[0]
        here = [n for n in rt.nodes() if n["state"] == "ALIVE" and n["address"].rpartition(":")[0].strip("[]") == local]
        if not here:
            return
        node = min(here, key=lambda n: (not n["is_head"], n["id"]))
        store = rt.object_store(node["address"])
    except (OSError, TroupeError, RuntimeError):
        return  # objects stay in this machine's directory, as a process of no node's
    _objects.use_node(store["directory"], node["id"], store["spill_directory"], store["limit"])


class _Nodes:
    """Other nodes' agents, as this process reaches them to pull objects (troupe._objects.nodes)."""

    def __init__(self):
        self._addresses = {}
        self._lock = threading.Lock()
        self._offer = None

    def _address(self, node_id):
        with self._lock:
            address = self._addresses.get(node_id)
        if address is not None:
            return address
        why = "is no node of this cluster"
        for n in runtime_call(runtime().nodes):
            if n["id"] == node_id and n["state"] != "ALIVE":
                why = f"is {n['state']}" + (f" ({n['death_reason']})" if n["death_reason"] else "")
            elif n["id"] == node_id:
                with self._lock:
                    self._addresses[node_id] = n["address"]
                return n["address"]
        raise ObjectLostError(f"its node {node_id} {why}, and the objects there with it")

    def offer_base(self):
        """"<host>:<bulk port>" of this process's node agent, which serves the copies pulled here
        to other nodes' pullers ("" for a process of no node)."""
        if self._offer is None:
            self._offer = ""
            node = _objects.host_id()
            if _objects._is_node(node):
                try:
                    address = self._address(node)
                    port = runtime_call(runtime().object_store, address)["bulk_port"]
                    if port:
                        self._offer = f"{address.rpartition(':')[0]}:{port}"
                except (TroupeError, OSError):
                    pass
        return self._offer

    def pull(self, node_id, name, path, reuse=False, offer=""):
        address = self._address(node_id)
        try:
            return runtime_call(runtime().pull_object, address, name, path, reuse, offer)
        except NotFoundError as e:
            raise ObjectLostError(str(e)) from None
        except UnavailableError:
            with self._lock:
                self._addresses.pop(node_id, None)
            self._address(node_id)  # says so if the node is gone
            raise

    def drop(self, node_id, name):
        runtime_call(runtime().drop_object, self._address(node_id), name)

    def hold(self, node_id, op, name, holder, extra):
        """A hold on an object of another node (troupe._objects: holds)."""
        try:
            runtime_call(runtime().hold_object, self._address(node_id), op, name, holder, extra)
        except NotFoundError as e:
            raise ObjectLostError(str(e)) from None


_objects.nodes = _Nodes()


def shutdown() -> None:
    """Disconnects; an embedded cluster is stopped and leaves nothing behind, and the objects this
    process put() are freed."""
    global _session
    with _lock:
        if _session is not None:
            session, _session = _session, None
            session.close()
        if _task_layer is not None:
            _task_layer.reset()
        _shipped.clear()
        _objects.close()


def is_initialized() -> bool:
    """Whether troupe.init() has connected this process."""
    return _session is not None


atexit.register(shutdown)


# The rest of the package (troupe.train, troupe.util, troupe.timeline, _tasks) reaches the cluster
# through runtime(), runtime_call() and PollRef: internal to troupe, but not private to this module.
def runtime() -> Any:
    """This process's `troupe._core.Runtime` (connecting a worker process on first use); raises
    TroupeError before troupe.init()."""
    if _session is None:
        _connect_worker()
    assert _session is not None
    return _session.runtime


def _auto_init():
    """Ray's rule: the first remote(), get(), wait() or put() before init() initialises, with an
    embedded local cluster (or the cluster TROUPE_ADDRESS names, as init() would)."""
    if _session is not None or (os.environ.get("TROUPE_ACTOR_ID") and os.environ.get("TROUPE_ADDRESS")):
        return
    with _lock:
        if _session is None:
            print("(troupe) init() was not called: starting it now, as init() with no arguments would",
                  file=sys.stderr, flush=True)
            init()


def _connect_worker():
    """Inside an actor or task worker, the first cluster call connects it to its cluster."""
    if os.environ.get("TROUPE_ACTOR_ID") and os.environ.get("TROUPE_ADDRESS"):
        init(log_to_driver=False, ignore_reinit_error=True)
    if _session is None:
        raise TroupeError("troupe.init() has not been called")


def runtime_call(fn: Callable[..., T], *args: Any) -> T:
    """Runs a runtime call, turning its errors into Troupe's exceptions."""
    try:
        return fn(*args)
    except TroupeError:
        raise  # already the class of its status code (troupe.exceptions.from_code)
    except RuntimeError as e:
        raise TroupeError(str(e)) from None


# The names tests and benchmarks use.
_runtime = runtime
_call = runtime_call


# ---- Actors ----

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


# The most the runtime's counters and options hold (int32 in the RPC records).
_MAX_INT_OPTION = 2**31 - 1


def _check_int(value, key, least):
    """None, or an integer in [least, 2**31 - 1]: ValueError saying which otherwise (a bigger one
    would reach the runtime's int32 fields as a raw TypeError)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not least <= value <= _MAX_INT_OPTION):
        raise InvalidArgumentError(f"{key} must be an integer in [{least}, {_MAX_INT_OPTION}], not {value!r}")


def _check_name(value, what="actor name"):
    """The one check of a name a user gives (troupe/runtime/names.h, shared with the CLI):
    printable UTF-8 of at most 256 bytes, no control or bidi characters, no '/' (which separates
    a namespace from a name). InvalidArgumentError (a ValueError) saying what is wrong."""
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{what} must be a string, not {value!r}")  # Ray's TypeError for init(namespace=123)
    from . import _core

    # surrogateescape: a lone surrogate becomes bytes that are not UTF-8, which the check names.
    _core.check_name(value.encode("utf-8", "surrogateescape"), what)


def _check_timeout(timeout, what):
    """None (wait for ever) or a finite number of seconds >= 0."""
    if timeout is None:
        return
    import numbers

    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not math.isfinite(timeout) \
            or timeout < 0:
        raise InvalidArgumentError(f"{what}: timeout must be None or a finite number of seconds >= 0, not {timeout!r}")


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


def _check_resources(resources, what):
    """Quantities must be finite and in [0, 1e18]: NaN or inf in a record breaks every reader."""
    for name, qty in resources.items():
        if not name or not math.isfinite(qty) or not 0 <= qty <= 1e18:
            raise InvalidArgumentError(f"{what}: quantity {qty!r} of resource {name!r} is not a finite number in [0, 1e18]")


def _scoped_name(name, namespace=None):
    """The cluster-wide name of `name` in a namespace: the default namespace keeps plain names
    (what C++ actors and the CLI see); others are "NAMESPACE/NAME"."""
    ns = namespace or (_session.namespace if _session is not None else None) or \
        _worker_context.get("namespace") or DEFAULT_NAMESPACE
    return name if ns == DEFAULT_NAMESPACE else f"{ns}/{name}"


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


def _check_retry_exceptions(value):
    if value is None or isinstance(value, bool):
        return
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, type) and issubclass(t, BaseException)
                                                        for t in value):
        raise ArgumentTypeError(f"retry_exceptions must be a bool or a list of exception types, not {value!r}")


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


def _check_call(signature, args, kwargs, what):
    if signature is not None:
        try:
            signature.bind(*args, **kwargs)
        except TypeError as e:
            raise ArgumentTypeError(f"{what}: {e}") from None


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
        session_env = (_session.runtime_env if _session is not None else _worker_context.get("runtime_env"))
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


def _job_id():
    if _session is not None:
        return _session.job_id
    return _worker_context.get("job_id") or ""


def _current_namespace():
    if _session is not None:
        return _session.namespace
    return _worker_context.get("namespace") or DEFAULT_NAMESPACE


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


def cpp_actor(type_name: str, init_args: bytes | str = b"", **options: Any) -> ActorHandle:
    """Starts a built-in C++ actor (e.g. "Counter", "Echo"); its methods take and return bytes."""
    _check_options(options)
    if "num_cpus" not in options:
        options["num_cpus"] = 1  # C++ actors keep holding a CPU by default (the training actors)
    if isinstance(init_args, str):
        init_args = init_args.encode()
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
    if _session is not None:
        _session.runtime.submit(actor_id, "__troupe_terminate__", _serialization.dumps(((), {})))


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


def _wants_retry(exc, retry_exceptions):
    """Whether retry_exceptions (True, or a list of exception types) names `exc`."""
    if not retry_exceptions:
        return False
    return not isinstance(retry_exceptions, (list, tuple)) or isinstance(exc, tuple(retry_exceptions))


class _ExceptionRetry:
    """Sends an actor call again when it raised an exception that retry_exceptions names, within
    the actor's max_task_retries (-1: no limit). Calls lost with a worker are retried by the
    client itself."""

    def __init__(self, send, ref, left, retry_exceptions):
        self.send, self.ref, self.left, self.retry_exceptions = send, ref, left, retry_exceptions

    def died(self, message):
        return False

    def exception(self, exc):
        if self.left == 0 or not _wants_retry(exc, self.retry_exceptions):
            return False
        if self.left > 0:
            self.left -= 1
        self.ref._ref = self.send()
        return True

    def finished(self):
        pass


def _top_level_args(args, kwargs):
    """ObjectRef arguments (positional or keyword): results of calls made here travel as their
    values (the callee gets the value, as Ray's); put() objects travel as refs the callee maps."""
    def resolved(a):
        if not isinstance(a, ObjectRef) or isinstance(a, _StoredRef):
            return a
        if not a._ready() and getattr(_deferring, "on", False):
            raise _Pending(a)
        return _ArgValue(get(a))

    if any(isinstance(a, ObjectRef) for a in args):
        args = tuple(resolved(a) for a in args)
    if any(isinstance(v, ObjectRef) for v in kwargs.values()):
        kwargs = {k: resolved(v) for k, v in kwargs.items()}
    return args, kwargs


class _ArgValue:
    """A resolved top-level argument (unwrapped by the callee's _resolve_args)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        return _identity, (self.value,)


def _identity(value):
    return value


def _split(ref, num_returns):
    if num_returns == 1:
        return ref
    if num_returns == 0:
        return None
    return [_ItemRef(ref, i, num_returns) for i in range(num_returns)]


# ---- Calls whose arguments are not ready yet ----

class _Pending(Exception):
    """Raised while .remote() pickles a call's arguments: `ref` among them is not ready yet."""

    def __init__(self, ref):
        super().__init__()
        self.ref = ref


_deferring = threading.local()  # .on: this thread's .remote() defers on a pending ref
_lending = threading.local()  # .keep: the put() refs this thread's call arguments pickled


@contextlib.contextmanager
def _keeping(ref):
    """Keeps the put() refs pickled into a call's arguments on the call's ref until it is over."""
    _lending.keep = []
    try:
        yield
    finally:
        ref._keep, _lending.keep = _lending.keep or None, None


def _submit(key, ref, send):
    """Sends a call now (send() sets ref._ref), unless an ObjectRef among its arguments is not
    ready yet, or calls with the same key (an actor's) wait already: then the call waits in
    _deferred, .remote() returns at once, and the calls of one key go in the order they were made
    (Ray's rule). Errors other than a pending argument are the caller's, at once."""
    if not _deferred.queues.get(key):
        _deferring.on = True
        try:
            send()
            return
        except _Pending as pending:
            dep = pending.ref
        finally:
            _deferring.on = False
    else:
        dep = None
    _deferred.add(key, ref, dep, send)


class _Deferred:
    """Calls waiting for their arguments: one thread sends each queue's first call once the ref it
    waits on is ready (pickling it again, which may find the next pending ref), then the next.
    A call is popped only once sent, so a .remote() that finds its key's queue empty comes after
    every call queued before it."""

    def __init__(self):
        self.queues = {}  # key -> deque of [ref, the ref it waits on (None: ready to try), send]
        self.cond = threading.Condition()
        self.thread = None
        self.pid = None

    def add(self, key, ref, dep, send):
        with self.cond:
            if self.pid != os.getpid():  # a fork's child has none of its parent's threads
                self.queues, self.thread, self.pid = {}, None, os.getpid()
            self.queues.setdefault(key, collections.deque()).append([ref, dep, send])
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="troupe-deferred-calls", daemon=True)
                self.thread.start()
            self.cond.notify()

    def _run(self):
        while True:
            waiting = []
            with self.cond:
                while not self.queues:
                    self.cond.wait()
                for key in list(self.queues):
                    queue = self.queues[key]
                    while queue:
                        head = queue[0]
                        if head[1] is not None and not head[1]._ready():
                            waiting.append(head[1])
                            break
                        _deferring.on = True
                        try:
                            head[2]()
                        except _Pending as pending:
                            head[1] = pending.ref
                            continue
                        except BaseException as e:  # noqa: B036 (the call's failure is its ref's value)
                            head[0]._value, head[0]._done = e, True
                        finally:
                            _deferring.on = False
                        queue.popleft()
                    if not queue:
                        del self.queues[key]
            if waiting:
                _settle(waiting, 1, 0.05, hook=False)


_deferred = _Deferred()


# ---- Object refs ----

class ObjectRef:
    """The future result of an actor call or task; also what troupe.put() returns."""

    __slots__ = ("_ref", "_handle", "_method", "_value", "_done", "_retry", "_files", "_keep", "__weakref__")

    def __init__(self, ref: int | None, handle: ActorHandle | None, method: str, retry: Any = None) -> None:
        self._ref = ref
        self._handle = handle
        self._method = method
        self._done = False
        self._value = None
        self._retry = retry
        self._files = None  # shared-memory files holding the call's arguments, deleted once it is over
        self._keep = None  # the put() refs among its arguments, kept until it is over (a retry sends them again)

    def _root(self):
        """The call this ref waits for (itself, or the call whose result it is part of)."""
        return self

    def _where(self):
        h = self._handle
        if h is None:
            return self._method
        return f"{h._type[3:] if h._is_python else h._type}.{self._method}"

    def _resolve(self, outcome, data, code=""):
        if outcome == 1:
            if self._handle is None or self._handle._is_python:
                is_exc, value = _serialization.load_reply(data)
                if is_exc:
                    exc, tb = value
                    if self._retry is not None and self._retry.exception(exc):
                        return
                    kind = TaskError if self._handle is None else ActorError
                    self._value = kind.wrap(exc, tb, self._where())
                else:
                    self._value = value
            else:
                self._value = data
        elif outcome == 3:
            message = data.decode(errors="replace")
            if self._retry is not None and self._retry.died(message):
                return
            self._value = ActorDiedError(message) if self._handle is not None else \
                WorkerCrashedError(f"task {self._method}: its worker died: {message}")
        else:
            # A failure with a status code (a C++ actor's INVALID_ARGUMENT, a DEADLINE_EXCEEDED):
            # an ActorError that is also that code's exception (InvalidArgumentError, a ValueError).
            message = data.decode(errors="replace")
            self._value = ActorError.of_code(code, message, self._where()) if code else \
                ActorError(f"{self._where()}: {message}")
        self._done = True
        if self._retry is not None:
            self._retry.finished()
        if self._files:
            _objects.store().unlink(self._files)
        self._keep = None

    def _ready(self):
        return self._done

    def _get_value(self):
        return self._value

    def __reduce__(self):
        # A ref passed inside a container: its value goes to this node's object store.
        if not self._ready() and getattr(_deferring, "on", False):
            raise _Pending(self)
        return _StoredRef._from_value, (get(self),)

    def __copy__(self):
        return self  # one ref, counted once (pickling it would lend it out of band)

    def __deepcopy__(self, memo):
        return self

    def future(self) -> concurrent.futures.Future:
        """A concurrent.futures.Future of the value (or the call's error), as Ray's
        ObjectRef.future(). A thread of its own waits for it: nothing else blocks."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def settle():
            try:
                fut.set_result(get(self))
            except BaseException as e:  # noqa: B036 (the call's failure, whatever it is, is the future's)
                fut.set_exception(e)

        if self._ready():
            settle()
        else:
            threading.Thread(target=settle, name="troupe-ref-future", daemon=True).start()
        return fut

    def as_future(self) -> asyncio.Future:
        """An asyncio future of the value in the running event loop, as Ray's as_future(): `await
        ref.as_future()`, or `await ref`, waits without blocking the loop (an async actor's
        other calls go on meanwhile)."""
        return asyncio.wrap_future(self.future())

    def __await__(self):
        return self.as_future().__await__()

    def __repr__(self):
        return f"ObjectRef({self._where()}#{self._ref})"


class _ItemRef(ObjectRef):
    """Result i of a call with num_returns=n."""

    __slots__ = ("_parent", "_index", "_count")

    def __init__(self, parent, index, count):
        super().__init__(None, parent._handle, parent._method)
        self._parent, self._index, self._count = parent, index, count

    def _root(self):
        return self._parent

    def _ready(self):
        return self._parent._done

    def _get_value(self):
        value = self._parent._value
        if isinstance(value, BaseException):
            return value
        try:
            items = tuple(value)
        except TypeError:
            items = None
        if items is None or len(items) != self._count:
            return ActorError(f"{self._where()} was declared with num_returns={self._count} but returned "
                              f"{type(value).__name__}" + ("" if items is None else f" of length {len(items)}"))
        return items[self._index]

    def __repr__(self):
        return f"ObjectRef({self._where()}#{self._parent._ref}[{self._index}])"


class _StoredRef(ObjectRef):
    """An object in this machine's shared-memory store (troupe.put, or a ref passed by value)."""

    __slots__ = ("_object_id", "_host", "_owner", "_size", "_counted", "_borrowed", "_cluster")

    def __init__(self, object_id, host, owner, size, counted, cluster=None):
        super().__init__(None, None, "put")
        self._object_id, self._host, self._owner, self._size = object_id, host, owner, size
        self._counted = counted  # one of its owner's refs
        self._borrowed = False  # one of a borrower's refs (counted in troupe._objects)
        self._cluster = cluster  # _cluster_tag() of the process that put it
        self._done = True
        if counted:
            _objects.store().ref_added(object_id)

    @classmethod
    def _arrive(cls, object_id, host, owner, size, cluster, lent):
        """A ref sent by another process (see _objects: holds)."""
        ref = cls(object_id, host, owner, size, False, cluster)
        if lent is None:
            return ref  # an object not held: it lives until its owner exits
        if _objects.store().hold(object_id, host, lent):
            ref._borrowed = True
        else:
            ref._counted = True  # back at its owner, which hold() counted
        return ref

    @classmethod
    def _from_value(cls, value):
        store = _objects.store()
        object_id, size = store.put(value)
        return cls(object_id, store.host, store.pid, size, True, _cluster_tag())

    def _get_value(self):
        here = _cluster_tag()
        if self._cluster is not None and here is not None and self._cluster != here:
            # Machines' stores are shared by every cluster of a user: without this, a ref of
            # another cluster would read that cluster's object.
            return InvalidArgumentError(f"{self!r} was put() in another cluster ({self._cluster}) than this "
                                        f"process's ({here}): pass values between clusters, not refs")
        try:
            return _objects.store().get(self._object_id, self._host, self._owner, self._size)
        except BaseException as e:  # returned, so that get() raises it like a call's error
            return e

    def __reduce__(self):
        lent = _objects.store().lend(self._object_id, self._host, pin=not _objects.pickling_ours())
        keep = getattr(_lending, "keep", None)
        if keep is not None:
            keep.append(self)
        return _StoredRef._arrive, (self._object_id, self._host, self._owner, self._size, self._cluster, lent)

    def __del__(self):
        try:
            if self._counted:
                _objects.store().ref_dropped(self._object_id)
            elif self._borrowed:
                _objects.store().unhold(self._object_id, self._host)
        except Exception:
            pass

    def hex(self):
        return self._object_id

    def __repr__(self):
        return f"ObjectRef(put:{self._object_id}, {self._size} bytes)"


class PollRef(ObjectRef):
    """A ref whose value comes from polling a condition (placement group ready)."""

    __slots__ = ("_poll",)

    def __init__(self, what, poll):
        super().__init__(None, None, what)
        self._poll = poll

    def _ready(self):
        if not self._done:
            done, value = self._poll()
            if done:
                self._value, self._done = value, True
        return self._done


def _tag_of(token):
    import hashlib
    import hmac

    return hmac.new(token.encode(), b"troupe cluster tag", hashlib.sha256).hexdigest()[:16]


def _cluster_tag():
    """Which cluster this process belongs to, as put() refs carry it: an HMAC of the cluster token
    (which it does not show); None in a process that knows no cluster."""
    if _session is not None:
        return getattr(_session, "cluster_tag", None)
    token = os.environ.get("TROUPE_TOKEN")  # a worker that has not connected yet
    return _tag_of(token) if token else None


def put(value: Any) -> ObjectRef:
    """Stores `value` in this machine's object store; returns an ObjectRef to pass to calls and
    tasks (by ref, without copying it again) or to get()."""
    if isinstance(value, ObjectRef):
        raise ArgumentTypeError("put() of an ObjectRef is not allowed: pass the ref itself")
    _auto_init()  # before the store is chosen: the node's directory, once connected
    return _StoredRef._from_value(value)


# How long one wait runs before Python checks for Ctrl-C (the wait itself releases the GIL).
_WAIT_SLICE = 0.5
# A get() still waiting after this long says what it waits for, once.
_SLOW_GET_NOTICE = 10.0


# Set in a task worker: called before a get() or wait() blocks (see _worker._Drainer).
_blocking_hook = None


_take_lock = threading.RLock()


def _collect(rt, root):
    """Takes a finished call's result into its ref, once: threads that wait on the same ref (a
    future's, the deferred calls', the caller's) may all see it done."""
    with _take_lock:
        if not root._done and root._ref is not None:
            root._resolve(*rt.take(root._ref))


def _settle(refs, need, timeout, hook=True):
    """Waits until `need` of refs are ready, or the timeout passes (returns False then). hook:
    this thread may run a task (a worker's queue goes to another thread while it waits)."""
    deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
    started, noticed = time.monotonic(), not hook
    hooked = not hook
    while True:
        ready = sum(1 for r in refs if r._ready())
        if ready >= need:
            return True
        if not hooked and _blocking_hook is not None:
            hooked = True
            _blocking_hook()
        roots = {}
        polling = False
        for r in refs:
            if not r._ready():
                root = r._root()
                if root._ref is None:
                    polling = True
                else:
                    roots[root._ref] = root
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return False
        left = _WAIT_SLICE if deadline is None else min(_WAIT_SLICE, deadline - now)
        if polling:
            left = min(left, 0.05)
        if roots:
            rt = runtime()
            ids = list(roots)
            for done in rt.wait(ids, min(len(ids), need - ready), left):
                _collect(rt, roots[done])
        else:
            time.sleep(left)
        if not noticed and timeout is None and time.monotonic() - started > _SLOW_GET_NOTICE:
            noticed = True
            why = _pending_reasons([r for r in refs if not r._ready()])
            if why:
                print(f"(troupe) still waiting after {_SLOW_GET_NOTICE:.0f} s: {why}", file=sys.stderr, flush=True)


def _pending_reasons(refs):
    """Why calls wait: the actors among theirs that are not ALIVE, with the controller's reason."""
    seen, reasons = set(), []
    for r in refs:
        h = r._root()._handle
        if h is None or h._id in seen:
            continue
        seen.add(h._id)
        try:
            info = runtime().actor_info(h._id)
        except Exception:
            continue
        if info["state"] != "ALIVE":
            reasons.append(f"actor {h._type[3:] if h._is_python else h._type} ({h._id[:8]}) is {info['state']}"
                           + (f": {info['death_reason']}" if info["death_reason"] else ""))
    return "; ".join(reasons)


def _value_of(r):
    value = r._get_value()
    if isinstance(value, BaseException):
        raise value
    return value


@overload
def get(refs: ObjectRef, timeout: float | None = None) -> Any: ...
@overload
def get(refs: Iterable[ObjectRef], timeout: float | None = None) -> list[Any]: ...


def get(refs: ObjectRef | Iterable[ObjectRef], timeout: float | None = None) -> Any:
    """The value of an ObjectRef (or a list of them), raising the call's error if it failed."""
    _check_timeout(timeout, "get()")
    if _session is None:
        _auto_init()
    if type(refs) is ObjectRef and refs._retry is None and refs._ref is not None:  # the common synchronous case
        if not refs._done:
            rt = runtime()
            if _blocking_hook is not None:
                _blocking_hook()
            if rt.wait([refs._ref], 1, _WAIT_SLICE if timeout is None else min(float(timeout), _WAIT_SLICE)):
                _collect(rt, refs)
            elif not _settle([refs], 1, None if timeout is None else max(0.0, float(timeout) - _WAIT_SLICE)):
                raise _timeout_error(timeout, [refs], 1)
        if isinstance(refs._value, BaseException):
            raise refs._value
        return refs._value
    single = isinstance(refs, ObjectRef)
    batch = [refs] if isinstance(refs, ObjectRef) else list(refs)
    for r in batch:
        if not isinstance(r, ObjectRef):
            raise ArgumentTypeError(f"get() takes ObjectRefs, not {type(r).__name__}")
    if not _settle(batch, len(batch), timeout):
        raise _timeout_error(timeout, batch, len(batch))
    values = [_value_of(r) for r in batch]
    return values[0] if single else values


def _timeout_error(timeout, refs, total):
    missing = [r for r in refs if not r._ready()]
    why = _pending_reasons(missing)
    return GetTimeoutError(f"get() timed out after {timeout} s with {len(missing)} of {total} result(s) missing"
                           + (f"; {why}" if why else ""))


def wait(refs: Iterable[ObjectRef], num_returns: int = 1, timeout: float | None = None,
         fetch_local: bool = True) -> tuple[list[ObjectRef], list[ObjectRef]]:
    """(ready, not_ready): returns once num_returns refs are done or timeout passes."""
    _check_timeout(timeout, "wait()")
    if _session is None:
        _auto_init()
    if isinstance(refs, ObjectRef):
        raise ArgumentTypeError("wait() expects a list of ObjectRefs, not one ObjectRef")
    refs = list(refs)
    for r in refs:
        if not isinstance(r, ObjectRef):
            raise ArgumentTypeError(f"wait() takes ObjectRefs, not {type(r).__name__}")
    if not refs:
        return [], []
    if len(set(map(id, refs))) != len(refs):
        raise InvalidArgumentError("wait() expects a list of unique ObjectRefs")
    if num_returns > len(refs):
        raise InvalidArgumentError(f"num_returns ({num_returns}) is larger than the number of refs ({len(refs)})")
    if num_returns <= 0:
        raise InvalidArgumentError(f"num_returns must be at least 1, not {num_returns}")
    _settle(refs, num_returns, timeout)
    ready = [r for r in refs if r._ready()][:num_returns]
    ready_ids = {id(r) for r in ready}
    return ready, [r for r in refs if id(r) not in ready_ids]


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


def get_runtime_context() -> _RuntimeContext:
    """What this process knows about where it runs (job id, namespace, actor id)."""
    return _RuntimeContext()


class _RuntimeContext:
    @property
    def namespace(self) -> str:
        return _current_namespace()

    def get_job_id(self) -> str:
        return _job_id()

    def get_actor_id(self) -> str | None:
        return os.environ.get("TROUPE_ACTOR_ID")

    def get_node_id(self) -> str | None:
        """The node this worker runs on (None in a driver, which is not a node's process)."""
        return os.environ.get("TROUPE_NODE_ID")

    def get(self) -> dict[str, Any]:
        """Ray's RuntimeContext.get(): the context as a dict."""
        return {"job_id": self.get_job_id(), "node_id": self.get_node_id(), "namespace": self.namespace,
                "actor_id": self.get_actor_id()}


def nodes() -> list[dict[str, Any]]:
    """The cluster's nodes as dicts (id, address, state, resources, used, ...)."""
    return runtime_call(runtime().nodes)


def cluster_resources() -> dict[str, float]:
    """Total resources of the alive nodes."""
    total: dict[str, float] = {}
    for n in nodes():
        if n["state"] == "ALIVE":
            for k, v in n["resources"].items():
                total[k] = total.get(k, 0.0) + v
    return total


def available_resources() -> dict[str, float]:
    """Resources of the alive nodes not held by actors or placement groups."""
    free: dict[str, float] = {}
    for n in nodes():
        if n["state"] == "ALIVE":
            for k, v in n["resources"].items():
                free[k] = free.get(k, 0.0) + max(0.0, v - n["used"].get(k, 0.0))
    return free


def actors() -> list[dict[str, Any]]:
    """Every actor the cluster knows, as dicts (id, type, name, state, restarts, death_reason)."""
    return runtime_call(runtime().status)["actors"]
