// ClusterStore over Redis (hiredis, synchronous). This is the only file that spells a Redis key.
//
// Key layout, prefix P = "troupe:<cluster>:":
//   P meta             hash  {token, controller_address, controller_pid, created_ms}
//   P nodes            zset  node ids scored by registered_ms
//   P node:<id>        hash  {id, address, hostname, pid, is_head, state, total, used, labels,
//                             registered_ms, last_heartbeat_ms, heartbeat_ttl_ms, death_reason}; total, used and
//                             labels are JSON objects. While the node has claims, `used` is their
//                             sum (every name in total, 0 if unclaimed), rewritten by each script
//                             that changes the claims or re-registers the node.
//   P node_hb:<id>     string with a PX ttl: the heartbeat; its absence means the node missed it
//   P sessions         hash  session id -> "host pid": drivers' open sessions (owners of actors)
//   P store_run        hash  {run_id, since_ms}: the Redis process that serves, and since when (its
//                             clock): nodes are not judged until it has served one heartbeat TTL
//   P node_res:<id>    hash  holder -> JSON resources: the claims on the node (reserve/release)
//   P actors           zset  actor ids scored by created_ms
//   P actor:<id>       hash  {id, type, name, node_id, pid, address, state, incarnation,
//                             restarts, max_restarts, max_task_retries, detached, owner, resources (JSON),
//                             init_args (raw bytes), placement_group, bundle_index, death_reason,
//                             created_ms, updated_ms}
//   P dead_nodes       zset  the ids of DEAD nodes scored by death time: the newest
//                             RedisOptions::keepDeadNodes are kept, older records deleted
//   P live_actors      zset  the ids of actors not DEAD, scored by created_ms (what scans read)
//   P dead_actors      zset  the ids of DEAD actors scored by updated_ms: the newest
//                             RedisOptions::keepDeadActors are kept, older records deleted
//   P actor_name:<name> string: the id of the actor holding the name
//   P pgs              zset  placement group ids scored by created_ms
//   P pg:<id>          hash  {id, name, strategy, state, pending_reason, created_ms,
//                             bundles (JSON array of {"resources": {...}, "node_id": "..."})}
//   P events           pub/sub channel of JSON {"type","node_id","reason","time_ms"}
//   P group_epoch:<group>        string: the collective group's epoch (absent: 0)
//   P group_epoch_events:<group> pub/sub channel: each advance publishes the new epoch (decimal)
//   P rendezvous:<group>:<epoch> hash rank -> opaque value (a communicator's address, an NCCL
//                                unique id), PEXPIRE'd by every write; the epoch is the text
//                                after the last ':', so group names may hold ':'
//   P egroups          zset  elastic group ids scored by created_ms
//   P egroup:<id>      string: the group's JSON document, written by its driver
//   P egroup_events:<id> list of event lines, the newest kMaxGroupEvents
//
// Every membership or claim change runs as one Lua script, so the hashes, the zsets, the
// heartbeat key and the published event never disagree, even with several controllers at once.
// Every argument travels with an explicit length (redisCommandArgv), so init_args may hold NULs.
#include <hiredis/hiredis.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <pthread.h>
#include <signal.h>
#include <sys/time.h>

#include <atomic>
#include <charconv>
#include <unordered_map>
#include <cmath>
#include <cstring>
#include <set>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include "store_args.h"
#include "store_records.h"
#include "handshake.h"
#include "troupe/runtime/tls.h"
#include "troupe/runtime/cluster_store.h"
#include "troupe/runtime/config.h"
#include "troupe/runtime/logging.h"
#include "troupe/runtime/process.h"

namespace troupe {

using store_args::checkNameArgs;
using store_args::checkNodeArgs;
using store_args::checkReservations;
using store_args::emptyArgument;
using store_args::emptyId;
using store_records::bundlesJson;
using store_records::eventMessage;
using store_records::malformed;
using store_records::parseActorState;
using store_records::parseBundlesJson;
using store_records::parseEventMessage;
using store_records::parseInteger;
using store_records::parsePlacementGroupState;

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
  if (auto s = handshake::connectBlocking(*fd, options.gatewayToken, handshake::Purpose::kStore, options.timeout);
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

  std::unordered_map<std::string, std::string> shas_;  // script text -> SHA1 in Redis's cache

  // Scripts travel once (SCRIPT LOAD) and then by their SHA1 (EVALSHA): each EVAL would send
  // and hash the whole script on every call. A Redis that lost its script cache (restarted)
  // answers NOSCRIPT, and the script is loaded again.
  ReplyPtr send(const std::vector<std::string>& args) {
    if (args.size() < 2 || args[0] != "EVAL") return sendRaw(args);
    for (int attempt = 0; attempt < 2; ++attempt) {
      auto sha = shas_.find(args[1]);
      if (sha == shas_.end()) {
        ReplyPtr loaded = sendRaw({"SCRIPT", "LOAD", args[1]});
        if (!loaded || loaded->type != REDIS_REPLY_STRING) return loaded;
        sha = shas_.emplace(args[1], std::string(loaded->str, loaded->len)).first;
      }
      std::vector<std::string> bySha = args;
      bySha[0] = "EVALSHA";
      bySha[1] = sha->second;
      ReplyPtr reply = sendRaw(bySha);
      if (reply && reply->type == REDIS_REPLY_ERROR && std::string_view(reply->str, reply->len).rfind("NOSCRIPT", 0) == 0) {
        shas_.erase(sha);
        continue;
      }
      return reply;
    }
    return sendRaw(args);
  }

  ReplyPtr sendRaw(const std::vector<std::string>& args) {
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

// Defines recomputeUsed(nodeKey, claimsKey): rewrites the node's `used` as the sum of its
// claims, listing every resource in `total` (0 when unclaimed). Prepended to the scripts that
// change claims. The JSON is built by hand because cjson writes numbers with 14 significant
// digits, which would turn a sum of exact claims into a `used` that no longer adds up.
// TODO(correctness): sums follow the hash's field order while the fake sums in holder order;
// for quantities that are not exact binary fractions `used` may then differ in the last bit.
constexpr const char* kRecomputeUsedLua = R"lua(
local function recomputeUsed(nodeKey, claimsKey)
  local used = {}
  for name, _ in pairs(cjson.decode(redis.call('HGET', nodeKey, 'total') or '{}')) do
    used[name] = 0
  end
  local claims = redis.call('HGETALL', claimsKey)
  for j = 2, #claims, 2 do
    for name, amount in pairs(cjson.decode(claims[j])) do
      used[name] = (used[name] or 0) + amount
    end
  end
  local parts = {}
  for name, amount in pairs(used) do
    table.insert(parts, cjson.encode(name) .. ':' .. string.format('%.17g', amount))
  end
  redis.call('HSET', nodeKey, 'used', '{' .. table.concat(parts, ',') .. '}')
end
)lua";

// KEYS: node hash, nodes zset, heartbeat key, claims hash, store-run hash, dead-nodes zset.
// ARGV: ttl ms, registered ms, node id, events channel, NODE_ADDED message, then the hash's
// field/value pairs. Re-registering overwrites every field, so it is idempotent. A node that
// still holds claims (re-registered without restarting) keeps `used` equal to their sum.
constexpr const char* kRegisterBody = R"lua(
storeUpMs(KEYS[5])
redis.call('ZREM', KEYS[6], ARGV[3])
redis.call('HSET', KEYS[1], unpack(ARGV, 6))
if redis.call('EXISTS', KEYS[4]) == 1 then recomputeUsed(KEYS[1], KEYS[4]) end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[1])
redis.call('PUBLISH', ARGV[4], ARGV[5])
return 1
)lua";

// How long this Redis process has served, as its clients saw it: each run of the server has
// its own run_id, and the first script to see a new one records when. (uptime_in_seconds is
// too coarse, and a restart from the AOF brings back the keys, so they cannot tell.)
constexpr const char* kStoreUpLua = R"lua(
local function storeUpMs(runKey)
  local clock = redis.call('TIME')
  local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
  local run = string.match(redis.call('INFO', 'server'), 'run_id:(%w+)')
  local seen = redis.call('HMGET', runKey, 'run_id', 'since_ms')
  if seen[1] ~= run then
    redis.call('HSET', runKey, 'run_id', run, 'since_ms', now)
    return 0
  end
  return now - tonumber(seen[2])
