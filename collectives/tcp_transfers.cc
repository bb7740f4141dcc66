// The byte transfers of the CPU communicator (tcp_communicator.h): per peer, one write and one
// read in flight over its data socket or its shared-memory pipes, the sender thread that copies
// writes into the kernel, and the shm waiter thread that turns a pipe's doorbell into a post to
// the I/O thread. Runs on the communicator's threads; the plan and its events come from
// tcp_communicator.cc.
#include "tcp_communicator.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstring>

#include <asio/post.hpp>
#include <fmt/format.h>

#include "reduce.h"
#include "wire.h"

#include "troupe/runtime/clock.h"

namespace troupe::collectives {

namespace {

using asio::ip::tcp;

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
}  // namespace

void TcpCommunicator::pumpWriter(Peer& peer) {
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

void TcpCommunicator::senderLoop() {
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

asio::error_code TcpCommunicator::transmit(Peer& peer, bool block, bool& done) {
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

asio::error_code TcpCommunicator::sendIov(Peer& peer, bool block, bool& done) {
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

void TcpCommunicator::onWritten(Peer& peer, const asio::error_code& ec) {
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

void TcpCommunicator::pumpReader(Peer& peer) {
  if (peer.reading || !peer.recvActive || !broken_.isOk()) return;
  if (peer.shm) {
    shmReadLoop(peer);
  } else {
    readLoop(peer);
  }
}

bool TcpCommunicator::startRead(Peer& peer) {
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

void TcpCommunicator::readLoop(Peer& peer) {
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

void TcpCommunicator::setLowWatermark(Peer& peer, size_t bytes) {
  const int value = static_cast<int>(std::max<size_t>(bytes, 1));
  if (value == peer.lowWatermark) return;
  ::setsockopt(peer.data.native_handle(), SOL_SOCKET, SO_RCVLOWAT, &value, sizeof(value));
  peer.lowWatermark = value;
}

bool TcpCommunicator::finishRead(Peer& peer) {
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

void TcpCommunicator::shmReadLoop(Peer& peer) {
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

std::optional<size_t> TcpCommunicator::spinForData(const ShmPipe& pipe) const {
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

void TcpCommunicator::shmWaitLoop(uint32_t posted) {
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

void TcpCommunicator::onShmDoorbell() {
  for (auto& peer : peers_) {
    if (!broken_.isOk() || shuttingDown_) return;
    if (peer && peer->shm && peer->shmWaiting) {
      peer->shmWaiting = false;
      if (peer->reading) shmReadLoop(*peer);
    }
  }
}

Status TcpCommunicator::shmCorruption(const Peer& peer, std::string_view what) {
  return Status(StatusCode::kInternal,
                fmt::format("the shared-memory pipe with {} holds an impossible value for {} during {}; {}",
                            peer.name, what, describeRequest(current_, opNumber_), recreateAdvice(options_)));
}

bool TcpCommunicator::recvsStranded(const Peer& peer) {
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

bool TcpCommunicator::sendsStranded(const Peer& peer) {
  if (peer.sendsDone()) return false;
  const size_t inFlight = peer.writing ? peer.writeItems : 0;
  const bool headerPending = !peer.headerSent && !(peer.writing && peer.writeHasHeader);
  return peer.out.unread() > 0 || headerPending || peer.nextSend + inFlight < peer.sends.size();
}

}  // namespace troupe::collectives
