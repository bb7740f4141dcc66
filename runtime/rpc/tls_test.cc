// TLS keyed by the cluster token: the identity is the same for the same token and only for it,
// and the relay carries bytes both ways between two holders while refusing a stranger.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <future>
#include <string>

#include "troupe/runtime/handshake.h"
#include "troupe/runtime/process.h"
#include "troupe/runtime/rpc.h"
#include "troupe/runtime/tls.h"

namespace troupe {
namespace {

// A listening socket on a free loopback port: (socket, port).
std::pair<int, uint16_t> loopbackListener() {
  int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  REQUIRE(::listen(listener, 1) == 0);
  socklen_t len = sizeof(addr);
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  return {listener, ntohs(addr.sin_port)};
}

// A connected TCP pair on loopback: (client side, server side).
std::pair<int, int> tcpPair() {
  auto [listener, port] = loopbackListener();
  auto client = connectTcp(HostPort{"127.0.0.1", port}, std::chrono::seconds(2));
  REQUIRE(client.isOk());
  int server = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
  ::close(listener);
  return {*client, server};
}

// The other process of the exit test below (this test binary, started again with the variable
// set): relays to the port as a TLS client, writes kExitBytes and exits at once through exit(),
// without closing its end.
constexpr size_t kExitBytes = size_t(8) << 20;  // more than the socketpair holds
const int exitSender = []() {
  const char* port = std::getenv("TROUPE_TLS_TEST_EXIT_SENDER");
  if (port == nullptr) return 0;
  auto fd = connectTcp(HostPort{"127.0.0.1", static_cast<uint16_t>(std::atoi(port))}, std::chrono::seconds(5));
  if (!fd.isOk()) _exit(2);
  auto plain = tls::relay(*fd, "same", false, std::chrono::seconds(5));
  if (!plain.isOk()) _exit(3);
  std::string bytes(kExitBytes, 'e');
  for (size_t at = 0; at < bytes.size();) {
    ssize_t n = ::send(*plain, bytes.data() + at, bytes.size() - at, MSG_NOSIGNAL);
    if (n <= 0) _exit(4);
    at += static_cast<size_t>(n);
  }
  std::exit(0);
}();

TEST_CASE("tls: bytes a process writes just before it exits still reach the peer") {
  auto [listener, port] = loopbackListener();
  SpawnOptions o;
  o.argv = {"/proc/self/exe"};
  o.env = {fmt::format("TROUPE_TLS_TEST_EXIT_SENDER={}", port)};
  auto spawned = spawnProcess(o);
  REQUIRE(spawned.isOk());
  ChildProcess child(*spawned);
  int s = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
  ::close(listener);
  REQUIRE(s >= 0);
  auto served = tls::relay(s, "same", true, std::chrono::seconds(5));
  REQUIRE(served.isOk());
  std::string got(kExitBytes + 1, '\0');
  size_t at = 0;
  for (ssize_t n; (n = ::recv(*served, got.data() + at, got.size() - at, 0)) > 0;) at += static_cast<size_t>(n);
  ::close(*served);
  auto exited = child.wait(std::chrono::seconds(10));
  REQUIRE(exited.has_value());
  // Before the exit waited for the relay, the bytes still in its socketpair (megabytes) were lost.
  CHECK(at == kExitBytes);
  CHECK(got.substr(0, at) == std::string(at, 'e'));
}

TEST_CASE("tls: the cluster identity is derived from the token, the same in every process") {
  auto a = tls::identity("token-a");
  CHECK(a.certPem == tls::identity("token-a").certPem);
  CHECK(a.keyPem == tls::identity("token-a").keyPem);
  CHECK(a.certPem != tls::identity("token-b").certPem);
  CHECK(a.certPem.find("BEGIN CERTIFICATE") != std::string::npos);
}

TEST_CASE("tls: two relays with the same token carry bytes both ways; a stranger is refused") {
  auto [c, s] = tcpPair();
  auto server = std::async(std::launch::async, [fd = s]() { return tls::relay(fd, "same", true, std::chrono::seconds(5)); });
  auto client = tls::relay(c, "same", false, std::chrono::seconds(5));
  auto served = server.get();
  REQUIRE(client.isOk());
  REQUIRE(served.isOk());
  std::string big(3 << 20, 'x');  // more than a record and more than the relay's buffer
  for (size_t i = 0; i < big.size(); i += 4096) big[i] = static_cast<char>(i / 4096);
  auto writer = std::async(std::launch::async, [&]() { return ::send(*client, big.data(), big.size(), MSG_NOSIGNAL); });
  std::string got(big.size(), '\0');
  size_t at = 0;
  while (at < got.size()) {
    ssize_t n = ::recv(*served, got.data() + at, got.size() - at, 0);
    REQUIRE(n > 0);
    at += static_cast<size_t>(n);
  }
  CHECK(writer.get() == static_cast<ssize_t>(big.size()));
  CHECK(got == big);
  REQUIRE(::send(*served, "pong", 4, MSG_NOSIGNAL) == 4);
  char pong[4];
  REQUIRE(::recv(*client, pong, 4, MSG_WAITALL) == 4);
  CHECK(std::string(pong, 4) == "pong");
  // Closing one end ends the relayed connection at the other.
  ::close(*client);
  char byte;
  CHECK(::recv(*served, &byte, 1, 0) == 0);
  ::close(*served);

  auto [c2, s2] = tcpPair();
  auto stranger = std::async(std::launch::async, [fd = s2]() { return tls::relay(fd, "other", true, std::chrono::seconds(5)); });
  auto refused = tls::relay(c2, "same", false, std::chrono::seconds(5));
  CHECK_FALSE(refused.isOk());
  CHECK(refused.status().code() == StatusCode::kUnauthenticated);
  CHECK(refused.status().message().find("not this cluster's") != std::string::npos);
  auto other = stranger.get();
  if (other.isOk()) ::close(*other);
}

}  // namespace
// An on-path relay without the token, between a client that starts in plaintext and a --tls
// server: it speaks TLS to the server (a TLS client needs no secret) and plaintext to the client,
// forwarding the handshake, so that it could read and rewrite everything after it. The proofs
// cover each side's transport, so the client refuses the server's proof and nothing is served.
// Relaying plaintext to plaintext (the control) succeeds: the relay itself is sound.
namespace {
struct Relayed {
  bool clientConnected = false;
  StatusCode clientCode = StatusCode::kOk;
  std::string clientError;
  bool served = false;
};

Relayed throughRelay(bool serverTls) {
  kj::AsyncIoContext io = kj::setupAsyncIo();
  const std::string token = "relay-test-token-0123456789abcdef";
  tls::Streams serverSide(token), relaySide(token);  // the relay's pinned check is a courtesy it could skip
  auto toRelay = kj::newTwoWayPipe();
  auto toServer = kj::newTwoWayPipe();
  auto& clientEnd = *toRelay.ends[0];
  auto& relayPlain = *toRelay.ends[1];

  Relayed r;
  auto served = handshake::acceptStream(kj::mv(toServer.ends[1]), token, handshake::Purpose::kRpc,
                                        serverTls ? &serverSide : nullptr)
                    .then([&r](kj::Maybe<kj::Own<kj::AsyncIoStream>> s) { r.served = s != nullptr; },
                          [](kj::Exception&&) {})
                    .eagerlyEvaluate(nullptr);
  auto upstream = serverTls ? relaySide.client(kj::mv(toServer.ends[0]))
                            : kj::Promise<kj::Own<kj::AsyncIoStream>>(kj::mv(toServer.ends[0]));
  kj::Own<kj::AsyncIoStream> up;
  kj::Promise<void> relay = upstream
                   .then([&](kj::Own<kj::AsyncIoStream> s) {
                     up = kj::mv(s);
                     return kj::joinPromises(kj::arr(
                         relayPlain.pumpTo(*up).ignoreResult().then([&]() { up->shutdownWrite(); }),
                         up->pumpTo(relayPlain).ignoreResult().then([&]() { relayPlain.shutdownWrite(); })));
                   })
                   .then([]() {}, [](kj::Exception&&) {})
                   .eagerlyEvaluate(nullptr);
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
    handshake::connect(clientEnd, token, handshake::Purpose::kRpc, handshake::Transport::kPlain).wait(io.waitScope);
    r.clientConnected = true;
  })) {
    Status s = statusFromException(*e, "");
    r.clientCode = s.code();
    r.clientError = s.message();
  }
  // The client and the relay go away: the server's read ends, and with it its verdict.
  toRelay.ends[0] = nullptr;
  relay = kj::READY_NOW;
  up = nullptr;
  served.wait(io.waitScope);
  return r;
}
}  // namespace

TEST_CASE("tls: a relay that strips TLS between a plaintext client and a --tls server is refused") {
  Relayed control = throughRelay(false);
  CHECK(control.clientConnected);
  CHECK(control.served);

  Relayed stripped = throughRelay(true);
  CHECK_FALSE(stripped.clientConnected);
  CHECK(stripped.clientCode == StatusCode::kUnauthenticated);
  CHECK(stripped.clientError.find("stripped TLS") != std::string::npos);
  CHECK_FALSE(stripped.served);
}

}  // namespace troupe
