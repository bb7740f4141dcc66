// The Checkpoint actor: its typed server (rpc::Checkpoint) and the wiring of its units, all on
// the worker's RPC thread (its KJ loop):
//   checkpoint_options.h  init args, segment mappings, what the units share
//   checkpoint_persist.h  PersistQueue: snapshots to the directory, on a persist thread
//   checkpoint_replica.h  ReplicaSender (replicas out, pins), HeldReplicas (replicas in)
//   checkpoint_restore.h  Restorer: restores, staged on a restore thread; inventory and read
//   checkpoint_peers.h    the group's other actors by name, deadlines on calls to them
// The threads share nothing but what a job carries; results come back to the RPC thread as
// promises (IoThread::call).
#include "troupe/actors/checkpoint_actor.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "troupe/runtime/logging.h"
#include "troupe/runtime/rpc.h"
#include "checkpoint.capnp.h"
#include "checkpoint_options.h"
#include "checkpoint_peers.h"
#include "checkpoint_persist.h"
#include "checkpoint_replica.h"
#include "checkpoint_restore.h"
#include "typed_call.h"

namespace troupe::actors {
namespace {

using namespace checkpoint_actor;

// Throws `result`'s error at the RPC edge, else returns its value.
template <typename T>
T valueOrThrow(Result<T> result) {
  if (!result.isOk()) throwStatus(result.status());
  return std::move(*result);
}

void throwIfError(const Status& status) {
  if (!status.isOk()) throwStatus(status);
}

class CheckpointActor final : public TypedActor<rpc::Checkpoint> {
 public:
  CheckpointActor(ActorContext context, Options options)
      : context_(std::move(context)),
        options_(std::move(options)),
        cache_(options_),
        peers_(context_.cluster, *context_.timer),
        persist_(options_),
        sender_(options_, cache_, peers_, [this](const std::string& gone) { dropMember(gone); }),
        held_(options_),
        restorer_(options_, cache_, peers_) {
    // A file size limit must make a write fail with EFBIG (reported), not kill the worker.
    signal(SIGXFSZ, SIG_IGN);
    TROUPE_LOG(kInfo, "checkpoint actor for group {} node {}: dir '{}', replicas to '{}', shm {}", options_.group,
               options_.node, options_.dir, options_.replicaTo, options_.shmDir);
    serve<Server>(*this);
  }

  ~CheckpointActor() override {
    persist_.stop();
    // Restores in progress go before the segments, so none re-creates one afterwards.
    restorer_.cancel();
    auto removed = removeSegments();
    TROUPE_LOG(kInfo, "checkpoint actor exiting: removed {} segment(s)", removed.size());
  }

 private:
  // rpc::Checkpoint: reads the params, runs the actor's method, writes the results; errors are
  // thrown as Status exceptions (troupe/runtime/rpc.h). The actor keeps a reference, so the
  // server outlives it; once the actor is gone, calls fail.
  class Server final : public ServerFor<rpc::Checkpoint, CheckpointActor> {
   public:
    using ServerFor::ServerFor;

   protected:
    kj::Promise<void> attach(AttachContext context) override {
      uint32_t rank = context.getParams().getRank();
      context.getResults().setSegment(actor().options_.primary(rank));
      context.getResults().setShmDir(actor().options_.shmDir);
      return kj::READY_NOW;
    }
    kj::Promise<void> saved(SavedContext context) override {
      uint32_t rank = context.getParams().getRank();
      actor().persist_.request(rank);
      actor().sender_.request(rank);
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
      PinReply reply = valueOrThrow(actor().sender_.pin(params.getRank(), params.getStep()));
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
      auto held = heldSnapshots(actor().options_, actor().cache_);
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
      std::string bytes = valueOrThrow(readHeld(actor().options_, actor().cache_, p.getKind() == rpc::SnapshotKind::REPLICA,
                                                p.getRank(), p.getStep(), p.getOffset(), p.getLength()));
      context.getResults().setData(kj::arrayPtr(reinterpret_cast<const kj::byte*>(bytes.data()), bytes.size()));
      return kj::READY_NOW;
    }
    kj::Promise<void> restore(RestoreContext context) override {
      auto p = context.getParams();
      RestoreReply reply = valueOrThrow(actor().restorer_.restore(p.getRank(), p.getMaxStep()));
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
      context.getResults().setSlot(valueOrThrow(actor().held_.begin(p.getRank(), p.getStep(), p.getImageBytes())));
      return kj::READY_NOW;
    }
    kj::Promise<void> replicaWrite(ReplicaWriteContext context) override {
      auto p = context.getParams();
      throwIfError(actor().held_.write(p.getRank(), p.getSlot(), p.getStep(), p.getOffset(), p.getData()));
      return kj::READY_NOW;
    }
    kj::Promise<void> replicaCommit(ReplicaCommitContext context) override {
      auto p = context.getParams();
      context.getResults().setStep(valueOrThrow(actor().held_.commit(p.getRank(), p.getSlot(), p.getStep())));
      return kj::READY_NOW;
    }
    kj::Promise<void> replicaPin(ReplicaPinContext context) override {
      auto p = context.getParams();
      context.getResults().setStep(valueOrThrow(actor().held_.pin(p.getRank(), p.getStep())));
      return kj::READY_NOW;
    }

