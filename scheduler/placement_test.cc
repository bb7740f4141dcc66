#include "troupe/scheduler/placement.h"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace troupe::scheduler {
namespace {

constexpr double kGiB = 1024.0 * 1024 * 1024;

NodeView node(const std::string& id, Resources total, Resources used = {}, bool alive = true) {
  return NodeView{NodeId(id), alive, std::move(total), std::move(used)};
}

NodeView deadNode(const std::string& id, Resources total) {
  return node(id, std::move(total), {}, /*alive=*/false);
}

NodeId id(const std::string& hex) { return NodeId(hex); }

std::vector<Resources> cpuBundles(std::initializer_list<double> cpus) {
  std::vector<Resources> out;
  for (double cpu : cpus) out.push_back({{"CPU", cpu}});
  return out;
}

std::set<NodeId> distinctNodes(const std::vector<NodeId>& nodes) {
  return std::set<NodeId>(nodes.begin(), nodes.end());
}

bool startsWith(const std::string& text, const std::string& prefix) {
  return text.rfind(prefix, 0) == 0;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Checks the code, the prefix and each fragment, printing the message when one is missing.
template <typename T>
void requireError(const Result<T>& result, StatusCode code, const std::string& prefix,
                  std::initializer_list<std::string> fragments = {}) {
  REQUIRE_FALSE(result.isOk());
  INFO(result.status().toString());
  CHECK(result.status().code() == code);
  CHECK(startsWith(result.status().message(), prefix));
  for (const std::string& fragment : fragments) {
    CHECK(contains(result.status().message(), fragment));
  }
}

// Sum of bundles per node, to check that a placement never oversubscribes a node.
std::map<NodeId, Resources> loadOf(const std::vector<NodeId>& placement,
                                   const std::vector<Resources>& bundles) {
  std::map<NodeId, Resources> load;
  for (size_t i = 0; i < placement.size(); ++i) {
    load[placement[i]] = add(load[placement[i]], bundles[i]);
  }
  return load;
}

// ---------------------------------------------------------------- resource arithmetic

TEST_CASE("available subtracts used from total and counts missing names as 0") {
  Resources free = available(node("a", {{"CPU", 8}, {"GPU", 2}}, {{"CPU", 2.5}, {"ssd", 1}}));
  CHECK(free.at("CPU") == doctest::Approx(5.5));
  CHECK(free.at("GPU") == doctest::Approx(2));
  CHECK(free.at("ssd") == doctest::Approx(-1));  // used but never offered: over-committed
}

TEST_CASE("fits compares every demanded name, with missing names as 0") {
  Resources free = {{"CPU", 4}, {"memory", 2 * kGiB}};
  CHECK(fits(free, {}));
  CHECK(fits(free, {{"CPU", 4}}));
  CHECK_FALSE(fits(free, {{"CPU", 4.5}}));
  CHECK(fits(free, {{"CPU", 1}, {"memory", 2 * kGiB}}));
  CHECK_FALSE(fits(free, {{"CPU", 1}, {"memory", 2 * kGiB + 1}}));  // one byte too many
  CHECK_FALSE(fits(free, {{"GPU", 1}}));
  CHECK(fits(free, {{"GPU", 0}}));
}

TEST_CASE("fits tolerates rounding of fractional resources") {
  double sum = 0.1 + 0.2;  // 0.30000000000000004
  CHECK(fits({{"CPU", 0.3}}, {{"CPU", sum}}));
  CHECK(fits({{"CPU", 1.0 - 0.1 - 0.1 - 0.1 - 0.1 - 0.1 - 0.1 - 0.1 - 0.1 - 0.1}}, {{"CPU", 0.1}}));
  CHECK_FALSE(fits({{"CPU", 0.3}}, {{"CPU", 0.31}}));
}

TEST_CASE("add and subtract work per name over the union of names") {
  Resources a = {{"CPU", 2}, {"GPU", 1}};
  Resources b = {{"CPU", 0.5}, {"ssd", 3}};
  Resources sum = add(a, b);
  CHECK(sum == Resources{{"CPU", 2.5}, {"GPU", 1}, {"ssd", 3}});
  Resources difference = subtract(a, b);
  CHECK(difference == Resources{{"CPU", 1.5}, {"GPU", 1}, {"ssd", -3}});
  CHECK(subtract(add(a, b), b) == Resources{{"CPU", 2}, {"GPU", 1}, {"ssd", 0}});
}

TEST_CASE("viewsOf copies id, resources and liveness from store records") {
  NodeRecord alive;
  alive.id = id("aa");
  alive.total = {{"CPU", 4}};
  alive.used = {{"CPU", 1}};
  NodeRecord dead = alive;
  dead.id = id("bb");
  dead.state = NodeState::kDead;
  std::vector<NodeView> views = viewsOf({alive, dead});
  REQUIRE(views.size() == 2);
  CHECK(views[0].id == id("aa"));
  CHECK(views[0].alive);
  CHECK(views[0].total == Resources{{"CPU", 4}});
  CHECK(views[0].used == Resources{{"CPU", 1}});
  CHECK(views[1].id == id("bb"));
  CHECK_FALSE(views[1].alive);
}

// ---------------------------------------------------------------- pickNode

TEST_CASE("pickNode picks the node with the most free CPU that fits") {
  std::vector<NodeView> nodes = {
      node("a", {{"CPU", 8}}, {{"CPU", 6}}),   // 2 free
      node("b", {{"CPU", 4}}, {{"CPU", 0}}),   // 4 free
      node("c", {{"CPU", 16}}, {{"CPU", 13}}), // 3 free
  };
  auto picked = pickNode(nodes, {{"CPU", 1}});
  REQUIRE(picked.isOk());
  CHECK(*picked == id("b"));
  // The freest node lacks the GPU, so the next one that has it wins.
  nodes[2].total["GPU"] = 1;
  picked = pickNode(nodes, {{"CPU", 1}, {"GPU", 1}});
  REQUIRE(picked.isOk());
  CHECK(*picked == id("c"));
}

TEST_CASE("pickNode breaks free-CPU ties by utilisation, then by id") {
  std::vector<NodeView> nodes = {
      node("c", {{"CPU", 4}, {"GPU", 2}}, {{"GPU", 1}}),
      node("b", {{"CPU", 4}, {"GPU", 2}}),
      node("a", {{"CPU", 4}, {"GPU", 2}}, {{"GPU", 1}}),
  };
  auto picked = pickNode(nodes, {{"CPU", 1}});
  REQUIRE(picked.isOk());
  CHECK(*picked == id("b"));  // same free CPU, but nothing used
  nodes[1].used["GPU"] = 1;
  picked = pickNode(nodes, {{"CPU", 1}});
  REQUIRE(picked.isOk());
  CHECK(*picked == id("a"));  // all equal now: smallest id
}

TEST_CASE("pickNode honours avoid") {
  std::vector<NodeView> nodes = {node("a", {{"CPU", 8}}), node("b", {{"CPU", 2}})};
  auto picked = pickNode(nodes, {{"CPU", 1}}, {id("a")});
  REQUIRE(picked.isOk());
  CHECK(*picked == id("b"));
  // Only the avoided node could ever hold it: wait for others rather than give up.
  auto blocked = pickNode(nodes, {{"CPU", 4}}, {id("a")});
  requireError(blocked, StatusCode::kUnavailable, "pending: ", {"CPU 4", "avoided", "node a"});
}

TEST_CASE("pickNode never uses a dead node") {
  std::vector<NodeView> nodes = {deadNode("a", {{"CPU", 64}}), node("b", {{"CPU", 2}})};
  auto picked = pickNode(nodes, {{"CPU", 1}});
  REQUIRE(picked.isOk());
  CHECK(*picked == id("b"));
  auto tooBig = pickNode(nodes, {{"CPU", 8}});
  requireError(tooBig, StatusCode::kResourceExhausted, "infeasible: ",
               {"CPU 8", "largest alive node has CPU 2"});
  auto noneAlive = pickNode({deadNode("a", {{"CPU", 64}})}, {{"CPU", 1}});
  requireError(noneAlive, StatusCode::kResourceExhausted, "infeasible: ", {"no node is alive"});
}

TEST_CASE("pickNode tells infeasible from pending") {
  std::vector<NodeView> nodes = {node("a", {{"CPU", 2}}, {{"CPU", 1}}),
                                 node("b", {{"CPU", 4}}, {{"CPU", 3.5}})};
  auto infeasible = pickNode(nodes, {{"CPU", 8}});
  requireError(infeasible, StatusCode::kResourceExhausted, "infeasible: ",
               {"needs CPU 8", "largest alive node has CPU 4"});
  auto pending = pickNode(nodes, {{"CPU", 3}});
  requireError(pending, StatusCode::kUnavailable, "pending: ",
               {"needs CPU 3", "most free CPU has 1 free"});
  // Every resource exists somewhere, never together.
  std::vector<NodeView> split = {node("a", {{"CPU", 8}}), node("b", {{"CPU", 1}, {"GPU", 1}})};
  auto apart = pickNode(split, {{"CPU", 4}, {"GPU", 1}});
  requireError(apart, StatusCode::kResourceExhausted, "infeasible: ",
               {"CPU 4, GPU 1", "no single alive node has all of it"});
}

TEST_CASE("pickNode rejects negative or NaN demands") {
  auto negative = pickNode({node("a", {{"CPU", 2}})}, {{"CPU", -1}});
  requireError(negative, StatusCode::kInvalidArgument, "the request asks for CPU -1");
}

// ---------------------------------------------------------------- new groups

TEST_CASE("PACK puts a new group on one node when one has room: the freest") {
  std::vector<NodeView> nodes = {node("a", {{"CPU", 8}}, {{"CPU", 4}}),
                                 node("b", {{"CPU", 8}}, {{"CPU", 1}}),
                                 node("c", {{"CPU", 16}}, {{"CPU", 14}})};
  auto placed = placeBundles(nodes, cpuBundles({2, 2, 1}), PlacementStrategy::kPack);
  REQUIRE(placed.isOk());
  CHECK(*placed == std::vector<NodeId>{id("b"), id("b"), id("b")});
}

TEST_CASE("PACK splits a group across as few nodes as it can") {
  std::vector<NodeView> nodes = {node("a", {{"CPU", 4}}), node("b", {{"CPU", 4}}),
                                 node("c", {{"CPU", 4}})};
  std::vector<Resources> bundles = cpuBundles({2, 2, 3});
  auto placed = placeBundles(nodes, bundles, PlacementStrategy::kPack);
  REQUIRE(placed.isOk());
  CHECK(distinctNodes(*placed).size() == 2);
  // Largest first on the freest (ties: smallest id), then fill nodes the group already uses.
  CHECK(*placed == std::vector<NodeId>{id("b"), id("b"), id("a")});
}

TEST_CASE("PACK backtracks when first-fit-decreasing gets stuck") {
  // FFD puts 3+3+3 on a (1 left), then 3+2+2+2 on b and cannot place the last 2.
  // The only packing is 3+3+2+2 on each node.
  std::vector<NodeView> nodes = {node("a", {{"CPU", 10}}), node("b", {{"CPU", 10}})};
  std::vector<Resources> bundles = cpuBundles({3, 3, 3, 3, 2, 2, 2, 2});
  auto placed = placeBundles(nodes, bundles, PlacementStrategy::kPack);
  REQUIRE_MESSAGE(placed.isOk(), placed.status().toString());
  auto load = loadOf(*placed, bundles);
  CHECK(load[id("a")]["CPU"] == doctest::Approx(10));
  CHECK(load[id("b")]["CPU"] == doctest::Approx(10));
}

TEST_CASE("PACK reports infeasible when the cluster as a whole is too small") {
  std::vector<NodeView> nodes = {node("a", {{"CPU", 4}}), node("b", {{"CPU", 4}})};
  auto placed = placeBundles(nodes, cpuBundles({3, 3, 3}), PlacementStrategy::kPack);
  requireError(placed, StatusCode::kResourceExhausted, "infeasible: ",
               {"need CPU 9", "have CPU 8"});
  // Enough in aggregate but not in bins of 4: the search over empty nodes proves it.
  auto packing = placeBundles(nodes, cpuBundles({3, 3, 2}), PlacementStrategy::kPack);
  requireError(packing, StatusCode::kResourceExhausted, "infeasible: ", {"bundle 2", "CPU 2"});
}

TEST_CASE("SPREAD puts a new group on distinct nodes, freest first") {
  std::vector<NodeView> nodes = {node("a", {{"CPU", 8}}, {{"CPU", 6}}), node("b", {{"CPU", 8}}),
                                 node("c", {{"CPU", 8}}, {{"CPU", 3}})};
  auto placed = placeBundles(nodes, cpuBundles({1, 1, 1}), PlacementStrategy::kSpread);
  REQUIRE(placed.isOk());
  CHECK(distinctNodes(*placed).size() == 3);
  CHECK(*placed == std::vector<NodeId>{id("b"), id("c"), id("a")});
}

TEST_CASE("SPREAD reuses nodes only once distinct ones run out") {
  std::vector<NodeView> nodes = {node("a", {{"CPU", 8}}), node("b", {{"CPU", 8}})};
  auto placed = placeBundles(nodes, cpuBundles({1, 1, 1, 1}), PlacementStrategy::kSpread);
  REQUIRE(placed.isOk());
  auto load = loadOf(*placed, cpuBundles({1, 1, 1, 1}));
  CHECK(load[id("a")]["CPU"] == doctest::Approx(2));
  CHECK(load[id("b")]["CPU"] == doctest::Approx(2));
  // A distinct node without room does not count: both bundles share the one that has room.
  std::vector<NodeView> cramped = {node("a", {{"CPU", 8}}), node("b", {{"CPU", 8}}, {{"CPU", 8}})};
  placed = placeBundles(cramped, cpuBundles({2, 2}), PlacementStrategy::kSpread);
  REQUIRE(placed.isOk());
  CHECK(*placed == std::vector<NodeId>{id("a"), id("a")});
}

TEST_CASE("STRICT_PACK puts every bundle on one node or fails") {
  std::vector<NodeView> nodes = {node("a", {{"CPU", 4}}), node("b", {{"CPU", 8}}, {{"CPU", 2}})};
  auto placed = placeBundles(nodes, cpuBundles({2, 2, 2}), PlacementStrategy::kStrictPack);
  REQUIRE(placed.isOk());
  CHECK(*placed == std::vector<NodeId>{id("b"), id("b"), id("b")});

  // b could hold 6 when empty: pending, even though PACK could split it right now.
  auto pending = placeBundles(nodes, cpuBundles({3, 3, 1}), PlacementStrategy::kStrictPack);
  requireError(pending, StatusCode::kUnavailable, "pending: ",
               {"3 bundles together", "CPU 7", "6 free"});
  CHECK(placeBundles(nodes, cpuBundles({3, 3, 1}), PlacementStrategy::kPack).isOk());

  // No node could ever hold 9 CPUs at once.
  auto infeasible = placeBundles(nodes, cpuBundles({3, 3, 3}), PlacementStrategy::kStrictPack);
  requireError(infeasible, StatusCode::kResourceExhausted, "infeasible: ",
               {"CPU 9", "largest alive node has CPU 8"});
}

TEST_CASE("STRICT_SPREAD puts each bundle on its own node") {
  std::vector<NodeView> nodes = {node("a", {{"CPU", 4}}), node("b", {{"CPU", 4}}),
                                 node("c", {{"CPU", 4}})};
  auto placed = placeBundles(nodes, cpuBundles({1, 1, 1}), PlacementStrategy::kStrictSpread);
  REQUIRE(placed.isOk());
  CHECK(distinctNodes(*placed).size() == 3);

  auto tooMany = placeBundles(nodes, cpuBundles({1, 1, 1, 1}), PlacementStrategy::kStrictSpread);
  requireError(tooMany, StatusCode::kResourceExhausted, "infeasible: ",
               {"4 distinct nodes", "only 3 alive nodes"});

  nodes[1].used = {{"CPU", 4}};
  auto busy = placeBundles(nodes, cpuBundles({1, 1, 1}), PlacementStrategy::kStrictSpread);
  requireError(busy, StatusCode::kUnavailable, "pending: ", {"3 distinct", "only 2 such nodes"});
}

TEST_CASE("STRICT_SPREAD finds a matching the greedy choice misses") {
  // Bundle 0 is bigger and would take a (the freest); but bundle 1 needs the ssd only a has.
  std::vector<NodeView> nodes = {node("a", {{"CPU", 8}, {"ssd", 4}}), node("b", {{"CPU", 4}})};
  std::vector<Resources> bundles = {{{"CPU", 4}}, {{"CPU", 1}, {"ssd", 1}}};
  auto placed = placeBundles(nodes, bundles, PlacementStrategy::kStrictSpread);
  REQUIRE_MESSAGE(placed.isOk(), placed.status().toString());
  CHECK(*placed == std::vector<NodeId>{id("b"), id("a")});
}

// ---------------------------------------------------------------- resizing a live group

TEST_CASE("resize PACK prefers nodes the group already uses") {
  std::vector<NodeView> nodes = {node("a", {{"CPU", 16}}), node("b", {{"CPU", 8}}, {{"CPU", 4}})};
  auto placed = placeBundles(nodes, cpuBundles({2, 2}), PlacementStrategy::kPack, {id("b")});
  REQUIRE(placed.isOk());
  CHECK(*placed == std::vector<NodeId>{id("b"), id("b")});
  // Too much for b, but a can take all of it: one node beats splitting.
  placed = placeBundles(nodes, cpuBundles({3, 3}), PlacementStrategy::kPack, {id("b")});
  REQUIRE(placed.isOk());
  CHECK(*placed == std::vector<NodeId>{id("a"), id("a")});
  // No node takes all of it: b (the group's node) is filled before a, though equally free.
  placed = placeBundles({node("a", {{"CPU", 4}}), node("b", {{"CPU", 8}}, {{"CPU", 4}})},
                        cpuBundles({3, 3}), PlacementStrategy::kPack, {id("b")});
  REQUIRE(placed.isOk());
  CHECK(*placed == std::vector<NodeId>{id("b"), id("a")});
}

TEST_CASE("resize SPREAD prefers nodes the group does not use yet") {
  std::vector<NodeView> nodes = {node("a", {{"CPU", 16}}), node("b", {{"CPU", 4}}),
                                 node("c", {{"CPU", 2}})};
  auto placed = placeBundles(nodes, cpuBundles({1, 1}), PlacementStrategy::kSpread, {id("a")});
  REQUIRE(placed.isOk());
  CHECK(*placed == std::vector<NodeId>{id("b"), id("c")});
  // The third new bundle has to share; it goes to the freest node with the fewest bundles.
  placed = placeBundles(nodes, cpuBundles({1, 1, 1}), PlacementStrategy::kSpread, {id("a")});
  REQUIRE(placed.isOk());
  CHECK(*placed == std::vector<NodeId>{id("b"), id("c"), id("a")});
}

TEST_CASE("resize STRICT_PACK stays on the group's node") {
  std::vector<NodeView> nodes = {node("a", {{"CPU", 16}}), node("b", {{"CPU", 8}}, {{"CPU", 4}})};
  auto placed = placeBundles(nodes, cpuBundles({1, 2}), PlacementStrategy::kStrictPack,
                             {id("b"), id("b")});
  REQUIRE(placed.isOk());
  CHECK(*placed == std::vector<NodeId>{id("b"), id("b")});

  // a has room, but the group is on b: wait for b.
  auto pending = placeBundles(nodes, cpuBundles({3, 3}), PlacementStrategy::kStrictPack, {id("b")});
  requireError(pending, StatusCode::kUnavailable, "pending: ", {"node b", "CPU 6", "4 free"});
  // b could never hold 9 more, whatever a has.
  auto infeasible =
      placeBundles(nodes, cpuBundles({5, 4}), PlacementStrategy::kStrictPack, {id("b")});
  requireError(infeasible, StatusCode::kResourceExhausted, "infeasible: ",
               {"node b", "CPU 9", "CPU 8"});

  nodes[1].alive = false;
  auto gone = placeBundles(nodes, cpuBundles({1}), PlacementStrategy::kStrictPack, {id("b")});
  requireError(gone, StatusCode::kResourceExhausted, "infeasible: ", {"node b", "not alive"});

  auto torn = placeBundles(nodes, cpuBundles({1}), PlacementStrategy::kStrictPack,
                           {id("a"), id("b")});
  requireError(torn, StatusCode::kInvalidArgument, "STRICT_PACK group's existing bundles sit on 2");
}

TEST_CASE("resize STRICT_SPREAD avoids the group's nodes") {
  std::vector<NodeView> nodes = {node("a", {{"CPU", 16}}), node("b", {{"CPU", 8}}),
                                 node("c", {{"CPU", 4}})};
  auto placed =
      placeBundles(nodes, cpuBundles({1}), PlacementStrategy::kStrictSpread, {id("a"), id("b")});
  REQUIRE(placed.isOk());
  CHECK(*placed == std::vector<NodeId>{id("c")});
  auto full =
      placeBundles(nodes, cpuBundles({1, 1}), PlacementStrategy::kStrictSpread, {id("a"), id("b")});
  requireError(full, StatusCode::kResourceExhausted, "infeasible: ",
               {"2 distinct nodes", "only 1 alive node", "2 used by the group"});
  // c exists but is too small for this bundle, and a and b are taken by the group.
  auto small =
      placeBundles(nodes, cpuBundles({6}), PlacementStrategy::kStrictSpread, {id("a"), id("b")});
  requireError(small, StatusCode::kResourceExhausted, "infeasible: ",
               {"bundle 0 needs CPU 6", "not used by the group has CPU 4"});
}

// ---------------------------------------------------------------- resources and rules

TEST_CASE("custom resources and memory steer placement and name themselves in errors") {
  std::vector<NodeView> nodes = {node("a", {{"CPU", 32}, {"memory", 64 * kGiB}}),
                                 node("b", {{"CPU", 4}, {"memory", 8 * kGiB}, {"ssd", 2}})};
  std::vector<Resources> bundles = {{{"CPU", 1}, {"ssd", 1}}, {{"CPU", 1}, {"ssd", 1}}};
  auto placed = placeBundles(nodes, bundles, PlacementStrategy::kSpread);
  REQUIRE(placed.isOk());
  CHECK(*placed == std::vector<NodeId>{id("b"), id("b")});  // a has no ssd at all

  auto ssd = placeBundles(nodes, {{{"ssd", 3}}}, PlacementStrategy::kPack);
  requireError(ssd, StatusCode::kResourceExhausted, "infeasible: ",
               {"bundle 0 needs ssd 3", "largest alive node has ssd 2"});

  placed = placeBundles(nodes, {{{"memory", 16 * kGiB}}}, PlacementStrategy::kPack);
  REQUIRE(placed.isOk());
  CHECK(*placed == std::vector<NodeId>{id("a")});
  nodes[0].used = {{"memory", 60 * kGiB}};
  auto memory = placeBundles(nodes, {{{"memory", 16 * kGiB}}}, PlacementStrategy::kPack);
  requireError(memory, StatusCode::kUnavailable, "pending: ",
               {"bundle 0 needs memory 16 GiB", "most free memory has 8 GiB free"});
}

TEST_CASE("fractional CPUs pack exactly") {
  std::vector<NodeView> nodes = {node("a", {{"CPU", 2}}), node("b", {{"CPU", 1}})};
  auto placed =
      placeBundles(nodes, cpuBundles({0.5, 0.5, 0.5, 0.5}), PlacementStrategy::kStrictPack);
  REQUIRE(placed.isOk());
  CHECK(*placed == std::vector<NodeId>(4, id("a")));
  auto over = placeBundles(nodes, cpuBundles({0.5, 0.5, 0.5, 0.5, 0.5}),
                           PlacementStrategy::kStrictPack);
  requireError(over, StatusCode::kResourceExhausted, "infeasible: ", {"CPU 2.5", "CPU 2"});
  std::vector<Resources> tenths(10, Resources{{"CPU", 0.1}});
  placed = placeBundles({node("a", {{"CPU", 1}})}, tenths, PlacementStrategy::kPack);
  CHECK(placed.isOk());
}

TEST_CASE("placement is all or nothing") {
  std::vector<NodeView> nodes = {node("a", {{"CPU", 4}}), node("b", {{"CPU", 4}}, {{"CPU", 3}})};
  // Bundles 0 and 1 would fit, bundle 2 cannot: no partial list comes back.
  auto placed = placeBundles(nodes, cpuBundles({2, 2, 2}), PlacementStrategy::kSpread);
  requireError(placed, StatusCode::kUnavailable, "pending: ", {"bundle", "CPU 2"});
  auto infeasible = placeBundles(nodes, cpuBundles({1, 1, 5}), PlacementStrategy::kSpread);
  requireError(infeasible, StatusCode::kResourceExhausted, "infeasible: ",
               {"bundle 2 needs CPU 5", "largest alive node has CPU 4"});
}

TEST_CASE("dead nodes are never used for bundles") {
  std::vector<NodeView> nodes = {deadNode("a", {{"CPU", 64}}), node("b", {{"CPU", 4}}),
                                 node("c", {{"CPU", 4}})};
  for (PlacementStrategy strategy : {PlacementStrategy::kPack, PlacementStrategy::kSpread,
                                     PlacementStrategy::kStrictSpread}) {
    auto placed = placeBundles(nodes, cpuBundles({1, 1}), strategy);
    REQUIRE(placed.isOk());
    CHECK(distinctNodes(*placed).count(id("a")) == 0);
  }
  auto strict = placeBundles(nodes, cpuBundles({1, 1, 1}), PlacementStrategy::kStrictSpread);
  requireError(strict, StatusCode::kResourceExhausted, "infeasible: ", {"only 2 alive nodes"});
  auto none = placeBundles({deadNode("a", {{"CPU", 64}})}, cpuBundles({1}),
                           PlacementStrategy::kPack);
  requireError(none, StatusCode::kResourceExhausted, "infeasible: ", {"no node is alive"});
}

TEST_CASE("bad bundles are rejected and an empty request places nothing") {
  std::vector<NodeView> nodes = {node("a", {{"CPU", 4}})};
  auto negative = placeBundles(nodes, cpuBundles({1, -2}), PlacementStrategy::kPack);
  requireError(negative, StatusCode::kInvalidArgument, "bundle 1 asks for CPU -2");
  auto empty = placeBundles(nodes, {}, PlacementStrategy::kStrictSpread);
  REQUIRE(empty.isOk());
  CHECK(empty->empty());
}

TEST_CASE("placement is deterministic whatever the node order") {
  std::vector<NodeView> nodes;
  for (int i = 0; i < 12; ++i) {
    // Several nodes share the same free CPU, so ties must fall to the id.
    nodes.push_back(node(fmt::format("n{:02}", i), {{"CPU", 8}, {"GPU", double(i % 2)}},
                         {{"CPU", double(i % 3)}}));
  }
  std::vector<Resources> bundles = {{{"CPU", 2}}, {{"CPU", 3}, {"GPU", 1}}, {{"CPU", 1}},
                                    {{"CPU", 5}}, {{"CPU", 2}},             {{"CPU", 4}}};
  std::vector<NodeView> reversed(nodes.rbegin(), nodes.rend());
  std::vector<NodeView> rotated = nodes;
  std::rotate(rotated.begin(), rotated.begin() + 5, rotated.end());
  for (PlacementStrategy strategy : {PlacementStrategy::kPack, PlacementStrategy::kSpread,
                                     PlacementStrategy::kStrictPack,
                                     PlacementStrategy::kStrictSpread}) {
    CAPTURE(static_cast<int>(strategy));
    auto first = placeBundles(nodes, bundles, strategy, {id("n03")});
    auto again = placeBundles(nodes, bundles, strategy, {id("n03")});
    auto fromReversed = placeBundles(reversed, bundles, strategy, {id("n03")});
    auto fromRotated = placeBundles(rotated, bundles, strategy, {id("n03")});
    REQUIRE(first.isOk() == again.isOk());
    REQUIRE(first.isOk() == fromReversed.isOk());
    REQUIRE(first.isOk() == fromRotated.isOk());
    if (first.isOk()) {
      CHECK(*first == *again);
      CHECK(*first == *fromReversed);
      CHECK(*first == *fromRotated);
    } else {
      CHECK(first.status().message() == fromReversed.status().message());
    }
  }
  auto picked = pickNode(nodes, {{"CPU", 1}});
  auto pickedReversed = pickNode(reversed, {{"CPU", 1}});
  REQUIRE(picked.isOk());
  REQUIRE(pickedReversed.isOk());
  CHECK(*picked == *pickedReversed);
  CHECK(*picked == id("n00"));  // 8 free on n00, n03, n06, n09, both GPU-less and GPU nodes
}

TEST_CASE("ties between equally free nodes go to the smallest id, whatever the input order") {
  std::vector<NodeView> nodes = {node("c", {{"CPU", 4}}), node("b", {{"CPU", 4}}),
                                 node("a", {{"CPU", 4}}), node("d", {{"CPU", 2}})};
  for (PlacementStrategy strategy : {PlacementStrategy::kPack, PlacementStrategy::kSpread,
                                     PlacementStrategy::kStrictPack,
                                     PlacementStrategy::kStrictSpread}) {
    CAPTURE(static_cast<int>(strategy));
    auto placed = placeBundles(nodes, cpuBundles({1}), strategy);
    REQUIRE(placed.isOk());
    CHECK(*placed == std::vector<NodeId>{id("a")});
  }
}

}  // namespace
}  // namespace troupe::scheduler
