// A real cluster for multi-process tests: a redis-server, a troupe-controller and node agents
// as child processes, in a private run directory. Owned by one test thread.
#pragma once

#include <doctest/doctest.h>
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include <fmt/format.h>

#include "troupe/runtime/schema_convert.h"
#include "troupe/testing/redis_server.h"
#include "troupe.capnp.h"
#include "troupe/runtime/ids.h"
#include "troupe/runtime/process.h"
#include "troupe/runtime/rpc.h"

namespace troupe::testing {

namespace fs = std::filesystem;

inline std::string binDir() {
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
    gateway_ = ChildProcess();
    fs::remove_all(runDir_);
  }

  void startController() {
    SpawnOptions o;
    o.argv = {binDir() + "/troupe-controller", "--run-dir", runDir_.string(), "--port", std::to_string(port_),
              "--heartbeat-ttl-ms", std::to_string(ttlMs_)};
    o.outputPath = (runDir_ / "logs/controller.out").string();
    controller_ = ChildProcess(*spawnProcess(o));
    REQUIRE(eventually(std::chrono::seconds(10), [&]() { return nodes().isOk(); }));
    if (!gateway_.pid()) startGateway();
  }

  // The store gateway, as `troupe start --head` runs it: the nodes started here reach Redis
  // through it, as every node but the head's does.
  void startGateway() {
    int port = *pickFreePort("127.0.0.1");
    SpawnOptions o;
    o.argv = {binDir() + "/troupe-gateway", "--run-dir", runDir_.string(), "--port", std::to_string(port)};
    o.outputPath = (runDir_ / "logs/gateway.out").string();
    gateway_ = ChildProcess(*spawnProcess(o));
    REQUIRE(eventually(std::chrono::seconds(10), [&]() { return fs::exists(runDir_ / "pids/gateway.ready"); }));
  }

  NodeId startNode(double cpus = 3, const std::string& resources = "ssd=1") {
    NodeId id = NodeId::generate();
    SpawnOptions o;
    o.argv = {binDir() + "/troupe-node", "--run-dir", runDir_.string(), "--address",
              HostPort{"127.0.0.1", port_}.toString(), "--node-id", id.hex(), "--num-cpus", fmt::format("{}", cpus),
              "--resources", resources};
    o.outputPath = (runDir_ / "logs/node.out").string();
    nodes_.emplace_back(*spawnProcess(o));
    bool alive = eventually(std::chrono::seconds(10), [&]() { return state(id) == "ALIVE"; });
    if (!alive) dumpLogs(fmt::format("node {} is {} after 10 s", id.hex(), state(id)));
    REQUIRE(alive);
    return id;
  }

  // Prints the daemons' logs, so a failed start in CI says why.
  void dumpLogs(const std::string& why) {
    std::string text = why + "\n";
    for (const auto& entry : fs::directory_iterator(runDir_ / "logs")) {
      std::ifstream in(entry.path());
      std::string body((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (body.size() > 4000) body = "..." + body.substr(body.size() - 4000);
      text += fmt::format("--- {}\n{}\n", entry.path().filename().string(), body);
    }
    MESSAGE(text);
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
  HostPort controllerAddress() const { return HostPort{"127.0.0.1", port_}; }
  const std::string& token() const { return token_; }
  kj::AsyncIoContext& io() { return io_; }
  const std::filesystem::path& runDir() const { return runDir_; }
  std::vector<ChildProcess>& nodeProcesses() { return nodes_; }
  int ttlMs() const { return ttlMs_; }

 private:
  int ttlMs_;
  RedisServerProcess redis_;
  fs::path runDir_;
  std::string token_;
  int port_ = 0;
  kj::AsyncIoContext io_ = kj::setupAsyncIo();
  ChildProcess controller_;
  ChildProcess gateway_;
  std::vector<ChildProcess> nodes_;
};

}  // namespace troupe::testing
