// The CPU backend's communicator (see tcp_communicator.cc for how it works): the operation engine
// in tcp_communicator.cc, the byte transfers over sockets and shared-memory pipes in
// tcp_transfers.cc. Internal to collectives/; made by connectCpuCommunicator().
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>
#include <asio/steady_timer.hpp>

#include "epoch_watcher.h"
#include "operation.h"
#include "peer.h"
#include "plan.h"
#include "rendezvous.h"
#include "shm_transport.h"
#include "troupe/collectives/communicator.h"

namespace troupe::collectives {

// What a failure means for fail(), which weighs causes by this and never by message text: a
// peer's death outranks what it caused; a peer's ABORT explains a data connection that ended.
enum class FailureCause { kOther, kPeerDied, kPeerAborted, kConnectionLost };
struct Failure {
  Status status;
  FailureCause cause = FailureCause::kOther;
};

class TcpCommunicator final : public Communicator {
 public:
  TcpCommunicator(const CommunicatorOptions& options, RendezvousResult met, std::optional<ShmLink> shm);
  ~TcpCommunicator() override;

  int rank() const override { return me_; }
  int worldSize() const override { return n_; }
  const std::string& group() const override { return options_.group; }
  int64_t epoch() const override { return options_.epoch; }
  Status health() const override;

  // Asked on the I/O thread, which never blocks on a peer, so it answers even mid-hang.
  std::string waitingOn() const override;
  std::vector<int> deadPeers() const override;

  std::shared_ptr<Work> allreduceAsync(const void* send, void* recv, size_t count, DataType type,
                                       ReduceOp op) override;
  std::shared_ptr<Work> reduceScatterAsync(const void* send, void* recv, size_t count,
                                           DataType type, ReduceOp op) override;
  std::shared_ptr<Work> allgatherAsync(const void* send, void* recv, size_t count,
                                       DataType type) override;
  std::shared_ptr<Work> broadcastAsync(void* buffer, size_t count, DataType type, int root) override;
  std::shared_ptr<Work> barrierAsync() override;
  std::shared_ptr<Work> sendAsync(const void* buffer, size_t count, DataType type, int peer) override;
  std::shared_ptr<Work> recvAsync(void* buffer, size_t count, DataType type, int peer) override;
  // Both directions in one operation: the peers' sockets carry them at once.
  std::shared_ptr<Work> sendRecvAsync(const void* send, int to, void* recv, int from, size_t count,
                                      DataType type) override;

 private:
  // ---- Caller side ----

  std::shared_ptr<Work> submit(Request request);

  // ---- I/O thread ----

  void enqueue(Request request);

  // Finishes the current operation when it is done and starts queued ones.
  void advance();
  bool currentDone() const;
  void finishCurrent();
  void startCurrent();

  // ---- Plans (plan.h) into peer items ----

  // Marks `peer` as taking part in the current operation in each direction and prepares the
  // headers: the one we send and the one we expect.
  void activate(int p, bool send, bool recv);
  size_t chunkElements() const;
  int mod(int x) const { return ((x % n_) + n_) % n_; }

  // The bytes a plan's region names, for peer p's scratch.
  char* regionData(Region region, int p);

  // Turns plan_ into the peers' send and receive items over this operation's buffers.
  void applyPlan();

  // out = x_0 op x_1 op ... op x_{n-1} (plan_.finalReduce), x_me being this rank's input, the
  // others in scratch.
  void directReduce();

  // ---- Transfers (tcp_transfers.cc) ----

  void pumpWriter(Peer& peer);

  // The sender thread: copies queued writes into the kernel, so sending overlaps with receiving
  // and reducing on the I/O thread (on loopback a send also runs the receiver's TCP processing,
  // which makes it the most expensive half). It touches only the raw descriptor and the peer's
  // writeIov, which the I/O thread leaves alone while the peer is `writing`; completions go back
  // to the I/O thread. Writes are FIFO across peers: every algorithm here reads from each peer
  // independently of its own writes, so a slow reader cannot block the others forever.
  void senderLoop();

  // Sends peer.writeIov through the peer's pipe or its data socket (see sendIov).
  asio::error_code transmit(Peer& peer, bool block, bool& done);

