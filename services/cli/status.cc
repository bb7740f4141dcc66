#include <algorithm>
#include <cctype>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "troupe/runtime/names.h"
#include "troupe/runtime/rpc.h"
#include "troupe.capnp.h"
#include "troupe/runtime/resources.h"

namespace troupe::cli {
namespace {

nlohmann::json toJson(const Resources& r) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [name, qty] : r) j[name] = qty;
  return j;
}

nlohmann::json toJson(const NodeRecord& n) {
  nlohmann::json labels = nlohmann::json::object();
  for (const auto& [k, v] : n.labels) labels[k] = v;
  return {{"id", n.id.hex()},
          {"address", n.address},
          {"hostname", n.hostname},
          {"state", nodeStateName(n.state)},
          {"pid", n.pid},
          {"is_head", n.isHead},
          {"resources", toJson(n.total)},
          {"used", toJson(n.used)},
          {"labels", labels},
          {"registered_ms", n.registeredMs},
          {"last_heartbeat_ms", n.lastHeartbeatMs},
          {"death_reason", n.deathReason}};
}

nlohmann::json toJson(const ActorRecord& a) {
  return {{"id", a.id.hex()},
          {"type", a.type},
          {"name", a.name},
          {"node_id", a.nodeId.hex()},
          {"pid", a.pid},
          {"address", a.address},
          {"state", actorStateName(a.state)},
          {"incarnation", a.incarnation},
          {"restarts", a.restarts},
          {"max_restarts", a.maxRestarts},
          {"resources", toJson(a.resources)},
          {"placement_group", a.placementGroup.hex()},
          {"bundle_index", a.bundleIndex},
          {"death_reason", a.deathReason}};
}

nlohmann::json toJson(const PlacementGroupRecord& g) {
  nlohmann::json bundles = nlohmann::json::array();
  for (const auto& b : g.bundles) {
    bundles.push_back({{"resources", toJson(b.resources)}, {"node_id", b.nodeId.hex()}, {"removed", b.resources.empty()}});
  }
  return {{"id", g.id.hex()},
          {"name", g.name},
          {"strategy", placementStrategyName(g.strategy)},
          {"state", placementGroupStateName(g.state)},
          {"bundles", bundles},
          {"pending_reason", g.pendingReason}};
}

// The driver's document (world_size, step, members, samples_per_s, ...) with the controller's
// epoch, the events ("<wall ms> <text>") as {"time_ms", "text"} and the drivers' commands.
nlohmann::json toJson(const ElasticGroupRecord& g) {
  nlohmann::json out = nlohmann::json::parse(g.doc, nullptr, false);
  if (!out.is_object()) out = {{"doc_error", "the driver's document is not a JSON object"}};
  out["id"] = g.id;
  out["epoch"] = g.epoch;
  nlohmann::json events = nlohmann::json::array();
  for (const auto& e : g.events) {
    size_t space = e.find(' ');
    int64_t ms = 0;
    try {
      ms = std::stoll(e.substr(0, space));
    } catch (const std::exception&) {
      space = std::string::npos;
    }
    events.push_back({{"time_ms", ms}, {"text", space == std::string::npos ? e : e.substr(space + 1)}});
  }
  out["events"] = events;
  nlohmann::json commands = nlohmann::json::array();
  for (const auto& c : g.commands) {
    commands.push_back({{"seq", c.seq}, {"kind", groupCommandKindName(c.kind)}, {"workers", c.workers},
                        {"time_ms", c.timeMs}, {"from", c.from}});
  }
  out["commands"] = commands;
  for (const char* key : {"world_size", "step"}) {
    if (!out.contains(key)) out[key] = 0;
  }
  if (!out.contains("members")) out["members"] = nlohmann::json::array();
  return out;
}

std::string ago(int64_t ms) {
  if (ms <= 0) return "-";
  double s = static_cast<double>(wallClockMs() - ms) / 1000.0;
  return s < 120 ? fmt::format("{:.1f}s ago", s) : fmt::format("{:.0f}m ago", s / 60);
}

// The head's dashboard URL (written by troupe.dashboard once it listens), or "" if this
// machine's run directory has none.
std::string dashboardUrl(const std::string& runDir) {
  std::ifstream in(runDir + "/dashboard.url");
  std::string url;
  if (runDir.empty() || !std::getline(in, url)) return "";
  return url;
}

