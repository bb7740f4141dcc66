#include "checkpoint_replica.h"

#include <kj/debug.h>
#include <kj/vector.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include <fmt/format.h>

#include "troupe/runtime/logging.h"

namespace troupe::actors::checkpoint_actor {
namespace {

constexpr uint64_t kChunkBytes = uint64_t(4) << 20;  // per replica call (messages stay small)
constexpr size_t kWindow = 4;                          // chunk calls in flight
// Replicas of images up to this size are sent from a private copy (see send).
constexpr uint64_t kCopyForReplicaBytes = uint64_t(256) << 20;
constexpr auto kChunkTimeout = std::chrono::seconds(60);
constexpr auto kPinCallTimeout = std::chrono::seconds(5);
constexpr auto kPinTimeout = std::chrono::milliseconds(20'000);  // a restarting peer takes seconds

const std::atomic<bool> kStopped{true};

}  // namespace

ReplicaSender::ReplicaSender(const Options& options, SegmentCache& cache, CheckpointPeers& peers,
                             TargetGone targetGone)
    : options_(options),
      cache_(cache),
      peers_(peers),
      targetGone_(std::move(targetGone)),
      tasks_(std::make_unique<kj::TaskSet>(errorLog_)) {}

// A target that died for good is looked up again by the next send, which then learns whether
// its name is gone.
void ReplicaSender::forgetIfDead(const kj::Exception& e) {
  if (statusOf(e).code() == StatusCode::kActorDied) peers_.forget(options_.replicaTo);
}

kj::Promise<rpc::Checkpoint::Client> ReplicaSender::findTarget(const std::string& name,
                                                               std::chrono::milliseconds limit, const char* what) {
  return peers_.withTimeout(peers_.checkpoint(name), limit, what)
      .catch_([this, name](kj::Exception&& e) -> kj::Promise<rpc::Checkpoint::Client> {
        if (statusOf(e).code() == StatusCode::kNotFound) targetGone_(name);
        return kj::mv(e);
      });
}

ReplicaSender::~ReplicaSender() { tasks_.reset(); }

void ReplicaSender::targetChanged() {
  for (auto& [rank, state] : ranks_) {
    state.replicatedId = {};
    state.replicated.reset();
    state.replicating = false;
    state.replicateAgain = false;
    ++state.generation;
  }
}

std::map<uint32_t, uint64_t> ReplicaSender::replicated() const {
  std::map<uint32_t, uint64_t> out;
  for (const auto& [rank, s] : ranks_) {
    if (s.replicated) out[rank] = *s.replicated;
  }
  return out;
}

void ReplicaSender::request(uint32_t rank) {
  if (options_.replicaTo.empty() || !peers_.connected()) return;
  RankState& state = ranks_[rank];
  if (state.replicating) {
    state.replicateAgain = true;
    return;
  }
  state.replicating = true;
  uint64_t generation = state.generation;
  tasks_->add(send(rank, generation)
                  .catch_([this, rank, generation](kj::Exception&& e) {
                    forgetIfDead(e);
                    if (ranks_[rank].generation != generation) return;
                    ranks_[rank].failures++;
                    errors_.add(fmt::format("replica of rank {} to {}: {}", rank, options_.replicaTo,
                                            statusOf(e).message()));
                  })
                  .then([this, rank, generation]() {
                    RankState& s = ranks_[rank];
                    if (s.generation != generation) return;  // the target changed meanwhile
                    s.replicating = false;
                    if (s.replicateAgain) {
                      s.replicateAgain = false;
                      request(rank);
                    }
                  }));
}

kj::Promise<void> ReplicaSender::send(uint32_t rank, uint64_t generation) {
  auto segment = cache_.get(options_.primary(rank));
  if (!segment.isOk()) return KJ_EXCEPTION(FAILED, segment.status().message());
  auto slot = (*segment)->newestComplete();
  if (!slot || ranks_[rank].replicatedId == SnapshotId{(*segment)->fileId(), slot->index, slot->seq}) {
    return kj::READY_NOW;
  }
  auto seg = *segment;
  ck::SlotInfo info = *slot;
  // A snapshot every step outruns a transfer, which would then always find its slot overwritten
  // and never complete: an image of modest size is copied out first (a memcpy, checked against
  // the slot's sequence afterwards) and sent from the copy.
  std::shared_ptr<const std::string> copy;
  if (info.imageBytes <= kCopyForReplicaBytes) {
    auto bytes = std::make_shared<std::string>(reinterpret_cast<const char*>(seg->slotData(info.index)),
                                               info.imageBytes);
    if (!seg->unchanged(info)) return KJ_EXCEPTION(FAILED, "the snapshot was overwritten while being copied");
    copy = std::move(bytes);
  }
  return findTarget(options_.replicaTo, kChunkTimeout, "finding the replica target")
      .then([this, rank, seg, info, copy, generation](rpc::Checkpoint::Client target) mutable {
        auto begin = target.replicaBeginRequest();
        begin.setRank(rank);
        begin.setStep(info.step);
        begin.setImageBytes(info.imageBytes);
        begin.setFrom(options_.self);
        return peers_.withTimeout(begin.send(), kChunkTimeout, "replicaBegin")
            .then([this, target, rank, seg, info, copy,
                   generation](capnp::Response<rpc::Checkpoint::ReplicaBeginResults> reply) mutable {
              uint32_t slot = reply.getSlot();
              return sendChunks(target, seg, info, rank, slot, 0, copy)
                  .then([this, target, slot, rank, seg, info, copy, generation]() mutable {
                    if (!copy && !seg->unchanged(info)) {
                      return kj::Promise<void>(KJ_EXCEPTION(FAILED, "the snapshot was overwritten while being sent; "
                                                                    "the newer one follows"));
                    }
                    auto commit = target.replicaCommitRequest();
                    commit.setRank(rank);
                    commit.setSlot(slot);
                    commit.setStep(info.step);
                    return peers_.withTimeout(commit.send(), kChunkTimeout, "replicaCommit")
                        .then([this, rank, info, seg,
                               generation](capnp::Response<rpc::Checkpoint::ReplicaCommitResults>) {
                          RankState& s = ranks_[rank];
                          if (s.generation != generation) return;  // committed at a target no longer ours
                          s.replicatedId = SnapshotId{seg->fileId(), info.index, info.seq};
                          s.replicated = info.step;
                          s.failures = 0;
                        });
                  });
            });
      });
}

// Sends chunks [offset, offset + kWindow chunks) of the image at once, then the next window.
// From `copy` when there is one (then nothing can overwrite it), else from the slot itself.
kj::Promise<void> ReplicaSender::sendChunks(rpc::Checkpoint::Client target, std::shared_ptr<ck::FlashSegment> seg,
                                            ck::SlotInfo info, uint32_t rank, uint32_t peerSlot, uint64_t offset,
                                            std::shared_ptr<const std::string> copy) {
  if (offset >= info.imageBytes) return kj::READY_NOW;
  if (!copy && !seg->unchanged(info)) return KJ_EXCEPTION(FAILED, "the snapshot was overwritten while being sent");
  const uint8_t* image = copy ? reinterpret_cast<const uint8_t*>(copy->data()) : seg->slotData(info.index);
  kj::Vector<kj::Promise<void>> calls(kWindow);
  uint64_t at = offset;
  for (size_t i = 0; i < kWindow && at < info.imageBytes; ++i) {
    uint64_t n = std::min(kChunkBytes, info.imageBytes - at);
    if (options_.fault.armed(ck::FaultStage::kReplica, info.step) && at + n > options_.fault.afterBytes &&
        (options_.fault.tries == 0 || faultTries_[info.step]++ < options_.fault.tries)) {
      options_.fault.pauseHere(info.step, at, &kStopped);  // returns at once: a send just stops here
      return KJ_EXCEPTION(FAILED, "replica stopped by the fault-injection seam");
    }
    auto write = target.replicaWriteRequest(capnp::MessageSize{n / sizeof(capnp::word) + 16, 0});
    write.setRank(rank);
    write.setSlot(peerSlot);
    write.setStep(info.step);
    write.setOffset(at);
    std::memcpy(write.initData(n).begin(), image + at, n);
    calls.add(peers_.withTimeout(write.send(), kChunkTimeout, "replicaWrite").ignoreResult());
    at += n;
  }
  return kj::joinPromises(calls.releaseAsArray()).then([this, target, seg, info, rank, peerSlot, at, copy]() mutable {
    return sendChunks(target, seg, info, rank, peerSlot, at, copy);
  });
}

Result<PinReply> ReplicaSender::pin(uint32_t rank, uint64_t step) {
  auto it = pins_.find(rank);
  if (it != pins_.end() && it->second->step == step) {
    auto job = it->second;
    if (!job->done) return PinReply{};
    pins_.erase(it);
    return job->result;
  }
  auto job = std::make_shared<PinJob>();
  job->step = step;
  pins_[rank] = job;
  tasks_->add(pinReplica(rank, step, std::chrono::steady_clock::now() + kPinTimeout, kj::READY_NOW)
                  .then(
                      [job](Result<PinReply> r) {
                        job->result = std::move(r);
                        job->done = true;
                      },
                      [job](kj::Exception&& e) {
                        job->result = Status(StatusCode::kUnavailable, fmt::format("pin: {}", statusOf(e).message()));
                        job->done = true;
                      }));
  return PinReply{};
}

// The pin job: waits for the replica (asking for it again while sends fail), then pins it.
// Waits for a peer that is restarting, up to kPinTimeout.
kj::Promise<Result<PinReply>> ReplicaSender::pinReplica(uint32_t rank, uint64_t step,
                                                        std::chrono::steady_clock::time_point deadline,
                                                        kj::Promise<void> pause) {
  return pause.then([this, rank, step, deadline]() -> kj::Promise<Result<PinReply>> {
    auto segment = cache_.get(options_.primary(rank));
    if (!segment.isOk()) return Result<PinReply>(segment.status());
    auto slot = (*segment)->newestComplete(step);
    if (!slot) return Result<PinReply>(PinReply{true, std::nullopt, ""});
    if (options_.replicaTo.empty() || !peers_.connected()) {
      return Result<PinReply>(PinReply{true, slot->step, ""});
    }
    RankState& state = ranks_[rank];
    if (state.replicatedId == SnapshotId{(*segment)->fileId(), slot->index, slot->seq}) {
      std::string target = options_.replicaTo;
      return findTarget(target, kPinCallTimeout, "finding the replica target")
          .then([this, rank, step = slot->step](rpc::Checkpoint::Client c) {
            auto request = c.replicaPinRequest();
            request.setRank(rank);
            request.setStep(step);
            return peers_.withTimeout(request.send().ignoreResult(), kPinCallTimeout, "replicaPin");
          })
          .then([step = slot->step, target]() -> kj::Promise<Result<PinReply>> {
            return Result<PinReply>(PinReply{true, step, target});
          }, [this, rank, step, deadline](kj::Exception&& e) -> kj::Promise<Result<PinReply>> {
            // The replica is gone or lacks the step (its actor restarted, its node was lost):
            // send it again.
            forgetIfDead(e);
            errors_.add(fmt::format("pinning the replica of rank {}: {}", rank, statusOf(e).message()));
            RankState& s = ranks_[rank];
            s.replicatedId = {};
            s.failures++;
            if (std::chrono::steady_clock::now() > deadline) {
              return Result<PinReply>(Status(StatusCode::kUnavailable, fmt::format("pin: {}", statusOf(e).message())));
            }
            return pinReplica(rank, step, deadline, peers_.after(std::chrono::milliseconds(50)));
          });
    }
    if (std::chrono::steady_clock::now() > deadline) {
      std::string last = errors_.list().empty() ? "none recorded" : errors_.list().back();
      return Result<PinReply>(Status(
          StatusCode::kUnavailable,
          fmt::format("rank {} step {}: its replica to {} was not confirmed within {} s (last replica error: {})", rank,
                      slot->step, options_.replicaTo, kPinTimeout.count() / 1000, last)));
    }
    if (!state.replicating) request(rank);  // else the newest follows the send on its way
    // Polled every 2 ms while sends succeed; backs off while the peer is unreachable.
    auto pause = std::chrono::milliseconds(std::min(2 + 50 * state.failures, 500));
    return pinReplica(rank, step, deadline, peers_.after(pause));
  });
}

Result<uint64_t> HeldReplicas::pin(uint32_t rank, uint64_t step) {
  Incoming& in = replicas_[rank];
  if (!in.segment) {
    // This actor restarted after the replica was written (a kill -9 leaves the segment).
    auto existing = ck::FlashSegment::openExisting(options_.segment(options_.replica(rank)), /*writable=*/true);
    if (!existing.isOk()) {
      return Status(StatusCode::kFailedPrecondition,
                    fmt::format("replicaPin: no replica of rank {} is held: {}", rank, existing.status().message()));
    }
    TROUPE_RETURN_IF_ERROR(existing->pin(step));
  } else {
    TROUPE_RETURN_IF_ERROR(in.segment->pin(step));
  }
  in.pinned = step;
  return step;
}

Result<uint32_t> HeldReplicas::begin(uint32_t rank, uint64_t step, uint64_t bytes) {
  Incoming& in = replicas_[rank];
  if (!in.segment || in.segment->slotCapacity() < bytes) {
    in.segment.reset();
    // TODO(perf): the first replica of a rank allocates its segment on the RPC thread.
    TROUPE_ASSIGN_OR_RETURN(auto segment, ck::FlashSegment::openForWrite(options_.segment(options_.replica(rank)), bytes));
    in.segment.emplace(std::move(segment));
  }
  TROUPE_ASSIGN_OR_RETURN(auto slot, in.segment->beginImage(bytes));
  in.slot = slot.index;
  in.step = step;
  in.imageBytes = bytes;
  return static_cast<uint32_t>(slot.index);
}

Status HeldReplicas::write(uint32_t rank, uint32_t slot, uint64_t step, uint64_t offset, capnp::Data::Reader data) {
  uint64_t n = data.size();
  auto it = replicas_.find(rank);
  if (it == replicas_.end() || !it->second.segment || it->second.slot != static_cast<int>(slot) ||
      it->second.step != step) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("replicaWrite: no replica of rank {} step {} in progress (slot {})", rank, step, slot));
  }
  Incoming& in = it->second;
  if (offset > in.imageBytes || n > in.imageBytes - offset) {
    return badArgs(fmt::format("replicaWrite: bytes [{}, {}) outside the {}-byte image", offset, offset + n,
                               in.imageBytes));
  }
  std::memcpy(in.segment->mutableSlotData(in.slot) + offset, data.begin(), n);
  return Status::ok();
}

