// A real cluster for multi-process tests: a redis-server, a troupe-controller, the store gateway
// and node agents as child processes, in a private run directory (the head is TestHead, which
// benchmarks use too). Owned by one test thread.
#pragma once

#include <doctest/doctest.h>
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include <fmt/format.h>

#include "troupe/runtime/schema_convert.h"
#include "troupe/testing/head.h"
#include "troupe/testing/redis_server.h"
#include "troupe.capnp.h"
#include "troupe/runtime/ids.h"
#include "troupe/runtime/process.h"
#include "troupe/runtime/rpc.h"

namespace troupe::testing {

namespace fs = std::filesystem;

// A test head (troupe/testing/head.h) whose failures fail the test, and node agents.
class Cluster {
 public:
  explicit Cluster(int ttlMs) : head_(HeadOptions{ttlMs, "ctl", "troupe_test_"}) {}
  ~Cluster() { nodes_.clear(); }

  void startController() {
    Status started = head_.startController();
    REQUIRE_MESSAGE(started.isOk(), started.toString());
    REQUIRE(eventually(std::chrono::seconds(10), [&]() { return nodes().isOk(); }));
    if (!head_.gateway().pid()) startGateway();
  }

  // The store gateway, as `troupe start --head` runs it: the nodes started here reach Redis
  // through it, as every node but the head's does.
  void startGateway() {
    Status started = head_.startGateway(std::chrono::seconds(10));
    REQUIRE_MESSAGE(started.isOk(), started.toString());
  }

  NodeId startNode(double cpus = 3, const std::string& resources = "ssd=1") {
    NodeId id = NodeId::generate();
    SpawnOptions o;
    o.argv = {binDir() + "/troupe-node", "--run-dir", runDir().string(), "--address",
              controllerAddress().toString(), "--node-id", id.hex(), "--num-cpus", fmt::format("{}", cpus),
              "--resources", resources};
    o.outputPath = (runDir() / "logs/node.out").string();
    nodes_.emplace_back(*spawnProcess(o));
    bool alive = eventually(std::chrono::seconds(10), [&]() { return state(id) == "ALIVE"; });
    if (!alive) dumpLogs(fmt::format("node {} is {} after 10 s", id.hex(), state(id)));
    REQUIRE(alive);
    return id;
  }

  // Prints the daemons' logs, so a failed start in CI says why.
  void dumpLogs(const std::string& why) {
    std::string text = why + "\n";
    for (const auto& entry : fs::directory_iterator(runDir() / "logs")) {
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
      auto client = RpcClient::connect(io_, controllerAddress(), token(), 2 * kj::SECONDS).wait(io_.waitScope);
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

  ChildProcess& controller() { return head_.controller(); }
  HostPort controllerAddress() const { return head_.controllerAddress(); }
  const std::string& token() const { return head_.token(); }
  kj::AsyncIoContext& io() { return io_; }
  const std::filesystem::path& runDir() const { return head_.runDir(); }
  std::vector<ChildProcess>& nodeProcesses() { return nodes_; }
  int ttlMs() const { return head_.heartbeatTtlMs(); }
  TestHead& head() { return head_; }

 private:
  TestHead head_;
  kj::AsyncIoContext io_ = kj::setupAsyncIo();
  std::vector<ChildProcess> nodes_;
};

}  // namespace troupe::testing
