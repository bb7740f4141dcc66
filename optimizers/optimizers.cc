// The LibTorch side of every optimizer (adamw.h, agd.h, lamb.h, lars.h, wsam.h): option
// validation, tensor checks, coefficients, the optimizer classes and their serialisation.
// One translation unit on purpose: each file including LibTorch costs ~30 s to compile.
// The arithmetic lives in kernels.cc.
#include <ATen/ATen.h>
#include <c10/util/string_utils.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>

#include "kernels.h"
#include "troupe/optimizers/adamw.h"
#include "troupe/optimizers/agd.h"
#include "troupe/optimizers/lamb.h"
#include "troupe/optimizers/lars.h"
#include "troupe/optimizers/reducers.h"
#include "troupe/optimizers/wsam.h"

namespace troupe::optimizers {

int defaultKernelThreads() { return kernels::availableCpus(); }

namespace {

using torch::Tensor;
using StateMap = ska::flat_hash_map<std::string, std::unique_ptr<torch::optim::OptimizerParamState>>;

// ---- option checks: c10::ValueError (Python ValueError) with the option and its value ----

void checkNonNegative(const char* optimizer, const char* name, double value) {
  TORCH_CHECK_VALUE(std::isfinite(value) && value >= 0, optimizer, ": ", name,
                    " must be a finite number >= 0, got ", value);
}

void checkBetas(const char* optimizer, const std::tuple<double, double>& betas) {
  const double b[2] = {std::get<0>(betas), std::get<1>(betas)};
  for (int i = 0; i < 2; ++i) {
    TORCH_CHECK_VALUE(b[i] >= 0 && b[i] < 1, optimizer, ": betas[", i, "] must be in [0, 1), got ", b[i]);
  }
}

// ---- tensor checks ----

void checkParam(const char* optimizer, const Tensor& param) {
  TORCH_CHECK(param.defined(), optimizer, ": got an undefined parameter tensor");
  TORCH_CHECK(param.device().is_cpu() && param.layout() == at::kStrided, optimizer,
              ": the fused kernels run on dense CPU tensors; got a parameter on ", param.device(), " with layout ",
              param.layout());
  TORCH_CHECK_TYPE(param.scalar_type() == at::kFloat || param.scalar_type() == at::kDouble, optimizer,
                   ": parameters must be float32 or float64, got ", param.scalar_type());
  TORCH_CHECK(param.is_contiguous(), optimizer, ": parameters must be contiguous (got sizes ", param.sizes(),
              ", strides ", param.strides(), "); make the parameter contiguous before building the optimizer");
}

void checkSameShape(const char* optimizer, const char* what, const Tensor& param, const Tensor& t) {
  TORCH_CHECK(t.defined(), optimizer, ": ", what, " is undefined");
  TORCH_CHECK(!t.is_sparse(), optimizer, ": sparse gradients are not supported");
  TORCH_CHECK(t.device().is_cpu(), optimizer, ": ", what, " is on ", t.device(), ", its parameter on the CPU");
  TORCH_CHECK_TYPE(t.scalar_type() == param.scalar_type(), optimizer, ": ", what, " has dtype ", t.scalar_type(),
                   " but its parameter ", param.scalar_type());
  TORCH_CHECK(t.sizes() == param.sizes(), optimizer, ": ", what, " has sizes ", t.sizes(), " but its parameter ",
              param.sizes());
}

// A gradient the kernels only read: copied when not contiguous (rare: e.g. an expanded grad).
Tensor readableGrad(const char* optimizer, const Tensor& param, const Tensor& grad) {
  checkSameShape(optimizer, "the gradient", param, grad);
  return grad.is_contiguous() ? grad : grad.contiguous();
}

// A gradient the kernels write (WSAM): must be the parameter's own, contiguous tensor.
void checkWritableGrad(const char* optimizer, const Tensor& param, const Tensor& grad) {
  checkSameShape(optimizer, "the gradient", param, grad);
  TORCH_CHECK(grad.is_contiguous(), optimizer, ": gradients must be contiguous (got strides ", grad.strides(), ")");
}

// A state buffer: created as zeros on first use, otherwise checked against its parameter
// (a state_dict from another model or dtype is refused rather than misread).
Tensor& stateBuffer(const char* optimizer, const char* name, Tensor& buffer, const Tensor& param) {
  if (!buffer.defined()) {
    buffer = at::zeros_like(param, at::MemoryFormat::Contiguous);
    return buffer;
  }
  checkSameShape(optimizer, name, param, buffer);
  TORCH_CHECK(buffer.is_contiguous(), optimizer, ": state '", name, "' is not contiguous");
  return buffer;
}

// An existing state buffer the step only reads (pass 2 of LAMB, WSAM's second step).
const Tensor& existingBuffer(const char* optimizer, const char* name, const Tensor& buffer, const Tensor& param,
                             const char* missing) {
  TORCH_CHECK(buffer.defined(), optimizer, ": ", missing);
  checkSameShape(optimizer, name, param, buffer);
  TORCH_CHECK(buffer.is_contiguous(), optimizer, ": state '", name, "' is not contiguous");
  return buffer;
}

void checkCounts(const char* optimizer, size_t params, size_t other, const char* what) {
  TORCH_CHECK(params == other, optimizer, ": got ", params, " parameters but ", other, " ", what);
}

// Checks every parameter and its gradient, calling per_param(i) (the state checks) after
// parameter i's; returns the gradients as the kernels read them.
template <typename PerParam>
std::vector<Tensor> readableGrads(const char* optimizer, const std::vector<Tensor>& params,
                                  const std::vector<Tensor>& grads, const PerParam& per_param) {
  checkCounts(optimizer, params.size(), grads.size(), "gradients");
  std::vector<Tensor> g(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    checkParam(optimizer, params[i]);
    g[i] = readableGrad(optimizer, params[i], grads[i]);
    per_param(i);
  }
  return g;
}

std::vector<Tensor> readableGrads(const char* optimizer, const std::vector<Tensor>& params,
                                  const std::vector<Tensor>& grads) {
  return readableGrads(optimizer, params, grads, [](size_t) {});
}

// The two moments of AdamW and LAMB.
void momentBuffers(const char* optimizer, MomentsParamState& state, const Tensor& param) {
  stateBuffer(optimizer, "exp_avg", state.exp_avg(), param);
  stateBuffer(optimizer, "exp_avg_sq", state.exp_avg_sq(), param);
}

// Calls body(T{}, indices) for the float32 parameters, then for the float64 ones: each kernel
// call, and so each parallel region, covers one dtype.
template <typename F>
void byDtype(const std::vector<Tensor>& params, const F& body) {
  std::vector<size_t> f32, f64;
  for (size_t i = 0; i < params.size(); ++i) (params[i].scalar_type() == at::kFloat ? f32 : f64).push_back(i);
  if (!f32.empty()) body(float{}, f32);
  if (!f64.empty()) body(double{}, f64);
}

std::vector<int64_t> sizesOf(const std::vector<Tensor>& params, const std::vector<size_t>& indices) {
  std::vector<int64_t> sizes;
  sizes.reserve(indices.size());
  for (size_t i : indices) sizes.push_back(params[i].numel());
  return sizes;
}

template <typename T>
T* ptr(const Tensor& t) {
  return t.data_ptr<T>();
}

int resolveThreads(int threads) { return threads > 0 ? threads : defaultKernelThreads(); }

// The kernels write through raw pointers; bumping the version counter keeps autograd's check
// that a tensor saved for backward was not modified in place (as torch.optim's in-place ops do).
void markWritten(const std::vector<Tensor>& tensors) {
  for (const auto& t : tensors) {
    if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
  }
}

std::string keyOf(const Tensor& param) { return c10::guts::to_string(param.unsafeGetTensorImpl()); }

template <typename State>
State& stateOf(StateMap& states, const Tensor& param) {
  auto& slot = states[keyOf(param)];
  if (!slot) slot = std::make_unique<State>();
  return static_cast<State&>(*slot);
}

template <typename Options>
const Options& optionsOf(const torch::optim::OptimizerParamGroup& group) {
  return static_cast<const Options&>(group.options());
}

// The parameters of one group that have a gradient, with their gradients and states.
template <typename State>
struct GroupWork {
  std::vector<Tensor> params;
  std::vector<Tensor> grads;
  std::vector<State*> states;
};

template <typename State>
GroupWork<State> withGrads(const torch::optim::OptimizerParamGroup& group, StateMap& states) {
  GroupWork<State> work;
  for (const auto& p : group.params()) {
    if (!p.grad().defined()) continue;
    work.params.push_back(p);
    work.grads.push_back(p.grad());
    work.states.push_back(&stateOf<State>(states, p));
  }
  return work;
}

// Runs the closure with gradients enabled, as LibTorch's optimizers do.
Tensor evaluate(const torch::optim::Optimizer::LossClosure& closure) {
  if (!closure) return {};
  at::AutoGradMode enable_grad(true);
  return closure();
}

// LibTorch's serialize<State, Options>(InputArchive&, Optimizer&) restores the per-parameter
// state but drops the saved hyper-parameters; a checkpoint must restore both.
template <typename State, typename Options>
void loadStateAndOptions(torch::serialize::InputArchive& archive, torch::optim::Optimizer& optimizer) {
  torch::optim::serialize<State, Options>(archive, optimizer);
  torch::serialize::InputArchive groups_archive;
  archive.read("param_groups", groups_archive);
  std::vector<std::pair<std::vector<std::string>, std::unique_ptr<torch::optim::OptimizerOptions>>> saved;
  torch::optim::detail::serialize<Options>(groups_archive, saved);
  TORCH_CHECK(saved.size() == optimizer.param_groups().size(), "loaded state has ", saved.size(),
              " param groups, the optimizer ", optimizer.param_groups().size());
  for (size_t i = 0; i < saved.size(); ++i) {
    validate(static_cast<const Options&>(*saved[i].second));
    optimizer.param_groups()[i].set_options(std::move(saved[i].second));
  }
}

}  // namespace

Tensor packNorms(const std::vector<SquaredNorms>& norms) {
  Tensor sums = torch::empty({static_cast<int64_t>(2 * norms.size())}, torch::kDouble);
  double* s = sums.data_ptr<double>();
  for (size_t i = 0; i < norms.size(); ++i) {
    s[2 * i] = norms[i].param;
    s[2 * i + 1] = norms[i].update;
  }
  return sums;
}

std::vector<SquaredNorms> unpackNorms(const char* optimizer, const Tensor& sums_in, size_t count) {
  TORCH_CHECK_VALUE(sums_in.defined() && sums_in.scalar_type() == at::kDouble && sums_in.dim() == 1 &&
                        sums_in.numel() == static_cast<int64_t>(2 * count) && sums_in.device().is_cpu(),
                    optimizer, ": the squared norms must be a float64 CPU tensor of length ", 2 * count,
                    " (did the norm reducer replace or resize it?)");
  const Tensor sums = sums_in.contiguous();
  const double* s = sums.data_ptr<double>();
  std::vector<SquaredNorms> out(count);
  for (size_t i = 0; i < count; ++i) out[i] = {s[2 * i], s[2 * i + 1]};
  return out;
}

// ============================ the shell of every rule ============================

template <typename T>
struct IsOptional : std::false_type {};
template <typename T>
struct IsOptional<c10::optional<T>> : std::true_type {};

template <typename Derived>
void FieldsOptions<Derived>::serialize(torch::serialize::OutputArchive& archive) const {
  forEachOption(const_cast<Derived&>(static_cast<const Derived&>(*this)),
                [&](const char* name, const auto& value) { archive.write(name, c10::IValue(value)); });
}

template <typename Derived>
void FieldsOptions<Derived>::serialize(torch::serialize::InputArchive& archive) {
  forEachOption(static_cast<Derived&>(*this), [&](const char* name, auto& value) {
    using T = std::decay_t<decltype(value)>;
    c10::IValue saved;
    const bool present = archive.try_read(name, saved);
    if constexpr (IsOptional<T>::value) {
      if (present) value = saved.toOptional<typename T::value_type>();
    } else {
      TORCH_CHECK(present, "optimizer options: the archive has no '", name, "'");
      value = saved.to<T>();
    }
  });
}

template <typename Derived>
void FieldsParamState<Derived>::serialize(torch::serialize::OutputArchive& archive) const {
  for (const StateField& f : fieldsOf(const_cast<Derived&>(static_cast<const Derived&>(*this)))) {
    if (f.counter != nullptr) {
      archive.write(f.name, c10::IValue(*f.counter));
    } else if (f.tensor->defined()) {
      archive.write(f.name, c10::IValue(*f.tensor));
    }
  }
}

template <typename Derived>
void FieldsParamState<Derived>::serialize(torch::serialize::InputArchive& archive) {
  for (const StateField& f : fieldsOf(static_cast<Derived&>(*this))) {
    c10::IValue value;
    const bool present = archive.try_read(f.name, value);
    if (f.counter != nullptr) {
      TORCH_CHECK(present, "optimizer state: the archive has no '", f.name, "'");
      *f.counter = value.toInt();
    } else if (present) {
      *f.tensor = value.toTensor();
    }
  }
}

template <typename Rule>
FusedOptimizer<Rule>::FusedOptimizer(std::vector<torch::optim::OptimizerParamGroup> param_groups, Options defaults,
                                     SquaredNormReducer reducer)
    : Optimizer(std::move(param_groups), std::make_unique<Options>(defaults)),
      reducer_(std::move(reducer)),
      threads_(defaultKernelThreads()) {
  validate(defaults);
  TORCH_CHECK(Rule::kTwoPass || !reducer_, Rule::kName, ": a SquaredNormReducer is for LAMB and LARS (",
              Rule::kName, " uses no whole-tensor norms)");
}

template <typename Rule>
FusedOptimizer<Rule>::FusedOptimizer(std::vector<Tensor> params, Options defaults, SquaredNormReducer reducer)
    : FusedOptimizer(
          std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(std::move(params))},
          std::move(defaults), std::move(reducer)) {}

