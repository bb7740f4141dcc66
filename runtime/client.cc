// GCC 12 reports kj::Maybe<std::string> inside promise nodes as maybe-uninitialized: a known
// false positive of its optimizer with unions; the value is always set before it is read.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "troupe/runtime/client.h"

#include <fmt/format.h>

#include "schema_convert.h"
#include "troupe.capnp.h"
#include "troupe/runtime/logging.h"
#include "troupe/runtime/rpc.h"

namespace troupe {

namespace {
constexpr uint32_t kWaitChunkMs = 30000;  // a pending actor is waited for in chunks of this

[[noreturn]] void fail(kj::Exception::Type type, const std::string& message) {
  kj::throwFatalException(kj::Exception(type, __FILE__, __LINE__, kj::str(message.c_str())));
}

// KJ prefixes errors that crossed an RPC; the user wants the message.
std::string plainDescription(const kj::Exception& e) {
  std::string d = e.getDescription().cStr();
  const std::string prefix = "remote exception: ";
  if (d.rfind(prefix, 0) == 0) d = d.substr(prefix.size());
  return d;
}

class LogErrors final : public kj::TaskSet::ErrorHandler {
 public:
  void taskFailed(kj::Exception&& e) override { TROUPE_LOG(kDebug, "client task: {}", e.getDescription().cStr()); }
};
LogErrors gLogErrors;
}  // namespace

struct ClusterClient::Shared {
  Shared(kj::AsyncIoContext& io, std::string token, kj::Own<RpcClient> rpc)
      : io(io), token(std::move(token)), rpc(kj::mv(rpc)), controller(this->rpc->bootstrap<rpc::Controller>()),
        tasks(gLogErrors) {}
  kj::AsyncIoContext& io;
  std::string token;
  kj::Own<RpcClient> rpc;
  rpc::Controller::Client controller;
  kj::TaskSet tasks;  // deferred clean-up

  kj::Promise<ActorRecord> waitActor(const ActorId& id, uint32_t minIncarnation, bool requireAlive, uint32_t timeoutMs) {
    auto request = controller.waitActorRequest();
    request.setId(id.hex());
    request.setMinIncarnation(minIncarnation);
    request.setRequireAlive(requireAlive);
    request.setTimeoutMs(timeoutMs);
    return request.send().then([](auto response) { return fromActorInfo(response.getActor()); });
  }
};

// One actor as seen by this client: the current incarnation's connection, shared by handles.
struct ActorConnection {
  std::shared_ptr<ClusterClient::Shared> shared;
  ActorId id;
  std::string type = "actor";
  int32_t maxTaskRetries = 0;
  uint32_t minIncarnation = 1;  // do not use incarnations older than this
  uint32_t incarnation = 0;     // of `cap`
  kj::Own<RpcClient> rpc;
  kj::Maybe<rpc::Actor::Client> cap;
  kj::Maybe<kj::ForkedPromise<void>> resolving;

  std::string died(const ActorRecord& r) const { return fmt::format("actor {} ({}) died: {}", id.hex(), type, r.deathReason); }

  void learn(const ActorRecord& r) {
    if (!r.type.empty()) type = r.type;
    maxTaskRetries = r.maxTaskRetries;
  }

