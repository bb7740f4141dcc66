// The bytes a rank reads from outside, as pure functions: rendezvous entries (read from the store),
// control messages (read from a peer's control connection) and operation headers. Kept apart from the sockets so
// they can be fuzzed (fuzz/collective_wire_fuzz.cc). Every function is thread-safe (no state).
// Byte order is the host's: Troupe runs on little-endian hosts only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "troupe/runtime/status.h"

namespace troupe::collectives {

inline constexpr size_t kNonceChars = 32;
inline constexpr size_t kMaxHostIdChars = 256;

// A rank's published address: its rendezvous entry in the store.
struct Entry {
  std::string host;
  int port = 0;
  int64_t pid = 0;
  std::string hostname;
  std::string nonce;  // kNonceChars characters; a connecting peer must echo it
  std::string extra;  // opaque bytes for the backend (NCCL's unique id)
  std::string hostId;  // which host (and network namespace) the rank runs on; "" when unknown
};

std::string encodeEntry(const Entry& entry);
// The entry `text` holds; nullopt when it is not one: not JSON, a field missing or of another
// type, a port outside 0..65535, a negative pid, a nonce of another length, `extra` not hex, a
// host_id (optional) over kMaxHostIdChars.
std::optional<Entry> decodeEntry(std::string_view text);

// Control connection messages: an 8-byte header (kind, payload length), then the payload.
enum class ControlKind : uint32_t { kGoodbye = 1, kAbort = 2 };
struct ControlHeader {
  uint32_t kind = 0;
  uint32_t length = 0;  // payload bytes (kAbort: a status code byte, then the message)
};
inline constexpr uint32_t kMaxControlPayload = 64 * 1024;

std::string encodeGoodbye();
// An ABORT carrying `code` (not OK) and `message`, cut so the payload fits kMaxControlPayload.
std::string encodeAbort(StatusCode code, std::string_view message);

// The first message of `bytes` (what a control connection delivered so far).
struct ControlMessage {
  enum class Kind { kIncomplete, kGoodbye, kAbort, kMalformed };
  Kind kind = Kind::kIncomplete;
  size_t bytes = 0;       // kGoodbye, kAbort: the bytes it took
  StatusCode code = StatusCode::kAborted;  // kAbort: the peer's code, never OK (unknown: ABORTED)
  std::string text;       // kAbort: the peer's message; kMalformed: what is wrong with the bytes
};
ControlMessage parseControlMessage(std::string_view bytes);

// The 32-byte header that starts each operation's traffic on a data connection; the receiver
// checks it against its own call, so a rank that issued another operation is reported instead of
// corrupting data.
inline constexpr uint32_t kWireMagic = 0x31435254;  // "TRC1"
struct WireHeader {
  uint32_t magic = kWireMagic;
  uint8_t kind = 0;  // an OpKind; a p2p pair is sent as kSend and expected as kSend
  uint8_t type = 0;  // a DataType
  uint8_t op = 0;    // a ReduceOp
  uint8_t unused = 0;
  int32_t root = -1;
  uint32_t unused2 = 0;
  uint64_t seq = 0;  // per connection and direction
  uint64_t count = 0;
  bool operator==(const WireHeader&) const = default;
};
static_assert(sizeof(WireHeader) == 32);

}  // namespace troupe::collectives
