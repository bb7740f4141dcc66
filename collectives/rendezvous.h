// Rendezvous of the CPU backend (internal to collectives/): every rank publishes a listening
// address in the store under (group, epoch), waits for all ranks, and builds a full mesh of
// TCP connections, two per pair of ranks: `data` carries operations, `control` carries only
// goodbyes and aborts and is read at all times, so a dead peer is noticed even while idle.
// Thread-safety: runs on the caller's thread; the result is handed to one communicator.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "troupe/collectives/communicator.h"
#include "troupe/runtime/rendezvous_store.h"

namespace troupe::collectives {

// An owned file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept;
  ~Fd();
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// One peer as met at the rendezvous.
struct RendezvousPeer {
  int rank = -1;
  std::string name;  // "rank 2 (pid 4242 on host, 127.0.0.1:40123)", for error messages
  std::string hostId;  // its localHostIdentity() (shm_transport.h); empty: unknown
  Fd data;
  Fd control;
};

struct RendezvousResult {
  std::vector<RendezvousPeer> peers;  // indexed by rank; this rank's entry has no sockets
  std::unique_ptr<GroupEpochWatch> watch;
};

// Validates `options`, opens the epoch watch, advances the group's epoch to options.epoch
// (kAborted if the group is already past it), publishes this rank and connects the mesh.
// `extra` travels in this rank's entry (the NCCL backend puts its unique id there) and comes
// back in `extras` (by rank) when not null.
Result<RendezvousResult> rendezvous(RendezvousStore& store, const CommunicatorOptions& options,
                                    bool connectMesh, const std::string& extra = "",
                                    std::vector<std::string>* extras = nullptr);

// Blocking-with-deadline transfers on a non-blocking descriptor (the mesh's sockets before the
// communicator takes them). kDeadlineExceeded when the deadline passes, kUnavailable when the
// connection fails or ends.
Status sendAllBefore(int fd, const void* data, size_t size, std::chrono::steady_clock::time_point deadline);
Status recvAllBefore(int fd, void* data, size_t size, std::chrono::steady_clock::time_point deadline);

// The message suffix every error of a broken communicator ends with.
std::string recreateAdvice(const CommunicatorOptions& options);

}  // namespace troupe::collectives
