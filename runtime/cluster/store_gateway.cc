#include "troupe/runtime/store_gateway.h"

#include <openssl/rand.h>

#include <map>
#include <set>
#include <vector>

#include <fmt/format.h>
#include <kj/debug.h>

#include "troupe/runtime/handshake.h"
#include "redis_connection.h"
#include "troupe/runtime/logging.h"

namespace troupe {
namespace {

constexpr auto kRedisTimeout = 5 * kj::SECONDS;
// The gateway's own beat: the controller's reap does not judge the nodes behind a gateway whose
// beat is over 1.5 s old (a stalled or starved gateway holds their beats), nor for a TTL after.
constexpr auto kBeatInterval = 250 * kj::MILLISECONDS;

// A command as RESP: an array of bulk strings.
std::string resp(const std::vector<std::string>& args) {
  std::string out = fmt::format("*{}\r\n", args.size());
  for (const auto& a : args) out += fmt::format("${}\r\n{}\r\n", a.size(), a);
  return out;
}

// RESP for AUTH <password>, sent on the client's behalf.
std::string authCommand(const std::string& password) { return resp({"AUTH", password}); }

// What a relayed connection may do: the commands the runtime sends (through hiredis, and from
// its Lua scripts, which Redis checks against the same user), on the cluster's keys and
// channels only. Not FLUSHALL, CONFIG, DEBUG, SHUTDOWN, ACL, CLIENT, MODULE, KEYS, ...: a token
// holder on another host is a node, not an administrator of the head's Redis.
constexpr const char* kRelayedCommands[] = {
    "eval", "evalsha", "script|load", "ping", "subscribe", "unsubscribe", "get", "set", "del", "exists",
    "hget", "hgetall", "hmget", "hset", "hdel", "hincrby", "lrange", "ltrim", "rpush", "pexpire", "pttl",
    "publish", "sadd", "scard", "smembers", "srem", "time", "zadd", "zcard", "zrange", "zrangebyscore", "zrem",
    "zremrangebyrank", "zscore", "info"};
constexpr const char* kRelayUser = "troupe-gateway";

// `text` as a literal in an ACL glob pattern.
std::string globLiteral(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '*' || c == '?' || c == '[' || c == ']' || c == '\\') out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

std::string randomSecret() {
  unsigned char bytes[24];
  KJ_REQUIRE(RAND_bytes(bytes, sizeof bytes) == 1, "the system's random source failed");
  std::string hex;
  for (unsigned char b : bytes) hex += fmt::format("{:02x}", b);
  return hex;
}


// Reads one line ("...\r\n") of at most 512 bytes: Redis's answer to AUTH.
kj::Promise<std::string> readLine(kj::AsyncIoStream& stream, std::string sofar = {}) {
  auto buf = kj::heapArray<char>(1);
  auto* b = buf.begin();
  return stream.tryRead(b, 1, 1).then([&stream, sofar = kj::mv(sofar), buf = kj::mv(buf)](size_t n) mutable
                                       -> kj::Promise<std::string> {
    if (n == 0) return KJ_EXCEPTION(DISCONNECTED, "Redis closed the connection");
    sofar.push_back(buf[0]);
    if (sofar.size() >= 2 && sofar.compare(sofar.size() - 2, 2, "\r\n") == 0) return kj::mv(sofar);
    if (sofar.size() > 512) return KJ_EXCEPTION(FAILED, "Redis answered AUTH with an overlong line");
    return readLine(stream, kj::mv(sofar));
  });
}

// Copies `from` into `to` until `from` ends, then ends `to`'s write side.
kj::Promise<void> relay(kj::AsyncIoStream& from, kj::AsyncIoStream& to) {
  return from.pumpTo(to).ignoreResult().then([&to]() { to.shutdownWrite(); });
}

class StoreGatewayImpl final : public StoreGateway {
 public:
  StoreGatewayImpl(kj::AsyncIoContext& io, kj::Own<kj::ConnectionReceiver> listener, std::string token,
                   RedisOptions redis)
      : io_(io), redis_(kj::mv(redis)),
        relayPassword_(randomSecret()),
        acceptor_(io, kj::mv(listener), kj::mv(token), handshake::Purpose::kStore, "store gateway",
                  [this](kj::Own<kj::AsyncIoStream> client) { return serve(kj::mv(client)); }) {}

