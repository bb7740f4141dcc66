#include "troupe/runtime/client.h"

#include <algorithm>
#include <map>
#include <unistd.h>

#include <fmt/format.h>

#include "troupe/runtime/held_buffers.h"
#include "troupe/runtime/schema_convert.h"
#include "troupe.capnp.h"
#include "troupe/runtime/config.h"
#include "troupe/runtime/logging.h"
#include "troupe/runtime/rpc.h"

namespace troupe {

namespace {
constexpr uint32_t kWaitChunkMs = 30000;  // a pending actor is waited for in chunks of this

// A worker's error for one call, `what` naming the call. The worker's code comes along, except
// ACTOR_DIED: from a worker it means that an actor the worker called died, while this one is
// alive, so the caller hears UNAVAILABLE (a peer could not be reached). Only this client, from
// the record of the actor it calls, says that actor died.
kj::Exception workerError(const kj::Exception& e, const std::string& what) {
  Status status = statusFromException(e, what);
  if (status.code() == StatusCode::kActorDied) status = Status(StatusCode::kUnavailable, status.message());
  return exceptionFromStatus(status);
}

class LogErrors final : public kj::TaskSet::ErrorHandler {
 public:
  void taskFailed(kj::Exception&& e) override { TROUPE_LOG(kDebug, "client task: {}", e.getDescription().cStr()); }
};
LogErrors gLogErrors;
}  // namespace

struct ClusterClient::Shared : std::enable_shared_from_this<ClusterClient::Shared> {
  Shared(kj::AsyncIoContext& io, std::string token, HostPort address, kj::Own<RpcClient> rpc, PeerWait actorCalls)
      : io(io), token(std::move(token)), address(std::move(address)), actorCalls(actorCalls), rpc(kj::mv(rpc)),
        controller(this->rpc->bootstrap<rpc::Controller>()), tasks(kj::heap<kj::TaskSet>(gLogErrors)) {}
  kj::AsyncIoContext& io;
  std::string token;
  HostPort address;
  PeerWait actorCalls;
  kj::Own<RpcClient> rpc;
  rpc::Controller::Client controller;
  uint64_t generation = 0;  // of `rpc`: each reconnect makes a new one
  kj::Maybe<kj::ForkedPromise<void>> reconnecting;
  // Background work of this client and its handles. Tasks hold handles, and handles hold this
  // object, so ~ClusterClient cancels them first: an object must never be destroyed from
  // inside one of its own tasks (KJ aborts).
  kj::Own<kj::TaskSet> tasks;
  // This client's session: its non-detached actors end when the client (or its connection) does.
  kj::Maybe<rpc::Session::Client> session;
  std::string sessionId;
  // Node deaths (watchNodeDeaths): the actor connections by the node of their worker, broken
  // when the controller declares it DEAD, and what else wants to hear (onNodeDeath).
  std::multimap<NodeId, std::weak_ptr<ActorConnection>> byNode;
  size_t byNodeSwept = 0;  // byNode's size after its last sweep of ended connections
  std::vector<kj::Function<void(const NodeId&, const Status&)>> deathListeners;
  bool watchingDeaths = false;
  bool closed = false;  // ~ClusterClient ran: start no watch that nothing would end
  uint64_t deathInstance = 0;  // the controller run whose count deathAfter is
  uint64_t deathAfter = 0;

  kj::Promise<ActorRecord> waitActor(const ActorId& id, uint32_t minIncarnation, bool requireAlive, uint32_t timeoutMs) {
    return withController([id, minIncarnation, requireAlive, timeoutMs](rpc::Controller::Client& c) {
      auto request = c.waitActorRequest();
      request.setId(id.hex());
      request.setMinIncarnation(minIncarnation);
      request.setRequireAlive(requireAlive);
      request.setTimeoutMs(timeoutMs);
      return request.send().then([](auto response) { return fromActorInfo(response.getActor()); });
    });
  }

  // Opens this client's session, or resumes it (same id) on a new connection.
  kj::Promise<void> openSession() {
    auto request = controller.openSessionRequest();
    request.setResume(sessionId);
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    request.setInfo(fmt::format("{} pid {}", host, getpid()));
    auto self = shared_from_this();
    return request.send().then([self](auto response) {
      self->session = response.getSession();
      self->sessionId = response.getId().cStr();
      // Resume at once when the controller goes, not at the next call: a worker may not call
      // it again for hours, and a session nobody resumes ends with its actors.
      std::weak_ptr<Shared> weak = self;
      self->tasks->add(self->rpc->onDisconnect().then([weak, used = self->generation]() -> kj::Promise<void> {
        if (auto alive = weak.lock()) return alive->reconnect(used);
        return kj::READY_NOW;
      }));
    });
  }

  // Runs `call` on the controller. When the connection is lost (the controller restarted), it
  // reconnects, resumes the session and runs `call` once more: every controller RPC is
  // idempotent (ids are chosen by the client), so a call that did reach the old one is safe.
  // An UNAVAILABLE answer (the controller lost Redis, which the head restarts) is asked again
  // after 50 ms doubling to 1 s, for up to kStoreOutageFor, unless the call says UNAVAILABLE
  // means something else for it (`retryUnavailable` false: addBundles's "no room now").
  template <typename Fn>
  auto withController(Fn call, bool retryUnavailable = true) -> decltype(call(std::declval<rpc::Controller::Client&>())) {
    auto now = kj::systemPreciseMonotonicClock().now();
    return withControllerUntil(kj::mv(call), retryUnavailable ? now + kStoreOutageFor : now, 50 * kj::MILLISECONDS);
  }

