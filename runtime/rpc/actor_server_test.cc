// The actor server C++ and Python workers share: one caller's calls run in the order sent, plain
// and batched, also while one waits; queries that answer at once do not wait; errors reach the
// caller with their code and hold nothing up. Real sockets on loopback, client and server on one
// event loop.
#include <doctest/doctest.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "troupe.capnp.h"
#include "troupe/runtime/actor.h"
#include "troupe/runtime/actor_server.h"
#include "troupe/runtime/rpc.h"
#include "troupe/runtime/held_buffers.h"

namespace troupe {
namespace {

// What the test sees of the Journal actor.
struct JournalState {
  std::vector<std::string> ran;  // "method:payload" of each call as it starts
  std::vector<kj::Own<kj::PromiseFulfiller<void>>> holds;  // one per "hold" call started: release it
  kj::Maybe<kj::Own<kj::PromiseFulfiller<void>>> holdWatch;

  // Resolves when the next "hold" call starts.
  kj::Promise<void> nextHold() {
    auto paf = kj::newPromiseAndFulfiller<void>();
    holdWatch = kj::mv(paf.fulfiller);
    return kj::mv(paf.promise);
  }
};

// Records its calls. "hold" waits until the test releases it; "fail" returns kInvalidArgument;
// "throw" throws; "peek" answers at once with the calls started so far; anything else echoes.
class Journal final : public Actor {
 public:
  explicit Journal(JournalState& state) : state_(state) {}

  Result<std::string> call(const std::string& method, std::string_view payload) override {
    if (method == "peek") {
      std::string all;
      for (const auto& r : state_.ran) all += (all.empty() ? "" : " ") + r;
      return all;
    }
    state_.ran.push_back(method + ":" + std::string(payload));
    if (method == "fail") return Status(StatusCode::kInvalidArgument, "asked to fail");
    if (method == "throw") throw std::runtime_error("asked to throw");
    return std::string(payload);
  }

  kj::Promise<Result<std::string>> callAsync(const std::string& method, std::string_view payload) override {
    if (method != "hold") return call(method, payload);
    state_.ran.push_back("hold:" + std::string(payload));
    auto paf = kj::newPromiseAndFulfiller<void>();
    state_.holds.push_back(kj::mv(paf.fulfiller));
    KJ_IF_MAYBE(w, state_.holdWatch) {
      (*w)->fulfill();
      state_.holdWatch = nullptr;
    }
    return paf.promise.then([p = std::string(payload)]() -> Result<std::string> { return "held " + p; });
  }

  bool answersAtOnce(const std::string& method) const override { return method == "peek"; }

 private:
  JournalState& state_;
};

struct Fixture {
  kj::AsyncIoContext io = kj::setupAsyncIo();
  JournalState state;
  kj::Own<RpcServer> server;
  kj::Own<RpcClient> client;
  rpc::Actor::Client actor = nullptr;

  explicit Fixture(ActorServerOptions options = {}) {
    auto s = listenActor(io, HostPort{"127.0.0.1", 0}, "token", std::make_unique<Journal>(state), "Journal", options);
    REQUIRE(s.isOk());
    server = kj::mv(*s);
    client = RpcClient::connect(io, HostPort{"127.0.0.1", server->port()}, "token", 5 * kj::SECONDS).wait(io.waitScope);
    actor = client->bootstrap<rpc::Actor>();
  }

  // Sends a call now (it is on the wire in send order); its reply, or the error's status.
  kj::Promise<Result<std::string>> call(const std::string& method, const std::string& payload = "") {
    auto req = actor.callRequest();
    req.setMethod(method);
    req.setPayload(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(payload.data()), payload.size()));
    return req.send().then(
        [](capnp::Response<rpc::Actor::CallResults> r) -> Result<std::string> {
          auto d = r.getResult();
          return std::string(reinterpret_cast<const char*>(d.begin()), d.size());
        },
        [](kj::Exception&& e) -> Result<std::string> { return statusFromException(e, ""); });
  }

  // Sends (method, payload) calls as one callBatch; each reply's result, or "error: <error>".
  kj::Promise<std::vector<std::string>> batch(const std::vector<std::pair<std::string, std::string>>& calls) {
    auto req = actor.callBatchRequest();
    auto list = req.initCalls(calls.size());
    for (unsigned i = 0; i < calls.size(); ++i) {
      list[i].setMethod(calls[i].first);
      const auto& p = calls[i].second;
      list[i].setPayload(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(p.data()), p.size()));
    }
    return req.send().then([](capnp::Response<rpc::Actor::CallBatchResults> r) {
      std::vector<std::string> out;
      for (auto reply : r.getReplies()) {
        if (reply.isError()) {
          out.push_back(std::string("error: ") + reply.getError().cStr());
        } else {
          auto d = reply.getResult();
          out.push_back(std::string(reinterpret_cast<const char*>(d.begin()), d.size()));
        }
      }
      return out;
    });
  }

  std::string value(kj::Promise<Result<std::string>> p) {
    auto r = p.wait(io.waitScope);
    REQUIRE(r.isOk());
    return *r;
  }
};

using Ran = std::vector<std::string>;

