// ControllerCore's decisions against the in-memory store: scheduling, lifecycle, restarts,
// node death, placement groups and their resizing; every operation applied twice changes
// nothing the second time (the RPC handlers are idempotent because these are).
#include <doctest/doctest.h>

#include <map>

#include <fmt/format.h>

#include "controller_core.h"
#include "troupe/runtime/ids.h"
#include "troupe/testing/redis_server.h"

namespace troupe {
namespace {

// The fake store, but every call that lists all actors or all groups fails: what a node's death
// touches must come from that node's own indexes.
class ScanRefusingStore final : public ClusterStore {
 public:
  explicit ScanRefusingStore(std::unique_ptr<ClusterStore> inner) : inner_(std::move(inner)) {}
  static Status refused(const char* what) {
    return Status(StatusCode::kFailedPrecondition, fmt::format("{}: a scan of the whole cluster", what));
  }
  Status putMeta(const ClusterMeta& meta) override { return inner_->putMeta(meta); }
  Result<std::optional<ClusterMeta>> getMeta() override { return inner_->getMeta(); }
  Status putStoreGateway(const std::string& address) override { return inner_->putStoreGateway(address); }
  Status registerNode(const NodeRecord& node, std::chrono::milliseconds ttl) override { return inner_->registerNode(node, ttl); }
  Result<bool> heartbeat(const NodeId& id, std::chrono::milliseconds ttl) override { return inner_->heartbeat(id, ttl); }
  Result<std::optional<NodeRecord>> getNode(const NodeId& id) override { return inner_->getNode(id); }
  Result<std::vector<NodeRecord>> listNodes() override { return inner_->listNodes(); }
  Result<std::vector<NodeId>> reapExpiredNodes() override { return inner_->reapExpiredNodes(); }
  Status markNodeDead(const NodeId& id, const std::string& reason) override { return inner_->markNodeDead(id, reason); }
  Result<bool> reserve(const std::vector<Reservation>& reservations) override { return inner_->reserve(reservations); }
  Status release(const std::vector<Reservation>& reservations) override { return inner_->release(reservations); }
  Result<std::map<std::string, Resources>> reservations(const NodeId& node) override { return inner_->reservations(node); }
  Status putActor(const ActorRecord& actor) override { return inner_->putActor(actor); }
  Result<std::optional<ActorRecord>> getActor(const ActorId& id) override { return inner_->getActor(id); }
  Result<std::vector<ActorRecord>> listActors() override { return refused("listActors"); }
  Result<ActorPage> listActorsPage(const ActorQuery&) override { return refused("listActorsPage"); }
  Result<std::vector<ActorRecord>> listLiveActors() override { return refused("listLiveActors"); }
  Result<std::vector<ActorRecord>> listNodeActors(const NodeId& node) override { return inner_->listNodeActors(node); }
  Result<std::vector<NodeId>> listDeadNodesWithWork() override { return inner_->listDeadNodesWithWork(); }
  Result<bool> claimActorName(const std::string& name, const ActorId& id) override { return inner_->claimActorName(name, id); }
  Status releaseActorName(const std::string& name, const ActorId& id) override { return inner_->releaseActorName(name, id); }
  Result<std::optional<ActorId>> lookupActorName(const std::string& name) override { return inner_->lookupActorName(name); }
  Status putPlacementGroup(const PlacementGroupRecord& group) override { return inner_->putPlacementGroup(group); }
  Result<std::optional<PlacementGroupRecord>> getPlacementGroup(const PlacementGroupId& id) override { return inner_->getPlacementGroup(id); }
  Result<std::vector<PlacementGroupRecord>> listPlacementGroups() override { return refused("listPlacementGroups"); }
  Status deletePlacementGroup(const PlacementGroupId& id) override { return inner_->deletePlacementGroup(id); }
  Result<GroupCreation> createPlacementGroup(const PlacementGroupRecord& group, const std::vector<Reservation>& claims) override { return inner_->createPlacementGroup(group, claims); }
  Result<GroupRemoval> removePlacementGroup(const PlacementGroupId& id) override { return inner_->removePlacementGroup(id); }
  Result<std::vector<ActorRecord>> listGroupActors(const PlacementGroupId& id) override { return inner_->listGroupActors(id); }
  Result<PendingWork> listPendingWork() override { return inner_->listPendingWork(); }
  Status putSession(const std::string& id, const std::string& info) override { return inner_->putSession(id, info); }
  Status deleteSession(const std::string& id) override { return inner_->deleteSession(id); }
  Result<std::map<std::string, std::string>> listSessions() override { return inner_->listSessions(); }
  Result<std::unique_ptr<EventSubscription>> subscribe() override { return inner_->subscribe(); }
  Result<int64_t> groupEpoch(const std::string& group) override { return inner_->groupEpoch(group); }
  Result<int64_t> advanceGroupEpoch(const std::string& group, int64_t epoch) override { return inner_->advanceGroupEpoch(group, epoch); }
  Result<std::unique_ptr<GroupEpochWatch>> watchGroupEpoch(const std::string& group) override { return inner_->watchGroupEpoch(group); }
  Status putRendezvousEntry(const std::string& group, int64_t epoch, int32_t rank, const std::string& value, std::chrono::milliseconds ttl) override { return inner_->putRendezvousEntry(group, epoch, rank, value, ttl); }
  Result<std::map<int32_t, std::string>> getRendezvous(const std::string& group, int64_t epoch) override { return inner_->getRendezvous(group, epoch); }
  Status setKey(const std::string& space, const std::string& key, const std::string& value, std::chrono::milliseconds ttl) override { return inner_->setKey(space, key, value, ttl); }
  Result<std::vector<std::optional<std::string>>> getKeys(const std::string& space, const std::vector<std::string>& keys) override { return inner_->getKeys(space, keys); }
  Result<int64_t> addToKey(const std::string& space, const std::string& key, int64_t delta, std::chrono::milliseconds ttl) override { return inner_->addToKey(space, key, delta, ttl); }
  Result<std::string> compareSetKey(const std::string& space, const std::string& key, const std::string& expected, const std::string& desired, std::chrono::milliseconds ttl) override { return inner_->compareSetKey(space, key, expected, desired, ttl); }
  Result<bool> deleteKey(const std::string& space, const std::string& key) override { return inner_->deleteKey(space, key); }
  Result<int64_t> countKeys(const std::string& space) override { return inner_->countKeys(space); }
  Status deleteKeySpace(const std::string& space) override { return inner_->deleteKeySpace(space); }
  Status putElasticGroup(const std::string& id, const std::string& doc) override { return inner_->putElasticGroup(id, doc); }
  Status appendGroupEvent(const std::string& id, const std::string& text) override { return inner_->appendGroupEvent(id, text); }
  Result<uint64_t> appendGroupCommand(const std::string& id, const GroupCommand& command, const std::string& nonce) override {
    return inner_->appendGroupCommand(id, command, nonce);
  }
  Result<std::optional<ElasticGroupRecord>> getElasticGroup(const std::string& id) override { return inner_->getElasticGroup(id); }
  Result<std::vector<ElasticGroupRecord>> listElasticGroups() override { return inner_->listElasticGroups(); }
  Status deleteElasticGroup(const std::string& id) override { return inner_->deleteElasticGroup(id); }

