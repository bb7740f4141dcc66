// Same-host transport of the CPU backend (internal to collectives/): ranks on one host move
// operation bytes through shared-memory pipes instead of their TCP data connections.
//
// One segment per host and communicator, created by the host's lowest rank (shm_open, a random
// name, mode 0600, space reserved with posix_fallocate so a full /dev/shm fails the setup
// instead of raising SIGBUS later), mapped pre-faulted by every rank of the host, and unlinked as
// soon as all have mapped it: nothing is left in /dev/shm after the setup, whatever happens later.
// It holds one single-producer single-consumer byte pipe per ordered pair of the host's ranks and
// one doorbell word per rank. A pipe carries exactly the byte stream the TCP data connection
// would (the same headers and items, each started on a 64-byte boundary), so every algorithm and
// its reduction order stay the same and results are bit-identical to TCP.
//
// Wake-ups: a consumer that finds too little data spins briefly, then publishes the position it
// waits for; the producer that reaches it bumps the consumer's doorbell and FUTEX_WAKEs it. A
// producer that finds the pipe full waits on the pipe's own futex word the same way. Every futex
// wait has a timeout, and waiters also watch a local stop flag, so an aborted communicator never
// hangs on a peer that died (its life lock, then its TCP control connection, says so).
//
// Counters read from the segment are the peer's and are checked before use (a position that
// goes backwards or past the capacity is reported as corruption).
//
// Thread-safety: a ShmSegment is immutable after setup. A pipe has one producer thread and one
// consumer thread at a time (the communicator hands each side between its threads with a
// happens-before edge).
#pragma once

#include <pthread.h>
#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "life_locks.h"
#include "rendezvous.h"
#include "troupe/collectives/communicator.h"
#include "troupe/runtime/status.h"

namespace troupe::collectives {

inline constexpr size_t kPipeAlign = 64;        // every item starts on this boundary
inline constexpr size_t kMinPipeBytes = 64 << 10;
inline constexpr size_t kMaxPipeBytes = 16 << 20;
inline constexpr uint64_t kMaxSegmentBytes = uint64_t{1} << 30;

constexpr size_t roundUpToPipeAlign(size_t bytes) { return (bytes + kPipeAlign - 1) & ~(kPipeAlign - 1); }

// This process's host for the transport's purpose: the kernel's boot id and the inode of the
// network namespace. Ranks in different network namespaces count as different hosts (the
// multi-host test bed is built from namespaces). Empty when it cannot be read (never same host).
// Tests split one machine into several hosts with TROUPE_COLLECTIVES_HOST_ID (appended).
std::string localHostIdentity();

// Whether shared memory is allowed here: options.sharedMemory and TROUPE_COLLECTIVES_SHM is not
// "0" (the benchmark's way to force TCP).
bool sharedMemoryEnabled(const CommunicatorOptions& options);

// Blocks the calling thread while *word == expected, for at most `timeout` (a shared futex:
// works across processes mapping the same memory).
void futexWait(std::atomic<uint32_t>& word, uint32_t expected, std::chrono::milliseconds timeout);
void futexWakeAll(std::atomic<uint32_t>& word);

// One pipe's counters: the producer's line and the consumer's line, so each side writes only its
// own cache line on the hot path.
struct PipeControl {
  alignas(64) std::atomic<uint64_t> head;          // bytes published (producer writes)
  std::atomic<uint64_t> consumerWant;              // 0, or the head the consumer sleeps for
  alignas(64) std::atomic<uint64_t> tail;          // bytes consumed (consumer writes)
  std::atomic<uint64_t> producerWant;              // 0, or the tail the producer sleeps for
  std::atomic<uint32_t> tailSeq;                   // the producer's futex word
};
static_assert(sizeof(PipeControl) == 128);

// A view of one pipe in a mapped segment. The producer side keeps its position in `head`, the
// consumer side in `tail` (local copies; the segment's are the published ones).
class ShmPipe {
 public:
  ShmPipe() = default;
  ShmPipe(PipeControl* control, char* data, size_t capacity, std::atomic<uint32_t>* consumerDoorbell)
      : control_(control), data_(data), capacity_(capacity), consumerDoorbell_(consumerDoorbell) {}
  explicit operator bool() const { return control_ != nullptr; }
  size_t capacity() const { return capacity_; }
  PipeControl& control() const { return *control_; }  // the shared counters (tests corrupt them)

