// The CPU backend: collectives over the TCP mesh built by rendezvous.cc, driven by one Asio
// io_context on the communicator's own thread.
//
// Every operation becomes a plan (plan.h, pure): per peer, a list of sends (each possibly
// waiting for an event) and a list of receives (each possibly reducing what arrived into the
// output and then setting an event); applyPlan() points it at the operation's buffers. The
// engine keeps one write and one read in flight per peer and starts each send as soon as its
// event is set, so for the ring the sender thread writes chunk k-1 while the kernel moves chunk
// k+1 and this thread reduces chunk k: sending, receiving and reducing overlap.
// Plans, events and scratch buffers live in the communicator and are reused, so steady-state
// operations allocate nothing but their Work.
//
// Each operation's traffic on a connection starts with a 32-byte header (kind, type, op,
// count, root, per-connection sequence number) that the receiver checks against its own call:
// a rank that issued a different operation is reported instead of corrupting data.
//
// Ranks on one host (shm_transport.h) exchange the same byte stream through shared-memory pipes
// instead of their data connections: the plans, headers and reduction order do not change, so
// results are bit-identical to TCP. A pipe receive reduces straight from the pipe into the output
// (no scratch copy); a consumer with too little data spins briefly, then arms the producer to ring
// its doorbell, which the shm waiter thread turns into a post to the I/O thread. The control
// connections stay TCP, so a dead or aborting peer is noticed exactly as before; fail() also
// wakes the sender thread if it is blocked on a full pipe.
//
// Failures: the first error (a data or control connection failing, a peer's ABORT, an epoch
// advance seen by the watcher thread, a timeout, a mismatched header) is recorded, every socket
// is closed, the current and queued operations fail with it, and an ABORT carrying it goes to
// every peer, so ranks that were not talking to the failed one stop too.
#include "tcp_communicator.h"

#include <sched.h>
#include <sys/socket.h>

#include <algorithm>
#include <future>

#include <asio/post.hpp>
#include <fmt/format.h>

#include "reduce.h"
#include "troupe/runtime/logging.h"
#include "wire.h"

