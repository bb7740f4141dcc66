#include "controller_core.h"

#include <algorithm>
#include <optional>
#include <set>

#include <fmt/format.h>

#include "troupe/runtime/config.h"
#include "troupe/runtime/logging.h"
#include "troupe/runtime/resources.h"
#include "troupe/scheduler/placement.h"

namespace troupe {
namespace {

// A reservation can lose a race with another controller call's; a fresh snapshot then decides.
constexpr int kReserveAttempts = 4;

std::string actorHolder(const ActorId& id) { return "actor:" + id.hex(); }
std::string bundleHolder(const PlacementGroupId& id, size_t index) { return fmt::format("pg:{}:{}", id.hex(), index); }
// The group of a bundle's claim ("pg:<id>:<index>"); nullopt for an actor's.
std::optional<PlacementGroupId> bundleHolderGroup(const std::string& holder) {
  if (!holder.starts_with("pg:")) return std::nullopt;
  auto colon = holder.rfind(':');
  if (colon <= 3) return std::nullopt;
  return PlacementGroupId(holder.substr(3, colon - 3));
}

// A removed bundle keeps its index with no resources and no node.
bool isRemoved(const Bundle& b) { return b.resources.empty(); }

Status validResources(const Resources& r, const std::string& what) {
  for (const auto& [name, qty] : r) {
    if (name.empty() || !(qty >= 0)) {
      return Status(StatusCode::kInvalidArgument, fmt::format("{}: resource '{}' = {} is not a non-negative quantity", what, name, qty));
    }
  }
  return Status::ok();
}

}  // namespace

std::chrono::milliseconds restartBackoff(int quickEnds) {
  using std::chrono::milliseconds;
  if (quickEnds <= 1) return milliseconds(0);  // one crash soon after a start can be bad luck
  return std::min(milliseconds(100LL << std::min(quickEnds - 2, 7)), milliseconds(10'000));
}

Status ControllerCore::place(ActorRecord& actor) {
  if (!actor.placementGroup.empty()) {
    auto group = store_.getPlacementGroup(actor.placementGroup);
    if (!group.isOk()) return group.status();
    if (!group->has_value() || (*group)->state == PlacementGroupState::kRemoved) {
      return Status(StatusCode::kNotFound, fmt::format("placement group {} does not exist (or was removed)", actor.placementGroup.hex()));
    }
    const auto& pg = **group;
    if (actor.bundleIndex < 0 || static_cast<size_t>(actor.bundleIndex) >= pg.bundles.size() ||
        isRemoved(pg.bundles[actor.bundleIndex])) {
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("placement group {} has no bundle {}", pg.id.hex(), actor.bundleIndex));
    }
    const Bundle& bundle = pg.bundles[actor.bundleIndex];
    if (!scheduler::fits(bundle.resources, actor.resources)) {
      return Status(StatusCode::kResourceExhausted,
                    fmt::format("infeasible: the actor needs {} but bundle {} of group {} holds only {}",
                                formatResources(actor.resources), actor.bundleIndex, pg.id.hex(),
                                formatResources(bundle.resources)));
    }
    if (bundle.nodeId.empty()) {
      return Status(StatusCode::kUnavailable, fmt::format("pending: bundle {} of group {} is not placed yet", actor.bundleIndex, pg.id.hex()));
    }
    // The bundle's claim covers every actor in it; check what the others already use.
    auto all = store_.listGroupActors(actor.placementGroup);
    if (!all.isOk()) return all.status();
    Resources used;
    for (const auto& other : *all) {
      if (other.id != actor.id && other.placementGroup == actor.placementGroup && other.bundleIndex == actor.bundleIndex &&
          other.state != ActorState::kDead && !other.nodeId.empty()) {
        used = scheduler::add(used, other.resources);
      }
    }
    if (!scheduler::fits(scheduler::subtract(bundle.resources, used), actor.resources)) {
      return Status(StatusCode::kUnavailable,
                    fmt::format("pending: bundle {} of group {} is full until one of its actors ends", actor.bundleIndex, pg.id.hex()));
    }
    actor.nodeId = bundle.nodeId;
    return Status::ok();
  }
  for (int attempt = 0; attempt < kReserveAttempts; ++attempt) {
    bool fresh = attempt > 0;
    auto nodes = nodeView(fresh);
    if (!nodes.isOk()) return nodes.status();
    auto node = scheduler::pickNode(**nodes, actor.resources);
    if (!node.isOk() && !fresh) continue;  // decided on a recent view: ask the store
    if (!node.isOk()) return node.status();
    std::vector<Reservation> claims = {Reservation{*node, actorHolder(actor.id), actor.resources}};
    auto reserved = store_.reserve(claims);
    if (!reserved.isOk()) return reserved.status();
    if (*reserved) {
      counted(claims);
      actor.nodeId = *node;
      return Status::ok();
    }
  }
  return Status(StatusCode::kUnavailable, "pending: resources changed under every attempt to reserve them");
}

void ControllerCore::releaseActorResources(const ActorRecord& actor) {
  if (actor.placementGroup.empty() && !actor.nodeId.empty()) {
    auto s = store_.release({Reservation{actor.nodeId, actorHolder(actor.id), {}}});
    if (!s.isOk()) TROUPE_LOG(kWarning, "cannot release actor {}'s resources: {}", actor.id.hex(), s.toString());
  }
}

Result<ActorRecord> ControllerCore::createActor(ActorRecord actor, std::vector<WorkerAction>& actions) {
  if (actor.id.empty() || actor.type.empty()) {
    return Status(StatusCode::kInvalidArgument, "an actor needs an id and a type");
  }
  if (actor.maxRestarts < -1 || actor.maxTaskRetries < -1) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("max_restarts ({}) and max_task_retries ({}) must be >= -1 (-1: unlimited)", actor.maxRestarts,
                              actor.maxTaskRetries));
  }
  TROUPE_RETURN_IF_ERROR(validResources(actor.resources, "actor " + actor.type));
  auto existing = store_.getActor(actor.id);
  if (!existing.isOk()) return existing.status();
  if (existing->has_value()) return **existing;  // a retried request

