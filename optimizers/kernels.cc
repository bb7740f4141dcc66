#include "kernels.h"

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <cmath>

namespace troupe::optimizers::kernels {
namespace {

// Below this many elements in a step, a fork/join (a few microseconds) costs more than it saves.
constexpr int64_t kMinParallel = int64_t{1} << 15;
// A reduction sums a parameter over at most this many parts, each in order; see partsFor.
constexpr int64_t kMaxParts = 64;

bool runParallel(int64_t total, int threads) { return threads > 1 && total >= kMinParallel; }

// The partition of a reduction depends on n only, so sums are identical for any thread count
// (a state_dict round trip or a change of `threads` continues bit for bit).
int64_t partsFor(int64_t n) { return std::clamp<int64_t>(n / 4096, 1, kMaxParts); }

template <typename T>
T clampTo(T x, T lo, T hi) {
  return std::min(std::max(x, lo), hi);
}

template <typename T>
void adamwRange(T* __restrict p, const T* __restrict g, T* __restrict m, T* __restrict v, int64_t begin,
                int64_t end, const AdamWCoeffs<T> c) {
  for (int64_t i = begin; i < end; ++i) {
    const T gi = g[i];
    const T mi = c.beta1 * m[i] + c.one_minus_beta1 * gi;
    const T vi = c.beta2 * v[i] + c.one_minus_beta2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const T denom = std::sqrt(vi) * c.inv_sqrt_bc2 + c.eps;
    p[i] = p[i] * c.decay - c.step_size * mi / denom;
  }
}

template <typename T, bool kAmsgrad, bool kWin>
void agdRange(T* __restrict p, const T* __restrict g, T* __restrict m, T* __restrict b, T* __restrict max_b,
              T* __restrict z, int64_t begin, int64_t end, const AgdCoeffs<T> c) {
  for (int64_t i = begin; i < end; ++i) {
    T pi = p[i];
    const T gi = g[i] + c.coupled_wd * pi;
    pi *= c.decay;
    const T m_prev = m[i];
    const T mi = c.beta1 * m_prev + c.one_minus_beta1 * gi;
    const T s = mi * c.inv_bc1 - m_prev * c.inv_bc1_prev;
    const T bi = c.beta2 * b[i] + c.one_minus_beta2 * s * s;
    m[i] = mi;
    b[i] = bi;
    T d2 = bi;
    if constexpr (kAmsgrad) {
      d2 = std::max(max_b[i], bi);
      max_b[i] = d2;
    }
    const T d = std::max(std::sqrt(d2), c.floor);
    const T u = clampTo(mi / d, -c.clip, c.clip);
    if constexpr (kWin) {
      const T zi = (z[i] - c.lr_t * u) * c.z_scale;
      z[i] = zi;
      p[i] = c.tau * pi - c.two_tau_lr * u + c.two_tau * zi;
    } else {
      p[i] = pi - c.lr_t * u;
    }
  }
}

template <typename T>
SquaredNorms lambMomentsRange(const T* __restrict p, const T* __restrict g, T* __restrict m, T* __restrict v,
                              int64_t begin, int64_t end, const LambCoeffs<T> c) {
  double pp = 0;
  double uu = 0;
#pragma omp simd reduction(+ : pp, uu)
  for (int64_t i = begin; i < end; ++i) {
    const T gi = g[i];
    const T mi = c.beta1 * m[i] + c.one_minus_beta1 * gi;
    const T vi = c.beta2 * v[i] + c.one_minus_beta2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const T u = mi / (std::sqrt(vi) + c.eps) + c.weight_decay * p[i];
    pp += static_cast<double>(p[i]) * p[i];
    uu += static_cast<double>(u) * u;
  }
  return {pp, uu};
}

template <typename T>
void lambApplyRange(T* __restrict p, const T* __restrict m, const T* __restrict v, int64_t begin, int64_t end,
                    const LambCoeffs<T> c, T scale) {
  for (int64_t i = begin; i < end; ++i) {
    const T u = m[i] / (std::sqrt(v[i]) + c.eps) + c.weight_decay * p[i];
    p[i] = p[i] - scale * u;
  }
}

template <typename T>
SquaredNorms squaredNormsRange(const T* __restrict a, const T* __restrict b, int64_t begin, int64_t end) {
  double aa = 0;
  double bb = 0;
#pragma omp simd reduction(+ : aa, bb)
  for (int64_t i = begin; i < end; ++i) {
    aa += static_cast<double>(a[i]) * a[i];
    bb += static_cast<double>(b[i]) * b[i];
  }
  return {aa, bb};
}

template <typename T, bool kMomentum>
void larsRange(T* __restrict p, const T* __restrict g, T* __restrict buf, int64_t begin, int64_t end, T wd,
               T momentum, bool first, T scale) {
  for (int64_t i = begin; i < end; ++i) {
    T d = clampTo(g[i] + wd * p[i], T(-10), T(10));
    if constexpr (kMomentum) {
      d = first ? d : momentum * buf[i] + d;
      buf[i] = d;
    }
    p[i] = p[i] - scale * d;
  }
}

template <typename T>
SquaredNorms wsamNormRange(const T* __restrict w, const T* __restrict g, int64_t begin, int64_t end,
                           bool adaptive) {
  double gg = 0;
  if (adaptive) {
#pragma omp simd reduction(+ : gg)
    for (int64_t i = begin; i < end; ++i) {
      const T x = std::abs(w[i]) * g[i];
      gg += static_cast<double>(x) * x;
    }
  } else {
#pragma omp simd reduction(+ : gg)
    for (int64_t i = begin; i < end; ++i) gg += static_cast<double>(g[i]) * g[i];
  }
  return {gg, 0};
}

}  // namespace

void parallelFor(const std::vector<int64_t>& sizes, int threads,
                 const std::function<void(size_t i, int64_t begin, int64_t end)>& body) {
  std::vector<int64_t> starts(sizes.size() + 1, 0);  // starts[i]: offset of array i in the total
  for (size_t i = 0; i < sizes.size(); ++i) starts[i + 1] = starts[i] + sizes[i];
  const int64_t total = starts.back();
  if (!runParallel(total, threads)) {
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (sizes[i] > 0) body(i, 0, sizes[i]);
    }
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int64_t nt = omp_get_num_threads();
    const int64_t t = omp_get_thread_num();
    const int64_t share = ((total + nt - 1) / nt + 15) / 16 * 16;
    const int64_t first = std::min(total, t * share);
    const int64_t last = std::min(total, first + share);
    // The array holding element `first`, then every array overlapping [first, last).
    size_t i = std::upper_bound(starts.begin(), starts.end(), first) - starts.begin() - 1;
    for (; i < sizes.size() && starts[i] < last; ++i) {
      const int64_t begin = std::max(first, starts[i]) - starts[i];
      const int64_t end = std::min(last, starts[i + 1]) - starts[i];
      if (begin < end) body(i, begin, end);
    }
  }
}

