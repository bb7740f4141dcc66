// In-memory ClusterStore for fast unit tests. Mirrors redis_cluster_store.cc call for call:
// the same suite (cluster_store_test.cc) runs against both, so a difference is a bug here.
#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>

#include <fmt/format.h>

#include "troupe/runtime/cluster_store.h"
#include "troupe/runtime/config.h"

namespace troupe {

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
  std::map<NodeId, Node> nodes;
  // Weak: a subscription that is destroyed simply stops receiving, like a closed connection.
  std::vector<std::weak_ptr<EventQueue>> subscribers;

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
    return state_->meta;
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

  Result<std::unique_ptr<EventSubscription>> subscribe() override {
    auto queue = std::make_shared<FakeClusterState::EventQueue>();
    {
      std::lock_guard lock(state_->mutex);
      state_->subscribers.push_back(queue);
    }
    return std::unique_ptr<EventSubscription>(
        std::make_unique<FakeEventSubscription>(std::move(queue)));
  }

 private:
  static Status emptyId() { return Status(StatusCode::kInvalidArgument, "empty node id"); }

  static Status checkNodeArgs(const NodeId& id, std::chrono::milliseconds ttl) {
    if (id.empty()) return emptyId();
    if (ttl.count() <= 0) {
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("heartbeat ttl must be positive, got {} ms", ttl.count()));
    }
    return Status::ok();
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
