// bench/run scale: the control plane at scale, simulated on one machine (issue 20). One process
// plays many node agents against a real troupe-controller and a real redis-server: each node has
// its own authenticated RPC connection to the controller and its own Redis connection, registers,
// heartbeats at the real interval (a third of the TTL, as troupe-node), serves the NodeAgent
// interface and reports the workers the controller asks it to start as ALIVE at once (no process
// is spawned), and their exits when killed. A driver creates and kills actors and placement
// groups through the real ClusterClient. Only the workers are simulated.
//
//   scale [--nodes 1000] [--actors 100000] [--pgs 10000] [--kill-nodes 20] [--window-s 10]
//         [--small] [--json]
//
// --small (100 nodes, 5,000 actors, 1,000 groups) is the regression check in `make test`: it
// checks the results (every actor ALIVE, dead nodes detected and their actors moved, counts) and
// exits 1 on a wrong one. Every run checks the same; the full run also prints the figures.
#include <hiredis/hiredis.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>

#include "troupe.capnp.h"
#include "troupe/runtime/client.h"
#include "troupe/runtime/clock.h"
#include "troupe/runtime/cluster_store.h"
#include "troupe/runtime/config.h"
#include "troupe/runtime/ids.h"
#include "troupe/runtime/process.h"
#include "troupe/runtime/rpc.h"
#include "troupe/runtime/schema_convert.h"
#include "troupe/testing/head.h"

namespace troupe::bench {
namespace {

namespace fs = std::filesystem;
double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

constexpr int kTtlMs = 3000;         // troupe-controller's default heartbeat TTL
constexpr double kNodeCpus = 128;    // per simulated node: room for 100 actors each, and a spare
constexpr int kCreateWindow = 1000;  // actor creations in flight at once
constexpr int kPgBatch = 100;        // groups in flight at once (as bench/actor_create)

struct Flags {
  int nodes = 1000;
  int actors = 100000;
  int pgs = 10000;
  int killNodes = 20;
  double windowS = 10;
  bool small = false;
  bool json = false;
};

// Every failed check is printed and makes the run exit 1.
int gFailures = 0;
void check(bool ok, const std::string& what) {
  if (ok) return;
  ++gFailures;
  fprintf(stderr, "scale: CHECK FAILED: %s\n", what.c_str());
}
// Thrown to end the run: unwinding stops the threads and the head's processes.
struct Fatal : std::runtime_error {
  using std::runtime_error::runtime_error;
};
[[noreturn]] void die(const std::string& why) { throw Fatal(why); }
// A later phase builds on this one: stop at the first that went wrong.
void phaseDone(const char* phase) {
  if (gFailures > 0) die(fmt::format("stopping after {}: a check failed", phase));
}

using testing::binDir;
using testing::TestHead;

// CPU seconds (user + system) a process has used, from /proc/PID/stat.
double cpuSeconds(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto close = text.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos) return 0;
  std::vector<std::string> fields;
  size_t pos = close + 2;
  while (pos < text.size() && fields.size() < 15) {
    size_t end = text.find(' ', pos);
    fields.push_back(text.substr(pos, end - pos));
    pos = end == std::string::npos ? text.size() : end + 1;
  }
  if (fields.size() < 13) return 0;
  // After the name: state is field 3, utime 14 and stime 15 (1-based, proc(5)).
  return (std::stod(fields[11]) + std::stod(fields[12])) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

double loadAverage() {
  double load[1] = {0};
  return getloadavg(load, 1) == 1 ? load[0] : -1;
}

// A plain hiredis connection for INFO: what the store does not expose.
class RedisInfo {
 public:
  RedisInfo(const std::string& host, int port, const std::string& password)
      : context_(redisConnect(host.c_str(), port), redisFree) {
    if (!context_ || context_->err) die("cannot connect to redis-server for INFO");
    Reply auth(static_cast<redisReply*>(redisCommand(context_.get(), "AUTH %s", password.c_str())), freeReplyObject);
    if (!auth || auth->type == REDIS_REPLY_ERROR) die("redis AUTH failed");
  }
  // What the cluster's keys take (MEMORY USAGE of every key under the cluster's prefix, whole
  // collections counted): records and indexes, without the server's or its clients' overhead.
  int64_t dataMemory(const std::string& cluster) {
    int64_t total = 0;
    std::string cursor = "0";
    std::string match = "troupe:" + cluster + ":*";
    do {
      Reply scan(static_cast<redisReply*>(redisCommand(context_.get(), "SCAN %s MATCH %s COUNT 1000", cursor.c_str(),
                                                       match.c_str())),
                 freeReplyObject);
      if (!scan || scan->type != REDIS_REPLY_ARRAY || scan->elements != 2) die("redis SCAN failed");
      cursor.assign(scan->element[0]->str, scan->element[0]->len);
      const redisReply& keys = *scan->element[1];
      for (size_t i = 0; i < keys.elements; ++i) {
        redisAppendCommand(context_.get(), "MEMORY USAGE %b SAMPLES 0", keys.element[i]->str, keys.element[i]->len);
      }
      for (size_t i = 0; i < keys.elements; ++i) {
        void* raw = nullptr;
        if (redisGetReply(context_.get(), &raw) != REDIS_OK) die("redis MEMORY USAGE failed");
        Reply usage(static_cast<redisReply*>(raw), freeReplyObject);
        if (usage->type == REDIS_REPLY_INTEGER) total += usage->integer;
      }
    } while (cursor != "0");
    return total;
  }
  // INFO memory's mem_clients_normal: the client connections' buffers.
  int64_t clientMemory() {
    Reply info(static_cast<redisReply*>(redisCommand(context_.get(), "INFO memory")), freeReplyObject);
    if (!info || info->type != REDIS_REPLY_STRING) die("redis INFO memory failed");
    std::string text(info->str, info->len);
    auto at = text.find("\nmem_clients_normal:");
    return at == std::string::npos ? 0 : std::stoll(text.substr(at + 20));
  }

