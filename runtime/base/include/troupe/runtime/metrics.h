// Process counters that a node agent reads live, for the head's Prometheus /metrics.
//
// A worker keeps its counters (actor calls, collective bytes and time, snapshot and persist
// times) in a small file its node agent named (TROUPE_METRICS_FILE): adding is one relaxed
// atomic add on shared memory, and a scrape reads the file without asking the worker, which
// may be busy in a long call. A process without that variable (a driver, a test) keeps them
// in private memory.
//
// Thread-safety: counter() and Counter::add from any thread; a Counter lives as long as the
// process.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "troupe/runtime/status.h"

namespace troupe::metrics {

enum class Unit : uint8_t { kCount = 1, kSeconds = 2 };  // seconds are kept as nanoseconds

class Counter {
 public:
  explicit Counter(std::atomic<uint64_t>* value) : value_(value) {}
  void add(uint64_t n = 1) { value_->fetch_add(n, std::memory_order_relaxed); }
  void addTime(std::chrono::nanoseconds elapsed) { add(static_cast<uint64_t>(elapsed.count())); }
  uint64_t value() const { return value_->load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t>* value_;
};

// The process's counter `name` (Prometheus syntax, e.g. "troupe_actor_calls_total") with
// `labels` (Prometheus label text written by labelText, e.g. `op="allreduce"`), made on first use.
// When the file is full (kSlots), further counters still count but are not published.
Counter& counter(std::string_view name, std::string_view labels = {}, Unit unit = Unit::kCount);

// The calls the actor this process serves has answered, failed (its own error), and their
// time from arrival to reply.
struct ActorCalls {
  Counter& calls;
  Counter& errors;
  Counter& seconds;
};
ActorCalls& actorCalls();

struct Sample {
  std::string name;
  std::string labels;  // Prometheus label text, possibly empty
  double value = 0;    // seconds for Unit::kSeconds
};

// Reads a published counter file. A file that is not one (wrong size or magic) is kFailedPrecondition;
// a slot whose text is not valid is skipped.
Result<std::vector<Sample>> read(const std::string& path);

// The Prometheus text form of a label value: backslash, quote and newline escaped. The one escape
// of label values in C++: labelText uses it, and so does what a node agent adds to a sample.
std::string escapeLabel(std::string_view value);

// Label pairs, in the order written: (name, value), the value unescaped.
using Labels = std::vector<std::pair<std::string, std::string>>;

// `a="x",b="y"`: each value through escapeLabel. A name that is not a label name is fatal.
std::string labelText(const Labels& labels);

// The pairs of label text as labelText writes it, or nullopt when it is not that (an unescaped
// quote or newline, a bad escape, a bad name): read() drops such a sample.
std::optional<Labels> parseLabels(std::string_view text);

inline constexpr size_t kSlots = 340;

}  // namespace troupe::metrics
