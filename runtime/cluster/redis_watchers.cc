#include "redis_watchers.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "troupe/runtime/logging.h"

namespace troupe::redis {

using store_records::parseEventMessage;
using store_records::parseInteger;

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

namespace {

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

}  // namespace

std::unique_ptr<EventSubscription> eventSubscription(RedisOptions options, ContextPtr context) {
  return std::make_unique<RedisEventSubscription>(std::move(options), std::move(context));
}

std::unique_ptr<GroupEpochWatch> groupEpochWatch(RedisOptions options, ContextPtr context, std::string group,
                                                 std::string channel, std::string epochKey) {
  return std::make_unique<RedisGroupEpochWatch>(std::move(options), std::move(context), std::move(group),
                                                std::move(channel), std::move(epochKey));
}

}  // namespace troupe::redis
