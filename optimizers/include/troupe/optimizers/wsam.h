// WSAM (weighted sharpness-aware minimisation) wrapping any LibTorch optimizer (REFERENCE.md).
// One step takes two forward/backward passes:
//   firstStep:  n = ||(|w| if adaptive else 1) * g||; e = (w^2 if adaptive else 1) * g * rho/(n+eps);
//               w += e; g0 = all-reduce-mean(g); g = 0
//   (forward/backward again at w + e)
//   secondStep: g1 = all-reduce-mean(g); w -= e;
//               decouple: g = g0; base.step(); w -= lr*alpha*(g1 - g0)
//               otherwise: g = alpha*g1 + (1-alpha)*g0; base.step()
// with alpha = gamma/(1-gamma) and lr each base group's current lr. The norm n is over every
// parameter of the optimizer (summed across shards by the SquaredNormReducer when sharded);
// "all-reduce-mean" is the GradientReducer hook. Each pass is fused: one pass per parameter
// for the norm, one for the perturbation, one for saving g0, one for the restore and one for
// the decoupled correction. e and g0 are per-parameter state (two model-sized buffers, as the
// rule requires); they are only meaningful between firstStep and secondStep and are not saved.
// Thread-safety: an optimizer belongs to the thread that calls step().
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <memory>
#include <vector>

#include "troupe/optimizers/fused_optimizer.h"

namespace troupe::optimizers {

struct WsamOptions : public FieldsOptions<WsamOptions> {
  WsamOptions(double rho = 0.05);  // NOLINT: implicit, as LibTorch's options
  TORCH_ARG(double, rho) = 0.05;
  TORCH_ARG(double, gamma) = 0.9;
  TORCH_ARG(double, eps) = 1e-12;
  TORCH_ARG(bool, adaptive) = false;
  TORCH_ARG(bool, decouple) = true;

 public:
  double alpha() const { return gamma() / (1 - gamma()); }
};

// Throws c10::ValueError naming the option and its value (rho < 0, gamma outside [0, 1), ...).
void validate(const WsamOptions& options);

// The hyper-parameters by name, in the order archives are read (troupe.optim.WSAM keeps them in
// the base optimizer's group dicts, its eps as sam_eps).
template <typename Visit>
void forEachOption(WsamOptions& o, Visit&& visit) {
  visit("rho", o.rho());
  visit("gamma", o.gamma());
  visit("eps", o.eps());
  visit("adaptive", o.adaptive());
  visit("decouple", o.decouple());
}
extern template struct FieldsOptions<WsamOptions>;

struct WsamParamState : public torch::optim::OptimizerCloneableParamState<WsamParamState> {
  TORCH_ARG(torch::Tensor, e);     // the perturbation; after the restore, g1 - g0 (decouple)
  TORCH_ARG(torch::Tensor, grad);  // g0
};

// e, grad (not saved by the Wsam class: only meaningful between its two steps).
std::vector<StateField> fieldsOf(WsamParamState& state);

// The fused passes over a list of parameters (one parallel region each); the Wsam class and
// the Python binding share them. Tensors must be contiguous float32/float64 CPU tensors of one
// dtype and size per parameter; `grads` are written by wsamSaveGrad and wsamRestore, so they
// must be the parameters' own gradients.
// The sum over the list of ||(|w| if adaptive else 1) * g||^2, in list order.
double wsamGradSquaredNorm(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                           bool adaptive, int threads);
// e = (w^2 if adaptive else 1) * g * scale; w += e.
void wsamPerturb(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                 const std::vector<WsamParamState*>& states, bool adaptive, double scale, int threads);
// g0 = g; g = 0.
void wsamSaveGrad(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                  const std::vector<WsamParamState*>& states, int threads);
// w -= e; decouple: e = g1 - g0, g = g0; otherwise g = alpha*g1 + (1-alpha)*g0.
void wsamRestore(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                 const std::vector<WsamParamState*>& states, bool decouple, double alpha, int threads);
// w -= scale * e (scale = lr*alpha), after the base step.
void wsamCorrect(const std::vector<torch::Tensor>& params, const std::vector<WsamParamState*>& states, double scale,
                 int threads);

class Wsam : public torch::optim::Optimizer {
 public:
  // Wraps `base` (shared: the caller may keep using it, e.g. for its lr). WSAM's param groups
  // mirror the base's at construction.
  explicit Wsam(std::shared_ptr<torch::optim::Optimizer> base, WsamOptions defaults = {},
                GradientReducer grad_reducer = nullptr, SquaredNormReducer norm_reducer = nullptr);

  // firstStep(); loss = closure() (forward and backward at w + e); secondStep(); returns loss.
  // Throws c10::Error without a closure.
  torch::Tensor step(LossClosure closure = nullptr) override;
  void firstStep();
  void secondStep();

  // Saves and loads the base optimizer's state ("base"). Throws between firstStep and
  // secondStep, where the parameters are perturbed.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  torch::optim::Optimizer& base() { return *base_; }
  void setThreads(int threads) { threads_ = threads; }

 private:
  std::shared_ptr<torch::optim::Optimizer> base_;
  GradientReducer grad_reducer_;
  SquaredNormReducer norm_reducer_;
  bool perturbed_ = false;
  // The parameters firstStep perturbed, and their group indices: secondStep restores exactly these.
  std::vector<torch::Tensor> perturbed_params_;
  std::vector<size_t> perturbed_groups_;
  int threads_;
};

}  // namespace troupe::optimizers
