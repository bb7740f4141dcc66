// The token handshake in front of Cap'n Proto: a connection without the cluster token gets no
// capability and is closed; a client never talks to a server that cannot prove the token; the
// token itself never crosses the wire.
#include <doctest/doctest.h>

#include <unistd.h>

#include <pthread.h>
#include <sched.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>

#include <fmt/format.h>

#include "troupe.capnp.h"
#include "troupe/runtime/handshake.h"
#include "spinning.h"
#include "troupe/runtime/process.h"
#include "troupe/runtime/rpc.h"

namespace troupe {
namespace {

class PingService final : public rpc::NodeAgent::Server {
 protected:
  kj::Promise<void> ping(PingContext context) override {
    context.getResults().setNodeId("n1");
    context.getResults().setPid(getpid());
    return kj::READY_NOW;
  }
};

// Throws the status whose code number is the requested node id's length (readLogs: any method
// with a Text parameter would do).
class ThrowingService final : public rpc::NodeAgent::Server {
 protected:
  kj::Promise<void> readLogs(ReadLogsContext context) override {
    auto code = static_cast<StatusCode>(context.getParams().getId().size());
    throwStatus(Status(code, fmt::format("failed with {}", statusCodeName(code))));
  }
};

struct Fixture {
  kj::AsyncIoContext io = kj::setupAsyncIo();
  kj::Own<RpcServer> server;
  Fixture() {
    auto s = RpcServer::listen(io, HostPort{"127.0.0.1", 0}, "secret-token",
                               rpc::NodeAgent::Client(kj::heap<PingService>()));
    REQUIRE(s.isOk());
    server = kj::mv(*s);
  }
  HostPort address() const { return HostPort{"127.0.0.1", server->port()}; }
};

TEST_CASE("rpc: a client with the cluster token can call the bootstrap capability") {
  Fixture f;
  auto client = RpcClient::connect(f.io, f.address(), "secret-token", 5 * kj::SECONDS).wait(f.io.waitScope);
  auto reply = client->bootstrap<rpc::NodeAgent>().pingRequest().send().wait(f.io.waitScope);
  CHECK(std::string(reply.getNodeId().cStr()) == "n1");
  CHECK(reply.getPid() == getpid());
  CHECK(f.server->refusedConnections() == 0);
}

TEST_CASE("rpc: a burst of clients from one host all connect (those over the handshake limit ask again)") {
  // 50 Python workers forked at once by a node's zygote connect to the controller together.
  Fixture f;
  constexpr int kClients = 3 * handshake::Acceptor::kMaxPendingPerSource;
  auto connects = kj::heapArrayBuilder<kj::Promise<kj::Own<RpcClient>>>(kClients);
  for (int i = 0; i < kClients; ++i) connects.add(RpcClient::connect(f.io, f.address(), "secret-token", 10 * kj::SECONDS));
  auto clients = kj::joinPromises(connects.finish()).wait(f.io.waitScope);
  for (auto& client : clients) {
    auto reply = client->bootstrap<rpc::NodeAgent>().pingRequest().send().wait(f.io.waitScope);
    CHECK(std::string(reply.getNodeId().cStr()) == "n1");
  }
}

TEST_CASE("rpc: a wrong token is refused before any capability is handed out") {
  Fixture f;
  Status error;
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
    RpcClient::connect(f.io, f.address(), "wrong-token", 5 * kj::SECONDS).wait(f.io.waitScope);
  })) {
    error = statusFromException(*e, "");
    CHECK(e->getType() == kj::Exception::Type::DISCONNECTED);
  }
  // The refusal's kind is its code, not its words.
  CHECK_MESSAGE(error.code() == StatusCode::kUnauthenticated, error.toString());
  CHECK(error.message().find("token was rejected") != std::string::npos);
  // The client hangs up as soon as the server's proof fails; the server sees that next.
  for (int i = 0; i < 400 && f.server->refusedConnections() == 0; ++i) {
    f.io.provider->getTimer().afterDelay(5 * kj::MILLISECONDS).wait(f.io.waitScope);
  }
  CHECK(f.server->refusedConnections() == 1);
}

