#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "cli.h"
#include "../head_supervisor.h"
#include "../node_objects.h"
#include "troupe/runtime/ids.h"
#include "troupe/runtime/process.h"
#include "troupe/runtime/resources.h"
#include "troupe/runtime/tls.h"

namespace troupe::cli {
namespace {

constexpr auto kStartLimit = std::chrono::seconds(10);

// The daemons one `troupe start` launched. Until commit(), destruction kills them all, so a
// failed start leaves nothing behind.
class Launch {
 public:
  explicit Launch(bool block) : block_(block) {}

  Result<pid_t> spawn(std::vector<std::string> argv, const std::string& logPath,
                      std::vector<std::string> env = {}) {
    SpawnOptions options;
    options.argv = std::move(argv);
    options.outputPath = logPath;
    options.newSession = !block_;  // daemons outlive this terminal unless --block
    options.env = std::move(env);
    auto pid = spawnProcess(options);
    if (pid.isOk()) children_.emplace_back(*pid);
    return pid;
  }

  void commit() {
    for (auto& c : children_) c.release();
  }

  std::vector<ChildProcess>& children() { return children_; }

 private:
  bool block_;
  std::vector<ChildProcess> children_;
};

Status writeRedisConfig(const std::string& path, const std::string& dataDir, int port,
                        const std::string& password) {
  std::error_code ec;
  std::filesystem::create_directories(dataDir, ec);
  std::ofstream out(path);
  out << "bind 127.0.0.1\n"
      << "port " << port << "\n"
      << "requirepass " << password << "\n"
      << "protected-mode yes\n"
      << "daemonize no\n"
      << "dir " << dataDir << "\n"
      << "appendonly yes\n"
      << "appendfsync everysec\n"
      << "save \"\"\n";
  out.close();
  if (!out || ::chmod(path.c_str(), 0600) != 0) {
    return Status(StatusCode::kFailedPrecondition, fmt::format("cannot write {}", path));
  }
  return Status::ok();
}

void writePidFile(const std::string& runDir, const std::string& name, pid_t pid) {
  std::ofstream(fmt::format("{}/pids/{}.pid", runDir, name)) << pid << "\n";
}

// The agent has registered, reached the store and beaten once (its ready file), and the
// controller shows it ALIVE.
bool nodeReady(kj::AsyncIoContext& io, const ClusterTarget& target, const std::string& runDir, const NodeId& id) {
  if (!std::filesystem::exists(fmt::format("{}/pids/node-{}.ready", runDir, id.hex()))) return false;
  auto nodes = fetchNodes(io, target, 1 * kj::SECONDS);
  if (!nodes.isOk()) return false;
  for (const auto& n : *nodes) {
    if (n.id == id) return n.state == NodeState::kAlive;
  }
  return false;
}

std::vector<std::string> nodeArgs(const StartFlags& f, const std::string& runDir, const std::string& controller,
                                  const NodeId& id) {
  std::vector<std::string> argv = {siblingExecutable("troupe-node"), "--run-dir", runDir, "--address", controller,
                                   "--node-id", id.hex(), "--node-ip-address", f.nodeIp};
  if (f.head) argv.push_back("--head");
  if (f.numCpus >= 0) argv.insert(argv.end(), {"--num-cpus", fmt::format("{}", f.numCpus)});
  if (!f.resources.empty()) argv.insert(argv.end(), {"--resources", f.resources});
  if (f.objectStoreMemory > 0) argv.insert(argv.end(), {"--object-store-memory", fmt::format("{}", f.objectStoreMemory)});
  return argv;
}

// --block: stay in the foreground until Ctrl-C / SIGTERM or until a daemon dies, then stop all.
int blockUntilStopped(Launch& launch, const std::string& runDir, pid_t watchPid) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  std::cout << "Running in the foreground (--block); Ctrl-C stops the cluster." << std::endl;
  int rc = 0;
  for (;;) {
    timespec tick{0, 200 * 1000 * 1000};
    if (sigtimedwait(&set, nullptr, &tick) > 0) break;
    if (watchPid > 0 && !processAlive(watchPid)) break;  // the embedding driver is gone
    bool died = false;
    for (auto& child : launch.children()) {
      pid_t pid = child.pid();
      if (auto info = child.wait(std::chrono::milliseconds(0))) {
        std::cerr << "troupe: error: process " << pid << " exited (" << info->toString() << "); stopping"
                  << std::endl;
        died = true;
        rc = 1;
      }
    }
    if (died) break;
  }
  stopRunDir(runDir, true);
  return rc;
}

namespace {
// <runDir>/token (0600): what a machine that joins needs, to copy there; never a command line.
Result<std::string> writeTokenFile(const std::string& runDir, const std::string& token) {
  std::string path = runDir + "/token";
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    return Status(StatusCode::kFailedPrecondition, fmt::format("cannot write {}: {}", path, std::strerror(errno)));
  }
  std::string text = token + "\n";
  bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  if (!ok) return Status(StatusCode::kFailedPrecondition, fmt::format("cannot write {}", path));
  return path;
}
}  // namespace

