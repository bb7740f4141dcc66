// ShardQueue: which samples each step of an elastic group consumes, which rank holds which of
// them, and which steps are done. It is the dataloader's record of the group's progress through
// the data; its bytes (serialize) go into every checkpoint, so a restore also restores it.
//
// Order. For data epoch e, the samples [0, N) are visited in a permutation fixed by (seed, e)
// alone: a keyed Feistel network with cycle walking, so sample_at(position) is computed in O(1)
// without storing the permutation. Positions concatenate the epochs: position p is sample
// perm_{p / N}(p % N) of epoch p / N. Step s consumes positions [s * G, (s + 1) * G), G the
// global batch size (a step may span two epochs).
// Ranks. In world W, rank r computes rows rankSlice(G, W, r) of its step (batch.h).
// Life of a step. take(step, rank, world) hands rank r its rows (a lease, "in flight");
// complete(step, rank) says rank r finished the step (optimizer step included); once every rank
// of the step completed, the step is committed, in step order. commit(step) commits through
// `step` directly (the group knows all ranks finished).
// Faults and resizes. requeue(rank) releases the leases a dead rank held but did not complete;
// whoever asks for that (step, rank) next gets the same rows. A step keeps the world of its first
// take while any rank holds or completed a lease (a take for another world is refused: it catches
// a member of an old group epoch); once all its leases are released it may be split for another
// world. rewind(step) returns to a restored checkpoint's step: later steps are uncommitted and
// every lease is released. In synchronous data-parallel training a failed step is redone by all
// ranks, so the group rewinds to the step it restored; requeue alone suits steps only prefetched.
// Exactly once: the committed steps are exactly [0, committedSteps()) and each consumed its fixed
// positions, so every sample of an epoch is committed exactly once however often it was handed out,
// as long as the model state and this queue's state are restored together.
//
// Thread-safety: not thread-safe; one owner (the dataloader's thread) calls it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "troupe/runtime/status.h"

namespace troupe::actors {

struct ShardQueueOptions {
  uint64_t num_samples = 0;    // N: samples per data epoch (> 0)
  int64_t global_batch = 0;    // G: samples per step (> 0)
  uint64_t seed = 0;           // fixes every epoch's permutation
  int64_t max_steps_ahead = 64;  // takes beyond committed + this are refused (a runaway prefetch)
};

// The rows of one step that one rank computes.
struct ShardLease {
  int64_t step = 0;
  int rank = 0;
  int world = 1;
  uint64_t first_position = 0;      // sample_ids[i] is at position first_position + i
  std::vector<uint64_t> sample_ids;
};

class ShardQueue {
 public:
  // kInvalidArgument for num_samples == 0, global_batch < 1 or max_steps_ahead < 1.
  static Result<ShardQueue> create(const ShardQueueOptions& options);

  const ShardQueueOptions& options() const { return options_; }

  // ---- The fixed order (pure functions of the options) ----
  // The sample at a position, and the data epoch of a position (position / N).
  uint64_t sampleAt(uint64_t position) const;
  uint64_t epochOf(uint64_t position) const { return position / options_.num_samples; }
  // The G sample ids step `step` consumes, in order.
  std::vector<uint64_t> stepSamples(int64_t step) const;

  // ---- Leases ----
  // Hands rank `rank` of `world` its rows of `step` (again, if it already holds them: a retried
  // call gets the same lease). kInvalidArgument (rank or world out of range, step < 0),
  // kFailedPrecondition (step already committed; beyond committed + max_steps_ahead; the step is
  // split for another world while leases of it are live; the rank already completed it).
  Result<ShardLease> take(int64_t step, int rank, int world);
  // Rank `rank` finished `step` (it must hold the lease). Commits the step once every rank of it
  // completed (and every earlier step is committed), then any later steps that became complete.
  // Returns committedSteps(). A repeat after the step was committed is a no-op.
  // kFailedPrecondition when the rank holds no lease of the step.
  Result<int64_t> complete(int64_t step, int rank);
  // Commits every step up to and including `step` (the group knows they finished on all ranks);
  // their leases are dropped. A step already committed is a no-op. kInvalidArgument for step < 0.
  Status commit(int64_t step);
  // Releases every lease `rank` holds and has not completed; returns how many samples went back.
  int64_t requeue(int rank);
  // Back to `step` (a restored checkpoint's step count: steps [0, step) applied): steps from
  // `step` on are uncommitted and every lease is released. kFailedPrecondition when step is
  // beyond committedSteps() (the queue cannot vouch for steps it never saw committed).
  Status rewind(int64_t step);

  // ---- What is done and what is in flight ----
  // Steps [0, committedSteps()) are committed.
  int64_t committedSteps() const { return committed_; }
  // Samples consumed by committed steps (committedSteps() * G) and the data epoch the next
  // step starts in.
  uint64_t committedSamples() const { return static_cast<uint64_t>(committed_) * options_.global_batch; }
  uint64_t dataEpoch() const { return epochOf(committedSamples()); }
  // Leases handed out and neither completed nor released, in (step, rank) order.
  std::vector<ShardLease> inFlight() const;

  // ---- Checkpoint ----
  // The whole state (options, committed steps, every step's split and lease states) as bytes
  // with a magic, a version and a checksum.
  std::string serialize() const;
  // The queue serialize() described. kInvalidArgument for bytes that are not one (bad magic,
  // version, checksum or length), saying which.
  static Result<ShardQueue> deserialize(const std::string& bytes);

 private:
  enum class LeaseState : uint8_t { kFree = 0, kHeld = 1, kCompleted = 2 };
  struct StepSplit {
    int world = 1;
    std::vector<LeaseState> ranks;  // one per rank of `world`
  };

  explicit ShardQueue(const ShardQueueOptions& options);
  ShardLease leaseOf(int64_t step, int rank, int world) const;
  void commitReady();

  ShardQueueOptions options_;
  int64_t committed_ = 0;
  std::map<int64_t, StepSplit> splits_;  // steps >= committed_ with any take since
};

}  // namespace troupe::actors
