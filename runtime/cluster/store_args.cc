#include "store_args.h"

#include <cmath>
#include <set>

#include <fmt/format.h>

namespace troupe::store_args {

Status emptyArgument(std::string_view what) {
  return Status(StatusCode::kInvalidArgument, fmt::format("empty {}", what));
}
Status emptyId() { return emptyArgument("node id"); }

Status checkNameArgs(const std::string& name, const ActorId& id) {
  if (name.empty()) return emptyArgument("actor name");
  if (id.empty()) return emptyArgument("actor id");
  return Status::ok();
}

Status checkReservations(const std::vector<Reservation>& reservations, bool forReserve) {
  std::set<std::pair<NodeId, std::string>> seen;
  for (const Reservation& r : reservations) {
    if (r.nodeId.empty()) {
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("reservation of holder '{}' has an empty node id", r.holder));
    }
    if (r.holder.empty()) {
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("reservation on node {} has an empty holder", r.nodeId.hex()));
    }
    if (!forReserve) continue;
    for (const auto& [name, amount] : r.resources) {
      if (!std::isfinite(amount) || amount < 0) {
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("holder '{}' asks node {} for {} {}; amounts must be finite "
                                  "and non-negative",
                                  r.holder, r.nodeId.hex(), amount, name));
      }
    }
    if (!seen.emplace(r.nodeId, r.holder).second) {
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("holder '{}' appears twice for node {} in one reserve(); merge "
                                "its resources into one reservation",
                                r.holder, r.nodeId.hex()));
    }
  }
  return Status::ok();
}

Status checkNodeArgs(const NodeId& id, std::chrono::milliseconds ttl) {
  if (id.empty()) return emptyId();
  if (ttl.count() <= 0) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("heartbeat ttl must be positive, got {} ms", ttl.count()));
  }
  return Status::ok();
}

Status checkGroupArgs(const std::string& group, int64_t epoch) {
  if (group.empty()) return Status(StatusCode::kInvalidArgument, "empty group name");
  if (epoch < 0) {
    return Status(StatusCode::kInvalidArgument, fmt::format("group '{}': epoch must be >= 0, got {}", group, epoch));
  }
  return Status::ok();
}

Status checkRendezvousArgs(const std::string& group, int64_t epoch, int32_t rank, std::chrono::milliseconds ttl) {
  TROUPE_RETURN_IF_ERROR(checkGroupArgs(group, epoch));
  if (rank < 0) {
    return Status(StatusCode::kInvalidArgument, fmt::format("group '{}': rank must be >= 0, got {}", group, rank));
  }
  if (ttl.count() <= 0) {
    return Status(StatusCode::kInvalidArgument, fmt::format("rendezvous ttl must be positive, got {} ms", ttl.count()));
  }
  return Status::ok();
}

Status checkKeySpaceArgs(const std::string& space, std::chrono::milliseconds ttl) {
  if (space.empty()) return emptyArgument("key space name");
  if (ttl.count() <= 0) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("key space '{}': ttl must be positive, got {} ms", space, ttl.count()));
  }
  return Status::ok();
}

}  // namespace troupe::store_args
