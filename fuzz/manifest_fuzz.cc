// Fuzz target: a checkpoint step's MANIFEST.json as read from disk (another user's or a damaged
// file): it parses to a consistent manifest or is refused with a message.
#include <cstdint>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "troupe/checkpoint/checkpoint_dir.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace troupe::checkpoint;
  std::string_view text(reinterpret_cast<const char*>(data), size);
  for (uint64_t step : {uint64_t(10), uint64_t(0)}) {
    auto m = parseManifest(text, step, "fuzz/MANIFEST.json");
    if (!m.isOk()) continue;
    if (m->step != step || m->worldSize == 0 || m->ranks.size() != m->worldSize) __builtin_trap();
    for (uint32_t r = 0; r < m->worldSize; ++r) {
      if (m->ranks[r].rank != r || m->ranks[r].file != fmt::format("rank-{:05d}.tckpt", r)) __builtin_trap();
    }
  }
  return 0;
}
