#include "troupe/scheduler/placement.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

namespace troupe::scheduler {
namespace {

constexpr std::string_view kCpu = "CPU";
// Sums of fractional CPUs carry rounding (0.1 + 0.2 > 0.3), so small quantities get an
// absolute slack; large ones (memory in bytes, exact below 2^53) get a relative slack small
// enough that a single byte still counts up to a terabyte.
constexpr double kAbsoluteEpsilon = 1e-9;
constexpr double kRelativeEpsilon = 1e-12;
// Candidate nodes tried by the backtracking search before it gives up. A greedy pass over
// tens of bundles and tens of nodes costs under a hundred tries; this leaves room for real
// backtracking while bounding a hopeless search (60 bundles, 30 distinct nodes) to ~25 ms
// per pass at -O2. Giving up reports "pending", since it proves nothing.
constexpr int kSearchBudget = 20000;
// Messages list at most this many bundles or nodes, so a large cluster cannot bloat them.
constexpr size_t kMaxListed = 8;

double quantityOf(const Resources& resources, std::string_view name) {
  auto it = resources.find(std::string(name));
  return it == resources.end() ? 0.0 : it->second;
}

double freeCpu(const Resources& free) { return quantityOf(free, kCpu); }

bool fitsOne(double demand, double available) {
  return demand <= available + std::max(kAbsoluteEpsilon, kRelativeEpsilon * std::fabs(demand));
}

// Memory is in bytes, which nobody reads well past a few digits.
std::string formatQuantity(std::string_view name, double qty) {
  constexpr double kGiB = 1024.0 * 1024 * 1024;
  if (name == "memory" && std::fabs(qty) >= kGiB / 1024) {
    std::string text = fmt::format("{:.3f}", qty / kGiB);
    while (text.back() == '0') text.pop_back();
    if (text.back() == '.') text.pop_back();
    return text + " GiB";
  }
  return fmt::format("{}", qty);
}

std::string formatResource(std::string_view name, double qty) {
  return fmt::format("{} {}", name, formatQuantity(name, qty));
}

std::string formatResources(const Resources& resources) {
  if (resources.empty()) return "nothing";
  std::string out;
  for (const auto& [name, qty] : resources) {
    if (!out.empty()) out += ", ";
    out += formatResource(name, qty);
  }
  return out;
}

template <typename T, typename Format>
std::string formatList(const std::vector<T>& items, Format format) {
  std::string out;
  for (size_t i = 0; i < items.size() && i < kMaxListed; ++i) {
    if (i > 0) out += ", ";
    out += format(items[i]);
  }
  if (items.size() > kMaxListed) out += fmt::format(" and {} more", items.size() - kMaxListed);
  return out;
}

Status validateDemand(const Resources& demand, std::string_view label) {
  for (const auto& [name, qty] : demand) {
    if (!std::isfinite(qty) || qty < 0) {
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("{} asks for {} {}; quantities must be finite and >= 0", label,
                                name, qty));
    }
  }
  return Status::ok();
}

// Whether a search sees what is free now or what each node has in total (every node empty).
// Running the same search both ways is what tells "pending" from "infeasible".
enum class Capacity { kFree, kTotal };

// One alive node as a search sees it.
struct Slot {
  NodeId id;
  Resources free;        // what this search may still hand out on the node
  int groupBundles = 0;  // bundles of the group on it: existing ones plus those placed so far
};

// The explanation of the first place a search got stuck, ready to follow "pending: " or
// "infeasible: ".
struct Blocked {
  std::string reason;
  bool searchLimitHit = false;
};

struct Outcome {
  std::optional<std::vector<NodeId>> nodes;  // one per bundle, in bundle order
  Blocked blocked;                           // meaningful when nodes is empty
};

// Says why `demand` fits none of `candidates`, naming the first short resource and the best
// quantity on offer. `where` names the candidate set ("alive node", ...); `label` is the
// subject ("bundle 2"), and `plural` picks the verb to match it.
std::string describeShortfall(const std::string& label, const Resources& demand,
                              const std::vector<const Slot*>& candidates, Capacity capacity,
                              std::string_view where, bool plural = false) {
  std::string_view needs = plural ? "need" : "needs";
  if (candidates.empty()) return fmt::format("{} {} {} but there is no {}", label, needs,
                                             formatResources(demand), where);
  for (const auto& [name, qty] : demand) {
    double best = -std::numeric_limits<double>::infinity();
    for (const Slot* slot : candidates) best = std::max(best, quantityOf(slot->free, name));
    if (fitsOne(qty, best)) continue;
    if (capacity == Capacity::kTotal) {
      return fmt::format("{} {} {} but the largest {} has {}", label, needs,
                         formatResource(name, qty), where, formatResource(name, best));
    }
    return fmt::format("{} {} {} but the {} with the most free {} has {} free", label, needs,
                       formatResource(name, qty), where, name, formatQuantity(name, best));
  }
  // Every resource is on offer somewhere, just not together: show the node that lacks the
  // fewest of them (ties: the first candidate, which callers order by id).
  const Slot* closest = nullptr;
  size_t closestMissing = std::numeric_limits<size_t>::max();
  for (const Slot* slot : candidates) {
    size_t missing = 0;
    for (const auto& [name, qty] : demand) {
      if (!fitsOne(qty, quantityOf(slot->free, name))) ++missing;
    }
    if (missing < closestMissing) {
      closest = slot;
      closestMissing = missing;
    }
  }
  Resources offered;
  for (const auto& [name, qty] : demand) offered[name] = quantityOf(closest->free, name);
  return fmt::format("{} {} {} but no single {} has all of it{} (closest: node {} has {})",
                     label, needs, formatResources(demand), where,
                     capacity == Capacity::kFree ? " free" : "", closest->id.hex(),
                     formatResources(offered));
}

std::vector<const Slot*> pointersTo(const std::vector<Slot>& slots) {
  std::vector<const Slot*> out;
  out.reserve(slots.size());
  for (const Slot& slot : slots) out.push_back(&slot);
  return out;
}

std::string bundleLabel(size_t index) { return fmt::format("bundle {}", index); }

// Largest first, by dominant share (the bundle's biggest fraction of the largest node's total
// of any resource), so the hardest bundles choose first whatever units their resources use.
std::vector<size_t> largestFirst(const std::vector<Resources>& bundles, const Resources& scale) {
  std::vector<double> share(bundles.size(), 0.0);
  for (size_t i = 0; i < bundles.size(); ++i) {
    for (const auto& [name, qty] : bundles[i]) {
      if (qty <= 0) continue;
      double largest = quantityOf(scale, name);
      share[i] = std::max(share[i], largest > 0 ? qty / largest
                                                : std::numeric_limits<double>::infinity());
    }
  }
  std::vector<size_t> order(bundles.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&share](size_t a, size_t b) { return share[a] > share[b]; });
  return order;
}