  if (!actor.name.empty()) {
    auto claimed = store_.claimActorName(actor.name, actor.id);
    if (!claimed.isOk()) return claimed.status();
    if (!*claimed) {
      return Status(StatusCode::kAlreadyExists,
                    fmt::format("an actor named '{}' already exists; use get_actor('{}') or another name", actor.name, actor.name));
    }
  }
  actor.state = ActorState::kPending;
  actor.incarnation = 1;
  actor.restarts = 0;
  actor.nodeId = NodeId();
  actor.address.clear();
  actor.pid = 0;
  actor.deathReason.clear();
  actor.createdMs = actor.updatedMs = wallClockMs();
  Status placed = place(actor);
  if (!placed.isOk() && placed.code() != StatusCode::kUnavailable) {
    if (!actor.name.empty()) (void)store_.releaseActorName(actor.name, actor.id);
    return placed;
  }
  if (!placed.isOk()) actor.deathReason = placed.message();  // the pending reason, shown in status
  TROUPE_RETURN_IF_ERROR(store_.putActor(actor));
  if (placed.isOk()) actions.push_back({WorkerAction::Kind::kSpawn, actor});
  return actor;
}

Result<ActorRecord> ControllerCore::actorReady(const ActorId& id, uint32_t incarnation, const std::string& address,
                                               int64_t pid) {
  auto actor = getActor(id);
  if (!actor.isOk()) return actor.status();
  if (actor->incarnation != incarnation || actor->state == ActorState::kDead) return actor;  // stale
  if (actor->state == ActorState::kAlive && actor->address == address) return actor;        // a retry
  actor->state = ActorState::kAlive;
  actor->address = address;
  actor->pid = pid;
  actor->updatedMs = wallClockMs();
  TROUPE_RETURN_IF_ERROR(store_.putActor(*actor));
  return actor;
}

// A member of an elastic group ended: the group's epoch advances (its survivors' collectives
// fail fast and they meet again at the new epoch) and the group records why.
void ControllerCore::memberEnded(const ActorRecord& actor, const std::string& reason, bool restarting) {
  if (actor.placementGroup.empty()) return;
  std::string id = actor.placementGroup.hex();
  auto group = store_.getElasticGroup(id);
  if (!group.isOk() || !group->has_value()) return;
  auto epoch = store_.advanceGroupEpoch(id, (*group)->epoch + 1);
  if (!epoch.isOk()) {
    TROUPE_LOG(kWarning, "group {}: could not advance its epoch: {}", id, epoch.status().toString());
    return;
  }
  (void)store_.appendGroupEvent(
      id, fmt::format("{} epoch {}: {} {} ended: {}; {}", wallClockMs(), *epoch, actor.type, actor.id.hex(), reason,
                      restarting ? "restarting" : "not restarted"));
}

