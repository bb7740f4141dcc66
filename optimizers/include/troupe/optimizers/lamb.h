// LAMB (layer-wise adaptive moments) on fused CPU kernels (REFERENCE.md):
//   m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2; u = m/(sqrt(v)+eps) + wd*p
//   r = ||p||/||u|| (1 if either is 0); p -= lr_t * r * u
// The trust ratio needs whole-tensor norms before any element moves, so a step is two passes
// per parameter (moments + norms, then the update), with no temporaries. In a sharded group the
// partial norms of every parameter are summed across shards by one SquaredNormReducer call.
// Thread-safety: an optimizer belongs to the thread that calls step().
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <tuple>
#include <vector>

#include "troupe/optimizers/reducers.h"

namespace troupe::optimizers {

struct LambOptions : public torch::optim::OptimizerCloneableOptions<LambOptions> {
  LambOptions(double lr = 1e-3);  // NOLINT: implicit, as LibTorch's options
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-6;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, bias_correction) = false;  // lr_t = lr * sqrt(1-b2^t)/(1-b1^t)

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

// Throws c10::ValueError naming the option and its value.
void validate(const LambOptions& options);

struct LambParamState : public torch::optim::OptimizerCloneableParamState<LambParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(torch::Tensor, exp_avg);
  TORCH_ARG(torch::Tensor, exp_avg_sq);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

// Pass 1 for a list of parameters (or shards): creates missing state, increments the step
// counts, updates the moments and returns each one's ||p||^2 and ||u||^2 (of this shard).
// Contract as adamwStep (adamw.h).
std::vector<SquaredNorms> lambMoments(const std::vector<torch::Tensor>& params,
                                      const std::vector<torch::Tensor>& grads,
                                      const std::vector<LambParamState*>& states, const LambOptions& options,
                                      int threads);
// Pass 2: p -= lr_t * r * u with r from the whole-tensor squared norms `whole[i]`.
void lambApply(const std::vector<torch::Tensor>& params, const std::vector<LambParamState*>& states,
               const LambOptions& options, const std::vector<SquaredNorms>& whole, int threads);

class Lamb : public torch::optim::Optimizer {
 public:
  explicit Lamb(std::vector<torch::optim::OptimizerParamGroup> param_groups, LambOptions defaults = {},
                SquaredNormReducer reducer = nullptr);
  explicit Lamb(std::vector<torch::Tensor> params, LambOptions defaults = {}, SquaredNormReducer reducer = nullptr);

  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
  void setThreads(int threads) { threads_ = threads; }

 private:
  SquaredNormReducer reducer_;
  int threads_;
};

}  // namespace troupe::optimizers
