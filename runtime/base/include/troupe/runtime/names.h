// Names users give: actors' and namespaces'. One check, at the API's edge (troupe._core.check_name
// for Python, the CLI for what it is given), so that what reaches the cluster's records, `troupe
// status` and the dashboard is printable text of bounded length.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "troupe/runtime/status.h"

namespace troupe {

inline constexpr size_t kMaxNameBytes = 256;

namespace names_detail {

// The code point at s[i] (advancing i), or -1 when the bytes there are not valid UTF-8.
inline int32_t nextCodePoint(std::string_view s, size_t& i) {
  auto byte = [&s](size_t k) { return static_cast<uint8_t>(s[k]); };
  uint8_t b = byte(i);
  int length = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xE ? 3 : (b >> 3) == 0x1E ? 4 : 0;
  if (length == 0 || i + length > s.size()) return -1;
  int32_t cp = length == 1 ? b : b & (0x7F >> length);
  for (int k = 1; k < length; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return -1;
    cp = (cp << 6) | (byte(i + k) & 0x3F);
  }
  static constexpr int32_t kLeast[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kLeast[length] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return -1;  // overlong, surrogate
  i += length;
  return cp;
}

// Controls (C0, DEL, C1), and the characters that reorder or break displayed text (bidi
// embeddings, overrides, isolates and marks; line and paragraph separators).
inline bool unprintable(int32_t cp) {
  return cp < 0x20 || (cp >= 0x7F && cp <= 0x9F) || cp == 0x061C || cp == 0x200E || cp == 0x200F ||
         (cp >= 0x202A && cp <= 0x202E) || (cp >= 0x2066 && cp <= 0x2069) || cp == 0x2028 || cp == 0x2029;
}

}  // namespace names_detail

// kInvalidArgument unless `name` is 1 to kMaxNameBytes bytes of UTF-8 without control, bidi or
// line-separator characters and without '/' ('/' separates a namespace from a name: the message
// says to pass them apart). `what` names it in the message ("actor name", "namespace").
[[nodiscard]] inline Status checkName(std::string_view name, std::string_view what = "actor name") {
  if (name.empty()) return Status(StatusCode::kInvalidArgument, fmt::format("{} must not be empty", what));
  if (name.size() > kMaxNameBytes) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{} is {} bytes long; at most {}", what, name.size(), kMaxNameBytes));
  }
  for (size_t i = 0; i < name.size();) {
    size_t at = i;
    int32_t cp = names_detail::nextCodePoint(name, i);
    if (cp < 0) return Status(StatusCode::kInvalidArgument, fmt::format("{} is not UTF-8 (byte {})", what, at));
    if (names_detail::unprintable(cp)) {
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("{} has the control or bidi character U+{:04X} at byte {}; names must be printable",
                                what, cp, at));
    }
  }
  if (auto slash = name.find('/'); slash != std::string_view::npos) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{} '{}' has a '/', which separates a namespace from a name: give the namespace "
                              "on its own (namespace='{}', name='{}')",
                              what, name, name.substr(0, slash), name.substr(slash + 1)));
  }
  return Status::ok();
}

// A name as the CLI takes it: "NAME" (the default namespace) or "NAMESPACE/NAME", each part as
// checkName wants it.
[[nodiscard]] inline Status checkScopedName(std::string_view scoped) {
  auto slash = scoped.find('/');
  if (slash == std::string_view::npos) return checkName(scoped);
  if (auto s = checkName(scoped.substr(0, slash), "namespace"); !s.isOk()) return s;
  return checkName(scoped.substr(slash + 1));
}

// `text` as one line a terminal shows as it is: every control, bidi or line-separator character
// and every byte that is not UTF-8 written as an escape (\n, \u{202E}, \xFF), and cut to at most
// `maxBytes` bytes of it with "..." after. For what `troupe status` prints of records (names, death
// reasons with an actor's stderr, events): a record that passed no check still cannot forge a row.
inline std::string displayText(std::string_view text, size_t maxBytes = 4096) {
  std::string out;
  for (size_t i = 0; i < text.size();) {
    if (out.size() >= maxBytes) {
      out += "...";
      break;
    }
    size_t at = i;
    int32_t cp = names_detail::nextCodePoint(text, i);
    if (cp < 0) {
      out += fmt::format("\\x{:02X}", static_cast<uint8_t>(text[at]));
      i = at + 1;
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (names_detail::unprintable(cp)) {
      out += fmt::format("\\u{{{:04X}}}", cp);
    } else {
      out.append(text.substr(at, i - at));
    }
  }
  return out;
}

}  // namespace troupe
