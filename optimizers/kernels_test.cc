// The raw kernels against scalar double loops written from REFERENCE.md, and their
// thread-count independence. No LibTorch here: the class-level tests are optimizers_test.cc.
#include "kernels.h"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace troupe::optimizers::kernels {
namespace {

std::vector<float> randomVector(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// |a - b| / max(|b|, 1e-3): parameters are of unit scale, and where one crosses zero the float32
// rounding of p - update (about 1e-9 here) is all any implementation can achieve.
double maxRelDiff(const std::vector<float>& a, const std::vector<double>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::abs(a[i] - b[i]) / std::max(std::abs(b[i]), 1e-3));
  }
  return worst;
}

TEST_CASE("adamw kernel follows the reference rule for several steps on 2 threads") {
  const size_t n = 100003;  // large enough to run in parallel, odd so ranges are uneven
  std::vector<float> p = randomVector(n, 1), m(n, 0), v(n, 0);
  std::vector<double> rp(p.begin(), p.end()), rm(n, 0), rv(n, 0);
  const double lr = 1e-2, b1 = 0.9, b2 = 0.99, eps = 1e-8, wd = 0.1;
  for (int t = 1; t <= 5; ++t) {
    const std::vector<float> g = randomVector(n, 100 + t);
    const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    const AdamWCoeffs<float> c{float(1 - lr * wd), float(b1), float(1 - b1), float(b2), float(1 - b2),
                               float(lr / bc1), float(1 / std::sqrt(bc2)), float(eps)};
    parallelFor({int64_t(n)}, 2,
                [&](size_t, int64_t b, int64_t e) { adamw(p.data(), g.data(), m.data(), v.data(), b, e, c); });
    for (size_t i = 0; i < n; ++i) {
      rp[i] *= 1 - lr * wd;
      rm[i] = b1 * rm[i] + (1 - b1) * g[i];
      rv[i] = b2 * rv[i] + (1 - b2) * double(g[i]) * g[i];
      rp[i] -= lr * (rm[i] / bc1) / (std::sqrt(rv[i] / bc2) + eps);
    }
  }
  CHECK(maxRelDiff(p, rp) <= 1e-5);
}

TEST_CASE("agd kernel: first step is m/bc1, the floor applies, clip bounds the update") {
  // One element where b is tiny (the SGD-with-momentum regime below the floor) and one where
  // the clip binds.
  std::vector<float> p = {1.0f, 1.0f}, g = {1e-9f, 1.0f}, m = {0, 0}, b = {0, 0};
  const double b1 = 0.9, b2 = 0.999, delta = 1e-5, lr = 0.1, clip = 0.5;
  const double bc1 = 1 - b1, bc2 = 1 - b2, lr_t = lr * std::sqrt(bc2) / bc1;
  AgdCoeffs<float> c{};
  c.decay = 1;
  c.beta1 = float(b1);
  c.one_minus_beta1 = float(1 - b1);
  c.beta2 = float(b2);
  c.one_minus_beta2 = float(1 - b2);
  c.inv_bc1 = float(1 / bc1);
  c.inv_bc1_prev = 0;
  c.floor = float(delta * std::sqrt(bc2));
  c.lr_t = float(lr_t);
  c.clip = float(clip);
  agd<float>(p.data(), g.data(), m.data(), b.data(), nullptr, nullptr, 0, 2, c, false, false);
  // Element 0: s = g, b = (1-b2) g^2, sqrt(b) < floor, so d = floor.
  const double m0 = (1 - b1) * 1e-9;
  const double expected0 = 1.0 - lr_t * (m0 / (delta * std::sqrt(bc2)));
  CHECK(std::abs(p[0] - expected0) <= 1e-6);
  // Element 1: u = m/sqrt(b) = 0.1/sqrt(0.001) = 3.16 is clipped to 0.5.
  CHECK(std::abs(p[1] - (1.0 - lr_t * clip)) <= 1e-6);
}

