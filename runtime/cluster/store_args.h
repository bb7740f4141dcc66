// Argument checks shared by the two ClusterStore implementations, so the fake and Redis reject
// the same input with the same message. Internal to runtime/.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "troupe/runtime/cluster_store.h"

namespace troupe::store_args {

Status emptyArgument(std::string_view what);  // kInvalidArgument "empty <what>"
Status emptyId();                             // an empty node id
Status checkNameArgs(const std::string& name, const ActorId& id);
Status checkNodeArgs(const NodeId& id, std::chrono::milliseconds ttl);
// Node ids and holders present; for reserve() also finite non-negative amounts and no holder
// twice on one node.
Status checkReservations(const std::vector<Reservation>& reservations, bool forReserve);
// A collective group's name present and its epoch >= 0.
Status checkGroupArgs(const std::string& group, int64_t epoch);
// The same, and a rendezvous rank >= 0 and a positive ttl.
Status checkRendezvousArgs(const std::string& group, int64_t epoch, int32_t rank, std::chrono::milliseconds ttl);
// A key space's name present and a positive ttl (a read passes none: 1 ms). Keys may be empty.
Status checkKeySpaceArgs(const std::string& space, std::chrono::milliseconds ttl = std::chrono::milliseconds(1));

}  // namespace troupe::store_args
