#include "node_agent.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string_view>
#include <fstream>

#include <kj/async-unix.h>

#include <asio/steady_timer.hpp>

#include "log_pump.h"
#include "troupe/runtime/schema_convert.h"
#include "troupe.capnp.h"
#include "troupe/runtime/logging.h"
#include "troupe/runtime/process.h"
#include "troupe/runtime/safe_open.h"
#include "troupe/runtime/tls.h"

namespace troupe {

// Everything the I/O thread touches; pending handlers share ownership.
struct NodeAgent::IoState {
  explicit IoState(asio::io_context& context) : timer(context) {}
  NodeId id;
  std::unique_ptr<NodeStore> store;  // its one role of the cluster store: membership, heartbeats
  asio::steady_timer timer;
  std::chrono::milliseconds ttl{3000};
  bool stopping = false;
  int failures = 0;
  kj::Own<kj::CrossThreadPromiseFulfiller<std::string>> fatal;
};

namespace {

void scheduleHeartbeat(std::shared_ptr<NodeAgent::IoState> state) {
  // Three beats per TTL: one lost or late beat never expires the node.
  state->timer.expires_after(state->ttl / 3);
  state->timer.async_wait([state](const std::error_code& ec) {
    if (ec || state->stopping) return;
    auto alive = state->store->heartbeat(state->id, state->ttl);
    if (!alive.isOk()) {
      if (state->failures++ % 10 == 0) {
        TROUPE_LOG(kWarning, "heartbeat failed ({} in a row): {}", state->failures, alive.status().toString());
      }
    } else if (!*alive) {
      state->fatal->fulfill("the cluster declared this node dead (its heartbeat expired); exiting");
      return;
    } else {
      state->failures = 0;
    }
    scheduleHeartbeat(state);
  });
}

class NodeAgentService final : public rpc::NodeAgent::Server {
 public:
  explicit NodeAgentService(NodeAgent& agent) : agent_(agent) {}

 protected:
  kj::Promise<void> ping(PingContext context) override {
    auto results = context.getResults();
    results.setNodeId(agent_.id().hex());
    results.setPid(getpid());
    return kj::READY_NOW;
  }

  kj::Promise<void> spawnWorker(SpawnWorkerContext context) override {
    auto params = context.getParams();
    ActorRecord actor = fromActorInfo(params.getActor());
    // The id names the worker's files: nothing but hex digits may get that far.
    if (!actor.id.valid()) throwStatus(Status(StatusCode::kInvalidArgument, "spawnWorker: the actor id is not hex"));
    auto args = params.getInitArgs();
    return agent_.spawnWorker(actor, std::string_view(reinterpret_cast<const char*>(args.begin()), args.size()))
        .then([context](int64_t pid) mutable { context.getResults().setPid(pid); });
  }

  kj::Promise<void> killWorker(KillWorkerContext context) override {
    agent_.killWorker(ActorId(context.getParams().getId().cStr()), context.getParams().getIncarnation());
    return kj::READY_NOW;
  }

  kj::Promise<void> readLogs(ReadLogsContext context) override {
    auto p = context.getParams();
    ActorId id(p.getId().cStr());
    if (!id.valid()) throwStatus(Status(StatusCode::kInvalidArgument, "readLogs: the actor id is not hex"));
    auto [out, outEnd] = agent_.readLog(id, "out", p.getStdoutFrom(), p.getMaxBytes());
    auto [err, errEnd] = agent_.readLog(id, "err", p.getStderrFrom(), p.getMaxBytes());
    auto results = context.getResults();
    results.setStdout(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(out.data()), out.size()));
    results.setStderr(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(err.data()), err.size()));
    results.setStdoutEnd(outEnd);
    results.setStderrEnd(errEnd);
    return kj::READY_NOW;
  }

  kj::Promise<void> metrics(MetricsContext context) override {
    auto samples = agent_.metrics();
    auto out = context.getResults().initSamples(samples.size());
    for (size_t i = 0; i < samples.size(); ++i) {
      out[i].setName(samples[i].name);
      out[i].setLabels(samples[i].labels);
      out[i].setValue(samples[i].value);
    }
    return kj::READY_NOW;
  }

  kj::Promise<void> objectStore(ObjectStoreContext context) override {
    auto usage = agent_.objects().usage();
    auto results = context.getResults();
    results.setDirectory(agent_.objects().directory());
    results.setObjects(usage.objects);
    results.setBytes(usage.bytes);
    results.setBulkPort(static_cast<uint16_t>(agent_.bulkPort()));
    results.setLimit(agent_.objects().limit());
    results.setSpillDirectory(agent_.objects().spillDirectory());
    results.setSpilledObjects(usage.spilledObjects);
    results.setSpilledBytes(usage.spilledBytes);
    results.setServedBytes(agent_.objects().servedBytes());
    return kj::READY_NOW;
  }