// Depth-first search over bundles (largest first) and nodes (in the strategy's preference
// order). Its first path is the plain greedy placement; it only backtracks when that fails,
// within kSearchBudget tries. Used for PACK and SPREAD, which allow several bundles per node.
class BundleSearch {
 public:
  BundleSearch(std::vector<Slot> slots, const std::vector<Resources>& bundles,
               const std::vector<size_t>& order, PlacementStrategy strategy, Capacity capacity)
      : slots_(std::move(slots)),
        bundles_(bundles),
        order_(order),
        strategy_(strategy),
        capacity_(capacity),
        assignment_(bundles.size(), 0) {}

  Outcome run() {
    Outcome outcome;
    if (place(0)) {
      std::vector<NodeId> nodes;
      nodes.reserve(assignment_.size());
      for (size_t slot : assignment_) nodes.push_back(slots_[slot].id);
      outcome.nodes = std::move(nodes);
      return outcome;
    }
    outcome.blocked = blocked_;
    outcome.blocked.searchLimitHit = budget_ <= 0;
    return outcome;
  }

 private:
  // True when `a` should be tried before `b` for the next bundle.
  bool prefer(const Slot& a, const Slot& b) const {
    if (strategy_ == PlacementStrategy::kPack) {
      bool aUsed = a.groupBundles > 0;
      bool bUsed = b.groupBundles > 0;
      if (aUsed != bUsed) return aUsed;
    } else if (a.groupBundles != b.groupBundles) {
      return a.groupBundles < b.groupBundles;
    }
    if (freeCpu(a.free) != freeCpu(b.free)) return freeCpu(a.free) > freeCpu(b.free);
    return a.id < b.id;
  }

