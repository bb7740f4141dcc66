// troupe-worker: hosts one actor. Started by a node agent, which captures its stdout and stderr
// and reports its exit; it tells the controller its address once it serves.
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <fstream>
#include <iterator>

#include "daemon.h"
#include "troupe.capnp.h"
#include "troupe/actors/checkpoint_actor.h"
#include "troupe/actors/test_actors.h"
#ifdef TROUPE_WITH_TRAIN
#include "troupe/actors/train_actors.h"
#endif
#include "troupe/runtime/actor.h"
#include "troupe/runtime/client.h"
#include "troupe/runtime/logging.h"
#include "troupe/runtime/metrics.h"
#include "troupe/runtime/rpc.h"

namespace troupe {
namespace {

// Serves the hosted actor. Calls run on the RPC thread one at a time, so a caller's calls run
// in the order it sent them (Cap'n Proto delivers calls on one capability in order).
class ActorService final : public rpc::Actor::Server {
 public:
  ActorService(std::unique_ptr<Actor> actor, std::string type) : actor_(std::move(actor)), type_(std::move(type)) {}

 protected:
  kj::Promise<void> call(CallContext context) override {
    // The arguments are read in place: the context (held below) keeps the message alive.
    auto params = context.getParams();
    auto payload = params.getPayload();
    std::string method = params.getMethod().cStr();
    return schedule(kj::mv(method), std::string_view(reinterpret_cast<const char*>(payload.begin()), payload.size()))
        .then([context, arrived = std::chrono::steady_clock::now()](Result<std::string> result) mutable {
          counted(arrived, result.isOk());
          // Always FAILED (exceptionFromStatus): a DISCONNECTED error would read as the worker's
          // death to callers. The status code travels in the description.
          if (!result.isOk()) kj::throwFatalException(exceptionFromStatus(result.status()));
          context.getResults().setResult(
              capnp::Data::Reader(reinterpret_cast<const kj::byte*>(result->data()), result->size()));
        });
  }

  kj::Promise<void> callBatch(CallBatchContext context) override {
    context.getResults().initReplies(context.getParams().getCalls().size());
    return runBatch(context, 0);
  }

  // Runs call i of the batch, then the rest, each after the previous one resolved.
  kj::Promise<void> runBatch(CallBatchContext context, unsigned i) {
    auto calls = context.getParams().getCalls();
    if (i == calls.size()) return kj::READY_NOW;
    std::string method = calls[i].getMethod().cStr();
    auto payload = calls[i].getPayload();
    return schedule(kj::mv(method), std::string_view(reinterpret_cast<const char*>(payload.begin()), payload.size()))
        .then([this, context, i, arrived = std::chrono::steady_clock::now()](Result<std::string> result) mutable {
          counted(arrived, result.isOk());
          auto reply = context.getResults().getReplies()[i];
          if (result.isOk()) {
            reply.setResult(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(result->data()), result->size()));
          } else {
            reply.setError(exceptionFromStatus(result.status()).getDescription());  // the code tag too
          }
          return runBatch(context, i + 1);
        });
  }

  // An answered call in this worker's counters (the node agent reads them for /metrics).
  static void counted(std::chrono::steady_clock::time_point arrived, bool ok) {
    auto& c = metrics::actorCalls();
    c.calls.add();
    if (!ok) c.errors.add();
    c.seconds.addTime(std::chrono::steady_clock::now() - arrived);
  }

  // A query the actor answers at once runs now; every other call in turn.
  // `payload` stays valid until the promise resolves (the call's context holds its message).
  kj::Promise<Result<std::string>> schedule(std::string method, std::string_view payload) {
    if (actor_->answersAtOnce(method)) return actor_->callAsync(method, payload);
    return inTurn([this, method = kj::mv(method), payload]() { return actor_->callAsync(method, payload); });
  }

  // Runs `start` once every earlier call has finished: one call at a time, in arrival order,
  // even when an actor's calls wait on something.
  template <typename Start>
  kj::Promise<Result<std::string>> inTurn(Start start) {
    auto paf = kj::newPromiseAndFulfiller<void>();
    auto previous = kj::mv(last_);
    last_ = kj::mv(paf.promise);
    auto done = std::make_shared<kj::Own<kj::PromiseFulfiller<void>>>(kj::mv(paf.fulfiller));
    return previous.then(kj::mv(start)).then(
        [done](Result<std::string> r) {
          (*done)->fulfill();
          return r;
        },
        [done](kj::Exception&& e) -> Result<std::string> {
          (*done)->fulfill();  // a failed call must not block the ones after it
          return statusFromException(e, "");
        });
  }

