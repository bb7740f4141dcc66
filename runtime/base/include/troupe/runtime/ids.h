// Strongly typed identifiers: 16 lower-case hex digits, random, unique per cluster.
// Thread-safety: value types.
#pragma once

#include <compare>
#include <functional>
#include <string>
#include <string_view>

namespace troupe {

// Random lower-case hex string of `bytes` random bytes (so 2*bytes characters),
// from the OS entropy source. Used for ids, tokens and passwords.
std::string randomHex(size_t bytes);

// True for 1 to 64 lower-case hex digits: what every id is, and all an id read from a peer
// or a flag may be before it becomes part of a file name or a Redis key.
bool isValidIdText(std::string_view text);

template <typename Tag>
class Id {
 public:
  Id() = default;
  explicit Id(std::string hex) : hex_(std::move(hex)) {}
  static Id generate() { return Id(randomHex(8)); }

  const std::string& hex() const { return hex_; }
  bool empty() const { return hex_.empty(); }
  bool valid() const { return isValidIdText(hex_); }
  auto operator<=>(const Id&) const = default;

 private:
  std::string hex_;
};

using NodeId = Id<struct NodeIdTag>;
using ActorId = Id<struct ActorIdTag>;
using GroupId = Id<struct GroupIdTag>;
using PlacementGroupId = Id<struct PlacementGroupIdTag>;

}  // namespace troupe

template <typename Tag>
struct std::hash<troupe::Id<Tag>> {
  size_t operator()(const troupe::Id<Tag>& id) const { return std::hash<std::string>()(id.hex()); }
};
