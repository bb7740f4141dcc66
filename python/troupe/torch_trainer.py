"""TorchTrainer: the user's own eager PyTorch loop in the elastic group (troupe.train's
GroupCoordinator with Python trainer actors instead of C++ ones).

    def train_loop(ctx):
        model = ctx.prepare(MyNet())                 # DDP over the group's "troupe" process group
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ctx.track(model=model, opt=opt)              # what a snapshot holds; restored on re-entry
        for x, y in ctx.batches():                   # this rank's share of each global batch
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
            ctx.report(loss=loss.item())             # ends the step

    trainer = TorchTrainer(train_loop, data=dataset, global_batch_size=64,
                           scaling=ScalingConfig(min_workers=1, max_workers=2))
    history = trainer.fit(steps=200)

Each rank is one Python worker process (_TorchTrainerActor) that answers the methods of the
Trainer interface the coordinator calls on C++ trainers (join, snapshots, restore, run, pin,
hash, configure, activity, timeline) and runs `train_loop(ctx)` in a thread of its own, started
as soon as the process is: what needs the group (ctx.prepare, rank, track, batches) waits until
the group is formed and its step restored, so a new process builds its model meanwhile. run()
lets the loop go on until the chunk's last report(); report() then blocks until the next run().
When the group re-forms (join), the loop's thread gets GroupChanged out of report() or
batches() (or its collective fails: the backend fails every pending one, and every new one, when
a peer dies), unwinds, and the loop is entered again in the same process: imports, the process's
objects and torch stay; a model made by ctx.prepare(factory) is kept, the restore writes the
tracked objects' own tensors, and ctx.track() loads the restored step's state. After a failure
the survivors train on while a killed rank's new process starts; it joins once its loop is
ready (troupe.train's GroupCoordinator: heals_in_background).

Snapshots go through checkpoint/'s tiers, as the C++ trainer's do: every snapshot_every steps
(default every step) each rank saves every tracked object's state_dict() and the RNG states into
its bundle's shared-memory segment on the node (troupe.checkpoint.FlashCheckpoint over the node's
Checkpoint actor: tensors copied without pickling, the rest pickled as the image's metadata,
troupe.checkpoint.pack_tracked). The actor persists it (checkpoint={"dir": ..., "persist_every":
N}) and replicates it to the next node's actor in the background; the step each chunk ends on is
pinned here and in the replica. A rank restarted in place (kill -9) finds its segment on the node;
one moved to another node, or a new member, is staged the step by its node's actor (a node mate's
memory, a peer's replica, or disk). A persisted step loads into plain torch objects without a
cluster: troupe.checkpoint.load_tracked(dir).

Rendezvous: each join goes through the cluster's store (troupe.dist.group_store: a c10d Store in
the key space of the group's epoch, which the join raises the group to), so the ranks may run on
any hosts; a rank listens for its peers on its node's address.
"""
from __future__ import annotations

import collections
import hashlib
import math
import os
import random
import re
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Mapping
from typing import Any, Callable, cast

from . import _api, _typed
from . import checkpoint as _ckpt
from .exceptions import ActorDiedError, ActorError, ArgumentTypeError, InvalidArgumentError, TroupeError
from ._group import (CheckpointConfig, FailureConfig, GroupCoordinator, ScalingConfig, _configs, _data_spec)

__all__ = ["GroupChanged", "TorchContext", "TorchTrainer", "TrainLoopError"]

_LOOP_FAILED = "troupe.train: train_loop raised"
_DTYPES = {"float32": "float32", "float64": "float64", "int64": "int64", "int32": "int32", "uint8": "uint8",
           "uint16": "int32", "uint32": "int64", "float16": "float16"}


class GroupChanged(BaseException):
    """Raised out of ctx.report()/ctx.batches() in the loop's thread when the group re-forms:
    let it unwind the loop (a BaseException, so `except Exception` in user code does not stop
    it); train_loop is entered again once the group has re-formed and restored a step."""


class TrainLoopError(TroupeError):
    """train_loop raised on a rank (not a failure of the group): `rank`, `step` and the remote
    traceback (`remote_traceback`), which the message also carries."""

    def __init__(self, message: str, rank: int, step: int, remote_traceback: str) -> None:
        super().__init__(message)
        self.rank, self.step, self.remote_traceback = rank, step, remote_traceback


class _GroupFailure(Exception):
    """A call the loop made to the group's services failed (a dataloader died): recoverable."""