  kj::Promise<void> readObject(ReadObjectContext context) override {
    auto p = context.getParams();
    auto results = context.getResults();
    // The reply's buffer is the read's destination: one copy, from the page cache.
    auto data = results.initData(std::min(p.getLength(), NodeObjects::kMaxChunk));
    auto read = agent_.objects().read(p.getName().cStr(), p.getOffset(), data);
    if (!read.isOk()) throwStatus(read.status());
    if (read->length < data.size()) {
      auto orphan = results.disownData();
      orphan.truncate(read->length);
      results.adoptData(kj::mv(orphan));
    }
    results.setSize(read->size);
    results.setBulkPort(static_cast<uint16_t>(agent_.bulkPort()));
    if (p.getOffset() == 0 && read->size > read->length) {  // more to come: a relay may serve it
      results.setRelay(agent_.objects().relayFor(p.getName().cStr(), p.getOffer().cStr()));
    }
    return kj::READY_NOW;
  }

  kj::Promise<void> holdObject(HoldObjectContext context) override {
    auto p = context.getParams();
    Status held = agent_.objects().hold(p.getName().cStr(), p.getHolder().cStr(), p.getLanded().cStr());
    if (!held.isOk()) throwStatus(held);
    return kj::READY_NOW;
  }

  kj::Promise<void> lendObject(LendObjectContext context) override {
    auto p = context.getParams();
    Status lent = agent_.objects().lend(p.getName().cStr(), p.getHolder().cStr(), p.getToken().cStr());
    if (!lent.isOk()) throwStatus(lent);
    return kj::READY_NOW;
  }

  kj::Promise<void> releaseObject(ReleaseObjectContext context) override {
    auto p = context.getParams();
    Status released = agent_.objects().release(p.getName().cStr(), p.getHolder().cStr());
    if (!released.isOk()) throwStatus(released);
    return kj::READY_NOW;
  }

  kj::Promise<void> dropSource(DropSourceContext context) override {
    auto p = context.getParams();
    agent_.objects().dropSource(p.getName().cStr(), p.getOffer().cStr());
    return kj::READY_NOW;
  }

  kj::Promise<void> processesAlive(ProcessesAliveContext context) override {
    std::vector<int32_t> alive;
    for (int32_t pid : context.getParams().getPids()) {
      if (processAlive(pid)) alive.push_back(pid);
    }
    auto out = context.getResults().initAlive(alive.size());
    for (size_t i = 0; i < alive.size(); ++i) out.set(i, alive[i]);
    return kj::READY_NOW;
  }

  kj::Promise<void> dropObject(DropObjectContext context) override {
    auto dropped = agent_.objects().drop(context.getParams().getName().cStr());
    if (!dropped.isOk()) throwStatus(dropped);
    return kj::READY_NOW;
  }

 private:
  NodeAgent& agent_;
};

class LogTaskErrors final : public kj::TaskSet::ErrorHandler {
 public:
  void taskFailed(kj::Exception&& e) override {
    TROUPE_LOG(kWarning, "node agent task failed: {}", e.getDescription().cStr());
  }
};
LogTaskErrors gLogTaskErrors;

// Workers that hold tensors (Python workers, the LibTorch worker) get glibc's malloc in
// transparent huge pages: fewer TLB misses in a step, and a killed worker's address space is
// torn down several times faster (2 GB: 0.02 s instead of 0.15 s), which matters because its
// sockets close only after that, and its peers learn of the death from them. About 2 MB more
// per process. The user's own glibc.malloc.hugetlb, or TROUPE_HUGE_PAGES=0, turns it off.
std::optional<std::string> hugePageMalloc() {
  const char* off = std::getenv("TROUPE_HUGE_PAGES");
  if (off != nullptr && std::string_view(off) == "0") return std::nullopt;
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  std::string current = tunables != nullptr ? tunables : "";
  if (current.find("glibc.malloc.hugetlb") != std::string::npos) return std::nullopt;
  return "GLIBC_TUNABLES=" + current + (current.empty() ? "" : ":") + "glibc.malloc.hugetlb=1";
}

std::string hostName() {
  char buf[256] = {};
  gethostname(buf, sizeof(buf) - 1);
  return buf;
}

// An actor's log, opened so that whatever its worker put at the path (a FIFO, a link) never
// blocks this loop; its size with it. Nothing (and a size of 0) when it is not a regular file.
std::pair<FileDescriptor, int64_t> openLog(const std::string& path) {
  auto fd = openRegularFile(path, O_RDONLY);
  struct stat st {};
  if (!fd.isOk() || ::fstat(fd->get(), &st) != 0) return {FileDescriptor(), 0};
  return {std::move(*fd), static_cast<int64_t>(st.st_size)};
}

