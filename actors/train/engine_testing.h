// Helpers for the TrainerEngine tests (test code only): engines, a real text as data, and
// ranks that are threads of the test process joined by the in-memory store and the real CPU
// ring on 127.0.0.1.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include "train_testing.h"
#include "troupe/actors/dataset.h"
#include "troupe/actors/trainer_engine.h"
#include "troupe/collectives/communicator.h"
#include "troupe/runtime/cluster_store.h"
#include "troupe/testing/redis_server.h"

namespace troupe::actors::testing {

using namespace std::chrono_literals;
using collectives::Communicator;

// The small tinylm most tests train: 2 layers of width 32, 16 tokens, global batch 8 in
// micro-batches of 4.
inline TrainerEngineOptions tinyOptions() {
  TrainerEngineOptions o;
  o.model = "tinylm";
  o.tinylm.context = 16;
  o.tinylm.d_model = 32;
  o.tinylm.layers = 2;
  o.tinylm.heads = 4;
  o.optimizer = "adamw";
  o.lr = 3e-3;
  o.seed = 1234;
  o.threads = 1;
  o.global_batch = 8;
  o.max_micro_batch = 4;
  return o;
}

inline std::unique_ptr<TrainerEngine> makeEngine(const TrainerEngineOptions& options) {
  auto engine = TrainerEngine::create(options);
  REQUIRE_MESSAGE(engine.isOk(), engine.status().toString());
  return std::move(engine).value();
}

// The GPL-3 text as a token dataset with `context` tokens per sample.
struct TextData {
  TempDir dir;
  std::unique_ptr<Dataset> dataset;

  explicit TextData(int64_t context) {
    const std::string path = dir.path() + "/gpl3.u16";
    auto built = buildTokenFile(testing::kEnglishText, path, "uint16");
    REQUIRE_MESSAGE(built.isOk(), built.status().toString());
    auto opened = openTokenDataset({path, "uint16", context});
    REQUIRE_MESSAGE(opened.isOk(), opened.status().toString());
    dataset = std::move(opened).value();
  }

  // The global batch of step `step`: samples step*g .. step*g+g-1, spread over the file.
  Batch step(int64_t step, int64_t g) const {
    std::vector<uint64_t> ids;
    for (int64_t i = 0; i < g; ++i) ids.push_back(static_cast<uint64_t>((step * g + i) * 7) % dataset->size());
    auto batch = dataset->batch(ids);
    REQUIRE(batch.isOk());
    return std::move(batch).value();
  }
};

// Rows [slice.begin, slice.end) of a batch.
inline Batch rowsOf(const Batch& full, RankSlice slice) {
  auto cut = [&](const HostTensor& t) {
    HostTensor out = t;
    const size_t row = t.bytes.size() / static_cast<size_t>(t.shape[0]);
    out.shape[0] = slice.size();
    out.bytes.assign(t.bytes.begin() + static_cast<std::ptrdiff_t>(row * slice.begin),
                     t.bytes.begin() + static_cast<std::ptrdiff_t>(row * slice.end));
    return out;
  };
  Batch out;
  out.inputs = cut(full.inputs);
  out.targets = cut(full.targets);
  if (!full.sample_ids.empty()) {
    out.sample_ids.assign(full.sample_ids.begin() + slice.begin, full.sample_ids.begin() + slice.end);
  }
  return out;
}

// The first entry that differs between two states ("" when bitwise equal).
inline std::string firstDifference(const std::vector<HostTensor>& a, const std::vector<HostTensor>& b) {
  if (a.size() != b.size()) return fmt::format("{} vs {} entries", a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].name != b[i].name || a[i].dtype != b[i].dtype || a[i].shape != b[i].shape ||
        a[i].bytes != b[i].bytes) {
      return a[i].name + " / " + b[i].name;
    }
  }
  return "";
}

// The largest |a - b| over the float32 parameters of two states of the same model.
inline double maxParamDifference(const std::vector<HostTensor>& a, const std::vector<HostTensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (a[i].name.rfind("param/", 0) != 0) continue;
    const auto* x = reinterpret_cast<const float*>(a[i].bytes.data());
    const auto* y = reinterpret_cast<const float*>(b[i].bytes.data());
    for (size_t k = 0; k < a[i].bytes.size() / 4; ++k) worst = std::max(worst, std::fabs(double(x[k]) - y[k]));
  }
  return worst;
}

// `world` communicators of one (group, epoch) on a test cluster store (troupe/testing/redis_server.h), connected on threads.
inline std::vector<std::shared_ptr<Communicator>> connectRanks(const std::string& cluster,
                                                        const std::string& group, int world) {
  std::vector<std::future<Result<std::unique_ptr<Communicator>>>> pending;
  for (int r = 0; r < world; ++r) {
    pending.push_back(std::async(std::launch::async, [cluster, group, world, r] {
      auto store = troupe::testing::openTestStore(cluster);
      collectives::CommunicatorOptions options;
      options.group = group;
      options.epoch = 1;
      options.rank = r;
      options.worldSize = world;
      options.rendezvousTimeout = 20s;
      options.operationTimeout = 60s;
      return collectives::connectCpuCommunicator(*store, options);
    }));
  }
  std::vector<std::shared_ptr<Communicator>> comms;
  for (auto& f : pending) {
    auto comm = f.get();
    REQUIRE_MESSAGE(comm.isOk(), comm.status().toString());
    comms.push_back(std::shared_ptr<Communicator>(std::move(comm).value()));
  }
  return comms;
}

// One step on every engine at once (rank r on its own thread with its rows of `full`).
inline std::vector<Result<StepMetrics>> stepAll(const std::vector<std::unique_ptr<TrainerEngine>>& engines,
                                         const Batch& full) {
  std::vector<std::future<Result<StepMetrics>>> pending;
  for (const auto& engine : engines) {
    TrainerEngine* e = engine.get();
    pending.push_back(std::async(std::launch::async, [e, &full] { return e->step(rowsOf(full, e->slice())); }));
  }
  std::vector<Result<StepMetrics>> out;
  for (auto& f : pending) out.push_back(f.get());
  return out;
}

}  // namespace troupe::actors::testing
