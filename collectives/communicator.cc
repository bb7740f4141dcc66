// What every backend shares: names and sizes of types, shards, and the paired send/receive
// for backends without a duplex one.
#include "troupe/collectives/communicator.h"

#include <algorithm>

namespace troupe::collectives {

const char* dataTypeName(DataType type) {
  switch (type) {
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kFloat16: return "float16";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
  }
  return "unknown";
}

const char* reduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
  }
  return "unknown";
}

size_t dataTypeSize(DataType type) {
  switch (type) {
    case DataType::kFloat32: return 4;
    case DataType::kFloat64: return 8;
    case DataType::kBFloat16: return 2;
    case DataType::kFloat16: return 2;
    case DataType::kInt32: return 4;
    case DataType::kInt64: return 8;
  }
  return 0;
}

Shard shardOf(size_t count, int worldSize, int rank) {
  const size_t n = static_cast<size_t>(worldSize);
  const size_t r = static_cast<size_t>(rank);
  const size_t base = count / n, extra = count % n;
  const size_t begin = r * base + std::min(r, extra);
  return Shard{begin, begin + base + (r < extra ? 1 : 0)};
}

namespace {

// Both halves of a sendRecv issued as two operations.
class PairWork final : public Work {
 public:
  PairWork(std::shared_ptr<Work> first, std::shared_ptr<Work> second)
      : first_(std::move(first)), second_(std::move(second)) {}
  Status wait() override {
    Status a = first_->wait();
    Status b = second_->wait();
    return a.isOk() ? b : a;
  }
  bool done() const override { return first_->done() && second_->done(); }
  int64_t finishedAtUs() const override { return std::max(first_->finishedAtUs(), second_->finishedAtUs()); }

 private:
  std::shared_ptr<Work> first_, second_;
};

}  // namespace

// Even ranks send first, odd ranks receive first: in a ring every send meets a posted receive
// or a rank that finishes its send next, so no cycle waits (also for odd ring sizes, where the
// last and first ranks are both even).
std::shared_ptr<Work> Communicator::sendRecvAsync(const void* send, int to, void* recv, int from, size_t count,
                                                  DataType type) {
  if (rank() % 2 == 0) {
    auto first = sendAsync(send, count, type, to);
    return std::make_shared<PairWork>(first, recvAsync(recv, count, type, from));
  }
  auto first = recvAsync(recv, count, type, from);
  return std::make_shared<PairWork>(first, sendAsync(send, count, type, to));
}

}  // namespace troupe::collectives
