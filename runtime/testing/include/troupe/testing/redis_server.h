// RedisServerProcess: a real redis-server child for tests, on 127.0.0.1, a free port and a
// random password, with its config and data in a private temp dir.
// Thread-safety: owned by one thread (the test's).
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

#include "troupe/runtime/cluster_store.h"
#include "troupe/runtime/process.h"

namespace troupe::testing {

struct RedisServerOptions {
  // false starts a Redis that accepts clients without a password, so tests can check that
  // Troupe refuses it.
  bool requirePassword = true;
};

class RedisServerProcess {
 public:
  // Starts redis-server and returns once it answers PING (after AUTH) on its port. Throws
  // std::runtime_error (with the server's log) when it cannot start within 10 s: a test
  // fixture has no caller to hand a Status to, and doctest reports the exception as a failure.
  explicit RedisServerProcess(RedisServerOptions options = {});
  // Kills the server (SIGKILL) and removes its temp dir.
  ~RedisServerProcess();
  RedisServerProcess(const RedisServerProcess&) = delete;
  RedisServerProcess& operator=(const RedisServerProcess&) = delete;

  const std::string& host() const { return host_; }
  int port() const { return port_; }
  // Empty when started without a password.
  const std::string& password() const { return password_; }
  pid_t pid() const { return child_.pid(); }
  // Store options for this server with key prefix "troupe:<cluster>:".
  RedisOptions options(std::string cluster) const;
  // SIGKILLs the server and reaps it; later connections to port() are refused.
  void kill9();

 private:
  // Owns the temp dir; declared before child_ so the server is dead before its dir goes.
  class TempDir {
   public:
    TempDir();
    ~TempDir();
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
    const std::string& path() const { return path_; }

   private:
    std::string path_;
  };

  // One attempt on a freshly picked port; false if the port was taken by someone else
  // between picking and binding.
  bool tryStart(std::string& failure);

  RedisServerOptions options_;
  std::string host_ = "127.0.0.1";
  int port_ = 0;
  std::string password_;
  TempDir dir_;
  ChildProcess child_;
};

// A cluster of its own on this test binary's redis-server (started on first use, killed when
// the binary exits; a test that kills its server starts a RedisServerProcess instead): stores
// opened for one cluster share data, as a cluster's processes do, and clusters share nothing
// (keys "troupe:<cluster>:"). This is the unit tests' store: the meaning of every store
// operation is written once, in the Lua scripts, and tested where it runs.
std::string newTestCluster();
// Connects to newTestCluster()'s server; throws std::runtime_error when it cannot (a rank's
// thread has no doctest context to REQUIRE in).
std::unique_ptr<ClusterStore> openTestStore(const std::string& cluster);

}  // namespace troupe::testing
