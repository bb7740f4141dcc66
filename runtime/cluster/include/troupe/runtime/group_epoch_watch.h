// GroupEpochWatch: what a collective communicator holds to notice that its group moved on to a
// later epoch (ClusterStore::watchGroupEpoch opens one). Apart from cluster_store.h so the
// collectives see this, not the whole store.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>

#include "troupe/runtime/status.h"

namespace troupe {

// Receives the advances of one group's collective epoch (see ClusterStore::advanceGroupEpoch)
// published after watchGroupEpoch() returned.
// Thread-safety: next() from one thread at a time; interrupt() from any thread.
class GroupEpochWatch {
 public:
  virtual ~GroupEpochWatch() = default;
  // Waits up to `timeout` for the next advance and returns the group's new epoch; nullopt on
  // timeout or once interrupt() was called. A watch whose connection is lost subscribes again
  // and then returns the epoch it reads (which may be one already seen: an advance published
  // meanwhile is never missed). kUnavailable when it cannot watch again before `timeout`.
  virtual Result<std::optional<int64_t>> next(std::chrono::milliseconds timeout) = 0;
  // Makes the next() in progress, and every later one, return nullopt at once (for shutting
  // down the thread that waits in next()).
  virtual void interrupt() = 0;
};

}  // namespace troupe