def _tensor(wire: Mapping[str, Any]) -> Any:
    import torch

    dtype = getattr(torch, _DTYPES.get(wire["dtype"], wire["dtype"]))
    data = bytearray(wire["data"])
    if not data:
        return torch.empty(list(wire["shape"]), dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(list(wire["shape"]))


class TorchContext:
    """What train_loop(ctx) gets on its rank: prepare(), track(), batches(), report(), and rank,
    world_size, step, device, process_group. Used from the loop's thread only."""

    def __init__(self, actor: _TorchTrainerActor, gen: int) -> None:
        self._a, self._gen = actor, gen

    @property
    def rank(self) -> int:
        self._a._await_group(self._gen)
        return self._a.rank

    @property
    def world_size(self) -> int:
        self._a._await_group(self._gen)
        return self._a.world

    @property
    def step(self) -> int:
        """Steps done (the next report() ends step `step + 1`)."""
        return self._a.step

    @property
    def device(self) -> Any:
        import torch

        return torch.device("cpu")

    @property
    def process_group(self) -> Any:
        """The group's process group for this epoch (torch.distributed's default group, on the
        "troupe" backend)."""
        import torch.distributed as dist

        self._a._await_group(self._gen)
        return dist.distributed_c10d._get_default_group()

    def prepare(self, model: Any, **ddp_options: Any) -> Any:
        """`model` wrapped in DistributedDataParallel over the group's process group, with
        `ddp_options` (find_unused_parameters, gradient_as_bucket_view, static_graph, ...).
        `model` is a module, or what makes one (its class, a function of no arguments): then a
        rank that enters the loop again after a recovery keeps the module it made before (its
        memory stays warm; ctx.track() loads the restored state into it) instead of making
        another."""
        import torch

        if "process_group" in ddp_options:
            raise ArgumentTypeError("ctx.prepare: the process group is the group's; pass DDP's other options")
        if not isinstance(model, torch.nn.Module):
            if not callable(model):
                raise ArgumentTypeError(f"ctx.prepare() takes a torch.nn.Module or a function that makes one, not a "
                                f"{type(model).__name__}")
            # A lambda written in the loop is a new function on each entry, with the same code.
            key = getattr(model, "__code__", model)
            kept = self._a.kept_modules.get(key)
            model = kept if kept is not None else model()
            if not isinstance(model, torch.nn.Module):
                raise ArgumentTypeError(f"ctx.prepare(factory): the factory made a {type(model).__name__}, not a "
                                f"torch.nn.Module")
            self._a.kept_modules[key] = model
        return self._a._prepared(torch.nn.parallel.DistributedDataParallel(model, process_group=self.process_group,
                                                                           **ddp_options))

    @property
    def sync_gradients(self) -> bool:
        """Whether the current batch ends its step: always, unless max_micro_batch splits this
        rank's share into micro-batches (then only at the last; clip gradients only then)."""
        return self._a.sync_gradients

    def track(self, **objects: Any) -> None:
        """What a snapshot holds: objects with state_dict() and load_state_dict() (models,
        optimizers, schedulers). On re-entry after a recovery, the restored step's state is
        loaded into them here. A model wrapped by prepare() is tracked as the module it wraps,
        so a persisted step loads into the plain model (troupe.checkpoint.load_tracked)."""
        import torch

        objects = {name: obj.module if isinstance(obj, torch.nn.parallel.DistributedDataParallel) else obj
                   for name, obj in objects.items()}
        for name, obj in objects.items():
            if name.startswith("__"):
                raise InvalidArgumentError(f"ctx.track({name}=...): names starting with '__' are the trainer's own")
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise ArgumentTypeError(f"ctx.track({name}=...): a {type(obj).__module__}.{type(obj).__qualname__} has no "
                                f"state_dict()/load_state_dict(); track objects that have both (a model, an "
                                f"optimizer, a scheduler), or wrap the value in one")
        self._a._track(objects, self._gen)

    def batches(self) -> Any:
        """This rank's share of each global batch, as (inputs, targets) tensors, one per step
        until the group stops the loop (GroupChanged) or training ends."""
        return self._a._batches(self._gen)

    def report(self, **metrics: Any) -> None:
        """Ends the step: its metrics (numbers; `loss` is the history's loss), a memory snapshot
        when one is due; blocks after the last step of the chunk the coordinator asked for."""
        self._a._report(metrics, self._gen)


@_api.remote(num_cpus=1)
class _TorchTrainerActor:
    """One rank of a TorchTrainer's group: the Trainer interface's methods (called by the
    coordinator on a pool of call threads) and the user's loop (on a thread of its own). One
    condition, `cv`, guards the loop's progress (step, chunk, rows, outcome) and its gates.

    The loop runs ahead of the group: a new process starts it at once, and a join starts it
    again as soon as the old one has unwound, so the user's setup (imports, building the model)
    overlaps the coordinator's work. What needs the group waits at a gate: the process group
    (ctx.prepare, rank, world_size) until the join has made it, ctx.track until the restore has
    said what to load, ctx.batches until run() asks for steps. Each start of the loop is a
    generation (`gen`); a loop whose generation is not the current one unwinds (GroupChanged)."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        import cloudpickle

        self.spec = dict(spec)
        self.loop: Callable[[TorchContext], Any] = cloudpickle.loads(spec["loop"])
        self.cv = threading.Condition()
        self.rank, self.world, self.epoch = 0, 1, 0
        self.step = 0
        self.snapshot_every = int(spec.get("snapshot_every", 1))
        self.persist_every = int(spec.get("persist_every", 0))
        self.notified = 0  # the step of the last snapshot the checkpoint actor was told of
        self.bundle = int(spec["bundle"])
        # This bundle's snapshots on the node (its segment, owned by the node's Checkpoint actor).
        # The lock keeps the coordinator's calls (pin, restore) off a save in progress.
        self.flash: Any = None  # a _ckpt.FlashCheckpoint once the actor has joined its first epoch
        self.flash_lock = threading.Lock()
        self.pinned: int | None = None
        self.pending: dict[str, Any] | None = None  # the restored step's state, loaded by track()
        self.tracked: dict[str, Any] | None = None
        self.thread: threading.Thread | None = None
        self.gen = 0  # the loop's current generation
        self.used_group = False  # the current generation's loop went past the group's gate
        self.group_ready = False  # this epoch's process group is made (the join's)
        self.restored = False  # the restore of this epoch is done: `pending` is what to load
        self.kept_modules: dict[Any, Any] = {}  # ctx.prepare(factory)'s modules, kept across entries
        # Gradient accumulation (max_micro_batch): the micro-batch in progress ends its step
        # (sync_gradients), its gradients' weight (grad_scale), whether a backward ran since the
        # optimizers last stepped (accumulated), and this generation's prepared DDP models.
        self.max_micro = int(spec.get("max_micro_batch") or 0)
        self.sync_gradients, self.grad_scale, self.accumulated = True, 1.0, False
        self.ddps: list[Any] = []
        self.hooked: weakref.WeakSet[Any] = weakref.WeakSet()  # parameters whose gradients grad_scale weighs
        # Modules whose forward first checks the group (_check_group), and the loop thread's generation.
        self.watched: weakref.WeakSet[Any] = weakref.WeakSet()
        self.local = threading.local()
        self.next_check = 0.0
        self.lost_ranks: list[int] = []  # the ranks whose death this epoch's communicator saw
        self.micro_metrics: list[tuple[float, dict[str, float]]] = []
        self.chunk_end = 0
        self.rows: list[dict[str, Any]] = []
        self.outcome: tuple[str, str] | None = None
        self.taken: dict[str, Any] | None = None  # the batch of the step in progress
        self.loader: _api.ActorHandle | None = None
        self.doing = ("idle", time.time(), 0)
        self.spans: collections.deque[dict[str, Any]] = collections.deque(maxlen=4096)  # for troupe timeline
        # Imported here, before the loop's thread starts: a first import of torch in two threads
        # at once (the loop's and join's) can hand one of them a half-initialised module.
        import torch.distributed  # noqa: F401

        from . import dist  # noqa: F401 (registers the "troupe" backend)
        self._start_loop()  # a warm start: the loop's setup runs while the group is being formed

    # ---- The Trainer interface (the coordinator's calls) ----
    def join(self, epoch: int, rank: int, world: int, dataloader: str, checkpoint: str) -> dict[str, Any]:
        import datetime

        import torch.distributed as dist

        from . import dist as _backend  # registers the "troupe" backend

        with self.cv:
            self.group_ready = self.restored = False
            self.pending = None
            keep = not self.used_group and self.thread is not None and self.thread.is_alive()
        if not keep:  # a loop that used the old group unwinds; one still in its setup goes on
            self._stop_loop()
        if dist.is_initialized():
            dist.destroy_process_group()
        timeout = datetime.timedelta(seconds=float(self.spec.get("timeout", 30.0)))
        # The epoch's store in the cluster (joining the epoch ends the earlier ones): ranks on any
        # hosts meet through it, and each epoch's keys are its own.
        store = _backend.group_store(self.spec["group"], epoch, timeout)
        dist.init_process_group("troupe", store=store, rank=rank, world_size=world, timeout=timeout)
        self.rank, self.world, self.epoch = rank, world, epoch
        self.lost_ranks = []
        self.loader = _api.ActorHandle(dataloader, "Dataloader")
        with self.flash_lock:
            if checkpoint and (self.flash is None or self.flash.actor.actor_id != checkpoint):
                if self.flash is not None:
                    self.flash.close()
                self.flash = _ckpt.FlashCheckpoint(rank=self.bundle, world_size=self._images_world(),
                                                   actor=_api.ActorHandle(checkpoint, "Checkpoint"))
            if self.flash is None:
                raise RuntimeError(f"rank {rank}: joined without its node's checkpoint actor")
            self.flash.world_size = self._images_world()
        with self.cv:
            self.group_ready = True
            self.cv.notify_all()
        if not keep:
            self._start_loop()
        return {"rank": rank, "world": world}

    def _images_world(self) -> int:
        """The world size a snapshot's image says. Its rank is the bundle's (each bundle keeps its
        own snapshots), which a shrink that drops a lower bundle leaves at or past the world
        size: an image whose rank is not below its world size is refused as corrupt."""
        return max(self.world, self.bundle + 1)

    def snapshots(self) -> dict[str, Any]:
        """The steps this bundle's segment on this node holds (0, the loop's initial state, always)."""
        with self.flash_lock:
            return {"steps": sorted({0, *self.flash.steps()})}

    def restore(self, step: int, fromBundle: int = -1, fromBundles: Any = None, broadcastFrom: int = -1,  # noqa: N803
                fromBroadcast: bool = False) -> dict[str, Any]:  # noqa: N803
        """Restores `step`: 0 is the loop's initial state; else this bundle's snapshot (or bundle
        `fromBundle`'s, a node mate's), from this node's segment or staged into it by the node's
        checkpoint actor (a peer's replica or memory, or disk). With `broadcastFrom` every rank
        then takes that rank's state by a broadcast (`fromBroadcast` ranks skip their own)."""
        if fromBundles:
            raise RuntimeError("TorchTrainer's snapshots are not sharded: there is nothing to re-shard")
        restart = self._hold_loop()
        state, source = None, "seed"
        if step > 0 and not fromBroadcast:
            bundle = fromBundle if fromBundle >= 0 else self.bundle
            # Into the tensors of the objects the last entry tracked when they match (a survivor's
            # warm memory, which the loop gets back through ctx.prepare(factory) and ctx.track).
            into = _ckpt.pack_tracked(self._states())[0] if self.tracked is not None else None
            with self.flash_lock:
                flash = self.flash if bundle == self.bundle else _ckpt.FlashCheckpoint(
                    rank=bundle, world_size=max(self._images_world(), bundle + 1), actor=self.flash.actor)
                try:
                    restored = flash.restore_step(step, into=into)
                    source = flash.restored_from
                except _ckpt.CheckpointNotFoundError as e:
                    raise RuntimeError(f"rank {self.rank}: {e}") from None
                finally:
                    if flash is not self.flash:
                        flash.close()
            state = _ckpt.unpack_tracked(restored.state_dict, restored.metadata)
            if bundle != self.bundle:
                source = f"snapshot of bundle {bundle} ({source})"
        if broadcastFrom >= 0:
            import torch.distributed as dist

            box = [state if self.rank == broadcastFrom else None]
            dist.broadcast_object_list(box, src=broadcastFrom)
            if fromBroadcast:
                state, source = box[0], f"broadcast from rank {broadcastFrom}"
        self._restored(step, state, restart)
        return {"step": step, "source": source, "hash": 0}  # hash() says it: hashing costs a pass over the state

    def run(self, fromStep: int, steps: int = 1) -> dict[str, Any]:  # noqa: N803
        with self.cv:
            if self.step != fromStep:
                raise RuntimeError(f"rank {self.rank}: trainer is at step {self.step}, asked to run from step "
                                   f"{fromStep}")
            ended = self.thread is None or not self.thread.is_alive()
            if not (ended and self.outcome is not None and self.outcome[0] == "error"):  # else: say it below
                self.outcome = None
            self.chunk_end, self.rows = fromStep + steps, []
            self.cv.notify_all()
        if ended and self.outcome is None:  # the loop returned earlier: it is entered again
            self._start_loop()
        with self.cv:
            while len(self.rows) < steps and self.outcome is None:
                self.cv.wait()
            rows, outcome = list(self.rows), self.outcome
        if len(rows) < steps:
            assert outcome is not None  # the loop thread ended: it said how
            kind, text = outcome
            if kind == "error":
                raise RuntimeError(f"{_LOOP_FAILED} on rank {self.rank} at step {self.step + 1}:\n{text}")
            if kind == "returned":
                raise RuntimeError(f"{_LOOP_FAILED} on rank {self.rank} at step {self.step + 1}:\ntrain_loop "
                                   f"returned before the chunk's last step ({fromStep + steps}); it should "
                                   f"iterate ctx.batches() until training ends")
            raise RuntimeError(f"rank {self.rank}: the group changed at step {self.step + 1}: {text}")
        return {"metrics": rows, "hash": 0, **self.pin()}

    def lostPeers(self) -> dict[str, Any]:  # noqa: N802
        """The ranks of this epoch whose death this rank's communicator saw (the kernel released
        their life lock, or their connection ended without a goodbye): the coordinator need not
        wait for the cluster to learn of it before it re-forms the group without them."""
        self._note_lost_ranks()
        return {"epoch": self.epoch, "ranks": list(self.lost_ranks)}

    def finished(self, after: int) -> dict[str, Any]:
        """This rank's rows of the steps after `after` in its last chunk (one that failed: the
        coordinator lost the run() reply, not the steps)."""
        with self.cv:
            return {"metrics": [r for r in self.rows if r["step"] > after]}

    def pin(self, snapshot: bool = False) -> dict[str, Any]:
        """Pins this bundle's newest snapshot at or before the current step here and in its
        replica (snapshots after the step, of a timeline the group left, are dropped); with
        `snapshot` the current step is snapshotted first unless it is held already."""
        with self.flash_lock:
            if snapshot and self.step > 0 and self.step not in self.flash.steps():
                if self.pending is not None:  # restored, and the loop has not taken it yet
                    self._save(self.pending)
                elif self.tracked is not None:
                    self._save(self._states())
            self.pinned = self.flash.pin(self.step) if self.step > 0 else None
        return self._pin_reply()

    def _pin_reply(self) -> dict[str, Any]:
        return {"hasPinned": self.pinned is not None, "pinned": self.pinned or 0}

    def hash(self) -> dict[str, Any]:
        """A hash of the tracked models' tensors (the restored state's until the loop takes it)."""
        with self.cv:
            pending, tracked = self.pending, self.tracked
        state = pending if pending is not None else (
            {name: obj.state_dict() for name, obj in tracked.items()} if tracked is not None else None)
        return {"hash": _state_hash(state), "step": self.step}

    def configure(self, snapshotEvery: int = -1, threads: int = -1, prefetch: int = -1) -> dict[str, Any]:  # noqa: N803
        import torch

        if threads > 0 and (self.spec.get("fault") or {}).get("kill_when_threads_set_to") == threads:
            self._killed_once()

        if snapshotEvery > 0:
            self.snapshot_every = int(snapshotEvery)
        if threads > 0:
            torch.set_num_threads(int(threads))
        return {"snapshotEvery": self.snapshot_every, "threads": torch.get_num_threads(), "prefetch": 0}

    def activity(self) -> dict[str, Any]:
        name, since, step = self.doing
        return {"rank": self.rank, "world": self.world, "pid": os.getpid(),
                "activity": {"name": name, "startUs": int(since * 1e6), "durUs": 0, "step": step, "bucket": -1,
                             "bytes": 0},
                "forS": time.time() - since, "waitingOn": self._waiting_on()}

    @staticmethod
    def _waiting_on() -> str:
        """The peers the loop's collective in progress waits for (the backend says), for hang reports."""
        try:
            import torch.distributed as dist

            from . import dist as troupe_dist

            return troupe_dist.waiting_on() if dist.is_initialized() else ""
        except Exception as e:  # a report must not fail for it
            return f"(unknown: {e})"

    def timeline(self) -> dict[str, Any]:
        """The newest spans of the loop's steps (data wait, step, snapshot), as the C++ trainer's."""
        return {"rank": self.rank, "world": self.world, "pid": os.getpid(), "spans": list(self.spans)}

    def _span(self, name: str, start: float, end: float, step: int) -> None:
        """`start` and `end` in time.time() seconds."""
        self.spans.append({"name": name, "startUs": int(start * 1e6), "durUs": int((end - start) * 1e6),
                           "step": step, "bucket": -1, "bytes": 0})

    def loadDir(self, dir: str, step: int) -> dict[str, Any]:  # noqa: N802,A002
        """Loads the newest complete step at or below `step` (0: the newest) persisted in `dir`."""
        restart = self._hold_loop()
        state, got = _ckpt.load_tracked(dir, step=step or None)
        self._restored(got, state, restart)
        return {"step": got, "source": f"{dir} step {got}", "hash": 0}

    def _killed_once(self) -> None:
        """Tests' fault injection: SIGKILL of this process, the first time only (a flag file in
        the group's workdir remembers it across the restart)."""
        flag = os.path.join(self.spec["workdir"], f"fault-killed-{self.spec['bundle']}")
        if not os.path.exists(flag):
            open(flag, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

    # ---- The loop's life: its generations and gates ----
    def _start_loop(self) -> None:
        """Enters the loop again in a new thread, a new generation."""
        with self.cv:
            self.gen += 1
            self.used_group = False
            self.taken = None  # a step an earlier entry took and did not finish is taken again
            self.ddps, self.micro_metrics = [], []
            self.sync_gradients, self.grad_scale, self.accumulated = True, 1.0, False
            self.thread = threading.Thread(target=self._loop_main, args=(self.gen,), name="troupe-train-loop",
                                           daemon=True)
            self.thread.start()

    def _hold_loop(self) -> bool:
        """Before a restore: a loop that went past the gate (it trains on the tensors the restore
        writes) unwinds, and is entered again by _restored(); one still before the gate waits
        there for the restore. Returns whether the loop was stopped."""
        with self.cv:
            stop = self.used_group and self.thread is not None and self.thread.is_alive()
            self.restored = False
        if stop:
            self._stop_loop()
        return stop

    def _restored(self, step: int, state: dict[str, Any] | None, restart: bool) -> None:
        with self.cv:
            self.step, self.chunk_end, self.pending = step, step, state
            self.restored = True
            self.cv.notify_all()
        if restart:
            self._start_loop()

    def _await_group(self, gen: int) -> None:
        """The gate: the loop of generation `gen` waits until this epoch's process group is made
        and its step restored (GroupChanged if a newer generation replaced it meanwhile)."""
        with self.cv:
            while not (self.group_ready and self.restored) and gen == self.gen:
                self.doing = ("waiting for the group", time.time(), self.step)
                self.cv.wait()
            if gen != self.gen:
                raise GroupChanged("the group re-forms")
            self.used_group = True

    def _loop_main(self, gen: int) -> None:
        self.local.gen = gen
        try:
            self.loop(TorchContext(self, gen))
            outcome = ("returned", "")
        except GroupChanged as e:
            outcome = ("changed", str(e) or "the coordinator re-formed the group")
        except BaseException as e:  # noqa: B036 (the loop's failure goes to run(), whatever it is)
            text = traceback.format_exc()
            outcome = (("changed", text) if isinstance(e, _GroupFailure) or self._group_broken(gen)
                       else ("error", text))
        if outcome[0] == "changed":
            self._note_lost_ranks()
        with self.cv:
            if gen == self.gen:  # an older generation's end is not this one's outcome
                self.outcome = outcome
                self.doing = ("loop ended", time.time(), self.step)
            self.cv.notify_all()

    def _note_lost_ranks(self) -> None:
        try:
            import torch.distributed as dist

            from . import dist as troupe_dist

            if dist.is_initialized():
                self.lost_ranks = list(troupe_dist.dead_peers())
        except Exception:  # the group is being re-formed: it says nothing more
            pass

    def _group_broken(self, gen: int) -> bool:
        """The group's communicator failed (a peer died) or the coordinator re-forms the group."""
        if gen != self.gen:
            return True
        try:
            from . import dist as troupe_dist

            return troupe_dist.health() != "OK"
        except Exception:
            return True

    def _stop_loop(self) -> None:
        """Ends the loop's thread before the group re-forms: GroupChanged out of its wait, or its
        collective fails when the old process group is destroyed."""
        with self.cv:
            thread = self.thread
            self.gen += 1  # the loop's waits raise GroupChanged
            self.cv.notify_all()
        if thread is None or not thread.is_alive():
            return
        thread.join(timeout=5.0)
        if thread.is_alive():  # blocked in a collective of the old group
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            thread.join(timeout=float(self.spec.get("timeout", 30.0)))
        if thread.is_alive():
            frame = sys._current_frames().get(thread.ident or 0)
            where = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)"
            raise RuntimeError(f"rank {self.rank}: train_loop did not stop when the group re-formed (is it "
                               f"blocked outside ctx.report()/ctx.batches() and the process group?); the loop's "
                               f"thread is at:\n{where}")

    # ---- Gradient accumulation (max_micro_batch) ----
    def _prepared(self, ddp: Any) -> Any:
        """A model ctx.prepare() wrapped. Its modules that hold parameters check the group before
        their forward, so a survivor stops a step the group lost within a layer of the peer's
        death (the backward stops at its next all-reduce anyway). With max_micro_batch, its
        all-reduce follows the micro-batches and its gradients are weighed by each micro-batch's
        share of the rows."""
        for module in ddp.module.modules():
            if module not in self.watched and next(module.parameters(recurse=False), None) is not None:
                self.watched.add(module)
                module.register_forward_pre_hook(self._check_group)
        if self.max_micro:
            self.ddps.append(ddp)
            for p in ddp.module.parameters():
                if p.requires_grad and p not in self.hooked:  # once, though a kept module comes back
                    self.hooked.add(p)
                    p.register_hook(self._weigh_gradient)
        return ddp

    def _check_group(self, *_: Any) -> None:
        """GroupChanged in a loop's thread once its generation is over or the communicator failed
        (a peer died: its collectives would fail). Checked at most every 2 ms."""
        gen = getattr(self.local, "gen", None)
        now = time.monotonic()
        if gen is None or now < self.next_check:
            return
        self.next_check = now + 0.002
        if gen != self.gen:
            raise GroupChanged("the group re-forms")
        try:
            from . import dist as troupe_dist

            health = troupe_dist.health()
        except Exception as e:  # no process group: it was destroyed to re-form the group
            health = str(e)
        if health != "OK":
            raise GroupChanged(f"rank {self.rank}: the group's communicator failed: {health}")

    def _weigh_gradient(self, grad: Any) -> Any:
        self.accumulated = True
        return grad if self.grad_scale == 1.0 else grad * self.grad_scale

    def _set_micro(self, sync: bool, scale: float) -> None:
        self.sync_gradients, self.grad_scale = sync, scale
        for ddp in self.ddps:
            ddp.require_backward_grad_sync = sync  # what DDP.no_sync() sets: read by its forward

    def _hold_steps(self, obj: Any) -> None:
        """A tracked optimizer steps only at a step's last micro-batch, and its zero_grad acts
        only when no gradient was accumulated since it last stepped (before the first micro-batch's
        backward, or after the step: either order of a loop works); a scheduler steps only at the
        last micro-batch."""
        import torch

        if getattr(obj, "_troupe_accumulates", False):
            return
        if isinstance(obj, torch.optim.Optimizer):
            step, zero_grad = obj.step, obj.zero_grad

            def held_step(*args: Any, **kwargs: Any) -> Any:
                if not self.sync_gradients:
                    return None
                self.accumulated = False
                return step(*args, **kwargs)

            def held_zero_grad(*args: Any, **kwargs: Any) -> Any:
                return None if self.accumulated else zero_grad(*args, **kwargs)

            setattr(obj, "step", held_step)
            setattr(obj, "zero_grad", held_zero_grad)
            setattr(obj, "_troupe_accumulates", True)  # an optimizer's state_dict() holds no attributes
        elif type(obj).__module__.startswith("torch.optim.lr_scheduler") and callable(getattr(obj, "step", None)):
            # A scheduler's state_dict() is its __dict__: its class changes instead.
            obj.__class__ = _held_scheduler(type(obj), self)

    def _track(self, objects: dict[str, Any], gen: int) -> None:
        import torch

        self._await_group(gen)
        if self.max_micro:
            if not self.ddps:
                raise RuntimeError("ctx.track: with max_micro_batch, pass the model through ctx.prepare() first (its "
                                   "all-reduce and gradients follow the micro-batches)")
            for obj in objects.values():
                self._hold_steps(obj)
        with self.cv:
            pending, self.pending = self.pending, None
        if pending is not None:
            missing = sorted(set(objects) - set(pending))
            if missing:
                raise KeyError(f"ctx.track: the restored step {self.step} holds no state for {missing} (it holds "
                               f"{sorted(k for k in pending if not k.startswith('__'))}); track the same names on "
                               f"every entry")
            for name, obj in objects.items():
                _load_state(obj, pending[name])
            rng = pending.get("__rng__") or {}
            if "torch" in rng:
                torch.set_rng_state(rng["torch"])
            if "python" in rng:
                random.setstate(rng["python"])
            if rng.get("cuda") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        self.tracked = dict(objects)
        if self.step > 0 and pending is None:
            with self.flash_lock:
                held = self.step in self.flash.steps()
            if not held:
                self._snapshot()

    def _states(self) -> dict[str, Any]:
        """What a snapshot holds: every tracked object's state_dict() and the RNG states."""
        import torch

        assert self.tracked is not None  # track() ran
        states = {name: obj.state_dict() for name, obj in self.tracked.items()}
        states["__rng__"] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
        return states

    def _save(self, states: Mapping[str, Any]) -> None:
        """Saves `states` as the current step into this bundle's segment (a memory copy); the
        checkpoint actor is told (persist, replicate) by the first snapshot at or past each
        multiple of persist_every (snapshot_every, which the coordinator may raise, need not
        divide it)."""
        tensors, metadata = _ckpt.pack_tracked(states)
        every = self.persist_every
        notify = every <= 0 or self.step // every != self.notified // every or self.step < self.notified
        self.flash.save(self.step, tensors, metadata, notify=notify)
        if notify:
            self.notified = self.step

    def _snapshot(self) -> float:
        t0 = time.monotonic()
        with self.flash_lock:
            self._save(self._states())
        return time.monotonic() - t0

    def _wait_for_chunk(self, gen: int) -> None:
        with self.cv:
            while self.step >= self.chunk_end and gen == self.gen:
                self.doing = ("waiting for the next chunk", time.time(), self.step)
                self.cv.wait()
            if gen != self.gen:
                raise GroupChanged(f"the group re-forms at step {self.step}")

    def _batches(self, gen: int) -> Any:
        self._await_group(gen)
        while True:
            if self.taken is not None:
                raise RuntimeError(f"rank {self.rank}: step {self.step + 1}'s batch was not reported: call "
                                   f"ctx.report() once per batch")
            self._wait_for_chunk(gen)
            t0 = time.monotonic()
            step = self.step
            self.doing = ("data wait", time.time(), step + 1)
            if (self.spec.get("fault") or {}).get("kill_at_step") == step:
                self._killed_once()  # the restarted process trains the step
            try:
                batch = _typed.get(self.loader, "Dataloader", "take", step=step, rank=self.rank,
                                   world=self.world)["batch"]
            except (ActorDiedError, ActorError, TroupeError) as e:
                raise _GroupFailure(f"rank {self.rank}: take of step {step + 1} failed: {e}") from e
            self.taken = {"ids": list(batch["sampleIds"]), "wait_s": time.monotonic() - t0, "t": time.monotonic(),
                          "wall": time.time(), "reported": 0}
            self._span("data wait", self.taken["wall"] - self.taken["wait_s"], self.taken["wall"], step + 1)
            self.doing = ("step", time.time(), step + 1)
            inputs, targets = _tensor(batch["inputs"]), _tensor(batch["targets"])
            parts = -(-len(inputs) // self.max_micro) if self.max_micro and len(inputs) else 1
            if parts <= 1:
                self._set_micro(True, 1.0)
                yield inputs, targets
                continue
            import torch

            # Contiguous near-equal parts, as the ranks' shares of a global batch are: a rank
            # training the shares of two ranks in two micro-batches adds the same gradients.
            for i, (x, y) in enumerate(zip(torch.tensor_split(inputs, parts), torch.tensor_split(targets, parts))):
                if self.taken is not None and self.taken["reported"] < i:
                    raise RuntimeError(f"rank {self.rank}: micro-batch {i} of step {step + 1} was not reported: "
                                       f"call ctx.report() once per batch")
                self._set_micro(i == parts - 1, len(x) / len(inputs))
                yield x, y

    def _report(self, metrics: Mapping[str, Any], gen: int) -> None:
        if self.taken is not None and not self.sync_gradients:  # a micro-batch before the step's last
            self.taken["reported"] += 1
            self.micro_metrics.append((self.grad_scale, {k: float(v) for k, v in metrics.items()}))
            return
        taken, self.taken = self.taken, None
        if taken is None:
            raise RuntimeError(f"rank {self.rank}: ctx.report() without a batch: call it once per batch of "
                               f"ctx.batches()")
        if self.micro_metrics:  # the step's metrics: each micro-batch's, weighed by its rows
            parts, self.micro_metrics = self.micro_metrics + [(self.grad_scale, dict(metrics))], []
            metrics = {k: sum(w * float(m.get(k, 0.0)) for w, m in parts) for k in parts[-1][1]}
        compute = time.monotonic() - taken["t"]
        self._span("step", taken["wall"], taken["wall"] + compute, self.step + 1)
        try:
            _typed.get(self.loader, "Dataloader", "complete", step=self.step, rank=self.rank)
        except (ActorDiedError, ActorError, TroupeError) as e:
            raise _GroupFailure(f"rank {self.rank}: complete of step {self.step + 1} failed: {e}") from e
        values = {k: float(v) for k, v in metrics.items()}
        with self.cv:
            self.step += 1
        snapshot_s = self._snapshot() if self.tracked is not None and self.step % self.snapshot_every == 0 else 0.0
        if snapshot_s:
            self._span("snapshot", time.time() - snapshot_s, time.time(), self.step)
        row = {"step": self.step, "loss": values.get("loss", math.nan), "computeS": compute, "commS": 0.0,
               "waitS": taken["wait_s"], "snapshotS": snapshot_s, "samples": int(self.spec["global_batch"]),
               "bytesAllreduced": 0, "sampleIds": taken["ids"], "metrics": values}
        with self.cv:
            self.rows.append(row)
            self.cv.notify_all()
        self._wait_for_chunk(gen)


def _actor_name(group: str, bundle: int) -> str:
    return f"torch-trainer-{group}-{bundle}"


_HELD_SCHEDULERS: dict[type, type] = {}


def _held_scheduler(cls: type, actor: _TorchTrainerActor) -> type:
    """A subclass of the scheduler class `cls` whose step() acts only at a step's last
    micro-batch (the actor's sync_gradients)."""
    held = _HELD_SCHEDULERS.get(cls)
    if held is None:
        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(cls, "step")(self, *args, **kwargs) if getattr(type(self), "actor").sync_gradients else None

        held = _HELD_SCHEDULERS[cls] = type(f"Held{cls.__name__}", (cls,), {"step": step})
    setattr(held, "actor", actor)
    return held


def _load_state(obj: Any, state: Any) -> None:
    """obj.load_state_dict(state). An optimizer takes the restored tensors as they are: torch's
    Optimizer.load_state_dict deep-copies the whole state first (0.4 s for AdamW's 800 MB at
    100M parameters here), and the restore made these tensors for this load alone."""
    import copy

    import torch

    optimizer_module = sys.modules.get(torch.optim.Optimizer.__module__)  # torch.optim deletes its name
    if not (isinstance(obj, torch.optim.Optimizer) and getattr(optimizer_module, "deepcopy", None) is copy.deepcopy):
        obj.load_state_dict(state)
        return

    def tensors_kept(value, memo=None):
        memo = {} if memo is None else memo
        stack = [value]
        while stack:
            v = stack.pop()
            if isinstance(v, torch.Tensor):
                memo[id(v)] = v  # deepcopy hands back what its memo holds
            elif isinstance(v, Mapping):
                stack.extend(v.values())
            elif isinstance(v, (list, tuple)):
                stack.extend(v)
        return copy.deepcopy(value, memo)

    setattr(optimizer_module, "deepcopy", tensors_kept)
    try:
        obj.load_state_dict(state)
    finally:
        setattr(optimizer_module, "deepcopy", copy.deepcopy)


def _state_hash(state: Mapping[str, Any] | None) -> int:
    """64 bits of a hash of the tensors of a snapshot's modules (equal on every rank of a
    healthy data-parallel group)."""
    import torch

    if not state:
        return 0
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(k for k in state if not k.startswith("__")):
        value = state[name]
        if isinstance(value, Mapping) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
            for key in sorted(value):
                h.update(key.encode())
                h.update(value[key].detach().contiguous().numpy().tobytes())
    return int.from_bytes(h.digest(), "little")


def _materialize(dataset: Any, workdir: str) -> dict[str, str]:
    """A map-style dataset of (features, label) pairs as the .npy features/labels spec the
    Dataloader reads: float32 features (flattened per sample) and int64 labels, written once."""
    import numpy as np

    n = len(dataset)
    if n == 0:
        raise InvalidArgumentError("data: the dataset is empty")
    xs, ys = [], []
    for i in range(n):
        item = dataset[i]
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise InvalidArgumentError(f"data[{i}] is a {type(item).__name__}: a map-style dataset of (features, label) "
                             f"pairs is needed")
        x, y = item
        xs.append(np.asarray(x, dtype=np.float32).reshape(-1))
        ys.append(int(y))
    features, labels = os.path.join(workdir, "features.npy"), os.path.join(workdir, "labels.npy")
    np.save(features, np.stack(xs))
    np.save(labels, np.asarray(ys, dtype=np.int64))
    return {"kind": "npy", "features": features, "labels": labels}


_STAGE_CHUNK = 8 << 20  # bytes per write() of a staged file (far below what one call may carry)
_STAGE_IN_FLIGHT = 8


@_api.remote(num_cpus=0)
class _DataStager:
    """A TorchTrainer's Dataset on one node: the .npy files the node's Dataloader reads. The
    driver's own files when this node sees them (same file: device, inode, size and mtime; one
    host, or a shared file system), else a copy sent through the cluster in chunks (each write's
    place checked against the size the driver declared, each file's CRC32 checked once whole) into
    a 0700 directory under the node's run directory, removed with the group (or by troupe stop)."""

    def __init__(self, group: str) -> None:
        self.group, self.sealed = group, False
        self.dir: str | None = None
        self.files: dict[str, dict[str, Any]] = {}

    def stage(self, files: Mapping[str, Mapping[str, Any]], copy: bool = False) -> dict[str, Any]:
        """`files`: {name: {"path", "size", "dev", "ino", "mtime_ns"}} of the driver's."""
        def visible(meta: Mapping[str, Any]) -> bool:
            try:
                st = os.stat(meta["path"])
            except OSError:
                return False
            return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) == (meta["dev"], meta["ino"], meta["size"],
                                                                           meta["mtime_ns"])

        if not copy and all(visible(m) for m in files.values()):
            return {"paths": {name: m["path"] for name, m in files.items()}, "copy": False}
        if self.sealed:  # staged already (the node's services were made again)
            return {"paths": {name: f["path"] for name, f in self.files.items()}, "copy": False}
        import tempfile

        self.dir = tempfile.mkdtemp(prefix=f"troupe-data-{self.group}-")
        for name, meta in files.items():
            if os.path.basename(name) != name or name.startswith("."):
                raise InvalidArgumentError(f"staged file name {name!r} is not a plain file name")
            path = os.path.join(self.dir, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, int(meta["size"]))
            finally:
                os.close(fd)
            self.files[name] = {"path": path, "size": int(meta["size"])}
        return {"paths": {name: f["path"] for name, f in self.files.items()}, "copy": True}

    def write(self, name: str, offset: int, data: bytes) -> int:
        f = self.files.get(name)
        if f is None:
            raise InvalidArgumentError(f"no staged file {name!r}")
        if offset < 0 or offset + len(data) > f["size"]:
            raise InvalidArgumentError(f"{name}: a write of {len(data)} bytes at {offset} runs past its {f['size']} bytes")
        fd = os.open(f["path"], os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)
        return len(data)

    def seal(self, crcs: Mapping[str, int]) -> dict[str, Any]:
        """Checks every staged file whole against the CRC32 of the driver's (`crcs`, by name)."""
        import zlib

        for name, f in self.files.items():
            crc = 0
            with open(f["path"], "rb") as fh:
                while chunk := fh.read(_STAGE_CHUNK):
                    crc = zlib.crc32(chunk, crc)
            if crc != crcs.get(name):
                raise InvalidArgumentError(f"staged {name} does not match the driver's file (CRC32 {crc:08x}, the driver's "
                                 f"{crcs.get(name, 0):08x})")
        self.sealed = True
        return {"files": len(self.files)}

    def remove(self) -> None:
        import shutil

        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


def _file_meta(path: str) -> dict[str, Any]:
    st = os.stat(path)
    return {"path": path, "size": st.st_size, "dev": st.st_dev, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns}


class _TorchTrainers:
    """The coordinator's trainers are Python processes running the user's loop
    (_TorchTrainerActor); their methods take keywords and return dicts."""

    name = "torch"
    # A restarted rank is a new Python process that imports torch and builds the model (seconds):
    # the group trains on without it and takes it back once its loop waits at the group's gate.
    heals_in_background = True

    def __init__(self, loop: bytes, data: Any, global_batch: int, seed: int, fault: Mapping[str, Any],
                 timeout: float, max_micro_batch: int = 0) -> None:
        self.loop, self.data, self.global_batch, self.seed = loop, data, global_batch, seed
        self.max_micro_batch = max_micro_batch
        self.files: dict[str, dict[str, Any]] = {}  # a materialized Dataset's files, staged on each node
        self.stagers: dict[str, Any] = {}
        self.fault, self.timeout = dict(fault or {}), timeout

    def prepare(self, workdir: str) -> tuple[dict[str, Any], dict[str, str]]:
        if isinstance(self.data, (str, os.PathLike, Mapping)):
            spec = _data_spec(self.data)
        else:
            spec = _materialize(self.data, workdir)
            self.files = {os.path.basename(spec[k]): _file_meta(spec[k]) for k in ("features", "labels")}
        engine = {"kind": "torch", "seed": self.seed, "global_batch": self.global_batch, "context": 1,
                  "max_micro_batch": self.max_micro_batch,
                  "sequence_parallel": 1, "zero": 0}
        return engine, spec

    def call(self, handle: Any, method: str, **params: Any) -> Any:
        return getattr(handle, method).remote(**params)

    def reply(self, method: str, value: Any) -> dict[str, Any]:
        return value

    def probe(self, handle: Any) -> Any:
        return handle.activity.remote()

    def data_for(self, group: GroupCoordinator, node: str, bundle: int) -> dict[str, Any]:
        """The data spec of `node`'s Dataloader: a Dataset the driver materialized is staged on
        the node first (a node on another host without a shared file system gets a copy)."""
        if not self.files:  # the user's files (every host has them), or an adopted group's spec
            return group._data
        for attempt in (1, 2):  # a stager that ended (its node's worker processes did) is made again
            stager: Any = self.stagers.get(node)
            if stager is None:
                stager = self.stagers[node] = cast(Any, _DataStager).options(
                    num_cpus=0, max_restarts=0, placement_group=group.group_id, bundle_index=bundle,
                    lifetime=group._lifetime).remote(group.group_id)
            try:
                reply = _api.get(stager.stage.remote(self.files, copy=bool(self.fault.get("copy_data"))),
                                 timeout=self.timeout)
                break
            except ActorDiedError:
                del self.stagers[node]
                if attempt == 2:
                    raise
        if reply["copy"]:
            import zlib

            pending: list[Any] = []
            crcs = {}
            for name, meta in self.files.items():
                with open(meta["path"], "rb") as fh:
                    offset, crc = 0, 0
                    while chunk := fh.read(_STAGE_CHUNK):
                        if len(pending) >= _STAGE_IN_FLIGHT:
                            _api.get(pending.pop(0), timeout=self.timeout)
                        pending.append(stager.write.remote(name, offset, chunk))
                        offset, crc = offset + len(chunk), zlib.crc32(chunk, crc)
                crcs[name] = crc
            _api.get(pending, timeout=self.timeout)
            _api.get(stager.seal.remote(crcs), timeout=self.timeout)
            group._event(f"data: staged {sum(m['size'] for m in self.files.values())} bytes on node {node}")
        paths = reply["paths"]
        return {**group._data, "features": paths["features.npy"], "labels": paths["labels.npy"]}

    def close(self) -> None:
        """The staged copies go with the group."""
        try:
            _api.get([s.remove.remote() for s in self.stagers.values()], timeout=30)
        except Exception:
            pass
        for stager in self.stagers.values():
            _api.kill(stager)
        self.stagers = {}

    def lost_peers(self, handle: Any) -> Any:
        return handle.lostPeers.remote()

    def finished(self, handle: Any, after: int) -> Any:
        """The rank's rows of the steps after `after` that its last chunk finished."""
        return handle.finished.remote(after)

    def warm(self, reply: Mapping[str, Any]) -> bool:
        """Whether a restarted rank that answered probe() can join without making the others
        wait for its setup: its loop waits at the group's gate."""
        return reply["activity"]["name"] == "waiting for the group"

    def handle(self, actor_id: str) -> Any:
        return _api.ActorHandle(actor_id, "py:_TorchTrainerActor")

    def fatal(self, failure: BaseException) -> TrainLoopError | None:
        text = str(failure)
        found = re.search(re.escape(_LOOP_FAILED) + r" on rank (\d+) at step (\d+):\n", text)
        if not found:
            return None
        remote = text[found.end():]
        return TrainLoopError(f"train_loop raised on rank {found.group(1)} at step {found.group(2)}:\n{remote}",
                              int(found.group(1)), int(found.group(2)), remote)

    def spawn(self, group: GroupCoordinator, bundle: int) -> Any:
        spec = {"loop": self.loop, "group": group.group_id, "bundle": bundle, "workdir": group._workdir,
                "global_batch": self.global_batch, "max_micro_batch": int(group._engine.get("max_micro_batch", 0)),
                "snapshot_every": group._checkpoint["snapshot_every"],
                "persist_every": group._checkpoint["persist_every"], "timeout": self.timeout,
                "fault": self.fault if self.fault.get("rank") == bundle else {}}
        return cast(Any, _TorchTrainerActor).options(num_cpus=1, max_restarts=-1, max_concurrency=4,
                                          placement_group=group.group_id, bundle_index=bundle,
                                          name=_actor_name(group.group_id, bundle),
                                          namespace=_api.DEFAULT_NAMESPACE,  # any driver's, as the group
                                          lifetime=group._lifetime).remote(spec)


class TorchTrainer(GroupCoordinator):
    """The user's own PyTorch loop, `train_loop(ctx)`, on every rank of an elastic group (see
    the module docstring). `data`: a map-style torch Dataset of (features, label) pairs
    (written once as .npy files the group's Dataloader serves), or ElasticTrainer's data specs.
    `global_batch_size` is split over the ranks, and stays fixed when the world changes. With
    `max_micro_batch` (as ElasticTrainer's), a rank whose share is larger trains it as several
    micro-batches with gradient accumulation, so a shrink does not grow what a rank holds at once:
    ctx.batches() yields each micro-batch, the tracked optimizers and schedulers step (and
    zero_grad acts) only at the step's last, where ctx.sync_gradients is True (clip gradients
    there), the prepared model all-reduces only then, and each micro-batch's gradient is weighted
    by its share of the rank's rows. `scaling`, `failure`, `checkpoint` and `tuner`
    as ElasticTrainer's (checkpoint: snapshots every snapshot_every steps into the nodes' shared
    memory, replicated to the next node; with `dir`, persisted every persist_every steps and
    resumed from on start). fit(steps=N) returns one row per step (its `metrics` are rank 0's
    report()); `step`, `recoveries`, `members()` and close() as ElasticTrainer's. An exception
    in train_loop is raised by fit() as TrainLoopError with the rank and remote traceback.
    `name` and `detached=True` as ElasticTrainer's: the group outlives its driver, and a driver
    that makes TorchTrainer(..., name=N, detached=True) again (a job's restart) adopts it: its
    trainers keep their processes and the loop they run; fit(until=S) goes on."""

    def __init__(self, train_loop: Callable[[TorchContext], Any], data: Any = None, global_batch_size: int = 32, *,
                 scaling: ScalingConfig | None = None, failure: FailureConfig | None = None,
                 checkpoint: CheckpointConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
                 tuner: bool | Mapping[str, Any] | None = None, seed: int = 0, steps_per_call: int = 10,
                 progress: bool = True, name: str | None = None, detached: bool = False,
                 tensorboard_dir: str | None = None, max_micro_batch: int | None = None,
                 _fault: Mapping[str, Any] | None = None) -> None:
        import cloudpickle

        if not callable(train_loop):
            raise ArgumentTypeError(f"train_loop must be a function of ctx, not {type(train_loop).__name__}")
        if data is None:
            raise InvalidArgumentError("data is required: a map-style Dataset of (features, label) pairs or a data spec")
        scaling, failure, ckpt = _configs(scaling, failure, checkpoint, {"tuner": tuner})
        if global_batch_size < scaling.max_workers:
            raise InvalidArgumentError(f"global_batch_size {global_batch_size} is smaller than max_workers {scaling.max_workers}")
        if max_micro_batch is not None and (isinstance(max_micro_batch, bool) or not isinstance(max_micro_batch, int)
                                            or max_micro_batch < 1):
            raise InvalidArgumentError(f"max_micro_batch must be an integer >= 1, not {max_micro_batch!r}")
        module = getattr(train_loop, "__module__", "__main__")
        loaded = __import__("sys").modules.get(module)
        if loaded is not None and module != "__main__" and not module.startswith("troupe"):
            try:  # the workers may not import the user's module: the loop travels by value
                cloudpickle.register_pickle_by_value(loaded)
            except ValueError:
                pass
        loop = cloudpickle.dumps(train_loop)
        kind = _TorchTrainers(loop, data, int(global_batch_size), int(seed), _fault or {},
                              failure.recovery_timeout, int(max_micro_batch or 0))
        if detached and name is None:
            raise InvalidArgumentError("detached=True needs a name: a restarted driver adopts the group by it")
        self._start(kind, scaling, failure, ckpt, name=name, detached=detached, progress=progress,
                    steps_per_call=steps_per_call, tensorboard_dir=tensorboard_dir, fault=None)
