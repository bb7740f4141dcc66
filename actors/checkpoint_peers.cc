#include "checkpoint_peers.h"

#include <asio/post.hpp>
#include <asio/steady_timer.hpp>

#include <memory>
#include <utility>

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

kj::Promise<void> CheckpointPeers::after(std::chrono::milliseconds delay) {
  auto paf = kj::newPromiseAndCrossThreadFulfiller<void>();
  auto& context = timerThread_.context();
  auto timer = std::make_shared<asio::steady_timer>(context, delay);
  // The timer is touched on its own thread only (asio timers are not thread-safe).
  asio::post(context, [timer, fulfiller = kj::mv(paf.fulfiller)]() mutable {
    timer->async_wait([timer, fulfiller = kj::mv(fulfiller)](const asio::error_code& e) mutable {
      if (!e) fulfiller->fulfill();  // cancelled: the promise is gone already
    });
  });
  auto cancel = kj::defer([timer, &context]() { asio::post(context, [timer]() { timer->cancel(); }); });
  return paf.promise.attach(kj::mv(cancel));
}

}  // namespace troupe::actors::checkpoint_actor
