#include "troupe/runtime/rpc.h"

#include <netinet/in.h>
#include <netinet/tcp.h>

#include <malloc.h>
#include <sched.h>
#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>

#include <capnp/rpc.h>
#include <kj/debug.h>

#include <fmt/format.h>

#include "forwarding_stream.h"
#include "troupe/runtime/handshake.h"
#include "troupe/runtime/held_buffers.h"
#include "spinning.h"
#include "troupe/runtime/logging.h"

namespace troupe {
namespace {

int64_t monotonicNs() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

// The longest spin of a kSpinFirst connection, in ns (TROUPE_RPC_SPIN_US, default 200 us).
int64_t maxSpinNs() {
  static const int64_t ns = []() -> int64_t {
    const char* env = getenv("TROUPE_RPC_SPIN_US");
    long us = env != nullptr ? atol(env) : 200;
    return std::clamp<long>(us, 0, 100'000) * 1000;
  }();
  return ns;
}

// The spin of one event-loop thread, shared by its kSpinFirst connections. While it runs, the
// thread's WaitScope polls the OS (epoll, timeout 0) every few turns, so every socket, timer and
// cross-thread wake-up of the loop is seen at once; the spin only keeps the loop from sleeping.
struct Spinner {
  int64_t window = maxSpinNs();
  int64_t deadline = 0;
  int64_t missedAt = 0;         // when the last spin ended without a message from a peer
  long preemptions = 0;         // this thread's, when last read
  int64_t busyUntil = 0;        // no spin starts before this: spins found the CPUs busy
  int busyStreak = 0;           // spins in a row that a busy CPU ended before a peer spoke
  bool heard = false;           // a peer's message arrived during this spin
  const void* owner = nullptr;  // the connection whose promise runs the spin, if one does
  uint64_t spins = 0;           // started on this thread, ever (tests read it)
  uint64_t yields = 0;          // by those spins
};
thread_local Spinner tSpinner;
// While spinning, the loop polls the OS after every this many turns: often enough that a spin
// notices an answer within a few microseconds, rarely enough that a busy loop (pipelined calls,
// where the spin keeps being extended) is not slowed by a syscall per turn.
constexpr uint kBusyPollTurns = 3;
// A sched_yield that took longer than this may have run another thread (or the host ran another
// VM: the thread's involuntary context switches tell the two apart).
constexpr int64_t kSlowYieldNs = 20'000;
// A yield that found the CPUs busy gave this thread's CPU to another one until its slice ended
// (milliseconds). Once is a daemon waking up; spins that keep ending so before they hear a peer
// mean the CPUs stay busy, and trying again on every call would cost each call that much: then
// no spin starts for a while, 1 ms after the second such spin, doubling up to 50 ms.
constexpr int64_t kFirstBackoffNs = 1'000'000;
constexpr int64_t kMaxBackoffNs = 50'000'000;

// This thread's involuntary context switches (a sched_yield that ran another thread is one).
long preemptions() {
  rusage usage;
  getrusage(RUSAGE_THREAD, &usage);
  return usage.ru_nivcsw;
}

// Reads the socket in blocks of up to 64 KiB: Cap'n Proto reads each message as a header, then
// the rest, so without it every message costs two or three read calls; with it, usually one,
// and a Finish that arrives with the next Call shares it too. Large reads go straight through.
// With PeerWait::kSpinFirst the loop also spins for the peer's next message before it sleeps.
class BufferedStream final : public ForwardingStream {
 public:
  // `spinScope`: spin first (PeerWait::kSpinFirst), on the loop this scope runs. `held`: the
  // buffers this connection's messages reference (a server's connection), or null.
  BufferedStream(kj::Own<kj::AsyncIoStream> inner, kj::WaitScope* spinScope,
                 std::shared_ptr<HeldBuffers> held = nullptr)
      : ForwardingStream(kj::mv(inner)), buffer_(kj::heapArray<kj::byte>(kSize)),
        spinScope_(spinScope != nullptr && maxSpinNs() > 0 ? spinScope : nullptr), held_(kj::mv(held)) {}
  ~BufferedStream() noexcept(false) {
    if (spinScope_ != nullptr && tSpinner.owner == this) {  // spin_ goes with us
      tSpinner.owner = nullptr;
      spinScope_->setBusyPollInterval(kj::maxValue);
    }
  }

  kj::Promise<size_t> tryRead(void* buffer, size_t minBytes, size_t maxBytes) override {
    auto* out = static_cast<kj::byte*>(buffer);
    size_t n = std::min(maxBytes, end_ - begin_);
    memcpy(out, buffer_.begin() + begin_, n);
    begin_ += n;
    if (n >= minBytes) return n;
    if (maxBytes - n >= kSize) {  // a large body: into its place, no copy
      return inner_->tryRead(out + n, minBytes - n, maxBytes - n).then([n](size_t more) { return n + more; });
    }
    begin_ = end_ = 0;
    return inner_->tryRead(buffer_.begin(), minBytes - n, kSize)
        .then([this, out, n, minBytes, maxBytes](size_t got) -> kj::Promise<size_t> {
          end_ = got;
          spinForNext(/*peerSpoke=*/true);
          return tryRead(out + n, std::min(minBytes - n, got), maxBytes - n).then([n](size_t more) { return n + more; });
        });
  }
  // Writes are not held back to be merged: a worker that runs a long call on this thread would
  // hold back the replies before it.
  kj::Promise<void> write(const void* buffer, size_t size) override {
    spinForNext(/*peerSpoke=*/false);
    return inner_->write(buffer, size);
  }
  kj::Promise<void> write(kj::ArrayPtr<const kj::ArrayPtr<const kj::byte>> pieces) override {
    spinForNext(/*peerSpoke=*/false);
    if (held_ != nullptr && !held_->empty()) {
      auto carried = held_->carriedBy(pieces);
      if (!carried.empty()) return inner_->write(pieces).attach(kj::mv(carried));
    }
    return inner_->write(pieces);
  }

 private:
  // After a message either way the peer's next one is usually close: the caller's answer, or
  // the next call after a Finish. So the loop spins (an evalLast task: it runs only when the loop
  // has nothing else to do, and never delays work) until a window has passed since the last
  // message, polling the OS between turns instead of sleeping in epoll. A spin that heard no
  // peer halves the thread's window (down to 1/8); a message that arrives within a whole window
  // after such a spin makes it whole again (without that, one slow stretch left it too short to
  // catch any answer).
  void spinForNext(bool peerSpoke) {
    if (spinScope_ == nullptr) return;
    Spinner& spinner = tSpinner;
    int64_t now = monotonicNs();
    if (peerSpoke) {
      spinner.heard = true;
      if (now - spinner.missedAt < maxSpinNs()) spinner.window = maxSpinNs();
    }
    spinner.deadline = std::max(spinner.deadline, now + spinner.window);
    if (spinner.owner == nullptr && now >= spinner.busyUntil) {
      spinner.owner = this;
      spinner.heard = false;
      spinner.preemptions = preemptions();
      ++spinner.spins;
      spinScope_->setBusyPollInterval(kBusyPollTurns);
      spin_ = spin().eagerlyEvaluate(nullptr);
    }
  }
  kj::Promise<void> spin() {
    return kj::evalLast([this]() -> kj::Promise<void> {
      Spinner& spinner = tSpinner;
      int64_t now = monotonicNs();
      bool busy = false;
      if (now <= spinner.deadline) {
        sched_yield();  // a runnable thread on this CPU goes first
        ++spinner.yields;
        // If one did, the CPUs are busy: a sleeping thread is then woken without a halted CPU
        // to wake up, and spinning only takes their time. Stop now. A slow yield that switched
        // to no thread was the host's doing (steal): keep spinning, wake-ups still cost a halt.
        if (monotonicNs() - now < kSlowYieldNs) return spin();
        long before = std::exchange(spinner.preemptions, preemptions());
        if (spinner.preemptions == before) return spin();
        spinner.deadline = now;
        spinner.busyStreak = spinner.heard ? 1 : spinner.busyStreak + 1;
        if (spinner.busyStreak >= 2) {
          spinner.busyUntil = now + std::min(kMaxBackoffNs, kFirstBackoffNs << std::min(spinner.busyStreak - 2, 6));
        }
        busy = true;
      }
      if (!busy) spinner.busyStreak = 0;
      if (!spinner.heard && !busy) {  // a miss, not a busy machine
        spinner.window = std::max(spinner.window / 2, maxSpinNs() / 8);
        spinner.missedAt = now;
      }
      spinner.owner = nullptr;
      spinScope_->setBusyPollInterval(kj::maxValue);  // KJ's default: no polls between turns
      return kj::READY_NOW;
    });
  }

  static constexpr size_t kSize = 64 * 1024;
  kj::Array<kj::byte> buffer_;
  size_t begin_ = 0, end_ = 0;  // the unread bytes of buffer_
  kj::WaitScope* spinScope_;          // non-null: spins (PeerWait::kSpinFirst)
  std::shared_ptr<HeldBuffers> held_;  // each goes with the write that carries it
  kj::Promise<void> spin_ = nullptr;  // the thread's spin, while this connection runs it
};

capnp::ReaderOptions readerOptions() {
  capnp::ReaderOptions options;
  options.traversalLimitInWords = kMaxRpcMessageBytes / sizeof(capnp::word);
  return options;
}

// One authenticated connection served by the RPC system (as capnp::TwoPartyServer does, with
// our message size bound).
struct ServedConnection {
  ServedConnection(kj::Own<kj::AsyncIoStream> s, ConnectionBootstrap& bootstrap, kj::WaitScope* spinScope,
                   std::shared_ptr<HeldBuffers> held = std::make_shared<HeldBuffers>())
      : stream(kj::heap<BufferedStream>(kj::mv(s), spinScope, held)),
        network(*stream, capnp::rpc::twoparty::Side::SERVER, readerOptions()),
        rpcSystem(capnp::makeRpcServer(network, bootstrap(held))) {}
  kj::Own<kj::AsyncIoStream> stream;
  capnp::TwoPartyVatNetwork network;
  capnp::RpcSystem<capnp::rpc::twoparty::VatId> rpcSystem;
};

class RpcServerImpl final : public RpcServer, private kj::TaskSet::ErrorHandler {
 public:
  RpcServerImpl(kj::AsyncIoContext& io, kj::Own<kj::ConnectionReceiver> listener, std::string token,
                ConnectionBootstrap bootstrap, PeerWait wait)
      : bootstrap_(kj::mv(bootstrap)), connections_(*this),
        acceptor_(io, kj::mv(listener), kj::mv(token), handshake::Purpose::kRpc, "RPC server",
                  [this, spinScope = wait == PeerWait::kSpinFirst ? &io.waitScope : nullptr](
                      kj::Own<kj::AsyncIoStream> stream) {
                    auto served = kj::heap<ServedConnection>(kj::mv(stream), bootstrap_, spinScope);
                    auto gone = served->network.onDisconnect();
                    connections_.add(gone.attach(kj::mv(served)));
                    return kj::READY_NOW;
                  }) {}

  int port() const override { return acceptor_.port(); }
  uint64_t refusedConnections() const override { return acceptor_.refused(); }

 private:
  void taskFailed(kj::Exception&& e) override {
    TROUPE_LOG(kDebug, "RPC connection ended: {}", e.getDescription().cStr());
  }

  ConnectionBootstrap bootstrap_;
  kj::TaskSet connections_;  // owns the authenticated connections
  handshake::Acceptor acceptor_;
};

// The server's bootstrap capability (as capnp::TwoPartyClient::bootstrap asks for it).
capnp::Capability::Client bootstrapOf(capnp::RpcSystem<capnp::rpc::twoparty::VatId>& rpcSystem) {
  capnp::word scratch[4] = {};
  capnp::MallocMessageBuilder message(scratch);
  auto server = message.getRoot<capnp::rpc::twoparty::VatId>();
  server.setSide(capnp::rpc::twoparty::Side::SERVER);
  return rpcSystem.bootstrap(server);
}

}  // namespace

uint64_t spinsOnThisThread() { return tSpinner.spins; }
uint64_t spinYieldsOnThisThread() { return tSpinner.yields; }

void keepMessageBuffers() {
  static std::once_flag once;
  std::call_once(once, []() {
    mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest allowed value
    mallopt(M_TRIM_THRESHOLD, 256 << 20);
  });
}

Result<kj::Own<RpcServer>> RpcServer::listen(kj::AsyncIoContext& io, const HostPort& bind,
                                             std::string token, capnp::Capability::Client bootstrap,
                                             PeerWait wait) {
  return listen(io, bind, kj::mv(token),
                [bootstrap = kj::mv(bootstrap)](std::shared_ptr<HeldBuffers>) mutable { return bootstrap; }, wait);
}

Result<kj::Own<RpcServer>> RpcServer::listen(kj::AsyncIoContext& io, const HostPort& bind,
                                             std::string token, ConnectionBootstrap bootstrap,
                                             PeerWait wait) {
  TROUPE_ASSIGN_OR_RETURN(auto listener, handshake::listen(io, bind));
  kj::Own<RpcServer> server =
      kj::heap<RpcServerImpl>(io, kj::mv(listener), kj::mv(token), kj::mv(bootstrap), wait);
  return server;
}

// A client's stream that breakConnection() can end: every read and write in flight, and every
// later one, rejects with the reason, so the RPC system drops the connection with it.
class RpcClient::BreakableStream final : public ForwardingStream {
 public:
  using ForwardingStream::ForwardingStream;
  kj::Promise<size_t> tryRead(void* buffer, size_t minBytes, size_t maxBytes) override {
    KJ_IF_MAYBE(e, broken_) { return kj::cp(*e); }
    return canceler_.wrap(inner_->tryRead(buffer, minBytes, maxBytes));
  }
  kj::Promise<void> write(const void* buffer, size_t size) override {
    KJ_IF_MAYBE(e, broken_) { return kj::cp(*e); }
    return canceler_.wrap(inner_->write(buffer, size));
  }
  kj::Promise<void> write(kj::ArrayPtr<const kj::ArrayPtr<const kj::byte>> pieces) override {
    KJ_IF_MAYBE(e, broken_) { return kj::cp(*e); }
    return canceler_.wrap(inner_->write(pieces));
  }
  void breakWith(kj::Exception e) {
    if (broken_ != nullptr) return;
    canceler_.cancel(e);
    broken_ = kj::mv(e);
  }

