#include "troupe/runtime/handshake.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <array>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>
#include <kj/debug.h>

#include "troupe/runtime/logging.h"
#include "troupe/runtime/process.h"
#include "troupe/runtime/rpc.h"

namespace troupe::handshake {
namespace {

constexpr kj::byte kMagic[4] = {'T', 'R', 'P', 'E'};
constexpr kj::byte kVersion = 3;  // 3: the proofs cover the transport (TLS or plaintext)
constexpr size_t kNonce = 32;
constexpr size_t kMac = 32;
constexpr size_t kHello = 6 + kNonce;
constexpr kj::byte kAccepted = 'Y';
constexpr kj::byte kRejected = 'N';
constexpr kj::byte kSpeakTls = 'S';
constexpr kj::byte kTlsRecord = 0x16;  // the first byte of a TLS ClientHello
constexpr auto kHandshakeTimeout = 5 * kj::SECONDS;
// The server's proof did not match: from here a wrong token and a stranger look alike.
constexpr const char* kNotShared =
    "the cluster token was rejected: the server proved a different token (wrong --token, not this cluster's "
    "server, or a relay between us changed the connection, e.g. stripped TLS)";

using Nonce = std::array<kj::byte, kNonce>;
using Mac = std::array<kj::byte, kMac>;

Nonce freshNonce() {
  Nonce n;
  KJ_REQUIRE(RAND_bytes(n.data(), static_cast<int>(n.size())) == 1, "the system's random source failed");
  return n;
}

// HMAC-SHA256(token, role | purpose | transport | client nonce | server nonce). The transport is
// each side's own view of its stream: a relay that speaks TLS to the server and plaintext to the
// client (a downgrade) leaves the two views different, so neither proof verifies.
Mac proof(const std::string& token, const char* role, Purpose purpose, Transport transport, const kj::byte* cn,
          const kj::byte* sn) {
  std::string message = role;
  message.push_back(static_cast<char>(purpose));
  message.push_back(static_cast<char>(transport));
  message.append(reinterpret_cast<const char*>(cn), kNonce);
  message.append(reinterpret_cast<const char*>(sn), kNonce);
  Mac mac;
  unsigned int size = 0;
  KJ_REQUIRE(HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()),
                  reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac.data(), &size) != nullptr &&
                 size == kMac,
             "HMAC-SHA256 failed");
  return mac;
}

bool same(const kj::byte* a, const Mac& b) { return CRYPTO_memcmp(a, b.data(), kMac) == 0; }

// A refusal carries its code (UNAUTHENTICATED, or FAILED_PRECONDITION for kTlsRequired) for the
// caller to act on; DISCONNECTED because the connection is gone.
constexpr const char* kClosedUnanswered =
    "the server closed the connection before answering (too many handshakes from this host at once, or it is "
    "stopping)";

kj::Exception refusedBy(StatusCode code, const char* why) {
  return exceptionFromStatus(Status(code, why), kj::Exception::Type::DISCONNECTED);
}

}  // namespace

Result<kj::Own<kj::ConnectionReceiver>> listen(kj::AsyncIoContext& io, const HostPort& bind) {
  kj::Own<kj::ConnectionReceiver> listener;
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
    auto addr = io.provider->getNetwork().parseAddress(bind.host, bind.port).wait(io.waitScope);
    listener = addr->listen();
  })) {
    // KJ's exception carries bind's errno only as text: bind again to learn it.
    auto why = checkBindable(bind.host, bind.port);
    if (why.code() == StatusCode::kAlreadyExists) {
      return Status(StatusCode::kAlreadyExists,
                    fmt::format("port {} on {} is already in use; pass another --port or stop the process using it",
                                bind.port, bind.host));
    }
    if (!why.isOk()) return why;
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("cannot listen on {}: {}", bind.toString(), e->getDescription().cStr()));
  }
  return listener;
}

