"""The driver API: init/shutdown, @remote actors, get/wait/kill, named actors, cluster views."""
import atexit
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from . import _serialization
from .exceptions import ActorDiedError, ActorError, GetTimeoutError, TroupeError, UnauthenticatedError, UnavailableError

_lock = threading.RLock()
_session = None


class _Session:
    """One driver's connection, and the embedded cluster it owns, if any."""

    def __init__(self, runtime, address, cluster_process=None, run_root=None, log_to_driver=True):
        self.runtime = runtime
        self.address = address
        self.cluster_process = cluster_process
        self.run_root = run_root
        self.closing = threading.Event()
        self.printer = None
        self.output = _OutputPrinter()
        if log_to_driver:
            self.printer = threading.Thread(target=_print_actor_output, args=(self,), daemon=True,
                                            name="troupe-actor-output")
            self.printer.start()

    def close(self):
        self.closing.set()
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


def _read_cluster_file(run_root):
    latest = os.path.join(run_root, "latest")
    with open(os.path.join(latest, "cluster.json")) as f:
        return json.load(f)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_embedded(num_cpus, resources):
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


def init(address=None, *, token=None, num_cpus=None, resources=None, ignore_reinit_error=False, log_to_driver=True):
    """Connects this driver to a cluster.

    address=None starts an embedded local cluster owned by this driver (stopped by shutdown()
    or at exit), unless TROUPE_ADDRESS names a cluster (a job's driver runs with it set); "auto" attaches to the cluster started by `troupe start --head` on this
    machine; "HOST:PORT" attaches to that controller (token from `token=`, TROUPE_TOKEN, or
    this machine's run directory). Fails within 10 s with ConnectionError if unreachable.
    With log_to_driver, the output of the actors this driver creates is printed here,
    prefixed with "(Class pid=N)".
    """
    global _session
    from . import _core

    with _lock:
        if _session is not None:
            if ignore_reinit_error:
                return
            raise TroupeError("troupe.init() was already called; call troupe.shutdown() first")
        proc = run_root = None
        if address is None and os.environ.get("TROUPE_ADDRESS"):
            address = os.environ["TROUPE_ADDRESS"]  # a job's driver, or a user's choice, as RAY_ADDRESS
        if address is None:
            proc, run_root = _start_embedded(num_cpus, resources)
            cluster = _read_cluster_file(run_root)
            address, token = cluster["controller_address"], cluster["token"]
        else:
            root = os.environ.get("TROUPE_TEMP_DIR", "/tmp/troupe")
            local = None
            try:
                local = _read_cluster_file(root)
            except (OSError, ValueError):
                pass
            if address == "auto":
                if local is None:
                    raise ConnectionError(f"no running Troupe cluster found under {root}; start one with "
                                          "`troupe start --head` or pass an address")
                address = local["controller_address"]
            token = token or os.environ.get("TROUPE_TOKEN")
            if not token and local and local["controller_address"] == address:
                token = local["token"]
            if not token:
                raise ValueError(f"no cluster token for {address}: pass token= or set TROUPE_TOKEN")
        try:
            runtime = _core.Runtime(address, token)
        except UnauthenticatedError:  # reached, but the token is not this cluster's (a PermissionError)
            if proc is not None:
                _stop_embedded(proc)
            raise
        except (ValueError, TroupeError) as e:
            if proc is not None:
                _stop_embedded(proc)
            raise UnavailableError(f"cannot reach the Troupe cluster at {address}: {e}") from None
        _session = _Session(runtime, address, proc, run_root, log_to_driver)


def shutdown():
    """Disconnects; an embedded cluster is stopped and leaves nothing behind."""
    global _session
    with _lock:
        if _session is not None:
            session, _session = _session, None
            session.close()


def is_initialized():
    return _session is not None


atexit.register(shutdown)


def _runtime():
    if _session is None:
        raise TroupeError("troupe.init() has not been called")
    return _session.runtime


def _call(fn, *args):
    """Runs a runtime call, turning its errors into Troupe's exceptions."""
    try:
        return fn(*args)
    except TroupeError:
        raise  # already the class of its status code (troupe.exceptions.from_code)
    except RuntimeError as e:
        raise TroupeError(str(e)) from None


