// The LibTorch optimizer classes: agreement with LibTorch's own AdamW, save/load continuing bit
// for bit, sharded LAMB/LARS norms through the reducer, WSAM around a LibTorch SGD, validation.
// The per-option numerical checks against an independent reference are in tests/optimizers/.
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>
#include <torch/torch.h>

#include <condition_variable>
#include <mutex>
#include <sstream>
#include <thread>

#include "troupe/optimizers/adamw.h"
#include "troupe/optimizers/agd.h"
#include "troupe/optimizers/lamb.h"
#include "troupe/optimizers/lars.h"
#include "troupe/optimizers/wsam.h"

// LibTorch's headers bring glog's CHECK macros; doctest's must win in this file.
#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE
#include <doctest/doctest.h>

namespace troupe::optimizers {
namespace {

using torch::Tensor;

// Gives every parameter the gradient grads(step)[i] and steps once.
void stepWith(torch::optim::Optimizer& opt, const std::vector<Tensor>& params, int64_t seed) {
  torch::manual_seed(seed);
  for (const auto& p : params) p.mutable_grad() = torch::randn_like(p);
  opt.step();
}

std::vector<Tensor> makeParams(torch::Dtype dtype, int64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({37, 41}, dtype), torch::randn({41}, dtype), torch::randn({70000}, dtype)};
}

std::vector<Tensor> cloneAll(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().clone());
  return out;
}

bool allEqual(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

TEST_CASE("AdamW matches LibTorch's AdamW in float64") {
  auto ours = makeParams(torch::kDouble, 1);
  auto theirs = cloneAll(ours);
  AdamW a(ours, AdamWOptions(1e-2).weight_decay(0.1).eps(1e-8));
  torch::optim::AdamW b(theirs, torch::optim::AdamWOptions(1e-2).weight_decay(0.1).eps(1e-8));
  for (int step = 0; step < 5; ++step) {
    stepWith(a, ours, 100 + step);
    stepWith(b, theirs, 100 + step);
  }
  for (size_t i = 0; i < ours.size(); ++i) CHECK(torch::allclose(ours[i], theirs[i], 1e-12, 1e-14));
}

TEST_CASE("AGD save/load continues the same trajectory bit for bit") {
  const auto options = AgdOptions(1e-2).weight_decay(0.01).amsgrad(true).win(true).clip(5.0);
  auto params = makeParams(torch::kFloat, 2);
  Agd opt(params, options);
  for (int step = 0; step < 3; ++step) stepWith(opt, params, 200 + step);

  std::stringstream saved;
  {
    torch::serialize::OutputArchive archive;
    opt.save(archive);
    archive.save_to(saved);
  }
  auto restored = cloneAll(params);
  Agd reopened(restored, AgdOptions(0.5));  // options come from the archive
  {
    torch::serialize::InputArchive archive;
    archive.load_from(saved);
    reopened.load(archive);
  }
  for (int step = 3; step < 6; ++step) {
    stepWith(opt, params, 200 + step);
    stepWith(reopened, restored, 200 + step);
  }
  CHECK(allEqual(params, restored));
  CHECK(static_cast<const AgdOptions&>(reopened.param_groups()[0].options()).clip() == 5.0);
}

TEST_CASE("LAMB and LARS state survives save/load") {
  auto params = makeParams(torch::kFloat, 3);
  Lars lars(params, LarsOptions(0.1).momentum(0.9).weight_decay(1e-4));
  Lamb lamb(params, LambOptions(1e-2).bias_correction(true));
  for (int step = 0; step < 2; ++step) {
    stepWith(lars, params, 300 + step);
    stepWith(lamb, params, 400 + step);
  }
  std::stringstream lars_saved, lamb_saved;
  {
    torch::serialize::OutputArchive a, b;
    lars.save(a);
    lamb.save(b);
    a.save_to(lars_saved);
    b.save_to(lamb_saved);
  }
  auto restored = cloneAll(params);
  Lars lars2(restored);
  Lamb lamb2(restored);
  {
    torch::serialize::InputArchive a, b;
    a.load_from(lars_saved);
    b.load_from(lamb_saved);
    lars2.load(a);
    lamb2.load(b);
  }
  for (int step = 2; step < 4; ++step) {
    stepWith(lars, params, 300 + step);
    stepWith(lars2, restored, 300 + step);
    stepWith(lamb, params, 400 + step);
    stepWith(lamb2, restored, 400 + step);
  }
  CHECK(allEqual(params, restored));
}

// Sums each rank's tensor across `ranks` threads, like an all-reduce (SUM) over a shard group.
class ThreadAllReduce {
 public:
  explicit ThreadAllReduce(int ranks) : ranks_(ranks) {}

  void operator()(Tensor& sums) {
    std::unique_lock<std::mutex> lock(mu_);
    total_ = arrived_ == 0 ? sums.clone() : total_ + sums;
    const int generation = generation_;
    if (++arrived_ == ranks_) {
      result_ = total_;
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != generation; });
    }
    sums.copy_(result_);
    ++calls_;
  }

  int calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  const int ranks_;
  int arrived_ = 0;
  int generation_ = 0;
  int calls_ = 0;
  Tensor total_, result_;
};

