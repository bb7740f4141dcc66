#include "troupe/runtime/schema_convert.h"

#include <fmt/format.h>

namespace troupe {

void toResources(const Resources& r, capnp::List<rpc::Resource>::Builder out) {
  unsigned i = 0;
  for (const auto& [name, qty] : r) {
    out[i].setName(name);
    out[i].setQuantity(qty);
    ++i;
  }
}

Resources fromResources(capnp::List<rpc::Resource>::Reader in) {
  Resources r;
  for (auto item : in) r[item.getName().cStr()] = item.getQuantity();
  return r;
}

void toNodeInfo(const NodeRecord& node, rpc::NodeInfo::Builder out) {
  out.setId(node.id.hex());
  out.setAddress(node.address);
  out.setHostname(node.hostname);
  out.setPid(node.pid);
  out.setIsHead(node.isHead);
  out.setState(nodeStateName(node.state));
  toResources(node.total, out.initTotal(static_cast<unsigned>(node.total.size())));
  toResources(node.used, out.initUsed(static_cast<unsigned>(node.used.size())));
  auto labels = out.initLabels(static_cast<unsigned>(node.labels.size()));
  unsigned i = 0;
  for (const auto& [key, value] : node.labels) {
    labels[i].setKey(key);
    labels[i].setValue(value);
    ++i;
  }
  out.setRegisteredMs(node.registeredMs);
  out.setLastHeartbeatMs(node.lastHeartbeatMs);
  out.setDeathReason(node.deathReason);
}

NodeRecord fromNodeInfo(rpc::NodeInfo::Reader in) {
  NodeRecord node;
  node.id = NodeId(in.getId().cStr());
  node.address = in.getAddress().cStr();
  node.hostname = in.getHostname().cStr();
  node.pid = in.getPid();
  node.isHead = in.getIsHead();
  node.state = std::string(in.getState().cStr()) == "DEAD" ? NodeState::kDead : NodeState::kAlive;
  node.total = fromResources(in.getTotal());
  node.used = fromResources(in.getUsed());
  for (auto label : in.getLabels()) node.labels[label.getKey().cStr()] = label.getValue().cStr();
  node.registeredMs = in.getRegisteredMs();
  node.lastHeartbeatMs = in.getLastHeartbeatMs();
  node.deathReason = in.getDeathReason().cStr();
  return node;
}

void toActorInfo(const ActorRecord& a, rpc::ActorInfo::Builder out) {
  out.setId(a.id.hex());
  out.setType(a.type);
  out.setName(a.name);
  out.setNodeId(a.nodeId.hex());
  out.setPid(a.pid);
  out.setAddress(a.address);
  out.setState(actorStateName(a.state));
  out.setIncarnation(a.incarnation);
  out.setRestarts(a.restarts);
  out.setMaxRestarts(a.maxRestarts);
  out.setMaxTaskRetries(a.maxTaskRetries);
  out.setDeathReason(a.deathReason);
  toResources(a.resources, out.initResources(static_cast<unsigned>(a.resources.size())));
  out.setPlacementGroup(a.placementGroup.hex());
  out.setBundleIndex(a.bundleIndex);
  out.setDetached(a.detached);
}

ActorRecord fromActorInfo(rpc::ActorInfo::Reader in) {
  ActorRecord a;
  a.id = ActorId(in.getId().cStr());
  a.type = in.getType().cStr();
  a.name = in.getName().cStr();
  a.nodeId = NodeId(in.getNodeId().cStr());
  a.pid = in.getPid();
  a.address = in.getAddress().cStr();
  std::string state = in.getState().cStr();
  a.state = state == "ALIVE" ? ActorState::kAlive
            : state == "RESTARTING" ? ActorState::kRestarting
            : state == "DEAD" ? ActorState::kDead
                              : ActorState::kPending;
  a.incarnation = in.getIncarnation();
  a.restarts = in.getRestarts();
  a.maxRestarts = in.getMaxRestarts();
  a.maxTaskRetries = in.getMaxTaskRetries();
  a.deathReason = in.getDeathReason().cStr();
  a.resources = fromResources(in.getResources());
  a.placementGroup = PlacementGroupId(in.getPlacementGroup().cStr());
  a.bundleIndex = in.getBundleIndex();
  a.detached = in.getDetached();
  return a;
}

void toGroupCommand(const GroupCommand& c, rpc::GroupCommand::Builder out) {
  out.setSeq(c.seq);
  out.setTimeMs(c.timeMs);
  out.setFrom(c.from);
  switch (c.kind) {
    case GroupCommand::Kind::kResize: out.setResize(c.workers); break;
    case GroupCommand::Kind::kStop: out.setStop(); break;
  }
}

Result<GroupCommand> fromGroupCommand(rpc::GroupCommand::Reader in) {
  GroupCommand c;
  c.seq = in.getSeq();
  c.timeMs = in.getTimeMs();
  c.from = in.getFrom().cStr();
  switch (in.which()) {
    case rpc::GroupCommand::RESIZE:
      c.kind = GroupCommand::Kind::kResize;
      c.workers = in.getResize();
      return c;
    case rpc::GroupCommand::STOP:
      c.kind = GroupCommand::Kind::kStop;
      return c;
  }
  // A newer peer's command this build does not know.
  return Status(StatusCode::kInvalidArgument,
                fmt::format("group command of unknown kind {}: is the sender a newer Troupe version?",
                            static_cast<unsigned>(in.which())));
}

void toElasticGroupInfo(const ElasticGroupRecord& g, rpc::ElasticGroupInfo::Builder out) {
  out.setId(g.id);
  out.setDoc(g.doc);
  out.setEpoch(g.epoch);
  auto events = out.initEvents(static_cast<unsigned>(g.events.size()));
  for (unsigned i = 0; i < g.events.size(); ++i) events.set(i, g.events[i]);
  auto commands = out.initCommands(static_cast<unsigned>(g.commands.size()));
  for (unsigned i = 0; i < g.commands.size(); ++i) toGroupCommand(g.commands[i], commands[i]);
}

ElasticGroupRecord fromElasticGroupInfo(rpc::ElasticGroupInfo::Reader in) {
  ElasticGroupRecord g;
  g.id = in.getId().cStr();
  g.doc = in.getDoc().cStr();
  g.epoch = in.getEpoch();
  for (auto e : in.getEvents()) g.events.push_back(e.cStr());
  for (auto c : in.getCommands()) {
    auto command = fromGroupCommand(c);
    if (command) g.commands.push_back(std::move(*command));  // one of a kind this build does not know: not shown
  }
  return g;
}

void toPlacementGroupInfo(const PlacementGroupRecord& g, rpc::PlacementGroupInfo::Builder out) {
  out.setId(g.id.hex());
  out.setName(g.name);
  out.setStrategy(placementStrategyName(g.strategy));
  out.setState(placementGroupStateName(g.state));
  auto bundles = out.initBundles(static_cast<unsigned>(g.bundles.size()));
  for (unsigned i = 0; i < g.bundles.size(); ++i) {
    toResources(g.bundles[i].resources, bundles[i].initResources(static_cast<unsigned>(g.bundles[i].resources.size())));
    bundles[i].setNodeId(g.bundles[i].nodeId.hex());
  }
  out.setPendingReason(g.pendingReason);
}

PlacementGroupRecord fromPlacementGroupInfo(rpc::PlacementGroupInfo::Reader in) {
  PlacementGroupRecord g;
  g.id = PlacementGroupId(in.getId().cStr());
  g.name = in.getName().cStr();
  auto strategy = parsePlacementStrategy(in.getStrategy().cStr());
  g.strategy = strategy.isOk() ? *strategy : PlacementStrategy::kPack;
  std::string state = in.getState().cStr();
  g.state = state == "CREATED" ? PlacementGroupState::kCreated
            : state == "REMOVED" ? PlacementGroupState::kRemoved
                                 : PlacementGroupState::kPending;
  for (auto b : in.getBundles()) g.bundles.push_back(Bundle{fromResources(b.getResources()), NodeId(b.getNodeId().cStr())});
  g.pendingReason = in.getPendingReason().cStr();
  return g;
}

}  // namespace troupe