Status ControllerCore::endIncarnation(ActorRecord actor, const std::string& reason, bool allowRestart,
                                      std::vector<WorkerAction>& actions) {
  releaseActorResources(actor);
  memberEnded(actor, reason, allowRestart && (actor.maxRestarts == -1 || actor.restarts < actor.maxRestarts));
  bool restart = allowRestart && (actor.maxRestarts == -1 || actor.restarts < actor.maxRestarts);
  const bool ranLong = actor.state == ActorState::kAlive && wallClockMs() - actor.updatedMs >= kStableRunMs;
  int quickEnds = 0;
  if (restart && !ranLong) quickEnds = ++quickEnds_[actor.id];
  if (!restart || ranLong) quickEnds_.erase(actor.id);
  actor.address.clear();
  if (restart) actor.pid = 0;  // a DEAD record keeps its last pid: its logs and output name it
  actor.deathReason = reason;
  actor.updatedMs = wallClockMs();
  if (!restart) {
    actor.state = ActorState::kDead;
    if (!actor.name.empty()) (void)store_.releaseActorName(actor.name, actor.id);
    TROUPE_RETURN_IF_ERROR(store_.putActor(actor));
    return retryPending(actions);  // its resources may unblock others
  }
  actor.state = ActorState::kRestarting;
  actor.restarts += 1;
  actor.incarnation += 1;
  actor.nodeId = NodeId();
  Status placed = place(actor);
  if (!placed.isOk()) {
    actor.nodeId = NodeId();
    if (placed.code() != StatusCode::kUnavailable) {
      actor.state = ActorState::kDead;
      actor.deathReason = fmt::format("{}; cannot restart: {}", reason, placed.message());
      if (!actor.name.empty()) (void)store_.releaseActorName(actor.name, actor.id);
    }
  }
  TROUPE_RETURN_IF_ERROR(store_.putActor(actor));
  if (placed.isOk()) actions.push_back({WorkerAction::Kind::kSpawn, actor, restartBackoff(quickEnds)});
  return Status::ok();
}

Status ControllerCore::workerExited(const ActorId& id, uint32_t incarnation, const std::string& reason,
                                    std::vector<WorkerAction>& actions, bool final) {
  auto actor = getActor(id);
  if (!actor.isOk()) return actor.status();
  if (actor->incarnation != incarnation || actor->state == ActorState::kDead) return Status::ok();  // stale or repeated
  return endIncarnation(*actor, reason, !final, actions);
}

Status ControllerCore::killActor(const ActorId& id, bool noRestart, std::vector<WorkerAction>& actions) {
  auto actor = getActor(id);
  if (!actor.isOk()) return actor.status();
  if (actor->state == ActorState::kDead) return Status::ok();
  if (!actor->nodeId.empty()) actions.push_back({WorkerAction::Kind::kKill, *actor});
  if (!noRestart) return Status::ok();  // its exit report applies the restart policy
  return endIncarnation(*actor, "killed on request (kill with no_restart)", false, actions);
}

Status ControllerCore::nodesDied(const std::vector<NodeId>& nodes, std::vector<WorkerAction>& actions) {
  std::set<NodeId> dead(nodes.begin(), nodes.end());
  // What was on each dead node, from its claims and its actor index: the cost follows what the
  // node held, not the cluster's size.
  for (const NodeId& node : dead) {
    auto claims = store_.reservations(node);
    if (!claims.isOk()) return claims.status();
    // Bundles there lose their claim and wait to be placed again. The group is written first,
    // its claims released after: a crash in between leaves a claim that the next pass finds
    // (and releases) through the same index.
    std::set<PlacementGroupId> groups;
    for (const auto& [holder, resources] : *claims) {
      if (auto group = bundleHolderGroup(holder)) groups.insert(*group);
    }
    for (const PlacementGroupId& id : groups) {
      auto group = store_.getPlacementGroup(id);
      if (!group.isOk()) return group.status();
      if (!group->has_value() || (*group)->state == PlacementGroupState::kRemoved) continue;
      bool changed = false;
      for (Bundle& b : (*group)->bundles) {
        if (!b.nodeId.empty() && dead.count(b.nodeId)) {
          b.nodeId = NodeId();
          changed = true;
        }
      }
      if (changed) {
        (*group)->state = PlacementGroupState::kPending;
        (*group)->pendingReason = "pending: a node holding some of its bundles died";
        TROUPE_RETURN_IF_ERROR(store_.putPlacementGroup(**group));
      }
    }
    auto actors = store_.listNodeActors(node);
    if (!actors.isOk()) return actors.status();
    for (const auto& actor : *actors) {
      if (actor.state == ActorState::kDead || actor.nodeId != node) continue;
      TROUPE_RETURN_IF_ERROR(endIncarnation(actor, fmt::format("its node {} died", node.hex()), true, actions));
    }
    // Whatever is claimed on a dead node now is held by nothing that runs there.
    std::vector<Reservation> release;
    for (const auto& [holder, resources] : *claims) release.push_back(Reservation{node, holder, {}});
    TROUPE_RETURN_IF_ERROR(store_.release(release));
  }
  return retryPending(actions);
}

