// troupe._optim: the rules of optimizers/ (fused_optimizer.h) for troupe/optim.py.
//
// torch.optim.Optimizer keeps hyper-parameters in param_group dicts and per-parameter state in
// `state[p]` dicts, and its state_dict()/load_state_dict() work on those. So the functions here
// take a group dict and lists of (param, grad, state dict), convert them to the C++ options and
// param states (by the fields each state lists: fieldsOf), run the rule without the GIL, and
// write new state (step, buffers created on the first step) back into the dicts.
// Hyper-parameters are validated by the C++ `validate` functions; c10::ValueError / TypeError
// become Python ValueError / TypeError.
// Thread-safety: called with the GIL held; it is released around each kernel.
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "troupe/optimizers/adamw.h"
#include "troupe/optimizers/agd.h"
#include "troupe/optimizers/lamb.h"
#include "troupe/optimizers/lars.h"
#include "troupe/optimizers/wsam.h"
#include "python_errors.h"

namespace py = pybind11;
using troupe::python::InvalidArgument;
using troupe::python::WrongType;
using torch::Tensor;

namespace troupe::optimizers {
namespace {

[[noreturn]] void missingKey(const char* optimizer, const char* key) {
  throw InvalidArgument(std::string(optimizer) + ": the param group has no '" + key +
                        "' (groups get it from the optimizer's defaults)");
}

py::object entry(const py::dict& group, const char* optimizer, const char* key) {
  if (!group.contains(key)) missingKey(optimizer, key);
  return group[key];
}

std::string typeName(const py::handle& obj) { return py::str(py::type::of(obj).attr("__name__")); }

double number(const py::object& obj, const char* optimizer, const char* key) {
  if (py::isinstance<py::bool_>(obj) || obj.is_none() || py::isinstance<py::str>(obj)) {
    throw WrongType(std::string(optimizer) + ": " + key + " must be a number, got " + typeName(obj));
  }
  try {
    return py::float_(obj).cast<double>();
  } catch (const py::error_already_set&) {
    throw WrongType(std::string(optimizer) + ": " + key + " must be a number, got " + typeName(obj));
  }
}

double number(const py::dict& group, const char* optimizer, const char* key) {
  return number(entry(group, optimizer, key), optimizer, key);
}

bool flag(const py::dict& group, const char* optimizer, const char* key) {
  const py::object obj = entry(group, optimizer, key);
  if (!py::isinstance<py::bool_>(obj) && !py::isinstance<py::int_>(obj)) {
    throw WrongType(std::string(optimizer) + ": " + key + " must be True or False, got " + typeName(obj));
  }
  return obj.cast<bool>();
}

std::tuple<double, double> betas(const py::dict& group, const char* optimizer) {
  const py::object obj = entry(group, optimizer, "betas");
  if (!py::isinstance<py::sequence>(obj) || py::isinstance<py::str>(obj) || py::len(obj) != 2) {
    throw InvalidArgument(std::string(optimizer) + ": betas must be a pair (beta1, beta2), got " +
                          std::string(py::repr(obj)));
  }
  const py::sequence seq = obj;
  return {number(py::object(seq[0]), optimizer, "betas[0]"), number(py::object(seq[1]), optimizer, "betas[1]")};
}

// One hyper-parameter from a param group dict, by its C++ type.
void read(const py::dict& g, const char* optimizer, const char* key, double& value) {
  value = number(g, optimizer, key);
}
void read(const py::dict& g, const char* optimizer, const char* key, bool& value) {
  value = flag(g, optimizer, key);
}
void read(const py::dict& g, const char* optimizer, const char* /*key*/, std::tuple<double, double>& value) {
  value = betas(g, optimizer);
}
void read(const py::dict& g, const char* optimizer, const char* key, c10::optional<double>& value) {
  const py::object obj = entry(g, optimizer, key);
  value = obj.is_none() ? c10::nullopt : c10::optional<double>(number(obj, optimizer, key));
}

// The options of a rule from a param group dict, by the keys forEachOption lists, validated.
template <typename Rule>
typename Rule::Options optionsFrom(const py::dict& g) {
  typename Rule::Options o;
  forEachOption(o, [&](const char* key, auto& value) { read(g, Rule::kName, key, value); });
  validate(o);
  return o;
}

// WSAM's keys live in the base optimizer's group dicts, so its epsilon is `sam_eps` there.
WsamOptions wsamOptions(const py::dict& g) {
  const double sam_eps = number(g, "WSAM", "sam_eps");
  if (!std::isfinite(sam_eps) || sam_eps < 0) {
    throw InvalidArgument("WSAM: sam_eps must be a finite number >= 0, got " +
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
    throw WrongType(std::string("optimizer state '") + key + "' must be a tensor, got " + typeName(obj));
  }
  return THPVariable_Unpack(obj.ptr());
}

int64_t counterIn(const py::dict& state, const std::string& key) {
  if (!state.contains(key)) return 0;
  return py::int_(state[key.c_str()]).cast<int64_t>();
}

// The C++ states of a list of state dicts: each field of State from the entry of its name.
template <typename State>
std::vector<State> statesIn(const char* optimizer, size_t params, const py::list& states) {
  for (const auto& s : states) {
    if (!py::isinstance<py::dict>(s)) throw WrongType("optimizer state entries must be dicts");
  }
  if (params != states.size()) {
    throw InvalidArgument(std::string(optimizer) + ": got " + std::to_string(params) + " parameters but " +
                          std::to_string(states.size()) + " states");
  }
  std::vector<State> out(states.size());
  for (size_t i = 0; i < out.size(); ++i) {
    const auto d = py::reinterpret_borrow<py::dict>(states[i]);
    for (const StateField& f : fieldsOf(out[i])) {
      if (f.counter != nullptr) {
        *f.counter = counterIn(d, f.name);
      } else {
        *f.tensor = tensorIn(d, f.name.c_str());
      }
    }
  }
  return out;
}

// Writes back what a step changed: counters, and buffers it created (an existing buffer is the
// same tensor, already in the dict).
template <typename State>
void statesOut(const py::list& states, std::vector<State>& after, std::vector<State>& before) {
  for (size_t i = 0; i < after.size(); ++i) {
    auto d = py::reinterpret_borrow<py::dict>(states[i]);
    const auto now = fieldsOf(after[i]);
    const auto old = fieldsOf(before[i]);
    for (size_t k = 0; k < now.size(); ++k) {
      if (now[k].counter != nullptr) {
        if (*now[k].counter != *old[k].counter) d[now[k].name.c_str()] = *now[k].counter;
      } else if (now[k].tensor->defined() && !now[k].tensor->is_same(*old[k].tensor)) {
        d[now[k].name.c_str()] = py::cast(*now[k].tensor);
      }
    }
  }
}

// Runs body(states) without the GIL on the C++ form of the state dicts `states`, then writes
// what changed back into them; returns what body returns.
template <typename State, typename Body>
auto onStates(const char* optimizer, size_t params, const py::list& states, const Body& body) {
  std::vector<State> st = statesIn<State>(optimizer, params, states);
  std::vector<State> before = st;
  std::vector<State*> pointers;
  for (auto& s : st) pointers.push_back(&s);
  using Result = decltype(body(pointers));
  if constexpr (std::is_void_v<Result>) {
    {
      py::gil_scoped_release no_gil;
      body(pointers);
    }
    statesOut(states, st, before);
  } else {
    Result result;
    {
      py::gil_scoped_release no_gil;
      result = body(pointers);
    }
    statesOut(states, st, before);
    return result;
  }
}

// One-pass rules (AdamW, AGD): the whole step.
template <typename Rule>
void stepAll(const py::dict& group, const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
             const py::list& states, int threads) {
  const auto o = optionsFrom<Rule>(group);
  onStates<typename Rule::State>(Rule::kName, params.size(), states,
                                 [&](const auto& st) { Rule::step(params, grads, st, o, threads); });
}

// Two-pass rules (LAMB, LARS), pass 1: float64 [2 * len(params)], (||p||^2, ||u||^2) per
// parameter, for the norm reducer.
template <typename Rule>
Tensor normsAll(const py::dict& group, const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                const py::list& states, int threads) {
  const auto o = optionsFrom<Rule>(group);
  return packNorms(onStates<typename Rule::State>(Rule::kName, params.size(), states, [&](const auto& st) {
    return Rule::norms(params, grads, st, o, threads);
  }));
}

// Pass 2, from the reduced sums.
template <typename Rule>
void applyAll(const py::dict& group, const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
              const py::list& states, const Tensor& sums, int threads) {
  const auto o = optionsFrom<Rule>(group);
  onStates<typename Rule::State>(Rule::kName, params.size(), states, [&](const auto& st) {
    Rule::apply(params, grads, st, o, unpackNorms(Rule::kName, sums, params.size()), threads);
  });
}

// WSAM's passes (wsam.h) on its state dicts.
template <typename Pass>
void wsamPass(const std::vector<Tensor>& params, const py::list& states, const Pass& pass) {
  onStates<WsamParamState>("WSAM", params.size(), states, pass);
}

}  // namespace
}  // namespace troupe::optimizers

PYBIND11_MODULE(_optim, m) {
  troupe::python::registerErrors();
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

  m.def("validate_adamw", [](const py::dict& g) { o::optionsFrom<o::AdamWRule>(g); }, py::arg("group"));
  m.def("validate_agd", [](const py::dict& g) { o::optionsFrom<o::AgdRule>(g); }, py::arg("group"));
  m.def("validate_lamb", [](const py::dict& g) { o::optionsFrom<o::LambRule>(g); }, py::arg("group"));
  m.def("validate_lars", [](const py::dict& g) { o::optionsFrom<o::LarsRule>(g); }, py::arg("group"));
  m.def("validate_wsam", [](const py::dict& g) { o::wsamOptions(g); }, py::arg("group"));

  m.def("adamw_step", &o::stepAll<o::AdamWRule>, py::arg("group"), py::arg("params"), py::arg("grads"),
        py::arg("states"), py::arg("threads"));
  m.def("agd_step", &o::stepAll<o::AgdRule>, py::arg("group"), py::arg("params"), py::arg("grads"),
        py::arg("states"), py::arg("threads"));
  m.def("lamb_moments", &o::normsAll<o::LambRule>, py::arg("group"), py::arg("params"), py::arg("grads"),
        py::arg("states"), py::arg("threads"));
  m.def(
      "lamb_apply",
      [](const py::dict& group, const std::vector<Tensor>& params, const py::list& states, const Tensor& sums,
         int threads) { o::applyAll<o::LambRule>(group, params, {}, states, sums, threads); },
      py::arg("group"), py::arg("params"), py::arg("states"), py::arg("sums"), py::arg("threads"));
  m.def(
      "lars_norms",
      [](const std::vector<Tensor>& params, const std::vector<Tensor>& grads, int threads) {
        std::vector<o::SquaredNorms> norms;
        {
          py::gil_scoped_release no_gil;
          norms = o::LarsRule::norms(params, grads, {}, o::LarsOptions(), threads);
        }
        return o::packNorms(norms);
      },
      py::arg("params"), py::arg("grads"), py::arg("threads"));
  m.def("lars_apply", &o::applyAll<o::LarsRule>, py::arg("group"), py::arg("params"), py::arg("grads"),
        py::arg("states"), py::arg("sums"), py::arg("threads"));
  m.def(
      "wsam_grad_sq",
      [](const std::vector<Tensor>& params, const std::vector<Tensor>& grads, bool adaptive, int threads) {
        py::gil_scoped_release no_gil;
        return o::wsamGradSquaredNorm(params, grads, adaptive, threads);
      },
      py::arg("params"), py::arg("grads"), py::arg("adaptive"), py::arg("threads"));
  m.def(
      "wsam_perturb",
      [](const std::vector<Tensor>& params, const std::vector<Tensor>& grads, const py::list& states, bool adaptive,
         double scale, int threads) {
        o::wsamPass(params, states,
                    [&](const auto& st) { o::wsamPerturb(params, grads, st, adaptive, scale, threads); });
      },
      py::arg("params"), py::arg("grads"), py::arg("states"), py::arg("adaptive"), py::arg("scale"),
      py::arg("threads"));
  m.def(
      "wsam_save_grad",
      [](const std::vector<Tensor>& params, const std::vector<Tensor>& grads, const py::list& states, int threads) {
        o::wsamPass(params, states, [&](const auto& st) { o::wsamSaveGrad(params, grads, st, threads); });
      },
      py::arg("params"), py::arg("grads"), py::arg("states"), py::arg("threads"));
  m.def(
      "wsam_restore",
      [](const std::vector<Tensor>& params, const std::vector<Tensor>& grads, const py::list& states, bool decouple,
         double alpha, int threads) {
        o::wsamPass(params, states,
                    [&](const auto& st) { o::wsamRestore(params, grads, st, decouple, alpha, threads); });
      },
      py::arg("params"), py::arg("grads"), py::arg("states"), py::arg("decouple"), py::arg("alpha"),
      py::arg("threads"));
  m.def(
      "wsam_correct",
      [](const std::vector<Tensor>& params, const py::list& states, double scale, int threads) {
        o::wsamPass(params, states, [&](const auto& st) { o::wsamCorrect(params, st, scale, threads); });
      },
      py::arg("params"), py::arg("states"), py::arg("scale"), py::arg("threads"));
}
