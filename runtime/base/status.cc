#include "troupe/runtime/status.h"

#include <fmt/format.h>

namespace troupe {

const char* statusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case StatusCode::kNotFound: return "NOT_FOUND";
    case StatusCode::kAlreadyExists: return "ALREADY_EXISTS";
    case StatusCode::kUnavailable: return "UNAVAILABLE";
    case StatusCode::kUnauthenticated: return "UNAUTHENTICATED";
    case StatusCode::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case StatusCode::kAborted: return "ABORTED";
    case StatusCode::kInternal: return "INTERNAL";
    case StatusCode::kActorDied: return "ACTOR_DIED";
  }
  return "UNKNOWN";
}

std::optional<StatusCode> statusCodeFromName(std::string_view name) {
  for (int c = static_cast<int>(StatusCode::kOk); c <= static_cast<int>(StatusCode::kActorDied); ++c) {
    if (name == statusCodeName(static_cast<StatusCode>(c))) return static_cast<StatusCode>(c);
  }
  return std::nullopt;
}

std::string Status::toString() const {
  if (isOk()) return "OK";
  return fmt::format("{}: {}", statusCodeName(code_), message_);
}

}  // namespace troupe
