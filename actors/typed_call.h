// Internal to actors/: the built-in actors' generic call path onto their typed interfaces.
// A caller without Cap'n Proto RPC of its own (the Python driver, through troupe._actors) calls
// method `m` of an actor's interface by name, with the method's params struct as a Cap'n Proto
// message (unpacked, one segment or more, as capnp::messageToFlatArray writes it; no bytes at all
// leave every param at its default); the reply is
// the results struct, encoded the same way. The call runs the same server code as a typed call.
// TypedActor and ServerFor are the actor and server halves every built-in typed actor derives from.
// Thread-safety: the actor's RPC thread only (it calls the actor's capability).
#pragma once

#include <capnp/capability.h>
#include <capnp/schema.h>
#include <kj/async.h>

#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "troupe/runtime/actor.h"
#include "troupe/runtime/rpc.h"
#include "troupe/runtime/status.h"

namespace troupe::actors {

// Calls `method` of `interface` on `server` with `payload` (the params). kInvalidArgument for an
// unknown method (naming the known ones) or a payload that is not a params message; the method's
// own error as its Status otherwise.
kj::Promise<Result<std::string>> callTyped(capnp::Capability::Client server, capnp::InterfaceSchema interface,
                                           const std::string& method, std::string_view payload);

// The typed server of an actor of class `Owner`. Its methods reach the actor through actor(),
// which fails with kUnavailable once the actor has ended: a caller may hold the capability
// longer than the actor lives. TypedActor::serve makes it and tells it when the actor ends.
template <typename Interface, typename Owner>
class ServerFor : public Interface::Server {
 public:
  explicit ServerFor(Owner& owner) : owner_(&owner) {}
  void actorEnded() { owner_ = nullptr; }

 protected:
  Owner& actor() {
    if (owner_ == nullptr) {
      throwStatus(Status(StatusCode::kUnavailable,
                         fmt::format("the {} actor has ended",
                                     capnp::Schema::from<Interface>().getShortDisplayName().cStr())));
    }
    return *owner_;
  }

 private:
  Owner* owner_;
};

// An actor whose every method is on its typed interface: typed() serves it, the generic path
// (callAsync, the Python driver) reaches it through callTyped, and a synchronous call is refused.
// The actor calls serve<Server>(*this) once, in its constructor.
template <typename Interface>
class TypedActor : public Actor {
 public:
  ~TypedActor() override {
    if (ended_) ended_();
  }

  kj::Promise<Result<std::string>> callAsync(const std::string& method, std::string_view payload) override {
    return callTyped(*server_, capnp::Schema::from<Interface>(), method, payload);
  }
  Result<std::string> call(const std::string& method, std::string_view) override {
    return Status(StatusCode::kInternal,
                  fmt::format("{}.{}: called synchronously (use callAsync)",
                              capnp::Schema::from<Interface>().getShortDisplayName().cStr(), method));
  }
  kj::Maybe<capnp::Capability::Client> typed() override { return *server_; }

 protected:
  // Serves a `Server` (a ServerFor<Interface, Self>) over `self`; it is told when the actor ends.
  template <typename Server, typename Self>
  void serve(Self& self) {
    auto server = kj::heap<Server>(self);
    ended_ = [raw = server.get()]() { raw->actorEnded(); };
    server_ = std::make_unique<capnp::Capability::Client>(kj::mv(server));
  }

 private:
  // Held by pointer: a capability's destructor may throw, an Actor's may not.
  std::unique_ptr<capnp::Capability::Client> server_;
  std::function<void()> ended_;
};

}  // namespace troupe::actors
