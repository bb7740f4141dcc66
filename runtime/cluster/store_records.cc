#include "store_records.h"

#include <cmath>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "troupe/runtime/resources.h"

namespace troupe {

// The names a record stores for each state and kind (cluster_store.h).
const char* nodeStateName(NodeState state) {
  switch (state) {
    case NodeState::kAlive: return "ALIVE";
    case NodeState::kDead: return "DEAD";
  }
  return "UNKNOWN";
}

const char* clusterEventTypeName(ClusterEventType type) {
  switch (type) {
    case ClusterEventType::kNodeAdded: return "NODE_ADDED";
    case ClusterEventType::kNodeDead: return "NODE_DEAD";
  }
  return "UNKNOWN";
}

const char* actorStateName(ActorState state) {
  switch (state) {
    case ActorState::kPending: return "PENDING";
    case ActorState::kAlive: return "ALIVE";
    case ActorState::kRestarting: return "RESTARTING";
    case ActorState::kDead: return "DEAD";
  }
  return "UNKNOWN";
}

std::optional<ActorState> actorStateFromName(const std::string& name) {
  for (ActorState state :
       {ActorState::kPending, ActorState::kAlive, ActorState::kRestarting, ActorState::kDead}) {
    if (name == actorStateName(state)) return state;
  }
  return std::nullopt;
}

const char* placementStrategyName(PlacementStrategy strategy) {
  switch (strategy) {
    case PlacementStrategy::kPack: return "PACK";
    case PlacementStrategy::kSpread: return "SPREAD";
    case PlacementStrategy::kStrictPack: return "STRICT_PACK";
    case PlacementStrategy::kStrictSpread: return "STRICT_SPREAD";
  }
  return "UNKNOWN";
}

Result<PlacementStrategy> parsePlacementStrategy(const std::string& name) {
  for (PlacementStrategy strategy :
       {PlacementStrategy::kPack, PlacementStrategy::kSpread, PlacementStrategy::kStrictPack,
        PlacementStrategy::kStrictSpread}) {
    if (name == placementStrategyName(strategy)) return strategy;
  }
  return Status(StatusCode::kInvalidArgument,
                fmt::format("unknown placement strategy '{}'; use PACK, SPREAD, STRICT_PACK or "
                            "STRICT_SPREAD",
                            name));
}

const char* placementGroupStateName(PlacementGroupState state) {
  switch (state) {
    case PlacementGroupState::kPending: return "PENDING";
    case PlacementGroupState::kCreated: return "CREATED";
    case PlacementGroupState::kRemoved: return "REMOVED";
  }
  return "UNKNOWN";
}

const char* groupCommandKindName(GroupCommand::Kind kind) {
  switch (kind) {
    case GroupCommand::Kind::kResize: return "resize";
    case GroupCommand::Kind::kStop: return "stop";
  }
  return "unknown";
}

std::optional<GroupCommand::Kind> groupCommandKindFromName(const std::string& name) {
  for (GroupCommand::Kind kind : {GroupCommand::Kind::kResize, GroupCommand::Kind::kStop}) {
    if (name == groupCommandKindName(kind)) return kind;
  }
  return std::nullopt;
}

namespace store_records {

using json = nlohmann::json;

namespace {

// Ids become Redis keys and file names: a record's own id must be one, an optional one empty or one.
bool validOrEmpty(const std::string& id) { return id.empty() || isValidIdText(id); }

// A time in ms written by cjson may be a float: any finite number that fits int64 (a cast of 1e300
// would be undefined behaviour).
std::optional<int64_t> millisOf(const json& v) {
  if (v.is_number_integer()) {
    if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)) return std::nullopt;
    return v.get<int64_t>();
  }
  if (!v.is_number_float()) return std::nullopt;
  double x = v.get<double>();
  if (!std::isfinite(x) || x < -9.2e18 || x > 9.2e18) return std::nullopt;
  return static_cast<int64_t>(x);
}

}  // namespace

Status malformed(const std::string& key, const std::string& detail) {
  return Status(StatusCode::kInternal,
                fmt::format("malformed record at Redis key '{}': {}; was it written by another "
                            "Troupe version?",
                            key, detail));
}

std::optional<ActorState> parseActorState(const std::string& name) { return actorStateFromName(name); }

std::optional<PlacementGroupState> parsePlacementGroupState(const std::string& name) {
  for (PlacementGroupState state : {PlacementGroupState::kPending, PlacementGroupState::kCreated,
                                    PlacementGroupState::kRemoved}) {
    if (name == placementGroupStateName(state)) return state;
  }
  return std::nullopt;
}

std::string bundlesJson(const std::vector<Bundle>& bundles) {
  json array = json::array();
  for (const Bundle& bundle : bundles) {
    array.push_back(json{{"resources", json(bundle.resources)}, {"node_id", bundle.nodeId.hex()}});
  }
  return array.dump();
}

