// How the Redis store writes and reads its records (node, actor and placement group hashes, the
// cluster event messages): shared by redis_cluster_store.cc and its fuzz target, since every byte
// read back from Redis may have been written by another version or by hand. Internal to runtime/.
// Thread-safe: no state.
#pragma once

#include <charconv>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "troupe/runtime/cluster_store.h"

namespace troupe::store_records {

// A hash as HGETALL returns it, field -> value.
using FieldMap = std::map<std::string, std::string>;

// kInternal naming the key and what is wrong with its record.
Status malformed(const std::string& key, const std::string& detail);

// The whole of `text` as an integer in Integer's range; false otherwise.
template <typename Integer>
bool parseInteger(const std::string& text, Integer& out) {
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, out);
  return ec == std::errc() && ptr == end;
}

std::optional<ActorState> parseActorState(const std::string& name);
std::optional<PlacementGroupState> parsePlacementGroupState(const std::string& name);

std::string bundlesJson(const std::vector<Bundle>& bundles);
// Throws json::exception when `text` is not an array of {"resources": {...}, "node_id": "..."}.
std::vector<Bundle> parseBundlesJson(const std::string& text);

// An elastic group's command as the append-command script takes it: a JSON object of its nonce,
// time_ms, from, kind and workers, to which the script prepends the seq it assigns.
std::string groupCommandJson(const GroupCommand& command, const std::string& nonce);
// A command as the script stored it (read at `key`, named in errors); malformed() when a field
// is missing, of another type or out of range (a resize to 0 or more than UINT32_MAX workers).
Result<GroupCommand> decodeGroupCommand(const std::string& text, const std::string& key);

// A NODE_ADDED / NODE_DEAD message on the events channel, and back; nullopt for anything else.
std::string eventMessage(ClusterEventType type, const NodeId& id, const std::string& reason, int64_t timeMs);
std::optional<ClusterEvent> parseEventMessage(const std::string& text);

// The record in `fields` (read at `key`, named in errors); malformed() when a field is missing,
// of another type or out of range. Missing fields read as empty (operator[] adds them).
Result<NodeRecord> decodeNode(FieldMap& fields, const std::string& key);
Result<ActorRecord> decodeActor(FieldMap& fields, const std::string& key);
Result<PlacementGroupRecord> decodePlacementGroup(FieldMap& fields, const std::string& key);

}  // namespace troupe::store_records
