#include "troupe/checkpoint/restore_plan.h"

#include <doctest/doctest.h>

namespace troupe::checkpoint {
namespace {

Holding held(uint32_t rank, uint64_t step, SourceTier tier, std::string holder = {}, uint32_t world = 2) {
  return Holding{rank, step, world, tier, std::move(holder)};
}

TEST_CASE("restore plan: the newest step held by every rank, sources best first") {
  std::vector<Holding> holdings = {
      held(0, 30, SourceTier::kLocalMemory),                   // rank 1 has no step 30: not a candidate
      held(0, 20, SourceTier::kDisk),
      held(0, 20, SourceTier::kPeerReplica, "ckpt-b"),
      held(0, 20, SourceTier::kLocalMemory),
      held(1, 20, SourceTier::kPeerMemory, "ckpt-b"),
      held(0, 10, SourceTier::kDisk),
      held(1, 10, SourceTier::kDisk),
  };
  auto plan = planRestore(holdings, 0);
  REQUIRE(plan.size() == 2);
  CHECK(plan[0].step == 20);
  REQUIRE(plan[0].sources.size() == 3);
  CHECK(plan[0].sources[0].tier == SourceTier::kLocalMemory);
  CHECK(plan[0].sources[1].tier == SourceTier::kPeerReplica);
  CHECK(plan[0].sources[2].tier == SourceTier::kDisk);
  CHECK(plan[1].step == 10);

  // Rank 1 restores step 20 from the other node's memory.
  auto other = planRestore(holdings, 1);
  REQUIRE(!other.empty());
  CHECK(other[0].step == 20);
  CHECK(other[0].sources[0].holder == "ckpt-b");

  // maxStep caps the choice (ranks that restored different steps agree on the older one).
  auto capped = planRestore(holdings, 0, 19);
  REQUIRE(capped.size() == 1);
  CHECK(capped[0].step == 10);
}

TEST_CASE("restore plan: nothing complete, ranks outside the world, duplicates") {
  CHECK(planRestore(std::vector<Holding>{held(0, 5, SourceTier::kDisk)}, 0).empty());
  std::vector<Holding> single = {held(0, 5, SourceTier::kDisk, "", 1), held(0, 5, SourceTier::kDisk, "", 1)};
  auto plan = planRestore(single, 0);
  REQUIRE(plan.size() == 1);
  CHECK(plan[0].sources.size() == 1);
  CHECK(planRestore(single, 1).empty());  // rank 1 is not part of a one-rank world
}

}  // namespace
}  // namespace troupe::checkpoint
