#include "checkpoint_restore.h"

#include <kj/debug.h>
#include <kj/vector.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <utility>

#include <fmt/format.h>

#include "troupe/checkpoint/checkpoint_dir.h"
#include "troupe/checkpoint/flash_segment.h"
#include "troupe/runtime/logging.h"
#include "troupe/runtime/rpc.h"

namespace troupe::actors::checkpoint_actor {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kChunkBytes = uint64_t(4) << 20;  // per fetch call (messages stay small)
constexpr uint64_t kMaxReadBytes = uint64_t(8) << 20;
constexpr size_t kWindow = 4;                          // chunk calls in flight
constexpr auto kInventoryTimeout = std::chrono::seconds(5);
constexpr auto kChunkTimeout = std::chrono::seconds(60);

// Step `step`'s complete slot in `segment`, its checksums verified; a slot that fails them is
// marked CORRUPT, so no later restore picks it.
Result<ck::SlotInfo> verifiedSlot(ck::FlashSegment& segment, uint64_t step) {
  auto slot = segment.completeAt(step);
  if (!slot) return Status(StatusCode::kNotFound, fmt::format("step {} is no longer in {}", step, segment.path()));
  auto verified = segment.verify(*slot);
  if (!verified.isOk()) {
    (void)segment.markSlot(*slot, ck::SlotState::kCorrupt);
    return verified.status();
  }
  return *slot;
}

// The blocking parts of a restore, run on the restore thread. Each stages step `step` of rank
// `rank` into the rank's segment on this node, or says why it could not.
Status stageFromLocalMemory(const Options& o, uint32_t rank, uint64_t step) {
  TROUPE_ASSIGN_OR_RETURN(auto segment, ck::FlashSegment::openExisting(o.segment(o.primary(rank)), /*writable=*/true));
  return verifiedSlot(segment, step).status();
}

Status stageFromLocalReplica(const Options& o, uint32_t rank, uint64_t step) {
  auto replica = ck::FlashSegment::openExisting(o.segment(o.replica(rank)), /*writable=*/true);
  if (!replica.isOk()) return replica.status();
  TROUPE_ASSIGN_OR_RETURN(auto slot, verifiedSlot(*replica, step));
  TROUPE_ASSIGN_OR_RETURN(auto primary, ck::FlashSegment::openForWrite(o.segment(o.primary(rank)), slot.imageBytes));
  TROUPE_ASSIGN_OR_RETURN(auto target, primary.beginImage(slot.imageBytes));
  std::memcpy(primary.mutableSlotData(target.index), replica->slotData(slot.index), slot.imageBytes);
  if (!replica->unchanged(slot)) {
    return Status(StatusCode::kAborted, fmt::format("the replica of step {} changed while being copied", step));
  }
  return primary.commitImage(target.index, /*verifyData=*/false).status();
}

Status stageFromDisk(const Options& o, uint32_t rank, uint64_t step) {
  ck::CheckpointDirectory dir(o.directory(nullptr));
  TROUPE_ASSIGN_OR_RETURN(auto manifest, dir.readManifest(step));
  if (rank >= manifest.worldSize) {
    return Status(StatusCode::kNotFound, fmt::format("step {} on disk has no rank {}", step, rank));
  }
  auto file = ck::RankFile::open(dir.rankPath(step, rank), &manifest.ranks[rank]);
  Status status = file.status();
  if (file.isOk()) {
    uint64_t bytes = file->header().layout.imageBytes();
    TROUPE_ASSIGN_OR_RETURN(auto primary, ck::FlashSegment::openForWrite(o.segment(o.primary(rank)), bytes));
    TROUPE_ASSIGN_OR_RETURN(auto target, primary.beginImage(bytes));
    status = file->readImage(primary.mutableSlotData(target.index));
    if (status.isOk()) return primary.commitImage(target.index, /*verifyData=*/false).status();
  }
  // A rank file that fails its checks makes the whole step unusable, for every rank.
  if (status.code() == StatusCode::kFailedPrecondition) (void)dir.quarantine(step);
  return status;
}

// After step `step` is staged: snapshots of later steps in this rank's segment and partial later
// steps on disk belong to a timeline the group abandoned.
Status finishStaging(const Options& o, uint32_t rank, uint64_t step) {
  TROUPE_ASSIGN_OR_RETURN(auto segment, ck::FlashSegment::openExisting(o.segment(o.primary(rank)), /*writable=*/true));
  for (const auto& slot : segment.slots()) {
    if (slot.complete() && slot.step > step) (void)segment.markSlot(slot, ck::SlotState::kEmpty);
  }
  if (!o.dir.empty()) return ck::CheckpointDirectory(o.directory(nullptr)).dropIncompleteAfter(step);
  return Status::ok();
}

// The disk tier's holdings: every rank of every step with a manifest.
std::vector<ck::Holding> diskHoldings(const Options& o, std::vector<std::string>& skipped) {
  std::vector<ck::Holding> out;
  if (o.dir.empty()) return out;
  ck::CheckpointDirectory dir(o.directory(nullptr));
  auto steps = dir.completeSteps();
  if (!steps.isOk()) {
    if (steps.status().code() != StatusCode::kNotFound) skipped.push_back("disk: " + steps.status().message());
    return out;
  }
  for (uint64_t step : *steps) {
    auto manifest = dir.readManifest(step);
    if (!manifest.isOk()) {
      skipped.push_back(fmt::format("step {} on disk: {}", step, manifest.status().message()));
      continue;
    }
    for (const auto& r : manifest->ranks) {
      out.push_back(ck::Holding{r.rank, step, manifest->worldSize, ck::SourceTier::kDisk, "", r.bytes});
    }
  }
  return out;
}

}  // namespace

