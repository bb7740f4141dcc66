#include "controller_core.h"

#include <algorithm>
#include <optional>
#include <set>
#include <unordered_map>

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
    TROUPE_ASSIGN_OR_RETURN(auto all, store_.listGroupActors(actor.placementGroup));
    Resources used;
    for (const auto& other : all) {
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
    TROUPE_ASSIGN_OR_RETURN(auto nodes, nodeView(fresh));
    std::optional<NodeId> picked = pickIndexed(actor.resources);
    // None fits: pickNode over every node says why (pending or infeasible).
    auto node = picked ? Result<NodeId>(*picked) : scheduler::pickNode(*nodes, actor.resources);
    if (!node.isOk() && !fresh) continue;  // decided on a recent view: ask the store
    if (!node.isOk()) return node.status();
    std::vector<Reservation> claims = {Reservation{*node, actorHolder(actor.id), actor.resources}};
    TROUPE_ASSIGN_OR_RETURN(auto reserved, store_.reserve(claims));
    if (reserved) {
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
  std::vector<ActorRecord> one;
  one.push_back(std::move(actor));
  return std::move(createActors(std::move(one), actions)[0]);
}

std::vector<Result<ActorRecord>> ControllerCore::createActors(std::vector<ActorRecord> actors,
                                                              std::vector<WorkerAction>& actions) {
  const size_t n = actors.size();
  std::vector<std::optional<Result<ActorRecord>>> results(n);
  auto fail = [&](size_t i, Status status) { results[i] = Result<ActorRecord>(std::move(status)); };
  // The first request for each id decides; a repeat gets its result.
  std::unordered_map<ActorId, size_t> first;
  std::vector<size_t> todo;
  for (size_t i = 0; i < n; ++i) {
    ActorRecord& actor = actors[i];
    if (actor.id.empty() || actor.type.empty()) {
      fail(i, Status(StatusCode::kInvalidArgument, "an actor needs an id and a type"));
      continue;
    }
    if (actor.maxRestarts < -1 || actor.maxTaskRetries < -1) {
      fail(i, Status(StatusCode::kInvalidArgument,
                     fmt::format("max_restarts ({}) and max_task_retries ({}) must be >= -1 (-1: unlimited)",
                                 actor.maxRestarts, actor.maxTaskRetries)));
      continue;
    }
    if (Status valid = validResources(actor.resources, "actor " + actor.type); !valid.isOk()) {
      fail(i, valid);
      continue;
    }
    if (first.emplace(actor.id, i).second) todo.push_back(i);
  }
  auto finish = [&]() {
    std::vector<Result<ActorRecord>> out;
    out.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      if (!results[i]) results[i] = *results[first.at(actors[i].id)];  // before any is moved out
    }
    for (size_t i = 0; i < n; ++i) out.push_back(std::move(*results[i]));
    return out;
  };
  auto failAll = [&](const std::vector<size_t>& which, const Status& status) {
    for (size_t i : which) fail(i, status);
    return finish();
  };

  // One read for the lot: a retried request finds the actor it made.
  std::vector<ActorId> ids;
  for (size_t i : todo) ids.push_back(actors[i].id);
  auto existing = ids.empty() ? Result<std::vector<std::optional<ActorRecord>>>(std::vector<std::optional<ActorRecord>>{})
                              : store_.getActors(ids);
  if (!existing.isOk()) return failAll(todo, existing.status());
  std::vector<size_t> fresh;
  for (size_t k = 0; k < todo.size(); ++k) {
    size_t i = todo[k];
    if ((*existing)[k]) {
      results[i] = std::move(*(*existing)[k]);
      continue;
    }
    ActorRecord& actor = actors[i];
    if (!actor.name.empty()) {
      auto claimed = store_.claimActorName(actor.name, actor.id);
      if (!claimed.isOk()) {
        fail(i, claimed.status());
        continue;
      }
      if (!*claimed) {
        fail(i, Status(StatusCode::kAlreadyExists,
                       fmt::format("an actor named '{}' already exists; use get_actor('{}') or another name", actor.name,
                                   actor.name)));
        continue;
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
    fresh.push_back(i);
  }

  std::vector<ActorRecord*> placing;
  for (size_t i : fresh) placing.push_back(&actors[i]);
  auto placedAll = placeAll(placing);
  if (!placedAll.isOk()) {
    for (size_t i : fresh) {
      if (!actors[i].name.empty()) (void)store_.releaseActorName(actors[i].name, actors[i].id);
    }
    return failAll(fresh, placedAll.status());
  }
  std::vector<Status> placed(n, Status::ok());
  for (size_t k = 0; k < fresh.size(); ++k) placed[fresh[k]] = (*placedAll)[k];

  std::vector<ActorRecord> writes;
  std::vector<size_t> written;
  for (size_t i : fresh) {
    ActorRecord& actor = actors[i];
    if (!placed[i].isOk() && placed[i].code() != StatusCode::kUnavailable) {
      if (!actor.name.empty()) (void)store_.releaseActorName(actor.name, actor.id);
      fail(i, placed[i]);
      continue;
    }
    if (!placed[i].isOk()) actor.deathReason = placed[i].message();  // the pending reason, shown in status
    writes.push_back(actor);
    written.push_back(i);
  }
  if (Status put = store_.putActors(writes); !put.isOk()) return failAll(written, put);
  for (size_t i : written) {
    if (placed[i].isOk()) actions.push_back({WorkerAction::Kind::kSpawn, actors[i]});
    results[i] = std::move(actors[i]);
  }
  return finish();
}

// Placement of many: each actor on the view in turn (its claim counted before the next is
// placed), then one script makes every claim; an actor whose claim was refused (the view was
// stale), or that needs its bundle or a fresh view, is placed on its own (place()).
Result<std::vector<Status>> ControllerCore::placeAll(const std::vector<ActorRecord*>& actors) {
  std::vector<Status> placed(actors.size(), Status::ok());
  std::vector<size_t> alone, claimed;
  std::vector<Reservation> claims;
  auto view = actors.empty() ? Result<const std::vector<scheduler::NodeView>*>(&views_) : nodeView(false);
  bool fresh = false;
  for (size_t k = 0; k < actors.size(); ++k) {
    ActorRecord& actor = *actors[k];
    if (!view.isOk() || !actor.placementGroup.empty()) {
      alone.push_back(k);
      continue;
    }
    std::optional<NodeId> node = pickIndexed(actor.resources);
    if (!node && !fresh) {
      // Nothing fits on the recent view: read the nodes once for the whole batch (not once per
      // actor: a full cluster with hundreds waiting read every node hundreds of times a pass).
      view = nodeView(true);
      fresh = true;
      if (!view.isOk()) return view.status();
      for (size_t c = 0; c < claims.size(); ++c) counted({claims[c]});  // this batch's claims, again
      node = pickIndexed(actor.resources);
    }
    if (!node) {
      auto why = scheduler::pickNode(**view, actor.resources);  // pending or infeasible, and why
      placed[k] = why.isOk() ? Status(StatusCode::kUnavailable, "pending: no node fits now") : why.status();
      continue;
    }
    claims.push_back(Reservation{*node, actorHolder(actor.id), actor.resources});
    counted({claims.back()});
    claimed.push_back(k);
  }
  if (!claims.empty()) {
    auto made = store_.reserveEach(claims);
    if (!made.isOk()) {
      counted(claims, -1);
      return made.status();
    }
    for (size_t c = 0; c < claimed.size(); ++c) {
      if ((*made)[c]) {
        actors[claimed[c]]->nodeId = claims[c].nodeId;
      } else {
        counted({claims[c]}, -1);
        alone.push_back(claimed[c]);
      }
    }
  }
  for (size_t k : alone) placed[k] = place(*actors[k]);
  return placed;
}

Result<ActorRecord> ControllerCore::actorReady(const ActorId& id, uint32_t incarnation, const std::string& address,
                                               int64_t pid) {
  return std::move(actorsReady({ReadyReport{id, incarnation, address, pid}})[0]);
}

std::vector<Result<ActorRecord>> ControllerCore::actorsReady(const std::vector<ReadyReport>& reports) {
  std::vector<Result<ActorRecord>> out;
  out.reserve(reports.size());
  std::vector<ActorId> ids;
  std::unordered_map<ActorId, size_t> slot;  // id -> its record in `records`
  for (const auto& r : reports) {
    if (slot.emplace(r.id, ids.size()).second) ids.push_back(r.id);
  }
  auto read = ids.empty() ? Result<std::vector<std::optional<ActorRecord>>>(std::vector<std::optional<ActorRecord>>{})
                          : store_.getActors(ids);
  if (!read.isOk()) {
    for (size_t i = 0; i < reports.size(); ++i) out.push_back(read.status());
    return out;
  }
  auto& records = *read;
  std::vector<bool> changed(records.size(), false);
  // Applied in order on the records read, as one report after another would be.
  std::vector<std::optional<ActorRecord>> seen;
  for (const auto& r : reports) {
    auto& actor = records[slot.at(r.id)];
    if (!actor) {
      seen.emplace_back();
      continue;
    }
    bool stale = actor->incarnation != r.incarnation || actor->state == ActorState::kDead;
    bool repeated = actor->state == ActorState::kAlive && actor->address == r.address;
    if (!stale && !repeated) {
      actor->state = ActorState::kAlive;
      actor->address = r.address;
      actor->pid = r.pid;
      actor->updatedMs = wallClockMs();
      changed[slot.at(r.id)] = true;
    }
    seen.push_back(*actor);
  }
  std::vector<ActorRecord> writes;
  for (size_t k = 0; k < records.size(); ++k) {
    if (changed[k]) writes.push_back(*records[k]);
  }
  Status put = store_.putActors(writes);
  for (size_t i = 0; i < reports.size(); ++i) {
    if (!seen[i]) {
      out.push_back(Status(StatusCode::kNotFound, fmt::format("no actor with id {}", reports[i].id.hex())));
    } else if (!put.isOk() && changed[slot.at(reports[i].id)]) {
      out.push_back(put);
    } else {
      out.push_back(std::move(*seen[i]));
    }
  }
  return out;
}

class ControllerCore::Incident {
 public:
  explicit Incident(ControllerCore& core) : core_(core), outer_(core.incident_ == nullptr) {
    if (outer_) core_.incident_ = &ends_;
  }
  // Written on every way out, errors included: the members did end.
  ~Incident() {
    if (!outer_) return;
    core_.incident_ = nullptr;
    for (const auto& [group, ends] : ends_) core_.groupEnded(group, ends);
  }
  Incident(const Incident&) = delete;
  Incident& operator=(const Incident&) = delete;

 private:
  ControllerCore& core_;
  const bool outer_;
  std::map<std::string, std::vector<MemberEnd>> ends_;
};

void ControllerCore::memberEnded(const ActorRecord& actor, const std::string& reason, bool restarting) {
  if (actor.placementGroup.empty()) return;
  MemberEnd end{actor.type, actor.id, reason, restarting};
  std::string group = actor.placementGroup.hex();
  if (incident_ != nullptr) {
    (*incident_)[group].push_back(std::move(end));
    return;
  }
  groupEnded(group, {end});
}

// The group's epoch advances (its survivors' collectives fail fast and they meet again at the new
// epoch) and the group records why. A second advance before anyone joined the first one would
// abort nothing more, but it would be read as a second failure: one lost host (a trainer, its
// dataloader and checkpoint actor, then the driver's removal of their bundle) made eight.
void ControllerCore::groupEnded(const std::string& id, const std::vector<MemberEnd>& ends) {
  if (ends.empty()) return;
  auto group = store_.getElasticGroup(id);
  if (!group.isOk() || !group->has_value()) return;
  const int64_t current = (*group)->epoch;
  std::string who;
  bool oneReason = true;
  for (const auto& e : ends) oneReason = oneReason && e.reason == ends.front().reason;
  for (const auto& e : ends) {
    if (!who.empty()) who += oneReason ? ", " : "; ";
    who += fmt::format("{} {} ({})", e.type, e.id.hex(), e.restarting ? "restarting" : "not restarted");
    if (!oneReason) who += " ended: " + e.reason;
  }
  if (oneReason) who += " ended: " + ends.front().reason;
  const auto now = std::chrono::steady_clock::now();
  auto last = advanced_.find(id);
  if (last != advanced_.end() && last->second.epoch == current && now - last->second.at < kOneRecovery) {
    // Nobody joined since: unless a rendezvous of this very epoch began (a join that read the
    // epoch before the advance), the advance already made covers this end too.
    auto joining = store_.getRendezvous(id, current);
    if (joining.isOk() && joining->empty()) {
      (void)store_.appendGroupEvent(id, fmt::format("{} epoch {} (the same recovery): {}", wallClockMs(), current, who));
      return;
    }
  }
  auto epoch = store_.advanceGroupEpoch(id, current + 1);
  // A join of current + 1 that began since the read is no advance: go past it.
  if (epoch.isOk() && *epoch != current + 1) epoch = store_.advanceGroupEpoch(id, *epoch + 1);
  if (!epoch.isOk()) {
    TROUPE_LOG(kWarning, "group {}: could not advance its epoch: {}", id, epoch.status().toString());
    return;
  }
  if (advanced_.size() >= 1024) {
    std::erase_if(advanced_, [&](const auto& entry) { return now - entry.second.at >= kOneRecovery; });
  }
  advanced_[id] = Advanced{*epoch, now};
  (void)store_.appendGroupEvent(id, fmt::format("{} epoch {}: {}", wallClockMs(), *epoch, who));
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

// endIncarnation(actor, reason, true) for actors outside groups that restart, in a few round
// trips for the lot (placeAll, one pipelined write). Their old claims are the caller's to release.
Status ControllerCore::restartAll(std::vector<ActorRecord> actors, const std::string& reason,
                                  std::vector<WorkerAction>& actions) {
  if (actors.empty()) return Status::ok();
  std::vector<int> quick(actors.size(), 0);
  std::vector<ActorRecord*> placing;
  for (size_t k = 0; k < actors.size(); ++k) {
    ActorRecord& actor = actors[k];
    const bool ranLong = actor.state == ActorState::kAlive && wallClockMs() - actor.updatedMs >= kStableRunMs;
    if (ranLong) {
      quickEnds_.erase(actor.id);
    } else {
      quick[k] = ++quickEnds_[actor.id];
    }
    actor.address.clear();
    actor.pid = 0;
    actor.deathReason = reason;
    actor.updatedMs = wallClockMs();
    actor.state = ActorState::kRestarting;
    actor.restarts += 1;
    actor.incarnation += 1;
    actor.nodeId = NodeId();
    placing.push_back(&actor);
  }
  TROUPE_ASSIGN_OR_RETURN(auto placed, placeAll(placing));
  for (size_t k = 0; k < actors.size(); ++k) {
    ActorRecord& actor = actors[k];
    const Status& status = placed[k];
    if (!status.isOk()) {
      actor.nodeId = NodeId();
      if (status.code() != StatusCode::kUnavailable) {
        actor.state = ActorState::kDead;
        actor.deathReason = fmt::format("{}; cannot restart: {}", reason, status.message());
        if (!actor.name.empty()) (void)store_.releaseActorName(actor.name, actor.id);
      }
    }
  }
  TROUPE_RETURN_IF_ERROR(store_.putActors(actors));
  for (size_t k = 0; k < actors.size(); ++k) {
    if (placed[k].isOk()) actions.push_back({WorkerAction::Kind::kSpawn, actors[k], restartBackoff(quick[k])});
  }
  return Status::ok();
}

Status ControllerCore::workerExited(const ActorId& id, uint32_t incarnation, const std::string& reason,
                                    std::vector<WorkerAction>& actions, bool final) {
  TROUPE_ASSIGN_OR_RETURN(auto actor, getActor(id));
  if (actor.incarnation != incarnation || actor.state == ActorState::kDead) return Status::ok();  // stale or repeated
  return endIncarnation(actor, reason, !final, actions);
}

Status ControllerCore::killActor(const ActorId& id, bool noRestart, std::vector<WorkerAction>& actions) {
  TROUPE_ASSIGN_OR_RETURN(auto actor, getActor(id));
  if (actor.state == ActorState::kDead) return Status::ok();
  if (!actor.nodeId.empty()) actions.push_back({WorkerAction::Kind::kKill, actor});
  if (!noRestart) return Status::ok();  // its exit report applies the restart policy
  return endIncarnation(actor, "killed on request (kill with no_restart)", false, actions);
}

Status ControllerCore::nodesDied(const std::vector<NodeId>& nodes, std::vector<WorkerAction>& actions) {
  std::set<NodeId> dead(nodes.begin(), nodes.end());
  Incident incident(*this);  // a group's members on these nodes: one epoch advance
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
      TROUPE_ASSIGN_OR_RETURN(auto group, store_.getPlacementGroup(id));
      if (!group.has_value() || group->state == PlacementGroupState::kRemoved) continue;
      bool changed = false;
      for (Bundle& b : group->bundles) {
        if (!b.nodeId.empty() && dead.count(b.nodeId)) {
          b.nodeId = NodeId();
          changed = true;
        }
      }
      if (changed) {
        group->state = PlacementGroupState::kPending;
        group->pendingReason = "pending: a node holding some of its bundles died";
        TROUPE_RETURN_IF_ERROR(store_.putPlacementGroup(*group));
      }
    }
    TROUPE_ASSIGN_OR_RETURN(auto actors, store_.listNodeActors(node));
    const std::string reason = fmt::format("its node {} died", node.hex());
    std::vector<ActorRecord> restarting;  // moved together (their claims go with the node's, below)
    for (const auto& actor : actors) {
      if (actor.state == ActorState::kDead || actor.nodeId != node) continue;
      bool restarts = actor.maxRestarts == -1 || actor.restarts < actor.maxRestarts;
      if (restarts && actor.placementGroup.empty()) {
        restarting.push_back(actor);
        continue;
      }
      TROUPE_RETURN_IF_ERROR(endIncarnation(actor, reason, true, actions));
    }
    TROUPE_RETURN_IF_ERROR(restartAll(std::move(restarting), reason, actions));
    // Whatever is claimed on a dead node now is held by nothing that runs there.
    std::vector<Reservation> release;
    for (const auto& [holder, resources] : *claims) release.push_back(Reservation{node, holder, {}});
    TROUPE_RETURN_IF_ERROR(store_.release(release));
  }
  return retryPending(actions);
}

Status ControllerCore::ownerGone(const std::string& owner, std::vector<WorkerAction>& actions) {
  if (owner.empty()) return Status::ok();
  TROUPE_ASSIGN_OR_RETURN(auto actors, store_.listLiveActors());
  Incident incident(*this);
  for (const auto& actor : actors) {
    if (actor.owner != owner || actor.detached || actor.state == ActorState::kDead) continue;
    if (!actor.nodeId.empty()) actions.push_back({WorkerAction::Kind::kKill, actor});
    TROUPE_RETURN_IF_ERROR(
        endIncarnation(actor, "its owner (the driver that created it) went away; use lifetime=detached to keep an actor",
                       false, actions));
  }
  return Status::ok();
}

Status ControllerCore::reconcileDeadNodes(std::vector<WorkerAction>& actions) {
  TROUPE_ASSIGN_OR_RETURN(auto dead, store_.listDeadNodesWithWork());
  if (dead.empty()) return Status::ok();
  return nodesDied(dead, actions);
}

Result<bool> ControllerCore::reconcileDeadNodes(std::vector<WorkerAction>& actions, size_t maxNodes) {
  TROUPE_ASSIGN_OR_RETURN(auto dead, store_.listDeadNodesWithWork());
  if (dead.empty()) return false;
  bool more = dead.size() > maxNodes;
  if (more) dead.resize(maxNodes);
  TROUPE_RETURN_IF_ERROR(nodesDied(dead, actions));
  return more;
}

Result<const std::vector<scheduler::NodeView>*> ControllerCore::nodeView(bool fresh) {
  auto now = std::chrono::steady_clock::now();
  if (fresh || views_.empty() || now - nodesRead_ > kNodeViewMaxAge) {
    TROUPE_ASSIGN_OR_RETURN(auto nodes, store_.listNodes());
    views_ = scheduler::viewsOf(nodes);
    viewIndex_.clear();
    byFree_.clear();
    keyOf_.assign(views_.size(), RankKey{});
    for (size_t i = 0; i < views_.size(); ++i) {
      viewIndex_[views_[i].id] = i;
      rank(i);
    }
    nodesRead_ = now;
  }
  // Kept between calls, not copied: a placement reads the index, not every node.
  return &views_;
}

namespace {
double quantity(const Resources& r, const std::string& name) {
  auto it = r.find(name);
  return it == r.end() ? 0.0 : it->second;
}
}  // namespace

// The key is computed as pickNode computes its order (free CPU, then the sum of per-resource
// utilisation over `total`, then id), so the first node in the index that fits is its choice.
void ControllerCore::rank(size_t i) {
  const scheduler::NodeView& node = views_[i];
  if (i < keyOf_.size() && !std::get<2>(keyOf_[i]).empty()) byFree_.erase(keyOf_[i]);
  if (!node.alive) {
    keyOf_[i] = RankKey{};
    return;
  }
  static const std::string kCpu = "CPU";
  double utilisation = 0;
  for (const auto& [name, total] : node.total) {
    if (total > 0) utilisation += quantity(node.used, name) / total;
  }
  keyOf_[i] = RankKey{-(quantity(node.total, kCpu) - quantity(node.used, kCpu)), utilisation, node.id};
  byFree_.insert(keyOf_[i]);
}

void ControllerCore::counted(const std::vector<Reservation>& claims, double sign) {
  for (const Reservation& claim : claims) {
    auto it = viewIndex_.find(claim.nodeId);
    if (it == viewIndex_.end()) continue;
    Resources& used = views_[it->second].used;
    for (const auto& [name, qty] : claim.resources) used[name] += sign * qty;
    rank(it->second);
  }
}

std::optional<NodeId> ControllerCore::pickIndexed(const Resources& demand) const {
  for (const auto& key : byFree_) {
    const scheduler::NodeView& node = views_[viewIndex_.at(std::get<2>(key))];
    if (scheduler::fits(scheduler::available(node), demand)) return node.id;
  }
  return std::nullopt;
}

std::vector<scheduler::NodeView> ControllerCore::shortlist(const std::vector<Resources>& demands,
                                                           const std::vector<NodeId>& existing, size_t limit) const {
  std::set<size_t> chosen;
  for (const NodeId& id : existing) {
    auto it = viewIndex_.find(id);
    if (it != viewIndex_.end()) chosen.insert(it->second);
  }
  for (const Resources& demand : demands) {
    size_t found = 0;
    for (const auto& key : byFree_) {
      if (found >= limit) break;
      size_t i = viewIndex_.at(std::get<2>(key));
      if (!scheduler::fits(scheduler::available(views_[i]), demand)) continue;
      chosen.insert(i);
      ++found;
    }
  }
  std::vector<scheduler::NodeView> out;
  out.reserve(chosen.size());
  for (size_t i : chosen) out.push_back(views_[i]);
  return out;
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
    // First on a few nodes (the freest that fit, and the group's own), copying those alone; the
    // whole cluster only when they cannot hold it (which also tells pending from infeasible).
    std::optional<Result<std::vector<NodeId>>> placement;
    const size_t limit = std::max<size_t>(8, 2 * demands.size());
    if ((*nodes)->size() > limit + existing.size()) {
      auto few = shortlist(demands, existing, limit);
      auto tried = scheduler::placeBundles(few, demands, group.strategy, existing);
      if (tried.isOk()) placement = std::move(tried);
    }
    if (!placement) placement = scheduler::placeBundles(**nodes, demands, group.strategy, existing);
    if (!placement->isOk() && !fresh) continue;  // decided on a recent view: ask the store
    if (!placement->isOk()) return placement->status();
    const std::vector<NodeId>& chosen = **placement;
    std::vector<Reservation> claims;
    for (size_t k = 0; k < todo.size(); ++k) {
      claims.push_back({chosen[k], bundleHolder(group.id, todo[k]), demands[k]});
    }
    for (size_t k = 0; k < todo.size(); ++k) group.bundles[todo[k]].nodeId = chosen[k];
    TROUPE_ASSIGN_OR_RETURN(auto reserved, claim(claims));
    if (reserved) {
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
    TROUPE_ASSIGN_OR_RETURN(auto created, store_.createPlacementGroup(group, claims));
    if (created.outcome == GroupCreation::Outcome::kExists) existing = std::move(created.existing);
    return created.outcome != GroupCreation::Outcome::kRefused;
  });
  if (existing) return std::move(*existing);
  if (placed.isOk()) return group;
  if (placed.code() != StatusCode::kUnavailable) return placed;
  group.state = PlacementGroupState::kPending;
  group.pendingReason = placed.message();
  TROUPE_ASSIGN_OR_RETURN(auto created, store_.createPlacementGroup(group, {}));
  if (created.outcome == GroupCreation::Outcome::kExists) return std::move(*created.existing);
  return group;
}