 private:
  using Reply = std::unique_ptr<redisReply, void (*)(void*)>;
  std::unique_ptr<redisContext, void (*)(redisContext*)> context_;
};

struct Sim;

// One simulated node agent. Its RPC objects belong to the KJ thread; its store to the
// heartbeat thread once the node has registered.
struct SimNode {
  NodeId id = NodeId::generate();
  std::string address;  // its NodeAgent server; also the address its actors report
  kj::Own<RpcServer> server;
  kj::Own<RpcClient> controller;
  std::unique_ptr<ClusterStore> store;
  std::atomic<bool> registered{false};
  std::atomic<bool> beating{true};
  std::atomic<int64_t> lastBeatMs{0};  // wall clock at the start of its last heartbeat
  std::unordered_map<ActorId, uint32_t> workers;  // actor -> incarnation "running" here
};

// What the simulated agents saw; touched on the KJ thread only, but for `unexpectedDeaths`.
struct Sim {
  kj::AsyncIoContext& io;
  std::vector<std::unique_ptr<SimNode>> nodes;
  struct Placement {
    size_t node = 0;
    uint32_t incarnation = 0;  // the latest started here
    uint32_t ready = 0;        // the latest whose actorReady the controller acknowledged
  };
  std::unordered_map<ActorId, Placement> placedOn;  // actor -> its latest start
  uint64_t started = 0;                          // spawnWorker calls for a new incarnation
  uint64_t ready = 0;                            // actorReady acknowledged by the controller
  uint64_t exits = 0;                            // workerExited acknowledged
  uint64_t rpcErrors = 0;
  std::atomic<uint64_t> unexpectedDeaths{0};     // heartbeats refused to a node we did not stop
  kj::TaskSet tasks;

  explicit Sim(kj::AsyncIoContext& io, kj::TaskSet::ErrorHandler& errors) : io(io), tasks(errors) {}

  void rpcFailed(const char* what, const kj::Exception& e) {
    if (rpcErrors++ < 5) fprintf(stderr, "scale: %s failed: %s\n", what, e.getDescription().cStr());
  }

  void reportReady(size_t index, ActorId id, uint32_t incarnation) {
    auto& node = *nodes[index];
    auto request = node.controller->bootstrap<rpc::Controller>().actorReadyRequest();
    request.setId(id.hex());
    request.setIncarnation(incarnation);
    request.setAddress(node.address);
    request.setPid(getpid());
    tasks.add(request.send().then([this, id, incarnation](auto) {
      ++ready;
      auto& p = placedOn[id];
      p.ready = std::max(p.ready, incarnation);
    }, [this](kj::Exception&& e) { rpcFailed("actorReady", e); }));
  }

  // As troupe-node reports a worker killed by SIGKILL.
  void reportExit(size_t index, ActorId id, uint32_t incarnation) {
    auto request = nodes[index]->controller->bootstrap<rpc::Controller>().workerExitedRequest();
    request.setId(id.hex());
    request.setIncarnation(incarnation);
    auto exit = request.initExit();
    exit.setExitCode(-1);
    exit.setSignal(9);
    tasks.add(request.send().then([this](auto) { ++exits; }, [this](kj::Exception&& e) { rpcFailed("workerExited", e); }));
  }
};

// The NodeAgent interface the controller calls, answered without processes.
class SimAgent final : public rpc::NodeAgent::Server {
 public:
  SimAgent(Sim& sim, size_t index) : sim_(sim), index_(index) {}

 protected:
  kj::Promise<void> ping(PingContext context) override {
    context.getResults().setNodeId(sim_.nodes[index_]->id.hex());
    context.getResults().setPid(getpid());
    return kj::READY_NOW;
  }

  kj::Promise<void> spawnWorker(SpawnWorkerContext context) override {
    ActorRecord actor = fromActorInfo(context.getParams().getActor());
    auto& workers = sim_.nodes[index_]->workers;
    auto it = workers.find(actor.id);
    context.getResults().setPid(getpid());
    if (it != workers.end() && it->second >= actor.incarnation) return kj::READY_NOW;  // a retry
    workers[actor.id] = actor.incarnation;
    auto& placed = sim_.placedOn[actor.id];
    placed.node = index_;
    placed.incarnation = actor.incarnation;
    ++sim_.started;
    // The worker's own report, as troupe-worker sends it once it serves.
    sim_.reportReady(index_, actor.id, actor.incarnation);
    return kj::READY_NOW;
  }

