// TrainerEngine: determinism, two ranks (threads of this process, the in-memory store, the real
// CPU ring on 127.0.0.1) against one rank with the whole global batch, learning on a real text,
// all-reduce overlapping backward, a peer leaving mid-step, checkpoint state round trips for every
// optimizer, and a TorchScript model exported by Python.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "engine_testing.h"
#include "train_testing.h"
#include "troupe/actors/dataset.h"
#include "troupe/actors/trainer_engine.h"
#include "troupe/collectives/communicator.h"
#include "troupe/runtime/clock.h"
#include "troupe/runtime/cluster_store.h"

namespace troupe::actors {
namespace {

using namespace std::chrono_literals;
using collectives::Communicator;
using testing::TempDir;
using namespace testing;

TEST_CASE("same seed and data: bitwise equal parameters; another seed differs") {
  TextData text(16);
  auto a = makeEngine(tinyOptions());
  auto b = makeEngine(tinyOptions());
  TrainerEngineOptions other_seed = tinyOptions();
  other_seed.seed = 99;
  auto c = makeEngine(other_seed);
  CHECK(a->parameterHash() == b->parameterHash());
  CHECK(a->parameterHash() != c->parameterHash());
  for (int s = 0; s < 3; ++s) {
    const Batch batch = text.step(s, 8);
    auto ma = a->step(batch);
    auto mb = b->step(batch);
    REQUIRE_MESSAGE(ma.isOk(), ma.status().toString());
    REQUIRE(mb.isOk());
    CHECK(ma->loss == mb->loss);
    CHECK(ma->micro_batches == 2);
    CHECK(ma->samples == 8);
  }
  CHECK(a->stepCount() == 3);
  CHECK(firstDifference(a->state(), b->state()) == "");
}

TEST_CASE("two ranks over the CPU ring equal one rank with the whole global batch") {
  TextData text(16);
  struct Config {
    std::string name;
    TrainerEngineOptions options;
  };
  std::vector<Config> configs;
  configs.push_back({"tinylm adamw, one bucket", tinyOptions()});
  {
    TrainerEngineOptions o = tinyOptions();
    o.optimizer = "wsam";  // two passes, both all-reduced
    o.wsam_base = "sgd";
    o.momentum = 0.9;
    o.lr = 0.05;
    configs.push_back({"tinylm wsam(sgd)", o});
  }
  {
    TrainerEngineOptions o = tinyOptions();
    o.bucket_bytes = 16 * 1024;  // many buckets, launched during backward
    o.optimizer = "lamb";
    configs.push_back({"tinylm lamb, 16 KiB buckets", o});
  }
  for (const auto& config : configs) {
    CAPTURE(config.name);
    auto single = makeEngine(config.options);
    auto cluster = troupe::testing::newTestCluster();
    auto comms = connectRanks(cluster, "equal-" + config.name, 2);
    std::vector<std::unique_ptr<TrainerEngine>> ranks;
    for (int r = 0; r < 2; ++r) {
      ranks.push_back(makeEngine(config.options));
      REQUIRE(ranks[r]->join(comms[r]).isOk());
      CHECK(ranks[r]->slice().size() == 4);
    }
    for (int s = 0; s < 4; ++s) {
      const Batch batch = text.step(s, 8);
      auto one = single->step(batch);
      REQUIRE_MESSAGE(one.isOk(), one.status().toString());
      auto two = stepAll(ranks, batch);
      for (auto& m : two) REQUIRE_MESSAGE(m.isOk(), m.status().toString());
      CHECK(two[0]->loss == one->loss);
      CHECK(two[1]->loss == one->loss);
      CHECK(two[0]->bytes_allreduced > 0);
    }
    // Bitwise: each rank's micro-batch is one of the single rank's, and a two-term sum is the
    // same in either order (see trainer_engine.h).
    // Every rank agrees (a collective check), and then one rank diverges.
    {
      std::vector<std::future<Status>> checks;
      for (auto& e : ranks) checks.push_back(std::async(std::launch::async, [&e] { return e->checkReplicas(); }));
      for (auto& c : checks) CHECK(c.get().isOk());
    }
    const auto s1 = single->state();
    CHECK(firstDifference(ranks[0]->state(), s1) == "");
    CHECK(firstDifference(ranks[1]->state(), s1) == "");
    MESSAGE(config.name << ": max |difference| of parameters, 2 ranks vs 1: "
                        << maxParamDifference(ranks[0]->state(), s1));
    auto fresh = makeEngine(config.options);
    REQUIRE(ranks[1]->loadState(fresh->state()).isOk());
    std::vector<std::future<Status>> checks;
    for (auto& e : ranks) checks.push_back(std::async(std::launch::async, [&e] { return e->checkReplicas(); }));
    for (auto& c : checks) {
      Status status = c.get();
      CHECK(status.code() == StatusCode::kFailedPrecondition);
      CHECK(status.message().find("different parameters") != std::string::npos);
    }
  }
}

TEST_CASE("three ranks with a remainder match one rank within float rounding") {
  TextData text(16);
  TrainerEngineOptions o = tinyOptions();
  o.global_batch = 7;  // 3, 2, 2 rows
  o.max_micro_batch = 2;
  auto single = makeEngine(o);
  auto comms = connectRanks(troupe::testing::newTestCluster(), "three", 3);
  std::vector<std::unique_ptr<TrainerEngine>> ranks;
  for (int r = 0; r < 3; ++r) {
    ranks.push_back(makeEngine(o));
    REQUIRE(ranks[r]->join(comms[r]).isOk());
  }
  CHECK(ranks[0]->slice().size() == 3);
  CHECK(ranks[2]->slice().size() == 2);
  for (int s = 0; s < 3; ++s) {
    const Batch batch = text.step(s, 7);
    REQUIRE(single->step(batch).isOk());
    for (auto& m : stepAll(ranks, batch)) REQUIRE_MESSAGE(m.isOk(), m.status().toString());
  }
  // Same parameters on every rank, bit for bit (the ring's reductions are the same everywhere).
  CHECK(ranks[0]->parameterHash() == ranks[1]->parameterHash());
  CHECK(ranks[0]->parameterHash() == ranks[2]->parameterHash());
  // Against one rank: the gradient sums are ordered differently. After 3 AdamW steps at lr 3e-3
  // the parameters agree to 1e-4 (an update is at most lr per step; rounding flips its sign only
  // where a gradient element is near zero).
  const double diff = maxParamDifference(ranks[0]->state(), single->state());
  MESSAGE("3 ranks vs 1: max |difference| of parameters " << diff);
  CHECK(diff < 1e-4);
}

TEST_CASE("more ranks than samples: a rank with no rows still all-reduces (zeros)") {
  TextData text(16);
  TrainerEngineOptions o = tinyOptions();
  o.global_batch = 1;
  auto single = makeEngine(o);
  auto comms = connectRanks(troupe::testing::newTestCluster(), "empty", 2);
  std::vector<std::unique_ptr<TrainerEngine>> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(makeEngine(o));
    REQUIRE(ranks[r]->join(comms[r]).isOk());
  }
  CHECK(ranks[1]->slice().size() == 0);
  for (int s = 0; s < 2; ++s) {
    const Batch batch = text.step(s, 1);
    auto one = single->step(batch);
    REQUIRE(one.isOk());
    auto two = stepAll(ranks, batch);
    for (auto& m : two) REQUIRE_MESSAGE(m.isOk(), m.status().toString());
    CHECK(two[1]->local_samples == 0);
    CHECK(two[1]->micro_batches == 0);
    CHECK(two[1]->loss == one->loss);
  }
  CHECK(firstDifference(ranks[1]->state(), single->state()) == "");
}

TEST_CASE("loss decreases on tinylm over a real English text") {
  TextData text(32);
  TrainerEngineOptions o;
  o.model = "tinylm";
  o.tinylm.context = 32;
  o.tinylm.d_model = 64;
  o.tinylm.layers = 2;
  o.tinylm.heads = 4;
  o.lr = 3e-3;
  o.global_batch = 16;
  o.max_micro_batch = 16;
  o.seed = 7;
  auto engine = makeEngine(o);
  // A held-out batch: ids never used for training below.
  std::vector<uint64_t> held;
  for (uint64_t i = 0; i < 32; ++i) held.push_back(text.dataset->size() - 1 - i);
  auto held_batch = text.dataset->batch(held);
  REQUIRE(held_batch.isOk());
  auto before = engine->evaluate(*held_batch);
  REQUIRE(before.isOk());
  CHECK(std::fabs(*before - std::log(256.0)) < 0.5);  // near uniform at the start
  double first = 0, last = 0;
  const int steps = 80;
  const uint64_t train_samples = text.dataset->size() - 64;
  for (int s = 0; s < steps; ++s) {
    std::vector<uint64_t> ids;
    for (int i = 0; i < 16; ++i) ids.push_back(static_cast<uint64_t>(s * 16 + i) * 13 % train_samples);
    auto batch = text.dataset->batch(ids);
    REQUIRE(batch.isOk());
    auto m = engine->step(*batch);
    REQUIRE_MESSAGE(m.isOk(), m.status().toString());
    if (s == 0) first = m->loss;
    last = m->loss;
  }
  auto after = engine->evaluate(*held_batch);
  REQUIRE(after.isOk());
  MESSAGE("tinylm on GPL-3: train loss " << first << " -> " << last << ", held-out " << *before << " -> "
                                         << *after);
  CHECK(*after < *before - 2.0);
  CHECK(*after < 3.3);
}

TEST_CASE("mlp with mse on .npy features learns a linear map") {
  TempDir dir;
  const int64_t n = 256, f = 6, k = 2;
  HostTensor x{"", "float32", {n, f}, std::vector<uint8_t>(n * f * 4)};
  HostTensor y{"", "float32", {n, k}, std::vector<uint8_t>(n * k * 4)};
  auto* xs = reinterpret_cast<float*>(x.bytes.data());
  auto* ys = reinterpret_cast<float*>(y.bytes.data());
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < f; ++j) xs[i * f + j] = static_cast<float>(((i * 31 + j * 17) % 23) - 11) / 11.0f;
    ys[i * k] = xs[i * f] - 0.5f * xs[i * f + 3];
    ys[i * k + 1] = 0.25f * xs[i * f + 1] + xs[i * f + 5];
  }
  REQUIRE(writeNpy(dir.path() + "/x.npy", x).isOk());
  REQUIRE(writeNpy(dir.path() + "/y.npy", y).isOk());
  auto dataset = openNpyDataset(dir.path() + "/x.npy", dir.path() + "/y.npy");
  REQUIRE_MESSAGE(dataset.isOk(), dataset.status().toString());
  TrainerEngineOptions o;
  o.model = "mlp";
  o.mlp_sizes = {f, 32, k};
  o.loss = "mse";
  o.optimizer = "adamw";
  o.lr = 1e-2;
  o.global_batch = 64;
  o.max_micro_batch = 16;
  auto engine = makeEngine(o);
  std::vector<uint64_t> all(n);
  for (int64_t i = 0; i < n; ++i) all[i] = static_cast<uint64_t>(i);
  auto everything = (*dataset)->batch(all);
  REQUIRE(everything.isOk());
  auto before = engine->evaluate(*everything);
  REQUIRE(before.isOk());
  for (int s = 0; s < 150; ++s) {
    std::vector<uint64_t> ids;
    for (int64_t i = 0; i < 64; ++i) ids.push_back(static_cast<uint64_t>((s * 64 + i) % n));
    auto batch = (*dataset)->batch(ids);
    REQUIRE(batch.isOk());
    auto m = engine->step(*batch);
    REQUIRE_MESSAGE(m.isOk(), m.status().toString());
  }
  auto after = engine->evaluate(*everything);
  REQUIRE(after.isOk());
  MESSAGE("mlp mse: " << *before << " -> " << *after);
  CHECK(*after < *before * 0.1);
  // Class labels are not mse targets.
  Batch wrong = *everything;
  wrong.targets.dtype = "int64";
  wrong.targets.shape = {n};
  CHECK(engine->evaluate(wrong).status().message().find("loss mse takes float32 targets") != std::string::npos);
}

