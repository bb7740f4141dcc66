#include <iostream>
#include <nlohmann/json.hpp>

#include "cli.h"
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

std::string ago(int64_t ms) {
  if (ms <= 0) return "-";
  double s = static_cast<double>(wallClockMs() - ms) / 1000.0;
  return s < 120 ? fmt::format("{:.1f}s ago", s) : fmt::format("{:.0f}m ago", s / 60);
}

}  // namespace

int statusCommand(const StatusFlags& flags) {
  auto target = resolveCluster(flags.address, flags.token);
  if (!target.isOk()) return fail(target.status());
  auto io = kj::setupAsyncIo();
  auto nodes = fetchNodes(io, *target, 3 * kj::SECONDS);
  if (!nodes.isOk()) return fail(nodes.status());

  if (flags.json) {
    nlohmann::json out = {{"cluster", {{"address", target->controller.toString()}, {"run_dir", target->runDir}}},
                          {"nodes", nlohmann::json::array()},
                          {"actors", nlohmann::json::array()},
                          {"groups", nlohmann::json::array()}};
    for (const auto& n : *nodes) out["nodes"].push_back(toJson(n));
    std::cout << out.dump() << std::endl;
    return 0;
  }
  size_t alive = 0;
  for (const auto& n : *nodes) alive += n.state == NodeState::kAlive;
  std::cout << fmt::format("Cluster at {}: {} node(s) alive, {} dead\n", target->controller.toString(), alive,
                           nodes->size() - alive);
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
    if (n.state == NodeState::kDead) std::cout << "    died: " << n.deathReason << "\n";
  }
  std::cout << "Actors: none (actors are not built yet)\nGroups: none (elastic groups are not built yet)"
            << std::endl;
  return 0;
}

}  // namespace troupe::cli
