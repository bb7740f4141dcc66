// The controller: the head's RPC service for node registration and cluster status, and the
// failure detector that marks nodes dead when their heartbeat expires. It keeps no state of its
// own: everything it answers is read from Redis, so a restarted controller simply continues.
// Thread-safety: created and destroyed on the KJ thread; its Redis store and the decisions over
// it (ControllerCore) run on the IoThread passed in. The reap timer is a KJ timer.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include <kj/async-io.h>

#include "troupe/runtime/cluster_store.h"
#include "troupe/runtime/config.h"
#include "troupe/runtime/io_thread.h"
#include "troupe/runtime/rpc.h"

namespace troupe {

struct ControllerOptions {
  HostPort bind{"127.0.0.1", 6380};
  RedisOptions redis;
  // Token for a new cluster. When Redis already holds this cluster, its token is kept so that
  // nodes and clients holding it stay connected across a controller restart.
  std::string token;
  std::chrono::milliseconds heartbeatTtl{3000};
  std::chrono::milliseconds reapInterval{250};
};

class Controller {
 public:
  // Connects to Redis, adopts or creates the cluster, listens, and starts reaping.
  // Errors: those of connectRedisStore() and RpcServer::listen(); kInvalidArgument with no token.
  static Result<kj::Own<Controller>> start(kj::AsyncIoContext& io, IoThread& ioThread,
                                           ControllerOptions options);
  ~Controller();

  int port() const { return server_->port(); }
  const std::string& token() const { return token_; }
  const RpcServer& server() const { return *server_; }

  struct IoState;  // owned jointly with the I/O thread's pending handlers

 private:
  Controller(IoThread& ioThread, std::shared_ptr<IoState> state, std::string token)
      : ioThread_(ioThread), state_(std::move(state)), token_(std::move(token)) {}

  IoThread& ioThread_;
  std::shared_ptr<IoState> state_;
  std::string token_;
  kj::Own<RpcServer> server_;
};

}  // namespace troupe
