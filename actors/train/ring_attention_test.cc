// Ring attention against full attention on one rank: forward and backward for rings of 1 to 4
// ranks (threads joined by the real CPU ring), with and without causal masking; and the zigzag
// split.
#include <doctest/doctest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <future>
#include <limits>
#include <tuple>
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
  // 3 tokens per zigzag chunk; and 150, so that a rank's 300 queries span two tiles of rows.
  const std::vector<std::pair<int, int64_t>> rings = {{1, 6}, {2, 12}, {3, 18}, {4, 24}, {2, 600}};
  for (const bool causal : {false, true}) {
    for (const auto& [S, L] : rings) {
      CAPTURE(causal);
      CAPTURE(S);
      CAPTURE(L);
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
      if (S > 1) comms = connectRanks(troupe::testing::newTestCluster(), fmt::format("ring-{}-{}-{}", S, L, causal), S);
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
      MESSAGE("ring of " << S << ", " << L << " tokens" << (causal ? std::string(", causal") : std::string()) << ": max |ring - full| over out, dq, dk, dv: " << worst);
      CHECK(worst < 1e-5);
    }
  }
}

}  // namespace
}  // namespace troupe::actors::train

namespace troupe::actors {
namespace {

using namespace testing;

TEST_CASE("sequence parallelism trains tinylm as one rank does: rings of 2 and 4, and 2 x 2 with data parallel") {
  TextData text(16);
  const TrainerEngineOptions o = tinyOptions();  // 16 tokens: 2S divides it for S = 2 and 4
  auto single = makeEngine(o);
  std::vector<double> losses;
  for (int s = 0; s < 3; ++s) {
    auto m = single->step(text.step(s, 8));
    REQUIRE_MESSAGE(m.isOk(), m.status().toString());
    losses.push_back(m->loss);
  }
  const auto expected = single->state();
  for (const auto& [world, seq, zero] : std::vector<std::tuple<int, int, int>>{{2, 2, 0}, {4, 4, 0}, {4, 2, 0}, {4, 2, 2}}) {
    CAPTURE(world);
    CAPTURE(seq);
    CAPTURE(zero);
    TrainerEngineOptions so = o;
    so.sequence_parallel = seq;
    so.zero = zero;
    auto comms = connectRanks(troupe::testing::newTestCluster(), fmt::format("sp-{}-{}-{}", world, seq, zero), world);
    std::vector<std::unique_ptr<TrainerEngine>> ranks;
    for (int r = 0; r < world; ++r) {
      ranks.push_back(makeEngine(so));
      REQUIRE(ranks[r]->join(comms[r]).isOk());
      CHECK(ranks[r]->slice().size() == 8 * seq / world);  // the rows of its data-parallel group
    }
    double worst_loss = 0;
    for (int s = 0; s < 3; ++s) {
      for (auto& m : stepAll(ranks, text.step(s, 8))) {
        REQUIRE_MESSAGE(m.isOk(), m.status().toString());
        worst_loss = std::max(worst_loss, std::fabs(m->loss - losses[s]));
      }
    }
    for (int r = 1; r < world; ++r) CHECK(ranks[r]->parameterHash() == ranks[0]->parameterHash());
    const double diff = maxParamDifference(ranks[0]->state(), expected);
    MESSAGE(world << " ranks, rings of " << seq << ", zero " << zero << ": max |loss - one rank's| " << worst_loss
                  << ", max |parameter - one rank's| " << diff << " after 3 AdamW steps");
    CHECK(worst_loss < 1e-5);
    CHECK(diff < 1e-4);
  }
}

TEST_CASE("sequence parallelism refuses what it cannot do") {
  TrainerEngineOptions mlp = tinyOptions();
  mlp.model = "mlp";
  mlp.sequence_parallel = 2;
  CHECK(TrainerEngine::create(mlp).status().message().find("only with the built-in tinylm") != std::string::npos);
  TrainerEngineOptions o = tinyOptions();
  o.sequence_parallel = 2;
  auto comms = connectRanks(troupe::testing::newTestCluster(), "sp-three", 3);
  auto engine = makeEngine(o);
  Status joined = engine->join(comms[0]);
  CHECK(joined.code() == StatusCode::kInvalidArgument);
  CHECK(joined.message().find("does not divide the world size 3") != std::string::npos);
  // 14 tokens do not split into 2 x 2 equal chunks.
  TextData text(14);
  auto two = connectRanks(troupe::testing::newTestCluster(), "sp-odd", 2);
  std::vector<std::unique_ptr<TrainerEngine>> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(makeEngine(o));
    REQUIRE(ranks[r]->join(two[r]).isOk());
  }
  auto refused = ranks[0]->step(rowsOf(text.step(0, 8), ranks[0]->slice()));
  CHECK(refused.status().code() == StatusCode::kInvalidArgument);
  CHECK(refused.status().message().find("multiple of 4 tokens") != std::string::npos);
}

}  // namespace
}  // namespace troupe::actors
