// troupe._core: the C++ runtime inside Python.
//
// Driver side (`Runtime`): one KJ event loop on a background thread and a ClusterClient serve the
// whole driver. Python threads queue calls to it (an eventfd wakes it) and wait on a condition
// variable for their completions; other work reaches the loop through its kj::Executor. Its
// actor connections spin for the peer's answer before sleeping (PeerWait::kSpinFirst), as
// workers' do. Actor calls return integer refs at once; calls made together are batched.
//
// Worker side (`serve_actor`): a Python worker process runs the KJ loop on its main thread and
// serves one Python actor with the C++ workers' actor server (troupe/runtime/actor_server.h),
// taking the GIL only to run the actor's method or hand calls to Python.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <fmt/format.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>
#include <typeinfo>

#include <kj/async-unix.h>
#include <kj/vector.h>

#include "troupe.capnp.h"
#include "troupe/actors/init_args.h"
#include "troupe/runtime/actor_server.h"
#include "troupe/runtime/client.h"
#include "troupe/runtime/config.h"
#include "troupe/runtime/logging.h"
#include "troupe/runtime/metrics.h"
#include "troupe/runtime/names.h"
#include "troupe/runtime/rpc.h"
#include "troupe/runtime/tls.h"
#include "python_errors.h"

namespace py = pybind11;
using troupe::python::InvalidArgument;
using troupe::python::WrongType;

