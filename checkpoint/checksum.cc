// CRC32C, three ways, all giving the same value:
//  * AVX-512 + VPCLMULQDQ (this machine): the message is folded 256 bytes at a time with
//    carry-less multiplies (four 512-bit accumulators, each 128-bit lane moved 2048 bits forward:
//    lane' = lo64 * (x^2111 mod P) ^ hi64 * (x^2047 mod P), bit-reflected), then the last 256 bytes
//    of accumulator are run through the crc32 instruction. Folding keeps the message's value mod P,
//    and the CRC of a message depends only on that, so no Barrett reduction is needed. The copy is
//    fused into the same loop (load, stream-store, fold), so copy + CRC runs at memcpy speed.
//  * SSE4.2 crc32 on three interleaved streams (one has a latency of three cycles), joined with
//    shift tables ("append B zero bytes" is linear in the CRC state).
//  * a byte table, for CPUs without SSE4.2.
// Measured here for 1 GiB: crc32 one stream 0.16 s, three streams 0.085 s, folding 0.082 s (all
// limited by reading memory); copy + CRC: chunked CRC then non-temporal copy 0.14 s, fused folding
// copy 0.113 s, plain memcpy (no CRC) 0.100 s.
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

// x^k mod P in the normal (not reflected) representation, then bit-reflected into the 64-bit form
// carry-less multiplies take: the coefficient of x^j at bit 63 - j.
uint64_t foldConstant(unsigned k) {
  uint64_t r = 1;
  for (unsigned i = 0; i < k; ++i) {
    r <<= 1;
    if (r & (uint64_t(1) << 32)) r ^= (uint64_t(1) << 32) | 0x1EDC6F41u;
  }
  uint64_t reflected = 0;
  for (int j = 0; j < 32; ++j) {
    if ((r >> j) & 1u) reflected |= uint64_t(1) << (63 - j);
  }
  return reflected;
}

constexpr size_t kFoldBlock = 256;  // four 512-bit accumulators
constexpr size_t kFoldMin = 2 * kFoldBlock;

#define TROUPE_FOLD_TARGET __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))

// Each 128-bit lane of `a` moved forward and XORed with the next block's lane.
TROUPE_FOLD_TARGET inline __m512i fold(__m512i a, __m512i k, __m512i next) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a, k, 0x00), _mm512_clmulepi64_epi128(a, k, 0x11), next,
                                   0x96);  // three-way XOR
}

// Raw CRC state after `size` (>= kFoldMin) more bytes of `src`, copying them to `dst` on the way
// when dst is not null (with non-temporal stores when `stream`; dst then 64-byte aligned).
TROUPE_FOLD_TARGET uint32_t foldCopy(uint32_t state, uint8_t* dst, const uint8_t* src, size_t size, bool stream) {
  static const uint64_t kLo = foldConstant(2048 + 63), kHi = foldConstant(2048 - 1);
  const __m512i k = _mm512_set_epi64(static_cast<long long>(kHi), static_cast<long long>(kLo),
                                     static_cast<long long>(kHi), static_cast<long long>(kLo),
                                     static_cast<long long>(kHi), static_cast<long long>(kLo),
                                     static_cast<long long>(kHi), static_cast<long long>(kLo));
  __m512i a0 = _mm512_loadu_si512(src), a1 = _mm512_loadu_si512(src + 64);
  __m512i a2 = _mm512_loadu_si512(src + 128), a3 = _mm512_loadu_si512(src + 192);
  if (dst != nullptr) {
    _mm512_storeu_si512(dst, a0);
    _mm512_storeu_si512(dst + 64, a1);
    _mm512_storeu_si512(dst + 128, a2);
    _mm512_storeu_si512(dst + 192, a3);
  }
  // The incoming state enters as the message's first four bytes XORed with it.
  a0 = _mm512_xor_si512(a0, _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(state))));
  size_t i = kFoldBlock;
  for (; i + kFoldBlock <= size; i += kFoldBlock) {
    __m512i b0 = _mm512_loadu_si512(src + i), b1 = _mm512_loadu_si512(src + i + 64);
    __m512i b2 = _mm512_loadu_si512(src + i + 128), b3 = _mm512_loadu_si512(src + i + 192);
    if (dst != nullptr && stream) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), b0);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 64), b1);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 128), b2);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 192), b3);
    } else if (dst != nullptr) {
      _mm512_storeu_si512(dst + i, b0);
      _mm512_storeu_si512(dst + i + 64, b1);
      _mm512_storeu_si512(dst + i + 128, b2);
      _mm512_storeu_si512(dst + i + 192, b3);
    }
    a0 = fold(a0, k, b0);
    a1 = fold(a1, k, b1);
    a2 = fold(a2, k, b2);
    a3 = fold(a3, k, b3);
  }
  if (dst != nullptr && stream) _mm_sfence();
  alignas(64) uint8_t window[kFoldBlock];
  _mm512_store_si512(window, a0);
  _mm512_store_si512(window + 64, a1);
  _mm512_store_si512(window + 128, a2);
  _mm512_store_si512(window + 192, a3);
  uint32_t crc = static_cast<uint32_t>(rawHardwareStream(0, window, kFoldBlock));
  if (dst != nullptr) std::memcpy(dst + i, src + i, size - i);
  return static_cast<uint32_t>(rawHardwareStream(crc, src + i, size - i));
}

bool hasFold() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq") &&
                          __builtin_cpu_supports("sse4.2");
  return yes;
}

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
  if (size >= kFoldMin && hasFold()) return foldCopy(state, nullptr, p, size, false);
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
  if (size >= kFoldMin && hasFold()) {
    // Non-temporal stores want a 64-byte aligned destination: the head goes the plain way.
    bool stream = size >= kNonTemporalMin;
    size_t head = stream ? (64 - (reinterpret_cast<uintptr_t>(d) & 63u)) & 63u : 0;
    std::memcpy(d, s, head);
    state = rawUpdate(state, s, head);
    return ~foldCopy(state, d + head, s + head, size - head, stream);
  }
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
