// Internal: copies a snapshot's tensors with their CRC32Cs, on one or more threads.
// Thread-safety: a plain function; it joins the threads it starts before returning.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

namespace troupe::checkpoint {

struct TensorTransfer {
  uint8_t* dst = nullptr;
  const uint8_t* src = nullptr;
  uint64_t size = 0;
};

// Makes sure the destinations' pages exist before they are copied into: a buffer whose sampled
// pages are not resident (fresh memory, never touched) is populated in one madvise call, because
// a page fault per 4 KiB inside a copy of non-temporal stores costs 2-5x more than that here.
// Resident buffers (a model's own tensors) are left alone; the sampling costs microseconds.
void prefaultDestinations(std::span<const TensorTransfer> transfers);

// Copies each transfer and returns its CRC32C. Large totals are cut into pieces shared by
// `threads` threads (the caller's included). With `progress`, copies on the calling thread in
// pieces of 1 MiB and calls it with the bytes done after each (the fault seam's hook).
std::vector<uint32_t> copyTensors(std::span<const TensorTransfer> transfers, unsigned threads,
                                  const std::function<void(uint64_t done)>& progress = {});

}  // namespace troupe::checkpoint