Status ControllerCore::removePlacementGroup(const PlacementGroupId& id, std::vector<WorkerAction>& actions) {
  // A group without live actors goes in one store call; one with actors ends them first.
  TROUPE_ASSIGN_OR_RETURN(auto removal, store_.removePlacementGroup(id));
  if (removal.outcome != GroupRemoval::Outcome::kHasActors) {
    return removal.pendingWork ? retryPending(actions) : Status::ok();
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
  advanced_.erase(id.hex());
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
  // Actors in removed bundles end first (no restart: their bundle is gone), in one epoch advance.
  TROUPE_ASSIGN_OR_RETURN(auto actors, store_.listGroupActors(group.id));
  Incident incident(*this);
  for (const auto& actor : actors) {
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
  TROUPE_ASSIGN_OR_RETURN(auto pending, store_.listPendingWork());
  for (auto& group : pending.groups) {
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
  // The waiting actors together: one claims script, one read of the nodes at most, one write.
  std::vector<ActorRecord*> waiting;
  for (auto& actor : pending.actors) {
    if (waitsForNode(actor)) waiting.push_back(&actor);
  }
  TROUPE_ASSIGN_OR_RETURN(auto placed, placeAll(waiting));
  std::vector<ActorRecord> writes;
  for (size_t k = 0; k < waiting.size(); ++k) {
    if (!placed[k].isOk()) continue;  // still waiting; its reason stays
    ActorRecord& actor = *waiting[k];
    if (actor.state == ActorState::kPending) actor.deathReason.clear();
    actor.updatedMs = wallClockMs();
    writes.push_back(actor);
  }
  TROUPE_RETURN_IF_ERROR(store_.putActors(writes));
  for (auto& actor : writes) actions.push_back({WorkerAction::Kind::kSpawn, std::move(actor)});
  return Status::ok();
}

Result<ActorRecord> ControllerCore::getActor(const ActorId& id) {
  auto actor = store_.getActor(id);
  if (!actor.isOk()) return actor.status();
  if (!actor->has_value()) return Status(StatusCode::kNotFound, fmt::format("no actor with id {}", id.hex()));
  return **actor;
}

Result<ActorRecord> ControllerCore::getActorByName(const std::string& name) {
  TROUPE_ASSIGN_OR_RETURN(auto id, store_.lookupActorName(name));
  if (!id.has_value()) return Status(StatusCode::kNotFound, fmt::format("no live actor named '{}'", name));
  return getActor(*id);
}

Result<PlacementGroupRecord> ControllerCore::getPlacementGroup(const PlacementGroupId& id) {
  auto group = store_.getPlacementGroup(id);
  if (!group.isOk()) return group.status();
  if (!group->has_value()) return Status(StatusCode::kNotFound, fmt::format("no placement group with id {}", id.hex()));
  return **group;
}

}  // namespace troupe
