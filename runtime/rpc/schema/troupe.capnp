@0xc4a1e0a2f1d3b5e7;
# Troupe's control-plane RPC. Every connection presents the cluster token in a handshake
# before Cap'n Proto starts (see rpc.h), so these interfaces are only reachable by holders
# of the token. Every method is idempotent: a caller may retry it after a lost reply.

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("troupe::rpc");

struct Resource {
  name @0 :Text;
  quantity @1 :Float64;
}

struct Label {
  key @0 :Text;
  value @1 :Text;
}

struct NodeInfo {
  id @0 :Text;
  address @1 :Text;         # HOST:PORT of the node agent's RPC server
  hostname @2 :Text;
  pid @3 :Int64;
  isHead @4 :Bool;
  state @5 :Text;           # "ALIVE" | "DEAD"
  total @6 :List(Resource);
  used @7 :List(Resource);
  labels @8 :List(Label);
  registeredMs @9 :Int64;
  lastHeartbeatMs @10 :Int64;
  deathReason @11 :Text;
}

# Where a node agent keeps its heartbeat; handed out only over an authenticated connection.
struct RedisEndpoint {
  address @0 :Text;
  password @1 :Text;         # empty when `gateway`: the password never leaves the head
  cluster @2 :Text;
  heartbeatTtlMs @3 :UInt32;
  gateway @4 :Bool;          # `address` is the head's store gateway (prove the token, speak RESP)
}

struct ActorSpec {
  type @0 :Text;
  name @1 :Text;
  resources @2 :List(Resource);
  maxRestarts @3 :Int32;
  maxTaskRetries @4 :Int32;
  detached @5 :Bool;
  initArgs @6 :Data;
  placementGroup @7 :Text;   # empty: not in a group
  bundleIndex @8 :Int32 = -1;
  owner @9 :Text;            # the creator's session id (see Controller.openSession)
}

struct ActorInfo {
  id @0 :Text;
  type @1 :Text;
  name @2 :Text;
  nodeId @3 :Text;
  pid @4 :Int64;
  address @5 :Text;
  state @6 :Text;            # PENDING | ALIVE | RESTARTING | DEAD
  incarnation @7 :UInt32;
  restarts @8 :Int32;
  maxRestarts @9 :Int32;
  maxTaskRetries @10 :Int32;
  deathReason @11 :Text;
  resources @12 :List(Resource);
  placementGroup @13 :Text;
  bundleIndex @14 :Int32;
  detached @15 :Bool;
}

struct BundleInfo {
  resources @0 :List(Resource);
  nodeId @1 :Text;           # empty while not placed
}

struct PlacementGroupInfo {
  id @0 :Text;
  name @1 :Text;
  strategy @2 :Text;         # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
  state @3 :Text;            # PENDING | CREATED | REMOVED
  bundles @4 :List(BundleInfo);
  pendingReason @5 :Text;
}

# An elastic training group as its driver describes it (see ClusterStore::ElasticGroupRecord).
struct ElasticGroupInfo {
  id @0 :Text;               # also its placement group's and collective group's id
  doc @1 :Text;              # JSON object written by the driver: members, world size, step, ...
  events @2 :List(Text);     # "<wall ms> <text>", oldest first
  epoch @3 :Int64;
  commands @4 :List(GroupCommand);  # the newest commands drivers sent it, oldest first
}

# A driver's command to an elastic group's coordinator (GroupHandle.resize / stop), kept with
# the group until it is removed (the newest ClusterStore kMaxGroupCommands). The coordinator
# carries out those with a seq above the highest it has handled, at its next chunk.
struct GroupCommand {
  seq @0 :UInt64;            # assigned by the store: 1, 2, ... per group (ignored when sent)
  timeMs @1 :Int64;          # the sender's wall clock (0 when sent: the controller's)
  from @2 :Text;             # who sent it: "<host> pid <pid>"
  union {
    resize @3 :UInt32;       # to this many trainers (at least 1)
    stop @4 :Void;           # stop training
  }
}

# How a worker process ended, as its node agent saw it.
struct WorkerExit {
  exitCode @0 :Int32;        # -1 when killed by a signal
  signal @1 :Int32;
  stderrTail @2 :Text;       # its last lines of stderr
}

