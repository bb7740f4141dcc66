// Rendezvous: publish, wait for every rank, connect the mesh. Plain POSIX sockets with poll()
// and a deadline on every step; the communicator hands the finished sockets to Asio.
//
// Who connects: each rank connects to every lower rank (data, then control) and then accepts
// from every higher rank. A rank waits only on lower ranks' acks, so there is no cycle.
// Every connection starts with a Hello carrying the acceptor's nonce from the store: only a
// process that read this (group, epoch) from the password-protected store can join, and a stale
// address reused by another process is refused instead of silently joined.
#include "rendezvous.h"
#include "shm_transport.h"
#include "wire.h"

#include "troupe/runtime/tls.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <set>
#include <thread>

#include <fmt/format.h>

#include "troupe/runtime/clock.h"
#include "troupe/runtime/cluster_store.h"
#include "troupe/runtime/ids.h"
#include "troupe/runtime/logging.h"

namespace troupe::collectives {

Fd& Fd::operator=(Fd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.release();
  }
  return *this;
}

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

std::string recreateAdvice(const CommunicatorOptions& options) {
  return fmt::format("the communicator of group '{}' epoch {} is unusable: recreate it at epoch {}",
                     options.group, options.epoch, options.epoch + 1);
}

namespace {


constexpr uint32_t kHelloMagic = 0x43505254;  // "TRPC" on the wire (little-endian)
constexpr uint16_t kHelloVersion = 1;
constexpr uint8_t kAck = 'Y';

enum class ConnectionKind : uint8_t { kData = 1, kControl = 2 };

struct Hello {
  uint32_t magic = kHelloMagic;
  uint16_t version = kHelloVersion;
  uint8_t kind = 0;
  uint8_t unused = 0;
  int32_t rank = 0;
  int32_t worldSize = 0;
  int64_t epoch = 0;
  char nonce[kNonceChars] = {};
};
static_assert(sizeof(Hello) == 56);

std::string peerName(int rank, const Entry& entry) {
  return fmt::format("rank {} (pid {} on {}, {}:{})", rank, entry.pid, entry.hostname, entry.host,
                     entry.port);
}

int millisLeft(Clock::time_point deadline) {
  auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 60'000));
}

std::string errnoText(int err) { return std::strerror(err); }

Status setNonBlocking(int fd) {
  int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    return Status(StatusCode::kInternal, fmt::format("fcntl(O_NONBLOCK): {}", errnoText(errno)));
  }
  return Status::ok();
}

// Resolves host:port (numeric or a name) to the first address.
Result<sockaddr_storage> resolve(const std::string& host, int port, socklen_t& length) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (rc != 0 || found == nullptr) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("cannot resolve '{}': {}", host, gai_strerror(rc)));
  }
  sockaddr_storage address{};
  std::memcpy(&address, found->ai_addr, found->ai_addrlen);
  length = found->ai_addrlen;
  ::freeaddrinfo(found);
  return address;
}

Status sendAll(int fd, const void* data, size_t size, Clock::time_point deadline) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    if (n > 0) {
      p += n;
      size -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd pfd{fd, POLLOUT, 0};
      if (::poll(&pfd, 1, millisLeft(deadline)) == 0) {
        return Status(StatusCode::kDeadlineExceeded, "send timed out");
      }
      continue;
    }
    return Status(StatusCode::kUnavailable, fmt::format("send: {}", errnoText(errno)));
  }
  return Status::ok();
}

Status recvAll(int fd, void* data, size_t size, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    ssize_t n = ::recv(fd, p, size, 0);
    if (n > 0) {
      p += n;
      size -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return Status(StatusCode::kUnavailable, "connection closed by the peer");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      pollfd pfd{fd, POLLIN, 0};
      int ready = ::poll(&pfd, 1, millisLeft(deadline));
      if (ready == 0 || Clock::now() >= deadline) {
        return Status(StatusCode::kDeadlineExceeded, "no reply in time");
      }
      continue;
    }
    return Status(StatusCode::kUnavailable, fmt::format("recv: {}", errnoText(errno)));
  }
  return Status::ok();
}

void tuneSocket(int fd, ConnectionKind kind) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  // Socket buffers stay auto-tuned: fixed sizes (1 or 4 MB) measured slower on loopback.
  if (kind == ConnectionKind::kControl) {
    // A peer host that vanishes without a reset is noticed in about 5 s even when nothing is
    // being sent; a peer process that dies is noticed at once (its kernel resets the socket).
    int idle = 2, interval = 1, count = 3;
    ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
  }
}

