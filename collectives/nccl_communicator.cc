// The NCCL backend. Compiled only when CUDA + NCCL are found (collectives/meson.build).
//
// The communicator is created non-blocking (config.blocking = 0), so every NCCL call returns at
// once and ncclCommAbort can end it from any thread: waits poll the stream's event, the
// communicator's async error and the abort flag, so an epoch advance (seen by the watcher
// thread) or a timeout ends a wait within milliseconds. After that the communicator is unusable.
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "rendezvous.h"
#include "troupe/collectives/nccl_communicator.h"
#include "troupe/runtime/clock.h"
#include "troupe/runtime/logging.h"

namespace troupe::collectives {

bool ncclBackendBuilt() { return true; }

int cudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

namespace {

constexpr auto kPollInterval = std::chrono::microseconds(50);

Result<ncclDataType_t> ncclType(DataType type) {
  switch (type) {
    case DataType::kFloat32: return ncclFloat32;
    case DataType::kFloat64: return ncclFloat64;
    case DataType::kBFloat16: return ncclBfloat16;
    case DataType::kFloat16: return ncclFloat16;
    case DataType::kInt32: return ncclInt32;
    case DataType::kInt64: return ncclInt64;
  }
  return Status(StatusCode::kInvalidArgument, "unknown data type");
}

ncclRedOp_t ncclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
  }
  return ncclSum;
}

Status cudaError(std::string_view what, cudaError_t error) {
  return Status(StatusCode::kInternal,
                fmt::format("{} failed: {} ({})", what, cudaGetErrorString(error),
                            cudaGetErrorName(error)));
}

Status ncclError(std::string_view what, ncclResult_t result, ncclComm_t comm) {
  const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  return Status(StatusCode::kInternal, fmt::format("{} failed: {}{}", what,
                                                   ncclGetErrorString(result),
                                                   last && *last ? fmt::format(" ({})", last) : ""));
}

class NcclCommunicator;

class NcclWork final : public Work {
 public:
  NcclWork(NcclCommunicator* owner, cudaEvent_t event, Status early)
      : owner_(owner), event_(event), status_(std::move(early)), done_(!status_.isOk() || !event) {}
  ~NcclWork() override {
    if (event_) cudaEventDestroy(event_);
  }
  Status wait() override;
  bool done() const override { return done_.load(); }

