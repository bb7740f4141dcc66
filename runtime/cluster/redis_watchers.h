// The store's pub/sub readers, each on a connection of its own: the cluster's membership events
// and one collective group's epoch. Internal to runtime/.
#pragma once

#include <memory>
#include <string>

#include "redis_connection.h"

namespace troupe::redis {

// Reads NODE_ADDED / NODE_DEAD events from `context`, already subscribed to the events channel.
std::unique_ptr<EventSubscription> eventSubscription(RedisOptions options, ContextPtr context);
// Subscribes `context` to a group's epoch channel; returns once Redis confirmed it (only then is
// every later PUBLISH guaranteed to reach it).
Status subscribeEpoch(redisContext* context, const RedisOptions& options, const std::string& channel);
// Watches a group's epoch on `context`, subscribed by subscribeEpoch; `epochKey` is re-read after
// a reconnect so that an advance published meanwhile is not missed.
std::unique_ptr<GroupEpochWatch> groupEpochWatch(RedisOptions options, ContextPtr context, std::string group,
                                                 std::string channel, std::string epochKey);

}  // namespace troupe::redis
