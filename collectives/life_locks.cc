#include "life_locks.h"

#include <cerrno>
#include <cstdlib>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <mutex>
#include <vector>
#include <thread>

#include <fmt/format.h>

#include "troupe/runtime/logging.h"

namespace troupe::collectives {

namespace {
// How often a watching thread looks up from its wait to see whether the watch is over.
constexpr auto kWatchSlice = std::chrono::milliseconds(100);
}  // namespace

struct LifeLocks::State {
  std::shared_ptr<ShmSegment> segment;
  pthread_mutex_t* mine = nullptr;
  std::mutex mutex;
  std::condition_variable changed;
  bool holding = false;  // the holder has locked `mine`
  bool held = false;     // ... or failed to (then `error`)
  bool release = false;  // the holder unlocks `mine` and ends
  bool released = false;  // ... and has
  bool stopped = false;  // no more onDeath calls
  std::string error;
  std::function<void(int)> onDeath;
  std::thread holder;
};

// A process that exits (exit(), the end of main, Python's end) without closing its communicators
// is not a crash: its locks are released as a clean close, and its peers learn of its end from
// its control connections, after what it sent them, as before life locks. Without this, a rank
// that finished its last collective and exited would fail the peers still finishing theirs.
// Only a process killed or crashed leaves its locks to the kernel.
namespace {
std::mutex registryMutex;
std::vector<std::weak_ptr<LifeLocks::State>>* registry = nullptr;

void releaseAtExit() {
  std::vector<std::shared_ptr<LifeLocks::State>> live;
  {
    std::lock_guard guard(registryMutex);
    if (registry == nullptr) return;
    for (auto& weak : *registry) {
      if (auto state = weak.lock()) live.push_back(std::move(state));
    }
  }
  for (auto& state : live) {
    std::unique_lock guard(state->mutex);
    state->stopped = true;
    state->onDeath = nullptr;
    state->release = true;
    state->changed.notify_all();
    state->changed.wait_for(guard, std::chrono::seconds(1), [&] { return state->released || !state->holding; });
  }
}

void enroll(const std::shared_ptr<LifeLocks::State>& state) {
  std::lock_guard guard(registryMutex);
  if (registry == nullptr) {
    registry = new std::vector<std::weak_ptr<LifeLocks::State>>();  // lives to the end: read at exit
    std::atexit(releaseAtExit);
  }
  std::erase_if(*registry, [](const auto& weak) { return weak.expired(); });
  registry->push_back(state);
}
}  // namespace

Status initLifeLock(pthread_mutex_t* lock) {
  pthread_mutexattr_t attr;
  if (int rc = pthread_mutexattr_init(&attr); rc != 0) {
    return Status(StatusCode::kInternal, fmt::format("pthread_mutexattr_init: {}", std::strerror(rc)));
  }
  int rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  if (rc == 0) rc = pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  if (rc == 0) rc = pthread_mutex_init(lock, &attr);
  pthread_mutexattr_destroy(&attr);
  if (rc != 0) return Status(StatusCode::kInternal, fmt::format("a robust shared mutex: {}", std::strerror(rc)));
  return Status::ok();
}

Result<std::unique_ptr<LifeLocks>> LifeLocks::hold(std::shared_ptr<ShmSegment> segment, pthread_mutex_t* mine) {
  auto state = std::make_shared<State>();
  state->segment = std::move(segment);
  state->mine = mine;
  state->holder = std::thread([state] {
    const int rc = pthread_mutex_trylock(state->mine);  // a new lock: nobody else holds it
    std::unique_lock guard(state->mutex);
    state->held = true;
    state->holding = rc == 0;
    if (rc != 0) state->error = rc == EBUSY ? "it is held already" : std::strerror(rc);
    state->changed.notify_all();
    if (rc != 0) return;
    state->changed.wait(guard, [&] { return state->release; });
    pthread_mutex_unlock(state->mine);
    state->released = true;
    state->changed.notify_all();
  });
  std::unique_lock guard(state->mutex);
  state->changed.wait(guard, [&] { return state->held; });
  if (!state->holding) {
    std::string error = state->error;
    guard.unlock();
    state->holder.join();
    return Status(StatusCode::kInternal, fmt::format("cannot hold this rank's life lock: {}", error));
  }
  guard.unlock();
  enroll(state);
  return std::unique_ptr<LifeLocks>(new LifeLocks(std::move(state)));
}

LifeLocks::~LifeLocks() {
  {
    std::lock_guard guard(state_->mutex);
    state_->stopped = true;
    state_->onDeath = nullptr;
    state_->release = true;
  }
  state_->changed.notify_all();
  state_->holder.join();
}

void LifeLocks::watch(const std::vector<Peer>& peers, std::function<void(int rank)> onDeath) {
  {
    std::lock_guard guard(state_->mutex);
    state_->onDeath = std::move(onDeath);
  }
  for (const Peer& peer : peers) {
    // Detached: it may be in a wait for up to kWatchSlice when the watch ends; it holds the state
    // and the segment, so nothing it touches goes away under it.
    std::thread([state = state_, peer] {
      for (;;) {
        {
          std::lock_guard guard(state->mutex);
          if (state->stopped) return;
        }
        timespec until{};
        clock_gettime(CLOCK_MONOTONIC, &until);
        const auto slice = std::chrono::duration_cast<std::chrono::nanoseconds>(kWatchSlice).count();
        until.tv_nsec += static_cast<long>(slice % 1'000'000'000);
        until.tv_sec += static_cast<time_t>(slice / 1'000'000'000) + until.tv_nsec / 1'000'000'000;
        until.tv_nsec %= 1'000'000'000;
        const int rc = pthread_mutex_clocklock(peer.lock, CLOCK_MONOTONIC, &until);
        if (rc == ETIMEDOUT || rc == EINTR) continue;
        if (rc == 0 && peer.died->load() == 0) {  // released: the peer closed its communicator
          pthread_mutex_unlock(peer.lock);
          return;
        }
        if (rc == 0 || rc == EOWNERDEAD) {
          // The kernel wakes one waiter of a dead owner's lock: this one marks the death beside
          // the lock and passes the lock on, so each of the peer's other watchers (one per rank
          // of the host) wakes in turn and reads the mark.
          peer.died->store(1);
          if (rc == EOWNERDEAD) pthread_mutex_consistent(peer.lock);
          pthread_mutex_unlock(peer.lock);
        } else if (rc != ENOTRECOVERABLE) {
          TROUPE_LOG(kWarning, "cannot watch rank {}'s life lock ({}); its death is seen when its "
                     "connection ends", peer.rank, std::strerror(rc));
          return;
        }
        std::lock_guard guard(state->mutex);
        if (!state->stopped && state->onDeath) state->onDeath(peer.rank);
        return;
      }
    }).detach();
  }
}

}  // namespace troupe::collectives