// Runs `steps` steps of an optimizer over whole tensors, and of two optimizers each holding
// one half of every tensor (ZeRO-style shards) whose norms go through ThreadAllReduce.
template <typename Make>
void checkShardedMatchesWhole(const Make& make) {
  const int steps = 3;
  auto whole = makeParams(torch::kDouble, 4);
  std::vector<std::vector<Tensor>> shards(2);
  for (const auto& p : whole) {
    const auto flat = p.detach().reshape(-1);
    const int64_t half = flat.numel() / 2;
    shards[0].push_back(flat.slice(0, 0, half).clone());
    shards[1].push_back(flat.slice(0, half).clone());
  }
  // Drawn up front: the global generator is not for concurrent use.
  std::vector<std::vector<Tensor>> all_grads(steps);
  torch::manual_seed(500);
  for (auto& g : all_grads) {
    for (const auto& p : whole) g.push_back(torch::randn_like(p));
  }
  auto grads = [&](int step) { return all_grads[step]; };

  auto opt = make(whole, SquaredNormReducer{});
  for (int step = 0; step < steps; ++step) {
    const auto g = grads(step);
    for (size_t i = 0; i < whole.size(); ++i) whole[i].mutable_grad() = g[i];
    opt->step();
  }

  ThreadAllReduce reduce(2);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back([&, rank] {
      auto shard_opt = make(shards[rank], [&](Tensor& sums) { reduce(sums); });
      for (int step = 0; step < steps; ++step) {
        const auto g = grads(step);
        for (size_t i = 0; i < whole.size(); ++i) {
          const auto flat = g[i].reshape(-1);
          const int64_t half = flat.numel() / 2;
          shards[rank][i].mutable_grad() = rank == 0 ? flat.slice(0, 0, half).clone() : flat.slice(0, half).clone();
        }
        shard_opt->step();
      }
    });
  }
  for (auto& t : ranks) t.join();
  CHECK(reduce.calls() == 2 * steps);  // one reduction per rank per step, for all tensors at once
  for (size_t i = 0; i < whole.size(); ++i) {
    const auto joined = torch::cat({shards[0][i], shards[1][i]});
    CHECK(torch::allclose(joined, whole[i].reshape(-1), 1e-12, 1e-14));
  }
}

TEST_CASE("LAMB in a sharded group uses whole-tensor norms through the reducer") {
  checkShardedMatchesWhole([](std::vector<Tensor> params, SquaredNormReducer reducer) {
    return std::make_unique<Lamb>(std::move(params), LambOptions(1e-2).weight_decay(0.01), std::move(reducer));
  });
}

TEST_CASE("LARS in a sharded group uses whole-tensor norms through the reducer") {
  checkShardedMatchesWhole([](std::vector<Tensor> params, SquaredNormReducer reducer) {
    return std::make_unique<Lars>(std::move(params), LarsOptions(0.5).momentum(0.9).weight_decay(1e-3).eeta(0.01),
                                  std::move(reducer));
  });
}

TEST_CASE("WSAM wraps LibTorch's SGD and follows the rule (decoupled and not)") {
  for (bool decouple : {true, false}) {
    CAPTURE(decouple);
    const double lr = 0.05, rho = 0.1, gamma = 0.8, alpha = gamma / (1 - gamma);
    torch::manual_seed(6);
    Tensor w = torch::randn({5}, torch::kDouble).requires_grad_(true);
    const Tensor a = torch::randn({5}, torch::kDouble);
    const Tensor w_start = w.detach().clone();
    auto loss_fn = [&] {
      Tensor loss = (w.pow(4) / 4 + a * w).sum();
      loss.backward();
      return loss;
    };
    auto sgd = std::make_shared<torch::optim::SGD>(std::vector<Tensor>{w}, torch::optim::SGDOptions(lr));
    int reduced = 0;
    Wsam wsam(sgd, WsamOptions(rho).gamma(gamma).decouple(decouple),
              [&](std::vector<Tensor>& grads) { reduced += static_cast<int>(grads.size()); });
    w.mutable_grad() = Tensor();
    loss_fn();
    wsam.step([&] { return loss_fn(); });
    CHECK(reduced == 2);  // the hook ran once per pass, with the one gradient

    // The rule, by hand.
    const Tensor g0 = w_start.pow(3) + a;
    const Tensor e = g0 * rho / (g0.norm() + 1e-12);
    const Tensor g1 = (w_start + e).pow(3) + a;
    Tensor expected;
    if (decouple) {
      expected = w_start - lr * g0 - lr * alpha * (g1 - g0);
    } else {
      expected = w_start - lr * (alpha * g1 + (1 - alpha) * g0);
    }
    CHECK(torch::allclose(w.detach(), expected, 1e-12, 1e-14));
  }
}

