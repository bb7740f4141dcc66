// In-memory ClusterStore for fast unit tests. Mirrors redis_cluster_store.cc call for call:
// the same suite (cluster_store_test.cc) runs against both, so a difference is a bug here.
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <set>

#include <fmt/format.h>

#include "store_args.h"
#include "store_records.h"
#include "troupe/runtime/cluster_store.h"
#include "troupe/runtime/config.h"

namespace troupe {

using store_args::checkGroupArgs;
using store_args::checkKeySpaceArgs;
using store_records::parseInteger;
using store_args::checkNameArgs;
using store_args::checkRendezvousArgs;
using store_args::checkNodeArgs;
using store_args::checkReservations;
using store_args::emptyArgument;
using store_args::emptyId;

// Shared by every store made from it, as one Redis is shared by its connections. All fields
// are guarded by `mutex`.
struct FakeClusterState {
  // One subscriber's pending events (the fake's pub/sub channel).
  struct EventQueue {
    std::mutex mutex;
    std::condition_variable ready;
    std::deque<ClusterEvent> events;
  };

  struct Node {
    NodeRecord record;
    // The heartbeat "key" exists while now < heartbeatExpiry. steady_clock, like Redis' own
    // expiry, so a wall-clock jump neither kills nor revives nodes.
    std::chrono::steady_clock::time_point heartbeatExpiry;
  };

  std::mutex mutex;
  std::optional<ClusterMeta> meta;
  std::string storeGateway;
  std::map<NodeId, Node> nodes;
  // Node -> holder -> claimed resources. A node without claims has no entry, as a Redis hash
  // with no fields does not exist.
  std::map<NodeId, std::map<std::string, Resources>> claims;
  std::map<ActorId, ActorRecord> actors;
  std::map<std::string, ActorId> actorNames;
  std::map<PlacementGroupId, PlacementGroupRecord> placementGroups;
  std::map<std::string, std::string> sessions;
  // Weak: a subscription that is destroyed simply stops receiving, like a closed connection.
  std::vector<std::weak_ptr<EventQueue>> subscribers;

  // One group-epoch watch's pending advances (the fake's per-group epoch channel).
  struct EpochQueue {
    std::mutex mutex;
    std::condition_variable ready;
    std::deque<int64_t> epochs;
    bool interrupted = false;
  };
  // A rendezvous of one (group, epoch): rank -> value, gone at `expiry` like a PEXPIRE'd hash.
  struct Rendezvous {
    std::map<int32_t, std::string> entries;
    std::chrono::steady_clock::time_point expiry;
  };
  std::map<std::string, int64_t> groupEpochs;
  std::map<std::string, std::vector<std::weak_ptr<EpochQueue>>> epochWatchers;
  std::map<std::pair<std::string, int64_t>, Rendezvous> rendezvous;
  // A key space: key -> value, gone at `expiry` like a PEXPIRE'd hash.
  struct KeySpace {
    std::map<std::string, std::string> values;
    std::chrono::steady_clock::time_point expiry;
  };
  std::map<std::string, KeySpace> keySpaces;
  // Elastic groups: id -> (doc, events); listed by (creation ms, id) as Redis's zset does.
  std::set<std::pair<int64_t, std::string>> elasticOrder;
  std::map<std::string, std::pair<std::string, std::vector<std::string>>> elasticGroups;

  // Caller holds `mutex`. Sets the node's `used` to the sum of its claims, listing every
  // resource in `total` (0 when unclaimed).
  void recomputeUsed(NodeRecord& node) {
    Resources used;
    for (const auto& [name, amount] : node.total) used[name] = 0;
    if (auto it = claims.find(node.id); it != claims.end()) {
      for (const auto& [holder, resources] : it->second) {
        for (const auto& [name, amount] : resources) used[name] += amount;
      }
    }
    node.used = std::move(used);
  }

  // Caller holds `mutex`. Adds sign * delta to the node's `used`, as the Redis store's addUsed
  // does: a sum back within 1e-9 of zero (relative to the total) is 0.
  static void addUsed(NodeRecord& node, const Resources& delta, double sign) {
    for (const auto& [name, amount] : node.total) node.used.try_emplace(name, 0);
    for (const auto& [name, amount] : delta) {
      double sum = node.used[name] + sign * amount;
      auto total = node.total.find(name);
      if (std::abs(sum) <= 1e-9 * std::max(1.0, total == node.total.end() ? 0.0 : total->second)) sum = 0;
      node.used[name] = sum;
    }
  }

