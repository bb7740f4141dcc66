// The one shell around every update rule. An optimizer's math is written once, as a rule
// (AdamWRule, AgdRule, LambRule, LarsRule, each in its own header); the LibTorch class
// (FusedOptimizer<Rule>), the trainer's optimizer (stepRule over its ZeRO shards) and the Python
// binding (troupe._optim) all run that rule.
//
// A rule is a struct deriving from RuleOf<Options, State> (the hyper-parameters and the
// per-parameter state) with
//   static constexpr const char* kName;   // as in error messages
//   static constexpr bool kTwoPass;       // needs whole-tensor norms between two passes
//   kTwoPass == false:  static Step step;
//   kTwoPass == true (LAMB, LARS):  static Norms norms;  static Apply apply;
// over lists of parameters (or shards of them) with their gradients and states (the caller owns
// the states): pass 1 returns each one's partial squared norms, pass 2 updates from the
// whole-tensor norms `whole`. Missing state buffers are created, step counts incremented, and
// parameters and state updated in place, in one parallel region of `threads` threads (<= 0:
// defaultKernelThreads()) per pass. Tensors: contiguous float32/float64 CPU tensors, gradients
// of their parameter's shape and dtype; other dtypes throw c10::TypeError, sparse or
// non-contiguous tensors c10::Error, before anything is modified. And for its State,
// `fieldsOf(State&)` (found by argument-dependent lookup) lists the state's fields.
// Thread-safety: a FusedOptimizer belongs to the thread that calls step(); rules are functions
// of their arguments.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "troupe/optimizers/reducers.h"

namespace troupe::optimizers {

// One per-parameter state field, by the name it has in checkpoints, LibTorch archives and Python
// state dicts: a tensor of the parameter's shape (undefined until a step creates it) or a step
// counter. Points into the state it was listed from.
struct StateField {
  std::string name;
  torch::Tensor* tensor = nullptr;
  int64_t* counter = nullptr;
};

// LibTorch options whose archive form is their hyper-parameters, each under its name, as
// forEachOption(Derived&, visit) lists them (beside each options struct); the Python binding
// reads a param group dict by the same list.
template <typename Derived>
struct FieldsOptions : public torch::optim::OptimizerCloneableOptions<Derived> {
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

// A LibTorch param state whose archive form is its fields: each field under its name, undefined
// tensors left out (as LibTorch's own states do).
template <typename Derived>
struct FieldsParamState : public torch::optim::OptimizerCloneableParamState<Derived> {
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

// The state of the Adam-style rules (AdamW, LAMB): the step count and the two moments.
struct MomentsParamState : public FieldsParamState<MomentsParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(torch::Tensor, exp_avg);
  TORCH_ARG(torch::Tensor, exp_avg_sq);
};

// step, exp_avg, exp_avg_sq.
std::vector<StateField> fieldsOf(MomentsParamState& state);
extern template struct FieldsParamState<MomentsParamState>;

// The base of every rule: its types and the signatures of its passes. Pass 1 (`Norms`) returns
// each parameter's partial squared norms; pass 2 (`Apply`) updates from the whole ones.
template <typename OptionsT, typename StateT>
struct RuleOf {
  using Options = OptionsT;
  using State = StateT;
  using Tensors = std::vector<torch::Tensor>;
  using Step = void(const Tensors& params, const Tensors& grads, const std::vector<State*>& states,
                    const Options& options, int threads);
  using Norms = std::vector<SquaredNorms>(const Tensors& params, const Tensors& grads,
                                          const std::vector<State*>& states, const Options& options, int threads);
  using Apply = void(const Tensors& params, const Tensors& grads, const std::vector<State*>& states,
                     const Options& options, const std::vector<SquaredNorms>& whole, int threads);
};

// One step of Rule over a list of parameters (or shards), as the contract above. For two-pass
// rules, `whole_norms` (when set) turns the partial norms of pass 1 into whole-tensor norms in
// place, e.g. a sum over the shards of a ZeRO group; unset, the tensors are whole.
template <typename Rule>
void stepRule(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
              const std::vector<typename Rule::State*>& states, const typename Rule::Options& options, int threads,
              const std::function<void(std::vector<SquaredNorms>&)>& whole_norms = nullptr) {
  if constexpr (Rule::kTwoPass) {
    std::vector<SquaredNorms> norms = Rule::norms(params, grads, states, options, threads);
    if (whole_norms) whole_norms(norms);
    Rule::apply(params, grads, states, options, norms, threads);
  } else {
    Rule::step(params, grads, states, options, threads);
  }
}

// The torch::optim::Optimizer running a rule over its param groups: AdamW, Agd, Lamb, Lars.
template <typename Rule>
class FusedOptimizer : public torch::optim::Optimizer {
 public:
  using Options = typename Rule::Options;

  // Validates `defaults` (c10::ValueError naming the option). `reducer`: two-pass rules only
  // (c10::Error otherwise); it sums the squared norms of every parameter across the shards of a
  // sharded group once per step (see reducers.h).
  explicit FusedOptimizer(std::vector<torch::optim::OptimizerParamGroup> param_groups, Options defaults = {},
                          SquaredNormReducer reducer = nullptr);
  explicit FusedOptimizer(std::vector<torch::Tensor> params, Options defaults = {},
                          SquaredNormReducer reducer = nullptr);

  // Parameters without a gradient are skipped. Validates every group's options first.
  torch::Tensor step(LossClosure closure = nullptr) override;
  // LibTorch's archive format; load also restores (and validates) each group's options.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // Kernel threads per step (default: defaultKernelThreads()).
  void setThreads(int threads) { threads_ = threads; }

 private:
  SquaredNormReducer reducer_;
  int threads_;
};

}  // namespace troupe::optimizers
