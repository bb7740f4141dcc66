// The built-in C++ actors' init args (actors/schema/init_args.capnp): which types have a struct
// there, JSON -> that struct's message for the driver that creates such an actor, and the checked
// typed reader the actor builds from the bytes it is given.
// Thread-safety: every function may be called from any thread; an InitArgs belongs to its owner.
#pragma once

#include <capnp/message.h>
#include <capnp/schema.h>

#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "init_args.capnp.h"
#include "troupe/runtime/status.h"

namespace troupe::actors {

// The struct whose message `type`'s init args are ("Trainer" -> rpc::TrainerArgs, ...); nullptr
// for a type whose init args are opaque bytes (Relay, Echo, Sleeper, Python actors "py:...").
kj::Maybe<capnp::StructSchema> initArgsSchema(std::string_view type);

// The init args of an actor of `type`, from the JSON object a driver was given (keys: the fields'
// $Json.name; "" stands for {}), as one flat message of initArgsSchema(type); for a type with no
// schema, `json` unchanged. kInvalidArgument naming the type and the field (by its JSON path, e.g.
// "engine.lr") for text that is not a JSON object, an unknown or repeated key, a value of the
// wrong JSON type, an integer out of its field's range or not whole, or null.
[[nodiscard]] Result<std::string> encodeInitArgs(std::string_view type, std::string_view json);

// A struct's message as init args bytes (what encodeInitArgs returns): for C++ callers that build
// the struct themselves.
std::string initArgsBytes(capnp::MessageBuilder& message);

// The init args an actor of `type` received, decoded and checked: a typed reader over an owned,
// validated copy, so reading it cannot fail. Empty bytes read as every field's default.
template <typename T>
class InitArgs {
 public:
  typename T::Reader get() const { return message_->getRoot<T>().asReader(); }

 private:
  template <typename U>
  friend Result<InitArgs<U>> decodeInitArgs(std::string_view type, std::string_view bytes);
  explicit InitArgs(std::unique_ptr<capnp::MallocMessageBuilder> message) : message_(std::move(message)) {}
  std::unique_ptr<capnp::MallocMessageBuilder> message_;
};

// Copies `bytes` (a flat message whose root is `schema`) into a message of its own, checking
// every size and pointer in it against `bytes` first. kInvalidArgument naming `type` for bytes
// that are not a whole number of words, a segment table or pointer that runs past them, a
// pointer of another kind than its field's (a struct where text is expected), bytes after the
// message, or a message nested or sized beyond what init args need.
[[nodiscard]] Result<std::unique_ptr<capnp::MallocMessageBuilder>> copyInitArgs(std::string_view type,
                                                                                 capnp::StructSchema schema,
                                                                                 std::string_view bytes);

// `bytes` as `type`'s init args of struct T (rpc::TrainerArgs, ...): copyInitArgs's errors.
template <typename T>
[[nodiscard]] Result<InitArgs<T>> decodeInitArgs(std::string_view type, std::string_view bytes) {
  TROUPE_ASSIGN_OR_RETURN(auto message, copyInitArgs(type, capnp::Schema::from<T>(), bytes));
  return InitArgs<T>(std::move(message));
}

}  // namespace troupe::actors
