// LARS (layer-wise adaptive rate scaling) on fused CPU kernels (REFERENCE.md):
//   r = eeta*||p|| / (||g|| + wd*||p|| + eps) if ||p|| > 0 and ||g|| > 0 else 1; r = clamp(r, 0, 50)
//   d = clamp(g + wd*p, -10, 10); with momentum: buf = d (first step) or momentum*buf + d; d = buf
//   p -= lr * r * d
// Two passes per parameter (norms, then the update); norms of a sharded group are summed
// across shards by one SquaredNormReducer call per step.
// The rule (LarsRule) is run by the Lars class, the trainer and troupe.optim (fused_optimizer.h).
// Thread-safety: an optimizer belongs to the thread that calls step().
#pragma once


#include <vector>

#include "troupe/optimizers/fused_optimizer.h"

namespace troupe::optimizers {

struct LarsOptions : public FieldsOptions<LarsOptions> {
  LarsOptions(double lr = 1e-3);  // NOLINT: implicit, as LibTorch's options
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, momentum) = 0;
  TORCH_ARG(double, eeta) = 1e-3;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(double, epsilon) = 0;

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

// Throws c10::ValueError naming the option and its value.
void validate(const LarsOptions& options);

// The hyper-parameters by name, in the order archives and param group dicts are read.
template <typename Visit>
void forEachOption(LarsOptions& o, Visit&& visit) {
  visit("lr", o.lr());
  visit("momentum", o.momentum());
  visit("eeta", o.eeta());
  visit("weight_decay", o.weight_decay());
  visit("epsilon", o.epsilon());
}

struct LarsParamState : public FieldsParamState<LarsParamState> {
  TORCH_ARG(torch::Tensor, momentum_buffer);  // undefined until the first step with momentum
};

// momentum_buffer.
std::vector<StateField> fieldsOf(LarsParamState& state);

// Two passes per step; contract in fused_optimizer.h.
struct LarsRule : RuleOf<LarsOptions, LarsParamState> {
  static constexpr const char* kName = "LARS";
  static constexpr bool kTwoPass = true;
  // Pass 1: each one's ||p||^2 and ||g||^2. Reads only params and grads (`states` may be empty).
  static Norms norms;
  // Pass 2 with the whole-tensor squared norms `whole[i]`; creates momentum buffers on first use.
  static Apply apply;
};

using Lars = FusedOptimizer<LarsRule>;
extern template struct FieldsParamState<LarsParamState>;
extern template struct FieldsOptions<LarsOptions>;
extern template class FusedOptimizer<LarsRule>;

}  // namespace troupe::optimizers