std::vector<HeldSnapshot> heldSnapshots(const Options& options, SegmentCache& cache) {
  std::vector<HeldSnapshot> holdings;
  std::string prefix = ck::segmentPrefix(options.group, options.node);
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(options.shmDir, ec)) {
    std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0 || name.find(".tmp.") != std::string::npos) continue;
    std::string rest = name.substr(prefix.size());
    bool replica = rest.rfind("replica.", 0) == 0;
    auto segment = cache.get(name);
    if (!segment.isOk()) continue;
    for (const auto& slot : (*segment)->slots()) {
      if (!slot.complete()) continue;
      const uint8_t* image = (*segment)->slotData(slot.index);
      auto header = ck::parseImageHeader(image, std::min(slot.imageBytes, (*segment)->slotCapacity()));
      if (!header.isOk() || !(*segment)->unchanged(slot)) continue;
      holdings.push_back(HeldSnapshot{header->stamp.rank, slot.step, header->stamp.worldSize, replica,
                                      slot.imageBytes});
    }
  }
  return holdings;
}

Result<std::string> readHeld(const Options& options, SegmentCache& cache, bool replica, uint32_t rank, uint64_t step,
                             uint64_t offset, uint64_t length) {
  const char* kind = replica ? "replica" : "memory";
  if (length > kMaxReadBytes) {
    return badArgs(fmt::format("read: {} bytes asked, at most {} per call", length, kMaxReadBytes));
  }
  TROUPE_ASSIGN_OR_RETURN(auto segment, cache.get(replica ? options.replica(rank) : options.primary(rank)));
  auto slot = segment->completeAt(step);
  if (!slot) {
    return Status(StatusCode::kNotFound, fmt::format("read: {} of rank {} step {} is no longer held", kind, rank, step));
  }
  if (offset > slot->imageBytes || length > slot->imageBytes - offset) {
    return badArgs(fmt::format("read: bytes [{}, {}) outside the {}-byte image", offset, offset + length,
                               slot->imageBytes));
  }
  std::string out(reinterpret_cast<const char*>(segment->slotData(slot->index) + offset), length);
  if (!segment->unchanged(*slot)) {
    return Status(StatusCode::kAborted, fmt::format("read: rank {} step {} changed while being read", rank, step));
  }
  return out;
}

struct Restorer::Job {
  uint32_t rank = 0;
  uint64_t maxStep = UINT64_MAX;
  std::vector<ck::Holding> holdings;
  std::vector<std::string> skipped;
  std::vector<ck::RestoreCandidate> candidates;
  size_t candidate = 0;
  size_t source = 0;
  enum class State { kRunning, kDone, kNone, kFailed } state = State::kRunning;
  uint64_t step = 0;
  std::string sourceText;
  Status error;
};

Restorer::Restorer(const Options& options, SegmentCache& cache, CheckpointPeers& peers)
    : options_(options), cache_(cache), peers_(peers), tasks_(std::make_unique<kj::TaskSet>(errorLog_)) {}

Restorer::~Restorer() { tasks_.reset(); }

void Restorer::cancel() {
  tasks_ = std::make_unique<kj::TaskSet>(errorLog_);
  jobs_.clear();
}

kj::Promise<void> Restorer::drained() {
  return thread_.call([]() { return 0; }).ignoreResult();
}