  std::vector<size_t> candidatesFor(const Resources& demand) const {
    std::vector<size_t> fitting;
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (fits(slots_[i].free, demand)) fitting.push_back(i);
    }
    std::sort(fitting.begin(), fitting.end(),
              [this](size_t a, size_t b) { return prefer(slots_[a], slots_[b]); });
    // Nodes with the same free resources and the same share of the group are interchangeable
    // for the rest of the search: trying more than one of them only repeats a failure.
    std::vector<size_t> distinct;
    for (size_t candidate : fitting) {
      bool repeat = std::any_of(distinct.begin(), distinct.end(), [&](size_t seen) {
        return slots_[seen].groupBundles == slots_[candidate].groupBundles &&
               slots_[seen].free == slots_[candidate].free;
      });
      if (!repeat) distinct.push_back(candidate);
    }
    return distinct;
  }

  bool place(size_t depth) {
    if (depth == order_.size()) return true;
    size_t bundle = order_[depth];
    const Resources& demand = bundles_[bundle];
    std::vector<size_t> candidates = candidatesFor(demand);
    if (candidates.empty() && blocked_.reason.empty()) recordBlocked(depth);
    for (size_t candidate : candidates) {
      if (budget_-- <= 0) return false;
      Slot& slot = slots_[candidate];
      Resources before = slot.free;
      slot.free = subtract(slot.free, demand);
      ++slot.groupBundles;
      assignment_[bundle] = candidate;
      if (place(depth + 1)) return true;
      slot.free = std::move(before);
      --slot.groupBundles;
      if (budget_ <= 0) return false;
    }
    return false;
  }

  // The first dead end is the one the greedy pass hit, which is what a reader expects to be
  // told about (later ones are artefacts of backtracking).
  // Once earlier bundles are placed, what remains is "free" even in a search over totals.
  void recordBlocked(size_t depth) {
    size_t bundle = order_[depth];
    blocked_.reason = describeShortfall(bundleLabel(bundle), bundles_[bundle],
                                        pointersTo(slots_), depth > 0 ? Capacity::kFree : capacity_,
                                        "alive node");
    if (depth > 0) {
      std::vector<size_t> placed(order_.begin(), order_.begin() + static_cast<long>(depth));
      blocked_.reason += fmt::format(
          " after placing bundle{} {} of the group first{}", depth > 1 ? "s" : "",
          formatList(placed, [](size_t i) { return fmt::format("{}", i); }),
          capacity_ == Capacity::kTotal ? ", even on empty nodes" : "");
    }
  }

  std::vector<Slot> slots_;
  const std::vector<Resources>& bundles_;
  const std::vector<size_t>& order_;
  PlacementStrategy strategy_;
  Capacity capacity_;
  std::vector<size_t> assignment_;  // bundle -> index into slots_
  int budget_ = kSearchBudget;
  Blocked blocked_;
};

Resources sumOf(const std::vector<Resources>& bundles) {
  Resources total;
  for (const Resources& bundle : bundles) total = add(total, bundle);
  return total;
}

// PACK: everything on one node if any node has room (one the group already uses first, then
// the freest), else a first-fit-decreasing search that fills the group's nodes before others.
Outcome placePack(const std::vector<Slot>& slots, const std::vector<Resources>& bundles,
                  const std::vector<size_t>& order, Capacity capacity) {
  Resources whole = sumOf(bundles);
  const Slot* best = nullptr;
  for (const Slot& slot : slots) {
    if (!fits(slot.free, whole)) continue;
    if (best == nullptr) {
      best = &slot;
      continue;
    }
    bool used = slot.groupBundles > 0;
    bool bestUsed = best->groupBundles > 0;
    if (used != bestUsed ? used : freeCpu(slot.free) > freeCpu(best->free)) best = &slot;
  }
  if (best != nullptr) {
    Outcome outcome;
    outcome.nodes = std::vector<NodeId>(bundles.size(), best->id);
    return outcome;
  }
  return BundleSearch(slots, bundles, order, PlacementStrategy::kPack, capacity).run();
}

