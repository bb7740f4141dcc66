#include "node_agent.h"

#include <unistd.h>

#include <asio/steady_timer.hpp>

#include "schema_convert.h"
#include "troupe.capnp.h"
#include "troupe/runtime/logging.h"

namespace troupe {

// Everything the I/O thread touches; pending handlers share ownership.
struct NodeAgent::IoState {
  explicit IoState(asio::io_context& context) : timer(context) {}
  NodeId id;
  std::unique_ptr<ClusterStore> store;
  asio::steady_timer timer;
  std::chrono::milliseconds ttl{3000};
  bool stopping = false;
  int failures = 0;
  kj::Own<kj::CrossThreadPromiseFulfiller<std::string>> fatal;
};

namespace {

void scheduleHeartbeat(std::shared_ptr<NodeAgent::IoState> state) {
  // Three beats per TTL: one lost or late beat never expires the node.
  state->timer.expires_after(state->ttl / 3);
  state->timer.async_wait([state](const std::error_code& ec) {
    if (ec || state->stopping) return;
    auto alive = state->store->heartbeat(state->id, state->ttl);
    if (!alive.isOk()) {
      if (state->failures++ % 10 == 0) {
        TROUPE_LOG(kWarning, "heartbeat failed ({} in a row): {}", state->failures, alive.status().toString());
      }
    } else if (!*alive) {
      state->fatal->fulfill("the cluster declared this node dead (its heartbeat expired); exiting");
      return;
    } else {
      state->failures = 0;
    }
    scheduleHeartbeat(state);
  });
}

class NodeAgentService final : public rpc::NodeAgent::Server {
 public:
  explicit NodeAgentService(NodeId id) : id_(std::move(id)) {}

 protected:
  kj::Promise<void> ping(PingContext context) override {
    auto results = context.getResults();
    results.setNodeId(id_.hex());
    results.setPid(getpid());
    return kj::READY_NOW;
  }

 private:
  NodeId id_;
};

std::string hostName() {
  char buf[256] = {};
  gethostname(buf, sizeof(buf) - 1);
  return buf;
}

}  // namespace

NodeAgent::NodeAgent(IoThread& ioThread, NodeAgentOptions options)
    : ioThread_(ioThread), options_(std::move(options)),
      state_(std::make_shared<IoState>(ioThread.context())) {
  state_->id = options_.id;
  auto paf = kj::newPromiseAndCrossThreadFulfiller<std::string>();
  state_->fatal = kj::mv(paf.fulfiller);
  fatal_ = kj::mv(paf.promise);
}

kj::Promise<kj::Own<NodeAgent>> NodeAgent::start(kj::AsyncIoContext& io, IoThread& ioThread,
                                                 NodeAgentOptions options) {
  kj::Own<NodeAgent> agent(new NodeAgent(ioThread, kj::mv(options)), kj::_::HeapDisposer<NodeAgent>::instance);
  auto server = RpcServer::listen(io, HostPort{agent->options_.ip, 0}, agent->options_.token,
                                  rpc::NodeAgent::Client(kj::heap<NodeAgentService>(agent->options_.id)));
  if (!server.isOk()) throwStatus(server.status());
  agent->server_ = kj::mv(*server);

  auto& a = *agent;
  return RpcClient::connect(io, a.options_.controller, a.options_.token, 10 * kj::SECONDS)
      .then([&a](kj::Own<RpcClient> client) {
        a.controller_ = kj::mv(client);
        NodeRecord self;
        self.id = a.options_.id;
        self.address = HostPort{a.options_.ip, a.server_->port()}.toString();
        self.hostname = hostName();
        self.pid = getpid();
        self.isHead = a.options_.isHead;
        self.total = a.options_.resources;
        for (const auto& [name, qty] : self.total) self.used[name] = 0;
        self.labels = a.options_.labels;
        auto request = a.controller_->bootstrap<rpc::Controller>().registerNodeRequest();
        toNodeInfo(self, request.initNode());
        return request.send();
      })
      .then([&a](capnp::Response<rpc::Controller::RegisterNodeResults> response) {
        auto endpoint = response.getRedis();
        auto hp = parseHostPort(endpoint.getAddress().cStr());
        if (!hp.isOk()) throwStatus(hp.status());
        RedisOptions redis;
        redis.host = hp->host;
        redis.port = hp->port;
        redis.password = endpoint.getPassword().cStr();
        redis.cluster = endpoint.getCluster().cStr();
        a.state_->ttl = std::chrono::milliseconds(endpoint.getHeartbeatTtlMs());
        // The store is created on the I/O thread, which owns it from then on.
        auto state = a.state_;
        return a.ioThread_.call([state, redis]() {
          auto store = connectRedisStore(redis);
          if (!store.isOk()) return store.status();
          state->store = std::move(*store);
          scheduleHeartbeat(state);
          return Status::ok();
        });
      })
      .then([agent = kj::mv(agent)](Status status) mutable {
        if (!status.isOk()) throwStatus(status);
        TROUPE_LOG(kInfo, "node {} registered; serving on {}:{}", agent->options_.id.hex(), agent->options_.ip,
                   agent->server_->port());
        return kj::mv(agent);
      });
}

kj::Promise<void> NodeAgent::shutdown(std::string reason) {
  auto state = state_;
  return ioThread_.call([state, reason]() {
           state->stopping = true;
           state->timer.cancel();
           return state->store ? state->store->markNodeDead(state->id, reason) : Status::ok();
         })
      .then([](Status status) {
        if (!status.isOk()) TROUPE_LOG(kWarning, "could not record the node's stop: {}", status.toString());
      });
}

NodeAgent::~NodeAgent() {
  auto state = state_;
  asio::post(ioThread_.context(), [state]() {
    state->stopping = true;
    state->timer.cancel();
  });
}

}  // namespace troupe
