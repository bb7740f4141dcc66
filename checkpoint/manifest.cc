// A step's MANIFEST.json, parsed (checkpoint_dir.h): kept apart from the directory's file handling so
// the parser is fuzzed on its own (fuzz/manifest_fuzz.cc).
#include <charconv>
#include <limits>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "troupe/checkpoint/checkpoint_dir.h"

namespace troupe::checkpoint {

namespace {

// An integer field: not get<T>(), which converts a float such as 1e300 to an integer it does not fit
// (undefined behaviour) and wraps a negative number.
template <typename T>
T integerField(const nlohmann::json& j, const char* name) {
  const auto& v = j.at(name);
  if (v.is_number_unsigned()) {
    uint64_t x = v.get<uint64_t>();
    if (x <= uint64_t(std::numeric_limits<T>::max())) return static_cast<T>(x);
  } else if (v.is_number_integer()) {
    int64_t x = v.get<int64_t>();
    if (x >= int64_t(std::numeric_limits<T>::min()) && (x < 0 || uint64_t(x) <= uint64_t(std::numeric_limits<T>::max()))) {
      return static_cast<T>(x);
    }
  } else {
    throw std::runtime_error(fmt::format("\"{}\" is not an integer", name));
  }
  throw std::runtime_error(fmt::format("\"{}\" is out of range", name));
}

}  // namespace

Result<Manifest> parseManifest(std::string_view text, uint64_t step, const std::string& path) {
  Manifest m;
  try {
    auto j = nlohmann::json::parse(text);
    if (!j.is_object() || j.at("format") != "troupe-checkpoint" || j.at("version") != 1) {
      throw std::runtime_error("unknown format");
    }
    m.step = integerField<uint64_t>(j, "step");
    m.worldSize = integerField<uint32_t>(j, "world_size");
    m.createdMs = j.contains("created_ms") ? integerField<int64_t>(j, "created_ms") : 0;
    const auto& ranks = j.at("ranks");
    if (!ranks.is_array() || ranks.size() != m.worldSize) {
      throw std::runtime_error(fmt::format("world size {} with {} ranks", m.worldSize, ranks.size()));
    }
    for (const auto& r : ranks) {
      ManifestRank rank;
      rank.rank = integerField<uint32_t>(r, "rank");
      rank.file = r.at("file").get<std::string>();
      rank.bytes = integerField<uint64_t>(r, "bytes");
      std::string crc = r.at("header_crc").get<std::string>();
      uint32_t value = 0;
      auto [end, ec] = std::from_chars(crc.data(), crc.data() + crc.size(), value, 16);
      if (crc.empty() || ec != std::errc() || end != crc.data() + crc.size()) {
        throw std::runtime_error(fmt::format("header_crc '{}' is not a 32-bit hex number", crc));
      }
      rank.headerCrc = value;
      m.ranks.push_back(std::move(rank));
    }
  } catch (const std::exception& e) {
    return Status(StatusCode::kFailedPrecondition, fmt::format("corrupt manifest {}: {}", path, e.what()));
  }
  if (m.step != step || m.worldSize == 0) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("corrupt manifest {}: step {} world size {} (expected step {})", path, m.step,
                              m.worldSize, step));
  }
  for (uint32_t r = 0; r < m.worldSize; ++r) {
    if (m.ranks[r].rank != r || m.ranks[r].file != fmt::format("rank-{:05d}.tckpt", r)) {
      return Status(StatusCode::kFailedPrecondition, fmt::format("corrupt manifest {}: entry {} is wrong", path, r));
    }
  }
  return m;
}

}  // namespace troupe::checkpoint