// STRICT_PACK: the sum of the new bundles on the group's node, or on the freest node that
// holds the sum for a new group.
Outcome placeStrictPack(const std::vector<Slot>& slots, const std::vector<Resources>& bundles,
                        Capacity capacity) {
  Resources whole = sumOf(bundles);
  std::vector<const Slot*> eligible;
  for (const Slot& slot : slots) {
    if (slot.groupBundles > 0) eligible = {&slot};
  }
  bool resizing = !eligible.empty();
  if (!resizing) eligible = pointersTo(slots);
  const Slot* best = nullptr;
  for (const Slot* slot : eligible) {
    if (fits(slot->free, whole) && (best == nullptr || freeCpu(slot->free) > freeCpu(best->free))) {
      best = slot;
    }
  }
  Outcome outcome;
  if (best != nullptr) {
    outcome.nodes = std::vector<NodeId>(bundles.size(), best->id);
    return outcome;
  }
  bool plural = bundles.size() > 1;
  std::string label =
      plural ? fmt::format("the {} bundles together", bundles.size()) : bundleLabel(0);
  if (resizing) {
    const Slot& holder = *eligible.front();
    for (const auto& [name, qty] : whole) {
      double offered = quantityOf(holder.free, name);
      if (fitsOne(qty, offered)) continue;
      outcome.blocked.reason = fmt::format(
          "{} {} {} but node {}, which holds the group's other bundles, has {}{}", label,
          plural ? "need" : "needs", formatResource(name, qty), holder.id.hex(),
          formatResource(name, offered), capacity == Capacity::kFree ? " free" : "");
      break;
    }
  } else {
    outcome.blocked.reason =
        describeShortfall(label, whole, eligible, capacity, "alive node", plural);
  }
  outcome.blocked.reason += " (STRICT_PACK keeps every bundle of the group on one node)";
  return outcome;
}

// STRICT_SPREAD: each node holds at most one new bundle and none of the group's existing
// ones, so this is a bipartite matching of bundles to nodes; augmenting paths (Kuhn) find one
// whenever one exists. Bundles go largest first and try nodes freest first, so the result
// is deterministic and close to the greedy choice.
class SpreadMatching {
 public:
  SpreadMatching(const std::vector<Slot>& slots, const std::vector<Resources>& bundles,
                 const std::vector<size_t>& order, Capacity capacity)
      : bundles_(bundles), order_(order), capacity_(capacity) {
    for (const Slot& slot : slots) {
      if (slot.groupBundles == 0) eligible_.push_back(&slot);
    }
    std::stable_sort(eligible_.begin(), eligible_.end(), [](const Slot* a, const Slot* b) {
      if (freeCpu(a->free) != freeCpu(b->free)) return freeCpu(a->free) > freeCpu(b->free);
      return a->id < b->id;
    });
    nodeToBundle_.assign(eligible_.size(), kNone);
  }

  Outcome run() {
    Outcome outcome;
    std::vector<size_t> bundleToNode(bundles_.size(), kNone);
    for (size_t bundle : order_) {
      visitedNodes_.assign(eligible_.size(), false);
      if (augment(bundle, bundleToNode)) continue;
      outcome.blocked.reason = explain(bundle);
      return outcome;
    }
    std::vector<NodeId> nodes;
    for (size_t node : bundleToNode) nodes.push_back(eligible_[node]->id);
    outcome.nodes = std::move(nodes);
    return outcome;
  }

 private:
  static constexpr size_t kNone = std::numeric_limits<size_t>::max();

  bool augment(size_t bundle, std::vector<size_t>& bundleToNode) {
    for (size_t node = 0; node < eligible_.size(); ++node) {
      if (visitedNodes_[node] || !fits(eligible_[node]->free, bundles_[bundle])) continue;
      visitedNodes_[node] = true;
      size_t holder = nodeToBundle_[node];
      if (holder == kNone || augment(holder, bundleToNode)) {
        nodeToBundle_[node] = bundle;
        bundleToNode[bundle] = node;
        return true;
      }
    }
    return false;
  }

