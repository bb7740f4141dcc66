// Internal to actors/: how a Checkpoint actor reaches the group's other checkpoint actors: their
// typed interfaces by name, and deadlines on the calls made to them.
// The deadlines run on a timer thread of their own (an IoThread): an actor is not handed its
// worker's kj::Timer (ActorContext has none). Once it is, after() becomes
// kj::Timer::afterDelay, withTimeout() kj::Timer::timeoutAfter, and the thread goes.
// Thread-safety: belongs to the actor's RPC thread; the timer thread only fulfils promises.
#pragma once

#include <kj/async.h>
#include <kj/debug.h>

#include <chrono>
#include <map>
#include <string>

#include "troupe/runtime/client.h"
#include "troupe/runtime/io_thread.h"
#include "checkpoint.capnp.h"

namespace troupe::actors::checkpoint_actor {

class CheckpointPeers {
 public:
  // `cluster` is null in tests that construct actors directly: then every peer call rejects.
  explicit CheckpointPeers(ClusterClient* cluster) : cluster_(cluster) {}

  bool connected() const { return cluster_ != nullptr; }

  // A peer's typed interface, on its current incarnation: asked once per transfer, so a peer
  // that restarted is reached again by the next one. The capability lives on the connection of
  // the handle kept here.
  kj::Promise<rpc::Checkpoint::Client> checkpoint(const std::string& name);

  // Resolves after `delay`. Dropping the promise cancels the timer.
  kj::Promise<void> after(std::chrono::milliseconds delay);

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
  std::map<std::string, ActorHandle> handles_;
  IoThread timerThread_;
};

}  // namespace troupe::actors::checkpoint_actor