  kj::Promise<void> killWorker(KillWorkerContext context) override {
    ActorId id(context.getParams().getId().cStr());
    uint32_t incarnation = context.getParams().getIncarnation();
    auto& workers = sim_.nodes[index_]->workers;
    auto it = workers.find(id);
    if (it == workers.end() || it->second != incarnation) return kj::READY_NOW;
    workers.erase(it);
    sim_.reportExit(index_, id, incarnation);
    return kj::READY_NOW;
  }

  kj::Promise<void> readLogs(ReadLogsContext context) override {
    context.getResults().setStdoutEnd(0);
    context.getResults().setStderrEnd(0);
    return kj::READY_NOW;
  }

  kj::Promise<void> metrics(MetricsContext context) override {
    context.getResults().initSamples(0);
    return kj::READY_NOW;
  }

 private:
  Sim& sim_;
  size_t index_;
};

// Beats for every registered node at a third of the TTL, as troupe-node, spread evenly over
// the interval. Each beat is one synchronous round trip through the store gateway, so the nodes
// are shared among threads (each node's store belongs to one of them): a thread has 1 s / (its
// nodes) per beat, and once a round trip takes longer it falls behind and its nodes expire,
// where real nodes are a thousand machines beating at once. With 4 threads (250 nodes, 4 ms a
// beat) a loaded machine left the beats 6 s late and 161 nodes expired; 32 threads give each
// beat 32 ms. `lateMs` is how far behind its schedule a thread has been at worst.
class HeartbeatThreads {
 public:
  static constexpr size_t kThreads = 32;
  explicit HeartbeatThreads(Sim& sim) : sim_(sim) {
    for (size_t t = 0; t < kThreads; ++t) threads_.emplace_back([this, t]() { run(t); });
  }
  ~HeartbeatThreads() {
    stop_ = true;
    for (auto& thread : threads_) thread.join();
  }
  int64_t lateMs() const { return lateMs_; }

 private:
  void run(size_t slice) {
    const auto interval = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::milliseconds(kTtlMs)) / 3;
    const auto ttl = std::chrono::milliseconds(kTtlMs);
    std::vector<SimNode*> mine;
    for (size_t i = slice; i < sim_.nodes.size(); i += kThreads) mine.push_back(sim_.nodes[i].get());
    if (mine.empty()) return;
    const auto step = interval / mine.size();
    auto next = Clock::now() + interval * slice / kThreads;
    for (uint64_t k = 0; !stop_; ++k) {
      next += step;
      std::this_thread::sleep_until(next);
      int64_t late = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - next).count();
      if (late > lateMs_) lateMs_ = late;  // a benign race between threads: a report, not a check
      SimNode& node = *mine[k % mine.size()];
      if (!node.registered || !node.beating) continue;
      node.lastBeatMs = wallClockMs();
      auto alive = node.store->heartbeat(node.id, ttl);
      if (alive.isOk() && !*alive && node.beating) ++sim_.unexpectedDeaths;
      if (!alive.isOk()) fprintf(stderr, "scale: heartbeat failed: %s\n", alive.status().toString().c_str());
    }
  }

  Sim& sim_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> lateMs_{0};
  std::vector<std::thread> threads_;
};

// NODE_DEAD events as they arrive, with the wall time each was received.
class DeathWatch {
 public:
  explicit DeathWatch(ClusterStore& store) {
    auto sub = store.subscribe();
    if (!sub.isOk()) die("cannot subscribe to cluster events: " + sub.status().toString());
    subscription_ = std::move(*sub);
    thread_ = std::thread([this]() {
      while (!stop_) {
        auto event = subscription_->next(std::chrono::milliseconds(100));
        if (!event.isOk() || !event->has_value() || (*event)->type != ClusterEventType::kNodeDead) continue;
        std::lock_guard<std::mutex> lock(mutex_);
        deaths_[(*event)->nodeId] = wallClockMs();
      }
    });
  }
  ~DeathWatch() {
    stop_ = true;
    thread_.join();
  }
  std::map<NodeId, int64_t> deaths() {
    std::lock_guard<std::mutex> lock(mutex_);
    return deaths_;
  }

