// ClusterStore over Redis (hiredis, synchronous). This is the only file that spells a Redis key;
// the connection is redis_connection.h, the scripts redis_scripts.h, the pub/sub readers
// redis_watchers.h.
//
// Key layout, prefix P = "troupe:<cluster>:":
//   P meta             hash  {token, controller_address, controller_pid, created_ms}, and the
//                             store gateway's {store_gateway, store_gateway_since_ms, store_gateway_beat_ms}
//   P nodes            zset  node ids scored by registered_ms
//   P node:<id>        hash  {id, address, hostname, pid, is_head, state, total, used, labels,
//                             registered_ms, last_heartbeat_ms, heartbeat_ttl_ms, death_reason}; total, used and
//                             labels are JSON objects. While the node has claims, `used` is their
//                             sum (every name in total, 0 if unclaimed), rewritten by each script
//                             that changes the claims or re-registers the node.
//   P node_hb:<id>     string with a PX ttl: the heartbeat; its absence means the node missed it
//   P node_deadlines   zset  ALIVE node ids by heartbeat deadline (server ms): what a reap reads
//   P sessions         hash  session id -> "host pid": drivers' open sessions (owners of actors)
//   P store_run        hash  {run_id, since_ms}: the Redis process that serves, and since when (its
//                             clock): nodes are not judged until it has served one heartbeat TTL
//   P node_res:<id>    hash  holder -> JSON resources: the claims on the node (reserve/release)
//   P actors           zset  actor ids scored by created_ms
//   P actor_counts     hash  state -> how many records in `actors` have it (and _counted): what
//                             status counts, kept by putActor once the first status made it
//   P actor:<id>       hash  {id, type, name, node_id, pid, address, state, incarnation,
//                             restarts, max_restarts, max_task_retries, detached, owner, resources (JSON),
//                             init_args (raw bytes), placement_group, bundle_index, death_reason,
//                             created_ms, updated_ms}
//   P dead_nodes       zset  the ids of DEAD nodes scored by death time: the newest
//                             RedisOptions::keepDeadNodes are kept, older records deleted
//   P live_actors      zset  the ids of actors not DEAD, scored by created_ms (what scans read)
//   P node_actors:<id> set   ids of the actors not DEAD placed on the node (what its death touches);
//                             deleted with the node's record when it leaves the DEAD history
//   P dead_actors      zset  the ids of DEAD actors scored by updated_ms: the newest
//                             RedisOptions::keepDeadActors are kept, older records deleted
//   P actor_name:<name> string: the id of the actor holding the name
//   P pgs              zset  placement group ids scored by created_ms
//   P pending_pgs      set   ids of PENDING placement groups
//   P waiting_actors   set   ids of PENDING/RESTARTING actors without a node
//   P pg_actors:<id>   set   ids of a placement group's live actors
//   P pg:<id>          hash  {id, name, strategy, state, pending_reason, created_ms,
//                             bundles (JSON array of {"resources": {...}, "node_id": "..."})}
//   P events           pub/sub channel of JSON {"type","node_id","reason","time_ms"}
//   P group_epoch:<group>        string: the collective group's epoch (absent: 0)
//   P group_epoch_events:<group> pub/sub channel: each advance publishes the new epoch (decimal)
//   P rendezvous:<group>:<epoch> hash rank -> opaque value (a communicator's address, an NCCL
//                                unique id), PEXPIRE'd by every write; the epoch is the text
//                                after the last ':', so group names may hold ':'
//   P egroups          zset  elastic group ids scored by created_ms
//   P egroup:<id>      string: the group's JSON document, written by its driver
//   P egroup_events:<id> list of event lines, the newest kMaxGroupEvents
//   P egroup_commands:<id> list of drivers' commands to the group's coordinator, the newest
//                             kMaxGroupCommands, oldest first: JSON {seq, nonce, time_ms, from,
//                             kind, workers}
//   P kv:<space>       hash  key -> value: a key space (setKey, ...; a torch.distributed store's
//                             keys), PEXPIRE'd by every write; a group's epoch has the space
//                             "<group>:<epoch>" (groupKeySpace), deleted with the elastic group
//   P kv_adds:<space>  hash  add id -> the sum that add returned, so a retried add counts once;
//                             PEXPIRE'd with the space's ttl
//
// Every membership or claim change runs as one Lua script, so the hashes, the zsets, the
// heartbeat key and the published event never disagree, even with several controllers at once.
// Every argument travels with an explicit length (redisCommandArgv), so init_args may hold NULs.
#include <hiredis/hiredis.h>

#include <algorithm>
#include <set>
#include <tuple>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "redis_connection.h"
#include "redis_scripts.h"
#include "redis_watchers.h"
#include "store_args.h"
#include "store_records.h"
#include "troupe/runtime/handshake.h"
#include "troupe/runtime/tls.h"
#include "troupe/runtime/cluster_store.h"
#include "troupe/runtime/config.h"
#include "troupe/runtime/logging.h"

namespace troupe {

using store_args::checkGroupArgs;
using store_args::checkKeySpaceArgs;
using store_args::checkNameArgs;
using store_args::checkRendezvousArgs;
using store_args::checkNodeArgs;
using store_args::checkReservations;
using store_args::emptyArgument;
using store_args::emptyId;
using store_records::bundlesJson;
using store_records::eventMessage;
using store_records::malformed;
using store_records::parseActorState;
using store_records::parseBundlesJson;
using store_records::parseEventMessage;
using store_records::parseInteger;
using store_records::parsePlacementGroupState;

namespace {

using json = nlohmann::json;
using namespace redis;           // the connection and its helpers (redis_connection.h)
using namespace redis_scripts;   // the Lua scripts (redis_scripts.h)
using FieldMap = store_records::FieldMap;


class RedisClusterStore final : public ClusterStore {
 public:
  RedisClusterStore(const RedisOptions& options, RedisConnection connection)
      : options_(options),
        prefix_(fmt::format("troupe:{}:", options.cluster)),
        connection_(std::move(connection)) {}

  Status putMeta(const ClusterMeta& meta) override {
    auto reply = connection_.run({"HSET", metaKey(), "token", meta.token, "controller_address",
                                  meta.controllerAddress, "controller_pid",
                                  std::to_string(meta.controllerPid), "created_ms",
                                  std::to_string(meta.createdMs)},
                                 "putMeta");
    return reply ? Status::ok() : reply.status();
  }

  Status putStoreGateway(const std::string& address) override {
    // With the time it (re)started, by the server's clock: nodes behind it are not judged by
    // their heartbeats until it has served one TTL (see the reap script).
    auto reply = connection_.run({"EVAL", R"lua(
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], 'store_gateway', ARGV[1], 'store_gateway_since_ms', now, 'store_gateway_beat_ms', now)
return 1
)lua", "1", metaKey(), address}, "putStoreGateway");
    return reply ? Status::ok() : reply.status();
  }

