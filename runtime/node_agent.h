// The node agent: one per machine. Serves the NodeAgent RPC interface, registers with the
// controller (which hands it the Redis endpoint over the authenticated connection), and
// heartbeats to Redis directly, so nodes stay alive while the controller restarts.
// Thread-safety: created and destroyed on the KJ thread; its Redis store and heartbeat timer
// live on the IoThread passed in.
#pragma once

#include <map>
#include <memory>
#include <string>

#include <kj/async-io.h>

#include "troupe/runtime/cluster_store.h"
#include "troupe/runtime/config.h"
#include "troupe/runtime/io_thread.h"
#include "troupe/runtime/rpc.h"

namespace troupe {

struct NodeAgentOptions {
  NodeId id;
  HostPort controller;
  std::string token;
  std::string ip = "127.0.0.1";  // where this node's RPC server binds (a free port)
  Resources resources;
  std::map<std::string, std::string> labels;
  bool isHead = false;
};

class NodeAgent {
 public:
  // Listens, registers and starts heartbeating. Rejects (KJ exception) when the controller
  // cannot be reached, refuses the token, or Redis cannot be reached.
  static kj::Promise<kj::Own<NodeAgent>> start(kj::AsyncIoContext& io, IoThread& ioThread,
                                               NodeAgentOptions options);
  ~NodeAgent();

  const NodeId& id() const { return options_.id; }
  // Resolves with a reason when the agent must exit: the cluster has declared this node dead.
  kj::Promise<std::string> onFatal() { return kj::mv(fatal_); }
  // Marks this node DEAD in Redis with `reason` (a clean stop), then stops heartbeating.
  kj::Promise<void> shutdown(std::string reason);

  struct IoState;

 private:
  NodeAgent(IoThread& ioThread, NodeAgentOptions options);

  IoThread& ioThread_;
  NodeAgentOptions options_;
  std::shared_ptr<IoState> state_;
  kj::Own<RpcServer> server_;
  kj::Own<RpcClient> controller_;
  kj::Promise<std::string> fatal_ = nullptr;
};

}  // namespace troupe
