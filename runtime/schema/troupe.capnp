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
  password @1 :Text;
  cluster @2 :Text;
  heartbeatTtlMs @3 :UInt32;
}

interface Controller {
  ping @0 () -> (pid :Int64, version :Text);
  # Records the node as ALIVE (again, if it registers twice) and says where to heartbeat.
  registerNode @1 (node :NodeInfo) -> (redis :RedisEndpoint);
  # Everything `troupe status` shows, read from Redis at the time of the call.
  status @2 () -> (nodes :List(NodeInfo));
}

interface NodeAgent {
  ping @0 () -> (nodeId :Text, pid :Int64);
}
