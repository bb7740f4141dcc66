// TLS for a cluster started with `--tls`: RPC, the store gateway and collective sockets.
//
// The cluster's TLS identity is derived from the cluster token: an Ed25519 key from
// HKDF-SHA256(token) and its self-signed certificate (CN and SAN "troupe-cluster"), byte for byte
// the same in every process that holds the token, so nothing is distributed and nothing secret
// crosses a wire. A client trusts exactly that certificate: a server that completes TLS holds a
// key only the token yields (the certificate is pinned through the token). The token handshake
// (handshake.h) then runs inside TLS and proves the client too.
//
// A server of a --tls cluster tells a plaintext client so ('S' instead of its challenge), and the
// client switches to TLS for the rest of its process (requireTls()); daemons and workers start
// with TROUPE_TLS=1 in their environment.
// Thread-safety: tlsRequired()/requireTls() from any thread; TlsStreams belongs to its KJ thread;
// relay() from any thread.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include <kj/async-io.h>

#include "troupe/runtime/status.h"

namespace troupe::tls {

// The hostname in the cluster certificate, checked by every client.
constexpr const char* kServerName = "troupe-cluster";

struct Identity {
  std::string keyPem;
  std::string certPem;
};
// The cluster's key and certificate for `token` (deterministic).
Identity identity(const std::string& token);

// Whether this process speaks TLS to cluster servers: TROUPE_TLS=1 at start, or a server said so.
bool required();
void require();

// Wraps KJ streams for one token (server and client contexts made once).
class Streams {
 public:
  explicit Streams(const std::string& token);
  ~Streams();
  kj::Promise<kj::Own<kj::AsyncIoStream>> server(kj::Own<kj::AsyncIoStream> stream);
  kj::Promise<kj::Own<kj::AsyncIoStream>> client(kj::Own<kj::AsyncIoStream> stream);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A stream that first yields `prefix` (bytes already read off `inner`), then `inner`'s bytes.
kj::Own<kj::AsyncIoStream> prefixed(kj::Own<kj::AsyncIoStream> inner, kj::Array<kj::byte> prefix);

// For code that owns a blocking descriptor (hiredis through the gateway, collective sockets):
// runs the TLS client (or server) handshake on the connected socket `fd`, then relays plaintext
// between it and one end of a socketpair on a thread of its own; returns the other end, which the
// caller uses as it used `fd`. The relay ends (closing both) when either side closes. Takes
// ownership of `fd` on success and on failure. kUnauthenticated when the peer's certificate is
// not the cluster's (or it rejected ours), kUnavailable for I/O errors or no handshake in `timeout`.
Result<int> relay(int fd, const std::string& token, bool server, std::chrono::milliseconds timeout);

}  // namespace troupe::tls
