// troupe-worker: hosts one actor. Started by a node agent, which captures its stdout and stderr
// and reports its exit; it tells the controller its address once it serves.
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fstream>
#include <iterator>

#include "daemon.h"
#include "troupe.capnp.h"
#include "troupe/actors/test_actors.h"
#include "troupe/runtime/actor.h"
#include "troupe/runtime/logging.h"
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
    auto params = context.getParams();
    auto payload = params.getPayload();
    auto result = actor_->call(params.getMethod().cStr(),
                               std::string_view(reinterpret_cast<const char*>(payload.begin()), payload.size()));
    context.releaseParams();
    if (!result.isOk()) throwStatus(result.status());
    context.getResults().setResult(
        capnp::Data::Reader(reinterpret_cast<const kj::byte*>(result->data()), result->size()));
    return kj::READY_NOW;
  }

  kj::Promise<void> callBatch(CallBatchContext context) override {
    auto calls = context.getParams().getCalls();
    auto replies = context.getResults().initReplies(calls.size());
    for (unsigned i = 0; i < calls.size(); ++i) {
      auto payload = calls[i].getPayload();
      auto result = actor_->call(calls[i].getMethod().cStr(),
                                 std::string_view(reinterpret_cast<const char*>(payload.begin()), payload.size()));
      if (result.isOk()) {
        replies[i].setResult(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(result->data()), result->size()));
      } else {
        replies[i].setError(result.status().message());
      }
    }
    return kj::READY_NOW;
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
};

}  // namespace
}  // namespace troupe

int main(int argc, char** argv) {
  using namespace troupe;
  // The worker must not outlive its node agent (kill -9 of the agent included).
  prctl(PR_SET_PDEATHSIG, SIGKILL);
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

  ActorRegistry registry;
  actors::registerTestActors(registry);
  ActorContext context{ActorId(actorId), type, incarnation};
  auto actor = registry.create(context, initArgs);
  if (!actor.isOk()) {
    fprintf(stderr, "troupe-worker: cannot create actor %s: %s\n", type.c_str(), actor.status().message().c_str());
    return 1;
  }

  captureStopSignals();
  auto io = kj::setupAsyncIo();
  auto server = RpcServer::listen(io, HostPort{ip, 0}, token,
                                  rpc::Actor::Client(kj::heap<ActorService>(std::move(*actor), type)));
  if (!server.isOk()) {
    fprintf(stderr, "troupe-worker: %s\n", server.status().message().c_str());
    return 1;
  }
  std::string address = HostPort{ip, (*server)->port()}.toString();
  kj::Own<RpcClient> client;
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
    client = RpcClient::connect(io, *controllerAddr, token, 10 * kj::SECONDS).wait(io.waitScope);
    auto ready = client->bootstrap<rpc::Controller>().actorReadyRequest();
    ready.setId(actorId);
    ready.setIncarnation(incarnation);
    ready.setAddress(address);
    ready.setPid(getpid());
    ready.send().wait(io.waitScope);
  })) {
    fprintf(stderr, "troupe-worker: cannot report to the controller: %s\n", e->getDescription().cStr());
    return 1;
  }
  onStopSignal(io).wait(io.waitScope);
  return 0;
}
