// Internal to actors/: the Checkpoint actor's replica unit, both sides of it.
// ReplicaSender sends each rank's newest snapshot to the replica target (options.replicaTo) in
// chunked replicaBegin/replicaWrite/replicaCommit calls, one transfer per rank at a time, and
// runs pin jobs (the newest snapshot at or before a step, replicated and pinned in the replica).
// HeldReplicas keeps the replicas peers send here: one segment per rank, an image held once its
// header and checksums are verified at commit.
// Thread-safety: both belong to the actor's RPC thread (transfers are calls on its KJ loop).
#pragma once

#include <kj/async.h>

#include <capnp/blob.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "checkpoint_options.h"
#include "checkpoint_peers.h"

namespace troupe::actors::checkpoint_actor {

// What pin answers (rpc::Checkpoint.pin).
struct PinReply {
  bool done = false;
  std::optional<uint64_t> step;
  std::string replicaTo;
};

class ReplicaSender {
 public:
  // Everything passed outlives this; `options.replicaTo` is read afresh by every send.
  // `targetGone(name)` runs when the target's name no longer names a live actor (it was killed
  // with its lost node): the owner picks another target instead of the sends waiting for it.
  using TargetGone = std::function<void(const std::string& name)>;
  ReplicaSender(const Options& options, SegmentCache& cache, CheckpointPeers& peers, TargetGone targetGone);
  ~ReplicaSender();
  ReplicaSender(const ReplicaSender&) = delete;
  ReplicaSender& operator=(const ReplicaSender&) = delete;

  // Sends rank's newest snapshot unless the target holds it already; while a send of the rank
  // is on its way, the newest follows it.
  void request(uint32_t rank);

  // The trainer of `rank` ends a chunk at `step`: its newest snapshot at or before it is
  // replicated (if it is not already) and pinned in the replica, so that the step survives
  // later snapshots on both sides until the next pin. Like restore, it answers at once (calls
  // to an actor take turns, and two actors pinning to each other must not wait on each other's
  // turn): running until the job ends, then done with the step and the peer ("" without one),
  // or the error, once.
  Result<PinReply> pin(uint32_t rank, uint64_t step);

  // The replica target changed: what the old one holds says nothing of the new one, and a send
  // to it (a lost node's actor, which may never answer) must not hold back the sends to the new.
  void targetChanged();

  // The newest step the target confirmed, by rank.
  std::map<uint32_t, uint64_t> replicated() const;
  const RecentErrors& errors() const { return errors_; }

 private:
  struct RankState {
    bool replicating = false;
    bool replicateAgain = false;
    SnapshotId replicatedId;
    std::optional<uint64_t> replicated;
    int failures = 0;  // sends failed in a row
    uint64_t generation = 0;  // moves on when the target changes: older sends count for nothing
  };
  struct PinJob {
    uint64_t step = 0;
    bool done = false;
    Result<PinReply> result = Status(StatusCode::kInternal, "pin not finished");
  };

  kj::Promise<void> send(uint32_t rank, uint64_t generation);
  // The target's interface; a name that is gone is reported to targetGone before the rejection.
  kj::Promise<rpc::Checkpoint::Client> findTarget(const std::string& name, std::chrono::milliseconds limit,
                                                  const char* what);
  void forgetIfDead(const kj::Exception& e);
  kj::Promise<void> sendChunks(rpc::Checkpoint::Client target, std::shared_ptr<ck::FlashSegment> seg, ck::SlotInfo info,
                               uint32_t rank, uint32_t peerSlot, uint64_t offset, std::shared_ptr<const std::string> copy);
  kj::Promise<Result<PinReply>> pinReplica(uint32_t rank, uint64_t step, std::chrono::steady_clock::time_point deadline,
                                           kj::Promise<void> pause);

  const Options& options_;
  SegmentCache& cache_;
  CheckpointPeers& peers_;
  TargetGone targetGone_;
  std::map<uint32_t, RankState> ranks_;
  std::map<uint32_t, std::shared_ptr<PinJob>> pins_;  // by rank
  std::map<uint64_t, uint64_t> faultTries_;  // sends stopped by the fault seam, by step
  RecentErrors errors_;
  TaskErrorLog errorLog_;
  // Held by pointer: kj::TaskSet's destructor may throw.
  std::unique_ptr<kj::TaskSet> tasks_;
};

class HeldReplicas {
 public:
  explicit HeldReplicas(const Options& options) : options_(options) {}

  // rpc::Checkpoint's replicaBegin/Write/Commit/Pin: errors name the rank, step and slot.
  Result<uint32_t> begin(uint32_t rank, uint64_t step, uint64_t bytes);
  Status write(uint32_t rank, uint32_t slot, uint64_t step, uint64_t offset, capnp::Data::Reader data);
  Result<uint64_t> commit(uint32_t rank, uint32_t slot, uint64_t step);
  Result<uint64_t> pin(uint32_t rank, uint64_t step);

  // The segments were removed: the mappings go.
  void clear() { replicas_.clear(); }

  // By rank: the newest replica held, the step pinned.
  std::map<uint32_t, uint64_t> held() const;
  std::map<uint32_t, uint64_t> pinned() const;

 private:
  struct Incoming {
    std::optional<ck::FlashSegment> segment;
    int slot = -1;
    uint64_t step = 0;
    uint64_t imageBytes = 0;
    std::optional<uint64_t> held;
    std::optional<uint64_t> pinned;
  };
  const Options& options_;
  std::map<uint32_t, Incoming> replicas_;
};

}  // namespace troupe::actors::checkpoint_actor