template <typename Rule>
Tensor FusedOptimizer<Rule>::step(LossClosure closure) {
  using State = typename Rule::State;
  torch::NoGradGuard no_grad;
  Tensor loss = evaluate(closure);
  for (auto& group : param_groups_) validate(optionsOf<Options>(group));
  std::vector<GroupWork<State>> work;
  for (auto& group : param_groups_) work.push_back(withGrads<State>(group, state_));
  if constexpr (Rule::kTwoPass) {
    // Pass 1 over every group, one reducer call for all of them, then pass 2.
    std::vector<SquaredNorms> norms;
    for (size_t gi = 0; gi < work.size(); ++gi) {
      const auto n = Rule::norms(work[gi].params, work[gi].grads, work[gi].states,
                                 optionsOf<Options>(param_groups_[gi]), threads_);
      norms.insert(norms.end(), n.begin(), n.end());
    }
    if (reducer_) {
      Tensor sums = packNorms(norms);
      reducer_(sums);
      norms = unpackNorms(Rule::kName, sums, norms.size());
    }
    size_t offset = 0;
    for (size_t gi = 0; gi < work.size(); ++gi) {
      const std::vector<SquaredNorms> whole(norms.begin() + offset, norms.begin() + offset + work[gi].params.size());
      offset += work[gi].params.size();
      Rule::apply(work[gi].params, work[gi].grads, work[gi].states, optionsOf<Options>(param_groups_[gi]), whole,
                  threads_);
    }
  } else {
    for (size_t gi = 0; gi < work.size(); ++gi) {
      Rule::step(work[gi].params, work[gi].grads, work[gi].states, optionsOf<Options>(param_groups_[gi]), threads_);
    }
  }
  return loss;
}