 private:
  std::unique_ptr<ClusterStore> inner_;
};

struct Core {
  explicit Core(std::unique_ptr<ClusterStore> s = testing::openTestStore(testing::newTestCluster()))
      : store(std::move(s)), core(*store) {}
  std::unique_ptr<ClusterStore> store;
  ControllerCore core;
  std::vector<WorkerAction> actions;

  NodeId addNode(double cpus, Resources extra = {}) {
    NodeRecord n;
    n.id = NodeId::generate();
    n.address = "127.0.0.1:1";
    n.total = {{"CPU", cpus}};
    for (auto& [k, v] : extra) n.total[k] = v;
    REQUIRE(store->registerNode(n, std::chrono::minutes(5)).isOk());
    return n.id;
  }
  ActorRecord spec(double cpus = 1, int maxRestarts = 0) {
    ActorRecord a;
    a.id = ActorId::generate();
    a.type = "Counter";
    a.resources = {{"CPU", cpus}};
    a.maxRestarts = maxRestarts;
    return a;
  }
  double used(const NodeId& id) { return (*store->getNode(id))->used.at("CPU"); }
  size_t spawns() {
    size_t n = 0;
    for (auto& a : actions) n += a.kind == WorkerAction::Kind::kSpawn;
    return n;
  }
};

TEST_CASE("core: an actor is placed, reserved, spawned once, and creation is idempotent") {
  Core c;
  NodeId node = c.addNode(2);
  auto spec = c.spec(1);
  auto a = c.core.createActor(spec, c.actions);
  REQUIRE(a.isOk());
  CHECK(a->state == ActorState::kPending);
  CHECK(a->nodeId == node);
  CHECK(c.used(node) == 1);
  CHECK(c.spawns() == 1);
  auto again = c.core.createActor(spec, c.actions);
  REQUIRE(again.isOk());
  CHECK(again->id == a->id);
  CHECK(c.used(node) == 1);   // not reserved twice
  CHECK(c.spawns() == 1);     // not spawned twice

  auto ready = c.core.actorReady(a->id, 1, "127.0.0.1:9", 42);
  REQUIRE(ready.isOk());
  CHECK(ready->state == ActorState::kAlive);
  CHECK(c.core.actorReady(a->id, 1, "127.0.0.1:9", 42)->state == ActorState::kAlive);
}

TEST_CASE("core: a batch of creations places each actor once, in order, as one creation each would") {
  Core c;
  NodeId big = c.addNode(3);
  NodeId small = c.addNode(2);
  std::vector<ActorRecord> batch;
  for (int i = 0; i < 4; ++i) batch.push_back(c.spec(1));
  ActorRecord repeat = batch[1];  // a retried request inside the batch
  ActorRecord tooBig = c.spec(8);
  ActorRecord waits = c.spec(1);
  ActorRecord named = c.spec(0.5);
  named.name = "solo";
  batch.push_back(repeat);
  batch.push_back(tooBig);
  batch.push_back(named);
  batch.push_back(waits);  // needs 1 CPU where 0.5 is left: PENDING
  auto results = c.core.createActors(batch, c.actions);
  REQUIRE(results.size() == batch.size());
  for (size_t i : {0, 1, 2, 3, 4, 6, 7}) REQUIRE_MESSAGE(results[i].isOk(), results[i].status().toString());
  CHECK(results[5].status().code() == StatusCode::kResourceExhausted);
  CHECK(results[4]->id == results[1]->id);
  CHECK(results[4]->nodeId == results[1]->nodeId);
  // pickNode's order, actor after actor: most free CPU first (ties to the smaller id).
  std::map<NodeId, int> placed;
  for (size_t i : {0, 1, 2, 3, 6}) placed[results[i]->nodeId] += 1;
  CHECK(placed[big] == 3);
  CHECK(placed[small] == 2);
  CHECK(results[7]->state == ActorState::kPending);
  CHECK(results[7]->nodeId.empty());
  CHECK(c.used(big) + c.used(small) == doctest::Approx(4.5));
  CHECK(c.spawns() == 5);  // not twice for the repeat, none for the waiting one
  // The whole batch again changes nothing: every record exists.
  auto again = c.core.createActors(batch, c.actions);
  CHECK(again[7]->state == ActorState::kPending);
  CHECK(c.used(big) + c.used(small) == doctest::Approx(4.5));
  CHECK(c.spawns() == 5);
  CHECK(c.core.createActors({named}, c.actions)[0]->id == named.id);  // its own name: the same actor
  ActorRecord taken = c.spec(0);
  taken.name = "solo";
  CHECK(c.core.createActors({taken}, c.actions)[0].status().code() == StatusCode::kAlreadyExists);

  // Ready reports in a batch: a stale one is ignored, a repeat changes nothing, an unknown id fails.
  std::vector<ControllerCore::ReadyReport> reports = {
      {results[0]->id, 1, "127.0.0.1:1", 11},
      {results[1]->id, 2, "127.0.0.1:2", 12},  // a later incarnation than the record's: stale
      {results[0]->id, 1, "127.0.0.1:1", 11},
      {ActorId::generate(), 1, "127.0.0.1:3", 13},
  };
  auto ready = c.core.actorsReady(reports);
  REQUIRE(ready.size() == 4);
  CHECK(ready[0]->state == ActorState::kAlive);
  CHECK(ready[1]->state == ActorState::kPending);
  CHECK(ready[2]->state == ActorState::kAlive);
  CHECK(ready[3].status().code() == StatusCode::kNotFound);
  CHECK(c.core.getActor(results[0]->id)->pid == 11);
  CHECK(c.core.getActor(results[1]->id)->state == ActorState::kPending);
}

TEST_CASE("core: a dead node's actors restart together, and reconciling one node at a time leaves the rest for the next call") {
  Core c;
  NodeId first = c.addNode(4), second = c.addNode(4);
  std::vector<ActorRecord> batch;
  for (int i = 0; i < 8; ++i) batch.push_back(c.spec(1, -1));
  for (auto& r : c.core.createActors(batch, c.actions)) REQUIRE(r.isOk());
  NodeId spare = c.addNode(8);
  REQUIRE(c.store->markNodeDead(first, "test").isOk());
  REQUIRE(c.store->markNodeDead(second, "test").isOk());
  c.actions.clear();
  auto more = c.core.reconcileDeadNodes(c.actions, 1);
  REQUIRE(more.isOk());
  CHECK(*more);
  CHECK(c.spawns() == 4);
  CHECK(c.store->listDeadNodesWithWork()->size() == 1);
  more = c.core.reconcileDeadNodes(c.actions, 1);
  REQUIRE(more.isOk());
  CHECK_FALSE(*more);
  CHECK(c.spawns() == 8);
  CHECK(c.used(spare) == 8);
  for (const auto& a : batch) {
    auto now = *c.core.getActor(a.id);
    CHECK(now.nodeId == spare);
    CHECK(now.incarnation == 2);
    CHECK(now.state == ActorState::kRestarting);
  }
  CHECK(c.store->listDeadNodesWithWork()->empty());
  CHECK_FALSE(*c.core.reconcileDeadNodes(c.actions, 1));
}

TEST_CASE("core: infeasible is an error, busy is PENDING until resources are freed") {
  Core c;
  NodeId node = c.addNode(2);
  auto big = c.core.createActor(c.spec(8), c.actions);
  REQUIRE_FALSE(big.isOk());
  CHECK(big.status().code() == StatusCode::kResourceExhausted);
  CHECK(big.status().message().find("infeasible") != std::string::npos);

  auto first = c.core.createActor(c.spec(2), c.actions);
  REQUIRE(first.isOk());
  auto second = c.core.createActor(c.spec(2), c.actions);
  REQUIRE(second.isOk());
  CHECK(second->state == ActorState::kPending);
  CHECK(second->nodeId.empty());
  CHECK(second->deathReason.find("pending") != std::string::npos);
  CHECK(c.spawns() == 1);

  // The first one dies without restarts: its CPUs go to the waiting one.
  REQUIRE(c.core.workerExited(first->id, 1, "worker exited with code 1", c.actions).isOk());
  CHECK(c.core.getActor(first->id)->state == ActorState::kDead);
  auto placed = c.core.getActor(second->id);
  CHECK(placed->nodeId == node);
  CHECK(c.spawns() == 2);
  CHECK(c.used(node) == 2);
}

TEST_CASE("core: names are unique among live actors and freed at death") {
  Core c;
  c.addNode(4);
  auto a = c.spec();
  a.name = "counter";
  REQUIRE(c.core.createActor(a, c.actions).isOk());
  auto b = c.spec();
  b.name = "counter";
  auto dup = c.core.createActor(b, c.actions);
  CHECK(dup.status().code() == StatusCode::kAlreadyExists);
  CHECK(c.core.getActorByName("counter")->id == a.id);
  REQUIRE(c.core.killActor(a.id, true, c.actions).isOk());
  REQUIRE(c.core.killActor(a.id, true, c.actions).isOk());  // twice: no change
  CHECK(c.core.getActorByName("counter").status().code() == StatusCode::kNotFound);
  CHECK(c.core.createActor(b, c.actions).isOk());
}

TEST_CASE("core: restarts within max_restarts, stale and repeated exit reports are ignored") {
  Core c;
  NodeId node = c.addNode(2);
  auto a = *c.core.createActor(c.spec(1, 1), c.actions);
  REQUIRE(c.core.actorReady(a.id, 1, "x:1", 1).isOk());
  REQUIRE(c.core.workerExited(a.id, 1, "worker killed by signal 11 (SIGSEGV)", c.actions).isOk());
  auto r = *c.core.getActor(a.id);
  CHECK(r.state == ActorState::kRestarting);
  CHECK(r.incarnation == 2);
  CHECK(r.restarts == 1);
  CHECK(r.pid == 0);  // no process until the next incarnation is ready
  CHECK(r.deathReason.find("SIGSEGV") != std::string::npos);
  CHECK(c.spawns() == 2);
  CHECK(c.used(node) == 1);
  REQUIRE(c.core.workerExited(a.id, 1, "again", c.actions).isOk());  // stale incarnation
  CHECK(c.core.getActor(a.id)->incarnation == 2);
  CHECK(c.spawns() == 2);
  REQUIRE(c.core.actorReady(a.id, 2, "x:2", 2).isOk());
  REQUIRE(c.core.workerExited(a.id, 2, "worker exited with code 3", c.actions).isOk());
  r = *c.core.getActor(a.id);
  CHECK(r.state == ActorState::kDead);
  CHECK(r.deathReason == "worker exited with code 3");
  CHECK(r.pid == 2);  // its last pid, which its logs and output name
  CHECK(c.used(node) == 0);
}

TEST_CASE("core: a final exit (the actor ended itself, its constructor raised) is never restarted") {
  Core c;
  NodeId node = c.addNode(2);
  auto a = *c.core.createActor(c.spec(1, -1), c.actions);
  REQUIRE(c.core.actorReady(a.id, 1, "x:1", 1).isOk());
  REQUIRE(c.core.workerExited(a.id, 1, "its constructor raised (not restarted)", c.actions, true).isOk());
  auto r = *c.core.getActor(a.id);
  CHECK(r.state == ActorState::kDead);  // max_restarts=-1, yet DEAD
  CHECK(r.restarts == 0);
  CHECK(r.deathReason == "its constructor raised (not restarted)");
  CHECK(c.spawns() == 1);
  CHECK(c.used(node) == 0);
}

TEST_CASE("core: an actor that keeps ending soon after it starts restarts with a back-off; a long run resets it") {
  using std::chrono::milliseconds;
  Core c;
  c.addNode(2);
  auto a = *c.core.createActor(c.spec(1, -1), c.actions);
  std::vector<int64_t> delays;
  for (uint32_t incarnation = 1; incarnation <= 12; ++incarnation) {
    c.actions.clear();
    // Ends before it ever served (its constructor raised, or its worker could not start).
    REQUIRE(c.core.workerExited(a.id, incarnation, "worker exited with code 1", c.actions).isOk());
    REQUIRE(c.actions.size() == 1);
    delays.push_back(c.actions[0].delay.count());
  }
  CHECK(delays == std::vector<int64_t>{0, 100, 200, 400, 800, 1600, 3200, 6400, 10000, 10000, 10000, 10000});
  // An incarnation that served for longer than kStableRunMs ends: it restarts at once, and the
  // count starts again.
  REQUIRE(c.core.actorReady(a.id, 13, "x:13", 13).isOk());
  auto r = *c.core.getActor(a.id);
  r.updatedMs -= kStableRunMs + 1000;
  REQUIRE(c.store->putActor(r).isOk());
  c.actions.clear();
  REQUIRE(c.core.workerExited(a.id, 13, "worker killed by signal 9 (SIGKILL)", c.actions).isOk());
  CHECK(c.actions.at(0).delay == milliseconds(0));
  c.actions.clear();
  REQUIRE(c.core.workerExited(a.id, 14, "worker exited with code 1", c.actions).isOk());
  CHECK(c.actions.at(0).delay == milliseconds(0));
  c.actions.clear();
  REQUIRE(c.core.workerExited(a.id, 15, "worker exited with code 1", c.actions).isOk());
  CHECK(c.actions.at(0).delay == milliseconds(100));
  // One that served briefly still counts as a quick end.
  REQUIRE(c.core.actorReady(a.id, 16, "x:16", 16).isOk());
  c.actions.clear();
  REQUIRE(c.core.workerExited(a.id, 16, "worker exited with code 1", c.actions).isOk());
  CHECK(c.actions.at(0).delay == milliseconds(200));
}

TEST_CASE("core: an owner going away ends its non-detached actors only") {
  Core c;
  c.addNode(4);
  auto mine = c.spec();
  mine.owner = "driver-1";
  auto kept = c.spec();
  kept.owner = "driver-1";
  kept.detached = true;
  auto other = c.spec();
  other.owner = "driver-2";
  for (auto* a : {&mine, &kept, &other}) REQUIRE(c.core.createActor(*a, c.actions).isOk());
  REQUIRE(c.core.ownerGone("driver-1", c.actions).isOk());
  REQUIRE(c.core.ownerGone("driver-1", c.actions).isOk());  // twice: nothing more
  CHECK(c.core.getActor(mine.id)->state == ActorState::kDead);
  CHECK(c.core.getActor(kept.id)->state != ActorState::kDead);
  CHECK(c.core.getActor(other.id)->state != ActorState::kDead);
}

TEST_CASE("core: actors on a dead node restart on another node") {
  Core c;
  NodeId a = c.addNode(1);
  auto restartable = *c.core.createActor(c.spec(1, -1), c.actions);
  CHECK(restartable.nodeId == a);
  NodeId b = c.addNode(1);
  auto mortal = c.spec(1, 0);
  // Fill b so the mortal one is placed there; then kill node b.
  auto m = *c.core.createActor(mortal, c.actions);
  CHECK(m.nodeId == b);
  REQUIRE(c.store->markNodeDead(a, "test").isOk());
  REQUIRE(c.core.reconcileDeadNodes(c.actions).isOk());
  REQUIRE(c.core.reconcileDeadNodes(c.actions).isOk());  // twice: nothing more
  auto moved = *c.core.getActor(restartable.id);
  CHECK(moved.state == ActorState::kRestarting);
  CHECK(moved.deathReason.find("node") != std::string::npos);
  CHECK(moved.nodeId.empty());  // b is full: it waits for resources
  REQUIRE(c.store->markNodeDead(b, "test").isOk());
  NodeId fresh = c.addNode(2);
  REQUIRE(c.core.reconcileDeadNodes(c.actions).isOk());
  CHECK(c.core.getActor(m.id)->state == ActorState::kDead);
  CHECK(c.core.getActor(restartable.id)->nodeId == fresh);
}

TEST_CASE("core: a node's death is reconciled from that node's indexes, without listing every actor or group") {
  Core c(std::make_unique<ScanRefusingStore>(testing::openTestStore(testing::newTestCluster())));
  ControllerCore& core = c.core;
  NodeId doomed = c.addNode(2);
  auto moving = *core.createActor(c.spec(1, -1), c.actions);
  PlacementGroupRecord group;
  group.id = PlacementGroupId::generate();
  group.bundles = {Bundle{{{"CPU", 1}}, NodeId()}};
  auto created = core.createPlacementGroup(group);
  REQUIRE(created.isOk());
  REQUIRE(created->bundles[0].nodeId == doomed);
  NodeId other = c.addNode(6);
  std::vector<ActorRecord> bystanders;
  for (int i = 0; i < 3; ++i) bystanders.push_back(*core.createActor(c.spec(1), c.actions));
  for (const auto& b : bystanders) CHECK(b.nodeId == other);

  REQUIRE(c.store->markNodeDead(doomed, "test").isOk());
  REQUIRE(c.store->listDeadNodesWithWork()->size() == 1);
  REQUIRE(core.reconcileDeadNodes(c.actions).isOk());
  auto moved = *core.getActor(moving.id);
  CHECK(moved.nodeId == other);
  CHECK(moved.incarnation == 2);
  auto regrouped = *core.getPlacementGroup(group.id);
  CHECK(regrouped.state == PlacementGroupState::kCreated);
  CHECK(regrouped.bundles[0].nodeId == other);
  CHECK(c.store->reservations(doomed)->empty());
  // Nothing is left on the dead node: the next pass has nothing to do.
  CHECK(c.store->listDeadNodesWithWork()->empty());
  REQUIRE(core.reconcileDeadNodes(c.actions).isOk());
  CHECK(core.getActor(moving.id)->incarnation == 2);
  for (const auto& b : bystanders) CHECK(core.getActor(b.id)->incarnation == 1);
}

TEST_CASE("core: a claim left on a dead node by a holder that no longer runs there is released") {
  Core c;
  NodeId doomed = c.addNode(2);
  // As a controller that crashed after writing a claim: nothing runs under it.
  REQUIRE(*c.store->reserve({Reservation{doomed, "actor:00aa", {{"CPU", 1}}}}));
  REQUIRE(c.store->markNodeDead(doomed, "test").isOk());
  REQUIRE(c.store->listDeadNodesWithWork()->size() == 1);
  REQUIRE(c.core.reconcileDeadNodes(c.actions).isOk());
  CHECK(c.store->reservations(doomed)->empty());
  CHECK(c.store->listDeadNodesWithWork()->empty());
}

TEST_CASE("core: placement groups are atomic, resizable, and removal frees everything") {
  Core c;
  NodeId a = c.addNode(2);
  NodeId b = c.addNode(2);
  PlacementGroupRecord pg;
  pg.id = PlacementGroupId::generate();
  pg.strategy = PlacementStrategy::kStrictSpread;
  pg.bundles = {Bundle{{{"CPU", 1}}, {}}, Bundle{{{"CPU", 1}}, {}}};
  auto created = c.core.createPlacementGroup(pg);
  REQUIRE(created.isOk());
  CHECK(created->state == PlacementGroupState::kCreated);
  CHECK(created->bundles[0].nodeId != created->bundles[1].nodeId);
  CHECK(c.used(a) == 1);
  CHECK(c.used(b) == 1);
  CHECK(c.core.createPlacementGroup(pg)->bundles.size() == 2);  // twice: same group
  CHECK(c.used(a) == 1);

  // A third STRICT_SPREAD bundle needs a third node: infeasible now, group unchanged.
  auto grown = c.core.addBundles(pg.id, {{{"CPU", 1}}}, 2);
  CHECK(grown.status().code() == StatusCode::kResourceExhausted);
  CHECK(c.core.getPlacementGroup(pg.id)->bundles.size() == 2);

  // An actor inside bundle 1 uses the bundle's reservation, not more of the node.
  auto inBundle = c.spec(1);
  inBundle.placementGroup = pg.id;
  inBundle.bundleIndex = 1;
  auto actor = c.core.createActor(inBundle, c.actions);
  REQUIRE(actor.isOk());
  CHECK(actor->nodeId == created->bundles[1].nodeId);
  CHECK(c.used(a) + c.used(b) == 2);

  // Remove bundle 0: bundle 1 and its actor are untouched; twice is a no-op.
  auto shrunk = c.core.removeBundles(pg.id, {0}, c.actions);
  REQUIRE(shrunk.isOk());
  CHECK(shrunk->bundles[0].resources.empty());
  CHECK(shrunk->bundles[1].nodeId == created->bundles[1].nodeId);
  CHECK(c.core.removeBundles(pg.id, {0}, c.actions).isOk());
  CHECK(c.core.getActor(actor->id)->state == ActorState::kPending);
  CHECK(c.used(a) + c.used(b) == 1);

  // Grow again (from index 2): placed on a node without bundle 1 (strict spread).
  auto regrown = c.core.addBundles(pg.id, {{{"CPU", 1}}}, 2);
  REQUIRE(regrown.isOk());
  CHECK(regrown->bundles[2].nodeId != regrown->bundles[1].nodeId);
  CHECK(c.core.addBundles(pg.id, {{{"CPU", 1}}}, 2)->bundles.size() == 3);  // a retried append
  CHECK(c.used(a) + c.used(b) == 2);

  REQUIRE(c.core.removePlacementGroup(pg.id, c.actions).isOk());
  REQUIRE(c.core.removePlacementGroup(pg.id, c.actions).isOk());
  CHECK(c.used(a) == 0);
  CHECK(c.used(b) == 0);
  CHECK(c.core.getActor(actor->id)->state == ActorState::kDead);
  CHECK(c.core.getPlacementGroup(pg.id).status().code() == StatusCode::kNotFound);  // forgotten
}

TEST_CASE("core: a group that does not fit now stays PENDING with a reason, then is created") {
  Core c;
  c.addNode(2);
  auto blocker = *c.core.createActor(c.spec(2), c.actions);
  PlacementGroupRecord pg;
  pg.id = PlacementGroupId::generate();
  pg.strategy = PlacementStrategy::kStrictPack;
  pg.bundles = {Bundle{{{"CPU", 1}}, {}}, Bundle{{{"CPU", 1}}, {}}};
  auto waiting = c.core.createPlacementGroup(pg);
  REQUIRE(waiting.isOk());
  CHECK(waiting->state == PlacementGroupState::kPending);
  CHECK_FALSE(waiting->pendingReason.empty());
  CHECK(waiting->bundles[0].nodeId.empty());
  REQUIRE(c.core.killActor(blocker.id, true, c.actions).isOk());
  auto created = *c.core.getPlacementGroup(pg.id);
  CHECK(created.state == PlacementGroupState::kCreated);
  CHECK(created.bundles[0].nodeId == created.bundles[1].nodeId);

  PlacementGroupRecord huge = pg;
  huge.id = PlacementGroupId::generate();
  huge.bundles = {Bundle{{{"CPU", 3}}, {}}};
  CHECK(c.core.createPlacementGroup(huge).status().code() == StatusCode::kResourceExhausted);
}

// Runs `body` on a core over the fake store, then over a real Redis: the same decisions on both.
template <typename Body>
void onBothStores(Body body) {
  SUBCASE("fake store") {
    Core c;
    body(c);
  }
  SUBCASE("real Redis") {
    testing::RedisServerProcess redis;
    auto store = connectRedisStore(redis.options("core" + randomHex(4)));
    REQUIRE(store.isOk());
    Core c(std::move(*store));
    body(c);
  }
}

// An elastic group as ElasticTrainer makes one: a placement group of `bundles` bundles of one
// CPU, its record, a Trainer in every bundle and a Dataloader and a Checkpoint actor (0 CPU) in
// bundle 0, all restarted without limit.
struct ElasticGroup {
  PlacementGroupRecord group;
  std::vector<ActorRecord> members;
  std::string id() const { return group.id.hex(); }
};

ElasticGroup makeElasticGroup(Core& c, uint32_t bundles) {
  ElasticGroup g;
  g.group.id = PlacementGroupId::generate();
  g.group.strategy = PlacementStrategy::kPack;
  for (uint32_t i = 0; i < bundles; ++i) g.group.bundles.push_back(Bundle{{{"CPU", 1}}, {}});
  auto created = c.core.createPlacementGroup(g.group);
  REQUIRE(created.isOk());
  REQUIRE(created->state == PlacementGroupState::kCreated);
  g.group = *created;
  REQUIRE(c.store->putElasticGroup(g.id(), "{}").isOk());
  auto member = [&](const char* type, double cpus, uint32_t bundle) {
    auto a = c.spec(cpus, -1);
    a.type = type;
    a.placementGroup = g.group.id;
    a.bundleIndex = static_cast<int32_t>(bundle);
    auto made = c.core.createActor(a, c.actions);
    REQUIRE(made.isOk());
    g.members.push_back(*made);
  };
  for (uint32_t i = 0; i < bundles; ++i) member("Trainer", 1, i);
  member("Dataloader", 0, 0);
  member("Checkpoint", 0, 0);
  return g;
}

int64_t epochOf(Core& c, const ElasticGroup& g) { return *c.store->groupEpoch(g.id()); }

// The group's events that name `text`.
std::vector<std::string> eventsWith(Core& c, const ElasticGroup& g, const std::string& text) {
  auto record = c.store->getElasticGroup(g.id());
  REQUIRE(record.isOk());
  REQUIRE(record->has_value());
  std::vector<std::string> out;
  for (const auto& e : (*record)->events) {
    if (e.find(text) != std::string::npos) out.push_back(e);
  }
  return out;
}

TEST_CASE("core: a node's death ends all its members of an elastic group in one epoch advance") {
  onBothStores([](Core& c) {
    NodeId doomed = c.addNode(2);
    ElasticGroup g = makeElasticGroup(c, 2);
    for (const auto& m : g.members) REQUIRE(m.nodeId == doomed);
    c.addNode(2);  // room for the bundles again
    REQUIRE(c.store->markNodeDead(doomed, "test").isOk());
    REQUIRE(c.core.reconcileDeadNodes(c.actions).isOk());
    CHECK(epochOf(c, g) == 1);
    auto advanced = eventsWith(c, g, "epoch 1: ");
    REQUIRE(advanced.size() == 1);
    for (const auto& m : g.members) CHECK(advanced[0].find(m.id.hex()) != std::string::npos);
    CHECK(advanced[0].find("its node " + doomed.hex() + " died") != std::string::npos);
    // The exit reports of the old incarnations, arriving late, and a second pass change nothing.
    for (const auto& m : g.members) REQUIRE(c.core.workerExited(m.id, 1, "worker killed by signal 9", c.actions).isOk());
    REQUIRE(c.core.reconcileDeadNodes(c.actions).isOk());
    CHECK(epochOf(c, g) == 1);
    for (const auto& m : g.members) CHECK(c.core.getActor(m.id)->incarnation == 2);
  });
}

TEST_CASE("core: members of an elastic group ending before it joins again share one advance; after a join one advances") {
  onBothStores([](Core& c) {
    c.addNode(4);
    ElasticGroup g = makeElasticGroup(c, 3);
    // A host's processes killed one after another, each reported on its own.
    REQUIRE(c.core.workerExited(g.members[0].id, 1, "worker killed by signal 9", c.actions).isOk());
    CHECK(epochOf(c, g) == 1);
    REQUIRE(c.core.workerExited(g.members[3].id, 1, "worker killed by signal 9", c.actions).isOk());
    REQUIRE(c.core.workerExited(g.members[1].id, 1, "worker killed by signal 9", c.actions).isOk());
    // The driver's recovery removes a trainer that does not come back: the same round.
    REQUIRE(c.core.killActor(g.members[2].id, true, c.actions).isOk());
    CHECK(epochOf(c, g) == 1);
    CHECK(eventsWith(c, g, "epoch 1: ").size() == 1);
    CHECK(eventsWith(c, g, "epoch 1 (the same recovery): ").size() == 3);
    // The survivors join epoch 2 (each rank's rendezvous advances it): the next end is a new failure.
    REQUIRE(*c.store->advanceGroupEpoch(g.id(), 2) == 2);
    REQUIRE(c.core.workerExited(g.members[0].id, 2, "worker killed by signal 9", c.actions).isOk());
    CHECK(epochOf(c, g) == 3);
    // A rank that read epoch 2 before that advance is meeting at epoch 3: the next end aborts it.
    REQUIRE(c.store->putRendezvousEntry(g.id(), 3, 0, "rank 0", std::chrono::seconds(60)).isOk());
    REQUIRE(c.core.workerExited(g.members[1].id, 2, "worker killed by signal 9", c.actions).isOk());
    CHECK(epochOf(c, g) == 4);
  });
}

TEST_CASE("core: removing bundles ends their members of an elastic group in one epoch advance") {
  onBothStores([](Core& c) {
    c.addNode(4);
    ElasticGroup g = makeElasticGroup(c, 3);
    auto shrunk = c.core.removeBundles(g.group.id, {0, 2}, c.actions);
    REQUIRE(shrunk.isOk());
    CHECK(epochOf(c, g) == 1);
    auto advanced = eventsWith(c, g, "epoch 1: ");
    REQUIRE(advanced.size() == 1);
    for (size_t i : {size_t{0}, size_t{2}, size_t{3}, size_t{4}}) CHECK(advanced[0].find(g.members[i].id.hex()) != std::string::npos);
    CHECK(advanced[0].find(g.members[1].id.hex()) == std::string::npos);
    CHECK(c.core.getActor(g.members[1].id)->state == ActorState::kPending);  // untouched, as created
  });
}

}  // namespace
}  // namespace troupe