// Throws json::exception when `text` is not an array of {"resources": {...}, "node_id": "..."}.
std::vector<Bundle> parseBundlesJson(const std::string& text) {
  std::vector<Bundle> bundles;
  for (const json& item : json::parse(text).get<std::vector<json>>()) {
    bundles.push_back(Bundle{item.at("resources").get<Resources>(),
                             NodeId(item.at("node_id").get<std::string>())});
  }
  return bundles;
}

std::string groupCommandJson(const GroupCommand& command, const std::string& nonce) {
  json out{{"nonce", nonce},
           {"time_ms", command.timeMs},
           {"from", command.from},
           {"kind", groupCommandKindName(command.kind)},
           {"workers", command.kind == GroupCommand::Kind::kResize ? command.workers : 0}};
  // A host name is not promised to be UTF-8: replace what is not instead of throwing.
  return out.dump(-1, ' ', false, json::error_handler_t::replace);
}

Result<GroupCommand> decodeGroupCommand(const std::string& text, const std::string& key) {
  json c = json::parse(text, nullptr, false);
  if (!c.is_object()) return malformed(key, "a command is not a JSON object");
  GroupCommand command;
  auto seq = c.find("seq");
  if (seq == c.end() || !seq->is_number_unsigned() || seq->get<uint64_t>() == 0) {
    return malformed(key, fmt::format("a command's seq is not a positive integer: {}", text.substr(0, 200)));
  }
  command.seq = seq->get<uint64_t>();
  auto time = c.find("time_ms");
  auto millis = time == c.end() ? std::nullopt : millisOf(*time);
  if (!millis) return malformed(key, fmt::format("command {} has no time_ms", command.seq));
  command.timeMs = *millis;
  auto from = c.find("from");
  if (from == c.end() || !from->is_string()) return malformed(key, fmt::format("command {} has no sender", command.seq));
  command.from = from->get<std::string>();
  auto kindName = c.find("kind");
  auto kind = kindName != c.end() && kindName->is_string() ? groupCommandKindFromName(kindName->get<std::string>())
                                                           : std::nullopt;
  if (!kind) return malformed(key, fmt::format("command {} is neither resize nor stop", command.seq));
  command.kind = *kind;
  if (command.kind == GroupCommand::Kind::kResize) {
    auto workers = c.find("workers");
    if (workers == c.end() || !workers->is_number_unsigned() || workers->get<uint64_t>() == 0 ||
        workers->get<uint64_t>() > UINT32_MAX) {
      return malformed(key, fmt::format("command {} resizes to no number of workers in [1, {}]", command.seq,
                                        UINT32_MAX));
    }
    command.workers = static_cast<uint32_t>(workers->get<uint64_t>());
  }
  return command;
}

std::string eventMessage(ClusterEventType type, const NodeId& id, const std::string& reason,
                         int64_t timeMs) {
  return json{{"type", clusterEventTypeName(type)},
              {"node_id", id.hex()},
              {"reason", reason},
              {"time_ms", timeMs}}
      .dump();
}

std::optional<ClusterEvent> parseEventMessage(const std::string& text) {
  try {
    json j = json::parse(text);
    ClusterEvent event;
    const std::string type = j.at("type").get<std::string>();
    if (type == clusterEventTypeName(ClusterEventType::kNodeAdded)) {
      event.type = ClusterEventType::kNodeAdded;
    } else if (type == clusterEventTypeName(ClusterEventType::kNodeDead)) {
      event.type = ClusterEventType::kNodeDead;
    } else {
      return std::nullopt;
    }
    event.nodeId = NodeId(j.at("node_id").get<std::string>());
    event.reason = j.value("reason", "");
    // cjson (inside Lua) may write the time as a float; accept any number that fits.
    auto timeMs = millisOf(j.at("time_ms"));
    if (!timeMs || !event.nodeId.valid()) return std::nullopt;
    event.timeMs = *timeMs;
    return event;
  } catch (const json::exception&) {
    return std::nullopt;
  }
}