template <typename Rule>
void FusedOptimizer<Rule>::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<typename Rule::State, Options>(archive, *this);
}

template <typename Rule>
void FusedOptimizer<Rule>::load(torch::serialize::InputArchive& archive) {
  loadStateAndOptions<typename Rule::State, Options>(archive, *this);
}

// ================================== AdamW ==================================

AdamWOptions::AdamWOptions(double lr) : lr_(lr) {}

std::vector<StateField> fieldsOf(MomentsParamState& s) {
  return {{"step", nullptr, &s.step()}, {"exp_avg", &s.exp_avg()}, {"exp_avg_sq", &s.exp_avg_sq()}};
}

void validate(const AdamWOptions& o) {
  checkNonNegative("AdamW", "lr", o.lr());
  checkBetas("AdamW", o.betas());
  checkNonNegative("AdamW", "eps", o.eps());
  checkNonNegative("AdamW", "weight_decay", o.weight_decay());
}

void AdamWRule::step(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                     const std::vector<AdamWParamState*>& states, const AdamWOptions& o, int threads) {
  checkCounts("AdamW", params.size(), states.size(), "states");
  const auto g =
      readableGrads("AdamW", params, grads, [&](size_t i) { momentBuffers("AdamW", *states[i], params[i]); });
  for (auto* s : states) s->step(s->step() + 1);
  const auto [b1, b2] = o.betas();
  byDtype(params, [&](auto tag, const std::vector<size_t>& indices) {
    using T = decltype(tag);
    struct Item {
      T* p;
      const T* g;
      T* m;
      T* v;
      kernels::AdamWCoeffs<T> c;
    };
    std::vector<Item> items;
    for (size_t i : indices) {
      const double t = static_cast<double>(states[i]->step());
      const double bc1 = 1 - std::pow(b1, t);
      const double bc2 = 1 - std::pow(b2, t);
      items.push_back({ptr<T>(params[i]), ptr<T>(g[i]), ptr<T>(states[i]->exp_avg()), ptr<T>(states[i]->exp_avg_sq()),
                       {T(1 - o.lr() * o.weight_decay()), T(b1), T(1 - b1), T(b2), T(1 - b2), T(o.lr() / bc1),
                        T(1 / std::sqrt(bc2)), T(o.eps())}});
    }
    kernels::parallelFor(sizesOf(params, indices), resolveThreads(threads), [&](size_t k, int64_t b, int64_t e) {
      const Item& it = items[k];
      kernels::adamw<T>(it.p, it.g, it.m, it.v, b, e, it.c);
    });
  });
  markWritten(params);
}