  // After a failed augment from `bundle`, the visited nodes are all the nodes any bundle in
  // the blocking set can use, and each holds one of them: one node too few (Hall's condition).
  std::string explain(size_t bundle) const {
    constexpr std::string_view kWhere = "alive node not used by the group";
    bool fitsAnywhere = std::any_of(eligible_.begin(), eligible_.end(), [&](const Slot* slot) {
      return fits(slot->free, bundles_[bundle]);
    });
    if (!fitsAnywhere) {
      return describeShortfall(bundleLabel(bundle), bundles_[bundle], eligible_, capacity_,
                               kWhere) +
             " (STRICT_SPREAD puts each bundle of the group on a different node)";
    }
    std::vector<size_t> blockingBundles = {bundle};
    std::vector<const Slot*> usableNodes;
    for (size_t node = 0; node < eligible_.size(); ++node) {
      if (!visitedNodes_[node]) continue;
      usableNodes.push_back(eligible_[node]);
      blockingBundles.push_back(nodeToBundle_[node]);
    }
    std::sort(blockingBundles.begin(), blockingBundles.end());
    return fmt::format(
        "bundles {} need {} distinct alive nodes not used by the group (STRICT_SPREAD) but only "
        "{} such node{} {} room for any of them{}: {}",
        formatList(blockingBundles,
                   [this](size_t i) {
                     return fmt::format("{} ({})", i, formatResources(bundles_[i]));
                   }),
        blockingBundles.size(), usableNodes.size(), usableNodes.size() == 1 ? "" : "s",
        usableNodes.size() == 1 ? "has" : "have", capacity_ == Capacity::kFree ? " right now" : "",
        formatList(usableNodes, [this](const Slot* slot) {
          return fmt::format("node {} ({}{})", slot->id.hex(), formatResources(slot->free),
                             capacity_ == Capacity::kFree ? " free" : "");
        }));
  }

  const std::vector<Resources>& bundles_;
  const std::vector<size_t>& order_;
  Capacity capacity_;
  std::vector<const Slot*> eligible_;
  std::vector<size_t> nodeToBundle_;  // index into eligible_ -> bundle, or kNone
  std::vector<bool> visitedNodes_;
};

Outcome placeWith(PlacementStrategy strategy, const std::vector<Slot>& slots,
                  const std::vector<Resources>& bundles, const std::vector<size_t>& order,
                  Capacity capacity) {
  switch (strategy) {
    case PlacementStrategy::kPack: return placePack(slots, bundles, order, capacity);
    case PlacementStrategy::kSpread:
      return BundleSearch(slots, bundles, order, PlacementStrategy::kSpread, capacity).run();
    case PlacementStrategy::kStrictPack: return placeStrictPack(slots, bundles, capacity);
    case PlacementStrategy::kStrictSpread:
      return SpreadMatching(slots, bundles, order, capacity).run();
  }
  Outcome outcome;
  outcome.blocked.reason = "unknown placement strategy";
  return outcome;
}

// Cheap proofs of infeasibility with the clearest messages; the search over totals would find
// the same cases (except for the aggregate check when it runs out of budget), but would
// explain them less directly.
std::optional<std::string> obviousInfeasibility(PlacementStrategy strategy,
                                                const std::vector<Slot>& totals,
                                                const std::vector<Resources>& bundles) {
  std::vector<const Slot*> eligible;
  std::string_view where = "alive node";
  for (const Slot& slot : totals) {
    if (strategy == PlacementStrategy::kStrictSpread && slot.groupBundles > 0) continue;
    eligible.push_back(&slot);
  }
  if (strategy == PlacementStrategy::kStrictSpread) {
    where = "alive node not used by the group";
    size_t inUse = totals.size() - eligible.size();
    if (bundles.size() > eligible.size()) {
      return fmt::format(
          "STRICT_SPREAD needs {} distinct nodes for {} new bundle{} but only {} alive node{} "
          "{} not already used by the group ({} alive, {} used by the group)",
          bundles.size(), bundles.size(), bundles.size() == 1 ? "" : "s", eligible.size(),
          eligible.size() == 1 ? "" : "s", eligible.size() == 1 ? "is" : "are", totals.size(),
          inUse);
    }
  }
  for (size_t i = 0; i < bundles.size(); ++i) {
    bool fitsSome = std::any_of(eligible.begin(), eligible.end(),
                                [&](const Slot* slot) { return fits(slot->free, bundles[i]); });
    if (!fitsSome) {
      return describeShortfall(bundleLabel(i), bundles[i], eligible, Capacity::kTotal, where);
    }
  }
  if (strategy == PlacementStrategy::kPack || strategy == PlacementStrategy::kSpread) {
    Resources clusterTotal;
    for (const Slot& slot : totals) clusterTotal = add(clusterTotal, slot.free);
    for (const auto& [name, qty] : sumOf(bundles)) {
      if (!fitsOne(qty, quantityOf(clusterTotal, name))) {
        return fmt::format(
            "the {} bundles together need {} but all {} alive nodes together have {}",
            bundles.size(), formatResource(name, qty), totals.size(),
            formatResource(name, quantityOf(clusterTotal, name)));
      }
    }
  }
  return std::nullopt;
}

}  // namespace

