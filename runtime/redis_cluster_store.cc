// ClusterStore over Redis (hiredis, synchronous). This is the only file that spells a Redis key.
//
// Key layout, prefix P = "troupe:<cluster>:":
//   P meta            hash  {token, controller_address, controller_pid, created_ms}
//   P nodes           zset  node ids scored by registered_ms
//   P node:<id>       hash  {id, address, hostname, pid, is_head, state, total, used, labels,
//                            registered_ms, last_heartbeat_ms, death_reason}
//   P node_hb:<id>    string with a PX ttl: the heartbeat; its absence means the node missed it
//   P events          pub/sub channel of JSON {"type","node_id","reason","time_ms"}
//
// Every membership change runs as one Lua script, so the hash, the zset, the heartbeat key and
// the published event never disagree, even with several controllers reaping at once.
#include <hiredis/hiredis.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/time.h>

#include <charconv>
#include <cstring>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include "troupe/runtime/cluster_store.h"
#include "troupe/runtime/config.h"
#include "troupe/runtime/logging.h"

namespace troupe {

const char* nodeStateName(NodeState state) {
  switch (state) {
    case NodeState::kAlive: return "ALIVE";
    case NodeState::kDead: return "DEAD";
  }
  return "UNKNOWN";
}

const char* clusterEventTypeName(ClusterEventType type) {
  switch (type) {
    case ClusterEventType::kNodeAdded: return "NODE_ADDED";
    case ClusterEventType::kNodeDead: return "NODE_DEAD";
  }
  return "UNKNOWN";
}

namespace {

using json = nlohmann::json;

struct ContextDeleter {
  void operator()(redisContext* context) const { redisFree(context); }
};
using ContextPtr = std::unique_ptr<redisContext, ContextDeleter>;

struct ReplyDeleter {
  void operator()(redisReply* reply) const { freeReplyObject(reply); }
};
using ReplyPtr = std::unique_ptr<redisReply, ReplyDeleter>;

// hiredis writes with write(2): writing to a socket the server has already reset raises
// SIGPIPE, which kills a process that has not ignored it. Rather than change the process-wide
// disposition behind main()'s back, block it on this thread for one call and drop a SIGPIPE
// that the call itself raised (the write then fails with EPIPE, which hiredis reports).
class SigpipeBlock {
 public:
  SigpipeBlock() {
    sigset_t pending;
    sigemptyset(&pending);
    sigpending(&pending);
    wasPending_ = sigismember(&pending, SIGPIPE) == 1;
    sigset_t block;
    sigemptyset(&block);
    sigaddset(&block, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &block, &saved_);
  }
  ~SigpipeBlock() {
    if (!wasPending_) {
      sigset_t pending;
      sigemptyset(&pending);
      sigpending(&pending);
      if (sigismember(&pending, SIGPIPE) == 1) {
        sigset_t only;
        sigemptyset(&only);
        sigaddset(&only, SIGPIPE);
        timespec zero{};
        sigtimedwait(&only, nullptr, &zero);
      }
    }
    pthread_sigmask(SIG_SETMASK, &saved_, nullptr);
  }
  SigpipeBlock(const SigpipeBlock&) = delete;
  SigpipeBlock& operator=(const SigpipeBlock&) = delete;

 private:
  sigset_t saved_;
  bool wasPending_ = false;
};

timeval toTimeval(std::chrono::milliseconds ms) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(ms.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms.count() % 1000) * 1000);
  return tv;
}

std::string addressOf(const RedisOptions& options) {
  return fmt::format("{}:{}", options.host, options.port);
}

std::string replyText(const redisReply& reply) {
  return reply.str ? std::string(reply.str, reply.len) : std::string();
}

bool startsWith(const std::string& text, std::string_view prefix) {
  return text.compare(0, prefix.size(), prefix) == 0;
}

