// ClusterStore: the typed cluster state. The only code that spells a Redis key lives in its
// Redis implementation (redis_cluster_store.cc); the key layout is in docs/design/redis-keys.md.
//
// One implementation, connectRedisStore() (Redis over hiredis): the meaning of each operation
// is written once, in its Lua scripts; unit tests run it on a redis-server of their own
// (troupe/testing/redis_server.h).
// Thread-safety: one ClusterStore object is used by one thread at a time (the owner's I/O
// thread in daemons); open one per thread. Calls block for one Redis round trip.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "troupe/runtime/group_epoch_watch.h"
#include "troupe/runtime/ids.h"
#include "troupe/runtime/rendezvous_store.h"
#include "troupe/runtime/status.h"

namespace troupe {

// Resource name -> quantity ("CPU", "memory" in bytes, "GPU", or a custom name).
using Resources = std::map<std::string, double>;

enum class NodeState { kAlive, kDead };
const char* nodeStateName(NodeState state);  // "ALIVE" / "DEAD"

struct NodeRecord {
  NodeId id;
  std::string address;   // HOST:PORT of the node agent's RPC server
  std::string hostname;
  int64_t pid = 0;       // node agent process id on its host
  bool isHead = false;
  NodeState state = NodeState::kAlive;
  Resources total;
  Resources used;
  std::map<std::string, std::string> labels;
  int64_t registeredMs = 0;     // wall clock, ms since epoch
  int64_t lastHeartbeatMs = 0;  // wall clock, ms since epoch
  std::string deathReason;      // empty while alive
};

// What a controller needs to continue a cluster after a restart.
struct ClusterMeta {
  std::string token;              // the cluster token every RPC connection presents
  std::string controllerAddress;  // HOST:PORT of the controller's RPC server
  int64_t controllerPid = 0;
  int64_t createdMs = 0;
  std::string storeGateway;       // HOST:PORT of the head's store gateway (putStoreGateway); "" until it runs
};


enum class ActorState { kPending, kAlive, kRestarting, kDead };
const char* actorStateName(ActorState state);  // "PENDING" / "ALIVE" / "RESTARTING" / "DEAD"
// The state a name from actorStateName() stands for; nullopt for any other text.
std::optional<ActorState> actorStateFromName(const std::string& name);

// One actor. The controller is its only writer (workers and node agents report to it).
struct ActorRecord {
  ActorId id;
  std::string type;              // name in the worker's actor registry
  std::string name;              // optional, unique per cluster while the actor is not DEAD
  NodeId nodeId;                 // where the current incarnation runs (or ran)
  int64_t pid = 0;
  std::string address;           // HOST:PORT of the worker's RPC server; empty unless ALIVE
  ActorState state = ActorState::kPending;
  uint32_t incarnation = 0;      // bumped on every (re)start; stale reports are ignored
  int32_t restarts = 0;
  int32_t maxRestarts = 0;       // -1: unlimited
  int32_t maxTaskRetries = 0;
  bool detached = false;         // lifetime: detached actors outlive their creator
  std::string owner;             // the creator's session; a non-detached actor ends with it
  Resources resources;           // demand of one incarnation
  std::string initArgs;          // opaque bytes handed to the actor's constructor
  PlacementGroupId placementGroup;  // empty unless created into a bundle
  int32_t bundleIndex = -1;
  std::string deathReason;       // why the last incarnation ended (kept while RESTARTING)
  int64_t createdMs = 0;
  int64_t updatedMs = 0;
};

// An actor that waits for the controller to give it a node (new, or restarting after a loss).
inline bool waitsForNode(const ActorRecord& a) {
  return (a.state == ActorState::kPending || a.state == ActorState::kRestarting) && a.nodeId.empty();
}

// A page of the status list: `limit` actors from `offset` among those that pass the filters.
struct ActorQuery {
  std::optional<ActorState> state;  // only actors in this state
  std::string nodePrefix;           // only actors whose node id starts with this
  uint64_t offset = 0;
  uint64_t limit = 100;
};
struct ActorPage {
  std::vector<ActorRecord> actors;               // without initArgs, as listActors
  uint64_t matching = 0;                         // actors that pass the filters
  std::map<ActorState, uint64_t> countsByState;  // every listed actor, filters aside
};

enum class PlacementStrategy { kPack, kSpread, kStrictPack, kStrictSpread };
const char* placementStrategyName(PlacementStrategy strategy);  // "PACK", ..., "STRICT_SPREAD"
Result<PlacementStrategy> parsePlacementStrategy(const std::string& name);

enum class PlacementGroupState { kPending, kCreated, kRemoved };
const char* placementGroupStateName(PlacementGroupState state);  // "PENDING" / "CREATED" / "REMOVED"

struct Bundle {
  Resources resources;
  NodeId nodeId;  // empty while the bundle is not placed
};

// A placement group; resizable: bundles are appended or removed on a live group.
struct PlacementGroupRecord {
  PlacementGroupId id;
  std::string name;
  PlacementStrategy strategy = PlacementStrategy::kPack;
  PlacementGroupState state = PlacementGroupState::kPending;
  std::vector<Bundle> bundles;
  std::string pendingReason;  // why it (or its newest bundles) could not be placed yet
  int64_t createdMs = 0;
};

// A claim on a node's resources by a holder ("actor:<id>", "pg:<id>:<bundle>"). Claims are
// keyed by holder, so making or releasing the same claim twice changes nothing.
struct Reservation {
  NodeId nodeId;
  std::string holder;
  Resources resources;
};

// What createPlacementGroup did: made it (with its claims), found it made already (a retried
// request; `existing` is its record), or wrote nothing because a claim no longer fits.
struct GroupCreation {
  enum class Outcome { kCreated, kExists, kRefused } outcome = Outcome::kCreated;
  std::optional<PlacementGroupRecord> existing;
};

// What removePlacementGroup did, and whether any group or actor still waits for resources
// (then the caller tries to place them on what was freed).
struct GroupRemoval {
  enum class Outcome { kRemoved, kNotFound, kHasActors } outcome = Outcome::kRemoved;
  bool pendingWork = false;
};

// What waits for resources: PENDING groups and PENDING/RESTARTING actors without a node.
struct PendingWork {
  std::vector<PlacementGroupRecord> groups;
  std::vector<ActorRecord> actors;
};

// A driver's command to an elastic group's coordinator (ElasticGroupStore::appendGroupCommand).
struct GroupCommand {
  enum class Kind { kResize, kStop };
  uint64_t seq = 0;      // assigned by the store: 1, 2, ... per group
  int64_t timeMs = 0;    // the sender's wall clock
  std::string from;      // who sent it ("<host> pid <pid>")
  Kind kind = Kind::kStop;
  uint32_t workers = 0;  // kResize: the trainers wanted (at least 1); 0 otherwise
};
const char* groupCommandKindName(GroupCommand::Kind kind);  // "resize" / "stop"
// The kind a name from groupCommandKindName() stands for; nullopt for any other text.
std::optional<GroupCommand::Kind> groupCommandKindFromName(const std::string& name);

// An elastic training group as its driver describes it, with its recent events and epoch.
struct ElasticGroupRecord {
  std::string id;                   // also the id of its placement group and collective group
  std::string doc;                  // a JSON object written by the driver (members, step, ...)
  std::vector<std::string> events;  // oldest first, at most kMaxGroupEvents
  int64_t epoch = 0;                // the collective epoch (groupEpoch(id))
  std::vector<GroupCommand> commands;  // oldest first (ascending seq), at most kMaxGroupCommands
};
constexpr int kMaxGroupEvents = 50;
constexpr int kMaxGroupCommands = 50;

enum class ClusterEventType { kNodeAdded, kNodeDead };
const char* clusterEventTypeName(ClusterEventType type);  // "NODE_ADDED" / "NODE_DEAD"

// A membership event, published on the cluster's events channel.
struct ClusterEvent {
  ClusterEventType type = ClusterEventType::kNodeAdded;
  NodeId nodeId;
  std::string reason;
  int64_t timeMs = 0;
};

// Receives membership events published after subscribe() returned.
// Thread-safety: one thread at a time; it has its own connection.
class EventSubscription {
 public:
  virtual ~EventSubscription() = default;
  // Waits up to `timeout` for the next event; nullopt on timeout.
  virtual Result<std::optional<ClusterEvent>> next(std::chrono::milliseconds timeout) = 0;
};

// The cluster's identity and membership: its meta, its nodes and their heartbeats, and the
// membership events.
class NodeStore {
 public:
  virtual ~NodeStore() = default;