  kj::Promise<void> typed(TypedContext context) override {
    KJ_IF_MAYBE(cap, actor_->typed()) {
      context.getResults().setCap(*cap);
      return kj::READY_NOW;
    }
    throwStatus(Status(StatusCode::kFailedPrecondition, fmt::format("actor type {} has no typed interface", type_)));
  }

 private:
  std::unique_ptr<Actor> actor_;
  std::string type_;
  kj::Promise<void> last_ = kj::READY_NOW;  // the previous call's end
};

}  // namespace
}  // namespace troupe

namespace troupe {
namespace {

// The actor types this executable hosts: troupe-worker has no LibTorch and starts in
// milliseconds; troupe-worker-torch (built with LibTorch) adds the training actors.
ActorRegistry builtInActors() {
  ActorRegistry registry;
  actors::registerTestActors(registry);
  actors::registerCheckpointActor(registry);
#ifdef TROUPE_WITH_TRAIN
  actors::registerTrainActors(registry);
#endif
  return registry;
}

}  // namespace
}  // namespace troupe

int main(int argc, char** argv) {
  using namespace troupe;
  // The node agent asks once which types this executable hosts (one per line).
  if (argc == 2 && std::string_view(argv[1]) == "--list-types") {
    for (const auto& t : builtInActors().types()) printf("%s\n", t.c_str());
    return 0;
  }
  // The worker must not outlive its node agent (kill -9 of the agent included).
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  keepMessageBuffers();
  CLI::App app{"Troupe worker: hosts one actor (started by a node agent)"};
  std::string actorId, type, controller, ip = "127.0.0.1", argsFile, logLevelName = "info";
  unsigned incarnation = 1;
  pid_t parent = 0;
  app.add_option("--actor-id", actorId)->required();
  app.add_option("--type", type)->required();
  app.add_option("--incarnation", incarnation)->required();
  app.add_option("--controller", controller)->required();
  app.add_option("--node-ip-address", ip);
  app.add_option("--args-file", argsFile, "initArgs bytes; removed once read");
  app.add_option("--parent-pid", parent, "exit at once if this process is already gone");
  app.add_option("--log-level", logLevelName)->envname("TROUPE_LOG_LEVEL");
  CLI11_PARSE(app, argc, argv);
  if (parent > 0 && getppid() != parent) return 1;  // the agent died before prctl took effect
  setLogLevel(parseLogLevel(logLevelName));
  setLogProcessName("worker-" + actorId);
  const char* tokenEnv = std::getenv("TROUPE_TOKEN");
  std::string token = tokenEnv ? tokenEnv : "";
  auto controllerAddr = parseHostPort(controller);
  if (token.empty() || !controllerAddr.isOk()) {
    fprintf(stderr, "troupe-worker: needs TROUPE_TOKEN and a valid --controller\n");
    return 2;
  }
  std::string initArgs;
  if (!argsFile.empty()) {
    std::ifstream in(argsFile, std::ios::binary);
    initArgs.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    std::remove(argsFile.c_str());
  }

  captureStopSignals();
  auto io = kj::setupAsyncIo();
  // Actors may call other actors (handles passed to them by id) through this connection.
  kj::Own<ClusterClient> cluster;
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
    cluster = ClusterClient::connect(io, *controllerAddr, token).wait(io.waitScope);
  })) {
    fprintf(stderr, "troupe-worker: cannot reach the controller: %s\n", statusFromException(*e, "").message().c_str());
    return 1;
  }
  ActorRegistry registry = builtInActors();
  ActorContext context{ActorId(actorId), type, incarnation, cluster.get(), ip};
  auto actor = registry.create(context, initArgs);
  if (!actor.isOk()) {
    fprintf(stderr, "troupe-worker: cannot create actor %s: %s\n", type.c_str(), actor.status().message().c_str());
    return 1;
  }

  auto server = RpcServer::listen(io, HostPort{ip, 0}, token,
                                  rpc::Actor::Client(kj::heap<ActorService>(std::move(*actor), type)),
                                  PeerWait::kSpinFirst);
  if (!server.isOk()) {
    fprintf(stderr, "troupe-worker: %s\n", server.status().message().c_str());
    return 1;
  }
  std::string address = HostPort{ip, (*server)->port()}.toString();
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
    cluster->reportActorReady(ActorId(actorId), incarnation, address).wait(io.waitScope);
  })) {
    fprintf(stderr, "troupe-worker: cannot report to the controller: %s\n",
            statusFromException(*e, "").message().c_str());
    return 1;
  }
  onStopSignal(io).wait(io.waitScope);
  return 0;
}
