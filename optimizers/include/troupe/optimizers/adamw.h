// AdamW with decoupled weight decay as one fused CPU pass per parameter (REFERENCE.md):
//   p *= 1 - lr*wd; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
//   p -= lr * (m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps)
// The rule (AdamWRule) is run by the AdamW class, the trainer and troupe.optim (fused_optimizer.h).
// Thread-safety: an optimizer belongs to the thread that calls step(); the kernels inside a
// step use `threads` OpenMP threads.
#pragma once


#include <tuple>
#include <vector>

#include "troupe/optimizers/fused_optimizer.h"

namespace troupe::optimizers {

struct AdamWOptions : public FieldsOptions<AdamWOptions> {
  AdamWOptions(double lr = 1e-3);  // NOLINT: implicit, as LibTorch's options
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

// Throws c10::ValueError naming the option and its value (lr < 0, betas outside [0, 1), ...).
void validate(const AdamWOptions& options);

// The hyper-parameters by name, in the order archives and param group dicts are read.
template <typename Visit>
void forEachOption(AdamWOptions& o, Visit&& visit) {
  visit("lr", o.lr());
  visit("betas", o.betas());
  visit("eps", o.eps());
  visit("weight_decay", o.weight_decay());
}

using AdamWParamState = MomentsParamState;

// One pass per step; contract in fused_optimizer.h.
struct AdamWRule : RuleOf<AdamWOptions, AdamWParamState> {
  static constexpr const char* kName = "AdamW";
  static constexpr bool kTwoPass = false;
  static Step step;
};

using AdamW = FusedOptimizer<AdamWRule>;
extern template struct FieldsOptions<AdamWOptions>;
extern template class FusedOptimizer<AdamWRule>;

}  // namespace troupe::optimizers
