// The store gateway: how nodes on other hosts reach the cluster's Redis, which listens on the
// head's loopback only. troupe-gateway (services/gateway_main.cc) serves it on the head's
// address. A connection proves the cluster token (runtime's handshake, purpose kStore); the
// gateway then opens a connection to Redis, authenticates it with the password (which never
// leaves the head), and relays bytes both ways, so a joined node's hiredis speaks plain RESP,
// pub/sub included, as if local.
// Thread-safety: owned by the KJ thread that created it.
#pragma once

#include <kj/async-io.h>

#include <string>

#include "troupe/runtime/cluster_store.h"
#include "troupe/runtime/config.h"
#include "troupe/runtime/status.h"

namespace troupe {

class StoreGateway {
 public:
  // Binds `bind` (port 0: a free one). Errors as RpcServer::listen.
  static Result<kj::Own<StoreGateway>> listen(kj::AsyncIoContext& io, const HostPort& bind, std::string token,
                                              RedisOptions redis);
  virtual ~StoreGateway() noexcept(false) = default;
  virtual int port() const = 0;
  // Connections refused for failing the handshake (tests check it).
  virtual uint64_t refusedConnections() const = 0;
};

}  // namespace troupe
