"""troupe.checkpoint: Flash checkpoints from Python.

Files (the persisted format, docs/checkpoint_format.md), usable outside any cluster:

    troupe.checkpoint.save({"w": torch.randn(3, 4)}, "/ckpt", step=100)
    state = troupe.checkpoint.load("/ckpt")               # the newest complete step
    state, info = troupe.checkpoint.load("/ckpt", with_metadata=True)   # info["step"], ...

A checkpoint whose files fail their checksums is skipped with a warning and the next older one
is loaded.

Shared-memory snapshots (what a trainer does every N steps), with the node's checkpoint actor
persisting them in the background, keeping a replica on another node and serving restores:

    ckpt = troupe.cpp_actor("Checkpoint", init_args=json.dumps({"group": "job", "node": "a",
                                                                 "dir": "/ckpt"}))
    flash = troupe.checkpoint.FlashCheckpoint(rank=0, world_size=1, actor=ckpt)
    flash.save(step, model.state_dict())                  # a memory copy; returns at once after
    restored = flash.restore(model.state_dict())          # in place; None when nothing to restore

Values are torch tensors or numpy arrays (CPU; others are copied to the CPU first); anything else
belongs in `metadata` (bytes). Importing this module does not import torch.
"""
from __future__ import annotations

import collections
import contextlib
import math
import os
import re
import time
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple, cast

from . import _checkpoint
from .exceptions import TroupeError
from .exceptions import ArgumentTypeError, InvalidArgumentError

__all__ = ["CheckpointCorruptError", "CheckpointError", "CheckpointNotFoundError", "CheckpointSpaceError",
           "FlashCheckpoint", "Restored", "TensorAt", "load", "load_into", "load_tracked", "pack_tracked", "save",
           "steps", "unpack_tracked"]


class CheckpointError(TroupeError, RuntimeError):
    """A checkpoint operation failed; `code` is the library's status code (e.g. "UNAVAILABLE").
    A TroupeError like every Troupe error, and a RuntimeError as it always was."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No usable checkpoint (or segment) where one was expected."""


class CheckpointSpaceError(CheckpointError, OSError):
    """The disk, the file size limit or the shared-memory filesystem has no room."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint failed its checks (checksum, header), or changed while being read."""


_ERRORS = {"NOT_FOUND": CheckpointNotFoundError, "RESOURCE_EXHAUSTED": CheckpointSpaceError,
           "FAILED_PRECONDITION": CheckpointCorruptError}


