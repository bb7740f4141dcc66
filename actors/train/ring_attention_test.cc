// Ring attention against full attention on one rank: forward and backward for rings of 1 to 4
// ranks (threads joined by the real CPU ring), with and without causal masking; and the zigzag
// split.
#include <doctest/doctest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <future>
#include <limits>
#include <vector>

#include "engine_testing.h"
#include "ring_attention.h"

namespace troupe::actors::train {
namespace {

using namespace testing;

double maxDiff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

TEST_CASE("zigzag: each rank holds chunks s and 2S-1-s; a length that does not split is refused") {
  CHECK(zigzagPositions(8, 2, 0).equal(at::tensor({0, 1, 6, 7}, at::kLong)));
  CHECK(zigzagPositions(8, 2, 1).equal(at::tensor({2, 3, 4, 5}, at::kLong)));
  CHECK(zigzagPositions(6, 1, 0).equal(at::arange(6, at::kLong)));
  CHECK_THROWS_WITH_AS(zigzagPositions(10, 3, 0), doctest::Contains("multiple of 2 x the ring size"), c10::Error);
}

TEST_CASE("ring attention equals full attention, forward and backward, for 1 to 4 ranks") {
  const int64_t B = 2, H = 3, D = 8;
  for (const bool causal : {false, true}) {
    for (int S = 1; S <= 4; ++S) {
      CAPTURE(causal);
      CAPTURE(S);
      const int64_t L = 6 * S;  // 3 tokens per zigzag chunk
      auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(100 * S + causal));
      auto make = [&] { return at::randn({B, H, L, D}, gen, at::TensorOptions().dtype(at::kFloat)); };
      const at::Tensor q = make(), k = make(), v = make(), g = make();
      // The reference: softmax(q k^T / sqrt(D)) v over the whole sequence.
      at::Tensor qr = q.clone().requires_grad_(), kr = k.clone().requires_grad_(), vr = v.clone().requires_grad_();
      at::Tensor s = at::matmul(qr, kr.transpose(-2, -1)) / std::sqrt(double(D));
      if (causal) s = s.masked_fill(at::ones({L, L}, at::kBool).triu(1), -std::numeric_limits<double>::infinity());
      const at::Tensor expected = at::matmul(s.softmax(-1), vr);
      (expected * g).sum().backward();

      std::vector<std::shared_ptr<collectives::Communicator>> comms;
      if (S > 1) comms = connectRanks(makeFakeClusterState(), fmt::format("ring-{}-{}", S, causal), S);
      struct Got {
        at::Tensor positions, out, dq, dk, dv;
      };
      std::vector<std::future<Got>> pending;
      for (int r = 0; r < S; ++r) {
        pending.push_back(std::async(std::launch::async, [&, r] {
          Ring ring;
          ring.comm = S > 1 ? comms[static_cast<size_t>(r)].get() : nullptr;
          for (int i = 0; i < S; ++i) ring.ranks.push_back(i);
          ring.index = r;
          Got got;
          got.positions = zigzagPositions(L, S, r);
          at::Tensor ql = q.index_select(2, got.positions).requires_grad_();
          at::Tensor kl = k.index_select(2, got.positions).requires_grad_();
          at::Tensor vl = v.index_select(2, got.positions).requires_grad_();
          got.out = ringAttention(ql, kl, vl, causal, ring);
          (got.out * g.index_select(2, got.positions)).sum().backward();
          got.dq = ql.grad();
          got.dk = kl.grad();
          got.dv = vl.grad();
          return got;
        }));
      }
      double worst = 0;
      for (auto& f : pending) {
        Got got = f.get();
        worst = std::max({worst, maxDiff(got.out, expected.detach().index_select(2, got.positions)),
                          maxDiff(got.dq, qr.grad().index_select(2, got.positions)),
                          maxDiff(got.dk, kr.grad().index_select(2, got.positions)),
                          maxDiff(got.dv, vr.grad().index_select(2, got.positions))});
      }
      MESSAGE("ring of " << S << (causal ? std::string(", causal") : std::string()) << ": max |ring - full| over out, dq, dk, dv: " << worst);
      CHECK(worst < 1e-5);
    }
  }
}

}  // namespace
}  // namespace troupe::actors::train
