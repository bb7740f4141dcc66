@0xa8640bc8195e18c3;
# The built-in Dataloader actor's typed interface (actors/dataloader_actor.cc; see
# troupe/actors/train_actors.h): one per node of an elastic group, holding the dataset and the
# group's ShardQueue. Trainers take their batches from it; the driver commits and rewinds.

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("troupe::actors::rpc");

# A dense C-order array: `data` holds product(shape) elements of `dtype` ("float32", "int64",
# ...), little-endian. A receiver checks the size before it reads.
struct Tensor {
  dtype @0 :Text;
  shape @1 :List(Int64);
  data @2 :Data;
}

# One rank's share of one step: row i of inputs and targets is sample sampleIds[i].
struct Batch {
  inputs @0 :Tensor;
  targets @1 :Tensor;
  sampleIds @2 :List(UInt64);
}

interface Dataloader {
  # The rows of `step` that data-parallel rank `rank` of `world` computes (leased until complete).
  take @0 (step :Int64, rank :UInt32, world :UInt32) -> (batch :Batch);
  # The rank finished the step; returns the steps committed (every rank finished) so far.
  complete @1 (step :Int64, rank :UInt32) -> (committed :Int64);
  # Every rank finished the steps before `step` (the driver gathered their replies).
  commit @2 (step :Int64) -> (committed :Int64);
  # Back to a restored step: steps [0, step) are applied, later leases are dropped.
  rewind @3 (step :Int64) -> (committed :Int64);
  info @4 () -> (samples :UInt64, committed :Int64, dataEpoch :UInt64, inFlight :UInt64, dataset :Text);
  # The samples a step consumes (for accounting tests).
  stepSamples @5 (step :Int64) -> (ids :List(UInt64));
}
