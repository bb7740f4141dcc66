#include "wire.h"

#include <cstring>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace troupe::collectives {
namespace {

using json = nlohmann::json;

std::string hexEncode(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

std::optional<std::string> hexDecode(const std::string& text) {
  if (text.size() % 2 != 0) return std::nullopt;
  std::string out;
  out.reserve(text.size() / 2);
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < text.size(); i += 2) {
    int hi = nibble(text[i]), lo = nibble(text[i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out.push_back(static_cast<char>(hi * 16 + lo));
  }
  return out;
}

// An integer field within [low, high]. Not get<int>(): a float such as 1e300 would be converted
// to an integer it does not fit (undefined behaviour).
std::optional<int64_t> integerIn(const json& j, const char* name, int64_t low, int64_t high) {
  const json& v = j.at(name);
  if (!v.is_number_integer()) return std::nullopt;
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(high)) return std::nullopt;
  int64_t x = v.get<int64_t>();
  if (x < low || x > high) return std::nullopt;
  return x;
}

}  // namespace

std::string encodeEntry(const Entry& entry) {
  return json{{"host", entry.host},         {"port", entry.port},
              {"pid", entry.pid},           {"hostname", entry.hostname},
              {"nonce", entry.nonce},       {"extra", hexEncode(entry.extra)},
              {"host_id", entry.hostId}}
      .dump();
}

std::optional<Entry> decodeEntry(std::string_view text) {
  try {
    json j = json::parse(text);
    if (!j.is_object()) return std::nullopt;
    Entry entry;
    entry.host = j.at("host").get<std::string>();
    auto port = integerIn(j, "port", 0, 65535);  // 0: a rank nobody connects to (the only one)
    auto pid = integerIn(j, "pid", 0, INT64_MAX);
    if (!port || !pid) return std::nullopt;
    entry.port = static_cast<int>(*port);
    entry.pid = *pid;
    entry.hostname = j.at("hostname").get<std::string>();
    entry.nonce = j.at("nonce").get<std::string>();
    auto extra = hexDecode(j.value("extra", ""));
    if (!extra || entry.nonce.size() != kNonceChars) return std::nullopt;
    entry.extra = std::move(*extra);
    entry.hostId = j.value("host_id", "");
    if (entry.hostId.size() > kMaxHostIdChars) return std::nullopt;
    return entry;
  } catch (const json::exception&) {
    return std::nullopt;
  }
}

namespace {
std::string encodeControl(ControlKind kind, std::string_view payload) {
  std::string message(sizeof(ControlHeader) + payload.size(), '\0');
  ControlHeader header{static_cast<uint32_t>(kind), static_cast<uint32_t>(payload.size())};
  std::memcpy(message.data(), &header, sizeof(header));
  std::memcpy(message.data() + sizeof(header), payload.data(), payload.size());
  return message;
}
}  // namespace

std::string encodeGoodbye() { return encodeControl(ControlKind::kGoodbye, ""); }

std::string encodeAbort(StatusCode code, std::string_view message) {
  std::string payload(1, static_cast<char>(code == StatusCode::kOk ? StatusCode::kAborted : code));
  payload.append(message.substr(0, kMaxControlPayload - 1));
  return encodeControl(ControlKind::kAbort, payload);
}

ControlMessage parseControlMessage(std::string_view bytes) {
  ControlMessage m;
  if (bytes.size() < sizeof(ControlHeader)) return m;
  ControlHeader header;
  std::memcpy(&header, bytes.data(), sizeof(header));
  const auto kind = static_cast<ControlKind>(header.kind);
  if (kind == ControlKind::kGoodbye && header.length == 0) {
    m.kind = ControlMessage::Kind::kGoodbye;
    m.bytes = sizeof(header);
    return m;
  }
  if (kind != ControlKind::kAbort || header.length == 0 || header.length > kMaxControlPayload) {
    m.kind = ControlMessage::Kind::kMalformed;
    m.text = fmt::format("kind {}, {} bytes", header.kind, header.length);
    return m;
  }
  if (bytes.size() - sizeof(header) < header.length) return m;
  m.kind = ControlMessage::Kind::kAbort;
  m.bytes = sizeof(header) + header.length;
  // The code byte is unsigned: a char above 127 must not become a negative code.
  const auto code = static_cast<uint8_t>(bytes[sizeof(header)]);
  m.code = code == 0 || code > static_cast<uint8_t>(StatusCode::kActorDied) ? StatusCode::kAborted
                                                                               : static_cast<StatusCode>(code);
  m.text = std::string(bytes.substr(sizeof(header) + 1, header.length - 1));
  return m;
}

}  // namespace troupe::collectives
