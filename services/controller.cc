#include "controller.h"

#include <unistd.h>

#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <map>
#include <optional>

#include "controller_core.h"
#include "troupe/runtime/schema_convert.h"
#include "troupe.capnp.h"
#include "troupe/runtime/actor.h"
#include "troupe/runtime/ids.h"
#include "troupe/runtime/logging.h"
#include "troupe/runtime/resources.h"

namespace troupe {

// What the I/O thread owns: the store and the core deciding over it. Shared with pending
// I/O-thread work so it outlives the Controller until that work has run.
struct Controller::IoState {
  explicit IoState(std::unique_ptr<ClusterStore> s) : store(std::move(s)), core(*store) {}
  std::unique_ptr<ClusterStore> store;
  ControllerCore core;
  // Cleared (on the KJ thread) when the controller shuts down: sessions torn down with its
  // connections then are not their drivers leaving, and must not end any actor.
  bool serving = true;
};

namespace {

using Actions = std::vector<WorkerAction>;

template <typename T>
T valueOrThrow(Result<T> r) {
  if (!r.isOk()) throwStatus(r.status());
  return std::move(r).value();
}

template <typename R>
struct ResultValue;
template <typename T>
struct ResultValue<Result<T>> {
  using type = T;
};

// Requests of one kind gathered while the I/O thread is busy and decided together: the first
// request goes at once; those that arrive while its batch runs wait and go as the next batch, in
// one call (a few store round trips for the lot instead of a few per request). Owned by the KJ
// thread; `run` is called on it with at most kMaxBatch requests and resolves with one result each.
template <typename In, typename Out>
class BatchQueue {
 public:
  static constexpr size_t kMaxBatch = 512;
  using Run = std::function<kj::Promise<std::vector<Result<Out>>>(std::vector<In>)>;
  BatchQueue(kj::TaskSet& tasks, Run run) : tasks_(tasks), run_(kj::mv(run)) {}

  kj::Promise<Out> add(In item) {
    auto paf = kj::newPromiseAndFulfiller<Out>();
    queue_.push_back(Waiting{kj::mv(item), kj::mv(paf.fulfiller)});
    if (!running_) next();
    return kj::mv(paf.promise);
  }

 private:
  struct Waiting {
    In item;
    kj::Own<kj::PromiseFulfiller<Out>> fulfiller;
  };

  void next() {
    if (queue_.empty()) {
      running_ = false;
      return;
    }
    running_ = true;
    size_t take = std::min(queue_.size(), kMaxBatch);
    auto batch = std::make_shared<std::vector<Waiting>>();
    std::vector<In> items;
    for (size_t i = 0; i < take; ++i) {
      items.push_back(kj::mv(queue_[i].item));
      batch->push_back(kj::mv(queue_[i]));
    }
    queue_.erase(queue_.begin(), queue_.begin() + static_cast<long>(take));
    tasks_.add(run_(kj::mv(items))
                   .then(
                       [batch](std::vector<Result<Out>> results) {
                         for (size_t i = 0; i < batch->size(); ++i) {
                           if (i >= results.size()) {
                             (*batch)[i].fulfiller->reject(KJ_EXCEPTION(FAILED, "a batch returned too few results"));
                           } else if (results[i].isOk()) {
                             (*batch)[i].fulfiller->fulfill(kj::mv(*results[i]));
                           } else {
                             (*batch)[i].fulfiller->reject(exceptionFromStatus(results[i].status()));
                           }
                         }
                       },
                       [batch](kj::Exception&& e) {
                         for (auto& w : *batch) w.fulfiller->reject(kj::cp(e));
                       })
                   .then([this]() { next(); }));
  }

  kj::TaskSet& tasks_;
  Run run_;
  std::vector<Waiting> queue_;
  bool running_ = false;
};

// The RPC face of the controller. Decisions run on the I/O thread (ControllerCore, one call
// at a time); this class carries out their side effects on node agents and answers waiters.
// Owned by the KJ thread.
class ControllerService final : public rpc::Controller::Server, private kj::TaskSet::ErrorHandler {
 public:
  ControllerService(kj::AsyncIoContext& asyncIo, IoThread& io, std::shared_ptr<Controller::IoState> state,
                    RedisOptions redis, std::chrono::milliseconds ttl, std::chrono::milliseconds reapInterval,
                    std::string token)
      : asyncIo_(asyncIo), io_(io), state_(std::move(state)), redis_(std::move(redis)), ttl_(ttl),
        reapInterval_(reapInterval), token_(std::move(token)), tasks_(*this),
        creates_(tasks_, [this](std::vector<ActorRecord> actors) { return createBatch(kj::mv(actors)); }),
        readies_(tasks_, [this](std::vector<ControllerCore::ReadyReport> reports) { return readyBatch(kj::mv(reports)); }) {
    tasks_.add(reapLoop());
    tasks_.add(endUnresumedSessions());
  }

 protected:
  kj::Promise<void> ping(PingContext context) override {
    context.getResults().setPid(getpid());
    context.getResults().setVersion("0.1.0");
    return kj::READY_NOW;
  }

