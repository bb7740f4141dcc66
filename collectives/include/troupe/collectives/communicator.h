// Communicator: collective operations (all-reduce, reduce-scatter, all-gather, broadcast,
// barrier, send/recv, ring send-receive) over the ranks of one (group, epoch) of an elastic group.
//
// Ranks meet through the cluster store: each publishes its address in the rendezvous of
// (group, epoch), connects to the others and then talks to them directly. A communicator belongs
// to one epoch. After any error (a peer died or closed, a timeout, a mismatched operation, or an
// advance of the group's epoch in the store) the communicator is unusable: every pending and
// later operation fails with the same error, which names the peer. Recreate it at epoch + 1,
// possibly with another world size.
//
// Every rank must issue the same collectives in the same order with the same counts, data type
// and operation (a mismatch is detected and reported as kFailedPrecondition). send/recv pairs
// must match in order between two ranks.
//
// Thread-safety: operations may be submitted from any thread, one submitter at a time; they run
// in submission order on the communicator's own I/O thread (an asio::io_context; large writes
// are handed to its sender thread; ranks on one host move their data through shared memory, see
// CommunicatorOptions::sharedMemory). The buffers handed to an operation must stay valid and
// untouched until its Work is done.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "troupe/runtime/rendezvous_store.h"
#include "troupe/runtime/status.h"

namespace troupe::collectives {

enum class DataType : uint8_t { kFloat32, kFloat64, kBFloat16, kFloat16, kInt32, kInt64 };
enum class ReduceOp : uint8_t { kSum, kAvg, kMin, kMax };

const char* dataTypeName(DataType type);  // "float32", "float64", "bfloat16", ...
const char* reduceOpName(ReduceOp op);    // "sum", "avg", "min", "max"
size_t dataTypeSize(DataType type);       // bytes per element

// The elements [begin, end) of a `count`-element buffer that rank `rank` of `worldSize` owns in
// reduceScatter and allgather: contiguous blocks, the first count % worldSize ranks one element
// longer, so any count works with any world size.
struct Shard {
  size_t begin = 0;
  size_t end = 0;
  size_t size() const { return end - begin; }
};
Shard shardOf(size_t count, int worldSize, int rank);

// The outcome of one submitted operation. Thread-safety: any thread may wait.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the operation finished, then returns its status (the same on every call).
  virtual Status wait() = 0;
  // True once the operation finished (wait() then returns at once).
  virtual bool done() const = 0;
  // When it finished, in microseconds of the system clock (for timelines); 0 while it runs or
  // where the backend does not know.
  virtual int64_t finishedAtUs() const { return 0; }
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int worldSize() const = 0;
  virtual const std::string& group() const = 0;
  virtual int64_t epoch() const = 0;
  // Ok while usable; otherwise the error that made it unusable.
  virtual Status health() const = 0;
  // For hang reports: which peers the operation in progress waits for and how far it got
  // ("rank 1 (pid 42 on h2, 10.0.0.2:4100): has not started allreduce #8 (...)"); empty when
  // none runs or the backend cannot say. Any thread; may take up to a second.
  virtual std::string waitingOn() const { return ""; }
  // The peers this communicator saw die (their process ended, as the kernel or their connection
  // told), in the order seen; empty where the backend cannot tell. Any thread.
  virtual std::vector<int> deadPeers() const { return {}; }

  // ---- Asynchronous operations: each returns at once; its Work reports the outcome ----
  // recv[i] = op over ranks of send[i], for i < count. send == recv is allowed (in place).
  // kAvg divides the sum by the world size (integer division for integer types).
  virtual std::shared_ptr<Work> allreduceAsync(const void* send, void* recv, size_t count,
                                               DataType type, ReduceOp op) = 0;
  // `send` has `count` elements on every rank; recv gets this rank's shard of the reduction
  // (shardOf(count, worldSize, rank): shardOf(...).size() elements). recv may be the shard's
  // place inside send.
  virtual std::shared_ptr<Work> reduceScatterAsync(const void* send, void* recv, size_t count,
                                                   DataType type, ReduceOp op) = 0;
  // `send` holds this rank's shard (shardOf(count, worldSize, rank).size() elements) of a
  // `count`-element buffer; recv gets the whole buffer. send may be the shard's place in recv.
  virtual std::shared_ptr<Work> allgatherAsync(const void* send, void* recv, size_t count,
                                               DataType type) = 0;
  // Copies root's `buffer` into every other rank's `buffer`.
  virtual std::shared_ptr<Work> broadcastAsync(void* buffer, size_t count, DataType type,
                                               int root) = 0;
  // Done on a rank once every rank has entered the barrier.
  virtual std::shared_ptr<Work> barrierAsync() = 0;
  // Point to point: `count` elements to or from `peer`; the peer's count and type must match.
  virtual std::shared_ptr<Work> sendAsync(const void* buffer, size_t count, DataType type,
                                          int peer) = 0;
  virtual std::shared_ptr<Work> recvAsync(void* buffer, size_t count, DataType type,
                                          int peer) = 0;
  // One step of a ring exchange: `count` elements of `send` to rank `to` and as many from rank
  // `from` into `recv` (to == from is allowed). Every rank of the exchange must call it in the
  // same order. The CPU backend moves both directions at once; the default issues a send and a
  // receive in an order that cannot deadlock in a ring.
  virtual std::shared_ptr<Work> sendRecvAsync(const void* send, int to, void* recv, int from, size_t count,
                                              DataType type);

