// The controller and node agents as real processes against a real Redis: registration,
// heartbeat expiry, and a controller restart (kill -9) that recovers every node from Redis.
#include <doctest/doctest.h>

#include <signal.h>

#include <thread>

#include "troupe/runtime/client.h"
#include "troupe/testing/cluster_fixture.h"

namespace troupe {
namespace {

using testing::Cluster;
using testing::eventually;

TEST_CASE("controller: nodes register with their resources and heartbeat") {
  Cluster c(1000);
  c.startController();
  NodeId a = c.startNode();
  auto nodes = c.nodes();
  REQUIRE(nodes.isOk());
  REQUIRE(nodes->size() == 1);
  const NodeRecord& n = nodes->front();
  CHECK(n.id == a);
  CHECK(n.total.at("CPU") == 3);
  CHECK(n.total.at("ssd") == 1);
  CHECK(n.total.at("memory") > 0);
  CHECK(n.pid == c.nodeProcesses().front().pid());
  // Heartbeats keep it alive well past its TTL: wait until it has beaten for two TTLs.
  int64_t registered = n.registeredMs;
  CHECK(eventually(std::chrono::milliseconds(4 * c.ttlMs()), [&]() {
    auto again = c.nodes();
    return again.isOk() && again->front().lastHeartbeatMs > registered + 2 * c.ttlMs();
  }));
  CHECK(c.state(a) == "ALIVE");
}

TEST_CASE("controller: a stalled store gateway (SIGSTOP for 3 TTLs) expires none of the nodes whose beats it carries") {
  Cluster c(1000);
  c.startController();
  NodeId a = c.startNode();  // beats through the gateway, as every node but the head's
  REQUIRE(c.state(a) == "ALIVE");
  pid_t gateway = c.head().gateway().pid();
  REQUIRE(::kill(gateway, SIGSTOP) == 0);
  // The stall's length is the fault injected (three TTLs), not a wait for a condition.
  std::this_thread::sleep_for(std::chrono::milliseconds(3 * c.ttlMs()));
  // Read from Redis, what the controller's reaps write (an RPC from this process to the
  // controller does not complete while its child is stopped: left for later).
  auto store = connectRedisStore(c.head().storeOptions());
  REQUIRE(store.isOk());
  auto node = (*store)->getNode(a);
  std::string during = node.isOk() && node->has_value() ? nodeStateName((*node)->state) : "UNREADABLE";
  REQUIRE(::kill(gateway, SIGCONT) == 0);
  CHECK(during == "ALIVE");
  // Once it relays again the node beats on, and stays ALIVE past another TTL.
  auto beatAfter = wallClockMs();
  CHECK(eventually(std::chrono::milliseconds(4 * c.ttlMs()), [&]() {
    auto nodes = c.nodes();
    return nodes.isOk() && nodes->front().lastHeartbeatMs > beatAfter + c.ttlMs();
  }));
  std::string after = c.state(a);
  if (during != "ALIVE" || after != "ALIVE") c.dumpLogs("the node did not stay ALIVE through the gateway's stall");
  CHECK(after == "ALIVE");
}

TEST_CASE("controller: a node killed with SIGKILL is marked dead within its TTL + 1 s") {
  Cluster c(1000);
  c.startController();
  NodeId a = c.startNode();
  NodeId b = c.startNode();
  auto killedAt = std::chrono::steady_clock::now();
  c.nodeProcesses()[0].stop(SIGKILL, std::chrono::seconds(5));
  CHECK(eventually(std::chrono::milliseconds(c.ttlMs() + 1000), [&]() { return c.state(a) == "DEAD"; }));
  auto took = std::chrono::steady_clock::now() - killedAt;
  CHECK(took <= std::chrono::milliseconds(c.ttlMs() + 1000));
  auto nodes = c.nodes();
  REQUIRE(nodes.isOk());
  for (const auto& n : *nodes) {
    if (n.id == a) CHECK(n.deathReason.find("heartbeat") != std::string::npos);
  }
  CHECK(c.state(b) == "ALIVE");
}

TEST_CASE("controller: kill -9 and restart recovers every node from Redis, none re-registers") {
  Cluster c(1000);
  c.startController();
  NodeId a = c.startNode();
  NodeId b = c.startNode();
  auto before = c.nodes();
  REQUIRE(before.isOk());
  REQUIRE(before->size() == 2);

  c.controller().stop(SIGKILL, std::chrono::seconds(5));
  CHECK(c.state(a) == "UNREACHABLE");
  // The nodes keep heartbeating to Redis while no controller runs, well past one TTL.
  c.startController();
  auto after = c.nodes();
  REQUIRE(after.isOk());
  REQUIRE(after->size() == 2);
  for (size_t i = 0; i < 2; ++i) {
    CHECK((*after)[i].id == (*before)[i].id);
    CHECK((*after)[i].state == NodeState::kAlive);
    CHECK((*after)[i].registeredMs == (*before)[i].registeredMs);  // recovered, not re-registered
    CHECK((*after)[i].address == (*before)[i].address);
  }
  // The restarted controller still detects failures.
  c.nodeProcesses()[1].stop(SIGKILL, std::chrono::seconds(5));
  CHECK(eventually(std::chrono::milliseconds(c.ttlMs() + 1000), [&]() { return c.state(b) == "DEAD"; }));
  CHECK(c.state(a) == "ALIVE");
}

TEST_CASE("node agent: SIGTERM records a clean stop") {
  Cluster c(1000);
  c.startController();
  NodeId a = c.startNode();
  auto exit = c.nodeProcesses()[0].stop(SIGTERM, std::chrono::seconds(5));
  CHECK(exit.exitCode == 0);
  auto nodes = c.nodes();
  REQUIRE(nodes.isOk());
  CHECK(nodeStateName(nodes->front().state) == std::string("DEAD"));
  CHECK(nodes->front().deathReason.find("SIGTERM") != std::string::npos);
}

TEST_CASE("controller: a node lost with several members of an elastic group advances the group's epoch once") {
  Cluster c(1000);
  c.startController();
  NodeId doomed = c.startNode(2);
  auto& ws = c.io().waitScope;
  auto client = ClusterClient::connect(c.io(), c.controllerAddress(), c.token()).wait(ws);
  // As ElasticTrainer makes one: two trainers' bundles, and a dataloader and a checkpoint actor
  // (0 CPU) in the first, all restarted without limit.
  auto group = client->createPlacementGroup(PlacementStrategy::kPack, {{{"CPU", 1}}, {{"CPU", 1}}}).wait(ws);
  REQUIRE(group.state == PlacementGroupState::kCreated);
  auto store = connectRedisStore(c.head().storeOptions());
  REQUIRE(store.isOk());
  REQUIRE((*store)->putElasticGroup(group.id.hex(), "{}").isOk());
  std::vector<ActorId> members;
  for (auto [bundle, cpus] : {std::pair{0, 1.0}, std::pair{1, 1.0}, std::pair{0, 0.0}, std::pair{0, 0.0}}) {
    ActorOptions o;
    o.type = "Counter";
    o.resources = {{"CPU", cpus}};
    o.maxRestarts = -1;
    o.placementGroup = group.id;
    o.bundleIndex = bundle;
    members.push_back(client->createActor(o).wait(ws).id());
  }
  for (const auto& id : members) REQUIRE(client->actorInfo(id).wait(ws).nodeId == doomed);
  NodeId rescue = c.startNode(2);

  c.nodeProcesses()[0].stop(SIGKILL, std::chrono::seconds(5));
  // Its workers die with it; once the node is DEAD every member comes back on the other node.
  bool back = eventually(std::chrono::milliseconds(c.ttlMs() + 20'000), [&]() {
    for (const auto& id : members) {
      auto info = client->actorInfo(id).wait(ws);
      if (info.state != ActorState::kAlive || info.incarnation != 2 || info.nodeId != rescue) return false;
    }
    return true;
  });
  if (!back) c.dumpLogs("the members did not come back on the other node");
  REQUIRE(back);
  auto record = (*store)->getElasticGroup(group.id.hex());
  REQUIRE(record.isOk());
  REQUIRE(record->has_value());
  CHECK((*record)->epoch == 1);
  std::vector<std::string> advances;
  for (const auto& e : (*record)->events) {
    if (e.find(" epoch ") != std::string::npos && e.find("ended") != std::string::npos) advances.push_back(e);
  }
  REQUIRE(advances.size() == 1);
  for (const auto& id : members) CHECK(advances[0].find(id.hex()) != std::string::npos);
  CHECK(advances[0].find(doomed.hex()) != std::string::npos);
}

}  // namespace
}  // namespace troupe
