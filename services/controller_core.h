// ControllerCore: the controller's decisions as synchronous functions over the ClusterStore:
// scheduling actors and placement groups, lifecycle transitions (PENDING -> ALIVE ->
// RESTARTING -> DEAD), restarts, node deaths, resizes. Its only state is a recent view of the
// nodes for choosing where to place (the store re-checks every claim, so a stale view costs a
// retry, never an over-commitment), the restart back-off counts, and per elastic group the epoch it
// last advanced for a member's end (a restarted core advances once more: harmless); so the same
// calls after a controller restart continue where the last one stopped.
// Side effects on processes are returned as WorkerActions for the caller to carry out.
// Thread-safety: runs on the controller's I/O thread (the store's thread); every call is a
// unit, so calls never interleave.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <tuple>
#include <string>
#include <unordered_map>
#include <vector>

#include "troupe/runtime/cluster_store.h"
#include "troupe/scheduler/placement.h"

namespace troupe {

// A worker process to start (the actor's current incarnation on actor.nodeId) or to kill.
struct WorkerAction {
  enum class Kind { kSpawn, kKill } kind = Kind::kSpawn;
  ActorRecord actor;
  // A restart of an actor whose last incarnations ended soon after they began waits this long
  // (doubling from 100 ms to 10 s), so a worker that cannot start does not restart in a hot loop.
  std::chrono::milliseconds delay{0};
};

// The wait before restarting an actor that has ended `quickEnds` times in a row within
// kStableRunMs of starting: none for the first, then 100 ms doubling up to 10 s.
std::chrono::milliseconds restartBackoff(int quickEnds);
constexpr int64_t kStableRunMs = 10'000;

class ControllerCore {
 public:
  explicit ControllerCore(ClusterStore& store) : store_(store) {}

  // Creates `actor` (id, type, name, resources, restart policy, group and bundle set by the
  // caller); idempotent by id. Errors: kInvalidArgument (bad spec), kAlreadyExists (name taken),
  // kResourceExhausted (infeasible anywhere). A busy cluster leaves it PENDING with a reason.
  Result<ActorRecord> createActor(ActorRecord actor, std::vector<WorkerAction>& actions);
  // createActor of each, in order, with one result each; the store round trips are made once for
  // the lot (a read, the claims, the writes), so a controller creating many actors at once pays
  // a few round trips per batch, not per actor. A repeated id gets its first request's result.
  std::vector<Result<ActorRecord>> createActors(std::vector<ActorRecord> actors, std::vector<WorkerAction>& actions);
  // A worker reports it serves `address`. Stale incarnations are ignored (returns the record).
  Result<ActorRecord> actorReady(const ActorId& id, uint32_t incarnation, const std::string& address, int64_t pid);
  struct ReadyReport {
    ActorId id;
    uint32_t incarnation = 0;
    std::string address;
    int64_t pid = 0;
  };
  // actorReady of each, in order, in two store round trips for the lot.
  std::vector<Result<ActorRecord>> actorsReady(const std::vector<ReadyReport>& reports);
  // A worker ended (`reason` says how). Restarts it within max_restarts, else marks it DEAD;
  // a final exit (the actor ended itself, or its constructor failed) is never restarted.
  Status workerExited(const ActorId& id, uint32_t incarnation, const std::string& reason,
                      std::vector<WorkerAction>& actions, bool final = false);
  // noRestart: DEAD now, then kill. Otherwise only kill: its exit follows the restart policy.
  Status killActor(const ActorId& id, bool noRestart, std::vector<WorkerAction>& actions);
  // A driver's session ended: its non-detached actors end too (no restart).
  Status ownerGone(const std::string& owner, std::vector<WorkerAction>& actions);
  // Actors on dead nodes restart elsewhere (or die); bundles there are placed again.
  Status nodesDied(const std::vector<NodeId>& nodes, std::vector<WorkerAction>& actions);
  // Applies nodesDied to every DEAD node still holding live actors or bundles: nodes that died
  // while no controller ran, or that stopped cleanly. Cheap when there is nothing to do.
  Status reconcileDeadNodes(std::vector<WorkerAction>& actions);
  // The same for at most `maxNodes` of them (the oldest deaths first); true when more are left.
  Result<bool> reconcileDeadNodes(std::vector<WorkerAction>& actions, size_t maxNodes);

  // Idempotent by id. Infeasible: kResourceExhausted. Not now: CREATED later, PENDING meanwhile.
  Result<PlacementGroupRecord> createPlacementGroup(PlacementGroupRecord group);
  Status removePlacementGroup(const PlacementGroupId& id, std::vector<WorkerAction>& actions);
  // Appends bundles all or nothing (see the schema for `fromIndex`). kUnavailable "pending: ..."
  // when they do not fit now (the group is unchanged), kResourceExhausted when they never could.
  Result<PlacementGroupRecord> addBundles(const PlacementGroupId& id, const std::vector<Resources>& bundles,
                                          uint32_t fromIndex);
  Result<PlacementGroupRecord> removeBundles(const PlacementGroupId& id, const std::vector<uint32_t>& indices,
                                             std::vector<WorkerAction>& actions);

