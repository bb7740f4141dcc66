// parallel_bench (bench/run parallel [--json]): what sharding buys, in two parts.
//
// 1. Memory and step time of data parallel against ZeRO-1 and ZeRO-2 for one model of about 50M
//    parameters (the built-in MLP, 2048-4096-4096-4096-2048, MSE on random features) with AdamW,
//    at world sizes 2 and 4. Per rank: optimizer-state bytes (every state tensor it holds), peak
//    resident memory (VmHWM of its process) and the median step time after warm-up; a row reports
//    the largest over its ranks (a synchronous step is as slow as the slowest rank).
// 2. Ring attention: tinylm (d_model 64, 4 heads, 2 layers, one sequence per step) at doubling
//    contexts, on one rank (ordinary attention) and on a ring of 4 (sequence parallelism): the
//    peak resident memory per rank of a training step, the longest context whose peak stays
//    within a per-rank budget (--ring-budget-mb), and tokens/s at a context both can run.
//
// Each rank is a process with one intra-op thread; ranks meet through a real redis-server and
// talk over the CPU ring. Prints tables and, with --json, one JSON object on the last line:
//   {"benchmark": "parallel", "config": {...}, "rows": [{"mode": "dp" | "zero1" | "zero2",
//    "world_size", "opt_state_bytes_per_rank", "opt_state_vs_dp_over_n", "peak_rss_bytes",
//    "step_s", "step_s_min", "step_s_max", "step_vs_dp", "parameters"}, ...],
//    "ring": [{"sequence_parallel", "context", "peak_rss_bytes", "step_s", "tokens_per_s"}, ...],
//    "ring_budget_bytes", "ring_max_context": {"1": tokens, "4": tokens},
//    "ring_max_context_is_lower_bound": {"1": bool, "4": bool} (true: the longest context tried),
//    "ring_tokens_per_s": {"context", "1", "4"}}
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "../bench_ranks.h"
#include "troupe/testing/redis_server.h"
#include "troupe/actors/trainer_engine.h"
#include "troupe/collectives/communicator.h"
#include "troupe/runtime/clock.h"
#include "troupe/runtime/process.h"

