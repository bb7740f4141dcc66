// The elastic group's "Trainer" and "Dataloader" actors (LibTorch builds only), driven by
// troupe.train.ElasticTrainer. Their methods are typed interfaces (actors/schema/*.capnp,
// included as "<name>.capnp.h"); the generic call reaches the same methods by name with the
// params and results encoded with that schema (troupe._actors, for Python). Init args are JSON.
//
// Dataloader (one per node): holds the dataset and the group's ShardQueue.
//   init args {"group", "node", "data": {"kind": "text"|"tokens"|"npy", "path"|"features",
//            "labels", "dtype"}, "seed", "global_batch", "context"}
//   methods: rpc::Dataloader (dataloader.capnp): take (a rank's rows of a step, as an
//   rpc::Batch), complete, commit, rewind, info, stepSamples.
//
// Trainer (one per rank): a TrainerEngine on a compute thread of its own.
//   init args {"group", "node", "engine": {TrainerEngineOptions by name}, "dataloader": actor id,
//            "checkpoint": actor id, "snapshot_every": n (0: never), "persist_every", "bundle",
//            "min_workers", and the tests' "fault_*" settings}
//   methods: rpc::Trainer (trainer.capnp): join (a new communicator at an epoch), snapshots,
//   restore, run (steps, with their StepMetrics), loadDir, configure, pin, hash run on the
//   compute thread, one at a time in arrival order, and never block the RPC thread; activity
//   and timeline answer on the RPC thread at once (answersAtOnce), also while a run is in
//   progress. A bad argument (a rank outside its world, threads below 1, a setting below -1)
//   fails with kInvalidArgument naming it and changes nothing.
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