TEST_CASE("bucketed all-reduce overlaps backward: bytes reduced before backward returned") {
  // A model whose backward takes long enough that early buckets finish during it.
  TrainerEngineOptions o;
  o.model = "mlp";
  o.mlp_sizes = {256, 512, 512, 512, 512, 10};
  o.optimizer = "sgd";
  o.lr = 0.01;
  o.global_batch = 256;
  o.max_micro_batch = 128;
  o.bucket_bytes = 256 * 1024;
  auto comms = connectRanks(troupe::testing::newTestCluster(), "overlap", 2);
  std::vector<std::unique_ptr<TrainerEngine>> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(makeEngine(o));
    REQUIRE(ranks[r]->join(comms[r]).isOk());
  }
  Batch batch;
  batch.inputs.dtype = "float32";
  batch.inputs.shape = {256, 256};
  batch.inputs.bytes.resize(256 * 256 * 4);
  auto* x = reinterpret_cast<float*>(batch.inputs.bytes.data());
  for (int i = 0; i < 256 * 256; ++i) x[i] = static_cast<float>((i * 37) % 101) / 101.0f - 0.5f;
  batch.targets.dtype = "int64";
  batch.targets.shape = {256};
  batch.targets.bytes.resize(256 * 8);
  auto* y = reinterpret_cast<int64_t*>(batch.targets.bytes.data());
  for (int i = 0; i < 256; ++i) y[i] = i % 10;
  uint64_t overlapped = 0;
  int64_t buckets = 0;
  for (int s = 0; s < 10 && overlapped == 0; ++s) {
    auto metrics = stepAll(ranks, batch);
    for (auto& m : metrics) REQUIRE_MESSAGE(m.isOk(), m.status().toString());
    overlapped += metrics[0]->bytes_reduced_in_backward;
    buckets = metrics[0]->buckets;
    CHECK(metrics[0]->bytes_allreduced == static_cast<uint64_t>(ranks[0]->parameterCount()) * 4 + 8);
  }
  MESSAGE("buckets per pass: " << buckets << "; bytes reduced before backward returned: " << overlapped);
  CHECK(buckets > 4);
  CHECK(overlapped > 0);
  CHECK(ranks[0]->parameterHash() == ranks[1]->parameterHash());
}