// Up to `length` bytes at `offset` (fewer if the file is shorter).
std::string readAt(const FileDescriptor& fd, int64_t offset, size_t length) {
  std::string out(length, '\0');
  size_t done = 0;
  while (done < length) {
    ssize_t got = ::pread(fd.get(), out.data() + done, length - done, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    done += static_cast<size_t>(got);
  }
  out.resize(done);
  return out;
}

// The last `maxBytes` of a file (whole lines where possible).
std::string fileTail(const std::string& path, size_t maxBytes) {
  auto [fd, fileSize] = openLog(path);
  if (fd.get() < 0) return "";
  auto size = static_cast<size_t>(fileSize);
  size_t from = size > maxBytes ? size - maxBytes : 0;
  std::string out = readAt(fd, static_cast<int64_t>(from), size - from);
  if (from > 0) {
    auto nl = out.find('\n');
    if (nl != std::string::npos) out.erase(0, nl + 1);
  }
  return out;
}

// The last `lines` non-empty lines of `text`, joined with " | " for a one-line reason.
std::string lastLines(const std::string& text, size_t lines) {
  std::vector<std::string> all;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    if (nl > pos) all.push_back(text.substr(pos, nl - pos));
    pos = nl + 1;
  }
  std::string out;
  for (size_t i = all.size() > lines ? all.size() - lines : 0; i < all.size(); ++i) {
    out += (out.empty() ? "" : " | ") + all[i];
  }
  return out;
}

}  // namespace

NodeAgent::NodeAgent(kj::AsyncIoContext& io, IoThread& ioThread, NodeAgentOptions options)
    : io_(io), ioThread_(ioThread), options_(std::move(options)),
      state_(std::make_shared<IoState>(ioThread.context())), tasks_(kj::heap<kj::TaskSet>(gLogTaskErrors)) {
  state_->id = options_.id;
  auto paf = kj::newPromiseAndCrossThreadFulfiller<std::string>();
  state_->fatal = kj::mv(paf.fulfiller);
  fatal_ = kj::mv(paf.promise);
}

kj::Promise<kj::Own<NodeAgent>> NodeAgent::start(kj::AsyncIoContext& io, IoThread& ioThread,
                                                 NodeAgentOptions options) {
  kj::Own<NodeAgent> agent(new NodeAgent(io, ioThread, kj::mv(options)), kj::_::HeapDisposer<NodeAgent>::instance);
  auto server = RpcServer::listen(io, HostPort{agent->options_.ip, 0}, agent->options_.token,
                                  rpc::NodeAgent::Client(kj::heap<NodeAgentService>(*agent)));
  if (!server.isOk()) throwStatus(server.status());
  agent->server_ = kj::mv(*server);
  auto objects = NodeObjects::open(agent->options_.id, agent->options_.runDir, agent->options_.objectStoreMemory);
  if (!objects.isOk()) throwStatus(objects.status());
  agent->objects_ = kj::mv(*objects);
  auto bulk = BulkServer::listen(io, HostPort{agent->options_.ip, 0}, agent->options_.token, "object server",
                                 [&objects = agent->objects_, &timer = io.provider->getTimer()](
                                     kj::Own<kj::AsyncIoStream> stream) {
                                   return objects.serve(kj::mv(stream), timer);
                                 });
  if (!bulk.isOk()) throwStatus(bulk.status());
  agent->bulk_ = kj::mv(*bulk);

  auto& a = *agent;
  // Store first, then registration: a node that cannot reach the store never shows as ALIVE.
  return RpcClient::connect(io, a.options_.controller, a.options_.token, 10 * kj::SECONDS)
      .then([&a](kj::Own<RpcClient> client) {
        a.controller_ = kj::mv(client);
        auto request = a.controller_->bootstrap<rpc::Controller>().storeEndpointRequest();
        request.setHead(a.options_.isHead);
        return request.send();
      })
      .then([&a](capnp::Response<rpc::Controller::StoreEndpointResults> response) {
        auto endpoint = response.getRedis();
        auto hp = parseHostPort(endpoint.getAddress().cStr());
        if (!hp.isOk()) throwStatus(hp.status());
        RedisOptions redis;
        redis.host = hp->host;
        redis.port = hp->port;
        redis.cluster = endpoint.getCluster().cStr();
        if (endpoint.getGateway()) {
          redis.gatewayToken = a.options_.token;
        } else if (a.options_.redisPassword.empty()) {
          throwStatus(Status(StatusCode::kFailedPrecondition,
                             "the controller handed this node Redis itself, which only the head's agent reaches (its "
                             "run directory's cluster.json holds the password); pass --head only on the head"));
        } else {
          redis.password = a.options_.redisPassword;
        }
        a.workerRedisAddress_ = endpoint.getAddress().cStr();
        a.workerRedisPassword_ = redis.password;
        a.workerRedisGateway_ = endpoint.getGateway();
        a.workerCluster_ = redis.cluster;
        a.state_->ttl = std::chrono::milliseconds(endpoint.getHeartbeatTtlMs());
        // Connections end on a silent peer within the cluster's TTL: this agent's from now on,
        // and its workers' (TROUPE_HEARTBEAT_TTL_MS in their environment).
        setPeerSilenceLimit(a.state_->ttl);
        // The store is created on the I/O thread, which owns it from then on.
        auto state = a.state_;
        return a.ioThread_.call([state, redis]() {
          TROUPE_ASSIGN_OR_RETURN(auto store, connectRedisStore(redis));
          state->store = std::move(store);
          return Status::ok();
        });
      })
      .then([&a](Status connected) {
        if (!connected.isOk()) throwStatus(connected);
        NodeRecord self;
        self.id = a.options_.id;
        self.address = HostPort{a.options_.ip, a.server_->port()}.toString();
        self.hostname = hostName();
        self.pid = getpid();
        self.isHead = a.options_.isHead;
        self.total = a.options_.resources;
        for (const auto& [name, qty] : self.total) self.used[name] = 0;
        self.labels = a.options_.labels;
        auto request = a.controller_->bootstrap<rpc::Controller>().registerNodeRequest();
        toNodeInfo(self, request.initNode());
        return request.send().ignoreResult();
      })
      .then([&a]() {
        // The first beat goes at once: `troupe start` reports a node only once it has beaten.
        auto state = a.state_;
        return a.ioThread_.call([state]() {
          TROUPE_ASSIGN_OR_RETURN(auto alive, state->store->heartbeat(state->id, state->ttl));
          if (!alive) {
            return Status(StatusCode::kAborted, "the cluster declared this node dead right after it registered");
          }
          scheduleHeartbeat(state);
          return Status::ok();
        });
      })
      .then([agent = kj::mv(agent)](Status status) mutable {
        if (!status.isOk()) throwStatus(status);
        agent->startLogPump();
        agent->tasks_->add(agent->sweepHolds());
        TROUPE_LOG(kInfo, "node {} registered; serving on {}:{}", agent->options_.id.hex(), agent->options_.ip,
                   agent->server_->port());
        return kj::mv(agent);
      });
}

