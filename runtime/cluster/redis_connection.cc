#include "redis_connection.h"

#include <poll.h>
#include <sys/time.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "troupe/runtime/handshake.h"
#include "troupe/runtime/process.h"
#include "troupe/runtime/tls.h"

namespace troupe::redis {
namespace {

timeval toTimeval(std::chrono::milliseconds ms) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(ms.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms.count() % 1000) * 1000);
  return tv;
}

bool startsWith(const std::string& text, std::string_view prefix) {
  return text.compare(0, prefix.size(), prefix) == 0;
}

}  // namespace

std::string addressOf(const RedisOptions& options) {
  return fmt::format("{}:{}", options.host, options.port);
}

std::string replyText(const redisReply& reply) {
  return reply.str ? std::string(reply.str, reply.len) : std::string();
}


Status unreachable(const RedisOptions& options, const std::string& reason) {
  if (!options.gatewayToken.empty()) {
    return Status(StatusCode::kUnavailable,
                  fmt::format("cannot reach the cluster store through the head's store gateway at {}: {}; check "
                              "that the head node is up and reachable from this host",
                              addressOf(options), reason));
  }
  return Status(StatusCode::kUnavailable,
                fmt::format("cannot reach Redis at {}: {}; check --redis-address and that "
                            "redis-server is running there",
                            addressOf(options), reason));
}

// A context-level failure (I/O error, EOF, timeout) as a message. hiredis reports a read that
// hit SO_RCVTIMEO as EAGAIN, which reads as nonsense to a user; say it was a timeout.
std::string contextError(const redisContext* context, const RedisOptions& options) {
  if (context == nullptr) return "out of memory allocating a hiredis context";
  std::string text = context->errstr;
  if (context->err == REDIS_ERR_IO &&
      (text == std::strerror(EAGAIN) || text == std::strerror(EWOULDBLOCK))) {
    return fmt::format("no reply within {} ms", options.timeout.count());
  }
  return text.empty() ? std::string("connection lost") : text;
}


namespace {

// Connects, checks that the server demands a password, and authenticates.
Result<ContextPtr> connectThroughGateway(const RedisOptions& options) {
  auto fd = connectTcp(HostPort{options.host, options.port}, options.timeout);
  if (!fd.isOk()) return unreachable(options, fd.status().message());
  bool secure = tls::required();
  if (secure) {
    // hiredis 0.14 has no TLS: a relay thread speaks it; hiredis gets the plaintext end.
    fd = tls::relay(*fd, options.gatewayToken, false, options.timeout);
    if (!fd.isOk()) return unreachable(options, fd.status().message());
  }
  auto transport = secure ? handshake::Transport::kTls : handshake::Transport::kPlain;
  if (auto s = handshake::connectBlocking(*fd, options.gatewayToken, handshake::Purpose::kStore, transport,
                                          options.timeout);
      !s.isOk()) {
    ::close(*fd);
    if (!secure && s.code() == StatusCode::kFailedPrecondition) {  // the handshake's kTlsRequired
      tls::require();  // a --tls cluster: this process speaks TLS from now on
      return connectThroughGateway(options);
    }
    if (s.code() == StatusCode::kUnauthenticated) {
      return Status(s.code(), fmt::format("the store gateway at {}: {}", addressOf(options), s.message()));
    }
    return unreachable(options, s.message());
  }
  ContextPtr context(redisConnectFd(*fd));  // owns the descriptor from here on
  if (!context || context->err) return unreachable(options, contextError(context.get(), options));
  if (redisSetTimeout(context.get(), toTimeval(options.timeout)) != REDIS_OK) {
    return unreachable(options, contextError(context.get(), options));
  }
  return context;
}

}  // namespace