void setNoDelay(kj::AsyncIoStream& stream) {
  int one = 1;
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() { stream.setsockopt(IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)); })) {
    (void)e;  // not a TCP stream (tests may use pipes): nothing to tune
  }
}

kj::Promise<bool> accept(kj::AsyncIoStream& stream, const std::string& token, Purpose purpose, Transport transport) {
  auto hello = kj::heapArray<kj::byte>(kHello);
  auto* h = hello.begin();
  // The fixed part first, so a stranger speaking another protocol is refused at once.
  return stream.read(h, 6).then([&stream, &token, purpose, transport,
                                 hello = kj::mv(hello)]() mutable -> kj::Promise<bool> {
    if (memcmp(hello.begin(), kMagic, 4) != 0 || hello[4] != kVersion || hello[5] != static_cast<kj::byte>(purpose)) {
      return stream.write(&kRejected, 1).then([]() { return false; });
    }
    auto* cnAt = hello.begin() + 6;
    return stream.read(cnAt, kNonce).then([&stream, &token, purpose, transport, hello = kj::mv(hello)]() {
      Nonce sn = freshNonce();
      Mac serverMac = proof(token, "troupe-server", purpose, transport, hello.begin() + 6, sn.data());
      Mac expected = proof(token, "troupe-client", purpose, transport, hello.begin() + 6, sn.data());
      auto reply = kj::heapArray<kj::byte>(kNonce + kMac);
      memcpy(reply.begin(), sn.data(), kNonce);
      memcpy(reply.begin() + kNonce, serverMac.data(), kMac);
      auto* r = reply.begin();
      return stream.write(r, reply.size()).attach(kj::mv(reply)).then([&stream, expected]() {
        auto answer = kj::heapArray<kj::byte>(kMac);
        auto* a = answer.begin();
        return stream.read(a, kMac).then([&stream, expected, answer = kj::mv(answer)]() {
          bool ok = same(answer.begin(), expected);
          return stream.write(ok ? &kAccepted : &kRejected, 1).then([ok]() { return ok; });
        });
      });
    });
  });
}

// The peer's address without its port ("?" if unknown), as per-source limits count it.
std::string peerHost(kj::AsyncIoStream& stream) {
  sockaddr_storage addr{};
  uint length = sizeof addr;
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() { stream.getpeername(reinterpret_cast<sockaddr*>(&addr), &length); })) {
    return "?";
  }
  char text[INET6_ADDRSTRLEN] = "?";
  if (addr.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&addr)->sin_addr, text, sizeof text);
  } else if (addr.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&addr)->sin6_addr, text, sizeof text);
  }
  return text;
}

Acceptor::Acceptor(kj::AsyncIoContext& io, kj::Own<kj::ConnectionReceiver> listener, std::string token,
                   Purpose purpose, std::string what, Serve serve)
    : io_(io), listener_(kj::mv(listener)), port_(static_cast<int>(listener_->getPort())), token_(kj::mv(token)),
      purpose_(purpose), what_(kj::mv(what)), serve_(kj::mv(serve)), tasks_(*this) {
  if (tls::required()) tls_ = kj::heap<tls::Streams>(token_);
  tasks_.add(acceptLoop());
}

Acceptor::~Acceptor() noexcept(false) = default;

kj::Promise<void> Acceptor::acceptLoop() {
  // accept() may throw at once (EMFILE when a descriptor is at hand): that must reach the
  // handler below too, or the loop would end.
  return kj::evalNow([this]() { return listener_->accept(); }).then(
      [this](kj::Own<kj::AsyncIoStream> stream) {
        setNoDelay(*stream);
        detectSilentPeer(*stream);
        std::string source = peerHost(*stream);
        if (pending_[source] >= kMaxPendingPerSource) {
          noteRefused(fmt::format("closed a connection from {}: it already has {} connections in the handshake",
                                  source, kMaxPendingPerSource));
        } else {
          ++pending_[source];
          tasks_.add(admit(kj::mv(stream), source));
        }
        return acceptLoop();
      },
      [this](kj::Exception&& e) -> kj::Promise<void> {
        // Out of descriptors, or a transient error: serving stops only with this object.
        auto now = std::chrono::steady_clock::now();
        if (now - lastAcceptFailureLog_ >= std::chrono::seconds(10)) {
          TROUPE_LOG(kWarning, "{}: accept failed ({}); retrying every 100 ms", what_, e.getDescription().cStr());
          lastAcceptFailureLog_ = now;
        }
        return io_.provider->getTimer().afterDelay(100 * kj::MILLISECONDS).then([this]() { return acceptLoop(); });
      });
}