   private:
  };

  // The group's live checkpoint actors changed (a node was lost, another joined): ask them for
  // inventories from now on, and send replicas to the next live one, never to a dead node's.
  std::string members(std::vector<std::string> live) {
    if (std::find(live.begin(), live.end(), options_.self) == live.end()) live.push_back(options_.self);
    std::sort(live.begin(), live.end());
    options_.members = live;
    auto it = std::find(live.begin(), live.end(), options_.self);
    std::string target = live.size() > 1 ? *(++it == live.end() ? live.begin() : it) : "";
    if (target != options_.replicaTo) sender_.targetChanged();
    options_.replicaTo = target;
    return options_.replicaTo;
  }

  // A member's name is gone (it was killed with its lost node, and this actor restarted with its
  // spawn's member list): replicas go to the next live one instead of waiting for it.
  void dropMember(const std::string& gone) {
    std::vector<std::string> live;
    for (const auto& m : options_.members) {
      if (m != gone) live.push_back(m);
    }
    std::string target = members(std::move(live));
    TROUPE_LOG(kInfo, "checkpoint peer {} is gone: replicas now go to '{}'", gone, target);
  }

  // Restores in progress are cancelled, and the one the restore thread may be staging is let
  // finish, so none re-creates a segment after they are removed.
  kj::Promise<std::vector<std::string>> releaseAfterRestores() {
    restorer_.cancel();
    return restorer_.drained().then([this]() { return removeSegments(); });
  }

  // Removes this node's segments of the group and dead writers' temporary files.
  std::vector<std::string> removeSegments() {
    cache_.clear();
    held_.clear();
    persist_.dropMappings();
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
    auto fill = [](capnp::List<rpc::RankStep>::Builder list, const std::map<uint32_t, uint64_t>& from) {
      size_t i = 0;
      for (const auto& [rank, step] : from) {
        list[i].setRank(rank);
        list[i].setStep(step);
        ++i;
      }
    };
    auto texts = [](capnp::List<capnp::Text>::Builder list, const std::vector<std::string>& from) {
      for (size_t i = 0; i < from.size(); ++i) list.set(i, from[i]);
    };
    const auto& persisted = persist_.persisted();
    auto replicated = sender_.replicated();
    auto held = held_.held();
    auto pinned = held_.pinned();
    out.setPid(getpid());
    out.setGroup(options_.group);
    out.setNode(options_.node);
    out.setDir(options_.dir);
    fill(out.initPersisted(persisted.size()), persisted);
    texts(out.initPersistErrors(persist_.errors().list().size()), persist_.errors().list());
    fill(out.initReplicated(replicated.size()), replicated);
    texts(out.initReplicaErrors(sender_.errors().list().size()), sender_.errors().list());
    fill(out.initReplicasHeld(held.size()), held);
    fill(out.initReplicasPinned(pinned.size()), pinned);
  }

  ActorContext context_;
  Options options_;  // members() changes the members and the replica target
  // The units use what is declared before them, so they go first (each cancels its own tasks).
  SegmentCache cache_;  // this thread's mappings
  CheckpointPeers peers_;
  PersistQueue persist_;
  ReplicaSender sender_;
  HeldReplicas held_;
  Restorer restorer_;
};

}  // namespace

void registerCheckpointActor(ActorRegistry& registry) {
  registry.add("Checkpoint", [](const ActorContext& context, std::string_view args) -> Result<std::unique_ptr<Actor>> {
    TROUPE_ASSIGN_OR_RETURN(auto options, parseOptions(args));
    if (context.timer == nullptr) {
      return Status(StatusCode::kFailedPrecondition, "the Checkpoint actor needs its event loop's timer (ActorContext::timer)");
    }
    return std::unique_ptr<Actor>(std::make_unique<CheckpointActor>(context, std::move(options)));
  });
}

}  // namespace troupe::actors