// Listens on host:0; returns the socket and the port it got.
Result<std::pair<Fd, int>> listenOn(const std::string& host) {
  socklen_t length = 0;
  auto address = resolve(host, 0, length);
  if (!address) return address.status();
  Fd fd(::socket(address->ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return Status(StatusCode::kInternal, fmt::format("socket: {}", errnoText(errno)));
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&*address), length) != 0 ||
      ::listen(fd.get(), 128) != 0) {
    return Status(StatusCode::kUnavailable,
                  fmt::format("cannot listen on {}: {}", host, errnoText(errno)));
  }
  sockaddr_storage bound{};
  socklen_t boundLength = sizeof(bound);
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &boundLength);
  int port = bound.ss_family == AF_INET6
                 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                 : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  TROUPE_RETURN_IF_ERROR(setNonBlocking(fd.get()));
  return std::make_pair(std::move(fd), port);
}

// Connects to `entry`, says hello as (rank, kind) and waits for the ack.
Result<Fd> connectTo(const Entry& entry, const CommunicatorOptions& options, ConnectionKind kind,
                     Clock::time_point deadline) {
  socklen_t length = 0;
  auto address = resolve(entry.host, entry.port, length);
  if (!address) return address.status();
  Fd fd(::socket(address->ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return Status(StatusCode::kInternal, fmt::format("socket: {}", errnoText(errno)));
  TROUPE_RETURN_IF_ERROR(setNonBlocking(fd.get()));
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&*address), length) != 0) {
    if (errno != EINPROGRESS) {
      return Status(StatusCode::kUnavailable, fmt::format("connect: {}", errnoText(errno)));
    }
    pollfd pfd{fd.get(), POLLOUT, 0};
    if (::poll(&pfd, 1, millisLeft(deadline)) <= 0) {
      return Status(StatusCode::kDeadlineExceeded, "connect timed out");
    }
    int err = 0;
    socklen_t errLength = sizeof(err);
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &errLength);
    if (err != 0) return Status(StatusCode::kUnavailable, fmt::format("connect: {}", errnoText(err)));
  }
  tuneSocket(fd.get(), kind);
  if (!options.tlsToken.empty()) {
    // TLS on a relay thread; the communicator keeps using a plain (socketpair) descriptor.
    TROUPE_ASSIGN_OR_RETURN(auto plain, tls::relay(fd.release(), options.tlsToken, false, std::chrono::milliseconds(millisLeft(deadline))));
    fd = Fd(plain);
    TROUPE_RETURN_IF_ERROR(setNonBlocking(fd.get()));
  }
  Hello hello;
  hello.kind = static_cast<uint8_t>(kind);
  hello.rank = options.rank;
  hello.worldSize = options.worldSize;
  hello.epoch = options.epoch;
  std::memcpy(hello.nonce, entry.nonce.data(), kNonceChars);
  TROUPE_RETURN_IF_ERROR(sendAll(fd.get(), &hello, sizeof(hello), deadline));
  uint8_t ack = 0;
  TROUPE_RETURN_IF_ERROR(recvAll(fd.get(), &ack, 1, deadline));
  if (ack != kAck) return Status(StatusCode::kUnavailable, "the peer refused the hello");
  return fd;
}