Status unreachable(const RedisOptions& options, const std::string& reason) {
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

// Connects, checks that the server demands a password, and authenticates.
Result<ContextPtr> connectAndAuthenticate(const RedisOptions& options) {
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

// One authenticated connection. Owned by one thread.
class RedisConnection {
 public:
  static Result<RedisConnection> open(const RedisOptions& options) {
    auto context = connectAndAuthenticate(options);
    if (!context) return context.status();
    return RedisConnection(options, std::move(context).value());
  }

  // Runs one command. On a broken connection it reconnects once and retries once: every
  // command this store sends may safely run twice (see the scripts), so a reply lost with the
  // connection costs nothing. `what` names the operation in error messages.
  Result<ReplyPtr> run(const std::vector<std::string>& args, std::string_view what) {
    SigpipeBlock sigpipe;
    std::string firstError = "not connected (an earlier reconnect failed)";
    if (context_) {
      ReplyPtr reply = send(args);
      if (reply) return checked(std::move(reply), what);
      firstError = contextError(context_.get(), options_);
      context_.reset();
    }
    auto fresh = connectAndAuthenticate(options_);
    if (!fresh) {
      return Status(fresh.status().code(),
                    fmt::format("lost the connection to Redis during {} ({}); reconnecting "
                                "failed: {}",
                                what, firstError, fresh.status().message()));
    }
    context_ = std::move(fresh).value();
    ReplyPtr reply = send(args);
    if (reply) return checked(std::move(reply), what);
    std::string secondError = contextError(context_.get(), options_);
    context_.reset();
    return unreachable(options_, fmt::format("{} failed twice ({}; after reconnecting: {})",
                                             what, firstError, secondError));
  }

 private:
  RedisConnection(const RedisOptions& options, ContextPtr context)
      : options_(options), context_(std::move(context)) {}

  ReplyPtr send(const std::vector<std::string>& args) {
    std::vector<const char*> argv;
    std::vector<size_t> lengths;
    argv.reserve(args.size());
    lengths.reserve(args.size());
    for (const auto& arg : args) {
      argv.push_back(arg.data());
      lengths.push_back(arg.size());
    }
    return ReplyPtr(static_cast<redisReply*>(redisCommandArgv(
        context_.get(), static_cast<int>(argv.size()), argv.data(), lengths.data())));
  }

  Result<ReplyPtr> checked(ReplyPtr reply, std::string_view what) {
    if (reply->type == REDIS_REPLY_ERROR) return replyError(options_, *reply, what);
    return reply;
  }

  RedisOptions options_;
  ContextPtr context_;  // null after a failed reconnect; the next run() tries again
};

// ---- Lua scripts. Each may run twice after a lost reply (RedisConnection::run retries). ----

// KEYS: node hash, nodes zset, heartbeat key.
// ARGV: ttl ms, registered ms, node id, events channel, NODE_ADDED message, then the hash's
// field/value pairs. Re-registering overwrites every field, so it is idempotent.
constexpr const char* kRegisterScript = R"lua(
redis.call('HSET', KEYS[1], unpack(ARGV, 6))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[1])
redis.call('PUBLISH', ARGV[4], ARGV[5])
return 1
)lua";

// KEYS: node hash, heartbeat key. ARGV: ttl ms, now ms.
// A node that is unknown or DEAD must not be revived by a late heartbeat: return 0, write nothing.
constexpr const char* kHeartbeatScript = R"lua(
if redis.call('HGET', KEYS[1], 'state') ~= 'ALIVE' then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[1])
redis.call('HSET', KEYS[1], 'last_heartbeat_ms', ARGV[2])
return 1
)lua";

// KEYS: nodes zset. ARGV: node hash prefix, heartbeat key prefix, events channel, now ms.
// The keys it touches depend on the zset's contents, so they cannot all be declared in KEYS;
// fine for a single Redis (not Redis Cluster).
// TODO(perf): walks every node ever registered; keep a set of ALIVE ids once clusters see
// thousands of node restarts.
constexpr const char* kReapScript = R"lua(
local now = tonumber(ARGV[4])
local dead = {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local nodeKey = ARGV[1] .. id
  if redis.call('HGET', nodeKey, 'state') == 'ALIVE' and
     redis.call('EXISTS', ARGV[2] .. id) == 0 then
    local last = tonumber(redis.call('HGET', nodeKey, 'last_heartbeat_ms')) or now
    local reason = 'missed heartbeats: no heartbeat for ' .. string.format('%d', now - last) ..
                   ' ms (heartbeat TTL expired)'
    redis.call('HSET', nodeKey, 'state', 'DEAD', 'death_reason', reason)
    redis.call('PUBLISH', ARGV[3], cjson.encode({type = 'NODE_DEAD', node_id = id,
                                                 reason = reason, time_ms = now}))
    table.insert(dead, id)
  end
end
return dead
)lua";

