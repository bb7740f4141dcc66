"""Elastic training on a Troupe cluster: one group of C++ trainer, dataloader and checkpoint
actors that keeps training through failures and resizes.

    import troupe
    from troupe.train import CheckpointConfig, ElasticTrainer, FailureConfig, ScalingConfig

    troupe.init(num_cpus=2)
    trainer = ElasticTrainer(model="tinylm", data="/usr/share/common-licenses/GPL-3",
                             optimizer={"name": "adamw", "lr": 3e-3}, global_batch_size=16,
                             scaling=ScalingConfig(min_workers=1, max_workers=2),
                             failure=FailureConfig(max_failures=3),
                             checkpoint=CheckpointConfig(dir="/tmp/ckpt", persist_every=50))
    history = trainer.fit(200)
    trainer.close()

The settings of ScalingConfig and FailureConfig (except max_failures) are also keywords of
ElasticTrainer (min_workers=1, max_workers=2, hang_timeout=60.0, ...); checkpoint= also takes a
dict of CheckpointConfig's fields or a directory. A setting is given one way (a keyword and its
config together raise TypeError), and every value is checked before anything is placed.

The driver drives the group in chunks of steps: every trainer runs the same steps; a failure
(a member killed, a node lost) ends the chunk on every rank, the controller advances the group's
epoch, the driver waits for the replacement (or shrinks, never below min_workers), every rank
restores the newest step that every rank holds in memory, the dataloader rewinds to it, and the
next chunk starts. Membership, epoch, step, throughput and events are in the cluster (shown by
`troupe status`).

With detached=True and a name, the group outlives its driver: run the script as a job
(`troupe job submit train.py --max-restarts 3`) and a restarted driver's
ElasticTrainer(name=..., detached=True) adopts the running group, where fit(until=N) goes on.
ElasticTrainer.attach(name) from any other driver or notebook returns a GroupHandle:
progress(), wait(step), resize(n) and stop() (carried out by the coordinator at its next
chunk).

tensorboard_dir=DIR writes each step's loss, samples/s and world size as TensorBoard scalars
(`tensorboard --logdir DIR`). A rank that computes more than 2x the other ranks' median over
the last steps is flagged as a straggler (an event; shown by `troupe status` and the dashboard).

checkpoint=CheckpointConfig(dir=DIR, resume=True) (or {"dir": DIR, "resume": True}) starts from
the newest complete step persisted in DIR (by a group of any world size, ZeRO or not) instead
of the seed.

zero=1 shards the optimizer state over the ranks (ZeRO-1: each keeps 1/N of it; gradients are
reduce-scattered and the parameters all-gathered), zero=2 the gradients too (ZeRO-2). Training
equals zero=0's (data parallel). It stays elastic: when the world changes (a shrink after a
loss, a resize, the tuner), every rank re-assembles its new shard from the snapshots of the old
ranks, so nothing is lost; troupe.checkpoint.load() puts a persisted step back together whole.

sequence_parallel=S (tinylm) splits every sequence over rings of S trainers: each holds 1/S of
each sequence (the zigzag split, so causal attention costs every rank the same) and attention
runs as a ring (ring attention, equal to full attention). The trainers form a 2-D mesh: W/S
data-parallel groups of S. The world size stays a multiple of S: a failure that leaves a broken
ring shrinks the group to whole rings (never below min_workers), and resizes go by whole rings.

TorchTrainer(train_loop, data=..., global_batch_size=..., scaling=...) runs the user's own eager
PyTorch loop on every rank instead of the C++ engine (troupe/torch_trainer.py). Both are one
GroupCoordinator (placement, recovery, resize, adoption, tuner; troupe/_group.py) with a
different trainer kind.

The actors' methods take and return JSON; the wire format is documented in
actors/include/troupe/actors/trainer_actor.h.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import _api, _typed
# The coordinator and its configs live in troupe._group (under TorchTrainer too); this module
# exports them with the trainers.
from ._group import (STUCK_FAILURES, CheckpointConfig, FailureConfig, GroupCoordinator, GroupHandle,
                     GroupPlacementError, GroupState, ScalingConfig, _configs, _data_spec)
from .exceptions import InvalidArgumentError

if TYPE_CHECKING:  # torch is imported only where a module is given
    import torch

__all__ = ["CheckpointConfig", "ElasticTrainer", "FailureConfig", "GroupCoordinator", "GroupHandle",
           "GroupPlacementError", "GroupState", "ScalingConfig", "STUCK_FAILURES", "TorchTrainer", "TrainLoopError"]


def _model_path(model: str | os.PathLike[str] | torch.nn.Module, workdir: str) -> str:
    """A model name the trainer knows ("tinylm", "mlp"), a TorchScript file, or a torch.nn.Module
    (scripted into `workdir`)."""
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if isinstance(model, str):
        if model in ("tinylm", "mlp") or os.path.exists(model):
            return model
        raise InvalidArgumentError(f"model {model!r}: not 'tinylm', 'mlp' or an existing TorchScript file")
    import torch

    scripted = model if isinstance(model, torch.jit.ScriptModule) else torch.jit.script(model)
    path = os.path.join(workdir, "model.pt")
    scripted.save(path)
    return path


class _CppTrainers:
    """The coordinator's trainers are C++ Trainer actors (actors/trainer_actor.cc): typed calls of
    actors/schema/trainer.capnp. `prepare(workdir)` -> (engine settings, data spec)."""

    name = "cpp"
    # A C++ trainer restarts in milliseconds: the group waits for it rather than shrinking.
    heals_in_background = False

    def __init__(self, prepare):
        self.prepare = prepare

    def probe(self, handle):
        """A call a live member answers at once (hash runs on the compute thread: it also
        says the member has finished what it was doing)."""
        return _typed.call(handle, "Trainer", "hash")

    def call(self, handle, method, **params):
        return _typed.call(handle, "Trainer", method, **params)

    def reply(self, method, value):
        return _typed.reply("Trainer", method, value)

    def handle(self, actor_id):
        return _api.ActorHandle(actor_id, "Trainer")

    def fatal(self, failure):
        """The error fit() raises at once for `failure` instead of recovering (None: recover)."""
        return None

    def spawn(self, group, bundle):
        node = group._pg["bundle_nodes"][bundle]
        loader, ckpt = group._node_services[node]
        # TrainerArgs of actors/schema/init_args.capnp: cpp_actor refuses a key it does not name.
        spec = {"group": group.group_id, "engine": group._engine, "dataloader": loader.actor_id,
                "checkpoint": ckpt.actor_id, "snapshot_every": group._checkpoint["snapshot_every"],
                "persist_every": group._checkpoint["persist_every"], "bundle": bundle,
                "min_workers": group.min_workers,
                "fault_kill_at_step": group._fault.get("kill_at_step", -1) if group._fault.get("rank") == bundle else -1,
                "fault_slow_ms": group._fault.get("slow_ms", 0) if group._fault.get("slow_rank") == bundle else 0,
                "fault_hang_at_step": group._fault.get("hang_at_step", -1) if group._fault.get("hang_rank") == bundle else -1,
                "fault_kill_in_join": group._fault.get("join_kill_bundle") == bundle,
                "fault_kill_at_start": group._fault.get("start_kill_bundle") == bundle}
        return _api.cpp_actor("Trainer", json.dumps(spec).encode(), num_cpus=1, max_restarts=-1,
                              placement_group=group.group_id, bundle_index=bundle, lifetime=group._lifetime)


class ElasticTrainer(GroupCoordinator):
    """A training job as one elastic group. See the module docstring.

    The job: `model` ("tinylm", "mlp", a TorchScript file or a torch.nn.Module), `loss`, `data`
    (a text or token file, or {"features": F, "labels": L} .npy paths), `optimizer` (a name or
    {"name": ..., "lr": ..., other hyper-parameters}), `global_batch_size` (split over the
    ranks, in micro-batches of at most `max_micro_batch`), `context` (tokens per sequence) and
    `seed`. How the group scales, fails and keeps its state: `scaling` (ScalingConfig),
    `failure` (FailureConfig) and `checkpoint` (CheckpointConfig, or the same as a dict or a
    directory). Each field of ScalingConfig and FailureConfig except max_failures may be given
    as a keyword instead (min_workers=2, hang_timeout=60.0, ...), not both ways (TypeError); a
    keyword left None takes the config's default. Invalid values raise ValueError before
    anything is placed. `steps_per_call`: steps per chunk; `progress`: a tqdm bar in fit();
    `name` and `detached`: see the module docstring; `tensorboard_dir`: TensorBoard scalars."""

    def __init__(self, model: str | os.PathLike[str] | torch.nn.Module = "tinylm", loss: str = "cross_entropy",
                 data: str | os.PathLike[str] | Mapping[str, str] | None = None,
                 optimizer: str | Mapping[str, Any] = "adamw", global_batch_size: int = 32,
                 min_workers: int | None = None, max_workers: int | None = None, workers: int | None = None,
                 checkpoint: CheckpointConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
                 seed: int = 0, threads_per_worker: int | None = None, max_micro_batch: int | None = None,
                 context: int = 64, steps_per_call: int = 10, recovery_timeout: float | None = None,
                 progress: bool = True, name: str | None = None, replace_timeout: float | None = None,
                 tuner: bool | Mapping[str, Any] | None = None, detached: bool = False,
                 tensorboard_dir: str | os.PathLike[str] | None = None, hang_timeout: float | None = None,
                 zero: int | None = None, sequence_parallel: int | None = None, *,
                 scaling: ScalingConfig | None = None, failure: FailureConfig | None = None,
                 _fault: Mapping[str, Any] | None = None) -> None:
        scaling, failure, ckpt = _configs(scaling, failure, checkpoint, {
            "min_workers": min_workers, "max_workers": max_workers, "workers": workers,
            "threads_per_worker": threads_per_worker, "sequence_parallel": sequence_parallel, "zero": zero,
            "tuner": tuner, "recovery_timeout": recovery_timeout, "replace_timeout": replace_timeout,
            "hang_timeout": hang_timeout})
        seq = scaling.sequence_parallel

        def prepare(workdir):
            if data is None:
                raise InvalidArgumentError("data is required: a text or token file, or {'features': ..., 'labels': ...}")
            if context % (2 * seq):
                raise InvalidArgumentError(f"sequence_parallel={seq} needs context ({context}) to be a multiple of twice it")
            if global_batch_size < scaling.max_workers:
                raise InvalidArgumentError(f"global_batch_size {global_batch_size} is smaller than max_workers {scaling.max_workers}")
            opt = {"name": optimizer} if isinstance(optimizer, str) else dict(optimizer)
            engine = {
                "model": _model_path(model, workdir), "loss": loss, "optimizer": opt.pop("name", "adamw"),
                "lr": float(opt.pop("lr", 1e-3)), "seed": int(seed), "threads": scaling.threads_per_worker,
                "global_batch": int(global_batch_size), "max_micro_batch": int(max_micro_batch or global_batch_size),
                "context": int(context), "zero": scaling.zero, "sequence_parallel": seq, **{k: v for k, v in opt.items()},
            }
            from . import _core

            try:  # the engine as the trainers' init args (EngineSpec): refused now, before anything is placed
                _core.encode_init_args("Trainer", {"engine": engine})
            except InvalidArgumentError as e:
                raise InvalidArgumentError(f"ElasticTrainer: {e}") from None
            return engine, _data_spec(data)

        self._start(_CppTrainers(prepare), scaling, failure, ckpt, name=name, detached=detached, progress=progress,
                    steps_per_call=steps_per_call, tensorboard_dir=tensorboard_dir, fault=_fault)


def __getattr__(name: str) -> Any:
    """TorchTrainer and TrainLoopError: the user's own PyTorch loop on the same coordinator
    (troupe/torch_trainer.py, which imports this module; loaded on first use)."""
    if name in ("TorchTrainer", "TrainLoopError", "TorchContext", "GroupChanged"):
        from . import torch_trainer

        return getattr(torch_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
