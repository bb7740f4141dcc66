// A test state: named tensors of many dtypes and shapes whose bytes depend on the step and rank,
// so a restore of the wrong step or rank shows. Shared by the unit tests and by the test writer
// process of tests/checkpoint (no doctest here).
// Thread-safety: test-only, one thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "troupe/checkpoint/image.h"
#include "troupe/checkpoint/tensor_state.h"
#include "troupe/runtime/logging.h"

namespace troupe::checkpoint::testing {

// Named tensors of every common dtype and awkward shapes (0-d, empty, odd sizes), with bytes that
// depend on the step (and rank) so a restore of the wrong one shows.
struct TestState {
  std::vector<TensorSpec> specs;
  std::vector<std::vector<uint8_t>> data;
  uint32_t rank = 0;

  explicit TestState(uint64_t largeBytes = 0, uint32_t forRank = 0) : rank(forRank) {
    add("weight.f32", "float32", {3, 5, 7});
    add("bias.f64", "float64", {11});
    add("emb.bf16", "bfloat16", {129, 3});
    add("half", "float16", {2, 2, 2, 2});
    add("counts", "int64", {1});
    add("scalar", "int32", {});
    add("mask", "bool", {17});
    add("bytes", "uint8", {4097});
    add("empty", "float32", {0, 4});
    add("complex", "complex64", {3});
    add("i8", "int8", {5});
    add("i16", "int16", {3, 3});
    if (largeBytes > 0) add("large", "float32", {static_cast<int64_t>(largeBytes / 4)});
  }
  void add(std::string name, std::string dtype, std::vector<int64_t> shape) {
    auto spec = makeTensorSpec(std::move(name), std::move(dtype), std::move(shape));
    TROUPE_CHECK(spec.isOk(), "{}", spec.status().toString());
    specs.push_back(*spec);
    data.emplace_back(spec->bytes);
  }
  void fill(uint64_t step) {
    for (size_t t = 0; t < data.size(); ++t) {
      uint64_t x = step * 1000003u + t * 7919u + rank * 104729u + 1;
      for (auto& b : data[t]) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        b = static_cast<uint8_t>(x >> 56);
      }
    }
  }
  bool holds(uint64_t step) const {
    TestState expected = *this;
    expected.fill(step);
    return expected.data == data;
  }
  std::vector<ConstBuffer> buffers() const {
    std::vector<ConstBuffer> out;
    for (const auto& d : data) out.push_back({d.data(), d.size()});
    return out;
  }
  std::vector<MutableBuffer> targets() {
    std::vector<MutableBuffer> out;
    for (auto& d : data) out.push_back({d.data(), d.size()});
    return out;
  }
  ImageLayout layout(uint64_t metaCapacity = kDefaultMetaCapacity) const {
    auto l = ImageLayout::plan(specs, metaCapacity);
    TROUPE_CHECK(l.isOk(), "{}", l.status().toString());
    return *l;
  }
};

}  // namespace troupe::checkpoint::testing