 private:
  std::unique_ptr<EventSubscription> subscription_;
  std::mutex mutex_;
  std::map<NodeId, int64_t> deaths_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

class LogErrors final : public kj::TaskSet::ErrorHandler {
 public:
  void taskFailed(kj::Exception&& e) override { fprintf(stderr, "scale: task failed: %s\n", e.getDescription().cStr()); }
};

// Runs the event loop until `done()` or the deadline; false on the deadline.
template <typename Cond>
bool runUntil(kj::AsyncIoContext& io, std::chrono::milliseconds limit, Cond done) {
  auto deadline = Clock::now() + limit;
  while (!done()) {
    if (Clock::now() >= deadline) return false;
    io.provider->getTimer().afterDelay(5 * kj::MILLISECONDS).wait(io.waitScope);
  }
  return true;
}

// Runs `count` operations with at most `window` in flight; `start(i)` begins the i-th.
template <typename Start>
void inFlight(kj::AsyncIoContext& io, int count, int window, Start start) {
  struct Pump {
    int next = 0, done = 0, failed = 0;
  };
  if (count <= 0) return;
  auto pump = std::make_shared<Pump>();
  std::function<kj::Promise<void>()> one = [&, pump]() -> kj::Promise<void> {
    if (pump->next >= count) return kj::READY_NOW;
    int i = pump->next++;
    return start(i)
        .catch_([pump](kj::Exception&& e) {
          if (pump->failed++ < 5) fprintf(stderr, "scale: operation failed: %s\n", e.getDescription().cStr());
        })
        .then([&, pump]() {
          ++pump->done;
          return one();
        });
  };
  auto lanes = kj::heapArrayBuilder<kj::Promise<void>>(std::min(window, count));
  for (int i = 0; i < std::min(window, count); ++i) lanes.add(one());
  kj::joinPromises(lanes.finish()).wait(io.waitScope);
  check(pump->failed == 0, fmt::format("{} of {} operations failed", pump->failed, count));
}

struct StatusReply {
  size_t nodesAlive = 0, nodesDead = 0;
  std::map<std::string, uint64_t> actorCounts;
  uint64_t matching = 0;
  size_t pageSize = 0;
  size_t groupsCreated = 0, groups = 0;
};

// The controller's status call, as `troupe status --limit` makes it.
StatusReply status(kj::AsyncIoContext& io, RpcClient& client, uint32_t limit, const std::string& state = "",
                   const std::string& node = "") {
  auto request = client.bootstrap<rpc::Controller>().statusRequest();
  request.setActors(true);
  request.setActorLimit(limit);
  request.setActorState(state);
  request.setActorNode(node);
  auto reply = request.send().wait(io.waitScope);
  StatusReply out;
  for (auto n : reply.getNodes()) (std::string(n.getState().cStr()) == "ALIVE" ? out.nodesAlive : out.nodesDead) += 1;
  for (auto c : reply.getActorCounts()) out.actorCounts[c.getState().cStr()] += c.getCount();
  out.matching = reply.getActorsMatching();
  out.pageSize = reply.getActors().size();
  for (auto g : reply.getPlacementGroups()) {
    ++out.groups;
    out.groupsCreated += std::string(g.getState().cStr()) == "CREATED";
  }
  return out;
}

std::string describe(const std::map<std::string, uint64_t>& counts) {
  std::string out;
  for (const auto& [state, n] : counts) out += fmt::format("{}{} {}", out.empty() ? "" : ", ", n, state);
  return out.empty() ? "none" : out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Controller + Redis CPU over `window`, as a fraction of one core.
struct CpuShare {
  double controller, redis, gateway;  // the gateway relays the nodes' beats; reported apart
  double total() const { return controller + redis; }
};
CpuShare cpuOver(kj::AsyncIoContext& io, TestHead& head, double windowS) {
  double c0 = cpuSeconds(head.controller().pid()), r0 = cpuSeconds(head.redis().pid()), g0 = cpuSeconds(head.gateway().pid());
  auto t0 = Clock::now();
  // The loop keeps serving the controller's calls meanwhile.
  io.provider->getTimer().afterDelay(static_cast<int64_t>(windowS * 1000) * kj::MILLISECONDS).wait(io.waitScope);
  double elapsed = seconds(Clock::now() - t0);
  return {(cpuSeconds(head.controller().pid()) - c0) / elapsed, (cpuSeconds(head.redis().pid()) - r0) / elapsed,
          (cpuSeconds(head.gateway().pid()) - g0) / elapsed};
}

// `troupe status --json --limit 100`, the real CLI, timed from start to exit.
double cliStatusMs(TestHead& head, const std::string& outPath) {
  SpawnOptions o;
  o.argv = {binDir() + "/troupe", "status", "--address", head.controllerAddress().toString(), "--token", head.token(), "--json",
            "--limit", "100"};
  o.outputPath = outPath;
  auto t0 = Clock::now();
  auto pid = spawnProcess(o);
  if (!pid.isOk()) die("cannot run troupe status: " + pid.status().toString());
  ChildProcess child(*pid);
  auto exit = child.wait(std::chrono::seconds(60));
  double ms = seconds(Clock::now() - t0) * 1e3;
  check(exit && exit->exitCode == 0, "troupe status --json --limit 100 failed (see " + outPath + ")");
  return ms;
}

int run(const Flags& flags) {
  // Per node: its server, its connection to the controller, the controller's to it, Redis.
  rlimit files{};
  getrlimit(RLIMIT_NOFILE, &files);
  rlim_t want = static_cast<rlim_t>(flags.nodes) * 5 + 1024;
  if (files.rlim_cur < want) {
    files.rlim_cur = std::min(want, files.rlim_max);
    setrlimit(RLIMIT_NOFILE, &files);
  }
  if (files.rlim_cur < want) die(fmt::format("{} nodes need {} open files; the hard limit is {}", flags.nodes, want, files.rlim_max));

  // The head, as the test fixture starts it (troupe/testing/head.h); inherits the raised limit.
  TestHead head(testing::HeadOptions{kTtlMs, "scale", "troupe_scale_"});
  if (Status s = head.startController(); !s.isOk()) die(s.toString());
  auto io = kj::setupAsyncIo();
  LogErrors errors;
  Sim sim(io, errors);
  RedisInfo redisInfo(head.redis().host(), head.redis().port(), head.redis().password());
  printf("scale: %d nodes, %d actors, %d placement groups; heartbeat TTL %d ms; load average %.2f on %ld cores\n",
         flags.nodes, flags.actors, flags.pgs, kTtlMs, loadAverage(), sysconf(_SC_NPROCESSORS_ONLN));
  fflush(stdout);

  kj::Own<RpcClient> probe;
  if (!runUntil(io, std::chrono::seconds(10), [&]() {
        auto client = kj::runCatchingExceptions([&]() {
          probe = RpcClient::connect(io, head.controllerAddress(), head.token(), 2 * kj::SECONDS).wait(io.waitScope);
          status(io, *probe, 1);
        });
        return client == nullptr;
      })) {
    die("the controller did not answer within 10 s (see " + head.controllerLog() + ")");
  }
  if (Status s = head.startGateway(); !s.isOk()) die(s.toString());

  // ---- Nodes: register, then beat ----
  int64_t memEmpty = redisInfo.dataMemory("scale"), clientsEmpty = redisInfo.clientMemory();
  for (int i = 0; i < flags.nodes; ++i) sim.nodes.push_back(std::make_unique<SimNode>());
  // Listening is done outside the loop's callbacks (listen waits on the loop).
  for (int i = 0; i < flags.nodes; ++i) {
    SimNode& node = *sim.nodes[i];
    auto server = RpcServer::listen(io, HostPort{"127.0.0.1", 0}, head.token(),
                                    rpc::NodeAgent::Client(kj::heap<SimAgent>(sim, static_cast<size_t>(i))));
    if (!server.isOk()) die("node server: " + server.status().toString());
    node.server = kj::mv(*server);
    node.address = HostPort{"127.0.0.1", node.server->port()}.toString();
  }
  HeartbeatThreads beats(sim);
  auto t0 = Clock::now();
  // Under the controller's 16 handshakes in flight per source address (handshake.h): every
  // simulated node connects from 127.0.0.1, where real ones come from hosts of their own.
  inFlight(io, flags.nodes, 8, [&](int i) {
    SimNode& node = *sim.nodes[i];
    // As troupe-node: where the store is, a connection there, registration, a first beat.
    return RpcClient::connect(io, head.controllerAddress(), head.token(), 10 * kj::SECONDS)
        .then([&node](kj::Own<RpcClient> c) {
          node.controller = kj::mv(c);
          return node.controller->bootstrap<rpc::Controller>().storeEndpointRequest().send();
        })
        .then([&node, &head, i](capnp::Response<rpc::Controller::StoreEndpointResults> reply) {
      auto endpoint = reply.getRedis();
      auto hp = parseHostPort(endpoint.getAddress().cStr());
      if (!hp.isOk()) die("store endpoint: " + hp.status().toString());
      RedisOptions redis;
      redis.host = hp->host;
      redis.port = hp->port;
      redis.cluster = endpoint.getCluster().cStr();
      redis.gatewayToken = head.token();
      auto store = connectRedisStore(redis);
      if (!store.isOk()) die("node store: " + store.status().toString());
      NodeRecord self;
      self.id = node.id;
      self.address = node.address;
      self.hostname = fmt::format("sim-{}", i);
      self.pid = getpid();
      self.total = {{"CPU", kNodeCpus}, {"memory", 256.0 * (1 << 30)}};
      for (const auto& [name, qty] : self.total) self.used[name] = 0;
      auto request = node.controller->bootstrap<rpc::Controller>().registerNodeRequest();
      toNodeInfo(self, request.initNode());
      return request.send().then([&node, store = kj::mv(*store)](auto) mutable {
        auto alive = store->heartbeat(node.id, std::chrono::milliseconds(kTtlMs));
        if (!alive.isOk() || !*alive) die("a node's first heartbeat failed");
        node.store = std::move(store);
        node.registered = true;  // the heartbeat thread takes the store from here on
      });
    });
  });
  double registerS = seconds(Clock::now() - t0);
  int64_t memNodes = redisInfo.dataMemory("scale"), clientsNodes = redisInfo.clientMemory();
  auto afterNodes = status(io, *probe, 1);
  check(afterNodes.nodesAlive == static_cast<size_t>(flags.nodes),
        fmt::format("{} nodes ALIVE after registering {}", afterNodes.nodesAlive, flags.nodes));
  phaseDone("registration");
  printf("registered %d nodes in %.2f s\n", flags.nodes, registerS);
  fflush(stdout);

  // Two TTLs of beats before measuring: every node has beaten through its steady state.
  io.provider->getTimer().afterDelay(2 * kTtlMs * kj::MILLISECONDS).wait(io.waitScope);
  CpuShare idle = cpuOver(io, head, flags.windowS);
  printf("heartbeats alone: controller %.1f%% + redis %.1f%% of one core (store gateway %.1f%%)\n",
         idle.controller * 100, idle.redis * 100, idle.gateway * 100);
  fflush(stdout);

  // ---- Actors ----
  auto driver = ClusterClient::connect(io, head.controllerAddress(), head.token()).wait(io.waitScope);
  ActorOptions options;
  options.type = "Counter";
  options.resources = {{"CPU", 1}};
  // Moved when its node dies, however often: the silenced nodes die over a second, so an
  // actor may first move to one that dies next.
  options.maxRestarts = -1;
  std::vector<ActorId> ids(flags.actors);
  t0 = Clock::now();
  inFlight(io, flags.actors, kCreateWindow, [&](int i) {
    return driver->submitActor(options).then([&ids, i](ActorHandle h) { ids[i] = h.id(); });
  });
  bool allUp = runUntil(io, std::chrono::seconds(120), [&]() { return sim.ready >= static_cast<uint64_t>(flags.actors); });
  double createS = seconds(Clock::now() - t0);
  check(allUp, fmt::format("{} of {} actors reported ALIVE within 120 s of the last request", sim.ready, flags.actors));
  double createPerS = flags.actors / createS;
  int64_t memActors = redisInfo.dataMemory("scale");
  auto afterCreate = status(io, *probe, 100);
  check(afterCreate.actorCounts["ALIVE"] == static_cast<uint64_t>(flags.actors),
        fmt::format("status counts {} ALIVE actors, not {}", afterCreate.actorCounts["ALIVE"], flags.actors));
  check(afterCreate.pageSize == std::min<size_t>(100, flags.actors), "status --limit 100 did not return 100 actors");
  phaseDone("actor creation");
  printf("created %d actors in %.2f s: %.0f/s\n", flags.actors, createS, createPerS);
  fflush(stdout);

  // ---- Status at this size ----
  std::vector<double> rpcMs, cliMs;
  for (int i = 0; i < 5; ++i) {
    auto s0 = Clock::now();
    status(io, *probe, 100);
    rpcMs.push_back(seconds(Clock::now() - s0) * 1e3);
  }
  std::string cliOut = fs::temp_directory_path() / fmt::format("troupe_scale_status_{}.json", getpid());
  for (int i = 0; i < 3; ++i) cliMs.push_back(cliStatusMs(head, cliOut));
  std::error_code ec;
  fs::remove(cliOut, ec);
  printf("status --limit 100: RPC %.1f ms, troupe status --json %.1f ms (medians)\n", median(rpcMs), median(cliMs));
  fflush(stdout);
  CpuShare withActors = cpuOver(io, head, flags.windowS);

  // ---- Node deaths ----
  std::vector<size_t> victims;
  for (int k = 0; k < flags.killNodes; ++k) victims.push_back(static_cast<size_t>(k) * flags.nodes / flags.killNodes);
  std::set<size_t> victimSet(victims.begin(), victims.end());
  std::vector<ActorId> moving;  // the actors on the nodes about to die
  for (const auto& [id, p] : sim.placedOn) {
    if (victimSet.count(p.node)) moving.push_back(id);
  }
  const uint64_t onVictims = moving.size();
  auto watchStore = connectRedisStore(head.storeOptions());
  if (!watchStore.isOk()) die("watch store: " + watchStore.status().toString());
  DeathWatch watch(**watchStore);
  for (size_t v : victims) sim.nodes[v]->beating = false;
  auto killedAt = Clock::now();
  bool detected = runUntil(io, std::chrono::milliseconds(kTtlMs + 15000), [&]() {
    auto deaths = watch.deaths();
    for (size_t v : victims) {
      if (!deaths.count(sim.nodes[v]->id)) return false;
    }
    return true;
  });
  double detectAllS = seconds(Clock::now() - killedAt);
  check(detected, fmt::format("not every one of {} silent nodes was marked DEAD within TTL + 15 s", victims.size()));
  auto deaths = watch.deaths();
  std::vector<double> detectS;
  for (size_t v : victims) {
    auto it = deaths.find(sim.nodes[v]->id);
    if (it != deaths.end()) detectS.push_back((it->second - sim.nodes[v]->lastBeatMs) / 1000.0);
  }
  std::sort(detectS.begin(), detectS.end());
  double detectP99 = detectS.empty() ? 0 : detectS[std::min(detectS.size() - 1, static_cast<size_t>(0.99 * detectS.size()))];
  auto recoverFrom = Clock::now();
  auto movedCount = [&]() {
    uint64_t n = 0;
    for (const auto& id : moving) {
      const auto& p = sim.placedOn[id];
      n += !victimSet.count(p.node) && p.ready == p.incarnation;
    }
    return n;
  };
  bool moved = runUntil(io, std::chrono::seconds(60), [&]() { return movedCount() == onVictims; });
  double recoverS = seconds(Clock::now() - recoverFrom);
  check(moved, fmt::format("{} of the {} actors on dead nodes came up elsewhere within 60 s", movedCount(), onVictims));
  check(sim.unexpectedDeaths == 0, fmt::format("{} heartbeats of live nodes were refused", sim.unexpectedDeaths.load()));
  auto afterDeaths = status(io, *probe, 100);
  check(afterDeaths.nodesDead == victims.size(), fmt::format("status shows {} DEAD nodes, not {}", afterDeaths.nodesDead, victims.size()));
  check(afterDeaths.actorCounts["ALIVE"] == static_cast<uint64_t>(flags.actors),
        fmt::format("after the deaths status counts {} ALIVE actors, not {} ({})", afterDeaths.actorCounts["ALIVE"],
                    flags.actors, describe(afterDeaths.actorCounts)));
  for (size_t v : victims) {
    auto left = status(io, *probe, 1, "ALIVE", sim.nodes[v]->id.hex());
    check(left.matching == 0, fmt::format("{} actors still ALIVE on dead node {}", left.matching, sim.nodes[v]->id.hex()));
  }
  phaseDone("node deaths");
  printf("%zu nodes silenced: all DEAD after %.2f s (p99 %.2f s after the last beat); their %llu actors up elsewhere "
         "%.2f s later\n",
         victims.size(), detectAllS, detectP99, static_cast<unsigned long long>(onVictims), recoverS);
  fflush(stdout);
  // With DEAD nodes in the history: what the failure detector costs now.
  CpuShare afterDeath = cpuOver(io, head, flags.windowS);

  // ---- Kills ----
  int kills = std::min(1000, std::max(1, flags.actors / 100));
  uint64_t exitsBefore = sim.exits;
  t0 = Clock::now();
  inFlight(io, kills, 100, [&](int i) { return driver->kill(driver->actor(ids[i]), true); });
  double killS = seconds(Clock::now() - t0);
  check(runUntil(io, std::chrono::seconds(30), [&]() { return sim.exits - exitsBefore >= static_cast<uint64_t>(kills); }),
        fmt::format("{} of {} killed workers' exits acknowledged", sim.exits - exitsBefore, kills));
  auto afterKills = status(io, *probe, 100);
  check(afterKills.actorCounts["DEAD"] == static_cast<uint64_t>(kills),
        fmt::format("status counts {} DEAD actors after {} kills", afterKills.actorCounts["DEAD"], kills));
  check(afterKills.actorCounts["ALIVE"] == static_cast<uint64_t>(flags.actors - kills),
        fmt::format("status counts {} ALIVE actors after {} kills, not {} ({}; {} DEAD nodes; the simulator's beats "
                    "were up to {} ms late)",
                    afterKills.actorCounts["ALIVE"], kills, flags.actors - kills, describe(afterKills.actorCounts),
                    afterKills.nodesDead, beats.lateMs()));
  check(afterKills.nodesDead == victims.size() && sim.unexpectedDeaths == 0,
        fmt::format("{} DEAD nodes after the kills, not {} ({} heartbeats of live nodes refused; the simulator's beats "
                    "were up to {} ms late)",
                    afterKills.nodesDead, victims.size(), sim.unexpectedDeaths.load(), beats.lateMs()));
  phaseDone("kills");
  printf("killed %d actors: %.0f/s\n", kills, kills / killS);
  fflush(stdout);

  // ---- Placement groups: fill to flags.pgs live groups, then create+remove at that size ----
  std::vector<Resources> bundle = {{{"CPU", 0.01}}};
  t0 = Clock::now();
  inFlight(io, flags.pgs, kPgBatch, [&](int) {
    return driver->createPlacementGroup(PlacementStrategy::kPack, bundle).ignoreResult();
  });
  double pgFillPerS = flags.pgs / seconds(Clock::now() - t0);
  constexpr int kPgRounds = 10;
  t0 = Clock::now();
  for (int round = 0; round < kPgRounds; ++round) {
    auto creates = kj::heapArrayBuilder<kj::Promise<PlacementGroupRecord>>(kPgBatch);
    for (int i = 0; i < kPgBatch; ++i) creates.add(driver->createPlacementGroup(PlacementStrategy::kPack, bundle));
    auto groups = kj::joinPromises(creates.finish()).wait(io.waitScope);
    auto removes = kj::heapArrayBuilder<kj::Promise<void>>(kPgBatch);
    for (auto& g : groups) removes.add(driver->removePlacementGroup(g.id));
    kj::joinPromises(removes.finish()).wait(io.waitScope);
  }
  double pgPerS = kPgRounds * kPgBatch / seconds(Clock::now() - t0);
  auto s0 = Clock::now();
  auto afterPgs = status(io, *probe, 100);
  double statusWithPgsMs = seconds(Clock::now() - s0) * 1e3;
  check(afterPgs.groups == static_cast<size_t>(flags.pgs) && afterPgs.groupsCreated == afterPgs.groups,
        fmt::format("status shows {} groups ({} CREATED), not {} CREATED", afterPgs.groups, afterPgs.groupsCreated, flags.pgs));
  printf("placement groups: %d made at %.0f/s; at %d live, create+remove %.0f/s\n", flags.pgs, pgFillPerS, flags.pgs, pgPerS);
  fflush(stdout);
  check(sim.rpcErrors == 0, fmt::format("{} agent reports to the controller failed", sim.rpcErrors));

  double bytesPerNode = flags.nodes ? static_cast<double>(memNodes - memEmpty) / flags.nodes : 0;
  double bytesPerActor = flags.actors ? static_cast<double>(memActors - memNodes) / flags.actors : 0;
  double clientBytesPerNode = flags.nodes ? static_cast<double>(clientsNodes - clientsEmpty) / flags.nodes : 0;

  // Stop the controller before the driver goes: its session's end would kill every actor.
  head.stopController();
  driver = nullptr;

  printf("\n%-58s %12s\n", "measure", "value");
  auto row = [](const std::string& what, const std::string& value) { printf("%-58s %12s\n", what.c_str(), value.c_str()); };
  row("nodes", std::to_string(flags.nodes));
  row("heartbeats alone: controller + redis CPU (of one core)", fmt::format("{:.3f}", idle.total()));
  row(fmt::format("  with {} actors", flags.actors), fmt::format("{:.3f}", withActors.total()));
  row(fmt::format("  with {} DEAD nodes in the history", victims.size()), fmt::format("{:.3f}", afterDeath.total()));
  row(fmt::format("death detected after the last beat, p99 of {} (s)", victims.size()), fmt::format("{:.2f}", detectP99));
  row(fmt::format("  their {} actors up elsewhere after (s)", onVictims), fmt::format("{:.2f}", recoverS));
  row("actors", std::to_string(flags.actors));
  row("actor creation, request -> ALIVE (/s)", fmt::format("{:.0f}", createPerS));
  row("troupe status --json --limit 100 (ms)", fmt::format("{:.1f}", median(cliMs)));
  row("  the status RPC alone (ms)", fmt::format("{:.1f}", median(rpcMs)));
  row(fmt::format("  with {} placement groups (RPC, ms)", flags.pgs), fmt::format("{:.1f}", statusWithPgsMs));
  row(fmt::format("placement groups at {} live: create+remove (/s)", flags.pgs), fmt::format("{:.0f}", pgPerS));
  row("redis bytes per actor record", fmt::format("{:.0f}", bytesPerActor));
  row("redis bytes per node record", fmt::format("{:.0f}", bytesPerNode));
  row("  and per node's connection (its buffers)", fmt::format("{:.0f}", clientBytesPerNode));
  row("the simulator's heartbeats: worst lateness (ms)", std::to_string(beats.lateMs()));
  row("load average at the end", fmt::format("{:.2f}", loadAverage()));
  if (flags.json) {
    printf("{\"nodes\": %d, \"heartbeat_cpu_fraction\": %.4f, \"heartbeat_cpu_controller\": %.4f, "
           "\"heartbeat_cpu_redis\": %.4f, \"cpu_fraction_with_actors\": %.4f, \"cpu_fraction_after_deaths\": %.4f, "
           "\"death_detect_p99_s\": %.3f, \"death_recover_s\": %.3f, \"actors_on_dead_nodes\": %llu, \"actors\": %d, "
           "\"status_ms\": %.2f, \"status_rpc_ms\": %.2f, \"status_rpc_ms_with_pgs\": %.2f, \"actor_create_per_s\": %.1f, "
           "\"actor_kill_per_s\": %.1f, \"pgs\": %d, \"pg_fill_per_s\": %.1f, \"pg_create_remove_per_s_at_10k\": %.1f, "
           "\"redis_bytes_per_actor\": %.0f, \"redis_bytes_per_node\": %.0f, \"redis_client_bytes_per_node\": %.0f, "
           "\"register_s\": %.3f, "
           "\"heartbeat_late_ms\": %lld, \"load_average\": %.2f, \"ok\": %s}\n",
           flags.nodes, idle.total(), idle.controller, idle.redis, withActors.total(), afterDeath.total(), detectP99,
           recoverS, static_cast<unsigned long long>(onVictims), flags.actors, median(cliMs), median(rpcMs),
           statusWithPgsMs, createPerS, kills / killS, flags.pgs, pgFillPerS, pgPerS, bytesPerActor, bytesPerNode,
           clientBytesPerNode, registerS, static_cast<long long>(beats.lateMs()), loadAverage(),
           gFailures == 0 ? "true" : "false");
  }
  return gFailures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace troupe::bench

int main(int argc, char** argv) {
  troupe::bench::Flags flags;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> double {
      if (i + 1 >= argc) troupe::bench::die(a + " needs a value");
      return std::atof(argv[++i]);
    };
    if (a == "--json") flags.json = true;
    else if (a == "--small") {
      flags.small = true;
      flags.nodes = 100;
      flags.actors = 5000;
      flags.pgs = 1000;
      flags.windowS = 3;
    } else if (a == "--nodes") flags.nodes = static_cast<int>(value());
    else if (a == "--actors") flags.actors = static_cast<int>(value());
    else if (a == "--pgs") flags.pgs = static_cast<int>(value());
    else if (a == "--kill-nodes") flags.killNodes = static_cast<int>(value());
    else if (a == "--window-s") flags.windowS = value();
    else troupe::bench::die("usage: scale [--nodes N] [--actors N] [--pgs N] [--kill-nodes N] [--window-s S] [--small] [--json]");
  }
  if (flags.nodes < 2 || flags.killNodes < 1 || flags.killNodes >= flags.nodes || flags.actors < 1 || flags.pgs < 0) {
    troupe::bench::die("need --nodes >= 2, 1 <= --kill-nodes < --nodes, --actors >= 1, --pgs >= 0");
  }
  try {
    return troupe::bench::run(flags);
  } catch (const troupe::bench::Fatal& e) {
    fprintf(stderr, "scale: %s\n", e.what());
  } catch (const kj::Exception& e) {
    fprintf(stderr, "scale: %s\n", e.getDescription().cStr());
  } catch (const std::exception& e) {  // the head could not start (troupe/testing/head.h)
    fprintf(stderr, "scale: %s\n", e.what());
  }
  return 1;
}