  kj::Promise<void> registerNode(RegisterNodeContext context) override {
    NodeRecord node = fromNodeInfo(context.getParams().getNode());
    if (node.id.empty() || node.address.empty()) {
      throwStatus(Status(StatusCode::kInvalidArgument, "registerNode needs a node id and an address"));
    }
    if (auto s = checkResources(node.total, fmt::format("node {}", node.id.hex())); !s.isOk()) throwStatus(s);
    node.state = NodeState::kAlive;
    node.deathReason.clear();
    node.registeredMs = node.lastHeartbeatMs = wallClockMs();
    auto ttl = ttl_;
    return onIo([node, ttl](Controller::IoState& s) -> Result<Actions> {
             TROUPE_RETURN_IF_ERROR(s.store->registerNode(node, ttl));
             Actions actions;
             TROUPE_RETURN_IF_ERROR(s.core.retryPending(actions));  // a new node may unblock work
             return actions;
           })
        .then([this, node](Actions actions) {
          TROUPE_LOG(kInfo, "node {} registered from {} ({})", node.id.hex(), node.address, node.hostname);
          execute(kj::mv(actions));
          return storeEndpointFor(node.isHead);
        })
        .then([this, context](std::pair<std::string, bool> endpoint) mutable {
          fillEndpoint(endpoint, context.getResults().initRedis());
        });
  }

  kj::Promise<void> storeEndpoint(StoreEndpointContext context) override {
    return storeEndpointFor(context.getParams().getHead()).then([this, context](std::pair<std::string, bool> e) mutable {
      fillEndpoint(e, context.getResults().initRedis());
    });
  }

  // Only the head reaches Redis directly; every other node goes through the head's store
  // gateway, so the Redis password never leaves the head and Redis stays on its loopback.
  // The head's agent reads the password from its run directory: it never crosses a wire.
  kj::Promise<std::pair<std::string, bool>> storeEndpointFor(bool head) {
    if (head) return std::make_pair(HostPort{redis_.host, redis_.port}.toString(), false);
    return onIo([](Controller::IoState& s) -> Result<std::pair<std::string, bool>> {
      TROUPE_ASSIGN_OR_RETURN(auto meta, s.store->getMeta());
      if (!meta.has_value() || meta->storeGateway.empty()) {
        return Status(StatusCode::kUnavailable,
                      "the head's store gateway is not running (is the head node up? see its logs/gateway.log)");
      }
      return std::make_pair(meta->storeGateway, true);
    });
  }

  void fillEndpoint(const std::pair<std::string, bool>& endpoint, rpc::RedisEndpoint::Builder redis) {
    redis.setAddress(endpoint.first);
    redis.setGateway(endpoint.second);
    redis.setCluster(redis_.cluster);
    redis.setHeartbeatTtlMs(static_cast<uint32_t>(ttl_.count()));
  }

  kj::Promise<void> status(StatusContext context) override {
    struct Snapshot {
      std::vector<NodeRecord> nodes;
      ActorPage actors;
      std::vector<PlacementGroupRecord> groups;
      std::vector<ElasticGroupRecord> elastic;
    };
    auto params = context.getParams();
    const bool withActors = params.getActors();
    std::optional<ActorQuery> page;
    if (params.getActorLimit() > 0) {
      page.emplace();
      page->limit = params.getActorLimit();
      page->offset = params.getActorOffset();
      page->nodePrefix = params.getActorNode().cStr();
      std::string state = params.getActorState().cStr();
      if (!state.empty()) {
        page->state = actorStateFromName(state);
        if (!page->state) throwStatus(Status(StatusCode::kInvalidArgument,
                                             fmt::format("status: no actor state '{}' (PENDING, ALIVE, RESTARTING or DEAD)", state)));
      }
    }
    return onIo([withActors, page](Controller::IoState& s) -> Result<Snapshot> {
             TROUPE_ASSIGN_OR_RETURN(auto nodes, s.store->listNodes());
             ActorPage actors;
             if (page) {
               TROUPE_ASSIGN_OR_RETURN(auto got, s.store->listActorsPage(*page));
               actors = std::move(got);
             } else if (withActors) {
               TROUPE_ASSIGN_OR_RETURN(auto got, s.store->listActors());
               actors.actors = std::move(got);
               actors.matching = actors.actors.size();
               for (const auto& a : actors.actors) actors.countsByState[a.state] += 1;
             }
             TROUPE_ASSIGN_OR_RETURN(auto groups, s.store->listPlacementGroups());
             TROUPE_ASSIGN_OR_RETURN(auto elastic, s.store->listElasticGroups());
             return Snapshot{std::move(nodes), std::move(actors), std::move(groups), std::move(elastic)};
           })
        .then([context](Snapshot snap) mutable {
          auto results = context.getResults();
          auto nodes = results.initNodes(static_cast<unsigned>(snap.nodes.size()));
          for (unsigned i = 0; i < snap.nodes.size(); ++i) toNodeInfo(snap.nodes[i], nodes[i]);
          const auto& list = snap.actors.actors;
          auto actors = results.initActors(static_cast<unsigned>(list.size()));
          for (unsigned i = 0; i < list.size(); ++i) toActorInfo(list[i], actors[i]);
          results.setActorsMatching(snap.actors.matching);
          auto counts = results.initActorCounts(static_cast<unsigned>(snap.actors.countsByState.size()));
          unsigned k = 0;
          for (const auto& [state, n] : snap.actors.countsByState) {
            counts[k].setState(actorStateName(state));
            counts[k++].setCount(n);
          }
          auto groups = results.initPlacementGroups(static_cast<unsigned>(snap.groups.size()));
          for (unsigned i = 0; i < snap.groups.size(); ++i) toPlacementGroupInfo(snap.groups[i], groups[i]);
          auto elastic = results.initGroups(static_cast<unsigned>(snap.elastic.size()));
          for (unsigned i = 0; i < snap.elastic.size(); ++i) toElasticGroupInfo(snap.elastic[i], elastic[i]);
        });
  }

