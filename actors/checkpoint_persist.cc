#include "checkpoint_persist.h"

#include <chrono>
#include <utility>

#include <fmt/format.h>

#include "troupe/runtime/logging.h"
#include "troupe/runtime/metrics.h"

namespace troupe::actors::checkpoint_actor {

struct PersistReport {
  uint32_t rank = 0;
  uint64_t step = 0;
  bool persisted = false;
  bool stepComplete = false;
  Status error;
};

// The persist thread's state: the directory and the segment mappings it reads.
class Persister {
 public:
  Persister(const Options& options, const std::atomic<bool>* stop)
      : options_(options), cache_(options_), dir_(options_.directory(stop)) {}

  Status open() { return dir_.open(); }

  PersistReport run(uint32_t rank) {
    PersistReport report;
    report.rank = rank;
    auto segment = cache_.get(options_.primary(rank));
    if (!segment.isOk()) {
      report.error = segment.status();
      return report;
    }
    auto slot = (*segment)->newestComplete();
    if (!slot) return report;
    report.step = slot->step;
    SnapshotId id{(*segment)->fileId(), slot->index, slot->seq};
    if (last_[rank] == id) return report;
    auto outcome = ck::persistSnapshot(dir_, **segment, *slot);
    if (!outcome.isOk()) {
      report.error = outcome.status();
      return report;
    }
    last_[rank] = id;
    persists_.add();
    persistBytes_.add(outcome->bytes);
    persistTime_.addTime(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(outcome->seconds)));
    report.persisted = true;
    report.stepComplete = outcome->stepComplete;
    TROUPE_LOG(kInfo, "persisted rank {} step {} ({} bytes in {:.3f} s{})", rank, slot->step, outcome->bytes,
               outcome->seconds, outcome->stepComplete ? ", step complete" : "");
    return report;
  }
  void dropMappings() { cache_.clear(); }

 private:
  Options options_;  // a copy: the RPC thread's may change (members)
  SegmentCache cache_;
  ck::CheckpointDirectory dir_;
  std::map<uint32_t, SnapshotId> last_;
  // In this worker's counters, for the head's /metrics.
  metrics::Counter& persists_ = metrics::counter("troupe_checkpoint_persists_total");
  metrics::Counter& persistBytes_ = metrics::counter("troupe_checkpoint_persist_bytes_total");
  metrics::Counter& persistTime_ = metrics::counter("troupe_checkpoint_persist_seconds_total", "", metrics::Unit::kSeconds);
};

PersistQueue::PersistQueue(const Options& options)
    : options_(options),
      persister_(std::make_shared<Persister>(options, &stop_)),
      tasks_(std::make_unique<kj::TaskSet>(errorLog_)) {
  if (options_.dir.empty()) return;
  // Creates the directory and removes what dead writers of this host left.
  tasks_->add(thread_.call([p = persister_]() { return p->open(); }).then([this](Status s) {
    if (!s.isOk()) errors_.add(s.toString());
  }));
}

PersistQueue::~PersistQueue() {
  stop_ = true;
  tasks_.reset();  // pending work first: its continuations use the members (the thread is joined last)
}

void PersistQueue::stop() { stop_ = true; }

void PersistQueue::request(uint32_t rank) {
  if (options_.dir.empty()) return;
  auto& slot = queued_[rank];
  if (!slot) slot = std::make_shared<std::atomic<bool>>(false);
  auto queued = slot;
  if (queued->exchange(true)) return;  // a job that has not started yet will take the newest
  tasks_->add(thread_
                  .call([p = persister_, queued, rank]() {
                    queued->store(false);
                    return p->run(rank);
                  })
                  .then([this](PersistReport r) {
                    if (!r.error.isOk()) {
                      // A snapshot overwritten during its persist: the newer one is queued already.
                      if (r.error.code() != StatusCode::kAborted) {
                        errors_.add(fmt::format("persisting rank {} step {}: {}", r.rank, r.step, r.error.toString()));
                      }
                    } else if (r.persisted) {
                      persisted_[r.rank] = r.step;
                    }
                  }));
}

void PersistQueue::dropMappings() {
  if (stop_) return;
  tasks_->add(thread_.call([p = persister_]() {
    p->dropMappings();
    return 0;
  }).ignoreResult());
}

}  // namespace troupe::actors::checkpoint_actor