TEST_CASE("a peer leaving mid-training: step() fails promptly and the state is unchanged") {
  TextData text(16);
  TrainerEngineOptions o = tinyOptions();
  o.bucket_bytes = 32 * 1024;
  auto comms = connectRanks(troupe::testing::newTestCluster(), "leave", 2);
  std::vector<std::unique_ptr<TrainerEngine>> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(makeEngine(o));
    REQUIRE(ranks[r]->join(comms[r]).isOk());
  }
  for (auto& m : stepAll(ranks, text.step(0, 8))) REQUIRE(m.isOk());
  const auto before = ranks[0]->state();
  // Rank 1 goes away (its communicator says goodbye on destruction).
  ranks[1].reset();
  comms[1].reset();
  const auto start = Clock::now();
  auto failed = ranks[0]->step(rowsOf(text.step(1, 8), ranks[0]->slice()));
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  REQUIRE_FALSE(failed.isOk());
  MESSAGE("step failed after " << seconds << " s: " << failed.status().toString());
  CHECK(seconds < 2.0);
  CHECK(failed.status().code() == StatusCode::kUnavailable);
  CHECK(failed.status().message().find("rank 1") != std::string::npos);
  CHECK(ranks[0]->stepCount() == 1);
  CHECK(firstDifference(ranks[0]->state(), before) == "");
  // The next step fails at once too; after joining a new epoch (here: alone) training goes on.
  CHECK(ranks[0]->step(rowsOf(text.step(1, 8), ranks[0]->slice())).status().code() == StatusCode::kUnavailable);
  REQUIRE(ranks[0]->join(nullptr).isOk());
  CHECK(ranks[0]->slice().size() == 8);
  auto alone = ranks[0]->step(text.step(1, 8));
  REQUIRE_MESSAGE(alone.isOk(), alone.status().toString());
  CHECK(ranks[0]->stepCount() == 2);
}

