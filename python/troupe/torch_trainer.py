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
hash, configure, activity, timeline) and runs `train_loop(ctx)` in a thread of its own. run()
lets the loop go on until the chunk's last report(); report() then blocks until the next run().
When the group re-forms (join), the loop's thread gets GroupChanged out of report() or
batches() (or its collective fails: the backend fails every pending one when a peer dies),
unwinds, and the loop is entered again in the same process after the restore: imports, the
process's objects and torch stay; ctx.track() loads the restored step's state.

Snapshots: every snapshot_every steps (default every step) each rank copies the tensors of every
tracked object's state_dict (detach().clone(): memory copies, no pickling) and the torch RNG
state into its process's memory, keeping the newest `keep` steps and the pinned one. A rank
whose process was restarted (kill -9) says so in its join reply and copies the restored step
from a live peer's memory (an actor call; the state is data parallel, so any rank's is its).
Left for checkpoint/'s tiers: the shared-memory segment, the replica on another host, and
persisting (checkpoint={"dir": ...} is accepted and ignored by this trainer kind).

Rendezvous: a c10d FileStore per (group, epoch) under the coordinator's work directory, so all
ranks must share its file system (one host). TODO(correctness): a store over the cluster for
groups that span hosts.
"""
from __future__ import annotations

import copy
import hashlib
import math
import os
import re
import signal
import threading
import time
import traceback
from collections.abc import Mapping
from typing import Any, Callable

from . import _api, _typed
from ._api import ActorDiedError, ActorError, TroupeError
from .train import (CheckpointConfig, FailureConfig, GroupCoordinator, ScalingConfig, _configs, _data_spec)

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


def _copy_tree(value: Any) -> Any:
    """A copy of a state_dict: tensors copied in memory (detach().clone()), containers rebuilt,
    anything else deep-copied."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return type(value)((k, _copy_tree(v)) for k, v in value.items()) if type(value) is not dict else \
            {k: _copy_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_tree(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_copy_tree(v) for v in value)
    return copy.deepcopy(value)


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

    def __init__(self, actor: _TorchTrainerActor) -> None:
        self._a = actor

    @property
    def rank(self) -> int:
        return self._a.rank

    @property
    def world_size(self) -> int:
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

        return dist.distributed_c10d._get_default_group()

    def prepare(self, model: Any) -> Any:
        """`model` wrapped in DistributedDataParallel over the group's process group."""
        import torch

        return torch.nn.parallel.DistributedDataParallel(model, process_group=self.process_group)

    def track(self, **objects: Any) -> None:
        """What a snapshot holds: objects with state_dict() and load_state_dict() (models,
        optimizers, schedulers). On re-entry after a recovery, the restored step's state is
        loaded into them here."""
        for name, obj in objects.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"ctx.track({name}=...): a {type(obj).__module__}.{type(obj).__qualname__} has no "
                                f"state_dict()/load_state_dict(); track objects that have both (a model, an "
                                f"optimizer, a scheduler), or wrap the value in one")
        self._a._track(objects)

    def batches(self) -> Any:
        """This rank's share of each global batch, as (inputs, targets) tensors, one per step
        until the group stops the loop (GroupChanged) or training ends."""
        return self._a._batches()

    def report(self, **metrics: Any) -> None:
        """Ends the step: its metrics (numbers; `loss` is the history's loss), a memory snapshot
        when one is due; blocks after the last step of the chunk the coordinator asked for."""
        self._a._report(metrics)