 private:
  kj::Maybe<kj::Exception> broken_;
  kj::Canceler canceler_;  // declared last: cancels what is wrapped before the stream goes
};

RpcClient::RpcClient(kj::Own<kj::AsyncIoStream> stream, kj::WaitScope* spinScope)
    : breakable_(nullptr),
      stream_([&]() -> kj::Own<kj::AsyncIoStream> {
        auto breakable = kj::heap<BreakableStream>(kj::heap<BufferedStream>(kj::mv(stream), spinScope));
        breakable_ = breakable.get();
        return breakable;
      }()),
      network_(*stream_, capnp::rpc::twoparty::Side::CLIENT, readerOptions()),
      rpcSystem_(capnp::makeRpcClient(network_)),
      bootstrap_(bootstrapOf(rpcSystem_)),
      disconnected_(kj::heap<bool>(false)),
      watch_(network_.onDisconnect()
                 .then([flag = disconnected_.get()]() { *flag = true; },
                       [flag = disconnected_.get()](kj::Exception&&) { *flag = true; })
                 .eagerlyEvaluate(nullptr)) {}

void RpcClient::breakConnection(const Status& why) {
  breakable_->breakWith(exceptionFromStatus(why, kj::Exception::Type::DISCONNECTED));
}

namespace {

// One attempt: TCP, then TLS when `secure`, then the token handshake.
kj::Promise<kj::Own<kj::AsyncIoStream>> connectOnce(kj::AsyncIoContext& io, const HostPort& address,
                                                    std::shared_ptr<const std::string> token, bool secure,
                                                    handshake::Purpose purpose) {
  return io.provider->getNetwork()
      .parseAddress(address.host, address.port)
      .then([](kj::Own<kj::NetworkAddress> addr) { return addr->connect().attach(kj::mv(addr)); })
      .then([token, secure, purpose](kj::Own<kj::AsyncIoStream> stream) {
        handshake::setNoDelay(*stream);
        detectSilentPeer(*stream);
        auto streams = secure ? kj::heap<tls::Streams>(*token) : kj::Own<tls::Streams>();
        auto* tls = streams.get();
        return handshake::connectStream(kj::mv(stream), *token, purpose, tls)
            .then([streams = kj::mv(streams), token](kj::Own<kj::AsyncIoStream> ready) mutable {
              return ready.attach(kj::mv(streams));
            });
      });
}

// connectOnce, asked again while the server closes unanswered (RESOURCE_EXHAUSTED: a burst of
// connections from this host is over its handshake limit), after 5 ms doubling to 200 ms; the
// caller's deadline bounds it.
kj::Promise<kj::Own<kj::AsyncIoStream>> connectPatiently(kj::AsyncIoContext& io, const HostPort& address,
                                                         std::shared_ptr<const std::string> token, bool secure,
                                                         handshake::Purpose purpose,
                                                         kj::Duration delay = 5 * kj::MILLISECONDS) {
  return connectOnce(io, address, token, secure, purpose)
      .catch_([&io, address, token, secure, purpose, delay](kj::Exception&& e) -> kj::Promise<kj::Own<kj::AsyncIoStream>> {
        if (statusFromException(e, "").code() != StatusCode::kResourceExhausted) return kj::mv(e);
        return io.provider->getTimer().afterDelay(delay).then([&io, address, token, secure, purpose, delay]() {
          return connectPatiently(io, address, token, secure, purpose, kj::min(delay * 2, 200 * kj::MILLISECONDS));
        });
      });
}

// The whole client path of an authenticated stream with `purpose`: TLS when the cluster asks
// for it, the deadline, and an error that names the address and says why.
kj::Promise<kj::Own<kj::AsyncIoStream>> connectAuthenticated(kj::AsyncIoContext& io, const HostPort& address,
                                                             std::string token, kj::Duration timeout,
                                                             handshake::Purpose purpose) {
  std::string where = address.toString();
  auto shared = std::make_shared<const std::string>(kj::mv(token));
  auto connected =
      connectPatiently(io, address, shared, tls::required(), purpose)
          .catch_([&io, address, shared, purpose](kj::Exception&& e) -> kj::Promise<kj::Own<kj::AsyncIoStream>> {
            // A --tls cluster said so (the handshake's only FAILED_PRECONDITION): speak TLS from
            // now on in this process.
            if (tls::required() || statusFromException(e, "").code() != StatusCode::kFailedPrecondition) {
              return kj::mv(e);
            }
            tls::require();
            return connectPatiently(io, address, shared, true, purpose);
          });
  auto expired = io.provider->getTimer().afterDelay(timeout).then([]() -> kj::Own<kj::AsyncIoStream> {
    kj::throwFatalException(exceptionFromStatus(Status(StatusCode::kDeadlineExceeded, "no answer in time"),
                                                kj::Exception::Type::DISCONNECTED));
  });
  return connected.exclusiveJoin(kj::mv(expired))
      .catch_([where](kj::Exception&& e) -> kj::Own<kj::AsyncIoStream> {
        // Ours (the handshake's refusals, the deadline) carry their code; KJ's socket and TLS
        // errors have only an OS or OpenSSL text, read here for a shorter reason and no more.
        Status s = statusFromException(e, "");
        std::string reason = s.message();
        StatusCode code = s.code() == StatusCode::kUnauthenticated || s.code() == StatusCode::kDeadlineExceeded
                              ? s.code()
                              : StatusCode::kUnavailable;
        if (code == StatusCode::kUnavailable) {
          if (reason.find("ECONNREFUSED") != std::string::npos || reason.find("refused") != std::string::npos) {
            reason = "connection refused";
          } else if (reason.find("certificate") != std::string::npos || reason.find("TLS") != std::string::npos) {
            reason = "TLS failed (not this cluster's certificate): " + reason;
          }
        }
        kj::throwFatalException(exceptionFromStatus(Status(code, fmt::format("cannot connect to {}: {}", where, reason)),
                                                    kj::Exception::Type::DISCONNECTED));
      });
}

class BulkServerImpl final : public BulkServer, private kj::TaskSet::ErrorHandler {
 public:
  BulkServerImpl(kj::AsyncIoContext& io, kj::Own<kj::ConnectionReceiver> listener, std::string token, std::string what,
                 Serve serve)
      : serve_(kj::mv(serve)), what_(what), connections_(*this),
        acceptor_(io, kj::mv(listener), kj::mv(token), handshake::Purpose::kBulk, what,
                  [this](kj::Own<kj::AsyncIoStream> stream) {
                    connections_.add(serve_(kj::mv(stream)));
                    return kj::READY_NOW;
                  }) {}
  int port() const override { return acceptor_.port(); }