// Each alive node's object store (NodeAgent.objectStore), asked of all at once; a node that
// does not answer within 200 ms (cut off, but not declared dead yet) is left out, so a status
// of a partitioned cluster, which scripts poll, is not held up.
struct StoreUsage {
  uint64_t objects = 0;
  uint64_t bytes = 0;
  uint64_t limit = 0;
  uint64_t spilledObjects = 0;
  uint64_t spilledBytes = 0;
};
std::map<std::string, StoreUsage> objectStores(kj::AsyncIoContext& io, const ClusterTarget& target,
                                               const std::vector<NodeRecord>& nodes) {
  constexpr kj::Duration kStoreDeadline = 200 * kj::MILLISECONDS;
  std::map<std::string, StoreUsage> out;
  kj::Vector<kj::Promise<void>> asks;
  for (const auto& n : nodes) {
    auto hp = parseHostPort(n.address);
    if (n.state != NodeState::kAlive || !hp.isOk()) continue;
    auto ask = RpcClient::connect(io, *hp, target.token, kStoreDeadline)
                   .then([](kj::Own<RpcClient> client) {
                     return client->bootstrap<rpc::NodeAgent>().objectStoreRequest().send().attach(kj::mv(client));
                   })
                   .then([&out, id = n.id.hex()](capnp::Response<rpc::NodeAgent::ObjectStoreResults> r) {
                     out[id] = StoreUsage{r.getObjects(), r.getBytes(), r.getLimit(), r.getSpilledObjects(), r.getSpilledBytes()};
                   });
    asks.add(io.provider->getTimer().timeoutAfter(kStoreDeadline, kj::mv(ask)).catch_([](kj::Exception&&) {}));
  }
  kj::joinPromises(asks.releaseAsArray()).wait(io.waitScope);
  return out;
}

}  // namespace