TEST_CASE("state round trip: the next steps are bitwise identical, for every optimizer") {
  TextData text(16);
  for (const std::string optimizer : {"adamw", "agd", "lamb", "lars", "sgd", "wsam"}) {
    CAPTURE(optimizer);
    TrainerEngineOptions o = tinyOptions();
    o.optimizer = optimizer;
    o.momentum = 0.9;
    o.weight_decay = 0.01;
    if (optimizer == "wsam") o.wsam_base = "adamw";
    auto a = makeEngine(o);
    for (int s = 0; s < 2; ++s) REQUIRE(a->step(text.step(s, 8)).isOk());
    const auto saved = a->state();
    bool has_optimizer_state = false;
    for (const auto& e : saved) has_optimizer_state |= e.name.rfind("optim/", 0) == 0 && !e.shape.empty();
    CHECK(has_optimizer_state);
    TrainerEngineOptions fresh = o;
    fresh.seed = 555;  // different initial parameters: all replaced by the load
    auto b = makeEngine(fresh);
    REQUIRE(b->loadState(saved).isOk());
    CHECK(b->stepCount() == 2);
    CHECK(firstDifference(b->state(), saved) == "");
    for (int s = 2; s < 4; ++s) {
      auto ma = a->step(text.step(s, 8));
      auto mb = b->step(text.step(s, 8));
      REQUIRE_MESSAGE(ma.isOk(), ma.status().toString());
      REQUIRE(mb.isOk());
      CHECK(ma->loss == mb->loss);
    }
    CHECK(firstDifference(a->state(), b->state()) == "");
  }
}