  Result<std::optional<ClusterMeta>> getMeta() override {
    auto reply = connection_.run({"HGETALL", metaKey()}, "getMeta");
    if (!reply) return reply.status();
    auto fields = fieldMap(**reply, metaKey());
    if (!fields) return fields.status();
    if (fields->empty()) return std::optional<ClusterMeta>();
    ClusterMeta meta;
    meta.token = (*fields)["token"];
    meta.controllerAddress = (*fields)["controller_address"];
    meta.storeGateway = (*fields)["store_gateway"];
    if (!parseInteger((*fields)["controller_pid"], meta.controllerPid) ||
        !parseInteger((*fields)["created_ms"], meta.createdMs)) {
      return malformed(metaKey(), "controller_pid or created_ms is not an integer");
    }
    return std::optional<ClusterMeta>(std::move(meta));
  }

  Status registerNode(const NodeRecord& node, std::chrono::milliseconds ttl) override {
    TROUPE_RETURN_IF_ERROR(checkNodeArgs(node.id, ttl));
    const int64_t now = wallClockMs();
    const int64_t registeredMs = node.registeredMs != 0 ? node.registeredMs : now;
    std::vector<std::string> args = {
        "EVAL",
        registerScript(),
        "7",
        nodeKey(node.id),
        nodesKey(),
        heartbeatKey(node.id),
        claimsKey(node.id),
        storeRunKey(),
        deadNodesKey(),
        deadlinesKey(),
        std::to_string(ttl.count()),
        std::to_string(registeredMs),
        node.id.hex(),
        eventsChannel(),
        eventMessage(ClusterEventType::kNodeAdded, node.id, "", now),
        "id", node.id.hex(),
        "address", node.address,
        "hostname", node.hostname,
        "pid", std::to_string(node.pid),
        "is_head", node.isHead ? "1" : "0",
        "state", nodeStateName(NodeState::kAlive),
        "total", json(node.total).dump(),
        "used", json(node.used).dump(),
        "labels", json(node.labels).dump(),
        "registered_ms", std::to_string(registeredMs),
        // The store, not the caller, records when it last heard from the node.
        "last_heartbeat_ms", std::to_string(now),
        "heartbeat_ttl_ms", std::to_string(ttl.count()),
        "death_reason", "",
    };
    auto reply = connection_.run(args, "registerNode");
    return reply ? Status::ok() : reply.status();
  }

  Result<bool> heartbeat(const NodeId& id, std::chrono::milliseconds ttl) override {
    TROUPE_RETURN_IF_ERROR(checkNodeArgs(id, ttl));
    auto reply = connection_.run({"EVAL", heartbeatScript(), "3", nodeKey(id), heartbeatKey(id), deadlinesKey(),
                                  std::to_string(ttl.count()), std::to_string(wallClockMs()), id.hex()},
                                 "heartbeat");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_INTEGER) return unexpected("heartbeat", **reply);
    return (*reply)->integer == 1;
  }

  Result<std::optional<NodeRecord>> getNode(const NodeId& id) override {
    if (id.empty()) return emptyId();
    auto reply = connection_.run({"HGETALL", nodeKey(id)}, "getNode");
    if (!reply) return reply.status();
    auto fields = fieldMap(**reply, nodeKey(id));
    if (!fields) return fields.status();
    if (fields->empty()) return std::optional<NodeRecord>();
    auto node = store_records::decodeNode(*fields, nodeKey(id));
    if (!node) return node.status();
    return std::optional<NodeRecord>(std::move(node).value());
  }

