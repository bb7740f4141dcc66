// The token handshake in front of Cap'n Proto: a connection without the cluster token gets no
// capability and is closed.
#include <doctest/doctest.h>

#include <unistd.h>

#include "troupe.capnp.h"
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

TEST_CASE("rpc: a wrong token is refused before any capability is handed out") {
  Fixture f;
  std::string error;
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
    RpcClient::connect(f.io, f.address(), "wrong-token", 5 * kj::SECONDS).wait(f.io.waitScope);
  })) {
    error = e->getDescription().cStr();
  }
  CHECK(error.find("token was rejected") != std::string::npos);
  CHECK(f.server->refusedConnections() == 1);
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
