// Reduction kernels: plain loops the compiler vectorises, compiled for AVX-512, AVX2 (+F16C)
// and baseline x86-64 and picked at load time (target_clones), so one binary runs anywhere and
// uses the widest vectors the CPU has. `#pragma GCC ivdep` because out may equal a or b: the
// loops only ever touch one index at a time, and without it GCC keeps a scalar fallback for
// the overlapping case, which is exactly the in-place case we run most.
#include "reduce.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "troupe/runtime/logging.h"

#if defined(__x86_64__)
#define TROUPE_VECTOR_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TROUPE_VECTOR_CLONES
#endif

namespace troupe::collectives {
namespace {

inline float bf16ToF(uint16_t v) { return std::bit_cast<float>(uint32_t(v) << 16); }

inline uint16_t fToBf16(float f) {
  uint32_t bits = std::bit_cast<uint32_t>(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40u);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

struct SumOp {
  template <typename T> static T apply(T a, T b) { return a + b; }
};
struct MinOp {
  template <typename T> static T apply(T a, T b) { return b < a ? b : a; }
};
struct MaxOp {
  template <typename T> static T apply(T a, T b) { return a < b ? b : a; }
};

template <typename T, typename Op>
TROUPE_VECTOR_CLONES void reduceLoop(T* out, const T* a, const T* b, size_t count) {
#pragma GCC ivdep
  for (size_t i = 0; i < count; ++i) out[i] = Op::apply(a[i], b[i]);
}

template <typename Op>
TROUPE_VECTOR_CLONES void reduceBf16Loop(uint16_t* out, const uint16_t* a, const uint16_t* b,
                                         size_t count) {
#pragma GCC ivdep
  for (size_t i = 0; i < count; ++i) out[i] = fToBf16(Op::apply(bf16ToF(a[i]), bf16ToF(b[i])));
}

template <typename Op>
TROUPE_VECTOR_CLONES void reduceF16Loop(_Float16* out, const _Float16* a, const _Float16* b,
                                        size_t count) {
#pragma GCC ivdep
  for (size_t i = 0; i < count; ++i) {
    out[i] = static_cast<_Float16>(Op::apply(static_cast<float>(a[i]), static_cast<float>(b[i])));
  }
}

template <typename T>
TROUPE_VECTOR_CLONES void divideLoop(T* out, const T* in, size_t count, T divisor) {
#pragma GCC ivdep
  for (size_t i = 0; i < count; ++i) out[i] = in[i] / divisor;
}

TROUPE_VECTOR_CLONES void divideBf16Loop(uint16_t* out, const uint16_t* in, size_t count,
                                         float divisor) {
#pragma GCC ivdep
  for (size_t i = 0; i < count; ++i) out[i] = fToBf16(bf16ToF(in[i]) / divisor);
}

TROUPE_VECTOR_CLONES void divideF16Loop(_Float16* out, const _Float16* in, size_t count,
                                        float divisor) {
#pragma GCC ivdep
  for (size_t i = 0; i < count; ++i) {
    out[i] = static_cast<_Float16>(static_cast<float>(in[i]) / divisor);
  }
}

template <typename Op>
void reduceTyped(DataType type, void* out, const void* a, const void* b, size_t count) {
  switch (type) {
    case DataType::kFloat32:
      return reduceLoop<float, Op>(static_cast<float*>(out), static_cast<const float*>(a),
                                   static_cast<const float*>(b), count);
    case DataType::kFloat64:
      return reduceLoop<double, Op>(static_cast<double*>(out), static_cast<const double*>(a),
                                    static_cast<const double*>(b), count);
    case DataType::kInt32:
      return reduceLoop<int32_t, Op>(static_cast<int32_t*>(out), static_cast<const int32_t*>(a),
                                     static_cast<const int32_t*>(b), count);
    case DataType::kInt64:
      return reduceLoop<int64_t, Op>(static_cast<int64_t*>(out), static_cast<const int64_t*>(a),
                                     static_cast<const int64_t*>(b), count);
    case DataType::kBFloat16:
      return reduceBf16Loop<Op>(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(a),
                                static_cast<const uint16_t*>(b), count);
    case DataType::kFloat16:
      return reduceF16Loop<Op>(static_cast<_Float16*>(out), static_cast<const _Float16*>(a),
                               static_cast<const _Float16*>(b), count);
  }
  TROUPE_CHECK(false, "unknown data type {}", static_cast<int>(type));
}

}  // namespace

void divideBuffer(DataType type, void* out, const void* in, size_t count, int divisor) {
  switch (type) {
    case DataType::kFloat32:
      return divideLoop<float>(static_cast<float*>(out), static_cast<const float*>(in), count,
                               static_cast<float>(divisor));
    case DataType::kFloat64:
      return divideLoop<double>(static_cast<double*>(out), static_cast<const double*>(in), count,
                                static_cast<double>(divisor));
    case DataType::kInt32:
      return divideLoop<int32_t>(static_cast<int32_t*>(out), static_cast<const int32_t*>(in),
                                 count, divisor);
    case DataType::kInt64:
      return divideLoop<int64_t>(static_cast<int64_t*>(out), static_cast<const int64_t*>(in),
                                 count, divisor);
    case DataType::kBFloat16:
      return divideBf16Loop(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(in), count,
                            static_cast<float>(divisor));
    case DataType::kFloat16:
      return divideF16Loop(static_cast<_Float16*>(out), static_cast<const _Float16*>(in), count,
                           static_cast<float>(divisor));
  }
  TROUPE_CHECK(false, "unknown data type {}", static_cast<int>(type));
}

void reduceBuffers(DataType type, ReduceOp op, void* out, const void* a, const void* b,
                   size_t count, int divisor) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: reduceTyped<SumOp>(type, out, a, b, count); break;
    case ReduceOp::kMin: reduceTyped<MinOp>(type, out, a, b, count); break;
    case ReduceOp::kMax: reduceTyped<MaxOp>(type, out, a, b, count); break;
  }
  // TODO(perf): fuse the division into the last reduction (one pass instead of two); it runs
  // once per element per all-reduce, on data still in cache.
  if (divisor > 1) divideBuffer(type, out, out, count, divisor);
}

float bfloat16ToFloat(uint16_t value) { return bf16ToF(value); }
uint16_t floatToBfloat16(float value) { return fToBf16(value); }
float float16ToFloat(uint16_t value) { return static_cast<float>(std::bit_cast<_Float16>(value)); }
uint16_t floatToFloat16(float value) {
  return std::bit_cast<uint16_t>(static_cast<_Float16>(value));
}

}  // namespace troupe::collectives
