"""Object refs and get/wait/put: the futures of actor calls and tasks, the objects put() stores,
and the calls that wait for an argument that is not ready yet (sent in order once it is).
Built on the session (troupe._session); actors (troupe._remote) and tasks (troupe._tasks) make
their refs here."""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any, overload

from . import _objects, _serialization, _session
from ._checks import _check_timeout
from ._session import _auto_init, _cluster_tag, runtime
from .exceptions import (ActorDiedError, ActorError, ArgumentTypeError, GetTimeoutError, InvalidArgumentError,
                         TaskError, WorkerCrashedError)

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


class ObjectRef:
    """The future result of an actor call or task; also what troupe.put() returns."""

    __slots__ = ("_ref", "_handle", "_method", "_value", "_done", "_retry", "_files", "_keep", "__weakref__")

    def __init__(self, ref: int | None, handle: Any, method: str, retry: Any = None) -> None:
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
    if _session.current is None:
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
    if _session.current is None:
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