 private:
  NcclCommunicator* owner_;
  cudaEvent_t event_;
  std::mutex mutex_;
  Status status_;
  std::atomic<bool> done_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const CommunicatorOptions& options, int device, ncclComm_t comm,
                   cudaStream_t stream, std::unique_ptr<GroupEpochWatch> watch)
      : options_(options), device_(device), comm_(comm), stream_(stream), watch_(std::move(watch)) {
    watcher_ = std::thread([this] { watchEpoch(); });
  }

  ~NcclCommunicator() override {
    stopping_.store(true);
    watch_->interrupt();
    watcher_.join();
    cudaSetDevice(device_);
    if (health().isOk()) {
      cudaStreamSynchronize(stream_);
      // Non-blocking: the finalize goes on after the call returns; destroy once it is done.
      ncclResult_t state = ncclCommFinalize(comm_);
      const auto deadline = Clock::now() + std::chrono::seconds(10);
      while (state == ncclInProgress && Clock::now() < deadline) {
        std::this_thread::sleep_for(kPollInterval);
        ncclCommGetAsyncError(comm_, &state);
      }
      if (state == ncclSuccess) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    } else if (!aborted_) {
      ncclCommAbort(comm_);
    }  // an aborted communicator is already freed: a second abort crashed (seen on an H100)
    if (barrier_ != nullptr) cudaFree(barrier_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return options_.rank; }
  int worldSize() const override { return options_.worldSize; }
  const std::string& group() const override { return options_.group; }
  int64_t epoch() const override { return options_.epoch; }
  Status health() const override {
    std::lock_guard lock(mutex_);
    return health_;
  }

  std::shared_ptr<Work> allreduceAsync(const void* send, void* recv, size_t count, DataType type,
                                       ReduceOp op) override {
    return enqueue("allreduce", type, [&](ncclDataType_t t) {
      return ncclAllReduce(send, recv, count, t, ncclOp(op), comm_, stream_);
    });
  }
  std::shared_ptr<Work> reduceScatterAsync(const void* send, void* recv, size_t count,
                                           DataType type, ReduceOp op) override {
    // NCCL's reduce-scatter needs equal shards; unequal ones go as one reduce per shard.
    const int n = options_.worldSize;
    const size_t elem = dataTypeSize(type);
    return enqueue("reduce_scatter", type, [&](ncclDataType_t t) {
      if (count % static_cast<size_t>(n) == 0) {
        return ncclReduceScatter(send, recv, count / n, t, ncclOp(op), comm_, stream_);
      }
      ncclGroupStart();
      for (int r = 0; r < n; ++r) {
        const Shard shard = shardOf(count, n, r);
        ncclReduce(static_cast<const char*>(send) + shard.begin * elem, recv, shard.size(), t,
                   ncclOp(op), r, comm_, stream_);
      }
      return ncclGroupEnd();
    });
  }
  std::shared_ptr<Work> allgatherAsync(const void* send, void* recv, size_t count,
                                       DataType type) override {
    const int n = options_.worldSize;
    const size_t elem = dataTypeSize(type);
    return enqueue("allgather", type, [&](ncclDataType_t t) {
      if (count % static_cast<size_t>(n) == 0) {
        return ncclAllGather(send, recv, count / n, t, comm_, stream_);
      }
      ncclGroupStart();
      for (int r = 0; r < n; ++r) {
        const Shard shard = shardOf(count, n, r);
        ncclBroadcast(send, static_cast<char*>(recv) + shard.begin * elem, shard.size(), t, r,
                      comm_, stream_);
      }
      return ncclGroupEnd();
    });
  }
  std::shared_ptr<Work> broadcastAsync(void* buffer, size_t count, DataType type,
                                       int root) override {
    return enqueue("broadcast", type, [&](ncclDataType_t t) {
      return ncclBroadcast(buffer, buffer, count, t, root, comm_, stream_);
    });
  }
  std::shared_ptr<Work> barrierAsync() override {
    // An all-reduce of one element on a buffer owned by the communicator.
    return enqueue("barrier", DataType::kFloat32, [&](ncclDataType_t t) {
      return ncclAllReduce(barrierBuffer(), barrierBuffer(), 1, t, ncclSum, comm_, stream_);
    });
  }
  std::shared_ptr<Work> sendAsync(const void* buffer, size_t count, DataType type,
                                  int peer) override {
    return enqueue("send", type, [&](ncclDataType_t t) {
      return ncclSend(buffer, count, t, peer, comm_, stream_);
    });
  }
  std::shared_ptr<Work> recvAsync(void* buffer, size_t count, DataType type, int peer) override {
    return enqueue("recv", type, [&](ncclDataType_t t) {
      return ncclRecv(buffer, count, t, peer, comm_, stream_);
    });
  }

  // Polls until `event` completed, the communicator failed, or the timeout passed.
  Status waitFor(cudaEvent_t event) {
    const auto deadline = Clock::now() + options_.operationTimeout;
    cudaSetDevice(device_);
    for (;;) {
      if (Status status = health(); !status.isOk()) return status;
      cudaError_t query = cudaEventQuery(event);
      if (query == cudaSuccess) return Status::ok();
      if (query != cudaErrorNotReady) return breakWith(cudaError("cudaEventQuery", query));
      ncclResult_t async = ncclSuccess;
      {
        std::lock_guard lock(mutex_);  // the communicator lives until an abort, under this lock
        if (aborted_) continue;        // health() says why on the next round
        ncclCommGetAsyncError(comm_, &async);
      }
      if (async != ncclSuccess && async != ncclInProgress) {
        return breakWith(ncclError("an NCCL operation", async, comm_));
      }
      if (Clock::now() >= deadline) {
        return breakWith(Status(StatusCode::kDeadlineExceeded,
                                fmt::format("an NCCL operation did not finish within {} ms",
                                            options_.operationTimeout.count())));
      }
      std::this_thread::sleep_for(kPollInterval);  // polling the GPU's progress
    }
  }

 private:
  // NCCL calls are made under mutex_, so an abort from the epoch watcher (which frees the
  // communicator) never runs in the middle of one.
  template <typename Call>
  std::shared_ptr<Work> enqueue(std::string_view what, DataType type, Call call) {
    auto t = ncclType(type);
    if (!t) return std::make_shared<NcclWork>(this, nullptr, t.status());
    Status failed;
    {
      std::lock_guard lock(mutex_);
      if (!health_.isOk()) return std::make_shared<NcclWork>(this, nullptr, health_);
      cudaSetDevice(device_);
      ncclResult_t result = call(*t);
      if (result != ncclSuccess && result != ncclInProgress) failed = ncclError(what, result, comm_);
    }
    if (!failed.isOk()) return std::make_shared<NcclWork>(this, nullptr, breakWith(failed));
    cudaEvent_t event = nullptr;
    cudaError_t error = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    if (error == cudaSuccess) error = cudaEventRecord(event, stream_);
    if (error != cudaSuccess) {
      if (event) cudaEventDestroy(event);
      return std::make_shared<NcclWork>(this, nullptr, breakWith(cudaError("cudaEventRecord", error)));
    }
    return std::make_shared<NcclWork>(this, event, Status::ok());
  }

  void* barrierBuffer() {  // under mutex_ (called from enqueue's call)
    if (barrier_ == nullptr) cudaMalloc(&barrier_, sizeof(float));
    return barrier_;
  }

  Status breakWith(Status status) {
    std::lock_guard lock(mutex_);
    if (!health_.isOk()) return health_;
    health_ = Status(status.code(), fmt::format("rank {}: {}; {}", options_.rank,
                                                status.message(), recreateAdvice(options_)));
    ncclCommAbort(comm_);  // ends every pending operation on the stream, and frees the communicator
    aborted_ = true;
    return health_;
  }

  void watchEpoch() {
    while (!stopping_.load()) {
      auto next = watch_->next(std::chrono::seconds(3600));
      if (!next.isOk()) {
        TROUPE_LOG(kWarning, "group '{}' epoch {}: {}", options_.group, options_.epoch,
                   next.status().message());
        return;
      }
      if (next->has_value() && **next > options_.epoch) {
        (void)breakWith(Status(StatusCode::kAborted, fmt::format("group '{}' advanced to epoch {}",
                                                                 options_.group, **next)));
        return;
      }
    }
  }

  const CommunicatorOptions options_;
  const int device_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  void* barrier_ = nullptr;
  mutable std::mutex mutex_;
  Status health_;
  bool aborted_ = false;  // comm_ is gone (ncclCommAbort frees it)
  std::unique_ptr<GroupEpochWatch> watch_;
  std::atomic<bool> stopping_{false};
  std::thread watcher_;
};

