#include "checkpoint_peers.h"

namespace troupe::actors::checkpoint_actor {

kj::Promise<rpc::Checkpoint::Client> CheckpointPeers::checkpoint(const std::string& name) {
  return handle(name).then([](ActorHandle handle) { return handle.typed<rpc::Checkpoint>(); });
}

kj::Promise<ActorHandle> CheckpointPeers::handle(const std::string& name) {
  auto it = handles_.find(name);
  if (it != handles_.end()) return it->second;
  if (cluster_ == nullptr) return KJ_EXCEPTION(FAILED, "no cluster connection");
  return cluster_->getActor(name).then([this, name](ActorHandle handle) {
    handles_.emplace(name, handle);
    return handle;
  });
}

}  // namespace troupe::actors::checkpoint_actor
