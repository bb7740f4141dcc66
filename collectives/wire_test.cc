// The wire formats a rank reads from outside (wire.h): a peer's or the store's bytes decode to a
// valid value or are refused. Crafted inputs the fuzzer found are kept here and in
// fuzz/corpus/collective_wire/.
#include <doctest/doctest.h>

#include <cstring>

#include "wire.h"

namespace troupe::collectives {
namespace {

std::string entryWith(const std::string& port, const std::string& pid = "42") {
  return R"({"host":"127.0.0.1","port":)" + port + R"(,"pid":)" + pid +
         R"(,"hostname":"h","nonce":"0123456789abcdef0123456789abcdef","extra":"00ff"})";
}

TEST_CASE("wire: rendezvous entries round-trip; out-of-range ports and pids are refused") {
  Entry entry;
  entry.host = "10.0.0.1";
  entry.port = 4000;
  entry.pid = 7;
  entry.hostname = "n1";
  entry.nonce = std::string(kNonceChars, 'a');
  entry.extra = std::string("\0\xff\x10", 3);
  auto back = decodeEntry(encodeEntry(entry));
  REQUIRE(back.has_value());
  CHECK(back->port == 4000);
  CHECK(back->extra == entry.extra);
  CHECK(decodeEntry(entryWith("40123")).has_value());
  // A float port was converted to int: 1e300 does not fit (undefined behaviour; UBSan stops there).
  for (const char* port : {"1e300", "65536", "-1", "80.5", "\"80\"", "18446744073709551615"}) {
    CHECK_MESSAGE(!decodeEntry(entryWith(port)).has_value(), port);
  }
  for (const char* pid : {"-1e30", "-1", "1e19"}) CHECK_MESSAGE(!decodeEntry(entryWith("80", pid)).has_value(), pid);
  CHECK(!decodeEntry("[]").has_value());
  CHECK(!decodeEntry("not json").has_value());
}

std::string message(uint32_t kind, uint32_t length, const std::string& payload) {
  std::string out(8, '\0');
  std::memcpy(out.data(), &kind, 4);
  std::memcpy(out.data() + 4, &length, 4);
  return out + payload;
}

TEST_CASE("wire: control messages: goodbye, abort, incomplete, malformed; a code byte is never negative") {
  auto bye = parseControlMessage(encodeGoodbye() + "rest");
  CHECK(bye.kind == ControlMessage::Kind::kGoodbye);
  CHECK(bye.bytes == 8);
  auto abort = parseControlMessage(encodeAbort(StatusCode::kActorDied, "rank 1 died"));
  CHECK(abort.kind == ControlMessage::Kind::kAbort);
  CHECK(abort.code == StatusCode::kActorDied);
  CHECK(abort.text == "rank 1 died");
  // Byte 0xff was read through a signed char as code -1 and passed the range check.
  auto high = parseControlMessage(message(2, 3, "\xffhi"));
  REQUIRE(high.kind == ControlMessage::Kind::kAbort);
  CHECK(high.code == StatusCode::kAborted);
  CHECK(parseControlMessage(message(2, 1, "\0")).code == StatusCode::kAborted);  // OK is not a failure
  CHECK(parseControlMessage(message(2, 100, "\x03short")).kind == ControlMessage::Kind::kIncomplete);
  CHECK(parseControlMessage(std::string(7, '\0')).kind == ControlMessage::Kind::kIncomplete);
  CHECK(parseControlMessage(message(7, 4, "abcd")).kind == ControlMessage::Kind::kMalformed);
  CHECK(parseControlMessage(message(2, 1u << 20, "")).kind == ControlMessage::Kind::kMalformed);
  CHECK(parseControlMessage(message(2, 0, "")).kind == ControlMessage::Kind::kMalformed);
  // A long message is cut to fit the payload limit.
  auto cut = parseControlMessage(encodeAbort(StatusCode::kInternal, std::string(200000, 'x')));
  CHECK(cut.kind == ControlMessage::Kind::kAbort);
  CHECK(cut.text.size() == kMaxControlPayload - 1);
}

}  // namespace
}  // namespace troupe::collectives
