// ZeRO-1 and ZeRO-2 in the TrainerEngine (ranks are threads joined by the real CPU ring): equal
// to data parallel for every optimizer, 1/N of the optimizer state per rank, a state saved at
// one world size continuing at another, and a state that covers only part of a shard refused.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine_testing.h"

namespace troupe::actors {
namespace {

using namespace testing;

struct Group {
  std::vector<std::unique_ptr<TrainerEngine>> ranks;

  Group(const TrainerEngineOptions& options, int world, const std::string& name) {
    auto comms = connectRanks(troupe::testing::newTestCluster(), name, world);
    for (int r = 0; r < world; ++r) {
      ranks.push_back(makeEngine(options));
      REQUIRE(ranks[r]->join(comms[r]).isOk());
    }
  }

  std::vector<StepMetrics> step(const Batch& batch) {
    std::vector<StepMetrics> out;
    for (auto& m : stepAll(ranks, batch)) {
      REQUIRE_MESSAGE(m.isOk(), m.status().toString());
      out.push_back(*m);
    }
    return out;
  }

  // Every rank's state, concatenated: what a restore at another world size is given.
  std::vector<HostTensor> states() const {
    std::vector<HostTensor> all;
    for (const auto& r : ranks) {
      auto s = r->state();
      all.insert(all.end(), s.begin(), s.end());
    }
    return all;
  }