Result<ContextPtr> connectAndAuthenticate(const RedisOptions& options) {
  if (!options.gatewayToken.empty()) return connectThroughGateway(options);
  const timeval tv = toTimeval(options.timeout);
  ContextPtr context(redisConnectWithTimeout(options.host.c_str(), options.port, tv));
  if (!context || context->err) return unreachable(options, contextError(context.get(), options));
  // The connect timeout does not cover replies; without this a stalled server hangs us.
  if (redisSetTimeout(context.get(), tv) != REDIS_OK) {
    return unreachable(options, contextError(context.get(), options));
  }

  // A PING before AUTH tells us whether the server lets anyone in: cluster tokens and node
  // records would then be readable (and forgeable) by every local user.
  ReplyPtr ping(static_cast<redisReply*>(redisCommand(context.get(), "PING")));
  if (!ping) return unreachable(options, contextError(context.get(), options));
  if (ping->type != REDIS_REPLY_ERROR) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("Redis at {} accepts clients without a password; Troupe requires a "
                              "password-protected Redis (requirepass)",
                              addressOf(options)));
  }
  if (options.password.empty()) {
    return Status(StatusCode::kUnauthenticated,
                  fmt::format("Redis at {} requires a password and none was given; pass "
                              "--redis-password",
                              addressOf(options)));
  }
  ReplyPtr auth(static_cast<redisReply*>(redisCommand(
      context.get(), "AUTH %b", options.password.data(), options.password.size())));
  if (!auth) return unreachable(options, contextError(context.get(), options));
  if (auth->type == REDIS_REPLY_ERROR) {
    // The reply never contains the password, so it is safe to show.
    return Status(StatusCode::kUnauthenticated,
                  fmt::format("Redis at {} rejected the password ({}); check --redis-password",
                              addressOf(options), replyText(*auth)));
  }
  return context;
}

// Redis error replies as Status. Authentication errors can appear mid-session when Redis was
// restarted with another password.
Status replyError(const RedisOptions& options, const redisReply& reply, std::string_view what) {
  const std::string text = replyText(reply);
  if (startsWith(text, "NOAUTH") || startsWith(text, "WRONGPASS")) {
    return Status(StatusCode::kUnauthenticated,
                  fmt::format("Redis at {} refused {}: {}; check --redis-password",
                              addressOf(options), what, text));
  }
  if (startsWith(text, "LOADING") || startsWith(text, "BUSY") || startsWith(text, "MASTERDOWN")) {
    return Status(StatusCode::kUnavailable,
                  fmt::format("Redis at {} cannot serve {} right now: {}", addressOf(options),
                              what, text));
  }
  return Status(StatusCode::kInternal,
                fmt::format("Redis at {} rejected {}: {}", addressOf(options), what, text));
}

// HGETALL's flat [field, value, ...] array as a map.
Result<store_records::FieldMap> fieldMap(const redisReply& reply, const std::string& key) {
  if (reply.type != REDIS_REPLY_ARRAY || reply.elements % 2 != 0) {
    return store_records::malformed(key, "expected a hash");
  }
  store_records::FieldMap fields;
  for (size_t i = 0; i + 1 < reply.elements; i += 2) {
    fields[replyText(*reply.element[i])] = replyText(*reply.element[i + 1]);
  }
  return fields;
}

// The payload of the next "message" on a subscribed connection; nullopt once `deadline` passes
// or `wakeFd` (if >= 0) is readable. An error (its message says why) leaves the connection
// unusable. poll() on the socket instead of a socket read timeout: hiredis 0.14 marks a context
// unusable after any timed-out read, which would drop the subscription on every idle wait.
Result<std::optional<std::string>> nextPubSubMessage(redisContext* context, const RedisOptions& options,
                                                     std::chrono::steady_clock::time_point deadline, int wakeFd) {
  auto broken = [](std::string why) { return Status(StatusCode::kUnavailable, std::move(why)); };
  for (;;) {
    // Replies read along with an earlier one wait in hiredis' buffer, invisible to poll().
    void* raw = nullptr;
    if (redisGetReplyFromReader(context, &raw) != REDIS_OK) return broken(contextError(context, options));
    if (raw != nullptr) {
      ReplyPtr reply(static_cast<redisReply*>(raw));
      if (reply->type == REDIS_REPLY_ARRAY && reply->elements == 3 && replyText(*reply->element[0]) == "message") {
        return std::optional<std::string>(replyText(*reply->element[2]));
      }
      continue;  // subscribe confirmations and the like
    }
    auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return std::optional<std::string>();
    pollfd pfds[2] = {{context->fd, POLLIN, 0}, {wakeFd, POLLIN, 0}};
    int ready = ::poll(pfds, wakeFd >= 0 ? 2 : 1, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return broken(fmt::format("poll: {}", std::strerror(errno)));
    if (ready == 0 || (wakeFd >= 0 && pfds[1].revents != 0)) return std::optional<std::string>();
    if (redisBufferRead(context) != REDIS_OK) return broken(contextError(context, options));
  }
}

}  // namespace troupe::redis