  int port() const override { return acceptor_.port(); }
  uint64_t refusedConnections() const override { return acceptor_.refused(); }

  void startBeating() { beats_ = beatLoop(true).eagerlyEvaluate(nullptr); }

 private:
  // One relayed connection, counted against its source while it lasts.
  kj::Promise<void> serve(kj::Own<kj::AsyncIoStream> client) {
    std::string source = handshake::peerHost(*client);
    if (relayed_[source] >= kMaxRelayedPerSource) {
      if (!warnedFull_.count(source)) {
        TROUPE_LOG(kWarning, "store gateway: closed a connection from {}: it already has {} relayed connections",
                   source, kMaxRelayedPerSource);
        warnedFull_.insert(source);
      }
      return kj::READY_NOW;  // the client is dropped: closed
    }
    ++relayed_[source];
    auto release = kj::defer([this, source]() {
      if (--relayed_[source] <= 0) relayed_.erase(source);
    });
    return openRedis(true)
        .then([client = kj::mv(client)](kj::Own<kj::AsyncIoStream> redis) mutable {
          auto& c = *client;
          auto& r = *redis;
          return relay(c, r).exclusiveJoin(relay(r, c)).attach(kj::mv(client), kj::mv(redis));
        })
        .attach(kj::mv(release));
  }

  // Beats on a connection of its own, from this event loop: the beat stops when relaying stops.
  kj::Promise<void> beatLoop(bool first) {
    return openRedis(false)
        .then([this, first](kj::Own<kj::AsyncIoStream> redis) { return beatOn(kj::mv(redis), first); })
        .catch_([this](kj::Exception&& e) {
          if (!beatFailing_) TROUPE_LOG(kWarning, "store gateway: its beat to Redis failed: {}", e.getDescription().cStr());
          beatFailing_ = true;
          return io_.provider->getTimer().afterDelay(kBeatInterval).then([this]() { return beatLoop(false); });
        });
  }

  kj::Promise<void> beatOn(kj::Own<kj::AsyncIoStream> redis, bool first) {
    auto command = kj::heap<std::string>(redis::gatewayBeatCommand(redis_, first));
    auto& r = *redis;
    auto& cmd = *command;
    auto beat = r.write(cmd.data(), cmd.size()).attach(kj::mv(command)).then([&r]() { return readLine(r); });
    return io_.provider->getTimer()
        .timeoutAfter(kRedisTimeout, kj::mv(beat))
        .then([this, redis = kj::mv(redis)](std::string line) mutable {
          if (line != ":1\r\n") {
            return kj::Promise<void>(KJ_EXCEPTION(FAILED, "Redis refused the gateway's beat", line.substr(0, line.size() - 2)));
          }
          if (beatFailing_) TROUPE_LOG(kInfo, "store gateway: its beat reaches Redis again");
          beatFailing_ = false;
          return io_.provider->getTimer().afterDelay(kBeatInterval).then([this, redis = kj::mv(redis)]() mutable {
            return beatOn(kj::mv(redis), false);
          });
        });
  }