namespace troupe {
namespace {

// How a call ended, as Python sees it.
enum class Outcome { kPending = 0, kOk = 1, kError = 2, kDied = 3 };

struct Completion {
  Outcome outcome = Outcome::kPending;
  std::string data;  // the reply, or the error message
  std::string code;  // a failure's StatusCode name ("INVALID_ARGUMENT"), for Python's exception type
};

py::dict toDict(const ActorRecord& r) {
  py::dict d;
  d["id"] = r.id.hex();
  d["type"] = r.type;
  d["name"] = r.name;
  d["state"] = actorStateName(r.state);
  d["node_id"] = r.nodeId.hex();
  d["pid"] = r.pid;
  d["incarnation"] = r.incarnation;
  d["restarts"] = r.restarts;
  d["death_reason"] = r.deathReason;
  return d;
}

py::dict toDict(const NodeRecord& n) {
  py::dict d;
  d["id"] = n.id.hex();
  d["address"] = n.address;
  d["state"] = nodeStateName(n.state);
  d["pid"] = n.pid;
  d["is_head"] = n.isHead;
  d["resources"] = std::map<std::string, double>(n.total.begin(), n.total.end());
  d["used"] = std::map<std::string, double>(n.used.begin(), n.used.end());
  d["death_reason"] = n.deathReason;
  return d;
}

py::dict toDict(const PlacementGroupRecord& g) {
  py::dict d;
  d["id"] = g.id.hex();
  d["state"] = placementGroupStateName(g.state);
  d["pending_reason"] = g.pendingReason;
  py::list nodes;
  for (const auto& b : g.bundles) nodes.append(b.nodeId.hex());
  d["bundle_nodes"] = nodes;
  return d;
}

class ErrorLog final : public kj::TaskSet::ErrorHandler {
 public:
  void taskFailed(kj::Exception&& e) override { TROUPE_LOG(kDebug, "runtime task: {}", e.getDescription().cStr()); }
};

// A call's failure by its status code (which crossed the RPC edge), not by its text.
Outcome classify(const kj::Exception& e) {
  return statusFromException(e, "").code() == StatusCode::kActorDied ? Outcome::kDied : Outcome::kError;
}

std::string describe(const kj::Exception& e) { return statusFromException(e, "").message(); }

std::string codeOf(const kj::Exception& e) { return statusCodeName(statusFromException(e, "").code()); }

// Thrown on the Python thread with a runtime Status; the translator registered in the module
// raises troupe.exceptions' class for its code (ActorDiedError, NotFoundError, ...).
struct StatusError {
  Status status;
};

// The bytes a `type` actor is created with. A built-in type whose init args have a schema
// (troupe/actors/init_args.h) takes JSON text or a mapping, encoded here to its message, so a bad
// field raises InvalidArgumentError in the driver instead of stopping a worker; any other type's
// bytes (a Python actor's pickle) pass unchanged. Called with the GIL held.
std::string initArgsFor(const std::string& type, const py::object& given) {
  const bool typed = actors::initArgsSchema(type) != nullptr;
  std::string text;
  if (py::isinstance<py::bytes>(given) || py::isinstance<py::str>(given)) {
    text = given.cast<std::string>();
  } else if (typed && py::isinstance(given, py::module_::import("collections.abc").attr("Mapping"))) {
    text = py::module_::import("json").attr("dumps")(py::dict(given)).cast<std::string>();
  } else {
    throw WrongType(fmt::format("init_args of a {} actor must be bytes or str{}, not {}", type,
                                typed ? " (JSON) or a dict" : "", py::str(py::type::of(given).attr("__name__")).cast<std::string>()));
  }
  if (!typed) return text;
  auto encoded = actors::encodeInitArgs(type, text);
  if (!encoded.isOk()) throw InvalidArgument(encoded.status().message());
  return std::move(encoded).value();
}

// A driver's connection to a cluster. Thread-safety: every public method may be called from
// any Python thread (they release the GIL while they wait); KJ objects belong to the background
// thread, which runs the loop.
class Runtime {
 public:
  Runtime(const std::string& address, const std::string& token) : token_(token) {
    auto hp = parseHostPort(address);
    if (!hp.isOk()) throw InvalidArgument(hp.status().message());
    std::mutex m;
    std::condition_variable cv;
    bool started = false;
    Status error;
    background_ = std::thread([&, hp = *hp]() {
      auto io = kj::setupAsyncIo();
      ErrorLog errors;
      auto tasks = kj::heap<kj::TaskSet>(errors);
      auto woken = kj::heap<kj::UnixEventPort::FdObserver>(io.unixEventPort, wakeFd_, kj::UnixEventPort::FdObserver::OBSERVE_READ);
      {
        std::lock_guard lock(m);
        executor_ = kj::getCurrentThreadExecutor().addRef();
        io_ = &io;
        tasks_ = tasks.get();
      }
      KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
        client_ = ClusterClient::connect(io, hp, token, PeerWait::kSpinFirst).wait(io.waitScope);
      })) {
        error = statusFromException(*e, "");
      }
      bool failed = !error.isOk();  // `error` belongs to the constructor's frame: read it now
      {
        std::lock_guard lock(m);
        started = true;
      }
      cv.notify_all();
      if (!failed) {
        // The controller declared a node DEAD: the agent connections to it break now, so a read
        // in flight (the output follower's, at shutdown) ends instead of waiting on a cut host.
        client_->onNodeDeath([this](const NodeId& node, const Status& why) { agentNodeDied(node, why); });
        tasks->add(followOutput());
        tasks->add(drainSubmitted(*woken));
        // Runs the loop until close() pokes stopFd_ (nothing else writes it).
        kj::UnixEventPort::FdObserver stop(io.unixEventPort, stopFd_, kj::UnixEventPort::FdObserver::OBSERVE_READ);
        stop.whenBecomesReadable().wait(io.waitScope);
      }
      // Cancel what is in flight first, while the connections it uses still exist; then drop
      // the connections. Clean-up queued by these destructors runs in the polls: an EventLoop
      // must die with an empty queue (KJ aborts otherwise).
      tasks_ = nullptr;
      tasks = nullptr;
      lastRound_ = kj::READY_NOW;
      io.waitScope.poll();
      handles_.clear();
      client_ = nullptr;
      nodeAgents_.clear();
      for (int i = 0; i < 3; ++i) io.waitScope.poll();
      woken = nullptr;
    });
    std::unique_lock lock(m);
    {
      py::gil_scoped_release release;
      cv.wait(lock, [&]() { return started; });
    }
    if (!error.isOk()) {
      lock.unlock();
      close();
      throw StatusError{error};  // its class by code; the Python layer keeps ConnectionError for the rest
    }
  }

  ~Runtime() {
    close();
    ::close(wakeFd_);
    ::close(stopFd_);
  }

  void close() {
    {
      std::lock_guard lock(mutex_);
      closing_ = true;
    }
    cv_.notify_all();
    if (!background_.joinable()) return;
    py::gil_scoped_release release;
    poke(stopFd_);
    background_.join();
  }

  std::string createActor(const std::string& type, const std::string& name, const std::map<std::string, double>& resources,
                          int maxRestarts, int maxTaskRetries, bool detached, const py::object& initArgs,
                          const std::string& placementGroup, int bundleIndex) {
    ActorOptions o;
    o.initArgs = initArgsFor(type, initArgs);
    o.type = type;
    o.name = name;
    o.resources = Resources(resources.begin(), resources.end());
    o.maxRestarts = maxRestarts;
    o.maxTaskRetries = maxTaskRetries;
    o.detached = detached;
    o.placementGroup = PlacementGroupId(placementGroup);
    o.bundleIndex = bundleIndex;
    return onLoop([this, o]() {
      return client_->submitActor(o).then([this, type = o.type](ActorHandle h) {
        handles_.emplace(h.id().hex(), h);
        followed_[h.id().hex()] = Cursor{type};
        relist_ = true;  // its first output should not wait for the next listing
        return h.id().hex();
      });
    });
  }

  // (id, type) of the live actor with this name.
  std::pair<std::string, std::string> getActor(const std::string& name) {
    return onLoop([this, name]() {
      return client_->getActor(name).then([this](ActorHandle h) {
        handles_.emplace(h.id().hex(), h);
        return client_->actorInfo(h.id());
      }).then([](ActorRecord r) { return std::make_pair(r.id.hex(), r.type); });
    });
  }

  py::dict actorInfo(const std::string& id) {
    return toDict(onLoop([this, id]() { return client_->actorInfo(ActorId(id)); }));
  }

  void waitReady(const std::string& id) {
    onLoop([this, id]() { return handle(id).ready().ignoreResult(); });
  }

  void kill(const std::string& id, bool noRestart) {
    onLoop([this, id, noRestart]() { return client_->kill(handle(id), noRestart); });
  }

  // Starts a call and returns its ref at once. The call joins a queue that the loop drains in
  // order; only the first call into an empty queue pokes the loop, and the client sends a burst
  // as one batch.
  // max_task_retries: this call's (a method's @troupe.method), else the actor's (-2).
  int64_t submit(const std::string& id, const std::string& method, const py::bytes& payload,
                 int32_t maxTaskRetries) {
    std::string bytes = payload;
    py::gil_scoped_release release;
    std::unique_lock lock(mutex_);
    int64_t ref = nextRef_++;
    completions_[ref];
    submitted_.push_back(Submitted{ref, id, method, std::move(bytes), maxTaskRetries});
    if (submitted_.size() == 1) poke(wakeFd_);
    return ref;
  }

  struct Submitted {
    int64_t ref;
    std::string actor;
    std::string method;
    std::string payload;
    int32_t maxTaskRetries = ActorHandle::kActorsRetries;
  };

  // Starts one call (loop thread).
  void start(Submitted s) {
    int64_t ref = s.ref;
    tasks_->add(handle(s.actor).call(kj::mv(s.method), kj::mv(s.payload), s.maxTaskRetries).then(
        [this, ref](std::string reply) { complete(ref, Outcome::kOk, kj::mv(reply)); },
        [this, ref](kj::Exception&& e) {
          complete(ref, classify(e), describe(e), codeOf(e));
        }));
  }

  // The loop thread's side of submit(): waits to be woken, starts every queued call in order.
  kj::Promise<void> drainSubmitted(kj::UnixEventPort::FdObserver& woken) {
    uint64_t count = 0;
    ssize_t n = ::read(wakeFd_, &count, sizeof(count));
    (void)n;
    std::vector<Submitted> batch;
    {
      std::lock_guard lock(mutex_);
      batch.swap(submitted_);
    }
    for (auto& s : batch) start(kj::mv(s));
    return woken.whenBecomesReadable().then([this, &woken]() { return drainSubmitted(woken); });
  }

  // Waits until at least `numReturns` of `refs` are done or `timeout` (seconds, < 0: forever)
  // passes; returns the done ones in the given order.
  std::vector<int64_t> wait(const std::vector<int64_t>& refs, size_t numReturns, double timeout) {
    py::gil_scoped_release release;
    std::unique_lock lock(mutex_);
    size_t need = std::min(numReturns, refs.size());
    auto deadline = std::chrono::steady_clock::now() +
                    std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(
                        timeout < 0 ? 1e9 : timeout));
    while (countDone(refs) < need && std::chrono::steady_clock::now() < deadline) {
      cv_.wait_until(lock, deadline);  // woken by complete()
    }
    std::vector<int64_t> done;
    for (int64_t r : refs) {
      auto it = completions_.find(r);
      if (it == completions_.end() || it->second.outcome != Outcome::kPending) done.push_back(r);
    }
    return done;
  }

  // (outcome, data, code) of a finished call, consuming it; (0, "", "") if it is still pending.
  // code: a failure's StatusCode name, "" for a reply.
  std::tuple<int, py::bytes, std::string> take(int64_t ref) {
    Completion c;
    {
      std::lock_guard lock(mutex_);
      auto it = completions_.find(ref);
      if (it == completions_.end()) {
        return {static_cast<int>(Outcome::kError), py::bytes("unknown or already consumed ref"), "INTERNAL"};
      }
      if (it->second.outcome == Outcome::kPending) return {0, py::bytes(), ""};
      c = std::move(it->second);
      completions_.erase(it);
    }
    return {static_cast<int>(c.outcome), py::bytes(c.data), c.code};
  }

  py::list nodes() {
    auto nodes = onLoop([this]() { return client_->listNodes(); });
    py::list out;
    for (const auto& n : nodes) out.append(toDict(n));
    return out;
  }

  // One object pull in progress (pullObject).
  struct Pull {
    Pull(rpc::NodeAgent::Client agent, std::string name, std::string path)
        : agent(kj::mv(agent)), name(std::move(name)), path(std::move(path)) {}
    ~Pull() {
      if (fd >= 0) ::close(fd);
      if (readyFd >= 0) ::close(readyFd);
    }
    // Says how many bytes have arrived in order, for an agent relaying this copy meanwhile.
    void arrived(uint64_t bytes) const {
      if (readyFd >= 0) (void)!::pwrite(readyFd, &bytes, sizeof bytes, 0);
    }
    rpc::NodeAgent::Client agent;
    std::string name, path;
    std::string offer;      // where this copy can be read by other pullers ("" for nowhere)
    std::string relay;      // another puller's copy to read the rest from ("" for the agent)
    int readyFd = -1;       // <path>.ready while the copy arrives (with an offer)
    std::string host;       // the agent's, for its bulk port
    uint16_t bulkPort = 0;  // 0: the agent streams nothing, chunks only
    int fd = -1;
    uint64_t size = 0, next = 0;  // the object's size; the first byte no lane has asked for yet
  };

  // One chunk at `offset`, written where it belongs; checks that the object is the size it was.
  kj::Promise<void> pullChunk(std::shared_ptr<Pull> pull, uint64_t offset) {
    auto request = pull->agent.readObjectRequest();
    request.setName(pull->name);
    request.setOffset(offset);
    request.setLength(kPullChunk);
    if (offset == 0) request.setOffer(pull->offer);
    return io_->provider->getTimer().timeoutAfter(kPullChunkDeadline, request.send())
        .then([pull, offset](capnp::Response<rpc::NodeAgent::ReadObjectResults> r) {
          auto data = r.getData();
          if (offset == 0) {
            pull->size = r.getSize();
            pull->bulkPort = r.getBulkPort();
            pull->relay = r.getRelay().cStr();
            if (::ftruncate(pull->fd, static_cast<off_t>(pull->size)) != 0) {
              throwStatus(Status(StatusCode::kResourceExhausted,
                                 fmt::format("cannot size {} for a pulled object: {}", pull->path, std::strerror(errno))));
            }
          }
          uint64_t want = std::min<uint64_t>(kPullChunk, pull->size - offset);
          if (r.getSize() != pull->size || data.size() != want) {
            throwStatus(Status(StatusCode::kInternal, fmt::format("object {} changed while it was pulled", pull->name)));
          }
          for (size_t done = 0; done < data.size();) {
            ssize_t wrote = ::pwrite(pull->fd, data.begin() + done, data.size() - done, static_cast<off_t>(offset + done));
            if (wrote < 0 && errno == EINTR) continue;
            if (wrote <= 0) {
              throwStatus(Status(StatusCode::kResourceExhausted,
                                 fmt::format("cannot write a pulled object to {}: {}", pull->path,
                                             wrote < 0 ? std::strerror(errno) : "no space left")));
            }
            done += static_cast<size_t>(wrote);
          }
        });
  }

  kj::Promise<void> pullLanes(std::shared_ptr<Pull> pull) {
    kj::Vector<kj::Promise<void>> lanes;
    for (int i = 0; i < kPullLanes; ++i) lanes.add(pullLane(pull));
    return kj::joinPromises(lanes.releaseAsArray());
  }

  // The rest of the object (after its first chunk) in one request on the agent's bulk port
  // (services/node_objects.h has the framing), read straight into a mapping of the file: no copy
  // but the kernel's.
  // `name`: the object's, or the copy's a relay serves.
  kj::Promise<void> pullStream(std::shared_ptr<Pull> pull, kj::Own<kj::AsyncIoStream> stream, const std::string& name) {
    const uint64_t offset = kPullChunk, length = pull->size - kPullChunk;
    const uint32_t nameLength = static_cast<uint32_t>(name.size());
    auto request = kj::heapArray<kj::byte>(4 + nameLength + 16);
    memcpy(request.begin(), &nameLength, 4);
    memcpy(request.begin() + 4, name.data(), nameLength);
    memcpy(request.begin() + 4 + nameLength, &offset, 8);
    memcpy(request.begin() + 12 + nameLength, &length, 8);
    auto& s = *stream;
    auto* req = request.begin();
    auto header = kj::heapArray<kj::byte>(13);
    auto* h = header.begin();
    return s.write(req, request.size())
        .attach(kj::mv(request))
        .then([&s, h]() { return s.read(h, 13); })
        .then([this, &s, pull, header = kj::mv(header)]() mutable -> kj::Promise<void> {
          auto code = static_cast<StatusCode>(header[0]);
          uint64_t size = 0;
          uint32_t messageLength = 0;
          memcpy(&size, header.begin() + 1, 8);
          memcpy(&messageLength, header.begin() + 9, 4);
          if (code != StatusCode::kOk) {
            if (messageLength > 4096) throwStatus(Status(StatusCode::kInternal, "a bulk answer's message is too long"));
            auto text = kj::heapArray<char>(messageLength);
            auto* t = text.begin();
            return s.read(t, text.size()).then([code, text = kj::mv(text)]() -> kj::Promise<void> {
              throwStatus(Status(code, std::string(text.begin(), text.size())));
            });
          }
          if (size != pull->size) {
            throwStatus(Status(StatusCode::kInternal, fmt::format("object {} changed while it was pulled", pull->name)));
          }
          void* at = ::mmap(nullptr, pull->size, PROT_WRITE, MAP_SHARED, pull->fd, 0);
          if (at == MAP_FAILED) {
            throwStatus(Status(StatusCode::kResourceExhausted,
                               fmt::format("cannot map {} for a pulled object: {}", pull->path, std::strerror(errno))));
          }
          // Fresh shared memory costs a page fault per 4 KiB where the socket's bytes land (a
          // third of a 1 GiB pull's time here); a thread allocates the pages ahead of them instead.
          // It is joined before the mapping goes.
          auto populate = kj::heap<std::thread>([at, size = pull->size]() { ::madvise(at, size, MADV_POPULATE_WRITE); });
          auto unmap = kj::defer([at, size = pull->size, populate = kj::mv(populate)]() mutable {
            populate->join();
            ::munmap(at, size);
          });
          return readInto(pull, s, static_cast<kj::byte*>(at), kPullChunk, pull->size).attach(kj::mv(unmap));
        })
        .attach(kj::mv(stream));
  }

  // Reads bytes [at, end) of the object into `base` + at, 16 MiB at a time, each within the
  // chunk deadline, saying how far it got after each.
  kj::Promise<void> readInto(std::shared_ptr<Pull> pull, kj::AsyncIoStream& s, kj::byte* base, uint64_t at,
                             uint64_t end) {
    if (at >= end) return kj::READY_NOW;
    size_t piece = static_cast<size_t>(std::min<uint64_t>(end - at, 16u << 20));
    return io_->provider->getTimer()
        .timeoutAfter(kPullChunkDeadline, s.read(base + at, piece))
        .then([this, pull, &s, base, at, end, piece]() {
          pull->arrived(at + piece);
          return readInto(pull, s, base, at + piece, end);
        });
  }

  // The rest of the object from the agent: its bulk port, else chunks.
  kj::Promise<void> pullDirect(std::shared_ptr<Pull> pull) {
    if (pull->bulkPort == 0 || pull->host.empty()) return pullLanes(pull);
    return connectBulk(*io_, HostPort{pull->host, pull->bulkPort}, token_, 3 * kj::SECONDS)
        .then([this, pull](kj::Own<kj::AsyncIoStream> stream) { return pullStream(pull, kj::mv(stream), pull->name); },
              [this, pull](kj::Exception&&) { return pullLanes(pull); });  // the chunks still work
  }

  // The rest of the object from the copy of another puller the agent named; from the agent
  // itself if that fails (then the agent forgets the copy).
  kj::Promise<void> pullRelayed(std::shared_ptr<Pull> pull) {
    std::string relay = pull->relay;
    size_t slash = relay.rfind('/');
    auto hp = parseHostPort(relay.substr(0, slash));
    if (slash == std::string::npos || !hp.isOk()) return pullDirect(pull);
    std::string copy = relay.substr(slash + 1);
    return connectBulk(*io_, *hp, token_, 3 * kj::SECONDS)
        .then([this, pull, copy](kj::Own<kj::AsyncIoStream> stream) { return pullStream(pull, kj::mv(stream), copy); })
        .catch_([this, pull](kj::Exception&& e) {
          TROUPE_LOG(kInfo, "object {}: the copy at {} failed ({}); pulling from its node", pull->name, pull->relay,
                     e.getDescription().cStr());
          auto drop = pull->agent.dropSourceRequest();
          drop.setName(pull->name);
          drop.setOffer(pull->relay);
          tasks_->add(drop.send().ignoreResult().catch_([](kj::Exception&&) {}));
          return pullDirect(pull);
        });
  }

  // A lane asks for the next chunk nobody has asked for, until none is left.
  kj::Promise<void> pullLane(std::shared_ptr<Pull> pull) {
    if (pull->next >= pull->size) return kj::READY_NOW;
    uint64_t offset = pull->next;
    pull->next += kPullChunk;
    return pullChunk(pull, offset).then([this, pull]() { return pullLane(pull); });
  }

  // Pulls object `name` from the node agent at `address` into a new file `path` (0600; nothing
  // may be there), or, with `reuse`, into the file already there (a freed one, whose pages are
  // allocated): chunks of kPullChunk, kPullLanes of them in flight, each written where it
  // belongs as it arrives. Returns the object's size. A failed pull leaves no file.
  // offer: where other pullers can read this copy ("<host>:<bulk port>/<copy name>"; "" for
  // nowhere): its progress goes to <path>.ready meanwhile, deleted once it is complete.
  uint64_t pullObject(const std::string& address, const std::string& name, const std::string& path, bool reuse,
                      const std::string& offer) {
    return onLoop([this, address, name, path, reuse, offer]() {
      return nodeAgent(address).then([this, address, name, path, reuse, offer](rpc::NodeAgent::Client agent) {
        auto pull = std::make_shared<Pull>(kj::mv(agent), name, path);
        if (auto hp = parseHostPort(address); hp.isOk()) pull->host = hp->host;
        int flags = O_RDWR | O_CLOEXEC | O_NOFOLLOW | (reuse ? 0 : O_CREAT | O_EXCL);
        pull->fd = ::open(path.c_str(), flags, 0600);
        if (pull->fd < 0) {
          throwStatus(Status(StatusCode::kUnavailable, fmt::format("cannot make {}: {}", path, std::strerror(errno))));
        }
        if (!offer.empty()) {
          pull->readyFd = ::open((path + ".ready").c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
          if (pull->readyFd >= 0) {
            pull->offer = offer;
            pull->arrived(0);
          }
        }
        return pullChunk(pull, 0)
            .then([this, pull]() -> kj::Promise<void> {
              pull->next = kPullChunk;
              if (pull->size <= kPullChunk) return kj::READY_NOW;
              pull->arrived(kPullChunk);
              return pull->relay.empty() ? pullDirect(pull) : pullRelayed(pull);
            })
            .then([pull]() {
                    if (pull->readyFd >= 0) ::unlink((pull->path + ".ready").c_str());  // complete
                    return pull->size;
                  },
                  [pull](kj::Exception&& e) -> uint64_t {
                    ::unlink(pull->path.c_str());
                    if (pull->readyFd >= 0) ::unlink((pull->path + ".ready").c_str());
                    kj::throwFatalException(kj::mv(e));
                  });
      });
    });
  }

  // Deletes a result handed over from another node once it was pulled (best effort: the
  // callee's exit deletes it too).
  void dropObject(const std::string& address, const std::string& name) {
    onLoop([this, address, name]() {
      return nodeAgent(address).then([name](rpc::NodeAgent::Client agent) {
        auto request = agent.dropObjectRequest();
        request.setName(name);
        return request.send().ignoreResult();
      });
    });
  }

  // The holds of the agent at `address` on one of its objects (NodeObjects::hold, lend,
  // release, dropSource): `op` is "hold" (extra: the in-flight record received), "lend" (extra:
  // its token), "release" or "withdraw" (extra: an offer of a copy that went).
  void holdObject(const std::string& address, const std::string& op, const std::string& name,
                  const std::string& holder, const std::string& extra) {
    onLoop([this, address, op, name, holder, extra]() {
      return nodeAgent(address).then([op, name, holder, extra](rpc::NodeAgent::Client agent) -> kj::Promise<void> {
        if (op == "hold") {
          auto request = agent.holdObjectRequest();
          request.setName(name);
          request.setHolder(holder);
          request.setLanded(extra);
          return request.send().ignoreResult();
        }
        if (op == "lend") {
          auto request = agent.lendObjectRequest();
          request.setName(name);
          request.setHolder(holder);
          request.setToken(extra);
          return request.send().ignoreResult();
        }
        if (op == "withdraw") {
          auto request = agent.dropSourceRequest();
          request.setName(name);
          request.setOffer(extra);
          return request.send().ignoreResult();
        }
        auto request = agent.releaseObjectRequest();
        request.setName(name);
        request.setHolder(holder);
        return request.send().ignoreResult();
      });
    });
  }

  // The object store of the node agent at `address`: {directory, objects, bytes, bulk_port, limit,
  // spill_directory, spilled_objects, spilled_bytes, served_bytes}.
  py::dict objectStore(const std::string& address) {
    auto store = onLoop([this, address]() {
      return nodeAgent(address).then([this](rpc::NodeAgent::Client agent) {
        return io_->provider->getTimer().timeoutAfter(kReadLogsDeadline, agent.objectStoreRequest().send());
      }).then([](capnp::Response<rpc::NodeAgent::ObjectStoreResults> r) {
        return std::make_tuple(std::string(r.getDirectory().cStr()), r.getObjects(), r.getBytes(), r.getBulkPort(),
                               r.getLimit(), std::string(r.getSpillDirectory().cStr()), r.getSpilledObjects(),
                               r.getSpilledBytes(), r.getServedBytes());
      });
    });
    auto& [directory, objects, bytes, bulkPort, limit, spillDirectory, spilledObjects, spilledBytes, servedBytes] = store;
    py::dict out;
    out["directory"] = directory;
    out["objects"] = objects;
    out["bytes"] = bytes;
    out["bulk_port"] = bulkPort;
    out["limit"] = limit;
    out["spill_directory"] = spillDirectory;
    out["spilled_objects"] = spilledObjects;
    out["spilled_bytes"] = spilledBytes;
    out["served_bytes"] = servedBytes;
    return out;
  }

  // The last `maxBytes` of an actor's stdout and stderr, read from its node's agent (any node).
  std::pair<py::bytes, py::bytes> readLogs(const std::string& id, uint32_t maxBytes) {
    auto logs = onLoop([this, id, maxBytes]() {
      return client_->actorInfo(ActorId(id)).then([this](ActorRecord actor) {
        return client_->listNodes().then([this, actor](std::vector<NodeRecord> nodes) {
          for (const auto& n : nodes) {
            if (n.id == actor.nodeId && n.state == NodeState::kAlive) return nodeAgent(n.address, n.id);
          }
          throwStatus(Status(StatusCode::kNotFound,
                             fmt::format("actor {}'s node {} is not alive: its logs are in that node's run directory",
                                         actor.id.hex(), actor.nodeId.hex())));
        });
      }).then([this, id, maxBytes](rpc::NodeAgent::Client agent) {
        auto request = agent.readLogsRequest();
        request.setId(id);
        request.setMaxBytes(maxBytes);
        return io_->provider->getTimer().timeoutAfter(kReadLogsDeadline, request.send());
      }).then([](capnp::Response<rpc::NodeAgent::ReadLogsResults> r) {
        auto text = [](capnp::Data::Reader d) { return std::string(reinterpret_cast<const char*>(d.begin()), d.size()); };
        return std::make_pair(text(r.getStdout()), text(r.getStderr()));
      });
    });
    return {py::bytes(logs.first), py::bytes(logs.second)};
  }

  // The live counters of the workers of the node agents at `addresses` (NodeAgent.metrics), as
  // (name, labels, value); a node that does not answer within 2 s is left out, not waited for.
  py::list nodeMetrics(const std::vector<std::string>& addresses) {
    using Samples = std::vector<std::tuple<std::string, std::string, double>>;
    auto all = onLoop([this, addresses]() {
      kj::Vector<kj::Promise<Samples>> asks;
      for (const auto& address : addresses) {
        auto ask = kj::evalNow([&]() { return nodeAgent(address); }).then([](rpc::NodeAgent::Client agent) {
          return agent.metricsRequest().send();
        }).then([](capnp::Response<rpc::NodeAgent::MetricsResults> r) {
          Samples out;
          for (auto s : r.getSamples()) out.emplace_back(s.getName().cStr(), s.getLabels().cStr(), s.getValue());
          return out;
        });
        asks.add(io_->provider->getTimer().timeoutAfter(2 * kj::SECONDS, kj::mv(ask)).catch_([](kj::Exception&&) {
          return Samples{};
        }));
      }
      return kj::joinPromises(asks.releaseAsArray());
    });
    py::list out;
    for (const auto& node : all) {
      for (const auto& [name, labels, value] : node) out.append(py::make_tuple(name, labels, value));
    }
    return out;
  }

  // Everything the controller's status call returns: nodes, actors, placement groups, groups.
  py::dict snapshot() {
    auto s = onLoop([this]() { return client_->snapshot(); });
    py::dict out;
    py::list nodes, actors, groups, training;
    for (const auto& n : s.nodes) nodes.append(toDict(n));
    for (const auto& a : s.actors) actors.append(toDict(a));
    for (const auto& g : s.placementGroups) {
      py::dict d = toDict(g);
      d["name"] = g.name;
      d["strategy"] = placementStrategyName(g.strategy);
      py::list bundles;
      for (const auto& b : g.bundles) bundles.append(std::map<std::string, double>(b.resources.begin(), b.resources.end()));
      d["bundles"] = bundles;
      groups.append(d);
    }
    for (const auto& g : s.groups) training.append(groupDict(g));
    out["nodes"] = nodes;
    out["actors"] = actors;
    out["placement_groups"] = groups;
    out["groups"] = training;
    return out;
  }

  // Output lines of this driver's actors since the last call: (label, stream, line) tuples.
  // Waits up to `timeout` seconds for some.
  std::vector<std::tuple<std::string, std::string, std::string>> pollOutput(double timeout) {
    py::gil_scoped_release release;
    std::unique_lock lock(mutex_);
    cv_.wait_for(lock, std::chrono::duration<double>(timeout), [this]() { return !output_.empty() || closing_; });
    std::vector<std::tuple<std::string, std::string, std::string>> lines;
    lines.swap(output_);
    return lines;
  }

  // Reads the output still on the nodes now (at shutdown, so none is lost) and returns it with
  // whatever was queued.
  std::vector<std::tuple<std::string, std::string, std::string>> flushOutput() {
    onLoop([this]() {
      relist_ = true;  // where every actor is now, and which are dead: their last output
      // Bounded: shutdown must not wait on a host that stopped answering (a read there ends by
      // its deadline, its node's death or its socket's, whichever comes first).
      return io_->provider->getTimer().timeoutAfter(peerSilenceLimit().count() * kj::MILLISECONDS + kj::SECONDS,
                                                    followOnce());
    });
    std::lock_guard lock(mutex_);
    std::vector<std::tuple<std::string, std::string, std::string>> lines;
    lines.swap(output_);
    return lines;
  }

  // ---- Placement groups and elastic group records (for troupe.train) ----
  // Creates a placement group; returns (id, state, pending reason, node id per bundle).
  py::dict createPlacementGroup(const std::string& strategy, const std::vector<std::map<std::string, double>>& bundles,
                                const std::string& name) {
    auto parsed = parsePlacementStrategy(strategy);
    if (!parsed.isOk()) throw InvalidArgument(parsed.status().message());
    std::vector<Resources> demands;
    for (const auto& b : bundles) demands.emplace_back(b.begin(), b.end());
    return toDict(onLoop([this, s = *parsed, demands, name]() { return client_->createPlacementGroup(s, demands, name); }));
  }

  py::dict placementGroup(const std::string& id) {
    return toDict(onLoop([this, id]() { return client_->placementGroup(PlacementGroupId(id)); }));
  }

  // Appends bundles to a live group (all or nothing); returns the group as placePlacementGroup.
  py::dict addBundles(const std::string& id, const std::vector<std::map<std::string, double>>& bundles) {
    std::vector<Resources> demands;
    for (const auto& b : bundles) demands.emplace_back(b.begin(), b.end());
    return toDict(onLoop([this, id, demands]() {
      return client_->placementGroup(PlacementGroupId(id)).then([this, demands](PlacementGroupRecord g) {
        return client_->addBundles(g, demands);
      });
    }));
  }

  py::dict removeBundles(const std::string& id, const std::vector<uint32_t>& indices) {
    return toDict(onLoop([this, id, indices]() { return client_->removeBundles(PlacementGroupId(id), indices); }));
  }

  void removePlacementGroup(const std::string& id) {
    onLoop([this, id]() { return client_->removePlacementGroup(PlacementGroupId(id)); });
  }

  void putGroup(const std::string& id, const std::string& doc) {
    onLoop([this, id, doc]() { return client_->putGroup(id, doc); });
  }

  void groupEvent(const std::string& id, const std::string& text) {
    onLoop([this, id, text]() { return client_->groupEvent(id, text); });
  }

  // Sends a command ("resize" to `workers` trainers, or "stop") to the group's coordinator;
  // returns its seq. NotFoundError for an unknown group, InvalidArgumentError for another kind
  // or a resize to fewer than 1 (or more than 2**32 - 1) workers.
  uint64_t groupCommand(const std::string& id, const std::string& kind, int64_t workers) {
    auto parsed = groupCommandKindFromName(kind);
    if (!parsed) throw InvalidArgument(fmt::format("group command '{}': use 'resize' or 'stop'", kind));
    GroupCommand command;
    command.kind = *parsed;
    if (command.kind == GroupCommand::Kind::kResize) {
      if (workers < 1 || workers > int64_t(UINT32_MAX)) {
        throw InvalidArgument(fmt::format("resize to {} workers: ask for at least 1", workers));
      }
      command.workers = static_cast<uint32_t>(workers);
    }
    return onLoop([this, id, command]() { return client_->groupCommand(id, command); });
  }

  void removeGroup(const std::string& id) {
    onLoop([this, id]() { return client_->removeGroup(id); });
  }

  // The group's record as a dict ({} for an unknown group).
  py::dict group(const std::string& id) {
    auto record = onLoop([this, id]() { return client_->group(id); });
    return record ? groupDict(*record) : py::dict();
  }

  py::list groups() {
    auto records = onLoop([this]() { return client_->listGroups(); });
    py::list out;
    for (const auto& r : records) out.append(groupDict(r));
    return out;
  }

  static py::dict groupDict(const ElasticGroupRecord& record) {
    py::dict d;
    d["id"] = record.id;
    d["doc"] = record.doc;
    d["events"] = record.events;
    d["epoch"] = record.epoch;
    py::list commands;
    for (const auto& c : record.commands) {
      py::dict command;
      command["seq"] = c.seq;
      command["kind"] = groupCommandKindName(c.kind);
      command["workers"] = c.workers;
      command["time_ms"] = c.timeMs;
      command["from"] = c.from;
      commands.append(command);
    }
    d["commands"] = commands;
    return d;
  }

  // {"actors": [...]} as plain dicts.
  py::dict status() {
    auto actors = onLoop([this]() { return client_->listActors(); });
    py::list out;
    for (const auto& r : actors) out.append(toDict(r));
    py::dict result;
    result["actors"] = out;
    return result;
  }

 private:
  // Runs `start` (which returns a promise) on the loop and waits for its value, GIL released.
  template <typename Start>
  auto onLoop(Start start) -> decltype(std::declval<const kj::Executor&>().executeSync(std::move(start))) {
    py::gil_scoped_release release;
    try {
      return executor_->executeSync(kj::mv(start));
    } catch (const kj::Exception& e) {
      py::gil_scoped_acquire acquire;
      throw StatusError{statusFromException(e, "")};
    }
  }

  struct Cursor {
    std::string type;
    int64_t outFrom = 0;
    int64_t errFrom = 0;
    int64_t pid = 0;  // of the incarnation that wrote the output
  };

  // Follows the output files of the actors this driver created (on their nodes' agents) and
  // queues new whole lines for Python to print. Polls every 200 ms while there are actors.
  kj::Promise<void> followOutput() {
    return io_->provider->getTimer().afterDelay(200 * kj::MILLISECONDS).then([this]() {
      return followOnce();
    }).then([this]() { return followOutput(); });
  }

  // One round of reading, after the previous round: two rounds at once would read the same
  // bytes twice (the periodic one and the one at shutdown).
  kj::Promise<void> followOnce() {
    auto round = lastRound_.then([this]() { return readRound(); }).fork();
    lastRound_ = round.addBranch();
    return round.addBranch();
  }

  // Reads new output of the followed actors from their nodes' agents. Where they are comes from
  // a listing of the cluster's actors, which costs the controller a read of every record: it is
  // made again only every kRelistEvery, or sooner when an actor was added or a read failed, so
  // a following driver does not keep a controller of 10k actors busy.
  kj::Promise<void> readRound() {
    if (followed_.empty()) return kj::READY_NOW;
    if (!relist_ && std::chrono::steady_clock::now() - listedAt_ < kRelistEvery) return readListed();
    relist_ = false;
    listedAt_ = std::chrono::steady_clock::now();
    return client_->listActors().then([this](std::vector<ActorRecord> actors) {
        return client_->listNodes().then([this, actors = kj::mv(actors)](std::vector<NodeRecord> nodes) mutable {
          listed_.clear();
          for (auto& a : actors) {
            if (followed_.count(a.id.hex())) listed_.push_back(kj::mv(a));
          }
          addresses_.clear();
          for (const auto& n : nodes) {
            if (n.state == NodeState::kAlive) addresses_[n.id] = n.address;
          }
          return readListed();
        });
      }).catch_([this](kj::Exception&&) { relist_ = true; });  // a node that went away: its output is in its logs
  }

  kj::Promise<void> readListed() {
    kj::Vector<kj::Promise<void>> reads;
    for (const auto& a : listed_) {
      auto where = addresses_.find(a.nodeId);
      if (!followed_.count(a.id.hex()) || where == addresses_.end()) continue;
      reads.add(readOutput(a, where->second).catch_([this](kj::Exception&&) { relist_ = true; }));
    }
    return kj::joinPromises(reads.releaseAsArray());
  }

  kj::Promise<void> readOutput(const ActorRecord& actor, const std::string& nodeAddress) {
    std::string id = actor.id.hex();
    auto cursor = followed_.count(id) ? followed_[id] : Cursor{};
    if (actor.pid != 0) cursor.pid = followed_[id].pid = actor.pid;
    // A DEAD record keeps its last pid; one that never started has none: name it by id.
    std::string who = cursor.pid != 0 ? fmt::format("pid={}", cursor.pid) : fmt::format("actor={}", id.substr(0, 8));
    std::string label = fmt::format("({} {})", actor.type.rfind("py:", 0) == 0 ? actor.type.substr(3) : actor.type, who);
    return nodeAgent(nodeAddress, actor.nodeId).then([this, id, cursor](rpc::NodeAgent::Client agent) {
      auto request = agent.readLogsRequest();
      request.setId(id);
      request.setMaxBytes(64 * 1024);
      request.setStdoutFrom(cursor.outFrom);
      request.setStderrFrom(cursor.errFrom);
      // A read that times out is asked again next round from the same offsets: nothing is lost.
      return io_->provider->getTimer().timeoutAfter(kFollowReadDeadline, request.send());
    }).then([this, id, label, dead = actor.state == ActorState::kDead](capnp::Response<rpc::NodeAgent::ReadLogsResults> r) {
      auto it = followed_.find(id);
      if (it != followed_.end()) {
        it->second.outFrom = r.getStdoutEnd();
        it->second.errFrom = r.getStderrEnd();
        if (dead) followed_.erase(it);  // this was its last output
      }
      std::vector<std::tuple<std::string, std::string, std::string>> lines;
      for (auto [stream, data] : {std::make_pair("stdout", r.getStdout()), std::make_pair("stderr", r.getStderr())}) {
        std::string text(reinterpret_cast<const char*>(data.begin()), data.size());
        size_t pos = 0;
        while (pos < text.size()) {
          size_t nl = text.find('\n', pos);
          if (nl == std::string::npos) nl = text.size();
          lines.emplace_back(label, stream, text.substr(pos, nl - pos));
          pos = nl + 1;
        }
      }
      if (lines.empty()) return;
      {
        std::lock_guard lock(mutex_);
        output_.insert(output_.end(), lines.begin(), lines.end());
      }
      cv_.notify_all();
    });
  }

  // A connection per node agent, made again once the old one broke: bootstrapping on a broken
  // connection makes capnp 0.9 throw while unwinding (std::terminate), so a broken one is never
  // used again.
  kj::Promise<rpc::NodeAgent::Client> nodeAgent(const std::string& address, const NodeId& node = {}) {
    auto it = nodeAgents_.find(address);
    if (it != nodeAgents_.end() && !*it->second.broken) return it->second.client->bootstrap<rpc::NodeAgent>();
    if (it != nodeAgents_.end()) nodeAgents_.erase(it);
    auto hp = parseHostPort(address);
    if (!hp.isOk()) throwStatus(hp.status());
    return RpcClient::connect(*io_, *hp, token_, 3 * kj::SECONDS).then([this, address, node](kj::Own<RpcClient> c) {
      auto cap = c->bootstrap<rpc::NodeAgent>();
      auto broken = std::make_shared<bool>(false);
      tasks_->add(c->onDisconnect().then([broken]() { *broken = true; }, [broken](kj::Exception&&) { *broken = true; }));
      nodeAgents_[address] = AgentConnection{kj::mv(c), broken, node};
      return cap;
    });
  }

  // The agent connections to a node the controller declared DEAD break at once (loop thread).
  void agentNodeDied(const NodeId& node, const Status& why) {
    auto known = addresses_.find(node);
    for (auto it = nodeAgents_.begin(); it != nodeAgents_.end();) {
      if (it->second.node != node && (known == addresses_.end() || it->first != known->second)) {
        ++it;
        continue;
      }
      it->second.client->breakConnection(why);
      *it->second.broken = true;
      // Destroyed on a later turn, after the calls in flight on it have heard.
      if (tasks_ != nullptr) tasks_->add(kj::evalLater([old = kj::mv(it->second.client)]() {}));
      it = nodeAgents_.erase(it);
    }
    relist_ = true;
  }

  ActorHandle handle(const std::string& id) {
    auto it = handles_.find(id);
    if (it == handles_.end()) it = handles_.emplace(id, client_->actor(ActorId(id))).first;
    return it->second;
  }

  void complete(int64_t ref, Outcome outcome, std::string data, std::string code = "") {
    {
      std::lock_guard lock(mutex_);
      auto& c = completions_[ref];
      c.outcome = outcome;
      c.data = std::move(data);
      c.code = std::move(code);
    }
    cv_.notify_all();
  }

  // Number of `refs` that are done (or unknown: consumed or never made). Caller holds mutex_.
  size_t countDone(const std::vector<int64_t>& refs) const {
    size_t n = 0;
    for (int64_t r : refs) {
      auto it = completions_.find(r);
      if (it == completions_.end() || it->second.outcome != Outcome::kPending) ++n;
    }
    return n;
  }

  static void poke(int fd) {
    uint64_t one = 1;
    ssize_t n = ::write(fd, &one, sizeof(one));
    (void)n;
  }

  std::thread background_;
  kj::Own<const kj::Executor> executor_;
  // The fields marked "loop" belong to the background thread, which runs the loop.
  kj::AsyncIoContext* io_ = nullptr;  // loop
  kj::TaskSet* tasks_ = nullptr;      // loop
  kj::Own<ClusterClient> client_;     // loop
  std::map<std::string, ActorHandle> handles_;  // loop: one per actor keeps call order
  int64_t nextRef_ = 1;                                     // guarded by mutex_
  std::vector<Submitted> submitted_;                        // guarded by mutex_
  int wakeFd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);   // submit() -> loop: calls are queued
  int stopFd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);   // close() -> loop: stop
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<int64_t, Completion> completions_;
  std::string token_;
  std::map<std::string, Cursor> followed_;                  // loop
  static constexpr auto kRelistEvery = std::chrono::seconds(2);
  std::vector<ActorRecord> listed_;                         // loop: the followed actors' records
  std::map<NodeId, std::string> addresses_;                 // loop: alive nodes' agents
  std::chrono::steady_clock::time_point listedAt_;          // loop
  bool relist_ = true;                                      // loop
  kj::Promise<void> lastRound_ = kj::READY_NOW;             // loop
  struct AgentConnection {
    kj::Own<RpcClient> client;
    std::shared_ptr<bool> broken;  // set when the agent closes it (or dies)
    NodeId node;                   // the agent's node, where the caller knew it
  };
  // Deadlines of reads from node agents: the follower's are asked again next round.
  static constexpr kj::Duration kFollowReadDeadline = 2 * kj::SECONDS;
  static constexpr kj::Duration kReadLogsDeadline = 10 * kj::SECONDS;
  // Object pulls: chunk size and how many are in flight (the window covers a link's delay), and
  // how long one chunk may take before the pull fails.
  static constexpr uint32_t kPullChunk = 8u << 20;
  static constexpr int kPullLanes = 4;
  static constexpr kj::Duration kPullChunkDeadline = 60 * kj::SECONDS;
  std::map<std::string, AgentConnection> nodeAgents_;       // loop
  std::vector<std::tuple<std::string, std::string, std::string>> output_;  // guarded by mutex_
  bool closing_ = false;                                    // guarded by mutex_
};