  // Places what waits for resources: PENDING groups' bundles, then actors without a node.
  Status retryPending(std::vector<WorkerAction>& actions);

  Result<ActorRecord> getActor(const ActorId& id);
  Result<ActorRecord> getActorByName(const std::string& name);
  Result<PlacementGroupRecord> getPlacementGroup(const PlacementGroupId& id);

 private:
  // Finds a node for the actor's current incarnation and claims its resources there (or checks
  // its bundle has room). Sets actor.nodeId; errors as pickNode's.
  Status place(ActorRecord& actor);
  Status placeBundles(PlacementGroupRecord& group, size_t from);
  // place() of many, in one claims script for those the view places (see the .cc); a status each.
  Result<std::vector<Status>> placeAll(const std::vector<ActorRecord*>& actors);
  Status restartAll(std::vector<ActorRecord> actors, const std::string& reason, std::vector<WorkerAction>& actions);
  // The scheduler's view of the nodes as read at most kNodeViewMaxAge ago (or now, when
  // `fresh`), with the claims this core made since counted in. Valid until the next call.
  Result<const std::vector<scheduler::NodeView>*> nodeView(bool fresh);
  // Adds (sign 1) or takes back (-1) claims in the view, keeping the index by free CPU.
  void counted(const std::vector<Reservation>& claims, double sign = 1);
  // The node pickNode would choose on the view, found from the index by free CPU (the first
  // that fits, in pickNode's order) instead of a pass over every node; nullopt when none fits.
  std::optional<NodeId> pickIndexed(const Resources& demand) const;
  // The nodes worth offering a group's bundles first: the `limit` freest (by CPU) that fit each
  // bundle, and the nodes holding its other bundles; the rest of the cluster only if these fail.
  std::vector<scheduler::NodeView> shortlist(const std::vector<Resources>& demands, const std::vector<NodeId>& existing,
                                             size_t limit) const;
  void rank(size_t view);
  // The same, making the claims through `claim` (true: made; false: refused, try afresh).
  using ClaimFn = std::function<Result<bool>(const std::vector<Reservation>&)>;
  Status placeBundles(PlacementGroupRecord& group, size_t from, const ClaimFn& claim);
  // Ends the actors in these bundles and frees their claims; marks them removed in `group`.
  Status releaseBundles(PlacementGroupRecord& group, const std::vector<uint32_t>& indices,
                        std::vector<WorkerAction>& actions);
  void releaseActorResources(const ActorRecord& actor);
  // A member of an elastic group ended. Inside an Incident it is gathered with the incident's
  // other ends; otherwise the group's epoch advances for it at once (groupEnded).
  void memberEnded(const ActorRecord& actor, const std::string& reason, bool restarting);
  struct MemberEnd {
    std::string type;
    ActorId id;
    std::string reason;
    bool restarting = false;
  };
  // The ends of one group's members caused by one incident: one epoch advance and one event,
  // or only the event while the group has not joined since this core advanced it for an earlier
  // end within kOneRecovery (its survivors are already aborted and nobody is in a newer epoch).
  void groupEnded(const std::string& group, const std::vector<MemberEnd>& ends);
  // Open while one call ends several members (a node's death, bundles removed, an owner gone):
  // their ends are gathered per group and written by groupEnded when the outermost one closes.
  class Incident;
  Status endIncarnation(ActorRecord actor, const std::string& reason, bool allowRestart,
                        std::vector<WorkerAction>& actions);

  ClusterStore& store_;
  static constexpr std::chrono::milliseconds kNodeViewMaxAge{500};
  std::vector<scheduler::NodeView> views_;
  std::unordered_map<NodeId, size_t> viewIndex_;  // node -> its place in views_
  // The alive nodes in pickNode's order: most free CPU, then least used overall, then id.
  using RankKey = std::tuple<double, double, NodeId>;  // (-free CPU, utilisation, id)
  std::set<RankKey> byFree_;
  std::vector<RankKey> keyOf_;  // views_ index -> its key in byFree_
  std::chrono::steady_clock::time_point nodesRead_{};

  // Per actor, how many incarnations in a row ended within kStableRunMs of starting (or before
  // they served). Kept in memory: a restarted controller starts the back-off afresh.
  std::unordered_map<ActorId, int> quickEnds_;

  // The ends gathered by the open Incident, by group; null when none is open.
  std::map<std::string, std::vector<MemberEnd>>* incident_ = nullptr;
  // Per elastic group, the epoch this core last advanced it to for a member's end, and when.
  // In memory: a restarted controller advances once more for the next end, which is harmless.
  struct Advanced {
    int64_t epoch = 0;
    std::chrono::steady_clock::time_point at;
  };
  std::unordered_map<std::string, Advanced> advanced_;
  static constexpr std::chrono::seconds kOneRecovery{30};
};

}  // namespace troupe