kj::Promise<void> Acceptor::admit(kj::Own<kj::AsyncIoStream> stream, std::string source) {
  // The source's handshake slot: given back when the handshake ends, however it ends.
  struct Slot {
    Slot(std::map<std::string, int>& p, std::string s) : pending(p), source(std::move(s)) {}
    Slot(const Slot&) = delete;
    std::map<std::string, int>& pending;
    std::string source;
    bool held = true;
    void release() {
      if (held && --pending[source] <= 0) pending.erase(source);
      held = false;
    }
    ~Slot() { release(); }
  };
  auto slot = kj::heap<Slot>(pending_, source);
  auto* held = slot.get();
  return io_.provider->getTimer()
      .timeoutAfter(kHandshakeTimeout, acceptStream(kj::mv(stream), token_, purpose_, tls_.get()))
      .then(
          [this, source, held](kj::Maybe<kj::Own<kj::AsyncIoStream>> served) -> kj::Promise<void> {
            held->release();  // authenticated or refused, it no longer counts against its source
            KJ_IF_MAYBE(s, served) { return serve_(kj::mv(*s)); }
            noteRefused(fmt::format("refused a connection from {} that could not prove the cluster token{}", source,
                                    tls_ ? " or did not speak TLS" : ""));
            return kj::READY_NOW;
          },
          [this, source](kj::Exception&& e) -> kj::Promise<void> {
            // Timed out or the peer closed mid-handshake: the stream is dropped (closed).
            noteRefused(fmt::format("closed a connection from {} that did not complete the token handshake: {}",
                                    source, e.getDescription().cStr()));
            return kj::READY_NOW;
          })
      .attach(kj::mv(slot));
}

void Acceptor::noteRefused(const std::string& why) {
  ++refused_;
  constexpr uint64_t kLogFirst = 5;
  constexpr auto kInterval = std::chrono::seconds(10);
  auto now = std::chrono::steady_clock::now();
  if (refused_ <= kLogFirst) {
    TROUPE_LOG(kWarning, "{}: {}", what_, why);
    lastRefusalLog_ = now;
    return;
  }
  ++unloggedRefusals_;
  if (now - lastRefusalLog_ >= kInterval) {
    TROUPE_LOG(kWarning, "{}: refused {} more connections in the last {} s (latest: {})", what_, unloggedRefusals_,
               std::chrono::duration_cast<std::chrono::seconds>(now - lastRefusalLog_).count(), why);
    unloggedRefusals_ = 0;
    lastRefusalLog_ = now;
  }
}

void Acceptor::taskFailed(kj::Exception&& e) {
  if (e.getType() != kj::Exception::Type::DISCONNECTED) {
    TROUPE_LOG(kWarning, "{}: a connection ended with an error: {}", what_, e.getDescription().cStr());
  }
}