Status ControllerCore::ownerGone(const std::string& owner, std::vector<WorkerAction>& actions) {
  if (owner.empty()) return Status::ok();
  auto actors = store_.listLiveActors();
  if (!actors.isOk()) return actors.status();
  for (const auto& actor : *actors) {
    if (actor.owner != owner || actor.detached || actor.state == ActorState::kDead) continue;
    if (!actor.nodeId.empty()) actions.push_back({WorkerAction::Kind::kKill, actor});
    TROUPE_RETURN_IF_ERROR(
        endIncarnation(actor, "its owner (the driver that created it) went away; use lifetime=detached to keep an actor",
                       false, actions));
  }
  return Status::ok();
}

Status ControllerCore::reconcileDeadNodes(std::vector<WorkerAction>& actions) {
  auto dead = store_.listDeadNodesWithWork();
  if (!dead.isOk()) return dead.status();
  if (dead->empty()) return Status::ok();
  return nodesDied(*dead, actions);
}

Result<const std::vector<scheduler::NodeView>*> ControllerCore::nodeView(bool fresh) {
  auto now = std::chrono::steady_clock::now();
  if (fresh || views_.empty() || now - nodesRead_ > kNodeViewMaxAge) {
    auto nodes = store_.listNodes();
    if (!nodes.isOk()) return nodes.status();
    views_ = scheduler::viewsOf(*nodes);
    viewIndex_.clear();
    for (size_t i = 0; i < views_.size(); ++i) viewIndex_[views_[i].id] = i;
    nodesRead_ = now;
  }
  // Kept between calls, not copied: a placement costs a pass over the nodes, no more.
  return &views_;
}

void ControllerCore::counted(const std::vector<Reservation>& claims) {
  for (const Reservation& claim : claims) {
    auto it = viewIndex_.find(claim.nodeId);
    if (it == viewIndex_.end()) continue;
    Resources& used = views_[it->second].used;
    for (const auto& [name, qty] : claim.resources) used[name] += qty;
  }
}

Status ControllerCore::placeBundles(PlacementGroupRecord& group, size_t from) {
  return placeBundles(group, from, [this](const std::vector<Reservation>& claims) { return store_.reserve(claims); });
}

Status ControllerCore::placeBundles(PlacementGroupRecord& group, size_t from, const ClaimFn& claim) {
  std::vector<size_t> todo;
  std::vector<Resources> demands;
  std::vector<NodeId> existing;
  for (size_t i = 0; i < group.bundles.size(); ++i) {
    const Bundle& b = group.bundles[i];
    if (isRemoved(b)) continue;
    if (i >= from && b.nodeId.empty()) {
      todo.push_back(i);
      demands.push_back(b.resources);
    } else if (!b.nodeId.empty()) {
      existing.push_back(b.nodeId);
    }
  }
  if (todo.empty()) return Status::ok();
  for (int attempt = 0; attempt < kReserveAttempts; ++attempt) {
    bool fresh = attempt > 0;
    auto nodes = nodeView(fresh);
    if (!nodes.isOk()) return nodes.status();
    auto placement = scheduler::placeBundles(**nodes, demands, group.strategy, existing);
    if (!placement.isOk() && !fresh) continue;  // decided on a recent view: ask the store
    if (!placement.isOk()) return placement.status();
    std::vector<Reservation> claims;
    for (size_t k = 0; k < todo.size(); ++k) {
      claims.push_back({(*placement)[k], bundleHolder(group.id, todo[k]), demands[k]});
    }
    for (size_t k = 0; k < todo.size(); ++k) group.bundles[todo[k]].nodeId = (*placement)[k];
    auto reserved = claim(claims);
    if (!reserved.isOk()) return reserved.status();
    if (*reserved) {
      counted(claims);
      return Status::ok();
    }
    for (size_t k : todo) group.bundles[k].nodeId = NodeId();
  }
  return Status(StatusCode::kUnavailable, "pending: resources changed under every attempt to reserve them");
}