def _call(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except _checkpoint.Error as e:
        code, message = e.args
        raise _ERRORS.get(code, CheckpointError)(code, message) from None


class Restored(NamedTuple):
    """What FlashCheckpoint.restore() found: the step, its tensors by name, and its metadata."""

    step: int
    state_dict: dict[str, Any]
    metadata: bytes


def _torch():
    import sys

    return sys.modules.get("torch")


def _as_bytes(name, value):
    """(spec, a 1-D uint8 view of the value's bytes) without copying when it is contiguous on the CPU."""
    import numpy as np

    torch = _torch()
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        dtype = str(t.dtype).replace("torch.", "")
        flat = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
        return (name, dtype, list(t.shape)), flat
    if isinstance(value, (np.ndarray, np.generic)):
        a = np.ascontiguousarray(value)
        dtype = a.dtype.name
        if a.dtype.byteorder == ">" or not _checkpoint.dtype_size(dtype):
            raise ArgumentTypeError(f"tensor {name!r} has dtype {a.dtype}, which a checkpoint cannot hold "
                            "(numeric and bool dtypes in native byte order)")
        return (name, dtype, list(a.shape)), a.reshape(-1).view(np.uint8)
    raise ArgumentTypeError(f"state_dict[{name!r}] is a {type(value).__name__}; checkpoints hold torch tensors and numpy "
                    "arrays (put other values in `metadata`)")


def _specs_and_buffers(state_dict):
    if not isinstance(state_dict, dict):
        raise ArgumentTypeError(f"state_dict must be a dict of tensors, not {type(state_dict).__name__}")
    specs, buffers = [], []
    for name, value in state_dict.items():
        if not isinstance(name, str):
            raise ArgumentTypeError(f"state_dict keys must be str, not {type(name).__name__}")
        spec, flat = _as_bytes(name, value)
        specs.append(spec)
        buffers.append(flat)
    return specs, buffers


_NUMPY_STAND_IN = {"bfloat16": "uint16", "complex32": "uint32", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8",
                   "bytes": "uint8"}


def _from_bytes(array, dtype, shape, as_numpy):
    """A tensor of `dtype` and `shape` over the uint8 array (no copy)."""
    import numpy as np

    torch = None if as_numpy else _torch_or_none()
    if torch is not None:
        if array.size == 0:
            return torch.empty(shape, dtype=getattr(torch, dtype))
        return torch.frombuffer(array, dtype=getattr(torch, dtype)).reshape(shape)
    return array.view(np.dtype(_NUMPY_STAND_IN.get(dtype, dtype))).reshape(shape)


def _torch_or_none():
    try:
        import torch

        return torch
    except ImportError:
        return None


def _allocate(nbytes):
    """A writable uint8 buffer of nbytes. Through torch when it is loaded: numpy asks the kernel for
    transparent huge pages on large arrays, and their first touch can stall on compaction (4 s for
    1 GiB measured here, against 1 s with ordinary pages)."""
    import numpy as np

    torch = _torch()
    if torch is not None and nbytes:
        return torch.empty(nbytes, dtype=torch.uint8).numpy()
    return np.empty(nbytes, np.uint8)


def save(state_dict: Mapping[str, Any], path: str | os.PathLike[str], step: int = 0, *, rank: int = 0,
         world_size: int = 1, metadata: bytes = b"", keep: int = 3) -> str:
    """Writes `state_dict` as rank `rank` of `step` in checkpoint directory `path`: the rank file is
    written under a temporary name, fsynced and renamed; once every rank of the step is there the
    manifest and `latest` are written and steps beyond the newest `keep` removed. Returns the rank
    file's path. Raises CheckpointSpaceError on a full disk (earlier steps stay intact)."""
    specs, buffers = _specs_and_buffers(state_dict)
    result = _call(_checkpoint.save_files, str(path), int(step), int(rank), int(world_size), specs, buffers,
                   bytes(metadata), int(keep))
    return result["path"]


def load(path: str | os.PathLike[str], *, step: int | None = None, rank: int = 0, as_numpy: bool = False,
         with_metadata: bool = False) -> dict[str, Any] | tuple[dict[str, Any], dict[str, Any]]:
    """Loads rank `rank` of the newest complete step in `path` (at most `step` when given). A step
    whose files fail their checks is skipped with a warning and the next older one is used. Returns
    a dict of torch tensors (numpy arrays with as_numpy=True, or when torch is missing); with
    with_metadata=True, (dict, info) where info has step, world_size, metadata and skipped.

    A step of a ZeRO trainer (ElasticTrainer(zero=1 or 2)) holds each rank's pieces of the
    optimizer state, "optim/<param>/<field>@<lo>:<hi>": they are read from every rank's file and
    put together, so the dict has the whole "optim/<param>/<field>", shaped as the parameter."""
    header, arrays, skipped = _call(_checkpoint.load_files, str(path), int(rank), step, _allocate)
    for reason in skipped:
        warnings.warn(f"troupe.checkpoint: skipped a checkpoint in {path}: {reason}", RuntimeWarning, stacklevel=2)
    state = _state_of(header, arrays, as_numpy)
    if any(_PIECE.match(name) for name in state):
        states = [state]
        for other in range(header["world_size"]):
            if other != rank:
                h, a, _ = _call(_checkpoint.load_files, str(path), other, header["step"], _allocate)
                states.append(_state_of(h, a, as_numpy))
        state = _whole(states)
    if with_metadata:
        info = {"step": header["step"], "world_size": header["world_size"], "metadata": header["metadata"],
                "skipped": list(skipped)}
        return state, info
    return state


_PIECE = re.compile(r"^(optim/.+/[^/@]+)@(\d+):(\d+)$")


def _state_of(header, arrays, as_numpy):
    it = iter(arrays)
    return {name: _from_bytes(next(it), dtype, shape, as_numpy) for name, dtype, shape in header["tensors"]}


def _whole(states):
    """One state from the ranks' states of a ZeRO trainer: entries every rank holds once, and
    the optimizer pieces joined into whole tensors shaped as their parameters."""
    merged, pieces = {}, {}
    for state in states:
        for name, value in state.items():
            m = _PIECE.match(name)
            if m:
                pieces.setdefault(m.group(1), []).append((int(m.group(2)), int(m.group(3)), value))
            else:
                merged.setdefault(name, value)
    for name, parts in pieces.items():
        param = merged.get("param/" + name[len("optim/"):name.rindex("/")])
        first = parts[0][2]
        if param is None or len(first.shape) == 0:  # a counter: the same in every piece
            merged[name] = first
            continue
        numel = int(math.prod(param.shape))
        if hasattr(first, "new_empty"):  # torch
            flat = first.new_empty(numel)
        else:
            import numpy as np

            flat = np.empty(numel, dtype=first.dtype)
        covered = 0
        for lo, hi, value in sorted(parts, key=lambda p: p[0]):
            if lo > covered:
                break
            flat[lo:hi] = value.reshape(-1)
            covered = max(covered, hi)
        if covered < numel:
            raise CheckpointCorruptError("FAILED_PRECONDITION", f"the pieces of {name} cover elements [0, {covered}) "
                                         f"of {numel}: a rank's file is missing")
        merged[name] = flat.reshape(tuple(param.shape))
    return merged


def load_into(state: Mapping[str, Any], model: Any, optimizer: Any = None) -> None:
    """Puts a trainer's checkpoint (what load() returns for an ElasticTrainer's directory) into a
    PyTorch model of the same architecture and, if given, its torch.optim optimizer:
    "param/<name>" and "buffer/<name>" go through model.load_state_dict (strict), and
    "optim/<name>/<field>" become the optimizer's per-parameter state (the counter "step" as
    torch.optim keeps it). The optimizer must hold model.parameters() in order, one group."""
    import torch

    tensors = {}
    for prefix in ("param/", "buffer/"):
        tensors.update({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
    model.load_state_dict(tensors, strict=True)
    if optimizer is None:
        return
    per_param = {}
    for index, (name, _) in enumerate(model.named_parameters()):
        prefix = f"optim/{name}/"
        fields = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix) and "/" not in k[len(prefix):]}
        if fields:
            per_param[index] = {f: torch.tensor(float(v)) if f == "step" else v.clone() for f, v in fields.items()}
    if not per_param and any(k.startswith("optim/") for k in state):
        raise InvalidArgumentError("the checkpoint's optimizer state names no parameter of this model")
    saved = optimizer.state_dict()
    saved["state"] = per_param
    optimizer.load_state_dict(saved)


# ---- Tracked objects (TorchTrainer's ctx.track) ----
# A snapshot of tracked objects is one image: every tensor of every object's state_dict() is an
# image tensor (named "<object>/<key>/<key>...", copied without pickling), and the rest of the
# state_dicts (dicts, lists, numbers: an optimizer's param_groups, a scheduler's counters) is the
# image's metadata, pickled with each tensor replaced by a TensorAt naming its image tensor.
_TRACKED_MAGIC = b"troupe-tracked-1\n"


class TensorAt(NamedTuple):
    """In a tracked snapshot's metadata: the image tensor that stands at this place."""

    name: str


def pack_tracked(states: Mapping[str, Any]) -> tuple[dict[str, Any], bytes]:
    """(image tensors, metadata) of {name: state_dict}: the tensors are the state's own (no copy
    is made here; FlashCheckpoint.save copies them into shared memory)."""
    import pickle

    torch = _torch()
    tensors: dict[str, Any] = {}

    def walk(value, path):
        if torch is not None and isinstance(value, torch.Tensor):
            name = path if len(path) <= 512 and path not in tensors else f"#{len(tensors)}"
            tensors[name] = value
            return TensorAt(name)
        if isinstance(value, dict):
            out = type(value)() if type(value) in (dict, collections.OrderedDict) else {}
            for k, v in value.items():
                out[k] = walk(v, f"{path}/{k}")
            if hasattr(value, "_metadata"):  # a module's state_dict carries its modules' versions
                out._metadata = value._metadata
            return out
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(walk(v, f"{path}/{i}") for i, v in enumerate(value))
        return value

    skeleton = {name: walk(state, name) for name, state in states.items()}
    return tensors, _TRACKED_MAGIC + pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)


