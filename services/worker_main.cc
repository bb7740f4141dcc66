// troupe-worker: hosts one actor. Started by a node agent, which captures its stdout and stderr
// and reports its exit; it tells the controller its address once it serves.
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fstream>
#include <iterator>

#include "daemon.h"
#include "troupe/actors/checkpoint_actor.h"
#include "troupe/actors/test_actors.h"
#ifdef TROUPE_WITH_TRAIN
#include "troupe/actors/train_actors.h"
#endif
#include "troupe/runtime/actor.h"
#include "troupe/runtime/actor_server.h"
#include "troupe/runtime/client.h"
#include "troupe/runtime/logging.h"
#include "troupe/runtime/rpc.h"

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
  ActorContext context{ActorId(actorId), type, incarnation, cluster.get(), ip, &io.provider->getTimer()};
  auto actor = registry.create(context, initArgs);
  if (!actor.isOk()) {
    fprintf(stderr, "troupe-worker: cannot create actor %s: %s\n", type.c_str(), actor.status().message().c_str());
    return 1;
  }

  // Calls run one at a time in arrival order (actor_server.h).
  auto server = listenActor(io, HostPort{ip, 0}, token, std::move(*actor), type);
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