TEST_CASE("rpc: a server that never answers the handshake fails the connect with DEADLINE_EXCEEDED") {
  kj::AsyncIoContext io = kj::setupAsyncIo();
  // Listening but never accepting: the kernel completes the TCP connection, nobody answers.
  auto listener = io.provider->getNetwork().parseAddress("127.0.0.1", 0).wait(io.waitScope)->listen();
  Status error;
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
    RpcClient::connect(io, HostPort{"127.0.0.1", static_cast<int>(listener->getPort())}, "secret-token", 200 * kj::MILLISECONDS)
        .wait(io.waitScope);
  })) {
    error = statusFromException(*e, "");
  }
  CHECK_MESSAGE(error.code() == StatusCode::kDeadlineExceeded, error.toString());
  CHECK(error.message().find("no answer in time") != std::string::npos);
}

TEST_CASE("rpc: a raw connection speaking Cap'n Proto without the handshake is closed") {
  Fixture f;
  auto addr = f.io.provider->getNetwork().parseAddress("127.0.0.1", f.server->port()).wait(f.io.waitScope);
  auto stream = addr->connect().wait(f.io.waitScope);
  // A Cap'n Proto frame header (one segment of 2 words) followed by zeros: not "TRPE".
  kj::byte frame[24] = {0, 0, 0, 0, 2, 0, 0, 0};
  stream->write(frame, sizeof(frame)).wait(f.io.waitScope);
  kj::byte reply[16];
  size_t n = stream->tryRead(reply, 1, sizeof(reply)).wait(f.io.waitScope);
  REQUIRE(n == 1);
  CHECK(reply[0] == 'N');
  // Then the server closes: end-of-stream, or a reset since our extra bytes were never read.
  size_t more = 0;
  auto closed = kj::runCatchingExceptions([&]() { more = stream->tryRead(reply, 1, sizeof(reply)).wait(f.io.waitScope); });
  KJ_IF_MAYBE(e, closed) { CHECK(e->getType() == kj::Exception::Type::DISCONNECTED); }
  else { CHECK(more == 0); }
  CHECK(f.server->refusedConnections() == 1);
}

TEST_CASE("rpc: a second server on a port in use gets a clear error") {
  Fixture f;
  auto second = RpcServer::listen(f.io, f.address(), "t", rpc::NodeAgent::Client(kj::heap<PingService>()));
  REQUIRE_FALSE(second.isOk());
  CHECK(second.status().code() == StatusCode::kAlreadyExists);
  CHECK(second.status().message().find("already in use") != std::string::npos);
}

}  // namespace
}  // namespace troupe

namespace troupe {
namespace {

// Everything a peer wrote until it closed or sent `limit` bytes.
std::string readAll(kj::AsyncIoStream& stream, kj::WaitScope& ws, size_t limit) {
  std::string out;
  kj::byte buf[256];
  while (out.size() < limit) {
    size_t n = 0;
    if (kj::runCatchingExceptions([&]() { n = stream.tryRead(buf, 1, sizeof(buf)).wait(ws); }) != nullptr || n == 0) break;
    out.append(reinterpret_cast<char*>(buf), n);
  }
  return out;
}

TEST_CASE("rpc: a client refuses a server that cannot prove the cluster token, and sends it nothing secret") {
  kj::AsyncIoContext io = kj::setupAsyncIo();
  // A stranger's server: it knows another token.
  auto stranger = RpcServer::listen(io, HostPort{"127.0.0.1", 0}, "other-token",
                                    rpc::NodeAgent::Client(kj::heap<PingService>()));
  REQUIRE(stranger.isOk());
  std::string error;
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
    RpcClient::connect(io, HostPort{"127.0.0.1", (*stranger)->port()}, "secret-token", 5 * kj::SECONDS)
        .wait(io.waitScope);
  })) {
    error = e->getDescription().cStr();
  }
  CHECK(error.find("proved a different token") != std::string::npos);
}

