// Internal to actors/: how a Checkpoint actor reaches the group's other checkpoint actors: their
// typed interfaces by name, and deadlines on the calls made to them, on the timer of the loop
// that serves the actor (ActorContext::timer).
// Thread-safety: belongs to the actor's RPC thread.
#pragma once

#include <kj/async.h>
#include <kj/debug.h>
#include <kj/timer.h>

#include <chrono>
#include <map>
#include <string>

#include "troupe/runtime/client.h"
#include "checkpoint.capnp.h"

namespace troupe::actors::checkpoint_actor {

class CheckpointPeers {
 public:
  // `cluster` is null in tests that construct actors directly: then every peer call rejects.
  // `timer`: the actor's loop's; it outlives this.
  CheckpointPeers(ClusterClient* cluster, kj::Timer& timer) : cluster_(cluster), timer_(timer) {}

  bool connected() const { return cluster_ != nullptr; }

  // A peer's typed interface, on its current incarnation: asked once per transfer, so a peer
  // that restarted is reached again by the next one. The capability lives on the connection of
  // the handle kept here.
  kj::Promise<rpc::Checkpoint::Client> checkpoint(const std::string& name);

  // Forgets the handle of `name`: the next transfer looks the name up again (an actor that was
  // killed keeps no name, and a lookup says so at once).
  void forget(const std::string& name) { handles_.erase(name); }

  // Resolves after `delay`. Dropping the promise cancels the timer.
  kj::Promise<void> after(std::chrono::milliseconds delay) { return timer_.afterDelay(delay.count() * kj::MILLISECONDS); }

  // Rejects with "<what> timed out after <limit> ms" unless `promise` resolves within `limit`;
  // however it ends, the timer is cancelled, so finished calls leave none behind.
  template <typename T>
  kj::Promise<T> withTimeout(kj::Promise<T> promise, std::chrono::milliseconds limit, const char* what) {
    return promise.exclusiveJoin(after(limit).then([what, limit]() -> T {
      kj::throwFatalException(KJ_EXCEPTION(FAILED, kj::str(what, " timed out after ", limit.count(), " ms")));
    }));
  }

 private:
  kj::Promise<ActorHandle> handle(const std::string& name);

  ClusterClient* cluster_;
  kj::Timer& timer_;
  std::map<std::string, ActorHandle> handles_;
};

}  // namespace troupe::actors::checkpoint_actor