int startHead(StartFlags f) {
  if (f.nodeIp.empty()) f.nodeIp = "127.0.0.1";  // a single-machine cluster unless told otherwise
  if (auto bindable = checkBindable(f.nodeIp, f.port); !bindable.isOk()) {
    if (bindable.code() != StatusCode::kAlreadyExists) return fail(bindable);
    return fail(Status(StatusCode::kAlreadyExists,
                       fmt::format("port {} on {} is already in use (a cluster may be running: 'troupe status'); "
                                   "pass --port or run 'troupe stop'",
                                   f.port, f.nodeIp)));
  }
  if (f.tls) {
    // The daemons inherit it; this process's own connections speak TLS too.
    ::setenv("TROUPE_TLS", "1", 1);
    tls::require();
  }
  // The daemons inherit the TTL: their connections end on a silent peer within it.
  ::setenv("TROUPE_HEARTBEAT_TTL_MS", std::to_string(f.heartbeatTtlMs).c_str(), 1);
  Launch launch(f.block);
  // What the head's agent starts again should one of them exit (not under --block, where the
  // cluster lives and dies with this process).
  struct Daemon {
    std::string name;
    std::vector<std::string> argv;
    std::string log;
  };
  std::vector<Daemon> supervised;
  ClusterFile file;
  file.tls = f.tls;
  file.cluster = f.clusterName;
  file.heartbeatTtlMs = f.heartbeatTtlMs;
  RedisOptions redis;
  redis.cluster = f.clusterName;
  std::string runDir;

  if (!f.redisAddress.empty()) {
    auto hp = parseHostPort(f.redisAddress);
    if (!hp.isOk()) return fail(hp.status());
    redis.host = hp->host;
    redis.port = hp->port;
    redis.password = f.redisPassword;
    auto store = connectRedisStore(redis);
    if (!store.isOk()) return fail(store.status());
    auto meta = (*store)->getMeta();
    if (!meta.isOk()) return fail(meta.status());
    // An existing cluster in this Redis keeps its token: its nodes and clients stay valid.
    file.token = meta->has_value() ? (*meta)->token : randomHex(16);
    auto dir = createRunDir();
    if (!dir.isOk()) return fail(dir.status());
    runDir = *dir;
  } else {
    auto dir = createRunDir();
    if (!dir.isOk()) return fail(dir.status());
    runDir = *dir;
    auto port = pickFreePort("127.0.0.1");
    if (!port.isOk()) return fail(port.status());
    redis.port = *port;
    redis.password = randomHex(16);
    std::string conf = runDir + "/redis.conf";
    if (auto s = writeRedisConfig(conf, runDir + "/redis", redis.port, redis.password); !s.isOk()) return fail(s);
    std::string log = runDir + "/logs/redis.log";
    supervised.push_back({"redis", {"redis-server", conf}, log});
    auto pid = launch.spawn(supervised.back().argv, log);
    if (!pid.isOk()) return fail(Status(StatusCode::kNotFound, "redis-server not found: run scripts/setup"));
    writePidFile(runDir, "redis", *pid);
    auto ready = waitReady("the embedded redis-server", *pid, log, kStartLimit,
                           [&]() { return connectRedisStore(redis).isOk(); });
    if (!ready.isOk()) return fail(ready);
    file.token = randomHex(16);
    file.embeddedRedis = true;
  }

  file.redisAddress = HostPort{redis.host, redis.port}.toString();
  file.redisPassword = redis.password;
  file.controllerAddress = HostPort{f.nodeIp, f.port}.toString();
  if (auto s = writeClusterFile(runDir, file); !s.isOk()) return fail(s);
  auto tokenFile = writeTokenFile(runDir, file.token);
  if (!tokenFile.isOk()) return fail(tokenFile.status());

  auto io = kj::setupAsyncIo();
  ClusterTarget target{HostPort{f.nodeIp, f.port}, file.token, runDir};
  std::string controllerLog = runDir + "/logs/controller.log";
  supervised.push_back({"controller",
                        {siblingExecutable("troupe-controller"), "--run-dir", runDir, "--host", f.nodeIp, "--port",
                         std::to_string(f.port), "--heartbeat-ttl-ms", std::to_string(f.heartbeatTtlMs)},
                        controllerLog});
  auto controller = launch.spawn(supervised.back().argv, controllerLog);
  if (!controller.isOk()) return fail(controller.status());
  auto ready = waitReady("troupe-controller", *controller, controllerLog, kStartLimit,
                         [&]() { return fetchNodes(io, target, 1 * kj::SECONDS).isOk(); });
  if (!ready.isOk()) return fail(ready);

  // The store gateway: how nodes on other hosts reach Redis, which stays on this host's loopback.
  auto gatewayPort = pickFreePort(f.nodeIp);
  if (!gatewayPort.isOk()) return fail(gatewayPort.status());
  std::string gatewayAddress = HostPort{f.nodeIp, *gatewayPort}.toString();
  std::string gatewayLog = runDir + "/logs/gateway.log";
  supervised.push_back({"gateway",
                        {siblingExecutable("troupe-gateway"), "--run-dir", runDir, "--host", f.nodeIp, "--port",
                         std::to_string(*gatewayPort)},
                        gatewayLog});
  auto gateway = launch.spawn(supervised.back().argv, gatewayLog);
  if (!gateway.isOk()) return fail(gateway.status());
  ready = waitReady("troupe-gateway", *gateway, gatewayLog, kStartLimit, [&]() {
    auto store = connectRedisStore(redis);
    if (!store.isOk()) return false;
    auto meta = (*store)->getMeta();
    return meta.isOk() && meta->has_value() && (*meta)->storeGateway == gatewayAddress;
  });
  if (!ready.isOk()) return fail(ready);

  // The dashboard and /metrics (python/troupe/dashboard.py), on loopback. The cluster works
  // without it: if it cannot start, say so and go on (the supervisor keeps trying).
  std::string dashboardLog = runDir + "/logs/dashboard.log";
  const char* python = std::getenv("TROUPE_PYTHON");
  const char* packagePath = std::getenv("TROUPE_PYTHONPATH");
  std::string packageDir = packagePath && *packagePath ? packagePath : siblingExecutable("python");
  supervised.push_back({"dashboard",
                        {"/usr/bin/env", "PYTHONPATH=" + packageDir, python && *python ? python : "/usr/bin/python3",
                         "-m", "troupe.dashboard", "--run-dir", runDir, "--port", std::to_string(f.dashboardPort)},
                        dashboardLog});
  std::string dashboardUrl;
  auto dashboard = launch.spawn(supervised.back().argv, dashboardLog);
  if (dashboard.isOk()) {
    auto up = waitReady("the dashboard", *dashboard, dashboardLog, kStartLimit, [&]() {
      std::ifstream in(runDir + "/dashboard.url");
      return static_cast<bool>(std::getline(in, dashboardUrl)) && !dashboardUrl.empty();
    });
    if (!up.isOk()) {
      dashboardUrl.clear();
      std::cerr << "troupe: warning: the dashboard did not start (" << up.message() << "); see " << dashboardLog
                << std::endl;
    }
  }

  NodeId nodeId = NodeId::generate();
  std::string nodeLog = fmt::format("{}/logs/node-{}.log", runDir, nodeId.hex());
  auto node = launch.spawn(nodeArgs(f, runDir, file.controllerAddress, nodeId), nodeLog);
  if (!node.isOk()) return fail(node.status());
  ready = waitReady("troupe-node", *node, nodeLog, kStartLimit,
                    [&]() { return nodeReady(io, target, runDir, nodeId); });
  if (!ready.isOk()) return fail(ready);

  std::cout << "Troupe head started.\n"
            << "  controller: " << file.controllerAddress << "\n"
            << "  redis:      " << file.redisAddress << (file.embeddedRedis ? " (embedded)" : "") << "\n"
            << "  gateway:    " << gatewayAddress << " (how other nodes reach the store)\n"
            << "  tls:        " << (f.tls ? "on (every connection encrypted)" : "off") << "\n"
            << "  dashboard:  " << (dashboardUrl.empty() ? "(not running)" : dashboardLoginUrl(runDir)) << "\n"
            << (dashboardUrl.empty() ? "" : "              (log in there; 'troupe dashboard' prints it again)\n")
            << "  head node:  " << nodeId.hex() << "\n"
            << "  run dir:    " << runDir << "\n\n"
            << "To add a machine: copy " << *tokenFile << " (0600) to it, then run there\n"
            << "  troupe start --address " << file.controllerAddress << " --token-file FILE\n"
            << "  (or put the token in TROUPE_TOKEN; never on a command line, where every local user sees it)\n"
            << "To see the cluster: troupe status\n"
            << "To stop this machine's processes: troupe stop" << std::endl;
  // Only now: a failed start must not redirect later commands to a dead cluster.
  if (auto s = markLatest(runDir); !s.isOk()) return fail(s);
  if (f.block) return blockUntilStopped(launch, runDir, f.watchPid);
  // The head's agent is recorded too: the gateway supervises the head as well, so a killed agent
  // comes back (as a new node) and the other daemons stay supervised meanwhile.
  supervised.push_back({"node-" + nodeId.hex(), nodeArgs(f, runDir, file.controllerAddress, nodeId), nodeLog});
  for (const auto& d : supervised) {
    if (auto s = supervisor::record(runDir, d.name, d.argv, d.log); !s.isOk()) return fail(s);
  }
  launch.commit();
  return 0;
}

