// The state a checkpoint holds, as plain buffers: named tensors (name, dtype, shape, bytes) and
// a metadata blob (step, and whatever bytes the trainer adds: RNG, data-shard and optimizer
// state). No LibTorch here; torch tensors and numpy arrays reach it as pointers and sizes.
// Thread-safety: value types.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "troupe/runtime/status.h"

namespace troupe::checkpoint {

// Bytes per element of a dtype named as torch names it without the prefix: "float32",
// "bfloat16", "int64", "bool", "complex64", ...; 0 when the name is unknown.
size_t dtypeSize(std::string_view dtype);

// What one tensor is. `bytes` is numel * dtypeSize (a checkpoint stores contiguous tensors).
struct TensorSpec {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  bool operator==(const TensorSpec&) const = default;
};

// A spec with `bytes` filled in. kInvalidArgument for an empty or too long name (1..1024 bytes),
// an unknown dtype, a negative dimension, more than 32 dimensions, or a size that overflows.
Result<TensorSpec> makeTensorSpec(std::string name, std::string dtype, std::vector<int64_t> shape);
// The same checks on a spec that claims its bytes (e.g. one read from a file).
Status validateTensorSpec(const TensorSpec& spec);

// A tensor's bytes to save; valid for the duration of the call that takes it.
struct ConstBuffer {
  const void* data = nullptr;
  uint64_t size = 0;
};
// Where a restore writes one tensor.
struct MutableBuffer {
  void* data = nullptr;
  uint64_t size = 0;
};

}  // namespace troupe::checkpoint
