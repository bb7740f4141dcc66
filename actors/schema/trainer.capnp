@0xc6270158f3f3d021;
# The built-in Trainer actor's typed interface (actors/trainer_actor.cc; see
# troupe/actors/train_actors.h): one per rank of an elastic group, a TrainerEngine on a compute
# thread of its own. The Python driver (troupe.train.ElasticTrainer) calls it through the
# actor's generic call, the params and results encoded with this schema (troupe._actors).
# Every method but activity and timeline runs on the compute thread, one at a time, in the order
# the calls arrive; those two answer at once, also while a `run` is in progress.

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("troupe::actors::rpc");

# What one step did on this rank. Times are wall-clock seconds.
struct StepMetrics {
  step @0 :Int64;              # steps done after this one
  loss @1 :Float64;            # mean per-sample loss over the global batch (all ranks)
  computeS @2 :Float64;        # time not spent waiting on collectives (a test's delay included)
  commS @3 :Float64;           # time blocked on all-reduces after backward
  waitS @4 :Float64;           # waiting for the step's batch
  snapshotS @5 :Float64;       # the memory snapshot and telling the checkpoint actor
  samples @6 :Int64;           # global batch size
  bytesAllreduced @7 :UInt64;
  sampleIds @8 :List(UInt64);  # the rows this rank trained on
}

# A span of the rank's recent activity (TrainerEngine's timeline). Times are microseconds of the
# system clock, so the ranks of a host line up.
struct TimelineSpan {
  name @0 :Text;     # forward, backward, allreduce, allreduce loss, optimizer, data wait, snapshot
  startUs @1 :Int64;
  durUs @2 :Int64;
  step @3 :Int64;    # the step it belongs to (1-based, as StepMetrics.step)
  bucket @4 :Int32;  # a gradient bucket's all-reduce; -1 otherwise
  bytes @5 :UInt64;
}

interface Trainer {
  # Joins the group's epoch `epoch` as `rank` of `world` (a new communicator; world 1 trains
  # alone). A trainer restarted on another node is told that node's services (ids; "" keeps
  # the current ones).
  join @0 (epoch :Int64 = 1, rank :UInt32, world :UInt32 = 1, dataloader :Text, checkpoint :Text)
      -> (rank :UInt32, world :UInt32);
  # The steps this rank can restore from memory (0, the seed's initial state, always).
  snapshots @1 () -> (steps :List(Int64));
  # Restores `step`: 0 from the seed; otherwise this bundle's snapshot, bundle `fromBundle`'s
  # (a new member copying a node mate's), or under ZeRO after the world changed, the old
  # bundles' `fromBundles` (in old rank order). With `broadcastFrom` >= 0 every rank then takes
  # the state of that rank by a broadcast; `fromBroadcast` ranks skip their own restore.
  restore @2 (step :Int64, fromBundle :Int32 = -1, fromBundles :List(UInt32), broadcastFrom :Int32 = -1,
              fromBroadcast :Bool) -> (step :Int64, source :Text, hash :UInt64);
  # Trains steps [fromStep, fromStep + steps) (a collective failure ends it with an error), then
  # pins the newest snapshot (hasPinned false when there is none). `hash` is parameterHash().
  run @3 (fromStep :Int64, steps :Int64 = 1)
      -> (metrics :List(StepMetrics), hash :UInt64, hasPinned :Bool, pinned :Int64);
  # Loads the newest complete step at or below `step` (0: the newest) of the persisted
  # checkpoint in `dir`, written by a group of any world size.
  loadDir @4 (dir :Text, step :Int64) -> (step :Int64, source :Text, hash :UInt64);
  # Settings from the next step on; -1 (the default) keeps one. snapshotEvery 0 never
  # snapshots; threads must be at least 1; prefetch is the batches asked for ahead.
  configure @5 (snapshotEvery :Int64 = -1, threads :Int32 = -1, prefetch :Int32 = -1)
      -> (snapshotEvery :Int64, threads :Int32, prefetch :Int32);
  # Pins the newest memory snapshot here and in its replica; with `snapshot` the current step
  # is snapshotted first unless it already is.
  pin @6 (snapshot :Bool) -> (hasPinned :Bool, pinned :Int64);
  hash @7 () -> (hash :UInt64, step :Int64);
  # What the rank is doing now and for how long, and the peers a collective waits for.
  activity @8 () -> (rank :Int32, world :Int32, pid :Int64, activity :TimelineSpan, forS :Float64,
                     waitingOn :Text);
  # The rank's newest spans (at most 4096), oldest first.
  timeline @9 () -> (rank :Int32, world :Int32, pid :Int64, spans :List(TimelineSpan));
}
