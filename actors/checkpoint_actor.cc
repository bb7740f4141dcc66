// The Checkpoint actor. Threads:
//   RPC thread (the worker's KJ loop): every call; sending replicas to the peer and fetching
//     snapshots from peers (chunked actor calls); bookkeeping (ranks_, replicas_, restores_).
//   persist thread (an IoThread): writes snapshots to the directory; owns a Persister.
//   restore thread (an IoThread): the blocking parts of a restore: verifying a snapshot, copying
//     a local replica, reading a rank file.
//   timer thread (an IoThread): deadlines for calls to peers.
// The threads share nothing but what a job carries; results come back to the RPC thread as
// promises (IoThread::call).
#include "troupe/actors/checkpoint_actor.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <asio/steady_timer.hpp>
#include <kj/debug.h>
#include <kj/vector.h>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "troupe/checkpoint/checkpoint_dir.h"
#include "troupe/checkpoint/flash_segment.h"
#include "troupe/checkpoint/restore_plan.h"
#include "troupe/runtime/client.h"
#include "troupe/runtime/io_thread.h"
#include "troupe/runtime/logging.h"
#include "troupe/runtime/metrics.h"
#include "troupe/runtime/rpc.h"
#include "checkpoint.capnp.h"
#include "typed_call.h"

namespace troupe::actors {
namespace {

namespace ck = troupe::checkpoint;
namespace fs = std::filesystem;
using nlohmann::json;

constexpr uint64_t kChunkBytes = uint64_t(4) << 20;  // per replica / fetch call (messages stay small)
constexpr uint64_t kMaxReadBytes = uint64_t(8) << 20;
constexpr size_t kWindow = 4;                          // chunk calls in flight
// Replicas of images up to this size are sent from a private copy (see sendReplica).
constexpr uint64_t kCopyForReplicaBytes = uint64_t(256) << 20;
constexpr size_t kMaxErrors = 10;                      // recent errors kept for status
constexpr auto kInventoryTimeout = std::chrono::seconds(5);
constexpr auto kChunkTimeout = std::chrono::seconds(60);
constexpr auto kPinTimeout = std::chrono::milliseconds(20'000);  // a restarting peer takes seconds

struct Options {
  std::string group;
  std::string node;
  std::string self;
  std::vector<std::string> members;
  std::string replicaTo;
  std::string dir;
  uint32_t keep = 3;
  uint32_t fileMode = 0600;  // of persisted files (directories get x where files get r)
  std::string shmDir;
  ck::FaultInjection fault;

  std::string primary(uint32_t rank) const { return *ck::segmentName(group, node, ck::SegmentKind::kPrimary, rank); }
  std::string replica(uint32_t rank) const { return *ck::segmentName(group, node, ck::SegmentKind::kReplica, rank); }
  ck::SegmentOptions segment(const std::string& name) const {
    ck::SegmentOptions o;
    o.dir = shmDir;
    o.name = name;
    o.fault = fault;
    return o;
  }
  ck::DirectoryOptions directory(const std::atomic<bool>* stop) const {
    ck::DirectoryOptions o;
    o.path = dir;
    o.keep = keep;
    o.fault = fault;
    o.stop = stop;
    o.fileMode = fileMode;
    return o;
  }
};

Status badArgs(const std::string& what) {
  return Status(StatusCode::kInvalidArgument, "Checkpoint actor: " + what);
}

Result<Options> parseOptions(std::string_view initArgs) {
  Options o;
  try {
    auto j = json::parse(initArgs.empty() ? std::string_view("{}") : initArgs);
    if (!j.is_object()) return badArgs("init args must be a JSON object");
    o.group = j.value("group", "");
    o.node = j.value("node", "");
    o.self = j.value("self", "");
    o.members = j.value("members", std::vector<std::string>{});
    o.dir = j.value("dir", "");
    o.fileMode = j.value("file_mode", 0600u);
    if ((o.fileMode & ~0777u) != 0 || (o.fileMode & 0600u) != 0600u) {
      return badArgs(fmt::format("\"file_mode\" {:o} must be a permission mode that lets its owner read and write",
                                 o.fileMode));
    }
    o.keep = j.value("keep", 3u);
    o.shmDir = j.value("shm_dir", ck::defaultShmDir());
    if (j.contains("replica_to")) {
      o.replicaTo = j.at("replica_to").get<std::string>();
    } else if (o.members.size() > 1) {
      auto it = std::find(o.members.begin(), o.members.end(), o.self);
      if (it == o.members.end()) return badArgs("\"self\" must be one of \"members\" to pick a replica target");
      o.replicaTo = *(++it == o.members.end() ? o.members.begin() : it);
    }
    auto fault = ck::FaultInjection::parse(j.value("fault", ""));
    if (!fault.isOk()) return fault.status();
    o.fault = *fault;
  } catch (const std::exception& e) {
    return badArgs(fmt::format("bad init args: {}", e.what()));
  }
  auto name = ck::segmentName(o.group, o.node, ck::SegmentKind::kPrimary, 0);
  if (!name.isOk()) return name.status();
  if (o.replicaTo == o.self && !o.replicaTo.empty()) return badArgs("an actor cannot keep its own replicas");
  return o;
}

// Throws `result`'s error at the RPC edge, else returns its value.
template <typename T>
T valueOrThrow(Result<T> result) {
  if (!result.isOk()) throwStatus(result.status());
  return std::move(*result);
}

void throwIfError(const Status& status) {
  if (!status.isOk()) throwStatus(status);
}

// A snapshot held in this node's segments (inventory).
struct HeldSnapshot {
  uint32_t rank = 0;
  uint64_t step = 0;
  uint32_t worldSize = 0;
  bool replica = false;
  uint64_t imageBytes = 0;
};

// What pin answers (rpc::Checkpoint.pin).
struct PinReply {
  bool done = false;
  std::optional<uint64_t> step;
  std::string replicaTo;
};

// What restore answers (rpc::Checkpoint.restore).
struct RestoreReply {
  rpc::JobState state = rpc::JobState::RUNNING;
  uint64_t step = 0;
  std::string source;
  std::string segment;
  std::vector<std::string> skipped;
};

void remember(std::vector<std::string>& errors, std::string error) {
  TROUPE_LOG(kWarning, "{}", error);
  errors.push_back(std::move(error));
  if (errors.size() > kMaxErrors) errors.erase(errors.begin());
}

// A peer's failure with the code that crossed the RPC edge (NOT_FOUND, ...; UNAVAILABLE when
// the connection itself went).
Status statusOf(const kj::Exception& e) { return statusFromException(e, ""); }

// Mappings of segments by name, reopened when the file was replaced (a writer re-created it for
// a new layout). Entries are shared so a transfer in progress keeps its mapping.
// Thread-safety: belongs to one thread.
class SegmentCache {
 public:
  explicit SegmentCache(const Options& options) : options_(options) {}

  Result<std::shared_ptr<ck::FlashSegment>> get(const std::string& name) {
    struct stat st {};
    std::string path = (options_.shmDir.empty() ? ck::defaultShmDir() : options_.shmDir) + "/" + name;
    if (::stat(path.c_str(), &st) != 0) {
      entries_.erase(name);
      return Status(StatusCode::kNotFound, fmt::format("no checkpoint segment {}", path));
    }
    auto it = entries_.find(name);
    if (it != entries_.end() && it->second.ino == st.st_ino && it->second.dev == st.st_dev) return it->second.segment;
    auto segment = ck::FlashSegment::openExisting(options_.segment(name));
    if (!segment.isOk()) return segment.status();
    auto shared = std::make_shared<ck::FlashSegment>(std::move(*segment));
    entries_[name] = Entry{shared, st.st_dev, st.st_ino};
    return shared;
  }
  void clear() { entries_.clear(); }

 private:
  struct Entry {
    std::shared_ptr<ck::FlashSegment> segment;
    dev_t dev = 0;
    ino_t ino = 0;
  };
  const Options& options_;
  std::map<std::string, Entry> entries_;
};

// Which snapshot was last handled: the segment file, a slot and its sequence number identify one
// save (a re-created segment starts its sequence numbers again).
struct SnapshotId {
  uint64_t file = 0;
  int slot = -1;
  uint64_t seq = 0;
  bool operator==(const SnapshotId&) const = default;
};

struct PersistReport {
  uint32_t rank = 0;
  uint64_t step = 0;
  bool persisted = false;
  bool stepComplete = false;
  Status error;
};

// The persist thread's state: the directory and the segment mappings it reads.
class Persister {
 public:
  Persister(const Options& options, const std::atomic<bool>* stop)
      : options_(options), cache_(options_), dir_(options_.directory(stop)) {}

  Status open() { return dir_.open(); }

  // Persists rank's newest complete snapshot unless it is the one persisted last.
  PersistReport run(uint32_t rank) {
    PersistReport report;
    report.rank = rank;
    auto segment = cache_.get(options_.primary(rank));
    if (!segment.isOk()) {
      report.error = segment.status();
      return report;
    }
    auto slot = (*segment)->newestComplete();
    if (!slot) return report;
    report.step = slot->step;
    SnapshotId id{(*segment)->fileId(), slot->index, slot->seq};
    if (last_[rank] == id) return report;
    auto outcome = ck::persistSnapshot(dir_, **segment, *slot);
    if (!outcome.isOk()) {
      report.error = outcome.status();
      return report;
    }
    last_[rank] = id;
    persists_.add();
    persistBytes_.add(outcome->bytes);
    persistTime_.addTime(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(outcome->seconds)));
    report.persisted = true;
    report.stepComplete = outcome->stepComplete;
    TROUPE_LOG(kInfo, "persisted rank {} step {} ({} bytes in {:.3f} s{})", rank, slot->step, outcome->bytes,
               outcome->seconds, outcome->stepComplete ? ", step complete" : "");
    return report;
  }
  void dropMappings() { cache_.clear(); }

 private:
  Options options_;
  SegmentCache cache_;
  ck::CheckpointDirectory dir_;
  std::map<uint32_t, SnapshotId> last_;
  // In this worker's counters, for the head's /metrics.
  metrics::Counter& persists_ = metrics::counter("troupe_checkpoint_persists_total");
  metrics::Counter& persistBytes_ = metrics::counter("troupe_checkpoint_persist_bytes_total");
  metrics::Counter& persistTime_ = metrics::counter("troupe_checkpoint_persist_seconds_total", "", metrics::Unit::kSeconds);
};

// The blocking parts of a restore, run on the restore thread. Each stages step `step` of rank
// `rank` into the rank's segment on this node, or says why it could not.
Status stageFromLocalMemory(const Options& o, uint32_t rank, uint64_t step) {
  auto segment = ck::FlashSegment::openExisting(o.segment(o.primary(rank)), /*writable=*/true);
  if (!segment.isOk()) return segment.status();
  auto slot = segment->completeAt(step);
  if (!slot) return Status(StatusCode::kNotFound, fmt::format("step {} is no longer in {}", step, segment->path()));
  auto verified = segment->verify(*slot);
  if (!verified.isOk()) {
    (void)segment->markSlot(*slot, ck::SlotState::kCorrupt);
    return verified.status();
  }
  return Status::ok();
}

Status stageFromLocalReplica(const Options& o, uint32_t rank, uint64_t step) {
  auto replica = ck::FlashSegment::openExisting(o.segment(o.replica(rank)), /*writable=*/true);
  if (!replica.isOk()) return replica.status();
  auto slot = replica->completeAt(step);
  if (!slot) return Status(StatusCode::kNotFound, fmt::format("step {} is no longer in {}", step, replica->path()));
  auto verified = replica->verify(*slot);
  if (!verified.isOk()) {
    (void)replica->markSlot(*slot, ck::SlotState::kCorrupt);
    return verified.status();
  }
  auto primary = ck::FlashSegment::openForWrite(o.segment(o.primary(rank)), slot->imageBytes);
  if (!primary.isOk()) return primary.status();
  auto target = primary->beginImage(slot->imageBytes);
  if (!target.isOk()) return target.status();
  std::memcpy(primary->mutableSlotData(target->index), replica->slotData(slot->index), slot->imageBytes);
  if (!replica->unchanged(*slot)) {
    return Status(StatusCode::kAborted, fmt::format("the replica of step {} changed while being copied", step));
  }
  return primary->commitImage(target->index, /*verifyData=*/false).status();
}

Status stageFromDisk(const Options& o, uint32_t rank, uint64_t step) {
  ck::CheckpointDirectory dir(o.directory(nullptr));
  auto manifest = dir.readManifest(step);
  if (!manifest.isOk()) return manifest.status();
  if (rank >= manifest->worldSize) {
    return Status(StatusCode::kNotFound, fmt::format("step {} on disk has no rank {}", step, rank));
  }
  auto file = ck::RankFile::open(dir.rankPath(step, rank), &manifest->ranks[rank]);
  Status status = file.status();
  if (file.isOk()) {
    uint64_t bytes = file->header().layout.imageBytes();
    auto primary = ck::FlashSegment::openForWrite(o.segment(o.primary(rank)), bytes);
    if (!primary.isOk()) return primary.status();
    auto target = primary->beginImage(bytes);
    if (!target.isOk()) return target.status();
    status = file->readImage(primary->mutableSlotData(target->index));
    if (status.isOk()) return primary->commitImage(target->index, /*verifyData=*/false).status();
  }
  // A rank file that fails its checks makes the whole step unusable, for every rank.
  if (status.code() == StatusCode::kFailedPrecondition) (void)dir.quarantine(step);
  return status;
}

// After step `step` is staged: snapshots of later steps in this rank's segment and partial later
// steps on disk belong to a timeline the group abandoned.
Status finishStaging(const Options& o, uint32_t rank, uint64_t step) {
  auto segment = ck::FlashSegment::openExisting(o.segment(o.primary(rank)), /*writable=*/true);
  if (!segment.isOk()) return segment.status();
  for (const auto& slot : segment->slots()) {
    if (slot.complete() && slot.step > step) (void)segment->markSlot(slot, ck::SlotState::kEmpty);
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

struct RestoreJob {
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

class CheckpointActor final : public TypedActor<rpc::Checkpoint> {
 public:
  CheckpointActor(ActorContext context, Options options)
      : context_(std::move(context)),
        options_(std::move(options)),
        rpcCache_(options_),
        tasks_(std::make_unique<kj::TaskSet>(errorHandler_)),
        restoreTasks_(std::make_unique<kj::TaskSet>(errorHandler_)) {
    // A file size limit must make a write fail with EFBIG (reported), not kill the worker.
    signal(SIGXFSZ, SIG_IGN);
    persister_ = std::make_shared<Persister>(options_, &stop_);
    if (!options_.dir.empty()) {
      // Creates the directory and removes what dead writers of this host left.
      tasks_->add(persistThread_.call([p = persister_]() { return p->open(); }).then([this](Status s) {
        if (!s.isOk()) remember(persistErrors_, s.toString());
      }));
    }
    TROUPE_LOG(kInfo, "checkpoint actor for group {} node {}: dir '{}', replicas to '{}', shm {}", options_.group,
               options_.node, options_.dir, options_.replicaTo, options_.shmDir);
    auto server = kj::heap<Server>(*this);
    server_ = server.get();
    serve(kj::mv(server));
  }

  ~CheckpointActor() override {
    stop_ = true;
    server_->actorEnded();  // a caller still holding the capability gets an error, not this freed actor
    // Pending work first: its continuations use the members below (the threads are joined last).
    restoreTasks_.reset();
    tasks_.reset();
    auto removed = removeSegments();
    TROUPE_LOG(kInfo, "checkpoint actor exiting: removed {} segment(s)", removed.size());
  }


 private:
  // rpc::Checkpoint: reads the params, runs the actor's method, writes the results; errors are
  // thrown as Status exceptions (troupe/runtime/rpc.h). The actor keeps a reference, so the
  // server outlives it; once the actor is gone, calls fail.
  class Server final : public rpc::Checkpoint::Server {
   public:
    explicit Server(CheckpointActor& actor) : actor_(&actor) {}
    void actorEnded() { actor_ = nullptr; }

   protected:
    kj::Promise<void> attach(AttachContext context) override {
      uint32_t rank = context.getParams().getRank();
      actor().ranks_[rank];
      context.getResults().setSegment(actor().options_.primary(rank));
      context.getResults().setShmDir(actor().options_.shmDir);
      return kj::READY_NOW;
    }
    kj::Promise<void> saved(SavedContext context) override {
      actor().saved(context.getParams().getRank());
      return kj::READY_NOW;
    }
    kj::Promise<void> members(MembersContext context) override {
      std::vector<std::string> live;
      for (auto name : context.getParams().getMembers()) live.emplace_back(name.cStr());
      context.getResults().setReplicaTo(actor().members(std::move(live)));
      return kj::READY_NOW;
    }
    kj::Promise<void> pin(PinContext context) override {
      auto params = context.getParams();
      PinReply reply = valueOrThrow(actor().pin(params.getRank(), params.getStep()));
      auto results = context.getResults();
      results.setState(reply.done ? rpc::JobState::DONE : rpc::JobState::RUNNING);
      results.setHasStep(reply.step.has_value());
      results.setStep(reply.step.value_or(0));
      results.setReplicaTo(reply.replicaTo);
      return kj::READY_NOW;
    }
    kj::Promise<void> status(StatusContext context) override {
      actor().status(context.getResults().initStatus());
      return kj::READY_NOW;
    }
    kj::Promise<void> inventory(InventoryContext context) override {
      auto held = actor().inventory();
      auto results = context.getResults();
      results.setActor(actor().options_.self);
      results.setNode(actor().options_.node);
      auto list = results.initHoldings(held.size());
      for (size_t i = 0; i < held.size(); ++i) {
        list[i].setRank(held[i].rank);
        list[i].setStep(held[i].step);
        list[i].setWorldSize(held[i].worldSize);
        list[i].setKind(held[i].replica ? rpc::SnapshotKind::REPLICA : rpc::SnapshotKind::MEMORY);
        list[i].setImageBytes(held[i].imageBytes);
      }
      return kj::READY_NOW;
    }
    kj::Promise<void> read(ReadContext context) override {
      auto p = context.getParams();
      std::string bytes = valueOrThrow(actor().read(p.getKind() == rpc::SnapshotKind::REPLICA, p.getRank(),
                                                    p.getStep(), p.getOffset(), p.getLength()));
      context.getResults().setData(kj::arrayPtr(reinterpret_cast<const kj::byte*>(bytes.data()), bytes.size()));
      return kj::READY_NOW;
    }
    kj::Promise<void> restore(RestoreContext context) override {
      auto p = context.getParams();
      RestoreReply reply = valueOrThrow(actor().restore(p.getRank(), p.getMaxStep()));
      auto results = context.getResults();
      results.setState(reply.state);
      results.setStep(reply.step);
      results.setSource(reply.source);
      results.setSegment(reply.segment);
      auto skipped = results.initSkipped(reply.skipped.size());
      for (size_t i = 0; i < reply.skipped.size(); ++i) skipped.set(i, reply.skipped[i]);
      return kj::READY_NOW;
    }
    kj::Promise<void> release(ReleaseContext context) override {
      return actor().releaseAfterRestores().then([context](std::vector<std::string> removed) mutable {
        auto list = context.getResults().initRemoved(removed.size());
        for (size_t i = 0; i < removed.size(); ++i) list.set(i, removed[i]);
      });
    }
    kj::Promise<void> replicaBegin(ReplicaBeginContext context) override {
      auto p = context.getParams();
      context.getResults().setSlot(valueOrThrow(actor().replicaBegin(p.getRank(), p.getStep(), p.getImageBytes())));
      return kj::READY_NOW;
    }
    kj::Promise<void> replicaWrite(ReplicaWriteContext context) override {
      auto p = context.getParams();
      throwIfError(actor().replicaWrite(p.getRank(), p.getSlot(), p.getStep(), p.getOffset(), p.getData()));
      return kj::READY_NOW;
    }
    kj::Promise<void> replicaCommit(ReplicaCommitContext context) override {
      auto p = context.getParams();
      context.getResults().setStep(valueOrThrow(actor().replicaCommit(p.getRank(), p.getSlot(), p.getStep())));
      return kj::READY_NOW;
    }
    kj::Promise<void> replicaPin(ReplicaPinContext context) override {
      auto p = context.getParams();
      context.getResults().setStep(valueOrThrow(actor().replicaPin(p.getRank(), p.getStep())));
      return kj::READY_NOW;
    }

   private:
    CheckpointActor& actor() {
      if (actor_ == nullptr) throwStatus(Status(StatusCode::kUnavailable, "the Checkpoint actor has ended"));
      return *actor_;
    }
    CheckpointActor* actor_;
  };

  struct RankState {
    std::shared_ptr<std::atomic<bool>> persistQueued = std::make_shared<std::atomic<bool>>(false);
    std::optional<uint64_t> persisted;
    bool replicating = false;
    bool replicateAgain = false;
    SnapshotId replicatedId;
    std::optional<uint64_t> replicated;
    int replicaFailures = 0;  // sends failed in a row
    uint64_t sendGeneration = 0;  // moves on when the target changes: older sends count for nothing
  };
  struct PinJob {
    uint64_t step = 0;
    bool done = false;
    Result<PinReply> result = Status(StatusCode::kInternal, "pin not finished");
  };
  struct IncomingReplica {
    std::optional<ck::FlashSegment> segment;
    int slot = -1;
    uint64_t step = 0;
    uint64_t imageBytes = 0;
    std::optional<uint64_t> held;
    std::optional<uint64_t> pinned;
  };
  class ErrorHandler final : public kj::TaskSet::ErrorHandler {
   public:
    void taskFailed(kj::Exception&& e) override {
      TROUPE_LOG(kWarning, "checkpoint actor task failed: {}", e.getDescription().cStr());
    }
  };

  // The group's live checkpoint actors changed (a node was lost, another joined): ask them for
  // inventories from now on, and send replicas to the next live one, never to a dead node's.
  std::string members(std::vector<std::string> live) {
    if (std::find(live.begin(), live.end(), options_.self) == live.end()) live.push_back(options_.self);
    std::sort(live.begin(), live.end());
    options_.members = live;
    auto it = std::find(live.begin(), live.end(), options_.self);
    std::string target = live.size() > 1 ? *(++it == live.end() ? live.begin() : it) : "";
    if (target != options_.replicaTo) {
      // What the old target holds says nothing of the new one, and a send to it (a lost node's
      // actor, which may never answer) must not hold back the sends to the new one.
      for (auto& [rank, state] : ranks_) {
        state.replicatedId = {};
        state.replicated.reset();
        state.replicating = false;
        state.replicateAgain = false;
        ++state.sendGeneration;
      }
    }
    options_.replicaTo = target;
    return options_.replicaTo;
  }

  void saved(uint32_t rank) {
    requestPersist(rank);
    requestReplica(rank);
  }

  void requestPersist(uint32_t rank) {
    if (options_.dir.empty()) return;
    auto queued = ranks_[rank].persistQueued;
    if (queued->exchange(true)) return;  // a job that has not started yet will take the newest
    tasks_->add(persistThread_
                   .call([p = persister_, queued, rank]() {
                     queued->store(false);
                     return p->run(rank);
                   })
                   .then([this](PersistReport r) {
                     if (!r.error.isOk()) {
                       // A snapshot overwritten during its persist: the newer one is queued already.
                       if (r.error.code() != StatusCode::kAborted) {
                         remember(persistErrors_, fmt::format("persisting rank {} step {}: {}", r.rank, r.step,
                                                              r.error.toString()));
                       }
                     } else if (r.persisted) {
                       ranks_[r.rank].persisted = r.step;
                     }
                   }));
  }

  // Sends rank's newest snapshot to the replica target, one transfer per rank at a time.
  void requestReplica(uint32_t rank) {
    if (options_.replicaTo.empty() || context_.cluster == nullptr) return;
    RankState& state = ranks_[rank];
    if (state.replicating) {
      state.replicateAgain = true;
      return;
    }
    state.replicating = true;
    uint64_t generation = state.sendGeneration;
    tasks_->add(sendReplica(rank, generation)
                   .catch_([this, rank, generation](kj::Exception&& e) {
                     if (ranks_[rank].sendGeneration != generation) return;
                     ranks_[rank].replicaFailures++;
                     remember(replicaErrors_, fmt::format("replica of rank {} to {}: {}", rank, options_.replicaTo,
                                                          statusOf(e).message()));
                   })
                   .then([this, rank, generation]() {
                     RankState& s = ranks_[rank];
                     if (s.sendGeneration != generation) return;  // the target changed meanwhile
                     s.replicating = false;
                     if (s.replicateAgain) {
                       s.replicateAgain = false;
                       requestReplica(rank);
                     }
                   }));
  }

  kj::Promise<void> sendReplica(uint32_t rank, uint64_t generation) {
    auto segment = rpcCache_.get(options_.primary(rank));
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
    return withTimeout(peerCheckpoint(options_.replicaTo), kChunkTimeout, "finding the replica target")
        .then([this, rank, seg, info, copy, generation](rpc::Checkpoint::Client target) mutable {
          auto begin = target.replicaBeginRequest();
          begin.setRank(rank);
          begin.setStep(info.step);
          begin.setImageBytes(info.imageBytes);
          begin.setFrom(options_.self);
          return withTimeout(begin.send(), kChunkTimeout, "replicaBegin")
              .then([this, target, rank, seg, info, copy,
                     generation](capnp::Response<rpc::Checkpoint::ReplicaBeginResults> reply) mutable {
            uint32_t slot = reply.getSlot();
            return sendChunks(target, seg, info, rank, slot, 0, copy).then([this, target, slot, rank, seg, info, copy,
                                                                            generation]() mutable {
              if (!copy && !seg->unchanged(info)) {
                return kj::Promise<void>(KJ_EXCEPTION(FAILED, "the snapshot was overwritten while being sent; "
                                                              "the newer one follows"));
              }
              auto commit = target.replicaCommitRequest();
              commit.setRank(rank);
              commit.setSlot(slot);
              commit.setStep(info.step);
              return withTimeout(commit.send(), kChunkTimeout, "replicaCommit")
                  .then([this, rank, info, seg, generation](capnp::Response<rpc::Checkpoint::ReplicaCommitResults>) {
                RankState& s = ranks_[rank];
                if (s.sendGeneration != generation) return;  // committed at a target no longer ours
                s.replicatedId = SnapshotId{seg->fileId(), info.index, info.seq};
                s.replicated = info.step;
                s.replicaFailures = 0;
              });
            });
          });
        });
  }

  // Sends chunks [first, first + kWindow) of the image at once, then the next window.
  // From `copy` when there is one (then nothing can overwrite it), else from the slot itself.
  kj::Promise<void> sendChunks(rpc::Checkpoint::Client target, std::shared_ptr<ck::FlashSegment> seg, ck::SlotInfo info,
                               uint32_t rank, uint32_t peerSlot, uint64_t offset,
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
      calls.add(withTimeout(write.send(), kChunkTimeout, "replicaWrite").ignoreResult());
      at += n;
    }
    return kj::joinPromises(calls.releaseAsArray()).then([this, target, seg, info, rank, peerSlot, at, copy]() mutable {
      return sendChunks(target, seg, info, rank, peerSlot, at, copy);
    });
  }

  // The trainer of `rank` ends a chunk at `step`: its newest snapshot at or before it is
  // replicated (if it is not already) and pinned in the replica, so that the step survives
  // later snapshots on both sides until the next pin. Like restore, it answers at once (calls
  // to an actor take turns, and two actors pinning to each other must not wait on each other's
  // turn): running until the job ends, then done with the step and the peer ("" without one),
  // or the error, once.
  Result<PinReply> pin(uint32_t rank, uint64_t step) {
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
                    .then([job](Result<PinReply> r) {
                      job->result = std::move(r);
                      job->done = true;
                    }, [job](kj::Exception&& e) {
                      job->result = Status(StatusCode::kUnavailable, fmt::format("pin: {}", statusOf(e).message()));
                      job->done = true;
                    }));
    return PinReply{};
  }

  // The pin job: waits for the replica (asking for it again while sends fail), then pins it.
  // Waits for a peer that is restarting, up to kPinTimeout.
  kj::Promise<Result<PinReply>> pinReplica(uint32_t rank, uint64_t step, std::chrono::steady_clock::time_point deadline,
                                           kj::Promise<void> pause) {
    return pause.then([this, rank, step, deadline]() -> kj::Promise<Result<PinReply>> {
      auto segment = rpcCache_.get(options_.primary(rank));
      if (!segment.isOk()) return Result<PinReply>(segment.status());
      auto slot = (*segment)->newestComplete(step);
      if (!slot) return Result<PinReply>(PinReply{true, std::nullopt, ""});
      if (options_.replicaTo.empty() || context_.cluster == nullptr) {
        return Result<PinReply>(PinReply{true, slot->step, ""});
      }
      RankState& state = ranks_[rank];
      if (state.replicatedId == SnapshotId{(*segment)->fileId(), slot->index, slot->seq}) {
        std::string target = options_.replicaTo;
        return withTimeout(peerCheckpoint(target).then([rank, step = slot->step](rpc::Checkpoint::Client c) {
                             auto request = c.replicaPinRequest();
                             request.setRank(rank);
                             request.setStep(step);
                             return request.send().ignoreResult();
                           }),
                           kInventoryTimeout, "replicaPin")
            .then([step = slot->step, target]() -> kj::Promise<Result<PinReply>> {
              return Result<PinReply>(PinReply{true, step, target});
            }, [this, rank, step, deadline](kj::Exception&& e) -> kj::Promise<Result<PinReply>> {
              // The replica is gone or lacks the step (its actor restarted, its node was lost):
              // send it again.
              remember(replicaErrors_, fmt::format("pinning the replica of rank {}: {}", rank, statusOf(e).message()));
              RankState& s = ranks_[rank];
              s.replicatedId = {};
              s.replicaFailures++;
              if (std::chrono::steady_clock::now() > deadline) {
                return Result<PinReply>(Status(StatusCode::kUnavailable, fmt::format("pin: {}", statusOf(e).message())));
              }
              return pinReplica(rank, step, deadline, after(std::chrono::milliseconds(50)));
            });
      }
      if (std::chrono::steady_clock::now() > deadline) {
        std::string last = replicaErrors_.empty() ? "none recorded" : replicaErrors_.back();
        return Result<PinReply>(Status(
            StatusCode::kUnavailable,
            fmt::format("rank {} step {}: its replica to {} was not confirmed within {} s (last replica error: {})", rank,
                        slot->step, options_.replicaTo, kPinTimeout.count() / 1000, last)));
      }
      if (!state.replicating) requestReplica(rank);  // else the newest follows the send on its way
      // Polled every 2 ms while sends succeed; backs off while the peer is unreachable.
      auto pause = std::chrono::milliseconds(std::min(2 + 50 * state.replicaFailures, 500));
      return pinReplica(rank, step, deadline, after(pause));
    });
  }

  Result<uint64_t> replicaPin(uint32_t rank, uint64_t step) {
    IncomingReplica& in = replicas_[rank];
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

  Result<uint32_t> replicaBegin(uint32_t rank, uint64_t step, uint64_t bytes) {
    IncomingReplica& in = replicas_[rank];
    if (!in.segment || in.segment->slotCapacity() < bytes) {
      in.segment.reset();
      // TODO(perf): the first replica of a rank allocates its segment on the RPC thread.
      auto segment = ck::FlashSegment::openForWrite(options_.segment(options_.replica(rank)), bytes);
      if (!segment.isOk()) return segment.status();
      in.segment.emplace(std::move(*segment));
    }
    auto slot = in.segment->beginImage(bytes);
    if (!slot.isOk()) return slot.status();
    in.slot = slot->index;
    in.step = step;
    in.imageBytes = bytes;
    return static_cast<uint32_t>(slot->index);
  }

  Status replicaWrite(uint32_t rank, uint32_t slot, uint64_t step, uint64_t offset, capnp::Data::Reader data) {
    uint64_t n = data.size();
    auto it = replicas_.find(rank);
    if (it == replicas_.end() || !it->second.segment || it->second.slot != static_cast<int>(slot) ||
        it->second.step != step) {
      return Status(StatusCode::kFailedPrecondition,
                    fmt::format("replicaWrite: no replica of rank {} step {} in progress (slot {})", rank, step, slot));
    }
    IncomingReplica& in = it->second;
    if (offset > in.imageBytes || n > in.imageBytes - offset) {
      return badArgs(fmt::format("replicaWrite: bytes [{}, {}) outside the {}-byte image", offset, offset + n,
                                 in.imageBytes));
    }
    std::memcpy(in.segment->mutableSlotData(in.slot) + offset, data.begin(), n);
    return Status::ok();
  }

  Result<uint64_t> replicaCommit(uint32_t rank, uint32_t sentSlot, uint64_t step) {
    auto it = replicas_.find(rank);
    if (it == replicas_.end() || it->second.slot < 0 || it->second.slot != static_cast<int>(sentSlot) ||
        it->second.step != step) {
      return Status(StatusCode::kFailedPrecondition,
                    fmt::format("replicaCommit: no replica of rank {} step {} in progress (slot {})", rank, step,
                                sentSlot));
    }
    IncomingReplica& in = it->second;
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
    auto committed = in.segment->commitImage(slot, /*verifyData=*/true);
    if (!committed.isOk()) return committed.status();
    if (committed->step != step) {
      return Status(StatusCode::kFailedPrecondition,
                    fmt::format("replicaCommit: image holds step {}, not {}", committed->step, step));
    }
    in.held = step;
    return step;
  }

  // Complete snapshots in this node's segments of the group.
  std::vector<HeldSnapshot> inventory() {
    std::vector<HeldSnapshot> holdings;
    std::string prefix = ck::segmentPrefix(options_.group, options_.node);
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(options_.shmDir, ec)) {
      std::string name = entry.path().filename().string();
      if (name.rfind(prefix, 0) != 0 || name.find(".tmp.") != std::string::npos) continue;
      std::string rest = name.substr(prefix.size());
      bool replica = rest.rfind("replica.", 0) == 0;
      auto segment = rpcCache_.get(name);
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

  Result<std::string> read(bool replica, uint32_t rank, uint64_t step, uint64_t offset, uint64_t length) {
    const char* kind = replica ? "replica" : "memory";
    if (length > kMaxReadBytes) {
      return badArgs(fmt::format("read: {} bytes asked, at most {} per call", length, kMaxReadBytes));
    }
    auto segment = rpcCache_.get(replica ? options_.replica(rank) : options_.primary(rank));
    if (!segment.isOk()) return segment.status();
    auto slot = (*segment)->completeAt(step);
    if (!slot) {
      return Status(StatusCode::kNotFound, fmt::format("read: {} of rank {} step {} is no longer held", kind, rank, step));
    }
    if (offset > slot->imageBytes || length > slot->imageBytes - offset) {
      return badArgs(fmt::format("read: bytes [{}, {}) outside the {}-byte image", offset, offset + length,
                                 slot->imageBytes));
    }
    std::string out(reinterpret_cast<const char*>((*segment)->slotData(slot->index) + offset), length);
    if (!(*segment)->unchanged(*slot)) {
      return Status(StatusCode::kAborted, fmt::format("read: rank {} step {} changed while being read", rank, step));
    }
    return out;
  }

  Result<RestoreReply> restore(uint32_t rank, uint64_t maxStep) {
    auto it = restores_.find(rank);
    if (it != restores_.end()) {
      auto job = it->second;
      if (job->state == RestoreJob::State::kRunning) return RestoreReply{};
      restores_.erase(it);
      if (job->state == RestoreJob::State::kFailed) return job->error;
      RestoreReply reply;
      reply.state = job->state == RestoreJob::State::kDone ? rpc::JobState::DONE : rpc::JobState::NONE;
      reply.skipped = job->skipped;
      if (job->state == RestoreJob::State::kDone) {
        reply.step = job->step;
        reply.source = job->sourceText;
        reply.segment = options_.primary(rank);
      }
      return reply;
    }
    auto job = std::make_shared<RestoreJob>();
    job->rank = rank;
    job->maxStep = maxStep;
    restores_[rank] = job;
    restoreTasks_->add(runRestore(job).catch_([job](kj::Exception&& e) {
      job->state = RestoreJob::State::kFailed;
      job->error = Status(StatusCode::kInternal, fmt::format("restore of rank {} failed: {}", job->rank,
                                                              statusOf(e).message()));
    }));
    return RestoreReply{};
  }

  kj::Promise<void> runRestore(std::shared_ptr<RestoreJob> job) {
    // Holdings: this node's segments, every other member's, and the disk.
    for (const auto& h : inventory()) {
      job->holdings.push_back(ck::Holding{h.rank, h.step, h.worldSize,
                                          h.replica ? ck::SourceTier::kLocalReplica : ck::SourceTier::kLocalMemory,
                                          options_.self, h.imageBytes});
    }
    kj::Vector<kj::Promise<void>> asks;
    for (const auto& member : options_.members) {
      if (member == options_.self || context_.cluster == nullptr) continue;
      asks.add(withTimeout(peerCheckpoint(member).then([](rpc::Checkpoint::Client c) {
                             return c.inventoryRequest().send();
                           }),
                           kInventoryTimeout, "inventory")
                   .then(
                       [job, member](capnp::Response<rpc::Checkpoint::InventoryResults> reply) {
                         for (auto h : reply.getHoldings()) {
                           bool replica = h.getKind() == rpc::SnapshotKind::REPLICA;
                           job->holdings.push_back(
                               ck::Holding{h.getRank(), h.getStep(), h.getWorldSize(),
                                           replica ? ck::SourceTier::kPeerReplica : ck::SourceTier::kPeerMemory, member,
                                           h.getImageBytes()});
                         }
                       },
                       [job, member](kj::Exception&& e) {
                         job->skipped.push_back(fmt::format("member {}: {}", member, statusOf(e).message()));
                       }));
    }
    asks.add(restoreThread_.call([o = options_]() {
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

  kj::Promise<void> tryNext(std::shared_ptr<RestoreJob> job) {
    while (job->candidate < job->candidates.size() &&
           job->source >= job->candidates[job->candidate].sources.size()) {
      ++job->candidate;
      job->source = 0;
    }
    if (job->candidate >= job->candidates.size()) {
      job->state = RestoreJob::State::kNone;
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
      return restoreThread_.call([o = options_, rank = job->rank, step]() { return finishStaging(o, rank, step); })
          .then([this, job, step, where](Status finished) {
            if (!finished.isOk()) job->skipped.push_back("cleaning up after the restore: " + finished.toString());
            job->step = step;
            job->sourceText = where;
            job->state = RestoreJob::State::kDone;
            TROUPE_LOG(kInfo, "restore of rank {}: step {} from {}", job->rank, step, where);
          });
    });
  }

  kj::Promise<Status> trySource(uint32_t rank, uint64_t step, const ck::Holding& source) {
    switch (source.tier) {
      case ck::SourceTier::kLocalMemory:
        return restoreThread_.call([o = options_, rank, step]() { return stageFromLocalMemory(o, rank, step); });
      case ck::SourceTier::kLocalReplica:
        return restoreThread_.call([o = options_, rank, step]() { return stageFromLocalReplica(o, rank, step); });
      case ck::SourceTier::kDisk:
        return restoreThread_.call([o = options_, rank, step]() { return stageFromDisk(o, rank, step); });
      case ck::SourceTier::kPeerMemory:
      case ck::SourceTier::kPeerReplica:
        return fetchFromPeer(rank, step, source).catch_([](kj::Exception&& e) { return statusOf(e); });
    }
    return Status(StatusCode::kInternal, "unknown tier");
  }

  // Copies a snapshot another node's actor holds into this node's segment for the rank.
  kj::Promise<Status> fetchFromPeer(uint32_t rank, uint64_t step, const ck::Holding& source) {
    if (context_.cluster == nullptr) return Status(StatusCode::kUnavailable, "no cluster connection");
    // TODO(perf): a first restore on this node allocates the segment on the RPC thread.
    auto opened = ck::FlashSegment::openForWrite(options_.segment(options_.primary(rank)), source.imageBytes);
    if (!opened.isOk()) return opened.status();
    auto segment = std::make_shared<ck::FlashSegment>(std::move(*opened));
    auto slot = segment->beginImage(source.imageBytes);
    if (!slot.isOk()) return slot.status();
    auto kind = source.tier == ck::SourceTier::kPeerReplica ? rpc::SnapshotKind::REPLICA : rpc::SnapshotKind::MEMORY;
    return peerCheckpoint(source.holder)
        .then([this, segment, slot = *slot, rank, step, kind, bytes = source.imageBytes](rpc::Checkpoint::Client holder) {
          return fetchChunks(holder, segment, slot.index, rank, step, kind, bytes, 0);
        })
        .then([this, segment, index = slot->index]() {
          return restoreThread_.call([segment, index]() { return segment->commitImage(index, true).status(); });
        });
  }

  kj::Promise<void> fetchChunks(rpc::Checkpoint::Client holder, std::shared_ptr<ck::FlashSegment> segment, int slot,
                                uint32_t rank, uint64_t step, rpc::SnapshotKind kind, uint64_t bytes, uint64_t offset) {
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
      calls.add(withTimeout(request.send(), kChunkTimeout, "read")
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

  // Restores in progress are cancelled, and the one the restore thread may be staging is let
  // finish, so none re-creates a segment after they are removed.
  kj::Promise<std::vector<std::string>> releaseAfterRestores() {
    restoreTasks_ = std::make_unique<kj::TaskSet>(errorHandler_);
    restores_.clear();
    return restoreThread_.call([]() { return 0; }).then([this](int) { return removeSegments(); });
  }

  // Removes this node's segments of the group and dead writers' temporary files.
  std::vector<std::string> removeSegments() {
    rpcCache_.clear();
    replicas_.clear();
    if (!stop_) {
      tasks_->add(persistThread_.call([p = persister_]() {
        p->dropMappings();
        return 0;
      }).ignoreResult());
    }
    std::vector<std::string> names;
    auto removed = ck::removeSegments(options_.shmDir, ck::segmentPrefix(options_.group, options_.node));
    if (removed.isOk()) names = *removed;
    if (!options_.dir.empty()) {
      for (auto& path : ck::CheckpointDirectory(options_.directory(nullptr)).removeTemporaryFiles()) {
        names.push_back(std::move(path));
      }
    }
    return names;
  }

  void status(rpc::CheckpointStatus::Builder out) {
    std::vector<std::pair<uint32_t, uint64_t>> persisted, replicated, held, pinned;
    for (const auto& [rank, s] : ranks_) {
      if (s.persisted) persisted.emplace_back(rank, *s.persisted);
      if (s.replicated) replicated.emplace_back(rank, *s.replicated);
    }
    for (const auto& [rank, in] : replicas_) {
      if (in.held) held.emplace_back(rank, *in.held);
      if (in.pinned) pinned.emplace_back(rank, *in.pinned);
    }
    auto fill = [](capnp::List<rpc::RankStep>::Builder list, const std::vector<std::pair<uint32_t, uint64_t>>& from) {
      for (size_t i = 0; i < from.size(); ++i) {
        list[i].setRank(from[i].first);
        list[i].setStep(from[i].second);
      }
    };
    auto texts = [](capnp::List<capnp::Text>::Builder list, const std::vector<std::string>& from) {
      for (size_t i = 0; i < from.size(); ++i) list.set(i, from[i]);
    };
    out.setPid(getpid());
    out.setGroup(options_.group);
    out.setNode(options_.node);
    out.setDir(options_.dir);
    fill(out.initPersisted(persisted.size()), persisted);
    texts(out.initPersistErrors(persistErrors_.size()), persistErrors_);
    fill(out.initReplicated(replicated.size()), replicated);
    texts(out.initReplicaErrors(replicaErrors_.size()), replicaErrors_);
    fill(out.initReplicasHeld(held.size()), held);
    fill(out.initReplicasPinned(pinned.size()), pinned);
  }

  // A peer's typed interface, on its current incarnation: asked once per transfer, so a peer
  // that restarted is reached again by the next one. The capability lives on the connection of
  // the handle kept in peers_.
  kj::Promise<rpc::Checkpoint::Client> peerCheckpoint(const std::string& name) {
    return peer(name).then([](ActorHandle handle) { return handle.typed<rpc::Checkpoint>(); });
  }

  kj::Promise<ActorHandle> peer(const std::string& name) {
    auto it = peers_.find(name);
    if (it != peers_.end()) return it->second;
    if (context_.cluster == nullptr) return KJ_EXCEPTION(FAILED, "no cluster connection");
    return context_.cluster->getActor(name).then([this, name](ActorHandle handle) {
      peers_.emplace(name, handle);
      return handle;
    });
  }

  // Resolves after `delay` (a timer on the timer thread).
  kj::Promise<void> after(std::chrono::milliseconds delay) {
    auto paf = kj::newPromiseAndCrossThreadFulfiller<void>();
    auto timer = std::make_shared<asio::steady_timer>(timerThread_.context(), delay);
    asio::post(timerThread_.context(), [timer, fulfiller = kj::mv(paf.fulfiller)]() mutable {
      timer->async_wait([timer, fulfiller = kj::mv(fulfiller)](const asio::error_code&) mutable { fulfiller->fulfill(); });
    });
    return kj::mv(paf.promise);
  }

  // Rejects with "<what> timed out" unless `promise` resolves within `limit`.
  template <typename T>
  kj::Promise<T> withTimeout(kj::Promise<T> promise, std::chrono::milliseconds limit, const char* what) {
    auto paf = kj::newPromiseAndCrossThreadFulfiller<void>();
    auto timer = std::make_shared<asio::steady_timer>(timerThread_.context(), limit);
    timer->async_wait([timer, fulfiller = kj::mv(paf.fulfiller)](const asio::error_code& e) mutable {
      if (!e) fulfiller->fulfill();  // cancelled: the fulfiller goes, its promise is gone already
    });
    // However the call ends, the timer is cancelled (on its own thread: asio timers are not
    // thread-safe), so finished calls leave no timer behind.
    auto cancel = kj::defer([timer, &context = timerThread_.context()]() {
      asio::post(context, [timer]() { timer->cancel(); });
    });
    return promise
        .exclusiveJoin(paf.promise.then([what, limit]() -> T {
          kj::throwFatalException(KJ_EXCEPTION(FAILED, kj::str(what, " timed out after ", limit.count(), " ms")));
        }))
        .attach(kj::mv(cancel));
  }

  ActorContext context_;
  Options options_;
  // The Server below. Held by pointer: a capability's destructor may throw, an Actor's may not.
  Server* server_ = nullptr;
  std::atomic<bool> stop_{false};
  static inline const std::atomic<bool> kStopped{true};
  // Declared before the tasks so they outlive them: a task's promise may wait on their work.
  IoThread persistThread_;
  IoThread restoreThread_;
  IoThread timerThread_;
  std::shared_ptr<Persister> persister_;
  SegmentCache rpcCache_;
  std::map<uint32_t, RankState> ranks_;
  std::map<uint32_t, IncomingReplica> replicas_;
  std::map<uint32_t, std::shared_ptr<RestoreJob>> restores_;
  std::map<std::string, ActorHandle> peers_;
  std::map<uint32_t, std::shared_ptr<PinJob>> pins_;  // by rank
  std::map<uint64_t, uint64_t> faultTries_;  // replica sends stopped by the fault seam, by step
  std::vector<std::string> persistErrors_;
  std::vector<std::string> replicaErrors_;
  ErrorHandler errorHandler_;
  // Held by pointer: kj::TaskSet's destructor may throw, an Actor's may not.
  std::unique_ptr<kj::TaskSet> tasks_;
  std::unique_ptr<kj::TaskSet> restoreTasks_;  // replaced (cancelled) by release
};

}  // namespace

void registerCheckpointActor(ActorRegistry& registry) {
  registry.add("Checkpoint", [](const ActorContext& context, std::string_view args) -> Result<std::unique_ptr<Actor>> {
    auto options = parseOptions(args);
    if (!options.isOk()) return options.status();
    return std::unique_ptr<Actor>(std::make_unique<CheckpointActor>(context, std::move(*options)));
  });
}

}  // namespace troupe::actors
