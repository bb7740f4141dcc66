#include "troupe/runtime/store_gateway.h"

#include <fmt/format.h>
#include <kj/debug.h>

#include "handshake.h"
#include "redis_connection.h"
#include "troupe/runtime/logging.h"

namespace troupe {
namespace {

constexpr auto kRedisTimeout = 5 * kj::SECONDS;
// The gateway's own beat: the controller's reap does not judge the nodes behind a gateway whose
// beat is over 1.5 s old (a stalled or starved gateway holds their beats), nor for a TTL after.
constexpr auto kBeatInterval = 250 * kj::MILLISECONDS;

// RESP for AUTH <password>, sent on the client's behalf.
std::string authCommand(const std::string& password) {
  return fmt::format("*2\r\n$4\r\nAUTH\r\n${}\r\n{}\r\n", password.size(), password);
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
        acceptor_(io, kj::mv(listener), kj::mv(token), handshake::Purpose::kStore, "store gateway",
                  [this](kj::Own<kj::AsyncIoStream> client) {
                    return openRedis().then([client = kj::mv(client)](kj::Own<kj::AsyncIoStream> redis) mutable {
                      auto& c = *client;
                      auto& r = *redis;
                      return relay(c, r).exclusiveJoin(relay(r, c)).attach(kj::mv(client), kj::mv(redis));
                    });
                  }) {}

  int port() const override { return acceptor_.port(); }
  uint64_t refusedConnections() const override { return acceptor_.refused(); }

  void startBeating() { beats_ = beatLoop(true).eagerlyEvaluate(nullptr); }

 private:
  // Beats on a connection of its own, from this event loop: the beat stops when relaying stops.
  kj::Promise<void> beatLoop(bool first) {
    return openRedis()
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

  // A connection to Redis, authenticated with the password on the client's behalf.
  kj::Promise<kj::Own<kj::AsyncIoStream>> openRedis() {
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

  kj::AsyncIoContext& io_;
  RedisOptions redis_;
  handshake::Acceptor acceptor_;
  bool beatFailing_ = false;
  kj::Promise<void> beats_ = nullptr;
};

}  // namespace

Result<kj::Own<StoreGateway>> StoreGateway::listen(kj::AsyncIoContext& io, const HostPort& bind, std::string token,
                                                   RedisOptions redis) {
  auto listener = handshake::listen(io, bind);
  if (!listener.isOk()) return listener.status();
  auto gateway = kj::heap<StoreGatewayImpl>(io, kj::mv(*listener), kj::mv(token), kj::mv(redis));
  gateway->startBeating();
  return kj::Own<StoreGateway>(kj::mv(gateway));
}

}  // namespace troupe
