#include "schema_convert.h"

namespace troupe {
namespace {

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

}  // namespace

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

}  // namespace troupe