@_api.remote(num_cpus=1)
class _TorchTrainerActor:
    """One rank of a TorchTrainer's group: the Trainer interface's methods (called by the
    coordinator on a pool of call threads) and the user's loop (on a thread of its own). One
    condition, `cv`, guards the loop's progress (step, chunk, rows, outcome)."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        import cloudpickle

        self.spec = dict(spec)
        self.loop: Callable[[TorchContext], Any] = cloudpickle.loads(spec["loop"])
        self.cv = threading.Condition()
        self.rank, self.world, self.epoch = 0, 1, 0
        self.step = 0
        self.snapshot_every = int(spec.get("snapshot_every", 1))
        self.keep = max(2, int(spec.get("keep", 3)))
        self.held: dict[int, dict[str, Any]] = {}  # step -> snapshot
        self.pinned: int | None = None
        self.pending: dict[str, Any] | None = None  # the restored step's state, loaded by track()
        self.tracked: dict[str, Any] | None = None
        self.thread: threading.Thread | None = None
        self.chunk_end = 0
        self.rows: list[dict[str, Any]] = []
        self.outcome: tuple[str, str] | None = None
        self.changed = False
        self.taken: dict[str, Any] | None = None  # the batch of the step in progress
        self.loader = None
        self.doing = ("idle", time.time(), 0)
        self.last_hash = 0

    # ---- The Trainer interface (the coordinator's calls) ----
    def join(self, epoch: int, rank: int, world: int, dataloader: str, checkpoint: str) -> dict[str, Any]:
        import datetime

        import torch.distributed as dist

        from . import dist as _backend  # noqa: F401 (registers the "troupe" backend)

        self._stop_loop()
        if dist.is_initialized():
            dist.destroy_process_group()
        store = dist.FileStore(os.path.join(self.spec["workdir"], f"store-{epoch}"), world)
        dist.init_process_group("troupe", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=float(self.spec.get("timeout", 30.0))))
        self.rank, self.world, self.epoch = rank, world, epoch
        self.loader = _api.ActorHandle(dataloader, "Dataloader")
        # A process that holds no snapshot (restarted after a kill) restores from a peer.
        return {"rank": rank, "world": world, "amnesic": not self.held}

    def _held_steps(self) -> list[int]:
        return sorted(self.held)

    def snapshots(self) -> dict[str, Any]:
        return {"steps": self._held_steps()}

    def restore(self, step: int, fromBundle: int = -1, fromBundles: Any = None, broadcastFrom: int = -1,  # noqa: N803
                fromBroadcast: bool = False) -> dict[str, Any]:  # noqa: N803
        self._stop_loop()
        source = "memory"
        if step in self.held:
            state = self.held[step]
        elif fromBundle >= 0:
            peer = _api.get_actor(_actor_name(self.spec["group"], fromBundle))
            state = _api.get(peer.snapshot_state.remote(step), timeout=60)
            self.held[step] = state
            source = f"peer (bundle {fromBundle})"
        elif step == 0:
            state = None
            source = "seed"
        else:
            raise RuntimeError(f"rank {self.rank}: no snapshot of step {step} in memory (held: "
                               f"{self._held_steps()}) and no peer to copy it from"
                               + (" (a broadcast from another host is not built yet)" if fromBroadcast else ""))
        for s in [s for s in self.held if s > step]:  # the state went back: later steps are void
            del self.held[s]
        with self.cv:
            self.step, self.chunk_end, self.pending = step, step, state
        return {"step": step, "source": source, "hash": _state_hash(state)}

    def snapshot_state(self, step: int) -> dict[str, Any]:
        """A peer's copy of this rank's snapshot of `step` (a restarted rank restores from it)."""
        if step not in self.held:
            raise RuntimeError(f"rank {self.rank}: no snapshot of step {step} (held: {self._held_steps()})")
        return self.held[step]

    def run(self, fromStep: int, steps: int = 1) -> dict[str, Any]:  # noqa: N803
        with self.cv:
            if self.step != fromStep:
                raise RuntimeError(f"rank {self.rank}: trainer is at step {self.step}, asked to run from step "
                                   f"{fromStep}")
            self.chunk_end, self.rows, self.outcome = fromStep + steps, [], None
            if self.thread is None or not self.thread.is_alive():
                self.changed = False
                self.thread = threading.Thread(target=self._loop_main, name="troupe-train-loop", daemon=True)
                self.thread.start()
            self.cv.notify_all()
            while len(self.rows) < steps and self.outcome is None:
                self.cv.wait()
            rows, outcome = list(self.rows), self.outcome
        if len(rows) < steps:
            kind, text = outcome
            if kind == "error":
                raise RuntimeError(f"{_LOOP_FAILED} on rank {self.rank} at step {self.step + 1}:\n{text}")
            if kind == "returned":
                raise RuntimeError(f"{_LOOP_FAILED} on rank {self.rank} at step {self.step + 1}:\ntrain_loop "
                                   f"returned before the chunk's last step ({fromStep + steps}); it should "
                                   f"iterate ctx.batches() until training ends")
            raise RuntimeError(f"rank {self.rank}: the group changed at step {self.step + 1}: {text}")
        return {"metrics": rows, "hash": self.last_hash, **self._pin_reply()}

    def pin(self, snapshot: bool = False) -> dict[str, Any]:
        if snapshot and self.tracked is not None and self.step not in self.held:
            self._snapshot()
        if self.step in self.held:
            self.pinned = self.step
        return self._pin_reply()

    def _pin_reply(self) -> dict[str, Any]:
        return {"hasPinned": self.pinned is not None, "pinned": self.pinned or 0}

    def hash(self) -> dict[str, Any]:
        return {"hash": self.last_hash, "step": self.step}

    def configure(self, snapshotEvery: int = -1, threads: int = -1, prefetch: int = -1) -> dict[str, Any]:  # noqa: N803
        import torch

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
                "forS": time.time() - since, "waitingOn": ""}

    def timeline(self) -> dict[str, Any]:
        return {"rank": self.rank, "world": self.world, "pid": os.getpid(), "spans": []}

    def loadDir(self, dir: str, step: int) -> dict[str, Any]:  # noqa: N802,A002
        raise RuntimeError("TorchTrainer does not persist or load checkpoint directories yet")

    # ---- The loop's side ----
    def _loop_main(self) -> None:
        self.taken = None  # a step an earlier entry took and did not finish is taken again
        try:
            self.loop(TorchContext(self))
            outcome = ("returned", "")
        except GroupChanged:
            outcome = ("changed", "the coordinator re-formed the group")
        except BaseException as e:  # noqa: B036 (the loop's failure goes to run(), whatever it is)
            text = traceback.format_exc()
            outcome = ("changed", text) if isinstance(e, _GroupFailure) or self._group_broken() else ("error", text)
        with self.cv:
            self.outcome = outcome
            self.doing = ("loop ended", time.time(), self.step)
            self.cv.notify_all()

    def _group_broken(self) -> bool:
        """The group's communicator failed (a peer died) or the coordinator re-forms the group."""
        if self.changed:
            return True
        try:
            from . import dist as troupe_dist

            return troupe_dist.health() != "OK"
        except Exception:
            return True

    def _stop_loop(self) -> None:
        """Ends the loop's thread before the group re-forms: GroupChanged out of its wait, or its
        collective fails when the old process group is destroyed."""
        thread = self.thread
        if thread is None or not thread.is_alive():
            return
        with self.cv:
            self.changed = True
            self.cv.notify_all()
        thread.join(timeout=5.0)
        if thread.is_alive():  # blocked in a collective of the old group
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            thread.join(timeout=float(self.spec.get("timeout", 30.0)))
        if thread.is_alive():
            raise RuntimeError(f"rank {self.rank}: train_loop did not stop when the group re-formed (is it "
                               f"blocked outside ctx.report()/ctx.batches() and the process group?)")

    def _track(self, objects: dict[str, Any]) -> None:
        import torch

        with self.cv:
            pending, self.pending = self.pending, None
        if pending is not None:
            missing = sorted(set(objects) - set(pending))
            if missing:
                raise KeyError(f"ctx.track: the restored step {self.step} holds no state for {missing} (it holds "
                               f"{sorted(k for k in pending if not k.startswith('__'))}); track the same names on "
                               f"every entry")
            for name, obj in objects.items():
                obj.load_state_dict(_copy_tree(pending[name]))
            if "__rng__" in pending:
                torch.set_rng_state(pending["__rng__"])
        self.tracked = dict(objects)
        if self.step not in self.held:
            self._snapshot()

    def _snapshot(self) -> float:
        import torch

        t0 = time.monotonic()
        state = {name: _copy_tree(obj.state_dict()) for name, obj in self.tracked.items()}
        state["__rng__"] = torch.get_rng_state()
        self.held[self.step] = state
        self.last_hash = _state_hash(state)
        old = sorted(s for s in self.held if s != self.pinned)
        for s in old[:-self.keep]:
            del self.held[s]
        return time.monotonic() - t0

    def _wait_for_chunk(self) -> None:
        with self.cv:
            while self.step >= self.chunk_end and not self.changed:
                self.doing = ("waiting for the next chunk", time.time(), self.step)
                self.cv.wait()
            if self.changed:
                raise GroupChanged(f"the group re-forms at step {self.step}")

    def _batches(self) -> Any:
        while True:
            if self.taken is not None:
                raise RuntimeError(f"rank {self.rank}: step {self.step + 1}'s batch was not reported: call "
                                   f"ctx.report() once per batch")
            self._wait_for_chunk()
            t0 = time.monotonic()
            step = self.step
            self.doing = ("data wait", time.time(), step + 1)
            fault = self.spec.get("fault") or {}
            if fault.get("kill_at_step") == step:
                flag = os.path.join(self.spec["workdir"], f"fault-killed-{self.spec['bundle']}")
                if not os.path.exists(flag):  # once: the restarted process trains the step
                    open(flag, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
            try:
                batch = _typed.get(self.loader, "Dataloader", "take", step=step, rank=self.rank,
                                   world=self.world)["batch"]
            except (ActorDiedError, ActorError, TroupeError) as e:
                raise _GroupFailure(f"rank {self.rank}: take of step {step + 1} failed: {e}") from e
            self.taken = {"ids": list(batch["sampleIds"]), "wait_s": time.monotonic() - t0, "t": time.monotonic()}
            self.doing = ("step", time.time(), step + 1)
            yield _tensor(batch["inputs"]), _tensor(batch["targets"])

    def _report(self, metrics: Mapping[str, Any]) -> None:
        taken, self.taken = self.taken, None
        if taken is None:
            raise RuntimeError(f"rank {self.rank}: ctx.report() without a batch: call it once per batch of "
                               f"ctx.batches()")
        compute = time.monotonic() - taken["t"]
        try:
            _typed.get(self.loader, "Dataloader", "complete", step=self.step, rank=self.rank)
        except (ActorDiedError, ActorError, TroupeError) as e:
            raise _GroupFailure(f"rank {self.rank}: complete of step {self.step + 1} failed: {e}") from e
        values = {k: float(v) for k, v in metrics.items()}
        with self.cv:
            self.step += 1
        snapshot_s = self._snapshot() if self.tracked is not None and self.step % self.snapshot_every == 0 else 0.0
        row = {"step": self.step, "loss": values.get("loss", math.nan), "computeS": compute, "commS": 0.0,
               "waitS": taken["wait_s"], "snapshotS": snapshot_s, "samples": int(self.spec["global_batch"]),
               "bytesAllreduced": 0, "sampleIds": taken["ids"], "metrics": values}
        with self.cv:
            self.rows.append(row)
            self.cv.notify_all()
        self._wait_for_chunk()


def _actor_name(group: str, bundle: int) -> str:
    return f"torch-trainer-{group}-{bundle}"


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
        raise ValueError("data: the dataset is empty")
    xs, ys = [], []
    for i in range(n):
        item = dataset[i]
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"data[{i}] is a {type(item).__name__}: a map-style dataset of (features, label) "
                             f"pairs is needed")
        x, y = item
        xs.append(np.asarray(x, dtype=np.float32).reshape(-1))
        ys.append(int(y))
    features, labels = os.path.join(workdir, "features.npy"), os.path.join(workdir, "labels.npy")
    np.save(features, np.stack(xs))
    np.save(labels, np.asarray(ys, dtype=np.int64))
    return {"kind": "npy", "features": features, "labels": labels}


