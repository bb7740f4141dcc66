// The clocks, one of each kind. Clock (steady) measures durations, timeouts and deadlines: it
// never jumps, so a wall-clock change neither fires nor delays them. wallClockMs() is the Unix
// time in milliseconds, for records people read (created_ms, death times) and nothing that waits.
#pragma once

#include <chrono>
#include <cstdint>

namespace troupe {

using Clock = std::chrono::steady_clock;

int64_t wallClockMs();

}  // namespace troupe