// =================================== AGD ===================================

AgdOptions::AgdOptions(double lr) : lr_(lr) {}

std::vector<StateField> fieldsOf(AgdParamState& s) {
  return {{"step", nullptr, &s.step()},
          {"exp_avg", &s.exp_avg()},
          {"exp_avg_sq", &s.exp_avg_sq()},
          {"max_exp_avg_sq", &s.max_exp_avg_sq()},
          {"z", &s.z()}};
}

void validate(const AgdOptions& o) {
  checkNonNegative("AGD", "lr", o.lr());
  checkBetas("AGD", o.betas());
  checkNonNegative("AGD", "delta", o.delta());
  checkNonNegative("AGD", "weight_decay", o.weight_decay());
  if (o.fixed_decay()) {
    TORCH_CHECK_VALUE(o.weight_decay() <= 1, "AGD: with fixed_decay the decay factor is 1 - weight_decay, so ",
                      "weight_decay must be <= 1, got ", o.weight_decay());
  }
  if (o.clip().has_value()) {
    TORCH_CHECK_VALUE(std::isfinite(*o.clip()) && *o.clip() > 0, "AGD: clip must be a finite number > 0 or None, got ",
                      *o.clip());
  }
}

void AgdRule::step(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                   const std::vector<AgdParamState*>& states, const AgdOptions& o, int threads) {
  checkCounts("AGD", params.size(), states.size(), "states");
  const auto g = readableGrads("AGD", params, grads, [&](size_t i) {
    stateBuffer("AGD", "exp_avg", states[i]->exp_avg(), params[i]);
    stateBuffer("AGD", "exp_avg_sq", states[i]->exp_avg_sq(), params[i]);
    if (o.amsgrad()) stateBuffer("AGD", "max_exp_avg_sq", states[i]->max_exp_avg_sq(), params[i]);
    if (o.win()) stateBuffer("AGD", "z", states[i]->z(), params[i]);
  });
  for (auto* s : states) s->step(s->step() + 1);
  const auto [b1, b2] = o.betas();
  const double lr = o.lr();
  const double wd = o.weight_decay();
  const bool decoupled = !o.win() && o.weight_decouple();
  const bool coupled = !o.win() && !o.weight_decouple();
  byDtype(params, [&](auto tag, const std::vector<size_t>& indices) {
    using T = decltype(tag);
    struct Item {
      T *p, *m, *b, *max_b, *z;
      const T* g;
      kernels::AgdCoeffs<T> c;
    };
    std::vector<Item> items;
    for (size_t i : indices) {
      const AgdParamState& s = *states[i];
      const double t = static_cast<double>(s.step());
      const double bc1 = 1 - std::pow(b1, t);
      const double bc2 = 1 - std::pow(b2, t);
      const double lr_t = lr * std::sqrt(bc2) / bc1;
      const double tau = 1 / (3 + 2 * lr_t * wd);
      kernels::AgdCoeffs<T> c{};
      c.coupled_wd = T(coupled ? wd : 0);
      c.decay = T(decoupled ? 1 - (o.fixed_decay() ? wd : lr * wd) : 1);
      c.beta1 = T(b1);
      c.one_minus_beta1 = T(1 - b1);
      c.beta2 = T(b2);
      c.one_minus_beta2 = T(1 - b2);
      c.inv_bc1 = T(1 / bc1);
      // On the first step s = m/bc1: the previous term has bc1_prev = 0 and m_prev = 0, so its
      // coefficient is 0 (not inf * 0).
      c.inv_bc1_prev = T(s.step() == 1 ? 0.0 : 1 / (1 - std::pow(b1, t - 1)));
      c.floor = T(o.delta() * std::sqrt(bc2));
      c.lr_t = T(lr_t);
      c.clip = o.clip().has_value() ? T(*o.clip()) : std::numeric_limits<T>::infinity();
      c.z_scale = T(1 / (1 + wd * lr_t));
      c.tau = T(tau);
      c.two_tau_lr = T(2 * tau * lr_t);
      c.two_tau = T(2 * tau);
      items.push_back({ptr<T>(params[i]), ptr<T>(s.exp_avg()), ptr<T>(s.exp_avg_sq()),
                       o.amsgrad() ? ptr<T>(s.max_exp_avg_sq()) : nullptr, o.win() ? ptr<T>(s.z()) : nullptr,
                       ptr<T>(g[i]), c});
    }
    kernels::parallelFor(sizesOf(params, indices), resolveThreads(threads), [&](size_t k, int64_t b, int64_t e) {
      const Item& it = items[k];
      kernels::agd<T>(it.p, it.g, it.m, it.b, it.max_b, it.z, b, e, it.c, o.amsgrad(), o.win());
    });
  });
  markWritten(params);
}

