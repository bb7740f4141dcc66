// Mutual proof of the cluster token, before any other byte on a connection (RPC and the store
// gateway). Challenge-response, so the token never crosses the wire and a client never talks
// to a server that cannot prove it knows the token:
//
//   client -> "TRPE", version 3, purpose, client nonce (32 bytes)
//   server -> server nonce (32), HMAC-SHA256(token, "troupe-server" purpose transport cn sn)
//   client -> HMAC-SHA256(token, "troupe-client" purpose transport cn sn)   (only if the server's proof holds)
//   server -> 'Y' (then the protocol starts) or 'N' and close
//
// The purpose byte keeps a proof for one service from being replayed to another; fresh nonces on
// both sides keep any proof from being replayed at all. The transport byte is each side's own view
// of whether the connection is inside TLS: an on-path relay without the token that speaks TLS to a
// --tls server and plaintext to the client (a downgrade) makes the views differ, and the client
// refuses the server's proof. Without --tls the bytes after the
// handshake are not protected (see docs/design/several-hosts.md).
// Thread-safety: the async functions belong to the KJ thread of their stream; the blocking one
// may run on any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <chrono>
#include <map>
#include <string>

#include <kj/async-io.h>
#include <kj/function.h>

#include "troupe/runtime/config.h"
#include "troupe/runtime/status.h"
#include "troupe/runtime/tls.h"

namespace troupe::handshake {

// Binds host:port (port 0: a free one) for a server that runs this handshake. kAlreadyExists
// when the port is taken, kInvalidArgument for an address that cannot be bound.
Result<kj::Own<kj::ConnectionReceiver>> listen(kj::AsyncIoContext& io, const HostPort& bind);
// Small messages must leave at once, not wait for Nagle's algorithm (no-op on non-TCP streams).
void setNoDelay(kj::AsyncIoStream& stream);
// The peer's address without its port ("?" if unknown), as per-source limits count it.
std::string peerHost(kj::AsyncIoStream& stream);

enum class Purpose : uint8_t { kRpc = 'R', kStore = 'S', kBulk = 'B' };
// Whether the handshake runs inside TLS, as this side sees it; bound into both proofs.
enum class Transport : uint8_t { kPlain = 'P', kTls = 'T' };

// A server's whole accept path: a first byte of 0x16 (a TLS ClientHello) is answered with TLS
// through `tls` (null: TLS is refused), anything else with the plaintext handshake, unless `tls`
// is given, which means the cluster requires TLS: then the client is told so ('S') and closed.
// Resolves with the stream to serve (TLS-wrapped or not), or null when the client was refused.
kj::Promise<kj::Maybe<kj::Own<kj::AsyncIoStream>>> acceptStream(kj::Own<kj::AsyncIoStream> stream,
                                                                 const std::string& token, Purpose purpose,
                                                                 tls::Streams* tls);
// A client's whole connect path: TLS first when `tls` is given, then the handshake. Rejects like
// connect(); a plaintext client of a TLS cluster gets a DISCONNECTED exception whose code
// (statusFromException) is kFailedPrecondition (it should call tls::require() and connect again).
kj::Promise<kj::Own<kj::AsyncIoStream>> connectStream(kj::Own<kj::AsyncIoStream> stream, const std::string& token,
                                                      Purpose purpose, tls::Streams* tls);
constexpr const char* kTlsRequired = "the cluster requires TLS";

// A listener whose every connection must pass acceptStream() within 5 s before `serve` gets it.
// It keeps accepting after accept() fails (out of descriptors: it retries after 100 ms).
// `what` names the server in log lines. Owned by the KJ thread of `io`.
class Acceptor final : private kj::TaskSet::ErrorHandler {
 public:
  using Serve = kj::Function<kj::Promise<void>(kj::Own<kj::AsyncIoStream>)>;
  Acceptor(kj::AsyncIoContext& io, kj::Own<kj::ConnectionReceiver> listener, std::string token, Purpose purpose,
           std::string what, Serve serve);
  ~Acceptor() noexcept(false);
  int port() const { return port_; }
  // Connections closed without passing the handshake (tests check it).
  uint64_t refused() const { return refused_; }
  // At most this many connections from one address may be in the handshake at once (each has
  // kHandshakeTimeout to finish); more are closed at once, so one host cannot take every
  // descriptor of a server.
  static constexpr int kMaxPendingPerSource = 16;

 private:
  kj::Promise<void> acceptLoop();
  kj::Promise<void> admit(kj::Own<kj::AsyncIoStream> stream, std::string source);
  // Counts a refusal; logs the first few, then one line per interval with how many more.
  void noteRefused(const std::string& why);
  void taskFailed(kj::Exception&& e) override;

  kj::AsyncIoContext& io_;
  kj::Own<kj::ConnectionReceiver> listener_;
  int port_;
  std::string token_;
  Purpose purpose_;
  std::string what_;
  Serve serve_;
  kj::Own<tls::Streams> tls_;  // set when this process serves a --tls cluster
  uint64_t refused_ = 0;
  // Connections still in the handshake, per source address: one host cannot hold them all.
  std::map<std::string, int> pending_;
  uint64_t unloggedRefusals_ = 0;
  std::chrono::steady_clock::time_point lastRefusalLog_{};
  std::chrono::steady_clock::time_point lastAcceptFailureLog_{};
  kj::TaskSet tasks_;
};

// Server side. Resolves true once the client proved the token (after writing 'Y'), false when it
// did not (after writing 'N'). Rejects when the stream fails.
kj::Promise<bool> accept(kj::AsyncIoStream& stream, const std::string& token, Purpose purpose, Transport transport);

// Client side. Rejects (DISCONNECTED, code kUnauthenticated) with a message starting "the cluster
// token was rejected" (by the server, or because the server proved a different token).
kj::Promise<void> connect(kj::AsyncIoStream& stream, const std::string& token, Purpose purpose, Transport transport);

// Client side on a blocking socket (the store's hiredis connections through the gateway);
// `transport` is kTls when `fd` is the plaintext end of a tls::relay().
// kUnauthenticated for either failed proof, kUnavailable for I/O errors or no answer in `timeout`,
// kFailedPrecondition (message kTlsRequired) when the server requires TLS.
Status connectBlocking(int fd, const std::string& token, Purpose purpose, Transport transport,
                       std::chrono::milliseconds timeout);

}  // namespace troupe::handshake
