"""Typed calls to the built-in C++ actors (Checkpoint, Dataloader, Trainer; see actors/schema/*.capnp).

The params of a method are given as keywords named as in the schema (camelCase), encoded by
troupe._actors into the method's params message and carried by the actor's ordinary call (so
ordering, retries and timeouts are those of any actor call); the reply is the method's results
message, decoded into a dict (Data as bytes, enums by name, structs as dicts, lists as lists).
"""

from __future__ import annotations

from typing import Any

from . import _actors, _refs


def call(handle: Any, interface: str, method: str, **params: Any) -> _refs.ObjectRef:
    """Calls `interface`.`method` on the actor `handle` with `params`; the ref's value is the
    results message (pass it to reply())."""
    return getattr(handle, method).remote(_actors.encode(interface, method, params))


def reply(interface: str, method: str, data: bytes) -> dict[str, Any]:
    """The results of `interface`.`method` from its reply's bytes."""
    return _actors.decode(interface, method, data)


def get(handle: Any, interface: str, method: str, timeout: float | None = None, **params: Any) -> dict[str, Any]:
    """call() and wait for its results."""
    return reply(interface, method, _refs.get(call(handle, interface, method, **params), timeout=timeout))