// =================================== LAMB ==================================

LambOptions::LambOptions(double lr) : lr_(lr) {}


void validate(const LambOptions& o) {
  checkNonNegative("LAMB", "lr", o.lr());
  checkBetas("LAMB", o.betas());
  checkNonNegative("LAMB", "eps", o.eps());
  checkNonNegative("LAMB", "weight_decay", o.weight_decay());
}

namespace {
template <typename T>
kernels::LambCoeffs<T> lambCoeffs(const LambOptions& o) {
  const auto [b1, b2] = o.betas();
  return {T(b1), T(1 - b1), T(b2), T(1 - b2), T(o.eps()), T(o.weight_decay())};
}
}  // namespace

std::vector<SquaredNorms> LambRule::norms(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                                          const std::vector<LambParamState*>& states, const LambOptions& o,
                                          int threads) {
  checkCounts("LAMB", params.size(), states.size(), "states");
  const auto g = readableGrads("LAMB", params, grads, [&](size_t i) { momentBuffers("LAMB", *states[i], params[i]); });
  for (auto* s : states) s->step(s->step() + 1);
  std::vector<SquaredNorms> out(params.size());
  byDtype(params, [&](auto tag, const std::vector<size_t>& indices) {
    using T = decltype(tag);
    const auto c = lambCoeffs<T>(o);
    struct Item {
      const T *p, *g;
      T *m, *v;
    };
    std::vector<Item> items;
    for (size_t i : indices) {
      items.push_back({ptr<T>(params[i]), ptr<T>(g[i]), ptr<T>(states[i]->exp_avg()), ptr<T>(states[i]->exp_avg_sq())});
    }
    const auto norms = kernels::parallelNorms(sizesOf(params, indices), resolveThreads(threads),
                                              [&](size_t k, int64_t b, int64_t e) {
                                                const Item& it = items[k];
                                                return kernels::lambMoments<T>(it.p, it.g, it.m, it.v, b, e, c);
                                              });
    for (size_t k = 0; k < indices.size(); ++k) out[indices[k]] = {norms[k].first, norms[k].second};
  });
  return out;
}

void LambRule::apply(const std::vector<Tensor>& params, const std::vector<Tensor>& /*grads*/,
                     const std::vector<LambParamState*>& states, const LambOptions& o,
                     const std::vector<SquaredNorms>& whole, int threads) {
  checkCounts("LAMB", params.size(), states.size(), "states");
  checkCounts("LAMB", params.size(), whole.size(), "norms");
  const char* missing = "pass 2 (apply) before pass 1 (norms) for this parameter";
  for (size_t i = 0; i < params.size(); ++i) {
    checkParam("LAMB", params[i]);
    TORCH_CHECK(states[i]->step() > 0, "LAMB: ", missing);
    existingBuffer("LAMB", "exp_avg", states[i]->exp_avg(), params[i], missing);
    existingBuffer("LAMB", "exp_avg_sq", states[i]->exp_avg_sq(), params[i], missing);
  }
  const auto [b1, b2] = o.betas();
  byDtype(params, [&](auto tag, const std::vector<size_t>& indices) {
    using T = decltype(tag);
    const auto c = lambCoeffs<T>(o);
    struct Item {
      T* p;
      const T *m, *v;
      T scale;
    };
    std::vector<Item> items;
    for (size_t i : indices) {
      const double t = static_cast<double>(states[i]->step());
      const double lr_t =
          o.bias_correction() ? o.lr() * std::sqrt(1 - std::pow(b2, t)) / (1 - std::pow(b1, t)) : o.lr();
      const double p_norm = std::sqrt(whole[i].param);
      const double u_norm = std::sqrt(whole[i].update);
      const double ratio = (p_norm > 0 && u_norm > 0) ? p_norm / u_norm : 1.0;
      items.push_back({ptr<T>(params[i]), ptr<T>(states[i]->exp_avg()), ptr<T>(states[i]->exp_avg_sq()),
                       T(lr_t * ratio)});
    }
    kernels::parallelFor(sizesOf(params, indices), resolveThreads(threads), [&](size_t k, int64_t b, int64_t e) {
      const Item& it = items[k];
      kernels::lambApply<T>(it.p, it.m, it.v, b, e, c, it.scale);
    });
  });
  markWritten(params);
}