# ---- Actors ----

_OPTION_NAMES = {"num_cpus", "num_gpus", "memory", "resources", "name", "max_restarts", "max_task_retries",
                 "lifetime", "placement_group", "bundle_index"}


def _check_options(options):
    unknown = set(options) - _OPTION_NAMES
    if unknown:
        raise TypeError(f"unknown actor option(s) {sorted(unknown)}; known: {sorted(_OPTION_NAMES)}")
    lifetime = options.get("lifetime")
    if lifetime not in (None, "detached"):
        raise ValueError(f"lifetime must be None or 'detached', not {lifetime!r}")


def _demand(options):
    resources = {"CPU": float(options.get("num_cpus", 1))}
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
            raise ValueError(f"{what}: quantity {qty!r} of resource {name!r} is not a finite number in [0, 1e18]")


def _create(type_name, init_args, options):
    rt = _runtime()
    pg = options.get("placement_group")
    actor_id = _call(rt.create_actor, type_name, options.get("name") or "", _demand(options),
                     int(options.get("max_restarts", 0)), int(options.get("max_task_retries", 0)),
                     options.get("lifetime") == "detached", init_args, pg or "", int(options.get("bundle_index", -1)))
    return ActorHandle(actor_id, type_name)


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


class ActorClass:
    """A class made remote with @troupe.remote. `Cls.remote(*args)` starts an actor."""

    def __init__(self, cls, options):
        _check_options(options)
        self._cls = cls
        self._options = dict(options)
        self.__name__ = cls.__name__
        self.__doc__ = cls.__doc__

    def options(self, **options):
        merged = dict(self._options)
        merged.update(options)
        return ActorClass(self._cls, merged)

    def remote(self, *args, **kwargs):
        _by_value(self._cls)
        init_args = _serialization.dumps((self._cls, args, kwargs))
        return _create("py:" + self._cls.__qualname__, init_args, self._options)

    def __call__(self, *args, **kwargs):
        raise TypeError(f"actor class {self.__name__} cannot be instantiated directly; use "
                        f"{self.__name__}.remote(...)")


def remote(*args, **options):
    """@troupe.remote or @troupe.remote(num_cpus=, resources=, name=, max_restarts=,
    max_task_retries=, lifetime=) on a class."""
    if len(args) == 1 and not options and isinstance(args[0], type):
        return ActorClass(args[0], {})
    if args:
        raise TypeError("@troupe.remote takes keyword options only, or decorates a class directly")

    def wrap(cls):
        if not isinstance(cls, type):
            raise TypeError("@troupe.remote decorates classes (actors); remote functions are not supported")
        return ActorClass(cls, options)

    return wrap


def cpp_actor(type_name, init_args=b"", **options):
    """Starts a built-in C++ actor (e.g. "Counter", "Echo"); its methods take and return bytes."""
    _check_options(options)
    if isinstance(init_args, str):
        init_args = init_args.encode()
    return _create(type_name, init_args, options)


class ActorHandle:
    """A handle to an actor: `handle.method.remote(*args)` returns an ObjectRef. Handles can be
    passed to other actors and survive restarts."""

    def __init__(self, actor_id, type_name):
        self._id = actor_id
        self._type = type_name

    @property
    def actor_id(self):
        return self._id

    @property
    def _is_python(self):
        return self._type.startswith("py:")

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return ActorMethod(self, name)

    def __reduce__(self):
        return ActorHandle, (self._id, self._type)

    def __repr__(self):
        return f"ActorHandle({self._type}, {self._id})"


class ActorMethod:
    def __init__(self, handle, name):
        self._handle = handle
        self._name = name

    def remote(self, *args, **kwargs):
        h = self._handle
        if h._is_python:
            payload = _serialization.dumps((args, kwargs))
        else:
            if kwargs or len(args) > 1:
                raise TypeError(f"{h._type}.{self._name} is a C++ actor method: pass one bytes or str payload")
            payload = args[0] if args else b""
            if isinstance(payload, str):
                payload = payload.encode()
        ref = _call(_runtime().submit, h._id, self._name, payload)
        return ObjectRef(ref, h, self._name)


