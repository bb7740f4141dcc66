// RendezvousStore: the store role of collective groups, their epochs and the rendezvous of
// (group, epoch): all the collectives need of a store to meet and to watch for an epoch's end.
// The cluster store is one (cluster_store.h); a torch.distributed store can be another.
// Thread-safety: as the implementation's; the collectives call it from the connecting thread
// and from the epoch watch they open.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "troupe/runtime/group_epoch_watch.h"
#include "troupe/runtime/status.h"

namespace troupe {

// A group is any non-empty name (an elastic group's id, a job name). Its epoch starts at 0 and
// only grows; a communicator belongs to one epoch, and an advance ends every earlier epoch.
class RendezvousStore {
 public:
  virtual ~RendezvousStore() = default;

  // The group's current epoch; 0 for a group never advanced. kInvalidArgument for an empty name.
  virtual Result<int64_t> groupEpoch(const std::string& group) = 0;
  // Raises the group's epoch to `epoch` when it is lower, and then publishes the new epoch to
  // every watch; returns the group's epoch after the call (>= `epoch`). A retry, or an advance to
  // an epoch already reached, changes and publishes nothing. kInvalidArgument for an empty name
  // or a negative epoch.
  virtual Result<int64_t> advanceGroupEpoch(const std::string& group, int64_t epoch) = 0;
  // Opens a watch on the group's epoch advances (its own connection for Redis). To miss none,
  // open the watch first, then read groupEpoch().
  virtual Result<std::unique_ptr<GroupEpochWatch>> watchGroupEpoch(const std::string& group) = 0;
  // Records `value` (opaque bytes: an address, an NCCL unique id) for `rank` in the rendezvous of
  // (group, epoch), replacing the rank's earlier value. The whole rendezvous expires `ttl` after
  // its last write, so finished epochs leave nothing behind. kInvalidArgument for an empty name,
  // a negative epoch or rank, or a ttl that is not positive.
  virtual Status putRendezvousEntry(const std::string& group, int64_t epoch, int32_t rank,
                                    const std::string& value, std::chrono::milliseconds ttl) = 0;
  // Every value recorded in the rendezvous of (group, epoch), by rank; empty when none (or
  // expired). Same argument errors as putRendezvousEntry().
  virtual Result<std::map<int32_t, std::string>> getRendezvous(const std::string& group,
                                                               int64_t epoch) = 0;
};

}  // namespace troupe
