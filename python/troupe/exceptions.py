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