  kj::Promise<void> putGroup(PutGroupContext context) override {
    std::string id = context.getParams().getId().cStr();
    std::string doc = context.getParams().getDoc().cStr();
    return onIo([id, doc](Controller::IoState& s) -> Result<bool> {
             TROUPE_RETURN_IF_ERROR(s.store->putElasticGroup(id, doc));
             return true;
           }).ignoreResult();
  }

  kj::Promise<void> groupEvent(GroupEventContext context) override {
    std::string id = context.getParams().getId().cStr();
    auto params = context.getParams();
    int64_t timeMs = params.getTimeMs() > 0 ? params.getTimeMs() : wallClockMs();
    std::string text = fmt::format("{} {}", timeMs, params.getText().cStr());
    return onIo([id, text](Controller::IoState& s) -> Result<bool> {
             TROUPE_RETURN_IF_ERROR(s.store->appendGroupEvent(id, text));
             return true;
           }).ignoreResult();
  }

  kj::Promise<void> groupCommand(GroupCommandContext context) override {
    auto params = context.getParams();
    std::string id = params.getId().cStr();
    std::string nonce = params.getNonce().cStr();
    GroupCommand command = valueOrThrow(fromGroupCommand(params.getCommand()));
    if (command.timeMs <= 0) command.timeMs = wallClockMs();
    return onIo([id, command, nonce](Controller::IoState& s) { return s.store->appendGroupCommand(id, command, nonce); })
        .then([context](uint64_t seq) mutable { context.getResults().setSeq(seq); });
  }

  kj::Promise<void> removeGroup(RemoveGroupContext context) override {
    std::string id = context.getParams().getId().cStr();
    return onIo([id](Controller::IoState& s) -> Result<bool> {
             TROUPE_RETURN_IF_ERROR(s.store->deleteElasticGroup(id));
             return true;
           }).ignoreResult();
  }

  kj::Promise<void> getGroup(GetGroupContext context) override {
    std::string id = context.getParams().getId().cStr();
    return onIo([id](Controller::IoState& s) { return s.store->getElasticGroup(id); })
        .then([context](std::optional<ElasticGroupRecord> group) mutable {
          context.getResults().setFound(group.has_value());
          if (group) toElasticGroupInfo(*group, context.getResults().initGroup());
        });
  }

  kj::Promise<void> createActor(CreateActorContext context) override {
    auto params = context.getParams();
    auto spec = params.getSpec();
    ActorRecord actor;
    actor.id = ActorId(params.getId().cStr());
    if (!actor.id.valid()) {
      throwStatus(Status(StatusCode::kInvalidArgument, "createActor: the actor id must be 1-64 lower-case hex digits"));
    }
    actor.type = spec.getType().cStr();
    actor.name = spec.getName().cStr();
    actor.resources = fromResources(spec.getResources());
    if (auto s = checkResources(actor.resources, fmt::format("actor {}", actor.type)); !s.isOk()) throwStatus(s);
    actor.maxRestarts = spec.getMaxRestarts();
    actor.maxTaskRetries = spec.getMaxTaskRetries();
    actor.detached = spec.getDetached();
    actor.owner = spec.getOwner().cStr();
    auto args = spec.getInitArgs();
    actor.initArgs.assign(reinterpret_cast<const char*>(args.begin()), args.size());
    actor.placementGroup = PlacementGroupId(spec.getPlacementGroup().cStr());
    actor.bundleIndex = spec.getBundleIndex();
    return creates_.add(kj::mv(actor)).then([context](ActorRecord created) mutable {
      toActorInfo(created, context.getResults().initActor());
    });
  }

  kj::Promise<void> waitActor(WaitActorContext context) override {
    auto params = context.getParams();
    ActorId id(params.getId().cStr());
    auto deadline = asyncIo_.provider->getTimer().now() + params.getTimeoutMs() * kj::MILLISECONDS;
    return waitFor(id, params.getMinIncarnation(), params.getRequireAlive(), deadline).then([context](ActorRecord actor) mutable {
      toActorInfo(actor, context.getResults().initActor());
    });
  }

