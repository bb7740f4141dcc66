// A Status across the RPC edge and back (rpc.h): apart from the RPC plumbing so that what needs
// only these (the handshake, its fuzz target) links without Cap'n Proto RPC.
#include <cstring>
#include <optional>

#include <fmt/format.h>

#include "troupe/runtime/rpc.h"

namespace troupe {

kj::Exception exceptionFromStatus(const Status& status, kj::Exception::Type type) {
  // FAILED by default: DISCONNECTED means only that the connection itself is gone (clients
  // reconnect or wait for an actor's next incarnation on it), so a peer's UNAVAILABLE must not
  // look like it.
  return kj::Exception(type, __FILE__, __LINE__,
                       kj::str("[", statusCodeName(status.code()), "] ", status.message().c_str()));
}

Status statusFromException(const kj::Exception& e, const std::string& what) {
  std::string desc = e.getDescription().cStr();
  // KJ prefixes remote errors with "remote exception: "; keep only the message.
  for (const char* prefix : {"remote exception: ", "expected "}) {
    auto at = desc.find(prefix);
    if (at == 0) desc = desc.substr(strlen(prefix));
  }
  std::optional<StatusCode> code;
  if (desc.size() > 2 && desc[0] == '[') {
    if (auto close = desc.find("] "); close != std::string::npos && close < 32) {
      code = statusCodeFromName(std::string_view(desc).substr(1, close - 1));
      if (code) desc = desc.substr(close + 2);
    }
  }
  if (!code) {
    code = e.getType() == kj::Exception::Type::DISCONNECTED ? StatusCode::kUnavailable
           : e.getType() == kj::Exception::Type::OVERLOADED  ? StatusCode::kResourceExhausted
                                                             : StatusCode::kInternal;
  }
  return Status(*code, what.empty() ? desc : fmt::format("{}: {}", what, desc));
}

void throwStatus(const Status& status) { kj::throwFatalException(exceptionFromStatus(status)); }

}  // namespace troupe