std::vector<SquaredNorms> parallelNorms(const std::vector<int64_t>& sizes, int threads,
                                        const std::function<SquaredNorms(size_t i, int64_t begin, int64_t end)>& body) {
  struct Part {
    size_t i;
    int64_t begin, end;
    SquaredNorms sums;
  };
  std::vector<Part> parts;  // at most kMaxParts per parameter: proportional to the parameter count
  int64_t total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t n = sizes[i];
    total += n;
    if (n == 0) continue;
    const int64_t count = partsFor(n);
    for (int64_t k = 0; k < count; ++k) parts.push_back({i, n * k / count, n * (k + 1) / count, {}});
  }
  const auto run = [&](size_t k) { parts[k].sums = body(parts[k].i, parts[k].begin, parts[k].end); };
  if (runParallel(total, threads)) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (size_t k = 0; k < parts.size(); ++k) run(k);
  } else {
    for (size_t k = 0; k < parts.size(); ++k) run(k);
  }
  std::vector<SquaredNorms> out(sizes.size());
  for (const auto& part : parts) {
    out[part.i].first += part.sums.first;
    out[part.i].second += part.sums.second;
  }
  return out;
}

template <typename T>
void adamw(T* p, const T* g, T* m, T* v, int64_t begin, int64_t end, const AdamWCoeffs<T>& c) {
  adamwRange(p, g, m, v, begin, end, c);
}

template <typename T>
void agd(T* p, const T* g, T* m, T* b, T* max_b, T* z, int64_t begin, int64_t end, const AgdCoeffs<T>& c,
         bool amsgrad, bool win) {
  if (amsgrad && win) agdRange<T, true, true>(p, g, m, b, max_b, z, begin, end, c);
  else if (amsgrad) agdRange<T, true, false>(p, g, m, b, max_b, z, begin, end, c);
  else if (win) agdRange<T, false, true>(p, g, m, b, max_b, z, begin, end, c);
  else agdRange<T, false, false>(p, g, m, b, max_b, z, begin, end, c);
}