  kj::Promise<void> watchNodeDeaths(WatchNodeDeathsContext context) override {
    auto params = context.getParams();
    uint64_t after = params.getInstance() == instance_ ? std::min(params.getAfter(), deathCount_) : deathCount_;
    auto wait = std::min<uint32_t>(params.getTimeoutMs(), 60'000) * kj::MILLISECONDS;
    return deathsAfter(after, asyncIo_.provider->getTimer().now() + wait).then([this, context, after]() mutable {
      auto results = context.getResults();
      results.setInstance(instance_);
      results.setNext(deathCount_);
      uint64_t first = std::max(after, deathCount_ - deaths_.size());
      auto nodes = results.initNodes(static_cast<unsigned>(deathCount_ - first));
      for (uint64_t i = first; i < deathCount_; ++i) {
        nodes.set(static_cast<unsigned>(i - first), deaths_[i - (deathCount_ - deaths_.size())]);
      }
    });
  }

  kj::Promise<void> getActorByName(GetActorByNameContext context) override {
    std::string name = context.getParams().getName().cStr();
    return onIo([name](Controller::IoState& s) { return s.core.getActorByName(name); })
        .then([context](ActorRecord actor) mutable { toActorInfo(actor, context.getResults().initActor()); });
  }

  kj::Promise<void> killActor(KillActorContext context) override {
    ActorId id(context.getParams().getId().cStr());
    bool noRestart = context.getParams().getNoRestart();
    return onIo([id, noRestart](Controller::IoState& s) -> Result<Actions> {
             Actions actions;
             TROUPE_RETURN_IF_ERROR(s.core.killActor(id, noRestart, actions));
             return actions;
           })
        .then([this](Actions actions) {
          notifyWaiters();
          return carryOut(kj::mv(actions));  // reply once the worker is gone
        });
  }

  kj::Promise<void> actorReady(ActorReadyContext context) override {
    auto p = context.getParams();
    ActorId id(p.getId().cStr());
    uint32_t incarnation = p.getIncarnation();
    std::string address = p.getAddress().cStr();
    int64_t pid = p.getPid();
    return readies_.add(ControllerCore::ReadyReport{id, incarnation, address, pid}).ignoreResult();
  }

  kj::Promise<void> workerExited(WorkerExitedContext context) override {
    auto p = context.getParams();
    ActorId id(p.getId().cStr());
    uint32_t incarnation = p.getIncarnation();
    std::string reason = describeExit(p.getExit());
    bool final = isFinalExit(p.getExit());
    return onIo([id, incarnation, reason, final](Controller::IoState& s) -> Result<Actions> {
             Actions actions;
             TROUPE_RETURN_IF_ERROR(s.core.workerExited(id, incarnation, reason, actions, final));
             return actions;
           })
        .then([this, id, reason](Actions actions) {
          TROUPE_LOG(kInfo, "actor {} worker ended: {}", id.hex(), reason);
          execute(kj::mv(actions));
          notifyWaiters();
        });
  }

  kj::Promise<void> createPlacementGroup(CreatePlacementGroupContext context) override {
    auto p = context.getParams();
    PlacementGroupRecord group;
    group.id = PlacementGroupId(p.getId().cStr());
    if (!group.id.valid()) {
      throwStatus(Status(StatusCode::kInvalidArgument, "createPlacementGroup: the id must be 1-64 lower-case hex digits"));
    }
    group.name = p.getName().cStr();
    group.strategy = valueOrThrow(parsePlacementStrategy(p.getStrategy().cStr()));
    for (auto b : p.getBundles()) group.bundles.push_back(Bundle{fromResources(b.getResources()), NodeId()});
    for (const auto& b : group.bundles) {
      if (auto s = checkResources(b.resources, "placement group bundle"); !s.isOk()) throwStatus(s);
    }
    return onIo([group](Controller::IoState& s) { return s.core.createPlacementGroup(group); })
        .then([context](PlacementGroupRecord created) mutable {
          toPlacementGroupInfo(created, context.getResults().initGroup());
        });
  }

  kj::Promise<void> removePlacementGroup(RemovePlacementGroupContext context) override {
    PlacementGroupId id(context.getParams().getId().cStr());
    return onIo([id](Controller::IoState& s) -> Result<Actions> {
             Actions actions;
             TROUPE_RETURN_IF_ERROR(s.core.removePlacementGroup(id, actions));
             return actions;
           })
        .then([this](Actions actions) {
          notifyWaiters();
          return carryOut(kj::mv(actions));
        });
  }

  kj::Promise<void> addBundles(AddBundlesContext context) override {
    auto p = context.getParams();
    PlacementGroupId id(p.getId().cStr());
    std::vector<Resources> bundles;
    for (auto b : p.getBundles()) bundles.push_back(fromResources(b.getResources()));
    for (const auto& b : bundles) {
      if (auto s = checkResources(b, "placement group bundle"); !s.isOk()) throwStatus(s);
    }
    uint32_t from = p.getFromIndex();
    return onIo([id, bundles, from](Controller::IoState& s) { return s.core.addBundles(id, bundles, from); })
        .then([context](PlacementGroupRecord group) mutable {
          toPlacementGroupInfo(group, context.getResults().initGroup());
        });
  }

  kj::Promise<void> removeBundles(RemoveBundlesContext context) override {
    auto p = context.getParams();
    PlacementGroupId id(p.getId().cStr());
    std::vector<uint32_t> indices;
    for (uint32_t i : p.getIndices()) indices.push_back(i);
    return onIo([id, indices](Controller::IoState& s) -> Result<std::pair<PlacementGroupRecord, Actions>> {
             Actions actions;
             TROUPE_ASSIGN_OR_RETURN(auto group, s.core.removeBundles(id, indices, actions));
             return std::make_pair(std::move(group), std::move(actions));
           })
        .then([this, context](std::pair<PlacementGroupRecord, Actions> done) mutable {
          notifyWaiters();
          toPlacementGroupInfo(done.first, context.getResults().initGroup());
          return carryOut(kj::mv(done.second));
        });
  }

  kj::Promise<void> openSession(OpenSessionContext context) override {
    auto params = context.getParams();
    std::string resume = params.getResume().cStr();
    std::string info = params.getInfo().cStr();
    if (!resume.empty() && !isValidIdText(resume)) {
      throwStatus(Status(StatusCode::kInvalidArgument, "openSession: a session id is 1-64 lower-case hex digits"));
    }
    if (info.size() > 256) info.resize(256);
    std::string id = resume.empty() ? randomHex(8) : resume;
    return onIo([id, resume, info](Controller::IoState& s) -> Result<bool> {
             if (!resume.empty()) {
               TROUPE_ASSIGN_OR_RETURN(auto open, s.store->listSessions());
               if (open.count(resume) == 0) {
                 return Status(StatusCode::kNotFound,
                               fmt::format("session {} has ended (it was not resumed in time after the controller "
                                           "restarted): its actors were reclaimed; connect again",
                                           resume));
               }
               return true;
             }
             TROUPE_RETURN_IF_ERROR(s.store->putSession(id, info));
             return true;
           })
        .then([this, context, id](bool) mutable {
          // A resume takes the session over from a connection the client has given up on.
          uint64_t generation = ++sessionGeneration_;
          attached_[id] = generation;
          context.getResults().setId(id);
          context.getResults().setSession(kj::heap<SessionImpl>(*this, id, generation));
        });
  }

  // A restarted controller gives the drivers of the sessions in the store a grace period to
  // resume them; then it ends the rest, as if their connections had broken.
  kj::Promise<void> endUnresumedSessions() {
    auto grace = std::max<int64_t>(10000, 3 * ttl_.count());
    return asyncIo_.provider->getTimer().afterDelay(grace * kj::MILLISECONDS).then([this]() {
      return onIo([](Controller::IoState& s) { return s.store->listSessions(); })
          .then([this](std::map<std::string, std::string> open) {
            for (const auto& [id, info] : open) {
              if (attached_.count(id) != 0) continue;
              TROUPE_LOG(kInfo, "session {} ({}) was not resumed after the restart: ending it", id, info);
              sessionEnded(id);
            }
          });
    });
  }

  // Called when a session's last reference is gone (dropped, or its connection broke).
  void sessionEnded(const std::string& owner) {
    if (!state_->serving) return;
    attached_.erase(owner);
    tasks_.add(onIo([owner](Controller::IoState& s) -> Result<Actions> {
                 Actions actions;
                 TROUPE_RETURN_IF_ERROR(s.core.ownerGone(owner, actions));
                 // Forgotten only once its actors are ended: a crash in between ends them again.
                 TROUPE_RETURN_IF_ERROR(s.store->deleteSession(owner));
                 return actions;
               }).then([this](Actions actions) {
      notifyWaiters();
      return carryOut(kj::mv(actions));
    }));
  }

  kj::Promise<void> getPlacementGroup(GetPlacementGroupContext context) override {
    PlacementGroupId id(context.getParams().getId().cStr());
    return onIo([id](Controller::IoState& s) { return s.core.getPlacementGroup(id); })
        .then([context](PlacementGroupRecord group) mutable {
          toPlacementGroupInfo(group, context.getResults().initGroup());
        });
  }

 private:
  // A batch of creations decided in one I/O-thread call (ControllerCore::createActors).
  kj::Promise<std::vector<Result<ActorRecord>>> createBatch(std::vector<ActorRecord> actors) {
    using Done = std::pair<std::vector<Result<ActorRecord>>, Actions>;
    auto state = state_;
    return io_.call([state, actors = kj::mv(actors)]() mutable -> Done {
             Actions actions;
             auto results = state->core.createActors(std::move(actors), actions);
             return Done(std::move(results), std::move(actions));
           })
        .then([this](Done done) {
          execute(kj::mv(done.second));
          return kj::mv(done.first);
        });
  }

  // A batch of workers' ready reports (ControllerCore::actorsReady).
  kj::Promise<std::vector<Result<ActorRecord>>> readyBatch(std::vector<ControllerCore::ReadyReport> reports) {
    auto state = state_;
    return io_.call([state, reports = kj::mv(reports)]() { return state->core.actorsReady(reports); })
        .then([this](std::vector<Result<ActorRecord>> results) {
          for (const auto& actor : results) {
            if (actor.isOk()) {
              TROUPE_LOG(kInfo, "actor {} ({}) incarnation {} is ALIVE at {}", actor->id.hex(), actor->type,
                         actor->incarnation, actor->address);
            }
          }
          notifyWaiters();
          return results;
        });
  }

  // Runs `fn` against the store on the I/O thread; an error Status becomes an RPC error.
  template <typename Fn, typename R = std::invoke_result_t<Fn, Controller::IoState&>>
  kj::Promise<typename ResultValue<R>::type> onIo(Fn fn) {
    auto state = state_;
    return io_.call([state, fn = kj::mv(fn)]() mutable -> R { return fn(*state); })
        .then([](R r) { return valueOrThrow(kj::mv(r)); });
  }

  // Exit codes a worker uses to say its actor must not be restarted (worker_exit.h).
  static bool isFinalExit(rpc::WorkerExit::Reader exit) {
    return exit.getSignal() == 0 && (exit.getExitCode() == kExitActorEnded || exit.getExitCode() == kExitInitFailed);
  }

  static std::string describeExit(rpc::WorkerExit::Reader exit) {
    int sig = exit.getSignal();
    std::string tail = exit.getStderrTail().cStr();
    if (sig == 0 && exit.getExitCode() == kExitActorEnded) return "the actor ended itself (exit_actor or terminate)";
    if (sig == 0 && exit.getExitCode() == kExitInitFailed) {
      return fmt::format("its constructor raised (not restarted){}", tail.empty() ? "" : ": " + tail);
    }
    const char* abbrev = sig != 0 ? sigabbrev_np(sig) : nullptr;
    std::string how = sig != 0 ? fmt::format("killed by signal {} (SIG{})", sig, abbrev ? abbrev : "?")
                               : fmt::format("exited with code {}", exit.getExitCode());
    return tail.empty() ? fmt::format("worker {}", how) : fmt::format("worker {}; last stderr: {}", how, tail);
  }

  // Failure detection: marks nodes whose heartbeat expired DEAD and moves their actors. The
  // reconciliation (which reads the DEAD nodes' own indexes, never every actor or group) runs
  // right after a reap, and otherwise every kReconcileEvery ticks, for nodes that stopped
  // cleanly or died while no controller ran.
  static constexpr int kReconcileEvery = 8;

  kj::Promise<void> reapLoop(int tick = 0) {
    return asyncIo_.provider->getTimer().afterDelay(reapInterval_.count() * kj::MILLISECONDS)
        .then([this]() {
          auto state = state_;
          return io_.call([state]() { return state->store->reapExpiredNodes(); });
        })
        .then([this, tick](Result<std::vector<NodeId>> dead) {
          noteStoreRead(dead.status());
          if (dead.isOk()) {
            for (const auto& id : *dead) TROUPE_LOG(kWarning, "node {} missed its heartbeat: marked DEAD", id.hex());
            noteDeaths(*dead);
            if (!dead->empty() || tick % kReconcileEvery == 0) reconcileSoon();
          }
          return reapLoop(tick + 1);
        });
  }

  // Nodes just declared DEAD: the connection to each one's agent is broken now (a spawn or kill in
  // flight fails at once, not when its socket notices), and watchNodeDeaths callers hear of them.
  void noteDeaths(const std::vector<NodeId>& dead) {
    if (dead.empty()) return;
    for (const auto& id : dead) {
      deaths_.push_back(id.hex());
      ++deathCount_;
      if (deaths_.size() > kKeptDeaths) deaths_.pop_front();
      auto it = nodes_.find(id);
      if (it == nodes_.end()) continue;
      it->second.client->breakConnection(Status(
          StatusCode::kUnavailable, fmt::format("node {} was declared DEAD: its host stopped answering", id.hex())));
      // Destroyed on a later turn, after the calls in flight have heard.
      tasks_.add(kj::evalLater([old = kj::mv(it->second)]() {}));
      nodes_.erase(it);
    }
    deathsUntold_ = true;
    for (auto& waiter : deathWaiters_) waiter->fulfill();
    deathWaiters_.clear();
  }

  // Resolves once a death after `after` is known, or at `deadline`.
  kj::Promise<void> deathsAfter(uint64_t after, kj::TimePoint deadline) {
    auto& timer = asyncIo_.provider->getTimer();
    if (deathCount_ > after || timer.now() >= deadline) return kj::READY_NOW;
    auto paf = kj::newPromiseAndFulfiller<void>();
    deathWaiters_.push_back(kj::mv(paf.fulfiller));
    return paf.promise.exclusiveJoin(timer.atTime(deadline)).then([this, after, deadline]() {
      return deathsAfter(after, deadline);
    });
  }

  // Moves the work off DEAD nodes one node per I/O-thread call, so the reaps queued meanwhile
  // run between them: moving a hundred actors off one node must not delay noticing the next
  // node's death (20 nodes dying within a second were detected up to a second late when one call
  // reconciled them all). One reconciliation at a time; a request meanwhile runs once after it.
  void reconcileSoon() {
    if (reconciling_) {
      reconcileAgain_ = true;
      return;
    }
    reconciling_ = true;
    using Done = std::pair<Actions, bool>;
    auto state = state_;
    tasks_.add(io_.call([state]() -> Result<Done> {
                    Actions actions;
                    TROUPE_ASSIGN_OR_RETURN(auto more, state->core.reconcileDeadNodes(actions, 1));
                    return Done(std::move(actions), more);
                  })
                   .then([this](Result<Done> done) {
                     reconciling_ = false;
                     bool again = reconcileAgain_;
                     reconcileAgain_ = false;
                     if (!done.isOk()) {
                       TROUPE_LOG(kWarning, "reconciling DEAD nodes: {}", done.status().toString());
                       return;
                     }
                     // Waiters hear of actors a death ended too, not only of restarts: a caller
                     // whose connection to a dead node's worker broke waits for that verdict.
                     bool told = !done->second && std::exchange(deathsUntold_, false);
                     if (!done->first.empty() || told) {
                       execute(std::move(done->first));
                       notifyWaiters();
                     }
                     if (done->second || again) reconcileSoon();
                   }));
  }

  // One warning when the failure detector loses Redis, one every 10 s while it stays lost (it
  // asks every tick), and one when it is back.
  void noteStoreRead(const Status& status) {
    auto now = std::chrono::steady_clock::now();
    if (status.isOk()) {
      if (storeLostAt_) {
        TROUPE_LOG(kInfo, "failure detector reads Redis again after {:.1f} s",
                   std::chrono::duration<double>(now - *storeLostAt_).count());
      }
      storeLostAt_.reset();
      return;
    }
    if (!storeLostAt_) {
      storeLostAt_ = now;
      storeLostLogged_ = now;
      storeLostFailures_ = 0;
      TROUPE_LOG(kWarning, "failure detector cannot read Redis: {}", status.toString());
      return;
    }
    ++storeLostFailures_;
    if (now - storeLostLogged_ >= std::chrono::seconds(10)) {
      TROUPE_LOG(kWarning, "failure detector still cannot read Redis after {:.0f} s ({} more failed reads): {}",
                 std::chrono::duration<double>(now - *storeLostAt_).count(), storeLostFailures_, status.toString());
      storeLostLogged_ = now;
      storeLostFailures_ = 0;
    }
  }

  static constexpr kj::Duration kKillDeadline = 10 * kj::SECONDS;
  static constexpr kj::Duration kSpawnDeadline = 60 * kj::SECONDS;

  // Carries out what the core decided in the background.
  void execute(Actions actions) { tasks_.add(carryOut(kj::mv(actions))); }

  // Starts and stops workers as the core decided; resolves when every node agent has answered.
  // A spawn that fails is reported back as the incarnation's end, so the restart policy
  // applies to it too.
  kj::Promise<void> carryOut(Actions actions) {
    auto done = kj::heapArrayBuilder<kj::Promise<void>>(actions.size());
    for (auto& action : actions) {
      ActorRecord actor = kj::mv(action.actor);
      bool spawn = action.kind == WorkerAction::Kind::kSpawn;
      if (spawn && action.delay.count() > 0) {
        done.add(delayedSpawn(kj::mv(actor), action.delay));
        continue;
      }
      // Deadlines: an agent answers a kill at once and a spawn once forked. Only a broken
      // connection is dropped (DISCONNECTED: its keepalive ended it, or noteDeaths broke it for a
      // DEAD node); an error of one spawn or kill, or its deadline, fails that action alone, as
      // the other calls in flight on the connection are fine.
      auto& timer = asyncIo_.provider->getTimer();
      done.add(nodeAgent(actor.nodeId)
                     .then([actor, spawn, &timer](rpc::NodeAgent::Client agent) mutable -> kj::Promise<void> {
                       if (!spawn) {
                         auto kill = agent.killWorkerRequest();
                         kill.setId(actor.id.hex());
                         kill.setIncarnation(actor.incarnation);
                         return timer.timeoutAfter(kKillDeadline, kill.send().ignoreResult());
                       }
                       auto request = agent.spawnWorkerRequest();
                       toActorInfo(actor, request.initActor());
                       request.setInitArgs(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(actor.initArgs.data()),
                                                               actor.initArgs.size()));
                       return timer.timeoutAfter(kSpawnDeadline, request.send().ignoreResult());
                     })
                     .catch_([this, actor, spawn](kj::Exception&& e) -> kj::Promise<void> {
                       if (e.getType() == kj::Exception::Type::DISCONNECTED) dropNodeAgent(actor.nodeId);
                       if (!spawn) return kj::READY_NOW;  // its node is gone: so is the worker
                       std::string reason = fmt::format("could not start its worker on node {}: {}", actor.nodeId.hex(),
                                                        statusFromException(e, "").message());
                       auto id = actor.id;
                       auto incarnation = actor.incarnation;
                       return onIo([id, incarnation, reason](Controller::IoState& s) -> Result<Actions> {
                                Actions next;
                                TROUPE_RETURN_IF_ERROR(s.core.workerExited(id, incarnation, reason, next));
                                return next;
                              })
                           .then([this](Actions next) {
                             execute(kj::mv(next));
                             notifyWaiters();
                           });
                     }));
    }
    return kj::joinPromises(done.finish());
  }