// =================================== LARS ==================================

LarsOptions::LarsOptions(double lr) : lr_(lr) {}

std::vector<StateField> fieldsOf(LarsParamState& s) { return {{"momentum_buffer", &s.momentum_buffer()}}; }

void validate(const LarsOptions& o) {
  checkNonNegative("LARS", "lr", o.lr());
  checkNonNegative("LARS", "momentum", o.momentum());
  checkNonNegative("LARS", "eeta", o.eeta());
  checkNonNegative("LARS", "weight_decay", o.weight_decay());
  checkNonNegative("LARS", "epsilon", o.epsilon());
}

std::vector<SquaredNorms> LarsRule::norms(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                                          const std::vector<LarsParamState*>& /*states*/, const LarsOptions& /*o*/,
                                          int threads) {
  const auto g = readableGrads("LARS", params, grads);
  std::vector<SquaredNorms> out(params.size());
  byDtype(params, [&](auto tag, const std::vector<size_t>& indices) {
    using T = decltype(tag);
    const auto norms = kernels::parallelNorms(sizesOf(params, indices), resolveThreads(threads),
                                              [&](size_t k, int64_t b, int64_t e) {
                                                const size_t i = indices[k];
                                                return kernels::squaredNorms<T>(ptr<T>(params[i]), ptr<T>(g[i]), b, e);
                                              });
    for (size_t k = 0; k < indices.size(); ++k) out[indices[k]] = {norms[k].first, norms[k].second};
  });
  return out;
}

void LarsRule::apply(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                     const std::vector<LarsParamState*>& states, const LarsOptions& o,
                     const std::vector<SquaredNorms>& whole, int threads) {
  checkCounts("LARS", params.size(), states.size(), "states");
  checkCounts("LARS", params.size(), whole.size(), "norms");
  std::vector<char> first(params.size(), 0);
  const auto g = readableGrads("LARS", params, grads, [&](size_t i) {
    if (o.momentum() == 0) return;
    first[i] = !states[i]->momentum_buffer().defined();
    if (first[i]) {  // written before it is read
      states[i]->momentum_buffer(at::empty_like(params[i], at::MemoryFormat::Contiguous));
    }
    stateBuffer("LARS", "momentum_buffer", states[i]->momentum_buffer(), params[i]);
  });
  byDtype(params, [&](auto tag, const std::vector<size_t>& indices) {
    using T = decltype(tag);
    struct Item {
      T* p;
      const T* g;
      T* buf;
      bool first;
      T scale;
    };
    std::vector<Item> items;
    for (size_t i : indices) {
      const double p_norm = std::sqrt(whole[i].param);
      const double g_norm = std::sqrt(whole[i].update);
      double ratio = 1;
      if (p_norm > 0 && g_norm > 0) ratio = o.eeta() * p_norm / (g_norm + o.weight_decay() * p_norm + o.epsilon());
      ratio = std::clamp(ratio, 0.0, 50.0);
      items.push_back({ptr<T>(params[i]), ptr<T>(g[i]),
                       o.momentum() != 0 ? ptr<T>(states[i]->momentum_buffer()) : nullptr, first[i] != 0,
                       T(o.lr() * ratio)});
    }
    kernels::parallelFor(sizesOf(params, indices), resolveThreads(threads), [&](size_t k, int64_t b, int64_t e) {
      const Item& it = items[k];
      kernels::lars<T>(it.p, it.g, it.buf, b, e, T(o.weight_decay()), T(o.momentum()), it.first, it.scale);
    });
  });
  markWritten(params);
}

template struct FieldsOptions<AdamWOptions>;
template struct FieldsOptions<AgdOptions>;
template struct FieldsOptions<LambOptions>;
template struct FieldsOptions<LarsOptions>;
template struct FieldsParamState<MomentsParamState>;
template struct FieldsParamState<AgdParamState>;
template struct FieldsParamState<LarsParamState>;
template class FusedOptimizer<AdamWRule>;
template class FusedOptimizer<AgdRule>;
template class FusedOptimizer<LambRule>;
template class FusedOptimizer<LarsRule>;

// =================================== WSAM ==================================

WsamOptions::WsamOptions(double rho) : rho_(rho) {}

template struct FieldsOptions<WsamOptions>;

std::vector<StateField> fieldsOf(WsamParamState& s) { return {{"e", &s.e()}, {"grad", &s.grad()}}; }

void validate(const WsamOptions& o) {
  checkNonNegative("WSAM", "rho", o.rho());
  TORCH_CHECK_VALUE(o.gamma() >= 0 && o.gamma() < 1, "WSAM: gamma must be in [0, 1) (alpha = gamma/(1-gamma)), got ",
                    o.gamma());
  checkNonNegative("WSAM", "eps", o.eps());
}

namespace {
void checkWsamLists(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                    const std::vector<WsamParamState*>& states) {
  checkCounts("WSAM", params.size(), grads.size(), "gradients");
  checkCounts("WSAM", params.size(), states.size(), "states");
  for (const auto& p : params) checkParam("WSAM", p);
}
}  // namespace

