// The cluster store's suite, on a real redis-server: every case in a cluster of its own on the
// binary's server (troupe/testing/redis_server.h); the cases that kill or misconfigure a
// server start one of their own.
#include <doctest/doctest.h>
#include <hiredis/hiredis.h>
#include <signal.h>

#include <chrono>
#include <cmath>
#include <map>
#include <set>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "redis_scripts.h"
#include "troupe/testing/redis_server.h"
#include "troupe/runtime/clock.h"
#include "troupe/runtime/cluster_store.h"
#include "troupe/runtime/config.h"
#include "troupe/runtime/process.h"

namespace troupe {
namespace {

using namespace std::chrono_literals;

// Short enough to keep the suite fast, long enough that a loaded machine does not miss a
// heartbeat sent every ~20 ms.
constexpr std::chrono::milliseconds kShortTtl{300};
constexpr std::chrono::milliseconds kLongTtl{60'000};

// A cluster of its own on the binary's redis-server: stores it opens share data.
struct Backend {
  std::string cluster = testing::newTestCluster();
  std::unique_ptr<ClusterStore> open() { return testing::openTestStore(cluster); }
};

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

TEST_CASE("meta round trip") {
  Backend backend;
  auto store = backend.open();
  auto empty = store->getMeta();
  REQUIRE(empty.isOk());
  CHECK_FALSE(empty->has_value());

  ClusterMeta meta{"tok-" + randomHex(8), "10.0.0.5:6380", 4711, 1700000000123, ""};
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

TEST_CASE("the store gateway's address survives a controller rewriting the meta") {
  Backend backend;
  auto store = backend.open();
  ClusterMeta meta{"tok", "10.0.0.5:6380", 1, 2, ""};
  REQUIRE(store->putMeta(meta).isOk());
  CHECK((*store->getMeta())->storeGateway.empty());
  REQUIRE(store->putStoreGateway("10.0.0.5:41000").isOk());
  meta.controllerPid = 3;  // a restarted controller
  REQUIRE(store->putMeta(meta).isOk());
  CHECK((*store->getMeta())->storeGateway == "10.0.0.5:41000");
}

TEST_CASE("register, get and list nodes keep every field") {
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

TEST_CASE("registerNode fills in the registration time when it is zero") {
  Backend backend;
  auto store = backend.open();
  NodeRecord node = sampleNode();
  node.registeredMs = 0;
  const int64_t before = wallClockMs();
  REQUIRE(store->registerNode(node, kLongTtl).isOk());
  CHECK(mustGet(*store, node.id).registeredMs >= before);
}

TEST_CASE("re-registering a node is idempotent") {
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

TEST_CASE("heartbeat is accepted only for alive nodes") {
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

TEST_CASE("reapExpiredNodes marks silent nodes dead and spares heartbeating ones") {
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

TEST_CASE("markNodeDead") {
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

TEST_CASE("subscription receives NODE_ADDED and NODE_DEAD") {
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

TEST_CASE("events published in a burst are all delivered, in order") {
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

TEST_CASE("two stores on the same state see each other's writes") {
  Backend backend;
  auto controller = backend.open();
  auto agent = backend.open();
  auto subscription = controller->subscribe();
  REQUIRE(subscription.isOk());

  NodeRecord node = sampleNode();
  REQUIRE(agent->registerNode(node, kLongTtl).isOk());
  checkSameNode(mustGet(*controller, node.id), node);
  CHECK(mustReceive(**subscription).nodeId == node.id);

  REQUIRE(controller->putMeta(ClusterMeta{"shared-token", "127.0.0.1:1", 1, 2, ""}).isOk());
  auto meta = agent->getMeta();
  REQUIRE(meta.isOk());
  REQUIRE(meta->has_value());
  CHECK((*meta)->token == "shared-token");

  REQUIRE(controller->markNodeDead(node.id, "evicted").isOk());
  auto beat = agent->heartbeat(node.id, kLongTtl);
  REQUIRE(beat.isOk());
  CHECK_FALSE(*beat);  // the agent learns it was declared dead
}

// ---- Resources ----

// An ALIVE node with exactly `total` and nothing claimed.
NodeRecord registerResourceNode(ClusterStore& store, Resources total) {
  NodeRecord node = sampleNode();
  node.total = std::move(total);
  node.used.clear();
  REQUIRE(store.registerNode(node, kLongTtl).isOk());
  return node;
}

bool mustReserve(ClusterStore& store, const std::vector<Reservation>& reservations) {
  auto reserved = store.reserve(reservations);
  REQUIRE_MESSAGE(reserved.isOk(), reserved.status().toString());
  return *reserved;
}

std::map<std::string, Resources> mustReservations(ClusterStore& store, const NodeId& node) {
  auto claims = store.reservations(node);
  REQUIRE_MESSAGE(claims.isOk(), claims.status().toString());
  return *claims;
}

// `used` as listNodes() reports it (the scheduler's view).
Resources listedUsed(ClusterStore& store, const NodeId& id) {
  auto nodes = store.listNodes();
  REQUIRE_MESSAGE(nodes.isOk(), nodes.status().toString());
  for (const NodeRecord& node : *nodes) {
    if (node.id == id) return node.used;
  }
  FAIL("node " << id.hex() << " is not listed");
  return {};
}

TEST_CASE("reserve: a claim that fits is recorded and shows in used") {
  Backend backend;
  auto store = backend.open();
  NodeRecord node = registerResourceNode(*store, {{"CPU", 8}, {"GPU", 2}, {"memory", 1 << 30}});
  // Before any claim, `used` is what the node registered with.
  CHECK(listedUsed(*store, node.id).empty());
  CHECK(mustReservations(*store, node.id).empty());

  CHECK(mustReserve(*store, {{node.id, "actor:a", {{"CPU", 2}, {"GPU", 1}}}}));
  // Every resource in total appears in used, 0 when unclaimed.
  const Resources afterOne = {{"CPU", 2}, {"GPU", 1}, {"memory", 0}};
  CHECK(listedUsed(*store, node.id) == afterOne);
  CHECK(mustGet(*store, node.id).used == afterOne);

  CHECK(mustReserve(*store, {{node.id, "actor:b", {{"CPU", 6}, {"memory", 1 << 29}}}}));
  CHECK(listedUsed(*store, node.id) ==
        Resources{{"CPU", 8}, {"GPU", 1}, {"memory", 1 << 29}});
  auto claims = mustReservations(*store, node.id);
  REQUIRE(claims.size() == 2);
  CHECK(claims["actor:a"] == Resources{{"CPU", 2}, {"GPU", 1}});
  CHECK(claims["actor:b"] == Resources{{"CPU", 6}, {"memory", 1 << 29}});

  // An empty list reserves nothing and succeeds.
  CHECK(mustReserve(*store, {}));
  CHECK(mustReservations(*store, node.id).size() == 2);
}

TEST_CASE("reserve: over capacity is refused and writes nothing") {
  Backend backend;
  auto store = backend.open();
  NodeRecord node = registerResourceNode(*store, {{"CPU", 4}, {"GPU", 1}});
  REQUIRE(mustReserve(*store, {{node.id, "actor:a", {{"CPU", 3}}}}));
  const Resources before = listedUsed(*store, node.id);

  CHECK_FALSE(mustReserve(*store, {{node.id, "actor:b", {{"CPU", 2}}}}));
  CHECK_FALSE(mustReserve(*store, {{node.id, "actor:c", {{"GPU", 2}}}}));
  // Two claims in one call that fit alone but not together.
  CHECK_FALSE(mustReserve(*store, {{node.id, "actor:d", {{"CPU", 1}}},
                                   {node.id, "actor:e", {{"CPU", 1}}}}));
  CHECK(listedUsed(*store, node.id) == before);
  auto claims = mustReservations(*store, node.id);
  REQUIRE(claims.size() == 1);
  CHECK(claims.contains("actor:a"));

  // Exactly the rest fits.
  CHECK(mustReserve(*store, {{node.id, "actor:b", {{"CPU", 1}, {"GPU", 1}}}}));
  CHECK(listedUsed(*store, node.id) == Resources{{"CPU", 4}, {"GPU", 1}});
}

TEST_CASE("reserve over several nodes is all or nothing") {
  Backend backend;
  auto store = backend.open();
  NodeRecord roomy = registerResourceNode(*store, {{"CPU", 8}});
  NodeRecord tight = registerResourceNode(*store, {{"CPU", 1}});

  CHECK_FALSE(mustReserve(*store, {{roomy.id, "pg:g:0", {{"CPU", 4}}},
                                   {tight.id, "pg:g:1", {{"CPU", 2}}}}));
  CHECK(mustReservations(*store, roomy.id).empty());
  CHECK(mustReservations(*store, tight.id).empty());
  CHECK(listedUsed(*store, roomy.id).empty());  // untouched: never recomputed

  CHECK(mustReserve(*store, {{roomy.id, "pg:g:0", {{"CPU", 4}}},
                             {tight.id, "pg:g:1", {{"CPU", 1}}}}));
  CHECK(listedUsed(*store, roomy.id) == Resources{{"CPU", 4}});
  CHECK(listedUsed(*store, tight.id) == Resources{{"CPU", 1}});
}

TEST_CASE("reserve: the same holder twice is idempotent; a new amount replaces it") {
  Backend backend;
  auto store = backend.open();
  NodeRecord node = registerResourceNode(*store, {{"CPU", 8}});
  const std::vector<Reservation> claim = {{node.id, "actor:a", {{"CPU", 6}}}};
  REQUIRE(mustReserve(*store, claim));
  // 6 + 6 would not fit on 8: a second call must not count the holder's own claim.
  CHECK(mustReserve(*store, claim));
  CHECK(mustReserve(*store, claim));
  CHECK(listedUsed(*store, node.id) == Resources{{"CPU", 6}});
  CHECK(mustReservations(*store, node.id).size() == 1);

  REQUIRE(mustReserve(*store, {{node.id, "actor:b", {{"CPU", 2}}}}));
  // Replacing a's claim is checked against what the others hold: 7 + 2 > 8.
  CHECK_FALSE(mustReserve(*store, {{node.id, "actor:a", {{"CPU", 7}}}}));
  CHECK(mustReservations(*store, node.id)["actor:a"] == Resources{{"CPU", 6}});
  CHECK(listedUsed(*store, node.id) == Resources{{"CPU", 8}});
  // Shrinking is always allowed, and growing back up to the free capacity too.
  CHECK(mustReserve(*store, {{node.id, "actor:a", {{"CPU", 1}}}}));
  CHECK(listedUsed(*store, node.id) == Resources{{"CPU", 3}});
  CHECK(mustReserve(*store, {{node.id, "actor:a", {{"CPU", 6}}}}));
  CHECK(listedUsed(*store, node.id) == Resources{{"CPU", 8}});
}

TEST_CASE("reserve refuses DEAD and unknown nodes") {
  Backend backend;
  auto store = backend.open();
  NodeRecord alive = registerResourceNode(*store, {{"CPU", 8}});
  NodeRecord dead = registerResourceNode(*store, {{"CPU", 8}});
  REQUIRE(store->markNodeDead(dead.id, "drained").isOk());
  const NodeId unknown = NodeId::generate();

  CHECK_FALSE(mustReserve(*store, {{dead.id, "actor:a", {{"CPU", 1}}}}));
  CHECK_FALSE(mustReserve(*store, {{unknown, "actor:a", {{"CPU", 1}}}}));
  // And a dead node in a batch sinks the whole batch.
  CHECK_FALSE(mustReserve(*store, {{alive.id, "actor:a", {{"CPU", 1}}},
                                   {dead.id, "actor:b", {{"CPU", 1}}}}));
  CHECK(mustReservations(*store, alive.id).empty());
  CHECK(mustReservations(*store, dead.id).empty());
  CHECK(mustReservations(*store, unknown).empty());
  // No record appears for the unknown node.
  auto missing = store->getNode(unknown);
  REQUIRE(missing.isOk());
  CHECK_FALSE(missing->has_value());

  // A node that dies keeps its claims until they are released, but takes no new ones, not
  // even a repeat of a claim it holds.
  REQUIRE(mustReserve(*store, {{alive.id, "actor:c", {{"CPU", 1}}}}));
  REQUIRE(store->markNodeDead(alive.id, "lost").isOk());
  CHECK_FALSE(mustReserve(*store, {{alive.id, "actor:c", {{"CPU", 1}}}}));
  CHECK(mustReservations(*store, alive.id).size() == 1);
}

TEST_CASE("release frees claims and is idempotent") {
  Backend backend;
  auto store = backend.open();
  NodeRecord first = registerResourceNode(*store, {{"CPU", 4}, {"GPU", 1}});
  NodeRecord second = registerResourceNode(*store, {{"CPU", 4}});
  REQUIRE(mustReserve(*store, {{first.id, "pg:g:0", {{"CPU", 4}, {"GPU", 1}}},
                               {second.id, "pg:g:1", {{"CPU", 3}}},
                               {first.id, "actor:x", {}}}));
  CHECK_FALSE(mustReserve(*store, {{first.id, "actor:y", {{"CPU", 1}}}}));

  // The resources in the argument are ignored: the whole claim goes.
  REQUIRE(store->release({{first.id, "pg:g:0", {}}, {second.id, "pg:g:1", {{"CPU", 1}}}}).isOk());
  CHECK(listedUsed(*store, first.id) == Resources{{"CPU", 0}, {"GPU", 0}});
  CHECK(listedUsed(*store, second.id) == Resources{{"CPU", 0}});
  auto remaining = mustReservations(*store, first.id);
  REQUIRE(remaining.size() == 1);
  CHECK(remaining.contains("actor:x"));
  CHECK(mustReservations(*store, second.id).empty());

  // Again, and claims that never existed, on known and unknown nodes: no error, no change.
  REQUIRE(store->release({{first.id, "pg:g:0", {}}, {second.id, "pg:g:1", {}}}).isOk());
  REQUIRE(store->release({{first.id, "actor:never", {}}, {NodeId::generate(), "x", {}}}).isOk());
  CHECK(listedUsed(*store, first.id) == Resources{{"CPU", 0}, {"GPU", 0}});
  CHECK(mustReservations(*store, first.id).size() == 1);

  // The freed capacity is usable again.
  CHECK(mustReserve(*store, {{first.id, "actor:y", {{"CPU", 4}, {"GPU", 1}}}}));
  CHECK(listedUsed(*store, first.id) == Resources{{"CPU", 4}, {"GPU", 1}});

  // A dead node's claims can still be released.
  REQUIRE(mustReserve(*store, {{second.id, "actor:z", {{"CPU", 2}}}}));
  REQUIRE(store->markNodeDead(second.id, "gone").isOk());
  REQUIRE(store->release({{second.id, "actor:z", {}}}).isOk());
  CHECK(mustReservations(*store, second.id).empty());
  CHECK(mustGet(*store, second.id).used == Resources{{"CPU", 0}});
}

TEST_CASE("reserve: fractional amounts add up exactly") {
  Backend backend;
  auto store = backend.open();
  NodeRecord node = registerResourceNode(*store, {{"CPU", 1}});
  CHECK(mustReserve(*store, {{node.id, "actor:a", {{"CPU", 0.5}}}}));
  CHECK(mustReserve(*store, {{node.id, "actor:b", {{"CPU", 0.5}}}}));
  CHECK(listedUsed(*store, node.id) == Resources{{"CPU", 1}});
  CHECK_FALSE(mustReserve(*store, {{node.id, "actor:c", {{"CPU", 0.001}}}}));

  // 0.1 + 0.1 + 0.1 is 0.30000000000000004 in binary: the tolerance lets it fit on 0.3.
  NodeRecord small = registerResourceNode(*store, {{"CPU", 0.3}});
  CHECK(mustReserve(*store, {{small.id, "actor:d", {{"CPU", 0.1}}}}));
  CHECK(mustReserve(*store, {{small.id, "actor:e", {{"CPU", 0.1}}}}));
  CHECK(mustReserve(*store, {{small.id, "actor:f", {{"CPU", 0.1}}}}));
  // `used` keeps every bit of the sum (cjson's 14 digits would have rounded it to 0.3).
  CHECK(listedUsed(*store, small.id).at("CPU") == 0.1 + 0.1 + 0.1);
  // ...but not one bit more.
  CHECK_FALSE(mustReserve(*store, {{small.id, "actor:g", {{"CPU", 1e-6}}}}));

  // `used` changes by each claim made or released (it does not re-add every claim), and a
  // node whose claims are all released is back at exactly 0, whatever order they went in.
  NodeRecord busy = registerResourceNode(*store, {{"CPU", 1}});
  for (int i = 0; i < 10; ++i) CHECK(mustReserve(*store, {{busy.id, fmt::format("pg:x:{}", i), {{"CPU", 0.1}}}}));
  CHECK_FALSE(mustReserve(*store, {{busy.id, "pg:x:10", {{"CPU", 0.1}}}}));
  for (int i : {3, 7, 0}) REQUIRE(store->release({{busy.id, fmt::format("pg:x:{}", i), {}}}).isOk());
  CHECK(mustReserve(*store, {{busy.id, "pg:y:0", {{"CPU", 0.25}}}}));
  CHECK(mustReserve(*store, {{busy.id, "pg:x:1", {{"CPU", 0.05}}}}));  // replaces its own 0.1
  CHECK(listedUsed(*store, busy.id).at("CPU") == doctest::Approx(0.9));
  CHECK_FALSE(mustReserve(*store, {{busy.id, "pg:y:1", {{"CPU", 0.11}}}}));
  std::vector<Reservation> all = {{busy.id, "pg:y:0", {}}};
  for (int i = 0; i < 10; ++i) all.push_back({busy.id, fmt::format("pg:x:{}", i), {}});
  REQUIRE(store->release(all).isOk());
  CHECK(listedUsed(*store, busy.id) == Resources{{"CPU", 0}});
}

TEST_CASE("reserve: custom resources") {
  Backend backend;
  auto store = backend.open();
  NodeRecord node = registerResourceNode(*store, {{"CPU", 4}, {"accel_slot", 2}});
  CHECK(mustReserve(*store, {{node.id, "actor:a", {{"CPU", 1}, {"accel_slot", 2}}}}));
  CHECK_FALSE(mustReserve(*store, {{node.id, "actor:b", {{"accel_slot", 1}}}}));
  // A resource the node does not have at all.
  CHECK_FALSE(mustReserve(*store, {{node.id, "actor:b", {{"GPU", 1}}}}));
  // Asking for none of it is fine, and the name then shows in used.
  CHECK(mustReserve(*store, {{node.id, "actor:b", {{"CPU", 1}, {"GPU", 0}}}}));
  CHECK(listedUsed(*store, node.id) == Resources{{"CPU", 2}, {"accel_slot", 2}, {"GPU", 0}});
  CHECK(mustReservations(*store, node.id)["actor:a"] == Resources{{"CPU", 1}, {"accel_slot", 2}});
}

TEST_CASE("re-registering a node with claims keeps used equal to the claims") {
  Backend backend;
  auto store = backend.open();
  NodeRecord node = registerResourceNode(*store, {{"CPU", 8}});
  REQUIRE(mustReserve(*store, {{node.id, "actor:a", {{"CPU", 3}}}}));
  node.used = {{"CPU", 0}};  // what a restarted agent would report
  node.total = {{"CPU", 8}, {"GPU", 1}};
  REQUIRE(store->registerNode(node, kLongTtl).isOk());
  CHECK(mustGet(*store, node.id).used == Resources{{"CPU", 3}, {"GPU", 0}});
  CHECK(mustReserve(*store, {{node.id, "actor:b", {{"CPU", 5}, {"GPU", 1}}}}));
  CHECK_FALSE(mustReserve(*store, {{node.id, "actor:c", {{"CPU", 0.5}}}}));

  // Re-registered with less than is claimed: the node is overcommitted on CPU, so no more CPU
  // fits, but a claim asking for none of it and for a free resource still does.
  node.total = {{"CPU", 4}, {"GPU", 2}};
  REQUIRE(store->registerNode(node, kLongTtl).isOk());
  CHECK(mustGet(*store, node.id).used == Resources{{"CPU", 8}, {"GPU", 1}});
  CHECK_FALSE(mustReserve(*store, {{node.id, "actor:c", {{"CPU", 0.5}}}}));
  CHECK(mustReserve(*store, {{node.id, "actor:c", {{"CPU", 0}, {"GPU", 1}}}}));
  CHECK(mustGet(*store, node.id).used == Resources{{"CPU", 8}, {"GPU", 2}});

  // Once every claim is released, a registration's own `used` stands again.
  REQUIRE(store->release({{node.id, "actor:a", {}}, {node.id, "actor:b", {}},
                          {node.id, "actor:c", {}}}).isOk());
  CHECK(mustGet(*store, node.id).used == Resources{{"CPU", 0}, {"GPU", 0}});
  node.used = {{"CPU", 1.25}};
  REQUIRE(store->registerNode(node, kLongTtl).isOk());
  CHECK(mustGet(*store, node.id).used == node.used);
}

TEST_CASE("reserve and release reject malformed claims") {
  Backend backend;
  auto store = backend.open();
  NodeRecord node = registerResourceNode(*store, {{"CPU", 8}});
  auto code = [&](const std::vector<Reservation>& reservations) {
    return store->reserve(reservations).status().code();
  };
  CHECK(code({{NodeId(), "actor:a", {{"CPU", 1}}}}) == StatusCode::kInvalidArgument);
  CHECK(code({{node.id, "", {{"CPU", 1}}}}) == StatusCode::kInvalidArgument);
  CHECK(code({{node.id, "actor:a", {{"CPU", -1}}}}) == StatusCode::kInvalidArgument);
  CHECK(code({{node.id, "actor:a", {{"CPU", std::nan("")}}}}) == StatusCode::kInvalidArgument);
  CHECK(code({{node.id, "actor:a", {{"CPU", 1}}}, {node.id, "actor:a", {{"CPU", 2}}}}) ==
        StatusCode::kInvalidArgument);
  CHECK(store->release({{node.id, "", {}}}).code() == StatusCode::kInvalidArgument);
  CHECK(store->reservations(NodeId()).status().code() == StatusCode::kInvalidArgument);
  CHECK(mustReservations(*store, node.id).empty());
}

// ---- Actors ----

ActorRecord sampleActor() {
  ActorRecord actor;
  actor.id = ActorId::generate();
  actor.type = "Trainer";
  actor.name = "trainer-0";
  actor.nodeId = NodeId::generate();
  actor.pid = 424242;
  actor.address = "127.0.0.1:5151";
  actor.state = ActorState::kRestarting;
  actor.incarnation = 4000000000u;  // above INT32_MAX
  actor.restarts = 3;
  actor.maxRestarts = -1;
  actor.maxTaskRetries = 5;
  actor.owner = "session-1234";
  actor.detached = true;
  actor.resources = {{"CPU", 0.5}, {"GPU", 1}, {"memory", 2147483648.0}, {"accel_slot", 0.25}};
  const char raw[] = "\0pickled\0\x01\x7f\x80\xff\r\n tail\0";
  actor.initArgs.assign(raw, sizeof raw);  // includes the terminating NUL too
  actor.placementGroup = PlacementGroupId::generate();
  actor.bundleIndex = 7;
  actor.deathReason = "worker exited with code 137 (SIGKILL)";
  actor.createdMs = 1700000000123;
  actor.updatedMs = 1700000004567;
  return actor;
}

void checkSameActor(const ActorRecord& got, const ActorRecord& want) {
  CHECK(got.id == want.id);
  CHECK(got.type == want.type);
  CHECK(got.name == want.name);
  CHECK(got.nodeId == want.nodeId);
  CHECK(got.pid == want.pid);
  CHECK(got.address == want.address);
  CHECK(got.state == want.state);
  CHECK(got.incarnation == want.incarnation);
  CHECK(got.restarts == want.restarts);
  CHECK(got.maxRestarts == want.maxRestarts);
  CHECK(got.maxTaskRetries == want.maxTaskRetries);
  CHECK(got.owner == want.owner);
  CHECK(got.detached == want.detached);
  CHECK(got.resources == want.resources);
  CHECK(got.initArgs.size() == want.initArgs.size());
  CHECK(got.initArgs == want.initArgs);
  CHECK(got.placementGroup == want.placementGroup);
  CHECK(got.bundleIndex == want.bundleIndex);
  CHECK(got.deathReason == want.deathReason);
  CHECK(got.createdMs == want.createdMs);
  CHECK(got.updatedMs == want.updatedMs);
}

ActorRecord mustGetActor(ClusterStore& store, const ActorId& id) {
  auto actor = store.getActor(id);
  REQUIRE_MESSAGE(actor.isOk(), actor.status().toString());
  REQUIRE(actor->has_value());
  return **actor;
}

TEST_CASE("actors: put, get and list keep every field") {
  Backend backend;
  auto store = backend.open();
  ActorRecord actor = sampleActor();
  REQUIRE(actor.initArgs.size() == 22);
  REQUIRE(actor.initArgs[0] == '\0');
  REQUIRE(store->putActor(actor).isOk());
  checkSameActor(mustGetActor(*store, actor.id), actor);

  // A plain actor: defaults, no placement group, empty resources and arguments.
  ActorRecord plain;
  plain.id = ActorId::generate();
  plain.type = "Counter";
  plain.createdMs = actor.createdMs + 1;
  REQUIRE(store->putActor(plain).isOk());
  ActorRecord gotPlain = mustGetActor(*store, plain.id);
  checkSameActor(gotPlain, plain);
  CHECK(gotPlain.bundleIndex == -1);
  CHECK(gotPlain.placementGroup.empty());
  CHECK(gotPlain.state == ActorState::kPending);

  // A put replaces the whole record.
  actor.state = ActorState::kAlive;
  actor.incarnation += 1;
  actor.initArgs = std::string("\0", 1);
  actor.deathReason.clear();
  actor.placementGroup = PlacementGroupId();
  actor.bundleIndex = -1;
  actor.resources.clear();
  REQUIRE(store->putActor(actor).isOk());
  REQUIRE(store->putActor(actor).isOk());
  checkSameActor(mustGetActor(*store, actor.id), actor);

  // The live list (what the controller spawns from) keeps every field; the status list leaves
  // out the init args, the bulk of a record.
  auto live = store->listLiveActors();
  REQUIRE_MESSAGE(live.isOk(), live.status().toString());
  REQUIRE(live->size() == 2);
  checkSameActor((*live)[0], actor);
  checkSameActor((*live)[1], plain);
  auto list = store->listActors();
  REQUIRE_MESSAGE(list.isOk(), list.status().toString());
  REQUIRE(list->size() == 2);
  ActorRecord listed = actor;
  listed.initArgs.clear();
  checkSameActor((*list)[0], listed);
  checkSameActor((*list)[1], plain);

  auto missing = store->getActor(ActorId::generate());
  REQUIRE(missing.isOk());
  CHECK_FALSE(missing->has_value());
  CHECK(store->putActor(ActorRecord{}).code() == StatusCode::kInvalidArgument);
  CHECK(store->getActor(ActorId()).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("actors in batches: putActors writes each record, getActors reads them in order") {
  Backend backend;
  auto store = backend.open();
  std::vector<ActorRecord> batch;
  for (int i = 0; i < 3; ++i) {
    ActorRecord a = sampleActor();
    a.id = ActorId::generate();
    a.createdMs += i;
    batch.push_back(a);
  }
  batch[1].state = ActorState::kDead;  // each record goes through the put script: indexes follow
  REQUIRE(store->putActors(batch).isOk());
  REQUIRE(store->putActors({}).isOk());
  std::vector<ActorId> ids = {batch[2].id, ActorId::generate(), batch[0].id, batch[1].id};
  auto got = store->getActors(ids);
  REQUIRE_MESSAGE(got.isOk(), got.status().toString());
  REQUIRE(got->size() == 4);
  REQUIRE((*got)[0].has_value());
  checkSameActor(*(*got)[0], batch[2]);
  CHECK_FALSE((*got)[1].has_value());
  REQUIRE((*got)[2].has_value());
  checkSameActor(*(*got)[2], batch[0]);
  REQUIRE((*got)[3].has_value());
  CHECK((*got)[3]->state == ActorState::kDead);
  auto live = store->listLiveActors();
  REQUIRE(live.isOk());
  CHECK(live->size() == 2);
  CHECK(store->putActors({batch[0], ActorRecord{}}).code() == StatusCode::kInvalidArgument);
  CHECK(store->getActors({ActorId()}).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("reserveEach: each claim is made or refused on its own, and used adds up") {
  Backend backend;
  auto store = backend.open();
  NodeRecord a = registerResourceNode(*store, {{"CPU", 4}, {"GPU", 1}});
  NodeRecord b = registerResourceNode(*store, {{"CPU", 1}});
  NodeRecord dead = registerResourceNode(*store, {{"CPU", 8}});
  REQUIRE(store->markNodeDead(dead.id, "test").isOk());
  REQUIRE(mustReserve(*store, {{a.id, "actor:old", {{"CPU", 1}}}}));
  auto made = store->reserveEach({
      {a.id, "actor:x", {{"CPU", 2}}},              // fits: 3 of 4
      {a.id, "actor:y", {{"CPU", 2}}},              // refused: 5 > 4, nothing written for it
      {b.id, "actor:z", {{"CPU", 1}}},              // another node
      {a.id, "actor:old", {{"CPU", 1}, {"GPU", 1}}},  // replaces its own claim: 3 of 4, and the GPU
      {dead.id, "actor:w", {{"CPU", 1}}},           // a DEAD node refuses
      {NodeId::generate(), "actor:v", {{"CPU", 1}}},  // so does an unknown one
  });
  REQUIRE_MESSAGE(made.isOk(), made.status().toString());
  CHECK(*made == std::vector<bool>{true, false, true, true, false, false});
  CHECK(listedUsed(*store, a.id) == Resources{{"CPU", 3}, {"GPU", 1}});
  CHECK(listedUsed(*store, b.id) == Resources{{"CPU", 1}});
  auto claims = mustReservations(*store, a.id);
  CHECK(claims.size() == 2);
  CHECK(claims.count("actor:y") == 0);
  CHECK(claims["actor:old"] == Resources{{"CPU", 1}, {"GPU", 1}});
  CHECK(mustReservations(*store, dead.id).empty());
  // Repeated, the batch changes nothing (y still does not fit).
  auto again = store->reserveEach({{a.id, "actor:x", {{"CPU", 2}}}, {a.id, "actor:y", {{"CPU", 2}}}});
  REQUIRE(again.isOk());
  CHECK(*again == std::vector<bool>{true, false});
  CHECK(listedUsed(*store, a.id) == Resources{{"CPU", 3}, {"GPU", 1}});
  CHECK(store->reserveEach({{a.id, "actor:u", {{"CPU", -1}}}}).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("listActors sorts by creation time, then id") {
  Backend backend;
  auto store = backend.open();
  auto empty = store->listActors();
  REQUIRE(empty.isOk());
  CHECK(empty->empty());

  // Ids in the opposite order to creation times, so sorting by id alone would be caught.
  ActorRecord late = sampleActor();
  late.id = ActorId("00000000" + randomHex(4));
  late.createdMs = 3000;
  ActorRecord early = sampleActor();
  early.id = ActorId("ffffffff" + randomHex(4));
  early.createdMs = 1000;
  ActorRecord tieLow = sampleActor();
  tieLow.id = ActorId("11111111" + randomHex(4));
  tieLow.createdMs = 2000;
  ActorRecord tieHigh = sampleActor();
  tieHigh.id = ActorId("22222222" + randomHex(4));
  tieHigh.createdMs = 2000;
  for (const ActorRecord* actor : {&late, &tieHigh, &early, &tieLow}) {
    REQUIRE(store->putActor(*actor).isOk());
  }
  auto list = store->listActors();
  REQUIRE(list.isOk());
  REQUIRE(list->size() == 4);
  CHECK((*list)[0].id == early.id);
  CHECK((*list)[1].id == tieLow.id);
  CHECK((*list)[2].id == tieHigh.id);
  CHECK((*list)[3].id == late.id);
  early.initArgs.clear();  // status lists leave them out
  checkSameActor((*list)[0], early);
}

TEST_CASE("listActorsPage: a filtered page in list order, with every actor's state counted") {
  Backend backend;
  auto store = backend.open();
  const NodeId nodeA("aaaa" + randomHex(6)), nodeB("bbbb" + randomHex(6));
  std::vector<ActorRecord> made;
  for (int i = 0; i < 10; ++i) {
    ActorRecord a = sampleActor();
    a.id = ActorId::generate();
    a.createdMs = 1000 + i;
    a.state = i < 7 ? ActorState::kAlive : ActorState::kPending;
    a.nodeId = i % 2 == 0 ? nodeA : nodeB;
    REQUIRE(store->putActor(a).isOk());
    made.push_back(a);
  }
  ActorQuery all;
  all.limit = 3;
  auto first = store->listActorsPage(all);
  REQUIRE_MESSAGE(first.isOk(), first.status().toString());
  CHECK(first->matching == 10);
  CHECK(first->countsByState[ActorState::kAlive] == 7);
  CHECK(first->countsByState[ActorState::kPending] == 3);
  REQUIRE(first->actors.size() == 3);
  CHECK(first->actors[0].id == made[0].id);
  CHECK(first->actors[2].id == made[2].id);
  CHECK(first->actors[0].initArgs.empty());  // as listActors: no init args

  ActorQuery pendingOnB;  // pending: 7, 8, 9; on B: the odd ones
  pendingOnB.state = ActorState::kPending;
  pendingOnB.nodePrefix = "bbbb";
  pendingOnB.offset = 1;
  auto page = store->listActorsPage(pendingOnB);
  REQUIRE(page.isOk());
  CHECK(page->matching == 2);  // 7 and 9
  REQUIRE(page->actors.size() == 1);
  CHECK(page->actors[0].id == made[9].id);
  CHECK(page->countsByState[ActorState::kAlive] == 7);  // counts ignore the filters

  ActorQuery past;
  past.offset = 50;
  auto empty = store->listActorsPage(past);
  REQUIRE(empty.isOk());
  CHECK(empty->actors.empty());
  CHECK(empty->matching == 10);
}

TEST_CASE("actor names: claim, lookup and release") {
  Backend backend;
  auto store = backend.open();
  const ActorId owner = ActorId::generate();
  const ActorId rival = ActorId::generate();
  auto claim = [&](const std::string& name, const ActorId& id) {
    auto claimed = store->claimActorName(name, id);
    REQUIRE_MESSAGE(claimed.isOk(), claimed.status().toString());
    return *claimed;
  };
  auto lookup = [&](const std::string& name) {
    auto found = store->lookupActorName(name);
    REQUIRE_MESSAGE(found.isOk(), found.status().toString());
    return *found;
  };

  CHECK_FALSE(lookup("trainer").has_value());
  CHECK(claim("trainer", owner));
  CHECK(claim("trainer", owner));  // a retried claim succeeds
  CHECK_FALSE(claim("trainer", rival));
  CHECK(lookup("trainer") == std::optional<ActorId>(owner));

  // Names are independent of each other.
  CHECK(claim("trainer:eval/1", rival));
  CHECK(lookup("trainer:eval/1") == std::optional<ActorId>(rival));

  // Releasing by the wrong id changes nothing.
  REQUIRE(store->releaseActorName("trainer", rival).isOk());
  CHECK(lookup("trainer") == std::optional<ActorId>(owner));
  CHECK_FALSE(claim("trainer", rival));

  REQUIRE(store->releaseActorName("trainer", owner).isOk());
  REQUIRE(store->releaseActorName("trainer", owner).isOk());  // idempotent
  CHECK_FALSE(lookup("trainer").has_value());
  CHECK(claim("trainer", rival));
  CHECK(lookup("trainer") == std::optional<ActorId>(rival));
  CHECK(lookup("trainer:eval/1") == std::optional<ActorId>(rival));

  CHECK(store->claimActorName("", owner).status().code() == StatusCode::kInvalidArgument);
  CHECK(store->claimActorName("x", ActorId()).status().code() == StatusCode::kInvalidArgument);
  CHECK(store->releaseActorName("", owner).code() == StatusCode::kInvalidArgument);
  CHECK(store->lookupActorName("").status().code() == StatusCode::kInvalidArgument);
}

// ---- Placement groups ----

void checkSameGroup(const PlacementGroupRecord& got, const PlacementGroupRecord& want) {
  CHECK(got.id == want.id);
  CHECK(got.name == want.name);
  CHECK(got.strategy == want.strategy);
  CHECK(got.state == want.state);
  CHECK(got.pendingReason == want.pendingReason);
  CHECK(got.createdMs == want.createdMs);
  REQUIRE(got.bundles.size() == want.bundles.size());
  for (size_t i = 0; i < want.bundles.size(); ++i) {
    CAPTURE(i);
    CHECK(got.bundles[i].resources == want.bundles[i].resources);
    CHECK(got.bundles[i].nodeId == want.bundles[i].nodeId);
  }
}

TEST_CASE("placement groups: delete forgets a group and is idempotent") {
  Backend backend;
  auto store = backend.open();
  PlacementGroupRecord keep, drop;
  keep.id = PlacementGroupId::generate();
  drop.id = PlacementGroupId::generate();
  keep.createdMs = 1;
  drop.createdMs = 2;
  REQUIRE(store->putPlacementGroup(keep).isOk());
  REQUIRE(store->putPlacementGroup(drop).isOk());
  REQUIRE(store->deletePlacementGroup(drop.id).isOk());
  REQUIRE(store->deletePlacementGroup(drop.id).isOk());
  REQUIRE(store->deletePlacementGroup(PlacementGroupId::generate()).isOk());
  CHECK_FALSE(store->getPlacementGroup(drop.id)->has_value());
  auto list = store->listPlacementGroups();
  REQUIRE(list.isOk());
  REQUIRE(list->size() == 1);
  CHECK(list->front().id == keep.id);
}

TEST_CASE("placement groups: create and remove each in one step, with their claims") {
  Backend backend;
  auto store = backend.open();
  NodeRecord node = registerResourceNode(*store, {{"CPU", 4}});
  PlacementGroupRecord group;
  group.id = PlacementGroupId::generate();
  group.state = PlacementGroupState::kCreated;
  group.createdMs = 7;
  group.bundles = {Bundle{{{"CPU", 1}}, node.id}, Bundle{{{"CPU", 2}}, node.id}};
  auto holder = [&](int i) { return fmt::format("pg:{}:{}", group.id.hex(), i); };
  std::vector<Reservation> claims = {{node.id, holder(0), {{"CPU", 1}}}, {node.id, holder(1), {{"CPU", 2}}}};

  auto created = store->createPlacementGroup(group, claims);
  REQUIRE(created.isOk());
  CHECK(created->outcome == GroupCreation::Outcome::kCreated);
  checkSameGroup(**store->getPlacementGroup(group.id), group);
  CHECK(mustReservations(*store, node.id).size() == 2);
  CHECK(listedUsed(*store, node.id) == Resources{{"CPU", 3}});

  // A retry finds the group and writes nothing, even with other claims.
  PlacementGroupRecord again = group;
  again.bundles.push_back(Bundle{{{"CPU", 1}}, node.id});
  auto retried = store->createPlacementGroup(again, {{node.id, holder(2), {{"CPU", 1}}}});
  REQUIRE(retried.isOk());
  CHECK(retried->outcome == GroupCreation::Outcome::kExists);
  REQUIRE(retried->existing.has_value());
  checkSameGroup(*retried->existing, group);
  CHECK(mustReservations(*store, node.id).size() == 2);

  // A claim that no longer fits writes neither the group nor any claim.
  PlacementGroupRecord big;
  big.id = PlacementGroupId::generate();
  big.state = PlacementGroupState::kCreated;
  big.bundles = {Bundle{{{"CPU", 1}}, node.id}, Bundle{{{"CPU", 1}}, node.id}};
  auto refused = store->createPlacementGroup(
      big, {{node.id, fmt::format("pg:{}:0", big.id.hex()), {{"CPU", 1}}}, {node.id, fmt::format("pg:{}:1", big.id.hex()), {{"CPU", 1.5}}}});
  REQUIRE(refused.isOk());
  CHECK(refused->outcome == GroupCreation::Outcome::kRefused);
  CHECK_FALSE(store->getPlacementGroup(big.id)->has_value());
  CHECK(mustReservations(*store, node.id).size() == 2);

  // Removal releases every bundle's claim with the record.
  auto removed = store->removePlacementGroup(group.id);
  REQUIRE(removed.isOk());
  CHECK(removed->outcome == GroupRemoval::Outcome::kRemoved);
  CHECK_FALSE(removed->pendingWork);
  CHECK_FALSE(store->getPlacementGroup(group.id)->has_value());
  CHECK(mustReservations(*store, node.id).empty());
  CHECK(listedUsed(*store, node.id) == Resources{{"CPU", 0}});
  CHECK(store->listPlacementGroups()->empty());
  auto gone = store->removePlacementGroup(group.id);
  REQUIRE(gone.isOk());
  CHECK(gone->outcome == GroupRemoval::Outcome::kNotFound);
}

TEST_CASE("placement groups: a group with live actors is not removed in one step; indexes follow the records") {
  Backend backend;
  auto store = backend.open();
  PlacementGroupRecord group;
  group.id = PlacementGroupId::generate();
  group.state = PlacementGroupState::kPending;
  group.bundles = {Bundle{{{"CPU", 1}}, NodeId()}};
  REQUIRE(store->createPlacementGroup(group, {})->outcome == GroupCreation::Outcome::kCreated);
  auto work = store->listPendingWork();
  REQUIRE(work.isOk());
  REQUIRE(work->groups.size() == 1);
  CHECK(work->groups[0].id == group.id);
  CHECK(work->actors.empty());

  ActorRecord actor;
  actor.id = ActorId::generate();
  actor.type = "Counter";
  actor.placementGroup = group.id;
  actor.bundleIndex = 0;
  actor.state = ActorState::kPending;
  REQUIRE(store->putActor(actor).isOk());
  work = store->listPendingWork();
  REQUIRE(work->actors.size() == 1);
  CHECK(work->actors[0].id == actor.id);
  REQUIRE(store->listGroupActors(group.id)->size() == 1);
  CHECK(store->listGroupActors(PlacementGroupId::generate())->empty());

  auto kept = store->removePlacementGroup(group.id);
  REQUIRE(kept.isOk());
  CHECK(kept->outcome == GroupRemoval::Outcome::kHasActors);
  CHECK(kept->pendingWork);
  CHECK(store->getPlacementGroup(group.id)->has_value());

  // Placed, the actor no longer waits; its group is CREATED now.
  actor.nodeId = NodeId::generate();
  actor.state = ActorState::kAlive;
  REQUIRE(store->putActor(actor).isOk());
  group.state = PlacementGroupState::kCreated;
  REQUIRE(store->putPlacementGroup(group).isOk());
  work = store->listPendingWork();
  CHECK(work->groups.empty());
  CHECK(work->actors.empty());
  CHECK(store->listGroupActors(group.id)->size() == 1);

  // Dead, it leaves the group's index, and the group goes in one step.
  actor.state = ActorState::kDead;
  REQUIRE(store->putActor(actor).isOk());
  CHECK(store->listGroupActors(group.id)->empty());
  auto removed = store->removePlacementGroup(group.id);
  REQUIRE(removed.isOk());
  CHECK(removed->outcome == GroupRemoval::Outcome::kRemoved);
  CHECK_FALSE(removed->pendingWork);
}

TEST_CASE("placement groups: put, get and list keep every field") {
  Backend backend;
  auto store = backend.open();
  const PlacementStrategy strategies[] = {PlacementStrategy::kPack, PlacementStrategy::kSpread,
                                          PlacementStrategy::kStrictPack,
                                          PlacementStrategy::kStrictSpread};
  const PlacementGroupState states[] = {PlacementGroupState::kPending,
                                        PlacementGroupState::kCreated,
                                        PlacementGroupState::kRemoved};
  const NodeId placedOn = NodeId::generate();
  std::vector<PlacementGroupRecord> groups;
  for (int i = 0; i < 4; ++i) {
    PlacementGroupRecord group;
    // Ids descending while creation times ascend.
    group.id = PlacementGroupId(fmt::format("{:x}{}", 15 - i, randomHex(8)).substr(0, 16));
    group.name = i == 0 ? "" : fmt::format("group-{}", i);
    group.strategy = strategies[i];
    group.state = states[i % 3];
    group.pendingReason = i % 2 == 0 ? "" : "no node has 2 GPU free";
    group.createdMs = 1700000000000 + i;
    if (i > 0) {
      group.bundles.push_back(Bundle{{{"CPU", 1}, {"GPU", 0.5}}, placedOn});
      group.bundles.push_back(Bundle{{{"CPU", 2}, {"accel_slot", 1}}, NodeId()});
      group.bundles.push_back(Bundle{{}, NodeId::generate()});
    }
    groups.push_back(group);
  }
  for (auto it = groups.rbegin(); it != groups.rend(); ++it) {
    REQUIRE(store->putPlacementGroup(*it).isOk());
  }
  for (const PlacementGroupRecord& group : groups) {
    auto got = store->getPlacementGroup(group.id);
    REQUIRE_MESSAGE(got.isOk(), got.status().toString());
    REQUIRE(got->has_value());
    checkSameGroup(**got, group);
  }
  auto list = store->listPlacementGroups();
  REQUIRE_MESSAGE(list.isOk(), list.status().toString());
  REQUIRE(list->size() == groups.size());
  for (size_t i = 0; i < groups.size(); ++i) checkSameGroup((*list)[i], groups[i]);

  // Resized: a bundle is removed and the group placed; the put replaces the record.
  PlacementGroupRecord& resized = groups[1];
  resized.bundles.erase(resized.bundles.begin());
  resized.bundles[0].nodeId = placedOn;
  resized.state = PlacementGroupState::kCreated;
  resized.pendingReason.clear();
  REQUIRE(store->putPlacementGroup(resized).isOk());
  auto got = store->getPlacementGroup(resized.id);
  REQUIRE(got.isOk());
  REQUIRE(got->has_value());
  checkSameGroup(**got, resized);

  auto missing = store->getPlacementGroup(PlacementGroupId::generate());
  REQUIRE(missing.isOk());
  CHECK_FALSE(missing->has_value());
  CHECK(store->putPlacementGroup(PlacementGroupRecord{}).code() == StatusCode::kInvalidArgument);
}

TEST_CASE("state and strategy names round trip") {
  CHECK(std::string(actorStateName(ActorState::kPending)) == "PENDING");
  CHECK(std::string(actorStateName(ActorState::kAlive)) == "ALIVE");
  CHECK(std::string(actorStateName(ActorState::kRestarting)) == "RESTARTING");
  CHECK(std::string(actorStateName(ActorState::kDead)) == "DEAD");
  CHECK(std::string(placementGroupStateName(PlacementGroupState::kPending)) == "PENDING");
  CHECK(std::string(placementGroupStateName(PlacementGroupState::kCreated)) == "CREATED");
  CHECK(std::string(placementGroupStateName(PlacementGroupState::kRemoved)) == "REMOVED");

  const std::pair<PlacementStrategy, const char*> strategies[] = {
      {PlacementStrategy::kPack, "PACK"},
      {PlacementStrategy::kSpread, "SPREAD"},
      {PlacementStrategy::kStrictPack, "STRICT_PACK"},
      {PlacementStrategy::kStrictSpread, "STRICT_SPREAD"},
  };
  for (const auto& [strategy, name] : strategies) {
    CAPTURE(name);
    CHECK(std::string(placementStrategyName(strategy)) == name);
    auto parsed = parsePlacementStrategy(name);
    REQUIRE(parsed.isOk());
    CHECK(*parsed == strategy);
  }
  for (const char* bad : {"BOGUS", "pack", "", "STRICT_PACK "}) {
    CAPTURE(bad);
    auto parsed = parsePlacementStrategy(bad);
    REQUIRE_FALSE(parsed.isOk());
    CHECK(parsed.status().code() == StatusCode::kInvalidArgument);
  }
  CHECK(parsePlacementStrategy("BOGUS").status().message().find("BOGUS") != std::string::npos);
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
  REQUIRE((*store)->putMeta(ClusterMeta{"secret-token", "127.0.0.1:1", 1, 2, ""}).isOk());

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

TEST_CASE("redis store: scripts run by SHA1 survive a flushed script cache") {
  testing::RedisServerProcess server;
  auto store = connectRedisStore(server.options("test"));
  REQUIRE(store.isOk());
  NodeRecord node = sampleNode();
  REQUIRE((*store)->registerNode(node, kLongTtl).isOk());  // loads the register script
  ContextPtr admin = rawConnect(server);
  REQUIRE(rawCommand(admin.get(), {"AUTH", server.password()})->type != REDIS_REPLY_ERROR);
  // As after a Redis restart: the store's cached SHA1s now answer NOSCRIPT.
  REQUIRE(rawCommand(admin.get(), {"SCRIPT", "FLUSH"})->type != REDIS_REPLY_ERROR);
  REQUIRE((*store)->registerNode(node, kLongTtl).isOk());
  auto alive = (*store)->heartbeat(node.id, kLongTtl);
  REQUIRE(alive.isOk());
  CHECK(*alive);
  auto list = (*store)->listNodes();
  REQUIRE(list.isOk());
  CHECK(list->size() == 1);
}

TEST_CASE("redis store: a pipelined batch survives a flushed script cache") {
  testing::RedisServerProcess server;
  auto store = connectRedisStore(server.options("test"));
  REQUIRE(store.isOk());
  ActorRecord one = sampleActor(), two = sampleActor();
  two.id = ActorId::generate();
  REQUIRE((*store)->putActors({one}).isOk());  // loads the put script
  ContextPtr admin = rawConnect(server);
  REQUIRE(rawCommand(admin.get(), {"AUTH", server.password()})->type != REDIS_REPLY_ERROR);
  REQUIRE(rawCommand(admin.get(), {"SCRIPT", "FLUSH"})->type != REDIS_REPLY_ERROR);
  REQUIRE((*store)->putActors({one, two}).isOk());
  auto got = (*store)->getActors({one.id, two.id});
  REQUIRE(got.isOk());
  REQUIRE((*got)[1].has_value());
  checkSameActor(*(*got)[1], two);
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

// ---- Collective groups: epochs and rendezvous ----

// Next advance within a deadline, failing the test if none comes.
int64_t mustReceiveEpoch(GroupEpochWatch& watch) {
  auto epoch = watch.next(5s);
  REQUIRE_MESSAGE(epoch.isOk(), epoch.status().toString());
  REQUIRE_MESSAGE(epoch->has_value(), "no epoch advance within 5 s");
  return **epoch;
}

TEST_CASE("group epochs only rise; an advance is published once") {
  Backend backend;
  auto store = backend.open();
  auto other = backend.open();
  auto fresh = store->groupEpoch("job-a");
  REQUIRE(fresh.isOk());
  CHECK(*fresh == 0);

  auto watchOrError = other->watchGroupEpoch("job-a");
  REQUIRE_MESSAGE(watchOrError.isOk(), watchOrError.status().toString());
  auto watch = std::move(watchOrError).value();
  auto raised = store->advanceGroupEpoch("job-a", 3);
  REQUIRE(raised.isOk());
  CHECK(*raised == 3);
  CHECK(mustReceiveEpoch(*watch) == 3);
  CHECK(*other->groupEpoch("job-a") == 3);

  // A retry and a lower epoch change nothing and publish nothing: the next advance seen is 7.
  CHECK(*store->advanceGroupEpoch("job-a", 3) == 3);
  CHECK(*store->advanceGroupEpoch("job-a", 1) == 3);
  CHECK(*store->advanceGroupEpoch("job-a", 7) == 7);
  CHECK(mustReceiveEpoch(*watch) == 7);
  CHECK(*store->groupEpoch("job-a") == 7);

  // Groups are independent, also when one name is a prefix of another.
  CHECK(*store->groupEpoch("job-a:x") == 0);
  CHECK(*store->advanceGroupEpoch("job-a:x", 1) == 1);
  CHECK(*store->groupEpoch("job-a") == 7);
  CHECK(*store->advanceGroupEpoch("job-a", 8) == 8);
  CHECK(mustReceiveEpoch(*watch) == 8);  // job-a:x's advance was not delivered to job-a's watch

  CHECK(store->groupEpoch("").status().code() == StatusCode::kInvalidArgument);
  CHECK(store->advanceGroupEpoch("", 1).status().code() == StatusCode::kInvalidArgument);
  CHECK(store->advanceGroupEpoch("job-a", -1).status().code() == StatusCode::kInvalidArgument);
  CHECK(store->watchGroupEpoch("").status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("elastic groups: document, capped events, epoch, delete") {
  Backend backend;
  auto store = backend.open();
  auto none = store->getElasticGroup("g1");
  REQUIRE(none.isOk());
  CHECK_FALSE(none->has_value());
  REQUIRE(store->appendGroupEvent("g1", "before it exists").isOk());  // ignored
  REQUIRE(store->putElasticGroup("g2", "{}").isOk());
  REQUIRE(store->appendGroupEvent("g2", "1 a").isOk());
  REQUIRE(store->appendGroupEvent("g2", "2 b").isOk());
  REQUIRE(store->appendGroupEvent("g2", "1 a").isOk());  // a retry of the first: kept once
  REQUIRE(store->appendGroupEvent("g2", "3 a").isOk());
  CHECK((*store->getElasticGroup("g2"))->events == std::vector<std::string>{"1 a", "2 b", "3 a"});
  REQUIRE(store->deleteElasticGroup("g2").isOk());
  REQUIRE(store->putElasticGroup("g1", R"({"world_size": 2})").isOk());
  REQUIRE(store->putElasticGroup("g0", "{}").isOk());
  REQUIRE(store->putElasticGroup("g1", R"({"world_size": 3})").isOk());  // replaces, keeps its place
  for (int i = 0; i < kMaxGroupEvents + 5; ++i) REQUIRE(store->appendGroupEvent("g1", fmt::format("e{}", i)).isOk());
  REQUIRE(store->advanceGroupEpoch("g1", 4).isOk());
  REQUIRE(store->putRendezvousEntry("g1", 4, 0, "addr", kLongTtl).isOk());

  auto g1 = store->getElasticGroup("g1");
  REQUIRE(g1.isOk());
  REQUIRE(g1->has_value());
  CHECK((*g1)->doc == R"({"world_size": 3})");
  CHECK((*g1)->epoch == 4);
  REQUIRE((*g1)->events.size() == kMaxGroupEvents);
  CHECK((*g1)->events.front() == "e5");
  CHECK((*g1)->events.back() == fmt::format("e{}", kMaxGroupEvents + 4));
  auto all = store->listElasticGroups();
  REQUIRE(all.isOk());
  REQUIRE(all->size() == 2);  // by creation time, then id
  CHECK((*all)[0].id == ((*all)[0].id == "g0" ? "g0" : "g1"));
  CHECK((*all)[1].id != (*all)[0].id);

  REQUIRE(store->deleteElasticGroup("g1").isOk());
  REQUIRE(store->deleteElasticGroup("g1").isOk());  // idempotent
  CHECK_FALSE(store->getElasticGroup("g1")->has_value());
  CHECK(*store->groupEpoch("g1") == 0);
  CHECK(store->getRendezvous("g1", 4)->empty());
  CHECK(store->listElasticGroups()->size() == 1);
  CHECK(store->putElasticGroup("", "{}").code() == StatusCode::kInvalidArgument);
}

GroupCommand resizeCommand(uint32_t workers, std::string from = "host-a pid 7") {
  GroupCommand c;
  c.kind = GroupCommand::Kind::kResize;
  c.workers = workers;
  c.timeMs = 1700000000123;
  c.from = std::move(from);
  return c;
}

GroupCommand stopCommand() {
  GroupCommand c;
  c.kind = GroupCommand::Kind::kStop;
  c.timeMs = 1700000000456;
  c.from = "host-b pid 8";
  return c;
}

std::vector<uint64_t> commandSeqs(ClusterStore& store, const std::string& id) {
  auto group = store.getElasticGroup(id);
  REQUIRE(group.isOk());
  REQUIRE(group->has_value());
  std::vector<uint64_t> seqs;
  for (const auto& c : (*group)->commands) seqs.push_back(c.seq);
  return seqs;
}

TEST_CASE("elastic groups: commands are typed, numbered, kept once per retry, capped and deleted with the group") {
  Backend backend;
  auto store = backend.open();
  // A command to a group that does not exist is refused, not dropped: its sender must learn.
  auto unknown = store->appendGroupCommand("gc", resizeCommand(2), "n0");
  REQUIRE_FALSE(unknown.isOk());
  CHECK(unknown.status().code() == StatusCode::kNotFound);
  CHECK(unknown.status().message().find("'gc'") != std::string::npos);

  REQUIRE(store->putElasticGroup("gc", "{}").isOk());
  CHECK(*store->appendGroupCommand("gc", resizeCommand(3, "h\"ost\" \xc3\xa9 pid 1"), "n1") == 1);
  CHECK(*store->appendGroupCommand("gc", stopCommand(), "n2") == 2);
  CHECK(*store->appendGroupCommand("gc", resizeCommand(3), "n1") == 1);  // a retry of the first: kept once
  CHECK(*store->appendGroupCommand("gc", stopCommand(), "") == 3);       // without a nonce every call is one
  CHECK(*store->appendGroupCommand("gc", stopCommand(), "") == 4);
  auto group = store->getElasticGroup("gc");
  REQUIRE(group.isOk());
  REQUIRE((*group)->commands.size() == 4);
  const GroupCommand& first = (*group)->commands[0];
  CHECK(first.seq == 1);
  CHECK(first.kind == GroupCommand::Kind::kResize);
  CHECK(first.workers == 3);
  CHECK(first.timeMs == 1700000000123);
  CHECK(first.from == "h\"ost\" \xc3\xa9 pid 1");
  const GroupCommand& second = (*group)->commands[1];
  CHECK(second.seq == 2);
  CHECK(second.kind == GroupCommand::Kind::kStop);
  CHECK(second.workers == 0);
  CHECK(second.from == "host-b pid 8");
  CHECK((*group)->events.empty());  // commands are not events
  auto listed = store->listElasticGroups();
  REQUIRE(listed.isOk());
  REQUIRE(listed->size() == 1);
  CHECK((*listed)[0].commands.size() == 4);

  CHECK(store->appendGroupCommand("gc", resizeCommand(0), "").status().code() == StatusCode::kInvalidArgument);
  CHECK(store->appendGroupCommand("", stopCommand(), "").status().code() == StatusCode::kInvalidArgument);
  CHECK(commandSeqs(*store, "gc").size() == 4);

  // The newest kMaxGroupCommands are kept; the seq goes on past the trimmed ones.
  for (int i = 0; i < kMaxGroupCommands; ++i) {
    REQUIRE(store->appendGroupCommand("gc", resizeCommand(static_cast<uint32_t>(i + 1)), fmt::format("m{}", i)).isOk());
  }
  auto seqs = commandSeqs(*store, "gc");
  REQUIRE(seqs.size() == size_t(kMaxGroupCommands));
  CHECK(seqs.front() == 5);
  CHECK(seqs.back() == uint64_t(kMaxGroupCommands) + 4);
  for (size_t i = 1; i < seqs.size(); ++i) CHECK(seqs[i] == seqs[i - 1] + 1);
  CHECK(*store->appendGroupCommand("gc", stopCommand(), "n1") == uint64_t(kMaxGroupCommands) + 5);  // n1 was trimmed

  REQUIRE(store->deleteElasticGroup("gc").isOk());
  CHECK(store->appendGroupCommand("gc", stopCommand(), "late").status().code() == StatusCode::kNotFound);
  REQUIRE(store->putElasticGroup("gc", "{}").isOk());  // the id made again has none of the old commands
  CHECK(commandSeqs(*store, "gc").empty());
  CHECK(*store->appendGroupCommand("gc", stopCommand(), "n9") == 1);
}

TEST_CASE("group epoch watch: interrupt wakes a blocked next() at once") {
  Backend backend;
  auto store = backend.open();
  auto watchOrError = store->watchGroupEpoch("job-b");
  REQUIRE(watchOrError.isOk());
  auto watch = std::move(watchOrError).value();
  std::optional<Result<std::optional<int64_t>>> got;
  std::thread waiter([&] { got.emplace(watch->next(30s)); });
  const auto start = Clock::now();
  watch->interrupt();
  waiter.join();
  CHECK(Clock::now() - start < 2s);
  REQUIRE(got.has_value());
  REQUIRE(got->isOk());
  CHECK_FALSE((*got)->has_value());
  // Later calls return at once too.
  auto after = watch->next(30s);
  REQUIRE(after.isOk());
  CHECK_FALSE(after->has_value());
}

TEST_CASE("redis store: an epoch watch whose connection is killed watches again and misses no advance") {
  testing::RedisServerProcess server;
  auto store = connectRedisStore(server.options("test"));
  REQUIRE(store.isOk());
  auto watch = (*store)->watchGroupEpoch("job-w");
  REQUIRE(watch.isOk());
  ContextPtr admin = rawConnect(server);
  REQUIRE(rawCommand(admin.get(), {"AUTH", server.password()})->type != REDIS_REPLY_ERROR);
  // The subscriber's connection goes (as when Redis restarts), and the epoch advances while it
  // is away: the publish reaches nobody.
  REQUIRE(rawCommand(admin.get(), {"CLIENT", "KILL", "TYPE", "pubsub"})->type != REDIS_REPLY_ERROR);
  REQUIRE((*store)->advanceGroupEpoch("job-w", 4).isOk());
  auto next = (*watch)->next(10s);
  REQUIRE(next.isOk());
  REQUIRE(next->has_value());
  CHECK(**next == 4);  // read after subscribing again
  // And it is subscribed again: a later advance is published to it.
  REQUIRE((*store)->advanceGroupEpoch("job-w", 5).isOk());
  next = (*watch)->next(10s);
  REQUIRE(next.isOk());
  REQUIRE(next->has_value());
  CHECK(**next == 5);
}

TEST_CASE("rendezvous: entries by rank, per (group, epoch), replaced and expiring") {
  Backend backend;
  auto store = backend.open();
  auto other = backend.open();
  auto empty = store->getRendezvous("job-c", 1);
  REQUIRE(empty.isOk());
  CHECK(empty->empty());

  REQUIRE(store->putRendezvousEntry("job-c", 1, 0, "127.0.0.1:4000", kLongTtl).isOk());
  REQUIRE(other->putRendezvousEntry("job-c", 1, 1, "127.0.0.1:4001", kLongTtl).isOk());
  const std::string binary("\0nccl\xff\x01id", 9);
  REQUIRE(other->putRendezvousEntry("job-c", 1, 2, binary, kLongTtl).isOk());
  REQUIRE(store->putRendezvousEntry("job-c", 1, 1, "127.0.0.1:5001", kLongTtl).isOk());  // replaces
  auto entries = other->getRendezvous("job-c", 1);
  REQUIRE(entries.isOk());
  CHECK(*entries == std::map<int32_t, std::string>{
                        {0, "127.0.0.1:4000"}, {1, "127.0.0.1:5001"}, {2, binary}});

  // Another epoch, and a group whose name ends like an epoch, are separate rendezvous.
  CHECK(store->getRendezvous("job-c", 2)->empty());
  REQUIRE(store->putRendezvousEntry("job-c:1", 2, 0, "elsewhere", kLongTtl).isOk());
  CHECK(store->getRendezvous("job-c", 1)->size() == 3);
  CHECK(store->getRendezvous("job-c:1", 2)->size() == 1);

  // A rendezvous expires `ttl` after its last write.
  REQUIRE(store->putRendezvousEntry("job-d", 4, 0, "soon gone", kShortTtl).isOk());
  CHECK(store->getRendezvous("job-d", 4)->size() == 1);
  const auto deadline = Clock::now() + 5s;
  bool gone = false;
  while (!gone && Clock::now() < deadline) {
    auto now = store->getRendezvous("job-d", 4);
    REQUIRE(now.isOk());
    gone = now->empty();
    if (!gone) std::this_thread::sleep_for(20ms);  // polling the condition (expiry), 5 s deadline
  }
  CHECK(gone);

  CHECK(store->putRendezvousEntry("", 1, 0, "x", kLongTtl).code() == StatusCode::kInvalidArgument);
  CHECK(store->putRendezvousEntry("g", -1, 0, "x", kLongTtl).code() ==
        StatusCode::kInvalidArgument);
  CHECK(store->putRendezvousEntry("g", 1, -1, "x", kLongTtl).code() ==
        StatusCode::kInvalidArgument);
  CHECK(store->putRendezvousEntry("g", 1, 0, "x", 0ms).code() == StatusCode::kInvalidArgument);
  CHECK(store->getRendezvous("", 1).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("key spaces: set, get, add, compareSet, delete and count, each space apart") {
  Backend backend;
  auto store = backend.open();
  auto other = backend.open();  // a second client of the same cluster
  using Values = std::vector<std::optional<std::string>>;
  CHECK(*store->getKeys("g:1", {"a"}) == Values{std::nullopt});
  CHECK(*store->countKeys("g:1") == 0);

  const std::string binary("\0nccl\xff\x01id", 9);
  REQUIRE(store->setKey("g:1", "a", binary, kLongTtl).isOk());
  REQUIRE(other->setKey("g:1", "", "empty key", kLongTtl).isOk());
  CHECK(*other->getKeys("g:1", {"a", "missing", ""}) == Values{binary, std::nullopt, "empty key"});
  CHECK(other->getKeys("g:1", {})->empty());

  // add: an absent key counts from 0 (and exists after an add of 0); the sum is decimal text.
  CHECK(*store->addToKey("g:1", "n", 0, kLongTtl) == 0);
  CHECK(*store->getKeys("g:1", {"n"}) == Values{"0"});
  CHECK(*store->addToKey("g:1", "n", 5, kLongTtl) == 5);
  CHECK(*other->addToKey("g:1", "n", -7, kLongTtl) == -2);
  CHECK(*store->addToKey("g:1", "big", int64_t{1} << 60, kLongTtl) == int64_t{1} << 60);
  CHECK(*store->addToKey("g:1", "big", 1, kLongTtl) == (int64_t{1} << 60) + 1);  // beyond a double's 53 bits
  auto notInteger = store->addToKey("g:1", "a", 1, kLongTtl);
  CHECK(notInteger.status().code() == StatusCode::kFailedPrecondition);
  CHECK(notInteger.status().message().find("key 'a'") != std::string::npos);
  CHECK(*store->getKeys("g:1", {"a"}) == Values{binary});  // untouched

  // compareSet, as torch's stores: absent and expected empty sets; absent otherwise returns
  // `expected`; a match sets; a mismatch returns the value.
  CHECK(*store->compareSetKey("g:1", "c", "x", "y", kLongTtl) == "x");
  CHECK(*store->getKeys("g:1", {"c"}) == Values{std::nullopt});
  CHECK(*store->compareSetKey("g:1", "c", "", "first", kLongTtl) == "first");
  CHECK(*other->compareSetKey("g:1", "c", "wrong", "second", kLongTtl) == "first");
  CHECK(*other->compareSetKey("g:1", "c", "first", "second", kLongTtl) == "second");
  CHECK(*store->getKeys("g:1", {"c"}) == Values{"second"});

  // Another space (another epoch, a name that extends this one) sees none of it.
  CHECK(*store->getKeys("g:2", {"a", "n"}) == Values{std::nullopt, std::nullopt});
  REQUIRE(store->setKey("g:1:x", "a", "other", kLongTtl).isOk());
  CHECK(*store->getKeys("g:1", {"a"}) == Values{binary});
  CHECK(*store->countKeys("g:1") == 5);  // a, "", n, big, c
  CHECK(*store->countKeys("g:1:x") == 1);

  CHECK(*store->deleteKey("g:1", "n"));
  CHECK_FALSE(*other->deleteKey("g:1", "n"));
  CHECK_FALSE(*other->deleteKey("nowhere", "n"));
  CHECK(*store->countKeys("g:1") == 4);
  REQUIRE(other->deleteKeySpace("g:1").isOk());
  REQUIRE(other->deleteKeySpace("g:1").isOk());  // idempotent
  CHECK(*store->countKeys("g:1") == 0);
  CHECK(*store->getKeys("g:1", {"a"}) == Values{std::nullopt});
  CHECK(*store->countKeys("g:1:x") == 1);

  CHECK(store->setKey("", "a", "x", kLongTtl).code() == StatusCode::kInvalidArgument);
  CHECK(store->setKey("s", "a", "x", 0ms).code() == StatusCode::kInvalidArgument);
  CHECK(store->addToKey("s", "a", 1, 0ms).status().code() == StatusCode::kInvalidArgument);
  CHECK(store->getKeys("", {"a"}).status().code() == StatusCode::kInvalidArgument);
  CHECK(store->countKeys("").status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("key spaces: a space expires ttl after its last write; a group's go with the group") {
  Backend backend;
  auto store = backend.open();
  REQUIRE(store->setKey("short", "a", "1", kShortTtl).isOk());
  REQUIRE(store->addToKey("short", "n", 1, kShortTtl).isOk());
  CHECK(*store->countKeys("short") == 2);
  const auto deadline = Clock::now() + 5s;
  bool gone = false;
  while (!gone && Clock::now() < deadline) {
    auto count = store->countKeys("short");
    REQUIRE(count.isOk());
    gone = *count == 0;
    if (!gone) std::this_thread::sleep_for(20ms);  // polling the condition (expiry), 5 s deadline
  }
  CHECK(gone);
  CHECK(*store->addToKey("short", "n", 1, kLongTtl) == 1);  // an expired space starts again empty

  REQUIRE(store->putElasticGroup("grp", "{}").isOk());
  REQUIRE(store->advanceGroupEpoch("grp", 2).isOk());
  for (int64_t e : {0, 1, 2}) REQUIRE(store->setKey(groupKeySpace("grp", e), "k", "v", kLongTtl).isOk());
  REQUIRE(store->addToKey(groupKeySpace("grp", 2), "n", 3, kLongTtl).isOk());
  REQUIRE(store->setKey(groupKeySpace("grp2", 1), "k", "v", kLongTtl).isOk());
  CHECK(groupKeySpace("grp", 2) == "grp:2");
  REQUIRE(store->deleteElasticGroup("grp").isOk());
  for (int64_t e : {0, 1, 2}) CHECK(*store->countKeys(groupKeySpace("grp", e)) == 0);
  CHECK(*store->countKeys(groupKeySpace("grp2", 1)) == 1);  // another group's is kept
}

TEST_CASE("redis store: an add retried after a lost reply counts once") {
  // What RedisConnection::run does after a lost reply: the same script with the same add id.
  testing::RedisServerProcess server;
  auto store = connectRedisStore(server.options("test"));
  REQUIRE(store.isOk());
  REQUIRE((*store)->addToKey("s", "n", 1, kLongTtl).isOk());
  ContextPtr admin = rawConnect(server);
  REQUIRE(rawCommand(admin.get(), {"AUTH", server.password()})->type != REDIS_REPLY_ERROR);
  const std::vector<std::string> add = {"EVAL", redis_scripts::kAddToKeyScript, "2", "troupe:test:kv:s",
                                        "troupe:test:kv_adds:s", "n", "2", "60000", "retried-add-id"};
  for (int attempt = 0; attempt < 2; ++attempt) {
    ReplyPtr reply = rawCommand(admin.get(), add);
    REQUIRE(reply->type == REDIS_REPLY_ARRAY);
    REQUIRE(reply->elements == 2);
    CHECK(std::string(reply->element[1]->str, reply->element[1]->len) == "3");  // both times
  }
  CHECK(*(*store)->addToKey("s", "n", 0, kLongTtl) == 3);
  CHECK(*(*store)->addToKey("s", "n", 1, kLongTtl) == 4);  // this store's own adds carry new ids
  CHECK(*(*store)->addToKey("s", "n", 1, kLongTtl) == 5);
}

TEST_CASE("listLiveActors skips DEAD actors; listActors shows them") {
  Backend backend;
  auto store = backend.open();
  ActorRecord alive = sampleActor();
  alive.state = ActorState::kAlive;
  ActorRecord dead = sampleActor();
  dead.state = ActorState::kDead;
  REQUIRE(store->putActor(alive).isOk());
  REQUIRE(store->putActor(dead).isOk());
  auto live = store->listLiveActors();
  REQUIRE(live.isOk());
  REQUIRE(live->size() == 1);
  CHECK((*live)[0].id == alive.id);
  CHECK(store->listActors()->size() == 2);
  // An actor that dies leaves the live index.
  alive.state = ActorState::kDead;
  REQUIRE(store->putActor(alive).isOk());
  CHECK(store->listLiveActors()->empty());
}

TEST_CASE("listNodeActors follows each live actor to its node; listDeadNodesWithWork finds what a death left") {
  Backend backend;
  auto store = backend.open();
  NodeRecord a = sampleNode("a"), b = sampleNode("b");
  REQUIRE(store->registerNode(a, kLongTtl).isOk());
  REQUIRE(store->registerNode(b, kLongTtl).isOk());
  auto idsOn = [&](const NodeId& node) {
    auto listed = store->listNodeActors(node);
    REQUIRE_MESSAGE(listed.isOk(), listed.status().toString());
    std::set<ActorId> ids;
    for (const auto& actor : *listed) ids.insert(actor.id);
    return ids;
  };
  ActorRecord x = sampleActor(), y = sampleActor(), waiting = sampleActor();
  x.state = y.state = ActorState::kAlive;
  x.nodeId = y.nodeId = a.id;
  waiting.state = ActorState::kPending;
  waiting.nodeId = NodeId();
  REQUIRE(store->putActor(x).isOk());
  REQUIRE(store->putActor(y).isOk());
  REQUIRE(store->putActor(waiting).isOk());
  CHECK(idsOn(a.id) == std::set<ActorId>{x.id, y.id});
  CHECK(idsOn(b.id).empty());
  // A restart on another node moves it; an actor that dies leaves the index.
  x.state = ActorState::kRestarting;
  x.nodeId = b.id;
  REQUIRE(store->putActor(x).isOk());
  y.state = ActorState::kDead;
  REQUIRE(store->putActor(y).isOk());
  CHECK(idsOn(a.id).empty());
  CHECK(idsOn(b.id) == std::set<ActorId>{x.id});

  // Only DEAD nodes are listed, and only while something is still on them.
  REQUIRE(*store->reserve({Reservation{a.id, "pg:00ff:0", {{"CPU", 1}}}}));
  CHECK(store->listDeadNodesWithWork()->empty());
  REQUIRE(store->markNodeDead(a.id, "test").isOk());
  REQUIRE(store->markNodeDead(b.id, "test").isOk());
  auto busy = store->listDeadNodesWithWork();
  REQUIRE(busy.isOk());
  CHECK(std::set<NodeId>(busy->begin(), busy->end()) == std::set<NodeId>{a.id, b.id});  // a claim; an actor
  REQUIRE(store->release({Reservation{a.id, "pg:00ff:0", {}}}).isOk());
  x.state = ActorState::kRestarting;
  x.nodeId = NodeId();
  REQUIRE(store->putActor(x).isOk());
  CHECK(store->listDeadNodesWithWork()->empty());
}

TEST_CASE("Redis forgets a DEAD node's actor index with its record") {
  testing::RedisServerProcess server;
  auto options = server.options("test");
  options.keepDeadNodes = 1;
  auto store = connectRedisStore(options);
  REQUIRE(store.isOk());
  NodeRecord first = sampleNode("first"), second = sampleNode("second");
  for (const NodeRecord& node : {first, second}) {
    REQUIRE((*store)->registerNode(node, std::chrono::seconds(30)).isOk());
    ActorRecord stranded = sampleActor();
    stranded.state = ActorState::kAlive;
    stranded.nodeId = node.id;
    REQUIRE((*store)->putActor(stranded).isOk());
  }
  REQUIRE((*store)->markNodeDead(first.id, "test").isOk());
  CHECK((*store)->listNodeActors(first.id)->size() == 1);
  CHECK((*store)->listDeadNodesWithWork()->size() == 1);
  // The second death pushes one of the two (the older, or the lower id within a millisecond)
  // out of the kept history, index and all.
  REQUIRE((*store)->markNodeDead(second.id, "test").isOk());
  CHECK((*store)->listNodeActors(first.id)->size() + (*store)->listNodeActors(second.id)->size() == 1);
  CHECK((*store)->listDeadNodesWithWork()->size() == 1);
}

// Calls Redis made (scripts' own included) of the named commands since the last CONFIG RESETSTAT.
long commandCalls(redisContext* admin, std::initializer_list<const char*> commands) {
  ReplyPtr stats = rawCommand(admin, {"INFO", "commandstats"});
  REQUIRE(stats->type == REDIS_REPLY_STRING);
  std::string text(stats->str, stats->len);
  long total = 0;
  for (const char* command : commands) {
    auto at = text.find(command);
    if (at != std::string::npos) total += std::stol(text.substr(text.find("calls=", at) + 6));
  }
  return total;
}

TEST_CASE("redis store: a heartbeat asks no INFO, and a reap reads only the nodes whose deadline passed") {
  testing::RedisServerProcess server;
  auto store = connectRedisStore(server.options("test"));
  REQUIRE(store.isOk());
  ContextPtr admin = rawConnect(server);
  REQUIRE(rawCommand(admin.get(), {"AUTH", server.password()})->type != REDIS_REPLY_ERROR);
  std::vector<NodeRecord> nodes;
  for (int i = 0; i < 200; ++i) {
    nodes.push_back(sampleNode(fmt::format("n{}", i)));
    nodes.back().isHead = true;  // judged by the reaps alone (no store gateway here)
    REQUIRE((*store)->registerNode(nodes.back(), i == 0 ? kShortTtl : kLongTtl).isOk());
  }
  REQUIRE((*store)->reapExpiredNodes().isOk());  // the first reap indexes the deadlines of stores written before
  REQUIRE(rawCommand(admin.get(), {"CONFIG", "RESETSTAT"})->type != REDIS_REPLY_ERROR);
  for (int i = 1; i < 200; ++i) REQUIRE(*(*store)->heartbeat(nodes[i].id, kLongTtl));
  CHECK(commandCalls(admin.get(), {"cmdstat_info:"}) == 0);
  // Node 0 stops beating: it is reaped within TTL + 1 s, and no reap reads the other 199.
  REQUIRE(rawCommand(admin.get(), {"CONFIG", "RESETSTAT"})->type != REDIS_REPLY_ERROR);
  const auto start = Clock::now();
  bool reaped = false;
  int reaps = 0;
  while (!reaped && Clock::now() < start + kShortTtl + 1s) {
    auto dead = (*store)->reapExpiredNodes();
    REQUIRE(dead.isOk());
    ++reaps;
    reaped = dead->size() == 1 && (*dead)[0] == nodes[0].id;
    std::this_thread::sleep_for(20ms);  // the reap period, not a wait for the condition
  }
  REQUIRE(reaped);
  // A whole walk would be 200 node reads per reap; the index leaves the one due node, a few times.
  CHECK(commandCalls(admin.get(), {"cmdstat_hget:", "cmdstat_hmget:", "cmdstat_exists:"}) <= 4 * reaps + 20);
  CHECK(mustGet(**store, nodes[1].id).state == NodeState::kAlive);
}

TEST_CASE("redis store: a group's command written by another version or by hand is refused, not misread") {
  testing::RedisServerProcess server;
  auto store = connectRedisStore(server.options("test"));
  REQUIRE(store.isOk());
  ContextPtr admin = rawConnect(server);
  REQUIRE(rawCommand(admin.get(), {"AUTH", server.password()})->type != REDIS_REPLY_ERROR);
  const std::string key = "troupe:test:egroup_commands:g";
  for (const std::string bad :
       {"not json", R"({"seq":0,"time_ms":1,"from":"x","kind":"stop","workers":0})",
        R"({"seq":-2,"time_ms":1,"from":"x","kind":"stop","workers":0})",
        R"({"seq":1,"time_ms":1,"from":"x","kind":"resize","workers":0})",
        R"({"seq":1,"time_ms":1,"from":"x","kind":"resize","workers":4294967296})",
        R"({"seq":1,"time_ms":1,"from":"x","kind":"resize","workers":-1})",
        R"({"seq":1,"time_ms":1,"from":"x","kind":"grow","workers":1})",
        R"({"seq":1,"time_ms":"soon","from":"x","kind":"stop","workers":0})",
        R"({"seq":1,"time_ms":1,"kind":"stop","workers":0})"}) {
    CAPTURE(bad);
    REQUIRE((*store)->putElasticGroup("g", "{}").isOk());
    REQUIRE(rawCommand(admin.get(), {"RPUSH", key, bad})->type == REDIS_REPLY_INTEGER);
    auto group = (*store)->getElasticGroup("g");
    REQUIRE_FALSE(group.isOk());
    CHECK(group.status().code() == StatusCode::kInternal);
    CHECK(group.status().message().find(key) != std::string::npos);
    REQUIRE((*store)->deleteElasticGroup("g").isOk());
  }
  // Seqs out of order are as wrong as a bad field.
  REQUIRE((*store)->putElasticGroup("g", "{}").isOk());
  for (const char* seq : {"2", "2"}) {
    REQUIRE(rawCommand(admin.get(), {"RPUSH", key, fmt::format(R"({{"seq":{},"time_ms":1,"from":"x","kind":"stop"}})", seq)})
                ->type == REDIS_REPLY_INTEGER);
  }
  auto repeated = (*store)->getElasticGroup("g");
  REQUIRE_FALSE(repeated.isOk());
  CHECK(repeated.status().message().find("command 2 follows command 2") != std::string::npos);
  // The script reads the kept commands too: one it cannot read fails the append, never numbers it 1.
  REQUIRE(rawCommand(admin.get(), {"RPUSH", key, "not json"})->type == REDIS_REPLY_INTEGER);
  CHECK_FALSE((*store)->appendGroupCommand("g", stopCommand(), "").isOk());
}

TEST_CASE("redis store: the nodes behind a store gateway that went quiet are not reaped, and get a TTL after it beats") {
  testing::RedisServerProcess server;
  auto store = connectRedisStore(server.options("test"));
  REQUIRE(store.isOk());
  ContextPtr admin = rawConnect(server);
  REQUIRE(rawCommand(admin.get(), {"AUTH", server.password()})->type != REDIS_REPLY_ERROR);
  REQUIRE((*store)->putStoreGateway("127.0.0.1:1").isOk());
  NodeRecord head = sampleNode("head"), remote = sampleNode("remote");
  head.isHead = true;
  REQUIRE((*store)->registerNode(head, kShortTtl).isOk());
  REQUIRE((*store)->registerNode(remote, kShortTtl).isOk());
  // The gateway's last beat was 2 s ago (the seam: its beat is a field of the meta hash).
  REQUIRE(rawCommand(admin.get(), {"HSET", "troupe:test:meta", "store_gateway_beat_ms",
                                   std::to_string(wallClockMs() - 2000)})->type != REDIS_REPLY_ERROR);
  // Neither beats: the head's node dies; the remote one, whose beats the gateway would carry, not.
  const auto start = Clock::now();
  bool headDead = false;
  while (!headDead && Clock::now() < start + kShortTtl + 1s) {
    auto dead = (*store)->reapExpiredNodes();
    REQUIRE(dead.isOk());
    for (const NodeId& id : *dead) {
      REQUIRE(id == head.id);
      headDead = true;
    }
    std::this_thread::sleep_for(20ms);  // the reap period, not a wait for the condition
  }
  REQUIRE(headDead);
  for (int i = 0; i < 5; ++i) REQUIRE((*store)->reapExpiredNodes()->empty());
  CHECK(mustGet(**store, remote.id).state == NodeState::kAlive);
  // The gateway beats again (as a restarted one does): the remote node is judged a TTL later.
  const auto back = Clock::now();
  REQUIRE((*store)->putStoreGateway("127.0.0.1:1").isOk());
  bool remoteDead = false;
  while (!remoteDead && Clock::now() < back + kShortTtl + 1s) {
    // The gateway beats on (every 20 ms here), as its event loop does every 250 ms.
    REQUIRE(rawCommand(admin.get(), {"EVAL", redis_scripts::kGatewayBeatScript, "1", "troupe:test:meta", "0"})->type ==
            REDIS_REPLY_INTEGER);
    auto dead = (*store)->reapExpiredNodes();
    REQUIRE(dead.isOk());
    remoteDead = dead->size() == 1;
    if (!remoteDead) std::this_thread::sleep_for(20ms);  // the reap period
  }
  REQUIRE(remoteDead);
  CHECK(Clock::now() - back >= kShortTtl - 10ms);  // Redis's clock and ours may differ by a tick
}

TEST_CASE("redis store: a status page reads the page's records, not every actor's, and its counts stay exact") {
  testing::RedisServerProcess server;
  auto options = server.options("test");
  options.keepDeadActors = 5;
  auto store = connectRedisStore(options);
  REQUIRE(store.isOk());
  ContextPtr admin = rawConnect(server);
  REQUIRE(rawCommand(admin.get(), {"AUTH", server.password()})->type != REDIS_REPLY_ERROR);
  // The calls Redis made for the store since the last reset: scripts' own calls count too.
  auto recordReads = [&]() {
    ReplyPtr stats = rawCommand(admin.get(), {"INFO", "commandstats"});
    REQUIRE(stats->type == REDIS_REPLY_STRING);
    std::string text(stats->str, stats->len);
    long total = 0;
    for (const char* command : {"cmdstat_hget:", "cmdstat_hmget:", "cmdstat_hgetall:"}) {
      auto at = text.find(command);
      if (at != std::string::npos) total += std::stol(text.substr(text.find("calls=", at) + 6));
    }
    return total;
  };
  std::vector<ActorRecord> actors;
  for (int i = 0; i < 300; ++i) {
    ActorRecord a = sampleActor();
    a.name.clear();
    a.state = ActorState::kAlive;
    a.createdMs = 1000 + i;
    actors.push_back(a);
    REQUIRE((*store)->putActor(a).isOk());
  }
  ActorQuery query;
  query.limit = 10;
  REQUIRE((*store)->listActorsPage(query).isOk());  // the first page counts the records once
  REQUIRE(rawCommand(admin.get(), {"CONFIG", "RESETSTAT"})->type != REDIS_REPLY_ERROR);
  auto page = (*store)->listActorsPage(query);
  REQUIRE(page.isOk());
  CHECK(page->actors.size() == 10);
  CHECK(page->matching == 300);
  CHECK(page->countsByState.at(ActorState::kAlive) == 300);
  CHECK(recordReads() <= 12);
  // A state filter stops once its page is full, and knows its total from the counts.
  query.state = ActorState::kAlive;
  REQUIRE(rawCommand(admin.get(), {"CONFIG", "RESETSTAT"})->type != REDIS_REPLY_ERROR);
  page = (*store)->listActorsPage(query);
  REQUIRE(page.isOk());
  CHECK(page->actors.size() == 10);
  CHECK(page->matching == 300);
  CHECK(recordReads() <= 25);

  // A state and one whole node id: that node's live-actor set, not every record.
  NodeRecord host = sampleNode("host"), other = sampleNode("other");
  REQUIRE((*store)->registerNode(host, kLongTtl).isOk());
  REQUIRE((*store)->registerNode(other, kLongTtl).isOk());
  for (int i = 0; i < 4; ++i) {
    actors[100 + i].nodeId = i < 3 ? host.id : other.id;
    REQUIRE((*store)->putActor(actors[100 + i]).isOk());
  }
  query.nodePrefix = host.id.hex();
  REQUIRE(rawCommand(admin.get(), {"CONFIG", "RESETSTAT"})->type != REDIS_REPLY_ERROR);
  page = (*store)->listActorsPage(query);
  REQUIRE(page.isOk());
  CHECK(page->matching == 3);
  REQUIRE(page->actors.size() == 3);
  for (int i = 0; i < 3; ++i) CHECK(page->actors[i].id == actors[100 + i].id);  // in list order
  CHECK(recordReads() <= 12);
  query.nodePrefix.clear();
  query.state.reset();

  // The counts follow every change: deaths, restarts, and DEAD records trimmed past keepDeadActors.
  for (int i = 0; i < 8; ++i) {
    actors[i].state = ActorState::kDead;
    actors[i].updatedMs = 5000 + i;
    REQUIRE((*store)->putActor(actors[i]).isOk());
    REQUIRE((*store)->putActor(actors[i]).isOk());  // a retried write counts once
  }
  actors[10].state = ActorState::kRestarting;
  REQUIRE((*store)->putActor(actors[10]).isOk());
  page = (*store)->listActorsPage(query);
  REQUIRE(page.isOk());
  auto listed = (*store)->listActors();
  REQUIRE(listed.isOk());
  std::map<ActorState, uint64_t> recount;
  for (const auto& a : *listed) recount[a.state] += 1;
  CHECK(recount[ActorState::kDead] == 5);
  CHECK(page->countsByState == recount);
  CHECK(page->matching == listed->size());
}

TEST_CASE("Redis keeps only the newest DEAD actor records") {
  testing::RedisServerProcess server;
  auto options = server.options("test");
  options.keepDeadActors = 3;
  auto store = connectRedisStore(options);
  REQUIRE(store.isOk());
  ActorRecord keeper = sampleActor();
  keeper.state = ActorState::kAlive;
  REQUIRE((*store)->putActor(keeper).isOk());
  std::vector<ActorId> dead;
  for (int i = 0; i < 8; ++i) {
    ActorRecord a = sampleActor();
    a.state = ActorState::kDead;
    a.updatedMs = 1000 + i;
    dead.push_back(a.id);
    REQUIRE((*store)->putActor(a).isOk());
  }
  auto all = (*store)->listActors();
  REQUIRE(all.isOk());
  REQUIRE(all->size() == 4);  // the live one and the newest three DEAD
  std::set<ActorId> shown;
  for (const auto& a : *all) shown.insert(a.id);
  CHECK(shown.count(keeper.id) == 1);
  for (int i = 5; i < 8; ++i) CHECK(shown.count(dead[i]) == 1);
  for (int i = 0; i < 5; ++i) CHECK(!(*(*store)->getActor(dead[i])).has_value());
  CHECK((*store)->listLiveActors()->size() == 1);
}


TEST_CASE("Redis keeps only the newest DEAD node records, and a node that comes back is kept") {
  testing::RedisServerProcess server;
  auto options = server.options("test");
  options.keepDeadNodes = 2;
  auto store = connectRedisStore(options);
  REQUIRE(store.isOk());
  std::vector<NodeRecord> nodes;
  for (int i = 0; i < 5; ++i) {
    nodes.push_back(sampleNode(fmt::format("w{}", i)));
    REQUIRE((*store)->registerNode(nodes.back(), std::chrono::seconds(30)).isOk());
  }
  auto counts = [&]() {
    std::map<NodeState, int> n;
    auto listed = (*store)->listNodes();
    REQUIRE(listed.isOk());
    for (const auto& node : *listed) n[node.state]++;
    return n;
  };
  for (int i = 0; i < 3; ++i) REQUIRE((*store)->markNodeDead(nodes[i].id, "test").isOk());
  CHECK(counts()[NodeState::kDead] == 2);  // one of the three records is gone
  CHECK(counts()[NodeState::kAlive] == 2);
  // Node 3 dies and comes back: once ALIVE again it is not counted (or deleted) as DEAD.
  REQUIRE((*store)->markNodeDead(nodes[3].id, "test").isOk());
  REQUIRE((*store)->registerNode(nodes[3], std::chrono::seconds(30)).isOk());
  REQUIRE((*store)->markNodeDead(nodes[4].id, "test").isOk());
  CHECK(counts()[NodeState::kDead] == 2);
  CHECK(counts()[NodeState::kAlive] == 1);
  auto back = (*store)->getNode(nodes[3].id);
  REQUIRE(back.isOk());
  REQUIRE(back->has_value());
  CHECK((*back)->state == NodeState::kAlive);
}

}  // namespace
}  // namespace troupe