  // Caller holds `mutex`. Lock order: state mutex, then a queue's mutex.
  void publish(const ClusterEvent& event) {
    std::erase_if(subscribers, [](const std::weak_ptr<EventQueue>& weak) { return weak.expired(); });
    for (const auto& weak : subscribers) {
      if (auto queue = weak.lock()) {
        {
          std::lock_guard lock(queue->mutex);
          queue->events.push_back(event);
        }
        queue->ready.notify_all();
      }
    }
  }
};

namespace {

using Clock = std::chrono::steady_clock;

class FakeEventSubscription final : public EventSubscription {
 public:
  explicit FakeEventSubscription(std::shared_ptr<FakeClusterState::EventQueue> queue)
      : queue_(std::move(queue)) {}

  Result<std::optional<ClusterEvent>> next(std::chrono::milliseconds timeout) override {
    std::unique_lock lock(queue_->mutex);
    if (!queue_->ready.wait_for(lock, timeout, [this] { return !queue_->events.empty(); })) {
      return std::optional<ClusterEvent>();
    }
    ClusterEvent event = std::move(queue_->events.front());
    queue_->events.pop_front();
    return std::optional<ClusterEvent>(std::move(event));
  }

 private:
  std::shared_ptr<FakeClusterState::EventQueue> queue_;
};

class FakeGroupEpochWatch final : public GroupEpochWatch {
 public:
  explicit FakeGroupEpochWatch(std::shared_ptr<FakeClusterState::EpochQueue> queue)
      : queue_(std::move(queue)) {}

  Result<std::optional<int64_t>> next(std::chrono::milliseconds timeout) override {
    std::unique_lock lock(queue_->mutex);
    if (!queue_->ready.wait_for(lock, timeout, [this] {
          return queue_->interrupted || !queue_->epochs.empty();
        })) {
      return std::optional<int64_t>();
    }
    if (queue_->interrupted) return std::optional<int64_t>();
    const int64_t epoch = queue_->epochs.front();
    queue_->epochs.pop_front();
    return std::optional<int64_t>(epoch);
  }

  void interrupt() override {
    {
      std::lock_guard lock(queue_->mutex);
      queue_->interrupted = true;
    }
    queue_->ready.notify_all();
  }

 private:
  std::shared_ptr<FakeClusterState::EpochQueue> queue_;
};

class FakeClusterStore final : public ClusterStore {
 public:
  explicit FakeClusterStore(std::shared_ptr<FakeClusterState> state) : state_(std::move(state)) {}

  Status putMeta(const ClusterMeta& meta) override {
    std::lock_guard lock(state_->mutex);
    state_->meta = meta;
    return Status::ok();
  }

  Result<std::optional<ClusterMeta>> getMeta() override {
    std::lock_guard lock(state_->mutex);
    if (state_->meta) state_->meta->storeGateway = state_->storeGateway;
    return state_->meta;
  }

  Status putStoreGateway(const std::string& address) override {
    std::lock_guard lock(state_->mutex);
    state_->storeGateway = address;
    return Status::ok();
  }

  Status registerNode(const NodeRecord& node, std::chrono::milliseconds ttl) override {
    TROUPE_RETURN_IF_ERROR(checkNodeArgs(node.id, ttl));
    const int64_t now = wallClockMs();
    std::lock_guard lock(state_->mutex);
    FakeClusterState::Node& stored = state_->nodes[node.id];
    stored.record = node;
    stored.record.state = NodeState::kAlive;
    stored.record.deathReason.clear();
    stored.record.registeredMs = node.registeredMs != 0 ? node.registeredMs : now;
    stored.record.lastHeartbeatMs = now;
    stored.heartbeatExpiry = Clock::now() + ttl;
    if (state_->claims.contains(node.id)) state_->recomputeUsed(stored.record);
    state_->publish(ClusterEvent{ClusterEventType::kNodeAdded, node.id, "", now});
    return Status::ok();
  }

  Result<bool> heartbeat(const NodeId& id, std::chrono::milliseconds ttl) override {
    TROUPE_RETURN_IF_ERROR(checkNodeArgs(id, ttl));
    std::lock_guard lock(state_->mutex);
    auto it = state_->nodes.find(id);
    if (it == state_->nodes.end() || it->second.record.state != NodeState::kAlive) return false;
    it->second.heartbeatExpiry = Clock::now() + ttl;
    it->second.record.lastHeartbeatMs = wallClockMs();
    return true;
  }