TEST_CASE("rpc: the token never crosses the wire, and a recorded proof cannot be replayed") {
  kj::AsyncIoContext io = kj::setupAsyncIo();
  // A listener that records what a client sends and answers like a server with the token.
  auto listener = io.provider->getNetwork().parseAddress("127.0.0.1", 0).wait(io.waitScope)->listen();
  auto port = listener->getPort();
  std::string token = "secret-token-0123456789abcdef";
  auto accepted = listener->accept();
  auto client = io.provider->getNetwork().parseAddress("127.0.0.1", port).wait(io.waitScope)->connect();
  auto serverSide = accepted.wait(io.waitScope);
  auto clientSide = client.wait(io.waitScope);
  auto clientDone = handshake::connect(*clientSide, token, handshake::Purpose::kRpc, handshake::Transport::kPlain).fork();
  // Tee the server side: record the client's bytes while a real accept() answers.
  auto ok = handshake::accept(*serverSide, token, handshake::Purpose::kRpc, handshake::Transport::kPlain).wait(io.waitScope);
  CHECK(ok);
  clientDone.addBranch().wait(io.waitScope);

  // Record a fresh exchange's client bytes with a raw reader, then replay them to a server.
  auto l2 = io.provider->getNetwork().parseAddress("127.0.0.1", 0).wait(io.waitScope)->listen();
  auto p2 = l2->getPort();
  auto a2 = l2->accept();
  auto c2 = io.provider->getNetwork().parseAddress("127.0.0.1", p2).wait(io.waitScope)->connect().wait(io.waitScope);
  auto s2 = a2.wait(io.waitScope);
  auto attempt = handshake::connect(*c2, token, handshake::Purpose::kRpc, handshake::Transport::kPlain).then([]() {}, [](kj::Exception&&) {}).eagerlyEvaluate(nullptr);
  kj::byte hello[38];
  s2->read(hello, sizeof(hello)).wait(io.waitScope);
  std::string sent(reinterpret_cast<char*>(hello), sizeof(hello));
  CHECK(sent.find(token) == std::string::npos);
  CHECK(sent.substr(0, 4) == "TRPE");

  // Replaying that hello to a real server gets a new server nonce: an old client proof fails.
  auto server = RpcServer::listen(io, HostPort{"127.0.0.1", 0}, token, rpc::NodeAgent::Client(kj::heap<PingService>()));
  REQUIRE(server.isOk());
  auto replay = io.provider->getNetwork().parseAddress("127.0.0.1", (*server)->port()).wait(io.waitScope)->connect().wait(io.waitScope);
  replay->write(hello, sizeof(hello)).wait(io.waitScope);
  kj::byte challenge[64];
  replay->read(challenge, sizeof(challenge)).wait(io.waitScope);
  kj::byte staleProof[32] = {};  // anything not computed over this server's fresh nonce
  replay->write(staleProof, sizeof(staleProof)).wait(io.waitScope);
  std::string verdict = readAll(*replay, io.waitScope, 8);
  CHECK(verdict == "N");
  CHECK((*server)->refusedConnections() == 1);
}

TEST_CASE("rpc: the blocking client side of the handshake agrees with the server") {
  Fixture f;
  Status ok = Status(StatusCode::kInternal, "unset"), bad = ok;
  std::atomic<bool> done{false};
  std::thread t([&]() {
    auto fd = connectTcp(f.address(), std::chrono::seconds(2));
    if (fd.isOk()) {
      ok = handshake::connectBlocking(*fd, "secret-token", handshake::Purpose::kRpc, handshake::Transport::kPlain, std::chrono::seconds(2));
      ::close(*fd);
    }
    fd = connectTcp(f.address(), std::chrono::seconds(2));
    if (fd.isOk()) {
      bad = handshake::connectBlocking(*fd, "wrong", handshake::Purpose::kRpc, handshake::Transport::kPlain, std::chrono::seconds(2));
      ::close(*fd);
    }
    done = true;
  });
  // The server runs on this thread's loop until the other thread is done.
  while (!done) f.io.provider->getTimer().afterDelay(5 * kj::MILLISECONDS).wait(f.io.waitScope);
  t.join();
  CHECK(ok.isOk());
  CHECK(bad.code() == StatusCode::kUnauthenticated);
  CHECK(bad.message().find("token was rejected") != std::string::npos);
}