  // Drops the connection to `inc` (its worker is gone); later calls resolve a newer one.
  void forget(uint32_t inc) {
    minIncarnation = std::max(minIncarnation, inc + 1);
    if (incarnation != inc) return;
    cap = nullptr;
    resolving = nullptr;
    // Destroyed on a later turn: we may be inside one of its own callbacks.
    if (rpc) shared->tasks.add(kj::evalLater([old = kj::mv(rpc)]() {}));
  }
};

namespace {

kj::Promise<void> connectAlive(std::shared_ptr<ActorConnection> c) {
  return c->shared->waitActor(c->id, c->minIncarnation, true, kWaitChunkMs)
      .then([c](ActorRecord record) -> kj::Promise<void> {
        c->learn(record);
        if (record.state == ActorState::kDead) fail(kj::Exception::Type::FAILED, c->died(record));
        if (record.state != ActorState::kAlive || record.incarnation < c->minIncarnation) {
          return connectAlive(c);  // still starting or waiting for resources
        }
        auto address = parseHostPort(record.address);
        if (!address.isOk()) throwStatus(address.status());
        uint32_t inc = record.incarnation;
        return RpcClient::connect(c->shared->io, *address, c->shared->token, 5 * kj::SECONDS)
            .then(
                [c, inc](kj::Own<RpcClient> client) -> kj::Promise<void> {
                  c->cap = client->bootstrap<rpc::Actor>();
                  // Once the worker's connection drops, later calls go to the next incarnation.
                  std::weak_ptr<ActorConnection> weak = c;
                  c->shared->tasks.add(client->onDisconnect().then([weak, inc]() {
                    if (auto alive = weak.lock()) alive->forget(inc);
                  }));
                  c->rpc = kj::mv(client);
                  c->incarnation = inc;
                  return kj::READY_NOW;
                },
                [c, inc](kj::Exception&&) -> kj::Promise<void> {
                  // It died between reporting ready and our connect: wait for what comes next.
                  c->minIncarnation = std::max(c->minIncarnation, inc + 1);
                  return connectAlive(c);
                });
      });
}

kj::Promise<std::pair<rpc::Actor::Client, uint32_t>> resolve(std::shared_ptr<ActorConnection> c) {
  KJ_IF_MAYBE(cap, c->cap) { return std::make_pair(*cap, c->incarnation); }
  if (c->resolving == nullptr) c->resolving = connectAlive(c).fork();
  KJ_IF_MAYBE(r, c->resolving) {
    return r->addBranch().then(
        [c]() -> kj::Promise<std::pair<rpc::Actor::Client, uint32_t>> { return resolve(c); },
        [c](kj::Exception&& e) -> kj::Promise<std::pair<rpc::Actor::Client, uint32_t>> {
          c->resolving = nullptr;  // the next call tries again
          kj::throwFatalException(kj::mv(e));
        });
  }
  KJ_UNREACHABLE;
}

kj::Promise<std::string> callActor(std::shared_ptr<ActorConnection> c, std::string method, std::string payload,
                                   int attempt) {
  return resolve(c).then([c, method, payload, attempt](std::pair<rpc::Actor::Client, uint32_t> target) mutable {
    uint32_t inc = target.second;
    auto request = target.first.callRequest();
    request.setMethod(method);
    request.setPayload(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(payload.data()), payload.size()));
    return request.send().then(
        [](capnp::Response<rpc::Actor::CallResults> response) -> kj::Promise<std::string> {
          auto r = response.getResult();
          return std::string(reinterpret_cast<const char*>(r.begin()), r.size());
        },
        [c, method, payload, attempt, inc](kj::Exception&& e) mutable -> kj::Promise<std::string> {
          if (e.getType() != kj::Exception::Type::DISCONNECTED) {
            fail(kj::Exception::Type::FAILED, fmt::format("actor {} ({}).{}: {}", c->id.hex(), c->type, method,
                                                          plainDescription(e)));
          }
          // The worker is gone. Learn why from the controller once it has handled the exit.
          c->forget(inc);
          return c->shared->waitActor(c->id, inc + 1, false, 10000)
              .then([c, method, payload, attempt, inc](ActorRecord record) mutable -> kj::Promise<std::string> {
                c->learn(record);
                if (record.state == ActorState::kDead) fail(kj::Exception::Type::FAILED, c->died(record));
                if (record.incarnation <= inc) {
                  fail(kj::Exception::Type::DISCONNECTED,
                       fmt::format("actor {} ({}): lost the connection to its worker; no exit was reported within 10 s",
                                   c->id.hex(), c->type));
                }
                if (c->maxTaskRetries == -1 || attempt < c->maxTaskRetries) {
                  return callActor(c, kj::mv(method), kj::mv(payload), attempt + 1);
                }
                fail(kj::Exception::Type::FAILED,
                     fmt::format("actor {} ({}) died: {} (during '{}'; it is restarting as incarnation {}; the call "
                                 "was not retried: max_task_retries={})",
                                 c->id.hex(), c->type, record.deathReason, method, record.incarnation,
                                 c->maxTaskRetries));
              });
        });
  });
}

std::shared_ptr<ActorConnection> connectionFor(std::shared_ptr<ClusterClient::Shared> shared, const ActorRecord& r) {
  auto c = std::make_shared<ActorConnection>();
  c->shared = std::move(shared);
  c->id = r.id;
  c->learn(r);
  return c;
}

void toSpec(const ActorOptions& o, rpc::ActorSpec::Builder spec) {
  spec.setType(o.type);
  spec.setName(o.name);
  toResources(o.resources, spec.initResources(static_cast<unsigned>(o.resources.size())));
  spec.setMaxRestarts(o.maxRestarts);
  spec.setMaxTaskRetries(o.maxTaskRetries);
  spec.setDetached(o.detached);
  spec.setInitArgs(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(o.initArgs.data()), o.initArgs.size()));
  spec.setPlacementGroup(o.placementGroup.hex());
  spec.setBundleIndex(o.bundleIndex);
}

void toBundles(const std::vector<Resources>& bundles, capnp::List<rpc::BundleInfo>::Builder out) {
  for (unsigned i = 0; i < bundles.size(); ++i) {
    toResources(bundles[i], out[i].initResources(static_cast<unsigned>(bundles[i].size())));
  }
}

}  // namespace

const ActorId& ActorHandle::id() const { return connection_->id; }

kj::Promise<std::string> ActorHandle::call(std::string method, std::string payload) {
  return callActor(connection_, kj::mv(method), kj::mv(payload), 0);
}

kj::Promise<capnp::Capability::Client> ActorHandle::typedCapability() {
  return resolve(connection_).then([](std::pair<rpc::Actor::Client, uint32_t> target) -> capnp::Capability::Client {
    return target.first.typedRequest().send().getCap();
  });
}

