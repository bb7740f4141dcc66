"""The driver's session and its launcher: init() (an embedded cluster or an existing one),
shutdown(), runtime() and runtime_call() (how the rest of the package reaches the cluster), and
the cluster views (nodes, resources, actors, the runtime context). The bottom of the Python API:
refs (troupe._refs) and actors (troupe._remote) are built on it."""
from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any, Callable, TypeVar

from . import _objects
from ._checks import _check_name, _check_resources, _check_runtime_env
from .exceptions import (NotFoundError, ObjectLostError, TroupeError, UnauthenticatedError, UnavailableError,
                         ArgumentTypeError, InvalidArgumentError)

_lock = threading.RLock()
current: _Session | None = None  # this process's connection (init() to shutdown())
# What a worker process knows of the job that started it (set by troupe._worker).
_worker_context: dict[str, Any] = {}
DEFAULT_NAMESPACE = "default"
# What the layers above forget at shutdown() (their task pools, their shipped modules): each
# adds its hook here when imported.
on_shutdown: list[Callable[[], None]] = []
T = TypeVar("T")


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
    global current
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
        if current is not None:
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
        current = _Session(rt, address, proc, run_root, log_to_driver, ctx.get("job_id") or secrets.token_hex(8),
                            namespace or ctx.get("namespace"),
                            runtime_env if runtime_env is not None else ctx.get("runtime_env"))
        current.cluster_tag = _tag_of(token)
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
    global current
    with _lock:
        if current is not None:
            session, current = current, None
            session.close()
        for hook in on_shutdown:
            hook()
        _objects.close()


def is_initialized() -> bool:
    """Whether troupe.init() has connected this process."""
    return current is not None


atexit.register(shutdown)


# The rest of the package (troupe.train, troupe.util, troupe.timeline, _tasks) reaches the cluster
# through runtime() and runtime_call() (and troupe._refs.PollRef): internal to troupe, not private here.
def runtime() -> Any:
    """This process's `troupe._core.Runtime` (connecting a worker process on first use); raises
    TroupeError before troupe.init()."""
    if current is None:
        _connect_worker()
    assert current is not None
    return current.runtime


def _auto_init():
    """Ray's rule: the first remote(), get(), wait() or put() before init() initialises, with an
    embedded local cluster (or the cluster TROUPE_ADDRESS names, as init() would)."""
    if current is not None or (os.environ.get("TROUPE_ACTOR_ID") and os.environ.get("TROUPE_ADDRESS")):
        return
    with _lock:
        if current is None:
            print("(troupe) init() was not called: starting it now, as init() with no arguments would",
                  file=sys.stderr, flush=True)
            init()


def _connect_worker():
    """Inside an actor or task worker, the first cluster call connects it to its cluster."""
    if os.environ.get("TROUPE_ACTOR_ID") and os.environ.get("TROUPE_ADDRESS"):
        init(log_to_driver=False, ignore_reinit_error=True)
    if current is None:
        raise TroupeError("troupe.init() has not been called")


def runtime_call(fn: Callable[..., T], *args: Any) -> T:
    """Runs a runtime call, turning its errors into Troupe's exceptions."""
    try:
        return fn(*args)
    except TroupeError:
        raise  # already the class of its status code (troupe.exceptions.from_code)
    except RuntimeError as e:
        raise TroupeError(str(e)) from None



def _scoped_name(name, namespace=None):
    """The cluster-wide name of `name` in a namespace: the default namespace keeps plain names
    (what C++ actors and the CLI see); others are "NAMESPACE/NAME"."""
    ns = namespace or (current.namespace if current is not None else None) or \
        _worker_context.get("namespace") or DEFAULT_NAMESPACE
    return name if ns == DEFAULT_NAMESPACE else f"{ns}/{name}"


def _job_id():
    if current is not None:
        return current.job_id
    return _worker_context.get("job_id") or ""


def _current_namespace():
    if current is not None:
        return current.namespace
    return _worker_context.get("namespace") or DEFAULT_NAMESPACE


def _tag_of(token):
    import hashlib
    import hmac

    return hmac.new(token.encode(), b"troupe cluster tag", hashlib.sha256).hexdigest()[:16]


def _cluster_tag():
    """Which cluster this process belongs to, as put() refs carry it: an HMAC of the cluster token
    (which it does not show); None in a process that knows no cluster."""
    if current is not None:
        return getattr(current, "cluster_tag", None)
    token = os.environ.get("TROUPE_TOKEN")  # a worker that has not connected yet
    return _tag_of(token) if token else None


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