  // ---- Blocking forms: submit, then wait ----
  Status allreduce(const void* send, void* recv, size_t count, DataType type, ReduceOp op) {
    return allreduceAsync(send, recv, count, type, op)->wait();
  }
  Status allreduce(void* buffer, size_t count, DataType type, ReduceOp op) {
    return allreduce(buffer, buffer, count, type, op);
  }
  Status reduceScatter(const void* send, void* recv, size_t count, DataType type, ReduceOp op) {
    return reduceScatterAsync(send, recv, count, type, op)->wait();
  }
  Status allgather(const void* send, void* recv, size_t count, DataType type) {
    return allgatherAsync(send, recv, count, type)->wait();
  }
  Status broadcast(void* buffer, size_t count, DataType type, int root) {
    return broadcastAsync(buffer, count, type, root)->wait();
  }
  Status barrier() { return barrierAsync()->wait(); }
  Status send(const void* buffer, size_t count, DataType type, int peer) {
    return sendAsync(buffer, count, type, peer)->wait();
  }
  Status recv(void* buffer, size_t count, DataType type, int peer) {
    return recvAsync(buffer, count, type, peer)->wait();
  }
  Status sendRecv(const void* send, int to, void* recv, int from, size_t count, DataType type) {
    return sendRecvAsync(send, to, recv, from, count, type)->wait();
  }
};

// What a rank needs to join (group, epoch).
struct CommunicatorOptions {
  std::string group;
  int64_t epoch = 0;
  int rank = 0;
  int worldSize = 1;
  // The address this rank listens on and publishes for its peers.
  std::string host = "127.0.0.1";
  // Non-empty: every connection speaks TLS keyed by this cluster token (troupe/runtime/tls.h),
  // as in a cluster started with --tls. Every rank must agree.
  std::string tlsToken;
  // How long connect waits for every rank to publish and connect.
  std::chrono::milliseconds rendezvousTimeout{60'000};
  // An operation not finished within this time fails (kDeadlineExceeded) and breaks the
  // communicator. Dead peers and epoch advances are detected without waiting for it.
  std::chrono::milliseconds operationTimeout{300'000};
  // Tuning of the CPU backend: messages up to smallMessageBytes use the latency algorithms (one
  // hop: every rank sends to every rank); larger ones the pipelined ring, in chunks of
  // chunkBytes. Both size buffers allocated once per communicator.
  size_t smallMessageBytes = 64 * 1024;
  size_t chunkBytes = 256 * 1024;
  // CPU backend: ranks on one host (same kernel boot and network namespace) move their data
  // through shared memory instead of TCP; ranks on other hosts keep TCP. Results are the same
  // bit for bit either way. false here, or TROUPE_COLLECTIVES_SHM=0 in the environment, on any
  // rank of a host makes that host's ranks use TCP.
  bool sharedMemory = true;
};

// Joins (group, epoch) with the CPU backend (TCP over Asio, shared memory between the ranks of
// one host): advances the group's epoch to `epoch` in the store (joining an epoch ends every
// earlier one), publishes this rank's address, waits for every rank and connects to each.
// `store` (a ClusterStore is one) is used only during the call; the
// communicator opens its own epoch watch through it. Errors: kInvalidArgument (bad options),
// kAborted (the group is already past `epoch`), kDeadlineExceeded (ranks missing after
// rendezvousTimeout, named), kUnavailable (the store or a peer cannot be reached).
Result<std::unique_ptr<Communicator>> connectCpuCommunicator(RendezvousStore& store,
                                                             const CommunicatorOptions& options);

}  // namespace troupe::collectives