  static constexpr kj::Duration kStoreOutageFor = 30 * kj::SECONDS;

  template <typename Fn>
  auto withControllerUntil(Fn call, kj::TimePoint deadline, kj::Duration delay)
      -> decltype(call(std::declval<rpc::Controller::Client&>())) {
    using P = decltype(call(std::declval<rpc::Controller::Client&>()));
    auto self = shared_from_this();
    uint64_t used = generation;
    return kj::evalNow([&]() { return call(controller); })
        .catch_([self, used, call, deadline, delay](kj::Exception&& e) mutable -> P {
          if (e.getType() == kj::Exception::Type::DISCONNECTED) {
            return self->reconnect(used).then([self, call]() mutable { return call(self->controller); });
          }
          if (statusFromException(e, "").code() != StatusCode::kUnavailable ||
              kj::systemPreciseMonotonicClock().now() + delay >= deadline) {
            return kj::mv(e);
          }
          if (delay == 50 * kj::MILLISECONDS) {
            TROUPE_LOG(kWarning, "the controller cannot serve this call now ({}); asking again for up to {} s",
                       statusFromException(e, "").message(), kStoreOutageFor / kj::SECONDS);
          }
          return self->io.provider->getTimer().afterDelay(delay).then([self, call, deadline, delay]() mutable {
            return self->withControllerUntil(kj::mv(call), deadline, kj::min(delay * 2, 1 * kj::SECONDS));
          });
        });
  }

  // One reconnect at a time, shared by every call that saw generation `failed` fail.
  kj::Promise<void> reconnect(uint64_t failed) {
    if (generation != failed) return kj::READY_NOW;
    if (reconnecting == nullptr) {
      auto self = shared_from_this();
      auto deadline = kj::systemPreciseMonotonicClock().now() + kReconnectFor;
      reconnecting = reconnectUntil(deadline)
                         .then([self]() { self->reconnecting = nullptr; },
                               [self](kj::Exception&& e) {
                                 self->reconnecting = nullptr;
                                 kj::throwFatalException(kj::mv(e));
                               })
                         .fork();
    }
    KJ_IF_MAYBE(r, reconnecting) { return r->addBranch(); }
    KJ_UNREACHABLE;
  }

  static constexpr kj::Duration kReconnectFor = 60 * kj::SECONDS;

  kj::Promise<void> reconnectUntil(kj::TimePoint deadline) {
    auto self = shared_from_this();
    return RpcClient::connect(io, address, token, 2 * kj::SECONDS)
        .then([self](kj::Own<RpcClient> fresh) {
          // Destroyed on a later turn: we may be inside one of its own callbacks.
          self->tasks->add(kj::evalLater([old = kj::mv(self->rpc)]() {}));
          self->rpc = kj::mv(fresh);
          self->controller = self->rpc->bootstrap<rpc::Controller>();
          ++self->generation;
          return self->openSession();
        })
        .catch_([self, deadline](kj::Exception&& e) -> kj::Promise<void> {
          // Only an unreachable controller is worth waiting for; a session the restarted
          // controller already ended (NOT_FOUND) cannot come back: say so now.
          if (e.getType() != kj::Exception::Type::DISCONNECTED && e.getType() != kj::Exception::Type::OVERLOADED) {
            return kj::mv(e);
          }
          if (kj::systemPreciseMonotonicClock().now() >= deadline) {
            return exceptionFromStatus(
                Status(StatusCode::kUnavailable,
                       fmt::format("lost the connection to the controller at {} and could not reconnect within 60 s: {}",
                                   self->address.toString(), statusFromException(e, "").message())),
                kj::Exception::Type::DISCONNECTED);
          }
          return self->io.provider->getTimer().afterDelay(200 * kj::MILLISECONDS).then([self, deadline]() {
            return self->reconnectUntil(deadline);
          });
        });
  }
};

// One actor as seen by this client: the current incarnation's connection, shared by handles.
struct ActorConnection {
  std::shared_ptr<ClusterClient::Shared> shared;
  ActorId id;
  std::string type = "actor";
  int32_t maxTaskRetries = 0;
  uint32_t minIncarnation = 1;  // do not use incarnations older than this
  uint32_t incarnation = 0;     // of `cap`
  NodeId nodeId;                // where incarnation `incarnation` runs
  std::string nodeDeath;        // why its connection was broken, when its node was declared DEAD
  kj::Own<RpcClient> rpc;
  kj::Maybe<rpc::Actor::Client> cap;
  kj::Maybe<kj::ForkedPromise<void>> resolving;

