// The controller and node agents as real processes against a real Redis: registration,
// heartbeat expiry, and a controller restart (kill -9) that recovers every node from Redis.
#include <doctest/doctest.h>

#include <signal.h>

#include <filesystem>
#include <thread>

#include "schema_convert.h"
#include "testing/redis_server.h"
#include "troupe.capnp.h"
#include "troupe/runtime/ids.h"
#include "troupe/runtime/process.h"
#include "troupe/runtime/rpc.h"

namespace troupe {
namespace {

namespace fs = std::filesystem;

std::string binDir() {
  const char* dir = std::getenv("TROUPE_BIN_DIR");
  return dir && *dir ? dir : executableDir() + "/..";
}

// Waits for `cond` with a deadline; a short back-off between checks, never a blind sleep.
template <typename Cond>
bool eventually(std::chrono::milliseconds limit, Cond cond) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return cond();
}

// A run directory, a real Redis, and helpers to start the daemons as the CLI would.
class Cluster {
 public:
  explicit Cluster(int ttlMs) : ttlMs_(ttlMs) {
    runDir_ = fs::temp_directory_path() / ("troupe_test_" + randomHex(6));
    fs::create_directories(runDir_ / "logs");
    fs::create_directories(runDir_ / "pids");
    ClusterFile file;
    file.redisAddress = HostPort{redis_.host(), redis_.port()}.toString();
    file.redisPassword = redis_.password();
    file.cluster = "ctl";
    file.token = randomHex(16);
    token_ = file.token;
    port_ = *pickFreePort("127.0.0.1");
    file.controllerAddress = HostPort{"127.0.0.1", port_}.toString();
    REQUIRE(writeClusterFile(runDir_.string(), file).isOk());
  }
  ~Cluster() {
    nodes_.clear();
    controller_ = ChildProcess();
    fs::remove_all(runDir_);
  }

  void startController() {
    SpawnOptions o;
    o.argv = {binDir() + "/troupe-controller", "--run-dir", runDir_.string(), "--port", std::to_string(port_),
              "--heartbeat-ttl-ms", std::to_string(ttlMs_)};
    o.outputPath = (runDir_ / "logs/controller.out").string();
    controller_ = ChildProcess(*spawnProcess(o));
    REQUIRE(eventually(std::chrono::seconds(10), [&]() { return nodes().isOk(); }));
  }

  NodeId startNode() {
    NodeId id = NodeId::generate();
    SpawnOptions o;
    o.argv = {binDir() + "/troupe-node", "--run-dir", runDir_.string(), "--address",
              HostPort{"127.0.0.1", port_}.toString(), "--node-id", id.hex(), "--num-cpus", "3",
              "--resources", "ssd=1"};
    o.outputPath = (runDir_ / "logs/node.out").string();
    nodes_.emplace_back(*spawnProcess(o));
    REQUIRE(eventually(std::chrono::seconds(10), [&]() { return state(id) == "ALIVE"; }));
    return id;
  }

  Result<std::vector<NodeRecord>> nodes() {
    std::vector<NodeRecord> out;
    KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
      auto client = RpcClient::connect(io_, HostPort{"127.0.0.1", port_}, token_, 2 * kj::SECONDS).wait(io_.waitScope);
      auto reply = client->bootstrap<rpc::Controller>().statusRequest().send().wait(io_.waitScope);
      for (auto n : reply.getNodes()) out.push_back(fromNodeInfo(n));
    })) {
      return statusFromException(*e, "status");
    }
    return out;
  }

  std::string state(const NodeId& id) {
    auto all = nodes();
    if (!all.isOk()) return "UNREACHABLE";
    for (const auto& n : *all) {
      if (n.id == id) return nodeStateName(n.state);
    }
    return "MISSING";
  }

  ChildProcess& controller() { return controller_; }
  std::vector<ChildProcess>& nodeProcesses() { return nodes_; }
  int ttlMs() const { return ttlMs_; }

 private:
  int ttlMs_;
  testing::RedisServerProcess redis_;
  fs::path runDir_;
  std::string token_;
  int port_ = 0;
  kj::AsyncIoContext io_ = kj::setupAsyncIo();
  ChildProcess controller_;
  std::vector<ChildProcess> nodes_;
};

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

}  // namespace
}  // namespace troupe