  Result<std::optional<NodeRecord>> getNode(const NodeId& id) override {
    if (id.empty()) return emptyId();
    std::lock_guard lock(state_->mutex);
    auto it = state_->nodes.find(id);
    if (it == state_->nodes.end()) return std::optional<NodeRecord>();
    return std::optional<NodeRecord>(it->second.record);
  }

  Result<std::vector<NodeRecord>> listNodes() override {
    std::vector<NodeRecord> nodes;
    {
      std::lock_guard lock(state_->mutex);
      for (const auto& [id, node] : state_->nodes) nodes.push_back(node.record);
    }
    // Redis' zset order: by score (registered_ms), then by member (the id).
    std::sort(nodes.begin(), nodes.end(), [](const NodeRecord& a, const NodeRecord& b) {
      return std::tie(a.registeredMs, a.id) < std::tie(b.registeredMs, b.id);
    });
    return nodes;
  }

  Result<std::vector<NodeId>> reapExpiredNodes() override {
    const int64_t now = wallClockMs();
    const auto steadyNow = Clock::now();
    std::vector<NodeId> dead;
    std::lock_guard lock(state_->mutex);
    for (auto& [id, node] : state_->nodes) {
      if (node.record.state != NodeState::kAlive || steadyNow < node.heartbeatExpiry) continue;
      node.record.state = NodeState::kDead;
      node.record.deathReason =
          fmt::format("missed heartbeats: no heartbeat for {} ms (heartbeat TTL expired)",
                      now - node.record.lastHeartbeatMs);
      state_->publish(ClusterEvent{ClusterEventType::kNodeDead, id, node.record.deathReason, now});
      dead.push_back(id);
    }
    return dead;
  }

  Status markNodeDead(const NodeId& id, const std::string& reason) override {
    if (id.empty()) return emptyId();
    std::lock_guard lock(state_->mutex);
    auto it = state_->nodes.find(id);
    if (it == state_->nodes.end()) {
      return Status(StatusCode::kNotFound,
                    fmt::format("node {} is not registered in this (fake) cluster", id.hex()));
    }
    FakeClusterState::Node& node = it->second;
    if (node.record.state != NodeState::kAlive) return Status::ok();
    node.record.state = NodeState::kDead;
    node.record.deathReason = reason;
    node.heartbeatExpiry = Clock::time_point::min();
    state_->publish(ClusterEvent{ClusterEventType::kNodeDead, id, reason, wallClockMs()});
    return Status::ok();
  }

  Result<bool> reserve(const std::vector<Reservation>& reservations) override {
    TROUPE_RETURN_IF_ERROR(checkReservations(reservations, /*forReserve=*/true));
    std::lock_guard lock(state_->mutex);
    return reserveLocked(reservations);
  }

  bool reserveLocked(const std::vector<Reservation>& reservations) {
    // Node -> holder -> its new claim.
    std::map<NodeId, std::map<std::string, const Resources*>> wanted;
    for (const Reservation& r : reservations) wanted[r.nodeId][r.holder] = &r.resources;
    for (const auto& [nodeId, holders] : wanted) {
      auto node = state_->nodes.find(nodeId);
      if (node == state_->nodes.end() || node->second.record.state != NodeState::kAlive) {
        return false;
      }
      // A holder's new claim replaces its old one, so only the other holders count.
      Resources others = node->second.record.used;
      if (auto it = state_->claims.find(nodeId); it != state_->claims.end()) {
        for (const auto& [holder, resources] : it->second) {
          if (!holders.contains(holder)) continue;
          for (const auto& [name, amount] : resources) others[name] -= amount;
        }
      }
      Resources demand;
      for (const auto& [holder, resources] : holders) {
        for (const auto& [name, amount] : *resources) demand[name] += amount;
      }
      const Resources& total = node->second.record.total;
      for (const auto& [name, amount] : demand) {
        if (amount > 0 && valueOr(others, name) + amount > valueOr(total, name) + kEpsilon) {
          return false;
        }
      }
    }
    for (const auto& [nodeId, holders] : wanted) {
      auto& nodeClaims = state_->claims[nodeId];
      NodeRecord& node = state_->nodes.at(nodeId).record;
      for (const auto& [holder, resources] : holders) {
        if (auto old = nodeClaims.find(holder); old != nodeClaims.end()) state_->addUsed(node, old->second, -1);
        state_->addUsed(node, *resources, 1);
        nodeClaims[holder] = *resources;
      }
    }
    return true;
  }

