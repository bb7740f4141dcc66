#include "typed_call.h"

#include <capnp/dynamic.h>
#include <capnp/serialize.h>
#include <fmt/format.h>

#include <cstring>

#include "troupe/runtime/rpc.h"

namespace troupe::actors {

kj::Promise<Result<std::string>> callTyped(capnp::Capability::Client server, capnp::InterfaceSchema interface,
                                           const std::string& method, std::string_view payload) {
  auto name = interface.getShortDisplayName();
  KJ_IF_MAYBE(m, interface.findMethodByName(method)) {
    if (payload.size() % sizeof(capnp::word) != 0) {
      return Result<std::string>(Status(StatusCode::kInvalidArgument,
                                        fmt::format("{}.{}: the params are {} bytes, not whole 8-byte words (encode "
                                                    "them with troupe._actors.encode)",
                                                    name.cStr(), method, payload.size())));
    }
    // The received bytes need not be word-aligned: copied once (params are small; the large
    // arguments, such as replica chunks, come from peers' typed calls, not this path).
    auto words = kj::heapArray<capnp::word>(payload.size() / sizeof(capnp::word));
    if (!payload.empty()) std::memcpy(words.begin(), payload.data(), payload.size());
    auto request = server.typelessRequest(interface.getProto().getId(), m->getIndex(), nullptr);
    KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
      if (words.size() == 0) return;  // no params: every field at its default
      capnp::FlatArrayMessageReader reader(words);
      KJ_REQUIRE(reader.getEnd() == words.end(), "bytes after the message");
      request.setAs<capnp::DynamicStruct>(reader.getRoot<capnp::DynamicStruct>(m->getParamType()));
    })) {
      return Result<std::string>(Status(StatusCode::kInvalidArgument,
                                        fmt::format("{}.{}: the params are not a message of its params struct "
                                                    "(encode them with troupe._actors.encode): {}",
                                                    name.cStr(), method, e->getDescription().cStr())));
    }
    return request.send().then(
        [](capnp::Response<capnp::AnyPointer> response) -> Result<std::string> {
          capnp::MallocMessageBuilder out;
          out.getRoot<capnp::AnyPointer>().set(response);
          auto flat = capnp::messageToFlatArray(out);
          auto bytes = flat.asBytes();
          return std::string(reinterpret_cast<const char*>(bytes.begin()), bytes.size());
        },
        [](kj::Exception&& e) -> Result<std::string> { return statusFromException(e, ""); });
  }
  std::string known;
  for (auto each : interface.getMethods()) {
    known += (known.empty() ? "" : ", ") + std::string(each.getProto().getName().cStr());
  }
  return Result<std::string>(Status(StatusCode::kInvalidArgument,
                                    fmt::format("{} has no method '{}' ({})", name.cStr(), method, known)));
}

}  // namespace troupe::actors