class _TorchTrainers:
    """The coordinator's trainers are Python processes running the user's loop
    (_TorchTrainerActor); their methods take keywords and return dicts."""

    name = "torch"

    def __init__(self, loop: bytes, data: Any, global_batch: int, seed: int, keep: int, fault: Mapping[str, Any],
                 timeout: float) -> None:
        self.loop, self.data, self.global_batch, self.seed = loop, data, global_batch, seed
        self.keep, self.fault, self.timeout = keep, dict(fault or {}), timeout

    def prepare(self, workdir: str) -> tuple[dict[str, Any], dict[str, str]]:
        if isinstance(self.data, (str, os.PathLike, Mapping)):
            spec = _data_spec(self.data)
        else:
            spec = _materialize(self.data, workdir)
        engine = {"kind": "torch", "seed": self.seed, "global_batch": self.global_batch, "context": 1,
                  "sequence_parallel": 1, "zero": 0}
        return engine, spec

    def call(self, handle: Any, method: str, **params: Any) -> Any:
        return getattr(handle, method).remote(**params)

    def reply(self, method: str, value: Any) -> dict[str, Any]:
        return value

    def handle(self, actor_id: str) -> Any:
        raise TroupeError("a TorchTrainer's group cannot be adopted by another driver yet")

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
                "global_batch": self.global_batch, "snapshot_every": group._checkpoint["snapshot_every"],
                "keep": self.keep, "timeout": self.timeout,
                "fault": self.fault if self.fault.get("rank") == bundle else {}}
        return _TorchTrainerActor.options(num_cpus=1, max_restarts=-1, max_concurrency=4,
                                          placement_group=group.group_id, bundle_index=bundle,
                                          name=_actor_name(group.group_id, bundle),
                                          lifetime=group._lifetime).remote(spec)


