// Fuzz target: the server side of the token handshake, fed the bytes a stranger could send. It
// must answer or close, never accept without the token, never read out of bounds.
#include <cstdint>
#include <string>

#include <kj/async-io.h>

#include "troupe/runtime/handshake.h"

namespace {
struct Loop {
  kj::EventLoop loop;
  kj::WaitScope scope{loop};
};
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace troupe;
  static Loop* loop = new Loop;
  static const std::string token = "fuzz-token-0123456789abcdef";  // the promise keeps a reference
  auto pipe = kj::newTwoWayPipe();
  auto server = handshake::accept(*pipe.ends[0], token, handshake::Purpose::kRpc, handshake::Transport::kPlain);
  auto* client = pipe.ends[1].get();
  kj::Promise<void> sent = size == 0 ? kj::Promise<void>(kj::READY_NOW) : client->write(data, size);
  sent = sent.then([client]() { client->shutdownWrite(); }).eagerlyEvaluate(nullptr);
  // Drain what the server answers so its writes complete.
  auto drained = client->readAllBytes().eagerlyEvaluate(nullptr);
  bool accepted = false;
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
    accepted = server.wait(loop->scope);
  })) {
    (void)e;
  }
  // The fuzzer does not know the token: an accepted handshake is a bug.
  if (accepted) __builtin_trap();
  pipe.ends[0] = nullptr;
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
    sent.wait(loop->scope);
    drained.wait(loop->scope);
  })) {
    (void)e;
  }
  return 0;
}