// Reads every rank's entry, waiting until all are there.
Result<std::vector<Entry>> waitForEntries(RendezvousStore& store, GroupEpochWatch& watch,
                                          const CommunicatorOptions& options,
                                          Clock::time_point deadline) {
  auto pause = std::chrono::milliseconds(1);
  for (;;) {
    auto raw = store.getRendezvous(options.group, options.epoch);
    if (!raw) return raw.status();
    std::vector<Entry> entries(options.worldSize);
    std::vector<int> missing;
    for (int r = 0; r < options.worldSize; ++r) {
      auto it = raw->find(r);
      std::optional<Entry> entry;
      if (it != raw->end()) entry = decodeEntry(it->second);
      if (entry) {
        entries[r] = std::move(*entry);
      } else {
        missing.push_back(r);
      }
    }
    if (missing.empty()) return entries;
    if (Clock::now() >= deadline) {
      return Status(StatusCode::kDeadlineExceeded,
                    fmt::format("rendezvous of group '{}' epoch {}: rank(s) {} did not publish "
                                "an address within {} ms; are all {} ranks started with this "
                                "group and epoch?",
                                options.group, options.epoch, fmt::join(missing, ", "),
                                options.rendezvousTimeout.count(), options.worldSize));
    }
    // Polling the store for the condition (every rank published), with a deadline; the pause
    // between polls is spent waiting on the epoch watch, since an advance ends this epoch and
    // the ranks we wait for would never come.
    auto advanced = watch.next(pause);
    if (advanced.isOk() && advanced->has_value() && **advanced > options.epoch) {
      return Status(StatusCode::kAborted,
                    fmt::format("group '{}' advanced to epoch {} while rank {} waited for the "
                                "rendezvous of epoch {}; join epoch {}",
                                options.group, **advanced, options.rank, options.epoch,
                                **advanced));
    }
    pause = std::min(pause * 2, std::chrono::milliseconds(20));
  }
}

}  // namespace

Status sendAllBefore(int fd, const void* data, size_t size, std::chrono::steady_clock::time_point deadline) {
  return sendAll(fd, data, size, deadline);
}

Status recvAllBefore(int fd, void* data, size_t size, std::chrono::steady_clock::time_point deadline) {
  return recvAll(fd, data, size, deadline);
}