// One Python actor as the shared actor server (actor_server.h) sees it. Inline (the default):
// `dispatch(method, payload) -> bytes` runs on the loop thread with the GIL held, in turn: one call
// at a time, in arrival order. Concurrent (threaded and async actors, task workers): every call
// answers at once, so calls start in arrival order and overlap; `dispatch(method, payload, reply)`
// only hands the call to Python's own executor and returns, and `reply(bytes)`, called once from
// any thread, answers it. Exceptions are part of the reply (the Python layer encodes them and
// counts them), so a call fails here only if the dispatcher itself raised.
class PythonActor final : public Actor {
 public:
  PythonActor(py::object dispatch, bool concurrent) : dispatch_(std::move(dispatch)), concurrent_(concurrent) {}
  ~PythonActor() noexcept override {
    py::gil_scoped_acquire acquire;
    dispatch_ = py::object();
  }

  Result<std::string> call(const std::string& method, std::string_view payload) override {
    py::gil_scoped_acquire acquire;
    try {
      py::bytes reply = dispatch_(method, py::bytes(payload.data(), payload.size()));
      return std::string(reply);
    } catch (py::error_already_set& e) {
      return Status(StatusCode::kInternal, fmt::format("the Python worker's dispatcher raised: {}", e.what()));
    }
  }