  Result<std::vector<NodeRecord>> listNodes() override {
    auto reply = connection_.run({"EVAL", kListScript, "1", nodesKey(), nodeKeyPrefix()},
                                 "listNodes");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_ARRAY) return unexpected("listNodes", **reply);
    std::vector<NodeRecord> nodes;
    nodes.reserve((*reply)->elements);
    for (size_t i = 0; i < (*reply)->elements; ++i) {
      auto fields = fieldMap(*(*reply)->element[i], nodeKeyPrefix() + "*");
      auto node = fields ? store_records::decodeNode(*fields, nodeKeyPrefix() + (*fields)["id"]) : Result<NodeRecord>(fields.status());
      // One bad record must not hide the others (nor stop status and the controller).
      if (!node) {
        skipMalformed(node.status());
        continue;
      }
      nodes.push_back(std::move(node).value());
    }
    return nodes;
  }

  Result<std::vector<NodeId>> reapExpiredNodes() override {
    auto reply = connection_.run({"EVAL", reapScript(), "5", nodesKey(), storeRunKey(), deadNodesKey(), metaKey(),
                                  deadlinesKey(), nodeKeyPrefix(),
                                  heartbeatKeyPrefix(), eventsChannel(), std::to_string(wallClockMs()),
                                  claimsKeyPrefix(), std::to_string(options_.keepDeadNodes)},
                                 "reapExpiredNodes");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_ARRAY) return unexpected("reapExpiredNodes", **reply);
    std::vector<NodeId> dead;
    for (size_t i = 0; i < (*reply)->elements; ++i) {
      dead.emplace_back(replyText(*(*reply)->element[i]));
    }
    return dead;
  }

  Status markNodeDead(const NodeId& id, const std::string& reason) override {
    if (id.empty()) return emptyId();
    auto reply = connection_.run({"EVAL", markDeadScript(), "5", nodeKey(id), heartbeatKey(id), nodesKey(),
                                  deadNodesKey(), deadlinesKey(), eventsChannel(), id.hex(), reason, std::to_string(wallClockMs()),
                                  nodeKeyPrefix(), claimsKeyPrefix(), std::to_string(options_.keepDeadNodes)},
                                 "markNodeDead");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_INTEGER) return unexpected("markNodeDead", **reply);
    if ((*reply)->integer < 0) {
      return Status(StatusCode::kNotFound,
                    fmt::format("node {} is not registered in cluster '{}'", id.hex(),
                                options_.cluster));
    }
    return Status::ok();
  }

  Result<bool> reserve(const std::vector<Reservation>& reservations) override {
    TROUPE_RETURN_IF_ERROR(checkReservations(reservations, /*forReserve=*/true));
    if (reservations.empty()) return true;
    auto reply = connection_.run(reservationArgs(reserveScript(), reservations), "reserve");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_INTEGER) return unexpected("reserve", **reply);
    return (*reply)->integer == 1;
  }

  // One script for the lot: each claim is checked and made on its own, and a node's `used` is
  // written once for all the claims made on it.
  Result<std::vector<bool>> reserveEach(const std::vector<Reservation>& reservations) override {
    TROUPE_RETURN_IF_ERROR(checkReservations(reservations, /*forReserve=*/true));
    if (reservations.empty()) return std::vector<bool>{};
    auto reply = connection_.run(reservationArgs(reserveEachScript(), reservations), "reserveEach");
    if (!reply) return reply.status();
    const redisReply& r = **reply;
    if (r.type != REDIS_REPLY_ARRAY || r.elements != reservations.size()) return unexpected("reserveEach", r);
    std::vector<bool> made;
    made.reserve(r.elements);
    for (size_t i = 0; i < r.elements; ++i) made.push_back(r.element[i]->type == REDIS_REPLY_INTEGER && r.element[i]->integer == 1);
    return made;
  }

  Status release(const std::vector<Reservation>& reservations) override {
    TROUPE_RETURN_IF_ERROR(checkReservations(reservations, /*forReserve=*/false));
    if (reservations.empty()) return Status::ok();
    std::vector<std::string> args = {"EVAL", releaseScript(),
                                     std::to_string(2 * reservations.size())};
    for (const Reservation& r : reservations) {
      args.push_back(nodeKey(r.nodeId));
      args.push_back(claimsKey(r.nodeId));
    }
    for (const Reservation& r : reservations) args.push_back(r.holder);
    auto reply = connection_.run(args, "release");
    return reply ? Status::ok() : reply.status();
  }

  Result<std::map<std::string, Resources>> reservations(const NodeId& node) override {
    if (node.empty()) return emptyId();
    const std::string key = claimsKey(node);
    auto reply = connection_.run({"HGETALL", key}, "reservations");
    if (!reply) return reply.status();
    auto fields = fieldMap(**reply, key);
    if (!fields) return fields.status();
    std::map<std::string, Resources> claims;
    for (const auto& [holder, resources] : *fields) {
      try {
        claims[holder] = json::parse(resources).get<Resources>();
      } catch (const json::exception& e) {
        return malformed(key, fmt::format("the claim of '{}' is not a JSON object of numbers: {}",
                                          holder, e.what()));
      }
    }
    return claims;
  }

  Status putActor(const ActorRecord& actor) override {
    if (actor.id.empty()) return emptyArgument("actor id");
    auto reply = connection_.run(putActorArgs(actor), "putActor");
    return reply ? Status::ok() : reply.status();
  }

  // One pipeline of put-actor scripts: the records are written in order, in one round trip.
  Status putActors(const std::vector<ActorRecord>& actors) override {
    std::vector<std::vector<std::string>> commands;
    commands.reserve(actors.size());
    for (const ActorRecord& actor : actors) {
      if (actor.id.empty()) return emptyArgument("actor id");
      commands.push_back(putActorArgs(actor));
    }
    auto replies = connection_.runAll(commands, "putActors");
    return replies ? Status::ok() : replies.status();
  }

  Result<std::vector<std::optional<ActorRecord>>> getActors(const std::vector<ActorId>& ids) override {
    std::vector<std::vector<std::string>> commands;
    commands.reserve(ids.size());
    for (const ActorId& id : ids) {
      if (id.empty()) return emptyArgument("actor id");
      commands.push_back({"HGETALL", actorKey(id)});
    }
    auto replies = connection_.runAll(commands, "getActors");
    if (!replies) return replies.status();
    std::vector<std::optional<ActorRecord>> out;
    out.reserve(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      auto fields = fieldMap(*(*replies)[i], actorKey(ids[i]));
      if (!fields) return fields.status();
      if (fields->empty()) {
        out.emplace_back();
        continue;
      }
      auto actor = store_records::decodeActor(*fields, actorKey(ids[i]));
      if (!actor) return actor.status();
      out.emplace_back(std::move(actor).value());
    }
    return out;
  }

  std::vector<std::string> putActorArgs(const ActorRecord& actor) const {
    return {
        "EVAL",
        kPutActorScript,
        "7",
        actorKey(actor.id),
        actorsKey(),
        liveActorsKey(),
        deadActorsKey(),
        waitingActorsKey(),
        actor.placementGroup.empty() ? std::string() : groupActorsKey(actor.placementGroup),
        actorCountsKey(),
        std::to_string(actor.createdMs),
        actor.id.hex(),
        actorStateName(actor.state),
        std::to_string(options_.keepDeadActors),
        std::to_string(actor.updatedMs != 0 ? actor.updatedMs : wallClockMs()),
        actorKeyPrefix(),
        waitsForNode(actor) ? "1" : "0",
        groupActorsKeyPrefix(),
        nodeActorsKeyPrefix(),
        actor.nodeId.hex(),
        "id", actor.id.hex(),
        "type", actor.type,
        "name", actor.name,
        "node_id", actor.nodeId.hex(),
        "pid", std::to_string(actor.pid),
        "address", actor.address,
        "state", actorStateName(actor.state),
        "incarnation", std::to_string(actor.incarnation),
        "restarts", std::to_string(actor.restarts),
        "max_restarts", std::to_string(actor.maxRestarts),
        "max_task_retries", std::to_string(actor.maxTaskRetries),
        "detached", actor.detached ? "1" : "0",
        "owner", actor.owner,
        "resources", json(actor.resources).dump(),
        "init_args", actor.initArgs,
        "placement_group", actor.placementGroup.hex(),
        "bundle_index", std::to_string(actor.bundleIndex),
        "death_reason", actor.deathReason,
        "created_ms", std::to_string(actor.createdMs),
        "updated_ms", std::to_string(actor.updatedMs),
    };
  }

  Result<std::optional<ActorRecord>> getActor(const ActorId& id) override {
    if (id.empty()) return emptyArgument("actor id");
    auto reply = connection_.run({"HGETALL", actorKey(id)}, "getActor");
    if (!reply) return reply.status();
    auto fields = fieldMap(**reply, actorKey(id));
    if (!fields) return fields.status();
    if (fields->empty()) return std::optional<ActorRecord>();
    auto actor = store_records::decodeActor(*fields, actorKey(id));
    if (!actor) return actor.status();
    return std::optional<ActorRecord>(std::move(actor).value());
  }

  Result<std::vector<ActorRecord>> listActors() override {
    return listActorsIn(actorsKey(), "init_args", "listActors");
  }
  Result<std::vector<ActorRecord>> listLiveActors() override {
    return listActorsIn(liveActorsKey(), "", "listLiveActors");
  }

  Result<std::vector<ActorRecord>> listActorsIn(const std::string& index, const char* skip, const char* what) {
    auto reply = connection_.run({"EVAL", kListScript, "1", index, actorKeyPrefix(), skip}, what);
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_ARRAY) return unexpected("listActors", **reply);
    return decodeActors(**reply);
  }

  Result<ActorPage> listActorsPage(const ActorQuery& query) override {
    auto reply = connection_.run({"EVAL", kListActorsPageScript, "3", actorsKey(), actorCountsKey(), nodesKey(),
                                  actorKeyPrefix(), query.state ? actorStateName(*query.state) : "", query.nodePrefix,
                                  std::to_string(query.offset), std::to_string(query.limit), nodeActorsKeyPrefix()},
                                 "listActorsPage");
    if (!reply) return reply.status();
    const redisReply& r = **reply;
    if (r.type != REDIS_REPLY_ARRAY || r.elements != 3 || r.element[0]->type != REDIS_REPLY_ARRAY ||
        r.element[0]->elements % 2 != 0 || r.element[1]->type != REDIS_REPLY_INTEGER ||
        r.element[2]->type != REDIS_REPLY_ARRAY) {
      return unexpected("listActorsPage", r);
    }
    ActorPage page;
    const redisReply& counts = *r.element[0];
    for (size_t i = 0; i + 1 < counts.elements; i += 2) {
      if (counts.element[i]->type != REDIS_REPLY_STRING || counts.element[i + 1]->type != REDIS_REPLY_INTEGER) {
        return unexpected("listActorsPage", r);
      }
      auto state = store_records::parseActorState(std::string(counts.element[i]->str, counts.element[i]->len));
      if (state) page.countsByState[*state] += static_cast<uint64_t>(counts.element[i + 1]->integer);
    }
    page.matching = static_cast<uint64_t>(std::max<long long>(0, r.element[1]->integer));
    TROUPE_ASSIGN_OR_RETURN(auto actors, decodeActors(*r.element[2]));
    page.actors = std::move(actors);
    return page;
  }

  // Records as the list scripts return them (an array of field arrays); malformed ones skipped.
  Result<std::vector<ActorRecord>> decodeActors(const redisReply& reply) {
    std::vector<ActorRecord> actors;
    actors.reserve(reply.elements);
    for (size_t i = 0; i < reply.elements; ++i) {
      auto fields = fieldMap(*reply.element[i], actorKeyPrefix() + "*");
      auto actor = fields ? store_records::decodeActor(*fields, actorKeyPrefix() + (*fields)["id"]) : Result<ActorRecord>(fields.status());
      if (!actor) {
        skipMalformed(actor.status());
        continue;
      }
      actors.push_back(std::move(actor).value());
    }
    return actors;
  }

  Result<std::vector<ActorRecord>> listNodeActors(const NodeId& node) override {
    if (node.empty()) return emptyId();
    auto reply = connection_.run({"EVAL", kListSetScript, "1", nodeActorsKeyPrefix() + node.hex(), actorKeyPrefix()},
                                 "listNodeActors");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_ARRAY) return unexpected("listNodeActors", **reply);
    return decodeActors(**reply);
  }

  Result<std::vector<NodeId>> listDeadNodesWithWork() override {
    auto reply = connection_.run({"EVAL", kDeadNodesWithWorkScript, "1", deadNodesKey(), claimsKeyPrefix(),
                                  nodeActorsKeyPrefix()},
                                 "listDeadNodesWithWork");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_ARRAY) return unexpected("listDeadNodesWithWork", **reply);
    std::vector<NodeId> nodes;
    for (size_t i = 0; i < (*reply)->elements; ++i) nodes.emplace_back(replyText(*(*reply)->element[i]));
    return nodes;
  }

  Result<bool> claimActorName(const std::string& name, const ActorId& id) override {
    TROUPE_RETURN_IF_ERROR(checkNameArgs(name, id));
    auto reply = connection_.run({"EVAL", kClaimNameScript, "1", actorNameKey(name), id.hex()},
                                 "claimActorName");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_INTEGER) return unexpected("claimActorName", **reply);
    return (*reply)->integer == 1;
  }

  Status releaseActorName(const std::string& name, const ActorId& id) override {
    TROUPE_RETURN_IF_ERROR(checkNameArgs(name, id));
    auto reply = connection_.run({"EVAL", kReleaseNameScript, "1", actorNameKey(name), id.hex()},
                                 "releaseActorName");
    return reply ? Status::ok() : reply.status();
  }

  Result<std::optional<ActorId>> lookupActorName(const std::string& name) override {
    if (name.empty()) return emptyArgument("actor name");
    auto reply = connection_.run({"GET", actorNameKey(name)}, "lookupActorName");
    if (!reply) return reply.status();
    if ((*reply)->type == REDIS_REPLY_NIL) return std::optional<ActorId>();
    if ((*reply)->type != REDIS_REPLY_STRING) return unexpected("lookupActorName", **reply);
    return std::optional<ActorId>(ActorId(replyText(**reply)));
  }

  Status putPlacementGroup(const PlacementGroupRecord& group) override {
    if (group.id.empty()) return emptyArgument("placement group id");
    std::vector<std::string> args = {"EVAL", kPutGroupScript, "3", placementGroupKey(group.id), placementGroupsKey(),
                                     pendingGroupsKey(), std::to_string(group.createdMs), group.id.hex(),
                                     placementGroupStateName(group.state)};
    appendGroupFields(group, args);
    auto reply = connection_.run(args, "putPlacementGroup");
    return reply ? Status::ok() : reply.status();
  }

  static void appendGroupFields(const PlacementGroupRecord& group, std::vector<std::string>& args) {
    for (std::string field : std::initializer_list<std::string>{"id", group.id.hex(), "name", group.name, "strategy", placementStrategyName(group.strategy),
                              "state", placementGroupStateName(group.state), "bundles", bundlesJson(group.bundles),
                              "pending_reason", group.pendingReason, "created_ms", std::to_string(group.createdMs)}) {
      args.push_back(std::move(field));
    }
  }

  Result<GroupCreation> createPlacementGroup(const PlacementGroupRecord& group,
                                             const std::vector<Reservation>& claims) override {
    if (group.id.empty()) return emptyArgument("placement group id");
    TROUPE_RETURN_IF_ERROR(checkReservations(claims, /*forReserve=*/true));
    std::vector<std::string> args = {"EVAL", createGroupScript(), std::to_string(3 + 2 * claims.size()),
                                     placementGroupKey(group.id), placementGroupsKey(), pendingGroupsKey()};
    for (const Reservation& r : claims) {
      args.push_back(nodeKey(r.nodeId));
      args.push_back(claimsKey(r.nodeId));
    }
    for (std::string arg : std::initializer_list<std::string>{std::to_string(claims.size()), std::to_string(group.createdMs), group.id.hex(),
                            std::string(placementGroupStateName(group.state))}) {
      args.push_back(std::move(arg));
    }
    for (const Reservation& r : claims) {
      args.push_back(r.holder);
      args.push_back(json(r.resources).dump());
    }
    appendGroupFields(group, args);
    auto reply = connection_.run(args, "createPlacementGroup");
    if (!reply) return reply.status();
    const redisReply& r = **reply;
    if (r.type == REDIS_REPLY_INTEGER) {
      return GroupCreation{r.integer == 1 ? GroupCreation::Outcome::kCreated : GroupCreation::Outcome::kRefused, {}};
    }
    const std::string key = placementGroupKey(group.id);
    auto fields = fieldMap(r, key);
    if (!fields) return fields.status();
    auto existing = store_records::decodePlacementGroup(*fields, key);
    if (!existing) return existing.status();
    return GroupCreation{GroupCreation::Outcome::kExists, std::move(existing).value()};
  }

  Result<GroupRemoval> removePlacementGroup(const PlacementGroupId& id) override {
    if (id.empty()) return emptyArgument("placement group id");
    auto reply = connection_.run({"EVAL", removeGroupScript(), "5", placementGroupKey(id), placementGroupsKey(),
                                  pendingGroupsKey(), groupActorsKey(id), waitingActorsKey(), id.hex(),
                                  claimsKeyPrefix(), nodeKeyPrefix()},
                                 "removePlacementGroup");
    if (!reply) return reply.status();
    const redisReply& r = **reply;
    if (r.type != REDIS_REPLY_ARRAY || r.elements != 2 || r.element[0]->type != REDIS_REPLY_INTEGER ||
        r.element[1]->type != REDIS_REPLY_INTEGER || r.element[0]->integer < 0 || r.element[0]->integer > 2) {
      return unexpected("removePlacementGroup", r);
    }
    static constexpr GroupRemoval::Outcome kOutcomes[] = {
        GroupRemoval::Outcome::kNotFound, GroupRemoval::Outcome::kRemoved, GroupRemoval::Outcome::kHasActors};
    return GroupRemoval{kOutcomes[r.element[0]->integer], r.element[1]->integer > 0};
  }

  Result<std::vector<ActorRecord>> listGroupActors(const PlacementGroupId& id) override {
    if (id.empty()) return emptyArgument("placement group id");
    auto reply = connection_.run({"EVAL", kListSetScript, "1", groupActorsKey(id), actorKeyPrefix()}, "listGroupActors");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_ARRAY) return unexpected("listGroupActors", **reply);
    return decodeActors(**reply);
  }

  Result<PendingWork> listPendingWork() override {
    PendingWork work;
    auto reply = connection_.run({"EVAL", kListSetScript, "2", pendingGroupsKey(), waitingActorsKey(),
                                  placementGroupKeyPrefix(), actorKeyPrefix()},
                                 "listPendingWork");  // one round trip for both
    if (!reply) return reply.status();
    const redisReply& both = **reply;
    if (both.type != REDIS_REPLY_ARRAY || both.elements != 2 || both.element[0]->type != REDIS_REPLY_ARRAY ||
        both.element[1]->type != REDIS_REPLY_ARRAY) {
      return unexpected("listPendingWork", both);
    }
    auto decoded = decodeGroups(*both.element[0]);
    if (!decoded) return decoded.status();
    work.groups = std::move(*decoded);
    auto waiting = decodeActors(*both.element[1]);
    if (!waiting) return waiting.status();
    work.actors = std::move(*waiting);
    // In the order a scan would have found them: oldest first.
    std::sort(work.groups.begin(), work.groups.end(), [](const auto& a, const auto& b) {
      return std::tie(a.createdMs, a.id) < std::tie(b.createdMs, b.id);
    });
    std::sort(work.actors.begin(), work.actors.end(), [](const auto& a, const auto& b) {
      return std::tie(a.createdMs, a.id) < std::tie(b.createdMs, b.id);
    });
    return work;
  }

  Result<std::optional<PlacementGroupRecord>> getPlacementGroup(
      const PlacementGroupId& id) override {
    if (id.empty()) return emptyArgument("placement group id");
    const std::string key = placementGroupKey(id);
    auto reply = connection_.run({"HGETALL", key}, "getPlacementGroup");
    if (!reply) return reply.status();
    auto fields = fieldMap(**reply, key);
    if (!fields) return fields.status();
    if (fields->empty()) return std::optional<PlacementGroupRecord>();
    auto group = store_records::decodePlacementGroup(*fields, key);
    if (!group) return group.status();
    return std::optional<PlacementGroupRecord>(std::move(group).value());
  }

  Status putSession(const std::string& id, const std::string& info) override {
    if (id.empty()) return emptyArgument("session id");
    auto reply = connection_.run({"HSET", sessionsKey(), id, info}, "putSession");
    return reply ? Status::ok() : reply.status();
  }

  Status deleteSession(const std::string& id) override {
    auto reply = connection_.run({"HDEL", sessionsKey(), id}, "deleteSession");
    return reply ? Status::ok() : reply.status();
  }

  Result<std::map<std::string, std::string>> listSessions() override {
    auto reply = connection_.run({"HGETALL", sessionsKey()}, "listSessions");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_ARRAY || (*reply)->elements % 2 != 0) return unexpected("listSessions", **reply);
    std::map<std::string, std::string> out;
    for (size_t i = 0; i + 1 < (*reply)->elements; i += 2) {
      out[replyText(*(*reply)->element[i])] = replyText(*(*reply)->element[i + 1]);
    }
    return out;
  }

  Status deletePlacementGroup(const PlacementGroupId& id) override {
    if (id.empty()) return emptyArgument("placement group id");
    auto reply = connection_.run({"EVAL", kDeleteGroupScript, "3", placementGroupKey(id), placementGroupsKey(), pendingGroupsKey(), id.hex()},
                                 "deletePlacementGroup");
    return reply ? Status::ok() : reply.status();
  }

  Result<std::vector<PlacementGroupRecord>> listPlacementGroups() override {
    auto reply = connection_.run(
        {"EVAL", kListScript, "1", placementGroupsKey(), placementGroupKeyPrefix()},
        "listPlacementGroups");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_ARRAY) return unexpected("listPlacementGroups", **reply);
    return decodeGroups(**reply);
  }

  // Records as the list scripts return them; malformed ones skipped.
  Result<std::vector<PlacementGroupRecord>> decodeGroups(const redisReply& reply) {
    std::vector<PlacementGroupRecord> groups;
    groups.reserve(reply.elements);
    for (size_t i = 0; i < reply.elements; ++i) {
      auto fields = fieldMap(*reply.element[i], placementGroupKeyPrefix() + "*");
      auto group = fields ? store_records::decodePlacementGroup(*fields, placementGroupKeyPrefix() + (*fields)["id"])
                          : Result<PlacementGroupRecord>(fields.status());
      if (!group) {
        skipMalformed(group.status());
        continue;
      }
      groups.push_back(std::move(group).value());
    }
    return groups;
  }

  Result<std::unique_ptr<EventSubscription>> subscribe() override {
    auto context = connectAndAuthenticate(options_);
    if (!context) return context.status();
    SigpipeBlock sigpipe;
    const std::string channel = eventsChannel();
    ReplyPtr reply(static_cast<redisReply*>(
        redisCommand(context->get(), "SUBSCRIBE %b", channel.data(), channel.size())));
    if (!reply) return unreachable(options_, contextError(context->get(), options_));
    if (reply->type == REDIS_REPLY_ERROR) return replyError(options_, *reply, "SUBSCRIBE");
    // Only after this confirmation is every later PUBLISH guaranteed to reach us.
    if (reply->type != REDIS_REPLY_ARRAY || reply->elements < 1 ||
        replyText(*reply->element[0]) != "subscribe") {
      return unexpected("SUBSCRIBE", *reply);
    }
    return redis::eventSubscription(options_, std::move(context).value());
  }

  Result<int64_t> groupEpoch(const std::string& group) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(group, 0));
    auto reply = connection_.run({"GET", groupEpochKey(group)}, "groupEpoch");
    if (!reply) return reply.status();
    return epochOf(**reply, group);
  }

  // A group's epoch as GET returns it: none yet is 0.
  Result<int64_t> epochOf(const redisReply& reply, const std::string& group) const {
    if (reply.type == REDIS_REPLY_NIL) return int64_t{0};
    int64_t epoch = 0;
    if (reply.type != REDIS_REPLY_STRING || !parseInteger(replyText(reply), epoch)) {
      return malformed(groupEpochKey(group), "the epoch is not an integer");
    }
    return epoch;
  }

  Result<int64_t> advanceGroupEpoch(const std::string& group, int64_t epoch) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(group, epoch));
    auto reply = connection_.run({"EVAL", kAdvanceGroupEpochScript, "1", groupEpochKey(group),
                                  std::to_string(epoch), groupEpochChannel(group)},
                                 "advanceGroupEpoch");
    if (!reply) return reply.status();
    int64_t now = 0;
    if ((*reply)->type != REDIS_REPLY_STRING || !parseInteger(replyText(**reply), now)) {
      return malformed(groupEpochKey(group), "the epoch is not an integer");
    }
    return now;
  }

  Result<std::unique_ptr<GroupEpochWatch>> watchGroupEpoch(const std::string& group) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(group, 0));
    auto context = connectAndAuthenticate(options_);
    if (!context) return context.status();
    const std::string channel = groupEpochChannel(group);
    TROUPE_RETURN_IF_ERROR(subscribeEpoch(context->get(), options_, channel));
    return redis::groupEpochWatch(options_, std::move(context).value(), group, channel, groupEpochKey(group));
  }

  Status putRendezvousEntry(const std::string& group, int64_t epoch, int32_t rank,
                            const std::string& value, std::chrono::milliseconds ttl) override {
    TROUPE_RETURN_IF_ERROR(checkRendezvousArgs(group, epoch, rank, ttl));
    auto reply = connection_.run({"EVAL", kPutRendezvousScript, "1", rendezvousKey(group, epoch),
                                  std::to_string(rank), value, std::to_string(ttl.count())},
                                 "putRendezvousEntry");
    return reply ? Status::ok() : reply.status();
  }

  Result<std::map<int32_t, std::string>> getRendezvous(const std::string& group,
                                                       int64_t epoch) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(group, epoch));
    const std::string key = rendezvousKey(group, epoch);
    auto reply = connection_.run({"HGETALL", key}, "getRendezvous");
    if (!reply) return reply.status();
    auto fields = fieldMap(**reply, key);
    if (!fields) return fields.status();
    std::map<int32_t, std::string> entries;
    for (auto& [field, value] : *fields) {
      int32_t rank = 0;
      if (!parseInteger(field, rank)) return malformed(key, fmt::format("rank '{}'", field));
      entries[rank] = std::move(value);
    }
    return entries;
  }

  Status setKey(const std::string& space, const std::string& key, const std::string& value,
                std::chrono::milliseconds ttl) override {
    TROUPE_RETURN_IF_ERROR(checkKeySpaceArgs(space, ttl));
    auto reply = connection_.run({"EVAL", kSetKeyScript, "1", keySpaceKey(space), key, value,
                                  std::to_string(ttl.count())},
                                 "setKey");
    return reply ? Status::ok() : reply.status();
  }

  Result<std::vector<std::optional<std::string>>> getKeys(const std::string& space,
                                                          const std::vector<std::string>& keys) override {
    TROUPE_RETURN_IF_ERROR(checkKeySpaceArgs(space));
    std::vector<std::optional<std::string>> values;
    if (keys.empty()) return values;
    std::vector<std::string> args = {"HMGET", keySpaceKey(space)};
    args.insert(args.end(), keys.begin(), keys.end());
    auto reply = connection_.run(args, "getKeys");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_ARRAY || (*reply)->elements != keys.size()) return unexpected("getKeys", **reply);
    for (size_t i = 0; i < keys.size(); ++i) {
      const redisReply& one = *(*reply)->element[i];
      if (one.type == REDIS_REPLY_NIL) {
        values.emplace_back();
      } else {
        values.emplace_back(replyText(one));
      }
    }
    return values;
  }

  Result<int64_t> addToKey(const std::string& space, const std::string& key, int64_t delta,
                           std::chrono::milliseconds ttl) override {
    TROUPE_RETURN_IF_ERROR(checkKeySpaceArgs(space, ttl));
    // An id per add, so the retry of one whose reply was lost returns its sum instead of adding
    // again (a barrier counting arrivals would count one twice).
    const std::string id = delta == 0 ? std::string() : fmt::format("{}:{}", addIdPrefix_, ++adds_);
    auto reply = connection_.run({"EVAL", kAddToKeyScript, "2", keySpaceKey(space), keySpaceAddsKey(space), key,
                                  std::to_string(delta), std::to_string(ttl.count()), id},
                                 "addToKey");
    if (!reply) return reply.status();
    const redisReply& r = **reply;
    if (r.type != REDIS_REPLY_ARRAY || r.elements != 2 || r.element[0]->type != REDIS_REPLY_INTEGER) {
      return unexpected("addToKey", r);
    }
    const std::string text = replyText(*r.element[1]);
    int64_t sum = 0;
    if (r.element[0]->integer == 0 || !parseInteger(text, sum)) {
      return Status(StatusCode::kFailedPrecondition,
                    fmt::format("key space '{}': cannot add to key '{}': its value '{}' is not a decimal integer", space,
                                key, text.substr(0, 64)));
    }
    return sum;
  }

  Result<std::string> compareSetKey(const std::string& space, const std::string& key, const std::string& expected,
                                    const std::string& desired, std::chrono::milliseconds ttl) override {
    TROUPE_RETURN_IF_ERROR(checkKeySpaceArgs(space, ttl));
    auto reply = connection_.run({"EVAL", kCompareSetKeyScript, "1", keySpaceKey(space), key, expected, desired,
                                  std::to_string(ttl.count())},
                                 "compareSetKey");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_STRING) return unexpected("compareSetKey", **reply);
    return replyText(**reply);
  }

  Result<bool> deleteKey(const std::string& space, const std::string& key) override {
    TROUPE_RETURN_IF_ERROR(checkKeySpaceArgs(space));
    auto reply = connection_.run({"HDEL", keySpaceKey(space), key}, "deleteKey");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_INTEGER) return unexpected("deleteKey", **reply);
    return (*reply)->integer > 0;
  }

  Result<int64_t> countKeys(const std::string& space) override {
    TROUPE_RETURN_IF_ERROR(checkKeySpaceArgs(space));
    auto reply = connection_.run({"EVAL", kCountKeysScript, "1", keySpaceKey(space)}, "countKeys");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_INTEGER) return unexpected("countKeys", **reply);
    return static_cast<int64_t>((*reply)->integer);
  }

  Status deleteKeySpace(const std::string& space) override {
    TROUPE_RETURN_IF_ERROR(checkKeySpaceArgs(space));
    auto reply = connection_.run({"DEL", keySpaceKey(space), keySpaceAddsKey(space)}, "deleteKeySpace");
    return reply ? Status::ok() : reply.status();
  }

  Status putElasticGroup(const std::string& id, const std::string& doc) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(id, 0));
    auto reply = connection_.run({"EVAL", kPutElasticGroupScript, "2", elasticKey(id), elasticListKey(), id, doc,
                                  std::to_string(wallClockMs())},
                                 "putElasticGroup");
    return reply ? Status::ok() : reply.status();
  }

  Status appendGroupEvent(const std::string& id, const std::string& text) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(id, 0));
    auto reply = connection_.run({"EVAL", kAppendGroupEventScript, "2", elasticKey(id), elasticEventsKey(id), text,
                                  std::to_string(kMaxGroupEvents)},
                                 "appendGroupEvent");
    return reply ? Status::ok() : reply.status();
  }

  Result<uint64_t> appendGroupCommand(const std::string& id, const GroupCommand& command,
                                      const std::string& nonce) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(id, 0));
    if (command.kind == GroupCommand::Kind::kResize && command.workers == 0) {
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("group '{}': a resize to 0 workers; ask for at least 1 (or stop the group)", id));
    }
    // Without the caller's nonce this call's own guards the connection's one retry.
    const std::string once = nonce.empty() ? fmt::format("{}:{}", addIdPrefix_, ++adds_) : nonce;
    auto reply = connection_.run({"EVAL", kAppendGroupCommandScript, "2", elasticKey(id), elasticCommandsKey(id),
                                  store_records::groupCommandJson(command, once), once,
                                  std::to_string(kMaxGroupCommands)},
                                 "appendGroupCommand");
    if (!reply) return reply.status();
    const redisReply& r = **reply;
    if (r.type != REDIS_REPLY_ARRAY || r.elements != 2 || r.element[0]->type != REDIS_REPLY_INTEGER) {
      return unexpected("appendGroupCommand", r);
    }
    if (r.element[0]->integer == 0) {
      return Status(StatusCode::kNotFound,
                    fmt::format("no elastic group '{}' (removed, or never made): its {} command was not sent", id,
                                groupCommandKindName(command.kind)));
    }
    uint64_t seq = 0;
    const std::string text = replyText(*r.element[1]);
    if (!parseInteger(text, seq) || seq == 0) {
      return malformed(elasticCommandsKey(id), fmt::format("the newest command's seq '{}' is not a positive integer",
                                                           text.substr(0, 64)));
    }
    return seq;
  }

  Result<std::optional<ElasticGroupRecord>> getElasticGroup(const std::string& id) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(id, 0));
    // Document, events, commands and epoch in one round trip: a coordinator reads its record
    // every chunk, and listElasticGroups every group's.
    auto replies = connection_.runAll({{"GET", elasticKey(id)},
                                       {"LRANGE", elasticEventsKey(id), "0", "-1"},
                                       {"LRANGE", elasticCommandsKey(id), "0", "-1"},
                                       {"GET", groupEpochKey(id)}},
                                      "getElasticGroup");
    if (!replies) return replies.status();
    const redisReply& doc = *(*replies)[0];
    const redisReply& events = *(*replies)[1];
    const redisReply& commands = *(*replies)[2];
    if (doc.type == REDIS_REPLY_NIL) return std::optional<ElasticGroupRecord>();
    ElasticGroupRecord record{id, replyText(doc), {}, 0, {}};
    if (events.type == REDIS_REPLY_ARRAY) {
      for (size_t i = 0; i < events.elements; ++i) record.events.push_back(replyText(*events.element[i]));
    }
    if (commands.type == REDIS_REPLY_ARRAY) {
      for (size_t i = 0; i < commands.elements; ++i) {
        auto command = store_records::decodeGroupCommand(replyText(*commands.element[i]), elasticCommandsKey(id));
        if (!command) return command.status();
        if (!record.commands.empty() && command->seq <= record.commands.back().seq) {
          return malformed(elasticCommandsKey(id), fmt::format("command {} follows command {}", command->seq,
                                                               record.commands.back().seq));
        }
        record.commands.push_back(std::move(*command));
      }
    }
    TROUPE_ASSIGN_OR_RETURN(record.epoch, epochOf(*(*replies)[3], id));
    return std::optional<ElasticGroupRecord>(std::move(record));
  }

  Result<std::vector<ElasticGroupRecord>> listElasticGroups() override {
    auto ids = connection_.run({"ZRANGE", elasticListKey(), "0", "-1"}, "listElasticGroups");
    if (!ids) return ids.status();
    std::vector<ElasticGroupRecord> groups;
    if ((*ids)->type != REDIS_REPLY_ARRAY) return groups;
    for (size_t i = 0; i < (*ids)->elements; ++i) {
      auto group = getElasticGroup(replyText(*(*ids)->element[i]));
      if (!group) return group.status();
      if (*group) groups.push_back(std::move(**group));
    }
    return groups;
  }

  Status deleteElasticGroup(const std::string& id) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(id, 0));
    auto reply = connection_.run({"EVAL", kDeleteElasticGroupScript, "5", elasticKey(id), elasticEventsKey(id),
                                  elasticListKey(), groupEpochKey(id), elasticCommandsKey(id), id,
                                  prefix_ + "rendezvous:" + id + ":",
                                  // groupKeySpace(id, e) is "<id>:<e>"
                                  keySpaceKey(id + ":"), keySpaceAddsKey(id + ":")},
                                 "deleteElasticGroup");
    return reply ? Status::ok() : reply.status();
  }

 private:
  std::string elasticListKey() const { return prefix_ + "egroups"; }
  std::string elasticKey(const std::string& id) const { return prefix_ + "egroup:" + id; }
  std::string elasticEventsKey(const std::string& id) const { return prefix_ + "egroup_events:" + id; }
  std::string elasticCommandsKey(const std::string& id) const { return prefix_ + "egroup_commands:" + id; }

  std::string groupEpochKey(const std::string& group) const {
    return prefix_ + "group_epoch:" + group;
  }
  std::string groupEpochChannel(const std::string& group) const {
    return prefix_ + "group_epoch_events:" + group;
  }
  std::string rendezvousKey(const std::string& group, int64_t epoch) const {
    return fmt::format("{}rendezvous:{}:{}", prefix_, group, epoch);
  }
  std::string keySpaceKey(const std::string& space) const { return prefix_ + "kv:" + space; }
  std::string keySpaceAddsKey(const std::string& space) const { return prefix_ + "kv_adds:" + space; }


  // Logs a record a listing skipped, once per distinct message (listings repeat every tick).
  void skipMalformed(const Status& why) {
    if (skipped_.insert(why.message()).second && skipped_.size() < 1000) {
      TROUPE_LOG(kWarning, "skipping a record: {}", why.message());
    }
  }
  std::set<std::string> skipped_;

  std::string metaKey() const { return prefix_ + "meta"; }
  std::string storeRunKey() const { return prefix_ + "store_run"; }
  std::string sessionsKey() const { return prefix_ + "sessions"; }
  std::string liveActorsKey() const { return prefix_ + "live_actors"; }
  std::string deadNodesKey() const { return prefix_ + "dead_nodes"; }
  std::string deadlinesKey() const { return prefix_ + "node_deadlines"; }
  // EVAL `script` over each reservation's node and claims keys, then its holder and resources
  // (the reserve scripts' calling convention).
  std::vector<std::string> reservationArgs(const std::string& script, const std::vector<Reservation>& reservations) const {
    std::vector<std::string> args = {"EVAL", script, std::to_string(2 * reservations.size())};
    for (const Reservation& r : reservations) {
      args.push_back(nodeKey(r.nodeId));
      args.push_back(claimsKey(r.nodeId));
    }
    for (const Reservation& r : reservations) {
      args.push_back(r.holder);
      args.push_back(json(r.resources).dump());
    }
    return args;
  }
  std::string claimsKeyPrefix() const { return prefix_ + "node_res:"; }
  // kBuryNodeLua derives this from claimsKeyPrefix(): keep the two names in step.
  std::string nodeActorsKeyPrefix() const { return prefix_ + "node_actors:"; }
  std::string deadActorsKey() const { return prefix_ + "dead_actors"; }
  std::string nodesKey() const { return prefix_ + "nodes"; }
  std::string nodeKeyPrefix() const { return prefix_ + "node:"; }
  std::string nodeKey(const NodeId& id) const { return nodeKeyPrefix() + id.hex(); }
  std::string heartbeatKeyPrefix() const { return prefix_ + "node_hb:"; }
  std::string heartbeatKey(const NodeId& id) const { return heartbeatKeyPrefix() + id.hex(); }
  std::string eventsChannel() const { return prefix_ + "events"; }
  std::string claimsKey(const NodeId& id) const { return prefix_ + "node_res:" + id.hex(); }
  std::string actorsKey() const { return prefix_ + "actors"; }
  std::string actorCountsKey() const { return prefix_ + "actor_counts"; }
  std::string actorKeyPrefix() const { return prefix_ + "actor:"; }
  std::string actorKey(const ActorId& id) const { return actorKeyPrefix() + id.hex(); }
  std::string actorNameKey(const std::string& name) const { return prefix_ + "actor_name:" + name; }
  std::string placementGroupsKey() const { return prefix_ + "pgs"; }
  std::string pendingGroupsKey() const { return prefix_ + "pending_pgs"; }
  std::string waitingActorsKey() const { return prefix_ + "waiting_actors"; }
  std::string groupActorsKeyPrefix() const { return prefix_ + "pg_actors:"; }
  std::string groupActorsKey(const PlacementGroupId& id) const { return groupActorsKeyPrefix() + id.hex(); }
  std::string placementGroupKeyPrefix() const { return prefix_ + "pg:"; }
  std::string placementGroupKey(const PlacementGroupId& id) const {
    return placementGroupKeyPrefix() + id.hex();
  }

  Status unexpected(std::string_view what, const redisReply& reply) const {
    return Status(StatusCode::kInternal,
                  fmt::format("unexpected reply type {} from Redis at {} to {}", reply.type,
                              addressOf(options_), what));
  }

  RedisOptions options_;
  std::string prefix_;
  RedisConnection connection_;
  const std::string addIdPrefix_ = randomHex(8);  // this store's adds: "<prefix>:<count>"
  uint64_t adds_ = 0;
};

}  // namespace