TEST_CASE("actor server: one caller's calls run in the order sent, plain and batched, while one waits") {
  Fixture f;
  auto held1 = f.state.nextHold();
  auto hold1 = f.call("hold", "1");
  auto a = f.call("a");
  auto batch = f.batch({{"b", ""}, {"hold", "2"}, {"c", ""}});
  auto d = f.call("d");
  auto peek = f.call("peek");
  held1.wait(f.io.waitScope);
  // Everything above has arrived (peek came last, and answers at once); nothing ran behind hold 1.
  CHECK(f.value(kj::mv(peek)) == "hold:1");
  CHECK(f.state.ran == Ran{"hold:1"});

  auto held2 = f.state.nextHold();
  f.state.holds[0]->fulfill();
  held2.wait(f.io.waitScope);
  CHECK(f.value(kj::mv(hold1)) == "held 1");
  CHECK(f.value(kj::mv(a)) == "");
  CHECK(f.state.ran == Ran{"hold:1", "a:", "b:", "hold:2"});
  // Sent while the batch's second call waits: it runs after the batch's rest and after d.
  auto e = f.call("e", "5");
  CHECK(f.value(f.call("peek")) == "hold:1 a: b: hold:2");

  f.state.holds[1]->fulfill();
  CHECK(batch.wait(f.io.waitScope) == std::vector<std::string>{"", "held 2", ""});
  CHECK(f.value(kj::mv(d)) == "");
  CHECK(f.value(kj::mv(e)) == "5");
  CHECK(f.state.ran == Ran{"hold:1", "a:", "b:", "hold:2", "c:", "d:", "e:5"});
}

TEST_CASE("actor server: an error reaches the caller with its code and the calls after it still run") {
  Fixture f;
  auto failed = f.call("fail");
  auto threw = f.call("throw");
  auto after = f.call("x", "1");
  auto r = failed.wait(f.io.waitScope);
  REQUIRE_FALSE(r.isOk());
  CHECK(r.status().code() == StatusCode::kInvalidArgument);
  CHECK(r.status().message().find("asked to fail") != std::string::npos);
  auto t = threw.wait(f.io.waitScope);
  REQUIRE_FALSE(t.isOk());
  CHECK(t.status().message().find("asked to throw") != std::string::npos);
  CHECK(f.value(kj::mv(after)) == "1");

  auto replies = f.batch({{"fail", ""}, {"y", "2"}}).wait(f.io.waitScope);
  REQUIRE(replies.size() == 2);
  CHECK(replies[0].find("error: [INVALID_ARGUMENT]") == 0);
  CHECK(replies[1] == "2");
  CHECK(f.state.ran == Ran{"fail:", "throw:", "x:1", "fail:", "y:2"});
}

TEST_CASE("actor server: a synchronous actor's calls run as they arrive, in the order sent, errors as for any") {
  Fixture f(ActorServerOptions{.synchronous = true});
  auto a = f.call("a", "1");
  auto batch = f.batch({{"b", "2"}, {"fail", ""}, {"c", "3"}});
  auto threw = f.call("throw");
  auto d = f.call("d", "4");
  auto peek = f.call("peek");  // answers at once: the calls before it have run
  CHECK(f.value(kj::mv(peek)) == "a:1 b:2 fail: c:3 throw: d:4");
  CHECK(f.value(kj::mv(a)) == "1");
  auto replies = batch.wait(f.io.waitScope);
  REQUIRE(replies.size() == 3);
  CHECK(replies[0] == "2");
  CHECK(replies[1].find("error: [INVALID_ARGUMENT]") == 0);
  CHECK(replies[2] == "3");
  auto t = threw.wait(f.io.waitScope);
  REQUIRE_FALSE(t.isOk());
  CHECK(t.status().message().find("asked to throw") != std::string::npos);
  CHECK(f.value(kj::mv(d)) == "4");
}

TEST_CASE("actor server: large results go out referenced, not copied, arrive intact and are let go once written") {
  Fixture f;
  auto pattern = [](size_t size, int salt) {
    std::string s(size, '\0');
    for (size_t i = 0; i < size; ++i) s[i] = static_cast<char>((i * 131 + size + salt) & 0xff);
    return s;
  };
  // Sizes off the 8-byte word, below the threshold too (copied).
  const std::vector<size_t> sizes = {kReferenceFrom - 1, kReferenceFrom,
                                     kReferenceFrom + 1, (size_t(1) << 20) + 3, (size_t(5) << 20) + 7};
  uint64_t everBefore = gHeldBytesEver;
  uint64_t referenced = 0;
  std::vector<kj::Promise<Result<std::string>>> plain;
  std::vector<std::pair<std::string, std::string>> batched;
  for (size_t size : sizes) {
    plain.push_back(f.call("echo", pattern(size, 1)));
    batched.emplace_back("echo", pattern(size, 2));
    if (size >= kReferenceFrom) referenced += 2 * size;
  }
  auto batch = f.batch(batched);
  for (size_t i = 0; i < sizes.size(); ++i) CHECK(f.value(kj::mv(plain[i])) == pattern(sizes[i], 1));
  auto replies = batch.wait(f.io.waitScope);
  REQUIRE(replies.size() == sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) CHECK(replies[i] == pattern(sizes[i], 2));
  CHECK(gHeldBytesEver - everBefore == referenced);
  // Each is let go with the write that carried it (which may finish a turn after the reply
  // was read).
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (gHeldBytes != 0 && std::chrono::steady_clock::now() < deadline) f.io.waitScope.poll();
  CHECK(gHeldBytes == 0);
}

TEST_CASE("actor server: an actor without a typed interface says so") {
  Fixture f;
  Status status;
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() { f.actor.typedRequest().send().wait(f.io.waitScope); })) {
    status = statusFromException(*e, "");
  }
  CHECK(status.code() == StatusCode::kFailedPrecondition);
  CHECK(status.message().find("Journal") != std::string::npos);
}

}  // namespace
}  // namespace troupe