  virtual Status putMeta(const ClusterMeta& meta) = 0;
  // nullopt when no cluster has been created under this prefix yet.
  virtual Result<std::optional<ClusterMeta>> getMeta() = 0;
  // Records where the head's store gateway listens (kept apart from putMeta, which the
  // controller rewrites at every start).
  virtual Status putStoreGateway(const std::string& address) = 0;

  // Writes the node as ALIVE with a heartbeat that expires after `ttl`, and publishes
  // NODE_ADDED. Idempotent: registering the same id again refreshes it and publishes again.
  virtual Status registerNode(const NodeRecord& node, std::chrono::milliseconds ttl) = 0;
  // Refreshes the node's heartbeat. Returns false (and writes nothing) when the node is
  // unknown or already DEAD: the agent must then stop, since the cluster has declared it dead.
  virtual Result<bool> heartbeat(const NodeId& id, std::chrono::milliseconds ttl) = 0;
  virtual Result<std::optional<NodeRecord>> getNode(const NodeId& id) = 0;
  // Every node ever registered under this cluster, alive or dead, sorted by registration time.
  virtual Result<std::vector<NodeRecord>> listNodes() = 0;
  // Atomically marks DEAD each ALIVE node whose heartbeat has expired, publishes NODE_DEAD
  // for each, and returns their ids. Safe to run from several controllers at once.
  virtual Result<std::vector<NodeId>> reapExpiredNodes() = 0;
  // Marks the node DEAD with `reason` (e.g. a clean shutdown) and publishes NODE_DEAD.
  // NotFound for an unknown node; a node already dead is left as it is.
  virtual Status markNodeDead(const NodeId& id, const std::string& reason) = 0;

