// Conversions between the store's records and their Cap'n Proto form (troupe.capnp): for every
// process that speaks the cluster's RPC (controller, node agents, clients, tests).
#pragma once

#include "troupe.capnp.h"
#include "troupe/runtime/cluster_store.h"

namespace troupe {

void toResources(const Resources& r, capnp::List<rpc::Resource>::Builder out);
Resources fromResources(capnp::List<rpc::Resource>::Reader in);

void toNodeInfo(const NodeRecord& node, rpc::NodeInfo::Builder out);
NodeRecord fromNodeInfo(rpc::NodeInfo::Reader in);

// Everything but initArgs, which travels separately and only to the node agent.
void toActorInfo(const ActorRecord& actor, rpc::ActorInfo::Builder out);
ActorRecord fromActorInfo(rpc::ActorInfo::Reader in);

void toPlacementGroupInfo(const PlacementGroupRecord& group, rpc::PlacementGroupInfo::Builder out);
void toElasticGroupInfo(const ElasticGroupRecord& group, rpc::ElasticGroupInfo::Builder out);
// Leaves out a command of a kind this build does not know (sent by a newer version).
ElasticGroupRecord fromElasticGroupInfo(rpc::ElasticGroupInfo::Reader in);
void toGroupCommand(const GroupCommand& command, rpc::GroupCommand::Builder out);
// kInvalidArgument for a command of a kind this build does not know.
Result<GroupCommand> fromGroupCommand(rpc::GroupCommand::Reader in);
PlacementGroupRecord fromPlacementGroupInfo(rpc::PlacementGroupInfo::Reader in);

}  // namespace troupe