  Status load(const std::vector<HostTensor>& state) {
    for (auto& r : ranks) TROUPE_RETURN_IF_ERROR(r->loadState(state));
    return Status::ok();
  }
};

// The largest |a - b| over the float32 entries the two states share by name; every float32
// entry of `a` must be in `b`.
double maxFloatDifference(const std::vector<HostTensor>& a, const std::vector<HostTensor>& b) {
  std::map<std::string, const HostTensor*> by_name;
  for (const auto& e : b) by_name[e.name] = &e;
  double worst = 0;
  for (const auto& e : a) {
    if (e.dtype != "float32") continue;
    auto it = by_name.find(e.name);
    REQUIRE_MESSAGE(it != by_name.end(), e.name);
    REQUIRE(it->second->bytes.size() == e.bytes.size());
    const auto* x = reinterpret_cast<const float*>(e.bytes.data());
    const auto* y = reinterpret_cast<const float*>(it->second->bytes.data());
    for (size_t k = 0; k < e.bytes.size() / 4; ++k) worst = std::max(worst, std::fabs(double(x[k]) - y[k]));
  }
  return worst;
}

// A whole-tensor view of a group's state: one data-parallel engine loads it.
std::vector<HostTensor> wholeState(const TrainerEngineOptions& options, const std::vector<HostTensor>& state) {
  TrainerEngineOptions plain = options;
  plain.zero = 0;
  auto engine = makeEngine(plain);
  Status loaded = engine->loadState(state);
  REQUIRE_MESSAGE(loaded.isOk(), loaded.toString());
  return engine->state();
}

TrainerEngineOptions zeroOptions(const std::string& optimizer, int zero) {
  TrainerEngineOptions o = tinyOptions();
  o.optimizer = optimizer;
  o.momentum = 0.9;
  o.weight_decay = 0.01;
  o.wsam_base = "adamw";
  o.bucket_bytes = 16 * 1024;  // many buckets: shards cut through parameters
  o.zero = zero;
  return o;
}

TEST_CASE("ZeRO-1 and ZeRO-2 train as data parallel does, for every optimizer") {
  TextData text(16);
  for (int world : {2, 3}) {
    for (const std::string optimizer : {"adamw", "agd", "lamb", "lars", "sgd", "wsam"}) {
      CAPTURE(world);
      CAPTURE(optimizer);
      const std::string tag = fmt::format("{}-{}", optimizer, world);
      Group dp(zeroOptions(optimizer, 0), world, "dp-" + tag);
      Group z1(zeroOptions(optimizer, 1), world, "z1-" + tag);
      Group z2(zeroOptions(optimizer, 2), world, "z2-" + tag);
      for (int s = 0; s < 3; ++s) {
        const Batch batch = text.step(s, 8);
        const auto a = dp.step(batch);
        const auto b = z1.step(batch);
        const auto c = z2.step(batch);
        CHECK(std::fabs(a[0].loss - b[0].loss) < 1e-5);
        CHECK(std::fabs(a[0].loss - c[0].loss) < 1e-5);
      }
      // Every rank holds the same whole model.
      for (int r = 1; r < world; ++r) {
        CHECK(z1.ranks[r]->parameterHash() == z1.ranks[0]->parameterHash());
        CHECK(z2.ranks[r]->parameterHash() == z2.ranks[0]->parameterHash());
      }
      const auto reference = dp.ranks[0]->state();
      const double p1 = maxParamDifference(z1.ranks[0]->state(), reference);
      const double p2 = maxParamDifference(z2.ranks[0]->state(), reference);
      // The sharded optimizer state, put together, is data parallel's.
      const double s1 = maxFloatDifference(wholeState(z1.ranks[0]->options(), z1.states()), reference);
      const double s2 = maxFloatDifference(wholeState(z2.ranks[0]->options(), z2.states()), reference);
      MESSAGE(optimizer << " at world " << world << ": max |ZeRO-1 - DP| params " << p1 << ", state " << s1
                        << "; ZeRO-2 params " << p2 << ", state " << s2);
      // Three steps at lr 3e-3: the reductions' order differs only in float32 rounding.
      CHECK(p1 < 1e-5);
      CHECK(p2 < 1e-5);
      CHECK(s1 < 1e-5);
      CHECK(s2 < 1e-5);
    }
  }
}

TEST_CASE("a ZeRO rank holds 1/N of the optimizer state; ZeRO-2 also 1/N of the gradients") {
  TextData text(16);
  auto whole = makeEngine(zeroOptions("adamw", 0));
  REQUIRE(whole->step(text.step(0, 8)).isOk());
  const double full = static_cast<double>(whole->optimizerStateBytes());
  REQUIRE(full > 0);
  const double gradients = static_cast<double>(whole->gradientBytes());
  for (int zero : {1, 2}) {
    Group group(zeroOptions("adamw", zero), 4, fmt::format("quarter-{}", zero));
    group.step(text.step(0, 8));
    for (const auto& r : group.ranks) {
      const double mine = static_cast<double>(r->optimizerStateBytes());
      CAPTURE(mine / full);
      CHECK(std::fabs(mine / (full / 4) - 1) < 0.05);
      // ZeRO-2 keeps only its shard of the gradients between steps; ZeRO-1 all of them.
      const double held = static_cast<double>(r->gradientBytes());
      CAPTURE(held / gradients);
      CHECK(std::fabs(held / (zero == 2 ? gradients / 4 : gradients) - 1) < 0.05);
    }
  }
}

TEST_CASE("a ZeRO-2 state saved at world 4 continues at world 3 as data parallel's does") {
  TextData text(16);
  for (const std::string optimizer : {"adamw", "lamb"}) {
    CAPTURE(optimizer);
    Group z4(zeroOptions(optimizer, 2), 4, "z4-" + optimizer);
    Group d4(zeroOptions(optimizer, 0), 4, "d4-" + optimizer);
    for (int s = 0; s < 2; ++s) {
      z4.step(text.step(s, 8));
      d4.step(text.step(s, 8));
    }
    const auto saved = z4.states();
    // A rank of the new world needs pieces of several old ranks: one old rank's is not enough.
    Group z3(zeroOptions(optimizer, 2), 3, "z3-" + optimizer);
    Status partial = z3.ranks[1]->loadState(z4.ranks[0]->state());
    CHECK(partial.code() == StatusCode::kInvalidArgument);
    CHECK(partial.message().find("give the states of every rank") != std::string::npos);
    REQUIRE(z3.load(saved).isOk());
    for (const auto& r : z3.ranks) CHECK(r->stepCount() == 2);
    Group d3(zeroOptions(optimizer, 0), 3, "d3-" + optimizer);
    REQUIRE(d3.load(d4.ranks[0]->state()).isOk());
    for (int s = 2; s < 4; ++s) {
      const Batch batch = text.step(s, 8);
      const auto a = d3.step(batch);
      const auto b = z3.step(batch);
      CHECK(std::fabs(a[0].loss - b[0].loss) < 1e-5);
    }
    const double diff = maxParamDifference(z3.ranks[0]->state(), d3.ranks[0]->state());
    MESSAGE(optimizer << ": ZeRO-2 4 -> 3 ranks vs data parallel 4 -> 3: max |difference| of parameters " << diff);
    CHECK(diff < 1e-5);
    // Loaded into a plain data-parallel engine: the same state as data parallel's.
    CHECK(maxFloatDifference(wholeState(z4.ranks[0]->options(), saved), d4.ranks[0]->state()) < 1e-5);
  }
}

TEST_CASE("ZeRO on one rank keeps the whole state; a bad zero option is refused") {
  TextData text(16);
  auto single = makeEngine(zeroOptions("lars", 2));
  auto plain = makeEngine(zeroOptions("lars", 0));
  for (int s = 0; s < 2; ++s) {
    REQUIRE(single->step(text.step(s, 8)).isOk());
    REQUIRE(plain->step(text.step(s, 8)).isOk());
  }
  CHECK(single->optimizerStateBytes() == plain->optimizerStateBytes());
  CHECK(maxFloatDifference(wholeState(single->options(), single->state()), plain->state()) == 0);
  TrainerEngineOptions bad = tinyOptions();
  bad.zero = 3;
  auto refused = TrainerEngine::create(bad);
  REQUIRE_FALSE(refused.isOk());
  CHECK(refused.status().message().find("zero must be 0") != std::string::npos);
}

}  // namespace
}  // namespace troupe::actors
