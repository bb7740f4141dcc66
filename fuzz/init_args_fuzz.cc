// Fuzz target: the built-in actors' init args (actors/args). The first byte picks the actor type
// and the side: the bytes a worker is given (from the store, through its node agent), copied
// into a checked message or refused, never read out of bounds; or the JSON a driver is given,
// encoded or refused, where whatever encodes also decodes.
#include <capnp/dynamic.h>
#include <capnp/pretty-print.h>

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "troupe/actors/init_args.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace troupe::actors;
  static constexpr std::array<std::string_view, 5> kTypes = {"Trainer", "Dataloader", "Checkpoint", "Counter",
                                                             "Crasher"};
  if (size == 0) return 0;
  std::string_view type = kTypes[(data[0] >> 1) % kTypes.size()];
  std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  capnp::StructSchema schema;
  KJ_IF_MAYBE(s, initArgsSchema(type)) {
    schema = *s;
  } else {
    __builtin_trap();
  }
  if ((data[0] & 1) == 0) {
    auto copy = copyInitArgs(type, schema, rest);
    if (!copy.isOk()) return 0;
    auto root = (*copy)->getRoot<capnp::DynamicStruct>(schema).asReader();
    (void)capnp::prettyPrint(root);  // reads every field
    // The copy is a message of its own: as bytes, it is accepted again.
    if (!copyInitArgs(type, schema, initArgsBytes(**copy)).isOk()) __builtin_trap();
    return 0;
  }
  auto bytes = encodeInitArgs(type, rest);
  if (!bytes.isOk()) return 0;
  if (!copyInitArgs(type, schema, *bytes).isOk()) __builtin_trap();
  return 0;
}