// The server's nonce is random: one in 256 begins with the byte that alone asks for TLS. The
// blocking client once read that as "speak TLS" and failed a node's store connection.
TEST_CASE("rpc: the blocking client accepts every server nonce, whatever its first byte") {
  Fixture f;
  std::atomic<int> failures{0}, tries{0};
  std::string firstFailure;
  std::atomic<bool> done{false};
  std::thread t([&]() {
    for (int i = 0; i < 2000; ++i) {  // P(no nonce begins with 'S') = (255/256)^2000 < 0.1%
      auto fd = connectTcp(f.address(), std::chrono::seconds(2));
      if (!fd.isOk()) continue;
      auto status = handshake::connectBlocking(*fd, "secret-token", handshake::Purpose::kRpc, handshake::Transport::kPlain, std::chrono::seconds(2));
      ::close(*fd);
      tries += 1;
      if (!status.isOk() && failures++ == 0) firstFailure = status.toString();
    }
    done = true;
  });
  while (!done) f.io.provider->getTimer().afterDelay(5 * kj::MILLISECONDS).wait(f.io.waitScope);
  t.join();
  CHECK(tries == 2000);
  CHECK_MESSAGE(failures == 0, firstFailure);
}

TEST_CASE("rpc: every status code a server throws reaches the client as the same code") {
  kj::AsyncIoContext io = kj::setupAsyncIo();
  auto server = RpcServer::listen(io, HostPort{"127.0.0.1", 0}, "secret-token",
                                  rpc::NodeAgent::Client(kj::heap<ThrowingService>()));
  REQUIRE(server.isOk());
  auto client = RpcClient::connect(io, HostPort{"127.0.0.1", (*server)->port()}, "secret-token", 5 * kj::SECONDS)
                    .wait(io.waitScope);
  auto agent = client->bootstrap<rpc::NodeAgent>();
  for (int c = static_cast<int>(StatusCode::kInvalidArgument); c <= static_cast<int>(StatusCode::kActorDied); ++c) {
    auto code = static_cast<StatusCode>(c);
    auto request = agent.readLogsRequest();
    request.setId(std::string(static_cast<size_t>(c), 'x'));
    Status got;
    KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() { request.send().wait(io.waitScope); })) {
      got = statusFromException(*e, "readLogs");
    }
    CHECK_MESSAGE(got.code() == code, statusCodeName(code), " arrived as ", got.toString());
    CHECK(got.message() == fmt::format("readLogs: failed with {}", statusCodeName(code)));
  }
  // An exception without a code (KJ's own, a broken connection) maps from its KJ type.
  CHECK(statusFromException(KJ_EXCEPTION(DISCONNECTED, "gone"), "").code() == StatusCode::kUnavailable);
  CHECK(statusFromException(KJ_EXCEPTION(FAILED, "[NOT_A_CODE] x"), "").code() == StatusCode::kInternal);
}

double threadCpuMs() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

// Actor calls wait for their answer by spinning first (PeerWait::kSpinFirst). The spin must end:
// a connection gone quiet costs at most one window of CPU, then nothing; a kSleep connection
// never spins. (How long it spins depends on the machine's load: it stops when the CPUs are
// busy. What it buys is measured by bench/run actor_calls.)
TEST_CASE("rpc: a spinning connection spins at most one window after its last message, then sleeps") {
  setenv("TROUPE_RPC_SPIN_US", "100000", 1);  // read once per process: no spinning stream before this
  std::promise<int> port;
  std::atomic<bool> stop{false};
  std::thread server([&]() {
    kj::AsyncIoContext io = kj::setupAsyncIo();
    auto s = RpcServer::listen(io, HostPort{"127.0.0.1", 0}, "secret-token",
                               rpc::NodeAgent::Client(kj::heap<PingService>()), PeerWait::kSpinFirst);
    port.set_value(s.isOk() ? (*s)->port() : -1);
    while (!stop) io.provider->getTimer().afterDelay(5 * kj::MILLISECONDS).wait(io.waitScope);
  });
  int p = port.get_future().get();
  REQUIRE(p > 0);
  kj::AsyncIoContext io = kj::setupAsyncIo();
  struct Idle {
    uint64_t spins;
    double cpuMs;
  };
  auto callThenIdle = [&](PeerWait wait) {
    auto client = RpcClient::connect(io, HostPort{"127.0.0.1", p}, "secret-token", 5 * kj::SECONDS, wait)
                      .wait(io.waitScope);
    auto agent = client->bootstrap<rpc::NodeAgent>();
    uint64_t spins = spinsOnThisThread();
    for (int i = 0; i < 100; ++i) CHECK(agent.pingRequest().send().wait(io.waitScope).getPid() == getpid());
    spins = spinsOnThisThread() - spins;
    double before = threadCpuMs();
    io.provider->getTimer().afterDelay(600 * kj::MILLISECONDS).wait(io.waitScope);
    return Idle{spins, threadCpuMs() - before};
  };
  Idle spinning = callThenIdle(PeerWait::kSpinFirst);
  Idle sleeping = callThenIdle(PeerWait::kSleep);
  stop = true;
  server.join();
  INFO("after the last call: spinning ", spinning.cpuMs, " ms of CPU (", spinning.spins, " spins), sleeping ",
       sleeping.cpuMs, " ms (", sleeping.spins, ")");
  CHECK(spinning.spins >= 1);
  CHECK(spinning.cpuMs < 300);  // a 100 ms window, then it stopped
  CHECK(sleeping.spins == 0);
  CHECK(sleeping.cpuMs < 2);
}

