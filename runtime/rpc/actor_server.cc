#include "troupe/runtime/actor_server.h"

#include <fmt/format.h>

#include <chrono>
#include <string_view>

#include <kj/vector.h>

#include "troupe/runtime/clock.h"
#include "troupe/runtime/held_buffers.h"
#include "troupe/runtime/metrics.h"

namespace troupe {
namespace {


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

// The actor and its turn queue: one per worker, shared by the servers of its connections.
class ActorCore {
 public:
  ActorCore(std::unique_ptr<Actor> actor, std::string type, ActorServerOptions options)
      : actor_(std::move(actor)), type_(std::move(type)), options_(options), turns_(kj::refcounted<Turns>()) {}

  Actor& actor() { return *actor_; }
  const std::string& type() const { return type_; }

  // A synchronous actor's in-turn call: it can run now, as no call is ever left unfinished.
  bool runsNow(const std::string& method) const { return options_.synchronous && !actor_->answersAtOnce(method); }

  Result<std::string> runNow(const std::string& method, std::string_view payload) {
    Result<std::string> result = Status(StatusCode::kInternal, "unset");
    KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() { result = actor_->call(method, payload); })) {
      result = statusFromException(*e, "");
    }
    return result;
  }

  // A query the actor answers at once starts now; every other call in turn.
  // `payload` stays valid until the promise resolves (the call's context holds its message).
  kj::Promise<Result<std::string>> schedule(std::string method, std::string_view payload) {
    if (actor_->answersAtOnce(method)) {
      return caught(kj::evalNow([&]() { return actor_->callAsync(method, payload); }));
    }
    return inTurn(kj::mv(method), payload);
  }

 private:
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
  ActorServerOptions options_;
  kj::Own<Turns> turns_;
};

// rpc::Actor for one connection (or for in-process callers, with `held` null): large results
// go out referenced from the connection's held buffers, not copied into the reply.
class ActorServer final : public rpc::Actor::Server {
 public:
  ActorServer(std::shared_ptr<ActorCore> core, std::shared_ptr<HeldBuffers> held)
      : core_(std::move(core)), held_(std::move(held)) {}

 protected:
  kj::Promise<void> call(CallContext context) override {
    // The arguments are read in place: the context (held below) keeps the message alive.
    auto params = context.getParams();
    auto arrived = Clock::now();
    std::string method = params.getMethod().cStr();
    if (core_->runsNow(method)) {
      answer(context, core_->runNow(method, view(params.getPayload())), arrived);
      return kj::READY_NOW;
    }
    return core_->schedule(kj::mv(method), view(params.getPayload()))
        .then([this, context, arrived](Result<std::string> result) mutable { answer(context, kj::mv(result), arrived); });
  }

  // Every call of the batch is queued now, in list order, so that a call arriving later (from
  // this caller or another) queues behind all of them, as if they had arrived one by one.
  kj::Promise<void> callBatch(CallBatchContext context) override {
    auto calls = context.getParams().getCalls();
    context.getResults().initReplies(calls.size());
    kj::Vector<kj::Promise<void>> replies;
    for (unsigned i = 0; i < calls.size(); ++i) {
      auto arrived = Clock::now();
      std::string method = calls[i].getMethod().cStr();
      if (core_->runsNow(method)) {
        answer(context, i, core_->runNow(method, view(calls[i].getPayload())), arrived);
        continue;
      }
      replies.add(core_->schedule(kj::mv(method), view(calls[i].getPayload()))
                      .then([this, context, i, arrived](Result<std::string> result) mutable {
                        answer(context, i, kj::mv(result), arrived);
                      }));
    }
    if (replies.empty()) return kj::READY_NOW;
    return kj::joinPromises(replies.releaseAsArray());
  }

  kj::Promise<void> typed(TypedContext context) override {
    KJ_IF_MAYBE(cap, core_->actor().typed()) {
      context.getResults().setCap(*cap);
      return kj::READY_NOW;
    }
    throwStatus(Status(StatusCode::kFailedPrecondition, fmt::format("actor type {} has no typed interface", core_->type())));
  }

 private:
  void answer(CallContext& context, Result<std::string> result, Clock::time_point arrived) {
    counted(arrived, result.isOk());
    // Always FAILED (exceptionFromStatus): a DISCONNECTED error would read as the worker's
    // death to callers. The status code travels in the description.
    if (!result.isOk()) kj::throwFatalException(exceptionFromStatus(result.status()));
    putResult(context.getResults(), std::move(*result));
  }

  void answer(CallBatchContext& context, unsigned i, Result<std::string> result, Clock::time_point arrived) {
    counted(arrived, result.isOk());
    auto reply = context.getResults().getReplies()[i];
    if (result.isOk()) {
      putResult(reply, std::move(*result));
    } else {
      reply.setError(exceptionFromStatus(result.status()).getDescription());  // the code tag too
    }
  }

  // A large result is referenced from the connection's held buffers rather than copied (one
  // over the message limit is copied, and refused there).
  template <typename Builder>
  void putResult(Builder out, std::string result) {
    if (held_ != nullptr && result.size() >= kReferenceFrom && result.size() < kMaxRpcMessageBytes) {
      out.adoptResult(held_->hold(out, std::move(result)));
    } else {
      out.setResult(dataOf(result));
    }
  }

  std::shared_ptr<ActorCore> core_;
  std::shared_ptr<HeldBuffers> held_;
};

}  // namespace

rpc::Actor::Client actorServer(std::unique_ptr<Actor> actor, std::string type, ActorServerOptions options) {
  return kj::heap<ActorServer>(std::make_shared<ActorCore>(std::move(actor), std::move(type), options), nullptr);
}

Result<kj::Own<RpcServer>> listenActor(kj::AsyncIoContext& io, const HostPort& bind, std::string token,
                                       std::unique_ptr<Actor> actor, std::string type, ActorServerOptions options) {
  auto core = std::make_shared<ActorCore>(std::move(actor), std::move(type), options);
  return RpcServer::listen(
      io, bind, std::move(token),
      [core](std::shared_ptr<HeldBuffers> held) -> capnp::Capability::Client {
        return rpc::Actor::Client(kj::heap<ActorServer>(core, std::move(held)));
      },
      PeerWait::kSpinFirst);
}

}  // namespace troupe
