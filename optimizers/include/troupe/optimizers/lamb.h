// LAMB (layer-wise adaptive moments) on fused CPU kernels (REFERENCE.md):
//   m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2; u = m/(sqrt(v)+eps) + wd*p
//   r = ||p||/||u|| (1 if either is 0); p -= lr_t * r * u
// The trust ratio needs whole-tensor norms before any element moves, so a step is two passes
// per parameter (moments + norms, then the update), with no temporaries. In a sharded group the
// partial norms of every parameter are summed across shards by one SquaredNormReducer call.
// The rule (LambRule) is run by the Lamb class, the trainer and troupe.optim (fused_optimizer.h).
// Thread-safety: an optimizer belongs to the thread that calls step().
#pragma once


#include <tuple>
#include <vector>

#include "troupe/optimizers/fused_optimizer.h"

namespace troupe::optimizers {

struct LambOptions : public FieldsOptions<LambOptions> {
  LambOptions(double lr = 1e-3);  // NOLINT: implicit, as LibTorch's options
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-6;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, bias_correction) = false;  // lr_t = lr * sqrt(1-b2^t)/(1-b1^t)

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

// Throws c10::ValueError naming the option and its value.
void validate(const LambOptions& options);

// The hyper-parameters by name, in the order archives and param group dicts are read.
template <typename Visit>
void forEachOption(LambOptions& o, Visit&& visit) {
  visit("lr", o.lr());
  visit("betas", o.betas());
  visit("eps", o.eps());
  visit("weight_decay", o.weight_decay());
  visit("bias_correction", o.bias_correction());
}

using LambParamState = MomentsParamState;

// Two passes per step; contract in fused_optimizer.h.
struct LambRule : RuleOf<LambOptions, LambParamState> {
  static constexpr const char* kName = "LAMB";
  static constexpr bool kTwoPass = true;
  // Pass 1: creates missing state, increments the step counts, updates the moments and returns
  // each one's ||p||^2 and ||u||^2 (of this shard).
  static Norms norms;
  // Pass 2: p -= lr_t * r * u with r from the whole-tensor squared norms `whole[i]` (u is
  // recomputed from the moments: `grads` is not read and may be empty).
  static Apply apply;
};

using Lamb = FusedOptimizer<LambRule>;
extern template struct FieldsOptions<LambOptions>;
extern template class FusedOptimizer<LambRule>;

}  // namespace troupe::optimizers
