// The C++ client API: connect to a cluster, create and find actors, call them, kill them, and
// manage placement groups. Method calls go straight to the actor's worker, never through the
// controller.
// Thread-safety: a ClusterClient and its handles belong to the KJ event-loop thread that
// connected it. Errors are KJ exceptions carrying a StatusCode; statusFromException (rpc.h)
// reads it back with the message, and the code, never the words, tells the kind:
//   ACTOR_DIED  "actor <id> (<type>) died: <reason>": the actor is DEAD, or died during the call
//   the method's own code (an ACTOR_DIED of an actor the method called arrives as UNAVAILABLE):
//               "actor <id> (<type>).<method>: <msg>": the actor's method returned an error
//   any other   the controller's error (RESOURCE_EXHAUSTED when infeasible, NOT_FOUND, ...)
#pragma once

#include <capnp/capability.h>
#include <kj/async-io.h>

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "troupe/runtime/cluster_store.h"
#include "troupe/runtime/config.h"
#include "troupe/runtime/rpc.h"

namespace troupe {

struct ActorOptions {
  std::string type;                 // registered actor type, e.g. "Counter"
  std::string name;                 // optional; unique among live actors
  Resources resources{{"CPU", 1}};  // demand of each incarnation
  int32_t maxRestarts = 0;          // -1: unlimited
  int32_t maxTaskRetries = 0;       // calls retried on a restarted incarnation; -1: unlimited
  bool detached = false;            // lifetime="detached": outlives this client; otherwise the
                                    // actor ends when this ClusterClient (or its connection) does
  std::string initArgs;             // bytes for the actor's constructor
  PlacementGroupId placementGroup;  // run inside this group's bundle
  int32_t bundleIndex = -1;
};

class ClusterClient;
struct ActorConnection;

// A call's result bytes. A large result stays where it arrived, in the reply message (kept
// alive by the Reply and its copies), instead of being copied out; a small one is a string.
// Like its client, a Reply that keeps a message belongs to the client's thread (dropping the
// message tells the actor's connection the reply is done).
class Reply {
 public:
  Reply() = default;
  explicit Reply(std::string bytes) : bytes_(std::move(bytes)) {}
  // `bytes` lie in `message`, which the Reply keeps.
  Reply(std::shared_ptr<const void> message, std::string_view bytes) : bytes_(Kept{std::move(message), bytes}) {}

  std::string_view bytes() const;
  size_t size() const { return bytes().size(); }
  // The bytes as a string (a copy, unless this Reply owned them).
  std::string str() &&;

 private:
  struct Kept {
    std::shared_ptr<const void> message;
    std::string_view bytes;
  };
  std::variant<std::string, Kept> bytes_;
};

// A handle to an actor. Copyable; copies share one connection. Survives restarts: after the
// worker dies, the next call waits for the new incarnation and goes there. Calls from one
// handle run in submission order; many may be in flight.
class ActorHandle {
 public:
  const ActorId& id() const;
  // maxTaskRetries of a call: the actor's own (ActorOptions::maxTaskRetries).
  static constexpr int32_t kActorsRetries = -2;
  // Calls `method` with `payload`; resolves with the actor's reply. A call lost with its worker
  // is sent again to the restarted actor up to maxTaskRetries times (-1: no limit).
  kj::Promise<std::string> call(std::string method, std::string payload = {}, int32_t maxTaskRetries = kActorsRetries);
  // As call(), with the reply's bytes where they arrived (no copy of a large result).
  kj::Promise<Reply> callReply(std::string method, std::string payload = {}, int32_t maxTaskRetries = kActorsRetries);
  // The actor's typed interface (e.g. rpc::Counter) on its current incarnation.
  template <typename T>
  kj::Promise<typename T::Client> typed() {
    return typedCapability().then([](capnp::Capability::Client cap) { return cap.castAs<T>(); });
  }
  // Resolves once the actor is ALIVE (at least the incarnation this handle last saw).
  kj::Promise<ActorRecord> ready();

