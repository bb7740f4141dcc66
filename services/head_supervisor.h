// The head's daemons come back by themselves: the embedded Redis, the controller and the store
// gateway (and the dashboard and the head's node agent) are each recorded when `troupe start
// --head` launches them, and two supervisors, the head's node agent and the gateway, start again
// any of them that exits (kill -9 included), each other included, until `troupe stop` marks the
// run directory as stopping. A node agent comes back with a fresh node id. Redis comes back from its AOF; the controller from Redis.
// Internal to services/. Thread-safety: the free functions are safe anywhere; superviseHeadDaemons
// runs on the calling thread's KJ event loop.
#pragma once

#include <string>
#include <vector>

#include <kj/async-io.h>

#include "troupe/runtime/status.h"

namespace troupe::supervisor {

// Records how to start daemon `name` again: <runDir>/pids/<name>.cmd (0600) holds its log path
// and argv. Errors: the file cannot be written.
Status record(const std::string& runDir, const std::string& name, const std::vector<std::string>& argv,
              const std::string& logPath);

// From now on nothing in this run directory is restarted: `troupe stop` calls it first.
void markStopping(const std::string& runDir);

// Held (flock) while a daemon is replaced by hand, e.g. by `troupe restart-controller`: the
// supervisor leaves the run directory alone meanwhile. Blocks until it has the lock.
class ReplaceLock {
 public:
  explicit ReplaceLock(const std::string& runDir);
  ~ReplaceLock();
  ReplaceLock(const ReplaceLock&) = delete;
  ReplaceLock& operator=(const ReplaceLock&) = delete;

 private:
  int fd_ = -1;
};

// Every `interval`, starts again each recorded daemon whose pid file names no live process (and
// that this loop did not just start). Logs each restart. Never resolves; cancel by dropping it.
kj::Promise<void> superviseHeadDaemons(kj::AsyncIoContext& io, std::string runDir, kj::Duration interval);

}  // namespace troupe::supervisor