Status NcclWork::wait() {
  std::lock_guard lock(mutex_);
  if (!done_.load()) {
    status_ = owner_->waitFor(event_);
    done_.store(true);
  }
  return status_;
}

}  // namespace

Result<std::unique_ptr<Communicator>> connectNcclCommunicator(RendezvousStore& store,
                                                              const CommunicatorOptions& options,
                                                              const NcclOptions& nccl) {
  const int devices = cudaDeviceCount();
  if (nccl.device < 0 || nccl.device >= devices) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("group '{}' rank {}: CUDA device {} does not exist (this process "
                              "sees {} device(s))",
                              options.group, options.rank, nccl.device, devices));
  }
  if (cudaError_t error = cudaSetDevice(nccl.device); error != cudaSuccess) {
    return cudaError("cudaSetDevice", error);
  }
  std::string id;
  if (options.rank == 0) {
    ncclUniqueId unique;
    if (ncclResult_t result = ncclGetUniqueId(&unique); result != ncclSuccess) {
      return ncclError("ncclGetUniqueId", result, nullptr);
    }
    id.assign(unique.internal, sizeof(unique.internal));
  }
  std::vector<std::string> extras;
  auto met = rendezvous(store, options, /*connectMesh=*/false, id, &extras);
  if (!met) return met.status();
  ncclUniqueId unique;
  if (extras.empty() || extras[0].size() != sizeof(unique.internal)) {
    return Status(StatusCode::kInternal,
                  fmt::format("group '{}' epoch {}: rank 0 published no NCCL unique id",
                              options.group, options.epoch));
  }
  std::memcpy(unique.internal, extras[0].data(), sizeof(unique.internal));

  cudaStream_t stream = nullptr;
  if (cudaError_t error = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      error != cudaSuccess) {
    return cudaError("cudaStreamCreateWithFlags", error);
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t result =
      ncclCommInitRankConfig(&comm, options.worldSize, unique, options.rank, &config);
  const auto deadline = Clock::now() + options.rendezvousTimeout;
  while (result == ncclInProgress && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));  // polling NCCL's init
    ncclCommGetAsyncError(comm, &result);
  }
  if (result != ncclSuccess) {
    Status status = result == ncclInProgress
                        ? Status(StatusCode::kDeadlineExceeded,
                                 fmt::format("NCCL init of group '{}' epoch {} did not finish "
                                             "within {} ms",
                                             options.group, options.epoch,
                                             options.rendezvousTimeout.count()))
                        : ncclError("ncclCommInitRankConfig", result, comm);
    if (comm) ncclCommAbort(comm);
    cudaStreamDestroy(stream);
    return status;
  }
  return std::unique_ptr<Communicator>(std::make_unique<NcclCommunicator>(
      options, nccl.device, comm, stream, std::move(met->watch)));
}

}  // namespace troupe::collectives
