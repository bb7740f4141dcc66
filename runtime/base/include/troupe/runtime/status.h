// Status and Result<T>: the error channel for failures a caller handles.
// Thread-safety: value types; safe to copy and move between threads.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace troupe {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,   // bad input from a user or caller
  kNotFound,          // a node, actor, group or file that does not exist
  kAlreadyExists,     // a name or port that is taken
  kUnavailable,       // a peer, Redis or the controller cannot be reached
  kUnauthenticated,   // wrong or missing cluster token / Redis password
  kDeadlineExceeded,  // a wait ran out of time
  kFailedPrecondition,// the system is not in a state that allows the call
  kResourceExhausted, // no memory, disk or cluster resources
  kAborted,           // the operation was cancelled (epoch bump, shutdown)
  kInternal,          // a broken invariant or an unexpected reply
  kActorDied,         // the actor is dead, or died during the call
};

const char* statusCodeName(StatusCode code);
// The code named `name` ("NOT_FOUND"), if any: how a code crosses the RPC edge and reaches Python.
std::optional<StatusCode> statusCodeFromName(std::string_view name);

// A code and a message that says what failed, with which value, and what to do.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return Status(); }

  bool isOk() const { return code_ == StatusCode::kOk; }
  explicit operator bool() const { return isOk(); }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "UNAVAILABLE: cannot reach Redis at 127.0.0.1:1 ..."
  std::string toString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Either a value or a non-ok Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}
  Result(Status status) : status_(std::move(status)) {}

  bool isOk() const { return value_.has_value(); }
  explicit operator bool() const { return isOk(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

#define TROUPE_RETURN_IF_ERROR(expr)           \
  do {                                         \
    ::troupe::Status troupe_status_ = (expr);  \
    if (!troupe_status_.isOk()) return troupe_status_; \
  } while (0)

// Evaluates `rexpr`, a Result<T>: returns its status when it failed, else declares or assigns
// `lhs` from its value. TROUPE_ASSIGN_OR_RETURN(auto store, connectRedisStore(options));
#define TROUPE_ASSIGN_OR_RETURN(lhs, rexpr) \
  TROUPE_ASSIGN_OR_RETURN_IMPL_(TROUPE_CONCAT_(troupe_result_, __LINE__), lhs, rexpr)
#define TROUPE_ASSIGN_OR_RETURN_IMPL_(result, lhs, rexpr) \
  auto result = (rexpr);                                  \
  if (!result.isOk()) return result.status();             \
  lhs = std::move(result).value()
#define TROUPE_CONCAT_INNER_(a, b) a##b
#define TROUPE_CONCAT_(a, b) TROUPE_CONCAT_INNER_(a, b)

}  // namespace troupe
