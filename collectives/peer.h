// What the CPU communicator keeps per peer rank: the data connection (or the shared-memory pipes
// that replace it on one host), the control channel, and the peer's part of the current
// operation's plan as send and receive items over the operation's buffers. Internal to
// collectives/; owned and used by the communicator's I/O thread (the sender thread borrows
// writeIov while `writing`).
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include <asio/buffer.hpp>
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>

#include "control_channel.h"
#include "shm_transport.h"
#include "wire.h"

namespace troupe::collectives {

// 64-byte aligned, pre-faulted memory allocated once (no first-touch faults on the hot path).
class AlignedBuffer {
 public:
  void reserve(size_t bytes) {
    if (bytes <= size_) return;
    data_.reset(static_cast<char*>(::operator new[](bytes, std::align_val_t(64))));
    std::memset(data_.get(), 0, bytes);
    size_ = bytes;
  }
  char* data() { return data_.get(); }

 private:
  struct Deleter {
    void operator()(char* p) const { ::operator delete[](p, std::align_val_t(64)); }
  };
  std::unique_ptr<char[], Deleter> data_;
  size_t size_ = 0;
};

struct SendItem {
  const char* data;
  size_t bytes;
  int32_t waitEvent;  // -1: ready at once
};

struct RecvItem {
  char* dst;
  size_t bytes;
  int32_t event;  // -1: none
  // When reduceOut is set: reduceOut[i] = local[i] op dst[i] for `count` elements.
  char* reduceOut;
  const char* local;
  size_t count;
  int divisor;
};

// One peer: its two connections and its part of the current plan. Owned by the I/O thread.
struct Peer {
  Peer(asio::io_context& io, int rank, std::string name)
      : rank(rank), name(std::move(name)), data(io), control(io) {}

  int rank;
  std::string name;
  asio::ip::tcp::socket data;
  ControlChannel control;
  uint64_t sendSeq = 0;
  uint64_t recvSeq = 0;
  AlignedBuffer scratch;

  // The current plan.
  bool sendActive = false, recvActive = false;
  bool headerSent = false, headerReceived = false;
  WireHeader outHeader, inHeader, expectedHeader;
  std::vector<SendItem> sends;
  std::vector<RecvItem> recvs;
  size_t nextSend = 0, nextRecv = 0;
  bool writing = false, reading = false;
  bool writeHasHeader = false, readIsHeader = false;
  char* readPtr = nullptr;
  size_t readLeft = 0;
  int lowWatermark = 1;  // the data socket's SO_RCVLOWAT
  size_t writeItems = 0;
  std::vector<asio::const_buffer> writeBuffers;
  std::vector<iovec> writeIov;  // the sender thread's copy of writeBuffers while `writing`
  int dataFd = -1;              // data.native_handle(), for the sender thread

  // Same host: the data goes through these pipes instead of `data` (which stays open, unused).
  bool shm = false;
  ShmPipe out, in;
  bool shmWaiting = false;  // a read armed the doorbell and waits for the waiter's post

  void resetPlan() {
    sendActive = recvActive = headerSent = headerReceived = false;
    sends.clear();
    recvs.clear();
    nextSend = nextRecv = 0;
  }
  bool sendsDone() const {
    return !sendActive || (headerSent && nextSend == sends.size() && !writing);
  }
  bool recvsDone() const {
    return !recvActive || (headerReceived && nextRecv == recvs.size() && !reading);
  }
};

}  // namespace troupe::collectives