TEST_CASE("rpc: a spin ends when a yield gives its CPU to another thread, and spins back off while it stays busy") {
  setenv("TROUPE_RPC_SPIN_US", "100000", 1);  // as above: read once per process
  std::promise<int> port;
  std::atomic<bool> stop{false};
  std::thread server([&]() {
    kj::AsyncIoContext io = kj::setupAsyncIo();
    auto s = RpcServer::listen(io, HostPort{"127.0.0.1", 0}, "secret-token",
                               rpc::NodeAgent::Client(kj::heap<PingService>()), PeerWait::kSleep);
    port.set_value(s.isOk() ? (*s)->port() : -1);
    while (!stop) io.provider->getTimer().afterDelay(5 * kj::MILLISECONDS).wait(io.waitScope);
  });
  int p = port.get_future().get();
  REQUIRE(p > 0);
  // This thread and a busy one share one CPU: each yield of a spin runs the busy thread.
  cpu_set_t all, one;
  REQUIRE(pthread_getaffinity_np(pthread_self(), sizeof all, &all) == 0);
  CPU_ZERO(&one);
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &all)) {
      CPU_SET(c, &one);
      break;
    }
  }
  REQUIRE(pthread_setaffinity_np(pthread_self(), sizeof one, &one) == 0);
  std::thread busy([&]() {
    pthread_setaffinity_np(pthread_self(), sizeof one, &one);
    while (!stop) {
    }
  });
  kj::AsyncIoContext io = kj::setupAsyncIo();
  auto client = RpcClient::connect(io, HostPort{"127.0.0.1", p}, "secret-token", 5 * kj::SECONDS,
                                   PeerWait::kSpinFirst)
                    .wait(io.waitScope);
  auto agent = client->bootstrap<rpc::NodeAgent>();
  uint64_t spins = spinsOnThisThread();
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 100; ++i) CHECK(agent.pingRequest().send().wait(io.waitScope).getPid() == getpid());
  double callsMs = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  spins = spinsOnThisThread() - spins;
  uint64_t yields = spinYieldsOnThisThread();
  io.provider->getTimer().afterDelay(300 * kj::MILLISECONDS).wait(io.waitScope);
  yields = spinYieldsOnThisThread() - yields;
  stop = true;
  busy.join();
  server.join();
  pthread_setaffinity_np(pthread_self(), sizeof all, &all);
  INFO("100 calls in ", callsMs, " ms started ", spins, " spins; then ", yields, " yields idle");
  CHECK(spins >= 1);
  // Without the back-off every call would start a spin; with it, a few (1, 2, 4 ... ms apart),
  // then one per 50 ms.
  CHECK(spins <= 10 + callsMs / 50);
  // Each yield ran the busy thread for its slice (milliseconds): a spin that went on yielding
  // through its 100 ms window would make dozens, and hear every answer that late.
  CHECK(yields <= 3);
}

}  // namespace
}  // namespace troupe
