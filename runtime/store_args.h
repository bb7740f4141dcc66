// Argument checks shared by the two ClusterStore implementations, so the fake and Redis reject
// the same input with the same message. Internal to runtime/.
#pragma once

#include <chrono>
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

}  // namespace troupe::store_args