TEST_CASE("loadState refuses foreign or broken state and changes nothing") {
  auto engine = makeEngine(tinyOptions());
  const auto original = engine->state();
  auto broken = original;
  for (auto& e : broken) {
    if (e.name.rfind("param/", 0) == 0) {
      e.shape[0] += 1;
      e.bytes.resize(e.bytes.size() + static_cast<size_t>(e.numel() / e.shape[0]) * 4);
      break;
    }
  }
  Status s = engine->loadState(broken);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("but this engine has") != std::string::npos);
  auto extra = original;
  extra.push_back(extra.back());
  extra.back().name = "param/not.in.this.model";
  CHECK(engine->loadState(extra).message().find("not part of this engine's state") != std::string::npos);
  TrainerEngineOptions sgd = tinyOptions();
  sgd.optimizer = "sgd";
  auto other = makeEngine(sgd);
  CHECK(other->loadState(original).message().find("optimizer 'adamw'") != std::string::npos);
  CHECK(firstDifference(engine->state(), original) == "");
}

TEST_CASE("bad options and bad batches are refused with the reason") {
  TrainerEngineOptions o = tinyOptions();
  o.optimizer = "adagrad";
  CHECK(TrainerEngine::create(o).status().message().find("unknown optimizer 'adagrad'") != std::string::npos);
  o = tinyOptions();
  o.loss = "hinge";
  CHECK(TrainerEngine::create(o).status().code() == StatusCode::kInvalidArgument);
  o = tinyOptions();
  o.model = "/nonexistent/model.pt";
  CHECK(TrainerEngine::create(o).status().code() == StatusCode::kNotFound);
  o = tinyOptions();
  o.lr = -1;
  CHECK(TrainerEngine::create(o).status().code() == StatusCode::kInvalidArgument);

  TextData text(16);
  auto engine = makeEngine(tinyOptions());
  const Batch batch = text.step(0, 8);
  auto too_few = engine->step(rowsOf(batch, {0, 5}));
  CHECK(too_few.status().message().find("5 rows but rank 0 of world 1 computes 8") != std::string::npos);
  Batch bad_token = batch;
  reinterpret_cast<int64_t*>(bad_token.inputs.bytes.data())[3] = 300;
  CHECK(engine->step(bad_token).status().message().find("token id 300") != std::string::npos);
  Batch bad_bytes = batch;
  bad_bytes.targets.bytes.pop_back();
  CHECK(engine->step(bad_bytes).status().code() == StatusCode::kInvalidArgument);
  CHECK(engine->stepCount() == 0);
}