kj::Promise<void> connect(kj::AsyncIoStream& stream, const std::string& token, Purpose purpose, Transport transport) {
  auto hello = kj::heapArray<kj::byte>(kHello);
  memcpy(hello.begin(), kMagic, 4);
  hello[4] = kVersion;
  hello[5] = static_cast<kj::byte>(purpose);
  Nonce cn = freshNonce();
  memcpy(hello.begin() + 6, cn.data(), kNonce);
  auto* h = hello.begin();
  return stream.write(h, kHello).attach(kj::mv(hello)).then([&stream, &token, purpose, transport, cn]() {
    // A server that refuses the hello answers 'N' and closes: the read comes up short.
    auto reply = kj::heapArray<kj::byte>(kNonce + kMac);
    auto* r = reply.begin();
    // evalNow: a read of a socket the server already reset throws at once, not in the promise.
    return kj::evalNow([&stream, r]() { return stream.tryRead(r, kNonce + kMac, kNonce + kMac); })
        .catch_([](kj::Exception&&) -> size_t { return 0; })  // reset before any answer: as a close
        .then([&stream, &token, purpose, transport, cn,
               reply = kj::mv(reply)](size_t got) mutable -> kj::Promise<void> {
          if (got == 1 && reply[0] == kSpeakTls) return refusedBy(StatusCode::kFailedPrecondition, kTlsRequired);
          // Closed unanswered: the server had kMaxPendingPerSource handshakes from this host under
          // way (or is stopping). RpcClient::connect asks again.
          if (got == 0) return refusedBy(StatusCode::kResourceExhausted, kClosedUnanswered);
          if (got != kNonce + kMac) return refusedBy(StatusCode::kUnauthenticated, "the cluster token was rejected");
          if (!same(reply.begin() + kNonce, proof(token, "troupe-server", purpose, transport, cn.data(), reply.begin()))) {
            return refusedBy(StatusCode::kUnauthenticated, kNotShared);
          }
          auto answer = kj::heapArray<kj::byte>(kMac + 1);
          Mac clientMac = proof(token, "troupe-client", purpose, transport, cn.data(), reply.begin());
          memcpy(answer.begin(), clientMac.data(), kMac);
          auto* a = answer.begin();
          return stream.write(a, kMac).then([&stream, answer = kj::mv(answer)]() mutable {
            auto* v = answer.begin() + kMac;
            return stream.tryRead(v, 1, 1).then([answer = kj::mv(answer)](size_t n) -> kj::Promise<void> {
              if (n != 1 || answer[kMac] != kAccepted) {
                return refusedBy(StatusCode::kUnauthenticated, "the cluster token was rejected");
              }
              return kj::READY_NOW;
            });
          });
        });
  });
}

kj::Promise<kj::Maybe<kj::Own<kj::AsyncIoStream>>> acceptStream(kj::Own<kj::AsyncIoStream> stream,
                                                                 const std::string& token, Purpose purpose,
                                                                 tls::Streams* tls) {
  using Served = kj::Maybe<kj::Own<kj::AsyncIoStream>>;
  auto first = kj::heapArray<kj::byte>(1);
  auto* f = first.begin();
  auto& s = *stream;
  return s.read(f, 1).then([stream = kj::mv(stream), first = kj::mv(first), &token, purpose,
                            tls]() mutable -> kj::Promise<Served> {
    bool hello = first[0] == kTlsRecord;
    if (!hello && tls != nullptr) {
      // Read the rest of the plaintext hello first: closing with unread bytes would reset the
      // connection, and the client might never see the answer.
      auto rest = kj::heapArray<kj::byte>(kHello - 1);
      auto& s = *stream;
      auto* r = rest.begin();
      return s.tryRead(r, rest.size(), rest.size())
          .then([&s](size_t) { return s.write(&kSpeakTls, 1); })
          .attach(kj::mv(stream), kj::mv(rest))
          .then([]() { return Served(nullptr); });
    }
    if (hello && tls == nullptr) return Served(nullptr);  // a TLS client of a plaintext cluster
    auto whole = tls::prefixed(kj::mv(stream), kj::mv(first));
    auto secured = hello ? tls->server(kj::mv(whole)) : kj::Promise<kj::Own<kj::AsyncIoStream>>(kj::mv(whole));
    Transport transport = hello ? Transport::kTls : Transport::kPlain;
    return secured.then([&token, purpose, transport](kj::Own<kj::AsyncIoStream> ready) {
      auto& r = *ready;
      return accept(r, token, purpose, transport).then([ready = kj::mv(ready)](bool ok) mutable {
        return ok ? Served(kj::mv(ready)) : Served(nullptr);
      });
    });
  });
}

