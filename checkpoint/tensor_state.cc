#include "troupe/checkpoint/tensor_state.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>
#include <utility>

namespace troupe::checkpoint {
namespace {

constexpr std::array<std::pair<std::string_view, size_t>, 19> kDtypes{{
    {"float32", 4}, {"float64", 8}, {"float16", 2}, {"bfloat16", 2}, {"int8", 1}, {"uint8", 1}, {"int16", 2},
    {"uint16", 2}, {"int32", 4}, {"uint32", 4}, {"int64", 8}, {"uint64", 8}, {"bool", 1}, {"complex64", 8},
    {"complex128", 16}, {"complex32", 4}, {"float8_e4m3fn", 1}, {"float8_e5m2", 1}, {"bytes", 1},
}};

constexpr size_t kMaxName = 1024;
constexpr size_t kMaxDims = 32;

Result<uint64_t> byteSize(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape) {
  if (name.empty() || name.size() > kMaxName) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("tensor name must be 1 to {} bytes, got {} bytes", kMaxName, name.size()));
  }
  size_t element = dtypeSize(dtype);
  if (element == 0) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("tensor '{}' has unknown dtype '{}' (known: float32, bfloat16, int64, bool, ...)", name,
                              dtype));
  }
  if (shape.size() > kMaxDims) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("tensor '{}' has {} dimensions; at most {}", name, shape.size(), kMaxDims));
  }
  unsigned __int128 total = element;
  for (int64_t d : shape) {
    if (d < 0) {
      return Status(StatusCode::kInvalidArgument, fmt::format("tensor '{}' has a negative dimension {}", name, d));
    }
    total *= static_cast<uint64_t>(d);
    if (total > (uint64_t(1) << 56)) {
      return Status(StatusCode::kInvalidArgument, fmt::format("tensor '{}' is too large", name));
    }
  }
  return static_cast<uint64_t>(total);
}

}  // namespace

size_t dtypeSize(std::string_view dtype) {
  for (const auto& [name, size] : kDtypes) {
    if (name == dtype) return size;
  }
  return 0;
}

Result<TensorSpec> makeTensorSpec(std::string name, std::string dtype, std::vector<int64_t> shape) {
  TROUPE_ASSIGN_OR_RETURN(auto bytes, byteSize(name, dtype, shape));
  return TensorSpec{std::move(name), std::move(dtype), std::move(shape), bytes};
}

Status validateTensorSpec(const TensorSpec& spec) {
  auto bytes = byteSize(spec.name, spec.dtype, spec.shape);
  if (!bytes.isOk()) return bytes.status();
  if (*bytes != spec.bytes) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("tensor '{}' ({} {}) should be {} bytes, not {}", spec.name, spec.dtype,
                              fmt::join(spec.shape, "x"), *bytes, spec.bytes));
  }
  return Status::ok();
}

}  // namespace troupe::checkpoint