end
)lua";

// Records that node `id` died, and deletes the oldest DEAD nodes beyond `keep` (their hash and
// claims), so listings and reaps cost what is alive plus a bounded history.
constexpr const char* kBuryNodeLua = R"lua(
local function buryNode(deadKey, nodesKey, nodePrefix, claimsPrefix, id, now, keep)
  redis.call('ZADD', deadKey, now, id)
  local extra = redis.call('ZCARD', deadKey) - keep
  if extra > 0 then
    for _, old in ipairs(redis.call('ZRANGE', deadKey, 0, extra - 1)) do
      redis.call('DEL', nodePrefix .. old, claimsPrefix .. old)
      redis.call('ZREM', nodesKey, old)
    end
    redis.call('ZREMRANGEBYRANK', deadKey, 0, extra - 1)
  end
end
)lua";

// KEYS: node hash, heartbeat key, store-run hash. ARGV: ttl ms, now ms.
// A node that is unknown or DEAD must not be revived by a late heartbeat: return 0, write nothing.
constexpr const char* kHeartbeatBody = R"lua(
storeUpMs(KEYS[3])
if redis.call('HGET', KEYS[1], 'state') ~= 'ALIVE' then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[1])
redis.call('HSET', KEYS[1], 'last_heartbeat_ms', ARGV[2], 'heartbeat_ttl_ms', ARGV[1])
return 1
)lua";

// KEYS: nodes zset, store-run hash, dead-nodes zset, meta hash. ARGV: node hash prefix,
// heartbeat key prefix, events channel, now ms, claims prefix, DEAD nodes to keep.
// The keys it touches depend on the zset's contents, so they cannot all be declared in KEYS;
// fine for a single Redis (not Redis Cluster).
// Missed heartbeats are deaths only while the store could take them: a node is judged only
// once this Redis process has served, and reaps have run without a gap of more than 1.5 s,
// for a whole heartbeat TTL. So a Redis restarted from its AOF (expired heartbeat keys come
// back), a stalled Redis (a reap that waited in its queue) and a controller that was away
// leave every node a TTL to beat again.
constexpr const char* kReapBody = R"lua(
local now = tonumber(ARGV[4])
local up = storeUpMs(KEYS[2])
local clock = redis.call('TIME')
local serverNow = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local last = tonumber(redis.call('HGET', KEYS[2], 'last_reap_ms'))
local since = tonumber(redis.call('HGET', KEYS[2], 'reaping_since_ms'))
if last == nil or since == nil then since = serverNow - up
elseif serverNow - last > 1500 then since = serverNow end
redis.call('HSET', KEYS[2], 'last_reap_ms', serverNow, 'reaping_since_ms', since)
local judged = math.min(up, serverNow - since)
-- Every node but the head's beats through the store gateway: a restarted gateway gives them a TTL too.
local gatewaySince = tonumber(redis.call('HGET', KEYS[4], 'store_gateway_since_ms'))
local judgedRemote = gatewaySince and math.min(judged, serverNow - gatewaySince) or judged
local dead = {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local nodeKey = ARGV[1] .. id
  if redis.call('HGET', nodeKey, 'state') == 'ALIVE' and
     redis.call('EXISTS', ARGV[2] .. id) == 0 and
     (redis.call('HGET', nodeKey, 'is_head') == '1' and judged or judgedRemote) >=
       (tonumber(redis.call('HGET', nodeKey, 'heartbeat_ttl_ms')) or 0) then
    local last = tonumber(redis.call('HGET', nodeKey, 'last_heartbeat_ms')) or now
    local reason = 'missed heartbeats: no heartbeat for ' .. string.format('%d', now - last) ..
                   ' ms (heartbeat TTL expired)'
    redis.call('HSET', nodeKey, 'state', 'DEAD', 'death_reason', reason)
    redis.call('PUBLISH', ARGV[3], cjson.encode({type = 'NODE_DEAD', node_id = id,
                                                 reason = reason, time_ms = now}))
    table.insert(dead, id)
  end
end
for _, id in ipairs(dead) do
  buryNode(KEYS[3], KEYS[1], ARGV[1], ARGV[5], id, now, tonumber(ARGV[6]))
end
return dead
)lua";

// KEYS: node hash, heartbeat key, nodes zset, dead-nodes zset. ARGV: events channel, node id,
// reason, now ms, node hash prefix, claims prefix, DEAD nodes to keep.
// Returns -1 for an unknown node, 0 when it was already DEAD (nothing written or published).
constexpr const char* kMarkDeadBody = R"lua(
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return -1 end
if state ~= 'ALIVE' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'DEAD', 'death_reason', ARGV[3])
redis.call('DEL', KEYS[2])
buryNode(KEYS[4], KEYS[3], ARGV[5], ARGV[6], ARGV[2], tonumber(ARGV[4]), tonumber(ARGV[7]))
redis.call('PUBLISH', ARGV[1], cjson.encode({type = 'NODE_DEAD', node_id = ARGV[2],
                                             reason = ARGV[3], time_ms = tonumber(ARGV[4])}))
return 1
)lua";

// KEYS: an index zset (nodes, actors, pgs). ARGV: the prefix of its record hashes.
// One consistent snapshot in one round trip, in zset order (score, then id).
// ARGV[2]: a field left out of every record ('' for none).
constexpr const char* kListScript = R"lua(
local out = {}
local skip = ARGV[2]
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local fields = redis.call('HGETALL', ARGV[1] .. id)
  if skip ~= '' then
    for i = 1, #fields, 2 do
      if fields[i] == skip then
        table.remove(fields, i)
        table.remove(fields, i)
        break
      end
    end
  end
  if #fields > 0 then table.insert(out, fields) end
end
return out
)lua";

// KEYS: the actors zset. ARGV: key prefix, state ('' any), node id prefix ('' any), offset,
// limit. Returns {state/count pairs of every actor, how many pass the filters, the page's
// records without init_args}. Only the page's records are read whole.
constexpr const char* kListActorsPageScript = R"lua(
local counts, page, matching = {}, {}, 0
local first = tonumber(ARGV[4])
local last = first + tonumber(ARGV[5])
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local key = ARGV[1] .. id
  local f = redis.call('HMGET', key, 'state', 'node_id')
  if f[1] then
    counts[f[1]] = (counts[f[1]] or 0) + 1
    if (ARGV[2] == '' or f[1] == ARGV[2]) and (ARGV[3] == '' or string.sub(f[2] or '', 1, #ARGV[3]) == ARGV[3]) then
      if matching >= first and matching < last then
        local fields = redis.call('HGETALL', key)
        for i = 1, #fields, 2 do
          if fields[i] == 'init_args' then
            table.remove(fields, i)
            table.remove(fields, i)
            break
          end
        end
        table.insert(page, fields)
      end
      matching = matching + 1
    end
  end
end
local flat = {}
for state, n in pairs(counts) do
  table.insert(flat, state)
  table.insert(flat, n)
end
return {flat, matching, page}
)lua";

// reserveClaims(keys, argv, k, a, n): claim i (1..n) has its node hash and that node's claims
// hash at keys[k + 2i - 1], keys[k + 2i], and its holder and resources (a JSON object) at
// argv[a + 2i - 1], argv[a + 2i]. All or nothing: checks every node first and returns false
// without writing when one refuses. A holder's new claim replaces its old one, so its old
// amount does not count against it. The caller guarantees each (node, holder) pair appears once.
constexpr const char* kReserveClaimsLua = R"lua(
local function reserveClaims(keys, argv, k, a, n)
  local eps = 1e-9
  local nodes, order = {}, {}
  for i = 1, n do
    local nodeKey = keys[k + 2 * i - 1]
    local node = nodes[nodeKey]
    if not node then
      node = {claimsKey = keys[k + 2 * i], holders = {}, demand = {}}
      nodes[nodeKey] = node
      table.insert(order, nodeKey)
    end
    node.holders[argv[a + 2 * i - 1]] = argv[a + 2 * i]
    for name, amount in pairs(cjson.decode(argv[a + 2 * i])) do
      node.demand[name] = (node.demand[name] or 0) + amount
    end
  end
  for _, nodeKey in ipairs(order) do
    local node = nodes[nodeKey]
    if redis.call('HGET', nodeKey, 'state') ~= 'ALIVE' then return false end
    local total = cjson.decode(redis.call('HGET', nodeKey, 'total') or '{}')
    local others = {}
    local claims = redis.call('HGETALL', node.claimsKey)
    for j = 1, #claims, 2 do
      if node.holders[claims[j]] == nil then
        for name, amount in pairs(cjson.decode(claims[j + 1])) do
          others[name] = (others[name] or 0) + amount
        end
      end
    end
    for name, amount in pairs(node.demand) do
      if amount > 0 and (others[name] or 0) + amount > (total[name] or 0) + eps then return false end
    end
  end
  for _, nodeKey in ipairs(order) do
    local node = nodes[nodeKey]
    for holder, resources in pairs(node.holders) do
      redis.call('HSET', node.claimsKey, holder, resources)
    end
    recomputeUsed(nodeKey, node.claimsKey)
  end
  return true
end
)lua";