TEST_CASE("WSAM refuses a step without a closure and a save between its two passes") {
  Tensor w = torch::randn({3}).requires_grad_(true);
  auto base = std::make_shared<Agd>(std::vector<Tensor>{w});
  Wsam wsam(base);
  CHECK_THROWS_AS(wsam.step(), c10::Error);
  w.mutable_grad() = torch::ones({3});
  wsam.firstStep();
  torch::serialize::OutputArchive archive;
  CHECK_THROWS_AS(wsam.save(archive), c10::Error);
  CHECK_THROWS_AS(wsam.firstStep(), c10::Error);
  w.mutable_grad() = torch::ones({3});
  wsam.secondStep();
  wsam.save(archive);
}

TEST_CASE("bad hyper-parameters raise c10::ValueError naming the value") {
  std::vector<Tensor> params = {torch::zeros({2})};
  CHECK_THROWS_AS(Agd(params, AgdOptions(-1.0)), c10::ValueError);
  CHECK_THROWS_AS(Agd(params, AgdOptions().betas({0.9, 1.0})), c10::ValueError);
  CHECK_THROWS_AS(Agd(params, AgdOptions().clip(0.0)), c10::ValueError);
  CHECK_THROWS_AS(AdamW(params, AdamWOptions().eps(-1e-8)), c10::ValueError);
  CHECK_THROWS_AS(Lamb(params, LambOptions().weight_decay(-0.1)), c10::ValueError);
  CHECK_THROWS_AS(Lars(params, LarsOptions().momentum(-0.9)), c10::ValueError);
  auto base = std::make_shared<AdamW>(params);
  CHECK_THROWS_AS(Wsam(base, WsamOptions().gamma(1.0)), c10::ValueError);
  try {
    Agd(params, AgdOptions(std::nan("")));
    FAIL("no error");
  } catch (const c10::ValueError& e) {
    CHECK(std::string(e.what_without_backtrace()).find("AGD: lr must be a finite number >= 0, got nan") !=
          std::string::npos);
  }
}

TEST_CASE("a float16 parameter is refused with a TypeError") {
  std::vector<Tensor> params = {torch::zeros({2}, torch::kHalf)};
  AdamW opt(params);
  params[0].mutable_grad() = torch::ones({2}, torch::kHalf);
  CHECK_THROWS_AS(opt.step(), c10::TypeError);
}

TEST_CASE("stepRule on caller-owned states runs the rule the class runs, bit for bit") {
  auto by_class = makeParams(torch::kFloat, 9);
  auto by_rule = cloneAll(by_class);
  const auto options = LambOptions(1e-2).weight_decay(0.01).bias_correction(true);
  Lamb opt(by_class, options);
  std::vector<LambParamState> states(by_rule.size());
  std::vector<LambParamState*> pointers;
  for (auto& s : states) pointers.push_back(&s);
  int whole_calls = 0;
  for (int step = 0; step < 3; ++step) {
    stepWith(opt, by_class, 900 + step);
    torch::manual_seed(900 + step);
    std::vector<Tensor> grads;
    for (const auto& p : by_rule) grads.push_back(torch::randn_like(p));
    torch::NoGradGuard no_grad;
    stepRule<LambRule>(by_rule, grads, pointers, options, defaultKernelThreads(),
                       [&](std::vector<SquaredNorms>& norms) {
                         CHECK(norms.size() == by_rule.size());
                         ++whole_calls;
                       });
  }
  CHECK(whole_calls == 3);
  CHECK(allEqual(by_class, by_rule));
  CHECK(states[0].step() == 3);
  const auto fields = fieldsOf(states[0]);
  REQUIRE(fields.size() == 3);
  CHECK(fields[0].name == "step");
  CHECK(fields[0].counter == &states[0].step());
  CHECK(fields[1].tensor->is_same(states[0].exp_avg()));
}

TEST_CASE("a one-pass rule refuses a norm reducer; a reducer that resizes the sums is a ValueError") {
  std::vector<Tensor> params = {torch::zeros({2})};
  const SquaredNormReducer noop = [](Tensor&) {};
  CHECK_THROWS_AS(AdamW(params, AdamWOptions(), noop), c10::Error);
  CHECK_THROWS_AS(Agd(params, AgdOptions(), noop), c10::Error);
  Lars lars(params, LarsOptions(), [](Tensor& sums) { sums = torch::zeros({1}, torch::kDouble); });
  params[0].mutable_grad() = torch::ones({2});
  CHECK_THROWS_AS(lars.step(), c10::ValueError);
}

TEST_CASE("results do not depend on the kernel thread count") {
  auto one = makeParams(torch::kFloat, 7);
  auto two = cloneAll(one);
  Lamb a(one, LambOptions(1e-2));
  Lamb b(two, LambOptions(1e-2));
  Agd c(one);
  Agd d(two);
  a.setThreads(1);
  c.setThreads(1);
  b.setThreads(2);
  d.setThreads(2);
  for (int step = 0; step < 3; ++step) {
    stepWith(a, one, 700 + step);
    stepWith(b, two, 700 + step);
    stepWith(c, one, 800 + step);
    stepWith(d, two, 800 + step);
  }
  CHECK(allEqual(one, two));
}

}  // namespace
}  // namespace troupe::optimizers