  // Calls made in this event-loop turn, sent together as one batch at its end.
  struct Queued {
    std::string method;
    std::string payload;
    int attempt = 0;
    kj::Own<kj::PromiseFulfiller<Reply>> reply;
    uint64_t seq = 0;  // submission order, kept across retries
    int32_t maxTaskRetries = ActorHandle::kActorsRetries;  // this call's, else the actor's
  };
  std::vector<Queued> queue;
  uint64_t nextSeq = 0;
  // Calls lost with a worker are sent again in submission order, and calls made meanwhile wait
  // behind them: one caller's calls keep their order across restarts.
  bool recovering = false;
  std::vector<Queued> lost;  // lost with the worker, waiting for the verdict on the incarnation
  std::vector<Queued> held;  // made while recovering

  std::string died(const ActorRecord& r) const { return fmt::format("actor {} ({}) died: {}", id.hex(), type, r.deathReason); }

  void learn(const ActorRecord& r) {
    if (!r.type.empty()) type = r.type;
    maxTaskRetries = r.maxTaskRetries;
  }

  // Drops the connection to `inc` (its worker is gone); later calls resolve a newer one.
  void forget(uint32_t inc) {
    minIncarnation = std::max(minIncarnation, inc + 1);
    if (incarnation != inc) return;
    cap = nullptr;
    resolving = nullptr;
    // Destroyed on a later turn: we may be inside one of its own callbacks.
    if (rpc) shared->tasks->add(kj::evalLater([old = kj::mv(rpc)]() {}));
  }
};

namespace {

std::string nodeDeathReason(const NodeId& node) {
  return fmt::format("node {} was declared DEAD: its host stopped answering", node.hex());
}

// A node the controller declared DEAD: the connections to its workers break now, so the calls in
// flight on them fail (with the verdict on their actor) instead of waiting for the sockets.
void nodeDied(ClusterClient::Shared& s, const NodeId& node) {
  Status why(StatusCode::kUnavailable, nodeDeathReason(node));
  auto range = s.byNode.equal_range(node);
  std::vector<std::shared_ptr<ActorConnection>> hit;
  for (auto it = range.first; it != range.second; ++it) {
    if (auto c = it->second.lock()) hit.push_back(std::move(c));
  }
  s.byNode.erase(range.first, range.second);
  for (auto& c : hit) {
    if (c->rpc && c->nodeId == node) {
      c->nodeDeath = why.message();
      c->rpc->breakConnection(why);
    }
  }
  for (auto& listener : s.deathListeners) listener(node, why);
}

// Asks the controller for the nodes it declares DEAD, one long wait after another, for as long as
// the client lives (held weakly: the wait must not keep it). A controller that does not know the
// call (older) ends the watch; any other failure is asked again after 500 ms (a restarted
// controller is reconnected by the session's watch).
kj::Promise<void> watchDeaths(std::weak_ptr<ClusterClient::Shared> weak) {
  auto self = weak.lock();
  if (!self || self->closed) return kj::READY_NOW;
  auto request = self->controller.watchNodeDeathsRequest();
  request.setInstance(self->deathInstance);
  request.setAfter(self->deathAfter);
  request.setTimeoutMs(30'000);
  auto& timer = self->io.provider->getTimer();
  self.reset();
  return request.send().then(
      [weak](capnp::Response<rpc::Controller::WatchNodeDeathsResults> response) -> kj::Promise<void> {
        auto self = weak.lock();
        if (!self) return kj::READY_NOW;
        self->deathInstance = response.getInstance();
        self->deathAfter = response.getNext();
        for (auto id : response.getNodes()) nodeDied(*self, NodeId(id.cStr()));
        return watchDeaths(weak);
      },
      [weak, &timer](kj::Exception&& e) -> kj::Promise<void> {
        if (e.getType() == kj::Exception::Type::UNIMPLEMENTED) return kj::READY_NOW;
        return timer.afterDelay(500 * kj::MILLISECONDS).then([weak]() { return watchDeaths(weak); });
      });
}

void startDeathWatch(ClusterClient::Shared& s) {
  if (s.watchingDeaths || s.closed) return;
  s.watchingDeaths = true;
  s.tasks->add(watchDeaths(s.weak_from_this()));
}

// Its callbacks hold the connection weakly: the promise lives in c->resolving, and a strong
// reference there would be a cycle whose last link goes from inside the promise's own callback
// (KJ aborts on a callback destroying itself). The callers that wait on it hold it strongly.
kj::Promise<void> connectAlive(std::shared_ptr<ActorConnection> c) {
  std::weak_ptr<ActorConnection> weak = c;
  auto gone = []() { return kj::Promise<void>(KJ_EXCEPTION(DISCONNECTED, "the actor handle was dropped")); };
  return c->shared->waitActor(c->id, c->minIncarnation, true, kWaitChunkMs)
      .then([weak, gone](ActorRecord record) -> kj::Promise<void> {
        auto c = weak.lock();
        if (!c) return gone();
        c->learn(record);
        if (record.state == ActorState::kDead) throwStatus(Status(StatusCode::kActorDied, c->died(record)));
        if (record.state != ActorState::kAlive || record.incarnation < c->minIncarnation) {
          return connectAlive(c);  // still starting or waiting for resources
        }
        auto address = parseHostPort(record.address);
        if (!address.isOk()) throwStatus(address.status());
        uint32_t inc = record.incarnation;
        // A host that does not answer a connect within the silence limit + 1 s is as silent as one
        // whose connection ends then (a connect in flight to a cut host's worker outlived the
        // node's DEAD verdict: nodeDied breaks only connections made).
        auto within = kj::min(5 * kj::SECONDS, (peerSilenceLimit().count() + 1000) * kj::MILLISECONDS);
        return RpcClient::connect(c->shared->io, *address, c->shared->token, within, c->shared->actorCalls)
            .then(
                [weak, gone, inc, nodeId = record.nodeId](kj::Own<RpcClient> client) -> kj::Promise<void> {
                  auto c = weak.lock();
                  if (!c) return gone();
                  c->cap = client->bootstrap<rpc::Actor>();
                  // Once the worker's connection drops, later calls go to the next incarnation.
                  c->shared->tasks->add(client->onDisconnect().then([weak, inc]() {
                    if (auto alive = weak.lock()) alive->forget(inc);
                  }));
                  c->rpc = kj::mv(client);
                  c->incarnation = inc;
                  c->nodeId = nodeId;
                  c->nodeDeath.clear();
                  auto& s = *c->shared;
                  if (s.byNode.size() >= 2 * s.byNodeSwept + 64) {  // drop the entries of ended handles
                    std::erase_if(s.byNode, [](const auto& entry) { return entry.second.expired(); });
                    s.byNodeSwept = s.byNode.size();
                  }
                  s.byNode.emplace(nodeId, weak);
                  startDeathWatch(s);
                  return kj::READY_NOW;
                },
                [weak, gone, inc](kj::Exception&&) -> kj::Promise<void> {
                  // It died between reporting ready and our connect: wait for what comes next.
                  auto c = weak.lock();
                  if (!c) return gone();
                  c->minIncarnation = std::max(c->minIncarnation, inc + 1);
                  return connectAlive(c);
                });
      });
}

kj::Promise<std::pair<rpc::Actor::Client, uint32_t>> resolve(std::shared_ptr<ActorConnection> c) {
  KJ_IF_MAYBE(cap, c->cap) { return std::make_pair(*cap, c->incarnation); }
  if (c->resolving == nullptr) c->resolving = connectAlive(c).fork();
  KJ_IF_MAYBE(r, c->resolving) {
    return r->addBranch().then(
        [c]() -> kj::Promise<std::pair<rpc::Actor::Client, uint32_t>> { return resolve(c); },
        [c](kj::Exception&& e) -> kj::Promise<std::pair<rpc::Actor::Client, uint32_t>> {
          c->resolving = nullptr;  // the next call tries again
          kj::throwFatalException(kj::mv(e));
        });
  }
  KJ_UNREACHABLE;
}

kj::Promise<Reply> callActor(std::shared_ptr<ActorConnection> c, std::string method, std::string payload,
                             int32_t maxTaskRetries);

void flush(std::shared_ptr<ActorConnection> c);

// The worker of incarnation `inc` is gone with these calls in flight: learn why from the
// controller once it has handled the exit, then retry each call or fail it with the reason.
// Every request in flight on the lost connection lands here (in the same turns); the first
// starts the wait, and the verdict re-sends all of them in submission order.
void callsLost(std::shared_ptr<ActorConnection> c, uint32_t inc, std::vector<ActorConnection::Queued> calls) {
  c->forget(inc);
  for (auto& call : calls) c->lost.push_back(kj::mv(call));
  if (c->recovering) return;
  c->recovering = true;
  auto finish = [c]() {
    c->recovering = false;
    for (auto& call : c->held) c->queue.push_back(kj::mv(call));
    c->held.clear();
    if (!c->queue.empty()) flush(c);
  };
  c->shared->tasks->add(c->shared->waitActor(c->id, inc + 1, false, 10000)
                            .then(
                                [c, inc, finish](ActorRecord record) {
                                  c->learn(record);
                                  auto lost = kj::mv(c->lost);
                                  c->lost.clear();
                                  std::sort(lost.begin(), lost.end(),
                                            [](const auto& a, const auto& b) { return a.seq < b.seq; });
                                  std::vector<ActorConnection::Queued> again;
                                  for (auto& call : lost) {
                                    std::string error;
                                    StatusCode code = StatusCode::kActorDied;
                                    if (record.state == ActorState::kDead) {
                                      // Its node's death, when that broke the connection, in
                                      // the client's words (naming the node and DEAD).
                                      error = c->nodeDeath.empty() || record.nodeId != c->nodeId
                                                  ? c->died(record)
                                                  : fmt::format("actor {} ({}) died: {}", c->id.hex(), c->type,
                                                                c->nodeDeath);
                                    } else if (record.incarnation <= inc) {
                                      code = StatusCode::kUnavailable;
                                      error = fmt::format(
                                          "actor {} ({}): lost the connection to its worker; no exit was reported within 10 s",
                                          c->id.hex(), c->type);
                                    } else if (int32_t limit = call.maxTaskRetries == ActorHandle::kActorsRetries
                                                                   ? c->maxTaskRetries
                                                                   : call.maxTaskRetries;
                                               limit == -1 || call.attempt < limit) {
                                      ++call.attempt;
                                      again.push_back(kj::mv(call));
                                      continue;
                                    } else {
                                      error = fmt::format(
                                          "actor {} ({}) died: {} (during '{}'; it is restarting as incarnation {}; the "
                                          "call was not retried: max_task_retries={})",
                                          c->id.hex(), c->type, record.deathReason, call.method, record.incarnation,
                                          call.maxTaskRetries == ActorHandle::kActorsRetries ? c->maxTaskRetries
                                                                                             : call.maxTaskRetries);
                                    }
                                    call.reply->reject(exceptionFromStatus(Status(code, error)));
                                  }
                                  // The retried calls go first, then the ones made meanwhile.
                                  for (auto& call : c->queue) again.push_back(kj::mv(call));
                                  c->queue = kj::mv(again);
                                  finish();
                                },
                                [c, finish](kj::Exception&& e) {
                                  for (auto& call : c->lost) call.reply->reject(kj::cp(e));
                                  c->lost.clear();
                                  finish();
                                }));
}

// A batch's replies arrive together, so a slow call delays the replies of the calls before it
// in the same batch. Only bursts at least this long are batched (throughput matters more
// there); smaller groups go as separate pipelined calls, each answered when it is done.
constexpr size_t kMinBatch = 16;

void sendQueued(std::shared_ptr<ActorConnection> c, std::vector<ActorConnection::Queued> queued);

std::string_view asChars(capnp::Data::Reader data) {
  return std::string_view(reinterpret_cast<const char*>(data.begin()), data.size());
}

// Large arguments go from the caller's buffer straight to the socket, not copied into the
// message: the call's queue entry holds `bytes` until its reply, so they outlive the message.
void setPayload(rpc::Actor::CallParams::Builder params, std::string& bytes) {
  if (bytes.size() < kReferenceFrom) {
    params.setPayload(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(bytes.data()), bytes.size()));
  } else {
    params.adoptPayload(referenceBytes(params, bytes));
  }
}

// Sends what was queued this turn: separate calls for a few, one batch for a burst.
void flush(std::shared_ptr<ActorConnection> c) {
  std::vector<ActorConnection::Queued> queued = std::move(c->queue);
  c->queue.clear();
  if (c->recovering) {  // behind the calls that are about to be sent again
    for (auto& call : queued) c->held.push_back(kj::mv(call));
    return;
  }
  if (queued.size() >= kMinBatch) return sendQueued(c, std::move(queued));
  for (auto& call : queued) {
    std::vector<ActorConnection::Queued> one;
    one.push_back(std::move(call));
    sendQueued(c, std::move(one));
  }
}

void sendQueued(std::shared_ptr<ActorConnection> c, std::vector<ActorConnection::Queued> queued) {
  auto calls = std::make_shared<std::vector<ActorConnection::Queued>>(std::move(queued));
  c->shared->tasks->add(resolve(c).then(
      [c, calls](std::pair<rpc::Actor::Client, uint32_t> target) -> kj::Promise<void> {
        uint32_t inc = target.second;
        auto onLost = [c, calls, inc](kj::Exception&& e) {
          if (e.getType() != kj::Exception::Type::DISCONNECTED) {
            for (auto& call : *calls) call.reply->reject(kj::cp(e));
            return;
          }
          callsLost(c, inc, std::move(*calls));
        };
        if (calls->size() == 1) {
          auto& call = calls->front();
          auto request = target.first.callRequest();
          request.setMethod(call.method);
          setPayload(request, call.payload);
          return request.send().then(
              [c, calls](capnp::Response<rpc::Actor::CallResults> response) {
                auto r = response.getResult();
                if (r.size() < kReferenceFrom) return calls->front().reply->fulfill(Reply(std::string(asChars(r))));
                auto message = std::make_shared<capnp::Response<rpc::Actor::CallResults>>(kj::mv(response));
                calls->front().reply->fulfill(Reply(std::move(message), asChars(r)));
              },
              [c, calls, onLost](kj::Exception&& e) mutable {
                if (e.getType() == kj::Exception::Type::DISCONNECTED) return onLost(kj::mv(e));
                // The worker's code, if it sent one, reaches the caller with the call named.
                calls->front().reply->reject(
                    workerError(e, fmt::format("actor {} ({}).{}", c->id.hex(), c->type, calls->front().method)));
              });
        }
        auto request = target.first.callBatchRequest();
        auto list = request.initCalls(static_cast<unsigned>(calls->size()));
        for (unsigned i = 0; i < calls->size(); ++i) {
          list[i].setMethod((*calls)[i].method);
          list[i].setPayload(capnp::Data::Reader(reinterpret_cast<const kj::byte*>((*calls)[i].payload.data()),
                                                 (*calls)[i].payload.size()));
        }
        return request.send().then(
            [c, calls](capnp::Response<rpc::Actor::CallBatchResults> response) {
              auto replies = response.getReplies();
              std::shared_ptr<const void> message;  // made for the first large result
              for (unsigned i = 0; i < calls->size(); ++i) {
                auto& call = (*calls)[i];
                if (i < replies.size() && replies[i].isResult()) {
                  auto r = replies[i].getResult();
                  if (r.size() < kReferenceFrom) {
                    call.reply->fulfill(Reply(std::string(asChars(r))));
                    continue;
                  }
                  // The readers stay valid: moving a Response moves its owner, not the bytes.
                  if (!message) {
                    message = std::make_shared<capnp::Response<rpc::Actor::CallBatchResults>>(kj::mv(response));
                  }
                  call.reply->fulfill(Reply(message, asChars(r)));
                } else {
                  std::string why = i < replies.size() ? replies[i].getError().cStr() : "no reply in the batch";
                  // A batched error is the worker's exception text, its code tag included.
                  call.reply->reject(
                      workerError(kj::Exception(kj::Exception::Type::FAILED, __FILE__, __LINE__, kj::str(why.c_str())),
                                  fmt::format("actor {} ({}).{}", c->id.hex(), c->type, call.method)));
                }
              }
            },
            kj::mv(onLost));
      },
      [calls](kj::Exception&& e) {
        for (auto& call : *calls) call.reply->reject(kj::cp(e));
      }).catch_([calls](kj::Exception&& e) {
        // Thrown while sending (e.g. a message over the limit): the calls not yet answered fail with it.
        for (auto& call : *calls) {
          if (call.reply->isWaiting()) call.reply->reject(kj::cp(e));
        }
      }));
}

// Queues the call; the first call of a turn schedules the flush at the end of the turn.
kj::Promise<Reply> callActor(std::shared_ptr<ActorConnection> c, std::string method, std::string payload,
                             int32_t maxTaskRetries) {
  if (payload.size() > kMaxRpcMessageBytes - 4096) {  // the rest of the message needs a little room
    return exceptionFromStatus(Status(
        StatusCode::kInvalidArgument,
        fmt::format("actor {} ({}).{}: the arguments are {} bytes, larger than one call carries ({} bytes)",
                    c->id.hex(), c->type, method, payload.size(), kMaxRpcMessageBytes - 4096)));
  }
  auto paf = kj::newPromiseAndFulfiller<Reply>();
  bool first = c->queue.empty();
  c->queue.push_back({kj::mv(method), kj::mv(payload), 0, kj::mv(paf.fulfiller), c->nextSeq++, maxTaskRetries});
  if (first) c->shared->tasks->add(kj::evalLast([c]() { flush(c); }));
  return kj::mv(paf.promise);
}

std::shared_ptr<ActorConnection> connectionFor(std::shared_ptr<ClusterClient::Shared> shared, const ActorRecord& r) {
  auto c = std::make_shared<ActorConnection>();
  c->shared = std::move(shared);
  c->id = r.id;
  c->learn(r);
  return c;
}

void toSpec(const ActorOptions& o, rpc::ActorSpec::Builder spec) {
  spec.setType(o.type);
  spec.setName(o.name);
  toResources(o.resources, spec.initResources(static_cast<unsigned>(o.resources.size())));
  spec.setMaxRestarts(o.maxRestarts);
  spec.setMaxTaskRetries(o.maxTaskRetries);
  spec.setDetached(o.detached);
  spec.setInitArgs(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(o.initArgs.data()), o.initArgs.size()));
  spec.setPlacementGroup(o.placementGroup.hex());
  spec.setBundleIndex(o.bundleIndex);
}

void toBundles(const std::vector<Resources>& bundles, capnp::List<rpc::BundleInfo>::Builder out) {
  for (unsigned i = 0; i < bundles.size(); ++i) {
    toResources(bundles[i], out[i].initResources(static_cast<unsigned>(bundles[i].size())));
  }
}

}  // namespace

