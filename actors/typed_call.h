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

#include <string>
#include <string_view>

#include "troupe/runtime/status.h"

namespace troupe::actors {

// Calls `method` of `interface` on `server` with `payload` (the params). kInvalidArgument for an
// unknown method (naming the known ones) or a payload that is not a params message; the method's
// own error as its Status otherwise.
kj::Promise<Result<std::string>> callTyped(capnp::Capability::Client server, capnp::InterfaceSchema interface,
                                           const std::string& method, std::string_view payload);

}  // namespace troupe::actors
