// troupe-node: a machine's node agent, started by `troupe start`.
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <set>

#include <kj/async-unix.h>

#include "daemon.h"
#include "head_supervisor.h"
#include "node_agent.h"
#include "troupe/runtime/logging.h"
#include "troupe/runtime/resources.h"
#include "troupe/runtime/process.h"
#include "troupe/runtime/rpc.h"

namespace {

// The actor types `worker` hosts (it prints one per line for --list-types); empty when it cannot
// say, and then every C++ actor goes to troupe-worker-torch, which hosts them all.
std::set<std::string> listWorkerTypes(const std::string& worker, const std::string& runDir) {
  using namespace troupe;
  std::string out = runDir + "/worker-types.txt";
  std::remove(out.c_str());
  SpawnOptions spawn;
  spawn.argv = {worker, "--list-types"};
  spawn.outputPath = out;
  auto pid = spawnProcess(spawn);
  std::set<std::string> types;
  if (!pid.isOk()) {
    TROUPE_LOG(kWarning, "cannot ask {} for its actor types: {}", worker, pid.status().message());
    return types;
  }
  ChildProcess child(*pid);
  auto ended = child.wait(std::chrono::seconds(10));
  if (!ended || ended->exitCode != 0) {
    TROUPE_LOG(kWarning, "{} --list-types did not answer: every C++ actor starts in troupe-worker-torch", worker);
    return types;
  }
  std::ifstream in(out);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) types.insert(line);
  }
  std::remove(out.c_str());
  return types;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace troupe;
  CLI::App app{"Troupe node agent (started by `troupe start`)"};
  std::string runDir, address, nodeId, token, ip = "127.0.0.1", resourcesText, logLevelName = "info";
  double numCpus = -1;
  uint64_t objectStoreMemory = 0;
  bool head = false;
  app.add_option("--run-dir", runDir, "Run directory for logs and the pid file")->required();
  app.add_option("--address", address, "Controller HOST:PORT")->required();
  app.add_option("--node-id", nodeId, "This node's id (generated when absent)");
  app.add_option("--token", token, "Cluster token (else TROUPE_TOKEN, else the run dir's cluster.json)")
      ->envname("TROUPE_TOKEN");
  app.add_option("--node-ip-address", ip, "Address this node's RPC server binds");
  app.add_option("--num-cpus", numCpus, "CPUs to offer (default: detected)");
  app.add_option("--resources", resourcesText, "Custom resources NAME=QTY,...");
  app.add_option("--object-store-memory", objectStoreMemory, "Object store limit in bytes (default: 30% of RAM)");
  app.add_flag("--head", head, "This is the head node");
  app.add_option("--log-level", logLevelName)->envname("TROUPE_LOG_LEVEL");
  CLI11_PARSE(app, argc, argv);
  setLogLevel(parseLogLevel(logLevelName));

  NodeAgentOptions options;
  options.id = nodeId.empty() ? NodeId::generate() : NodeId(nodeId);
  if (!options.id.valid()) {
    std::fprintf(stderr, "troupe-node: --node-id must be 1-64 lower-case hex digits, not '%s'\n", nodeId.c_str());
    return 2;
  }
  DaemonFiles files(runDir, "node-" + options.id.hex());
  auto controller = parseHostPort(address);
  auto custom = parseResources(resourcesText);
  for (const Status& s : {controller.status(), custom.status()}) {
    if (!s.isOk()) {
      TROUPE_LOG(kError, "{}", s.message());
      return 2;
    }
  }
  auto cluster = readClusterFile(runDir);
  if (token.empty() && cluster.isOk()) token = cluster->token;
  if (head) {
    if (!cluster.isOk() || cluster->redisPassword.empty()) {
      TROUPE_LOG(kError, "the head node needs its run directory's cluster.json with the Redis password: {}",
                 cluster.isOk() ? "no password in it" : cluster.status().message());
      return 2;
    }
    options.redisPassword = cluster->redisPassword;
  }
  if (token.empty()) {
    TROUPE_LOG(kError, "no cluster token: pass --token or set TROUPE_TOKEN");
    return 2;
  }
  options.controller = *controller;
  options.token = token;
  options.ip = ip;
  options.isHead = head;
  options.runDir = runDir;
  options.objectStoreMemory = objectStoreMemory;
  options.workerBinary = executableDir() + "/troupe-worker";
  // Python workers import the troupe package from TROUPE_PYTHONPATH (set by an embedding
  // driver), else from the build tree next to this binary.
  if (const char* py = std::getenv("TROUPE_PYTHON"); py && *py) options.pythonBinary = py;
  if (const char* path = std::getenv("TROUPE_PYTHONPATH"); path && *path) {
    options.pythonPath = path;
  } else {
    options.pythonPath = executableDir() + "/python";
  }
  // Modules on the starting environment's PYTHONPATH (a driver's own) stay importable, after troupe.
  if (const char* inherited = std::getenv("PYTHONPATH"); inherited && *inherited) {
    options.pythonPath += std::string(":") + inherited;
  }
  if (const char* dir = std::getenv("TROUPE_BIN_DIR"); dir && *dir) options.workerBinary = std::string(dir) + "/troupe-worker";
  std::string workerDir = options.workerBinary.substr(0, options.workerBinary.rfind('/') + 1);
  if (::access((workerDir + "troupe-worker-torch").c_str(), X_OK) == 0) {
    options.torchWorkerBinary = workerDir + "troupe-worker-torch";
  }
  options.workerTypes = listWorkerTypes(options.workerBinary, runDir);
  if (const char* zygote = std::getenv("TROUPE_PYTHON_ZYGOTE"); zygote && std::string(zygote) == "0") {
    options.pythonZygote = false;
  }
  // Workers the Python zygote forks are reparented to this process, which watches them (their exit
  // status, their stderr tail) as it does the workers it spawns. Every orphan below this process
  // comes here too: KJ's child-exit handling reaps any child, so none is left a zombie.
  if (options.pythonZygote && ::prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) {
    TROUPE_LOG(kWarning, "cannot become a child subreaper ({}): Python workers start as new processes",
               std::strerror(errno));
    options.pythonZygote = false;
  }
  options.resources = detectLocalResources();
  if (numCpus >= 0) options.resources["CPU"] = numCpus;
  for (const auto& [name, qty] : *custom) options.resources[name] = qty;
  if (auto s = checkResources(options.resources, "--num-cpus/--resources"); !s.isOk()) {
    TROUPE_LOG(kError, "{}", s.message());
    return 2;
  }

  captureStopSignals();
  kj::UnixEventPort::captureChildExit();
  auto io = kj::setupAsyncIo();
  IoThread ioThread;
  kj::Own<NodeAgent> agent;
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
    agent = NodeAgent::start(io, ioThread, options).wait(io.waitScope);
    files.markReady();
  })) {
    TROUPE_LOG(kError, "cannot join the cluster: {}", statusFromException(*e, "").message());
    return 1;
  }
  // The head's agent keeps the head's daemons running (Redis, controller, gateway).
  kj::Promise<void> supervision = head ? supervisor::superviseHeadDaemons(io, runDir, 200 * kj::MILLISECONDS)
                                             .eagerlyEvaluate([](kj::Exception&& e) {
                                               TROUPE_LOG(kError, "supervision ended: {}", e.getDescription().cStr());
                                             })
                                       : kj::Promise<void>(kj::READY_NOW);
  auto stop = onStopSignal(io).then([](std::string why) { return std::make_pair(why, true); });
  auto fatal = agent->onFatal().then([](std::string why) { return std::make_pair(why, false); });
  auto [why, clean] = stop.exclusiveJoin(kj::mv(fatal)).wait(io.waitScope);
  if (!clean) {
    TROUPE_LOG(kError, "{}", why);
    return 3;
  }
  TROUPE_LOG(kInfo, "stopping on {}", why);
  agent->shutdown("stopped by " + why).wait(io.waitScope);
  return 0;
}
