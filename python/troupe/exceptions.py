"""Errors a Troupe driver sees."""


class TroupeError(Exception):
    """Base class of Troupe's errors."""


class ActorError(TroupeError):
    """An actor method raised. Instances are also instances of the original exception's type
    (see `ActorError.wrap`), so `except ValueError` catches a remote ValueError; the remote
    traceback is in `remote_traceback` and in the message."""

    def __init__(self, message, remote_traceback="", cause=None):
        super().__init__(message)
        self.remote_traceback = remote_traceback
        self.cause = cause

    @staticmethod
    def wrap(cause, remote_traceback, where):
        """An exception that is both an ActorError and of type(cause)."""
        base = type(cause)
        message = f"{where} raised {base.__name__}: {cause}\n\nRemote traceback:\n{remote_traceback}"
        try:
            cls = type(f"ActorError({base.__name__})", (ActorError, base), {
                "__init__": lambda self, *a: ActorError.__init__(self, message, remote_traceback, cause),
                "__str__": lambda self: message,
                "__reduce__": lambda self: (ActorError, (message, remote_traceback)),
            })
            return cls()
        except TypeError:  # a type that cannot be subclassed (e.g. with __slots__ conflicts)
            return ActorError(message, remote_traceback, cause)


class ActorDiedError(TroupeError):
    """The actor is dead (or died during the call); the message says why: exit code or signal,
    its last stderr lines, or the node's death."""


class GetTimeoutError(TroupeError, TimeoutError):
    """`troupe.get(..., timeout=)` ran out of time."""


# Errors from the runtime carry a status code (runtime/include/troupe/runtime/status.h) across
# the RPC edge; each code has its class here, raised by _core from the code, never from the text.
# Each is also an instance of the matching built-in exception, so `except TimeoutError` works.
class InvalidArgumentError(TroupeError, ValueError):
    """Bad input (an argument, an option, a quantity)."""


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


def from_code(code, message):
    """The exception for a runtime status code (called by _core)."""
    cls = _BY_CODE.get(code, TroupeError)
    err = cls(message)
    err.code = code
    return err