  // Concurrent calls are handed to Python together at the end of this turn of the loop, under
  // one GIL acquisition: taking it per call makes the loop thread and the threads running calls
  // trade it back and forth (a callBatch of task calls arrives in one turn).
  kj::Promise<Result<std::string>> callAsync(const std::string& method, std::string_view payload) override {
    if (!concurrent_) return call(method, payload);
    auto paf = kj::newPromiseAndCrossThreadFulfiller<Result<std::string>>();
    starting_.push_back(Starting{method, payload, kj::mv(paf.fulfiller)});
    if (starting_.size() == 1) {
      startAll_ = kj::evalLater([this]() { startAll(); }).eagerlyEvaluate(nullptr);
    }
    return kj::mv(paf.promise);
  }

  bool answersAtOnce(const std::string& /*method*/) const override { return concurrent_; }

 private:
  struct Starting {
    std::string method;
    std::string_view payload;  // valid while the call's promise is (actor.h)
    kj::Own<kj::CrossThreadPromiseFulfiller<Result<std::string>>> fulfiller;
  };

  void startAll() {
    std::vector<Starting> batch;
    batch.swap(starting_);
    py::gil_scoped_acquire acquire;
    for (auto& s : batch) {
      if (!s.fulfiller->isWaiting()) continue;  // its call was cancelled: the payload is gone
      auto fulfiller = std::make_shared<kj::Own<kj::CrossThreadPromiseFulfiller<Result<std::string>>>>(kj::mv(s.fulfiller));
      py::cpp_function reply([fulfiller](py::bytes data) {
        std::string bytes = data;
        py::gil_scoped_release release;
        if ((*fulfiller)->isWaiting()) (*fulfiller)->fulfill(Result<std::string>(kj::mv(bytes)));
      });
      try {
        dispatch_(s.method, py::bytes(s.payload.data(), s.payload.size()), reply);
      } catch (py::error_already_set& e) {
        (*fulfiller)->fulfill(Status(StatusCode::kInternal, fmt::format("the Python worker's dispatcher raised: {}", e.what())));
      }
    }
  }