namespace troupe::actors {
namespace {

using json = nlohmann::json;
using bench::median;
using bench::readText;

struct Config {
  std::vector<int64_t> sizes = {2048, 4096, 4096, 4096, 2048};
  int64_t global_batch = 16;
  int steps = 5;
  int warmup = 2;
  double bucket_mb = 25;
  // Ring attention part.
  // Up to 8192: a step of a ring of 4 at 8192 tokens takes about 20 s on 2 cores, and one at
  // 16384 four times that.
  std::vector<int64_t> contexts = {512, 1024, 2048, 4096, 8192};
  double ring_budget_mb = 1024;
  int ring_steps = 2;
};

int fail(const Status& status) {
  std::fprintf(stderr, "parallel_bench: %s\n", status.toString().c_str());
  return 1;
}

// Peak resident bytes of this process (VmHWM).
uint64_t peakRssBytes() {
  std::istringstream lines(readText("/proc/self/status"));
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::strtoull(line.c_str() + 6, nullptr, 10) * 1024;
  }
  return 0;
}

// Rows [begin, end) of step `step`'s global batch: random features and targets, the same on
// every rank and in every mode.
Batch batchOf(const Config& c, int64_t step, RankSlice slice) {
  const int64_t in = c.sizes.front(), out = c.sizes.back();
  auto fill = [&](HostTensor& t, int64_t width, uint64_t salt) {
    t.dtype = "float32";
    t.shape = {slice.size(), width};
    t.bytes.resize(static_cast<size_t>(slice.size() * width) * 4);
    auto* v = reinterpret_cast<float*>(t.bytes.data());
    for (int64_t r = 0; r < slice.size(); ++r) {
      std::mt19937_64 rng(static_cast<uint64_t>(step * c.global_batch + slice.begin + r) * 2 + salt);
      std::normal_distribution<float> normal;
      for (int64_t k = 0; k < width; ++k) v[r * width + k] = normal(rng);
    }
  };
  Batch b;
  fill(b.inputs, in, 0);
  fill(b.targets, out, 1);
  return b;
}

// ---- One rank (a child process) ----

int serveRank(const Config& c, int rank, int world, int zero) {
  TrainerEngineOptions o;
  o.model = "mlp";
  o.mlp_sizes = c.sizes;
  o.loss = "mse";
  o.optimizer = "adamw";
  o.lr = 1e-4;
  o.threads = 1;
  o.global_batch = c.global_batch;
  o.max_micro_batch = c.global_batch;
  o.bucket_bytes = static_cast<size_t>(c.bucket_mb * (1 << 20));
  o.zero = zero;
  auto engine = TrainerEngine::create(o);
  if (!engine) return fail(engine.status());
  auto comm = bench::joinRanks(fmt::format("parallel-{}-{}", world, zero), rank, world);
  if (!comm) return fail(comm.status());
  if (Status s = (*engine)->join(*comm); !s.isOk()) return fail(s);

  std::vector<double> step_s;
  for (int step = 0; step < c.warmup + c.steps; ++step) {
    const Batch batch = batchOf(c, step, (*engine)->slice());
    const auto start = Clock::now();
    auto metrics = (*engine)->step(batch);
    if (!metrics) return fail(metrics.status());
    if (step >= c.warmup) step_s.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  json result = {{"rank", rank},
                 {"step_s", median(step_s)},
                 {"step_s_min", *std::min_element(step_s.begin(), step_s.end())},
                 {"step_s_max", *std::max_element(step_s.begin(), step_s.end())},
                 {"opt_state_bytes", (*engine)->optimizerStateBytes()},
                 {"peak_rss_bytes", peakRssBytes()},
                 {"parameters", (*engine)->parameterCount()}};
  std::printf("RESULT %s\n", result.dump().c_str());
  return 0;
}

// One rank of a tinylm ring of `seq` (a world of `seq`, one sequence of `context` tokens per
// step): peak memory and step time.
int serveRingRank(const Config& c, int rank, int seq, int64_t context) {
  TrainerEngineOptions o;
  o.model = "tinylm";
  o.tinylm.context = context;
  o.tinylm.d_model = 64;
  o.tinylm.heads = 4;
  o.tinylm.layers = 2;
  o.optimizer = "adamw";
  o.threads = 1;
  o.global_batch = 1;
  o.max_micro_batch = 1;
  o.sequence_parallel = seq;
  auto engine = TrainerEngine::create(o);
  if (!engine) return fail(engine.status());
  if (seq > 1) {
    auto comm = bench::joinRanks(fmt::format("ring-{}-{}", seq, context), rank, seq);
    if (!comm) return fail(comm.status());
    if (Status s = (*engine)->join(*comm); !s.isOk()) return fail(s);
  }
  Batch b;
  for (HostTensor* t : {&b.inputs, &b.targets}) {
    t->dtype = "int64";
    t->shape = {1, context};
    t->bytes.resize(static_cast<size_t>(context) * 8);
    auto* v = reinterpret_cast<int64_t*>(t->bytes.data());
    for (int64_t i = 0; i < context; ++i) v[i] = (i * 7919 + (t == &b.targets ? 1 : 0)) % 256;
  }
  std::vector<double> step_s;
  for (int step = 0; step < c.ring_steps; ++step) {
    const auto start = Clock::now();
    auto metrics = (*engine)->step(b);
    if (!metrics) return fail(metrics.status());
    step_s.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  json result = {{"rank", rank}, {"step_s", median(step_s)}, {"peak_rss_bytes", peakRssBytes()}};
  std::printf("RESULT %s\n", result.dump().c_str());
  return 0;
}

// ---- The driver ----

double largest(const std::vector<json>& ranks, const char* key) {
  double m = 0;
  for (const auto& r : ranks) m = std::max(m, r[key].get<double>());
  return m;
}

}  // namespace
}  // namespace troupe::actors

int main(int argc, char** argv) {
  using namespace troupe;
  using namespace troupe::actors;
  Config c;
  bool emit_json = false;
  int serve = -1, world = 0, zero = 0;
  std::vector<int> worlds = {2, 4};
  CLI::App app("Data parallel vs ZeRO-1 vs ZeRO-2: optimizer state, peak memory and step time per rank");
  app.add_flag("--json", emit_json, "print one JSON object as the last line");
  app.add_option("--worlds", worlds, "world sizes")->delimiter(',');
  app.add_option("--steps", c.steps, "timed steps");
  app.add_option("--warmup", c.warmup, "untimed first steps");
  app.add_option("--global-batch", c.global_batch);
  app.add_option("--sizes", c.sizes, "MLP layer widths")->delimiter(',');
  app.add_option("--bucket-mb", c.bucket_mb);
  app.add_option("--contexts", c.contexts, "ring attention: contexts tried, ascending")->delimiter(',');
  app.add_option("--ring-budget-mb", c.ring_budget_mb, "ring attention: peak resident memory allowed per rank");
  bool skip_zero = false, skip_ring = false;
  app.add_flag("--no-zero", skip_zero, "skip the data parallel vs ZeRO part");
  app.add_flag("--no-ring", skip_ring, "skip the ring attention part");
  int serve_ring = -1, seq = 1;
  int64_t context = 0;
  app.add_option("--serve-rank", serve)->group("");  // internal: run one rank
  app.add_option("--serve-ring", serve_ring)->group("");
  app.add_option("--seq", seq)->group("");
  app.add_option("--context", context)->group("");
  app.add_option("--world", world)->group("");
  app.add_option("--zero", zero)->group("");
  CLI11_PARSE(app, argc, argv);
  if (serve >= 0) return serveRank(c, serve, world, zero);
  if (serve_ring >= 0) return serveRingRank(c, serve_ring, seq, context);

  testing::RedisServerProcess redis;
  char pattern[] = "/tmp/troupe-bench-parallel-XXXXXX";
  const std::string dir = ::mkdtemp(pattern);
  const std::string self = executableDir() + "/parallel_bench";
  std::vector<std::string> common = {"--steps", std::to_string(c.steps), "--warmup", std::to_string(c.warmup),
                                     "--global-batch", std::to_string(c.global_batch), "--bucket-mb",
                                     fmt::format("{}", c.bucket_mb), "--sizes", fmt::format("{}", fmt::join(c.sizes, ","))};
  const char* kModes[] = {"dp", "zero1", "zero2"};
  json rows = json::array();
  bool ok = true;
  std::printf("MLP %s, MSE, AdamW, global batch %ld, one intra-op thread per rank; step: median of %d after %d "
              "warm-up (min-max)\n",
              fmt::format("{}", fmt::join(c.sizes, "-")).c_str(), static_cast<long>(c.global_batch), c.steps, c.warmup);
  std::printf("%5s %6s | %14s %10s | %13s | %9s %17s %8s\n", "world", "mode", "opt state MB", "vs DP/N", "peak RSS MB",
              "step s", "(min-max)", "vs DP");
  for (int w : skip_zero ? std::vector<int>{} : worlds) {
    double dp_state = 0, dp_step = 0;
    for (int z = 0; z < 3; ++z) {
      std::fprintf(stderr, "parallel_bench: %s, world %d...\n", kModes[z], w);
      auto ranks = bench::runRanks("parallel_bench", w, [&](int r) {
        SpawnOptions spawn;
        spawn.argv = {self, "--serve-rank", std::to_string(r), "--world", std::to_string(w), "--zero", std::to_string(z)};
        spawn.argv.insert(spawn.argv.end(), common.begin(), common.end());
        spawn.env = bench::redisEnvironment(redis.host(), redis.port(), redis.password());
        return spawn;
      }, dir, kModes[z]);
      if (ranks.size() != static_cast<size_t>(w)) {
        ok = false;
        continue;
      }
      const double state = largest(ranks, "opt_state_bytes");
      const double step = largest(ranks, "step_s");
      if (z == 0) {
        dp_state = state;
        dp_step = step;
      }
      const double vs_share = dp_state > 0 ? state / (dp_state / w) : 0;
      const double vs_dp = dp_step > 0 ? step / dp_step : 0;
      std::printf("%5d %6s | %14.1f %9.3fx | %13.1f | %9.3f %8.3f-%-8.3f %7.2fx\n", w, kModes[z], state / 1e6, vs_share,
                  largest(ranks, "peak_rss_bytes") / 1e6, step, largest(ranks, "step_s_min"),
                  largest(ranks, "step_s_max"), vs_dp);
      rows.push_back(json{{"mode", kModes[z]},
                          {"world_size", w},
                          {"opt_state_bytes_per_rank", static_cast<uint64_t>(state)},
                          {"opt_state_vs_dp_over_n", vs_share},
                          {"peak_rss_bytes", static_cast<uint64_t>(largest(ranks, "peak_rss_bytes"))},
                          {"step_s", step},
                          {"step_s_min", largest(ranks, "step_s_min")},
                          {"step_s_max", largest(ranks, "step_s_max")},
                          {"step_vs_dp", vs_dp},
                          {"parameters", ranks[0]["parameters"]}});
    }
  }
  std::printf("vs DP/N = this rank's optimizer state / (data parallel's / world): 1.00x is a perfect 1/N share; "
              "vs DP = step time / data parallel's at the same world size\n");

  // Ring attention: each ring size tries doubling contexts until a rank's peak passes the budget.
  json ring = json::array();
  const double budget = c.ring_budget_mb * 1e6;
  std::map<int, int64_t> longest;
  std::map<std::pair<int, int64_t>, double> tokens_per_s;
  if (!skip_ring) {
    std::printf("\nring attention: tinylm d_model 64, 4 heads, 2 layers, one sequence per step, AdamW; budget %.0f MB "
                "peak per rank\n",
                c.ring_budget_mb);
    std::printf("%5s %8s | %13s %9s %10s\n", "ranks", "context", "peak RSS MB", "step s", "tokens/s");
    for (int s : {1, 4}) {
      longest[s] = 0;
      for (int64_t t : c.contexts) {
        if (t % (2 * s) != 0) continue;
        std::fprintf(stderr, "parallel_bench: ring of %d, context %ld...\n", s, static_cast<long>(t));
        auto ranks = bench::runRanks("parallel_bench", s, [&](int r) {
          SpawnOptions spawn;
          spawn.argv = {self, "--serve-ring", std::to_string(r), "--seq", std::to_string(s), "--context",
                        std::to_string(t)};
          spawn.env = bench::redisEnvironment(redis.host(), redis.port(), redis.password());
          return spawn;
        }, dir, fmt::format("ring{}-{}", s, t));
        if (ranks.size() != static_cast<size_t>(s)) {
          ok = false;
          break;
        }
        const double peak = largest(ranks, "peak_rss_bytes"), step = largest(ranks, "step_s");
        const double tps = step > 0 ? static_cast<double>(t) / step : 0;
        std::printf("%5d %8ld | %13.1f %9.3f %10.0f%s\n", s, static_cast<long>(t), peak / 1e6, step, tps,
                    peak > budget ? "  (over the budget)" : "");
        ring.push_back(json{{"sequence_parallel", s}, {"context", t}, {"peak_rss_bytes", static_cast<uint64_t>(peak)},
                            {"step_s", step}, {"tokens_per_s", tps}});
        tokens_per_s[{s, t}] = tps;
        if (peak > budget) break;
        longest[s] = t;
      }
    }
    auto bound = [&](int s) { return longest[s] == c.contexts.back() ? " (the longest tried: at least)" : ""; };
    std::printf("longest context within the budget: %ld tokens on one rank%s, %ld on a ring of 4%s (%.1fx)\n",
                static_cast<long>(longest[1]), bound(1), static_cast<long>(longest[4]), bound(4),
                longest[1] > 0 ? static_cast<double>(longest[4]) / static_cast<double>(longest[1]) : 0.0);
  }
  // tokens/s at the longest context both ran within the budget
  const int64_t both = std::min(longest[1], longest[4]);
  json ring_tps = json::object();
  if (both > 0) {
    ring_tps = {{"context", both}, {"1", tokens_per_s[{1, both}]}, {"4", tokens_per_s[{4, both}]}};
    std::printf("at %ld tokens: %.0f tokens/s on one rank, %.0f on a ring of 4 (%.2fx)\n", static_cast<long>(both),
                tokens_per_s[{1, both}], tokens_per_s[{4, both}],
                tokens_per_s[{1, both}] > 0 ? tokens_per_s[{4, both}] / tokens_per_s[{1, both}] : 0.0);
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  if (emit_json) {
    json config = {{"model", "mlp"}, {"sizes", c.sizes}, {"optimizer", "adamw"}, {"global_batch", c.global_batch},
                   {"steps", c.steps}, {"warmup", c.warmup}, {"bucket_mb", c.bucket_mb},
                   {"ring_contexts", c.contexts}, {"ring_steps", c.ring_steps}};
    json max_context = skip_ring ? json::object() : json{{"1", longest[1]}, {"4", longest[4]}};
    // A context that is the longest tried is a lower bound of the ring's reach.
    json at_least = skip_ring ? json::object()
                              : json{{"1", longest[1] == c.contexts.back()}, {"4", longest[4] == c.contexts.back()}};
    std::printf("%s\n", json{{"benchmark", "parallel"}, {"config", config}, {"rows", rows}, {"ring", ring},
                              {"ring_budget_bytes", static_cast<uint64_t>(budget)}, {"ring_max_context", max_context},
                              {"ring_max_context_is_lower_bound", at_least},
                              {"ring_tokens_per_s", ring_tps}}
                             .dump()
                             .c_str());
  }
  return ok ? 0 : 1;
}
