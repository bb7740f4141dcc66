// The header-only LibTorch adapter: two in-process ranks on the fake store. Built only when
// LibTorch is found.
#include <doctest/doctest.h>

#include <future>

#include "troupe/collectives/torch_adapter.h"
#include "troupe/runtime/cluster_store.h"
#include "troupe/testing/redis_server.h"

namespace troupe::collectives {
namespace {

TEST_CASE("tensors: allreduce, broadcast, reduce-scatter and all-gather through the adapter") {
  auto cluster = testing::newTestCluster();
  auto run = [cluster](int rank) -> std::string {
    auto store = testing::openTestStore(cluster);
    CommunicatorOptions options;
    options.group = "torch";
    options.epoch = 1;
    options.rank = rank;
    options.worldSize = 2;
    auto comm = connectCpuCommunicator(*store, options);
    if (!comm) return comm.status().toString();
    at::Tensor t = at::full({3, 5}, static_cast<double>(rank + 1), at::kBFloat16);
    if (Status s = allreduce(**comm, t, ReduceOp::kSum); !s.isOk()) return s.toString();
    if (!at::equal(t, at::full({3, 5}, 3.0, at::kBFloat16))) return "allreduce result";
    at::Tensor b = at::arange(7, at::kLong) * (rank == 1 ? 1 : 0);
    if (Status s = broadcast(**comm, b, 1); !s.isOk()) return s.toString();
    if (!at::equal(b, at::arange(7, at::kLong))) return "broadcast result";
    at::Tensor whole = at::ones({7}, at::kFloat);
    at::Tensor shard = at::empty({rank == 0 ? 4 : 3}, at::kFloat);
    if (Status s = reduceScatter(**comm, whole, shard); !s.isOk()) return s.toString();
    if (!at::equal(shard, at::full({rank == 0 ? 4 : 3}, 2.0f))) return "reduceScatter result";
    at::Tensor gathered = at::zeros({7}, at::kFloat);
    if (Status s = allgather(**comm, shard, gathered); !s.isOk()) return s.toString();
    if (!at::equal(gathered, at::full({7}, 2.0f))) return "allgather result";
    at::Tensor bad = at::ones({2}, at::kBool);
    if (allreduce(**comm, bad).code() != StatusCode::kInvalidArgument) return "bool accepted";
    return "";
  };
  auto r0 = std::async(std::launch::async, run, 0);
  auto r1 = std::async(std::launch::async, run, 1);
  CHECK(r0.get() == "");
  CHECK(r1.get() == "");
}

}  // namespace
}  // namespace troupe::collectives