void ClusterClient::onNodeDeath(kj::Function<void(const NodeId&, const Status&)> listener) {
  shared_->deathListeners.push_back(kj::mv(listener));
  startDeathWatch(*shared_);
}

const ActorId& ActorHandle::id() const { return connection_->id; }

kj::Promise<Reply> ActorHandle::callReply(std::string method, std::string payload, int32_t maxTaskRetries) {
  return callActor(connection_, kj::mv(method), kj::mv(payload), maxTaskRetries);
}

kj::Promise<std::string> ActorHandle::call(std::string method, std::string payload, int32_t maxTaskRetries) {
  return callReply(kj::mv(method), kj::mv(payload), maxTaskRetries).then([](Reply reply) {
    return std::move(reply).str();
  });
}

kj::Promise<capnp::Capability::Client> ActorHandle::typedCapability() {
  return resolve(connection_).then([](std::pair<rpc::Actor::Client, uint32_t> target) -> capnp::Capability::Client {
    return target.first.typedRequest().send().getCap();
  });
}

kj::Promise<ActorRecord> ActorHandle::ready() {
  auto c = connection_;
  return resolve(c).then([c](std::pair<rpc::Actor::Client, uint32_t>) {
    return c->shared->waitActor(c->id, c->incarnation, true, 0);
  });
}