  // A restart under back-off: spawned after `delay` unless the actor was killed, or restarted
  // otherwise, meanwhile.
  kj::Promise<void> delayedSpawn(ActorRecord actor, std::chrono::milliseconds delay) {
    TROUPE_LOG(kInfo, "actor {} ended soon after it started: restarting it in {} ms", actor.id.hex(), delay.count());
    return asyncIo_.provider->getTimer()
        .afterDelay(delay.count() * kj::MILLISECONDS)
        .then([this, id = actor.id]() { return onIo([id](Controller::IoState& s) { return s.core.getActor(id); }); })
        .then([this, actor](ActorRecord now) mutable -> kj::Promise<void> {
          if (now.incarnation != actor.incarnation || now.state == ActorState::kDead || now.nodeId != actor.nodeId) {
            return kj::READY_NOW;
          }
          Actions again;
          again.push_back({WorkerAction::Kind::kSpawn, kj::mv(actor)});
          return carryOut(kj::mv(again));
        })
        .catch_([id = actor.id](kj::Exception&& e) {
          TROUPE_LOG(kWarning, "restarting actor {}: {}", id.hex(), e.getDescription().cStr());
        });
  }

  // Forgets a broken connection to a node's agent (the next action connects anew). It is
  // destroyed on a later turn: destroyed now, the calls still in flight on it would reject with
  // "RpcSystem was destroyed" instead of the connection's own error.
  void dropNodeAgent(NodeId id) {
    auto it = nodes_.find(id);
    if (it == nodes_.end()) return;
    tasks_.add(kj::evalLater([old = kj::mv(it->second)]() {}));
    nodes_.erase(it);
  }

