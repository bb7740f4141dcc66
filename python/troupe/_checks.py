"""The checks of what a user passes to the API (names, timeouts, resources, runtime_env,
call signatures): each raises the exception family's InvalidArgumentError or ArgumentTypeError
(a ValueError or TypeError) saying what is wrong. Depends on nothing else of the API."""
from __future__ import annotations

import inspect
import math
import os

from .exceptions import ArgumentTypeError, InvalidArgumentError

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


def _check_resources(resources, what):
    """Quantities must be finite and in [0, 1e18]: NaN or inf in a record breaks every reader."""
    for name, qty in resources.items():
        if not name or not math.isfinite(qty) or not 0 <= qty <= 1e18:
            raise InvalidArgumentError(f"{what}: quantity {qty!r} of resource {name!r} is not a finite number in [0, 1e18]")


def _check_retry_exceptions(value):
    if value is None or isinstance(value, bool):
        return
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, type) and issubclass(t, BaseException)
                                                        for t in value):
        raise ArgumentTypeError(f"retry_exceptions must be a bool or a list of exception types, not {value!r}")


def _check_call(signature, args, kwargs, what):
    if signature is not None:
        try:
            signature.bind(*args, **kwargs)
        except TypeError as e:
            raise ArgumentTypeError(f"{what}: {e}") from None