def unpack_tracked(tensors: Mapping[str, Any], metadata: bytes) -> dict[str, Any]:
    """{name: state_dict} from an image's tensors and metadata written by pack_tracked."""
    import pickle

    if bytes(metadata[:len(_TRACKED_MAGIC)]) != _TRACKED_MAGIC:
        raise CheckpointError("INVALID_ARGUMENT", "this checkpoint does not hold tracked objects (it was not written "
                                                  "by a TorchTrainer): use troupe.checkpoint.load()")
    skeleton = pickle.loads(bytes(metadata[len(_TRACKED_MAGIC):]))

    def walk(value):
        if isinstance(value, TensorAt):
            if value.name not in tensors:
                raise CheckpointCorruptError("FAILED_PRECONDITION", f"the metadata names tensor {value.name!r}, which "
                                                                    f"the image does not hold")
            return tensors[value.name]
        if isinstance(value, dict):
            for k in list(value):
                value[k] = walk(value[k])
            return value
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(walk(v) for v in value)
        return value

    return {name: walk(state) for name, state in skeleton.items()}


def load_tracked(path: str | os.PathLike[str], *, step: int | None = None, rank: int = 0) -> tuple[dict[str, Any], int]:
    """({name: state_dict}, step) of the newest complete step (at most `step`) a TorchTrainer
    persisted in `path`: what ctx.track(name=obj) held, for obj.load_state_dict() in plain torch,
    without a cluster (docs/checkpoint_format.md).

        states, step = troupe.checkpoint.load_tracked("/ckpt")
        model.load_state_dict(states["model"]); opt.load_state_dict(states["opt"])
    """
    tensors, info = cast("tuple[dict[str, Any], dict[str, Any]]", load(path, step=step, rank=rank, with_metadata=True))
    return unpack_tracked(tensors, info["metadata"]), int(info["step"])


