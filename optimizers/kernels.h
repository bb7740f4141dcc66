// Fused CPU kernels behind the optimizers: raw pointers, no LibTorch, so this file compiles in
// seconds and the kernels can be tested on plain arrays. Internal to optimizers/.
//
// A kernel is a function over one element range [begin, end) of one parameter: a single pass,
// in place, no allocation, written so that GCC vectorises it at -O3 (built with -fno-math-errno
// so sqrt vectorises too). parallelFor / parallelNorms run a kernel over every parameter of a
// step in ONE OpenMP parallel region, each thread taking one contiguous share of all the
// elements: one fork/join per step rather than one per parameter, so small parameters are
// shared out too and a descheduled thread (on a busy machine) delays a step once, not once per
// tensor. Squared norms are summed in double over a partition of each parameter that depends
// only on its length, never on the thread count, so results are bit-for-bit reproducible
// whatever `threads` is.
//
// Coefficients are precomputed by the caller (optimizers.cc) in double from the update rules in
// ../shared/REFERENCE.md and passed converted to T.
// Thread-safety: pure functions of their arguments; callers must not share output arrays.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace troupe::optimizers::kernels {

// Squared norms of two arrays, accumulated in double.
struct SquaredNorms {
  double first = 0;
  double second = 0;
};

// Calls body(i, begin, end) on pieces covering [0, sizes[i]) for every i, in one parallel region
// of up to `threads` threads (on the calling thread alone when the total is small).
void parallelFor(const std::vector<int64_t>& sizes, int threads,
                 const std::function<void(size_t i, int64_t begin, int64_t end)>& body);

// Returns, for every i, the sum of body(i, begin, end) over a fixed partition of [0, sizes[i])
// (summed in partition order: independent of `threads`).
std::vector<SquaredNorms> parallelNorms(const std::vector<int64_t>& sizes, int threads,
                                        const std::function<SquaredNorms(size_t i, int64_t begin, int64_t end)>& body);

// AdamW: p = p*decay - step_size * m / (sqrt(v)*inv_sqrt_bc2 + eps) after the moment updates.
template <typename T>
struct AdamWCoeffs {
  T decay;          // 1 - lr*wd
  T beta1, one_minus_beta1, beta2, one_minus_beta2;
  T step_size;      // lr / (1 - beta1^t)
  T inv_sqrt_bc2;   // 1 / sqrt(1 - beta2^t)
  T eps;
};
template <typename T>
void adamw(T* p, const T* g, T* m, T* v, int64_t begin, int64_t end, const AdamWCoeffs<T>& c);

// AGD (see REFERENCE.md). Options are folded into coefficients so one loop serves all of them:
// coupled weight decay is `coupled_wd` (0 when decoupled), decoupled decay is `decay` (1 when
// coupled or win), no clip is an infinite `clip`. amsgrad and win select template variants.
template <typename T>
struct AgdCoeffs {
  T coupled_wd;     // g' = g + coupled_wd * p
  T decay;          // p *= decay (before the update)
  T beta1, one_minus_beta1, beta2, one_minus_beta2;
  T inv_bc1;        // 1 / (1 - beta1^t)
  T inv_bc1_prev;   // 1 / (1 - beta1^(t-1)), 0 on the first step
  T floor;          // delta * sqrt(1 - beta2^t)
  T lr_t;           // lr * sqrt(1 - beta2^t) / (1 - beta1^t)
  T clip;           // |u| <= clip; +inf for none
  // win only: z = (z - lr_t*u) * z_scale; p = tau*p - two_tau_lr*u + two_tau*z
  T z_scale;        // 1 / (1 + wd*lr_t)
  T tau;            // 1 / (3 + 2*lr_t*wd)
  T two_tau_lr;     // 2*tau*lr_t
  T two_tau;        // 2*tau
};
// max_b is read and written only when amsgrad; z only when win (both may be null otherwise).
template <typename T>
void agd(T* p, const T* g, T* m, T* b, T* max_b, T* z, int64_t begin, int64_t end, const AgdCoeffs<T>& c,
         bool amsgrad, bool win);

// LAMB, pass 1: updates m and v in place and returns (||p||^2, ||u||^2) over the range, with
// u = m/(sqrt(v)+eps) + wd*p.
template <typename T>
struct LambCoeffs {
  T beta1, one_minus_beta1, beta2, one_minus_beta2;
  T eps;
  T weight_decay;
};
template <typename T>
SquaredNorms lambMoments(const T* p, const T* g, T* m, T* v, int64_t begin, int64_t end, const LambCoeffs<T>& c);
// LAMB, pass 2: p -= scale * u, with scale = lr_t * trust ratio, u recomputed from m and v
// exactly as in pass 1.
template <typename T>
void lambApply(T* p, const T* m, const T* v, int64_t begin, int64_t end, const LambCoeffs<T>& c, T scale);

// LARS, pass 1: (||a||^2, ||b||^2) over the range. Read only.
template <typename T>
SquaredNorms squaredNorms(const T* a, const T* b, int64_t begin, int64_t end);
// LARS, pass 2: d = clamp(g + wd*p, -10, 10); with momentum buf = first ? d : momentum*buf + d,
// d = buf; p -= scale*d with scale = lr * trust ratio. buf may be null when momentum is 0.
template <typename T>
void lars(T* p, const T* g, T* buf, int64_t begin, int64_t end, T weight_decay, T momentum, bool first, T scale);

// WSAM, first step: (||(|w| if adaptive else 1) * g||^2, 0) over the range.
template <typename T>
SquaredNorms wsamGradNorm(const T* w, const T* g, int64_t begin, int64_t end, bool adaptive);
// WSAM, first step: e = (w^2 if adaptive else 1) * g * scale; w += e.
template <typename T>
void wsamPerturb(T* w, const T* g, T* e, int64_t begin, int64_t end, bool adaptive, T scale);
// WSAM, first step: g0 = g; g = 0.
template <typename T>
void saveAndZero(T* g0, T* g, int64_t begin, int64_t end);
// WSAM, second step: w -= e, then
//   decouple:  e = g1 - g0 (kept for the correction after the base step); g = g0
//   otherwise: g = alpha*g1 + (1-alpha)*g0
template <typename T>
void wsamRestore(T* w, T* g, T* e, const T* g0, int64_t begin, int64_t end, bool decouple, T alpha);
// WSAM, after the base step (decouple only): w -= scale * e, with scale = lr*alpha.
template <typename T>
void wsamCorrect(T* w, const T* e, int64_t begin, int64_t end, T scale);

// How many CPUs this process may run on (its affinity mask); at least 1.
int availableCpus();

}  // namespace troupe::optimizers::kernels