kj::Promise<kj::Own<ClusterClient>> ClusterClient::connect(kj::AsyncIoContext& io, const HostPort& controller,
                                                          std::string token, PeerWait actorCalls) {
  keepMessageBuffers();
  return RpcClient::connect(io, controller, token, 10 * kj::SECONDS)
      .then([&io, token, controller, actorCalls](kj::Own<RpcClient> rpc) {
        auto shared = std::make_shared<Shared>(io, token, controller, kj::mv(rpc), actorCalls);
        // Through withController: a controller that cannot reach Redis right now is asked again.
        return shared->withController([shared](rpc::Controller::Client&) { return shared->openSession(); }).then([shared]() {
          return kj::Own<ClusterClient>(new ClusterClient(shared), kj::_::HeapDisposer<ClusterClient>::instance);
        });
      });
}

// Ends the session now (handles may keep `shared_` alive longer), so this client's
// non-detached actors are reclaimed when the client goes, as in Ray.
ClusterClient::~ClusterClient() {
  shared_->session = nullptr;
  shared_->closed = true;
  shared_->deathListeners.clear();
  // Cancel in-flight work now, from outside it (see Shared::tasks); handles that outlive the
  // client get a fresh set.
  auto old = kj::mv(shared_->tasks);
  shared_->tasks = kj::heap<kj::TaskSet>(gLogErrors);
  old = nullptr;
}

