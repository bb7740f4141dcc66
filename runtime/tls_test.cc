// TLS keyed by the cluster token: the identity is the same for the same token and only for it,
// and the relay carries bytes both ways between two holders while refusing a stranger.
#include <doctest/doctest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <string>

#include "troupe/runtime/process.h"
#include "troupe/runtime/tls.h"

namespace troupe {
namespace {

// A connected TCP pair on loopback: (client side, server side).
std::pair<int, int> tcpPair() {
  int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  REQUIRE(::listen(listener, 1) == 0);
  socklen_t len = sizeof(addr);
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  auto client = connectTcp(HostPort{"127.0.0.1", ntohs(addr.sin_port)}, std::chrono::seconds(2));
  REQUIRE(client.isOk());
  int server = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
  ::close(listener);
  return {*client, server};
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
}  // namespace troupe
