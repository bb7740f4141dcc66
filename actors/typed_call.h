// Internal to actors/: the built-in actors' generic call path onto their typed interfaces.
// A caller without Cap'n Proto RPC of its own (the Python driver, through troupe._actors) calls
// method `m` of an actor's interface by name, with the method's params struct as a Cap'n Proto
// message (unpacked, one segment or more, as capnp::messageToFlatArray writes it; no bytes at all
// leave every param at its default); the reply is
// the results struct, encoded the same way. The call runs the same server code as a typed call.
// Thread-safety: the actor's RPC thread only (it calls the actor's capability).
#pragma once

#include <capnp/capability.h>
#include <capnp/schema.h>
#include <kj/async.h>

#include <memory>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "troupe/runtime/actor.h"
#include "troupe/runtime/status.h"

namespace troupe::actors {

// Calls `method` of `interface` on `server` with `payload` (the params). kInvalidArgument for an
// unknown method (naming the known ones) or a payload that is not a params message; the method's
// own error as its Status otherwise.
kj::Promise<Result<std::string>> callTyped(capnp::Capability::Client server, capnp::InterfaceSchema interface,
                                           const std::string& method, std::string_view payload);

// An actor whose every method is on its typed interface: typed() serves it, the generic path
// (callAsync, the Python driver) reaches it through callTyped, and a synchronous call is refused.
// The actor calls serve() once, in its constructor.
template <typename Interface>
class TypedActor : public Actor {
 public:
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
  void serve(capnp::Capability::Client server) {
    server_ = std::make_unique<capnp::Capability::Client>(kj::mv(server));
  }

 private:
  std::unique_ptr<capnp::Capability::Client> server_;
};

}  // namespace troupe::actors