// KEYS: node hash, heartbeat key. ARGV: events channel, node id, reason, now ms.
// Returns -1 for an unknown node, 0 when it was already DEAD (nothing written or published).
constexpr const char* kMarkDeadScript = R"lua(
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return -1 end
if state ~= 'ALIVE' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'DEAD', 'death_reason', ARGV[3])
redis.call('DEL', KEYS[2])
redis.call('PUBLISH', ARGV[1], cjson.encode({type = 'NODE_DEAD', node_id = ARGV[2],
                                             reason = ARGV[3], time_ms = tonumber(ARGV[4])}))
return 1
)lua";

// KEYS: nodes zset. ARGV: node hash prefix. One consistent snapshot in one round trip.
constexpr const char* kListScript = R"lua(
local out = {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local fields = redis.call('HGETALL', ARGV[1] .. id)
  if #fields > 0 then table.insert(out, fields) end
end
return out
)lua";

// ---- Encoding ----

Status malformed(const std::string& key, const std::string& detail) {
  return Status(StatusCode::kInternal,
                fmt::format("malformed record at Redis key '{}': {}; was it written by another "
                            "Troupe version?",
                            key, detail));
}

bool parseInt64(const std::string& text, int64_t& out) {
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, out);
  return ec == std::errc() && ptr == end;
}

using FieldMap = std::map<std::string, std::string>;

// HGETALL's flat [field, value, ...] array as a map.
Result<FieldMap> fieldMap(const redisReply& reply, const std::string& key) {
  if (reply.type != REDIS_REPLY_ARRAY || reply.elements % 2 != 0) {
    return malformed(key, "expected a hash");
  }
  FieldMap fields;
  for (size_t i = 0; i + 1 < reply.elements; i += 2) {
    fields[replyText(*reply.element[i])] = replyText(*reply.element[i + 1]);
  }
  return fields;
}

std::string eventMessage(ClusterEventType type, const NodeId& id, const std::string& reason,
                         int64_t timeMs) {
  return json{{"type", clusterEventTypeName(type)},
              {"node_id", id.hex()},
              {"reason", reason},
              {"time_ms", timeMs}}
      .dump();
}

std::optional<ClusterEvent> parseEventMessage(const std::string& text) {
  try {
    json j = json::parse(text);
    ClusterEvent event;
    const std::string type = j.at("type").get<std::string>();
    if (type == clusterEventTypeName(ClusterEventType::kNodeAdded)) {
      event.type = ClusterEventType::kNodeAdded;
    } else if (type == clusterEventTypeName(ClusterEventType::kNodeDead)) {
      event.type = ClusterEventType::kNodeDead;
    } else {
      return std::nullopt;
    }
    event.nodeId = NodeId(j.at("node_id").get<std::string>());
    event.reason = j.value("reason", "");
    // cjson (inside Lua) may write the time as a float; accept any number.
    event.timeMs = static_cast<int64_t>(j.at("time_ms").get<double>());
    return event;
  } catch (const json::exception&) {
    return std::nullopt;
  }
}

class RedisEventSubscription final : public EventSubscription {
 public:
  RedisEventSubscription(RedisOptions options, ContextPtr context)
      : options_(std::move(options)), context_(std::move(context)) {}