Result<RestoreReply> Restorer::restore(uint32_t rank, uint64_t maxStep) {
  auto it = jobs_.find(rank);
  if (it != jobs_.end()) {
    auto job = it->second;
    if (job->state == Job::State::kRunning) return RestoreReply{};
    jobs_.erase(it);
    if (job->state == Job::State::kFailed) return job->error;
    RestoreReply reply;
    reply.state = job->state == Job::State::kDone ? rpc::JobState::DONE : rpc::JobState::NONE;
    reply.skipped = job->skipped;
    if (job->state == Job::State::kDone) {
      reply.step = job->step;
      reply.source = job->sourceText;
      reply.segment = options_.primary(rank);
    }
    return reply;
  }
  auto job = std::make_shared<Job>();
  job->rank = rank;
  job->maxStep = maxStep;
  jobs_[rank] = job;
  tasks_->add(run(job).catch_([job](kj::Exception&& e) {
    job->state = Job::State::kFailed;
    job->error = Status(StatusCode::kInternal,
                        fmt::format("restore of rank {} failed: {}", job->rank, statusOf(e).message()));
  }));
  return RestoreReply{};
}

kj::Promise<void> Restorer::run(std::shared_ptr<Job> job) {
  // Holdings: this node's segments, every other member's, and the disk.
  for (const auto& h : heldSnapshots(options_, cache_)) {
    job->holdings.push_back(ck::Holding{h.rank, h.step, h.worldSize,
                                        h.replica ? ck::SourceTier::kLocalReplica : ck::SourceTier::kLocalMemory,
                                        options_.self, h.imageBytes});
  }
  kj::Vector<kj::Promise<void>> asks;
  for (const auto& member : options_.members) {
    if (member == options_.self || !peers_.connected()) continue;
    asks.add(peers_
                 .withTimeout(peers_.checkpoint(member).then([](rpc::Checkpoint::Client c) {
                   return c.inventoryRequest().send();
                 }),
                              kInventoryTimeout, "inventory")
                 .then(
                     [job, member](capnp::Response<rpc::Checkpoint::InventoryResults> reply) {
                       for (auto h : reply.getHoldings()) {
                         bool replica = h.getKind() == rpc::SnapshotKind::REPLICA;
                         job->holdings.push_back(ck::Holding{h.getRank(), h.getStep(), h.getWorldSize(),
                                                             replica ? ck::SourceTier::kPeerReplica
                                                                     : ck::SourceTier::kPeerMemory,
                                                             member, h.getImageBytes()});
                       }
                     },
                     [job, member](kj::Exception&& e) {
                       job->skipped.push_back(fmt::format("member {}: {}", member, statusOf(e).message()));
                     }));
  }
  asks.add(thread_
               .call([o = options_]() {
                 std::vector<std::string> skipped;
                 auto holdings = diskHoldings(o, skipped);
                 return std::make_pair(std::move(holdings), std::move(skipped));
               })
               .then([job](std::pair<std::vector<ck::Holding>, std::vector<std::string>> disk) {
                 job->holdings.insert(job->holdings.end(), disk.first.begin(), disk.first.end());
                 job->skipped.insert(job->skipped.end(), disk.second.begin(), disk.second.end());
               }));
  return kj::joinPromises(asks.releaseAsArray()).then([this, job]() {
    job->candidates = ck::planRestore(job->holdings, job->rank, job->maxStep);
    TROUPE_LOG(kInfo, "restore of rank {}: {} holdings, {} candidate steps", job->rank, job->holdings.size(),
               job->candidates.size());
    return tryNext(job);
  });
}

kj::Promise<void> Restorer::tryNext(std::shared_ptr<Job> job) {
  while (job->candidate < job->candidates.size() && job->source >= job->candidates[job->candidate].sources.size()) {
    ++job->candidate;
    job->source = 0;
  }
  if (job->candidate >= job->candidates.size()) {
    job->state = Job::State::kNone;
    TROUPE_LOG(kInfo, "restore of rank {}: nothing complete on every rank", job->rank);
    return kj::READY_NOW;
  }
  const auto& c = job->candidates[job->candidate];
  ck::Holding source = c.sources[job->source];
  return trySource(job->rank, c.step, source).then([this, job, source, step = c.step](Status status) {
    std::string where = ck::sourceTierName(source.tier);
    if (source.tier == ck::SourceTier::kPeerMemory || source.tier == ck::SourceTier::kPeerReplica) {
      where += " of " + source.holder;
    }
    if (!status.isOk()) {
      std::string why = fmt::format("step {} from {}: {}", step, where, status.toString());
      TROUPE_LOG(kWarning, "restore of rank {} skipped {}", job->rank, why);
      job->skipped.push_back(std::move(why));
      ++job->source;
      return tryNext(job);
    }
    return thread_.call([o = options_, rank = job->rank, step]() { return finishStaging(o, rank, step); })
        .then([job, step, where](Status finished) {
          if (!finished.isOk()) job->skipped.push_back("cleaning up after the restore: " + finished.toString());
          job->step = step;
          job->sourceText = where;
          job->state = Job::State::kDone;
          TROUPE_LOG(kInfo, "restore of rank {}: step {} from {}", job->rank, step, where);
        });
  });
}

