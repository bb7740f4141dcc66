// Actors as the worker process hosts them, and the explicit registry of C++ actor types.
// A worker (troupe-worker) hosts exactly one actor and calls it on its RPC thread, one call at
// a time, in the order calls arrive (per caller, the order they were submitted).
// Thread-safety: an Actor is only touched by its worker's RPC thread; a registry is filled in
// main() before any actor is created and read-only afterwards.
#pragma once

#include <capnp/capability.h>
#include <kj/async.h>
#include <kj/common.h>
#include <kj/timer.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "troupe/runtime/ids.h"
#include "troupe/runtime/status.h"

namespace troupe {

class ClusterClient;

// Exit codes by which a worker tells its node agent (and so the controller) that its actor must
// not be restarted, whatever its max_restarts: the actor ended itself (exit_actor, a graceful
// terminate), or its constructor raised (a restart would raise again).
inline constexpr int kExitActorEnded = 75;
inline constexpr int kExitInitFailed = 76;

// What an actor learns about itself at construction.
struct ActorContext {
  ActorId id;
  std::string type;
  uint32_t incarnation = 1;  // 1 for the first start, +1 for each restart
  // The worker's connection to its cluster: lets an actor call actors whose ids it was given.
  // Null in unit tests that construct actors directly. Owned by the worker; outlives the actor.
  ClusterClient* cluster = nullptr;
  // The node's address: servers an actor opens (collective ranks) bind and advertise it.
  std::string nodeIp = "127.0.0.1";
  // The timer of the event loop that serves the actor: what its deadlines wait on. Null in
  // unit tests that construct actors directly. Owned by the worker; outlives the actor.
  kj::Timer* timer = nullptr;
};

class Actor {
 public:
  virtual ~Actor() = default;
  // A generic call: the actor defines its methods and payload encodings. An error Status
  // reaches the caller as an error with this message (the actor keeps running).
  virtual Result<std::string> call(const std::string& method, std::string_view payload) = 0;
  // The same, for actors that wait on other actors or I/O: the worker runs the next call only
  // once this promise resolves, so calls keep their order. Default: the synchronous call().
  // `payload` points into the received message (no copy) and stays valid until the promise
  // resolves; copy what is kept longer.
  virtual kj::Promise<Result<std::string>> callAsync(const std::string& method, std::string_view payload) {
    return call(method, payload);
  }
  // The actor's typed Cap'n Proto interface, for actors that have one.
  virtual kj::Maybe<capnp::Capability::Client> typed() { return nullptr; }
  // True for a read-only query (e.g. "what are you doing now") that the worker runs at once,
  // outside the one-at-a-time order, so it answers while an earlier call still waits.
  virtual bool answersAtOnce(const std::string& /*method*/) const { return false; }
};

// Builds an actor from its context and the opaque bytes its creator passed. An error Status
// makes the worker exit with that message on stderr (reported as the death reason).
using ActorFactory =
    std::function<Result<std::unique_ptr<Actor>>(const ActorContext& context, std::string_view initArgs)>;

class ActorRegistry {
 public:
  // Registers `type`; a second registration of the same name replaces the first.
  void add(std::string type, ActorFactory factory);
  // kNotFound naming the known types when `type` is not registered.
  Result<std::unique_ptr<Actor>> create(const ActorContext& context, std::string_view initArgs) const;
  std::vector<std::string> types() const;

 private:
  std::map<std::string, ActorFactory> factories_;
};

}  // namespace troupe