  // A connection to Redis, authenticated with the password; for a relayed client (`asRelay`)
  // then narrowed to the relay user (ACL SETUSER, idempotent, so a restarted Redis gets it back;
  // AUTH as it on the same connection). A Redis without ACLs (before 6) relays as the password's
  // user, with one warning.
  kj::Promise<kj::Own<kj::AsyncIoStream>> openRedis(bool asRelay) {
    return openAdmin().then([this, asRelay](kj::Own<kj::AsyncIoStream> redis) -> kj::Promise<kj::Own<kj::AsyncIoStream>> {
      if (!asRelay || aclUnavailable_) return kj::mv(redis);
      std::vector<std::string> setUser = {"ACL", "SETUSER", kRelayUser, "reset", "on", ">" + relayPassword_,
                                          "~" + globLiteral(prefix()) + "*", "&" + globLiteral(prefix()) + "*"};
      for (const char* c : kRelayedCommands) setUser.push_back(std::string("+") + c);
      auto command = kj::heap<std::string>(resp(setUser) + resp({"AUTH", kRelayUser, relayPassword_}));
      auto& r = *redis;
      auto& cmd = *command;
      return r.write(cmd.data(), cmd.size())
          .attach(kj::mv(command))
          .then([&r]() { return readLine(r); })
          .then([this, &r](std::string setUserLine) {
            return readLine(r).then([this, setUserLine](std::string authLine) {
              if (setUserLine == "+OK\r\n" && authLine == "+OK\r\n") return;
              if (setUserLine != "+OK\r\n") {
                // No ACL command (or no right to it): the old relay, said once.
                aclUnavailable_ = true;
                TROUPE_LOG(kWarning,
                           "store gateway: Redis refused ACL SETUSER ({}); relaying every command as the password's "
                           "user. Use Redis 6 or newer with ACLs to limit what joined nodes may run",
                           setUserLine.substr(0, setUserLine.size() - 2));
                return;
              }
              kj::throwFatalException(KJ_EXCEPTION(FAILED, "Redis refused the gateway's relay user",
                                                   authLine.substr(0, authLine.size() - 2)));
            });
          })
          .then([redis = kj::mv(redis)]() mutable { return kj::mv(redis); });
    });
  }

  std::string prefix() const { return fmt::format("troupe:{}:", redis_.cluster); }

  // A connection to Redis, authenticated with the password.
  kj::Promise<kj::Own<kj::AsyncIoStream>> openAdmin() {
    auto opened = io_.provider->getNetwork()
                      .parseAddress(redis_.host, redis_.port)
                      .then([](kj::Own<kj::NetworkAddress> addr) { return addr->connect().attach(kj::mv(addr)); })
                      .then([this](kj::Own<kj::AsyncIoStream> redis) {
                        handshake::setNoDelay(*redis);
                        auto command = kj::heap<std::string>(authCommand(redis_.password));
                        auto& r = *redis;
                        auto& cmd = *command;
                        return r.write(cmd.data(), cmd.size())
                            .attach(kj::mv(command))
                            .then([&r]() { return readLine(r); })
                            .then([redis = kj::mv(redis)](std::string line) mutable -> kj::Own<kj::AsyncIoStream> {
                              if (line != "+OK\r\n") {
                                kj::throwFatalException(KJ_EXCEPTION(
                                    FAILED, "Redis refused the gateway's password", line.substr(0, line.size() - 2)));
                              }
                              return kj::mv(redis);
                            });
                      });
    return io_.provider->getTimer().timeoutAfter(kRedisTimeout, kj::mv(opened));
  }

  // Relayed connections one source address may hold at once: a host cannot take every
  // descriptor of the gateway or every client slot of Redis. Far above a node's need (its agent
  // and each of its workers hold one or two).
  static constexpr int kMaxRelayedPerSource = 4096;

  kj::AsyncIoContext& io_;
  RedisOptions redis_;
  std::string relayPassword_;  // the relay user's, new for each gateway; never leaves the head
  bool aclUnavailable_ = false;
  std::map<std::string, int> relayed_;
  std::set<std::string> warnedFull_;
  handshake::Acceptor acceptor_;
  bool beatFailing_ = false;
  kj::Promise<void> beats_ = nullptr;
};

}  // namespace

Result<kj::Own<StoreGateway>> StoreGateway::listen(kj::AsyncIoContext& io, const HostPort& bind, std::string token,
                                                   RedisOptions redis) {
  TROUPE_ASSIGN_OR_RETURN(auto listener, handshake::listen(io, bind));
  auto gateway = kj::heap<StoreGatewayImpl>(io, kj::mv(listener), kj::mv(token), kj::mv(redis));
  gateway->startBeating();
  return kj::Own<StoreGateway>(kj::mv(gateway));
}

}  // namespace troupe
