"""Arguments and results on the wire: pickle protocol 5 with out-of-band buffers, so numpy
arrays and tensors travel as raw bytes next to a small pickle instead of being copied into it.

Frame: b"T5" | u32 count | u64 len(pickle) | u64 len(buffer) * count | pickle | buffers...
Replies from Python actors add one tag byte in front: 0 = value, 1 = (exception, traceback).
"""
import pickle
import struct

import cloudpickle

from . import _objects
from ._objects import ours
from .exceptions import InvalidArgumentError

_MAGIC = b"T5"


# Values the C pickler writes the same way cloudpickle would (nothing defined in __main__, no
# lambdas): the common case of calls, about ten times cheaper to encode.
_PLAIN = frozenset([bytes, bytearray, str, int, float, bool, complex, type(None)])
_PLAIN_MODULES = ("numpy", "torch")


def _plain(value, depth=0):
    t = type(value)
    if t in _PLAIN:
        return True
    if t is tuple or t is list:
        return depth < 3 and all(_plain(v, depth + 1) for v in value)
    if t is dict:
        return depth < 3 and all(type(k) is str and _plain(v, depth + 1) for k, v in value.items())
    return t.__module__.partition(".")[0] in _PLAIN_MODULES and t.__module__ != "__main__"


def dumps(obj, tag=b"", plain=None) -> bytes:
    """plain=True: the caller knows obj needs no cloudpickle (saves the walk over it)."""
    buffers: list[pickle.PickleBuffer] = []
    pickler = pickle.dumps if (plain if plain is not None else _plain(obj)) else cloudpickle.dumps
    with ours():
        main = pickler(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    header = _MAGIC + struct.pack(f"<IQ{len(raws)}Q", len(raws), len(main), *[r.nbytes for r in raws])
    return b"".join([tag, header, main, *raws])  # one copy of the bytes, tag included


def loads(data: bytes):
    view = memoryview(data)
    if view[:2] != _MAGIC:
        raise InvalidArgumentError("not a Troupe-serialized value")
    (count,) = struct.unpack_from("<I", view, 2)
    sizes = struct.unpack_from(f"<Q{count}Q", view, 6)
    offset = 6 + 8 * (count + 1)
    main = view[offset:offset + sizes[0]]
    offset += sizes[0]
    buffers: list[memoryview] = []
    for size in sizes[1:]:
        buffers.append(view[offset:offset + size])  # zero-copy slices of the reply
        offset += size
    return pickle.loads(main, buffers=buffers)


# A result whose out-of-band buffers (arrays, tensors) are at least this large goes to its
# caller through a file in this node's object directory: a caller on the same node maps it (no
# copy on the way), one on another node pulls it from this node's agent in chunks (no limit from
# the RPC's message size either way). Smaller ones travel in the reply.
HANDOFF_MIN_BYTES = 1 << 20


class _SharedFile:
    """Stands for a value written to a file of the object directory of node `host`; unpickles to
    the value, mapped on that node and pulled anywhere else. take=True (a result handed to its
    caller): the file is deleted once mapped or pulled. take=False (a call's arguments): the
    caller deletes it when the call is over, as a retry sends it again."""

    __slots__ = ("object_id", "take", "host")

    def __init__(self, object_id, take, host):
        self.object_id = object_id
        self.take = take
        self.host = host

    def __reduce__(self):
        return _open_shared, (self.object_id, self.take, self.host)


def _open_shared(object_id, take, host=None):
    store = _objects.store()
    if host is not None and host != store.host:
        return store.pull(object_id, host, take)
    return store.take(object_id) if take else store.map(object_id)


# A call whose arguments' buffers total at least this much goes through a file of the caller's
# node that the callee maps or pulls (a message this large would hold the connection, and one
# over 1 GiB cannot be sent), and that the caller deletes once the call is over (a retry sends the
# same file again).
ARG_HANDOFF_MIN_BYTES = 48 << 20


def dumps_call(obj, plain, files) -> bytes:
    """A call's payload; a large one is written to the object directory and its file id appended
    to `files` (the caller deletes them when the call is over)."""
    buffers: list[pickle.PickleBuffer] = []
    with ours():
        main = (pickle.dumps if plain else cloudpickle.dumps)(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    if sum(r.nbytes for r in raws) >= ARG_HANDOFF_MIN_BYTES:
        store = _objects.store()
        if _objects._is_node(store.host):  # else no agent could serve it to another node
            object_id, _ = store.write(main, raws, to_disk_if_full=True)
            files.append(object_id)
            return dumps(_SharedFile(object_id, False, store.host))
    header = _MAGIC + struct.pack(f"<IQ{len(raws)}Q", len(raws), len(main), *[r.nbytes for r in raws])
    return b"".join([header, main, *raws])


def dump_reply(value, caller_host=None) -> bytes:
    buffers: list[pickle.PickleBuffer] = []
    pickler = pickle.dumps if _plain(value) else cloudpickle.dumps
    with ours():
        main = pickler(value, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    if caller_host is not None and sum(r.nbytes for r in raws) >= HANDOFF_MIN_BYTES:
        store = _objects.store()
        if caller_host == store.host or _objects._is_node(store.host):
            object_id, _ = store.write(main, raws, "h", to_disk_if_full=True)
            return dumps(_SharedFile(object_id, True, store.host), b"\x00")
    header = _MAGIC + struct.pack(f"<IQ{len(raws)}Q", len(raws), len(main), *[r.nbytes for r in raws])
    return b"".join([b"\x00", header, main, *raws])


def dump_exception(exc, traceback_text) -> bytes:
    try:
        return dumps((exc, traceback_text), b"\x01")
    except Exception:  # an exception that cannot be pickled still reaches the caller
        return dumps((RuntimeError(f"{type(exc).__name__}: {exc}"), traceback_text), b"\x01")


def load_reply(data: bytes):
    """(is_exception, value or (exception, traceback))."""
    return data[:1] == b"\x01", loads(memoryview(data)[1:])