int joinCluster(StartFlags f) {
  auto target = resolveCluster(f.address, f.token);
  if (!target.isOk()) return fail(target.status());
  if (f.nodeIp.empty()) {
    // As Ray does: the address of the interface that routes to the head, not loopback (unless
    // the head itself is on loopback: a single-machine cluster).
    const std::string& head = target->controller.host;
    if (head.rfind("127.", 0) == 0 || head == "localhost") {
      f.nodeIp = "127.0.0.1";
    } else {
      auto local = localAddressToward(head);
      if (!local.isOk()) {
        return fail(Status(local.status().code(),
                           fmt::format("cannot reach the head at {}: {}; check the network, or pass --node-ip-address",
                                       target->controller.toString(), local.status().message())));
      }
      f.nodeIp = *local;
    }
  }
  auto io = kj::setupAsyncIo();
  // Fail fast with a clear message before spawning anything.
  auto reachable = fetchNodes(io, *target, 3 * kj::SECONDS);
  if (!reachable.isOk()) return fail(reachable.status());

  std::string runDir = target->runDir;
  bool ownRunDir = runDir.empty();
  if (runDir.empty()) {
    auto dir = createRunDir();
    if (!dir.isOk()) return fail(dir.status());
    runDir = *dir;
    ClusterFile file;
    file.controllerAddress = target->controller.toString();
    file.token = target->token;
    if (auto s = writeClusterFile(runDir, file); !s.isOk()) return fail(s);
  }

  Launch launch(f.block);
  NodeId nodeId = NodeId::generate();
  std::string nodeLog = fmt::format("{}/logs/node-{}.log", runDir, nodeId.hex());
  // The token travels in the environment, not argv, so `ps` does not show it. A --tls cluster
  // told this process so while it checked the controller above.
  std::vector<std::string> env = {"TROUPE_TOKEN=" + target->token};
  if (tls::required()) env.push_back("TROUPE_TLS=1");
  auto node = launch.spawn(nodeArgs(f, runDir, target->controller.toString(), nodeId), nodeLog, env);
  if (!node.isOk()) return fail(node.status());
  auto ready = waitReady("troupe-node", *node, nodeLog, kStartLimit,
                         [&]() { return nodeReady(io, *target, runDir, nodeId); });
  if (!ready.isOk()) return fail(ready);
  std::cout << "Node " << nodeId.hex() << " (" << f.nodeIp << ") joined the cluster at "
            << target->controller.toString() << " (log: " << nodeLog << ")" << std::endl;
  if (ownRunDir) {
    if (auto s = markLatest(runDir); !s.isOk()) return fail(s);
  }
  if (f.block) return blockUntilStopped(launch, runDir, f.watchPid);
  launch.commit();
  return 0;
}

}  // namespace