kj::Promise<kj::Own<kj::AsyncIoStream>> connectStream(kj::Own<kj::AsyncIoStream> stream, const std::string& token,
                                                      Purpose purpose, tls::Streams* tls) {
  auto secured = tls ? tls->client(kj::mv(stream)) : kj::Promise<kj::Own<kj::AsyncIoStream>>(kj::mv(stream));
  Transport transport = tls ? Transport::kTls : Transport::kPlain;
  return secured.then([&token, purpose, transport](kj::Own<kj::AsyncIoStream> ready) {
    auto& r = *ready;
    return connect(r, token, purpose, transport).then([ready = kj::mv(ready)]() mutable { return kj::mv(ready); });
  });
}

namespace {

// Reads or writes exactly `size` bytes before `deadline`.
Status transfer(int fd, kj::byte* data, size_t size, bool write, std::chrono::steady_clock::time_point deadline) {
  size_t done = 0;
  while (done < size) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return Status(StatusCode::kUnavailable, "no answer during the handshake in time");
    pollfd p{fd, static_cast<short>(write ? POLLOUT : POLLIN), 0};
    int ready = ::poll(&p, 1, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return Status(StatusCode::kUnavailable, "no answer during the handshake in time");
    ssize_t n = write ? ::send(fd, data + done, size - done, MSG_NOSIGNAL) : ::recv(fd, data + done, size - done, 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) {
      return Status(StatusCode::kUnavailable, n == 0 ? std::string("the server closed the connection during the handshake")
                                                     : fmt::format("handshake I/O failed: {}", strerror(errno)));
    }
    done += static_cast<size_t>(n);
  }
  return Status::ok();
}

}  // namespace

Status connectBlocking(int fd, const std::string& token, Purpose purpose, Transport transport,
                       std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  std::array<kj::byte, kHello> hello;
  memcpy(hello.data(), kMagic, 4);
  hello[4] = kVersion;
  hello[5] = static_cast<kj::byte>(purpose);
  Nonce cn = freshNonce();
  memcpy(hello.data() + 6, cn.data(), kNonce);
  TROUPE_RETURN_IF_ERROR(transfer(fd, hello.data(), hello.size(), true, deadline));
  std::array<kj::byte, kNonce + kMac> reply;
  if (auto s = transfer(fd, reply.data(), 1, false, deadline); !s.isOk()) {
    return Status(StatusCode::kUnauthenticated, "the cluster token was rejected");
  }
  if (auto s = transfer(fd, reply.data() + 1, reply.size() - 1, false, deadline); !s.isOk()) {
    // 'S' alone, then the close, asks for TLS; a server nonce may begin with 'S' too (1 in 256).
    if (reply[0] == kSpeakTls) return Status(StatusCode::kFailedPrecondition, kTlsRequired);
    return Status(StatusCode::kUnauthenticated, "the cluster token was rejected");
  }
  if (!same(reply.data() + kNonce, proof(token, "troupe-server", purpose, transport, cn.data(), reply.data()))) {
    return Status(StatusCode::kUnauthenticated, kNotShared);
  }
  Mac clientMac = proof(token, "troupe-client", purpose, transport, cn.data(), reply.data());
  TROUPE_RETURN_IF_ERROR(transfer(fd, clientMac.data(), kMac, true, deadline));
  kj::byte verdict = 0;
  if (!transfer(fd, &verdict, 1, false, deadline).isOk() || verdict != kAccepted) {
    return Status(StatusCode::kUnauthenticated, "the cluster token was rejected");
  }
  return Status::ok();
}

}  // namespace troupe::handshake