namespace redis {

std::string gatewayBeatCommand(const RedisOptions& options, bool first) {
  const std::string script = redis_scripts::kGatewayBeatScript;
  const std::vector<std::string> args = {"EVAL", script, "1", fmt::format("troupe:{}:meta", options.cluster),
                                         first ? "1" : "0"};
  std::string out = fmt::format("*{}\r\n", args.size());
  for (const auto& arg : args) out += fmt::format("${}\r\n{}\r\n", arg.size(), arg);
  return out;
}

}  // namespace redis

Result<std::unique_ptr<ClusterStore>> connectRedisStore(const RedisOptions& options) {
  if (options.cluster.empty()) {
    return Status(StatusCode::kInvalidArgument, "empty cluster name; pass --cluster NAME");
  }
  if (options.timeout.count() <= 0) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("Redis timeout must be positive, got {} ms", options.timeout.count()));
  }
  auto connection = RedisConnection::open(options);
  if (!connection) return connection.status();
  return std::unique_ptr<ClusterStore>(
      std::make_unique<RedisClusterStore>(options, std::move(connection).value()));
}

Result<RedisOptions> workerRedisOptions() {
  const char* address = getenv("TROUPE_REDIS_ADDRESS");
  const char* password = getenv("TROUPE_REDIS_PASSWORD");
  const char* cluster = getenv("TROUPE_CLUSTER");
  const char* gateway = getenv("TROUPE_REDIS_GATEWAY");
  const char* token = getenv("TROUPE_TOKEN");
  if (!address || !*address || !password || !cluster) {
    return Status(StatusCode::kFailedPrecondition,
                  "TROUPE_REDIS_ADDRESS, TROUPE_REDIS_PASSWORD and TROUPE_CLUSTER are not set: this is not a worker "
                  "started by a node agent");
  }
  TROUPE_ASSIGN_OR_RETURN(auto hp, parseHostPort(address));
  RedisOptions options;
  options.host = hp.host;
  options.port = hp.port;
  options.password = password;
  options.cluster = cluster;
  if (gateway && std::string(gateway) == "1") {
    if (!token || !*token) {
      return Status(StatusCode::kFailedPrecondition, "TROUPE_REDIS_GATEWAY is set but TROUPE_TOKEN is not");
    }
    options.gatewayToken = token;
  }
  return options;
}

}  // namespace troupe
