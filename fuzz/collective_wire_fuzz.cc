// Fuzz target: what a collectives rank reads from outside: a rendezvous entry (from the store) and
// the messages of a peer's control connection. Anything decodes to something valid or is refused.
#include <cstdint>
#include <string>
#include <string_view>

#include "wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace troupe;
  using namespace troupe::collectives;
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  if (auto entry = decodeEntry(bytes)) {
    if (entry->port < 0 || entry->port > 65535 || entry->pid < 0 || entry->nonce.size() != kNonceChars) {
      __builtin_trap();
    }
    auto again = decodeEntry(encodeEntry(*entry));
    if (!again || again->extra != entry->extra || again->host != entry->host) __builtin_trap();
  }
  // The control connection as drainControl() reads it: message after message until one is
  // incomplete, malformed or an ABORT.
  std::string_view rest = bytes;
  for (;;) {
    ControlMessage m = parseControlMessage(rest);
    if (m.kind == ControlMessage::Kind::kGoodbye) {
      if (m.bytes != sizeof(ControlHeader)) __builtin_trap();
      rest.remove_prefix(m.bytes);
      continue;
    }
    if (m.kind == ControlMessage::Kind::kAbort) {
      if (m.bytes > rest.size() || m.code == StatusCode::kOk || m.code > StatusCode::kActorDied) __builtin_trap();
      ControlMessage back = parseControlMessage(encodeAbort(m.code, m.text));
      if (back.kind != ControlMessage::Kind::kAbort || back.code != m.code || back.text != m.text) __builtin_trap();
    }
    break;
  }
  return 0;
}