  // Opens a subscription to membership events (its own connection for Redis).
  virtual Result<std::unique_ptr<EventSubscription>> subscribe() = 0;
};

// What each node's holders (actors, bundles, tasks) have claimed of its resources.
class ResourceStore {
 public:
  virtual ~ResourceStore() = default;

  // Atomically makes every reservation or none: true when each node is ALIVE and has the
  // resources free (total minus the sum of its other holders' claims); false (nothing written)
  // otherwise. A holder's new claim on a node replaces its old one (so a retry changes nothing) and
  // is checked against capacity; kInvalidArgument for empty ids or holders and bad amounts. The node's
  // `used` is the sum of its claims.
  virtual Result<bool> reserve(const std::vector<Reservation>& reservations) = 0;
  // Makes each reservation on its own, in order (not all or nothing): per reservation, whether
  // it was made, as reserve() of it alone. One round trip for the lot in Redis.
  virtual Result<std::vector<bool>> reserveEach(const std::vector<Reservation>& reservations) {
    std::vector<bool> made;
    for (const Reservation& r : reservations) {
      TROUPE_ASSIGN_OR_RETURN(auto one, reserve({r}));
      made.push_back(one);
    }
    return made;
  }
  // Drops the claims of these holders on these nodes (resources in the argument are ignored).
  // Unknown claims are ignored.
  virtual Status release(const std::vector<Reservation>& reservations) = 0;
  // Every claim on a node, holder -> resources.
  virtual Result<std::map<std::string, Resources>> reservations(const NodeId& node) = 0;
};

// Actors: their records, by node and by name.
class ActorStore {
 public:
  virtual ~ActorStore() = default;

  // Writes the whole record (the controller is the single writer).
  virtual Status putActor(const ActorRecord& actor) = 0;
  virtual Result<std::optional<ActorRecord>> getActor(const ActorId& id) = 0;
  // Batches (one round trip for the lot in Redis): putActor of each record in order, and the
  // records of `ids` in order (nullopt for an unknown id).
  virtual Status putActors(const std::vector<ActorRecord>& actors) {
    for (const ActorRecord& a : actors) TROUPE_RETURN_IF_ERROR(putActor(a));
    return Status::ok();
  }
  virtual Result<std::vector<std::optional<ActorRecord>>> getActors(const std::vector<ActorId>& ids) {
    std::vector<std::optional<ActorRecord>> out;
    for (const ActorId& id : ids) {
      TROUPE_ASSIGN_OR_RETURN(auto one, getActor(id));
      out.push_back(std::move(one));
    }
    return out;
  }
  // The actors not DEAD and the newest DEAD ones (older DEAD records are deleted; Redis keeps
  // RedisOptions::keepDeadActors), sorted by creation time: what status shows. Without their
  // initArgs (the bulk of a record, which status never shows).
  virtual Result<std::vector<ActorRecord>> listActors() = 0;
  // One page of listActors() after filters, and the counts by state of the whole list: what a
  // status with a limit shows. Reads each record's state (and node) but only the page's whole.
  virtual Result<ActorPage> listActorsPage(const ActorQuery& query) = 0;
  // Only the actors not DEAD, sorted by creation time: what the controller scans, so its cost
  // follows what is alive, not the cluster's history.
  virtual Result<std::vector<ActorRecord>> listLiveActors() = 0;
  // The actors not DEAD whose current incarnation is placed on `node` (any order), from an index
  // putActor keeps: what the node's death touches, whatever the number of other actors.
  virtual Result<std::vector<ActorRecord>> listNodeActors(const NodeId& node) = 0;
  // The DEAD nodes (of those kept, RedisOptions::keepDeadNodes) that still hold claims or actors
  // not DEAD: what the controller has yet to move off them. Costs the DEAD nodes kept.
  virtual Result<std::vector<NodeId>> listDeadNodesWithWork() = 0;
  // Claims `name` for `id`: true if it was free or already `id`'s, false if another actor has it.
  virtual Result<bool> claimActorName(const std::string& name, const ActorId& id) = 0;
  // Frees `name` if `id` holds it.
  virtual Status releaseActorName(const std::string& name, const ActorId& id) = 0;
  virtual Result<std::optional<ActorId>> lookupActorName(const std::string& name) = 0;
};

// Placement groups: their records, their atomic creation and removal, and the work pending.
class PlacementGroupStore {
 public:
  virtual ~PlacementGroupStore() = default;