  py::object dispatch_;
  bool concurrent_;
  std::vector<Starting> starting_;          // loop thread: concurrent calls not yet handed to Python
  kj::Promise<void> startAll_ = kj::READY_NOW;  // loop thread: hands them over at the end of the turn
};

// The Python worker's main loop: serve the actor, report ready, run until SIGTERM.
void serveActor(const std::string& actorId, uint32_t incarnation, const std::string& controller,
                const std::string& ip, const std::string& token, py::object dispatch, bool concurrent,
                const std::string& type) {
  auto controllerAddr = parseHostPort(controller);
  if (!controllerAddr.isOk()) throw InvalidArgument(controllerAddr.status().message());
  auto actor = std::make_unique<PythonActor>(std::move(dispatch), concurrent);
  py::gil_scoped_release release;
  kj::UnixEventPort::captureSignal(SIGTERM);
  auto io = kj::setupAsyncIo();
  // The same server as C++ workers' (actor_server.h): inline calls run in turn, in arrival order
  // (synchronous: the server runs them as they arrive, as nothing of an inline actor waits).
  auto server = listenActor(io, HostPort{ip, 0}, token, std::move(actor), type,
                            ActorServerOptions{.synchronous = !concurrent});
  if (!server.isOk()) throw std::runtime_error(server.status().message());
  std::string address = HostPort{ip, (*server)->port()}.toString();
  auto cluster = ClusterClient::connect(io, *controllerAddr, token).wait(io.waitScope);
  cluster->reportActorReady(ActorId(actorId), incarnation, address).wait(io.waitScope);
  io.unixEventPort.onSignal(SIGTERM).wait(io.waitScope);
}

}  // namespace
}  // namespace troupe

