// CRC32C with the SSE4.2 crc32 instruction. One crc32 has a latency of three cycles and a
// throughput of one, so three independent streams (three blocks of one chunk) keep the unit
// busy; their CRCs are joined with shift tables ("append B zero bytes" is linear in the CRC
// state). Measured here for 1 GiB: one stream 0.16 s, three streams 0.085 s, memcpy 0.095 s;
// CRC of a chunk then a non-temporal copy of it 0.14 s, against 0.23 s for memcpy then CRC.
#include "troupe/checkpoint/checksum.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#include <nmmintrin.h>
#endif

namespace troupe::checkpoint {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78u;  // CRC32C, bit-reflected
constexpr size_t kBlock = 8192;                // one stream's share of a chunk
constexpr size_t kChunk = 3 * kBlock;          // CRC'd and then copied while in L1/L2
constexpr size_t kNonTemporalMin = size_t(1) << 20;

struct ByteTable {
  std::array<uint32_t, 256> entries{};
  constexpr ByteTable() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ kPolynomial : c >> 1;
      entries[i] = c;
    }
  }
};
constexpr ByteTable kByteTable;

// The raw (not inverted) CRC state after `size` more bytes.
uint32_t rawSoftware(uint32_t state, const uint8_t* p, size_t size) {
  for (size_t i = 0; i < size; ++i) state = (state >> 8) ^ kByteTable.entries[(state ^ p[i]) & 0xffu];
  return state;
}

// A linear map on 32-bit CRC states: column i is the image of bit i.
struct Gf2Matrix {
  std::array<uint32_t, 32> columns{};
  uint32_t apply(uint32_t v) const {
    uint32_t out = 0;
    for (int i = 0; v != 0; ++i, v >>= 1) {
      if (v & 1u) out ^= columns[i];
    }
    return out;
  }
  Gf2Matrix times(const Gf2Matrix& other) const {
    Gf2Matrix out;
    for (int i = 0; i < 32; ++i) out.columns[i] = apply(other.columns[i]);
    return out;
  }
};

// Appending n zero bytes to the message maps the raw state s to zeros(n)(s).
uint32_t appendZeros(uint32_t state, uint64_t n) {
  static const Gf2Matrix oneByte = [] {
    Gf2Matrix m;
    for (int i = 0; i < 32; ++i) {
      uint8_t zero = 0;
      m.columns[i] = rawSoftware(1u << i, &zero, 1);
    }
    return m;
  }();
  Gf2Matrix power = oneByte;
  while (n != 0) {
    if (n & 1u) state = power.apply(state);
    n >>= 1;
    if (n != 0) power = power.times(power);
  }
  return state;
}

// Byte-wise lookup tables for zeros(kBlock) and zeros(2 * kBlock).
struct ShiftTables {
  std::array<std::array<uint32_t, 256>, 4> one{};
  std::array<std::array<uint32_t, 256>, 4> two{};
  ShiftTables() {
    // The map is linear: tabulate it from the images of the 32 single bits.
    std::array<uint32_t, 32> bitOne{}, bitTwo{};
    for (int i = 0; i < 32; ++i) {
      bitOne[i] = appendZeros(1u << i, kBlock);
      bitTwo[i] = appendZeros(1u << i, 2 * kBlock);
    }
    for (int k = 0; k < 4; ++k) {
      for (uint32_t v = 0; v < 256; ++v) {
        for (int bit = 0; bit < 8; ++bit) {
          if (v & (1u << bit)) {
            one[k][v] ^= bitOne[8 * k + bit];
            two[k][v] ^= bitTwo[8 * k + bit];
          }
        }
      }
    }
  }
  static uint32_t shift(const std::array<std::array<uint32_t, 256>, 4>& t, uint32_t s) {
    return t[0][s & 0xffu] ^ t[1][(s >> 8) & 0xffu] ^ t[2][(s >> 16) & 0xffu] ^ t[3][s >> 24];
  }
};

const ShiftTables& shiftTables() {
  static const ShiftTables tables;
  return tables;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint64_t rawHardwareStream(uint64_t state, const uint8_t* p, size_t size) {
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, 8);
    state = _mm_crc32_u64(state, v);
  }
  for (; i < size; ++i) state = _mm_crc32_u8(static_cast<uint32_t>(state), p[i]);
  return state;
}

// Whole chunks on three streams, the rest on one.
__attribute__((target("sse4.2"))) uint32_t rawHardware(uint32_t state, const uint8_t* p, size_t size) {
  const ShiftTables& tables = shiftTables();
  while (size >= kChunk) {
    uint64_t a = state, b = 0, c = 0;
    const uint8_t* p1 = p + kBlock;
    const uint8_t* p2 = p + 2 * kBlock;
    for (size_t i = 0; i < kBlock; i += 8) {
      uint64_t v0, v1, v2;
      std::memcpy(&v0, p + i, 8);
      std::memcpy(&v1, p1 + i, 8);
      std::memcpy(&v2, p2 + i, 8);
      a = _mm_crc32_u64(a, v0);
      b = _mm_crc32_u64(b, v1);
      c = _mm_crc32_u64(c, v2);
    }
    state = ShiftTables::shift(tables.two, static_cast<uint32_t>(a)) ^
            ShiftTables::shift(tables.one, static_cast<uint32_t>(b)) ^ static_cast<uint32_t>(c);
    p += kChunk;
    size -= kChunk;
  }
  return static_cast<uint32_t>(rawHardwareStream(state, p, size));
}

// Streams 64-byte lines past the cache; head and tail with memcpy.
__attribute__((target("avx2"))) void copyNonTemporal(uint8_t* dst, const uint8_t* src, size_t size) {
  size_t head = (32 - (reinterpret_cast<uintptr_t>(dst) & 31u)) & 31u;
  if (head > size) head = size;
  std::memcpy(dst, src, head);
  size_t i = head;
  for (; i + 64 <= size; i += 64) {
    __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), x);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), y);
  }
  std::memcpy(dst + i, src + i, size - i);
}

__attribute__((target("avx2"))) void storeFence() { _mm_sfence(); }

bool hasSse42() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
bool hasAvx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
#endif

uint32_t rawUpdate(uint32_t state, const uint8_t* p, size_t size) {
#if defined(__x86_64__)
  if (hasSse42()) return rawHardware(state, p, size);
#endif
  return rawSoftware(state, p, size);
}

}  // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  return ~rawUpdate(~crc, static_cast<const uint8_t*>(data), size);
}

uint32_t crc32cCombine(uint32_t crcA, uint32_t crcB, uint64_t sizeB) {
  // raw(~0, a ++ b) = zeros(|b|)(raw(~0, a)) ^ raw(0, b); the inversions cancel to this.
  return appendZeros(crcA, sizeB) ^ crcB;
}

uint32_t copyWithCrc32c(void* dst, const void* src, size_t size, uint32_t crc) {
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  uint32_t state = ~crc;
#if defined(__x86_64__)
  if (size >= kNonTemporalMin && hasAvx2()) {
    // The CRC reads the chunk into cache; the copy then reads it from there.
    for (size_t off = 0; off < size; off += kChunk) {
      size_t n = size - off < kChunk ? size - off : kChunk;
      state = rawUpdate(state, s + off, n);
      copyNonTemporal(d + off, s + off, n);
    }
    storeFence();
    return ~state;
  }
#endif
  for (size_t off = 0; off < size; off += kChunk) {
    size_t n = size - off < kChunk ? size - off : kChunk;
    state = rawUpdate(state, s + off, n);
    std::memcpy(d + off, s + off, n);
  }
  return ~state;
}

}  // namespace troupe::checkpoint
