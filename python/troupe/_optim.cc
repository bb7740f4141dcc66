// troupe._optim: the fused optimizer steps of optimizers/ for troupe/optim.py.
//
// torch.optim.Optimizer keeps hyper-parameters in param_group dicts and per-parameter state in
// `state[p]` dicts, and its state_dict()/load_state_dict() work on those. So the functions here
// take a group dict and lists of (param, grad, state dict), convert them to the C++ options and
// param states, run the kernels without the GIL, and write new state (step, buffers created on
// the first step) back into the dicts. Hyper-parameters are validated by the C++ `validate`
// functions; c10::ValueError / TypeError become Python ValueError / TypeError.
// Thread-safety: called with the GIL held; it is released around each kernel.
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "troupe/optimizers/adamw.h"
#include "troupe/optimizers/agd.h"
#include "troupe/optimizers/lamb.h"
#include "troupe/optimizers/lars.h"
#include "troupe/optimizers/wsam.h"

namespace py = pybind11;
using torch::Tensor;

namespace troupe::optimizers {
namespace {

[[noreturn]] void missingKey(const char* optimizer, const char* key) {
  throw py::value_error(std::string(optimizer) + ": the param group has no '" + key +
                        "' (groups get it from the optimizer's defaults)");
}

py::object entry(const py::dict& group, const char* optimizer, const char* key) {
  if (!group.contains(key)) missingKey(optimizer, key);
  return group[key];
}

std::string typeName(const py::handle& obj) { return py::str(py::type::of(obj).attr("__name__")); }

double number(const py::object& obj, const char* optimizer, const char* key) {
  if (py::isinstance<py::bool_>(obj) || obj.is_none() || py::isinstance<py::str>(obj)) {
    throw py::type_error(std::string(optimizer) + ": " + key + " must be a number, got " + typeName(obj));
  }
  try {
    return py::float_(obj).cast<double>();
  } catch (const py::error_already_set&) {
    throw py::type_error(std::string(optimizer) + ": " + key + " must be a number, got " + typeName(obj));
  }
}

double number(const py::dict& group, const char* optimizer, const char* key) {
  return number(entry(group, optimizer, key), optimizer, key);
}

bool flag(const py::dict& group, const char* optimizer, const char* key) {
  const py::object obj = entry(group, optimizer, key);
  if (!py::isinstance<py::bool_>(obj) && !py::isinstance<py::int_>(obj)) {
    throw py::type_error(std::string(optimizer) + ": " + key + " must be True or False, got " + typeName(obj));
  }
  return obj.cast<bool>();
}

std::tuple<double, double> betas(const py::dict& group, const char* optimizer) {
  const py::object obj = entry(group, optimizer, "betas");
  if (!py::isinstance<py::sequence>(obj) || py::isinstance<py::str>(obj) || py::len(obj) != 2) {
    throw py::value_error(std::string(optimizer) + ": betas must be a pair (beta1, beta2), got " +
                          std::string(py::repr(obj)));
  }
  const py::sequence seq = obj;
  return {number(py::object(seq[0]), optimizer, "betas[0]"), number(py::object(seq[1]), optimizer, "betas[1]")};
}

AdamWOptions adamwOptions(const py::dict& g) {
  AdamWOptions o(number(g, "AdamW", "lr"));
  o.betas(betas(g, "AdamW")).eps(number(g, "AdamW", "eps")).weight_decay(number(g, "AdamW", "weight_decay"));
  validate(o);
  return o;
}

AgdOptions agdOptions(const py::dict& g) {
  AgdOptions o(number(g, "AGD", "lr"));
  o.betas(betas(g, "AGD"))
      .delta(number(g, "AGD", "delta"))
      .weight_decay(number(g, "AGD", "weight_decay"))
      .weight_decouple(flag(g, "AGD", "weight_decouple"))
      .fixed_decay(flag(g, "AGD", "fixed_decay"))
      .amsgrad(flag(g, "AGD", "amsgrad"))
      .win(flag(g, "AGD", "win"));
  const py::object clip = entry(g, "AGD", "clip");
  if (!clip.is_none()) o.clip(number(clip, "AGD", "clip"));
  validate(o);
  return o;
}

LambOptions lambOptions(const py::dict& g) {
  LambOptions o(number(g, "LAMB", "lr"));
  o.betas(betas(g, "LAMB"))
      .eps(number(g, "LAMB", "eps"))
      .weight_decay(number(g, "LAMB", "weight_decay"))
      .bias_correction(flag(g, "LAMB", "bias_correction"));
  validate(o);
  return o;
}

LarsOptions larsOptions(const py::dict& g) {
  LarsOptions o(number(g, "LARS", "lr"));
  o.momentum(number(g, "LARS", "momentum"))
      .eeta(number(g, "LARS", "eeta"))
      .weight_decay(number(g, "LARS", "weight_decay"))
      .epsilon(number(g, "LARS", "epsilon"));
  validate(o);
  return o;
}

// WSAM's keys live in the base optimizer's group dicts, so its epsilon is `sam_eps` there.
WsamOptions wsamOptions(const py::dict& g) {
  const double sam_eps = number(g, "WSAM", "sam_eps");
  if (!std::isfinite(sam_eps) || sam_eps < 0) {
    throw py::value_error("WSAM: sam_eps must be a finite number >= 0, got " +
                          std::string(py::repr(py::float_(sam_eps))));
  }
  WsamOptions o(number(g, "WSAM", "rho"));
  o.gamma(number(g, "WSAM", "gamma"))
      .eps(sam_eps)
      .adaptive(flag(g, "WSAM", "adaptive"))
      .decouple(flag(g, "WSAM", "decouple"));
  validate(o);
  return o;
}

// ---- per-parameter state dicts ----

Tensor tensorIn(const py::dict& state, const char* key) {
  if (!state.contains(key)) return {};
  const py::object obj = state[key];
  if (obj.is_none()) return {};
  if (!THPVariable_Check(obj.ptr())) {
    throw py::type_error(std::string("optimizer state '") + key + "' must be a tensor, got " + typeName(obj));
  }
  return THPVariable_Unpack(obj.ptr());
}

// Stores a buffer the step created (an existing one is the same tensor, already there).
void tensorOut(py::dict& state, const char* key, const Tensor& t, const Tensor& before) {
  if (t.defined() && !t.is_same(before)) state[key] = py::cast(t);
}

int64_t stepIn(const py::dict& state) {
  if (!state.contains("step")) return 0;
  return py::int_(state["step"]).cast<int64_t>();
}

void checkLengths(const char* optimizer, size_t params, size_t other, const char* what) {
  if (params != other) {
    throw py::value_error(std::string(optimizer) + ": got " + std::to_string(params) + " parameters but " +
                          std::to_string(other) + " " + what);
  }
}

std::vector<py::dict> dicts(const py::list& states) {
  std::vector<py::dict> out;
  out.reserve(states.size());
  for (const auto& s : states) {
    if (!py::isinstance<py::dict>(s)) throw py::type_error("optimizer state entries must be dicts");
    out.push_back(py::reinterpret_borrow<py::dict>(s));
  }
  return out;
}

template <typename State>
std::vector<State*> pointers(std::vector<State>& states) {
  std::vector<State*> out;
  out.reserve(states.size());
  for (auto& s : states) out.push_back(&s);
  return out;
}

void adamwStepAll(const py::dict& group, const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                  const py::list& states, int threads) {
  const AdamWOptions o = adamwOptions(group);
  auto ds = dicts(states);
  checkLengths("AdamW", params.size(), ds.size(), "states");
  std::vector<AdamWParamState> st(ds.size());
  for (size_t i = 0; i < ds.size(); ++i) {
    st[i].step(stepIn(ds[i])).exp_avg(tensorIn(ds[i], "exp_avg")).exp_avg_sq(tensorIn(ds[i], "exp_avg_sq"));
  }
  const std::vector<AdamWParamState> before = st;
  {
    py::gil_scoped_release no_gil;
    adamwStep(params, grads, pointers(st), o, threads);
  }
  for (size_t i = 0; i < ds.size(); ++i) {
    ds[i]["step"] = st[i].step();
    tensorOut(ds[i], "exp_avg", st[i].exp_avg(), before[i].exp_avg());
    tensorOut(ds[i], "exp_avg_sq", st[i].exp_avg_sq(), before[i].exp_avg_sq());
  }
}

void agdStepAll(const py::dict& group, const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                const py::list& states, int threads) {
  const AgdOptions o = agdOptions(group);
  auto ds = dicts(states);
  checkLengths("AGD", params.size(), ds.size(), "states");
  std::vector<AgdParamState> st(ds.size());
  for (size_t i = 0; i < ds.size(); ++i) {
    st[i].step(stepIn(ds[i]))
        .exp_avg(tensorIn(ds[i], "exp_avg"))
        .exp_avg_sq(tensorIn(ds[i], "exp_avg_sq"))
        .max_exp_avg_sq(tensorIn(ds[i], "max_exp_avg_sq"))
        .z(tensorIn(ds[i], "z"));
  }
  const std::vector<AgdParamState> before = st;
  {
    py::gil_scoped_release no_gil;
    agdStep(params, grads, pointers(st), o, threads);
  }
  for (size_t i = 0; i < ds.size(); ++i) {
    ds[i]["step"] = st[i].step();
    tensorOut(ds[i], "exp_avg", st[i].exp_avg(), before[i].exp_avg());
    tensorOut(ds[i], "exp_avg_sq", st[i].exp_avg_sq(), before[i].exp_avg_sq());
    tensorOut(ds[i], "max_exp_avg_sq", st[i].max_exp_avg_sq(), before[i].max_exp_avg_sq());
    tensorOut(ds[i], "z", st[i].z(), before[i].z());
  }
}

Tensor packNorms(const std::vector<SquaredNorms>& norms) {
  Tensor sums = torch::empty({static_cast<int64_t>(2 * norms.size())}, torch::kDouble);
  double* s = sums.data_ptr<double>();
  for (size_t i = 0; i < norms.size(); ++i) {
    s[2 * i] = norms[i].param;
    s[2 * i + 1] = norms[i].update;
  }
  return sums;
}

std::vector<SquaredNorms> unpackNorms(const char* optimizer, const Tensor& sums_in, size_t params) {
  if (!sums_in.defined() || sums_in.scalar_type() != torch::kDouble || sums_in.dim() != 1 ||
      sums_in.numel() != static_cast<int64_t>(2 * params) || !sums_in.device().is_cpu()) {
    throw py::value_error(std::string(optimizer) + ": the squared norms must be a float64 CPU tensor of length " +
                          std::to_string(2 * params) + " (did norm_reduce replace or resize it?)");
  }
  const Tensor sums = sums_in.contiguous();
  const double* s = sums.data_ptr<double>();
  std::vector<SquaredNorms> out(params);
  for (size_t i = 0; i < params; ++i) out[i] = {s[2 * i], s[2 * i + 1]};
  return out;
}

std::vector<LambParamState> lambStatesIn(std::vector<py::dict>& ds) {
  std::vector<LambParamState> st(ds.size());
  for (size_t i = 0; i < ds.size(); ++i) {
    st[i].step(stepIn(ds[i])).exp_avg(tensorIn(ds[i], "exp_avg")).exp_avg_sq(tensorIn(ds[i], "exp_avg_sq"));
  }
  return st;
}

// Returns float64 [2 * len(params)]: (||p||^2, ||u||^2) per parameter, for the norm reducer.
Tensor lambMomentsAll(const py::dict& group, const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                      const py::list& states, int threads) {
  const LambOptions o = lambOptions(group);
  auto ds = dicts(states);
  checkLengths("LAMB", params.size(), ds.size(), "states");
  std::vector<LambParamState> st = lambStatesIn(ds);
  const std::vector<LambParamState> before = st;
  std::vector<SquaredNorms> norms;
  {
    py::gil_scoped_release no_gil;
    norms = lambMoments(params, grads, pointers(st), o, threads);
  }
  for (size_t i = 0; i < ds.size(); ++i) {
    ds[i]["step"] = st[i].step();
    tensorOut(ds[i], "exp_avg", st[i].exp_avg(), before[i].exp_avg());
    tensorOut(ds[i], "exp_avg_sq", st[i].exp_avg_sq(), before[i].exp_avg_sq());
  }
  return packNorms(norms);
}

void lambApplyAll(const py::dict& group, const std::vector<Tensor>& params, const py::list& states,
                  const Tensor& sums, int threads) {
  const LambOptions o = lambOptions(group);
  auto ds = dicts(states);
  checkLengths("LAMB", params.size(), ds.size(), "states");
  std::vector<LambParamState> st = lambStatesIn(ds);
  const std::vector<SquaredNorms> whole = unpackNorms("LAMB", sums, params.size());
  py::gil_scoped_release no_gil;
  lambApply(params, pointers(st), o, whole, threads);
}

Tensor larsNormsAll(const std::vector<Tensor>& params, const std::vector<Tensor>& grads, int threads) {
  std::vector<SquaredNorms> norms;
  {
    py::gil_scoped_release no_gil;
    norms = larsNorms(params, grads, threads);
  }
  return packNorms(norms);
}

void larsApplyAll(const py::dict& group, const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                  const py::list& states, const Tensor& sums, int threads) {
  const LarsOptions o = larsOptions(group);
  auto ds = dicts(states);
  checkLengths("LARS", params.size(), ds.size(), "states");
  std::vector<LarsParamState> st(ds.size());
  for (size_t i = 0; i < ds.size(); ++i) st[i].momentum_buffer(tensorIn(ds[i], "momentum_buffer"));
  const std::vector<LarsParamState> before = st;
  const std::vector<SquaredNorms> whole = unpackNorms("LARS", sums, params.size());
  {
    py::gil_scoped_release no_gil;
    larsApply(params, grads, pointers(st), o, whole, threads);
  }
  for (size_t i = 0; i < ds.size(); ++i) {
    tensorOut(ds[i], "momentum_buffer", st[i].momentum_buffer(), before[i].momentum_buffer());
  }
}

std::vector<WsamParamState> wsamStatesIn(std::vector<py::dict>& ds) {
  std::vector<WsamParamState> st(ds.size());
  for (size_t i = 0; i < ds.size(); ++i) st[i].e(tensorIn(ds[i], "e")).grad(tensorIn(ds[i], "grad"));
  return st;
}

void wsamStatesOut(std::vector<py::dict>& ds, const std::vector<WsamParamState>& st,
                   const std::vector<WsamParamState>& before) {
  for (size_t i = 0; i < ds.size(); ++i) {
    tensorOut(ds[i], "e", st[i].e(), before[i].e());
    tensorOut(ds[i], "grad", st[i].grad(), before[i].grad());
  }
}

double wsamGradSquaredNormAll(const std::vector<Tensor>& params, const std::vector<Tensor>& grads, bool adaptive,
                              int threads) {
  py::gil_scoped_release no_gil;
  return wsamGradSquaredNorm(params, grads, adaptive, threads);
}

void wsamPerturbAll(const std::vector<Tensor>& params, const std::vector<Tensor>& grads, const py::list& states,
                    bool adaptive, double scale, int threads) {
  auto ds = dicts(states);
  checkLengths("WSAM", params.size(), ds.size(), "states");
  std::vector<WsamParamState> st = wsamStatesIn(ds);
  const std::vector<WsamParamState> before = st;
  {
    py::gil_scoped_release no_gil;
    wsamPerturb(params, grads, pointers(st), adaptive, scale, threads);
  }
  wsamStatesOut(ds, st, before);
}

void wsamSaveGradAll(const std::vector<Tensor>& params, const std::vector<Tensor>& grads, const py::list& states,
                     int threads) {
  auto ds = dicts(states);
  checkLengths("WSAM", params.size(), ds.size(), "states");
  std::vector<WsamParamState> st = wsamStatesIn(ds);
  const std::vector<WsamParamState> before = st;
  {
    py::gil_scoped_release no_gil;
    wsamSaveGrad(params, grads, pointers(st), threads);
  }
  wsamStatesOut(ds, st, before);
}

void wsamRestoreAll(const std::vector<Tensor>& params, const std::vector<Tensor>& grads, const py::list& states,
                    bool decouple, double alpha, int threads) {
  auto ds = dicts(states);
  checkLengths("WSAM", params.size(), ds.size(), "states");
  std::vector<WsamParamState> st = wsamStatesIn(ds);
  py::gil_scoped_release no_gil;
  wsamRestore(params, grads, pointers(st), decouple, alpha, threads);
}

void wsamCorrectAll(const std::vector<Tensor>& params, const py::list& states, double scale, int threads) {
  auto ds = dicts(states);
  checkLengths("WSAM", params.size(), ds.size(), "states");
  std::vector<WsamParamState> st = wsamStatesIn(ds);
  py::gil_scoped_release no_gil;
  wsamCorrect(params, pointers(st), scale, threads);
}

}  // namespace
}  // namespace troupe::optimizers

