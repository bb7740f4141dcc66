// Fuzz target: the text parsers behind flags and cluster files (HOST:PORT, NAME=QTY lists):
// anything is parsed or refused with a message, and what parses is valid.
#include <cmath>
#include <cstdint>
#include <string>

#include "troupe/runtime/config.h"
#include "troupe/runtime/ids.h"
#include "troupe/runtime/resources.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace troupe;
  std::string text(reinterpret_cast<const char*>(data), size);
  if (auto hp = parseHostPort(text); hp.isOk() && (hp->port < 1 || hp->port > 65535)) __builtin_trap();
  if (auto r = parseResources(text); r.isOk()) {
    for (const auto& [name, qty] : *r) {
      if (name.empty() || !std::isfinite(qty) || qty < 0) __builtin_trap();
    }
    if (!checkResources(*r, "fuzz").isOk()) __builtin_trap();
  }
  if (isValidIdText(text)) {
    for (char c : text) {
      if (c == '/' || c == '.' || c == '\0') __builtin_trap();
    }
  }
  return 0;
}
