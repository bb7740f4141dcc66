// Stands in for nccl_communicator.cc in builds without CUDA + NCCL (see the Meson summary).
#include <fmt/format.h>

#include "troupe/collectives/nccl_communicator.h"

namespace troupe::collectives {

bool ncclBackendBuilt() { return false; }
int cudaDeviceCount() { return 0; }

Result<std::unique_ptr<Communicator>> connectNcclCommunicator(RendezvousStore&,
                                                              const CommunicatorOptions& options,
                                                              const NcclOptions&) {
  return Status(StatusCode::kFailedPrecondition,
                fmt::format("group '{}': this build has no NCCL backend (CUDA and NCCL were not "
                            "found at configure time; point -Dgpu_toolkit_dir at them and "
                            "reconfigure)",
                            options.group));
}

}  // namespace troupe::collectives