  // A connection to a node's agent, made on first use and kept.
  kj::Promise<rpc::NodeAgent::Client> nodeAgent(NodeId id) {
    auto it = nodes_.find(id);
    if (it != nodes_.end()) return it->second.cap;
    return onIo([id](Controller::IoState& s) -> Result<NodeRecord> {
             auto node = s.store->getNode(id);
             if (!node.isOk()) return node.status();
             if (!node->has_value()) return Status(StatusCode::kNotFound, fmt::format("no node {}", id.hex()));
             return **node;
           })
        .then([this](NodeRecord node) {
          auto address = valueOrThrow(parseHostPort(node.address));
          return RpcClient::connect(asyncIo_, address, token_, 5 * kj::SECONDS);
        })
        .then([this, id](kj::Own<RpcClient> client) -> rpc::NodeAgent::Client {
          auto it = nodes_.find(id);
          if (it != nodes_.end()) return it->second.cap;  // another call connected first
          auto cap = client->bootstrap<rpc::NodeAgent>();
          nodes_.emplace(id, NodeConnection{kj::mv(client), cap});
          return cap;
        });
  }

  // Resolves with the actor once it reaches minIncarnation (ALIVE, if requireAlive) or is DEAD,
  // or at the deadline.
  kj::Promise<ActorRecord> waitFor(ActorId id, uint32_t minIncarnation, bool requireAlive, kj::TimePoint deadline) {
    return onIo([id](Controller::IoState& s) { return s.core.getActor(id); })
        .then([this, id, minIncarnation, requireAlive, deadline](ActorRecord actor) -> kj::Promise<ActorRecord> {
          bool done = actor.state == ActorState::kDead ||
                      (actor.incarnation >= minIncarnation && (actor.state == ActorState::kAlive || !requireAlive));
          auto& timer = asyncIo_.provider->getTimer();
          if (done || timer.now() >= deadline) return actor;
          auto paf = kj::newPromiseAndFulfiller<void>();
          waiters_.push_back(kj::mv(paf.fulfiller));
          return paf.promise.exclusiveJoin(timer.atTime(deadline)).then([this, id, minIncarnation, requireAlive, deadline]() {
            return waitFor(id, minIncarnation, requireAlive, deadline);
          });
        });
  }