kj::Promise<ActorHandle> ClusterClient::submitActor(ActorOptions options) {
  auto shared = shared_;
  // The id is chosen once, so a retry after a reconnect finds the actor the first try made.
  return shared_->withController([shared, id = ActorId::generate(), options](rpc::Controller::Client& c) {
    auto request = c.createActorRequest();
    request.setId(id.hex());
    toSpec(options, request.initSpec());
    request.getSpec().setOwner(shared->sessionId);
    return request.send().then([shared](auto response) {
      return ActorHandle(connectionFor(shared, fromActorInfo(response.getActor())));
    });
  });
}

kj::Promise<ActorHandle> ClusterClient::createActor(ActorOptions options) {
  return submitActor(kj::mv(options)).then([](ActorHandle handle) {
    return handle.ready().then([handle](ActorRecord) { return handle; });
  });
}

kj::Promise<ActorHandle> ClusterClient::getActor(const std::string& name) {
  auto shared = shared_;
  return shared_->withController([shared, name](rpc::Controller::Client& c) {
    auto request = c.getActorByNameRequest();
    request.setName(name);
    return request.send().then([shared](auto response) {
      return ActorHandle(connectionFor(shared, fromActorInfo(response.getActor())));
    });
  });
}

ActorHandle ClusterClient::actor(const ActorId& id) {
  ActorRecord r;
  r.id = id;
  return ActorHandle(connectionFor(shared_, r));
}

