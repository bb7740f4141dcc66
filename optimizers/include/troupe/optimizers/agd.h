// AGD (auto-switchable optimizer with step-wise gradient difference preconditioning) as one
// fused CPU pass per parameter, with every option of REFERENCE.md: weight_decouple,
// fixed_decay, amsgrad, win, clip and delta. Defaults are REFERENCE.md's; for transformers
// the authors suggest delta=1e-14 and a tenth of AdamW's lr.
// The rule (AgdRule) is run by the Agd class, the trainer and troupe.optim (fused_optimizer.h).
// Thread-safety: an optimizer belongs to the thread that calls step(); the kernels inside a
// step use `threads` OpenMP threads.
#pragma once

#include <c10/util/Optional.h>

#include <tuple>
#include <vector>

#include "troupe/optimizers/fused_optimizer.h"

namespace troupe::optimizers {

struct AgdOptions : public FieldsOptions<AgdOptions> {
  AgdOptions(double lr = 1e-3);  // NOLINT: implicit, as LibTorch's options
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, delta) = 1e-5;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, weight_decouple) = true;  // p *= 1 - lr*wd; otherwise g += wd*p
  TORCH_ARG(bool, fixed_decay) = false;     // decoupled decay p *= 1 - wd (not scaled by lr)
  TORCH_ARG(bool, amsgrad) = false;         // precondition with the running max of b
  TORCH_ARG(bool, win) = false;             // the "win" variant with its extra z sequence
  TORCH_ARG(c10::optional<double>, clip) = c10::nullopt;  // |u| <= clip elementwise

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

// Throws c10::ValueError naming the option and its value.
void validate(const AgdOptions& options);

// The hyper-parameters by name, in the order archives and param group dicts are read.
template <typename Visit>
void forEachOption(AgdOptions& o, Visit&& visit) {
  visit("lr", o.lr());
  visit("betas", o.betas());
  visit("delta", o.delta());
  visit("weight_decay", o.weight_decay());
  visit("weight_decouple", o.weight_decouple());
  visit("fixed_decay", o.fixed_decay());
  visit("amsgrad", o.amsgrad());
  visit("win", o.win());
  visit("clip", o.clip());
}

struct AgdParamState : public FieldsParamState<AgdParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(torch::Tensor, exp_avg);         // m
  TORCH_ARG(torch::Tensor, exp_avg_sq);      // b
  TORCH_ARG(torch::Tensor, max_exp_avg_sq);  // running max of b (amsgrad only)
  TORCH_ARG(torch::Tensor, z);               // win only, starts at 0
};

// step, exp_avg, exp_avg_sq, max_exp_avg_sq, z.
std::vector<StateField> fieldsOf(AgdParamState& state);

// One pass per step; contract in fused_optimizer.h. Coupled weight decay (weight_decouple=false)
// adds wd*p to a local value of the gradient: gradients are never written.
struct AgdRule : RuleOf<AgdOptions, AgdParamState> {
  static constexpr const char* kName = "AGD";
  static constexpr bool kTwoPass = false;
  static Step step;
};

using Agd = FusedOptimizer<AgdRule>;
extern template struct FieldsParamState<AgdParamState>;
extern template struct FieldsOptions<AgdOptions>;
extern template class FusedOptimizer<AgdRule>;

}  // namespace troupe::optimizers
