// The store gateway relays a token holder's RESP to the head's Redis, but only what the runtime
// itself sends (issue 34 finding 9): FLUSHALL emptied a cluster through it, CONFIG GET
// requirepass gave away the Redis password, and one source could open connections without end.
#include <doctest/doctest.h>
#include <hiredis/hiredis.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "redis_connection.h"
#include "troupe/runtime/store_gateway.h"
#include "troupe/testing/redis_server.h"

namespace troupe {
namespace {

using redis::connectAndAuthenticate;
using redis::ContextPtr;

struct Gateway {
  testing::RedisServerProcess redis;
  kj::AsyncIoContext io = kj::setupAsyncIo();
  kj::Own<StoreGateway> gateway;
  RedisOptions admin;

  Gateway() {
    admin.host = redis.host();
    admin.port = redis.port();
    admin.password = redis.password();
    admin.cluster = "gwtest";
    auto listened = StoreGateway::listen(io, HostPort{"127.0.0.1", 0}, "gateway-test-token", admin);
    REQUIRE(listened.isOk());
    gateway = kj::mv(*listened);
  }
  RedisOptions relayed() const {
    RedisOptions o;
    o.host = "127.0.0.1";
    o.port = gateway->port();
    o.cluster = admin.cluster;
    o.gatewayToken = "gateway-test-token";
    return o;
  }
  // Runs `work` on a thread of its own while this thread's loop serves the gateway.
  template <typename F>
  void whileServing(F work) {
    std::atomic<bool> done{false};
    std::thread t([&]() {
      work();
      done = true;
    });
    while (!done) io.provider->getTimer().afterDelay(2 * kj::MILLISECONDS).wait(io.waitScope);
    t.join();
  }
};

std::string run(redisContext* c, std::vector<std::string> args) {
  std::vector<const char*> p;
  std::vector<size_t> n;
  for (auto& a : args) {
    p.push_back(a.data());
    n.push_back(a.size());
  }
  auto* reply = static_cast<redisReply*>(redisCommandArgv(c, static_cast<int>(p.size()), p.data(), n.data()));
  if (reply == nullptr) return "(connection lost)";
  std::string out = reply->type == REDIS_REPLY_ERROR ? "ERR " + std::string(reply->str, reply->len)
                    : reply->type == REDIS_REPLY_STRING || reply->type == REDIS_REPLY_STATUS
                        ? std::string(reply->str, reply->len)
                        : reply->type == REDIS_REPLY_INTEGER ? std::to_string(reply->integer) : "(other)";
  freeReplyObject(reply);
  return out;
}

TEST_CASE("store gateway: only the runtime's commands on the cluster's keys are relayed") {
  Gateway g;
  std::vector<std::string> answers;
  std::string after;
  g.whileServing([&]() {
    auto c = connectAndAuthenticate(g.relayed());
    REQUIRE(c.isOk());
    redisContext* ctx = c->get();
    answers.push_back(run(ctx, {"HSET", "troupe:gwtest:x", "a", "b"}));                            // 0: the runtime's
    answers.push_back(run(ctx, {"FLUSHALL"}));                                                     // 1
    answers.push_back(run(ctx, {"CONFIG", "GET", "requirepass"}));                                 // 2
    answers.push_back(run(ctx, {"DEBUG", "SLEEP", "0"}));                                          // 3
    answers.push_back(run(ctx, {"SHUTDOWN", "NOSAVE"}));                                           // 4
    answers.push_back(run(ctx, {"SET", "someone-else", "1"}));                                     // 5: not the cluster's key
    answers.push_back(run(ctx, {"EVAL", "return redis.call('FLUSHALL')", "0"}));                   // 6: through a script
    std::string sha = run(ctx, {"SCRIPT", "LOAD", "return redis.call('CONFIG', 'GET', 'requirepass')"});
    answers.push_back(run(ctx, {"EVALSHA", sha, "0"}));                                            // 7
    answers.push_back(run(ctx, {"ACL", "SETUSER", "troupe-gateway", "+@all"}));                    // 8
    answers.push_back(run(ctx, {"HGET", "troupe:gwtest:x", "a"}));                                 // 9: still there
    auto direct = connectAndAuthenticate(g.admin);
    REQUIRE(direct.isOk());
    after = run(direct->get(), {"HGET", "troupe:gwtest:x", "a"});
  });
  CHECK(answers[0] == "1");
  for (size_t i = 1; i <= 8; ++i) {
    INFO("answer ", i, ": ", answers[i]);
    CHECK(answers[i].rfind("ERR ", 0) == 0);  // NOPERM, or a script's refusal: never done
    CHECK(answers[i].find(g.redis.password()) == std::string::npos);
  }
  CHECK(answers[9] == "b");
  CHECK(after == "b");  // nothing was flushed, and Redis still runs
}

TEST_CASE("store gateway: a key space's calls (a torch.distributed store's) pass the narrowed relay") {
  Gateway g;
  std::vector<Status> failures;
  int64_t sum = 0, count = 0;
  std::string swapped;
  g.whileServing([&]() {
    auto store = connectRedisStore(g.relayed());
    REQUIRE(store.isOk());
    auto& s = **store;
    constexpr std::chrono::milliseconds ttl{60'000};
    auto note = [&](const Status& st) {
      if (!st.isOk()) failures.push_back(st);
    };
    note(s.setKey("g:1", "a", "v", ttl));
    note(s.getKeys("g:1", {"a", "b"}).status());
    auto added = s.addToKey("g:1", "n", 2, ttl);
    note(added.status());
    if (added.isOk()) sum = *added;
    auto cas = s.compareSetKey("g:1", "c", "", "x", ttl);
    note(cas.status());
    if (cas.isOk()) swapped = *cas;
    note(s.deleteKey("g:1", "a").status());
    auto counted = s.countKeys("g:1");
    note(counted.status());
    if (counted.isOk()) count = *counted;
    note(s.putElasticGroup("g", "{}"));
    note(s.deleteElasticGroup("g"));  // deletes the group's key spaces from its script
    note(s.deleteKeySpace("g:1"));
  });
  for (const Status& st : failures) CHECK_MESSAGE(false, st.toString());
  CHECK(sum == 2);
  CHECK(swapped == "x");
  CHECK(count == 2);
}

TEST_CASE("store gateway: one source holds at most 4096 relayed connections; the next is closed") {
  Gateway g;
  std::vector<ContextPtr> held;
  std::string overLimit;
  bool freedSlotWorks = false;
  g.whileServing([&]() {
    for (int i = 0; i < 4096; ++i) {
      auto c = connectAndAuthenticate(g.relayed());
      REQUIRE(c.isOk());
      REQUIRE(run(c->get(), {"PING"}) == "PONG");  // relayed, so counted
      held.push_back(std::move(*c));
    }
    auto extra = connectAndAuthenticate(g.relayed());
    overLimit = extra.isOk() ? run(extra->get(), {"PING"}) : extra.status().message();
    held.pop_back();  // one closes: its slot is free again once the gateway sees the close
    for (int attempt = 0; attempt < 500 && !freedSlotWorks; ++attempt) {
      auto again = connectAndAuthenticate(g.relayed());
      freedSlotWorks = again.isOk() && run(again->get(), {"PING"}) == "PONG";
    }
  });
  CHECK(overLimit != "PONG");
  CHECK(freedSlotWorks);
}

}  // namespace
}  // namespace troupe
