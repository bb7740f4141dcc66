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
#include <asio/ip/tcp.hpp>
#include <asio/post.hpp>
#include <asio/steady_timer.hpp>

#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <atomic>
#include <cerrno>
#include <optional>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <mutex>
#include <new>
#include <thread>

#include <fmt/format.h>

#include "control_channel.h"
#include "epoch_watcher.h"
#include "operation.h"
#include "peer.h"
#include "plan.h"
#include "reduce.h"
#include "rendezvous.h"
#include "shm_transport.h"
#include "wire.h"
#include "troupe/collectives/communicator.h"
#include "troupe/runtime/logging.h"
#include "troupe/runtime/metrics.h"

namespace troupe::collectives {

namespace {

using asio::ip::tcp;
using Clock = std::chrono::steady_clock;

tcp protocolOf(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  return address.ss_family == AF_INET6 ? tcp::v6() : tcp::v4();
}

constexpr size_t kMaxGatherItems = 16;      // buffers per writev
constexpr size_t kMaxWriteBytes = 4 << 20;  // bytes per write, so events are checked often
constexpr size_t kLowWatermarkCap = 256 << 10;  // wake a reader for at most this much data
constexpr size_t kInlineWriteBytes = 64 << 10;  // smaller writes skip the sender thread
inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
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

// What a failure means for fail(), which weighs causes by this and never by message text: a
// peer's death outranks what it caused; a peer's ABORT explains a data connection that ended.
enum class FailureCause { kOther, kPeerDied, kPeerAborted, kConnectionLost };
struct Failure {
  Status status;
  FailureCause cause = FailureCause::kOther;
};

class TcpCommunicator final : public Communicator {
 public:
  TcpCommunicator(const CommunicatorOptions& options, RendezvousResult met, std::optional<ShmLink> shm)
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
  }