  Status release(const std::vector<Reservation>& reservations) override {
    TROUPE_RETURN_IF_ERROR(checkReservations(reservations, /*forReserve=*/false));
    std::lock_guard lock(state_->mutex);
    releaseLocked(reservations);
    return Status::ok();
  }

  void releaseLocked(const std::vector<Reservation>& reservations) {
    for (const Reservation& r : reservations) {
      auto it = state_->claims.find(r.nodeId);
      if (it == state_->claims.end()) continue;
      auto held = it->second.find(r.holder);
      if (held == it->second.end()) continue;
      if (auto node = state_->nodes.find(r.nodeId); node != state_->nodes.end()) {
        state_->addUsed(node->second.record, held->second, -1);
      }
      it->second.erase(held);
      if (it->second.empty()) state_->claims.erase(it);
    }
  }

  Result<std::map<std::string, Resources>> reservations(const NodeId& node) override {
    if (node.empty()) return emptyId();
    std::lock_guard lock(state_->mutex);
    auto it = state_->claims.find(node);
    if (it == state_->claims.end()) return std::map<std::string, Resources>();
    return it->second;
  }

  Status putActor(const ActorRecord& actor) override {
    if (actor.id.empty()) return emptyArgument("actor id");
    std::lock_guard lock(state_->mutex);
    state_->actors[actor.id] = actor;
    return Status::ok();
  }

  Result<std::optional<ActorRecord>> getActor(const ActorId& id) override {
    if (id.empty()) return emptyArgument("actor id");
    std::lock_guard lock(state_->mutex);
    auto it = state_->actors.find(id);
    if (it == state_->actors.end()) return std::optional<ActorRecord>();
    return std::optional<ActorRecord>(it->second);
  }

  Result<std::vector<ActorRecord>> listActors() override {
    std::vector<ActorRecord> actors;
    {
      std::lock_guard lock(state_->mutex);
      for (const auto& [id, actor] : state_->actors) actors.push_back(actor);
    }
    for (auto& a : actors) a.initArgs.clear();  // as Redis lists them
    // Redis' zset order: by score (created_ms), then by member (the id).
    std::sort(actors.begin(), actors.end(), [](const ActorRecord& a, const ActorRecord& b) {
      return std::tie(a.createdMs, a.id) < std::tie(b.createdMs, b.id);
    });
    return actors;
  }

  Result<ActorPage> listActorsPage(const ActorQuery& query) override {
    auto all = listActors();
    if (!all.isOk()) return all.status();
    ActorPage page;
    for (auto& a : *all) {
      page.countsByState[a.state] += 1;
      if ((query.state && a.state != *query.state) || !a.nodeId.hex().starts_with(query.nodePrefix)) continue;
      if (page.matching >= query.offset && page.matching - query.offset < query.limit) page.actors.push_back(std::move(a));
      page.matching += 1;
    }
    return page;
  }

  Result<std::vector<ActorRecord>> listLiveActors() override {
    std::vector<ActorRecord> live;
    {
      std::lock_guard lock(state_->mutex);
      for (const auto& [id, actor] : state_->actors) {
        if (actor.state != ActorState::kDead) live.push_back(actor);
      }
    }
    std::sort(live.begin(), live.end(), [](const ActorRecord& a, const ActorRecord& b) {
      return std::tie(a.createdMs, a.id) < std::tie(b.createdMs, b.id);
    });
    return live;
  }

  Result<std::vector<ActorRecord>> listNodeActors(const NodeId& node) override {
    if (node.empty()) return emptyId();
    auto live = listLiveActors();
    if (!live.isOk()) return live.status();
    std::erase_if(*live, [&](const ActorRecord& a) { return a.nodeId != node; });
    return live;
  }

  Result<std::vector<NodeId>> listDeadNodesWithWork() override {
    std::lock_guard lock(state_->mutex);
    std::set<NodeId> busy;
    for (const auto& [id, claims] : state_->claims) busy.insert(id);
    for (const auto& [id, actor] : state_->actors) {
      if (actor.state != ActorState::kDead && !actor.nodeId.empty()) busy.insert(actor.nodeId);
    }
    std::vector<NodeId> out;
    for (const auto& [id, node] : state_->nodes) {
      if (node.record.state == NodeState::kDead && busy.count(id)) out.push_back(id);
    }
    return out;
  }

