// One collective operation as the communicator queues it: what the caller asked (Request), the
// Work it waits on, the checks made before anything is sent, and the process counters of
// finished operations. Internal to collectives/.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "plan.h"
#include "troupe/collectives/communicator.h"
#include "wire.h"

namespace troupe::collectives {

// A Work completed by the communicator's I/O thread and waited on by callers.
class WorkState final : public Work {
 public:
  Status wait() override;
  bool done() const override;
  int64_t finishedAtUs() const override;
  // The first completion wins; later ones are ignored.
  void complete(Status status);

 private:
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  bool done_ = false;
  int64_t finishedAtUs_ = 0;
  Status status_;
};

struct Request {
  OpKind kind = OpKind::kBarrier;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  DataType type = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = -1;  // broadcast root, or the p2p peer (sendrecv: the rank sent to)
  std::shared_ptr<WorkState> work;
  int from = -1;  // sendrecv: the rank received from
};

// INVALID_ARGUMENT naming the mistake (unknown type, too many elements, a peer or root that is not
// another rank, a null buffer), or OK: a local mistake is reported before anything is sent.
Status validateRequest(const Request& request, int worldSize, int rank);

// "allreduce #7 (1024 elements of float32, sum)": for errors and waitingOn().
std::string describeRequest(const Request& request, uint64_t number);

// "allreduce #3 (1024 elements of float32, sum)": what a peer's operation header announced.
std::string describeHeader(const WireHeader& header);

// Counts a finished operation in the process's metrics (ops, bytes, seconds per kind).
void countFinished(const Request& request, std::chrono::steady_clock::duration took);

}  // namespace troupe::collectives
