// What tests may ask of the spinning of PeerWait::kSpinFirst connections (rpc.cc). Internal to
// runtime/.
#pragma once

#include <cstdint>

namespace troupe {

// Spins started by this thread's loop since the thread began.
uint64_t spinsOnThisThread();
// The sched_yield calls of those spins.
uint64_t spinYieldsOnThisThread();

}  // namespace troupe
