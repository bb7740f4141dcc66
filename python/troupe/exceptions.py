"""Errors a Troupe driver sees."""
from __future__ import annotations

__all__ = ["AbortedError", "ActorDiedError", "ActorError", "ActorExit", "ActorNotFoundError", "AlreadyExistsError",
           "ArgumentTypeError",
           "DeadlineExceededError", "FailedPreconditionError", "GetTimeoutError", "InternalError",
           "InvalidArgumentError", "NotFoundError", "ObjectLostError", "ResourceExhaustedError", "TaskError",
           "TroupeError", "UnauthenticatedError", "UnavailableError", "WorkerCrashedError", "from_code"]


class TroupeError(Exception):
    """Base class of Troupe's errors."""

    code: str  # an error raised from a runtime status carries its code (see from_code)


class ActorError(TroupeError):
    """An actor method raised. Instances are also instances of the original exception's type
    (see `ActorError.wrap`), so `except ValueError` catches a remote ValueError; the remote
    traceback is in `remote_traceback` and in the message."""

    def __init__(self, message: str, remote_traceback: str = "", cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.remote_traceback = remote_traceback
        self.cause = cause

    @classmethod
    def wrap(cls, cause: BaseException, remote_traceback: str, where: str) -> ActorError:
        """An exception that is both a `cls` (ActorError or TaskError) and of type(cause)."""
        if isinstance(cause, cls):  # raised again by a caller in between: keep the innermost
            return cause
        message = f"{where} raised {type(cause).__name__}: {cause}\n\nRemote traceback:\n{remote_traceback}"
        return cls._also(cause, message, remote_traceback)

    @classmethod
    def of_code(cls, code: str, message: str, where: str) -> ActorError:
        """A call that failed with a runtime status code: an ActorError that is also the code's
        exception type (from_code), with `code` set."""
        cause = from_code(code, message)
        err = cls(f"{where}: {message}") if type(cause) is TroupeError else cls._also(cause, f"{where}: {message}", "")
        err.code = code
        return err

    @classmethod
    def _also(cls, cause: BaseException, message: str, remote_traceback: str) -> ActorError:
        """A `cls` that is also of type(cause), saying `message`."""
        base = type(cause)
        try:
            return type(f"{cls.__name__}({base.__name__})", (cls, base), {
                "__init__": lambda self, *a: ActorError.__init__(self, message, remote_traceback, cause),
                "__str__": lambda self: message,
                "__reduce__": lambda self: (cls, (message, remote_traceback)),
            })()
        except TypeError:  # a type that cannot be subclassed (e.g. with __slots__ conflicts)
            return cls(message, remote_traceback, cause)


class TaskError(ActorError):
    """A remote function raised; like ActorError, also an instance of the original type."""


class ActorDiedError(TroupeError):
    """The actor is dead (or died during the call); the message says why: exit code or signal,
    its last stderr lines, or the node's death."""


class GetTimeoutError(TroupeError, TimeoutError):
    """`troupe.get(..., timeout=)` ran out of time."""


# Errors from the runtime carry a status code (runtime/base/include/troupe/runtime/status.h) across
# the RPC edge; each code has its class here, raised by _core from the code, never from the text.
# Each is also an instance of the matching built-in exception, so `except TimeoutError` works.
class InvalidArgumentError(TroupeError, ValueError):
    """Bad input (an argument, an option, a quantity)."""


class ArgumentTypeError(TroupeError, TypeError):
    """An argument of the wrong type (code INVALID_ARGUMENT), raised by the extension modules."""


class NotFoundError(TroupeError, LookupError):
    """No such node, actor, group, session or file."""


class AlreadyExistsError(TroupeError):
    """A name or port is taken."""


class UnavailableError(TroupeError, ConnectionError):
    """A peer, Redis or the controller cannot be reached."""


class UnauthenticatedError(TroupeError, PermissionError):
    """Wrong or missing cluster token."""


class DeadlineExceededError(TroupeError, TimeoutError):
    """A wait ran out of time."""


class FailedPreconditionError(TroupeError):
    """The system is not in a state that allows the call."""


class ResourceExhaustedError(TroupeError):
    """No memory, disk or cluster resources."""


class AbortedError(TroupeError):
    """The operation was cancelled (an epoch bump, a shutdown)."""


class InternalError(TroupeError):
    """A broken invariant or an unexpected reply: a bug to report."""


_BY_CODE = {
    "INVALID_ARGUMENT": InvalidArgumentError,
    "NOT_FOUND": NotFoundError,
    "ALREADY_EXISTS": AlreadyExistsError,
    "UNAVAILABLE": UnavailableError,
    "UNAUTHENTICATED": UnauthenticatedError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "FAILED_PRECONDITION": FailedPreconditionError,
    "RESOURCE_EXHAUSTED": ResourceExhaustedError,
    "ABORTED": AbortedError,
    "INTERNAL": InternalError,
    "ACTOR_DIED": ActorDiedError,
}


for _code, _cls in _BY_CODE.items():
    _cls.code = _code  # a class's instances say their code, however they were raised
ArgumentTypeError.code = "INVALID_ARGUMENT"


def from_code(code: str, message: str) -> TroupeError:
    """The exception for a runtime status code (called by _core)."""
    cls = _BY_CODE.get(code, TroupeError)
    err = cls(message)
    err.code = code
    return err


class ObjectLostError(TroupeError):
    """An object cannot be read: its owner died or freed it, or it lives on another host."""


class ObjectStoreFullError(ResourceExhaustedError):
    """A put() (or a result, or an argument) does not fit in its node's object store, even after
    spilling what could be spilled (Ray's ObjectStoreFullError)."""


class WorkerCrashedError(TroupeError):
    """The worker running a task died (and the task's retries are spent); the message says why."""


class ActorExit(BaseException):
    """Raised by troupe.exit_actor() inside an actor: ends it once the current call is done. A
    BaseException, so that `except Exception` in the actor's code does not swallow it."""


class ActorNotFoundError(NotFoundError, ValueError):
    """get_actor() found no live actor by that name (a ValueError, as in Ray)."""
