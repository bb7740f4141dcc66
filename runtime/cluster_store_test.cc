// One suite, two stores: every TEST_CASE_TEMPLATE runs against the in-memory fake and against
// a real redis-server child, so the fake cannot drift from Redis unnoticed.
#include <doctest/doctest.h>
#include <hiredis/hiredis.h>
#include <signal.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "testing/redis_server.h"
#include "troupe/runtime/cluster_store.h"
#include "troupe/runtime/config.h"
#include "troupe/runtime/process.h"

namespace troupe {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Short enough to keep the suite fast, long enough that a loaded machine does not miss a
// heartbeat sent every ~20 ms.
constexpr std::chrono::milliseconds kShortTtl{300};
constexpr std::chrono::milliseconds kLongTtl{60'000};

struct FakeBackend {
  std::shared_ptr<FakeClusterState> state = makeFakeClusterState();
  std::unique_ptr<ClusterStore> open() { return makeFakeClusterStore(state); }
};

struct RedisBackend {
  testing::RedisServerProcess server;
  std::unique_ptr<ClusterStore> open() {
    auto store = connectRedisStore(server.options("test"));
    REQUIRE_MESSAGE(store.isOk(), store.status().toString());
    return std::move(store).value();
  }
};

#define TROUPE_STORE_BACKENDS FakeBackend, RedisBackend

NodeRecord sampleNode(std::string hostname = "worker-1") {
  NodeRecord node;
  node.id = NodeId::generate();
  node.address = "127.0.0.1:4242";
  node.hostname = std::move(hostname);
  node.pid = 31337;
  node.isHead = false;
  node.total = {{"CPU", 8}, {"GPU", 2}, {"memory", 17179869184.0}, {"custom_slot", 0.5}};
  node.used = {{"CPU", 1.25}};
  node.labels = {{"zone", "eu-west-1a"}, {"rack", "r7"}};
  node.registeredMs = wallClockMs();
  return node;
}

// Same record, ignoring the fields the store owns (state, timestamps, death reason).
void checkSameNode(const NodeRecord& got, const NodeRecord& want) {
  CHECK(got.id == want.id);
  CHECK(got.address == want.address);
  CHECK(got.hostname == want.hostname);
  CHECK(got.pid == want.pid);
  CHECK(got.isHead == want.isHead);
  CHECK(got.total == want.total);
  CHECK(got.used == want.used);
  CHECK(got.labels == want.labels);
  CHECK(got.registeredMs == want.registeredMs);
}

NodeRecord mustGet(ClusterStore& store, const NodeId& id) {
  auto node = store.getNode(id);
  REQUIRE_MESSAGE(node.isOk(), node.status().toString());
  REQUIRE(node->has_value());
  return **node;
}

// Next event within a deadline, failing the test if none comes.
ClusterEvent mustReceive(EventSubscription& subscription) {
  auto event = subscription.next(5s);
  REQUIRE_MESSAGE(event.isOk(), event.status().toString());
  REQUIRE_MESSAGE(event->has_value(), "no event within 5 s");
  return **event;
}

TEST_CASE_TEMPLATE("meta round trip", Backend, TROUPE_STORE_BACKENDS) {
  Backend backend;
  auto store = backend.open();
  auto empty = store->getMeta();
  REQUIRE(empty.isOk());
  CHECK_FALSE(empty->has_value());

  ClusterMeta meta{"tok-" + randomHex(8), "10.0.0.5:6380", 4711, 1700000000123};
  REQUIRE(store->putMeta(meta).isOk());
  auto got = store->getMeta();
  REQUIRE(got.isOk());
  REQUIRE(got->has_value());
  CHECK((*got)->token == meta.token);
  CHECK((*got)->controllerAddress == meta.controllerAddress);
  CHECK((*got)->controllerPid == meta.controllerPid);
  CHECK((*got)->createdMs == meta.createdMs);

  meta.controllerPid = 4712;  // a restarted controller overwrites it
  REQUIRE(store->putMeta(meta).isOk());
  CHECK((*store->getMeta())->controllerPid == 4712);
}

TEST_CASE_TEMPLATE("register, get and list nodes keep every field", Backend,
                   TROUPE_STORE_BACKENDS) {
  Backend backend;
  auto store = backend.open();
  NodeRecord head = sampleNode("head-host");
  head.isHead = true;
  head.registeredMs = 1000;
  NodeRecord worker = sampleNode("worker-host");
  worker.registeredMs = 2000;
  worker.labels.clear();
  worker.used.clear();
  // Ids in the opposite order to registration times, so sorting by id would be caught.
  head.id = NodeId("ffffffff" + randomHex(4));
  worker.id = NodeId("00000000" + randomHex(4));

  const int64_t before = wallClockMs();
  // Registered out of order: the listing follows registration time, not call order.
  REQUIRE(store->registerNode(worker, kLongTtl).isOk());
  REQUIRE(store->registerNode(head, kLongTtl).isOk());

  NodeRecord got = mustGet(*store, head.id);
  checkSameNode(got, head);
  CHECK(got.state == NodeState::kAlive);
  CHECK(got.deathReason.empty());
  CHECK(got.lastHeartbeatMs >= before);
  checkSameNode(mustGet(*store, worker.id), worker);

  auto missing = store->getNode(NodeId::generate());
  REQUIRE(missing.isOk());
  CHECK_FALSE(missing->has_value());

  auto list = store->listNodes();
  REQUIRE(list.isOk());
  REQUIRE(list->size() == 2);
  checkSameNode((*list)[0], head);
  checkSameNode((*list)[1], worker);

  CHECK(std::string(nodeStateName(NodeState::kAlive)) == "ALIVE");
  CHECK(std::string(nodeStateName(NodeState::kDead)) == "DEAD");
}

TEST_CASE_TEMPLATE("registerNode fills in the registration time when it is zero", Backend,
                   TROUPE_STORE_BACKENDS) {
  Backend backend;
  auto store = backend.open();
  NodeRecord node = sampleNode();
  node.registeredMs = 0;
  const int64_t before = wallClockMs();
  REQUIRE(store->registerNode(node, kLongTtl).isOk());
  CHECK(mustGet(*store, node.id).registeredMs >= before);
}

TEST_CASE_TEMPLATE("re-registering a node is idempotent", Backend, TROUPE_STORE_BACKENDS) {
  Backend backend;
  auto store = backend.open();
  NodeRecord node = sampleNode();
  REQUIRE(store->registerNode(node, kLongTtl).isOk());
  node.used = {{"CPU", 3}};
  REQUIRE(store->registerNode(node, kLongTtl).isOk());
  REQUIRE(store->registerNode(node, kLongTtl).isOk());

  auto list = store->listNodes();
  REQUIRE(list.isOk());
  REQUIRE(list->size() == 1);
  checkSameNode((*list)[0], node);
  CHECK((*list)[0].state == NodeState::kAlive);
}

TEST_CASE_TEMPLATE("heartbeat is accepted only for alive nodes", Backend, TROUPE_STORE_BACKENDS) {
  Backend backend;
  auto store = backend.open();
  NodeRecord node = sampleNode();
  REQUIRE(store->registerNode(node, kLongTtl).isOk());
  const int64_t registeredHeartbeat = mustGet(*store, node.id).lastHeartbeatMs;

  auto alive = store->heartbeat(node.id, kLongTtl);
  REQUIRE(alive.isOk());
  CHECK(*alive);
  CHECK(mustGet(*store, node.id).lastHeartbeatMs >= registeredHeartbeat);

  auto unknown = store->heartbeat(NodeId::generate(), kLongTtl);
  REQUIRE(unknown.isOk());
  CHECK_FALSE(*unknown);

  REQUIRE(store->markNodeDead(node.id, "clean shutdown").isOk());
  NodeRecord dead = mustGet(*store, node.id);
  auto late = store->heartbeat(node.id, kLongTtl);
  REQUIRE(late.isOk());
  CHECK_FALSE(*late);
  NodeRecord after = mustGet(*store, node.id);
  CHECK(after.state == NodeState::kDead);  // a late heartbeat must not revive it
  CHECK(after.lastHeartbeatMs == dead.lastHeartbeatMs);

  CHECK(store->heartbeat(node.id, 0ms).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE_TEMPLATE("reapExpiredNodes marks silent nodes dead and spares heartbeating ones",
                   Backend, TROUPE_STORE_BACKENDS) {
  Backend backend;
  auto store = backend.open();
  NodeRecord silent = sampleNode("silent");
  NodeRecord beating = sampleNode("beating");
  REQUIRE(store->registerNode(silent, kShortTtl).isOk());
  REQUIRE(store->registerNode(beating, kShortTtl).isOk());
  const auto start = Clock::now();

  // Keep going for at least 3 TTLs so `beating` would certainly have expired without its
  // heartbeats; stop at TTL + 1 s if `silent` is never reaped.
  bool silentReaped = false;
  bool beatingReaped = false;
  const auto deadline = start + kShortTtl + 1s;
  const auto observeUntil = start + 3 * kShortTtl;
  while (Clock::now() < deadline && !(silentReaped && Clock::now() >= observeUntil)) {
    auto beat = store->heartbeat(beating.id, kShortTtl);
    REQUIRE(beat.isOk());
    auto reaped = store->reapExpiredNodes();
    REQUIRE_MESSAGE(reaped.isOk(), reaped.status().toString());
    for (const NodeId& id : *reaped) {
      if (id == silent.id) {
        CHECK_FALSE(silentReaped);  // reaped exactly once
        silentReaped = true;
      }
      if (id == beating.id) beatingReaped = true;
    }
    std::this_thread::sleep_for(20ms);  // the polling period, not a wait for the condition
  }
  REQUIRE(silentReaped);
  CHECK_FALSE(beatingReaped);

  NodeRecord dead = mustGet(*store, silent.id);
  CHECK(dead.state == NodeState::kDead);
  CHECK(dead.deathReason.find("heartbeat") != std::string::npos);
  CHECK(mustGet(*store, beating.id).state == NodeState::kAlive);

  auto again = store->reapExpiredNodes();
  REQUIRE(again.isOk());
  CHECK(again->empty());
}

TEST_CASE_TEMPLATE("markNodeDead", Backend, TROUPE_STORE_BACKENDS) {
  Backend backend;
  auto store = backend.open();
  NodeRecord node = sampleNode();
  REQUIRE(store->registerNode(node, kLongTtl).isOk());

  REQUIRE(store->markNodeDead(node.id, "clean shutdown").isOk());
  NodeRecord dead = mustGet(*store, node.id);
  CHECK(dead.state == NodeState::kDead);
  CHECK(dead.deathReason == "clean shutdown");

  // Already dead: unchanged.
  REQUIRE(store->markNodeDead(node.id, "second opinion").isOk());
  CHECK(mustGet(*store, node.id).deathReason == "clean shutdown");
  // A dead node is not reaped again.
  auto reaped = store->reapExpiredNodes();
  REQUIRE(reaped.isOk());
  CHECK(reaped->empty());

  Status unknown = store->markNodeDead(NodeId::generate(), "never existed");
  CHECK(unknown.code() == StatusCode::kNotFound);
}

TEST_CASE_TEMPLATE("subscription receives NODE_ADDED and NODE_DEAD", Backend,
                   TROUPE_STORE_BACKENDS) {
  Backend backend;
  auto store = backend.open();
  auto subscription = store->subscribe();
  REQUIRE_MESSAGE(subscription.isOk(), subscription.status().toString());
  EventSubscription& events = **subscription;

  // An idle wait times out cleanly and leaves the subscription usable.
  auto idle = events.next(50ms);
  REQUIRE_MESSAGE(idle.isOk(), idle.status().toString());
  CHECK_FALSE(idle->has_value());

  NodeRecord node = sampleNode();
  const int64_t before = wallClockMs();
  REQUIRE(store->registerNode(node, kShortTtl).isOk());
  ClusterEvent added = mustReceive(events);
  CHECK(added.type == ClusterEventType::kNodeAdded);
  CHECK(added.nodeId == node.id);
  CHECK(added.timeMs >= before);

  NodeRecord other = sampleNode();
  REQUIRE(store->registerNode(other, kLongTtl).isOk());
  CHECK(mustReceive(events).nodeId == other.id);
  REQUIRE(store->markNodeDead(other.id, "drained by operator").isOk());
  ClusterEvent marked = mustReceive(events);
  CHECK(marked.type == ClusterEventType::kNodeDead);
  CHECK(marked.nodeId == other.id);
  CHECK(marked.reason == "drained by operator");
  // Already dead: nothing is published.
  REQUIRE(store->markNodeDead(other.id, "again").isOk());

  // `node` stops heartbeating; reap until it goes.
  const auto deadline = Clock::now() + kShortTtl + 1s;
  bool reaped = false;
  while (!reaped && Clock::now() < deadline) {
    auto dead = store->reapExpiredNodes();
    REQUIRE(dead.isOk());
    reaped = !dead->empty();
    if (!reaped) std::this_thread::sleep_for(20ms);
  }
  REQUIRE(reaped);
  ClusterEvent expired = mustReceive(events);
  CHECK(expired.type == ClusterEventType::kNodeDead);
  CHECK(expired.nodeId == node.id);
  CHECK(expired.reason.find("heartbeat") != std::string::npos);
  CHECK(expired.timeMs >= before);

  auto quiet = events.next(50ms);
  REQUIRE(quiet.isOk());
  CHECK_FALSE(quiet->has_value());

  CHECK(std::string(clusterEventTypeName(ClusterEventType::kNodeAdded)) == "NODE_ADDED");
  CHECK(std::string(clusterEventTypeName(ClusterEventType::kNodeDead)) == "NODE_DEAD");
}

TEST_CASE_TEMPLATE("events published in a burst are all delivered, in order", Backend,
                   TROUPE_STORE_BACKENDS) {
  Backend backend;
  auto store = backend.open();
  auto subscription = store->subscribe();
  REQUIRE(subscription.isOk());
  // All published before the first next(): for Redis they typically arrive in one read, and
  // the later ones then sit in hiredis' buffer where poll() cannot see them.
  std::vector<NodeId> ids;
  for (int i = 0; i < 5; ++i) {
    NodeRecord node = sampleNode();
    ids.push_back(node.id);
    REQUIRE(store->registerNode(node, kLongTtl).isOk());
  }
  for (const NodeId& id : ids) {
    auto event = (*subscription)->next(500ms);
    REQUIRE_MESSAGE(event.isOk(), event.status().toString());
    REQUIRE(event->has_value());
    CHECK((*event)->nodeId == id);
  }
}

TEST_CASE_TEMPLATE("two stores on the same state see each other's writes", Backend,
                   TROUPE_STORE_BACKENDS) {
  Backend backend;
  auto controller = backend.open();
  auto agent = backend.open();
  auto subscription = controller->subscribe();
  REQUIRE(subscription.isOk());

  NodeRecord node = sampleNode();
  REQUIRE(agent->registerNode(node, kLongTtl).isOk());
  checkSameNode(mustGet(*controller, node.id), node);
  CHECK(mustReceive(**subscription).nodeId == node.id);

  REQUIRE(controller->putMeta(ClusterMeta{"shared-token", "127.0.0.1:1", 1, 2}).isOk());
  auto meta = agent->getMeta();
  REQUIRE(meta.isOk());
  REQUIRE(meta->has_value());
  CHECK((*meta)->token == "shared-token");

  REQUIRE(controller->markNodeDead(node.id, "evicted").isOk());
  auto beat = agent->heartbeat(node.id, kLongTtl);
  REQUIRE(beat.isOk());
  CHECK_FALSE(*beat);  // the agent learns it was declared dead
}

// ---- Real Redis only ----

struct ContextDeleter {
  void operator()(redisContext* context) const { redisFree(context); }
};
struct ReplyDeleter {
  void operator()(redisReply* reply) const { freeReplyObject(reply); }
};
using ContextPtr = std::unique_ptr<redisContext, ContextDeleter>;
using ReplyPtr = std::unique_ptr<redisReply, ReplyDeleter>;

ContextPtr rawConnect(const testing::RedisServerProcess& server) {
  ContextPtr context(redisConnect(server.host().c_str(), server.port()));
  REQUIRE(context);
  REQUIRE_MESSAGE(context->err == 0, context->errstr);
  return context;
}

ReplyPtr rawCommand(redisContext* context, const std::vector<std::string>& args) {
  std::vector<const char*> argv;
  std::vector<size_t> lengths;
  for (const auto& arg : args) {
    argv.push_back(arg.data());
    lengths.push_back(arg.size());
  }
  ReplyPtr reply(static_cast<redisReply*>(
      redisCommandArgv(context, static_cast<int>(argv.size()), argv.data(), lengths.data())));
  REQUIRE_MESSAGE(reply, context->errstr);
  return reply;
}

TEST_CASE("redis store: a wrong password is kUnauthenticated") {
  testing::RedisServerProcess server;
  RedisOptions options = server.options("test");
  options.password = "not-" + server.password();
  auto store = connectRedisStore(options);
  REQUIRE_FALSE(store.isOk());
  CHECK(store.status().code() == StatusCode::kUnauthenticated);
  CHECK(store.status().message().find(server.password()) == std::string::npos);

  options.password.clear();
  auto none = connectRedisStore(options);
  REQUIRE_FALSE(none.isOk());
  CHECK(none.status().code() == StatusCode::kUnauthenticated);
}

TEST_CASE("redis store: Redis refuses a client without the password") {
  testing::RedisServerProcess server;
  auto store = connectRedisStore(server.options("test"));
  REQUIRE(store.isOk());
  REQUIRE((*store)->putMeta(ClusterMeta{"secret-token", "127.0.0.1:1", 1, 2}).isOk());

  ContextPtr context = rawConnect(server);
  ReplyPtr ping = rawCommand(context.get(), {"PING"});
  REQUIRE(ping->type == REDIS_REPLY_ERROR);
  CHECK(std::string(ping->str, ping->len).rfind("NOAUTH", 0) == 0);
  ReplyPtr read = rawCommand(context.get(), {"HGETALL", "troupe:test:meta"});
  CHECK(read->type == REDIS_REPLY_ERROR);
}

TEST_CASE("redis store: a password-less Redis is refused with kFailedPrecondition") {
  testing::RedisServerProcess server(testing::RedisServerOptions{.requirePassword = false});
  RedisOptions options = server.options("test");
  options.password = "whatever";
  auto store = connectRedisStore(options);
  REQUIRE_FALSE(store.isOk());
  CHECK(store.status().code() == StatusCode::kFailedPrecondition);
  CHECK(store.status().message().find("requirepass") != std::string::npos);
}

TEST_CASE("redis store: an unreachable Redis is kUnavailable within 3 s") {
  auto port = pickFreePort("127.0.0.1");
  REQUIRE(port.isOk());
  RedisOptions options;
  options.port = *port;  // nothing listens there
  options.password = "irrelevant";
  const auto start = Clock::now();
  auto store = connectRedisStore(options);
  CHECK(Clock::now() - start < 3s);
  REQUIRE_FALSE(store.isOk());
  CHECK(store.status().code() == StatusCode::kUnavailable);
  CHECK(store.status().message().find(fmt::format("127.0.0.1:{}", *port)) != std::string::npos);
  CHECK(store.status().message().find("--redis-address") != std::string::npos);
}

TEST_CASE("redis store: a killed Redis gives kUnavailable, not a hang or a crash") {
  testing::RedisServerProcess server;
  auto store = connectRedisStore(server.options("test"));
  REQUIRE(store.isOk());
  auto subscription = (*store)->subscribe();
  REQUIRE(subscription.isOk());
  NodeRecord node = sampleNode();
  REQUIRE((*store)->registerNode(node, kLongTtl).isOk());

  server.kill9();
  const auto start = Clock::now();
  auto got = (*store)->getNode(node.id);
  REQUIRE_FALSE(got.isOk());
  CHECK(got.status().code() == StatusCode::kUnavailable);
  auto beat = (*store)->heartbeat(node.id, kLongTtl);
  REQUIRE_FALSE(beat.isOk());
  CHECK(beat.status().code() == StatusCode::kUnavailable);
  CHECK(Clock::now() - start < 3s);

  // The subscription drains the buffered NODE_ADDED, then reports the loss.
  bool lost = false;
  for (int i = 0; i < 3 && !lost; ++i) {
    auto event = (*subscription)->next(2s);
    if (!event.isOk()) {
      CHECK(event.status().code() == StatusCode::kUnavailable);
      lost = true;
    }
  }
  CHECK(lost);
}

TEST_CASE("redis store: a stalled Redis times out with kUnavailable, then recovers") {
  testing::RedisServerProcess server;
  RedisOptions options = server.options("test");
  options.timeout = 200ms;
  auto store = connectRedisStore(options);
  REQUIRE(store.isOk());
  NodeRecord node = sampleNode();
  REQUIRE((*store)->registerNode(node, kLongTtl).isOk());

  // A stopped server still completes TCP handshakes (the kernel does) but never replies:
  // only the per-command timeout saves the caller.
  REQUIRE(::kill(server.pid(), SIGSTOP) == 0);
  const auto start = Clock::now();
  auto stalled = (*store)->getNode(node.id);
  const auto took = Clock::now() - start;
  ::kill(server.pid(), SIGCONT);
  REQUIRE_FALSE(stalled.isOk());
  CHECK(stalled.status().code() == StatusCode::kUnavailable);
  CHECK(stalled.status().message().find("no reply within 200 ms") != std::string::npos);
  CHECK(took < 2s);  // command, reconnect and PING each bounded by 200 ms

  auto recovered = (*store)->getNode(node.id);
  REQUIRE_MESSAGE(recovered.isOk(), recovered.status().toString());
  CHECK(recovered->has_value());
}

TEST_CASE("redis store: a dropped connection is re-established once, transparently") {
  testing::RedisServerProcess server;
  auto store = connectRedisStore(server.options("test"));
  REQUIRE(store.isOk());
  NodeRecord node = sampleNode();
  REQUIRE((*store)->registerNode(node, kLongTtl).isOk());

  ContextPtr admin = rawConnect(server);
  REQUIRE(rawCommand(admin.get(), {"AUTH", server.password()})->type != REDIS_REPLY_ERROR);
  // Drops every normal client except the caller: the store's connection.
  ReplyPtr killed = rawCommand(admin.get(), {"CLIENT", "KILL", "TYPE", "normal"});
  REQUIRE(killed->type == REDIS_REPLY_INTEGER);
  REQUIRE(killed->integer >= 1);

  auto got = (*store)->getNode(node.id);
  REQUIRE_MESSAGE(got.isOk(), got.status().toString());
  CHECK(got->has_value());
}

TEST_CASE("redis store: clusters under different names do not see each other") {
  testing::RedisServerProcess server;
  auto first = connectRedisStore(server.options("first"));
  auto second = connectRedisStore(server.options("second"));
  REQUIRE(first.isOk());
  REQUIRE(second.isOk());
  REQUIRE((*first)->registerNode(sampleNode(), kLongTtl).isOk());
  auto nodes = (*second)->listNodes();
  REQUIRE(nodes.isOk());
  CHECK(nodes->empty());
  auto own = (*first)->listNodes();
  REQUIRE(own.isOk());
  CHECK(own->size() == 1);
}

}  // namespace
}  // namespace troupe
