#include "copy_tensors.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

#include "troupe/checkpoint/checksum.h"

namespace troupe::checkpoint {
namespace {

constexpr uint64_t kPiece = uint64_t(32) << 20;
constexpr uint64_t kProgressPiece = uint64_t(1) << 20;
// Below this a second thread costs more than it saves.
constexpr uint64_t kParallelMin = uint64_t(64) << 20;

struct Piece {
  size_t transfer;
  uint64_t offset;
  uint64_t size;
  uint32_t crc = 0;
};

#ifdef MADV_POPULATE_WRITE
constexpr int kMadvPopulateWrite = MADV_POPULATE_WRITE;
#else
constexpr int kMadvPopulateWrite = 23;
#endif
constexpr uint64_t kPrefaultMin = uint64_t(1) << 20;

// True when the page holding `p` is resident.
bool resident(const uint8_t* p, uintptr_t pageSize) {
  auto page = reinterpret_cast<uintptr_t>(p) & ~(pageSize - 1);
  unsigned char in = 0;
  return mincore(reinterpret_cast<void*>(page), 1, &in) == 0 && (in & 1u);
}

}  // namespace

void prefaultDestinations(std::span<const TensorTransfer> transfers) {
  static const uintptr_t pageSize = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  for (const auto& t : transfers) {
    if (t.size < kPrefaultMin) continue;
    if (resident(t.dst, pageSize) && resident(t.dst + t.size / 2, pageSize) && resident(t.dst + t.size - 1, pageSize)) {
      continue;
    }
    // The whole pages inside the buffer (its first and last may be shared with other data).
    auto begin = (reinterpret_cast<uintptr_t>(t.dst) + pageSize - 1) & ~(pageSize - 1);
    auto end = (reinterpret_cast<uintptr_t>(t.dst) + t.size) & ~(pageSize - 1);
    if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, kMadvPopulateWrite);
  }
}

std::vector<uint32_t> copyTensors(std::span<const TensorTransfer> transfers, unsigned threads,
                                  const std::function<void(uint64_t done)>& progress) {
  std::vector<uint32_t> crcs(transfers.size(), 0);
  uint64_t total = 0;
  for (const auto& t : transfers) total += t.size;
  if (progress) {
    uint64_t done = 0;
    for (size_t i = 0; i < transfers.size(); ++i) {
      const auto& t = transfers[i];
      for (uint64_t off = 0; off < t.size; off += kProgressPiece) {
        uint64_t n = std::min(kProgressPiece, t.size - off);
        crcs[i] = copyWithCrc32c(t.dst + off, t.src + off, n, crcs[i]);
        done += n;
        progress(done);
      }
    }
    return crcs;
  }
  if (threads <= 1 || total < kParallelMin) {
    for (size_t i = 0; i < transfers.size(); ++i) {
      crcs[i] = copyWithCrc32c(transfers[i].dst, transfers[i].src, transfers[i].size);
    }
    return crcs;
  }
  std::vector<Piece> pieces;
  for (size_t i = 0; i < transfers.size(); ++i) {
    for (uint64_t off = 0; off < transfers[i].size; off += kPiece) {
      pieces.push_back(Piece{i, off, std::min(kPiece, transfers[i].size - off)});
    }
  }
  // Contiguous runs of pieces of about equal bytes, one per thread.
  std::vector<size_t> bounds{0};
  uint64_t share = (total + threads - 1) / threads, acc = 0;
  for (size_t p = 0; p < pieces.size(); ++p) {
    acc += pieces[p].size;
    if (acc >= share * bounds.size() && bounds.size() < threads) bounds.push_back(p + 1);
  }
  bounds.push_back(pieces.size());
  auto run = [&](size_t begin, size_t end) {
    for (size_t p = begin; p < end; ++p) {
      const auto& t = transfers[pieces[p].transfer];
      pieces[p].crc = copyWithCrc32c(t.dst + pieces[p].offset, t.src + pieces[p].offset, pieces[p].size);
    }
  };
  std::vector<std::thread> helpers;
  for (size_t b = 1; b + 1 < bounds.size(); ++b) helpers.emplace_back(run, bounds[b], bounds[b + 1]);
  run(bounds[0], bounds[1]);
  for (auto& h : helpers) h.join();
  for (const auto& p : pieces) crcs[p.transfer] = p.offset == 0 ? p.crc : crc32cCombine(crcs[p.transfer], p.crc, p.size);
  return crcs;
}

}  // namespace troupe::checkpoint