  // poll() on the socket instead of a socket read timeout: hiredis 0.14 marks a context
  // unusable after any timed-out read, which would drop the subscription on every idle wait.
  Result<std::optional<ClusterEvent>> next(std::chrono::milliseconds timeout) override {
    if (!context_) return lost("the subscription failed earlier");
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      // Replies read along with an earlier one wait in hiredis' buffer, invisible to poll().
      void* raw = nullptr;
      if (redisGetReplyFromReader(context_.get(), &raw) != REDIS_OK) {
        return lost(contextError(context_.get(), options_));
      }
      if (raw != nullptr) {
        ReplyPtr reply(static_cast<redisReply*>(raw));
        if (auto event = decode(*reply)) return event;
        continue;
      }
      auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline -
                                                               std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::optional<ClusterEvent>();
      pollfd pfd{context_->fd, POLLIN, 0};
      int ready = ::poll(&pfd, 1, static_cast<int>(left.count()));
      if (ready < 0 && errno == EINTR) continue;
      if (ready < 0) return lost(fmt::format("poll: {}", std::strerror(errno)));
      if (ready == 0) return std::optional<ClusterEvent>();
      if (redisBufferRead(context_.get()) != REDIS_OK) {
        return lost(contextError(context_.get(), options_));
      }
    }
  }

 private:
  // Events published while disconnected are gone, so the subscription is not silently
  // re-established: the caller must resubscribe and re-read listNodes().
  Status lost(const std::string& reason) {
    context_.reset();
    return Status(StatusCode::kUnavailable,
                  fmt::format("lost the event subscription to Redis at {} ({}); events may have "
                              "been missed: subscribe() again and re-read listNodes()",
                              addressOf(options_), reason));
  }

  std::optional<ClusterEvent> decode(const redisReply& reply) {
    if (reply.type != REDIS_REPLY_ARRAY || reply.elements != 3 ||
        replyText(*reply.element[0]) != "message") {
      return std::nullopt;  // subscribe confirmations and the like
    }
    const std::string payload = replyText(*reply.element[2]);
    auto event = parseEventMessage(payload);
    if (!event) {
      // Not actionable by the subscriber; the stream stays usable.
      TROUPE_LOG(kWarning, "ignoring a malformed cluster event from Redis at {}: {}",
                 addressOf(options_), payload);
    }
    return event;
  }

  RedisOptions options_;
  ContextPtr context_;
};

class RedisClusterStore final : public ClusterStore {
 public:
  RedisClusterStore(const RedisOptions& options, RedisConnection connection)
      : options_(options),
        prefix_(fmt::format("troupe:{}:", options.cluster)),
        connection_(std::move(connection)) {}

  Status putMeta(const ClusterMeta& meta) override {
    auto reply = connection_.run({"HSET", metaKey(), "token", meta.token, "controller_address",
                                  meta.controllerAddress, "controller_pid",
                                  std::to_string(meta.controllerPid), "created_ms",
                                  std::to_string(meta.createdMs)},
                                 "putMeta");
    return reply ? Status::ok() : reply.status();
  }

  Result<std::optional<ClusterMeta>> getMeta() override {
    auto reply = connection_.run({"HGETALL", metaKey()}, "getMeta");
    if (!reply) return reply.status();
    auto fields = fieldMap(**reply, metaKey());
    if (!fields) return fields.status();
    if (fields->empty()) return std::optional<ClusterMeta>();
    ClusterMeta meta;
    meta.token = (*fields)["token"];
    meta.controllerAddress = (*fields)["controller_address"];
    if (!parseInt64((*fields)["controller_pid"], meta.controllerPid) ||
        !parseInt64((*fields)["created_ms"], meta.createdMs)) {
      return malformed(metaKey(), "controller_pid or created_ms is not an integer");
    }
    return std::optional<ClusterMeta>(std::move(meta));
  }

