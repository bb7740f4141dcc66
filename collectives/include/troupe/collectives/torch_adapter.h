// LibTorch tensors on a Communicator: header-only, so the collectives library never includes
// LibTorch; include it only from code that already links LibTorch. Tensors must be contiguous
// (CPU tensors for the CPU backend, CUDA tensors for the NCCL backend) and are used in place;
// they must stay alive until the operation is done (the blocking forms wait for that).
// Thread-safety: as Communicator.
#pragma once

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "troupe/collectives/communicator.h"

namespace troupe::collectives {

// The DataType of a tensor's scalar type; kInvalidArgument for types collectives do not carry.
inline Result<DataType> dataTypeOf(const at::Tensor& tensor) {
  switch (tensor.scalar_type()) {
    case at::kFloat: return DataType::kFloat32;
    case at::kDouble: return DataType::kFloat64;
    case at::kBFloat16: return DataType::kBFloat16;
    case at::kHalf: return DataType::kFloat16;
    case at::kInt: return DataType::kInt32;
    case at::kLong: return DataType::kInt64;
    default:
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("collectives do not carry tensors of type {}; use float32, "
                                "float64, bfloat16, float16, int32 or int64",
                                c10::toString(tensor.scalar_type())));
  }
}

namespace detail {
inline Status checkContiguous(const at::Tensor& tensor, const char* what) {
  if (!tensor.defined() || !tensor.is_contiguous()) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: the tensor must be defined and contiguous (call .contiguous())",
                              what));
  }
  return Status::ok();
}
}  // namespace detail

// Every rank's `tensor` becomes op over all ranks' tensors.
inline Status allreduce(Communicator& comm, at::Tensor& tensor, ReduceOp op = ReduceOp::kSum) {
  TROUPE_RETURN_IF_ERROR(detail::checkContiguous(tensor, "allreduce"));
  auto type = dataTypeOf(tensor);
  if (!type) return type.status();
  return comm.allreduce(tensor.data_ptr(), static_cast<size_t>(tensor.numel()), *type, op);
}

// Root's `tensor` is copied into every other rank's.
inline Status broadcast(Communicator& comm, at::Tensor& tensor, int root) {
  TROUPE_RETURN_IF_ERROR(detail::checkContiguous(tensor, "broadcast"));
  auto type = dataTypeOf(tensor);
  if (!type) return type.status();
  return comm.broadcast(tensor.data_ptr(), static_cast<size_t>(tensor.numel()), *type, root);
}

// `whole` (same shape on every rank) is reduced; `shard` gets this rank's part of the flattened
// result (shardOf(whole.numel(), worldSize, rank) elements).
inline Status reduceScatter(Communicator& comm, const at::Tensor& whole, at::Tensor& shard,
                            ReduceOp op = ReduceOp::kSum) {
  TROUPE_RETURN_IF_ERROR(detail::checkContiguous(whole, "reduceScatter"));
  TROUPE_RETURN_IF_ERROR(detail::checkContiguous(shard, "reduceScatter"));
  auto type = dataTypeOf(whole);
  if (!type) return type.status();
  const size_t count = static_cast<size_t>(whole.numel());
  if (shard.scalar_type() != whole.scalar_type() ||
      static_cast<size_t>(shard.numel()) != shardOf(count, comm.worldSize(), comm.rank()).size()) {
    return Status(StatusCode::kInvalidArgument,
                  "reduceScatter: shard must have whole's type and shardOf(...).size() elements");
  }
  return comm.reduceScatter(whole.data_ptr(), shard.data_ptr(), count, *type, op);
}

// `whole` gets every rank's `shard`, in rank order (shards of shardOf(whole.numel(), ...)).
inline Status allgather(Communicator& comm, const at::Tensor& shard, at::Tensor& whole) {
  TROUPE_RETURN_IF_ERROR(detail::checkContiguous(whole, "allgather"));
  TROUPE_RETURN_IF_ERROR(detail::checkContiguous(shard, "allgather"));
  auto type = dataTypeOf(whole);
  if (!type) return type.status();
  const size_t count = static_cast<size_t>(whole.numel());
  if (shard.scalar_type() != whole.scalar_type() ||
      static_cast<size_t>(shard.numel()) != shardOf(count, comm.worldSize(), comm.rank()).size()) {
    return Status(StatusCode::kInvalidArgument,
                  "allgather: shard must have whole's type and shardOf(...).size() elements");
  }
  return comm.allgather(shard.data_ptr(), whole.data_ptr(), count, *type);
}

}  // namespace troupe::collectives