kj::Promise<ActorRecord> ActorHandle::ready() {
  auto c = connection_;
  return resolve(c).then([c](std::pair<rpc::Actor::Client, uint32_t>) {
    return c->shared->waitActor(c->id, c->incarnation, true, 0);
  });
}

kj::Promise<kj::Own<ClusterClient>> ClusterClient::connect(kj::AsyncIoContext& io, const HostPort& controller,
                                                          std::string token) {
  return RpcClient::connect(io, controller, token, 10 * kj::SECONDS).then([&io, token](kj::Own<RpcClient> rpc) {
    return kj::Own<ClusterClient>(new ClusterClient(std::make_shared<Shared>(io, token, kj::mv(rpc))),
                                  kj::_::HeapDisposer<ClusterClient>::instance);
  });
}

ClusterClient::~ClusterClient() = default;

kj::Promise<ActorHandle> ClusterClient::submitActor(ActorOptions options) {
  auto request = shared_->controller.createActorRequest();
  request.setId(ActorId::generate().hex());
  toSpec(options, request.initSpec());
  auto shared = shared_;
  return request.send().then([shared](auto response) {
    return ActorHandle(connectionFor(shared, fromActorInfo(response.getActor())));
  });
}

kj::Promise<ActorHandle> ClusterClient::createActor(ActorOptions options) {
  return submitActor(kj::mv(options)).then([](ActorHandle handle) {
    return handle.ready().then([handle](ActorRecord) { return handle; });
  });
}

kj::Promise<ActorHandle> ClusterClient::getActor(const std::string& name) {
  auto request = shared_->controller.getActorByNameRequest();
  request.setName(name);
  auto shared = shared_;
  return request.send().then([shared](auto response) {
    return ActorHandle(connectionFor(shared, fromActorInfo(response.getActor())));
  });
}

ActorHandle ClusterClient::actor(const ActorId& id) {
  ActorRecord r;
  r.id = id;
  return ActorHandle(connectionFor(shared_, r));
}

kj::Promise<void> ClusterClient::kill(const ActorHandle& actor, bool noRestart) {
  auto request = shared_->controller.killActorRequest();
  request.setId(actor.id().hex());
  request.setNoRestart(noRestart);
  return request.send().ignoreResult();
}

kj::Promise<ActorRecord> ClusterClient::actorInfo(const ActorId& id) { return shared_->waitActor(id, 0, false, 0); }

kj::Promise<std::vector<ActorRecord>> ClusterClient::listActors() {
  return shared_->controller.statusRequest().send().then([](auto response) {
    std::vector<ActorRecord> out;
    for (auto a : response.getActors()) out.push_back(fromActorInfo(a));
    return out;
  });
}

kj::Promise<PlacementGroupRecord> ClusterClient::createPlacementGroup(PlacementStrategy strategy,
                                                                      std::vector<Resources> bundles, std::string name) {
  auto request = shared_->controller.createPlacementGroupRequest();
  request.setId(PlacementGroupId::generate().hex());
  request.setName(name);
  request.setStrategy(placementStrategyName(strategy));
  toBundles(bundles, request.initBundles(static_cast<unsigned>(bundles.size())));
  return request.send().then([](auto response) { return fromPlacementGroupInfo(response.getGroup()); });
}

kj::Promise<PlacementGroupRecord> ClusterClient::placementGroup(const PlacementGroupId& id) {
  auto request = shared_->controller.getPlacementGroupRequest();
  request.setId(id.hex());
  return request.send().then([](auto response) { return fromPlacementGroupInfo(response.getGroup()); });
}

kj::Promise<void> ClusterClient::removePlacementGroup(const PlacementGroupId& id) {
  auto request = shared_->controller.removePlacementGroupRequest();
  request.setId(id.hex());
  return request.send().ignoreResult();
}

kj::Promise<PlacementGroupRecord> ClusterClient::addBundles(const PlacementGroupRecord& group,
                                                            std::vector<Resources> bundles) {
  auto request = shared_->controller.addBundlesRequest();
  request.setId(group.id.hex());
  request.setFromIndex(static_cast<uint32_t>(group.bundles.size()));
  toBundles(bundles, request.initBundles(static_cast<unsigned>(bundles.size())));
  return request.send().then([](auto response) { return fromPlacementGroupInfo(response.getGroup()); });
}

kj::Promise<PlacementGroupRecord> ClusterClient::removeBundles(const PlacementGroupId& id,
                                                               std::vector<uint32_t> indices) {
  auto request = shared_->controller.removeBundlesRequest();
  request.setId(id.hex());
  auto list = request.initIndices(static_cast<unsigned>(indices.size()));
  for (unsigned i = 0; i < indices.size(); ++i) list.set(i, indices[i]);
  return request.send().then([](auto response) { return fromPlacementGroupInfo(response.getGroup()); });
}

}  // namespace troupe