// KEYS: per reservation, its node hash and claims hash. ARGV: per reservation, holder, resources.
constexpr const char* kReserveBody = R"lua(
if reserveClaims(KEYS, ARGV, 0, 0, #KEYS / 2) then return 1 end
return 0
)lua";

// KEYS: group hash, groups zset, pending-groups set, then per claim its node hash and claims
// hash. ARGV: claim count, created ms, id, state, per claim its holder and resources, then the
// hash's field/value pairs. Returns the existing record's fields for a group that exists
// (nothing written), 0 when a claim does not fit (nothing written), 1 when created.
constexpr const char* kCreateGroupBody = R"lua(
if redis.call('EXISTS', KEYS[1]) == 1 then return redis.call('HGETALL', KEYS[1]) end
local n = tonumber(ARGV[1])
if n > 0 and not reserveClaims(KEYS, ARGV, 3, 4, n) then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 5 + 2 * n))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
if ARGV[4] == 'PENDING' then redis.call('SADD', KEYS[3], ARGV[3]) end
return 1
)lua";

// KEYS: group hash, groups zset, pending-groups set, the group's live-actors set, waiting-actors
// set. ARGV: id, claims-hash prefix, node-hash prefix. Returns {outcome, waiting}: outcome 0 not
// found, 1 removed (record deleted, bundles' claims released), 2 it has live actors (nothing
// done); waiting: how many groups and actors wait for resources.
constexpr const char* kRemoveGroupBody = R"lua(
local waiting = function() return redis.call('SCARD', KEYS[3]) + redis.call('SCARD', KEYS[5]) end
local bundles = redis.call('HGET', KEYS[1], 'bundles')
if not bundles then return {0, waiting()} end
if redis.call('SCARD', KEYS[4]) > 0 then return {2, waiting()} end
local changed = {}
for i, bundle in ipairs(cjson.decode(bundles)) do
  local node = bundle['node_id']
  if type(node) == 'string' and node ~= '' then
    local claims = ARGV[2] .. node
    if redis.call('HDEL', claims, 'pg:' .. ARGV[1] .. ':' .. (i - 1)) == 1 then changed[node] = claims end
  end
end
for node, claims in pairs(changed) do
  local nodeKey = ARGV[3] .. node
  if redis.call('EXISTS', nodeKey) == 1 then recomputeUsed(nodeKey, claims) end
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[1])
return {1, waiting()}
)lua";

// KEYS: group hash, groups zset, pending-groups set. ARGV: created ms, id, state, then the
// hash's field/value pairs. Replaces the whole record and keeps the pending index true.
constexpr const char* kPutGroupScript = R"lua(
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[2])
if ARGV[3] == 'PENDING' then redis.call('SADD', KEYS[3], ARGV[2]) else redis.call('SREM', KEYS[3], ARGV[2]) end
return 1
)lua";

// KEYS: a set of ids. ARGV: the prefix of their record hashes. The records of the set's
// members, in no order; members whose record is gone are dropped from the set.
constexpr const char* kListSetScript = R"lua(
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local fields = redis.call('HGETALL', ARGV[1] .. id)
  if #fields > 0 then table.insert(out, fields) else redis.call('SREM', KEYS[1], id) end
end
return out
)lua";

// KEYS: per claim, its node hash and that node's claims hash. ARGV: per claim, the holder.
// `used` is rewritten only on nodes that lost a claim, and only while the node exists.
constexpr const char* kReleaseBody = R"lua(
local changed, order = {}, {}
for i = 1, #ARGV do
  local nodeKey = KEYS[2 * i - 1]
  if redis.call('HDEL', KEYS[2 * i], ARGV[i]) == 1 and not changed[nodeKey] then
    changed[nodeKey] = KEYS[2 * i]
    table.insert(order, nodeKey)
  end
end
for _, nodeKey in ipairs(order) do
  if redis.call('EXISTS', nodeKey) == 1 then recomputeUsed(nodeKey, changed[nodeKey]) end
end
return 1
)lua";

// KEYS: group hash, groups zset, pending-groups set. ARGV: the group's id. All go together.
constexpr const char* kDeleteGroupScript = R"lua(
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[1])
return 1
)lua";

// KEYS: actor hash, actors zset, live-actors zset, dead-actors zset, waiting-actors set, the
// live-actors set of its placement group ('' when none).
// ARGV: created ms, id, state, keep, updated ms, actor hash prefix, waiting ('1' when it waits
// for a node), the prefix of the groups' live-actors sets, then the hash's field/value pairs. Live actors are indexed on their own, so the
// controller's scans cost what is alive, not the history; only the newest `keep` DEAD actors are
// kept (for status), older ones deleted.
constexpr const char* kPutActorScript = R"lua(
local old = redis.call('HGET', KEYS[1], 'placement_group')
if old and old ~= '' then redis.call('SREM', ARGV[8] .. old, ARGV[2]) end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 9))
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[2])
if ARGV[7] == '1' then redis.call('SADD', KEYS[5], ARGV[2]) else redis.call('SREM', KEYS[5], ARGV[2]) end
if ARGV[3] ~= 'DEAD' then
  redis.call('ZADD', KEYS[3], ARGV[1], ARGV[2])
  if KEYS[6] ~= '' then redis.call('SADD', KEYS[6], ARGV[2]) end
  return 1
end
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('ZADD', KEYS[4], ARGV[5], ARGV[2])
local extra = redis.call('ZCARD', KEYS[4]) - tonumber(ARGV[4])
if extra > 0 then
  for _, old in ipairs(redis.call('ZRANGE', KEYS[4], 0, extra - 1)) do
    redis.call('DEL', ARGV[6] .. old)
    redis.call('ZREM', KEYS[2], old)
  end
  redis.call('ZREMRANGEBYRANK', KEYS[4], 0, extra - 1)
end
return 1
)lua";

// KEYS: name key. ARGV: actor id. 1 when the name was free or already this actor's, so a
// retried claim whose first reply was lost still reports success.
constexpr const char* kClaimNameScript = R"lua(
local holder = redis.call('GET', KEYS[1])
if not holder then
  redis.call('SET', KEYS[1], ARGV[1])
  return 1
end
if holder == ARGV[1] then return 1 end
return 0
)lua";

// KEYS: name key. ARGV: actor id. Deletes the name only if this actor holds it.
constexpr const char* kReleaseNameScript = R"lua(
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
)lua";

// KEYS: the group's epoch key. ARGV: the wanted epoch, the group's epoch channel.
// Raises the epoch (never lowers it) and publishes only a real change, so a retry is silent.
// Returns the epoch after the call as text (Lua numbers are doubles; the text stays exact).
constexpr const char* kAdvanceGroupEpochScript = R"lua(
local current = redis.call('GET', KEYS[1]) or '0'
if tonumber(ARGV[1]) > tonumber(current) then
  redis.call('SET', KEYS[1], ARGV[1])
  redis.call('PUBLISH', ARGV[2], ARGV[1])
  return ARGV[1]