  void notifyWaiters() {
    std::vector<kj::Own<kj::PromiseFulfiller<void>>> waiters;
    waiters.swap(waiters_);
    for (auto& w : waiters) w->fulfill();
  }

  void taskFailed(kj::Exception&& e) override {
    TROUPE_LOG(kWarning, "controller background task failed: {}", e.getDescription().cStr());
  }

  class SessionImpl final : public rpc::Session::Server {
   public:
    SessionImpl(ControllerService& service, std::string id, uint64_t generation)
        : service_(service), alive_(service.alive_), id_(std::move(id)), generation_(generation) {}
    ~SessionImpl() noexcept(false) {
      if (!*alive_) return;
      auto it = service_.attached_.find(id_);
      if (it != service_.attached_.end() && it->second == generation_) service_.sessionEnded(id_);
    }

   private:
    ControllerService& service_;
    std::shared_ptr<bool> alive_;  // false once the service is gone
    std::string id_;
    uint64_t generation_;  // a resumed session's earlier connections end nothing
  };

  struct NodeConnection {
    kj::Own<RpcClient> client;
    rpc::NodeAgent::Client cap;
  };

  kj::AsyncIoContext& asyncIo_;
  IoThread& io_;
  std::shared_ptr<Controller::IoState> state_;
  RedisOptions redis_;
  std::chrono::milliseconds ttl_;
  std::chrono::milliseconds reapInterval_;
  std::optional<std::chrono::steady_clock::time_point> storeLostAt_;  // the failure detector's outage
  std::chrono::steady_clock::time_point storeLostLogged_;
  uint64_t storeLostFailures_ = 0;
  std::string token_;
  std::map<NodeId, NodeConnection> nodes_;
  std::vector<kj::Own<kj::PromiseFulfiller<void>>> waiters_;
  // Nodes this controller declared DEAD (the last kKeptDeaths of deathCount_), for watchNodeDeaths.
  static constexpr size_t kKeptDeaths = 1024;
  const uint64_t instance_ = std::stoull(randomHex(7), nullptr, 16) + 1;  // never 0: "no instance"
  std::deque<std::string> deaths_;
  uint64_t deathCount_ = 0;
  bool deathsUntold_ = false;  // reconciliation has not yet told the waiters of the last deaths
  std::vector<kj::Own<kj::PromiseFulfiller<void>>> deathWaiters_;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
  std::map<std::string, uint64_t> attached_;  // sessions open on this controller -> generation
  uint64_t sessionGeneration_ = 0;
  bool reconciling_ = false;
  bool reconcileAgain_ = false;
  kj::TaskSet tasks_;
  BatchQueue<ActorRecord, ActorRecord> creates_;
  BatchQueue<ControllerCore::ReadyReport, ActorRecord> readies_;