std::vector<NodeView> viewsOf(const std::vector<NodeRecord>& nodes) {
  std::vector<NodeView> views;
  views.reserve(nodes.size());
  for (const NodeRecord& node : nodes) {
    views.push_back(NodeView{node.id, node.state == NodeState::kAlive, node.total, node.used});
  }
  return views;
}

Resources available(const NodeView& node) { return subtract(node.total, node.used); }

bool fits(const Resources& available, const Resources& demand) {
  for (const auto& [name, qty] : demand) {
    if (!fitsOne(qty, quantityOf(available, name))) return false;
  }
  return true;
}

Resources add(const Resources& a, const Resources& b) {
  Resources out = a;
  for (const auto& [name, qty] : b) out[name] += qty;
  return out;
}

Resources subtract(const Resources& a, const Resources& b) {
  Resources out = a;
  for (const auto& [name, qty] : b) out[name] -= qty;
  return out;
}

Result<NodeId> pickNode(const std::vector<NodeView>& nodes, const Resources& demand,
                        const std::set<NodeId>& avoid) {
  TROUPE_RETURN_IF_ERROR(validateDemand(demand, "the request"));
  // "Fewest used resources overall" as the sum of per-resource utilisation, so that bytes of
  // memory do not outweigh cores.
  auto utilisation = [](const NodeView& node) {
    double sum = 0;
    for (const auto& [name, total] : node.total) {
      if (total > 0) sum += quantityOf(node.used, name) / total;
    }
    return sum;
  };
  const NodeView* best = nullptr;
  double bestFree = 0;
  double bestUtilisation = 0;
  // Free quantities are read in place, not as an available() map per node: this pass runs for
  // every actor placed, over every node.
  auto freeOf = [](const NodeView& node, const std::string& name) {
    return quantityOf(node.total, name) - quantityOf(node.used, name);
  };
  const std::string cpu(kCpu);
  for (const NodeView& node : nodes) {
    if (!node.alive || (!avoid.empty() && avoid.count(node.id) > 0)) continue;
    bool fitsHere = true;
    for (const auto& [name, qty] : demand) fitsHere = fitsHere && fitsOne(qty, freeOf(node, name));
    if (!fitsHere) continue;
    double nodeFree = freeOf(node, cpu);
    double nodeUtilisation = utilisation(node);
    bool better = best == nullptr || nodeFree > bestFree;
    if (best != nullptr && nodeFree == bestFree) {
      better = nodeUtilisation < bestUtilisation ||
               (nodeUtilisation == bestUtilisation && node.id < best->id);
    }
    if (better) {
      best = &node;
      bestFree = nodeFree;
      bestUtilisation = nodeUtilisation;
    }
  }
  if (best != nullptr) return best->id;

  // Sorted by id so that the "closest node" in messages does not depend on input order.
  std::vector<Slot> totals;
  std::vector<Slot> free;
  std::vector<NodeId> avoidedThatFit;
  for (const NodeView& node : nodes) {
    if (!node.alive) continue;
    if (avoid.count(node.id) > 0) {
      if (fits(node.total, demand)) avoidedThatFit.push_back(node.id);
      continue;
    }
    totals.push_back(Slot{node.id, node.total, 0});
    free.push_back(Slot{node.id, available(node), 0});
  }
  auto byId = [](const Slot& a, const Slot& b) { return a.id < b.id; };
  std::sort(totals.begin(), totals.end(), byId);
  std::sort(free.begin(), free.end(), byId);
  std::sort(avoidedThatFit.begin(), avoidedThatFit.end());
  std::string where = avoid.empty() ? "alive node" : "alive node outside the avoid set";

  bool anyTotalFits = std::any_of(totals.begin(), totals.end(),
                                  [&](const Slot& slot) { return fits(slot.free, demand); });
  if (!anyTotalFits && avoidedThatFit.empty()) {
    if (nodes.empty() || std::none_of(nodes.begin(), nodes.end(),
                                      [](const NodeView& node) { return node.alive; })) {
      return Status(StatusCode::kResourceExhausted,
                    fmt::format("infeasible: the request needs {} but no node is alive ({} dead)",
                                formatResources(demand), nodes.size()));
    }
    return Status(StatusCode::kResourceExhausted,
                  "infeasible: " + describeShortfall("the request", demand, pointersTo(totals),
                                                     Capacity::kTotal, where));
  }
  if (!anyTotalFits) {
    return Status(StatusCode::kUnavailable,
                  fmt::format("pending: the request needs {} and only avoided nodes can hold it "
                              "({})",
                              formatResources(demand),
                              formatList(avoidedThatFit, [](const NodeId& id) {
                                return fmt::format("node {}", id.hex());
                              })));
  }
  return Status(StatusCode::kUnavailable,
                "pending: " + describeShortfall("the request", demand, pointersTo(free),
                                                Capacity::kFree, where));
}