  Status registerNode(const NodeRecord& node, std::chrono::milliseconds ttl) override {
    TROUPE_RETURN_IF_ERROR(checkNodeArgs(node.id, ttl));
    const int64_t now = wallClockMs();
    const int64_t registeredMs = node.registeredMs != 0 ? node.registeredMs : now;
    std::vector<std::string> args = {
        "EVAL",
        kRegisterScript,
        "3",
        nodeKey(node.id),
        nodesKey(),
        heartbeatKey(node.id),
        std::to_string(ttl.count()),
        std::to_string(registeredMs),
        node.id.hex(),
        eventsChannel(),
        eventMessage(ClusterEventType::kNodeAdded, node.id, "", now),
        "id", node.id.hex(),
        "address", node.address,
        "hostname", node.hostname,
        "pid", std::to_string(node.pid),
        "is_head", node.isHead ? "1" : "0",
        "state", nodeStateName(NodeState::kAlive),
        "total", json(node.total).dump(),
        "used", json(node.used).dump(),
        "labels", json(node.labels).dump(),
        "registered_ms", std::to_string(registeredMs),
        // The store, not the caller, records when it last heard from the node.
        "last_heartbeat_ms", std::to_string(now),
        "death_reason", "",
    };
    auto reply = connection_.run(args, "registerNode");
    return reply ? Status::ok() : reply.status();
  }