TEST_CASE("reductions and updates are bit-identical for 1 and 2 threads") {
  const std::vector<int64_t> sizes = {300001, 7, 40000};
  std::vector<std::vector<float>> p0, g;
  for (size_t i = 0; i < sizes.size(); ++i) {
    p0.push_back(randomVector(sizes[i], 7 + i));
    g.push_back(randomVector(sizes[i], 70 + i));
  }
  const LambCoeffs<float> c{0.9f, 0.1f, 0.999f, 0.001f, 1e-6f, 0.01f};
  auto run = [&](int threads, std::vector<std::vector<float>>& p) {
    p = p0;
    std::vector<std::vector<float>> m, v;
    for (int64_t n : sizes) {
      m.emplace_back(n, 0.0f);
      v.emplace_back(n, 0.0f);
    }
    const auto norms = parallelNorms(sizes, threads, [&](size_t i, int64_t b, int64_t e) {
      return lambMoments(p[i].data(), g[i].data(), m[i].data(), v[i].data(), b, e, c);
    });
    parallelFor(sizes, threads, [&](size_t i, int64_t b, int64_t e) {
      lambApply(p[i].data(), m[i].data(), v[i].data(), b, e, c, 1e-3f);
    });
    return norms;
  };
  std::vector<std::vector<float>> p1, p2;
  const auto a = run(1, p1);
  const auto b = run(2, p2);
  for (size_t i = 0; i < sizes.size(); ++i) {
    CHECK(a[i].first == b[i].first);
    CHECK(a[i].second == b[i].second);
  }
  CHECK(p1 == p2);

  double direct = 0;
  for (float x : p0[0]) direct += double(x) * x;
  CHECK(std::abs(a[0].first - direct) <= 1e-9 * direct);
}

TEST_CASE("parallelFor covers every element of every array exactly once") {
  const std::vector<int64_t> sizes = {0, 5, 100000, 1, 0, 33333};
  std::vector<std::vector<int>> hits;
  for (int64_t n : sizes) hits.emplace_back(n, 0);
  parallelFor(sizes, 2, [&](size_t i, int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) ++hits[i][k];
  });
  int64_t wrong = 0;
  for (const auto& h : hits) {
    for (int x : h) wrong += x != 1;
  }
  CHECK(wrong == 0);
}

TEST_CASE("lars kernel: clamp to [-10, 10], momentum buffer starts at d") {
  std::vector<float> p = {1.0f, 2.0f}, g = {100.0f, -0.5f}, buf(2, 0);
  lars<float>(p.data(), g.data(), buf.data(), 0, 2, 0.0f, 0.9f, /*first=*/true, 0.1f);
  CHECK(buf[0] == 10.0f);
  CHECK(buf[1] == -0.5f);
  CHECK(p[0] == doctest::Approx(1.0 - 0.1 * 10));
  CHECK(p[1] == doctest::Approx(2.0 + 0.1 * 0.5));
  lars<float>(p.data(), g.data(), buf.data(), 0, 2, 0.0f, 0.9f, /*first=*/false, 0.1f);
  CHECK(buf[0] == doctest::Approx(0.9 * 10 + 10));
}

TEST_CASE("wsam kernels: perturb, save and zero, restore (decoupled and not), correct") {
  std::vector<float> w = {2.0f, -1.0f}, g = {0.5f, 0.25f}, e(2), g0(2);
  wsamPerturb<float>(w.data(), g.data(), e.data(), 0, 2, /*adaptive=*/true, 0.1f);
  CHECK(e[0] == doctest::Approx(4 * 0.5 * 0.1));
  CHECK(w[0] == doctest::Approx(2.0 + 0.2));
  saveAndZero<float>(g0.data(), g.data(), 0, 2);
  CHECK(g0[0] == 0.5f);
  CHECK(g[0] == 0.0f);
  g = {1.5f, 0.75f};  // g1
  std::vector<float> w2 = w, e2 = e, gb = g;
  wsamRestore<float>(w.data(), g.data(), e.data(), g0.data(), 0, 2, /*decouple=*/true, 9.0f);
  CHECK(w[0] == doctest::Approx(2.0));
  CHECK(e[0] == doctest::Approx(1.5 - 0.5));
  CHECK(g[0] == 0.5f);
  wsamCorrect<float>(w.data(), e.data(), 0, 2, 0.01f);
  CHECK(w[0] == doctest::Approx(2.0 - 0.01));
  wsamRestore<float>(w2.data(), gb.data(), e2.data(), g0.data(), 0, 2, /*decouple=*/false, 9.0f);
  CHECK(gb[0] == doctest::Approx(9 * 1.5 + (1 - 9) * 0.5));
}

TEST_CASE("availableCpus is at least one") { CHECK(availableCpus() >= 1); }

}  // namespace
}  // namespace troupe::optimizers::kernels
