@0xc669804a1bd55494;
# The built-in C++ actors' init args: the contract between whoever creates one of these actors
# and the actor. ActorSpec.initArgs (runtime/rpc/schema/troupe.capnp) carries, for each type named
# below, one flat Cap'n Proto message whose root is that type's struct.
#
#   type          struct            actor
#   "Trainer"     TrainerArgs       actors/trainer_actor.cc
#   "Dataloader"  DataloaderArgs    actors/dataloader_actor.cc
#   "Checkpoint"  CheckpointArgs    actors/checkpoint_actor.cc
#   "Counter"     CounterArgs       actors/test_actors.cc
#   "Crasher"     CrasherArgs       actors/test_actors.cc
#
# A driver writes them from a JSON object whose keys are the $Json.name of each field (snake_case,
# what Python passes: troupe.cpp_actor("Checkpoint", init_args={"group": ..., "shm_dir": ...})).
# troupe/actors/init_args.h encodes that JSON before the actor is submitted: an unknown key, a
# value of the wrong type or out of its field's range fails there, in the driver, naming the type
# and the field. An absent key takes the default written here, which is the actor's default.
# Every other type (Relay, Echo, Sleeper: none; Python actors "py:...": a pickle) carries its
# bytes unchanged.
#
# Evolution: add fields at the end with new ordinals; never renumber, retype or rename a JSON name
# (a driver and a worker of one cluster run the same build, but recorded actors restart from
# their stored init args).

using Cxx = import "/capnp/c++.capnp";
using Json = import "/capnp/compat/json.capnp";
$Cxx.namespace("troupe::actors::rpc");

# The trainer's engine (TrainerEngineOptions, troupe/actors/trainer_engine.h, says what each does).
struct EngineSpec {
  model @0 :Text = "tinylm";            # "tinylm", "mlp", or a TorchScript file's path
  loss @1 :Text = "cross_entropy";      # "cross_entropy" or "mse"
  optimizer @2 :Text = "adamw";         # "adamw", "agd", "lamb", "lars", "sgd", "wsam"
  wsamBase @3 :Text = "sgd" $Json.name("wsam_base");
  lr @4 :Float64 = 0.001;
  weightDecay @5 :Float64 = 0.0 $Json.name("weight_decay");
  momentum @6 :Float64 = 0.0;           # sgd and lars
  wsamRho @7 :Float64 = 0.05 $Json.name("wsam_rho");
  wsamGamma @8 :Float64 = 0.9 $Json.name("wsam_gamma");
  seed @9 :UInt64 = 0;
  threads @10 :Int32 = 1;               # LibTorch intra-op and optimizer threads
  globalBatch @11 :Int64 = 32 $Json.name("global_batch");
  maxMicroBatch @12 :Int64 = 32 $Json.name("max_micro_batch");
  context @13 :Int64 = 64;              # tinylm's context (tokens)
  zero @14 :Int32 = 0;                  # 0: data parallel; 1: ZeRO-1; 2: ZeRO-2
  sequenceParallel @15 :Int32 = 1 $Json.name("sequence_parallel");
  mlpSizes @16 :List(Int64) = [16, 64, 4] $Json.name("mlp_sizes");  # the built-in MLP's widths
}

# "Trainer": one rank of an elastic group (troupe/actors/train_actors.h).
struct TrainerArgs {
  group @0 :Text;                       # the group: its communicator's rendezvous name
  engine @1 :EngineSpec;
  dataloader @2 :Text;                  # the node's Dataloader actor (id); join may name another
  checkpoint @3 :Text;                  # the node's Checkpoint actor (id); join may name another
  snapshotEvery @4 :Int64 = 1 $Json.name("snapshot_every");   # steps between memory snapshots
  persistEvery @5 :Int64 = 0 $Json.name("persist_every");     # steps between persists (0: never)
  bundle @6 :Int32 = 0;                 # its bundle of the group's placement group
  minWorkers @7 :Int32 = 1 $Json.name("min_workers");         # the smallest world it trains in
  # Faults for tests, on the first incarnation only (a restart runs clean).
  faultKillAtStep @8 :Int64 = -1 $Json.name("fault_kill_at_step");  # SIGKILL itself at this step
  faultSlowMs @9 :Int64 = 0 $Json.name("fault_slow_ms");            # each step takes this much longer
  faultHangAtStep @10 :Int64 = -1 $Json.name("fault_hang_at_step"); # hang at this step
  faultKillInJoin @11 :Bool = false $Json.name("fault_kill_in_join");
  faultKillAtStart @12 :Bool = false $Json.name("fault_kill_at_start");
}

# Where a Dataloader's samples come from.
struct DataSpec {
  kind @0 :Text;                        # "text" (its bytes are the tokens), "tokens" or "npy"
  path @1 :Text;                        # text and tokens: the file
  dtype @2 :Text = "uint16";            # tokens: "uint16" or "uint32"
  features @3 :Text;                    # npy: the features' .npy file
  labels @4 :Text;                      # npy: the labels' .npy file
}

# "Dataloader": a node's shard queue over one dataset (troupe/actors/train_actors.h).
struct DataloaderArgs {
  data @0 :DataSpec;
  seed @1 :UInt64 = 0;                  # the epochs' permutations
  globalBatch @2 :Int64 = 32 $Json.name("global_batch");
  context @3 :Int64 = 64;               # tokens per sample (text and tokens)
}

# "Checkpoint": a node's flash checkpoints (troupe/actors/checkpoint_actor.h says what each does).
struct CheckpointArgs {
  group @0 :Text;                       # required: part of every segment name
  node @1 :Text;                        # required: this node's tag
  self @2 :Text;                        # this actor's name: peers use it; picks the replica target
  members @3 :List(Text);               # every checkpoint actor of the group, this one included
  # Who keeps this node's replicas. Absent: the member after `self` in `members` (cyclic) when
  # there are several; "" turns replicas off.
  replicaTo @4 :Text $Json.name("replica_to");
  dir @5 :Text;                         # the checkpoint directory; "": no persistence
  keep @6 :UInt32 = 3;                  # complete steps kept on disk
  fileMode @7 :UInt32 = 384 $Json.name("file_mode");  # persisted files' mode (384 = 0600)
  shmDir @8 :Text $Json.name("shm_dir");  # "": /dev/shm, or $TROUPE_SHM_DIR
  fault @9 :Text;                       # a fault-injection spec (checkpoint/fault.h), for tests
}

# "Counter": a test actor holding one integer.
struct CounterArgs {
  start @0 :Int64 = 0;
}

# "Crasher": a test actor that fails on request.
struct CrasherArgs {
  failOnStart @0 :Bool = false $Json.name("fail_on_start");  # its constructor fails
}