namespace troupe::collectives {

namespace {

using asio::ip::tcp;

tcp protocolOf(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  return address.ss_family == AF_INET6 ? tcp::v6() : tcp::v4();
}

// How long a pipe reader polls before it sleeps: long enough to catch a peer that is running, when
// the host's ranks have a CPU each; briefly when they share CPUs, where polling would take the
// CPU from the very peer it waits for (measured on 2 CPUs: 4 ranks got slower with 100 us,
// 2 ranks faster for small messages).
constexpr auto kShmSpinOwnCpu = std::chrono::microseconds(50);
constexpr auto kShmSpinSharedCpu = std::chrono::microseconds(5);

int cpusAvailable() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

}  // namespace

TcpCommunicator::TcpCommunicator(const CommunicatorOptions& options, RendezvousResult met, std::optional<ShmLink> shm)
    : options_(options),
      n_(options.worldSize),
      me_(options.rank),
      elementsPerChunkBytes_(std::max<size_t>(options.chunkBytes & ~size_t{63}, 4096)),
      timer_(io_) {
  const size_t scratchBytes = std::max(elementsPerChunkBytes_, options_.smallMessageBytes) + 64;
  peers_.resize(n_);
  for (int r = 0; r < n_; ++r) {
    if (r == me_) continue;
    RendezvousPeer& raw = met.peers[r];
    auto peer = std::make_unique<Peer>(io_, r, raw.name);
    asio::error_code ec;
    const tcp protocol = protocolOf(raw.data.get());
    peer->data.assign(protocol, raw.data.release(), ec);
    TROUPE_CHECK(!ec, "assigning a data socket: {}", ec.message());
    peer->control.socket().assign(protocol, raw.control.release(), ec);
    TROUPE_CHECK(!ec, "assigning a control socket: {}", ec.message());
    peer->dataFd = peer->data.native_handle();
    peer->scratch.reserve(scratchBytes);
    if (shm && shm->localOf(r) >= 0) {
      peer->shm = true;
      peer->out = shm->segment->pipe(shm->myLocal, shm->localOf(r));
      peer->in = shm->segment->pipe(shm->localOf(r), shm->myLocal);
    }
    peers_[r] = std::move(peer);
  }
  selfSlot_.reserve(options_.smallMessageBytes + 64);
  for (auto& peer : peers_) {
    if (peer) watchControl(*peer);
  }
  shm_ = std::move(shm);
  // The doorbell's value before any operation can run: the waiter posts for every ring after
  // it, including rings that come before the waiter thread first reads the word.
  const uint32_t bellBefore = shm_ ? shm_->segment->doorbell(shm_->myLocal).load() : 0;
  if (shm_) {
    shmSpin_ = static_cast<int>(shm_->localRanks.size()) <= cpusAvailable() ? kShmSpinOwnCpu : kShmSpinSharedCpu;
  }
  ioThread_ = std::thread([this] { io_.run(); });  // runs until the guard goes (destructor)
  sender_ = std::thread([this] { senderLoop(); });
  epochWatcher_ = std::make_unique<EpochWatcher>(
      std::move(met.watch), options_.epoch,
      fmt::format("group '{}' epoch {} rank {}", options_.group, options_.epoch, me_), [this](int64_t advanced) {
        asio::post(io_, [this, advanced] {
          fail(Status(StatusCode::kAborted, fmt::format("group '{}' advanced to epoch {}; {}", options_.group,
                                                        advanced, recreateAdvice(options_))));
        });
      });
  if (shm_) shmWaiter_ = std::thread([this, bellBefore] { shmWaitLoop(bellBefore); });
  if (shm_ && shm_->life) {
    std::vector<LifeLocks::Peer> mates;
    for (int local = 0; local < static_cast<int>(shm_->localRanks.size()); ++local) {
      if (local != shm_->myLocal) {
        mates.push_back({shm_->localRanks[local], shm_->segment->lifeLock(local), shm_->segment->lifeDied(local)});
        deathMarks_.emplace_back(shm_->localRanks[local], shm_->segment->lifeDied(local));
      }
    }
    shm_->life->watch(mates, [this](int rank) {
      noteDeath(rank);
      asio::post(io_, [this, rank] { onLifeLockReleased(*peers_[rank]); });
    });
  }
}

TcpCommunicator::~TcpCommunicator() {
  epochWatcher_.reset();  // joins its thread, which may post to io_
  if (shm_) shm_->life.reset();  // its watchers may post to io_ until then
  if (shmWaiter_.joinable()) {
    shmWaiterStop_.store(true);
    std::atomic<uint32_t>& bell = shm_->segment->doorbell(shm_->myLocal);
    bell.fetch_add(1);
    futexWakeAll(bell);
    shmWaiter_.join();
  }
  asio::post(io_, [this] { shutdown(); });
  keepRunning_.reset();
  ioThread_.join();
  {
    std::lock_guard lock(sendMutex_);
    sendStop_ = true;
  }
  sendReady_.notify_one();
  sender_.join();  // its sockets were shut down, so a write in progress has ended
}

Status TcpCommunicator::health() const {
  std::lock_guard lock(healthMutex_);
  return health_;
}

void TcpCommunicator::onLifeLockReleased(const Peer& peer) {
  if (!broken_.isOk() || shuttingDown_) return;
  // At once, as when its control connection ends: an operation in progress may need the peer
  // through others (a ring), which this rank cannot see. As a lost connection, an ABORT the peer
  // sent before it ended says why, and wins.
  fail(Status(StatusCode::kUnavailable,
              fmt::format("{} died or was killed (the kernel released its life lock in this host's shared memory){}; {}",
                          peer.name, active_ ? fmt::format(" (during {})", describeRequest(current_, opNumber_)) : "",
                          recreateAdvice(options_))),
       FailureCause::kConnectionLost);
}

std::vector<int> TcpCommunicator::deadPeers() const {
  std::lock_guard lock(healthMutex_);
  std::vector<int> dead = deadPeers_;
  for (const auto& [rank, mark] : deathMarks_) {  // the segment stays mapped while shm_ lives
    if (mark->load() != 0 && std::find(dead.begin(), dead.end(), rank) == dead.end()) dead.push_back(rank);
  }
  return dead;
}

void TcpCommunicator::noteDeath(int rank) {
  std::lock_guard lock(healthMutex_);
  if (std::find(deadPeers_.begin(), deadPeers_.end(), rank) == deadPeers_.end()) deadPeers_.push_back(rank);
}

std::string TcpCommunicator::waitingOn() const {
  auto answer = std::make_shared<std::promise<std::string>>();
  auto result = answer->get_future();
  asio::post(io_, [this, answer] { answer->set_value(describeWaiting()); });
  if (result.wait_for(std::chrono::seconds(1)) != std::future_status::ready) return "";
  return result.get();
}

std::shared_ptr<Work> TcpCommunicator::allreduceAsync(const void* send, void* recv, size_t count, DataType type,
                                                      ReduceOp op) {
  return submit(Request{OpKind::kAllreduce, send, recv, count, type, op, -1, nullptr});
}

std::shared_ptr<Work> TcpCommunicator::reduceScatterAsync(const void* send, void* recv, size_t count, DataType type,
                                                          ReduceOp op) {
  return submit(Request{OpKind::kReduceScatter, send, recv, count, type, op, -1, nullptr});
}

std::shared_ptr<Work> TcpCommunicator::allgatherAsync(const void* send, void* recv, size_t count, DataType type) {
  return submit(Request{OpKind::kAllgather, send, recv, count, type, ReduceOp::kSum, -1, nullptr});
}

std::shared_ptr<Work> TcpCommunicator::broadcastAsync(void* buffer, size_t count, DataType type, int root) {
  return submit(Request{OpKind::kBroadcast, buffer, buffer, count, type, ReduceOp::kSum, root, nullptr});
}

std::shared_ptr<Work> TcpCommunicator::barrierAsync() {
  return submit(Request{OpKind::kBarrier, nullptr, nullptr, 0, DataType::kFloat32, ReduceOp::kSum, -1, nullptr});
}

std::shared_ptr<Work> TcpCommunicator::sendAsync(const void* buffer, size_t count, DataType type, int peer) {
  return submit(Request{OpKind::kSend, buffer, nullptr, count, type, ReduceOp::kSum, peer, nullptr});
}

std::shared_ptr<Work> TcpCommunicator::recvAsync(void* buffer, size_t count, DataType type, int peer) {
  return submit(Request{OpKind::kRecv, nullptr, buffer, count, type, ReduceOp::kSum, peer, nullptr});
}

std::shared_ptr<Work> TcpCommunicator::sendRecvAsync(const void* send, int to, void* recv, int from, size_t count,
                                                     DataType type) {
  return submit(Request{OpKind::kSendRecv, send, recv, count, type, ReduceOp::kSum, to, nullptr, from});
}

std::shared_ptr<Work> TcpCommunicator::submit(Request request) {
  auto work = std::make_shared<WorkState>();
  request.work = work;
  if (Status invalid = validateRequest(request, n_, me_); !invalid.isOk()) {
    work->complete(std::move(invalid));  // a local mistake: nothing was sent, still usable
    return work;
  }
  {
    std::lock_guard lock(healthMutex_);
    if (!health_.isOk()) {
      work->complete(health_);
      return work;
    }
  }
  asio::post(io_,
             [this, request = std::move(request)]() mutable { enqueue(std::move(request)); });
  return work;
}

void TcpCommunicator::enqueue(Request request) {
  if (!broken_.isOk()) {
    request.work->complete(broken_);
    return;
  }
  queue_.push_back(std::move(request));
  advance();
}

void TcpCommunicator::advance() {
  for (;;) {
    if (active_) {
      if (!currentDone()) return;
      finishCurrent();
    }
    if (queue_.empty() || !broken_.isOk()) return;
    current_ = std::move(queue_.front());
    queue_.pop_front();
    startCurrent();
  }
}

bool TcpCommunicator::currentDone() const {
  for (const auto& peer : peers_) {
    if (peer && (!peer->sendsDone() || !peer->recvsDone())) return false;
  }
  return true;
}

void TcpCommunicator::finishCurrent() {
  if (plan_.finalReduce) directReduce();
  active_ = false;
  timer_.cancel();
  for (auto& peer : peers_) {
    if (peer) peer->resetPlan();
  }
  countFinished(current_, std::chrono::steady_clock::now() - opStarted_);
  auto work = std::move(current_.work);
  work->complete(Status::ok());
}

void TcpCommunicator::startCurrent() {
  active_ = true;
  opStarted_ = std::chrono::steady_clock::now();
  ++opNumber_;
  // Ring and chain steps go to the next rank and come from the previous one: bigger chunks when
  // both are pipes (shmChunkBytes), the TCP chunk otherwise.
  opChunkBytes_ = elementsPerChunkBytes_;
  if (n_ > 1 && peers_[mod(me_ + 1)]->shm && peers_[mod(me_ - 1)]->shm) opChunkBytes_ = shmChunkBytes(elementsPerChunkBytes_);
  const Request& r = current_;
  PlanShape shape;
  shape.kind = r.kind;
  shape.worldSize = n_;
  shape.rank = me_;
  shape.count = r.count;
  shape.op = r.op;
  shape.root = r.root;
  shape.from = r.from;
  shape.oneHop = r.count * dataTypeSize(r.type) <= options_.smallMessageBytes;
  shape.chunkElements = chunkElements();
  planCollective(shape, plan_);
  applyPlan();
  for (auto& peer : peers_) {
    if (peer && (peer->sendActive || peer->recvActive) && peer->control.left()) {
      fail(Status(StatusCode::kUnavailable,
                  fmt::format("{} needs {}, which closed its communicator (it left the "
                              "group); {}",
                              describeRequest(current_, opNumber_), peer->name, recreateAdvice(options_))));
      return;
    }
  }
  const uint64_t number = opNumber_;
  timer_.expires_after(options_.operationTimeout);
  timer_.async_wait([this, number](const asio::error_code& ec) {
    if (ec || !active_ || number != opNumber_ || !broken_.isOk()) return;
    onTimeout();
  });
  for (auto& peer : peers_) {
    if (!peer) continue;
    pumpWriter(*peer);
    pumpReader(*peer);
  }
}

void TcpCommunicator::activate(int p, bool send, bool recv) {
  Peer& peer = *peers_[p];
  const Request& r = current_;
  WireHeader header;
  header.kind = static_cast<uint8_t>(r.kind == OpKind::kRecv ? OpKind::kSend : r.kind);
  header.type = static_cast<uint8_t>(r.type);
  header.op = static_cast<uint8_t>(r.kind == OpKind::kAllreduce ||
                                           r.kind == OpKind::kReduceScatter
                                       ? r.op
                                       : ReduceOp::kSum);
  header.root = r.kind == OpKind::kBroadcast ? r.root : -1;
  header.count = r.kind == OpKind::kBarrier ? 0 : r.count;
  if (send && !peer.sendActive) {
    peer.sendActive = true;
    peer.outHeader = header;
    peer.outHeader.seq = peer.sendSeq++;
  }
  if (recv && !peer.recvActive) {
    peer.recvActive = true;
    peer.expectedHeader = header;
    peer.expectedHeader.seq = peer.recvSeq++;
  }
}

size_t TcpCommunicator::chunkElements() const {
  return std::max<size_t>(1, opChunkBytes_ / dataTypeSize(current_.type));
}

char* TcpCommunicator::regionData(Region region, int p) {
  const Request& r = current_;
  switch (region) {
    case Region::kInput: return const_cast<char*>(static_cast<const char*>(r.send));
    case Region::kOutput: return static_cast<char*>(r.recv);
    case Region::kWorkspace: return workspace_.data();
    case Region::kScratch: return peers_[p]->scratch.data();
  }
  return nullptr;
}

void TcpCommunicator::applyPlan() {
  const Request& r = current_;
  const size_t elem = dataTypeSize(r.type);
  if (plan_.copy && plan_.copy->count > 0) {
    const char* from = static_cast<const char*>(r.send) + plan_.copy->fromBegin * elem;
    char* to = static_cast<char*>(r.recv) + plan_.copy->toBegin * elem;
    if (from != to) std::memmove(to, from, plan_.copy->count * elem);
  }
  if (plan_.workspaceElements > 0) workspace_.reserve(plan_.workspaceElements * elem);
  events_.assign(static_cast<size_t>(plan_.events), 0);
  for (const PlanLink& link : plan_.links) activate(link.peer, link.send, link.recv);
  for (const PlanSend& send : plan_.sends) {
    peers_[send.peer]->sends.push_back(
        SendItem{regionData(send.from, send.peer) + send.begin * elem, send.count * elem, send.waitEvent});
  }
  for (const PlanRecv& recv : plan_.recvs) {
    RecvItem item{regionData(recv.into, recv.peer) + recv.begin * elem, recv.count * elem, recv.event,
                  nullptr, nullptr, 0, 1};
    if (recv.reduce) {
      item.reduceOut = regionData(recv.reduceInto, recv.peer) + recv.reduceBegin * elem;
      item.local = static_cast<const char*>(r.send) + recv.localBegin * elem;
      item.count = recv.count;
      item.divisor = recv.divisor;
    }
    peers_[recv.peer]->recvs.push_back(item);
  }
}

void TcpCommunicator::directReduce() {
  const Request& r = current_;
  const PlanFinalReduce& reduce = *plan_.finalReduce;
  const size_t elem = dataTypeSize(r.type);
  const size_t bytes = reduce.count * elem;
  if (bytes == 0) return;
  char* out = static_cast<char*>(r.recv);
  const char* self = static_cast<const char*>(r.send) + reduce.selfBegin * elem;
  // The output may be this rank's input: keep a copy, since out is written before x_me is read.
  if (me_ >= 2 && self == out) {
    std::memcpy(selfSlot_.data(), self, bytes);
    self = selfSlot_.data();
  }
  auto source = [&](int p) -> const char* { return p == me_ ? self : peers_[p]->scratch.data(); };
  reduceBuffers(r.type, r.op, out, source(0), source(1), reduce.count, n_ == 2 ? reduce.divisor : 1);
  for (int p = 2; p < n_; ++p) {
    reduceBuffers(r.type, r.op, out, out, source(p), reduce.count, p == n_ - 1 ? reduce.divisor : 1);
  }
}

void TcpCommunicator::watchControl(Peer& peer) {
  peer.control.socket().async_wait(tcp::socket::wait_read, [this, &peer](const asio::error_code& ec) {
    if (!broken_.isOk() || shuttingDown_ || ec == asio::error::operation_aborted) return;
    if (auto failure = drainControl(peer)) {
      fail(std::move(failure->status), failure->cause);
      return;
    }
    // A peer that left cleanly in the middle of an operation that needs it: over TCP its data
    // connection's end fails the operation; a pipe never ends, so fail it here.
    if (peer.control.left() && peer.shm && active_ && (recvsStranded(peer) || sendsStranded(peer))) {
      fail(Status(StatusCode::kUnavailable,
                  fmt::format("{} closed its communicator (it left the group) during {}; {}", peer.name,
                              describeRequest(current_, opNumber_), recreateAdvice(options_))));
      return;
    }
    if (peer.control.isOpen()) watchControl(peer);
  });
}

std::optional<Failure> TcpCommunicator::drainControl(Peer& peer) {
  ControlChannel::Event event = peer.control.drain();
  switch (event.kind) {
    case ControlChannel::Event::Kind::kNothing:
      return std::nullopt;
    case ControlChannel::Event::Kind::kMalformed:
      return Failure{Status(StatusCode::kInternal, fmt::format("{} sent a malformed control message ({}); {}",
                                                               peer.name, event.text, recreateAdvice(options_)))};
    case ControlChannel::Event::Kind::kAborted:
      return Failure{Status(event.code, fmt::format("{} stopped: {}", peer.name, event.text)),
                     FailureCause::kPeerAborted};
    case ControlChannel::Event::Kind::kDied:
      noteDeath(peer.rank);
      break;
  }
  return Failure{Status(StatusCode::kUnavailable,
                        fmt::format("{} closed its connection without a goodbye: the process "
                                    "died or was killed{}; {}",
                                    peer.name,
                                    active_ ? fmt::format(" (during {})", describeRequest(current_, opNumber_)) : "",
                                    recreateAdvice(options_))),
                 FailureCause::kPeerDied};
}

std::string TcpCommunicator::describeWaiting() const {
  if (!active_ || !broken_.isOk()) return "";
  std::string out;
  auto add = [&out](std::string part) { out += (out.empty() ? "" : "; ") + part; };
  for (const auto& peer : peers_) {
    if (!peer) continue;
    if (!peer->recvsDone()) {
      add(peer->headerReceived
              ? fmt::format("{}: {} of {} parts received", peer->name, peer->nextRecv, peer->recvs.size())
              : fmt::format("{}: has not started {}", peer->name, describeRequest(current_, opNumber_)));
    } else if (!peer->sendsDone()) {
      add(fmt::format("{}: {} of {} parts sent", peer->name, peer->nextSend, peer->sends.size()));
    }
  }
  return out;
}

Failure TcpCommunicator::connectionError(const Peer& peer, std::string_view doing, const asio::error_code& ec) {
  if (peer.control.saidGoodbye()) {
    return Failure{Status(StatusCode::kUnavailable,
                          fmt::format("{} closed its communicator (it left the group) while this "
                                      "rank was {} it during {}; {}",
                                      peer.name, doing, describeRequest(current_, opNumber_),
                                      recreateAdvice(options_)))};
  }
  return Failure{Status(StatusCode::kUnavailable,
                        fmt::format("lost the connection to {} while {} it during {} ({}): the "
                                    "peer died, was killed or aborted; {}",
                                    peer.name, doing, describeRequest(current_, opNumber_), ec.message(),
                                    recreateAdvice(options_))),
                 FailureCause::kConnectionLost};
}

void TcpCommunicator::onTimeout() {
  const Peer* waiting = nullptr;
  for (const auto& peer : peers_) {
    if (peer && !peer->recvsDone()) {
      waiting = peer.get();
      break;
    }
  }
  for (const auto& peer : peers_) {
    if (!waiting && peer && !peer->sendsDone()) waiting = peer.get();
  }
  fail(Status(StatusCode::kDeadlineExceeded,
              fmt::format("{} did not finish within {} ms{}; {}", describeRequest(current_, opNumber_),
                          options_.operationTimeout.count(),
                          waiting ? fmt::format("; still waiting for {}", waiting->name) : "",
                          recreateAdvice(options_))));
}

void TcpCommunicator::fail(Status status, FailureCause cause) {
  if (!broken_.isOk()) return;
  std::optional<Status> death, abort;
  for (auto& peer : peers_) {
    if (!peer) continue;
    auto found = drainControl(*peer);
    if (!found) continue;
    if (found->cause == FailureCause::kPeerDied) {
      if (!death) death = std::move(found->status);
    } else if (!abort) {
      abort = std::move(found->status);
    }
  }
  if (cause != FailureCause::kPeerDied && death) {
    status = Status(StatusCode::kUnavailable,
                    fmt::format("{}; also: {}", death->message(), status.message()));
  } else if (abort && cause == FailureCause::kConnectionLost) {
    status = std::move(*abort);  // the data connection ended because the peer aborted: say why
  }
  broken_ = status;
  {
    std::lock_guard lock(healthMutex_);
    health_ = status;
  }
  TROUPE_LOG(kWarning, "group '{}' epoch {} rank {}: {}", options_.group, options_.epoch, me_,
             status.toString());
  stopShmWriters();
  const std::string ourAbort = encodeAbort(status.code(), fmt::format("rank {} of group '{}' epoch {} failed: {}",
                                                                       me_, options_.group, options_.epoch,
                                                                       status.message()));
  for (auto& peer : peers_) {
    if (!peer) continue;
    if (peer->control.isOpen()) peer->control.send(ourAbort);
    closeSockets(*peer);
  }
  timer_.cancel();
  if (active_) {
    active_ = false;
    current_.work->complete(status);
    current_.work.reset();
  }
  for (auto& request : queue_) request.work->complete(status);
  queue_.clear();
}

void TcpCommunicator::stopShmWriters() {
  shmStop_.store(true);
  for (auto& peer : peers_) {
    if (peer && peer->shm) peer->out.wakeProducer();
  }
}

void TcpCommunicator::closeSockets(Peer& peer) {
  asio::error_code ignored;
  peer.data.shutdown(tcp::socket::shutdown_both, ignored);
  peer.control.close();
}

void TcpCommunicator::shutdown() {
  shuttingDown_ = true;
  Status closed(StatusCode::kAborted,
                fmt::format("the communicator of group '{}' epoch {} was destroyed",
                            options_.group, options_.epoch));
  if (active_) current_.work->complete(closed);
  for (auto& request : queue_) request.work->complete(closed);
  queue_.clear();
  active_ = false;
  timer_.cancel();
  stopShmWriters();
  for (auto& peer : peers_) {
    if (!peer) continue;
    if (broken_.isOk() && peer->control.isOpen()) peer->control.send(encodeGoodbye());
    closeSockets(*peer);
  }
}


Result<std::unique_ptr<Communicator>> connectCpuCommunicator(RendezvousStore& store,
                                                             const CommunicatorOptions& options) {
  if (options.chunkBytes < 4096 || options.smallMessageBytes > (size_t{64} << 20)) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("chunkBytes must be >= 4096 (got {}) and smallMessageBytes <= 64 MiB "
                              "(got {})",
                              options.chunkBytes, options.smallMessageBytes));
  }
  auto met = rendezvous(store, options, /*connectMesh=*/true);
  if (!met) return met.status();
  auto shm = setUpSharedMemory(options, met->peers, localHostIdentity(),
                               std::chrono::steady_clock::now() + options.rendezvousTimeout);
  if (!shm) return shm.status();
  return std::unique_ptr<Communicator>(
      std::make_unique<TcpCommunicator>(options, std::move(met).value(), std::move(shm).value()));
}

}  // namespace troupe::collectives