kj::Promise<void> NodeAgent::shutdown(std::string reason) {
  auto state = state_;
  return ioThread_.call([state, reason]() {
           state->stopping = true;
           state->timer.cancel();
           return state->store ? state->store->markNodeDead(state->id, reason) : Status::ok();
         })
      .then([](Status status) {
        if (!status.isOk()) TROUPE_LOG(kWarning, "could not record the node's stop: {}", status.toString());
      });
}

kj::Promise<int64_t> NodeAgent::spawnWorker(const ActorRecord& actor, std::string_view initArgs) {
  auto it = workers_.find(actor.id);
  if (it != workers_.end() && it->second.incarnation >= actor.incarnation) {  // a retry
    KJ_IF_MAYBE(forking, it->second.forking) return forking->addBranch();
    return static_cast<int64_t>(it->second.pid);
  }
  std::string base = fmt::format("{}/logs/actor-{}", options_.runDir, actor.id.hex());
  std::string argsFile = fmt::format("{}.{}.args", base, actor.incarnation);
  {
    // The name is this agent's alone, but the actor's earlier incarnation could have put a FIFO
    // or a link there: whatever is there goes, and the file is made anew.
    ::unlink(argsFile.c_str());
    auto out = openRegularFile(argsFile, O_WRONLY | O_CREAT | O_EXCL);
    if (!out.isOk()) throwStatus(out.status());
    for (size_t done = 0; done < initArgs.size();) {
      ssize_t wrote = ::write(out->get(), initArgs.data() + done, initArgs.size() - done);
      if (wrote < 0 && errno == EINTR) continue;
      if (wrote <= 0) {
        throwStatus(Status(StatusCode::kResourceExhausted, fmt::format("cannot write {}: {}", argsFile, std::strerror(errno))));
      }
      done += static_cast<size_t>(wrote);
    }
  }
  SpawnOptions spawn;
  // Python actors ("py:<Class>") run in a Python worker hosting the same runtime.
  bool python = actor.type.rfind("py:", 0) == 0;
  if (python) {
    spawn.argv = {options_.pythonBinary, "-m", "troupe._worker"};
    if (!options_.pythonPath.empty()) spawn.env.push_back("PYTHONPATH=" + options_.pythonPath);
  } else {
    bool light = options_.workerTypes.count(actor.type) || options_.torchWorkerBinary.empty();
    spawn.argv = {light ? options_.workerBinary : options_.torchWorkerBinary};
  }
  const std::vector<std::string> args = {"--actor-id", actor.id.hex(), "--type", actor.type, "--incarnation",
                                         std::to_string(actor.incarnation), "--controller",
                                         options_.controller.toString(), "--node-ip-address", options_.ip,
                                         "--args-file", argsFile, "--parent-pid", std::to_string(getpid())};
  spawn.argv.insert(spawn.argv.end(), args.begin(), args.end());
  const bool tensors = python || spawn.argv[0] == options_.torchWorkerBinary;
  const std::optional<std::string> hugePages = hugePageMalloc();
  if (tensors && hugePages) spawn.env.push_back(*hugePages);
  spawn.outputPath = base + ".out";
  spawn.errorPath = base + ".err";
  // An earlier incarnation could have put a FIFO or a link at its log's path, which the new
  // worker refuses to open: the name is this agent's, so what is not a file of ours there goes.
  for (const auto& log : {spawn.outputPath, spawn.errorPath}) {
    struct stat st {};
    if (::lstat(log.c_str(), &st) == 0 && (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid())) {
      TROUPE_LOG(kWarning, "actor {}: removing {}, which is not a regular file of this user", actor.id.hex(), log);
      ::unlink(log.c_str());
    }
  }
  // The worker writes into pipes the log pump drains within the caps; without the pump (not yet
  // registered) or a pipe, it appends to the files itself.
  auto logEnds = std::make_shared<std::pair<FileDescriptor, FileDescriptor>>();
  if (logPump_) {
    auto out = logPump_->open(spawn.outputPath);
    auto err = out.isOk() ? logPump_->open(spawn.errorPath) : Result<FileDescriptor>(out.status());
    if (out.isOk() && err.isOk()) {
      *logEnds = {std::move(*out), std::move(*err)};
      spawn.outputFd = logEnds->first.get();
      spawn.errorFd = logEnds->second.get();
    } else {
      TROUPE_LOG(kWarning, "actor {}: its output goes to its log files uncapped: {}", actor.id.hex(),
                 (out.isOk() ? err : out).status().toString());
    }
  }
  spawn.env.push_back("TROUPE_TOKEN=" + options_.token);
  spawn.env.push_back("TROUPE_REDIS_ADDRESS=" + workerRedisAddress_);
  spawn.env.push_back("TROUPE_REDIS_PASSWORD=" + workerRedisPassword_);
  if (workerRedisGateway_) spawn.env.push_back("TROUPE_REDIS_GATEWAY=1");
  spawn.env.push_back("TROUPE_NODE_IP=" + options_.ip);
  if (tls::required()) spawn.env.push_back("TROUPE_TLS=1");
  spawn.env.push_back("TROUPE_CLUSTER=" + workerCluster_);
  spawn.env.push_back("TROUPE_NODE_ID=" + options_.id.hex());
  // Its put() objects go to this node's directory, which this agent serves to other nodes.
  spawn.env.push_back("TROUPE_OBJECT_DIR=" + objects_.directory());
  spawn.env.push_back("TROUPE_OBJECT_SPILL_DIR=" + objects_.spillDirectory());
  spawn.env.push_back(fmt::format("TROUPE_OBJECT_STORE_MEMORY={}", objects_.limit()));
  spawn.env.push_back(fmt::format("TROUPE_HEARTBEAT_TTL_MS={}", state_->ttl.count()));
  // Checkpoint segments the worker makes are recorded here, for `troupe stop` to remove.
  std::string registry = options_.runDir + "/shm";
  std::string countersDir = options_.runDir + "/metrics";
  if (::mkdir(countersDir.c_str(), 0700) != 0 && errno != EEXIST) {
    throwStatus(Status(StatusCode::kResourceExhausted, fmt::format("cannot make {}: {}", countersDir, std::strerror(errno))));
  }
  if (::mkdir(registry.c_str(), 0700) == 0 || errno == EEXIST) spawn.env.push_back("TROUPE_SHM_REGISTRY=" + registry);
  spawn.env.push_back("PYTHONUNBUFFERED=1");  // actor output reaches its log file as it is printed
  spawn.env.push_back("TROUPE_JOBS_DIR=" + options_.runDir + "/jobs");  // a job's files (job.py), removed by stop
  // Temporary files of workers (a dataloader's token file, a user's tempfile) go with the run:
  // a killed worker cannot remove its own, and `troupe stop` removes this directory. A TMPDIR
  // the node was started with is kept.
  if (const char* tmp = std::getenv("TMPDIR"); tmp == nullptr || *tmp == '\0') {
    std::string workerTmp = options_.runDir + "/tmp";
    if (::mkdir(workerTmp.c_str(), 0700) == 0 || errno == EEXIST) spawn.env.push_back("TMPDIR=" + workerTmp);
  }
  std::string counters = metricsPath(actor.id, actor.incarnation);
  ::unlink(counters.c_str());  // left by an agent that died with its worker: the worker makes it anew
  spawn.env.push_back("TROUPE_METRICS_FILE=" + counters);
  if (python && options_.pythonZygote && !zygote_) {
    // Made for the first Python actor (a node that hosts none never starts it), when this agent
    // knows whether the cluster speaks TLS.
    ZygoteOptions zygote;
    zygote.python = options_.pythonBinary;
    // What a spawned Python worker has when its interpreter starts and imports troupe.
    if (!options_.pythonPath.empty()) zygote.env.push_back("PYTHONPATH=" + options_.pythonPath);
    zygote.env.push_back("PYTHONUNBUFFERED=1");
    if (hugePages) zygote.env.push_back(*hugePages);  // read by ld.so when the zygote starts
    if (tls::required()) zygote.env.push_back("TROUPE_TLS=1");  // troupe._core reads it when loaded
    zygote.logDir = options_.runDir + "/logs";
    zygote.logName = "python-zygote-" + options_.id.hex();
    zygote_ = kj::heap<PythonZygote>(io_, std::move(zygote));
  }
  if (!python || !zygote_ || !zygote_->accepting()) {
    auto pid = spawnDirect(actor.id, actor.incarnation, spawn);
    if (!pid.isOk()) throwStatus(pid.status());
    Worker& worker = workers_[actor.id] = Worker{};
    worker.incarnation = actor.incarnation;
    worker.pid = static_cast<pid_t>(*pid);
    worker.type = actor.type;
    return *pid;
  }
  ActorId id = actor.id;
  uint32_t incarnation = actor.incarnation;
  // The pipes' write ends live until the zygote has them or the fallback below has spawned.
  auto forked = zygote_->fork(args, spawn)
                    .then([this, id, incarnation, logEnds](ForkedWorker worker) {
                      *logEnds = {};
                      return adoptForked(id, incarnation, kj::mv(worker));
                    },
                    [this, id, incarnation, spawn, logEnds](kj::Exception&& e) -> int64_t {
                      KJ_DEFER(*logEnds = {});
                      // The zygote failed (it says so once, and restarts): a new process instead.
                      TROUPE_LOG(kDebug, "actor {}: {}; spawning its worker", id.hex(), e.getDescription().cStr());
                      auto it = workers_.find(id);
                      if (it == workers_.end() || it->second.incarnation != incarnation || it->second.killed) {
                        // Killed (or replaced) meanwhile: nothing to start; its end is a kill.
                        if (it != workers_.end() && it->second.incarnation == incarnation) it->second.pid = 0;
                        tasks_->add(reportExit(id, incarnation, SIGKILL, 0));
                        return 0;
                      }
                      auto pid = spawnDirect(id, incarnation, spawn);
                      it->second.pid = pid.isOk() ? static_cast<pid_t>(*pid) : 0;
                      if (!pid.isOk()) throwStatus(pid.status());
                      return *pid;
                    })
                    .fork();
  auto result = forked.addBranch();
  Worker& worker = workers_[actor.id] = Worker{};
  worker.incarnation = actor.incarnation;
  worker.pid = -1;
  worker.type = actor.type;
  worker.forking = kj::mv(forked);
  return result;
}