  Result<bool> claimActorName(const std::string& name, const ActorId& id) override {
    TROUPE_RETURN_IF_ERROR(checkNameArgs(name, id));
    std::lock_guard lock(state_->mutex);
    auto [it, inserted] = state_->actorNames.try_emplace(name, id);
    return inserted || it->second == id;
  }

  Status releaseActorName(const std::string& name, const ActorId& id) override {
    TROUPE_RETURN_IF_ERROR(checkNameArgs(name, id));
    std::lock_guard lock(state_->mutex);
    auto it = state_->actorNames.find(name);
    if (it != state_->actorNames.end() && it->second == id) state_->actorNames.erase(it);
    return Status::ok();
  }

  Result<std::optional<ActorId>> lookupActorName(const std::string& name) override {
    if (name.empty()) return emptyArgument("actor name");
    std::lock_guard lock(state_->mutex);
    auto it = state_->actorNames.find(name);
    if (it == state_->actorNames.end()) return std::optional<ActorId>();
    return std::optional<ActorId>(it->second);
  }

  Status putPlacementGroup(const PlacementGroupRecord& group) override {
    if (group.id.empty()) return emptyArgument("placement group id");
    std::lock_guard lock(state_->mutex);
    state_->placementGroups[group.id] = group;
    return Status::ok();
  }

  Result<std::optional<PlacementGroupRecord>> getPlacementGroup(
      const PlacementGroupId& id) override {
    if (id.empty()) return emptyArgument("placement group id");
    std::lock_guard lock(state_->mutex);
    auto it = state_->placementGroups.find(id);
    if (it == state_->placementGroups.end()) return std::optional<PlacementGroupRecord>();
    return std::optional<PlacementGroupRecord>(it->second);
  }

  Status putSession(const std::string& id, const std::string& info) override {
    if (id.empty()) return emptyArgument("session id");
    std::lock_guard lock(state_->mutex);
    state_->sessions[id] = info;
    return Status::ok();
  }

  Status deleteSession(const std::string& id) override {
    std::lock_guard lock(state_->mutex);
    state_->sessions.erase(id);
    return Status::ok();
  }

  Result<std::map<std::string, std::string>> listSessions() override {
    std::lock_guard lock(state_->mutex);
    return state_->sessions;
  }

  Status deletePlacementGroup(const PlacementGroupId& id) override {
    if (id.empty()) return emptyArgument("placement group id");
    std::lock_guard lock(state_->mutex);
    state_->placementGroups.erase(id);
    return Status::ok();
  }

  Result<GroupCreation> createPlacementGroup(const PlacementGroupRecord& group,
                                             const std::vector<Reservation>& claims) override {
    if (group.id.empty()) return emptyArgument("placement group id");
    TROUPE_RETURN_IF_ERROR(checkReservations(claims, /*forReserve=*/true));
    std::lock_guard lock(state_->mutex);
    if (auto it = state_->placementGroups.find(group.id); it != state_->placementGroups.end()) {
      return GroupCreation{GroupCreation::Outcome::kExists, it->second};
    }
    if (!claims.empty() && !reserveLocked(claims)) return GroupCreation{GroupCreation::Outcome::kRefused, {}};
    state_->placementGroups[group.id] = group;
    return GroupCreation{GroupCreation::Outcome::kCreated, {}};
  }

  Result<GroupRemoval> removePlacementGroup(const PlacementGroupId& id) override {
    if (id.empty()) return emptyArgument("placement group id");
    std::lock_guard lock(state_->mutex);
    GroupRemoval removal{GroupRemoval::Outcome::kNotFound, false};
    auto it = state_->placementGroups.find(id);
    bool hasActors = std::any_of(state_->actors.begin(), state_->actors.end(), [&](const auto& entry) {
      return entry.second.placementGroup == id && entry.second.state != ActorState::kDead;
    });
    if (it != state_->placementGroups.end() && hasActors) {
      removal.outcome = GroupRemoval::Outcome::kHasActors;
    } else if (it != state_->placementGroups.end()) {
      std::vector<Reservation> claims;
      for (size_t i = 0; i < it->second.bundles.size(); ++i) {
        const NodeId& node = it->second.bundles[i].nodeId;
        if (!node.empty()) claims.push_back({node, fmt::format("pg:{}:{}", id.hex(), i), {}});
      }
      releaseLocked(claims);
      state_->placementGroups.erase(it);
      removal.outcome = GroupRemoval::Outcome::kRemoved;
    }
    removal.pendingWork =
        std::any_of(state_->placementGroups.begin(), state_->placementGroups.end(),
                    [](const auto& entry) { return entry.second.state == PlacementGroupState::kPending; }) ||
        std::any_of(state_->actors.begin(), state_->actors.end(),
                    [](const auto& entry) { return waitsForNode(entry.second); });
    return removal;
  }

