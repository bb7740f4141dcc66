// Internal to actors/: the Checkpoint actor's persist unit. PersistQueue takes "rank R saved"
// on the actor's RPC thread and has the newest snapshot of R written to the checkpoint directory
// on a persist thread, requests coalesced per rank (one not yet started takes the newest).
// The persist thread is kept (not the KJ loop): a write blocks for as long as the disk takes.
// Thread-safety: a PersistQueue belongs to the RPC thread; its Persister to the persist thread,
// which it reaches through jobs only; results come back to the RPC thread as promises.
#pragma once

#include <kj/async.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>

#include "troupe/runtime/io_thread.h"
#include "checkpoint_options.h"

namespace troupe::actors::checkpoint_actor {

class Persister;

class PersistQueue {
 public:
  // Without a directory in `options`, requests are ignored; with one, it is opened (created,
  // dead writers' leftovers removed) on the persist thread at once. `options` outlives this.
  explicit PersistQueue(const Options& options);
  ~PersistQueue();
  PersistQueue(const PersistQueue&) = delete;
  PersistQueue& operator=(const PersistQueue&) = delete;

  // Persists rank's newest complete snapshot unless it is the one persisted last.
  void request(uint32_t rank);
  // The segments were removed: the persist thread lets go of its mappings.
  void dropMappings();
  // The actor is ending: a write in progress stops early, nothing more is queued.
  void stop();

  // The newest step persisted, by rank.
  const std::map<uint32_t, uint64_t>& persisted() const { return persisted_; }
  const RecentErrors& errors() const { return errors_; }

 private:
  const Options& options_;
  std::atomic<bool> stop_{false};
  // Declared before the tasks so it outlives them: a task's promise may wait on its work.
  IoThread thread_;
  std::shared_ptr<Persister> persister_;
  std::map<uint32_t, std::shared_ptr<std::atomic<bool>>> queued_;
  std::map<uint32_t, uint64_t> persisted_;
  RecentErrors errors_;
  TaskErrorLog errorLog_;
  // Held by pointer: kj::TaskSet's destructor may throw.
  std::unique_ptr<kj::TaskSet> tasks_;
};

}  // namespace troupe::actors::checkpoint_actor
