"""The elastic group's coordinator, under both trainers (troupe.train.ElasticTrainer, the C++
engine, and troupe.torch_trainer.TorchTrainer, the user's own PyTorch loop): the configs
(ScalingConfig, FailureConfig, CheckpointConfig), the group's placement, chunks, recovery,
resizes, adoption and tuner (GroupCoordinator), and other drivers' view of it (GroupHandle).
troupe.train is the public module; see its docstring for how a group trains."""
from __future__ import annotations

import dataclasses
import enum
import json
import math
import operator
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

from . import _api, _tensorboard, _typed
from .exceptions import (ActorDiedError, ActorError, ArgumentTypeError, InvalidArgumentError, ResourceExhaustedError,
                         TroupeError, UnavailableError)


class GroupPlacementError(TroupeError):
    """The group cannot be placed: not even min_workers trainers fit the cluster."""


def _invalid(owner: str, field: str, value: Any, want: str) -> ValueError:
    return ValueError(f"{owner}.{field} must be {want}, got {value!r}")


def _check_int(owner: str, field: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _invalid(owner, field, value, f"an int >= {low}")


def _check_seconds(owner: str, field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _invalid(owner, field, value, "a finite number of seconds > 0")


@dataclasses.dataclass(frozen=True)
class ScalingConfig:
    """How many trainers the group has and how the model is laid out over them.

    min_workers, max_workers: the group never shrinks below min_workers (a failure that would
    leave fewer ends fit()) nor grows above max_workers. workers: how many to start with (None:
    max_workers; fewer are placed, down to min_workers, when they do not fit). Each trainer holds
    1 CPU and runs threads_per_worker intra-op threads. sequence_parallel=S splits every sequence
    over rings of S trainers (min_workers, max_workers and the world size are multiples of S).
    zero=1 shards the optimizer state over the ranks (ZeRO-1), zero=2 the gradients too.
    tuner=True (or a dict of troupe.tuner.ResourceTuner options) lets the tuner resize the group
    and set the threads and prefetch depth at chunk boundaries."""

    min_workers: int = 1
    max_workers: int = 2
    workers: int | None = None
    threads_per_worker: int = 1
    sequence_parallel: int = 1
    zero: int = 0
    tuner: bool | Mapping[str, Any] = False

    def __post_init__(self) -> None:
        _check_int("ScalingConfig", "min_workers", self.min_workers, 1)
        _check_int("ScalingConfig", "max_workers", self.max_workers, 1)
        if self.min_workers > self.max_workers:
            raise InvalidArgumentError(f"need 1 <= min_workers <= max_workers, got {self.min_workers} and {self.max_workers}")
        if self.workers is not None:
            _check_int("ScalingConfig", "workers", self.workers, 1)
            if not self.min_workers <= self.workers <= self.max_workers:
                raise _invalid("ScalingConfig", "workers", self.workers,
                               f"None or between min_workers ({self.min_workers}) and max_workers "
                               f"({self.max_workers})")
        _check_int("ScalingConfig", "threads_per_worker", self.threads_per_worker, 1)
        _check_int("ScalingConfig", "sequence_parallel", self.sequence_parallel, 1)
        seq = self.sequence_parallel
        if self.min_workers % seq or self.max_workers % seq:
            raise InvalidArgumentError(f"sequence_parallel={seq} needs min_workers ({self.min_workers}) and max_workers "
                             f"({self.max_workers}) to be multiples of it")
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2):
            raise InvalidArgumentError(f"zero must be 0 (data parallel), 1 (ZeRO-1) or 2 (ZeRO-2), got {self.zero!r}")
        if isinstance(self.tuner, Mapping):
            object.__setattr__(self, "tuner", dict(self.tuner))  # a copy: later edits by the caller do not leak in
        elif not isinstance(self.tuner, bool):
            raise _invalid("ScalingConfig", "tuner", self.tuner, "a bool or a dict of ResourceTuner options")


STUCK_FAILURES = 8  # failures of one step in a row after which fit() gives up (FailureConfig)


@dataclasses.dataclass(frozen=True)
class FailureConfig:
    """What the group does when members fail (all times in seconds).

    max_failures: how many failures fit() recovers from before it raises the next one instead
    (-1: no limit). Whatever it is, fit() raises once the same step has failed
    STUCK_FAILURES times in a row (a rank that crashes there each time, a step no recovery
    can restore): recovering again would loop forever. recovery_timeout: how long the calls of a recovery (join, restore, pin) may
    take. replace_timeout: how long a failed trainer has to come back before the group shrinks
    without it. hang_timeout: a chunk without progress for this long is reported as an event
    naming what each rank is doing."""

    max_failures: int = -1
    recovery_timeout: float = 30.0
    replace_timeout: float = 10.0
    hang_timeout: float = 120.0

    def __post_init__(self) -> None:
        _check_int("FailureConfig", "max_failures", self.max_failures, -1)
        for field in ("recovery_timeout", "replace_timeout", "hang_timeout"):
            _check_seconds("FailureConfig", field, getattr(self, field))


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often the group's state is kept.

    Every snapshot_every steps each trainer copies its state to shared memory, replicated to the
    next node (None: every step while that costs under 5% of a step, else as often as it does).
    Every persist_every steps (0: never) the checkpoint actors write a step to `dir`, keeping the
    newest `keep` steps there. resume=True starts from the newest complete step in `dir` (written
    by a group of any world size) instead of the seed."""

    dir: str | None = None
    resume: bool = False
    snapshot_every: int | None = None
    persist_every: int = 0
    keep: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.dir, os.PathLike):
            object.__setattr__(self, "dir", os.fspath(self.dir))
        if self.dir is not None and (not isinstance(self.dir, str) or not self.dir):
            raise _invalid("CheckpointConfig", "dir", self.dir, "None or a directory path")
        if not isinstance(self.resume, bool):
            raise _invalid("CheckpointConfig", "resume", self.resume, "a bool")
        if self.resume and not self.dir:
            raise InvalidArgumentError("CheckpointConfig.resume=True (checkpoint={'resume': True}) needs the checkpoint's 'dir'")
        if self.snapshot_every is not None:
            _check_int("CheckpointConfig", "snapshot_every", self.snapshot_every, 1)
        _check_int("CheckpointConfig", "persist_every", self.persist_every, 0)
        _check_int("CheckpointConfig", "keep", self.keep, 1)

    @classmethod
    def of(cls, value: CheckpointConfig | Mapping[str, Any] | str | os.PathLike[str] | None) -> CheckpointConfig:
        """ElasticTrainer's checkpoint= argument as a CheckpointConfig: a CheckpointConfig, a dict of
        its fields ({"dir": D, "resume": True}), a directory, or None (memory snapshots only)."""
        if isinstance(value, CheckpointConfig):
            return value
        if value is None:
            return cls()
        if isinstance(value, (str, os.PathLike)):
            return cls(dir=os.fspath(value))
        if isinstance(value, Mapping):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ArgumentTypeError(f"checkpoint: unknown key(s) {unknown}; known: {sorted(known)}")
            return cls(**value)
        raise ArgumentTypeError(f"checkpoint must be a CheckpointConfig, a dict, a directory or None, not "
                        f"{type(value).__name__}")


# ElasticTrainer's keywords that are also fields of a config: each may be given one way only.
_SCALING_KEYWORDS = ("min_workers", "max_workers", "workers", "threads_per_worker", "sequence_parallel", "zero",
                     "tuner")


_FAILURE_KEYWORDS = ("recovery_timeout", "replace_timeout", "hang_timeout")


def _configs(scaling: ScalingConfig | None, failure: FailureConfig | None,
             checkpoint: CheckpointConfig | Mapping[str, Any] | str | os.PathLike[str] | None,
             keywords: Mapping[str, Any]) -> tuple[ScalingConfig, FailureConfig, CheckpointConfig]:
    """The trainer's configs from its config arguments and its keywords (None: not given)."""
    resolved = []
    for config, cls, names in ((scaling, ScalingConfig, _SCALING_KEYWORDS),
                               (failure, FailureConfig, _FAILURE_KEYWORDS)):
        given = {k: keywords[k] for k in names if keywords.get(k) is not None}
        if config is None:
            resolved.append(cls(**given))
            continue
        if not isinstance(config, cls):
            raise ArgumentTypeError(f"{cls.__name__.removesuffix('Config').lower()} must be a {cls.__name__}, not "
                            f"{type(config).__name__}")
        if given:
            raise ArgumentTypeError(f"{sorted(given)} given both as keyword(s) and in {cls.__name__}: pass each setting "
                            f"one way")
        resolved.append(config)
    return resolved[0], resolved[1], CheckpointConfig.of(checkpoint)


def _step_row(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """A rank's StepMetrics with the history's names (computeS -> compute_s)."""
    def snake(c: re.Match[str]) -> str:
        return "_" + c.group(0).lower()

    return {re.sub(r"[A-Z]", snake, str(k)): v for k, v in metrics.items()}


def _merged_row(ranks: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """One history row of a step from its ranks' rows (_step_row's): the split is the straggler's
    (the rank that computed longest): its comm_s is what communicating costs; the others' also
    holds their wait for it, which does not shrink with fewer ranks (the tuner read that as ring
    latency and over-predicted every shrink by 5-10%). Loss and metrics are rank 0's."""
    straggler = max(ranks, key=lambda r: r["compute_s"])
    row = {"step": ranks[0]["step"], "loss": ranks[0]["loss"], "world_size": world,
           "compute_s": straggler["compute_s"], "comm_s": straggler["comm_s"],
           **{k: max(r[k] for r in ranks) for k in ("wait_s", "snapshot_s", "bytes_allreduced")},
           "samples": ranks[0]["samples"]}
    if "metrics" in ranks[0]:  # what a user's loop reported
        row["metrics"] = ranks[0]["metrics"]
    return row


def _data_spec(data: str | os.PathLike[str] | Mapping[str, str]) -> dict[str, str]:
    """A token file (.bin/.u16/.u32), a text file (its bytes are the tokens), or a dict with
    'features' and 'labels' .npy paths."""
    if isinstance(data, os.PathLike):
        data = os.fspath(data)
    if isinstance(data, Mapping):
        for key in ("features", "labels"):
            if not os.path.exists(data.get(key, "")):
                raise InvalidArgumentError(f"data[{key!r}]: no such .npy file: {data.get(key)!r}")
        return {"kind": "npy", "features": os.path.abspath(data["features"]), "labels": os.path.abspath(data["labels"])}
    if not isinstance(data, str) or not os.path.exists(data):
        raise InvalidArgumentError(f"data {data!r}: no such file")
    path = os.path.abspath(data)
    if path.endswith(".u16"):
        return {"kind": "tokens", "path": path, "dtype": "uint16"}
    if path.endswith(".u32"):
        return {"kind": "tokens", "path": path, "dtype": "uint32"}
    return {"kind": "text", "path": path}


class GroupState(enum.StrEnum):
    """The coordinator's phases, as the group record's "state" says them (a str: the record is
    JSON, and a state compares equal to its name)."""

    STARTING = "STARTING"      # placing the group
    JOINING = "JOINING"        # the trainers join a new epoch and restore a step
    RUNNING = "RUNNING"        # training chunks
    RECOVERING = "RECOVERING"  # a member failed: waiting for it, or shrinking without it
    ADOPTING = "ADOPTING"      # a new coordinator takes over a detached group
    HUNG = "HUNG"              # a chunk made no progress for hang_timeout
    STOPPED = "STOPPED"        # stopped at another driver's request
    FAILED = "FAILED"          # a failure that was not recovered
    CLOSED = "CLOSED"          # its record is gone (GroupHandle.progress of a closed group)


class GroupCoordinator:
    """The elastic group's coordinator: it places the group (trainer bundles, one dataloader and
    one checkpoint actor per node, the tuner), drives the trainers chunk by chunk, and carries
    the group through failures, resizes, adoption and the tuner's decisions. What the trainers
    are is its strategy, `kind` (_CppTrainers: the C++ Trainer actor; troupe.torch_trainer's:
    a Python process running the user's own loop): the coordinator only calls the Trainer
    interface's methods through it, so both kinds are driven by this one class.

    Its phases are the group record's states (GroupState): STARTING, JOINING, RUNNING,
    RECOVERING, ADOPTING, HUNG, STOPPED and FAILED. Not thread-safe: one driver thread calls it."""

    def _start(self, kind, scaling, failure, ckpt, *, name, detached, progress, steps_per_call, tensorboard_dir,
               fault):
        """Adopts the running group `name` (detached) or places a new one. `kind.prepare(workdir)`
        returns the trainers' engine settings and the data spec (called only for a new group)."""
        self._kind = kind
        self.name = name or f"train-{uuid.uuid4().hex[:6]}"
        # Scalars per step (loss, samples/s, world size) for TensorBoard, written by this
        # coordinator, which receives every rank's results.
        self._tensorboard = _tensorboard.ScalarWriter(tensorboard_dir) if tensorboard_dir else None
        self.hang_timeout = float(failure.hang_timeout)  # a chunk without progress this long is reported
        self.max_failures = failure.max_failures
        self._failures = 0  # failures fit() has seen
        self._stuck = (-1, 0)  # (step, failures in a row there without a chunk finished)
        self._rt = _api.runtime()
        self._closed = False
        self._lifetime = "detached" if detached else None
        self._last_extra: dict[str, Any] = {}
        self._stop_beat = threading.Event()
        self._handled = 0  # the highest seq of the group's commands (GroupHandle) already acted on
        if name is not None:
            found = _find_group(self._rt, name)
            if found is not None:
                if self._adopt(found, progress):
                    return
                # A group of this name whose driver died without detached=True: its actors are
                # gone; what is left of it goes, and a new group takes the name.
                for remove in (self._rt.remove_placement_group, self._rt.remove_group):
                    try:
                        remove(found["id"])
                    except TroupeError:
                        pass
        self._workdir = tempfile.mkdtemp(prefix="troupe-train-")
        try:
            self._engine, self._data = kind.prepare(self._workdir)
        except BaseException:
            shutil.rmtree(self._workdir, ignore_errors=True)
            raise
        self._engine.setdefault("threads", scaling.threads_per_worker)
        self._snapshot_fixed = ckpt.snapshot_every is not None
        self._checkpoint = {"dir": ckpt.dir or "", "snapshot_every": ckpt.snapshot_every or 1,
                            "persist_every": ckpt.persist_every, "keep": ckpt.keep}
        self.min_workers, self.max_workers = scaling.min_workers, scaling.max_workers
        self.steps_per_call = steps_per_call
        self.recovery_timeout = failure.recovery_timeout
        self.replace_timeout = failure.replace_timeout
        self.progress = progress
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._resize_to: int | None = None
        self._fresh: set[str] = set()  # members a grow added that do not hold the group's state yet
        # Members restarting after a failure while the group trains on without them (kinds whose
        # restart takes seconds): actor id -> {"handle", "bundle", "since"}; taken back, warm,
        # at a chunk boundary (_take_back_healed).
        self._healing: dict[str, dict[str, Any]] = {}
        # tests: {"rank": r, "kill_at_step": s, "join_kill_bundle": b, "start_kill_bundle": b, "checkpoint": fault spec}
        self._fault = dict(fault or {})
        self.recoveries: list[dict[str, Any]] = []
        self._tuner = None
        self._settings = {"threads": scaling.threads_per_worker, "prefetch": 2}
        self.tuner_decisions: list[dict[str, Any]] = []
        self.trainers, self._node_services = [], {}
        try:
            self._place(scaling.workers or scaling.max_workers)
            if ckpt.resume:
                self._resume_from_disk()
            if scaling.tuner:
                # The tuner is a member of the group (0 CPU, in the first bundle); it keeps the model
                # and the decisions, and the driver applies what it decides at chunk boundaries.
                options = {"warmup_chunks": 1, **(scaling.tuner if isinstance(scaling.tuner, dict) else {})}
                self._tuner = _TunerActor.options(num_cpus=0, placement_group=self.group_id,
                                                  bundle_index=self._bundles[0], max_restarts=-1,
                                                  lifetime=self._lifetime).remote(self.min_workers, self.max_workers,
                                                                                  options)
                self._record({"state": GroupState.RUNNING, "tuner": self._tuner.actor_id})
        except BaseException:
            # A start that fails once something is placed (a trainer that cannot start, a step
            # that cannot be resumed) takes it all back: the caller has no group to close().
            if getattr(self, "group_id", None):
                try:
                    self.close()
                except Exception:
                    pass
            raise
        self._start_heartbeat()

    # ---- Membership ----
    def _place(self, workers):
        """Reserves `workers` trainer bundles (fewer, down to min_workers, if they do not fit)."""
        self._pg = _reserve_trainers(self._rt, self.name, workers, self.min_workers, self._seq())
        self.group_id = self._pg["id"]
        self._record({"state": GroupState.STARTING})
        self._event(f"placed {len(self._pg['bundle_nodes'])} trainer bundle(s) on node(s) "
                    f"{sorted(set(self._pg['bundle_nodes']))}")
        self._node_services = {}
        self._trainer_nodes = {}
        self._ensure_node_services()
        self._bundles = list(range(len(self._pg["bundle_nodes"])))
        self.trainers = [self._spawn_trainer(b) for b in self._bundles]
        self._join_all()

    def _seq(self):
        """Trainers per ring (sequence parallelism); the world size is a multiple of it."""
        return int(self._engine.get("sequence_parallel", 1))

    def _ckpt_name(self, node):
        return f"ckpt-{self.group_id}-{node}"

    def _ensure_node_services(self):
        """One dataloader and one checkpoint actor per node, in the node's first bundle. The
        checkpoint actors know each other by name, so each node's snapshots are replicated to
        the next node's actor and a trainer that moves to another node can be restored there."""
        nodes = [n for n in dict.fromkeys(self._pg["bundle_nodes"]) if n]
        members = sorted({self._ckpt_name(n) for n in nodes} | {self._ckpt_name(n) for n in self._node_services})
        for index, node in enumerate(self._pg["bundle_nodes"]):
            if node in self._node_services or not node:
                continue
            # Their init args are DataloaderArgs and CheckpointArgs of actors/schema/init_args.capnp.
            data = self._kind.data_for(self, node, index) if hasattr(self._kind, "data_for") else self._data
            loader = _api.cpp_actor("Dataloader", json.dumps({"data": data, "seed": self._engine["seed"],
                                                              "global_batch": self._engine["global_batch"],
                                                              "context": self._engine["context"]}).encode(),
                                    num_cpus=0, max_restarts=-1, placement_group=self.group_id, bundle_index=index,
                                    lifetime=self._lifetime)
            ckpt_args = {"group": self.group_id, "node": node, "dir": self._checkpoint["dir"],
                         "keep": self._checkpoint["keep"], "self": self._ckpt_name(node), "members": members}
            if self._fault.get("checkpoint"):  # tests: a checkpoint fault spec (checkpoint/.../fault.h)
                ckpt_args["fault"] = self._fault["checkpoint"]
            ckpt = _api.cpp_actor("Checkpoint", json.dumps(ckpt_args).encode(),
                                  num_cpus=0, max_restarts=-1, placement_group=self.group_id, bundle_index=index,
                                  # Peers look each other up by these plain names, and a group
                                  # is any driver's to adopt: the names live in "default".
                                  name=self._ckpt_name(node), namespace=_api.DEFAULT_NAMESPACE,
                                  lifetime=self._lifetime)
            self._node_services[node] = (loader, ckpt)

    def _drop_idle_services(self):
        """A node with no trainer left loses its dataloader and checkpoint actor (replicas then
        go to the next node that has members)."""
        bundles = self._bundles + [h["bundle"] for h in self._healing.values()]  # healing: coming back
        live_nodes = {self._pg["bundle_nodes"][b] for b in bundles}
        for node, (loader, ckpt) in list(self._node_services.items()):
            if node not in live_nodes:
                _api.kill(loader)
                _api.kill(ckpt)
                del self._node_services[node]

    def _tell_members(self):
        """Every live checkpoint actor learns the current members: replicas go to the next live
        node's actor, never to a lost node's."""
        names = sorted(self._ckpt_name(n) for n in self._node_services)
        if names:  # a lone actor learns it has no replica target any more
            _api.get([_typed.call(ckpt, "Checkpoint", "members", members=names)
                      for _, ckpt in self._node_services.values()])

    def _services_of(self, node):
        """The dataloader and checkpoint actor of `node` (a trainer's node now)."""
        loader, ckpt = self._node_services.get(node) or next(iter(self._node_services.values()))
        return {"dataloader": loader.actor_id, "checkpoint": ckpt.actor_id}

    def _spawn_trainer(self, bundle):
        return self._kind.spawn(self, bundle)

    def _epoch(self):
        return int(self._rt.group(self.group_id).get("epoch", 0))

    def _join_all(self, restore_step=None, fresh=()):
        """Every trainer joins a new epoch of the group (a new communicator), then restores
        `restore_step` (None: the newest step every rank holds in memory). Trainers in `fresh`
        (new members) restore from the memory of the first other member on their node; so do
        those of a grow whose join or restore failed (self._fresh), when the recovery joins again."""
        fresh = set(fresh) | {t.actor_id for t in self.trainers if t.actor_id in self._fresh}
        self._fresh = set(fresh)  # until they hold the group's state
        # The controller advances the epoch when a member dies; the trainers' join advances it
        # otherwise (joining an epoch ends every earlier one: collectives/README.md; a Python
        # trainer's through troupe.dist.group_store), so no two join rounds share an epoch.
        epoch = self._epoch() + 1
        self._record({"state": GroupState.JOINING})
        world = len(self.trainers)
        nodes = {t.actor_id: self._rt.actor_info(t.actor_id)["node_id"] for t in self.trainers}
        # A trainer restarted on another node (its node was lost) has no memory snapshot there:
        # it does not vote on the step, and its node's checkpoint actor stages the step for it.
        moved = {tid for tid, node in nodes.items() if self._trainer_nodes.get(tid, node) != node}
        self._trainer_nodes.update(nodes)
        joins = [self._kind.call(t, "join", epoch=epoch, rank=r, world=world, **self._services_of(nodes[t.actor_id]))
                 for r, t in enumerate(self.trainers)]
        joined = _api.get(joins, timeout=self.recovery_timeout)
        # A trainer kind whose memory snapshots live in the trainer's process (Python trainers)
        # says so in its join reply when that process holds none (it was restarted): it restores
        # from a peer, as a new member does.
        fresh |= {t.actor_id for t, x in zip(self.trainers, joined) if self._kind.reply("join", x).get("amnesic")}
        self._fresh = set(fresh)
        old = [t for t in self.trainers if t.actor_id not in fresh and t.actor_id not in moved]
        if moved:
            self._event(f"trainer(s) {sorted(moved)} moved to another node; their state comes from a peer's "
                        f"replica or memory, or from disk")
        candidates = [restore_step]
        if restore_step is None:
            held = [set(self._kind.reply("snapshots", x)["steps"])
                    for x in _api.get([self._kind.call(t, "snapshots") for t in old])]
            common = set.intersection(*held) if held else set()
            # Newest first. A moved member's state comes from a peer's replica, which may lag the
            # newest snapshots: then an older step every member holds is used, down to the step
            # every rank pinned at the last chunk's end (held in memory and in every replica).
            candidates = sorted(common, reverse=True) if common else [0]
            # A re-shard also needs the old ranks that left: an older step when they lack it.
            if not moved and not self._resharding():
                candidates = candidates[:1]
        for i, restore_step in enumerate(candidates):
            try:
                self._restore_all(restore_step, fresh)
                break
            except ActorError as e:
                if i + 1 == len(candidates):
                    raise
                self._event(f"step {restore_step} is not held for every member ({str(e).splitlines()[0][:160]}); "
                            f"restoring step {candidates[i + 1]}")
        self._fresh = set()
        self._settle()

    def _settle(self):
        """After a restore: the restored step is pinned on every rank and replica, and the data
        rewinds to it, before training goes on."""
        _api.get([self._kind.call(t, "pin") for t in self.trainers], timeout=self.recovery_timeout)
        _api.get([_typed.call(loader, "Dataloader", "rewind", step=self.step) for loader, _ in self._node_services.values()])
        self._record({"state": GroupState.RUNNING})

    def _resume_from_disk(self):
        """Every trainer loads the newest complete step persisted in the checkpoint directory,
        whatever the world size (and ZeRO sharding) that wrote it; the data rewinds to it."""
        from . import checkpoint as persisted

        directory = self._checkpoint["dir"]
        try:
            complete = persisted.steps(directory)
        except persisted.CheckpointError:
            complete = []
        if not complete:
            self._event(f"resume: no complete step in {directory}; training starts from the seed")
            return
        replies = _api.get([self._kind.call(t, "loadDir", dir=directory, step=complete[0]) for t in self.trainers],
                           timeout=self.recovery_timeout)
        self._restored([self._kind.reply("loadDir", x) for x in replies])
        self._settle()
        self._event(f"resumed at step {self.step} from {directory}")

    def _resharding(self):
        """ZeRO, and the bundles (ranks) differ from those that saved the snapshots."""
        sharded_as = getattr(self, "_sharded_as", None)
        return bool(self._engine.get("zero")) and sharded_as is not None and sharded_as != list(self._bundles)

    def _restore_all(self, restore_step, fresh):
        if self._resharding() and restore_step > 0:
            # Every rank puts its new shard together from the old ranks' snapshots.
            replies = _api.get([self._kind.call(t, "restore", step=restore_step, fromBundles=self._sharded_as)
                                for t in self.trainers], timeout=self.recovery_timeout)
            self._restored([self._kind.reply("restore", x) for x in replies])
            self._event(f"re-sharded the optimizer state of step {restore_step} from the snapshots of bundle(s) "
                        f"{self._sharded_as} onto {len(self.trainers)} rank(s)")
            return
        # A new member copies the memory snapshot of a member on its node; on a host where no
        # member runs, it gets the state by a broadcast from a live rank (every rank takes part).
        held_on = {self._pg["bundle_nodes"][b]: b for o, b in zip(self.trainers, self._bundles)
                   if o.actor_id not in fresh}
        remote = {t.actor_id for t, b in zip(self.trainers, self._bundles)
                  if t.actor_id in fresh and restore_step > 0 and self._pg["bundle_nodes"][b] not in held_on}
        root = next((r for r, t in enumerate(self.trainers) if t.actor_id not in fresh), 0)
        requests = []
        for t, bundle in zip(self.trainers, self._bundles):
            params = {"step": restore_step}
            if t.actor_id in fresh and t.actor_id not in remote and restore_step > 0:
                params["fromBundle"] = held_on[self._pg["bundle_nodes"][bundle]]
            if remote:
                params["broadcastFrom"] = root
                params["fromBroadcast"] = t.actor_id in remote
            requests.append(self._kind.call(t, "restore", **params))
        self._restored([self._kind.reply("restore", x) for x in _api.get(requests, timeout=self.recovery_timeout)])

    def _restored(self, replies):
        """`replies`: every rank's results of restore or loadDir."""
        restored = {x["step"] for x in replies}
        if len(restored) != 1:
            raise TroupeError(f"ranks restored different steps {sorted(restored)}")
        self.step = restored.pop()
        self._sharded_as = list(self._bundles)  # every rank's snapshot is now of this world
        # Steps after the restored one were undone (the state went back): they are trained again.
        self.history = [r for r in self.history if r["step"] <= self.step]

    # ---- Records ----
    def _doc(self, extra=None):
        doc = {"name": self.name, "world_size": len(getattr(self, "trainers", [])), "step": self.step,
               "members": [t.actor_id for t in getattr(self, "trainers", [])],
               "dataloaders": [l.actor_id for l, _ in getattr(self, "_node_services", {}).values()],
               "checkpoints": [c.actor_id for _, c in getattr(self, "_node_services", {}).values()],
               "min_workers": self.min_workers, "max_workers": self.max_workers,
               "samples_per_s": self.history[-1]["samples_per_s"] if self.history else 0.0,
               "loss": self.history[-1]["loss"] if self.history else None,
               "snapshot_every": self._checkpoint["snapshot_every"],
               # What a new coordinator needs to adopt the group (ElasticTrainer(name=...) after
               # this one died), and how to tell whether this one is alive.
               "bundles": list(getattr(self, "_bundles", [])),
               "healing": [[aid, h["bundle"]] for aid, h in getattr(self, "_healing", {}).items()],
               "sharded_as": getattr(self, "_sharded_as", None),
               "services": {n: [l.actor_id, c.actor_id] for n, (l, c) in getattr(self, "_node_services", {}).items()},
               "trainer_nodes": dict(getattr(self, "_trainer_nodes", {})),
               "engine": self._engine, "data": self._data, "checkpoint": self._checkpoint,
               "steps_per_call": self.steps_per_call, "detached": self._lifetime == "detached",
               "coordinator": {"host": socket.gethostname(), "pid": os.getpid(),
                               "job": os.environ.get("TROUPE_JOB_NAME", "")},
               "heartbeat_ms": int(time.time() * 1000)}
        if getattr(self, "_tuner", None) is not None:
            doc["tuner"] = self._tuner.actor_id
        if self.history:  # the last step's time split, as the trainers measured it
            doc.update({k: self.history[-1][k] for k in ("step_s", "compute_s", "comm_s", "wait_s", "snapshot_s")})
        # For the dashboard and /metrics: the recent loss curve, the split per rank, recoveries and
        # the tuner's decisions (bounded: the record is rewritten every chunk).
        doc["curve"] = [[h["step"], h["loss"], round(h["samples_per_s"], 3)] for h in self.history[-200:]]
        doc["ranks"] = list(getattr(self, "_last_ranks", []))
        doc["stragglers"] = list(getattr(self, "stragglers", []))
        doc["recovery_count"] = len(getattr(self, "recoveries", []))
        doc["recoveries"] = list(getattr(self, "recoveries", [])[-20:])
        doc["tuner_decisions"] = [{k: d.get(k) for k in ("action", "world_size", "target", "predicted_samples_per_s",
                                                         "predicted_current_samples_per_s", "reason")}
                                  for d in list(getattr(self, "tuner_decisions", []))[-10:] if isinstance(d, dict)]
        doc.update(extra or {})
        return doc

    def _record(self, extra=None):
        if extra:
            self._last_extra = dict(extra)
        self._rt.put_group(self.group_id, json.dumps(self._doc(self._last_extra)))

    def _start_heartbeat(self):
        """The record says when this coordinator was last alive: another driver adopts the
        group only once that is HEARTBEAT_STALE_S old."""
        def beat():
            while not self._stop_beat.wait(HEARTBEAT_S):
                try:
                    self._record()
                except Exception:  # the controller is restarting: the next beat tells
                    pass

        threading.Thread(target=beat, daemon=True, name=f"troupe-train-{self.name}-heartbeat").start()

    def _commands(self):
        """The commands other drivers sent since the last look (GroupHandle.resize / stop), oldest
        first: the group's commands with a seq above the highest handled."""
        try:
            commands = self._rt.group(self.group_id).get("commands", [])
        except Exception:  # the controller is restarting: the next chunk looks again
            return []
        out = [c for c in commands if c["seq"] > self._handled]
        if out:
            self._handled = max(c["seq"] for c in out)
        return out

    # ---- Adoption: a new coordinator for a running group ----
    def _adopt(self, record, progress):
        doc = json.loads(record["doc"])
        kind = "torch" if doc.get("engine", {}).get("kind") == "torch" else "cpp"
        if kind != self._kind.name:
            theirs, ours = ("TorchTrainer", "ElasticTrainer") if kind == "torch" else ("ElasticTrainer", "TorchTrainer")
            raise TroupeError(f"group {self.name} is a {theirs}'s: {ours}(name={self.name!r}) cannot adopt it; use "
                              f"{theirs}(name={self.name!r}, detached=True), or another name")

        def beating(d):
            return time.time() * 1000 - d.get("heartbeat_ms", 0) < HEARTBEAT_STALE_S * 1000

        # A coordinator that has just died (a job's driver restarted at once) still looks alive
        # until its heartbeat is HEARTBEAT_STALE_S old.
        deadline = time.monotonic() + HEARTBEAT_STALE_S + 2
        while beating(doc) and time.monotonic() < deadline:
            time.sleep(0.2)
            record = self._rt.group(record["id"]) or record
            doc = json.loads(record["doc"])
        if beating(doc):
            c = doc.get("coordinator", {})
            raise TroupeError(f"group {self.name} is trained by a live coordinator (pid {c.get('pid')} on "
                              f"{c.get('host')}{', job ' + c['job'] if c.get('job') else ''}): use "
                              f"ElasticTrainer.attach({self.name!r}) to watch, resize or stop it")
        if not doc.get("detached"):
            return False  # its actors ended with its driver: only its record is left
        self.group_id = record["id"]
        self._workdir = tempfile.mkdtemp(prefix="troupe-train-")
        self._engine, self._data, self._checkpoint = doc["engine"], doc["data"], doc["checkpoint"]
        self._snapshot_fixed = True
        self.min_workers, self.max_workers = doc["min_workers"], doc["max_workers"]
        self.steps_per_call = doc.get("steps_per_call", 10)
        self.recovery_timeout, self.replace_timeout, self.progress = 60.0, 20.0, progress
        self.history, self.events, self.recoveries, self.tuner_decisions = [], [], [], []
        self._resize_to, self._fault, self._fresh = None, {}, set()
        self._settings = {"threads": int(self._engine.get("threads", 1)), "prefetch": 2}
        self._pg = self._rt.placement_group(self.group_id)
        self._bundles = list(doc["bundles"])
        self._sharded_as = list(doc.get("sharded_as") or doc["bundles"])
        self.trainers = [self._kind.handle(i) for i in doc["members"]]
        self._healing = {aid: {"handle": self._kind.handle(aid), "bundle": b, "since": time.monotonic()}
                         for aid, b in doc.get("healing", [])}
        self._node_services = {n: (_api.ActorHandle(l, "Dataloader"), _api.ActorHandle(c, "Checkpoint"))
                               for n, (l, c) in doc["services"].items()}
        self._trainer_nodes = dict(doc.get("trainer_nodes", {}))
        self._tuner = _api.ActorHandle(doc["tuner"], "py:_TunerActor") if doc.get("tuner") else None
        self._lifetime = "detached"
        self.step = int(doc.get("step", 0))
        self._handled = _newest_command(record)
        t0 = time.monotonic()
        # The members finish what the dead coordinator asked of them, then every one restores
        # the newest step they all hold, as after a failure.
        self._record({"state": GroupState.ADOPTING})
        self._recover(TroupeError(f"the group's coordinator (pid {doc.get('coordinator', {}).get('pid')}) is gone"),
                      [])
        self._event(f"adopted by a new coordinator (pid {os.getpid()}) in {time.monotonic() - t0:.2f} s at step "
                    f"{self.step}")
        self._start_heartbeat()
        return True

    @classmethod
    def attach(cls, name: str) -> GroupHandle:
        """A view of the running group `name` from any driver: progress() and events, and
        resize(n) / stop() requests that its coordinator carries out at its next chunk."""
        rt = _api.runtime()
        record = _find_group(rt, name)
        if record is None:
            raise TroupeError(f"no training group named {name!r} in this cluster")
        return GroupHandle(rt, name, record["id"])

    def _event(self, text):
        self.events.append({"step": self.step, "time": time.time(), "text": text})
        self._rt.group_event(self.group_id, text)

    # ---- Training ----
    def resize(self, workers: int) -> None:
        """Grows or shrinks to `workers` trainers at the next chunk boundary."""
        if not self.min_workers <= workers <= self.max_workers:
            raise InvalidArgumentError(f"resize({workers}): outside [{self.min_workers}, {self.max_workers}]")
        if workers % self._seq():
            raise InvalidArgumentError(f"resize({workers}): not a multiple of sequence_parallel={self._seq()}")
        self._resize_to = workers

    def fit(self, steps: int | None = None, until: int | None = None) -> list[dict[str, Any]]:
        """Trains `steps` more steps, or until step `until` (what a script that may be restarted
        and adopt its group wants); returns the history (one dict per step: step, loss, times,
        samples/s, world size). A stop() request from ElasticTrainer.attach ends it early."""
        if (steps is None) == (until is None):
            raise InvalidArgumentError("pass steps (how many more) or until (the step to reach), not both")
        target = until if until is not None else self.step + steps
        steps = max(0, target - self.step)
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=steps, unit="step", dynamic_ncols=True)
        start = self.step
        try:
            while self.step < target:
                stop = False
                for command in self._commands():
                    if command["kind"] == "stop":
                        stop = True
                    elif command["kind"] == "resize":
                        n = max(self.min_workers, min(self.max_workers, command["workers"]))
                        if n % self._seq():  # resize() would raise here, ending fit: the sender erred
                            self._event(f"resize to {n} trainer(s) requested by another driver ignored: not a "
                                        f"multiple of sequence_parallel={self._seq()}")
                            continue
                        self._event(f"resize to {n} trainer(s) requested by another driver")
                        self.resize(n)
                if stop:
                    self._event(f"stopped at step {self.step} at the request of another driver")
                    self._record({"state": GroupState.STOPPED})
                    break
                resize_to, self._resize_to = self._resize_to, None
                refs = []
                try:
                    if resize_to is not None and resize_to != len(self.trainers):
                        # A member may end while the group moves (a new trainer whose start fails,
                        # a crash): the epoch advances under the joins, which then fail. That is a
                        # failure like one in a chunk, recovered the same way (the members that
                        # answer join a new epoch and restore the step every old one pinned).
                        current = len(self.trainers)
                        try:
                            self._apply_resize(resize_to)
                        except (ActorDiedError, ActorError) as e:
                            self._event(f"failure during the resize from {current} to {resize_to} trainer(s) at "
                                        f"step {self.step}: {str(e).splitlines()[0][:200]}")
                            raise
                    if self._healing and self._take_back_healed() and bar is not None:
                        bar.write(f"(troupe.train) {self.events[-1]['text']}")
                    chunk = min(self.steps_per_call, target - self.step)
                    t0 = time.monotonic()
                    refs = [self._kind.call(t, "run", fromStep=self.step, steps=chunk) for t in self.trainers]
                    replies = [self._kind.reply("run", x) for x in self._gather(refs, watch=True)]
                except (ActorDiedError, ActorError) as failure:
                    fatal = self._kind.fatal(failure)
                    if fatal is not None:
                        self._event(f"failure at step {self.step}, not recovered: {str(fatal).splitlines()[0][:200]}")
                        self._record({"state": GroupState.FAILED})
                        raise fatal from failure
                    self._failures += 1
                    at, times = self._stuck
                    self._stuck = (self.step, times + 1 if at == self.step else 1)
                    if self._stuck[1] >= STUCK_FAILURES:
                        self._event(f"failure at step {self.step}: not recovered, the step failed {STUCK_FAILURES} "
                                    f"times in a row: {str(failure).splitlines()[0][:200]}")
                        self._record({"state": GroupState.FAILED})
                        raise TroupeError(f"group {self.name}: step {self.step + 1} failed {STUCK_FAILURES} times in "
                                          "a row, each recovery ending where it began; the last failure: "
                                          f"{str(failure).splitlines()[0][:300]}") from failure
                    if 0 <= self.max_failures < self._failures:
                        self._event(f"failure at step {self.step}: not recovered, FailureConfig.max_failures="
                                    f"{self.max_failures} reached: {str(failure).splitlines()[0][:200]}")
                        self._record({"state": GroupState.FAILED})
                        raise TroupeError(f"group {self.name}: failure {self._failures} at step {self.step}, more "
                                          f"than FailureConfig.max_failures={self.max_failures}") from failure
                    self._recover(failure, refs)
                    if bar is not None:
                        bar.write(f"(troupe.train) {self.events[-1]['text']}")
                        bar.n = self.step - start
                        bar.refresh()
                    continue
                wall = time.monotonic() - t0
                self._stuck = (-1, 0)
                self._absorb(replies, wall)
                if self._tuner is not None:
                    self._consult_tuner(chunk)
                if bar is not None:
                    last = self.history[-1]
                    bar.update(chunk)
                    bar.set_postfix(loss=f"{last['loss']:.3f}", sps=f"{last['samples_per_s']:.0f}",
                                    world=len(self.trainers))
        finally:
            if bar is not None:
                bar.close()
        return self.history

    def _absorb(self, replies, wall):
        per_rank = [[_step_row(m) for m in r["metrics"]] for r in replies]
        for i in range(len(per_rank[0])):
            row = _merged_row([r[i] for r in per_rank], len(self.trainers))
            # the members of a ring share their rows: each row once
            row["sample_ids"] = sorted(x for r in per_rank[::self._seq()] for x in r[i]["sample_ids"])
            row["step_s"] = wall / len(per_rank[0])
            row["samples_per_s"] = row["samples"] / row["step_s"] if row["step_s"] > 0 else 0.0
            self.history.append(row)
            if self._tensorboard is not None:
                self._tensorboard.add(row["step"], {"train/loss": row["loss"], "train/samples_per_s": row["samples_per_s"],
                                                    "train/world_size": row["world_size"]})
        if self._tensorboard is not None:
            self._tensorboard.flush()
        self._last_ranks = [{"rank": j, **{k: r[-1][k] for k in ("compute_s", "comm_s", "wait_s", "snapshot_s")}}
                            for j, r in enumerate(per_rank)]  # the last step's split, per rank (dashboard)
        self._watch_stragglers(per_rank)
        self.step = per_rank[0][-1]["step"]
        # Every rank finished these steps: commit them in each node's queue (which hears only its
        # own ranks' completions), or its window of uncommitted steps would fill.
        if len(self._node_services) > 1:
            try:
                _api.get([_typed.call(loader, "Dataloader", "commit", step=self.step)
                          for loader, _ in self._node_services.values()])
            except (ActorDiedError, ActorError):
                pass  # a dataloader is restarting: the next chunk fails, and its recovery rewinds every queue
        self._tune_snapshots()
        self._record({"state": GroupState.RUNNING})

    def _tune_snapshots(self):
        """Unless the user chose an interval, snapshot every step while a snapshot costs under 5%
        of a step, else every n steps so that it does."""
        if self._snapshot_fixed or len(self.history) < 3:
            return
        recent = self.history[-3:]
        step_s = sum(r["step_s"] for r in recent) / 3
        cost = sum(r["snapshot_s"] for r in recent) / 3
        every = max(1, int(-(-cost // (0.05 * step_s)))) if step_s > 0 else 1
        every = min(every, 100)
        if every != self._checkpoint["snapshot_every"] and self._configure_between_chunks(snapshotEvery=every):
            self._event(f"memory snapshots every {every} step(s): a snapshot takes {cost * 1e3:.1f} ms, "
                        f"a step {step_s * 1e3:.1f} ms")
            self._checkpoint["snapshot_every"] = every

    def _configure_between_chunks(self, **settings):
        """Applies settings to every trainer between chunks. A member that died since the chunk
        ended (or is restarting) makes the next chunk fail and be recovered, and the recovery
        configures every member again: its failure here is not the caller's. Returns whether
        every member took them."""
        try:
            _api.get([self._kind.call(t, "configure", **settings) for t in self.trainers])
            return True
        except (ActorDiedError, ActorError) as e:
            self._event(f"settings {settings} not applied at step {self.step} (a member failed: "
                        f"{str(e).splitlines()[0][:120]}); the next chunk recovers it")
            return False

    def _recover(self, failure, refs):
        t0 = time.monotonic()
        absorbed, world_before = self.step, (self.history[-1]["world_size"] if self.history else len(self.trainers))
        self._record({"state": GroupState.RECOVERING})
        # Every live rank's run() must have ended (the others' collectives failed) before they
        # join a new epoch. A call to a member that died before it arrived waits for the member's
        # restart, which may never come: such calls are not waited for.
        # Checked every 20 ms: the survivors' calls end within milliseconds of a death on their
        # host (life locks), and the dead member's state changes soon after.
        deadline = time.monotonic() + self.recovery_timeout
        lost, asked = set(), set()  # members a survivor saw die; survivors asked
        member = {id(r): t for t, r in zip(self.trainers, refs)}
        while refs and time.monotonic() < deadline:
            ready, not_ready = _api.wait(refs, num_returns=len(refs), timeout=0.02)
            lost |= self._seen_dead([member[id(r)] for r in ready], asked)
            if all(member[id(r)].actor_id in lost or self._rt.actor_info(member[id(r)].actor_id)["state"] != "ALIVE"
                   for r in not_ready):
                break
        self._event(f"failure at step {self.step}: {str(failure).splitlines()[0][:200]}")
        self._heal_in_background(refs, lost)
        # Members come back as new incarnations of the same actors; one that does not answer
        # by the deadline (its node is gone and there is no room elsewhere) leaves the group.
        deadline = time.monotonic() + self.replace_timeout
        answering = self._answering([(t, self._kind.probe) for t in self.trainers], deadline)
        survivors = [t for t in self.trainers if t.actor_id in answering]
        for t, bundle in zip(self.trainers, self._bundles):
            if t.actor_id not in answering:
                self._event(f"trainer {t.actor_id} (bundle {bundle}) is not coming back (no room for a replacement "
                            f"within {self.replace_timeout:.0f} s): the group shrinks")
                _api.kill(t)
        broken = len(survivors) % self._seq()
        if broken:  # sequence parallelism trains whole rings: the newest survivors leave too
            for t in survivors[-broken:]:
                self._event(f"trainer {t.actor_id} leaves so that the group keeps whole rings of {self._seq()}")
                _api.kill(t)
                answering.discard(t.actor_id)
            survivors = survivors[:-broken]
        if len(survivors) < self.min_workers:
            raise TroupeError(f"group {self.name}: {len(survivors)} trainer(s) left, fewer than min_workers "
                              f"{self.min_workers}") from failure
        gone = [b for t, b in zip(self.trainers, self._bundles) if t.actor_id not in answering]
        self._bundles = [b for t, b in zip(self.trainers, self._bundles) if t.actor_id in answering]
        self.trainers = survivors
        if gone:
            self._pg = self._rt.remove_bundles(self.group_id, gone)
        # Bundles of a lost node may have been placed again elsewhere; members restarted there.
        self._pg = self._rt.placement_group(self.group_id)
        self._ensure_node_services()
        # The nodes' services restart in place too; a node with no trainer left loses them.
        self._drop_idle_services()
        services = [probe for loader, ckpt in self._node_services.values()
                    for probe in ((loader, lambda h: _typed.call(h, "Dataloader", "info")),
                                  (ckpt, lambda h: _typed.call(h, "Checkpoint", "status")))]
        answering = self._answering(services, deadline + self.replace_timeout)
        if len(answering) != len(services):
            raise TroupeError(f"group {self.name}: a dataloader or checkpoint actor did not come back") from failure
        self._tell_members()
        self._join_all()
        if self.step > absorbed and hasattr(self._kind, "finished"):
            self._history_of_lost_chunk(absorbed, world_before)
        # A restarted member starts with its spawn's settings, and one a failed grow added missed
        # the resize's configure: every member gets the group's current ones.
        _api.get([self._kind.call(t, "configure", **self._settings, snapshotEvery=self._checkpoint["snapshot_every"])
                  for t in self.trainers], timeout=self.recovery_timeout)
        took = time.monotonic() - t0
        self._event(f"recovered in {took:.2f} s: world size {len(self.trainers)}, resuming at step {self.step}")
        self.recoveries.append({"step": self.step, "recovery_s": took})

    def _history_of_lost_chunk(self, absorbed, world):
        """The rows of steps (absorbed, self.step]: a chunk that failed had finished them on every
        rank (every rank restored a snapshot of self.step) but its run() replies were lost. The
        trainers of kinds that keep their last chunk's rows (Python trainers: `finished`) give
        them (a step no survivor kept gets a row whose metrics say they were lost); the samples
        are what the queue planned for the step. C++ trainers keep none: their history skips
        such steps (bench/chaos.py counts them from the plan)."""
        rows = {}
        for ref in [self._kind.finished(t, absorbed) for t in self.trainers]:
            try:
                for m in _api.get(ref, timeout=self.recovery_timeout)["metrics"]:
                    rows.setdefault(int(m["step"]), []).append(_step_row(m))
            except Exception:  # a member that kept nothing (a new process) or does not answer
                pass
        loader = next(iter(self._node_services.values()))[0]
        for step in range(absorbed + 1, self.step + 1):
            ranks = rows.get(step)
            planned = sorted(_typed.get(loader, "Dataloader", "stepSamples", step=step - 1)["ids"])
            if ranks:
                row = {**_merged_row(ranks, world), "sample_ids": planned}
                row["step_s"] = row["compute_s"] + row["comm_s"] + row["wait_s"] + row["snapshot_s"]
            else:
                row = {"step": step, "loss": math.nan, "world_size": world, "compute_s": 0.0, "comm_s": 0.0,
                       "wait_s": 0.0, "snapshot_s": 0.0, "bytes_allreduced": 0, "samples": len(planned),
                       "sample_ids": planned, "step_s": 0.0, "metrics_lost": True}
            row["samples_per_s"] = row["samples"] / row["step_s"] if row["step_s"] > 0 else 0.0
            row["from_failed_chunk"] = True
            self.history.append(row)
        self._event(f"steps {absorbed + 1}..{self.step} were done when the chunk failed: their rows come "
                    f"{'from the survivors' if rows else 'without metrics'}")

    def _seen_dead(self, members, asked):
        """The actor ids of trainers that `members` (whose calls ended) saw die, for kinds whose
        trainers can say (lost_peers): a peer's death on their host is known to them from the
        kernel at once, to the cluster only once the process has been torn down (a tenth of a
        second or more for gigabytes of memory)."""
        if not hasattr(self._kind, "lost_peers"):
            return set()
        refs = [(t, self._kind.lost_peers(t)) for t in members if t.actor_id not in asked]
        seen = set()
        for t, ref in refs:
            asked.add(t.actor_id)
            try:
                reply = _api.get(ref, timeout=2.0)
            except Exception:  # it cannot say: the cluster's word is waited for
                continue
            seen |= {self.trainers[r].actor_id for r in reply["ranks"] if 0 <= r < len(self.trainers)}
        return seen

    def _heal_in_background(self, refs, lost=()):
        """With a kind whose restart takes seconds (a Python process that imports torch and
        builds the model), the members that died leave the group for now and restart in their
        bundles while the survivors train on, if they are at least min_workers; they are taken
        back once warm (_take_back_healed), at a chunk boundary."""
        if not self._kind.heals_in_background or self._seq() != 1:
            return
        died = set()
        for t, ref in zip(self.trainers, refs):
            try:
                _api.get(ref, timeout=0)
            except ActorDiedError:
                died.add(t.actor_id)
            except Exception:
                pass
        died |= set(lost) | {t.actor_id for t in self.trainers if self._rt.actor_info(t.actor_id)["state"] != "ALIVE"}
        staying = [(t, b) for t, b in zip(self.trainers, self._bundles) if t.actor_id not in died]
        if not died or len(staying) < max(1, self.min_workers):
            return
        now = time.monotonic()
        for t, b in zip(self.trainers, self._bundles):
            if t.actor_id in died:
                self._healing[t.actor_id] = {"handle": t, "bundle": b, "since": now}
        self.trainers, self._bundles = [t for t, _ in staying], [b for _, b in staying]
        self._event(f"trainer(s) {sorted(died)} restarting: the group trains on with {len(staying)} and takes them "
                    f"back once they are ready")

    def _take_back_healed(self):
        """Members restarted after a failure rejoin, warm (their loop waits at the group's gate),
        at this chunk boundary: the group grows by them as by a resize (they restore the current
        step from a member's memory). One that is not back within replace_timeout leaves.
        Returns whether the group grew."""
        back = []
        for aid, h in list(self._healing.items()):
            info = self._rt.actor_info(aid)
            waited = time.monotonic() - h["since"]
            if info["state"] == "ALIVE":
                try:
                    reply = _api.get(self._kind.probe(h["handle"]), timeout=2.0)
                except Exception:
                    reply = None
                if reply is not None and (self._kind.warm(reply) or waited > self.replace_timeout):
                    back.append(h)
                    continue
            if info["state"] == "DEAD" or (info["state"] != "ALIVE" and waited > self.replace_timeout):
                self._event(f"trainer {aid} (bundle {h['bundle']}) is not coming back within "
                            f"{self.replace_timeout:.0f} s: the group goes on without it")
                del self._healing[aid]
                _api.kill(h["handle"])
                self._pg = self._rt.remove_bundles(self.group_id, [h["bundle"]])
                self._drop_idle_services()
                self._tell_members()
        if not back or len(self.trainers) + len(back) > self.max_workers:
            return False
        t0, current = time.monotonic(), len(self.trainers)
        _api.get([self._kind.call(t, "pin", snapshot=True) for t in self.trainers], timeout=self.recovery_timeout)
        for h in back:
            del self._healing[h["handle"].actor_id]
            self.trainers.append(h["handle"])
            self._bundles.append(h["bundle"])
        self._ensure_node_services()
        self._tell_members()
        self._join_all(restore_step=self.step, fresh={h["handle"].actor_id for h in back})
        _api.get([self._kind.call(t, "configure", **self._settings, snapshotEvery=self._checkpoint["snapshot_every"])
                  for t in self.trainers], timeout=self.recovery_timeout)
        self._event(f"trainer(s) {[h['handle'].actor_id for h in back]} back: grew from {current} to "
                    f"{len(self.trainers)} at step {self.step} in {time.monotonic() - t0:.2f} s")
        return True

    def _abandon_healing(self):
        """A resize supersedes the members still restarting: they leave with their bundles."""
        if not self._healing:
            return
        for aid, h in list(self._healing.items()):
            _api.kill(h["handle"])
        self._pg = self._rt.remove_bundles(self.group_id, [h["bundle"] for h in self._healing.values()])
        self._event(f"trainer(s) {sorted(self._healing)} were restarting: the resize goes on without them")
        self._healing = {}

    # A rank whose compute time per step is more than STRAGGLER_RATIO times the median of the
    # other ranks' over the last STRAGGLER_WINDOW steps is a straggler (DLRover's rule, from the
    # step times the ranks report anyway: no probes). Flagged and cleared as group events.
    STRAGGLER_WINDOW = 6
    STRAGGLER_RATIO = 2.0

    def _watch_stragglers(self, per_rank):
        window = getattr(self, "_compute_window", None)
        if window is None or window["world"] != len(per_rank):
            window = self._compute_window = {"world": len(per_rank), "steps": []}
        for i in range(len(per_rank[0])):
            window["steps"].append([r[i]["compute_s"] for r in per_rank])
        del window["steps"][:-self.STRAGGLER_WINDOW]
        flagged = {}
        if len(per_rank) >= 2 and len(window["steps"]) >= self.STRAGGLER_WINDOW:
            means = [sum(step[j] for step in window["steps"]) / len(window["steps"]) for j in range(len(per_rank))]
            for j, mine in enumerate(means):
                others = sorted(m for k, m in enumerate(means) if k != j)
                median = others[len(others) // 2] if len(others) % 2 else (others[len(others) // 2 - 1] +
                                                                             others[len(others) // 2]) / 2
                if median > 0 and mine > self.STRAGGLER_RATIO * median:
                    flagged[j] = {"rank": j, "compute_s": round(mine, 4), "others_median_s": round(median, 4),
                                  "ratio": round(mine / median, 2)}
        before = {s["rank"] for s in getattr(self, "stragglers", [])}
        for j, f in flagged.items():
            trainer = self.trainers[j].actor_id if j < len(self.trainers) else "?"
            f.update(trainer=trainer, node=self._trainer_nodes.get(trainer, ""))
            if j not in before:
                self._event(f"straggler: rank {j} (Trainer {trainer}) computes {f['compute_s']:.3f} s per step, "
                            f"{f['ratio']:.1f}x the other ranks' median {f['others_median_s']:.3f} s over the last "
                            f"{self.STRAGGLER_WINDOW} steps")
        for j in before - set(flagged):
            self._event(f"straggler cleared: rank {j} is back within {self.STRAGGLER_RATIO:g}x the others' median")
        self.stragglers = list(flagged.values())

    def _gather(self, refs, watch=False):
        """The values of `refs`; raises the first failure as soon as it is known (a call to a
        member that is gone may never end, while its peers' calls fail at once). With watch,
        a chunk with no progress for hang_timeout seconds is reported (see _report_hang)."""
        started = reported = time.monotonic()
        pending = list(refs)
        while True:
            ready, pending = _api.wait(pending, num_returns=1, timeout=0.5)  # each as it ends
            for r in ready:
                _api.get(r)  # a ready ref: its value at once, or its failure raised
            if not pending:
                return _api.get(refs)
            if watch and time.monotonic() - reported >= self.hang_timeout:
                reported = time.monotonic()
                self._report_hang(reported - started)

    def _report_hang(self, waited):
        """An event naming what each rank is doing and since when (asked out of turn, so a rank
        stuck in its step still answers), e.g. that one waits in bucket 3's all-reduce while the
        rank it needs is stuck in its data wait."""
        refs = [self._kind.call(t, "activity") for t in self.trainers]
        parts = []
        for t, ref in zip(self.trainers, refs):
            try:
                a = self._kind.reply("activity", _api.get(ref, timeout=10))
            except TroupeError as e:
                parts.append(f"Trainer {t.actor_id}: no answer ({e})")
                continue
            act = a["activity"]
            where = act["name"] + (f" of bucket {act['bucket']} ({act['bytes']} bytes)" if act["bucket"] >= 0 else "")
            waiting = f", waiting on {a['waitingOn']}" if a["waitingOn"] else ""
            parts.append(f"rank {a['rank']} (Trainer {t.actor_id}, pid {a['pid']}): {where} at step {act['step']} "
                         f"for {a['forS']:.1f} s{waiting}")
        self._event(f"no progress for {waited:.0f} s (hang_timeout {self.hang_timeout:g} s): " + "; ".join(parts))
        self._record({"state": GroupState.HUNG})

    def _consult_tuner(self, chunk):
        rows = self.history[-chunk:]
        alive = [n for n in _api.nodes() if n["state"] == "ALIVE"]
        used = sum(n["used"].get("CPU", 0.0) for n in alive)
        total = sum(n["resources"].get("CPU", 0.0) for n in alive)
        obs = {"world_size": len(self.trainers), "rows": [{k: r[k] for k in ("world_size", "step_s", "samples",
                                                                             "samples_per_s", "compute_s", "comm_s",
                                                                             "wait_s", "step", "bytes_allreduced")}
                                                  for r in rows],
               "free_cpus": max(0.0, total - used), "cores": len(os.sched_getaffinity(0)),
               "threads": self._engine["threads"]}
        decision = _api.get(self._tuner.observe.remote(obs))
        self.tuner_decisions.append(decision)
        if self.history:
            self.history[-1]["tuner"] = decision
        if decision["action"] != "keep":
            self._event(f"tuner: {decision['action']} {decision['world_size']} -> {decision['target']} trainer(s)"
                        f"{' (exploring)' if decision['explore'] else ''}: {decision['reason']}; predicted "
                        f"{(decision['predicted_samples_per_s'] or 0):.1f} samples/s at {decision['target']} "
                        f"({decision.get('prediction_basis') or 'no prediction'}) vs "
                        f"{(decision['predicted_current_samples_per_s'] or 0):.1f} now")
            self.resize(max(self.min_workers, decision["target"] - decision["target"] % self._seq()))
        settings = {"threads": int(decision["threads"]), "prefetch": int(decision["prefetch"])}
        if settings != self._settings:
            # Applied now to the current trainers, and by _spawn_trainer to new ones.
            self._settings = settings
            self._engine["threads"] = settings["threads"]
            if decision["action"] == "keep":
                self._configure_between_chunks(**settings)
            self._event(f"tuner: {settings['threads']} intra-op thread(s) per trainer, prefetch depth "
                        f"{settings['prefetch']}")
        # The outcome of the previous change is measured now: its decision record is on the tuner.
        self.tuner_decisions = _api.get(self._tuner.decisions.remote())
        errors = [d for d in self.tuner_decisions if d.get("prediction_error") is not None]
        self._record({"state": GroupState.RUNNING, "tuner": {"last": decision["action"], "target": decision["target"],
                                                    "reason": decision["reason"],
                                                    "prediction_errors": [round(d["prediction_error"], 3)
                                                                          for d in errors]}})

    def _answering(self, members, deadline):
        """Ids of the members that answer a cheap call (each (handle, probe) of `members`, where
        probe(handle) makes the call) before the deadline."""
        waiting = {m.actor_id: (m, probe) for m, probe in members}
        answered = set()
        while waiting and time.monotonic() < deadline:
            probes = {}
            for mid, (m, probe) in waiting.items():
                probes[mid] = probe(m)
            for mid, ref in probes.items():
                try:
                    _api.get(ref, timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                    answered.add(mid)
                except Exception:
                    pass
            for mid in answered:
                waiting.pop(mid, None)
            for mid in list(waiting):  # a restart with no room anywhere will not answer: stop waiting
                info = self._rt.actor_info(mid)
                if info["state"] == "DEAD" or (info["state"] == "RESTARTING" and not info["node_id"]):
                    waiting.pop(mid)
            if waiting:
                time.sleep(0.05)  # the controller restarts them; ask again
        return answered

    def _apply_resize(self, workers):
        """Shrinks (the newest trainers leave and their bundles are freed) or grows (bundles are
        added to the placement group, new trainers start from a member's memory snapshot) at
        a step boundary; no step is lost either way."""
        self._abandon_healing()
        current = len(self.trainers)
        # Every rank restores the current step after the move, a new member copies a node mate's
        # snapshot of it, and under ZeRO the ranks re-shard from every old rank's (the leaving
        # ones' included): each rank snapshots it now, as snapshot_every > 1 skips most steps.
        _api.get([self._kind.call(t, "pin", snapshot=True) for t in self.trainers], timeout=self.recovery_timeout)
        if workers < current:
            leaving = self._bundles[workers:]
            for t in self.trainers[workers:]:
                _api.kill(t)
            self.trainers, self._bundles = self.trainers[:workers], self._bundles[:workers]
            self._pg = self._rt.remove_bundles(self.group_id, leaving)
            # The services of a node left without members may sit in a removed bundle (gone
            # with it): no replica goes there any more.
            self._drop_idle_services()
            self._tell_members()
            self._join_all(restore_step=self.step)
        else:
            try:
                self._pg = self._rt.add_bundles(self.group_id, [{"CPU": 1.0}] * (workers - current))
            except (ResourceExhaustedError, UnavailableError) as e:  # no room for them now
                self._event(f"cannot grow from {current} to {workers} trainer(s): {e}")
                return False
            self._ensure_node_services()
            self._tell_members()
            added = list(range(len(self._pg["bundle_nodes"]) - (workers - current), len(self._pg["bundle_nodes"])))
            fresh = [self._spawn_trainer(b) for b in added]
            self.trainers += fresh
            self._bundles += added
            self._join_all(restore_step=self.step, fresh={t.actor_id for t in fresh})
        _api.get([self._kind.call(t, "configure", **self._settings) for t in self.trainers])
        self._event(f"resized from {current} to {workers} trainer(s) at step {self.step}")
        return True

    def members(self) -> list[dict[str, Any]]:
        """The group's members: [{"kind": "trainer"|"dataloader"|"checkpoint", "rank" (a
        trainer's rank, else None), "actor_id", "pid", "node"}], trainers first in rank order."""
        out = [{"kind": "trainer", "rank": r, "actor_id": t.actor_id} for r, t in enumerate(self.trainers)]
        for loader, ckpt in self._node_services.values():
            out += [{"kind": "dataloader", "rank": None, "actor_id": loader.actor_id},
                    {"kind": "checkpoint", "rank": None, "actor_id": ckpt.actor_id}]
        for m in out:
            info = self._rt.actor_info(m["actor_id"])
            m.update(pid=info.get("pid"), node=info.get("node_id"))
        return out

    def parameter_hash(self) -> list[str]:
        """Every rank's hash of its parameters (equal on every rank of a healthy group)."""
        replies = _api.get([self._kind.call(t, "hash") for t in self.trainers])
        return [f"{self._kind.reply('hash', x)['hash']:016x}" for x in replies]

    def close(self) -> None:
        """Ends the group: its actors, shared-memory segments and records."""
        if self._closed:
            return
        self._closed = True
        self._stop_beat.set()
        if self._tensorboard is not None:
            self._tensorboard.close()
        try:
            _api.get([_typed.call(c, "Checkpoint", "release") for _, c in self._node_services.values()], timeout=30)
        except Exception:
            pass
        if hasattr(self._kind, "close"):
            self._kind.close()
        for t in self.trainers + [h["handle"] for h in self._healing.values()]:
            _api.kill(t)
        for loader, ckpt in self._node_services.values():
            _api.kill(loader)
            _api.kill(ckpt)
        self._rt.remove_placement_group(self.group_id)
        self._rt.remove_group(self.group_id)
        # The driver's work directory (a Dataset written as files the dataloaders read): the
        # group is over. A detached group whose driver exits without close() keeps it.
        if getattr(self, "_workdir", None):
            shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> GroupCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


HEARTBEAT_S = 1.0


HEARTBEAT_STALE_S = 4.0


def _reserve_trainers(rt: Any, name: str, workers: int, min_workers: int, seq: int) -> dict[str, Any]:
    """A placement group of `workers` trainer bundles of 1 CPU, or of fewer (whole rings of `seq`,
    down to min_workers) when they do not fit; GroupPlacementError when not even min_workers do.
    Only an infeasible request (ResourceExhaustedError) or a group left pending counts as "does
    not fit": any other error is raised as it is."""
    reasons = []
    for n in range(workers - workers % seq, min_workers - 1, -seq):
        try:
            pg = rt.create_placement_group("PACK", [{"CPU": 1.0}] * n, name)
        except ResourceExhaustedError as e:  # infeasible: more CPUs than the cluster has
            reasons.append(f"{n} trainer(s): {e}")
            continue
        if pg["state"] == "CREATED":
            return pg
        reasons.append(f"{n} trainer(s): {pg['pending_reason']}")
        rt.remove_placement_group(pg["id"])
    raise GroupPlacementError(f"group {name} cannot be placed with at least {min_workers} trainer(s) of 1 CPU "
                              f"each: " + "; ".join(reasons))


def _newest_command(record: dict[str, Any]) -> int:
    """The seq of the newest command in a group's record (0: none), where an adopting coordinator
    starts: the commands sent before are not replayed, since the dead coordinator may have
    carried them out already (a stop replayed would end the new coordinator's fit at once)."""
    return max((c["seq"] for c in record.get("commands", [])), default=0)


def _find_group(rt: Any, name: str) -> dict[str, Any] | None:
    """The record of the live group named `name`, or None."""
    for g in rt.groups():
        try:
            doc = json.loads(g["doc"])
        except ValueError:
            continue
        if doc.get("name") == name and doc.get("state") != GroupState.CLOSED:
            return g
    return None


class GroupHandle:
    """A running training group seen from another driver (ElasticTrainer.attach)."""

    def __init__(self, rt: Any, name: str, group_id: str) -> None:
        self._rt, self.name, self.group_id = rt, name, group_id

    def progress(self) -> dict[str, Any]:
        """The group's record: step, world_size, loss, samples_per_s, state, members, and
        `events` (its newest events) and `coordinator_alive`."""
        record = self._rt.group(self.group_id)
        if not record:
            return {"name": self.name, "state": GroupState.CLOSED, "events": [], "coordinator_alive": False}
        doc = json.loads(record["doc"])
        doc["events"] = list(record.get("events", []))
        doc["coordinator_alive"] = time.time() * 1000 - doc.get("heartbeat_ms", 0) < HEARTBEAT_STALE_S * 1000
        return doc

    def resize(self, workers: int) -> int:
        """Asks the coordinator to resize the group to `workers` trainers at its next chunk
        (clamped to its [min_workers, max_workers]); returns the command's seq.
        InvalidArgumentError unless `workers` is a positive int; NotFoundError when the group is
        gone."""
        try:
            n = operator.index(workers)  # an int or a numpy integer, not a float or a string
        except TypeError:
            n = 0
        if isinstance(workers, bool) or n < 1:
            raise InvalidArgumentError(f"resize({workers!r}): the number of trainers must be a positive int")
        # What the coordinator would refuse is refused here, where the sender learns it: a world
        # size (after clamping) that is not whole rings of sequence_parallel trainers.
        record = self._rt.group(self.group_id)
        doc = json.loads(record["doc"]) if record else {}
        seq = int(doc.get("engine", {}).get("sequence_parallel", 1) or 1)
        clamped = max(doc.get("min_workers", n), min(doc.get("max_workers", n), n))
        if clamped % seq:
            raise InvalidArgumentError(f"resize({n}): {clamped} trainer(s) after clamping to [{doc.get('min_workers')}, "
                                       f"{doc.get('max_workers')}] is not a multiple of sequence_parallel={seq}")
        return self._rt.group_command(self.group_id, "resize", n)

    def stop(self) -> int:
        """Asks the coordinator to stop training at its next chunk; returns the command's seq.
        NotFoundError when the group is gone."""
        return self._rt.group_command(self.group_id, "stop")

    def wait(self, step: int | None = None, timeout: float = 60.0,
             states: tuple[str, ...] = (GroupState.STOPPED, GroupState.CLOSED)) -> dict[str, Any]:
        """Waits until the group reaches `step` (or, without one, one of `states`); returns
        progress(). TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            p = self.progress()
            if (step is not None and p.get("step", 0) >= step) or (step is None and p.get("state") in states):
                return p
            if time.monotonic() > deadline:
                raise TimeoutError(f"group {self.name}: {'step ' + str(step) if step else states} not reached in "
                                   f"{timeout:.0f} s (now step {p.get('step')}, {p.get('state')})")
            time.sleep(0.1)


@_api.remote(num_cpus=0)
class _TunerActor:
    """The group's resource tuner (troupe.tuner.ResourceTuner) as a member of the group."""

    def __init__(self, min_workers, max_workers, options):
        from .tuner import ResourceTuner

        self.tuner = ResourceTuner(min_workers, max_workers, **options)

    def observe(self, obs):
        from .tuner import Observation

        rows = obs.pop("rows")
        decision = self.tuner.observe(Observation.from_history(rows, **obs))
        return decision.as_dict()

    def decisions(self):
        return self.tuner.decisions
