// Conversions between the store's records and their Cap'n Proto form. Internal to runtime/.
#pragma once

#include "troupe.capnp.h"
#include "troupe/runtime/cluster_store.h"

namespace troupe {

void toNodeInfo(const NodeRecord& node, rpc::NodeInfo::Builder out);
NodeRecord fromNodeInfo(rpc::NodeInfo::Reader in);

}  // namespace troupe
