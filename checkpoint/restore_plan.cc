#include "troupe/checkpoint/restore_plan.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

namespace troupe::checkpoint {

const char* sourceTierName(SourceTier tier) {
  switch (tier) {
    case SourceTier::kLocalMemory: return "memory";
    case SourceTier::kLocalReplica: return "local replica";
    case SourceTier::kPeerMemory: return "peer memory";
    case SourceTier::kPeerReplica: return "peer replica";
    case SourceTier::kDisk: return "disk";
  }
  return "?";
}

std::vector<RestoreCandidate> planRestore(std::span<const Holding> holdings, uint32_t rank, uint64_t maxStep) {
  // (step, world size) -> ranks held, and the restoring rank's sources.
  std::map<std::pair<uint64_t, uint32_t>, std::set<uint32_t>> ranksHeld;
  std::map<std::pair<uint64_t, uint32_t>, std::vector<Holding>> mine;
  for (const auto& h : holdings) {
    if (h.step > maxStep || h.worldSize == 0 || h.rank >= h.worldSize) continue;
    auto key = std::make_pair(h.step, h.worldSize);
    ranksHeld[key].insert(h.rank);
    if (h.rank == rank) mine[key].push_back(h);
  }
  std::vector<RestoreCandidate> out;
  for (auto it = ranksHeld.rbegin(); it != ranksHeld.rend(); ++it) {
    const auto& [key, ranks] = *it;
    if (ranks.size() != key.second || rank >= key.second) continue;
    RestoreCandidate c{key.first, key.second, mine[key]};
    std::sort(c.sources.begin(), c.sources.end(), [](const Holding& a, const Holding& b) {
      return std::tie(a.tier, a.holder) < std::tie(b.tier, b.holder);
    });
    c.sources.erase(std::unique(c.sources.begin(), c.sources.end()), c.sources.end());
    out.push_back(std::move(c));
  }
  // Equal steps with different world sizes: the larger world first (deterministic).
  std::stable_sort(out.begin(), out.end(), [](const RestoreCandidate& a, const RestoreCandidate& b) {
    return a.step > b.step;
  });
  return out;
}

}  // namespace troupe::checkpoint