Result<int64_t> NodeAgent::spawnDirect(const ActorId& id, uint32_t incarnation, const SpawnOptions& spawn) {
  TROUPE_ASSIGN_OR_RETURN(auto pid, spawnProcess(spawn));
  TROUPE_LOG(kInfo, "started worker {} for actor {} incarnation {}", pid, id.hex(), incarnation);
  tasks_->add(watchWorker(id, incarnation, pid));
  return static_cast<int64_t>(pid);
}

int64_t NodeAgent::adoptForked(const ActorId& id, uint32_t incarnation, ForkedWorker forked) {
  pid_t pid = forked.pid();
  // Watched before it may run: its exit status reaches this process like a spawned worker's.
  tasks_->add(watchWorker(id, incarnation, pid));
  auto it = workers_.find(id);
  if (it == workers_.end() || it->second.incarnation != incarnation || it->second.killed) {
    // Killed while it was forked (or a newer incarnation replaced it): it never runs, and its end
    // is reported as a kill.
    ::kill(pid, SIGKILL);
    if (it != workers_.end() && it->second.incarnation == incarnation) it->second.pid = pid;
    return pid;
  }
  it->second.pid = pid;
  if (!forked.start()) {
    TROUPE_LOG(kWarning, "worker {} for actor {} ended before it started", pid, id.hex());
  } else {
    TROUPE_LOG(kInfo, "started worker {} for actor {} incarnation {} (forked by the Python zygote)", pid, id.hex(),
               incarnation);
  }
  return pid;
}