def steps(path: str | os.PathLike[str]) -> list[int]:
    """The complete steps in checkpoint directory `path`, newest first."""
    return _call(_checkpoint.complete_steps, str(path))


class FlashCheckpoint:
    """One rank's snapshots in a shared-memory segment on this node: save() is a memory copy (the
    previous snapshot stays intact until the new one is complete), restore() copies back, with
    every tensor's CRC32C checked.

    With `actor` (the node's "Checkpoint" actor), the segment is the one the actor owns: save()
    then asks it to persist the snapshot and send a replica to its peer (in the background, off
    the caller's path), and restore() first asks it for the newest step complete on every rank
    (from this node's memory, another node's memory or replica, or disk). Without an actor the
    segment is named by `segment` (or `group` and `node`) in `shm_dir` (default this user's /dev/shm/troupe-ckpt-<uid>, or
    $TROUPE_SHM_DIR), and restore() reads the newest complete snapshot in it.
    """

    def __init__(self, segment: str | None = None, *, rank: int = 0, world_size: int = 1, actor: Any = None,
                 group: str | None = None, node: str | None = None, shm_dir: str | os.PathLike[str] | None = None,
                 metadata_capacity: int = 64 * 1024, copy_threads: int = 2) -> None:
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.actor = actor
        self.shm_dir = str(shm_dir or _checkpoint.default_shm_dir())
        if actor is not None:
            reply = self._actor_call("attach", rank=self.rank)
            segment, self.shm_dir = reply["segment"], reply["shmDir"]
        elif segment is None:
            if group is None or node is None:
                raise InvalidArgumentError("FlashCheckpoint needs an actor, a segment name, or group and node")
            segment = _checkpoint.segment_name(group, node, self.rank)
        self.segment_name = segment
        self.metadata_capacity = int(metadata_capacity)
        self.copy_threads = int(copy_threads)
        self._writer: Any = None  # a _checkpoint.Segment open for writing, made by the first save
        self._reader: Any = None
        self._specs: list[Any] | None = None
        self._pending: list[Any] = []
        self.restored_from = ""  # where restore_step found its step: "memory" or staged by the actor

    def _actor_call(self, method, **params):
        """A method of the actor's typed interface (rpc::Checkpoint, actors/schema/checkpoint.capnp)."""
        from . import _typed

        return _typed.get(self.actor, "Checkpoint", method, **params)

    def save(self, step: int, state_dict: Mapping[str, Any], metadata: bytes = b"", *, notify: bool = True) -> int:
        """Snapshots `state_dict` as `step` into shared memory and returns once it is complete there
        (persisting and replicating continue in the actor; with notify=False the actor is not told,
        and a later pin() replicates the step). The segment is laid out by the first save and
        re-laid out only when the tensors' names, dtypes or shapes change."""
        specs, buffers = _specs_and_buffers(state_dict)
        metadata = bytes(metadata)
        if self._writer is None or specs != self._specs or len(metadata) > self.metadata_capacity:
            self.close()
            self.metadata_capacity = max(self.metadata_capacity, 2 * len(metadata))
            self._writer = _call(_checkpoint.Segment.open_for_write, self.shm_dir, self.segment_name, specs,
                                 self.metadata_capacity, self.copy_threads)
            self._specs = specs
        slot = _call(self._writer.save, int(step), self.rank, self.world_size, buffers, metadata)
        if self.actor is not None and notify:
            self._reap()
            from . import _typed

            self._pending.append(_typed.call(self.actor, "Checkpoint", "saved", rank=self.rank, step=int(step)))
        return slot

    def _reap(self):
        """Raises the error of a finished notification, and forgets finished ones."""
        from . import _api

        if not self._pending:
            return
        ready, self._pending = _api.wait(self._pending, num_returns=len(self._pending), timeout=0)
        _api.get(ready)

    def restore(self, state_dict: Mapping[str, Any] | None = None, *, max_step: int | None = None,
                as_numpy: bool = False, timeout: float = 600) -> Restored | None:
        """Restores the newest snapshot (at most `max_step`): into `state_dict`'s tensors in place when
        given (names, dtypes and shapes must match), else into new tensors. Returns
        Restored(step, state_dict, metadata), or None when there is nothing to restore."""
        step = None
        if self.actor is not None:
            # The actor may stage the snapshot into this rank's segment: it needs the writer lock.
            self.close()
            step = self._restore_through_actor(max_step, timeout)
            if step is None:
                return None
        reader = self._writer or self._reader
        if reader is None:
            try:
                reader = _call(_checkpoint.Segment.open_existing, self.shm_dir, self.segment_name, self.copy_threads)
            except CheckpointNotFoundError:
                return None  # never saved on this node
            # Kept for later restores (unmapping a large segment takes a while); an actor may
            # re-create the segment, so restores through one open it afresh.
            self._reader = reader
        header = reader.peek(step, max_step)
        if header is None:
            return None
        if state_dict is not None:
            targets, copies = self._targets(state_dict, header)
        else:
            targets = [_allocate(_nbytes(dtype, shape)) for _, dtype, shape in header["tensors"]]
        header = _call(reader.restore_into, header["step"], None, targets)
        if state_dict is None:
            state_dict = {name: _from_bytes(t, dtype, shape, as_numpy)
                          for t, (name, dtype, shape) in zip(targets, header["tensors"])}
        else:
            for name, tmp in copies:
                _copy_back(state_dict, name, tmp)
        return Restored(header["step"], cast("dict[str, Any]", state_dict), header["metadata"])  # `into` itself

    @contextlib.contextmanager
    def _segment(self, writable=False):
        """This rank's segment: the open writer, else the existing one mapped for the call (None
        when it does not exist); `writable` maps it for pin/discard_after."""
        if self._writer is not None:
            yield self._writer
            return
        try:
            segment = _call(_checkpoint.Segment.open_existing, self.shm_dir, self.segment_name, self.copy_threads,
                            writable)
        except CheckpointNotFoundError:
            yield None
            return
        try:
            yield segment
        finally:
            segment.close()

    def steps(self) -> list[int]:
        """The steps complete in this rank's segment on this node, oldest first."""
        with self._segment() as segment:
            return [] if segment is None else sorted(s["step"] for s in segment.slots() if s["complete"])

    def restore_step(self, step: int, *, into: Mapping[str, Any] | None = None, as_numpy: bool = False,
                     timeout: float = 600) -> Restored:
        """Restores exactly `step`: into `into`'s tensors in place when their names, dtypes and
        shapes are the snapshot's (warm memory: a survivor's own tensors), else into new ones;
        from this node's segment when it holds the step, else staged into it by the actor (from a
        peer's memory or replica, or from disk). CheckpointNotFoundError when no tier holds it."""
        restored = self._read_exact(step, as_numpy, into)
        self.restored_from = "memory"
        if restored is None and self.actor is not None:
            self.close()
            self._restore_through_actor(step, timeout)
            restored = self._read_exact(step, as_numpy, into)
            self.restored_from = "staged by the checkpoint actor"
        if restored is None:
            raise CheckpointNotFoundError("NOT_FOUND", f"rank {self.rank}: no complete snapshot of step {step} in "
                                                       f"{os.path.join(self.shm_dir, str(self.segment_name))}"
                                          + ("" if self.actor is None else ", a peer's memory or replica, or disk"))
        return restored

    def _read_exact(self, step, as_numpy, into=None):
        with self._segment() as segment:
            header = None if segment is None else segment.peek(int(step))
            if header is None:
                return None
            copies = None
            if into is not None and not as_numpy and set(into) == {name for name, _, _ in header["tensors"]}:
                try:
                    targets, copies = self._targets(into, header)
                except ValueError:  # a dtype or shape differs: new tensors
                    copies = None
            if copies is None:
                targets = [_allocate(_nbytes(dtype, shape)) for _, dtype, shape in header["tensors"]]
            header = _call(segment.restore_into, int(step), None, targets)
            if copies is None:
                state = {name: _from_bytes(t, dtype, shape, as_numpy)
                         for t, (name, dtype, shape) in zip(targets, header["tensors"])}
            else:
                state = dict(into)
                for name, tmp in copies:
                    _copy_back(state, name, tmp)
            return Restored(header["step"], state, header["metadata"])

    def pin(self, step: int, *, timeout: float = 60) -> int | None:
        """Pins the newest complete snapshot at or before `step` in this segment and, through the
        actor, in its replica on the next node (replicating it first when it is not there yet),
        after emptying the snapshots newer than `step` (a timeline the state left). Saves then
        leave it alone until the next pin. Returns the step pinned, or None when there is none."""
        with self._segment(writable=True) as segment:
            if segment is None:
                return None
            segment.discard_after(int(step))
            held = [slot["step"] for slot in segment.slots() if slot["complete"] and slot["step"] <= step]
            if not held:
                return None
            newest = max(held)
            if self.actor is not None:
                deadline = time.monotonic() + timeout
                delay = 0.001
                while self._actor_call("pin", rank=self.rank, step=newest)["state"] == "running":
                    if time.monotonic() > deadline:
                        raise CheckpointError("DEADLINE_EXCEEDED", f"pinning step {newest} of rank {self.rank} in its "
                                                                   f"replica took over {timeout} s")
                    time.sleep(delay)  # the actor's pin job replicates the step first
                    delay = min(delay * 2, 0.02)
            _call(segment.pin, newest)
            return newest

    def _restore_through_actor(self, max_step, timeout):
        request = {"rank": self.rank}
        if max_step is not None:
            request["maxStep"] = int(max_step)
        deadline = time.monotonic() + timeout
        delay = 0.002
        while True:
            reply = self._actor_call("restore", **request)
            if reply["state"] == "done":
                for reason in reply["skipped"]:
                    warnings.warn(f"troupe.checkpoint: restore skipped {reason}", RuntimeWarning, stacklevel=3)
                return reply.get("step")
            if reply["state"] == "none":
                return None
            if time.monotonic() > deadline:
                raise CheckpointError("DEADLINE_EXCEEDED", f"restore of rank {self.rank} did not finish in {timeout} s")
            time.sleep(delay)  # the actor is fetching from a peer or disk: poll with a short back-off
            delay = min(delay * 2, 0.05)

    def _targets(self, state_dict, header):
        import numpy as np

        targets, copies = [], []
        for name, dtype, shape in header["tensors"]:
            if name not in state_dict:
                raise KeyError(f"the snapshot of step {header['step']} has tensor {name!r}; state_dict has not")
            spec, flat = _as_bytes(name, state_dict[name])
            if spec != (name, dtype, shape):
                raise InvalidArgumentError(f"tensor {name!r} is {spec[1]} {spec[2]} here but {dtype} {shape} in the snapshot")
            value = state_dict[name]
            if _shares_memory(value, flat):
                targets.append(flat)
            else:
                tmp = np.empty(flat.size, np.uint8)
                targets.append(tmp)
                copies.append((name, tmp))
        return targets, copies

    def close(self) -> None:
        """Unmaps the segment (it stays in shared memory: the actor, or `troupe stop`, removes it)."""
        for segment in (self._writer, self._reader):
            if segment is not None:
                segment.close()
        self._writer = self._reader = None

    def __enter__(self) -> FlashCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nbytes(dtype, shape):
    n = _checkpoint.dtype_size(dtype)
    for d in shape:
        n *= d
    return n