PYBIND11_MODULE(_core, m) {
  troupe::python::registerErrors();
  troupe::keepMessageBuffers();
  using troupe::Runtime;
  m.doc() = "Troupe's C++ runtime (used by the troupe package; not a public API)";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const troupe::StatusError& e) {
      auto error = py::module_::import("troupe.exceptions")
                       .attr("from_code")(troupe::statusCodeName(e.status.code()), e.status.message());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
    }
  });
  // If the runtime ever terminates the process, say why before aborting.
  std::set_terminate([]() {
    try {
      if (auto e = std::current_exception()) std::rethrow_exception(e);
    } catch (const kj::Exception& e) {
      fprintf(stderr, "troupe._core: fatal: %s\n", kj::str(e).cStr());
    } catch (const std::exception& e) {
      fprintf(stderr, "troupe._core: fatal: %s: %s\n", typeid(e).name(), e.what());
    } catch (...) {
    }
    abort();
  });
  py::class_<Runtime>(m, "Runtime")
      .def(py::init<const std::string&, const std::string&>(), py::arg("address"), py::arg("token"))
      .def("close", &Runtime::close)
      .def("create_actor", &Runtime::createActor)
      .def("get_actor", &Runtime::getActor)
      .def("actor_info", &Runtime::actorInfo)
      .def("wait_ready", &Runtime::waitReady)
      .def("kill", &Runtime::kill)
      .def("submit", &Runtime::submit, py::arg("actor"), py::arg("method"), py::arg("payload"),
           py::arg("max_task_retries") = troupe::ActorHandle::kActorsRetries)
      .def("wait", &Runtime::wait)
      .def("take", &Runtime::take)
      .def("status", &Runtime::status)
      .def("snapshot", &Runtime::snapshot)
      .def("read_logs", &Runtime::readLogs)
      .def("pull_object", &Runtime::pullObject, py::arg("address"), py::arg("name"), py::arg("path"),
           py::arg("reuse") = false, py::arg("offer") = "")
      .def("drop_object", &Runtime::dropObject)
      .def("hold_object", &Runtime::holdObject)
      .def("object_store", &Runtime::objectStore)
      .def("node_metrics", &Runtime::nodeMetrics)
      .def("nodes", &Runtime::nodes)
      .def("poll_output", &Runtime::pollOutput)
      .def("flush_output", &Runtime::flushOutput)
      .def("create_placement_group", &Runtime::createPlacementGroup)
      .def("placement_group", &Runtime::placementGroup)
      .def("remove_placement_group", &Runtime::removePlacementGroup)
      .def("add_bundles", &Runtime::addBundles)
      .def("remove_bundles", &Runtime::removeBundles)
      .def("put_group", &Runtime::putGroup)
      .def("group_event", &Runtime::groupEvent)
      .def("group_command", &Runtime::groupCommand, py::arg("group_id"), py::arg("kind"), py::arg("workers") = 0)
      .def("remove_group", &Runtime::removeGroup)
      .def("group", &Runtime::group)
      .def("groups", &Runtime::groups);
  m.def("serve_actor", &troupe::serveActor, py::arg("actor_id"), py::arg("incarnation"), py::arg("controller"),
        py::arg("ip"), py::arg("token"), py::arg("dispatch"), py::arg("concurrent") = false,
        py::arg("type") = "python");
  m.def("die_with_parent", []() { prctl(PR_SET_PDEATHSIG, SIGKILL); });
  // The cluster file of `root`'s newest run, through the same owner-and-mode checks as the CLI's
  // (troupe.init("auto"), troupe job): a dict, or the check's error as a troupe exception.
  m.def(
      "read_cluster_file",
      [](const std::string& root, bool latest) {
        auto dir = latest ? troupe::latestRunDir(root) : troupe::Result<std::string>(root);
        if (!dir.isOk()) throw troupe::StatusError{dir.status()};
        auto file = troupe::readClusterFile(*dir);
        if (!file.isOk()) throw troupe::StatusError{file.status()};
        py::dict d;
        d["run_dir"] = *dir;
        d["controller_address"] = file->controllerAddress;
        d["token"] = file->token;
        d["redis_address"] = file->redisAddress;
        d["redis_password"] = file->redisPassword;
        d["cluster"] = file->cluster;
        d["embedded_redis"] = file->embeddedRedis;
        d["tls"] = file->tls;
        d["heartbeat_ttl_ms"] = file->heartbeatTtlMs;
        return d;
      },
      py::arg("root"), py::arg("latest") = true);
  m.def("default_run_root", &troupe::runRoot);
  // A built-in actor's init args as create_actor would send them (JSON text or a mapping, to its
  // message): what troupe.train checks before it places anything.
  m.def(
      "encode_init_args",
      [](const std::string& type, const py::object& initArgs) { return py::bytes(troupe::initArgsFor(type, initArgs)); },
      py::arg("type"), py::arg("init_args"));
  // A --tls cluster (its cluster file says so): every connection of this process starts with
  // TLS, so nothing on the path can make it speak plaintext.
  m.def("require_tls", &troupe::tls::require);
  // The one check of the names users give (troupe/runtime/names.h, which the CLI uses too):
  // InvalidArgumentError (a ValueError) saying what is wrong. Bytes, so that Python's lone
  // surrogates arrive as the bytes that are not UTF-8 rather than as a conversion error.
  m.def(
      "check_name",
      [](const py::bytes& name, const std::string& what) {
        if (auto s = troupe::checkName(std::string(name), what); !s.isOk()) throw troupe::StatusError{s};
      },
      py::arg("name"), py::arg("what") = "actor name");
  // A call that raised, in this worker's counters (the node agent reads them for /metrics).
  m.def("count_call_error", []() { troupe::metrics::actorCalls().errors.add(); });
}