void NodeAgent::killWorker(const ActorId& id, uint32_t incarnation) {
  auto it = workers_.find(id);
  if (it == workers_.end() || it->second.incarnation != incarnation) return;
  if (it->second.pid > 0) ::kill(it->second.pid, SIGKILL);
  if (it->second.pid < 0) it->second.killed = true;  // killed as soon as it has a pid
}

std::pair<std::string, int64_t> NodeAgent::readLog(const ActorId& id, const char* stream, int64_t from,
                                                   size_t maxBytes) const {
  std::string path = fmt::format("{}/logs/actor-{}.{}", options_.runDir, id.hex(), stream);
  if (from < 0) {
    // Just after a rotation the current file is short: the tail continues in the rotated one.
    std::string tail = fileTail(path, maxBytes);
    if (tail.size() < maxBytes) tail = fileTail(path + ".1", maxBytes - tail.size()) + tail;
    return {tail, -1};
  }
  auto [fd, size] = openLog(path);
  if (fd.get() < 0) return {"", from};
  if (from >= size) return {"", size};
  // Whole lines only, so a follower never splits one (unless a line exceeds maxBytes).
  std::string out = readAt(fd, from, static_cast<size_t>(std::min<int64_t>(size - from, static_cast<int64_t>(maxBytes))));
  auto nl = out.rfind('\n');
  if (nl != std::string::npos) out.resize(nl + 1);
  return {out, from + static_cast<int64_t>(out.size())};
}