Result<PlacementGroupRecord> ControllerCore::createPlacementGroup(PlacementGroupRecord group) {
  if (group.id.empty()) return Status(StatusCode::kInvalidArgument, "a placement group needs an id");
  if (group.bundles.empty()) return Status(StatusCode::kInvalidArgument, "a placement group needs at least one bundle");
  for (size_t i = 0; i < group.bundles.size(); ++i) {
    auto& b = group.bundles[i];
    b.nodeId = NodeId();
    TROUPE_RETURN_IF_ERROR(validResources(b.resources, fmt::format("bundle {}", i)));
    if (b.resources.empty()) return Status(StatusCode::kInvalidArgument, fmt::format("bundle {} asks for no resources", i));
  }
  group.createdMs = wallClockMs();
  // The group and its claims are written in one store call: one round trip, and a retried
  // request finds the group it made (which it returns untouched).
  std::optional<PlacementGroupRecord> existing;
  Status placed = placeBundles(group, 0, [&](const std::vector<Reservation>& claims) -> Result<bool> {
    group.state = PlacementGroupState::kCreated;
    auto created = store_.createPlacementGroup(group, claims);
    if (!created.isOk()) return created.status();
    if (created->outcome == GroupCreation::Outcome::kExists) existing = std::move(created->existing);
    return created->outcome != GroupCreation::Outcome::kRefused;
  });
  if (existing) return std::move(*existing);
  if (placed.isOk()) return group;
  if (placed.code() != StatusCode::kUnavailable) return placed;
  group.state = PlacementGroupState::kPending;
  group.pendingReason = placed.message();
  auto created = store_.createPlacementGroup(group, {});
  if (!created.isOk()) return created.status();
  if (created->outcome == GroupCreation::Outcome::kExists) return std::move(*created->existing);
  return group;
}

Status ControllerCore::removePlacementGroup(const PlacementGroupId& id, std::vector<WorkerAction>& actions) {
  // A group without live actors goes in one store call; one with actors ends them first.
  auto removal = store_.removePlacementGroup(id);
  if (!removal.isOk()) return removal.status();
  if (removal->outcome != GroupRemoval::Outcome::kHasActors) {
    return removal->pendingWork ? retryPending(actions) : Status::ok();
  }
  auto group = getPlacementGroup(id);
  if (group.status().code() == StatusCode::kNotFound) return Status::ok();  // already removed
  if (!group.isOk()) return group.status();
  if (group->state == PlacementGroupState::kPending) {
    // Marked first, so no retry places its bundles while they are being released.
    group->state = PlacementGroupState::kRemoved;
    TROUPE_RETURN_IF_ERROR(store_.putPlacementGroup(*group));
  }
  std::vector<uint32_t> all;
  for (uint32_t i = 0; i < group->bundles.size(); ++i) all.push_back(i);
  TROUPE_RETURN_IF_ERROR(releaseBundles(*group, all, actions));
  TROUPE_RETURN_IF_ERROR(store_.deletePlacementGroup(id));
  return retryPending(actions);
}

Result<PlacementGroupRecord> ControllerCore::addBundles(const PlacementGroupId& id, const std::vector<Resources>& bundles,
                                                        uint32_t fromIndex) {
  auto group = getPlacementGroup(id);
  if (!group.isOk()) return group.status();
  if (group->state == PlacementGroupState::kRemoved) {
    return Status(StatusCode::kFailedPrecondition, fmt::format("placement group {} was removed", id.hex()));
  }
  if (bundles.empty()) return Status(StatusCode::kInvalidArgument, "addBundles needs at least one bundle");
  for (size_t i = 0; i < bundles.size(); ++i) {
    TROUPE_RETURN_IF_ERROR(validResources(bundles[i], fmt::format("new bundle {}", i)));
    if (bundles[i].empty()) return Status(StatusCode::kInvalidArgument, fmt::format("new bundle {} asks for no resources", i));
  }
  size_t size = group->bundles.size();
  if (size != fromIndex) {
    // A retry of an append that already happened finds its bundles in place.
    bool applied = size >= fromIndex + bundles.size();
    for (size_t i = 0; applied && i < bundles.size(); ++i) applied = group->bundles[fromIndex + i].resources == bundles[i];
    if (applied) return group;
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("placement group {} has {} bundles, not {}: it changed since you read it", id.hex(), size, fromIndex));
  }
  PlacementGroupRecord grown = *group;
  for (const auto& r : bundles) grown.bundles.push_back(Bundle{r, NodeId()});
  TROUPE_RETURN_IF_ERROR(placeBundles(grown, size));
  TROUPE_RETURN_IF_ERROR(store_.putPlacementGroup(grown));
  return grown;
}

