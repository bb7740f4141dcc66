// Watches a group's epoch on a thread of its own: when the group advances past the epoch a
// communicator was made for (its survivors recreating it without a rank, say), that communicator
// must fail at once rather than wait for a timeout. Internal to collectives/.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "troupe/runtime/rendezvous_store.h"

namespace troupe::collectives {

class EpochWatcher {
 public:
  // Calls `onAdvance(newEpoch)` once, on the watcher's thread, when the group passes `epoch`.
  // `who` names the communicator in the warning logged if the watch itself fails.
  EpochWatcher(std::unique_ptr<GroupEpochWatch> watch, int64_t epoch, std::string who,
               std::function<void(int64_t)> onAdvance);
  // Interrupts the watch and joins the thread: no call to onAdvance starts after it returns.
  ~EpochWatcher();
  EpochWatcher(const EpochWatcher&) = delete;
  EpochWatcher& operator=(const EpochWatcher&) = delete;

 private:
  void run();

  std::unique_ptr<GroupEpochWatch> watch_;
  const int64_t epoch_;
  const std::string who_;
  const std::function<void(int64_t)> onAdvance_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace troupe::collectives