int statusCommand(const StatusFlags& flags) {
  auto target = resolveCluster(flags.address, flags.token);
  if (!target.isOk()) return fail(target.status());
  auto io = kj::setupAsyncIo();
  StatusQuery query;
  query.limit = flags.limit;
  query.offset = flags.offset;
  query.state = flags.state;
  std::transform(query.state.begin(), query.state.end(), query.state.begin(), ::toupper);
  query.node = flags.node;
  if (query.limit == 0 && (query.offset > 0 || !query.state.empty() || !query.node.empty())) {
    query.limit = UINT32_MAX;  // filters need the paged call, which applies them in the store
  }
  auto snapshot = fetchStatus(io, *target, 10 * kj::SECONDS, query);
  if (!snapshot.isOk()) return fail(snapshot.status());
  auto* nodes = &snapshot->nodes;
  auto stores = objectStores(io, *target, *nodes);
  uint64_t totalActors = 0;
  for (const auto& [state, n] : snapshot->actorCounts) totalActors += n;

  if (flags.json) {
    nlohmann::json out = {{"cluster", {{"address", target->controller.toString()},
                                       {"run_dir", target->runDir},
                                       {"dashboard", dashboardUrl(target->runDir)}}},
                          {"nodes", nlohmann::json::array()},
                          {"actors", nlohmann::json::array()},
                          {"actors_matching", snapshot->actorsMatching},
                          {"actor_counts", snapshot->actorCounts},
                          {"placement_groups", nlohmann::json::array()},
                          {"groups", nlohmann::json::array()}};
    for (const auto& n : *nodes) {
      auto node = toJson(n);
      if (auto it = stores.find(n.id.hex()); it != stores.end()) {
        const auto& u = it->second;
        node["object_store"] = {{"objects", u.objects},
                                {"bytes", u.bytes},
                                {"limit", u.limit},
                                {"spilled_objects", u.spilledObjects},
                                {"spilled_bytes", u.spilledBytes}};
      }
      out["nodes"].push_back(node);
    }
    for (const auto& a : snapshot->actors) out["actors"].push_back(toJson(a));
    for (const auto& g : snapshot->placementGroups) out["placement_groups"].push_back(toJson(g));
    for (const auto& g : snapshot->groups) out["groups"].push_back(toJson(g));
    std::cout << out.dump() << std::endl;
    return 0;
  }
  size_t alive = 0;
  for (const auto& n : *nodes) alive += n.state == NodeState::kAlive;
  std::cout << fmt::format("Cluster at {}: {} node(s) alive, {} dead\n", target->controller.toString(), alive,
                           nodes->size() - alive);
  if (auto url = dashboardUrl(target->runDir); !url.empty()) {
    std::cout << "Dashboard: " << url << " (log in with the URL 'troupe dashboard' prints)\n";
  }
  std::cout << fmt::format("{:<18}{:<6}{:<22}{:<8}{:<9}{:<12}{}\n", "NODE", "HEAD", "ADDRESS", "PID", "STATE",
                           "HEARTBEAT", "RESOURCES (used / total)");
  for (const auto& n : *nodes) {
    std::string res;
    for (const auto& [name, qty] : n.total) {
      if (!res.empty()) res += ", ";
      double used = n.used.count(name) ? n.used.at(name) : 0;
      res += name == "memory" ? fmt::format("memory {:.1f}/{:.1f} GiB", used / (1 << 30), qty / (1 << 30))
                              : fmt::format("{} {:g}/{:g}", name, used, qty);
    }
    std::cout << fmt::format("{:<18}{:<6}{:<22}{:<8}{:<9}{:<12}{}\n", n.id.hex(), n.isHead ? "yes" : "", n.address,
                             n.pid, nodeStateName(n.state), ago(n.lastHeartbeatMs), res);
    if (n.state == NodeState::kDead) std::cout << "    died: " << displayText(n.deathReason) << "\n";
    if (auto it = stores.find(n.id.hex()); it != stores.end()) {
      const auto& u = it->second;
      constexpr double kMiB = 1 << 20;
      std::cout << fmt::format("    objects: {} in {:.1f} of {:.1f} MiB; spilled: {} in {:.1f} MiB\n", u.objects,
                               static_cast<double>(u.bytes) / kMiB, static_cast<double>(u.limit) / kMiB,
                               u.spilledObjects, static_cast<double>(u.spilledBytes) / kMiB);
    }
  }
  std::string counts;
  for (const auto& [state, n] : snapshot->actorCounts) counts += fmt::format("{}{} {}", counts.empty() ? "" : ", ", n, state);
  if (snapshot->actors.empty()) {
    std::cout << (totalActors == 0 ? std::string("Actors: none\n")
                                   : fmt::format("Actors: none shown of {} ({})\n", totalActors, counts));
  } else {
    std::string shown = snapshot->actors.size() == totalActors
                            ? fmt::format("{}", totalActors)
                            : fmt::format("{} shown of {} matching, from {}{}", snapshot->actors.size(),
                                          snapshot->actorsMatching, totalActors,
                                          snapshot->actors.size() < snapshot->actorsMatching ? "; --limit 0 shows all" : "");
    // Columns as wide as their longest entry (a name in an anonymous namespace is ~40 wide).
    size_t typeWidth = 10, nameWidth = 14;
    for (const auto& a : snapshot->actors) {
      typeWidth = std::max(typeWidth, displayText(a.type, 64).size() + 2);
      nameWidth = std::max(nameWidth, displayText(a.name, 64).size() + 2);
    }
    std::cout << fmt::format("\nActors ({}: {})\n{:<18}{:<{}}{:<{}}{:<18}{:<8}{:<11}{:<9}{}\n", shown, counts, "ACTOR",
                             "TYPE", typeWidth, "NAME", nameWidth, "NODE", "PID", "STATE", "RESTARTS", "REASON");
    for (const auto& a : snapshot->actors) {
      // Names, types and reasons as one line each: none can forge a row (a reason holds stderr).
      std::cout << fmt::format("{:<18}{:<{}}{:<{}}{:<18}{:<8}{:<11}{:<9}{}\n", a.id.hex(), displayText(a.type, 64),
                               typeWidth, a.name.empty() ? "-" : displayText(a.name, 64), nameWidth,
                               a.nodeId.empty() ? "-" : a.nodeId.hex(), a.pid, actorStateName(a.state), a.restarts,
                               displayText(a.deathReason));
    }
  }
  if (!snapshot->placementGroups.empty()) {
    std::cout << fmt::format("\nPlacement groups ({})\n", snapshot->placementGroups.size());
    for (const auto& g : snapshot->placementGroups) {
      std::cout << fmt::format("{:<18}{:<14}{:<9}{} bundle(s){}\n", g.id.hex(), placementStrategyName(g.strategy),
                               placementGroupStateName(g.state), g.bundles.size(),
                               g.pendingReason.empty() ? "" : "  " + g.pendingReason);
    }
  }
  if (snapshot->groups.empty()) {
    std::cout << "Groups: none" << std::endl;
    return 0;
  }
  std::cout << fmt::format("\nGroups ({})\n", snapshot->groups.size());
  for (const auto& record : snapshot->groups) {
    auto g = toJson(record);
    std::cout << fmt::format("{}  {}  epoch {}  world size {}  step {}  {:.1f} samples/s\n", g["id"].get<std::string>(),
                             g.value("state", std::string("?")), g["epoch"].get<int64_t>(), g["world_size"].get<int64_t>(),
                             g["step"].get<int64_t>(), g.value("samples_per_s", 0.0));
    std::cout << "  members: " << g["members"].dump() << "\n";
    for (const auto& s : g.value("stragglers", nlohmann::json::array())) {
      std::cout << fmt::format("  straggler: rank {} (Trainer {}) {:.3f} s compute per step, {:.1f}x the others' median\n",
                               s.value("rank", -1), s.value("trainer", std::string("?")), s.value("compute_s", 0.0),
                               s.value("ratio", 0.0));
    }
    if (!record.commands.empty()) {
      const GroupCommand& c = record.commands.back();
      std::cout << fmt::format("  last command: #{} {} from {} ({})\n", c.seq,
                               c.kind == GroupCommand::Kind::kResize ? fmt::format("resize to {}", c.workers) : "stop",
                               displayText(c.from), ago(c.timeMs));
    }
    auto& events = g["events"];
    size_t from = events.size() > 5 ? events.size() - 5 : 0;
    for (size_t i = from; i < events.size(); ++i) {
      std::cout << fmt::format("  {:>11} {}\n", ago(events[i]["time_ms"].get<int64_t>()),
                               displayText(events[i]["text"].get<std::string>()));
    }
  }
  std::cout << std::flush;
  return 0;
}

}  // namespace troupe::cli