std::string NodeAgent::metricsPath(const ActorId& id, uint32_t incarnation) const {
  return fmt::format("{}/metrics/actor-{}.{}", options_.runDir, id.hex(), incarnation);
}

std::vector<metrics::Sample> NodeAgent::metrics() const {
  std::vector<metrics::Sample> out;
  const std::string node = options_.id.hex();
  auto store = objects_.usage();
  out.push_back({"troupe_object_store_objects", fmt::format("node=\"{}\"", node), static_cast<double>(store.objects)});
  out.push_back({"troupe_object_store_bytes", fmt::format("node=\"{}\"", node), static_cast<double>(store.bytes)});
  out.push_back({"troupe_object_store_limit_bytes", fmt::format("node=\"{}\"", node), static_cast<double>(objects_.limit())});
  out.push_back({"troupe_object_store_spilled_objects", fmt::format("node=\"{}\"", node),
                 static_cast<double>(store.spilledObjects)});
  out.push_back({"troupe_object_store_spilled_bytes", fmt::format("node=\"{}\"", node),
                 static_cast<double>(store.spilledBytes)});
  for (const auto& [id, worker] : workers_) {
    if (worker.pid <= 0) continue;
    auto samples = metrics::read(metricsPath(id, worker.incarnation));
    if (!samples.isOk()) continue;  // not made yet (the worker is starting), or not ours
    std::string labels = fmt::format("node=\"{}\",actor=\"{}\",class=\"{}\"", node, id.hex(),
                                     metrics::escapeLabel(worker.type));
    for (auto& s : *samples) {
      s.labels = s.labels.empty() ? labels : labels + "," + s.labels;
      out.push_back(std::move(s));
    }
  }
  return out;
}

kj::Promise<void> NodeAgent::watchWorker(ActorId id, uint32_t incarnation, pid_t pid) {
  auto watched = kj::heap<kj::Maybe<pid_t>>(pid);
  auto& ref = *watched;
  return io_.unixEventPort.onChildExit(ref).attach(kj::mv(watched)).then([this, id, incarnation](int status) {
    auto it = workers_.find(id);
    if (it != workers_.end() && it->second.incarnation == incarnation) it->second.pid = 0;
    ::unlink(metricsPath(id, incarnation).c_str());
    if (logPump_) {
      std::string base = fmt::format("{}/logs/actor-{}", options_.runDir, id.hex());
      logPump_->drain(base + ".out");
      logPump_->drain(base + ".err");  // its last words, read into the exit report below
    }
    return reportExit(id, incarnation, status, 0);
  });
}

kj::Promise<rpc::Controller::Client> NodeAgent::controller() {
  // A restarted controller is a new connection: the old one is never asked again.
  if (controller_ && !controller_->disconnected()) return controller_->bootstrap<rpc::Controller>();
  return RpcClient::connect(io_, options_.controller, options_.token, 5 * kj::SECONDS)
      .then([this](kj::Own<RpcClient> client) {
        controller_ = kj::mv(client);
        return controller_->bootstrap<rpc::Controller>();
      });
}