 private:
  void taskFailed(kj::Exception&& e) override {
    TROUPE_LOG(kDebug, "{} connection ended: {}", what_, e.getDescription().cStr());
  }
  Serve serve_;
  std::string what_;
  kj::TaskSet connections_;  // one task per connection, served until it ends
  handshake::Acceptor acceptor_;
};

}  // namespace

kj::Promise<kj::Own<RpcClient>> RpcClient::connect(kj::AsyncIoContext& io, const HostPort& address,
                                                  std::string token, kj::Duration timeout, PeerWait wait) {
  return connectAuthenticated(io, address, kj::mv(token), timeout, handshake::Purpose::kRpc)
      .then([spinScope = wait == PeerWait::kSpinFirst ? &io.waitScope : nullptr](kj::Own<kj::AsyncIoStream> stream) {
        return kj::heap<RpcClient>(kj::mv(stream), spinScope);
      });
}

Result<kj::Own<BulkServer>> BulkServer::listen(kj::AsyncIoContext& io, const HostPort& bind, std::string token,
                                               std::string what, Serve serve) {
  TROUPE_ASSIGN_OR_RETURN(auto listener, handshake::listen(io, bind));
  kj::Own<BulkServer> server = kj::heap<BulkServerImpl>(io, kj::mv(listener), kj::mv(token), kj::mv(what), kj::mv(serve));
  return server;
}

kj::Promise<kj::Own<kj::AsyncIoStream>> connectBulk(kj::AsyncIoContext& io, const HostPort& address, std::string token,
                                                    kj::Duration timeout) {
  return connectAuthenticated(io, address, kj::mv(token), timeout, handshake::Purpose::kBulk);
}

}  // namespace troupe