double wsamGradSquaredNorm(const std::vector<Tensor>& params, const std::vector<Tensor>& grads, bool adaptive,
                           int threads) {
  const auto g = readableGrads("WSAM", params, grads);
  std::vector<double> per_param(params.size(), 0.0);
  byDtype(params, [&](auto tag, const std::vector<size_t>& indices) {
    using T = decltype(tag);
    const auto norms = kernels::parallelNorms(sizesOf(params, indices), resolveThreads(threads),
                                              [&](size_t k, int64_t b, int64_t e) {
                                                const size_t i = indices[k];
                                                return kernels::wsamGradNorm<T>(ptr<T>(params[i]), ptr<T>(g[i]), b, e,
                                                                                adaptive);
                                              });
    for (size_t k = 0; k < indices.size(); ++k) per_param[indices[k]] = norms[k].first;
  });
  double total = 0;  // in parameter order, whatever the dtypes
  for (double x : per_param) total += x;
  return total;
}

void wsamPerturb(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                 const std::vector<WsamParamState*>& states, bool adaptive, double scale, int threads) {
  checkWsamLists(params, grads, states);
  std::vector<Tensor> g(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    g[i] = readableGrad("WSAM", params[i], grads[i]);
    stateBuffer("WSAM", "e", states[i]->e(), params[i]);
  }
  byDtype(params, [&](auto tag, const std::vector<size_t>& indices) {
    using T = decltype(tag);
    kernels::parallelFor(sizesOf(params, indices), resolveThreads(threads), [&](size_t k, int64_t b, int64_t e) {
      const size_t i = indices[k];
      kernels::wsamPerturb<T>(ptr<T>(params[i]), ptr<T>(g[i]), ptr<T>(states[i]->e()), b, e, adaptive, T(scale));
    });
  });
  markWritten(params);
}

void wsamSaveGrad(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                  const std::vector<WsamParamState*>& states, int threads) {
  checkWsamLists(params, grads, states);
  for (size_t i = 0; i < params.size(); ++i) {
    checkWritableGrad("WSAM", params[i], grads[i]);
    stateBuffer("WSAM", "grad", states[i]->grad(), params[i]);
  }
  byDtype(params, [&](auto tag, const std::vector<size_t>& indices) {
    using T = decltype(tag);
    kernels::parallelFor(sizesOf(params, indices), resolveThreads(threads), [&](size_t k, int64_t b, int64_t e) {
      const size_t i = indices[k];
      kernels::saveAndZero<T>(ptr<T>(states[i]->grad()), ptr<T>(grads[i]), b, e);
    });
  });
  markWritten(grads);
}

void wsamRestore(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                 const std::vector<WsamParamState*>& states, bool decouple, double alpha, int threads) {
  checkWsamLists(params, grads, states);
  const char* missing = "the second step found a parameter the first step did not perturb; call first_step before "
                        "second_step";
  for (size_t i = 0; i < params.size(); ++i) {
    checkWritableGrad("WSAM", params[i], grads[i]);
    existingBuffer("WSAM", "e", states[i]->e(), params[i], missing);
    existingBuffer("WSAM", "grad", states[i]->grad(), params[i], missing);
  }
  byDtype(params, [&](auto tag, const std::vector<size_t>& indices) {
    using T = decltype(tag);
    kernels::parallelFor(sizesOf(params, indices), resolveThreads(threads), [&](size_t k, int64_t b, int64_t e) {
      const size_t i = indices[k];
      kernels::wsamRestore<T>(ptr<T>(params[i]), ptr<T>(grads[i]), ptr<T>(states[i]->e()), ptr<T>(states[i]->grad()),
                              b, e, decouple, T(alpha));
    });
  });
  markWritten(params);
  markWritten(grads);
}

void wsamCorrect(const std::vector<Tensor>& params, const std::vector<WsamParamState*>& states, double scale,
                 int threads) {
  checkCounts("WSAM", params.size(), states.size(), "states");
  for (size_t i = 0; i < params.size(); ++i) {
    checkParam("WSAM", params[i]);
    existingBuffer("WSAM", "e", states[i]->e(), params[i], "wsamCorrect before wsamRestore");
  }
  byDtype(params, [&](auto tag, const std::vector<size_t>& indices) {
    using T = decltype(tag);
    kernels::parallelFor(sizesOf(params, indices), resolveThreads(threads), [&](size_t k, int64_t b, int64_t e) {
      const size_t i = indices[k];
      kernels::wsamCorrect<T>(ptr<T>(params[i]), ptr<T>(states[i]->e()), b, e, T(scale));
    });
  });
  markWritten(params);
}

namespace {
std::vector<torch::optim::OptimizerParamGroup> mirrorGroups(const torch::optim::Optimizer& base,
                                                            const WsamOptions& defaults) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (const auto& group : base.param_groups()) {
    groups.emplace_back(group.params(), std::make_unique<WsamOptions>(defaults));
  }
  return groups;
}

// Makes p.grad() hold the reducer's result even if it replaced the tensors instead of
// reducing in place.
void reduceGrads(const GradientReducer& reducer, const std::vector<Tensor>& params) {
  if (!reducer) return;
  std::vector<Tensor> grads;
  grads.reserve(params.size());
  for (const auto& p : params) grads.push_back(p.grad());
  reducer(grads);
  TORCH_CHECK(grads.size() == params.size(), "GradientReducer changed the number of gradients from ", params.size(),
              " to ", grads.size());
  for (size_t i = 0; i < params.size(); ++i) {
    if (!grads[i].is_same(params[i].grad())) params[i].grad().copy_(grads[i]);
  }
}
}  // namespace

