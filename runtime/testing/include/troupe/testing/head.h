// TestHead: a cluster's head for tests and benchmarks: a private run directory with
// cluster.json, a real redis-server, and troupe-controller and troupe-gateway started as
// `troupe start --head` starts them. No test framework: failures are Status values (and a
// std::runtime_error from the constructor), so a benchmark uses it as a test fixture does
// (troupe/testing/cluster_fixture.h wraps it with doctest checks).
// Thread-safety: owned by one thread.
#pragma once

#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include "troupe/runtime/config.h"
#include "troupe/runtime/ids.h"
#include "troupe/runtime/process.h"
#include "troupe/testing/redis_server.h"

namespace troupe::testing {

// Where the daemons are: $TROUPE_BIN_DIR, else the build directory above this executable's.
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

struct HeadOptions {
  int heartbeatTtlMs = 3000;
  std::string cluster = "ctl";           // the key prefix in Redis: troupe:<cluster>:
  std::string dirPrefix = "troupe_test_";  // the run directory: <temp>/<dirPrefix><random>
};

class TestHead {
 public:
  // Starts Redis and writes the run directory (with a fresh token and a free controller port);
  // starts no daemon. Throws std::runtime_error when it cannot.
  explicit TestHead(HeadOptions options = {}) : options_(std::move(options)) {
    namespace fs = std::filesystem;
    runDir_ = fs::temp_directory_path() / (options_.dirPrefix + randomHex(6));
    fs::create_directories(runDir_ / "logs");
    fs::create_directories(runDir_ / "pids");
    // 0700, as createRunDir makes it: readClusterFile refuses a run directory open to others.
    fs::permissions(runDir_, fs::perms::owner_all, fs::perm_options::replace);
    ClusterFile file;
    file.redisAddress = HostPort{redis_.host(), redis_.port()}.toString();
    file.redisPassword = redis_.password();
    file.cluster = options_.cluster;
    file.token = token_ = randomHex(16);
    auto port = pickFreePort("127.0.0.1");
    if (!port.isOk()) throw std::runtime_error("no free port for the controller: " + port.status().toString());
    port_ = *port;
    file.controllerAddress = controllerAddress().toString();
    if (Status s = writeClusterFile(runDir_.string(), file); !s.isOk()) {
      throw std::runtime_error("cannot write cluster.json: " + s.toString());
    }
  }
  // Stops the daemons (SIGKILL, as ChildProcess does) and removes the run directory.
  ~TestHead() {
    controller_ = ChildProcess();
    gateway_ = ChildProcess();
    std::error_code ec;
    std::filesystem::remove_all(runDir_, ec);
  }
  TestHead(const TestHead&) = delete;
  TestHead& operator=(const TestHead&) = delete;

  // Spawns troupe-controller on the run directory's port; returns once it is spawned (the
  // caller waits for it to answer, with its own client).
  Status startController() {
    SpawnOptions o;
    o.argv = {binDir() + "/troupe-controller", "--run-dir", runDir_.string(), "--port", std::to_string(port_),
              "--heartbeat-ttl-ms", std::to_string(options_.heartbeatTtlMs)};
    o.outputPath = (runDir_ / "logs/controller.out").string();
    auto pid = spawnProcess(o);
    if (!pid.isOk()) return Status(pid.status().code(), "cannot start troupe-controller: " + pid.status().message());
    controller_ = ChildProcess(*pid);
    return Status::ok();
  }
  void stopController() { controller_ = ChildProcess(); }

  // The store gateway, as `troupe start --head` runs it (every node but the head's reaches
  // Redis through it): returns once it is ready (pids/gateway.ready), kUnavailable when it
  // exits or is not ready within `limit`.
  Status startGateway(std::chrono::milliseconds limit = std::chrono::seconds(10)) {
    SpawnOptions o;
    o.argv = {binDir() + "/troupe-gateway", "--run-dir", runDir_.string(), "--port", "0"};
    o.outputPath = (runDir_ / "logs/gateway.out").string();
    auto pid = spawnProcess(o);
    if (!pid.isOk()) return Status(pid.status().code(), "cannot start troupe-gateway: " + pid.status().message());
    gateway_ = ChildProcess(*pid);
    bool exited = false;
    bool ready = eventually(limit, [&]() {
      exited = exited || gateway_.wait(std::chrono::milliseconds(0)).has_value();
      return exited || std::filesystem::exists(runDir_ / "pids/gateway.ready");
    });
    if (!ready || exited) {
      return Status(StatusCode::kUnavailable,
                    fmt::format("troupe-gateway {} (see {})", exited ? "exited" : "was not ready in time",
                                (runDir_ / "logs/gateway.out").string()));
    }
    return Status::ok();
  }

  HostPort controllerAddress() const { return HostPort{"127.0.0.1", port_}; }
  const std::string& token() const { return token_; }
  const std::filesystem::path& runDir() const { return runDir_; }
  int heartbeatTtlMs() const { return options_.heartbeatTtlMs; }
  ChildProcess& controller() { return controller_; }
  ChildProcess& gateway() { return gateway_; }
  const RedisServerProcess& redis() const { return redis_; }
  // Store options for this head's Redis and cluster name.
  RedisOptions storeOptions() const { return redis_.options(options_.cluster); }
  std::string controllerLog() const { return (runDir_ / "logs/controller.out").string(); }

 private:
  HeadOptions options_;
  RedisServerProcess redis_;
  std::filesystem::path runDir_;
  std::string token_;
  int port_ = 0;
  ChildProcess controller_;
  ChildProcess gateway_;
};

}  // namespace troupe::testing