class ObjectRef:
    """The future result of an actor call."""

    __slots__ = ("_ref", "_handle", "_method", "_value", "_done")

    def __init__(self, ref, handle, method):
        self._ref = ref
        self._handle = handle
        self._method = method
        self._done = False
        self._value = None

    def _where(self):
        h = self._handle
        return f"{h._type[3:] if h._is_python else h._type}.{self._method}"

    def _resolve(self, outcome, data):
        if outcome == 1:
            if self._handle._is_python:
                is_exc, value = _serialization.load_reply(data)
                if is_exc:
                    exc, tb = value
                    self._value = ActorError.wrap(exc, tb, self._where())
                else:
                    self._value = value
            else:
                self._value = data
        elif outcome == 3:
            self._value = ActorDiedError(data.decode(errors="replace"))
        else:
            self._value = ActorError(f"{self._where()}: {data.decode(errors='replace')}")
        self._done = True

    def __repr__(self):
        return f"ObjectRef({self._handle._type}.{self._method}#{self._ref})"


def _collect(refs, timeout):
    pending = [r for r in refs if not r._done]
    if pending:
        ids = [r._ref for r in pending]
        done = set(_runtime().wait(ids, len(ids), -1.0 if timeout is None else float(timeout)))
        for r in pending:
            if r._ref in done:
                outcome, data = _runtime().take(r._ref)
                r._resolve(outcome, data)
        if any(not r._done for r in refs):
            raise GetTimeoutError(f"get() timed out after {timeout} s with "
                                  f"{sum(not r._done for r in refs)} of {len(refs)} result(s) missing")


def get(refs, timeout=None):
    """The value of an ObjectRef (or a list of them), raising the call's error if it failed."""
    if type(refs) is ObjectRef:  # the common synchronous case, without the list handling
        if not refs._done:
            rt = _runtime()
            if rt.wait([refs._ref], 1, -1.0 if timeout is None else float(timeout)):
                refs._resolve(*rt.take(refs._ref))
            else:
                raise GetTimeoutError(f"get() timed out after {timeout} s with 1 of 1 result(s) missing")
        if isinstance(refs._value, BaseException):
            raise refs._value
        return refs._value
    single = isinstance(refs, ObjectRef)
    batch = [refs] if single else list(refs)
    for r in batch:
        if not isinstance(r, ObjectRef):
            raise TypeError(f"get() takes ObjectRefs, not {type(r).__name__}")
    _collect(batch, timeout)
    values = []
    for r in batch:
        if isinstance(r._value, BaseException):
            raise r._value
        values.append(r._value)
    return values[0] if single else values


def wait(refs, num_returns=1, timeout=None):
    """(ready, not_ready): returns once num_returns refs are done or timeout passes."""
    refs = list(refs)
    if num_returns > len(refs):
        raise ValueError(f"num_returns ({num_returns}) is larger than the number of refs ({len(refs)})")
    pending = [r for r in refs if not r._done]
    if pending:
        need = max(0, num_returns - (len(refs) - len(pending)))
        done = set(_runtime().wait([r._ref for r in pending], need, -1.0 if timeout is None else float(timeout)))
        for r in pending:
            if r._ref in done:
                r._resolve(*_runtime().take(r._ref))
    ready = [r for r in refs if r._done][:max(num_returns, 0)] if num_returns else []
    ready_ids = {id(r) for r in ready}
    return ready, [r for r in refs if id(r) not in ready_ids]


def kill(handle, no_restart=True):
    """Kills the actor's worker; with no_restart it is DEAD afterwards."""
    _call(_runtime().kill, handle._id, bool(no_restart))


def get_actor(name):
    """The handle of the live actor named `name` (from any driver)."""
    actor_id, type_name = _call(_runtime().get_actor, name)
    return ActorHandle(actor_id, type_name)


def nodes():
    """The cluster's nodes as dicts (id, address, state, resources, used, ...)."""
    return _call(_runtime().nodes)


def cluster_resources():
    """Total resources of the alive nodes."""
    total = {}
    for n in nodes():
        if n["state"] == "ALIVE":
            for k, v in n["resources"].items():
                total[k] = total.get(k, 0.0) + v
    return total


def actors():
    """Every actor the cluster knows, as dicts (id, type, name, state, restarts, death_reason)."""
    return _call(_runtime().status)["actors"]