  Result<std::vector<ActorRecord>> listGroupActors(const PlacementGroupId& id) override {
    if (id.empty()) return emptyArgument("placement group id");
    auto live = listLiveActors();
    if (!live.isOk()) return live.status();
    std::erase_if(*live, [&](const ActorRecord& a) { return a.placementGroup != id; });
    return live;
  }

  Result<PendingWork> listPendingWork() override {
    PendingWork work;
    auto groups = listPlacementGroups();
    if (!groups.isOk()) return groups.status();
    for (auto& g : *groups) {
      if (g.state == PlacementGroupState::kPending) work.groups.push_back(std::move(g));
    }
    auto actors = listLiveActors();
    if (!actors.isOk()) return actors.status();
    for (auto& a : *actors) {
      if (waitsForNode(a)) work.actors.push_back(std::move(a));
    }
    return work;
  }

  Result<std::vector<PlacementGroupRecord>> listPlacementGroups() override {
    std::vector<PlacementGroupRecord> groups;
    {
      std::lock_guard lock(state_->mutex);
      for (const auto& [id, group] : state_->placementGroups) groups.push_back(group);
    }
    std::sort(groups.begin(), groups.end(),
              [](const PlacementGroupRecord& a, const PlacementGroupRecord& b) {
                return std::tie(a.createdMs, a.id) < std::tie(b.createdMs, b.id);
              });
    return groups;
  }

  Result<std::unique_ptr<EventSubscription>> subscribe() override {
    auto queue = std::make_shared<FakeClusterState::EventQueue>();
    {
      std::lock_guard lock(state_->mutex);
      state_->subscribers.push_back(queue);
    }
    return std::unique_ptr<EventSubscription>(
        std::make_unique<FakeEventSubscription>(std::move(queue)));
  }

  Result<int64_t> groupEpoch(const std::string& group) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(group, 0));
    std::lock_guard lock(state_->mutex);
    auto it = state_->groupEpochs.find(group);
    return it == state_->groupEpochs.end() ? int64_t{0} : it->second;
  }