  ~TcpCommunicator() override {
    epochWatcher_.reset();  // joins its thread, which may post to io_
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

  int rank() const override { return me_; }
  int worldSize() const override { return n_; }
  const std::string& group() const override { return options_.group; }
  int64_t epoch() const override { return options_.epoch; }
  Status health() const override {
    std::lock_guard lock(healthMutex_);
    return health_;
  }

  // Asked on the I/O thread, which never blocks on a peer, so it answers even mid-hang.
  std::string waitingOn() const override {
    auto answer = std::make_shared<std::promise<std::string>>();
    auto result = answer->get_future();
    asio::post(io_, [this, answer] { answer->set_value(describeWaiting()); });
    if (result.wait_for(std::chrono::seconds(1)) != std::future_status::ready) return "";
    return result.get();
  }

  std::shared_ptr<Work> allreduceAsync(const void* send, void* recv, size_t count, DataType type,
                                       ReduceOp op) override {
    return submit(Request{OpKind::kAllreduce, send, recv, count, type, op, -1, nullptr});
  }
  std::shared_ptr<Work> reduceScatterAsync(const void* send, void* recv, size_t count,
                                           DataType type, ReduceOp op) override {
    return submit(Request{OpKind::kReduceScatter, send, recv, count, type, op, -1, nullptr});
  }
  std::shared_ptr<Work> allgatherAsync(const void* send, void* recv, size_t count,
                                       DataType type) override {
    return submit(
        Request{OpKind::kAllgather, send, recv, count, type, ReduceOp::kSum, -1, nullptr});
  }
  std::shared_ptr<Work> broadcastAsync(void* buffer, size_t count, DataType type,
                                       int root) override {
    return submit(Request{OpKind::kBroadcast, buffer, buffer, count, type, ReduceOp::kSum, root,
                          nullptr});
  }
  std::shared_ptr<Work> barrierAsync() override {
    return submit(Request{OpKind::kBarrier, nullptr, nullptr, 0, DataType::kFloat32,
                          ReduceOp::kSum, -1, nullptr});
  }
  std::shared_ptr<Work> sendAsync(const void* buffer, size_t count, DataType type,
                                  int peer) override {
    return submit(
        Request{OpKind::kSend, buffer, nullptr, count, type, ReduceOp::kSum, peer, nullptr});
  }
  std::shared_ptr<Work> recvAsync(void* buffer, size_t count, DataType type, int peer) override {
    return submit(
        Request{OpKind::kRecv, nullptr, buffer, count, type, ReduceOp::kSum, peer, nullptr});
  }
  // Both directions in one operation: the peers' sockets carry them at once.
  std::shared_ptr<Work> sendRecvAsync(const void* send, int to, void* recv, int from, size_t count,
                                      DataType type) override {
    return submit(Request{OpKind::kSendRecv, send, recv, count, type, ReduceOp::kSum, to, nullptr, from});
  }

 private:
  // ---- Caller side ----

  std::shared_ptr<Work> submit(Request request) {
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

  // ---- I/O thread ----

  void enqueue(Request request) {
    if (!broken_.isOk()) {
      request.work->complete(broken_);
      return;
    }
    queue_.push_back(std::move(request));
    advance();
  }

  // Finishes the current operation when it is done and starts queued ones.
  void advance() {
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

  bool currentDone() const {
    for (const auto& peer : peers_) {
      if (peer && (!peer->sendsDone() || !peer->recvsDone())) return false;
    }
    return true;
  }

  void finishCurrent() {
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

  void startCurrent() {
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

  // ---- Plans (plan.h) into peer items ----

  // Marks `peer` as taking part in the current operation in each direction and prepares the
  // headers: the one we send and the one we expect.
  void activate(int p, bool send, bool recv) {
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

  size_t chunkElements() const {
    return std::max<size_t>(1, opChunkBytes_ / dataTypeSize(current_.type));
  }

  int mod(int x) const { return ((x % n_) + n_) % n_; }

  // The bytes a plan's region names, for peer p's scratch.
  char* regionData(Region region, int p) {
    const Request& r = current_;
    switch (region) {
      case Region::kInput: return const_cast<char*>(static_cast<const char*>(r.send));
      case Region::kOutput: return static_cast<char*>(r.recv);
      case Region::kWorkspace: return workspace_.data();
      case Region::kScratch: return peers_[p]->scratch.data();
    }
    return nullptr;
  }

  // Turns plan_ into the peers' send and receive items over this operation's buffers.
  void applyPlan() {
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

  // out = x_0 op x_1 op ... op x_{n-1} (plan_.finalReduce), x_me being this rank's input, the
  // others in scratch.
  void directReduce() {
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

  // ---- Transfers ----

  void pumpWriter(Peer& peer) {
    if (peer.writing || !peer.sendActive || !broken_.isOk()) return;
    peer.writeBuffers.clear();
    peer.writeHasHeader = !peer.headerSent;
    if (peer.writeHasHeader) {
      peer.writeBuffers.push_back(asio::buffer(&peer.outHeader, sizeof(WireHeader)));
    }
    size_t items = 0, bytes = 0;
    for (size_t i = peer.nextSend; i < peer.sends.size(); ++i) {
      const SendItem& item = peer.sends[i];
      if (items == kMaxGatherItems || bytes >= kMaxWriteBytes) break;
      if (item.waitEvent >= 0 && events_[item.waitEvent] == 0) break;
      peer.writeBuffers.push_back(asio::buffer(item.data, item.bytes));
      bytes += item.bytes;
      ++items;
    }
    if (items == 0 && !peer.writeHasHeader) return;
    peer.writing = true;
    peer.writeItems = items;
    peer.writeIov.clear();
    for (const asio::const_buffer& buffer : peer.writeBuffers) {
      peer.writeIov.push_back(iovec{const_cast<void*>(buffer.data()), buffer.size()});
    }
    // Small writes go out at once from this thread: handing them to the sender thread would
    // add a wake-up to every small message's latency. What does not fit goes to the sender.
    if (bytes <= kInlineWriteBytes) {
      bool done = false;
      const asio::error_code ec = transmit(peer, /*block=*/false, done);
      if (ec || done) {
        asio::post(io_, [this, &peer, ec] { onWritten(peer, ec); });
        return;
      }
    }
    {
      std::lock_guard lock(sendMutex_);
      sendQueue_.push_back(&peer);
    }
    sendReady_.notify_one();
  }

  // The sender thread: copies queued writes into the kernel, so sending overlaps with receiving
  // and reducing on the I/O thread (on loopback a send also runs the receiver's TCP processing,
  // which makes it the most expensive half). It touches only the raw descriptor and the peer's
  // writeIov, which the I/O thread leaves alone while the peer is `writing`; completions go back
  // to the I/O thread. Writes are FIFO across peers: every algorithm here reads from each peer
  // independently of its own writes, so a slow reader cannot block the others forever.
  void senderLoop() {
    for (;;) {
      Peer* peer = nullptr;
      {
        std::unique_lock lock(sendMutex_);
        sendReady_.wait(lock, [this] { return sendStop_ || !sendQueue_.empty(); });
        if (sendQueue_.empty()) return;
        peer = sendQueue_.front();
        sendQueue_.pop_front();
      }
      bool done = false;
      const asio::error_code ec = transmit(*peer, /*block=*/true, done);
      asio::post(io_, [this, peer, ec] { onWritten(*peer, ec); });
    }
  }

  // Sends peer.writeIov through the peer's pipe or its data socket (see sendIov).
  asio::error_code transmit(Peer& peer, bool block, bool& done) {
    if (!peer.shm) return sendIov(peer, block, done);
    const ShmPipe::WriteResult result = peer.out.write(peer.writeIov, block, shmStop_);
    done = result == ShmPipe::WriteResult::kDone;
    switch (result) {
      case ShmPipe::WriteResult::kDone:
      case ShmPipe::WriteResult::kFull: return {};
      case ShmPipe::WriteResult::kStopped: return asio::error::operation_aborted;
      case ShmPipe::WriteResult::kCorrupt: return std::make_error_code(std::errc::protocol_error);
    }
    return {};
  }

  // Sends what it can of peer.writeIov, waiting for room only when `block`; what is not sent
  // stays in writeIov. `done` tells whether everything went.
  static asio::error_code sendIov(Peer& peer, bool block, bool& done) {
    std::vector<iovec>& iovs = peer.writeIov;
    size_t first = 0;
    asio::error_code result;
    while (first < iovs.size()) {
      msghdr message{};
      message.msg_iov = iovs.data() + first;
      message.msg_iovlen = iovs.size() - first;
      const ssize_t n = ::sendmsg(peer.dataFd, &message, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n >= 0) {
        size_t sent = static_cast<size_t>(n);
        while (first < iovs.size() && sent >= iovs[first].iov_len) {
          sent -= iovs[first].iov_len;
          ++first;
        }
        if (first < iovs.size()) {
          iovs[first].iov_base = static_cast<char*>(iovs[first].iov_base) + sent;
          iovs[first].iov_len -= sent;
        }
        continue;
      }
      if (errno == EINTR) continue;
      if ((errno == EAGAIN || errno == EWOULDBLOCK) && block) {
        // A failure shuts the socket down, which ends this wait too.
        pollfd pfd{peer.dataFd, POLLOUT, 0};
        ::poll(&pfd, 1, -1);
        continue;
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        result = asio::error_code(errno, asio::system_category());
      }
      break;
    }
    iovs.erase(iovs.begin(), iovs.begin() + static_cast<ptrdiff_t>(first));
    done = iovs.empty();
    return result;
  }

  void onWritten(Peer& peer, const asio::error_code& ec) {
    if (!broken_.isOk() || shuttingDown_) return;
    if (ec == std::errc::protocol_error && peer.shm) {
      fail(shmCorruption(peer, "its consumer position"));
      return;
    }
    if (ec) {
      fail(connectionError(peer, "sending to", ec));
      return;
    }
    peer.writing = false;
    if (peer.writeHasHeader) peer.headerSent = true;
    peer.nextSend += peer.writeItems;
    if (peer.sendsDone()) {
      advance();
    } else {
      pumpWriter(peer);
    }
  }

  // Reads run as our own loop over non-blocking recv() and readiness waits rather than
  // async_read, so each wait can set SO_RCVLOWAT to what the current item still needs (capped):
  // the kernel then wakes this thread once per chunk instead of once per arriving segment, which
  // matters most when ranks share few cores.
  void pumpReader(Peer& peer) {
    if (peer.reading || !peer.recvActive || !broken_.isOk()) return;
    if (peer.shm) {
      shmReadLoop(peer);
    } else {
      readLoop(peer);
    }
  }

  // Starts the next read of the plan; false when there is none.
  bool startRead(Peer& peer) {
    peer.readIsHeader = !peer.headerReceived;
    if (peer.readIsHeader) {
      peer.readPtr = reinterpret_cast<char*>(&peer.inHeader);
      peer.readLeft = sizeof(WireHeader);
    } else if (peer.nextRecv < peer.recvs.size()) {
      const RecvItem& item = peer.recvs[peer.nextRecv];
      peer.readPtr = item.dst;
      peer.readLeft = item.bytes;
    } else {
      return false;
    }
    peer.reading = true;
    return true;
  }

  void readLoop(Peer& peer) {
    for (;;) {
      if (!peer.reading && !startRead(peer)) return;
      while (peer.readLeft > 0) {
        const ssize_t n = ::recv(peer.data.native_handle(), peer.readPtr, peer.readLeft,
                                 MSG_DONTWAIT);
        if (n > 0) {
          peer.readPtr += n;
          peer.readLeft -= static_cast<size_t>(n);
          continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
          setLowWatermark(peer, std::min(peer.readLeft, kLowWatermarkCap));
          peer.data.async_wait(tcp::socket::wait_read, [this, &peer](const asio::error_code& ec) {
            if (!broken_.isOk()) return;
            if (ec) {
              fail(connectionError(peer, "receiving from", ec));
              return;
            }
            readLoop(peer);
          });
          return;
        }
        fail(connectionError(peer, "receiving from",
                             n == 0 ? asio::error_code(asio::error::eof)
                                    : asio::error_code(errno, asio::system_category())));
        return;
      }
      peer.reading = false;
      if (!finishRead(peer)) return;
    }
  }

  void setLowWatermark(Peer& peer, size_t bytes) {
    const int value = static_cast<int>(std::max<size_t>(bytes, 1));
    if (value == peer.lowWatermark) return;
    ::setsockopt(peer.data.native_handle(), SOL_SOCKET, SO_RCVLOWAT, &value, sizeof(value));
    peer.lowWatermark = value;
  }

  // Handles a finished read; false when reading must stop here (a failure, or this peer's part
  // of the operation is done and advance() moved on).
  bool finishRead(Peer& peer) {
    if (peer.readIsHeader) {
      if (!(peer.inHeader == peer.expectedHeader)) {
        fail(Status(StatusCode::kFailedPrecondition,
                    fmt::format("operation mismatch with {}: this rank issued {} but the peer "
                                "sent {}; every rank must issue the same collectives (and "
                                "matching send/recv) in the same order; {}",
                                peer.name, describeHeader(peer.expectedHeader),
                                peer.inHeader.magic == kWireMagic
                                    ? describeHeader(peer.inHeader)
                                    : std::string("bytes that are not a Troupe header"),
                                recreateAdvice(options_))));
        return false;
      }
      peer.headerReceived = true;
    } else {
      const RecvItem& item = peer.recvs[peer.nextRecv++];
      if (item.reduceOut != nullptr && !peer.shm) {  // a pipe's items are reduced as they are read
        reduceBuffers(current_.type, current_.op, item.reduceOut, item.local, item.dst,
                      item.count, item.divisor);
      }
      if (item.event >= 0) {
        events_[item.event] = 1;
        for (auto& other : peers_) {
          if (other) pumpWriter(*other);
        }
        if (!broken_.isOk()) return false;
      }
    }
    if (peer.recvsDone()) {
      advance();
      return false;
    }
    return true;
  }

  // ---- Shared-memory receives ----

  // readLoop's twin for a pipe: copies (or, for a reducing item, reduces) what has been published,
  // in place of the pipe, as it arrives; with nothing there it spins briefly, then arms the
  // doorbell and returns until the waiter thread posts onShmDoorbell.
  void shmReadLoop(Peer& peer) {
    ShmPipe& pipe = peer.in;
    for (;;) {
      if (!peer.reading && !startRead(peer)) return;
      while (peer.readLeft > 0) {
        std::optional<size_t> available = pipe.available();
        if (!available) {
          fail(shmCorruption(peer, "its producer position"));
          return;
        }
        if (*available == 0) {
          available = spinForData(pipe);
          if (!available) {
            fail(shmCorruption(peer, "its producer position"));
            return;
          }
          if (*available == 0) {
            const size_t want = std::min({roundUpToPipeAlign(peer.readLeft), kLowWatermarkCap, pipe.capacity() / 2});
            if (pipe.armWake(want)) {
              peer.shmWaiting = true;
              return;
            }
            continue;
          }
        }
        const size_t n = std::min({*available, pipe.contiguous(), peer.readLeft});
        const RecvItem* item = peer.readIsHeader ? nullptr : &peer.recvs[peer.nextRecv];
        if (item != nullptr && item->reduceOut != nullptr) {
          const size_t elem = dataTypeSize(current_.type);
          const size_t offset = item->bytes - peer.readLeft;
          reduceBuffers(current_.type, current_.op, item->reduceOut + offset, item->local + offset, pipe.peek(),
                        n / elem, item->divisor);
        } else {
          std::memcpy(peer.readPtr, pipe.peek(), n);
          peer.readPtr += n;
        }
        peer.readLeft -= n;
        pipe.consume(peer.readLeft == 0 ? roundUpToPipeAlign(n) : n);
      }
      peer.reading = false;
      if (!finishRead(peer)) return;
    }
  }

  // Polls the pipe for up to shmSpin_ (a peer in the middle of a copy publishes again within
  // microseconds; sleeping costs two wake-ups: the waiter thread's, then the I/O thread's).
  // Returns what is available then.
  std::optional<size_t> spinForData(const ShmPipe& pipe) const {
    const auto until = Clock::now() + shmSpin_;
    for (;;) {
      for (int i = 0; i < 64; ++i) {
        std::optional<size_t> available = pipe.available();
        if (!available || *available > 0) return available;
        cpuRelax();
      }
      if (Clock::now() >= until) return size_t{0};
    }
  }

  // The shm waiter thread: sleeps on this rank's doorbell and posts onShmDoorbell whenever a
  // producer rang it. The timeout only lets it notice shmWaiterStop_.
  void shmWaitLoop(uint32_t posted) {
    std::atomic<uint32_t>& bell = shm_->segment->doorbell(shm_->myLocal);
    while (!shmWaiterStop_.load()) {
      const uint32_t now = bell.load();
      if (now != posted) {
        posted = now;
        asio::post(io_, [this] { onShmDoorbell(); });
      }
      futexWait(bell, now, std::chrono::milliseconds(200));
    }
  }

  void onShmDoorbell() {
    for (auto& peer : peers_) {
      if (!broken_.isOk() || shuttingDown_) return;
      if (peer && peer->shm && peer->shmWaiting) {
        peer->shmWaiting = false;
        if (peer->reading) shmReadLoop(*peer);
      }
    }
  }

  Status shmCorruption(const Peer& peer, std::string_view what) {
    return Status(StatusCode::kInternal,
                  fmt::format("the shared-memory pipe with {} holds an impossible value for {} during {}; {}",
                              peer.name, what, describeRequest(current_, opNumber_), recreateAdvice(options_)));
  }

  // Whether this operation still needs bytes from a pipe peer that left which are not in the pipe.
  // (A peer that finished the operation and left has published everything: not stranded.)
  static bool recvsStranded(const Peer& peer) {
    if (peer.recvsDone()) return false;
    size_t needed = 0;
    size_t next = peer.nextRecv;
    if (peer.reading) {
      needed += roundUpToPipeAlign(peer.readLeft);
      if (!peer.readIsHeader) ++next;
    } else if (!peer.headerReceived) {
      needed += roundUpToPipeAlign(sizeof(WireHeader));
    }
    for (size_t i = next; i < peer.recvs.size(); ++i) needed += roundUpToPipeAlign(peer.recvs[i].bytes);
    const std::optional<size_t> available = peer.in.available();
    return !available || *available < needed;
  }

  // Whether some of this operation's bytes for a pipe peer that left will never be read: it left
  // bytes in the pipe, or items remain to be written. (Everything written and read, with the
  // completion not yet back from the sender thread, is a finished send, as over TCP.)
  static bool sendsStranded(const Peer& peer) {
    if (peer.sendsDone()) return false;
    const size_t inFlight = peer.writing ? peer.writeItems : 0;
    const bool headerPending = !peer.headerSent && !(peer.writing && peer.writeHasHeader);
    return peer.out.unread() > 0 || headerPending || peer.nextSend + inFlight < peer.sends.size();
  }

  // ---- Control channel (control_channel.h) ----

  void watchControl(Peer& peer) {
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

  // What the peer's control connection holds, as the failure it means: an ABORT, a malformed
  // message, or the end of the connection without a goodbye (a goodbye is only noted).
  std::optional<Failure> drainControl(Peer& peer) {
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

  // ---- Failure ----

  // Which peers the current operation still waits for, and how far each direction got: a peer
  // that has not even started this operation is the one to look at.
  std::string describeWaiting() const {
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

  Failure connectionError(const Peer& peer, std::string_view doing, const asio::error_code& ec) {
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

  void onTimeout() {
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

  // Records the first error, tells every peer, closes everything, fails all operations.
  // A failure noticed one way (a data connection ending, an epoch advance made by the survivors,
  // a peer's ABORT) is first checked against what the control connections already hold, so the
  // error names the rank that died or the root cause a peer reported.
  void fail(Failure failure) { fail(std::move(failure.status), failure.cause); }
  void fail(Status status, FailureCause cause = FailureCause::kOther) {
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

  // The data socket is only shut down here (which ends the sender thread's write on it) and
  // closed by its destructor once the sender thread is gone, so its descriptor is never reused
  // under a write.
  // Ends a write the sender thread may be blocked in on a full pipe.
  void stopShmWriters() {
    shmStop_.store(true);
    for (auto& peer : peers_) {
      if (peer && peer->shm) peer->out.wakeProducer();
    }
  }

  static void closeSockets(Peer& peer) {
    asio::error_code ignored;
    peer.data.shutdown(tcp::socket::shutdown_both, ignored);
    peer.control.close();
  }

  // Destruction: operations still pending fail, peers get a goodbye, then every socket closes,
  // which ends io_.run() (nothing else keeps it busy).
  void shutdown() {
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

  const CommunicatorOptions options_;
  const int n_;
  const int me_;
  const size_t elementsPerChunkBytes_;

  // Declared before everything holding sockets or timers, so it is destroyed after them.
  mutable asio::io_context io_;  // mutable: const queries (waitingOn) post to it
  asio::executor_work_guard<asio::io_context::executor_type> keepRunning_{io_.get_executor()};
  asio::steady_timer timer_;
  std::vector<std::unique_ptr<Peer>> peers_;  // by rank; null for this rank

  // I/O thread only.
  std::deque<Request> queue_;
  Request current_;
  bool active_ = false;
  bool shuttingDown_ = false;
  uint64_t opNumber_ = 0;
  std::chrono::steady_clock::time_point opStarted_;
  std::vector<uint8_t> events_;
  Status broken_;
  size_t opChunkBytes_ = 0;  // the current operation's ring chunk
  CollectivePlan plan_;      // the current operation's
  AlignedBuffer selfSlot_;
  AlignedBuffer workspace_;

  mutable std::mutex healthMutex_;
  Status health_;  // a copy of broken_ for other threads

  std::thread ioThread_;
  std::unique_ptr<EpochWatcher> epochWatcher_;

  // The sender thread's queue: peers whose writeIov is ready to go.
  std::mutex sendMutex_;
  std::condition_variable sendReady_;
  std::deque<Peer*> sendQueue_;
  bool sendStop_ = false;
  std::thread sender_;

  // Shared memory with the ranks on this host (none: all TCP). The segment outlives every thread
  // that touches it (they are joined in the destructor, before members go).
  std::optional<ShmLink> shm_;
  std::atomic<bool> shmStop_{false};  // set by fail() and shutdown(): blocked pipe writes give up
  std::atomic<bool> shmWaiterStop_{false};
  std::thread shmWaiter_;
  std::chrono::microseconds shmSpin_{0};
};

}  // namespace

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