kj::Promise<void> NodeAgent::reportExit(ActorId id, uint32_t incarnation, int status, int attempt) {
  return controller()
      .then([this, id, incarnation, status](rpc::Controller::Client controller) {
        auto request = controller.workerExitedRequest();
        request.setId(id.hex());
        request.setIncarnation(incarnation);
        auto exit = request.initExit();
        exit.setExitCode(WIFEXITED(status) ? WEXITSTATUS(status) : -1);
        exit.setSignal(WIFSIGNALED(status) ? WTERMSIG(status) : 0);
        exit.setStderrTail(lastLines(fileTail(fmt::format("{}/logs/actor-{}.err", options_.runDir, id.hex()), 4096), 3));
        return request.send().ignoreResult();
      })
      .catch_([this, id, incarnation, status, attempt](kj::Exception&& e) -> kj::Promise<void> {
        // The controller may be restarting: the report must not be lost, so retry (on a new
        // connection once this one is known to be gone).
        if (attempt >= 60) {
          TROUPE_LOG(kError, "giving up reporting the exit of actor {}: {}", id.hex(), e.getDescription().cStr());
          return kj::READY_NOW;
        }
        return io_.provider->getTimer().afterDelay(std::min(attempt + 1, 10) * 100 * kj::MILLISECONDS).then(
            [this, id, incarnation, status, attempt]() { return reportExit(id, incarnation, status, attempt + 1); });
      });
}

namespace {
uint64_t byteLimit(const char* name, uint64_t fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  unsigned long long v = std::strtoull(text, &end, 10);
  return end && *end == '\0' && v > 0 ? v : fallback;
}

}  // namespace

kj::Promise<void> NodeAgent::sweepHolds() {
  constexpr kj::Duration kEvery = 1 * kj::SECONDS;
  auto& timer = io_.provider->getTimer();
  return timer.afterDelay(kEvery).then([this, &timer]() -> kj::Promise<void> {
    auto remote = objects_.remoteHolders();
    if (remote.empty()) {
      objects_.sweep({});
      return kj::READY_NOW;
    }
    auto state = state_;
    return ioThread_.call([state]() { return state->store->listNodes(); })
        .then([this, &timer, remote = kj::mv(remote)](Result<std::vector<NodeRecord>> nodes) -> kj::Promise<void> {
          if (!nodes.isOk()) return kj::READY_NOW;  // nothing known of the others: next time
          auto liveness = kj::heap<NodeObjects::RemoteLiveness>();
          kj::Vector<kj::Promise<void>> asks;
          for (const auto& [node, pids] : remote) {
            auto record = std::find_if(nodes->begin(), nodes->end(), [&](const NodeRecord& n) { return n.id.hex() == node; });
            auto hp = record == nodes->end() ? Result<HostPort>(Status(StatusCode::kNotFound, "")) : parseHostPort(record->address);
            if (record == nodes->end() || record->state == NodeState::kDead || !hp.isOk()) {
              liveness->dead.insert(node);
              continue;
            }
            auto ask = RpcClient::connect(io_, *hp, options_.token, kEvery)
                           .then([pids = pids](kj::Own<RpcClient> client) {
                             auto request = client->bootstrap<rpc::NodeAgent>().processesAliveRequest();
                             auto list = request.initPids(pids.size());
                             size_t i = 0;
                             for (int pid : pids) list.set(i++, pid);
                             return request.send().attach(kj::mv(client));
                           })
                           .then([&known = liveness->alive, node = node](
                                     capnp::Response<rpc::NodeAgent::ProcessesAliveResults> r) {
                             auto& alive = known[node];  // made even when none is alive
                             for (int32_t pid : r.getAlive()) alive.insert(pid);
                           });
            asks.add(timer.timeoutAfter(2 * kEvery, kj::mv(ask)).catch_([](kj::Exception&&) {}));  // unknown: kept
          }
          return kj::joinPromises(asks.releaseAsArray()).then([this, liveness = kj::mv(liveness)]() {
            objects_.sweep(*liveness);
          });
        });
  }).then([this]() { return sweepHolds(); });
}

void NodeAgent::startLogPump() {
  logPump_ = std::make_unique<LogPump>(LogPumpOptions{options_.runDir + "/logs",
                                                      byteLimit("TROUPE_LOG_MAX_BYTES", 256ull << 20),
                                                      byteLimit("TROUPE_LOG_RUN_MAX_BYTES", 4ull << 30)});
}

NodeAgent::~NodeAgent() {
  auto state = state_;
  asio::post(ioThread_.context(), [state]() {
    state->stopping = true;
    state->timer.cancel();
  });
}

}  // namespace troupe