class TorchTrainer(GroupCoordinator):
    """The user's own PyTorch loop, `train_loop(ctx)`, on every rank of an elastic group (see
    the module docstring). `data`: a map-style torch Dataset of (features, label) pairs
    (written once as .npy files the group's Dataloader serves), or ElasticTrainer's data specs.
    `global_batch_size` is split over the ranks. `scaling`, `failure`, `checkpoint` and `tuner`
    as ElasticTrainer's (checkpoint: snapshot_every and keep apply; persisting is not built
    for this kind yet). fit(steps=N) returns one row per step (its `metrics` are rank 0's
    report()); `step`, `recoveries`, `members()` and close() as ElasticTrainer's. An exception
    in train_loop is raised by fit() as TrainLoopError with the rank and remote traceback."""

    def __init__(self, train_loop: Callable[[TorchContext], Any], data: Any = None, global_batch_size: int = 32, *,
                 scaling: ScalingConfig | None = None, failure: FailureConfig | None = None,
                 checkpoint: CheckpointConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
                 tuner: bool | Mapping[str, Any] | None = None, seed: int = 0, steps_per_call: int = 10,
                 progress: bool = True, name: str | None = None, tensorboard_dir: str | None = None,
                 _fault: Mapping[str, Any] | None = None) -> None:
        import cloudpickle

        if not callable(train_loop):
            raise TypeError(f"train_loop must be a function of ctx, not {type(train_loop).__name__}")
        if data is None:
            raise ValueError("data is required: a map-style Dataset of (features, label) pairs or a data spec")
        scaling, failure, ckpt = _configs(scaling, failure, checkpoint, {"tuner": tuner})
        if global_batch_size < scaling.max_workers:
            raise ValueError(f"global_batch_size {global_batch_size} is smaller than max_workers {scaling.max_workers}")
        module = getattr(train_loop, "__module__", "__main__")
        loaded = __import__("sys").modules.get(module)
        if loaded is not None and module != "__main__" and not module.startswith("troupe"):
            try:  # the workers may not import the user's module: the loop travels by value
                cloudpickle.register_pickle_by_value(loaded)
            except ValueError:
                pass
        loop = cloudpickle.dumps(train_loop)
        kind = _TorchTrainers(loop, data, int(global_batch_size), int(seed), ckpt.keep, _fault or {},
                              failure.recovery_timeout)
        self._start(kind, scaling, failure, ckpt, name=name, detached=False, progress=progress,
                    steps_per_call=steps_per_call, tensorboard_dir=tensorboard_dir, fault=None)
