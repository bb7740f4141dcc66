// The reduction kernels against a scalar reference, for every type and operation, in place and
// out of place, with lengths that leave vector tails.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "reduce.h"

namespace troupe::collectives {
namespace {

double scalar(ReduceOp op, double a, double b) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return a + b;
    case ReduceOp::kMin: return std::min(a, b);
    case ReduceOp::kMax: return std::max(a, b);
  }
  return 0;
}

template <typename T>
void checkNative(DataType type) {
  std::mt19937 random(42);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax}) {
    for (size_t count : {size_t{0}, size_t{1}, size_t{15}, size_t{64}, size_t{1027}}) {
      for (bool inPlace : {false, true}) {
        CAPTURE(dataTypeName(type));
        CAPTURE(reduceOpName(op));
        CAPTURE(count);
        CAPTURE(inPlace);
        std::vector<T> a(count), b(count), out(count);
        for (size_t i = 0; i < count; ++i) {
          a[i] = static_cast<T>(static_cast<int>(random() % 2001) - 1000) / T(4);
          b[i] = static_cast<T>(static_cast<int>(random() % 2001) - 1000) / T(4);
        }
        const std::vector<T> a0 = a;
        T* target = inPlace ? a.data() : out.data();
        const int divisor = op == ReduceOp::kAvg ? 3 : 1;
        reduceBuffers(type, op, target, a.data(), b.data(), count, divisor);
        for (size_t i = 0; i < count; ++i) {
          T want = static_cast<T>(scalar(op, double(a0[i]), double(b[i])));
          if (divisor > 1) want = static_cast<T>(want / T(divisor));
          REQUIRE(target[i] == want);
        }
      }
    }
  }
}

TEST_CASE("reduce kernels: float32, float64, int32, int64 match the scalar reference") {
  checkNative<float>(DataType::kFloat32);
  checkNative<double>(DataType::kFloat64);
  checkNative<int32_t>(DataType::kInt32);
  checkNative<int64_t>(DataType::kInt64);
}

TEST_CASE("reduce kernels: integer average truncates toward zero") {
  std::vector<int32_t> a = {7, -7, 5}, b = {0, 0, 0};
  reduceBuffers(DataType::kInt32, ReduceOp::kAvg, a.data(), a.data(), b.data(), 3, 2);
  CHECK(a == std::vector<int32_t>{3, -3, 2});
}

TEST_CASE("bfloat16 and float16 conversions round to nearest even") {
  CHECK(bfloat16ToFloat(floatToBfloat16(1.0f)) == 1.0f);
  // 1 + 2^-8 is halfway between two bfloat16 values: ties go to the even one (1.0).
  CHECK(bfloat16ToFloat(floatToBfloat16(1.0f + 1.0f / 256)) == 1.0f);
  CHECK(bfloat16ToFloat(floatToBfloat16(1.0f + 3.0f / 256)) == 1.0f + 4.0f / 256);
  CHECK(std::isnan(bfloat16ToFloat(floatToBfloat16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isinf(bfloat16ToFloat(floatToBfloat16(std::numeric_limits<float>::infinity()))));
  CHECK(float16ToFloat(floatToFloat16(0.5f)) == 0.5f);
  CHECK(float16ToFloat(floatToFloat16(1.0f + 1.0f / 2048)) == 1.0f);
  CHECK(float16ToFloat(floatToFloat16(65504.0f)) == 65504.0f);
}

TEST_CASE("reduce kernels: bfloat16 and float16 reduce in float32, rounded once") {
  std::mt19937 random(7);
  for (DataType type : {DataType::kBFloat16, DataType::kFloat16}) {
    const bool bf = type == DataType::kBFloat16;
    auto from = [&](float f) { return bf ? floatToBfloat16(f) : floatToFloat16(f); };
    auto to = [&](uint16_t v) { return bf ? bfloat16ToFloat(v) : float16ToFloat(v); };
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax}) {
      for (bool inPlace : {false, true}) {
        CAPTURE(dataTypeName(type));
        CAPTURE(reduceOpName(op));
        const size_t count = 517;
        std::vector<uint16_t> a(count), b(count), out(count);
        for (size_t i = 0; i < count; ++i) {
          a[i] = from(static_cast<float>(static_cast<int>(random() % 20001) - 10000) / 1000);
          b[i] = from(static_cast<float>(static_cast<int>(random() % 20001) - 10000) / 1000);
        }
        const std::vector<uint16_t> a0 = a;
        uint16_t* target = inPlace ? a.data() : out.data();
        const int divisor = op == ReduceOp::kAvg ? 2 : 1;
        reduceBuffers(type, op, target, a.data(), b.data(), count, divisor);
        for (size_t i = 0; i < count; ++i) {
          uint16_t want = from(static_cast<float>(scalar(op, to(a0[i]), to(b[i]))));
          if (divisor > 1) want = from(to(want) / static_cast<float>(divisor));
          REQUIRE(target[i] == want);
        }
      }
    }
  }
}

TEST_CASE("shardOf covers the buffer once, in rank order, for any count") {
  for (int world = 1; world <= 5; ++world) {
    for (size_t count : {size_t{0}, size_t{1}, size_t{4}, size_t{7}, size_t{1001}}) {
      size_t next = 0, largest = 0, smallest = count;
      for (int r = 0; r < world; ++r) {
        const Shard s = shardOf(count, world, r);
        CHECK(s.begin == next);
        next = s.end;
        largest = std::max(largest, s.size());
        smallest = std::min(smallest, s.size());
      }
      CHECK(next == count);
      CHECK(largest - smallest <= 1);
    }
  }
}

}  // namespace
}  // namespace troupe::collectives