Wsam::Wsam(std::shared_ptr<torch::optim::Optimizer> base, WsamOptions defaults, GradientReducer grad_reducer,
           SquaredNormReducer norm_reducer)
    : Optimizer(mirrorGroups(*base, defaults), std::make_unique<WsamOptions>(defaults)),
      base_(std::move(base)),
      grad_reducer_(std::move(grad_reducer)),
      norm_reducer_(std::move(norm_reducer)),
      threads_(defaultKernelThreads()) {
  validate(defaults);
}

void Wsam::firstStep() {
  TORCH_CHECK(!perturbed_, "WSAM: firstStep called twice; call secondStep after the second backward pass");
  torch::NoGradGuard no_grad;
  std::vector<GroupWork<WsamParamState>> work;
  for (auto& group : param_groups_) {
    validate(optionsOf<WsamOptions>(group));
    work.push_back(withGrads<WsamParamState>(group, state_));
  }
  double squared = 0;  // summed in group order, so it does not depend on the thread count
  for (size_t gi = 0; gi < work.size(); ++gi) {
    squared += wsamGradSquaredNorm(work[gi].params, work[gi].grads,
                                   optionsOf<WsamOptions>(param_groups_[gi]).adaptive(), threads_);
  }
  if (norm_reducer_) {
    Tensor sums = torch::full({1}, squared, torch::kDouble);
    norm_reducer_(sums);
    TORCH_CHECK_VALUE(sums.defined() && sums.scalar_type() == at::kDouble && sums.numel() == 1,
                      "WSAM: the squared norm must stay a float64 tensor of one element (did the norm reducer ",
                      "replace or resize it?)");
    squared = sums.item<double>();
  }
  const double norm = std::sqrt(squared);
  for (size_t gi = 0; gi < work.size(); ++gi) {
    const auto& o = optionsOf<WsamOptions>(param_groups_[gi]);
    wsamPerturb(work[gi].params, work[gi].grads, work[gi].states, o.adaptive(), o.rho() / (norm + o.eps()), threads_);
  }
  perturbed_ = true;
  perturbed_params_.clear();
  perturbed_groups_.clear();
  for (size_t gi = 0; gi < work.size(); ++gi) {
    for (const auto& p : work[gi].params) {
      perturbed_params_.push_back(p);
      perturbed_groups_.push_back(gi);
    }
  }
  reduceGrads(grad_reducer_, perturbed_params_);
  std::vector<Tensor> grads;
  for (const auto& p : perturbed_params_) grads.push_back(p.grad());
  std::vector<WsamParamState*> states;
  for (auto& w : work) states.insert(states.end(), w.states.begin(), w.states.end());
  wsamSaveGrad(perturbed_params_, grads, states, threads_);
}

void Wsam::secondStep() {
  TORCH_CHECK(perturbed_, "WSAM: secondStep without firstStep");
  torch::NoGradGuard no_grad;
  TORCH_CHECK(base_->param_groups().size() == param_groups_.size(), "WSAM: the base optimizer has ",
              base_->param_groups().size(), " param groups but WSAM mirrors ", param_groups_.size(),
              "; add groups before wrapping it");
  const std::vector<Tensor> params = std::move(perturbed_params_);
  const std::vector<size_t> groups = std::move(perturbed_groups_);
  perturbed_params_.clear();
  perturbed_groups_.clear();
  perturbed_ = false;
  for (const auto& p : params) {
    TORCH_CHECK(p.grad().defined(), "WSAM: a parameter had a gradient in the first backward pass but none in the ",
                "second (sizes ", p.sizes(), ")");
  }
  reduceGrads(grad_reducer_, params);
  // Per group (decouple, alpha and lr are group options), in one kernel call each.
  std::vector<GroupWork<WsamParamState>> work(param_groups_.size());
  for (size_t i = 0; i < params.size(); ++i) {
    auto& w = work[groups[i]];
    w.params.push_back(params[i]);
    w.grads.push_back(params[i].grad());
    w.states.push_back(&stateOf<WsamParamState>(state_, params[i]));
  }
  for (size_t gi = 0; gi < work.size(); ++gi) {
    const auto& o = optionsOf<WsamOptions>(param_groups_[gi]);
    wsamRestore(work[gi].params, work[gi].grads, work[gi].states, o.decouple(), o.alpha(), threads_);
  }
  base_->step();
  for (size_t gi = 0; gi < work.size(); ++gi) {
    const auto& o = optionsOf<WsamOptions>(param_groups_[gi]);
    if (!o.decouple()) continue;
    const double lr = base_->param_groups()[gi].options().get_lr();
    wsamCorrect(work[gi].params, work[gi].states, lr * o.alpha(), threads_);
  }
}

Tensor Wsam::step(LossClosure closure) {
  TORCH_CHECK(closure != nullptr, "WSAM: step needs a closure that runs the forward and backward pass again ",
              "(it is evaluated at the perturbed weights w + e)");
  firstStep();
  Tensor loss = evaluate(closure);
  secondStep();
  return loss;
}

void Wsam::save(torch::serialize::OutputArchive& archive) const {
  TORCH_CHECK(!perturbed_, "WSAM: cannot save between firstStep and secondStep: the weights are perturbed");
  torch::serialize::OutputArchive base_archive(archive.compilation_unit());
  base_->save(base_archive);
  archive.write("base", base_archive);
}

void Wsam::load(torch::serialize::InputArchive& archive) {
  TORCH_CHECK(!perturbed_, "WSAM: cannot load between firstStep and secondStep: the weights are perturbed");
  torch::serialize::InputArchive base_archive;
  archive.read("base", base_archive);
  base_->load(base_archive);
}

}  // namespace troupe::optimizers