kj::Promise<void> ClusterClient::reportActorReady(const ActorId& actor, uint32_t incarnation,
                                                 const std::string& address) {
  return shared_->withController([actor, incarnation, address](rpc::Controller::Client& c) {
    auto request = c.actorReadyRequest();
    request.setId(actor.hex());
    request.setIncarnation(incarnation);
    request.setAddress(address);
    request.setPid(getpid());
    return request.send().ignoreResult();
  });
}

kj::Promise<void> ClusterClient::kill(const ActorHandle& actor, bool noRestart) {
  return shared_->withController([id = actor.id(), noRestart](rpc::Controller::Client& c) {
    auto request = c.killActorRequest();
    request.setId(id.hex());
    request.setNoRestart(noRestart);
    return request.send().ignoreResult();
  });
}

kj::Promise<ActorRecord> ClusterClient::actorInfo(const ActorId& id) { return shared_->waitActor(id, 0, false, 0); }

kj::Promise<std::vector<ActorRecord>> ClusterClient::listActors() {
  return shared_->withController([](rpc::Controller::Client& c) {
    return c.statusRequest().send().then([](auto response) {
      std::vector<ActorRecord> out;
      for (auto a : response.getActors()) out.push_back(fromActorInfo(a));
      return out;
    });
  });
}

kj::Promise<std::vector<NodeRecord>> ClusterClient::listNodes() {
  return shared_->withController([](rpc::Controller::Client& c) {
    auto request = c.statusRequest();
    request.setActors(false);
    return request.send().then([](auto response) {
      std::vector<NodeRecord> out;
      for (auto n : response.getNodes()) out.push_back(fromNodeInfo(n));
      return out;
    });
  });
}

kj::Promise<ClusterClient::Snapshot> ClusterClient::snapshot() {
  return shared_->withController([](rpc::Controller::Client& c) {
    return c.statusRequest().send().then([](auto response) {
      Snapshot out;
      for (auto n : response.getNodes()) out.nodes.push_back(fromNodeInfo(n));
      for (auto a : response.getActors()) out.actors.push_back(fromActorInfo(a));
      for (auto g : response.getPlacementGroups()) out.placementGroups.push_back(fromPlacementGroupInfo(g));
      for (auto g : response.getGroups()) out.groups.push_back(fromElasticGroupInfo(g));
      return out;
    });
  });
}

kj::Promise<PlacementGroupRecord> ClusterClient::createPlacementGroup(PlacementStrategy strategy,
                                                                      std::vector<Resources> bundles, std::string name) {
  // The id is chosen once, so a retry after a reconnect cannot create a second group.
  return shared_->withController([id = PlacementGroupId::generate(), strategy, bundles, name](rpc::Controller::Client& c) {
    auto request = c.createPlacementGroupRequest();
    request.setId(id.hex());
    request.setName(name);
    request.setStrategy(placementStrategyName(strategy));
    toBundles(bundles, request.initBundles(static_cast<unsigned>(bundles.size())));
    return request.send().then([](auto response) { return fromPlacementGroupInfo(response.getGroup()); });
  });
}