  virtual Status putPlacementGroup(const PlacementGroupRecord& group) = 0;
  virtual Result<std::optional<PlacementGroupRecord>> getPlacementGroup(const PlacementGroupId& id) = 0;
  virtual Result<std::vector<PlacementGroupRecord>> listPlacementGroups() = 0;
  // Forgets a removed group (its record and its place in the list); unknown ids are ignored.
  // Removed groups are deleted rather than kept, so lists stay as short as the live groups.
  virtual Status deletePlacementGroup(const PlacementGroupId& id) = 0;
  // In one step: writes a new group and claims its placed bundles (`claims`, all or none, as
  // reserve()). A group that exists already is returned untouched (kExists).
  virtual Result<GroupCreation> createPlacementGroup(const PlacementGroupRecord& group,
                                                     const std::vector<Reservation>& claims) = 0;
  // In one step: deletes a group that has no live actors and releases its bundles' claims.
  // A group with live actors is left as it is (kHasActors): the caller ends them first.
  virtual Result<GroupRemoval> removePlacementGroup(const PlacementGroupId& id) = 0;
  // The live actors placed in a group's bundles, from an index (no scan of every actor).
  virtual Result<std::vector<ActorRecord>> listGroupActors(const PlacementGroupId& id) = 0;
  // What waits for resources, from indexes kept by putActor and putPlacementGroup.
  virtual Result<PendingWork> listPendingWork() = 0;
};

// Driver sessions: the owners of non-detached actors.
class SessionStore {
 public:
  virtual ~SessionStore() = default;

  // Records an open session, so a restarted controller knows whom to wait for; `info` is a
  // short description for status (host, pid). Idempotent.
  virtual Status putSession(const std::string& id, const std::string& info) = 0;
  // Forgets an ended session; unknown ids are ignored.
  virtual Status deleteSession(const std::string& id) = 0;
  // The open sessions: id -> info.
  virtual Result<std::map<std::string, std::string>> listSessions() = 0;
};

// Key spaces: small shared dictionaries of opaque bytes (a torch.distributed store,
// troupe.dist.ClusterStore, keeps its keys in one).
class KeySpaceStore {
 public:
  virtual ~KeySpaceStore() = default;

  // A space is any non-empty name; groupKeySpace(group, epoch) is the space of a collective
  // group's epoch, deleted with its elastic group (deleteElasticGroup). A write keeps the whole
  // space `ttl` more, so an abandoned space leaves nothing behind. Every call is safe to retry:
  // the Redis store retries once on a broken connection, and an add counts once.
  // kInvalidArgument for an empty space name or a ttl that is not positive (keys may be empty).

