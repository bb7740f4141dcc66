// LARS (layer-wise adaptive rate scaling) on fused CPU kernels (REFERENCE.md):
//   r = eeta*||p|| / (||g|| + wd*||p|| + eps) if ||p|| > 0 and ||g|| > 0 else 1; r = clamp(r, 0, 50)
//   d = clamp(g + wd*p, -10, 10); with momentum: buf = d (first step) or momentum*buf + d; d = buf
//   p -= lr * r * d
// Two passes per parameter (norms, then the update); norms of a sharded group are summed
// across shards by one SquaredNormReducer call per step.
// Thread-safety: an optimizer belongs to the thread that calls step().
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <vector>

#include "troupe/optimizers/reducers.h"

namespace troupe::optimizers {

struct LarsOptions : public torch::optim::OptimizerCloneableOptions<LarsOptions> {
  LarsOptions(double lr = 1e-3);  // NOLINT: implicit, as LibTorch's options
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, momentum) = 0;
  TORCH_ARG(double, eeta) = 1e-3;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(double, epsilon) = 0;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

// Throws c10::ValueError naming the option and its value.
void validate(const LarsOptions& options);

struct LarsParamState : public torch::optim::OptimizerCloneableParamState<LarsParamState> {
  TORCH_ARG(torch::Tensor, momentum_buffer);  // undefined until the first step with momentum

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

// Pass 1 for a list of parameters (or shards): each one's ||p||^2 and ||g||^2. Reads only.
std::vector<SquaredNorms> larsNorms(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                                    int threads);
// Pass 2 with the whole-tensor squared norms `whole[i]`; creates momentum buffers on first use.
// Contract as adamwStep (adamw.h).
void larsApply(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
               const std::vector<LarsParamState*>& states, const LarsOptions& options,
               const std::vector<SquaredNorms>& whole, int threads);

class Lars : public torch::optim::Optimizer {
 public:
  explicit Lars(std::vector<torch::optim::OptimizerParamGroup> param_groups, LarsOptions defaults = {},
                SquaredNormReducer reducer = nullptr);
  explicit Lars(std::vector<torch::Tensor> params, LarsOptions defaults = {}, SquaredNormReducer reducer = nullptr);

  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
  void setThreads(int threads) { threads_ = threads; }

 private:
  SquaredNormReducer reducer_;
  int threads_;
};

}  // namespace troupe::optimizers