  Result<int64_t> advanceGroupEpoch(const std::string& group, int64_t epoch) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(group, epoch));
    std::lock_guard lock(state_->mutex);
    int64_t& current = state_->groupEpochs[group];
    if (epoch <= current) return current;
    current = epoch;
    // Lock order: state mutex, then a queue's mutex (as publish()).
    auto& watchers = state_->epochWatchers[group];
    std::erase_if(watchers, [](const auto& weak) { return weak.expired(); });
    for (const auto& weak : watchers) {
      if (auto queue = weak.lock()) {
        {
          std::lock_guard queueLock(queue->mutex);
          queue->epochs.push_back(epoch);
        }
        queue->ready.notify_all();
      }
    }
    return current;
  }

  Result<std::unique_ptr<GroupEpochWatch>> watchGroupEpoch(const std::string& group) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(group, 0));
    auto queue = std::make_shared<FakeClusterState::EpochQueue>();
    {
      std::lock_guard lock(state_->mutex);
      state_->epochWatchers[group].push_back(queue);
    }
    return std::unique_ptr<GroupEpochWatch>(std::make_unique<FakeGroupEpochWatch>(std::move(queue)));
  }

  Status putRendezvousEntry(const std::string& group, int64_t epoch, int32_t rank,
                            const std::string& value, std::chrono::milliseconds ttl) override {
    TROUPE_RETURN_IF_ERROR(checkRendezvousArgs(group, epoch, rank, ttl));
    std::lock_guard lock(state_->mutex);
    auto& rendezvous = state_->rendezvous[{group, epoch}];
    if (rendezvous.expiry <= Clock::now()) rendezvous.entries.clear();  // an expired hash is gone
    rendezvous.entries[rank] = value;
    rendezvous.expiry = Clock::now() + ttl;
    return Status::ok();
  }

  Result<std::map<int32_t, std::string>> getRendezvous(const std::string& group,
                                                       int64_t epoch) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(group, epoch));
    std::lock_guard lock(state_->mutex);
    auto it = state_->rendezvous.find({group, epoch});
    if (it == state_->rendezvous.end()) return std::map<int32_t, std::string>();
    if (it->second.expiry <= Clock::now()) {
      state_->rendezvous.erase(it);
      return std::map<int32_t, std::string>();
    }
    return it->second.entries;
  }

  Status setKey(const std::string& space, const std::string& key, const std::string& value,
                std::chrono::milliseconds ttl) override {
    TROUPE_RETURN_IF_ERROR(checkKeySpaceArgs(space, ttl));
    std::lock_guard lock(state_->mutex);
    writableSpace(space, ttl).values[key] = value;
    return Status::ok();
  }

  Result<std::vector<std::optional<std::string>>> getKeys(const std::string& space,
                                                          const std::vector<std::string>& keys) override {
    TROUPE_RETURN_IF_ERROR(checkKeySpaceArgs(space));
    std::lock_guard lock(state_->mutex);
    const auto* held = liveSpace(space);
    std::vector<std::optional<std::string>> values;
    for (const std::string& key : keys) {
      values.emplace_back();
      if (!held) continue;
      if (auto it = held->values.find(key); it != held->values.end()) values.back() = it->second;
    }
    return values;
  }

  Result<int64_t> addToKey(const std::string& space, const std::string& key, int64_t delta,
                           std::chrono::milliseconds ttl) override {
    TROUPE_RETURN_IF_ERROR(checkKeySpaceArgs(space, ttl));
    std::lock_guard lock(state_->mutex);
    const auto* held = liveSpace(space);
    int64_t value = 0;
    if (held) {
      if (auto it = held->values.find(key); it != held->values.end() && !parseInteger(it->second, value)) {
        return Status(StatusCode::kFailedPrecondition,
                      fmt::format("key space '{}': cannot add to key '{}': its value '{}' is not a decimal integer",
                                  space, key, it->second.substr(0, 64)));
      }
    }
    if (__builtin_add_overflow(value, delta, &value)) {  // as Redis's HINCRBY refuses it
      return Status(StatusCode::kInternal, fmt::format("key space '{}': adding {} to key '{}' would overflow", space,
                                                       delta, key));
    }
    writableSpace(space, ttl).values[key] = std::to_string(value);
    return value;
  }

  Result<std::string> compareSetKey(const std::string& space, const std::string& key, const std::string& expected,
                                    const std::string& desired, std::chrono::milliseconds ttl) override {
    TROUPE_RETURN_IF_ERROR(checkKeySpaceArgs(space, ttl));
    std::lock_guard lock(state_->mutex);
    const auto* held = liveSpace(space);
    std::optional<std::string> value;
    if (held) {
      if (auto it = held->values.find(key); it != held->values.end()) value = it->second;
    }
    if ((!value && expected.empty()) || (value && *value == expected)) {
      writableSpace(space, ttl).values[key] = desired;
      return desired;
    }
    return value ? *value : expected;
  }

  Result<bool> deleteKey(const std::string& space, const std::string& key) override {
    TROUPE_RETURN_IF_ERROR(checkKeySpaceArgs(space));
    std::lock_guard lock(state_->mutex);
    if (!liveSpace(space)) return false;
    auto& values = state_->keySpaces[space].values;
    bool erased = values.erase(key) > 0;
    if (values.empty()) state_->keySpaces.erase(space);  // an empty hash does not exist
    return erased;
  }

  Result<int64_t> countKeys(const std::string& space) override {
    TROUPE_RETURN_IF_ERROR(checkKeySpaceArgs(space));
    std::lock_guard lock(state_->mutex);
    const auto* held = liveSpace(space);
    return held ? static_cast<int64_t>(held->values.size()) : int64_t{0};
  }

  Status deleteKeySpace(const std::string& space) override {
    TROUPE_RETURN_IF_ERROR(checkKeySpaceArgs(space));
    std::lock_guard lock(state_->mutex);
    state_->keySpaces.erase(space);
    return Status::ok();
  }

  Status putElasticGroup(const std::string& id, const std::string& doc) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(id, 0));
    std::lock_guard lock(state_->mutex);
    auto [it, added] = state_->elasticGroups.try_emplace(id);
    if (added) state_->elasticOrder.emplace(wallClockMs(), id);
    it->second.first = doc;
    return Status::ok();
  }

  Status appendGroupEvent(const std::string& id, const std::string& text) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(id, 0));
    std::lock_guard lock(state_->mutex);
    auto it = state_->elasticGroups.find(id);
    if (it == state_->elasticGroups.end()) return Status::ok();
    auto& events = it->second.second;
    for (size_t i = events.size() > 32 ? events.size() - 32 : 0; i < events.size(); ++i) {
      if (events[i] == text) return Status::ok();  // a retry
    }
    events.push_back(text);
    if (events.size() > kMaxGroupEvents) events.erase(events.begin(), events.end() - kMaxGroupEvents);
    return Status::ok();
  }

  Result<std::optional<ElasticGroupRecord>> getElasticGroup(const std::string& id) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(id, 0));
    std::lock_guard lock(state_->mutex);
    return elasticRecord(id);
  }

  Result<std::vector<ElasticGroupRecord>> listElasticGroups() override {
    std::lock_guard lock(state_->mutex);
    std::vector<ElasticGroupRecord> groups;
    for (const auto& [createdMs, id] : state_->elasticOrder) {
      if (auto r = elasticRecord(id)) groups.push_back(std::move(*r));
    }
    return groups;
  }

  Status deleteElasticGroup(const std::string& id) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(id, 0));
    std::lock_guard lock(state_->mutex);
    state_->elasticGroups.erase(id);
    std::erase_if(state_->elasticOrder, [&id](const auto& entry) { return entry.second == id; });
    // The key space of each epoch up to the group's, as the Redis script deletes them.
    if (auto epoch = state_->groupEpochs.find(id); epoch != state_->groupEpochs.end()) {
      for (int64_t e = 0; e <= epoch->second; ++e) state_->keySpaces.erase(groupKeySpace(id, e));
    } else {
      state_->keySpaces.erase(groupKeySpace(id, 0));
    }
    state_->groupEpochs.erase(id);
    std::erase_if(state_->rendezvous, [&id](const auto& entry) { return entry.first.first == id; });
    return Status::ok();
  }

 private:
  // Caller holds the state's mutex. The space, or nullptr when it is absent or expired (then
  // forgotten, as Redis forgets an expired key).
  const FakeClusterState::KeySpace* liveSpace(const std::string& space) {
    auto it = state_->keySpaces.find(space);
    if (it == state_->keySpaces.end()) return nullptr;
    if (it->second.expiry <= Clock::now()) {
      state_->keySpaces.erase(it);
      return nullptr;
    }
    return &it->second;
  }
  // Caller holds the state's mutex. The space to write into, kept `ttl` more.
  FakeClusterState::KeySpace& writableSpace(const std::string& space, std::chrono::milliseconds ttl) {
    liveSpace(space);  // an expired one starts empty
    auto& held = state_->keySpaces[space];
    held.expiry = Clock::now() + ttl;
    return held;
  }
  // Caller holds the state's mutex.
  std::optional<ElasticGroupRecord> elasticRecord(const std::string& id) const {
    auto it = state_->elasticGroups.find(id);
    if (it == state_->elasticGroups.end()) return std::nullopt;
    auto epoch = state_->groupEpochs.find(id);
    return ElasticGroupRecord{id, it->second.first, it->second.second,
                              epoch == state_->groupEpochs.end() ? 0 : epoch->second};
  }



  // Redis compares claims with the same tolerance (redis_cluster_store.cc, kReserveBody).
  static constexpr double kEpsilon = 1e-9;

  static double valueOr(const Resources& resources, const std::string& name) {
    auto it = resources.find(name);
    return it == resources.end() ? 0.0 : it->second;
  }

  std::shared_ptr<FakeClusterState> state_;
};

}  // namespace

std::shared_ptr<FakeClusterState> makeFakeClusterState() {
  return std::make_shared<FakeClusterState>();
}

std::unique_ptr<ClusterStore> makeFakeClusterStore(std::shared_ptr<FakeClusterState> state) {
  return std::make_unique<FakeClusterStore>(std::move(state));
}

}  // namespace troupe