  // Sets `key` to `value`.
  virtual Status setKey(const std::string& space, const std::string& key, const std::string& value,
                        std::chrono::milliseconds ttl) = 0;
  // The value of each of `keys`, in order; nullopt for an absent one (or an expired space).
  virtual Result<std::vector<std::optional<std::string>>> getKeys(const std::string& space,
                                                                  const std::vector<std::string>& keys) = 0;
  // Adds `delta` to the key's value (absent: 0, so the key exists after any add, 0 included),
  // kept as decimal text, and returns the sum. kFailedPrecondition naming the value when it is
  // not a decimal integer.
  virtual Result<int64_t> addToKey(const std::string& space, const std::string& key, int64_t delta,
                                   std::chrono::milliseconds ttl) = 0;
  // torch's compareSet: sets `key` to `desired` when its value is `expected`, or when it is
  // absent and `expected` is empty; returns the value after the call, but `expected` when the
  // key is absent and stays so.
  virtual Result<std::string> compareSetKey(const std::string& space, const std::string& key,
                                            const std::string& expected, const std::string& desired,
                                            std::chrono::milliseconds ttl) = 0;
  // Deletes the key; true when it was there (a retry after a lost reply may say false).
  virtual Result<bool> deleteKey(const std::string& space, const std::string& key) = 0;
  // How many keys the space holds.
  virtual Result<int64_t> countKeys(const std::string& space) = 0;
  // Deletes the space and every key in it; an absent space is ignored.
  virtual Status deleteKeySpace(const std::string& space) = 0;
};

// Elastic groups (see ElasticGroupRecord).
class ElasticGroupStore {
 public:
  virtual ~ElasticGroupStore() = default;

  // Creates or replaces the group's document. kInvalidArgument for an empty id.
  virtual Status putElasticGroup(const std::string& id, const std::string& doc) = 0;
  // Appends an event line to a group (kept: the newest kMaxGroupEvents); unknown groups are
  // ignored (an event may race with the group's removal). A line equal to one of the newest 32
  // is not appended again: a retried call (same "<ms> text") adds it once.
  virtual Status appendGroupEvent(const std::string& id, const std::string& text) = 0;
  // Appends a command to the group's commands (kept: the newest kMaxGroupCommands) and returns
  // its seq, one more than the newest command's (the first is 1); command.seq is ignored. A
  // call with the nonce of a command still kept is a retry: it returns that command's seq and
  // appends nothing ("" for no nonce: every call appends). kNotFound for an unknown group (a
  // command must not vanish unseen); kInvalidArgument for an empty id or a resize to 0 workers.
  virtual Result<uint64_t> appendGroupCommand(const std::string& id, const GroupCommand& command,
                                              const std::string& nonce) = 0;
  virtual Result<std::optional<ElasticGroupRecord>> getElasticGroup(const std::string& id) = 0;
  virtual Result<std::vector<ElasticGroupRecord>> listElasticGroups() = 0;
  // Forgets the group: its document, events, commands, epoch and rendezvous. Unknown ids are
  // ignored.
  virtual Status deleteElasticGroup(const std::string& id) = 0;
};

// The whole cluster state: every role. A process opens one and hands each of its parts the
// roles that part uses (the collectives a RendezvousStore, for one).
class ClusterStore : public NodeStore,
                     public ResourceStore,
                     public ActorStore,
                     public PlacementGroupStore,
                     public SessionStore,
                     public RendezvousStore,
                     public KeySpaceStore,
                     public ElasticGroupStore {};

// The key space of epoch `epoch` of collective group `group`: "<group>:<epoch>".
inline std::string groupKeySpace(const std::string& group, int64_t epoch) {
  return group + ":" + std::to_string(epoch);
}

struct RedisOptions {
  std::string host = "127.0.0.1";
  int port = 6379;
  std::string password;        // required: a Redis that accepts clients without one is refused
  std::string cluster = "default";  // key prefix is "troupe:<cluster>:"
  std::chrono::milliseconds timeout{2000};  // connect and per-command timeout
  // Non-empty: host:port is the head's store gateway (store_gateway.h), not Redis. The
  // connection proves this cluster token and the gateway authenticates to Redis; no password.
  std::string gatewayToken;
  // DEAD actor records kept for status (the newest); older ones are deleted.
  size_t keepDeadActors = 1000;
  // The same for DEAD nodes.
  size_t keepDeadNodes = 1000;
};

// Connects and authenticates. Errors: kUnavailable (cannot reach it), kUnauthenticated (wrong
// password), kFailedPrecondition (Redis accepts clients without a password).
Result<std::unique_ptr<ClusterStore>> connectRedisStore(const RedisOptions& options);

// In a worker process: the cluster's Redis as its node agent handed it over (TROUPE_REDIS_ADDRESS,
// TROUPE_REDIS_PASSWORD, TROUPE_CLUSTER; TROUPE_REDIS_GATEWAY=1 with TROUPE_TOKEN on a joined node,
// whose address is then the store gateway's). kFailedPrecondition naming what is missing.
Result<RedisOptions> workerRedisOptions();

}  // namespace troupe