 private:
  friend class ClusterClient;
  explicit ActorHandle(std::shared_ptr<ActorConnection> connection) : connection_(std::move(connection)) {}
  kj::Promise<capnp::Capability::Client> typedCapability();
  std::shared_ptr<ActorConnection> connection_;
};

class ClusterClient {
 public:
  // Connects to the controller with the cluster token; rejects naming the address and why.
  // `actorCalls`: how connections to actors wait for answers (rpc.h; kSleep where the loop is
  // run through other WaitScopes than io's).
  static kj::Promise<kj::Own<ClusterClient>> connect(kj::AsyncIoContext& io, const HostPort& controller,
                                                     std::string token, PeerWait actorCalls = PeerWait::kSpinFirst);
  ~ClusterClient();

  // Creates the actor and resolves with its handle once it is ALIVE. Rejects if it cannot be
  // placed anywhere (infeasible), its name is taken, or it dies while starting (with why).
  kj::Promise<ActorHandle> createActor(ActorOptions options);
  // Creates without waiting: the handle's calls wait for the actor to come up.
  kj::Promise<ActorHandle> submitActor(ActorOptions options);
  kj::Promise<ActorHandle> getActor(const std::string& name);
  // A handle from an id (e.g. one passed from another process).
  ActorHandle actor(const ActorId& id);
  // noRestart: the actor is DEAD afterwards; otherwise its restart policy applies.
  kj::Promise<void> kill(const ActorHandle& actor, bool noRestart = true);
  kj::Promise<ActorRecord> actorInfo(const ActorId& id);
  kj::Promise<std::vector<ActorRecord>> listActors();
  kj::Promise<std::vector<NodeRecord>> listNodes();
  // Everything `troupe status` shows, from one status call (the dashboard's view).
  struct Snapshot {
    std::vector<NodeRecord> nodes;
    std::vector<ActorRecord> actors;
    std::vector<PlacementGroupRecord> placementGroups;
    std::vector<ElasticGroupRecord> groups;
  };
  kj::Promise<Snapshot> snapshot();

  // Placement groups: created all or nothing; PENDING (with a reason) while they cannot be
  // placed; infeasible rejects.
  kj::Promise<PlacementGroupRecord> createPlacementGroup(PlacementStrategy strategy, std::vector<Resources> bundles,
                                                         std::string name = {});
  kj::Promise<PlacementGroupRecord> placementGroup(const PlacementGroupId& id);
  kj::Promise<void> removePlacementGroup(const PlacementGroupId& id);
  // Resize a live group (see troupe.capnp: addBundles / removeBundles).
  kj::Promise<PlacementGroupRecord> addBundles(const PlacementGroupRecord& group, std::vector<Resources> bundles);
  kj::Promise<PlacementGroupRecord> removeBundles(const PlacementGroupId& id, std::vector<uint32_t> indices);

  // Elastic groups (troupe.capnp: putGroup ...): the driver's document and events; the group's
  // id is its placement group's. group() resolves to nullopt for an unknown group.
  kj::Promise<void> putGroup(const std::string& id, const std::string& doc);
  kj::Promise<void> groupEvent(const std::string& id, const std::string& text);
  // Sends `command` (its kind and workers; the time and sender are filled in here) to the
  // group's coordinator (troupe.capnp: groupCommand) and resolves to its seq. Rejected with
  // NOT_FOUND for an unknown group, INVALID_ARGUMENT for a resize to 0 workers.
  kj::Promise<uint64_t> groupCommand(const std::string& id, GroupCommand command);
  kj::Promise<void> removeGroup(const std::string& id);
  kj::Promise<std::optional<ElasticGroupRecord>> group(const std::string& id);
  kj::Promise<std::vector<ElasticGroupRecord>> listGroups();

  // Calls `listener` (on this client's thread) with each node the controller declares DEAD from
  // now on, and why, after this client broke its connections to that node's workers (their
  // calls in flight fail with the actor's fate: "actor ... died: node ... was declared DEAD").
  // Every client that holds an actor connection watches anyway; the listener is for a caller's
  // own connections to the node (its agent). Dropped with the client.
  void onNodeDeath(kj::Function<void(const NodeId&, const Status&)> listener);

  // For worker processes: this incarnation of `actor` now serves `address` (HOST:PORT).
  kj::Promise<void> reportActorReady(const ActorId& actor, uint32_t incarnation, const std::string& address);

  // Used by handles: the controller capability and what a connection needs.
  struct Shared;

 private:
  explicit ClusterClient(std::shared_ptr<Shared> shared) : shared_(std::move(shared)) {}
  std::shared_ptr<Shared> shared_;
};

}  // namespace troupe
