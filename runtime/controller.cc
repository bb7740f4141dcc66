#include "controller.h"

#include <unistd.h>

#include <asio/steady_timer.hpp>

#include "schema_convert.h"
#include "troupe.capnp.h"
#include "troupe/runtime/logging.h"

namespace troupe {

// Everything the I/O thread touches. Pending handlers hold a shared_ptr, so it outlives the
// Controller until the last handler has run.
struct Controller::IoState {
  IoState(asio::io_context& context, std::unique_ptr<ClusterStore> s) : store(std::move(s)), timer(context) {}
  std::unique_ptr<ClusterStore> store;
  asio::steady_timer timer;
  std::chrono::milliseconds reapInterval{250};
  bool stopping = false;
};

namespace {

void scheduleReap(std::shared_ptr<Controller::IoState> state) {
  state->timer.expires_after(state->reapInterval);
  state->timer.async_wait([state](const std::error_code& ec) {
    if (ec || state->stopping) return;
    auto dead = state->store->reapExpiredNodes();
    if (!dead.isOk()) {
      TROUPE_LOG(kWarning, "failure detector cannot read Redis: {}", dead.status().toString());
    } else {
      for (const auto& id : *dead) TROUPE_LOG(kWarning, "node {} missed its heartbeat: marked DEAD", id.hex());
    }
    scheduleReap(state);
  });
}

class ControllerService final : public rpc::Controller::Server {
 public:
  ControllerService(IoThread& io, std::shared_ptr<Controller::IoState> state, RedisOptions redis,
                    std::chrono::milliseconds ttl)
      : io_(io), state_(std::move(state)), redis_(std::move(redis)), ttl_(ttl) {}

 protected:
  kj::Promise<void> ping(PingContext context) override {
    auto results = context.getResults();
    results.setPid(getpid());
    results.setVersion("0.1.0");
    return kj::READY_NOW;
  }

  kj::Promise<void> registerNode(RegisterNodeContext context) override {
    NodeRecord node = fromNodeInfo(context.getParams().getNode());
    if (node.id.empty() || node.address.empty()) {
      throwStatus(Status(StatusCode::kInvalidArgument, "registerNode needs a node id and an address"));
    }
    node.state = NodeState::kAlive;
    node.deathReason.clear();
    node.registeredMs = node.lastHeartbeatMs = wallClockMs();
    auto state = state_;
    auto ttl = ttl_;
    return io_.call([state, node, ttl]() { return state->store->registerNode(node, ttl); })
        .then([this, context, node](Status status) mutable {
          if (!status.isOk()) throwStatus(status);
          TROUPE_LOG(kInfo, "node {} registered from {} ({})", node.id.hex(), node.address, node.hostname);
          auto redis = context.getResults().initRedis();
          redis.setAddress(HostPort{redis_.host, redis_.port}.toString());
          redis.setPassword(redis_.password);
          redis.setCluster(redis_.cluster);
          redis.setHeartbeatTtlMs(static_cast<uint32_t>(ttl_.count()));
        });
  }

  kj::Promise<void> status(StatusContext context) override {
    auto state = state_;
    return io_.call([state]() { return state->store->listNodes(); })
        .then([context](Result<std::vector<NodeRecord>> nodes) mutable {
          if (!nodes.isOk()) throwStatus(nodes.status());
          auto list = context.getResults().initNodes(static_cast<unsigned>(nodes->size()));
          for (unsigned i = 0; i < nodes->size(); ++i) toNodeInfo((*nodes)[i], list[i]);
        });
  }

 private:
  IoThread& io_;
  std::shared_ptr<Controller::IoState> state_;
  RedisOptions redis_;
  std::chrono::milliseconds ttl_;
};

}  // namespace

Result<kj::Own<Controller>> Controller::start(kj::AsyncIoContext& io, IoThread& ioThread,
                                              ControllerOptions options) {
  auto store = connectRedisStore(options.redis);
  if (!store.isOk()) return store.status();
  auto meta = (*store)->getMeta();
  if (!meta.isOk()) return meta.status();

  ClusterMeta cluster;
  if (meta->has_value()) {
    cluster = **meta;
    TROUPE_LOG(kInfo, "continuing cluster '{}' found in Redis (created at {} ms)", options.redis.cluster,
               cluster.createdMs);
  } else {
    if (options.token.empty()) {
      return Status(StatusCode::kInvalidArgument, "a new cluster needs a token (none in Redis, none given)");
    }
    cluster.token = options.token;
    cluster.createdMs = wallClockMs();
  }

  auto state = std::make_shared<IoState>(ioThread.context(), std::move(*store));
  state->reapInterval = options.reapInterval;
  kj::Own<Controller> controller(new Controller(ioThread, state, cluster.token), kj::_::HeapDisposer<Controller>::instance);
  auto service = kj::heap<ControllerService>(ioThread, state, options.redis, options.heartbeatTtl);
  auto server = RpcServer::listen(io, options.bind, cluster.token, rpc::Controller::Client(kj::mv(service)));
  if (!server.isOk()) return server.status();
  controller->server_ = kj::mv(*server);

  // Recorded only once we listen, so the address in Redis is always one that answers.
  cluster.controllerAddress = HostPort{options.bind.host, controller->port()}.toString();
  cluster.controllerPid = getpid();
  // The store is handed to the I/O thread below; until then this thread may use it.
  TROUPE_RETURN_IF_ERROR(state->store->putMeta(cluster));
  asio::post(ioThread.context(), [state]() { scheduleReap(state); });
  TROUPE_LOG(kInfo, "controller listening on {}", cluster.controllerAddress);
  return controller;
}

Controller::~Controller() {
  auto state = state_;
  asio::post(ioThread_.context(), [state]() {
    state->stopping = true;
    state->timer.cancel();
  });
}

}  // namespace troupe
