// The node agent: one per machine. Serves the NodeAgent RPC interface, registers with the
// controller (which tells it where the store is), and heartbeats to Redis itself, so nodes stay
// alive while the controller restarts. The head's agent reaches Redis directly (the password is
// in its run directory); every other agent, and its workers, reach Redis through the head's
// store gateway (troupe/runtime/store_gateway.h).
// Thread-safety: created and destroyed on the KJ thread; its Redis store and heartbeat timer
// live on the IoThread passed in.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <kj/async-io.h>

#include "troupe/runtime/cluster_store.h"
#include "troupe/runtime/config.h"
#include "troupe/runtime/io_thread.h"
#include "troupe/runtime/metrics.h"
#include "troupe/runtime/process.h"
#include "troupe/runtime/rpc.h"
#include "log_pump.h"
#include "node_objects.h"
#include "python_zygote.h"
#include "troupe.capnp.h"

namespace troupe {

struct NodeAgentOptions {
  NodeId id;
  HostPort controller;
  std::string token;
  std::string ip = "127.0.0.1";  // where this node's RPC server binds (a free port)
  Resources resources;
  std::map<std::string, std::string> labels;
  bool isHead = false;
  std::string redisPassword;  // the head's only (from its run directory's cluster.json)
  std::string runDir;        // actors' logs go to <runDir>/logs/actor-<id>.{out,err}
  uint64_t objectStoreMemory = 0;  // the object store's limit in bytes (0: NodeObjects' default)
  std::string workerBinary;  // troupe-worker: no LibTorch, starts in milliseconds
  std::set<std::string> workerTypes;  // what workerBinary hosts (troupe-worker --list-types)
  std::string torchWorkerBinary;  // troupe-worker-torch: every other C++ type ("" if not built)
  std::string pythonBinary = "/usr/bin/python3";  // runs Python actors (python -m troupe._worker)
  std::string pythonPath;    // PYTHONPATH for Python workers: where the troupe package is
  // Python workers are forked by a zygote that has imported troupe (python_zygote.h): the process
  // must be a child subreaper. False: each is a new `python -m troupe._worker` (TROUPE_PYTHON_ZYGOTE=0).
  bool pythonZygote = true;
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

  // Starts the worker of this actor incarnation unless it already runs (or starts); resolves to
  // its pid. Rejects with the Status of a worker that cannot be started.
  kj::Promise<int64_t> spawnWorker(const ActorRecord& actor, std::string_view initArgs);
  // SIGKILLs the worker of this incarnation if it runs (its exit is reported as usual).
  void killWorker(const ActorId& id, uint32_t incarnation);
  // The actor's captured output from byte `from` (< 0: the last `maxBytes`), at most `maxBytes`,
  // and the offset after it. `stream` is "out" or "err".
  std::pair<std::string, int64_t> readLog(const ActorId& id, const char* stream, int64_t from, size_t maxBytes) const;
  // The counters of the running workers (their TROUPE_METRICS_FILE), labelled with this node,
  // the actor and its class. A file a worker has not made yet is skipped.
  std::vector<metrics::Sample> metrics() const;
  // This node's object directory (node_objects.h), made when the agent starts.
  const NodeObjects& objects() const { return objects_; }
  // The port of the bulk server that streams this node's objects (NodeObjects::serve).
  int bulkPort() const { return bulk_ ? bulk_->port() : 0; }

  struct IoState;

 private:
  struct Worker {
    uint32_t incarnation = 0;
    pid_t pid = 0;  // 0 once it has exited; -1 while the zygote forks it
    std::string type;
    bool killed = false;  // killWorker came while it was being forked
    kj::Maybe<kj::ForkedPromise<int64_t>> forking;  // its pid, for a retried spawnWorker meanwhile
  };
  std::string metricsPath(const ActorId& id, uint32_t incarnation) const;
  // Spawns `python -m troupe._worker` or a C++ worker as a new process, and watches it.
  Result<int64_t> spawnDirect(const ActorId& id, uint32_t incarnation, const SpawnOptions& spawn);
  // Watches and starts a worker the zygote forked (killing it at once if killWorker came meanwhile).
  int64_t adoptForked(const ActorId& id, uint32_t incarnation, ForkedWorker forked);

  NodeAgent(kj::AsyncIoContext& io, IoThread& ioThread, NodeAgentOptions options);
  kj::Promise<void> watchWorker(ActorId id, uint32_t incarnation, pid_t pid);
  // Reports an exit to the controller, reconnecting and retrying while it is unreachable.
  kj::Promise<void> reportExit(ActorId id, uint32_t incarnation, int status, int attempt);
  kj::Promise<rpc::Controller::Client> controller();
  void startLogPump();
  // Every second: drops the holds of processes that are gone (asking other nodes' agents about
  // theirs) and deletes the objects whose last holder went (NodeObjects::sweep).
  kj::Promise<void> sweepHolds();

  kj::AsyncIoContext& io_;
  IoThread& ioThread_;
  NodeAgentOptions options_;
  std::shared_ptr<IoState> state_;
  kj::Own<RpcServer> server_;
  kj::Own<RpcClient> controller_;
  kj::Promise<std::string> fatal_ = nullptr;
  kj::Own<PythonZygote> zygote_;  // null when options_.pythonZygote is false
  std::map<ActorId, Worker> workers_;
  // Handed to workers (TROUPE_REDIS_*): actors in elastic groups meet through the store.
  std::string workerRedisAddress_;
  std::string workerRedisPassword_;
  bool workerRedisGateway_ = false;
  std::string workerCluster_;
  kj::Own<kj::TaskSet> tasks_;
  // Writes the workers' output (pipes) to their logs within TROUPE_LOG_MAX_BYTES per file and
  // TROUPE_LOG_RUN_MAX_BYTES per run, on a thread of its own; made once registered.
  std::unique_ptr<LogPump> logPump_;
  NodeObjects objects_;
  kj::Own<BulkServer> bulk_;  // declared after objects_: it serves them, so it goes first
};

}  // namespace troupe
