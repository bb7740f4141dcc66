#include "operation.h"

#include <vector>

#include <fmt/format.h>

#include "troupe/runtime/metrics.h"

namespace troupe::collectives {

Status WorkState::wait() {
  std::unique_lock lock(mutex_);
  ready_.wait(lock, [this] { return done_; });
  return status_;
}

bool WorkState::done() const {
  std::lock_guard lock(mutex_);
  return done_;
}

int64_t WorkState::finishedAtUs() const {
  std::lock_guard lock(mutex_);
  return finishedAtUs_;
}

void WorkState::complete(Status status) {
  auto now = std::chrono::duration_cast<std::chrono::microseconds>(
                 std::chrono::system_clock::now().time_since_epoch()).count();
  {
    std::lock_guard lock(mutex_);
    if (done_) return;
    status_ = std::move(status);
    done_ = true;
    finishedAtUs_ = now;
  }
  ready_.notify_all();
}

Status validateRequest(const Request& request, int n, int me) {
  if (dataTypeSize(request.type) == 0) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("unknown data type {}", static_cast<int>(request.type)));
  }
  if (request.count > (size_t{1} << 48)) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{} of {} elements is too large", opKindName(request.kind), request.count));
  }
  const bool p2p = request.kind == OpKind::kSend || request.kind == OpKind::kRecv;
  if (request.kind == OpKind::kSendRecv &&
      (request.root < 0 || request.root >= n || request.root == me || request.from < 0 || request.from >= n ||
       request.from == me)) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("sendrecv: to {} and from {} must be other ranks of this communicator (rank "
                              "{} of {})",
                              request.root, request.from, me, n));
  }
  if (p2p && (request.root < 0 || request.root >= n || request.root == me)) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: peer {} is not another rank of this communicator (rank {} of {})",
                              opKindName(request.kind), request.root, me, n));
  }
  if (request.kind == OpKind::kBroadcast && (request.root < 0 || request.root >= n)) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("broadcast: root {} is not a rank of this communicator (world size {})",
                              request.root, n));
  }
  if (request.count > 0 && request.kind != OpKind::kBarrier &&
      ((request.kind != OpKind::kRecv && request.send == nullptr) ||
       (request.kind != OpKind::kSend && request.recv == nullptr))) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: null buffer for {} elements", opKindName(request.kind), request.count));
  }
  return Status::ok();
}

std::string describeRequest(const Request& r, uint64_t number) {
  std::string what =
      fmt::format("{} #{} ({} elements of {}", opKindName(r.kind), number, r.count, dataTypeName(r.type));
  if (r.kind == OpKind::kAllreduce || r.kind == OpKind::kReduceScatter) {
    what += fmt::format(", {}", reduceOpName(r.op));
  }
  if (r.kind == OpKind::kSend || r.kind == OpKind::kRecv) what += fmt::format(", peer {}", r.root);
  if (r.kind == OpKind::kSendRecv) what += fmt::format(", to {}, from {}", r.root, r.from);
  if (r.kind == OpKind::kBroadcast) what += fmt::format(", root {}", r.root);
  return what + ")";
}

std::string describeHeader(const WireHeader& header) {
  const auto kind = static_cast<OpKind>(header.kind);
  const auto type = static_cast<DataType>(header.type);
  std::string what =
      fmt::format("{} #{} ({} elements of {}", opKindName(kind), header.seq, header.count, dataTypeName(type));
  if (kind == OpKind::kAllreduce || kind == OpKind::kReduceScatter) {
    what += fmt::format(", {}", reduceOpName(static_cast<ReduceOp>(header.op)));
  }
  if (kind == OpKind::kBroadcast) what += fmt::format(", root {}", header.root);
  return what + ")";
}

namespace {

// Per operation kind, in the process's counters (troupe/runtime/metrics.h) for the head's /metrics.
struct OpCounters {
  metrics::Counter& ops;
  metrics::Counter& bytes;
  metrics::Counter& seconds;
};

OpCounters& opCounters(OpKind kind) {
  static std::vector<OpCounters> table = [] {
    std::vector<OpCounters> t;
    for (int k = static_cast<int>(OpKind::kAllreduce); k <= static_cast<int>(OpKind::kSendRecv); ++k) {
      std::string op = metrics::labelText({{"op", opKindName(static_cast<OpKind>(k))}});
      t.push_back(OpCounters{metrics::counter("troupe_collective_ops_total", op),
                             metrics::counter("troupe_collective_bytes_total", op),
                             metrics::counter("troupe_collective_seconds_total", op, metrics::Unit::kSeconds)});
    }
    return t;
  }();
  return table[static_cast<size_t>(kind) - static_cast<size_t>(OpKind::kAllreduce)];
}

}  // namespace

void countFinished(const Request& request, std::chrono::steady_clock::duration took) {
  OpCounters& counters = opCounters(request.kind);
  counters.ops.add();
  counters.bytes.add(request.count * dataTypeSize(request.type));
  counters.seconds.addTime(took);
}

}  // namespace troupe::collectives
