#include "troupe/runtime/actor_server.h"

#include <fmt/format.h>

#include <chrono>
#include <string_view>

#include "troupe/runtime/metrics.h"

namespace troupe {
namespace {

using Clock = std::chrono::steady_clock;

std::string_view view(capnp::Data::Reader data) {
  return std::string_view(reinterpret_cast<const char*>(data.begin()), data.size());
}

capnp::Data::Reader dataOf(const std::string& bytes) {
  return capnp::Data::Reader(reinterpret_cast<const kj::byte*>(bytes.data()), bytes.size());
}

// An answered call in this worker's counters (the node agent reads them for /metrics).
void counted(Clock::time_point arrived, bool ok) {
  auto& c = metrics::actorCalls();
  c.calls.add();
  if (!ok) c.errors.add();
  c.seconds.addTime(Clock::now() - arrived);
}

// A call's exception as its Result: the caller gets it like any error (and the next call runs).
kj::Promise<Result<std::string>> caught(kj::Promise<Result<std::string>> call) {
  return call.catch_([](kj::Exception&& e) -> Result<std::string> { return statusFromException(e, ""); });
}

// The in-turn queue: `last` resolves when the latest queued call has ended; `unfinished` counts
// the queued calls that have not. Shared with each call's TurnEnd, which may outlive the server.
struct Turns : public kj::Refcounted {
  kj::Promise<void> last = kj::READY_NOW;
  unsigned unfinished = 0;
};

// Ends one call's turn when dropped: once the call has ended, and also when its promise is
// cancelled (the next call must not wait forever, nor fail because this one went away).
class TurnEnd {
 public:
  TurnEnd(kj::Own<kj::PromiseFulfiller<void>> fulfiller, kj::Own<Turns> turns)
      : fulfiller_(kj::mv(fulfiller)), turns_(kj::mv(turns)) {
    ++turns_->unfinished;
  }
  ~TurnEnd() {
    --turns_->unfinished;
    fulfiller_->fulfill();
  }
  KJ_DISALLOW_COPY(TurnEnd);

 private:
  kj::Own<kj::PromiseFulfiller<void>> fulfiller_;
  kj::Own<Turns> turns_;
};

class ActorServer final : public rpc::Actor::Server {
 public:
  ActorServer(std::unique_ptr<Actor> actor, std::string type)
      : actor_(std::move(actor)), type_(std::move(type)), turns_(kj::refcounted<Turns>()) {}

 protected:
  kj::Promise<void> call(CallContext context) override {
    // The arguments are read in place: the context (held below) keeps the message alive.
    auto params = context.getParams();
    auto arrived = Clock::now();
    return schedule(params.getMethod().cStr(), view(params.getPayload()))
        .then([context, arrived](Result<std::string> result) mutable {
          counted(arrived, result.isOk());
          // Always FAILED (exceptionFromStatus): a DISCONNECTED error would read as the worker's
          // death to callers. The status code travels in the description.
          if (!result.isOk()) kj::throwFatalException(exceptionFromStatus(result.status()));
          context.getResults().setResult(dataOf(*result));
        });
  }

  // Every call of the batch is queued now, in list order, so that a call arriving later (from
  // this caller or another) queues behind all of them, as if they had arrived one by one.
  kj::Promise<void> callBatch(CallBatchContext context) override {
    auto calls = context.getParams().getCalls();
    context.getResults().initReplies(calls.size());
    auto replies = kj::heapArrayBuilder<kj::Promise<void>>(calls.size());
    for (unsigned i = 0; i < calls.size(); ++i) {
      auto arrived = Clock::now();
      replies.add(schedule(calls[i].getMethod().cStr(), view(calls[i].getPayload()))
                      .then([context, i, arrived](Result<std::string> result) mutable {
                        counted(arrived, result.isOk());
                        auto reply = context.getResults().getReplies()[i];
                        if (result.isOk()) {
                          reply.setResult(dataOf(*result));
                        } else {
                          reply.setError(exceptionFromStatus(result.status()).getDescription());  // the code tag too
                        }
                      }));
    }
    return kj::joinPromises(replies.finish());
  }

  kj::Promise<void> typed(TypedContext context) override {
    KJ_IF_MAYBE(cap, actor_->typed()) {
      context.getResults().setCap(*cap);
      return kj::READY_NOW;
    }
    throwStatus(Status(StatusCode::kFailedPrecondition, fmt::format("actor type {} has no typed interface", type_)));
  }

 private:
  // A query the actor answers at once starts now; every other call in turn.
  // `payload` stays valid until the promise resolves (the call's context holds its message).
  kj::Promise<Result<std::string>> schedule(std::string method, std::string_view payload) {
    if (actor_->answersAtOnce(method)) {
      return caught(kj::evalNow([&]() { return actor_->callAsync(method, payload); }));
    }
    return inTurn(kj::mv(method), payload);
  }

  // Starts the call once every earlier in-turn call has ended: one call at a time, in arrival
  // order, even when an actor's calls wait on something. With none unfinished it starts now,
  // inside this event (a synchronous actor's call then costs no extra turn of the loop).
  kj::Promise<Result<std::string>> inTurn(std::string method, std::string_view payload) {
    auto turn = kj::newPromiseAndFulfiller<void>();
    kj::Promise<void> previous = kj::mv(turns_->last);
    turns_->last = kj::mv(turn.promise);
    bool free = turns_->unfinished == 0;  // so `previous` has resolved
    auto end = kj::heap<TurnEnd>(kj::mv(turn.fulfiller), kj::addRef(*turns_));
    auto start = [this, method = kj::mv(method), payload]() { return actor_->callAsync(method, payload); };
    auto started = free ? kj::evalNow(kj::mv(start)) : previous.then(kj::mv(start));
    // Eager: the turn ends when the call does, not when whoever awaits it (a callBatch's join,
    // which reads its parts only once all are done) takes the result.
    return caught(kj::mv(started)).attach(kj::mv(end)).eagerlyEvaluate(nullptr);
  }

  std::unique_ptr<Actor> actor_;
  std::string type_;
  kj::Own<Turns> turns_;
};

}  // namespace

rpc::Actor::Client actorServer(std::unique_ptr<Actor> actor, std::string type) {
  return kj::heap<ActorServer>(std::move(actor), std::move(type));
}

Result<kj::Own<RpcServer>> listenActor(kj::AsyncIoContext& io, const HostPort& bind, std::string token,
                                       std::unique_ptr<Actor> actor, std::string type) {
  return RpcServer::listen(io, bind, std::move(token), actorServer(std::move(actor), std::move(type)),
                           PeerWait::kSpinFirst);
}

}  // namespace troupe
