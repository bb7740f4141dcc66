// Plain buffers shared by the dataloader side (datasets, ShardQueue) and the trainer side
// (TrainerEngine): no LibTorch here, so these types cross RPC and checkpoint code freely.
// Thread-safety: value types.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace troupe::actors {

// A dense C-order array in host memory: element type by name ("float32", "float64", "int64",
// "int32", "uint8", ...), shape, and the raw little-endian bytes (product(shape) * element size).
// `name` says what it is where it is one of many (checkpoint state); batches leave it empty.
struct HostTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;

  int64_t numel() const;
};

// Bytes per element of a dtype name; 0 for a name this code does not know.
size_t dtypeSize(const std::string& dtype);

// One rank's share of one step: row i of `inputs` and `targets` is sample `sample_ids[i]`.
//   language model: inputs int64 [B, T] token ids, targets int64 [B, T] (the next tokens)
//   features:       inputs float32 [B, F], targets int64 [B] (class labels) or float32 [B, K]
struct Batch {
  HostTensor inputs;
  HostTensor targets;
  std::vector<uint64_t> sample_ids;

  int64_t rows() const { return inputs.shape.empty() ? 0 : inputs.shape[0]; }
};

// The rows [begin, end) of a step's `global_batch` samples that rank `rank` of `world` computes:
// contiguous, global_batch / world each, the first global_batch % world ranks one more. The
// dataloader splits with it and the trainer checks its batch against it.
struct RankSlice {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};
RankSlice rankSlice(int64_t global_batch, int world, int rank);

}  // namespace troupe::actors