TEST_CASE("a TorchScript model exported by Python trains (skipped without python3-torch)") {
  TempDir dir;
  const std::string path = dir.path() + "/model.pt";
  const std::string script =
      "import sys, torch\n"
      "torch.manual_seed(0)\n"
      "class Net(torch.nn.Module):\n"
      "    def __init__(self):\n"
      "        super().__init__()\n"
      "        self.fc1 = torch.nn.Linear(8, 32)\n"
      "        self.fc2 = torch.nn.Linear(32, 3)\n"
      "    def forward(self, x):\n"
      "        return self.fc2(torch.tanh(self.fc1(x)))\n"
      "torch.jit.save(torch.jit.script(Net()), sys.argv[1])\n";
  if (!testing::pythonHas("torch")) {
    MESSAGE("skipped: " << testing::python() << " cannot import torch (install python3-torch)");
    return;
  }
  const std::string failure = testing::runPython(dir.path(), script, {path});
  REQUIRE_MESSAGE(failure.empty(), failure);
  TrainerEngineOptions o;
  o.model = path;
  o.loss = "cross_entropy";
  o.optimizer = "adamw";
  o.lr = 1e-2;
  o.global_batch = 32;
  o.max_micro_batch = 8;
  auto engine = makeEngine(o);
  CHECK(engine->parameterCount() == 8 * 32 + 32 + 32 * 3 + 3);
  // A separable task: the class is the index of the largest of the first three features.
  Batch batch;
  batch.inputs.dtype = "float32";
  batch.inputs.shape = {32, 8};
  batch.inputs.bytes.resize(32 * 8 * 4);
  batch.targets.dtype = "int64";
  batch.targets.shape = {32};
  batch.targets.bytes.resize(32 * 8);
  auto* x = reinterpret_cast<float*>(batch.inputs.bytes.data());
  auto* y = reinterpret_cast<int64_t*>(batch.targets.bytes.data());
  for (int i = 0; i < 32; ++i) {
    for (int j = 0; j < 8; ++j) x[i * 8 + j] = static_cast<float>(((i + 3) * (j + 5) * 7919) % 97) / 97.0f;
    y[i] = x[i * 8] > x[i * 8 + 1] ? (x[i * 8] > x[i * 8 + 2] ? 0 : 2) : (x[i * 8 + 1] > x[i * 8 + 2] ? 1 : 2);
  }
  auto before = engine->evaluate(batch);
  REQUIRE(before.isOk());
  for (int s = 0; s < 100; ++s) {
    auto m = engine->step(batch);
    REQUIRE_MESSAGE(m.isOk(), m.status().toString());
    CHECK(m->micro_batches == 4);
  }
  auto after = engine->evaluate(batch);
  REQUIRE(after.isOk());
  MESSAGE("TorchScript MLP: loss " << *before << " -> " << *after);
  CHECK(*after < *before * 0.5);
  // Its state round-trips like a built-in model's.
  auto copy = makeEngine(o);
  REQUIRE(copy->loadState(engine->state()).isOk());
  CHECK(copy->parameterHash() == engine->parameterHash());
}

}  // namespace
}  // namespace troupe::actors