Result<std::vector<NodeId>> placeBundles(const std::vector<NodeView>& nodes,
                                         const std::vector<Resources>& bundles,
                                         PlacementStrategy strategy,
                                         const std::vector<NodeId>& existing) {
  for (size_t i = 0; i < bundles.size(); ++i) {
    TROUPE_RETURN_IF_ERROR(validateDemand(bundles[i], bundleLabel(i)));
  }
  if (bundles.empty()) return std::vector<NodeId>{};

  std::map<NodeId, int> existingCount;
  for (const NodeId& id : existing) ++existingCount[id];

  // Slots are sorted by id: every tie in every search then falls to the smaller id, whatever
  // order the caller listed the nodes in.
  std::vector<Slot> free;
  std::vector<Slot> totals;
  for (const NodeView& node : nodes) {
    if (!node.alive) continue;
    auto it = existingCount.find(node.id);
    int inGroup = it == existingCount.end() ? 0 : it->second;
    free.push_back(Slot{node.id, available(node), inGroup});
    totals.push_back(Slot{node.id, node.total, inGroup});
  }
  auto byId = [](const Slot& a, const Slot& b) { return a.id < b.id; };
  std::sort(free.begin(), free.end(), byId);
  std::sort(totals.begin(), totals.end(), byId);

  if (totals.empty()) {
    return Status(StatusCode::kResourceExhausted,
                  fmt::format("infeasible: {} bundle{} to place but no node is alive ({} dead)",
                              bundles.size(), bundles.size() == 1 ? "" : "s", nodes.size()));
  }

  if (strategy == PlacementStrategy::kStrictPack && !existingCount.empty()) {
    if (existingCount.size() > 1) {
      std::vector<NodeId> holders;
      for (const auto& [id, count] : existingCount) holders.push_back(id);
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("STRICT_PACK group's existing bundles sit on {} nodes ({}); a "
                                "STRICT_PACK group must be on exactly one",
                                holders.size(), formatList(holders, [](const NodeId& id) {
                                  return fmt::format("node {}", id.hex());
                                })));
    }
    const NodeId& holder = existingCount.begin()->first;
    bool alive = std::any_of(totals.begin(), totals.end(),
                             [&](const Slot& slot) { return slot.id == holder; });
    if (!alive) {
      return Status(StatusCode::kResourceExhausted,
                    fmt::format("infeasible: STRICT_PACK group's existing bundles sit on node {}, "
                                "which is not alive; new bundles can only join that node, so the "
                                "group must be rescheduled as a whole",
                                holder.hex()));
    }
  }

  Resources scale;
  for (const Slot& slot : totals) {
    for (const auto& [name, qty] : slot.free) scale[name] = std::max(scale[name], qty);
  }
  std::vector<size_t> order = largestFirst(bundles, scale);

  if (auto reason = obviousInfeasibility(strategy, totals, bundles)) {
    return Status(StatusCode::kResourceExhausted, "infeasible: " + *reason);
  }

  Outcome now = placeWith(strategy, free, bundles, order, Capacity::kFree);
  if (now.nodes) return std::move(*now.nodes);

  Outcome empty = placeWith(strategy, totals, bundles, order, Capacity::kTotal);
  if (!empty.nodes && !empty.blocked.searchLimitHit) {
    return Status(StatusCode::kResourceExhausted, "infeasible: " + empty.blocked.reason);
  }
  // Either it fits an empty cluster, or the search gave up before proving it never would;
  // both are worth retrying when resources are freed.
  std::string reason = now.blocked.reason;
  if (now.blocked.searchLimitHit || empty.blocked.searchLimitHit) {
    reason = fmt::format("no placement found within {} tries ({})", kSearchBudget,
                         reason.empty() ? "search cut short" : "first blocked: " + reason);
  }
  return Status(StatusCode::kUnavailable, "pending: " + reason);
}

}  // namespace troupe::scheduler