kj::Promise<Status> Restorer::trySource(uint32_t rank, uint64_t step, const ck::Holding& source) {
  switch (source.tier) {
    case ck::SourceTier::kLocalMemory:
      return thread_.call([o = options_, rank, step]() { return stageFromLocalMemory(o, rank, step); });
    case ck::SourceTier::kLocalReplica:
      return thread_.call([o = options_, rank, step]() { return stageFromLocalReplica(o, rank, step); });
    case ck::SourceTier::kDisk:
      return thread_.call([o = options_, rank, step]() { return stageFromDisk(o, rank, step); });
    case ck::SourceTier::kPeerMemory:
    case ck::SourceTier::kPeerReplica:
      return fetchFromPeer(rank, step, source).catch_([](kj::Exception&& e) { return statusOf(e); });
  }
  return Status(StatusCode::kInternal, "unknown tier");
}

// Copies a snapshot another node's actor holds into this node's segment for the rank.
kj::Promise<Status> Restorer::fetchFromPeer(uint32_t rank, uint64_t step, const ck::Holding& source) {
  if (!peers_.connected()) return Status(StatusCode::kUnavailable, "no cluster connection");
  // TODO(perf): a first restore on this node allocates the segment on the RPC thread.
  TROUPE_ASSIGN_OR_RETURN(auto opened, ck::FlashSegment::openForWrite(options_.segment(options_.primary(rank)), source.imageBytes));
  auto segment = std::make_shared<ck::FlashSegment>(std::move(opened));
  auto slot = segment->beginImage(source.imageBytes);
  if (!slot.isOk()) return slot.status();
  auto kind = source.tier == ck::SourceTier::kPeerReplica ? rpc::SnapshotKind::REPLICA : rpc::SnapshotKind::MEMORY;
  return peers_.checkpoint(source.holder)
      .then([this, segment, slot = *slot, rank, step, kind, bytes = source.imageBytes](rpc::Checkpoint::Client holder) {
        return fetchChunks(holder, segment, slot.index, rank, step, kind, bytes, 0);
      })
      .then([this, segment, index = slot->index]() {
        return thread_.call([segment, index]() { return segment->commitImage(index, true).status(); });
      });
}

kj::Promise<void> Restorer::fetchChunks(rpc::Checkpoint::Client holder, std::shared_ptr<ck::FlashSegment> segment,
                                        int slot, uint32_t rank, uint64_t step, rpc::SnapshotKind kind, uint64_t bytes,
                                        uint64_t offset) {
  if (offset >= bytes) return kj::READY_NOW;
  kj::Vector<kj::Promise<void>> calls(kWindow);
  uint64_t at = offset;
  for (size_t i = 0; i < kWindow && at < bytes; ++i) {
    uint64_t n = std::min(kChunkBytes, bytes - at);
    auto request = holder.readRequest();
    request.setKind(kind);
    request.setRank(rank);
    request.setStep(step);
    request.setOffset(at);
    request.setLength(n);
    calls.add(peers_.withTimeout(request.send(), kChunkTimeout, "read")
                  .then([segment, slot, at, n](capnp::Response<rpc::Checkpoint::ReadResults> reply) {
                    auto data = reply.getData();
                    if (data.size() != n) {
                      throwStatus(Status(StatusCode::kInternal,
                                         fmt::format("read: the peer sent {} bytes at offset {}, not the {} asked",
                                                     data.size(), at, n)));
                    }
                    std::memcpy(segment->mutableSlotData(slot) + at, data.begin(), n);
                  }));
    at += n;
  }
  return kj::joinPromises(calls.releaseAsArray()).then([this, holder, segment, slot, rank, step, kind, bytes, at]() mutable {
    return fetchChunks(holder, segment, slot, rank, step, kind, bytes, at);
  });
}

}  // namespace troupe::actors::checkpoint_actor