Result<NodeRecord> decodeNode(FieldMap& fields, const std::string& key) {
  NodeRecord node;
  node.id = NodeId(fields["id"]);
  node.address = fields["address"];
  node.hostname = fields["hostname"];
  node.isHead = fields["is_head"] == "1";
  node.deathReason = fields["death_reason"];
  const std::string& state = fields["state"];
  if (state == nodeStateName(NodeState::kAlive)) {
    node.state = NodeState::kAlive;
  } else if (state == nodeStateName(NodeState::kDead)) {
    node.state = NodeState::kDead;
  } else {
    return malformed(key, fmt::format("state '{}' is neither ALIVE nor DEAD", state));
  }
  if (!parseInteger(fields["pid"], node.pid) ||
      !parseInteger(fields["registered_ms"], node.registeredMs) ||
      !parseInteger(fields["last_heartbeat_ms"], node.lastHeartbeatMs)) {
    return malformed(key, "pid, registered_ms or last_heartbeat_ms is not an integer");
  }
  try {
    node.total = json::parse(fields["total"]).get<Resources>();
    node.used = json::parse(fields["used"]).get<Resources>();
    node.labels = json::parse(fields["labels"]).get<std::map<std::string, std::string>>();
  } catch (const json::exception& e) {
    return malformed(key, fmt::format("total, used or labels is not a JSON object: {}",
                                      e.what()));
  }
  if (!node.id.valid()) return malformed(key, fmt::format("id '{}' is not an id", node.id.hex()));
  for (const Resources* r : {&node.total, &node.used}) {
    if (auto s = checkResources(*r, "total or used"); !s.isOk()) return malformed(key, s.message());
  }
  return node;
}

Result<ActorRecord> decodeActor(FieldMap& fields, const std::string& key) {
  ActorRecord actor;
  actor.id = ActorId(fields["id"]);
  actor.type = fields["type"];
  actor.name = fields["name"];
  actor.nodeId = NodeId(fields["node_id"]);
  actor.address = fields["address"];
  actor.detached = fields["detached"] == "1";
  actor.owner = fields["owner"];
  actor.initArgs = fields["init_args"];
  actor.placementGroup = PlacementGroupId(fields["placement_group"]);
  actor.deathReason = fields["death_reason"];
  auto state = parseActorState(fields["state"]);
  if (!state) return malformed(key, fmt::format("unknown actor state '{}'", fields["state"]));
  actor.state = *state;
  if (!parseInteger(fields["pid"], actor.pid) ||
      !parseInteger(fields["incarnation"], actor.incarnation) ||
      !parseInteger(fields["restarts"], actor.restarts) ||
      !parseInteger(fields["max_restarts"], actor.maxRestarts) ||
      !parseInteger(fields["max_task_retries"], actor.maxTaskRetries) ||
      !parseInteger(fields["bundle_index"], actor.bundleIndex) ||
      !parseInteger(fields["created_ms"], actor.createdMs) ||
      !parseInteger(fields["updated_ms"], actor.updatedMs)) {
    return malformed(key, "pid, incarnation, restarts, max_restarts, max_task_retries, "
                          "bundle_index, created_ms or updated_ms is not an integer in range");
  }
  try {
    actor.resources = json::parse(fields["resources"]).get<Resources>();
  } catch (const json::exception& e) {
    return malformed(key, fmt::format("resources is not a JSON object of numbers: {}",
                                      e.what()));
  }
  if (!actor.id.valid() || !validOrEmpty(actor.nodeId.hex()) || !validOrEmpty(actor.placementGroup.hex())) {
    return malformed(key, fmt::format("id '{}', node_id '{}' or placement_group '{}' is not an id", actor.id.hex(),
                                      actor.nodeId.hex(), actor.placementGroup.hex()));
  }
  if (auto s = checkResources(actor.resources, "resources"); !s.isOk()) return malformed(key, s.message());
  return actor;
}

Result<PlacementGroupRecord> decodePlacementGroup(FieldMap& fields,
                                                         const std::string& key) {
  PlacementGroupRecord group;
  group.id = PlacementGroupId(fields["id"]);
  group.name = fields["name"];
  group.pendingReason = fields["pending_reason"];
  auto strategy = parsePlacementStrategy(fields["strategy"]);
  if (!strategy) return malformed(key, strategy.status().message());
  group.strategy = *strategy;
  auto state = parsePlacementGroupState(fields["state"]);
  if (!state) {
    return malformed(key, fmt::format("unknown placement group state '{}'", fields["state"]));
  }
  group.state = *state;
  if (!parseInteger(fields["created_ms"], group.createdMs)) {
    return malformed(key, "created_ms is not an integer");
  }
  try {
    group.bundles = parseBundlesJson(fields["bundles"]);
  } catch (const json::exception& e) {
    return malformed(key, fmt::format("bundles is not a JSON array of {{\"resources\": {{...}}, "
                                      "\"node_id\": \"...\"}}: {}",
                                      e.what()));
  }
  if (!group.id.valid()) return malformed(key, fmt::format("id '{}' is not an id", group.id.hex()));
  for (const Bundle& bundle : group.bundles) {
    if (!validOrEmpty(bundle.nodeId.hex())) {
      return malformed(key, fmt::format("bundle node_id '{}' is not an id", bundle.nodeId.hex()));
    }
    if (auto s = checkResources(bundle.resources, "bundle"); !s.isOk()) return malformed(key, s.message());
  }
  return group;
}

}  // namespace store_records
}  // namespace troupe