kj::Promise<PlacementGroupRecord> ClusterClient::placementGroup(const PlacementGroupId& id) {
  return shared_->withController([id](rpc::Controller::Client& c) {
    auto request = c.getPlacementGroupRequest();
    request.setId(id.hex());
    return request.send().then([](auto response) { return fromPlacementGroupInfo(response.getGroup()); });
  });
}

kj::Promise<void> ClusterClient::putGroup(const std::string& id, const std::string& doc) {
  return shared_->withController([id, doc](rpc::Controller::Client& c) {
    auto request = c.putGroupRequest();
    request.setId(id);
    request.setDoc(doc);
    return request.send().ignoreResult();
  });
}

kj::Promise<void> ClusterClient::groupEvent(const std::string& id, const std::string& text) {
  // Stamped once: a call retried on a new connection carries the same time and is stored once.
  return shared_->withController([id, text, timeMs = wallClockMs()](rpc::Controller::Client& c) {
    auto request = c.groupEventRequest();
    request.setId(id);
    request.setText(text);
    request.setTimeMs(timeMs);
    return request.send().ignoreResult();
  });
}

kj::Promise<uint64_t> ClusterClient::groupCommand(const std::string& id, GroupCommand command) {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  command.timeMs = wallClockMs();
  command.from = fmt::format("{} pid {}", host, getpid());
  // The nonce is chosen once: a call retried on a new connection returns the first one's seq.
  return shared_->withController([id, command, nonce = randomHex(8)](rpc::Controller::Client& c) {
    auto request = c.groupCommandRequest();
    request.setId(id);
    toGroupCommand(command, request.initCommand());
    request.setNonce(nonce);
    return request.send().then([](auto response) { return response.getSeq(); });
  });
}

kj::Promise<void> ClusterClient::removeGroup(const std::string& id) {
  return shared_->withController([id](rpc::Controller::Client& c) {
    auto request = c.removeGroupRequest();
    request.setId(id);
    return request.send().ignoreResult();
  });
}

kj::Promise<std::vector<ElasticGroupRecord>> ClusterClient::listGroups() {
  return shared_->withController([](rpc::Controller::Client& c) {
    auto request = c.statusRequest();
    request.setActors(false);
    return request.send().then([](auto response) {
      std::vector<ElasticGroupRecord> out;
      for (auto g : response.getGroups()) out.push_back(fromElasticGroupInfo(g));
      return out;
    });
  });
}

kj::Promise<std::optional<ElasticGroupRecord>> ClusterClient::group(const std::string& id) {
  return shared_->withController([id](rpc::Controller::Client& c) {
    auto request = c.getGroupRequest();
    request.setId(id);
    return request.send().then([](auto response) -> std::optional<ElasticGroupRecord> {
      if (!response.getFound()) return std::nullopt;
      return fromElasticGroupInfo(response.getGroup());
    });
  });
}

kj::Promise<void> ClusterClient::removePlacementGroup(const PlacementGroupId& id) {
  return shared_->withController([id](rpc::Controller::Client& c) {
    auto request = c.removePlacementGroupRequest();
    request.setId(id.hex());
    return request.send().ignoreResult();
  });
}

kj::Promise<PlacementGroupRecord> ClusterClient::addBundles(const PlacementGroupRecord& group,
                                                            std::vector<Resources> bundles) {
  return shared_->withController([group, bundles](rpc::Controller::Client& c) {
    auto request = c.addBundlesRequest();
    request.setId(group.id.hex());
    request.setFromIndex(static_cast<uint32_t>(group.bundles.size()));
    toBundles(bundles, request.initBundles(static_cast<unsigned>(bundles.size())));
    return request.send().then([](auto response) { return fromPlacementGroupInfo(response.getGroup()); });
  }, /*retryUnavailable=*/false);  // UNAVAILABLE: the new bundles have no room now
}

kj::Promise<PlacementGroupRecord> ClusterClient::removeBundles(const PlacementGroupId& id,
                                                               std::vector<uint32_t> indices) {
  return shared_->withController([id, indices](rpc::Controller::Client& c) {
    auto request = c.removeBundlesRequest();
    request.setId(id.hex());
    auto list = request.initIndices(static_cast<unsigned>(indices.size()));
    for (unsigned i = 0; i < indices.size(); ++i) list.set(i, indices[i]);
    return request.send().then([](auto response) { return fromPlacementGroupInfo(response.getGroup()); });
  });
}

std::string_view Reply::bytes() const {
  if (const auto* owned = std::get_if<std::string>(&bytes_)) return *owned;
  return std::get<Kept>(bytes_).bytes;
}

std::string Reply::str() && {
  if (auto* owned = std::get_if<std::string>(&bytes_)) return std::move(*owned);
  return std::string(std::get<Kept>(bytes_).bytes);
}

}  // namespace troupe
