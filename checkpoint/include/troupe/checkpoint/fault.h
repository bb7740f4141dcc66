// The fault-injection seam: makes a snapshot writer or a persister stop in the middle of its
// work, so a test can kill -9 the process exactly there. Off unless asked for.
//
// Spec: "<stage>[:step=<S>][:until=<U>][:after=<N>][:tries=<T>]", stage "snapshot" (the copy
// into shared memory), "persist" (the write of a rank file) or "replica" (the copy to a peer);
// the writer stops once it has written at least N bytes of the image for step S (steps S to U
// with until; any step when absent). A replica send stops only on its first T tries of a step
// (every try when absent): a replica that lags, then catches up. Processes read
// it from $TROUPE_CHECKPOINT_FAULT; the checkpoint actor also takes it in its init args.
// Stopping prints one line to stderr, "troupe checkpoint fault: <stage> of step <S> paused after
// <N> bytes (pid <P>)", and blocks the calling thread until the process is killed (or, for a
// thread that has a stop flag, until that flag is set).
// Thread-safety: an immutable value; pauseHere() may be called from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

#include "troupe/runtime/status.h"

namespace troupe::checkpoint {

enum class FaultStage { kNone, kSnapshot, kPersist, kReplica };

struct FaultInjection {
  FaultStage stage = FaultStage::kNone;
  int64_t step = -1;         // -1: any step
  int64_t until = -1;        // -1: step only
  uint64_t afterBytes = 0;   // stop once at least this many image bytes are written
  uint64_t tries = 0;        // replicas: the first this many tries of a step stop; 0: every try

  // kInvalidArgument naming the bad part of `spec`; "" gives no fault.
  static Result<FaultInjection> parse(std::string_view spec);
  // From $TROUPE_CHECKPOINT_FAULT; an invalid value is logged and ignored.
  static FaultInjection fromEnvironment();

  // True when this fault applies to `stage` at `step`.
  bool armed(FaultStage at, uint64_t atStep) const {
    if (stage == FaultStage::kNone || stage != at) return false;
    if (step < 0) return true;
    uint64_t last = static_cast<uint64_t>(until >= 0 ? until : step);
    return atStep >= static_cast<uint64_t>(step) && atStep <= last;
  }
  // Reports the stop and blocks until `stop` (if given) becomes true.
  void pauseHere(uint64_t atStep, uint64_t written, const std::atomic<bool>* stop = nullptr) const;
};

const char* faultStageName(FaultStage stage);

}  // namespace troupe::checkpoint
