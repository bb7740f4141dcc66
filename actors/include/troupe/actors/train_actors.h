// The elastic group's "Trainer" and "Dataloader" actors (LibTorch builds only), driven by
// troupe.train.ElasticTrainer. Payloads and replies are JSON unless noted.
//
// Dataloader (one per node): holds the dataset and the group's ShardQueue.
//   init    {"group", "node", "data": {"kind": "text"|"tokens"|"npy", "path"|"features","labels",
//            "dtype"}, "seed", "global_batch", "context"}
//   take    {"step", "rank", "world"} -> a batch (binary, see encodeBatch) of that rank's rows
//   complete {"step", "rank"} -> {"committed": n}
//   rewind  {"step"} -> {"committed": n}: back to a restored step (steps [0, step) applied)
//   info    {} -> {"samples", "committed", "data_epoch", "in_flight"}
//   step_samples {"step"} -> {"ids": [...]}: the samples a step consumes (for accounting tests)
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

#include "troupe/actors/batch.h"
#include "troupe/runtime/actor.h"
#include "troupe/runtime/status.h"

namespace troupe::actors {

// Registers "Trainer" and "Dataloader".
void registerTrainActors(ActorRegistry& registry);

// A batch on the wire: u32 header length, a JSON header ({"inputs": {dtype, shape}, "targets":
// {...}, "ids": [...]}), then the inputs' and the targets' bytes.
std::string encodeBatch(const Batch& batch);
Result<Batch> decodeBatch(std::string_view bytes);

}  // namespace troupe::actors