int startCommand(const StartFlags& flags) {
  if (flags.head == !flags.address.empty()) {
    return fail(Status(StatusCode::kInvalidArgument,
                       "pass --head to start a new cluster or --address HOST:PORT to join one (exactly one)"));
  }
  if (auto r = parseResources(flags.resources); !r.isOk()) return fail(r.status());
  if (flags.numCpus != -1 && !(std::isfinite(flags.numCpus) && flags.numCpus >= 0 && flags.numCpus <= 1e18)) {
    return fail(Status(StatusCode::kInvalidArgument,
                       fmt::format("--num-cpus {} is not a finite number in [0, 1e18]", flags.numCpus)));
  }
  if (flags.objectStoreMemory != 0 && flags.objectStoreMemory < NodeObjects::kMinLimit) {
    return fail(Status(StatusCode::kInvalidArgument,
                       fmt::format("--object-store-memory {} is below the smallest store, {} bytes",
                                   flags.objectStoreMemory, NodeObjects::kMinLimit)));
  }
  // Ctrl-C or SIGTERM during start-up must still run the clean-up that kills half-started
  // daemons, so those signals are held pending and checked while waiting (children unblock them).
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigprocmask(SIG_BLOCK, &set, nullptr);
  return flags.head ? startHead(flags) : joinCluster(flags);
}

