// Fuzz target: the client side of the token handshake, fed the bytes a server (or whatever answers
// on the address) sends back, both on KJ streams (RPC) and on a blocking socket (the store's
// connections through the gateway). Without the token no answer may be accepted.
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
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
  auto* server = pipe.ends[1].get();
  auto client = handshake::connect(*pipe.ends[0], token, handshake::Purpose::kRpc, handshake::Transport::kPlain);
  kj::Promise<void> sent = size == 0 ? kj::Promise<void>(kj::READY_NOW) : server->write(data, size);
  sent = sent.then([server]() { server->shutdownWrite(); }).eagerlyEvaluate(nullptr);
  auto drained = server->readAllBytes().eagerlyEvaluate(nullptr);  // the client's hello and answer
  bool connected = false;
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
    client.wait(loop->scope);
    connected = true;
  })) {
    (void)e;
  }
  if (connected) __builtin_trap();
  pipe.ends[0] = nullptr;
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
    sent.wait(loop->scope);
    drained.wait(loop->scope);
  })) {
    (void)e;
  }

  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) return 0;
  size_t at = 0;
  while (at < size) {  // the socket buffer holds more than libFuzzer's inputs; stop if it does not
    ssize_t n = ::write(fds[1], data + at, size - at);
    if (n <= 0) break;
    at += static_cast<size_t>(n);
  }
  ::shutdown(fds[1], SHUT_WR);
  auto status = handshake::connectBlocking(fds[0], token, handshake::Purpose::kStore, handshake::Transport::kPlain,
                                            std::chrono::milliseconds(200));
  ::close(fds[0]);
  ::close(fds[1]);
  if (status.isOk()) __builtin_trap();
  return 0;
}
