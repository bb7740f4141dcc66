// The RPC server of a worker's one actor: the same for C++ workers (services/worker_main.cc) and
// Python workers (troupe._core's serve_actor, whose Python actor is an Actor like any other).
// Thread-safety: the server and its actor belong to the thread whose event loop serves them.
#pragma once

#include <kj/async-io.h>

#include <memory>
#include <string>

#include "troupe.capnp.h"
#include "troupe/runtime/actor.h"
#include "troupe/runtime/config.h"
#include "troupe/runtime/rpc.h"
#include "troupe/runtime/status.h"

namespace troupe {

// Serves `actor` as rpc::Actor, taking ownership of it; `type` names it in errors.
// - Calls run one at a time in arrival order, also while one's callAsync waits on something, so
//   one caller's calls run in the order it sent them (Cap'n Proto delivers one capability's
//   calls in order, and a callBatch's calls are queued together, in list order). A call that
//   fails does not hold up the ones after it.
// - A method for which actor.answersAtOnce() is true starts as soon as it arrives, outside that
//   order (calls that answer at once still start in arrival order).
// - An error Result reaches the caller as a FAILED exception carrying its StatusCode; in a
//   callBatch, as that call's error, the other calls unaffected.
// - typed() returns actor.typed(), or kFailedPrecondition for an actor without one.
// Every answered call is counted in metrics::actorCalls() (an error Result as an error).
struct ActorServerOptions {
  // The actor's calls never wait (its callAsync is call(): Python's inline actors). The server
  // then runs each call that does not answer at once through call(), inside the event that
  // brought it, with no promise per call; the order is the same (no call is ever unfinished).
  bool synchronous = false;
};
rpc::Actor::Client actorServer(std::unique_ptr<Actor> actor, std::string type, ActorServerOptions options = {});

// Serves actorServer(actor, type, options) on `bind` (port 0: any free port) for callers
// presenting `token`, with actor connections' PeerWait::kSpinFirst. Errors as RpcServer::listen.
Result<kj::Own<RpcServer>> listenActor(kj::AsyncIoContext& io, const HostPort& bind, std::string token,
                                       std::unique_ptr<Actor> actor, std::string type,
                                       ActorServerOptions options = {});

}  // namespace troupe