  // ---- Producer ----
  enum class WriteResult { kDone, kFull, kStopped, kCorrupt };
  // Copies iovs into the pipe, each entry starting on a kPipeAlign boundary, publishing as it
  // goes (at most kPublishBytes at a time, so the consumer overlaps with the copy). Finished
  // entries are erased from `iovs` and a partly written one is advanced. kFull: no room and not
  // `block`; kStopped: `stop` became true while waiting; kCorrupt: the consumer's position is
  // impossible.
  WriteResult write(std::vector<iovec>& iovs, bool block, const std::atomic<bool>& stop);
  // Wakes a producer blocked in write() (after setting its stop flag).
  void wakeProducer();
  // Bytes published and not consumed, from the shared counters (any thread; 0 when they are
  // impossible).
  size_t unread() const;

  // ---- Consumer ----
  // Bytes published and not yet consumed; nullopt when the producer's position is impossible.
  std::optional<size_t> available() const;
  // Where the next unconsumed byte is, and how many follow it before the pipe wraps.
  const char* peek() const { return data_ + tail_ % capacity_; }
  size_t contiguous() const { return capacity_ - tail_ % capacity_; }
  // Frees `bytes` (a multiple of kPipeAlign, or the rest of an item rounded up to it).
  void consume(size_t bytes);
  // Asks the producer to ring the consumer's doorbell once `bytes` more than the consumer holds
  // are published. Returns false (and asks nothing) when they already are.
  bool armWake(size_t bytes);

 private:
  void publishHead();
  PipeControl* control_ = nullptr;
  char* data_ = nullptr;
  size_t capacity_ = 0;
  std::atomic<uint32_t>* consumerDoorbell_ = nullptr;
  uint64_t head_ = 0;  // producer's
  uint64_t tail_ = 0;  // consumer's
};

// A mapped segment; unmapped when destroyed. Its name was unlinked during the setup.
class ShmSegment {
 public:
  ShmSegment(void* base, size_t bytes, int localCount, size_t pipeBytes);
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  int localCount() const { return localCount_; }
  size_t pipeBytes() const { return pipeBytes_; }
  // The pipe from local rank `from` to local rank `to` (from != to).
  ShmPipe pipe(int from, int to) const;
  // Local rank `local`'s doorbell: producers bump and wake it when they reach its wait.
  std::atomic<uint32_t>& doorbell(int local) const;
  // Local rank `local`'s life lock (life_locks.h): held by that rank while it lives.
  pthread_mutex_t* lifeLock(int local) const;
  std::atomic<uint32_t>* lifeDied(int local) const;  // its death mark, beside it

 private:
  char* base_;
  size_t bytes_;
  int localCount_;
  size_t pipeBytes_;
};

// The ring's chunk between two ranks that both have pipe neighbours: 4 of the TCP chunk, at most
// 1 MiB, never less than `chunkBytes` (measured on 2 CPUs: 64 MB at 2 ranks took 24-32 ms with
// 1 MiB chunks and 33-74 ms with 256 KiB; even at 4 ranks). A multiple of 64 bytes when
// chunkBytes is, so the two ends of a pipe may chunk differently: items still pad only at
// segment ends, where both sides end an item.
size_t shmChunkBytes(size_t chunkBytes);

// The layout's size for `localCount` ranks and pipes of `pipeBytes`; 0 when over
// kMaxSegmentBytes.
uint64_t segmentBytes(int localCount, size_t pipeBytes);
// The pipe size for `localCount` ranks given the ring's chunk size: 4 chunks, within
// [kMinPipeBytes, kMaxPipeBytes] and the segment bound; 0 when no pipe size fits.
size_t pipeBytesFor(int localCount, size_t chunkBytes);

// The setup's outcome for this rank.
struct ShmLink {
  std::shared_ptr<ShmSegment> segment;
  std::unique_ptr<LifeLocks> life;  // this rank's life lock, held; its peers' to watch
  std::vector<int> localRanks;  // the host's ranks, ascending; local index = position
  int myLocal = -1;
  int localOf(int rank) const;  // -1 when `rank` is on another host
};

// Run by every rank after the mesh is connected and before the communicator starts: the ranks
// whose hostId equals this rank's agree, over their data connections, on a segment. The lowest
// creates and offers it, each other opens and checks it and answers, the lowest sends the verdict
// (every rank of the host used it, or none does) and unlinks the name. Returns nullopt when the
// transport is not used here (alone on the host, disabled on some rank of the host, or a rank
// could not map it: those fall back to TCP, logged). Errors: a peer that stops answering or sends
// bytes that are not the handshake (kUnavailable / kDeadlineExceeded).
Result<std::optional<ShmLink>> setUpSharedMemory(const CommunicatorOptions& options,
                                                 std::vector<RendezvousPeer>& peers,
                                                 const std::string& myHostId,
                                                 std::chrono::steady_clock::time_point deadline);

}  // namespace troupe::collectives