interface Controller {
  ping @0 () -> (pid :Int64, version :Text);
  # Records the node as ALIVE (again, if it registers twice) and says where to heartbeat.
  registerNode @1 (node :NodeInfo) -> (redis :RedisEndpoint);
  # Everything `troupe status` shows, read from Redis at the time of the call. Without actors
  # when `actors` is false: listing nodes costs nothing per actor. With an actorLimit, actors is
  # one page of the actors that pass the filters (state name, node id prefix), and only that
  # page's records are read whole; actorsMatching and actorCounts (every actor by state) come
  # either way.
  status @2 (actors :Bool = true, actorLimit :UInt32 = 0, actorOffset :UInt32 = 0, actorState :Text,
             actorNode :Text)
      -> (nodes :List(NodeInfo), actors :List(ActorInfo), placementGroups :List(PlacementGroupInfo),
          groups :List(ElasticGroupInfo), actorsMatching :UInt64, actorCounts :List(StateCount));

  # Actors. The caller picks the id, which makes creation idempotent: a retry returns the
  # same actor. Infeasible demands are an error; busy clusters leave the actor PENDING.
  createActor @3 (id :Text, spec :ActorSpec) -> (actor :ActorInfo);
  # Waits (up to timeoutMs) until the actor has incarnation >= minIncarnation (and is ALIVE,
  # if requireAlive) or is DEAD, and returns it; returns the current record on timeout.
  waitActor @4 (id :Text, minIncarnation :UInt32, timeoutMs :UInt32, requireAlive :Bool = true)
      -> (actor :ActorInfo);
  getActorByName @5 (name :Text) -> (actor :ActorInfo);
  killActor @6 (id :Text, noRestart :Bool) -> ();
  # From workers and node agents: an incarnation is up, or has ended.
  actorReady @7 (id :Text, incarnation :UInt32, address :Text, pid :Int64) -> ();
  workerExited @8 (id :Text, incarnation :UInt32, exit :WorkerExit) -> ();

  # Placement groups. Creation is all or nothing; a group that cannot be placed now stays
  # PENDING with a reason and is retried when resources are freed; infeasible is an error.
  createPlacementGroup @9 (id :Text, name :Text, strategy :Text, bundles :List(BundleInfo))
      -> (group :PlacementGroupInfo);
  removePlacementGroup @10 (id :Text) -> ();
  # Resize a live group: append bundles (all or nothing) or remove bundles by index; the other
  # bundles and the actors in them are untouched. `fromIndex` is the group's size the caller
  # saw: a retry of an append that already happened returns the group unchanged. Removed
  # bundles keep their index (shown with no resources), so actors' bundle indices stay valid.
  addBundles @11 (id :Text, bundles :List(BundleInfo), fromIndex :UInt32) -> (group :PlacementGroupInfo);
  removeBundles @12 (id :Text, indices :List(UInt32)) -> (group :PlacementGroupInfo);
  getPlacementGroup @13 (id :Text) -> (group :PlacementGroupInfo);

  # A driver's session: its non-detached actors end when the session does (the client drops
  # it or its connection breaks). The id goes into ActorSpec.owner. Sessions are kept in the
  # store: a client whose controller restarted resumes its session by id (`resume`), and a
  # restarted controller ends the sessions nobody resumed within its grace period. `info`
  # (host and pid) is shown by status. Resuming an ended session fails with NOT_FOUND.
  openSession @14 (resume :Text, info :Text) -> (session :Session, id :Text);

  # Elastic groups: the driver records the group's document (replacing it) and events; a member's
  # death advances the group's epoch (done by the controller itself). removeGroup forgets the
  # record, epoch and rendezvous (not the placement group: remove that separately).
  putGroup @15 (id :Text, doc :Text) -> ();
  # An event's time is the caller's (timeMs; 0: the controller's clock), set once, so a retried
  # call stores one line.
  groupEvent @16 (id :Text, text :Text, timeMs :Int64) -> ();
  removeGroup @17 (id :Text) -> ();
  getGroup @18 (id :Text) -> (group :ElasticGroupInfo, found :Bool);
  # Where a node agent reaches the store: Redis for the head's (no password: it has it),
  # the head's store gateway for every other node. Asked before registering, so a node that
  # cannot reach the store never shows as ALIVE.
  storeEndpoint @19 (head :Bool) -> (redis :RedisEndpoint);
  # Waits (up to timeoutMs) until this controller has declared a node DEAD after the caller's
  # `after`, a count of its declarations kept by `instance` (this controller's run: a caller
  # that names another instance, or 0, starts from now), and returns the ids declared since and
  # the count to pass next. Clients break their connections to those nodes' agents and workers
  # at once, instead of waiting for their sockets to notice. Returns no ids on timeout.
  watchNodeDeaths @20 (instance :UInt64, after :UInt64, timeoutMs :UInt32)
      -> (instance :UInt64, next :UInt64, nodes :List(Text));
  # Sends a command to an elastic group's coordinator: the store appends it to the group's
  # commands with the next seq, which is returned. `nonce` (chosen once by the caller; "" for
  # none) makes a retry return the first call's seq instead of appending the command again.
  # NOT_FOUND for an unknown (or removed) group; INVALID_ARGUMENT for a resize to 0 trainers.
  groupCommand @21 (id :Text, command :GroupCommand, nonce :Text) -> (seq :UInt64);
}