end
return current
)lua";

// KEYS: the group's document, the groups zset. ARGV: id, doc, now ms.
constexpr const char* kPutElasticGroupScript = R"lua(
redis.call('SET', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], 'NX', ARGV[3], ARGV[1])
return 1
)lua";

// KEYS: the group's document, its events list. ARGV: text, how many to keep. A line equal to
// one of the newest 32 is a retry: it is not added twice.
constexpr const char* kAppendGroupEventScript = R"lua(
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
for _, line in ipairs(redis.call('LRANGE', KEYS[2], -32, -1)) do
  if line == ARGV[1] then return 1 end
end
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('LTRIM', KEYS[2], -tonumber(ARGV[2]), -1)
return 1
)lua";

// KEYS: document, events, groups zset, epoch. ARGV: id, the rendezvous key prefix (the
// rendezvous of each epoch up to the current one is deleted; they expire anyway).
constexpr const char* kDeleteElasticGroupScript = R"lua(
local epoch = tonumber(redis.call('GET', KEYS[4]) or '0')
for e = 0, epoch do redis.call('DEL', ARGV[2] .. e) end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[4])
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
)lua";

// KEYS: the rendezvous hash. ARGV: rank, value, ttl ms. The write and the expiry go together.
constexpr const char* kPutRendezvousScript = R"lua(
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
)lua";

const std::string& registerScript() {
  static const std::string script = std::string(kRecomputeUsedLua) + kStoreUpLua + kRegisterBody;
  return script;
}
const std::string& heartbeatScript() {
  static const std::string script = std::string(kStoreUpLua) + kHeartbeatBody;
  return script;
}
const std::string& reapScript() {
  static const std::string script = std::string(kStoreUpLua) + kBuryNodeLua + kReapBody;
  return script;
}
const std::string& markDeadScript() {
  static const std::string script = std::string(kBuryNodeLua) + kMarkDeadBody;
  return script;
}
const std::string& reserveScript() {
  static const std::string script = std::string(kRecomputeUsedLua) + kReserveClaimsLua + kReserveBody;
  return script;
}
const std::string& createGroupScript() {
  static const std::string script = std::string(kRecomputeUsedLua) + kReserveClaimsLua + kCreateGroupBody;
  return script;
}
const std::string& removeGroupScript() {
  static const std::string script = std::string(kRecomputeUsedLua) + kRemoveGroupBody;
  return script;
}
const std::string& releaseScript() {
  static const std::string script = std::string(kRecomputeUsedLua) + kReleaseBody;
  return script;
}

// ---- Encoding (store_records.h) ----

using FieldMap = store_records::FieldMap;

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

class RedisEventSubscription final : public EventSubscription {
 public:
  RedisEventSubscription(RedisOptions options, ContextPtr context)
      : options_(std::move(options)), context_(std::move(context)) {}

  Result<std::optional<ClusterEvent>> next(std::chrono::milliseconds timeout) override {
    if (!context_) return lost("the subscription failed earlier");
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      auto payload = nextPubSubMessage(context_.get(), options_, deadline, -1);
      if (!payload.isOk()) return lost(payload.status().message());
      if (!*payload) return std::optional<ClusterEvent>();
      if (auto event = decode(**payload)) return event;
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

  std::optional<ClusterEvent> decode(const std::string& payload) {
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

// Same argument checks, same messages as the fake's (fake_cluster_store.cc).
Status checkGroupArgs(const std::string& group, int64_t epoch) {
  if (group.empty()) return Status(StatusCode::kInvalidArgument, "empty group name");
  if (epoch < 0) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("group '{}': epoch must be >= 0, got {}", group, epoch));
  }
  return Status::ok();
}

// A subscription to one group's epoch channel on its own connection. interrupt() wakes a
// next() blocked in poll() through an eventfd, so the waiting thread can be joined at once.
// Subscribes `context` to the group's epoch channel; returns once Redis confirmed it (only then
// is every later PUBLISH guaranteed to reach it).
Status subscribeEpoch(redisContext* context, const RedisOptions& options, const std::string& channel) {
  SigpipeBlock sigpipe;
  ReplyPtr reply(static_cast<redisReply*>(redisCommand(context, "SUBSCRIBE %b", channel.data(), channel.size())));
  if (!reply) return unreachable(options, contextError(context, options));
  if (reply->type == REDIS_REPLY_ERROR) return replyError(options, *reply, "SUBSCRIBE");
  if (reply->type != REDIS_REPLY_ARRAY || reply->elements < 1 || replyText(*reply->element[0]) != "subscribe") {
    return Status(StatusCode::kInternal, fmt::format("unexpected reply type {} from Redis at {} to SUBSCRIBE",
                                                     reply->type, addressOf(options)));
  }
  return Status::ok();
}

// A lost connection (Redis restarted, a network blip) is not the end of a watch: it subscribes
// again (50 ms doubling to 1 s between tries, until next()'s deadline), then reads the epoch
// once over another connection and returns it, so an advance published while it was away is
// not missed (the caller ignores epochs it has reached already).
class RedisGroupEpochWatch final : public GroupEpochWatch {
 public:
  RedisGroupEpochWatch(RedisOptions options, ContextPtr context, std::string group, std::string channel,
                       std::string epochKey)
      : options_(std::move(options)),
        context_(std::move(context)),
        group_(std::move(group)),
        channel_(std::move(channel)),
        epochKey_(std::move(epochKey)),
        wakeFd_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}
  ~RedisGroupEpochWatch() override {
    if (wakeFd_ >= 0) ::close(wakeFd_);
  }
  RedisGroupEpochWatch(const RedisGroupEpochWatch&) = delete;
  RedisGroupEpochWatch& operator=(const RedisGroupEpochWatch&) = delete;

