// The elastic group's "Trainer" and "Dataloader" actors (LibTorch builds only), driven by
// troupe.train.ElasticTrainer. Payloads and replies are JSON unless noted.
//
// Dataloader (one per node): holds the dataset and the group's ShardQueue.
//   init args (JSON) {"group", "node", "data": {"kind": "text"|"tokens"|"npy", "path"|"features",
//            "labels", "dtype"}, "seed", "global_batch", "context"}
//   methods: the typed interface rpc::Dataloader (actors/schema/dataloader.capnp, included as
//   "dataloader.capnp.h"): take (a rank's rows of a step, as an rpc::Batch), complete, commit,
//   rewind, info, stepSamples. The generic call reaches the same methods by name with the params
//   and results encoded with that schema (troupe._actors, for Python).
//
// Trainer (one per rank): a TrainerEngine on a compute thread of its own; calls that compute or
// wait (join, restore, run) run there, in order, and never block the RPC thread.
//   init    {"group", "node", "engine": {TrainerEngineOptions by name}, "dataloader": actor id,
//            "checkpoint": actor id, "snapshot_every": n (0: never)}
//   join    {"epoch", "rank", "world"} -> {"rank", "world"}: a new communicator at that epoch
//   snapshots {} -> {"steps": [...]}: complete memory snapshots this rank can restore
//   restore {"step"} -> {"step", "source", "hash"}: loads the snapshot of that step (0: the
//            initial parameters, re-created from the seed)
//   run     {"from", "steps"} -> {"metrics": [StepMetrics as JSON per step], "hash"}: trains
//            steps [from, from + steps); a collective failure ends it with an error
//   configure {"snapshot_every": n} -> {"snapshot_every": n}
//   pin     {"snapshot": bool} -> {"pinned": step or null}: pins the newest memory snapshot here
//            and in its replica; with "snapshot", the current step is snapshotted first unless
//            it already is (a resize restores the current step whatever snapshot_every is)
//   hash    {} -> {"hash", "step"}
#pragma once

#include <string>
#include <string_view>

#include "dataloader.capnp.h"
#include "troupe/actors/batch.h"
#include "troupe/runtime/actor.h"
#include "troupe/runtime/status.h"

namespace troupe::actors {

// Registers "Trainer" and "Dataloader".
void registerTrainActors(ActorRegistry& registry);

// A batch on the wire (rpc::Batch). batchFromWire checks what a peer sent: a known dtype, dims
// that are not negative and whose product cannot wrap, data of exactly product(shape) elements,
// and one sample id per row of the inputs; kInvalidArgument naming the numbers otherwise.
void batchToWire(const Batch& batch, rpc::Batch::Builder out);
Result<Batch> batchFromWire(rpc::Batch::Reader wire);

}  // namespace troupe::actors