  // Sends what it can of peer.writeIov, waiting for room only when `block`; what is not sent
  // stays in writeIov. `done` tells whether everything went.
  static asio::error_code sendIov(Peer& peer, bool block, bool& done);
  void onWritten(Peer& peer, const asio::error_code& ec);

  // Reads run as our own loop over non-blocking recv() and readiness waits rather than
  // async_read, so each wait can set SO_RCVLOWAT to what the current item still needs (capped):
  // the kernel then wakes this thread once per chunk instead of once per arriving segment, which
  // matters most when ranks share few cores.
  void pumpReader(Peer& peer);

  // Starts the next read of the plan; false when there is none.
  bool startRead(Peer& peer);
  void readLoop(Peer& peer);
  void setLowWatermark(Peer& peer, size_t bytes);

  // Handles a finished read; false when reading must stop here (a failure, or this peer's part
  // of the operation is done and advance() moved on).
  bool finishRead(Peer& peer);

  // ---- Shared-memory receives ----

  // readLoop's twin for a pipe: copies (or, for a reducing item, reduces) what has been published,
  // in place of the pipe, as it arrives; with nothing there it spins briefly, then arms the
  // doorbell and returns until the waiter thread posts onShmDoorbell.
  void shmReadLoop(Peer& peer);

  // Polls the pipe for up to shmSpin_ (a peer in the middle of a copy publishes again within
  // microseconds; sleeping costs two wake-ups: the waiter thread's, then the I/O thread's).
  // Returns what is available then.
  std::optional<size_t> spinForData(const ShmPipe& pipe) const;

  // The shm waiter thread: sleeps on this rank's doorbell and posts onShmDoorbell whenever a
  // producer rang it. The timeout only lets it notice shmWaiterStop_.
  void shmWaitLoop(uint32_t posted);
  void onShmDoorbell();
  Status shmCorruption(const Peer& peer, std::string_view what);

  // Whether this operation still needs bytes from a pipe peer that left which are not in the pipe.
  // (A peer that finished the operation and left has published everything: not stranded.)
  static bool recvsStranded(const Peer& peer);

  // Whether some of this operation's bytes for a pipe peer that left will never be read: it left
  // bytes in the pipe, or items remain to be written. (Everything written and read, with the
  // completion not yet back from the sender thread, is a finished send, as over TCP.)
  static bool sendsStranded(const Peer& peer);

  // ---- Control channel (control_channel.h) ----

  void watchControl(Peer& peer);

  // What the peer's control connection holds, as the failure it means: an ABORT, a malformed
  // message, or the end of the connection without a goodbye (a goodbye is only noted).
  std::optional<Failure> drainControl(Peer& peer);

  // ---- Failure ----

  // Which peers the current operation still waits for, and how far each direction got: a peer
  // that has not even started this operation is the one to look at.
  std::string describeWaiting() const;
  Failure connectionError(const Peer& peer, std::string_view doing, const asio::error_code& ec);
  void onTimeout();

  // Records the first error, tells every peer, closes everything, fails all operations.
  // A failure noticed one way (a data connection ending, an epoch advance made by the survivors,
  // a peer's ABORT) is first checked against what the control connections already hold, so the
  // error names the rank that died or the root cause a peer reported.
  void fail(Failure failure) { fail(std::move(failure.status), failure.cause); }
  void fail(Status status, FailureCause cause = FailureCause::kOther);
  void noteDeath(int rank);  // any thread
  // A pipe peer's life lock was released (life_locks.h): it died.
  void onLifeLockReleased(const Peer& peer);

  // Ends a write the sender thread may be blocked in on a full pipe.
  void stopShmWriters();
  // The data socket is only shut down here (which ends the sender thread's write on it) and
  // closed by its destructor once the sender thread is gone, so its descriptor is never reused
  // under a write.
  static void closeSockets(Peer& peer);

  // Destruction: operations still pending fail, peers get a goodbye, then every socket closes,
  // which ends io_.run() (nothing else keeps it busy).
  void shutdown();

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
  std::vector<int> deadPeers_;  // under healthMutex_
  // Host mates' death marks beside their life locks (rank, mark): a mate that another rank's
  // watcher found dead is dead here too, even when that rank's ABORT arrived first.
  std::vector<std::pair<int, const std::atomic<uint32_t>*>> deathMarks_;

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

}  // namespace troupe::collectives