  Result<std::optional<int64_t>> next(std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (interrupted_.load()) return std::optional<int64_t>();
      if (!context_) return watchAgain(deadline);
      auto payload = nextPubSubMessage(context_.get(), options_, deadline, wakeFd_);
      if (!payload.isOk()) {
        context_.reset();
        lostAt_ = std::chrono::steady_clock::now();
        TROUPE_LOG(kWarning, "lost the epoch watch of group '{}' on Redis at {} ({}); watching again",
                   group_, addressOf(options_), payload.status().message());
        continue;
      }
      if (!*payload) return std::optional<int64_t>();
      if (auto epoch = decode(**payload)) return epoch;
    }
  }

  void interrupt() override {
    interrupted_.store(true);
    if (wakeFd_ >= 0) {
      const uint64_t one = 1;
      [[maybe_unused]] ssize_t n = ::write(wakeFd_, &one, sizeof(one));
    }
  }

 private:
  Result<std::optional<int64_t>> watchAgain(std::chrono::steady_clock::time_point deadline) {
    Status last = Status::ok();
    for (auto pause = std::chrono::milliseconds(50);; pause = std::min(pause * 2, std::chrono::milliseconds(1000))) {
      if (interrupted_.load()) return std::optional<int64_t>();
      auto context = connectAndAuthenticate(options_);
      if (context.isOk()) {
        last = subscribeEpoch(context->get(), options_, channel_);
        if (last.isOk()) {
          // Subscribed first, then read: an advance is either published to us or in the read.
          auto reader = connectAndAuthenticate(options_);
          std::optional<int64_t> epoch;
          if (reader.isOk()) {
            SigpipeBlock sigpipe;
            ReplyPtr reply(static_cast<redisReply*>(
                redisCommand(reader->get(), "GET %b", epochKey_.data(), epochKey_.size())));
            int64_t value = 0;
            if (reply && reply->type == REDIS_REPLY_NIL) epoch = 0;  // never advanced
            if (reply && reply->type == REDIS_REPLY_STRING && parseInteger(replyText(*reply), value)) epoch = value;
          }
          if (reader.isOk() && epoch) {
            context_ = std::move(context).value();
            TROUPE_LOG(kInfo, "watching the epoch of group '{}' again after {:.1f} s (epoch {})", group_,
                       std::chrono::duration<double>(std::chrono::steady_clock::now() - lostAt_).count(), *epoch);
            return epoch;
          }
          last = reader.isOk() ? Status(StatusCode::kUnavailable, "cannot read the group's epoch") : reader.status();
        }
      } else {
        last = context.status();
      }
      auto now = std::chrono::steady_clock::now();
      if (now + pause > deadline) {
        return Status(StatusCode::kUnavailable,
                      fmt::format("lost the epoch watch of group '{}' on Redis at {} and could not watch again ({}); "
                                  "advances may have been missed: watch again and re-read groupEpoch()",
                                  group_, addressOf(options_), last.message()));
      }
      pollfd wake{wakeFd_, POLLIN, 0};  // sleeps, unless interrupt() is called
      ::poll(&wake, 1, static_cast<int>(pause.count()));
    }
  }

  std::optional<int64_t> decode(const std::string& payload) {
    int64_t epoch = 0;
    if (!parseInteger(payload, epoch)) {
      TROUPE_LOG(kWarning, "ignoring a malformed epoch '{}' of group '{}' from Redis at {}",
                 payload, group_, addressOf(options_));
      return std::nullopt;
    }
    return epoch;
  }

  RedisOptions options_;
  ContextPtr context_;
  std::string group_;
  std::string channel_;
  std::string epochKey_;
  int wakeFd_;
  std::atomic<bool> interrupted_{false};
  std::chrono::steady_clock::time_point lostAt_;
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

  Status putStoreGateway(const std::string& address) override {
    // With the time it (re)started, by the server's clock: nodes behind it are not judged by
    // their heartbeats until it has served one TTL (see the reap script).
    auto reply = connection_.run({"EVAL", R"lua(
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'store_gateway', ARGV[1],
           'store_gateway_since_ms', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
return 1
)lua", "1", metaKey(), address}, "putStoreGateway");
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
    meta.storeGateway = (*fields)["store_gateway"];
    if (!parseInteger((*fields)["controller_pid"], meta.controllerPid) ||
        !parseInteger((*fields)["created_ms"], meta.createdMs)) {
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
        registerScript(),
        "6",
        nodeKey(node.id),
        nodesKey(),
        heartbeatKey(node.id),
        claimsKey(node.id),
        storeRunKey(),
        deadNodesKey(),
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
        "heartbeat_ttl_ms", std::to_string(ttl.count()),
        "death_reason", "",
    };
    auto reply = connection_.run(args, "registerNode");
    return reply ? Status::ok() : reply.status();
  }

  Result<bool> heartbeat(const NodeId& id, std::chrono::milliseconds ttl) override {
    TROUPE_RETURN_IF_ERROR(checkNodeArgs(id, ttl));
    auto reply = connection_.run({"EVAL", heartbeatScript(), "3", nodeKey(id), heartbeatKey(id), storeRunKey(),
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
    auto node = store_records::decodeNode(*fields, nodeKey(id));
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
      auto node = fields ? store_records::decodeNode(*fields, nodeKeyPrefix() + (*fields)["id"]) : Result<NodeRecord>(fields.status());
      // One bad record must not hide the others (nor stop status and the controller).
      if (!node) {
        skipMalformed(node.status());
        continue;
      }
      nodes.push_back(std::move(node).value());
    }
    return nodes;
  }

  Result<std::vector<NodeId>> reapExpiredNodes() override {
    auto reply = connection_.run({"EVAL", reapScript(), "4", nodesKey(), storeRunKey(), deadNodesKey(), metaKey(), nodeKeyPrefix(),
                                  heartbeatKeyPrefix(), eventsChannel(), std::to_string(wallClockMs()),
                                  claimsKeyPrefix(), std::to_string(options_.keepDeadNodes)},
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
    auto reply = connection_.run({"EVAL", markDeadScript(), "4", nodeKey(id), heartbeatKey(id), nodesKey(),
                                  deadNodesKey(), eventsChannel(), id.hex(), reason, std::to_string(wallClockMs()),
                                  nodeKeyPrefix(), claimsKeyPrefix(), std::to_string(options_.keepDeadNodes)},
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

  Result<bool> reserve(const std::vector<Reservation>& reservations) override {
    TROUPE_RETURN_IF_ERROR(checkReservations(reservations, /*forReserve=*/true));
    if (reservations.empty()) return true;
    std::vector<std::string> args = {"EVAL", reserveScript(),
                                     std::to_string(2 * reservations.size())};
    for (const Reservation& r : reservations) {
      args.push_back(nodeKey(r.nodeId));
      args.push_back(claimsKey(r.nodeId));
    }
    for (const Reservation& r : reservations) {
      args.push_back(r.holder);
      args.push_back(json(r.resources).dump());
    }
    auto reply = connection_.run(args, "reserve");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_INTEGER) return unexpected("reserve", **reply);
    return (*reply)->integer == 1;
  }

  Status release(const std::vector<Reservation>& reservations) override {
    TROUPE_RETURN_IF_ERROR(checkReservations(reservations, /*forReserve=*/false));
    if (reservations.empty()) return Status::ok();
    std::vector<std::string> args = {"EVAL", releaseScript(),
                                     std::to_string(2 * reservations.size())};
    for (const Reservation& r : reservations) {
      args.push_back(nodeKey(r.nodeId));
      args.push_back(claimsKey(r.nodeId));
    }
    for (const Reservation& r : reservations) args.push_back(r.holder);
    auto reply = connection_.run(args, "release");
    return reply ? Status::ok() : reply.status();
  }

  Result<std::map<std::string, Resources>> reservations(const NodeId& node) override {
    if (node.empty()) return emptyId();
    const std::string key = claimsKey(node);
    auto reply = connection_.run({"HGETALL", key}, "reservations");
    if (!reply) return reply.status();
    auto fields = fieldMap(**reply, key);
    if (!fields) return fields.status();
    std::map<std::string, Resources> claims;
    for (const auto& [holder, resources] : *fields) {
      try {
        claims[holder] = json::parse(resources).get<Resources>();
      } catch (const json::exception& e) {
        return malformed(key, fmt::format("the claim of '{}' is not a JSON object of numbers: {}",
                                          holder, e.what()));
      }
    }
    return claims;
  }

  Status putActor(const ActorRecord& actor) override {
    if (actor.id.empty()) return emptyArgument("actor id");
    std::vector<std::string> args = {
        "EVAL",
        kPutActorScript,
        "6",
        actorKey(actor.id),
        actorsKey(),
        liveActorsKey(),
        deadActorsKey(),
        waitingActorsKey(),
        actor.placementGroup.empty() ? std::string() : groupActorsKey(actor.placementGroup),
        std::to_string(actor.createdMs),
        actor.id.hex(),
        actorStateName(actor.state),
        std::to_string(options_.keepDeadActors),
        std::to_string(actor.updatedMs != 0 ? actor.updatedMs : wallClockMs()),
        actorKeyPrefix(),
        waitsForNode(actor) ? "1" : "0",
        groupActorsKeyPrefix(),
        "id", actor.id.hex(),
        "type", actor.type,
        "name", actor.name,
        "node_id", actor.nodeId.hex(),
        "pid", std::to_string(actor.pid),
        "address", actor.address,
        "state", actorStateName(actor.state),
        "incarnation", std::to_string(actor.incarnation),
        "restarts", std::to_string(actor.restarts),
        "max_restarts", std::to_string(actor.maxRestarts),
        "max_task_retries", std::to_string(actor.maxTaskRetries),
        "detached", actor.detached ? "1" : "0",
        "owner", actor.owner,
        "resources", json(actor.resources).dump(),
        "init_args", actor.initArgs,
        "placement_group", actor.placementGroup.hex(),
        "bundle_index", std::to_string(actor.bundleIndex),
        "death_reason", actor.deathReason,
        "created_ms", std::to_string(actor.createdMs),
        "updated_ms", std::to_string(actor.updatedMs),
    };
    auto reply = connection_.run(args, "putActor");
    return reply ? Status::ok() : reply.status();
  }

  Result<std::optional<ActorRecord>> getActor(const ActorId& id) override {
    if (id.empty()) return emptyArgument("actor id");
    auto reply = connection_.run({"HGETALL", actorKey(id)}, "getActor");
    if (!reply) return reply.status();
    auto fields = fieldMap(**reply, actorKey(id));
    if (!fields) return fields.status();
    if (fields->empty()) return std::optional<ActorRecord>();
    auto actor = store_records::decodeActor(*fields, actorKey(id));
    if (!actor) return actor.status();
    return std::optional<ActorRecord>(std::move(actor).value());
  }

  Result<std::vector<ActorRecord>> listActors() override {
    return listActorsIn(actorsKey(), "init_args", "listActors");
  }
  Result<std::vector<ActorRecord>> listLiveActors() override {
    return listActorsIn(liveActorsKey(), "", "listLiveActors");
  }

  Result<std::vector<ActorRecord>> listActorsIn(const std::string& index, const char* skip, const char* what) {
    auto reply = connection_.run({"EVAL", kListScript, "1", index, actorKeyPrefix(), skip}, what);
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_ARRAY) return unexpected("listActors", **reply);
    return decodeActors(**reply);
  }

  Result<ActorPage> listActorsPage(const ActorQuery& query) override {
    auto reply = connection_.run({"EVAL", kListActorsPageScript, "1", actorsKey(), actorKeyPrefix(),
                                  query.state ? actorStateName(*query.state) : "", query.nodePrefix,
                                  std::to_string(query.offset), std::to_string(query.limit)},
                                 "listActorsPage");
    if (!reply) return reply.status();
    const redisReply& r = **reply;
    if (r.type != REDIS_REPLY_ARRAY || r.elements != 3 || r.element[0]->type != REDIS_REPLY_ARRAY ||
        r.element[0]->elements % 2 != 0 || r.element[1]->type != REDIS_REPLY_INTEGER ||
        r.element[2]->type != REDIS_REPLY_ARRAY) {
      return unexpected("listActorsPage", r);
    }
    ActorPage page;
    const redisReply& counts = *r.element[0];
    for (size_t i = 0; i + 1 < counts.elements; i += 2) {
      if (counts.element[i]->type != REDIS_REPLY_STRING || counts.element[i + 1]->type != REDIS_REPLY_INTEGER) {
        return unexpected("listActorsPage", r);
      }
      auto state = store_records::parseActorState(std::string(counts.element[i]->str, counts.element[i]->len));
      if (state) page.countsByState[*state] += static_cast<uint64_t>(counts.element[i + 1]->integer);
    }
    page.matching = static_cast<uint64_t>(std::max<long long>(0, r.element[1]->integer));
    auto actors = decodeActors(*r.element[2]);
    if (!actors.isOk()) return actors.status();
    page.actors = std::move(*actors);
    return page;
  }

  // Records as the list scripts return them (an array of field arrays); malformed ones skipped.
  Result<std::vector<ActorRecord>> decodeActors(const redisReply& reply) {
    std::vector<ActorRecord> actors;
    actors.reserve(reply.elements);
    for (size_t i = 0; i < reply.elements; ++i) {
      auto fields = fieldMap(*reply.element[i], actorKeyPrefix() + "*");
      auto actor = fields ? store_records::decodeActor(*fields, actorKeyPrefix() + (*fields)["id"]) : Result<ActorRecord>(fields.status());
      if (!actor) {
        skipMalformed(actor.status());
        continue;
      }
      actors.push_back(std::move(actor).value());
    }
    return actors;
  }

  Result<bool> claimActorName(const std::string& name, const ActorId& id) override {
    TROUPE_RETURN_IF_ERROR(checkNameArgs(name, id));
    auto reply = connection_.run({"EVAL", kClaimNameScript, "1", actorNameKey(name), id.hex()},
                                 "claimActorName");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_INTEGER) return unexpected("claimActorName", **reply);
    return (*reply)->integer == 1;
  }

  Status releaseActorName(const std::string& name, const ActorId& id) override {
    TROUPE_RETURN_IF_ERROR(checkNameArgs(name, id));
    auto reply = connection_.run({"EVAL", kReleaseNameScript, "1", actorNameKey(name), id.hex()},
                                 "releaseActorName");
    return reply ? Status::ok() : reply.status();
  }

  Result<std::optional<ActorId>> lookupActorName(const std::string& name) override {
    if (name.empty()) return emptyArgument("actor name");
    auto reply = connection_.run({"GET", actorNameKey(name)}, "lookupActorName");
    if (!reply) return reply.status();
    if ((*reply)->type == REDIS_REPLY_NIL) return std::optional<ActorId>();
    if ((*reply)->type != REDIS_REPLY_STRING) return unexpected("lookupActorName", **reply);
    return std::optional<ActorId>(ActorId(replyText(**reply)));
  }

  Status putPlacementGroup(const PlacementGroupRecord& group) override {
    if (group.id.empty()) return emptyArgument("placement group id");
    std::vector<std::string> args = {"EVAL", kPutGroupScript, "3", placementGroupKey(group.id), placementGroupsKey(),
                                     pendingGroupsKey(), std::to_string(group.createdMs), group.id.hex(),
                                     placementGroupStateName(group.state)};
    appendGroupFields(group, args);
    auto reply = connection_.run(args, "putPlacementGroup");
    return reply ? Status::ok() : reply.status();
  }

  static void appendGroupFields(const PlacementGroupRecord& group, std::vector<std::string>& args) {
    for (std::string field : std::initializer_list<std::string>{"id", group.id.hex(), "name", group.name, "strategy", placementStrategyName(group.strategy),
                              "state", placementGroupStateName(group.state), "bundles", bundlesJson(group.bundles),
                              "pending_reason", group.pendingReason, "created_ms", std::to_string(group.createdMs)}) {
      args.push_back(std::move(field));
    }
  }

  Result<GroupCreation> createPlacementGroup(const PlacementGroupRecord& group,
                                             const std::vector<Reservation>& claims) override {
    if (group.id.empty()) return emptyArgument("placement group id");
    TROUPE_RETURN_IF_ERROR(checkReservations(claims, /*forReserve=*/true));
    std::vector<std::string> args = {"EVAL", createGroupScript(), std::to_string(3 + 2 * claims.size()),
                                     placementGroupKey(group.id), placementGroupsKey(), pendingGroupsKey()};
    for (const Reservation& r : claims) {
      args.push_back(nodeKey(r.nodeId));
      args.push_back(claimsKey(r.nodeId));
    }
    for (std::string arg : std::initializer_list<std::string>{std::to_string(claims.size()), std::to_string(group.createdMs), group.id.hex(),
                            std::string(placementGroupStateName(group.state))}) {
      args.push_back(std::move(arg));
    }
    for (const Reservation& r : claims) {
      args.push_back(r.holder);
      args.push_back(json(r.resources).dump());
    }
    appendGroupFields(group, args);
    auto reply = connection_.run(args, "createPlacementGroup");
    if (!reply) return reply.status();
    const redisReply& r = **reply;
    if (r.type == REDIS_REPLY_INTEGER) {
      return GroupCreation{r.integer == 1 ? GroupCreation::Outcome::kCreated : GroupCreation::Outcome::kRefused, {}};
    }
    const std::string key = placementGroupKey(group.id);
    auto fields = fieldMap(r, key);
    if (!fields) return fields.status();
    auto existing = store_records::decodePlacementGroup(*fields, key);
    if (!existing) return existing.status();
    return GroupCreation{GroupCreation::Outcome::kExists, std::move(existing).value()};
  }

  Result<GroupRemoval> removePlacementGroup(const PlacementGroupId& id) override {
    if (id.empty()) return emptyArgument("placement group id");
    auto reply = connection_.run({"EVAL", removeGroupScript(), "5", placementGroupKey(id), placementGroupsKey(),
                                  pendingGroupsKey(), groupActorsKey(id), waitingActorsKey(), id.hex(),
                                  claimsKeyPrefix(), nodeKeyPrefix()},
                                 "removePlacementGroup");
    if (!reply) return reply.status();
    const redisReply& r = **reply;
    if (r.type != REDIS_REPLY_ARRAY || r.elements != 2 || r.element[0]->type != REDIS_REPLY_INTEGER ||
        r.element[1]->type != REDIS_REPLY_INTEGER || r.element[0]->integer < 0 || r.element[0]->integer > 2) {
      return unexpected("removePlacementGroup", r);
    }
    static constexpr GroupRemoval::Outcome kOutcomes[] = {
        GroupRemoval::Outcome::kNotFound, GroupRemoval::Outcome::kRemoved, GroupRemoval::Outcome::kHasActors};
    return GroupRemoval{kOutcomes[r.element[0]->integer], r.element[1]->integer > 0};
  }

  Result<std::vector<ActorRecord>> listGroupActors(const PlacementGroupId& id) override {
    if (id.empty()) return emptyArgument("placement group id");
    auto reply = connection_.run({"EVAL", kListSetScript, "1", groupActorsKey(id), actorKeyPrefix()}, "listGroupActors");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_ARRAY) return unexpected("listGroupActors", **reply);
    return decodeActors(**reply);
  }

  Result<PendingWork> listPendingWork() override {
    PendingWork work;
    auto groups = connection_.run({"EVAL", kListSetScript, "1", pendingGroupsKey(), placementGroupKeyPrefix()},
                                  "listPendingWork");
    if (!groups) return groups.status();
    if ((*groups)->type != REDIS_REPLY_ARRAY) return unexpected("listPendingWork", **groups);
    auto decoded = decodeGroups(**groups);
    if (!decoded) return decoded.status();
    work.groups = std::move(*decoded);
    auto actors = connection_.run({"EVAL", kListSetScript, "1", waitingActorsKey(), actorKeyPrefix()}, "listPendingWork");
    if (!actors) return actors.status();
    if ((*actors)->type != REDIS_REPLY_ARRAY) return unexpected("listPendingWork", **actors);
    auto waiting = decodeActors(**actors);
    if (!waiting) return waiting.status();
    work.actors = std::move(*waiting);
    // In the order a scan would have found them: oldest first.
    std::sort(work.groups.begin(), work.groups.end(), [](const auto& a, const auto& b) {
      return std::tie(a.createdMs, a.id) < std::tie(b.createdMs, b.id);
    });
    std::sort(work.actors.begin(), work.actors.end(), [](const auto& a, const auto& b) {
      return std::tie(a.createdMs, a.id) < std::tie(b.createdMs, b.id);
    });
    return work;
  }

  Result<std::optional<PlacementGroupRecord>> getPlacementGroup(
      const PlacementGroupId& id) override {
    if (id.empty()) return emptyArgument("placement group id");
    const std::string key = placementGroupKey(id);
    auto reply = connection_.run({"HGETALL", key}, "getPlacementGroup");
    if (!reply) return reply.status();
    auto fields = fieldMap(**reply, key);
    if (!fields) return fields.status();
    if (fields->empty()) return std::optional<PlacementGroupRecord>();
    auto group = store_records::decodePlacementGroup(*fields, key);
    if (!group) return group.status();
    return std::optional<PlacementGroupRecord>(std::move(group).value());
  }

  Status putSession(const std::string& id, const std::string& info) override {
    if (id.empty()) return emptyArgument("session id");
    auto reply = connection_.run({"HSET", sessionsKey(), id, info}, "putSession");
    return reply ? Status::ok() : reply.status();
  }

  Status deleteSession(const std::string& id) override {
    auto reply = connection_.run({"HDEL", sessionsKey(), id}, "deleteSession");
    return reply ? Status::ok() : reply.status();
  }

  Result<std::map<std::string, std::string>> listSessions() override {
    auto reply = connection_.run({"HGETALL", sessionsKey()}, "listSessions");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_ARRAY || (*reply)->elements % 2 != 0) return unexpected("listSessions", **reply);
    std::map<std::string, std::string> out;
    for (size_t i = 0; i + 1 < (*reply)->elements; i += 2) {
      out[replyText(*(*reply)->element[i])] = replyText(*(*reply)->element[i + 1]);
    }
    return out;
  }

  Status deletePlacementGroup(const PlacementGroupId& id) override {
    if (id.empty()) return emptyArgument("placement group id");
    auto reply = connection_.run({"EVAL", kDeleteGroupScript, "3", placementGroupKey(id), placementGroupsKey(), pendingGroupsKey(), id.hex()},
                                 "deletePlacementGroup");
    return reply ? Status::ok() : reply.status();
  }

  Result<std::vector<PlacementGroupRecord>> listPlacementGroups() override {
    auto reply = connection_.run(
        {"EVAL", kListScript, "1", placementGroupsKey(), placementGroupKeyPrefix()},
        "listPlacementGroups");
    if (!reply) return reply.status();
    if ((*reply)->type != REDIS_REPLY_ARRAY) return unexpected("listPlacementGroups", **reply);
    return decodeGroups(**reply);
  }

  // Records as the list scripts return them; malformed ones skipped.
  Result<std::vector<PlacementGroupRecord>> decodeGroups(const redisReply& reply) {
    std::vector<PlacementGroupRecord> groups;
    groups.reserve(reply.elements);
    for (size_t i = 0; i < reply.elements; ++i) {
      auto fields = fieldMap(*reply.element[i], placementGroupKeyPrefix() + "*");
      auto group = fields ? store_records::decodePlacementGroup(*fields, placementGroupKeyPrefix() + (*fields)["id"])
                          : Result<PlacementGroupRecord>(fields.status());
      if (!group) {
        skipMalformed(group.status());
        continue;
      }
      groups.push_back(std::move(group).value());
    }
    return groups;
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

  Result<int64_t> groupEpoch(const std::string& group) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(group, 0));
    auto reply = connection_.run({"GET", groupEpochKey(group)}, "groupEpoch");
    if (!reply) return reply.status();
    if ((*reply)->type == REDIS_REPLY_NIL) return int64_t{0};
    int64_t epoch = 0;
    if ((*reply)->type != REDIS_REPLY_STRING || !parseInteger(replyText(**reply), epoch)) {
      return malformed(groupEpochKey(group), "the epoch is not an integer");
    }
    return epoch;
  }

  Result<int64_t> advanceGroupEpoch(const std::string& group, int64_t epoch) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(group, epoch));
    auto reply = connection_.run({"EVAL", kAdvanceGroupEpochScript, "1", groupEpochKey(group),
                                  std::to_string(epoch), groupEpochChannel(group)},
                                 "advanceGroupEpoch");
    if (!reply) return reply.status();
    int64_t now = 0;
    if ((*reply)->type != REDIS_REPLY_STRING || !parseInteger(replyText(**reply), now)) {
      return malformed(groupEpochKey(group), "the epoch is not an integer");
    }
    return now;
  }

  Result<std::unique_ptr<GroupEpochWatch>> watchGroupEpoch(const std::string& group) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(group, 0));
    auto context = connectAndAuthenticate(options_);
    if (!context) return context.status();
    const std::string channel = groupEpochChannel(group);
    TROUPE_RETURN_IF_ERROR(subscribeEpoch(context->get(), options_, channel));
    return std::unique_ptr<GroupEpochWatch>(std::make_unique<RedisGroupEpochWatch>(
        options_, std::move(context).value(), group, channel, groupEpochKey(group)));
  }

  Status putRendezvousEntry(const std::string& group, int64_t epoch, int32_t rank,
                            const std::string& value, std::chrono::milliseconds ttl) override {
    TROUPE_RETURN_IF_ERROR(checkRendezvousArgs(group, epoch, rank, ttl));
    auto reply = connection_.run({"EVAL", kPutRendezvousScript, "1", rendezvousKey(group, epoch),
                                  std::to_string(rank), value, std::to_string(ttl.count())},
                                 "putRendezvousEntry");
    return reply ? Status::ok() : reply.status();
  }

  Result<std::map<int32_t, std::string>> getRendezvous(const std::string& group,
                                                       int64_t epoch) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(group, epoch));
    const std::string key = rendezvousKey(group, epoch);
    auto reply = connection_.run({"HGETALL", key}, "getRendezvous");
    if (!reply) return reply.status();
    auto fields = fieldMap(**reply, key);
    if (!fields) return fields.status();
    std::map<int32_t, std::string> entries;
    for (auto& [field, value] : *fields) {
      int32_t rank = 0;
      if (!parseInteger(field, rank)) return malformed(key, fmt::format("rank '{}'", field));
      entries[rank] = std::move(value);
    }
    return entries;
  }

  Status putElasticGroup(const std::string& id, const std::string& doc) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(id, 0));
    auto reply = connection_.run({"EVAL", kPutElasticGroupScript, "2", elasticKey(id), elasticListKey(), id, doc,
                                  std::to_string(wallClockMs())},
                                 "putElasticGroup");
    return reply ? Status::ok() : reply.status();
  }

  Status appendGroupEvent(const std::string& id, const std::string& text) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(id, 0));
    auto reply = connection_.run({"EVAL", kAppendGroupEventScript, "2", elasticKey(id), elasticEventsKey(id), text,
                                  std::to_string(kMaxGroupEvents)},
                                 "appendGroupEvent");
    return reply ? Status::ok() : reply.status();
  }

  Result<std::optional<ElasticGroupRecord>> getElasticGroup(const std::string& id) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(id, 0));
    auto doc = connection_.run({"GET", elasticKey(id)}, "getElasticGroup");
    if (!doc) return doc.status();
    if ((*doc)->type == REDIS_REPLY_NIL) return std::optional<ElasticGroupRecord>();
    ElasticGroupRecord record{id, replyText(**doc), {}, 0};
    auto events = connection_.run({"LRANGE", elasticEventsKey(id), "0", "-1"}, "getElasticGroup");
    if (!events) return events.status();
    if ((*events)->type == REDIS_REPLY_ARRAY) {
      for (size_t i = 0; i < (*events)->elements; ++i) record.events.push_back(replyText(*(*events)->element[i]));
    }
    auto epoch = groupEpoch(id);
    if (!epoch) return epoch.status();
    record.epoch = *epoch;
    return std::optional<ElasticGroupRecord>(std::move(record));
  }

  Result<std::vector<ElasticGroupRecord>> listElasticGroups() override {
    auto ids = connection_.run({"ZRANGE", elasticListKey(), "0", "-1"}, "listElasticGroups");
    if (!ids) return ids.status();
    std::vector<ElasticGroupRecord> groups;
    if ((*ids)->type != REDIS_REPLY_ARRAY) return groups;
    for (size_t i = 0; i < (*ids)->elements; ++i) {
      auto group = getElasticGroup(replyText(*(*ids)->element[i]));
      if (!group) return group.status();
      if (*group) groups.push_back(std::move(**group));
    }
    return groups;
  }

  Status deleteElasticGroup(const std::string& id) override {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(id, 0));
    auto reply = connection_.run({"EVAL", kDeleteElasticGroupScript, "4", elasticKey(id), elasticEventsKey(id),
                                  elasticListKey(), groupEpochKey(id), id, prefix_ + "rendezvous:" + id + ":"},
                                 "deleteElasticGroup");
    return reply ? Status::ok() : reply.status();
  }

 private:
  std::string elasticListKey() const { return prefix_ + "egroups"; }
  std::string elasticKey(const std::string& id) const { return prefix_ + "egroup:" + id; }
  std::string elasticEventsKey(const std::string& id) const { return prefix_ + "egroup_events:" + id; }

  std::string groupEpochKey(const std::string& group) const {
    return prefix_ + "group_epoch:" + group;
  }
  std::string groupEpochChannel(const std::string& group) const {
    return prefix_ + "group_epoch_events:" + group;
  }
  std::string rendezvousKey(const std::string& group, int64_t epoch) const {
    return fmt::format("{}rendezvous:{}:{}", prefix_, group, epoch);
  }

  // Same checks, same messages as the fake's.
  static Status checkRendezvousArgs(const std::string& group, int64_t epoch, int32_t rank,
                                    std::chrono::milliseconds ttl) {
    TROUPE_RETURN_IF_ERROR(checkGroupArgs(group, epoch));
    if (rank < 0) {
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("group '{}': rank must be >= 0, got {}", group, rank));
    }
    if (ttl.count() <= 0) {
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("rendezvous ttl must be positive, got {} ms", ttl.count()));
    }
    return Status::ok();
  }

  // Logs a record a listing skipped, once per distinct message (listings repeat every tick).
  void skipMalformed(const Status& why) {
    if (skipped_.insert(why.message()).second && skipped_.size() < 1000) {
      TROUPE_LOG(kWarning, "skipping a record: {}", why.message());
    }
  }
  std::set<std::string> skipped_;

  std::string metaKey() const { return prefix_ + "meta"; }
  std::string storeRunKey() const { return prefix_ + "store_run"; }
  std::string sessionsKey() const { return prefix_ + "sessions"; }
  std::string liveActorsKey() const { return prefix_ + "live_actors"; }
  std::string deadNodesKey() const { return prefix_ + "dead_nodes"; }
  std::string claimsKeyPrefix() const { return prefix_ + "node_res:"; }
  std::string deadActorsKey() const { return prefix_ + "dead_actors"; }
  std::string nodesKey() const { return prefix_ + "nodes"; }
  std::string nodeKeyPrefix() const { return prefix_ + "node:"; }
  std::string nodeKey(const NodeId& id) const { return nodeKeyPrefix() + id.hex(); }
  std::string heartbeatKeyPrefix() const { return prefix_ + "node_hb:"; }
  std::string heartbeatKey(const NodeId& id) const { return heartbeatKeyPrefix() + id.hex(); }
  std::string eventsChannel() const { return prefix_ + "events"; }
  std::string claimsKey(const NodeId& id) const { return prefix_ + "node_res:" + id.hex(); }
  std::string actorsKey() const { return prefix_ + "actors"; }
  std::string actorKeyPrefix() const { return prefix_ + "actor:"; }
  std::string actorKey(const ActorId& id) const { return actorKeyPrefix() + id.hex(); }
  std::string actorNameKey(const std::string& name) const { return prefix_ + "actor_name:" + name; }
  std::string placementGroupsKey() const { return prefix_ + "pgs"; }
  std::string pendingGroupsKey() const { return prefix_ + "pending_pgs"; }
  std::string waitingActorsKey() const { return prefix_ + "waiting_actors"; }
  std::string groupActorsKeyPrefix() const { return prefix_ + "pg_actors:"; }
  std::string groupActorsKey(const PlacementGroupId& id) const { return groupActorsKeyPrefix() + id.hex(); }
  std::string placementGroupKeyPrefix() const { return prefix_ + "pg:"; }
  std::string placementGroupKey(const PlacementGroupId& id) const {
    return placementGroupKeyPrefix() + id.hex();
  }

  Status unexpected(std::string_view what, const redisReply& reply) const {
    return Status(StatusCode::kInternal,
                  fmt::format("unexpected reply type {} from Redis at {} to {}", reply.type,
                              addressOf(options_), what));
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

Result<RedisOptions> workerRedisOptions() {
  const char* address = getenv("TROUPE_REDIS_ADDRESS");
  const char* password = getenv("TROUPE_REDIS_PASSWORD");
  const char* cluster = getenv("TROUPE_CLUSTER");
  const char* gateway = getenv("TROUPE_REDIS_GATEWAY");
  const char* token = getenv("TROUPE_TOKEN");
  if (!address || !*address || !password || !cluster) {
    return Status(StatusCode::kFailedPrecondition,
                  "TROUPE_REDIS_ADDRESS, TROUPE_REDIS_PASSWORD and TROUPE_CLUSTER are not set: this is not a worker "
                  "started by a node agent");
  }
  auto hp = parseHostPort(address);
  if (!hp.isOk()) return hp.status();
  RedisOptions options;
  options.host = hp->host;
  options.port = hp->port;
  options.password = password;
  options.cluster = cluster;
  if (gateway && std::string(gateway) == "1") {
    if (!token || !*token) {
      return Status(StatusCode::kFailedPrecondition, "TROUPE_REDIS_GATEWAY is set but TROUPE_TOKEN is not");
    }
    options.gatewayToken = token;
  }
  return options;
}

}  // namespace troupe
