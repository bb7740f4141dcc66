// AdamW with decoupled weight decay as one fused CPU pass per parameter (REFERENCE.md):
//   p *= 1 - lr*wd; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
//   p -= lr * (m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps)
// Thread-safety: an optimizer belongs to the thread that calls step(); the kernels inside a
// step use `threads` OpenMP threads.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <tuple>
#include <vector>

namespace troupe::optimizers {

struct AdamWOptions : public torch::optim::OptimizerCloneableOptions<AdamWOptions> {
  AdamWOptions(double lr = 1e-3);  // NOLINT: implicit, as LibTorch's options
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

// Throws c10::ValueError naming the option and its value (lr < 0, betas outside [0, 1), ...).
void validate(const AdamWOptions& options);

struct AdamWParamState : public torch::optim::OptimizerCloneableParamState<AdamWParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(torch::Tensor, exp_avg);
  TORCH_ARG(torch::Tensor, exp_avg_sq);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

// One step for params[i] with grads[i] and *states[i] (the caller owns the states): creates
// missing state, increments each step count, updates parameters and state in place, in one
// parallel region of `threads` threads (<= 0: defaultKernelThreads()) over all of them.
// Parameters: contiguous float32/float64 CPU tensors; gradients of the same shape and dtype.
// Throws c10::TypeError for other dtypes, c10::Error for sparse or non-contiguous tensors, before
// anything is modified. The functional form the AdamW class and the Python binding share.
void adamwStep(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
               const std::vector<AdamWParamState*>& states, const AdamWOptions& options, int threads);

class AdamW : public torch::optim::Optimizer {
 public:
  explicit AdamW(std::vector<torch::optim::OptimizerParamGroup> param_groups, AdamWOptions defaults = {});
  explicit AdamW(std::vector<torch::Tensor> params, AdamWOptions defaults = {});

  // Parameters without a gradient are skipped. Validates every group's options first.
  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // Kernel threads per step (default: defaultKernelThreads()).
  void setThreads(int threads) { threads_ = threads; }

 private:
  int threads_;
};

}  // namespace troupe::optimizers
