// The NCCL backend: always checks that the build reports it truthfully; the GPU cases skip,
// saying so, on machines without a CUDA device.
#include <doctest/doctest.h>

#include <cstdio>
#include <future>
#include <vector>

#include "troupe/collectives/nccl_communicator.h"

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
  auto state = makeFakeClusterState();
  auto store = makeFakeClusterStore(state);
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
  auto state = makeFakeClusterState();
  auto store = makeFakeClusterStore(state);
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

}  // namespace
}  // namespace troupe::collectives