Result<RendezvousResult> rendezvous(RendezvousStore& store, const CommunicatorOptions& options,
                                    bool connectMesh, const std::string& extra,
                                    std::vector<std::string>* extras) {
  if (options.group.empty()) return Status(StatusCode::kInvalidArgument, "empty group name");
  if (options.epoch < 0 || options.worldSize < 1 || options.rank < 0 ||
      options.rank >= options.worldSize) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("group '{}': bad epoch {} / rank {} / world size {}: need epoch "
                              ">= 0 and 0 <= rank < world size",
                              options.group, options.epoch, options.rank, options.worldSize));
  }
  if (options.rendezvousTimeout.count() <= 0 || options.operationTimeout.count() <= 0) {
    return Status(StatusCode::kInvalidArgument, "timeouts must be positive");
  }
  const auto deadline = Clock::now() + options.rendezvousTimeout;

  RendezvousResult result;
  auto watch = store.watchGroupEpoch(options.group);
  if (!watch) return watch.status();
  result.watch = std::move(watch).value();
  auto current = store.advanceGroupEpoch(options.group, options.epoch);
  if (!current) return current.status();
  if (*current > options.epoch) {
    return Status(StatusCode::kAborted,
                  fmt::format("group '{}' is already at epoch {}: epoch {} is over; join epoch {}",
                              options.group, *current, options.epoch, *current));
  }

  Fd listener;
  Entry self;
  self.host = options.host;
  self.pid = ::getpid();
  char hostname[256] = {};
  ::gethostname(hostname, sizeof(hostname) - 1);
  self.hostname = hostname;
  self.nonce = randomHex(kNonceChars / 2);
  self.hostId = localHostIdentity();
  self.extra = extra;
  if (connectMesh && options.worldSize > 1) {
    auto listening = listenOn(options.host);
    if (!listening) return listening.status();
    listener = std::move(listening->first);
    self.port = listening->second;
  }
  // Entries outlive the rendezvous a little (a slow rank may still read them), then expire.
  const auto ttl = std::max<std::chrono::milliseconds>(std::chrono::minutes(10),
                                                      2 * options.rendezvousTimeout);
  TROUPE_RETURN_IF_ERROR(store.putRendezvousEntry(options.group, options.epoch, options.rank,
                                                  encodeEntry(self), ttl));

  auto entries = waitForEntries(store, *result.watch, options, deadline);
  if (!entries) return entries.status();
  if (extras != nullptr) {
    extras->clear();
    for (const Entry& entry : *entries) extras->push_back(entry.extra);
  }
  result.peers.resize(options.worldSize);
  for (int r = 0; r < options.worldSize; ++r) {
    result.peers[r].rank = r;
    result.peers[r].name = peerName(r, (*entries)[r]);
    result.peers[r].hostId = (*entries)[r].hostId;
  }
  if (!connectMesh) return result;

  // Connect to every lower rank. A refused or dropped attempt re-reads the rank's entry (it may
  // have restarted at a new address) and tries again until the deadline.
  for (int r = 0; r < options.rank; ++r) {
    for (ConnectionKind kind : {ConnectionKind::kData, ConnectionKind::kControl}) {
      auto pause = std::chrono::milliseconds(1);
      for (;;) {
        auto fd = connectTo((*entries)[r], options, kind, deadline);
        if (fd) {
          (kind == ConnectionKind::kData ? result.peers[r].data : result.peers[r].control) =
              std::move(fd).value();
          break;
        }
        if (Clock::now() >= deadline) {
          return Status(StatusCode::kDeadlineExceeded,
                        fmt::format("rendezvous of group '{}' epoch {}: rank {} could not connect "
                                    "to {} within {} ms: {}",
                                    options.group, options.epoch, options.rank,
                                    result.peers[r].name, options.rendezvousTimeout.count(),
                                    fd.status().message()));
        }
        std::this_thread::sleep_for(pause);  // back-off before the next attempt
        pause = std::min(pause * 2, std::chrono::milliseconds(50));
        if (auto raw = store.getRendezvous(options.group, options.epoch); raw) {
          if (auto it = raw->find(r); it != raw->end()) {
            if (auto entry = decodeEntry(it->second)) (*entries)[r] = std::move(*entry);
          }
        }
      }
    }
  }

  // Accept from every higher rank: a data and a control connection each.
  size_t expected = 2 * static_cast<size_t>(options.worldSize - 1 - options.rank);
  size_t accepted = 0;
  while (accepted < expected) {
    pollfd pfd{listener.get(), POLLIN, 0};
    int ready = ::poll(&pfd, 1, millisLeft(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0 || Clock::now() >= deadline) {
      std::vector<int> missing;
      for (int r = options.rank + 1; r < options.worldSize; ++r) {
        if (!result.peers[r].data || !result.peers[r].control) missing.push_back(r);
      }
      return Status(StatusCode::kDeadlineExceeded,
                    fmt::format("rendezvous of group '{}' epoch {}: rank(s) {} did not connect "
                                "to rank {} within {} ms",
                                options.group, options.epoch, fmt::join(missing, ", "),
                                options.rank, options.rendezvousTimeout.count()));
    }
    Fd fd(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd) continue;
    Hello hello;
    const auto helloDeadline = std::min(deadline, Clock::now() + std::chrono::seconds(5));
    if (!options.tlsToken.empty()) {
      tuneSocket(fd.get(), ConnectionKind::kControl);  // the TCP side; the hello comes through TLS
      auto plain = tls::relay(fd.release(), options.tlsToken, true, std::chrono::milliseconds(millisLeft(helloDeadline)));
      if (!plain.isOk()) {
        TROUPE_LOG(kWarning, "group '{}' epoch {} rank {}: refused a connection: {}", options.group, options.epoch,
                   options.rank, plain.status().message());
        continue;
      }
      fd = Fd(*plain);
      if (!setNonBlocking(fd.get()).isOk()) continue;
    }
    if (!recvAll(fd.get(), &hello, sizeof(hello), helloDeadline).isOk()) continue;
    const bool valid =
        hello.magic == kHelloMagic && hello.version == kHelloVersion &&
        hello.epoch == options.epoch && hello.worldSize == options.worldSize &&
        std::string(hello.nonce, kNonceChars) == self.nonce && hello.rank > options.rank &&
        hello.rank < options.worldSize &&
        (hello.kind == static_cast<uint8_t>(ConnectionKind::kData) ||
         hello.kind == static_cast<uint8_t>(ConnectionKind::kControl));
    if (!valid) {
      TROUPE_LOG(kWarning, "group '{}' epoch {} rank {}: refused a connection with a bad hello "
                 "(rank {}, epoch {}, world size {})", options.group, options.epoch, options.rank,
                 hello.rank, hello.epoch, hello.worldSize);
      continue;
    }
    const auto kind = static_cast<ConnectionKind>(hello.kind);
    Fd& slot = kind == ConnectionKind::kData ? result.peers[hello.rank].data
                                             : result.peers[hello.rank].control;
    if (slot) continue;  // a duplicate: keep the first
    tuneSocket(fd.get(), kind);
    if (!sendAll(fd.get(), &kAck, 1, helloDeadline).isOk()) continue;
    slot = std::move(fd);
    ++accepted;
  }
  return result;
}

}  // namespace troupe::collectives
