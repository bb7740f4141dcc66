// Death notice between the ranks of one host (internal to collectives/). Each rank holds a
// robust, process-shared mutex in the host's shared-memory segment for as long as its
// communicator lives, and watches its peers' mutexes. The kernel releases a thread's robust
// mutexes as soon as the thread starts to exit, before it tears down the address space and
// closes the files. A killed process with gigabytes of memory can take a tenth of a second or
// more to close its sockets, so this notice comes first: a peer learns of the death within a
// millisecond of the kill, while the TCP control connection stays the notice across hosts. A
// process that exits normally releases its locks as a clean close (atexit): its peers learn of
// its end from its connections, after the bytes it sent.
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "troupe/runtime/status.h"

namespace troupe::collectives {

class ShmSegment;

// Initialises a life lock in a segment's memory (robust, process-shared, unlocked).
Status initLifeLock(pthread_mutex_t* lock);

class LifeLocks {
 public:
  // Holds `mine` from a thread of its own (robust mutexes belong to threads, and the calling
  // thread may end before the communicator does). `segment` keeps the memory mapped while any of
  // this object's threads runs.
  static Result<std::unique_ptr<LifeLocks>> hold(std::shared_ptr<ShmSegment> segment, pthread_mutex_t* mine);
  // Releases this rank's lock (its peers see it leave, not die) and stops the watch: no
  // onDeath call starts after it returns. The watching threads end within kWatchSlice.
  ~LifeLocks();
  LifeLocks(const LifeLocks&) = delete;
  LifeLocks& operator=(const LifeLocks&) = delete;

  // Watches each peer's lock (each held since the setup ended) on a thread of its own:
  // `onDeath(peer)` once for each peer that dies holding it. A peer that releases its lock left
  // cleanly (its control connection says goodbye) and is not reported.
  struct Peer {
    int rank;
    pthread_mutex_t* lock;
    std::atomic<uint32_t>* died;  // beside the lock: set by the watcher that found the owner dead
  };
  void watch(const std::vector<Peer>& peers, std::function<void(int rank)> onDeath);

 public:
  struct State;  // shared with the threads (and the release at exit)

 private:
  explicit LifeLocks(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

}  // namespace troupe::collectives
