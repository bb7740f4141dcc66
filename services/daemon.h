// What troupe-controller and troupe-node share: logging into the run directory, a pid file
// that `troupe stop` finds, and a promise for SIGTERM/SIGINT. Internal to services/.
#pragma once

#include <string>

#include <kj/async-io.h>

#include "troupe/runtime/cluster_store.h"
#include "troupe/runtime/status.h"

namespace troupe {

// The head's Redis as its run directory's cluster.json names it (address, password, cluster
// name), and the cluster token. Errors: the file's, or an unparsable Redis address.
Result<std::pair<RedisOptions, std::string>> headRedis(const std::string& runDir);

// Call before kj::setupAsyncIo(): routes SIGTERM and SIGINT to the KJ event port.
void captureStopSignals();
// Resolves with the signal's name when SIGTERM or SIGINT arrives.
kj::Promise<std::string> onStopSignal(kj::AsyncIoContext& io);

// Opens <runDir>/logs/<name>.log and writes <runDir>/pids/<name>.pid. The pid file is removed
// by the returned object's destructor (a clean exit); `troupe stop` removes stale ones.
class DaemonFiles {
 public:
  DaemonFiles(const std::string& runDir, const std::string& name);
  ~DaemonFiles();
  // Writes <runDir>/pids/<name>.ready: the daemon serves (the CLI waits for it; removed with the pid file).
  void markReady();
  DaemonFiles(const DaemonFiles&) = delete;
  DaemonFiles& operator=(const DaemonFiles&) = delete;

 private:
  std::string pidPath_;
  std::string readyPath_;
};

}  // namespace troupe
