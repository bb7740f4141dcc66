// RendezvousStore: the few store calls the collectives make to meet (group, epoch) and to watch
// for its end. Backends depend on this, not on the whole ClusterStore, so a test or another
// store needs only these four calls; ClusterRendezvousStore adapts a ClusterStore.
// Thread-safety: as the store behind it; the collectives call it from the connecting thread and
// from the epoch watch they open.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "troupe/runtime/group_epoch_watch.h"
#include "troupe/runtime/status.h"

namespace troupe {
class ClusterStore;  // troupe/runtime/cluster_store.h
}  // namespace troupe

namespace troupe::collectives {

class RendezvousStore {
 public:
  virtual ~RendezvousStore() = default;
  // Raises the group's epoch to `epoch` when it is lower (publishing it to every watch) and
  // returns the epoch after the call, as ClusterStore::advanceGroupEpoch.
  virtual Result<int64_t> advanceGroupEpoch(const std::string& group, int64_t epoch) = 0;
  // Opens a watch on the group's epoch advances, as ClusterStore::watchGroupEpoch.
  virtual Result<std::unique_ptr<GroupEpochWatch>> watchGroupEpoch(const std::string& group) = 0;
  // Records this rank's entry in the rendezvous of (group, epoch), expiring `ttl` after the last
  // write, as ClusterStore::putRendezvousEntry.
  virtual Status putRendezvousEntry(const std::string& group, int64_t epoch, int32_t rank,
                                    const std::string& value, std::chrono::milliseconds ttl) = 0;
  // Every entry of the rendezvous of (group, epoch), by rank, as ClusterStore::getRendezvous.
  virtual Result<std::map<int32_t, std::string>> getRendezvous(const std::string& group,
                                                               int64_t epoch) = 0;
};

// A RendezvousStore over a ClusterStore, which must outlive it (it is needed only while a
// communicator connects: the communicator keeps the epoch watch, not the store).
class ClusterRendezvousStore final : public RendezvousStore {
 public:
  explicit ClusterRendezvousStore(ClusterStore& store) : store_(store) {}

  Result<int64_t> advanceGroupEpoch(const std::string& group, int64_t epoch) override;
  Result<std::unique_ptr<GroupEpochWatch>> watchGroupEpoch(const std::string& group) override;
  Status putRendezvousEntry(const std::string& group, int64_t epoch, int32_t rank, const std::string& value,
                            std::chrono::milliseconds ttl) override;
  Result<std::map<int32_t, std::string>> getRendezvous(const std::string& group, int64_t epoch) override;

 private:
  ClusterStore& store_;
};

}  // namespace troupe::collectives
