#include "troupe/actors/batch.h"

#include <algorithm>

namespace troupe::actors {

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

size_t dtypeSize(const std::string& dtype) {
  if (dtype == "float32" || dtype == "int32") return 4;
  if (dtype == "float64" || dtype == "int64") return 8;
  if (dtype == "float16" || dtype == "bfloat16" || dtype == "int16") return 2;
  if (dtype == "uint8" || dtype == "int8" || dtype == "bool") return 1;
  return 0;
}

RankSlice rankSlice(int64_t global_batch, int world, int rank) {
  const int64_t base = global_batch / world;
  const int64_t extra = global_batch % world;
  RankSlice slice;
  slice.begin = rank * base + std::min<int64_t>(rank, extra);
  slice.end = slice.begin + base + (rank < extra ? 1 : 0);
  return slice;
}

}  // namespace troupe::actors
