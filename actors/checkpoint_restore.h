// Internal to actors/: the Checkpoint actor's restore unit. Restorer runs restore jobs: it
// gathers holdings (this node's segments, every other member's inventory, the disk), plans with
// checkpoint/restore_plan.h, and stages the chosen step into the rank's segment here, trying the
// next source when one fails. It also answers what this node holds (heldSnapshots, readHeld),
// which peers' restores ask for.
// The restore thread is kept (not the KJ loop): verifying a snapshot, copying a local replica
// and reading a rank file block for as long as the bytes take.
// Thread-safety: a Restorer belongs to the actor's RPC thread; the staging it posts to the
// restore thread takes copies of what it reads.
#pragma once

#include <kj/async.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "troupe/checkpoint/restore_plan.h"
#include "troupe/runtime/io_thread.h"
#include "checkpoint.capnp.h"
#include "checkpoint_options.h"
#include "checkpoint_peers.h"

namespace troupe::actors::checkpoint_actor {

// A complete snapshot held in this node's segments (inventory).
struct HeldSnapshot {
  uint32_t rank = 0;
  uint64_t step = 0;
  uint32_t worldSize = 0;
  bool replica = false;
  uint64_t imageBytes = 0;
};

// Complete snapshots in this node's segments of the group.
std::vector<HeldSnapshot> heldSnapshots(const Options& options, SegmentCache& cache);

// Bytes [offset, offset + length) of a held snapshot's image (rpc::Checkpoint.read): kNotFound
// when no longer held, kAborted when it changed while being read, kInvalidArgument for a range
// outside the image or longer than 8 MiB.
Result<std::string> readHeld(const Options& options, SegmentCache& cache, bool replica, uint32_t rank, uint64_t step,
                             uint64_t offset, uint64_t length);

// What restore answers (rpc::Checkpoint.restore).
struct RestoreReply {
  rpc::JobState state = rpc::JobState::RUNNING;
  uint64_t step = 0;
  std::string source;
  std::string segment;
  std::vector<std::string> skipped;
};

class Restorer {
 public:
  // Everything passed outlives this.
  Restorer(const Options& options, SegmentCache& cache, CheckpointPeers& peers);
  ~Restorer();
  Restorer(const Restorer&) = delete;
  Restorer& operator=(const Restorer&) = delete;

  // Starts a restore of `rank` (at most maxStep) and answers `running`; asked again, `running`
  // until it ends, then once its outcome (or its error).
  Result<RestoreReply> restore(uint32_t rank, uint64_t maxStep);

  // Cancels the restores in progress. The staging the restore thread may be doing still runs:
  // drained() resolves once it has finished, so none re-creates a segment after that.
  void cancel();
  kj::Promise<void> drained();

 private:
  struct Job;
  kj::Promise<void> run(std::shared_ptr<Job> job);
  kj::Promise<void> tryNext(std::shared_ptr<Job> job);
  kj::Promise<Status> trySource(uint32_t rank, uint64_t step, const ck::Holding& source);
  kj::Promise<Status> fetchFromPeer(uint32_t rank, uint64_t step, const ck::Holding& source);
  kj::Promise<void> fetchChunks(rpc::Checkpoint::Client holder, std::shared_ptr<ck::FlashSegment> segment, int slot,
                                uint32_t rank, uint64_t step, rpc::SnapshotKind kind, uint64_t bytes, uint64_t offset);

  const Options& options_;
  SegmentCache& cache_;
  CheckpointPeers& peers_;
  // Declared before the tasks so it outlives them: a task's promise may wait on its work.
  IoThread thread_;
  std::map<uint32_t, std::shared_ptr<Job>> jobs_;  // by rank
  TaskErrorLog errorLog_;
  // Held by pointer: kj::TaskSet's destructor may throw; replaced (cancelled) by cancel().
  std::unique_ptr<kj::TaskSet> tasks_;
};

}  // namespace troupe::actors::checkpoint_actor
