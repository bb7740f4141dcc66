// The NCCL backend: the same Communicator API on CUDA device buffers. The NCCL unique id
// travels through the same (group, epoch) rendezvous in the cluster store (rank 0 creates it).
// An epoch advance, a timeout or an NCCL error aborts the NCCL communicator (ncclCommAbort), so
// waiters fail within about 2 s instead of hanging; then recreate it at epoch + 1.
//
// Built only when CUDA and NCCL are found (see the Meson summary, option gpu_toolkit_dir);
// otherwise connectNcclCommunicator() fails with kFailedPrecondition saying so.
// Thread-safety: as Communicator; operations are enqueued on the communicator's CUDA stream, and
// Work::wait() blocks until the stream reached them. An NCCL Work must be waited on (or dropped)
// before its communicator is destroyed.
#pragma once

#include <memory>

#include "troupe/collectives/communicator.h"

namespace troupe::collectives {

// True when this build has the NCCL backend.
bool ncclBackendBuilt();

// How many CUDA devices this process sees; 0 without a GPU, a driver, or the NCCL backend.
int cudaDeviceCount();

struct NcclOptions {
  int device = 0;  // the CUDA device this rank uses
};

// Joins (group, epoch) on `nccl.device`. Errors: those of connectCpuCommunicator, plus
// kFailedPrecondition (no NCCL backend in this build, or no such CUDA device) and kInternal (an
// NCCL or CUDA call failed, with its message).
Result<std::unique_ptr<Communicator>> connectNcclCommunicator(RendezvousStore& store,
                                                              const CommunicatorOptions& options,
                                                              const NcclOptions& nccl);

}  // namespace troupe::collectives
