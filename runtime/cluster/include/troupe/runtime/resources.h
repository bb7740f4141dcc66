// Resources of this machine and the --resources flag. Thread-safety: plain functions.
#pragma once

#include <string>

#include "troupe/runtime/cluster_store.h"

namespace troupe {

// CPU (cores this process may run on), memory (bytes, MemTotal), GPU (/dev/nvidiaN devices).
Resources detectLocalResources();
// Parses "NAME=QTY,NAME=QTY" (QTY a non-negative number). kInvalidArgument naming the bad item.
Result<Resources> parseResources(const std::string& text);
// Every entry point that takes resource quantities (the CLI, controller RPCs) checks them
// here: names non-empty, quantities finite and in [0, 1e18]. kInvalidArgument naming `what`,
// the resource and the value otherwise (NaN or inf stored in a record would break every reader).
Status checkResources(const Resources& resources, const std::string& what);
// "CPU 2, GPU 0, memory 23.4 GiB, disk_ssd 1" for tables.
std::string formatResources(const Resources& resources);

}  // namespace troupe
