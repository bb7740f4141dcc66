// A peer's control channel (control_channel.h) over a real socket pair, and the checks a request
// passes before anything is sent (operation.h): each way a peer can end is told apart.
#include <doctest/doctest.h>

#include <sys/socket.h>
#include <unistd.h>

#include "control_channel.h"
#include "operation.h"
#include "wire.h"

namespace troupe::collectives {
namespace {

using Kind = ControlChannel::Event::Kind;

// A channel over one end of a socket pair; the test writes to (and closes) the other end.
struct Pair {
  asio::io_context io;
  ControlChannel channel{io};
  int peer = -1;
  Pair() {
    int fds[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0);
    channel.socket().assign(asio::ip::tcp::v4(), fds[0]);
    peer = fds[1];
  }
  ~Pair() {
    if (peer >= 0) ::close(peer);
  }
  void write(const std::string& bytes) { REQUIRE(::write(peer, bytes.data(), bytes.size()) == ssize_t(bytes.size())); }
  void hangUp() {
    ::close(peer);
    peer = -1;
  }
};

TEST_CASE("control channel: a goodbye then the end is a clean leave; the end alone is a death") {
  Pair left;
  left.write(encodeGoodbye());
  CHECK(left.channel.drain().kind == Kind::kNothing);
  CHECK(left.channel.saidGoodbye());
  CHECK(!left.channel.left());  // still connected: operations with it may still finish
  left.hangUp();
  CHECK(left.channel.drain().kind == Kind::kNothing);
  CHECK(left.channel.left());
  CHECK(!left.channel.isOpen());

  Pair died;
  CHECK(died.channel.drain().kind == Kind::kNothing);  // open and quiet
  died.hangUp();
  auto event = died.channel.drain();
  CHECK(event.kind == Kind::kDied);
  CHECK(!died.channel.left());
}

TEST_CASE("control channel: an ABORT carries the peer's code and text, even split across reads") {
  Pair pair;
  std::string abort = encodeAbort(StatusCode::kDeadlineExceeded, "rank 1 timed out");
  pair.write(abort.substr(0, 5));
  CHECK(pair.channel.drain().kind == Kind::kNothing);
  pair.write(abort.substr(5));
  pair.hangUp();  // an ABORT, then the end: the ABORT is the news
  auto event = pair.channel.drain();
  CHECK(event.kind == Kind::kAborted);
  CHECK(event.code == StatusCode::kDeadlineExceeded);
  CHECK(event.text == "rank 1 timed out");
}

TEST_CASE("control channel: bytes that are no control message are reported as malformed") {
  Pair pair;
  pair.write(std::string(8, '\xee'));
  auto event = pair.channel.drain();
  CHECK(event.kind == Kind::kMalformed);
  CHECK(!event.text.empty());
}

TEST_CASE("control channel: sending to a peer that is gone fails quietly") {
  Pair pair;
  pair.hangUp();
  pair.channel.send(encodeGoodbye());  // no exception, no SIGPIPE (the test would die)
  pair.channel.close();
  CHECK(!pair.channel.isOpen());
}

TEST_CASE("operations: local mistakes are refused before anything is sent, naming them") {
  auto check = [](Request r) { return validateRequest(r, /*worldSize=*/4, /*rank=*/1); };
  float x[4] = {};
  auto request = [&](OpKind kind, const void* send, void* recv, size_t count, int root = -1) {
    Request r;
    r.kind = kind;
    r.send = send;
    r.recv = recv;
    r.count = count;
    r.root = root;
    return r;
  };
  Request ok = request(OpKind::kAllreduce, x, x, 4);
  CHECK(check(ok).isOk());
  Request badPeer = request(OpKind::kSend, x, nullptr, 4, /*root=*/1);
  CHECK(check(badPeer).code() == StatusCode::kInvalidArgument);
  CHECK(check(badPeer).message().find("peer 1 is not another rank") != std::string::npos);
  Request badRoot = request(OpKind::kBroadcast, x, x, 4, /*root=*/4);
  CHECK(check(badRoot).message().find("root 4") != std::string::npos);
  Request nullBuffer = request(OpKind::kAllgather, nullptr, x, 4);
  CHECK(check(nullBuffer).message().find("null buffer") != std::string::npos);
  Request huge = request(OpKind::kAllreduce, x, x, (size_t{1} << 48) + 1);
  CHECK(check(huge).message().find("too large") != std::string::npos);
  Request sendRecvSelf = request(OpKind::kSendRecv, x, x, 4, /*root=*/2);
  sendRecvSelf.from = 1;
  CHECK(check(sendRecvSelf).code() == StatusCode::kInvalidArgument);
  CHECK(describeRequest(ok, 7) == "allreduce #7 (4 elements of float32, sum)");
}

}  // namespace
}  // namespace troupe::collectives
