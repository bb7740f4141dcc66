#include "troupe/checkpoint/checksum.h"

#include <doctest/doctest.h>

#include <cstring>
#include <random>
#include <vector>

namespace troupe::checkpoint {
namespace {

// Bit by bit, straight from the definition: the reference every fast path must match.
uint32_t referenceCrc32c(const uint8_t* p, size_t n, uint32_t crc = 0) {
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int k = 0; k < 8; ++k) crc = (crc & 1u) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
  }
  return ~crc;
}

std::vector<uint8_t> randomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

TEST_CASE("checksum: crc32c matches the published check value and the bitwise reference") {
  const char* check = "123456789";
  CHECK(crc32c(check, 9) == 0xE3069283u);
  CHECK(crc32c(nullptr, 0) == 0u);
  auto data = randomBytes(300000, 1);
  // Lengths around the folding path's minimum and block (512, 256), the three-stream chunk
  // (3 x 8 KiB), and odd offsets.
  for (size_t n : {size_t(1), size_t(7), size_t(8), size_t(63), size_t(511), size_t(512), size_t(513), size_t(767),
                   size_t(768), size_t(1029), size_t(24575), size_t(24576), size_t(24577),
                   size_t(49152 + 13), size_t(299990)}) {
    for (size_t off : {size_t(0), size_t(1), size_t(5)}) {
      CHECK(crc32c(data.data() + off, n) == referenceCrc32c(data.data() + off, n));
    }
  }
}

TEST_CASE("checksum: continuing and combining give the CRC of the concatenation") {
  auto data = randomBytes(100000, 2);
  uint32_t whole = crc32c(data.data(), data.size());
  for (size_t cut : {size_t(0), size_t(1), size_t(24576), size_t(33333), size_t(100000)}) {
    uint32_t a = crc32c(data.data(), cut);
    uint32_t b = crc32c(data.data() + cut, data.size() - cut);
    CHECK(crc32c(data.data() + cut, data.size() - cut, a) == whole);
    CHECK(crc32cCombine(a, b, data.size() - cut) == whole);
  }
}

TEST_CASE("checksum: copyWithCrc32c copies exactly and checksums what it copied") {
  // Sizes below and above the non-temporal threshold (1 MiB), destinations at odd alignments.
  for (size_t n : {size_t(0), size_t(100), size_t(600), size_t(1) << 20, (size_t(3) << 20) + 77}) {
    auto src = randomBytes(n + 64, static_cast<uint32_t>(n));
    for (size_t dstOff : {size_t(0), size_t(3), size_t(32)}) {
      std::vector<uint8_t> dst(n + 64, 0xEE);
      uint32_t crc = copyWithCrc32c(dst.data() + dstOff, src.data() + 1, n);
      CHECK(crc == crc32c(src.data() + 1, n));
      CHECK(std::memcmp(dst.data() + dstOff, src.data() + 1, n) == 0);
      CHECK(dst[dstOff + n] == 0xEE);  // nothing written past the end
      if (dstOff > 0) CHECK(dst[dstOff - 1] == 0xEE);
    }
  }
}

}  // namespace
}  // namespace troupe::checkpoint