 public:
  ~ControllerService() noexcept(false) { *alive_ = false; }
};

}  // namespace

Result<kj::Own<Controller>> Controller::start(kj::AsyncIoContext& io, IoThread& ioThread, ControllerOptions options) {
  auto store = connectRedisStore(options.redis);
  if (!store.isOk()) return store.status();
  TROUPE_ASSIGN_OR_RETURN(auto meta, (*store)->getMeta());

  ClusterMeta cluster;
  if (meta.has_value()) {
    cluster = *meta;
    TROUPE_LOG(kInfo, "continuing cluster '{}' found in Redis (created at {} ms)", options.redis.cluster,
               cluster.createdMs);
  } else {
    if (options.token.empty()) {
      return Status(StatusCode::kInvalidArgument, "a new cluster needs a token (none in Redis, none given)");
    }
    cluster.token = options.token;
    cluster.createdMs = wallClockMs();
  }

  auto state = std::make_shared<IoState>(std::move(*store));
  kj::Own<Controller> controller(new Controller(ioThread, state, cluster.token),
                                 kj::_::HeapDisposer<Controller>::instance);
  auto service = kj::heap<ControllerService>(io, ioThread, state, options.redis, options.heartbeatTtl,
                                             options.reapInterval, cluster.token);
  TROUPE_ASSIGN_OR_RETURN(auto server, RpcServer::listen(io, options.bind, cluster.token, rpc::Controller::Client(kj::mv(service))));
  controller->server_ = kj::mv(server);

  // Recorded only once we listen, so the address in Redis is always one that answers. The
  // store is used from this thread only until the service's first I/O-thread call.
  cluster.controllerAddress = HostPort{options.bind.host, controller->port()}.toString();
  cluster.controllerPid = getpid();
  auto put = ioThread.call([state, cluster]() { return state->store->putMeta(cluster); }).wait(io.waitScope);
  if (!put.isOk()) return put;
  TROUPE_LOG(kInfo, "controller listening on {}", cluster.controllerAddress);
  return controller;
}

Controller::~Controller() { state_->serving = false; }

}  // namespace troupe