int restartControllerCommand() {
  auto runDir = latestRunDir();
  if (!runDir.isOk()) return fail(runDir.status());
  auto file = readClusterFile(*runDir);
  if (!file.isOk()) return fail(file.status());
  auto hp = parseHostPort(file->controllerAddress);
  if (!hp.isOk()) return fail(hp.status());
  if (file->tls) {
    ::setenv("TROUPE_TLS", "1", 1);
    tls::require();
  }
  ::setenv("TROUPE_HEARTBEAT_TTL_MS", std::to_string(file->heartbeatTtlMs).c_str(), 1);
  // The head's agent would start one too: it waits while we replace it.
  supervisor::ReplaceLock replacing(*runDir);
  std::ifstream pidFile(*runDir + "/pids/controller.pid");
  pid_t old = 0;
  if (pidFile >> old && processAlive(old) && processCommandLine(old).find(*runDir) != std::string::npos) {
    ::kill(old, SIGTERM);
    auto gone = waitReady("the old controller", 0, "", std::chrono::seconds(5), [&]() { return !processAlive(old); });
    if (!gone.isOk()) ::kill(old, SIGKILL);
  }
  Launch launch(false);
  std::string log = *runDir + "/logs/controller.log";
  auto pid = launch.spawn({siblingExecutable("troupe-controller"), "--run-dir", *runDir, "--host", hp->host, "--port",
                           std::to_string(hp->port), "--heartbeat-ttl-ms", std::to_string(file->heartbeatTtlMs)},
                          log);
  if (!pid.isOk()) return fail(pid.status());
  auto io = kj::setupAsyncIo();
  ClusterTarget target{*hp, file->token, *runDir};
  size_t nodes = 0;
  auto ready = waitReady("troupe-controller", *pid, log, kStartLimit, [&]() {
    auto n = fetchNodes(io, target, 1 * kj::SECONDS);
    if (n.isOk()) nodes = n->size();
    return n.isOk();
  });
  if (!ready.isOk()) return fail(ready);
  launch.commit();
  std::cout << "Controller restarted (pid " << *pid << ") on " << hp->toString() << "; " << nodes
            << " node(s) recovered from Redis." << std::endl;
  return 0;
}

}  // namespace troupe::cli
