#include "troupe/checkpoint/fault.h"

#include <unistd.h>

#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include <fmt/format.h>

#include "troupe/runtime/logging.h"

namespace troupe::checkpoint {

const char* faultStageName(FaultStage stage) {
  switch (stage) {
    case FaultStage::kNone: return "none";
    case FaultStage::kSnapshot: return "snapshot";
    case FaultStage::kPersist: return "persist";
    case FaultStage::kReplica: return "replica";
  }
  return "?";
}

Result<FaultInjection> FaultInjection::parse(std::string_view spec) {
  FaultInjection fault;
  if (spec.empty()) return fault;
  auto bad = [&](std::string_view why) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("bad checkpoint fault '{}': {} (expected snapshot|persist|replica[:step=S][:until=U][:after=N][:tries=T])",
                              spec, why));
  };
  size_t colon = spec.find(':');
  std::string_view stage = spec.substr(0, colon);
  if (stage == "snapshot") {
    fault.stage = FaultStage::kSnapshot;
  } else if (stage == "persist") {
    fault.stage = FaultStage::kPersist;
  } else if (stage == "replica") {
    fault.stage = FaultStage::kReplica;
  } else {
    return bad("unknown stage");
  }
  while (colon != std::string_view::npos) {
    size_t next = spec.find(':', colon + 1);
    std::string_view part = spec.substr(colon + 1, next == std::string_view::npos ? next : next - colon - 1);
    colon = next;
    size_t eq = part.find('=');
    if (eq == std::string_view::npos) return bad("missing '='");
    std::string_view key = part.substr(0, eq), value = part.substr(eq + 1);
    uint64_t number = 0;
    auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), number);
    if (ec != std::errc() || end != value.data() + value.size()) return bad("not a number");
    if (key == "step") {
      fault.step = static_cast<int64_t>(number);
    } else if (key == "until") {
      fault.until = static_cast<int64_t>(number);
    } else if (key == "after") {
      fault.afterBytes = number;
    } else if (key == "tries") {
      fault.tries = number;
    } else {
      return bad("unknown key");
    }
  }
  if (fault.until >= 0 && (fault.step < 0 || fault.until < fault.step)) return bad("until needs a step at or below it");
  return fault;
}

FaultInjection FaultInjection::fromEnvironment() {
  const char* spec = std::getenv("TROUPE_CHECKPOINT_FAULT");
  if (spec == nullptr) return {};
  auto fault = parse(spec);
  if (!fault.isOk()) {
    TROUPE_LOG(kWarning, "ignoring TROUPE_CHECKPOINT_FAULT: {}", fault.status().message());
    return {};
  }
  return *fault;
}

void FaultInjection::pauseHere(uint64_t atStep, uint64_t written, const std::atomic<bool>* stop) const {
  fprintf(stderr, "troupe checkpoint fault: %s of step %llu paused after %llu bytes (pid %d)\n", faultStageName(stage),
          static_cast<unsigned long long>(atStep), static_cast<unsigned long long>(written), getpid());
  fflush(stderr);
  // The point of this seam is to stay put until the test kills the process.
  while (stop == nullptr || !stop->load()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

}  // namespace troupe::checkpoint
