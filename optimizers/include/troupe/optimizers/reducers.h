// Seams where a distributed group plugs its collectives into the optimizers.
// Thread-safety: the optimizers call these on the thread that calls step().
#pragma once

#include <torch/types.h>

#include <functional>
#include <vector>

namespace troupe::optimizers {

// Sums `sums` (a float64 CPU tensor of squared norms) in place across the shards of one
// sharded (ZeRO-style) group, so that trust ratios use whole-tensor norms. LAMB, LARS and
// WSAM call it once per step with every parameter's partial sums, e.g. with
// `c10d::ProcessGroup::allreduce` (SUM). Unset: the optimizer holds whole tensors.
using SquaredNormReducer = std::function<void(torch::Tensor& sums)>;

// Replaces each gradient with its mean over the data-parallel ranks (all-reduce SUM, then
// divide by the world size). WSAM calls it where its rule says "all-reduce-mean(g)".
// Unset: single process, gradients are used as they are.
using GradientReducer = std::function<void(std::vector<torch::Tensor>& grads)>;

// Squared norms of one parameter's shard, as the two-pass optimizers compute them.
struct SquaredNorms {
  double param = 0;   // ||p||^2
  double update = 0;  // ||u||^2 (LAMB) or ||g||^2 (LARS)
};

// The reducer's tensor: float64 [2 * norms.size()], (||p||^2, ||u||^2) per parameter.
torch::Tensor packNorms(const std::vector<SquaredNorms>& norms);
// The norms back from the reducer's tensor. Throws c10::ValueError naming `optimizer` when the
// reducer left something else than a float64 CPU vector of 2 * count sums.
std::vector<SquaredNorms> unpackNorms(const char* optimizer, const torch::Tensor& sums, size_t count);

// How many CPUs this process may run on (its affinity mask): the default kernel thread count.
// torch.get_num_threads() is not used because LibTorch may detect fewer cores than are usable.
int defaultKernelThreads();

}  // namespace troupe::optimizers
