// Authenticated Cap'n Proto RPC over TCP. Before any Cap'n Proto message, the client sends
// "TRPE", a version byte, a length byte and the cluster token; the server answers 'Y' and
// starts RPC, or answers 'N' and closes: a connection without the token never gets a
// capability. Handshakes that do not finish within 5 s are closed too.
// Thread-safety: every object here belongs to the KJ event-loop thread that created it.
#pragma once

#include <capnp/capability.h>
#include <capnp/rpc-twoparty.h>
#include <kj/async-io.h>
#include <kj/function.h>

#include <chrono>
#include <memory>
#include <string>

#include "troupe/runtime/config.h"
#include "troupe/runtime/status.h"

namespace troupe {

// The largest RPC message either side sends or accepts (a call's arguments or result). Cap'n
// Proto's default, 64 MiB, would refuse a 100 MB array; past this bound a call fails at the
// sender with a clear error.
inline constexpr size_t kMaxRpcMessageBytes = size_t(1) << 30;

// How a connection's thread waits for the peer's next message once it has nothing else to do.
//   kSleep      in epoll at once (daemons: the controller, node agents, the store gateway).
//   kSpinFirst  first spins for a short window after each message sent or received (200 us,
//               TROUPE_RPC_SPIN_US; 0 turns it off): the loop polls the OS between turns instead
//               of sleeping (WaitScope::setBusyPollInterval on the AsyncIoContext's scope, which
//               must be the scope that runs the loop), yielding the CPU to anything else
//               runnable. Actor calls use it: a wake-up from epoll costs more than a whole call
//               on a virtual machine. A spin that heard nothing halves the window (down to 1/8);
//               it is whole again when an answer comes within a whole window after all.
enum class PeerWait { kSleep, kSpinFirst };

// A connection's held buffers: what its replies reference instead of copying (runtime-internal).
class HeldBuffers;
// Makes a connection's bootstrap capability, given the connection's held buffers.
using ConnectionBootstrap = kj::Function<capnp::Capability::Client(std::shared_ptr<HeldBuffers>)>;

// Serves `bootstrap` to every connection on `bind` that presents `token`.
class RpcServer {
 public:
  // Binds host:port (port 0: any free port). kAlreadyExists when the port is taken,
  // kInvalidArgument for an address that cannot be bound.
  static Result<kj::Own<RpcServer>> listen(kj::AsyncIoContext& io, const HostPort& bind,
                                           std::string token, capnp::Capability::Client bootstrap,
                                           PeerWait wait = PeerWait::kSleep);
  // As above, with a capability made for each connection.
  static Result<kj::Own<RpcServer>> listen(kj::AsyncIoContext& io, const HostPort& bind,
                                           std::string token, ConnectionBootstrap bootstrap,
                                           PeerWait wait = PeerWait::kSleep);
  virtual ~RpcServer() noexcept(false) = default;
  virtual int port() const = 0;
  // Connections closed for a wrong or missing token (shown in logs and checked by tests).
  virtual uint64_t refusedConnections() const = 0;
};

// One authenticated connection to a server.
class RpcClient {
 public:
  // Connects and presents `token`. Rejects with a KJ exception naming the address: refused,
  // token rejected, or no answer within `timeout`.
  static kj::Promise<kj::Own<RpcClient>> connect(kj::AsyncIoContext& io, const HostPort& address,
                                                 std::string token, kj::Duration timeout,
                                                 PeerWait wait = PeerWait::kSleep);
  // `spinScope`: spin first (PeerWait::kSpinFirst) on the loop this scope runs.
  explicit RpcClient(kj::Own<kj::AsyncIoStream> stream, kj::WaitScope* spinScope = nullptr);

  // The server's bootstrap capability, taken once at connect: once the connection is gone
  // its calls reject with DISCONNECTED (asking capnp for a new bootstrap on a dead
  // connection would end the process).
  template <typename T>
  typename T::Client bootstrap() {
    return bootstrap_.castAs<T>();
  }
  // Resolves when the server closes the connection.
  kj::Promise<void> onDisconnect() { return network_.onDisconnect(); }
  // True once the connection is gone: make a new RpcClient to go on.
  bool disconnected() const { return *disconnected_; }
  // Ends the connection now, as if the peer had gone with `why`: every call in flight on it
  // rejects with DISCONNECTED and `why`'s message (code included), and so do later ones. For a
  // peer known to be gone whose socket has not noticed yet (its node was declared DEAD).
  void breakConnection(const Status& why);