  Result<bool> heartbeat(const NodeId& id, std::chrono::milliseconds ttl) override {
    TROUPE_RETURN_IF_ERROR(checkNodeArgs(id, ttl));
    auto reply = connection_.run({"EVAL", kHeartbeatScript, "2", nodeKey(id), heartbeatKey(id),
                                  std::to_string(ttl.count()), std::to_string(wallClockMs())},
                                 "heartbeat");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_INTEGER) return unexpected("heartbeat", **reply);
    return (*reply)->integer == 1;
  }

  Result<std::optional<NodeRecord>> getNode(const NodeId& id) override {
    if (id.empty()) return emptyId();
    auto reply = connection_.run({"HGETALL", nodeKey(id)}, "getNode");
    if (!reply) return reply.status();
    auto fields = fieldMap(**reply, nodeKey(id));
    if (!fields) return fields.status();
    if (fields->empty()) return std::optional<NodeRecord>();
    auto node = decodeNode(*fields, nodeKey(id));
    if (!node) return node.status();
    return std::optional<NodeRecord>(std::move(node).value());
  }

  Result<std::vector<NodeRecord>> listNodes() override {
    auto reply = connection_.run({"EVAL", kListScript, "1", nodesKey(), nodeKeyPrefix()},
                                 "listNodes");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_ARRAY) return unexpected("listNodes", **reply);
    std::vector<NodeRecord> nodes;
    nodes.reserve((*reply)->elements);
    for (size_t i = 0; i < (*reply)->elements; ++i) {
      auto fields = fieldMap(*(*reply)->element[i], nodeKeyPrefix() + "*");
      if (!fields) return fields.status();
      auto node = decodeNode(*fields, nodeKeyPrefix() + (*fields)["id"]);
      if (!node) return node.status();
      nodes.push_back(std::move(node).value());
    }
    return nodes;
  }

  Result<std::vector<NodeId>> reapExpiredNodes() override {
    auto reply = connection_.run({"EVAL", kReapScript, "1", nodesKey(), nodeKeyPrefix(),
                                  heartbeatKeyPrefix(), eventsChannel(),
                                  std::to_string(wallClockMs())},
                                 "reapExpiredNodes");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_ARRAY) return unexpected("reapExpiredNodes", **reply);
    std::vector<NodeId> dead;
    for (size_t i = 0; i < (*reply)->elements; ++i) {
      dead.emplace_back(replyText(*(*reply)->element[i]));
    }
    return dead;
  }

  Status markNodeDead(const NodeId& id, const std::string& reason) override {
    if (id.empty()) return emptyId();
    auto reply = connection_.run({"EVAL", kMarkDeadScript, "2", nodeKey(id), heartbeatKey(id),
                                  eventsChannel(), id.hex(), reason,
                                  std::to_string(wallClockMs())},
                                 "markNodeDead");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_INTEGER) return unexpected("markNodeDead", **reply);
    if ((*reply)->integer < 0) {
      return Status(StatusCode::kNotFound,
                    fmt::format("node {} is not registered in cluster '{}'", id.hex(),
                                options_.cluster));
    }
    return Status::ok();
  }

  Result<std::unique_ptr<EventSubscription>> subscribe() override {
    auto context = connectAndAuthenticate(options_);
    if (!context) return context.status();
    SigpipeBlock sigpipe;
    const std::string channel = eventsChannel();
    ReplyPtr reply(static_cast<redisReply*>(
        redisCommand(context->get(), "SUBSCRIBE %b", channel.data(), channel.size())));
    if (!reply) return unreachable(options_, contextError(context->get(), options_));
    if (reply->type == REDIS_REPLY_ERROR) return replyError(options_, *reply, "SUBSCRIBE");
    // Only after this confirmation is every later PUBLISH guaranteed to reach us.
    if (reply->type != REDIS_REPLY_ARRAY || reply->elements < 1 ||
        replyText(*reply->element[0]) != "subscribe") {
      return unexpected("SUBSCRIBE", *reply);
    }
    return std::unique_ptr<EventSubscription>(
        std::make_unique<RedisEventSubscription>(options_, std::move(context).value()));
  }

 private:
  std::string metaKey() const { return prefix_ + "meta"; }
  std::string nodesKey() const { return prefix_ + "nodes"; }
  std::string nodeKeyPrefix() const { return prefix_ + "node:"; }
  std::string nodeKey(const NodeId& id) const { return nodeKeyPrefix() + id.hex(); }
  std::string heartbeatKeyPrefix() const { return prefix_ + "node_hb:"; }
  std::string heartbeatKey(const NodeId& id) const { return heartbeatKeyPrefix() + id.hex(); }
  std::string eventsChannel() const { return prefix_ + "events"; }

  static Status emptyId() {
    return Status(StatusCode::kInvalidArgument, "empty node id");
  }

  static Status checkNodeArgs(const NodeId& id, std::chrono::milliseconds ttl) {
    if (id.empty()) return emptyId();
    if (ttl.count() <= 0) {
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("heartbeat ttl must be positive, got {} ms", ttl.count()));
    }
    return Status::ok();
  }

  Status unexpected(std::string_view what, const redisReply& reply) const {
    return Status(StatusCode::kInternal,
                  fmt::format("unexpected reply type {} from Redis at {} to {}", reply.type,
                              addressOf(options_), what));
  }

  static Result<NodeRecord> decodeNode(FieldMap& fields, const std::string& key) {
    NodeRecord node;
    node.id = NodeId(fields["id"]);
    node.address = fields["address"];
    node.hostname = fields["hostname"];
    node.isHead = fields["is_head"] == "1";
    node.deathReason = fields["death_reason"];
    const std::string& state = fields["state"];
    if (state == nodeStateName(NodeState::kAlive)) {
      node.state = NodeState::kAlive;
    } else if (state == nodeStateName(NodeState::kDead)) {
      node.state = NodeState::kDead;
    } else {
      return malformed(key, fmt::format("state '{}' is neither ALIVE nor DEAD", state));
    }
    if (!parseInt64(fields["pid"], node.pid) ||
        !parseInt64(fields["registered_ms"], node.registeredMs) ||
        !parseInt64(fields["last_heartbeat_ms"], node.lastHeartbeatMs)) {
      return malformed(key, "pid, registered_ms or last_heartbeat_ms is not an integer");
    }
    try {
      node.total = json::parse(fields["total"]).get<Resources>();
      node.used = json::parse(fields["used"]).get<Resources>();
      node.labels = json::parse(fields["labels"]).get<std::map<std::string, std::string>>();
    } catch (const json::exception& e) {
      return malformed(key, fmt::format("total, used or labels is not a JSON object: {}",
                                        e.what()));
    }
    return node;
  }

  RedisOptions options_;
  std::string prefix_;
  RedisConnection connection_;
};

}  // namespace

Result<std::unique_ptr<ClusterStore>> connectRedisStore(const RedisOptions& options) {
  if (options.cluster.empty()) {
    return Status(StatusCode::kInvalidArgument, "empty cluster name; pass --cluster NAME");
  }
  if (options.timeout.count() <= 0) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("Redis timeout must be positive, got {} ms", options.timeout.count()));
  }
  auto connection = RedisConnection::open(options);
  if (!connection) return connection.status();
  return std::unique_ptr<ClusterStore>(
      std::make_unique<RedisClusterStore>(options, std::move(connection).value()));
}

}  // namespace troupe
