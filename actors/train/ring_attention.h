// Ring attention (internal; LibTorch): exact softmax attention over a sequence split across a
// ring of ranks (sequence parallelism). Each rank holds the queries, keys and values of its
// positions; the key/value blocks travel around the ring, one hop per step (a duplex
// sendRecv, overlapped with the block's compute), and each rank merges the blocks' results with
// the log-sum-exp rule:
//   lse' = log(exp(lse) + exp(blk_lse)),  out' = exp(lse - lse') out + exp(blk_lse - lse') blk_out.
// Backward runs a second ring: the key/value blocks travel again, each with the gradient of its
// keys and values accumulated by every rank it visits, and after the last hop each gradient is
// back at its owner.
//
// Causal masking uses the zigzag split: a sequence of L tokens is cut into 2S chunks and rank s
// of S holds chunks s and 2S-1-s, so every rank has the same amount of visible work. Only the
// part of each block pair that any query can see is computed.
//
// Thread-safety: one caller at a time per communicator (the engine's thread); backward runs on
// the thread that calls backward().
#pragma once

#include <ATen/ATen.h>

#include <stdexcept>
#include <vector>

#include "troupe/runtime/status.h"

namespace troupe::collectives {
class Communicator;
}

namespace troupe::actors::train {

// A communicator error inside forward or backward; the engine returns `status`.
struct RingFailure : std::runtime_error {
  explicit RingFailure(Status s) : std::runtime_error(s.toString()), status(std::move(s)) {}
  Status status;
};

// The ring: ranks[i] is the communicator rank of ring member i, and this process is member
// `index`. A ring of one needs no communicator.
struct Ring {
  collectives::Communicator* comm = nullptr;
  std::vector<int> ranks;
  int index = 0;
  int size() const { return static_cast<int>(ranks.size()); }
};

// The positions member `index` of a ring of `size` holds of a sequence of `length` tokens
// (length a multiple of 2 * size): chunks index and 2*size-1-index, ascending. int64 [length/size].
at::Tensor zigzagPositions(int64_t length, int size, int index);

// q, k, v: float32 [B, H, T, D], this member's positions zigzagPositions(T * size, size, index)
// (any positions when `causal` is false). Returns the attention output [B, H, T, D],
// differentiable in q, k and v. Throws RingFailure when the communicator fails.
at::Tensor ringAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                         const Ring& ring);

}  // namespace troupe::actors::train
