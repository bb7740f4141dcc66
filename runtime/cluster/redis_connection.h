// One authenticated hiredis connection that reconnects and retries once, and the helpers every
// reader of Redis shares (errors that name the server, replies as text and maps, pub/sub reads).
// Internal to runtime/.
#pragma once

#include <hiredis/hiredis.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>

#include "store_records.h"
#include "troupe/runtime/cluster_store.h"

namespace troupe::redis {

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

std::string addressOf(const RedisOptions& options);
std::string replyText(const redisReply& reply);
// kUnavailable naming the server (or the gateway) and why it cannot be reached.
Status unreachable(const RedisOptions& options, const std::string& reason);
std::string contextError(const redisContext* context, const RedisOptions& options);
// A connection that has proved the password (or, through the head's gateway, the cluster token).
Result<ContextPtr> connectAndAuthenticate(const RedisOptions& options);
// An error reply as a Status: kUnauthenticated, kUnavailable (loading, busy) or kInternal.
Status replyError(const RedisOptions& options, const redisReply& reply, std::string_view what);
// HGETALL's flat [field, value, ...] array as a map.
Result<store_records::FieldMap> fieldMap(const redisReply& reply, const std::string& key);
// The payload of the next "message" on a subscribed connection; nullopt once `deadline` passes
// or `wakeFd` (if >= 0) is readable. An error leaves the connection unusable.
Result<std::optional<std::string>> nextPubSubMessage(redisContext* context, const RedisOptions& options,
                                                     std::chrono::steady_clock::time_point deadline, int wakeFd);

// The RESP bytes of the store gateway's own beat (kGatewayBeatScript) for `options.cluster`;
// `first` for the first beat of a gateway process. Spelled in redis_cluster_store.cc, with the
// keys: the gateway writes it on its own connection from its event loop (store_gateway.cc).
std::string gatewayBeatCommand(const RedisOptions& options, bool first);

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

  // Runs several commands in one round trip (a pipeline): all are sent, then every reply read,
  // in order. Retried as run() is, the whole batch once (each command is safe to run twice).
  // A reply that is an error fails the batch with it (the others have run).
  Result<std::vector<ReplyPtr>> runAll(const std::vector<std::vector<std::string>>& commands, std::string_view what) {
    if (commands.empty()) return std::vector<ReplyPtr>{};
    SigpipeBlock sigpipe;
    std::string firstError = "not connected (an earlier reconnect failed)";
    for (int attempt = 0; attempt < 2; ++attempt) {
      if (!context_) {
        auto fresh = connectAndAuthenticate(options_);
        if (!fresh) {
          return Status(fresh.status().code(),
                        fmt::format("lost the connection to Redis during {} ({}); reconnecting failed: {}", what,
                                    firstError, fresh.status().message()));
        }
        context_ = std::move(fresh).value();
      }
      auto replies = sendAll(commands);
      if (replies) {
        for (auto& reply : *replies) {
          if (reply->type == REDIS_REPLY_ERROR) return replyError(options_, *reply, what);
        }
        return std::move(*replies);
      }
      firstError = contextError(context_.get(), options_);
      context_.reset();
    }
    return unreachable(options_, fmt::format("{} failed twice (last: {})", what, firstError));
  }

 private:
  // Sends every command, then reads every reply; nullopt on a broken connection. Scripts are
  // loaded first (SCRIPT LOAD, in the same pipeline), and a NOSCRIPT reply (a Redis restarted
  // meanwhile) reloads them and sends the batch again.
  std::optional<std::vector<ReplyPtr>> sendAll(const std::vector<std::vector<std::string>>& commands) {
    for (int attempt = 0; attempt < 2; ++attempt) {
      std::vector<std::string> loading;
      for (const auto& args : commands) {
        if (args.size() >= 2 && args[0] == "EVAL" && !shas_.count(args[1]) &&
            std::find(loading.begin(), loading.end(), args[1]) == loading.end()) {
          loading.push_back(args[1]);
        }
      }
      for (const auto& script : loading) {
        ReplyPtr loaded = sendRaw({"SCRIPT", "LOAD", script});
        if (!loaded) return std::nullopt;
        if (loaded->type == REDIS_REPLY_ERROR) {  // the batch fails with it
          std::vector<ReplyPtr> error;
          error.push_back(std::move(loaded));
          return error;
        }
        if (loaded->type != REDIS_REPLY_STRING) return std::nullopt;
        shas_.emplace(script, std::string(loaded->str, loaded->len));
      }
      for (const auto& args : commands) {
        if (args.size() >= 2 && args[0] == "EVAL") {
          std::vector<std::string> bySha = args;
          bySha[0] = "EVALSHA";
          bySha[1] = shas_[args[1]];
          appendRaw(bySha);
        } else {
          appendRaw(args);
        }
      }
      std::vector<ReplyPtr> replies;
      bool noScript = false;
      for (size_t i = 0; i < commands.size(); ++i) {
        void* raw = nullptr;
        if (redisGetReply(context_.get(), &raw) != REDIS_OK || raw == nullptr) return std::nullopt;
        ReplyPtr reply(static_cast<redisReply*>(raw));
        noScript = noScript || (reply->type == REDIS_REPLY_ERROR &&
                                std::string_view(reply->str, reply->len).rfind("NOSCRIPT", 0) == 0);
        replies.push_back(std::move(reply));
      }
      if (!noScript) return replies;
      shas_.clear();
    }
    return std::nullopt;
  }

  // hiredis's view of a command's arguments (pointers into `args`, which must outlive it).
  struct Argv {
    explicit Argv(const std::vector<std::string>& args) {
      pointers.reserve(args.size());
      lengths.reserve(args.size());
      for (const auto& arg : args) {
        pointers.push_back(arg.data());
        lengths.push_back(arg.size());
      }
    }
    int count() const { return static_cast<int>(pointers.size()); }
    std::vector<const char*> pointers;
    std::vector<size_t> lengths;
  };

  void appendRaw(const std::vector<std::string>& args) {
    Argv argv(args);
    redisAppendCommandArgv(context_.get(), argv.count(), argv.pointers.data(), argv.lengths.data());
  }

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
    Argv argv(args);
    return ReplyPtr(static_cast<redisReply*>(
        redisCommandArgv(context_.get(), argv.count(), argv.pointers.data(), argv.lengths.data())));
  }

  Result<ReplyPtr> checked(ReplyPtr reply, std::string_view what) {
    if (reply->type == REDIS_REPLY_ERROR) return replyError(options_, *reply, what);
    return reply;
  }

  RedisOptions options_;
  ContextPtr context_;  // null after a failed reconnect; the next run() tries again
};

}  // namespace troupe::redis