Result<uint64_t> HeldReplicas::commit(uint32_t rank, uint32_t sentSlot, uint64_t step) {
  auto it = replicas_.find(rank);
  if (it == replicas_.end() || it->second.slot < 0 || it->second.slot != static_cast<int>(sentSlot) ||
      it->second.step != step) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("replicaCommit: no replica of rank {} step {} in progress (slot {})", rank, step,
                              sentSlot));
  }
  Incoming& in = it->second;
  // The image came from a peer: before it is held, its header must describe exactly the image
  // that was announced and written (this rank, this step, these bytes), not merely parse.
  int slot = std::exchange(in.slot, -1);
  auto header = ck::parseImageHeader(in.segment->slotData(slot), in.imageBytes);
  if (!header.isOk()) {
    return Status(header.status().code(),
                  fmt::format("replicaCommit: rank {} step {}: {}", rank, step, header.status().message()));
  }
  if (header->stamp.rank != rank || header->stamp.step != step || header->layout.imageBytes() != in.imageBytes) {
    return badArgs(fmt::format("replicaCommit: the image sent holds rank {} step {} ({} bytes), not the rank {} "
                               "step {} ({} bytes) announced by replicaBegin; the sender must resend it",
                               header->stamp.rank, header->stamp.step, header->layout.imageBytes(), rank, step,
                               in.imageBytes));
  }
  // TODO(perf): verifying a large replica's checksums holds the RPC thread (about 0.1 s/GiB).
  TROUPE_ASSIGN_OR_RETURN(auto committed, in.segment->commitImage(slot, /*verifyData=*/true));
  if (committed.step != step) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("replicaCommit: image holds step {}, not {}", committed.step, step));
  }
  in.held = step;
  return step;
}

std::map<uint32_t, uint64_t> HeldReplicas::held() const {
  std::map<uint32_t, uint64_t> out;
  for (const auto& [rank, in] : replicas_) {
    if (in.held) out[rank] = *in.held;
  }
  return out;
}

std::map<uint32_t, uint64_t> HeldReplicas::pinned() const {
  std::map<uint32_t, uint64_t> out;
  for (const auto& [rank, in] : replicas_) {
    if (in.pinned) out[rank] = *in.pinned;
  }
  return out;
}

}  // namespace troupe::actors::checkpoint_actor