PYBIND11_MODULE(_optim, m) {
  namespace o = troupe::optimizers;
  m.doc() = "Fused optimizer steps behind troupe.optim (see optimizers/ in the Troupe repository).";

  // Local, so they take precedence: LibTorch errors arrive without their C++ backtrace.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });

  m.def("default_threads", &o::defaultKernelThreads,
        "CPUs this process may run on: the default kernel thread count.");

  m.def("validate_adamw", [](const py::dict& g) { o::adamwOptions(g); }, py::arg("group"));
  m.def("validate_agd", [](const py::dict& g) { o::agdOptions(g); }, py::arg("group"));
  m.def("validate_lamb", [](const py::dict& g) { o::lambOptions(g); }, py::arg("group"));
  m.def("validate_lars", [](const py::dict& g) { o::larsOptions(g); }, py::arg("group"));
  m.def("validate_wsam", [](const py::dict& g) { o::wsamOptions(g); }, py::arg("group"));

  m.def("adamw_step", &o::adamwStepAll, py::arg("group"), py::arg("params"), py::arg("grads"), py::arg("states"),
        py::arg("threads"));
  m.def("agd_step", &o::agdStepAll, py::arg("group"), py::arg("params"), py::arg("grads"), py::arg("states"),
        py::arg("threads"));
  m.def("lamb_moments", &o::lambMomentsAll, py::arg("group"), py::arg("params"), py::arg("grads"),
        py::arg("states"), py::arg("threads"));
  m.def("lamb_apply", &o::lambApplyAll, py::arg("group"), py::arg("params"), py::arg("states"), py::arg("sums"),
        py::arg("threads"));
  m.def("lars_norms", &o::larsNormsAll, py::arg("params"), py::arg("grads"), py::arg("threads"));
  m.def("lars_apply", &o::larsApplyAll, py::arg("group"), py::arg("params"), py::arg("grads"), py::arg("states"),
        py::arg("sums"), py::arg("threads"));
  m.def("wsam_grad_sq", &o::wsamGradSquaredNormAll, py::arg("params"), py::arg("grads"), py::arg("adaptive"),
        py::arg("threads"));
  m.def("wsam_perturb", &o::wsamPerturbAll, py::arg("params"), py::arg("grads"), py::arg("states"),
        py::arg("adaptive"), py::arg("scale"), py::arg("threads"));
  m.def("wsam_save_grad", &o::wsamSaveGradAll, py::arg("params"), py::arg("grads"), py::arg("states"),
        py::arg("threads"));
  m.def("wsam_restore", &o::wsamRestoreAll, py::arg("params"), py::arg("grads"), py::arg("states"),
        py::arg("decouple"), py::arg("alpha"), py::arg("threads"));
  m.def("wsam_correct", &o::wsamCorrectAll, py::arg("params"), py::arg("states"), py::arg("scale"),
        py::arg("threads"));
}
