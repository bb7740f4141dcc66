#include "epoch_watcher.h"

#include "troupe/runtime/logging.h"

namespace troupe::collectives {

EpochWatcher::EpochWatcher(std::unique_ptr<GroupEpochWatch> watch, int64_t epoch, std::string who,
                           std::function<void(int64_t)> onAdvance)
    : watch_(std::move(watch)), epoch_(epoch), who_(std::move(who)), onAdvance_(std::move(onAdvance)) {
  thread_ = std::thread([this] { run(); });
}

EpochWatcher::~EpochWatcher() {
  stopping_.store(true);
  watch_->interrupt();
  thread_.join();
}

void EpochWatcher::run() {
  while (!stopping_.load()) {
    auto next = watch_->next(std::chrono::seconds(3600));
    if (!next.isOk()) {
      TROUPE_LOG(kWarning, "{}: {}; epoch advances are no longer seen by this communicator (peer failures and "
                 "timeouts still are)", who_, next.status().message());
      return;
    }
    if (!next->has_value() || **next <= epoch_) continue;
    onAdvance_(**next);
    return;
  }
}

}  // namespace troupe::collectives
