// The NCCL backend: always checks that the build reports it truthfully; the GPU cases skip,
// saying so, on machines without a CUDA device.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <future>
#include <vector>

#if __has_include(<cuda_runtime.h>)
#include <cuda_runtime.h>
#define TROUPE_TEST_CUDA 1
#endif

#include "troupe/collectives/nccl_communicator.h"
#include "troupe/runtime/cluster_store.h"
#include "troupe/testing/redis_server.h"

namespace troupe::collectives {
namespace {

bool haveGpu() {
  if (!ncclBackendBuilt() || cudaDeviceCount() == 0) {
    std::printf("SKIPPED: no CUDA device (NCCL backend %s in this build)\n",
                ncclBackendBuilt() ? "built" : "not built");
    return false;
  }
  return true;
}

TEST_CASE("connectNcclCommunicator fails cleanly when it cannot run") {
  auto cluster = testing::newTestCluster();
  auto store = testing::openTestStore(cluster);
  CommunicatorOptions options;
  options.group = "nccl";
  options.epoch = 1;
  NcclOptions nccl;
  nccl.device = cudaDeviceCount();  // one past the last device: never exists
  auto comm = connectNcclCommunicator(*store, options, nccl);
  REQUIRE_FALSE(comm.isOk());
  CHECK(comm.status().code() == StatusCode::kFailedPrecondition);
}

TEST_CASE("NCCL all-reduce on one GPU (skips without a GPU)" * doctest::skip(!haveGpu())) {
  auto cluster = testing::newTestCluster();
  auto store = testing::openTestStore(cluster);
  CommunicatorOptions options;
  options.group = "nccl-gpu";
  options.epoch = 1;
  auto comm = connectNcclCommunicator(*store, options, NcclOptions{});
  REQUIRE_MESSAGE(comm.isOk(), comm.status().toString());
  CHECK((*comm)->barrier().isOk());
  REQUIRE(store->advanceGroupEpoch("nccl-gpu", 2).isOk());
  // The advance aborts the communicator: the next operation fails instead of running.
  Status after = Status::ok();
  for (int i = 0; i < 2000 && after.isOk(); ++i) after = (*comm)->barrier();
  CHECK(after.code() == StatusCode::kAborted);
}

#ifdef TROUPE_TEST_CUDA
// One GPU is one rank (NCCL refuses two ranks on a device): every operation must still move
// device data through NCCL and give the one-rank result; and the all-reduce's time is printed.
TEST_CASE("NCCL operations on device buffers give the one-rank results (skips without a GPU)" *
          doctest::skip(!haveGpu())) {
  auto cluster = testing::newTestCluster();
  auto store = testing::openTestStore(cluster);
  CommunicatorOptions options;
  options.group = "nccl-data";
  options.epoch = 1;
  auto comm = connectNcclCommunicator(*store, options, NcclOptions{});
  REQUIRE_MESSAGE(comm.isOk(), comm.status().toString());
  const size_t count = size_t{16} << 20;  // 64 MB of float32
  std::vector<float> host(count);
  for (size_t i = 0; i < count; ++i) host[i] = static_cast<float>(i % 1000) * 0.5f;
  float* in = nullptr;
  float* out = nullptr;
  REQUIRE(cudaMalloc(&in, count * 4) == cudaSuccess);
  REQUIRE(cudaMalloc(&out, count * 4) == cudaSuccess);
  REQUIRE(cudaMemcpy(in, host.data(), count * 4, cudaMemcpyHostToDevice) == cudaSuccess);
  auto expectEqualToInput = [&](const char* what) {
    std::vector<float> back(count, -1.0f);
    REQUIRE(cudaMemcpy(back.data(), out, count * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
    CAPTURE(what);
    CHECK(back == host);
  };
  Communicator& c = **comm;
  REQUIRE(cudaMemset(out, 0, count * 4) == cudaSuccess);
  REQUIRE(c.allreduce(in, out, count, DataType::kFloat32, ReduceOp::kSum).isOk());
  expectEqualToInput("allreduce sum");
  REQUIRE(cudaMemset(out, 0, count * 4) == cudaSuccess);
  REQUIRE(c.allreduce(in, out, count, DataType::kFloat32, ReduceOp::kAvg).isOk());
  expectEqualToInput("allreduce avg");
  REQUIRE(cudaMemset(out, 0, count * 4) == cudaSuccess);
  REQUIRE(c.reduceScatter(in, out, count, DataType::kFloat32, ReduceOp::kSum).isOk());
  expectEqualToInput("reduce-scatter");
  REQUIRE(cudaMemset(out, 0, count * 4) == cudaSuccess);
  REQUIRE(c.allgather(in, out, count, DataType::kFloat32).isOk());
  expectEqualToInput("allgather");
  REQUIRE(cudaMemcpy(out, in, count * 4, cudaMemcpyDeviceToDevice) == cudaSuccess);
  REQUIRE(c.broadcast(out, count, DataType::kFloat32, 0).isOk());
  expectEqualToInput("broadcast");
  // 20 all-reduces of 64 MB, pipelined on the stream, then waited.
  const int rounds = 20;
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::shared_ptr<Work>> works;
  for (int i = 0; i < rounds; ++i) works.push_back(c.allreduceAsync(in, out, count, DataType::kFloat32, ReduceOp::kSum));
  for (auto& w : works) REQUIRE(w->wait().isOk());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("NCCL all-reduce of 64 MB on one GPU: %.3f ms each (%.1f GB/s of buffer)\n", seconds / rounds * 1e3,
              static_cast<double>(count * 4) * rounds / seconds / 1e9);
  cudaFree(in);
  cudaFree(out);
}
#endif

}  // namespace
}  // namespace troupe::collectives