Status ControllerCore::releaseBundles(PlacementGroupRecord& group, const std::vector<uint32_t>& indices,
                                      std::vector<WorkerAction>& actions) {
  std::set<int32_t> removing;
  for (uint32_t i : indices) {
    if (i >= group.bundles.size()) {
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("placement group {} has no bundle {} (it has {})", group.id.hex(), i, group.bundles.size()));
    }
    if (!isRemoved(group.bundles[i])) removing.insert(static_cast<int32_t>(i));  // removed twice: no-op
  }
  if (removing.empty()) return Status::ok();
  // Actors in removed bundles end first (no restart: their bundle is gone).
  auto actors = store_.listGroupActors(group.id);
  if (!actors.isOk()) return actors.status();
  for (const auto& actor : *actors) {
    if (actor.placementGroup == group.id && removing.count(actor.bundleIndex) && actor.state != ActorState::kDead) {
      if (!actor.nodeId.empty()) actions.push_back({WorkerAction::Kind::kKill, actor});
      TROUPE_RETURN_IF_ERROR(endIncarnation(actor, fmt::format("its bundle {} of placement group {} was removed",
                                                               actor.bundleIndex, group.id.hex()),
                                            false, actions));
    }
  }
  std::vector<Reservation> claims;
  for (int32_t i : removing) {
    Bundle& b = group.bundles[i];
    if (!b.nodeId.empty()) claims.push_back({b.nodeId, bundleHolder(group.id, i), {}});
    b = Bundle{};
  }
  return store_.release(claims);
}

Result<PlacementGroupRecord> ControllerCore::removeBundles(const PlacementGroupId& id, const std::vector<uint32_t>& indices,
                                                           std::vector<WorkerAction>& actions) {
  auto group = getPlacementGroup(id);
  if (!group.isOk()) return group.status();
  TROUPE_RETURN_IF_ERROR(releaseBundles(*group, indices, actions));
  TROUPE_RETURN_IF_ERROR(store_.putPlacementGroup(*group));
  TROUPE_RETURN_IF_ERROR(retryPending(actions));
  return group;
}

Status ControllerCore::retryPending(std::vector<WorkerAction>& actions) {
  auto pending = store_.listPendingWork();
  if (!pending.isOk()) return pending.status();
  for (auto& group : pending->groups) {
    if (group.state != PlacementGroupState::kPending) continue;
    Status placed = placeBundles(group, 0);
    if (placed.isOk()) {
      group.state = PlacementGroupState::kCreated;
      group.pendingReason.clear();
    } else {
      group.pendingReason = placed.message();
    }
    TROUPE_RETURN_IF_ERROR(store_.putPlacementGroup(group));
  }
  for (auto& actor : pending->actors) {
    if (!waitsForNode(actor)) continue;
    Status placed = place(actor);
    if (!placed.isOk()) continue;  // still waiting; its reason stays
    if (actor.state == ActorState::kPending) actor.deathReason.clear();
    actor.updatedMs = wallClockMs();
    TROUPE_RETURN_IF_ERROR(store_.putActor(actor));
    actions.push_back({WorkerAction::Kind::kSpawn, actor});
  }
  return Status::ok();
}

Result<ActorRecord> ControllerCore::getActor(const ActorId& id) {
  auto actor = store_.getActor(id);
  if (!actor.isOk()) return actor.status();
  if (!actor->has_value()) return Status(StatusCode::kNotFound, fmt::format("no actor with id {}", id.hex()));
  return **actor;
}

Result<ActorRecord> ControllerCore::getActorByName(const std::string& name) {
  auto id = store_.lookupActorName(name);
  if (!id.isOk()) return id.status();
  if (!id->has_value()) return Status(StatusCode::kNotFound, fmt::format("no live actor named '{}'", name));
  return getActor(**id);
}

Result<PlacementGroupRecord> ControllerCore::getPlacementGroup(const PlacementGroupId& id) {
  auto group = store_.getPlacementGroup(id);
  if (!group.isOk()) return group.status();
  if (!group->has_value()) return Status(StatusCode::kNotFound, fmt::format("no placement group with id {}", id.hex()));
  return **group;
}

}  // namespace troupe