 private:
  class BreakableStream;
  BreakableStream* breakable_;  // owned by stream_
  kj::Own<kj::AsyncIoStream> stream_;
  capnp::TwoPartyVatNetwork network_;
  capnp::RpcSystem<capnp::rpc::twoparty::VatId> rpcSystem_;
  capnp::Capability::Client bootstrap_;
  kj::Own<bool> disconnected_;
  kj::Promise<void> watch_;
};

// Bulk byte streams beside RPC (a node's object pulls): the same token handshake and TLS as RPC
// connections, under a purpose of their own, so neither service accepts the other's proof; what
// flows after it is the service's own framing.
class BulkServer {
 public:
  using Serve = kj::Function<kj::Promise<void>(kj::Own<kj::AsyncIoStream>)>;
  // Binds host:port (0: a free one); `serve` gets each authenticated connection, for as long as
  // the promise it returns runs. `what` names the server in log lines.
  static Result<kj::Own<BulkServer>> listen(kj::AsyncIoContext& io, const HostPort& bind, std::string token,
                                            std::string what, Serve serve);
  virtual ~BulkServer() noexcept(false) = default;
  virtual int port() const = 0;
};
// Connects to a BulkServer as RpcClient::connect does (same errors and deadline).
kj::Promise<kj::Own<kj::AsyncIoStream>> connectBulk(kj::AsyncIoContext& io, const HostPort& address, std::string token,
                                                    kj::Duration timeout);

// The controller's default heartbeat TTL (--heartbeat-ttl-ms): a node silent this long is DEAD.
inline constexpr int kDefaultHeartbeatTtlMs = 3000;
// How long a connection may go without a sign of its peer before it ends: the heartbeat TTL
// this process was told (TROUPE_HEARTBEAT_TTL_MS, 300..600000), else kDefaultHeartbeatTtlMs.
std::chrono::milliseconds peerSilenceLimit();
// Sets it once this process learns the cluster's TTL (a joining agent, from the controller);
// connections made from then on use it. Any thread.
void setPeerSilenceLimit(std::chrono::milliseconds ttl);
// Tunes a TCP connection so that a peer whose host went silent (cut off, frozen) ends it within
// peerSilenceLimit() + 1 s, whether data is in flight or the connection waits for an answer:
// keepalive probes from peerSilenceLimit() - 1 s of silence, one a second, and
// TCP_USER_TIMEOUT = peerSilenceLimit(). Called beside handshake::setNoDelay on every RPC and
// gateway connection, both sides; a no-op on non-TCP streams. Any thread (the stream's own).
void detectSilentPeer(kj::AsyncIoStream& stream);

// Keeps the memory of freed buffers up to 32 MiB mapped for the next message (glibc's
// mallopt; up to 256 MiB of it in all) instead of returning it to the kernel at once. A 16 MB
// argument or result otherwise costs a fresh mapping each time, whose page faults took four
// times the copying itself here. Called by workers, drivers (ClusterClient::connect) and the
// Python module; idempotent.
void keepMessageBuffers();

// The error model at the RPC edge: a Status travels as a KJ exception whose description starts
// with its code in brackets ("[NOT_FOUND] no actor named 'x'"), which Cap'n Proto carries to
// the caller intact. statusFromException reads the code back (never guessing from the text);
// an exception without one (a broken connection, KJ's own) maps from its KJ type.
// FAILED unless `type` says otherwise (DISCONNECTED: the connection itself was refused or lost).
kj::Exception exceptionFromStatus(const Status& status, kj::Exception::Type type = kj::Exception::Type::FAILED);
// Turns a KJ exception from an RPC into a Status with a readable message (`what: message`).
Status statusFromException(const kj::Exception& e, const std::string& what);

}  // namespace troupe

namespace troupe {
// Throws `status` as a KJ exception at an RPC edge (exceptionFromStatus).
[[noreturn]] void throwStatus(const Status& status);
}  // namespace troupe