interface Session {}

interface NodeAgent {
  ping @0 () -> (nodeId :Text, pid :Int64);
  # Starts the worker for this incarnation (idempotent: an incarnation already started is not
  # started twice).
  spawnWorker @1 (actor :ActorInfo, initArgs :Data) -> (pid :Int64);
  # SIGKILLs the worker of this incarnation if it runs; its exit is reported as usual.
  killWorker @2 (id :Text, incarnation :UInt32) -> ();
  # The actor's captured output (stdout and stderr): with no offsets, up to maxBytes from the
  # end of each; with offsets (for following), up to maxBytes from there, and where to go on.
  readLogs @3 (id :Text, maxBytes :UInt32, stdoutFrom :Int64 = -1, stderrFrom :Int64 = -1)
      -> (stdout :Data, stderr :Data, stdoutEnd :Int64, stderrEnd :Int64);
  # The counters of this node's running workers (troupe/runtime/metrics.h), each labelled with
  # its node, actor and class, read live for the head's /metrics.
  metrics @4 () -> (samples :List(MetricSample));
  # This node's object directory (where its processes put() objects) and what it holds now; its
  # limit in bytes, past which objects are spilled to spillDirectory (on disk), and what that holds.
  # servedBytes: bytes of its objects sent to other nodes so far.
  objectStore @5 () -> (directory :Text, objects :UInt64, bytes :UInt64, bulkPort :UInt16,
                        limit :UInt64, spillDirectory :Text, spilledObjects :UInt64, spilledBytes :UInt64,
                        servedBytes :UInt64);
  # Up to `length` bytes (at most 16 MiB) of object `name` in this node's directory from
  # `offset`, and the object's whole size: another node pulls an object in such chunks, or takes
  # the rest of a larger one in one stream from the agent's bulk port (node_objects.h).
  # With the first chunk (offset 0), `offer` says where the puller's own copy can be read while
  # and after it arrives ("<host>:<bulk port>/<copy>"), and `relay` where to read the rest from
  # instead of this agent ("" for here): another puller's copy (NodeObjects::relayFor).
  readObject @6 (name :Text, offset :UInt64, length :UInt32, offer :Text)
      -> (data :Data, size :UInt64, bulkPort :UInt16, relay :Text);
  # Deletes a result handed over to a caller on another node, once that caller has pulled it.
  dropObject @7 (name :Text) -> ();
  # Refs to this node's objects held by processes of other nodes (node_objects.h, "Holds"):
  # `holder` ("<node>.<pid>", or "x<id>.<pid>" for a process of no node) received a ref, the
  # in-flight record `landed` ("<holder>:<token>") with it; sends one on (token); dropped its last.
  holdObject @8 (name :Text, holder :Text, landed :Text) -> ();
  lendObject @9 (name :Text, holder :Text, token :Text) -> ();
  releaseObject @10 (name :Text, holder :Text) -> ();
  # Which of these pids are processes alive on this node: another node's agent asks about the
  # processes here that hold refs to its objects.
  processesAlive @11 (pids :List(Int32)) -> (alive :List(Int32));
  # The copy an offer named is gone, or could not be read: no puller is sent to it any more.
  dropSource @12 (name :Text, offer :Text) -> ();
}

struct StateCount {
  state @0 :Text;
  count @1 :UInt64;
}

struct MetricSample {
  name @0 :Text;
  labels @1 :Text;   # Prometheus label text, values escaped
  value @2 :Float64;
}

struct ActorCall {
  method @0 :Text;
  payload @1 :Data;
}

struct ActorReply {
  union {
    result @0 :Data;
    error @1 :Text;   # the method's error; the calls after it still run
  }
}

# What a worker serves: one actor.
interface Actor {
  # Generic call: a method name and an opaque payload; the actor defines both.
  call @0 (method :Text, payload :Data) -> (result :Data);
  # The actor's typed interface, for built-in actors that have one (e.g. Counter).
  typed @1 () -> (cap :Capability);
  # Several calls in one message, run in order: clients coalesce the calls they make in one
  # event-loop turn, so pipelined calls cost one round trip per batch, not per call.
  callBatch @2 (calls :List(ActorCall)) -> (replies :List(ActorReply));
}

# Typed interface of the built-in Counter test actor.
interface Counter {
  add @0 (delta :Int64) -> (value :Int64);
  get @1 () -> (value :Int64);
}
