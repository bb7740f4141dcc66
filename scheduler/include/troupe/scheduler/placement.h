// Placement decisions: which node runs an actor, where a placement group's bundles go, and
// where bundles added to a live (resizable) group go. Pure functions over a snapshot of the
// cluster; the controller reserves the result in Redis atomically (ClusterStore::reserve) and
// retries with a fresh snapshot if the reservation loses a race.
// Thread-safety: pure functions; no shared state.
#pragma once

#include <set>
#include <vector>

#include "troupe/runtime/cluster_store.h"

namespace troupe::scheduler {

// What the scheduler knows of one node.
struct NodeView {
  NodeId id;
  bool alive = true;
  Resources total;
  Resources used;
};

// Builds views from store records (used = the node record's `used`).
std::vector<NodeView> viewsOf(const std::vector<NodeRecord>& nodes);

// total - used, per resource name (missing names count as 0).
Resources available(const NodeView& node);
// True when every quantity in `demand` is <= the same name in `available` (with a small
// epsilon for fractional resources). An empty demand always fits.
bool fits(const Resources& available, const Resources& demand);
// a + b and a - b per resource name.
Resources add(const Resources& a, const Resources& b);
Resources subtract(const Resources& a, const Resources& b);

// Picks the alive node with the most free CPU (ties: fewest used resources overall, then id)
// that fits `demand`, skipping `avoid`.
// Errors: kResourceExhausted "infeasible: ..." when no alive node's *total* could ever fit the
// demand (the message names the resource, the demand and the largest node's total);
// kUnavailable "pending: ..." when some node could fit it once resources are freed.
Result<NodeId> pickNode(const std::vector<NodeView>& nodes, const Resources& demand,
                        const std::set<NodeId>& avoid = {});

// Places `bundles` (appended to a group whose already-placed bundles sit on `existing`, empty
// for a new group), honouring `strategy` over the whole group:
//   PACK          as few nodes as possible, preferring nodes the group already uses;
//   SPREAD        as many distinct nodes as possible, preferring nodes the group does not use;
//   STRICT_PACK   every bundle of the group on one node (the existing bundles' node if any);
//   STRICT_SPREAD every bundle of the group on a distinct node.
// Returns one node per bundle, in order; all or nothing.
// Errors as pickNode: kResourceExhausted when no cluster state could ever satisfy it (e.g.
// STRICT_SPREAD with more bundles than alive nodes, a bundle larger than every node),
// kUnavailable when it could once resources are freed. Messages say which bundle and why.
Result<std::vector<NodeId>> placeBundles(const std::vector<NodeView>& nodes,
                                         const std::vector<Resources>& bundles,
                                         PlacementStrategy strategy,
                                         const std::vector<NodeId>& existing = {});

}  // namespace troupe::scheduler