template <typename T>
SquaredNorms lambMoments(const T* p, const T* g, T* m, T* v, int64_t begin, int64_t end, const LambCoeffs<T>& c) {
  return lambMomentsRange(p, g, m, v, begin, end, c);
}

template <typename T>
void lambApply(T* p, const T* m, const T* v, int64_t begin, int64_t end, const LambCoeffs<T>& c, T scale) {
  lambApplyRange(p, m, v, begin, end, c, scale);
}

template <typename T>
SquaredNorms squaredNorms(const T* a, const T* b, int64_t begin, int64_t end) {
  return squaredNormsRange(a, b, begin, end);
}

template <typename T>
void lars(T* p, const T* g, T* buf, int64_t begin, int64_t end, T weight_decay, T momentum, bool first, T scale) {
  if (buf != nullptr) larsRange<T, true>(p, g, buf, begin, end, weight_decay, momentum, first, scale);
  else larsRange<T, false>(p, g, buf, begin, end, weight_decay, momentum, first, scale);
}

template <typename T>
SquaredNorms wsamGradNorm(const T* w, const T* g, int64_t begin, int64_t end, bool adaptive) {
  return wsamNormRange(w, g, begin, end, adaptive);
}

template <typename T>
void wsamPerturb(T* w, const T* g, T* e, int64_t begin, int64_t end, bool adaptive, T scale) {
  T* __restrict wr = w;
  const T* __restrict gr = g;
  T* __restrict er = e;
  if (adaptive) {
    for (int64_t i = begin; i < end; ++i) {
      const T ei = wr[i] * wr[i] * gr[i] * scale;
      er[i] = ei;
      wr[i] += ei;
    }
  } else {
    for (int64_t i = begin; i < end; ++i) {
      const T ei = gr[i] * scale;
      er[i] = ei;
      wr[i] += ei;
    }
  }
}

template <typename T>
void saveAndZero(T* g0, T* g, int64_t begin, int64_t end) {
  T* __restrict dst = g0;
  T* __restrict src = g;
  for (int64_t i = begin; i < end; ++i) {
    dst[i] = src[i];
    src[i] = T(0);
  }
}

template <typename T>
void wsamRestore(T* w, T* g, T* e, const T* g0, int64_t begin, int64_t end, bool decouple, T alpha) {
  T* __restrict wr = w;
  T* __restrict gr = g;
  T* __restrict er = e;
  const T* __restrict g0r = g0;
  if (decouple) {
    for (int64_t i = begin; i < end; ++i) {
      wr[i] -= er[i];
      er[i] = gr[i] - g0r[i];
      gr[i] = g0r[i];
    }
  } else {
    const T beta = T(1) - alpha;
    for (int64_t i = begin; i < end; ++i) {
      wr[i] -= er[i];
      gr[i] = alpha * gr[i] + beta * g0r[i];
    }
  }
}

template <typename T>
void wsamCorrect(T* w, const T* e, int64_t begin, int64_t end, T scale) {
  T* __restrict wr = w;
  const T* __restrict er = e;
  for (int64_t i = begin; i < end; ++i) wr[i] -= scale * er[i];
}

int availableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

#define TROUPE_INSTANTIATE_KERNELS(T)                                                                      \
  template void adamw<T>(T*, const T*, T*, T*, int64_t, int64_t, const AdamWCoeffs<T>&);                    \
  template void agd<T>(T*, const T*, T*, T*, T*, T*, int64_t, int64_t, const AgdCoeffs<T>&, bool, bool);    \
  template SquaredNorms lambMoments<T>(const T*, const T*, T*, T*, int64_t, int64_t, const LambCoeffs<T>&); \
  template void lambApply<T>(T*, const T*, const T*, int64_t, int64_t, const LambCoeffs<T>&, T);            \
  template SquaredNorms squaredNorms<T>(const T*, const T*, int64_t, int64_t);                              \
  template void lars<T>(T*, const T*, T*, int64_t, int64_t, T, T, bool, T);                                 \
  template SquaredNorms wsamGradNorm<T>(const T*, const T*, int64_t, int64_t, bool);                        \
  template void wsamPerturb<T>(T*, const T*, T*, int64_t, int64_t, bool, T);                                \
  template void saveAndZero<T>(T*, T*, int64_t, int64_t);                                                   \
  template void wsamRestore<T>(T*, T*, T*, const T*, int64_t, int64_t, bool, T);                            \
  template void wsamCorrect<T>(T*, const T*, int64_t, int64_t, T);

TROUPE_INSTANTIATE_KERNELS(float)
TROUPE_INSTANTIATE_KERNELS(double)

}  // namespace troupe::optimizers::kernels
