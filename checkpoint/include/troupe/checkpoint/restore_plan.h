// Choosing what to restore: the newest step that every rank of that step's world holds in some
// tier, and for the restoring rank the places that hold it, best first: this node's memory, a
// replica kept on this node, the memory of another node (the rank's old node), a replica kept by
// another node, then disk.
// Thread-safety: pure functions over values.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace troupe::checkpoint {

enum class SourceTier { kLocalMemory = 0, kLocalReplica = 1, kPeerMemory = 2, kPeerReplica = 3, kDisk = 4 };
// "memory", "local replica", "peer memory", "peer replica", "disk"
const char* sourceTierName(SourceTier tier);

// One place that holds one rank's snapshot of one step.
struct Holding {
  uint32_t rank = 0;
  uint64_t step = 0;
  uint32_t worldSize = 1;
  SourceTier tier = SourceTier::kDisk;
  std::string holder;       // the checkpoint actor holding it (memory and replica tiers)
  uint64_t imageBytes = 0;  // the size of its image, when known
  bool operator==(const Holding&) const = default;
};

struct RestoreCandidate {
  uint64_t step = 0;
  uint32_t worldSize = 1;
  std::vector<Holding> sources;  // the restoring rank's holdings of this step, best first
};

// The candidates for `rank`, newest step first, keeping only steps (at most `maxStep`) that
// every rank of the step's world holds somewhere and of which `rank` is a member.
std::vector<RestoreCandidate> planRestore(std::span<const Holding> holdings, uint32_t rank,
                                          uint64_t maxStep = UINT64_MAX);

}  // namespace troupe::checkpoint
