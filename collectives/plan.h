// Collective plans (internal to collectives/): which elements each rank sends to and receives
// from which peer, in which order, what it reduces on arrival and which receive a send waits
// for. Pure: no sockets, no buffers, only element ranges in a few named regions, so the ring,
// chain and one-hop schedules are unit-tested on their own (plan_test.cc) and the transport
// (tcp_communicator.cc) only moves the bytes a plan names.
// Thread-safety: plain functions and values; a plan is filled by one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "troupe/collectives/communicator.h"

namespace troupe::collectives {

enum class OpKind : uint8_t {
  kAllreduce = 1,
  kReduceScatter,
  kAllgather,
  kBroadcast,
  kBarrier,
  kSend,
  kRecv,
  kSendRecv,
};

const char* opKindName(OpKind kind);  // "allreduce", "reduce_scatter", ...

// One operation as a rank sees it. `root` is the broadcast root or the p2p peer (sendrecv: the
// rank sent to); `from` is sendrecv's source. `oneHop` picks the small-message algorithm (every
// rank to every rank) over the ring or chain; `chunkElements` (>= 1) cuts ring and chain segments.
struct PlanShape {
  OpKind kind = OpKind::kBarrier;
  int worldSize = 1;
  int rank = 0;
  size_t count = 0;
  ReduceOp op = ReduceOp::kSum;
  int root = -1;
  int from = -1;
  bool oneHop = false;
  size_t chunkElements = 1;
};

// Where a step's elements live. kInput is the send buffer, kOutput the receive buffer (the one
// buffer of a broadcast), kWorkspace a count-element buffer of the communicator (a ring
// reduce-scatter's partial sums), kScratch the communicator's landing buffer for that peer.
enum class Region : uint8_t { kInput, kOutput, kWorkspace, kScratch };

struct PlanSend {
  int peer = -1;
  Region from = Region::kInput;
  size_t begin = 0;  // elements
  size_t count = 0;
  int32_t waitEvent = -1;  // sent once this event is set; -1: at once
};

// Receives `count` elements into `into` at `begin`. When `reduce` is set, the arrived elements
// are then combined: output region `reduceInto` at `reduceBegin` = input at `localBegin` op the
// arrived elements, divided by `divisor` (an average's last step). Then `event`, if any, is set.
struct PlanRecv {
  int peer = -1;
  Region into = Region::kOutput;
  size_t begin = 0;
  size_t count = 0;
  int32_t event = -1;
  bool reduce = false;
  Region reduceInto = Region::kOutput;
  size_t reduceBegin = 0;
  size_t localBegin = 0;
  int divisor = 1;
};

// Peers that take part in each direction: both sides exchange a header even with no elements.
struct PlanLink {
  int peer = -1;
  bool send = false;
  bool recv = false;
};

// A local copy before any transfer (input to output: a one-rank operation, an all-gather's own
// shard). The transport skips it when both are the same memory.
struct PlanCopy {
  size_t fromBegin = 0;  // in kInput
  size_t toBegin = 0;    // in kOutput
  size_t count = 0;
};

// After every transfer, with oneHop reductions: output[0, count) = x_0 op ... op x_{n-1} in rank
// order, x_me being kInput at selfBegin and x_p peer p's kScratch, so every rank computes
// bit-identical results.
struct PlanFinalReduce {
  size_t selfBegin = 0;
  size_t count = 0;
  int divisor = 1;
};

// The per-peer sends and receives of one operation, each list in the order it runs on its peer.
// Events are numbered 0..events-1, each set by exactly one receive.
struct CollectivePlan {
  std::optional<PlanCopy> copy;
  std::vector<PlanLink> links;
  std::vector<PlanSend> sends;
  std::vector<PlanRecv> recvs;
  int32_t events = 0;
  size_t workspaceElements = 0;  // kWorkspace's size
  std::optional<PlanFinalReduce> finalReduce;

  void clear();
};

// Fills `plan` (cleared first, its capacity kept so steady-state operations allocate nothing)
// for `shape`. The shape must be valid (ranks in range, chunkElements >= 1): the transport
// checks requests before planning.
void planCollective(const PlanShape& shape, CollectivePlan& plan);

}  // namespace troupe::collectives