def _shares_memory(value, flat):
    """True when writing `flat` writes `value` (a contiguous CPU tensor or a writable array)."""
    import numpy as np

    torch = _torch()
    if torch is not None and isinstance(value, torch.Tensor):
        return value.device.type == "cpu" and value.is_contiguous() and (value.numel() == 0 or
                                                                          flat.ctypes.data == value.data_ptr())
    return isinstance(value, np.ndarray) and value.flags.writeable and np.shares_memory(value, flat)


def _copy_back(state_dict, name, tmp):
    """Copies restored bytes into a value that could not be written directly (not contiguous, not on
    the CPU); immutable values (numpy scalars, read-only arrays) are replaced in the dict."""
    import numpy as np

    value = state_dict[name]
    torch = _torch()
    if torch is not None and isinstance(value, torch.Tensor):
        if tmp.size:
            with torch.no_grad():
                value.copy_(torch.frombuffer(tmp, dtype=value.dtype).reshape(value.shape))
    elif isinstance(value, np.ndarray) and value.flags.writeable:
        np.copyto(value, tmp.view(value.dtype).reshape(value.shape))
    else:
        dtype = np.asarray(value).dtype
        restored = tmp.view(dtype).reshape(np.shape(value))
        state_dict[name] = restored[()] if isinstance(value, np.generic) else restored
