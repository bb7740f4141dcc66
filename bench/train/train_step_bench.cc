// train_step_bench (bench/run train_step [--json]): the TrainerEngine's step time for tinylm at
// world sizes 1 and 2 (each rank a process with one intra-op thread; world 2 meets through a
// real redis-server and all-reduces over the CPU ring), split into compute, exposed
// communication and data wait, next to the PyTorch peer (torch_peer.py: the same model and split,
// DistributedDataParallel over gloo, torch.optim.AdamW) run in the same invocation. Prints a table
// and, with --json, one JSON object on the last line:
//   {"benchmark": "train_step", "config": {...}, "rows": [{"world_size", "step_ms", "compute_ms",
//    "comm_ms", "wait_ms", "cpu_ms", "samples_per_s", "bytes_allreduced",
//    "bytes_reduced_in_backward", "parameters", "torch_step_ms", "torch_cpu_ms", "ratio"}, ...]}
//
// Method: each rank builds its rows of every step from the GPL-3 text through a ShardQueue lease
// and the token dataset (timed as wait), then times TrainerEngine::step; after warm-up steps, the
// median of each quantity per rank, and the slowest rank's median step is reported.
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "../bench_ranks.h"
#include "troupe/testing/redis_server.h"
#include "troupe/actors/dataset.h"
#include "troupe/actors/shard_queue.h"
#include "troupe/actors/trainer_engine.h"
#include "troupe/collectives/communicator.h"
#include "troupe/runtime/clock.h"
#include "troupe/runtime/process.h"

#ifndef TROUPE_TORCH_PEER
#define TROUPE_TORCH_PEER "bench/train/torch_peer.py"
#endif

namespace troupe::actors {
namespace {

using json = nlohmann::json;
using bench::median;
using bench::readText;

struct Config {
  int64_t context = 64;
  int64_t d_model = 64;
  int64_t layers = 2;
  int64_t heads = 4;
  int64_t global_batch = 32;
  int64_t micro = 32;
  int steps = 20;
  int warmup = 3;
  int threads = 1;
  double bucket_mb = 25;
};

// CPU seconds this process used (all its threads): unlike wall time, it does not grow when other
// jobs share the machine's cores.
double processCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

int fail(const Status& status) {
  std::fprintf(stderr, "train_step_bench: %s\n", status.toString().c_str());
  return 1;
}

// ---- One Troupe rank (a child process) ----

int serveRank(const Config& c, int rank, int world, const std::string& tokens) {
  TrainerEngineOptions o;
  o.model = "tinylm";
  o.tinylm.context = c.context;
  o.tinylm.d_model = c.d_model;
  o.tinylm.layers = c.layers;
  o.tinylm.heads = c.heads;
  o.optimizer = "adamw";
  o.lr = 1e-3;
  o.threads = c.threads;
  o.global_batch = c.global_batch;
  o.max_micro_batch = c.micro;
  o.bucket_bytes = static_cast<size_t>(c.bucket_mb * (1 << 20));
  auto engine = TrainerEngine::create(o);
  if (!engine) return fail(engine.status());
  auto dataset = openTokenDataset({tokens, "uint16", c.context});
  if (!dataset) return fail(dataset.status());
  auto queue = ShardQueue::create({(*dataset)->size(), c.global_batch, 0, 64});
  if (!queue) return fail(queue.status());

  std::shared_ptr<collectives::Communicator> comm;
  if (world > 1) {
    auto connected = bench::joinRanks(fmt::format("train-step-{}", world), rank, world);
    if (!connected) return fail(connected.status());
    comm = *connected;
  }
  if (Status s = (*engine)->join(comm); !s.isOk()) return fail(s);

  std::vector<double> step_s, compute_s, comm_s, wait_s, cpu_s;
  StepMetrics last;
  for (int step = 0; step < c.warmup + c.steps; ++step) {
    const auto start = Clock::now();
    auto lease = queue->take(step, rank, world);
    if (!lease) return fail(lease.status());
    auto batch = (*dataset)->batch(lease->sample_ids);
    if (!batch) return fail(batch.status());
    const double wait = std::chrono::duration<double>(Clock::now() - start).count();
    const auto step_start = Clock::now();
    const double cpu_start = processCpuSeconds();
    auto metrics = (*engine)->step(*batch);
    if (!metrics) return fail(metrics.status());
    const double seconds = std::chrono::duration<double>(Clock::now() - step_start).count();
    const double cpu = processCpuSeconds() - cpu_start;
    // Every rank completes its rows: the step commits once all did (here, each rank's own queue
    // stands in for the dataloader's).
    for (int r = 0; r < world; ++r) {
      if (r != rank && !queue->take(step, r, world).isOk()) return 1;
      if (!queue->complete(step, r).isOk()) return 1;
    }
    last = *metrics;
    if (step < c.warmup) continue;
    step_s.push_back(seconds);
    compute_s.push_back(metrics->compute_s);
    comm_s.push_back(metrics->comm_s);
    wait_s.push_back(wait);
    cpu_s.push_back(cpu);
  }
  json result = {{"rank", rank},
                 {"step_s", median(step_s)},
                 {"compute_s", median(compute_s)},
                 {"comm_s", median(comm_s)},
                 {"wait_s", median(wait_s)},
                 {"cpu_s", median(cpu_s)},
                 {"loss", last.loss},
                 {"bytes_allreduced", last.bytes_allreduced},
                 {"bytes_reduced_in_backward", last.bytes_reduced_in_backward},
                 {"parameters", (*engine)->parameterCount()}};
  std::printf("RESULT %s\n", result.dump().c_str());
  return 0;
}

// ---- The driver ----

}  // namespace
}  // namespace troupe::actors

int main(int argc, char** argv) {
  using namespace troupe;
  using namespace troupe::actors;
  Config c;
  bool emit_json = false, skip_torch = false;
  int serve = -1, world = 0;
  std::string tokens;
  std::vector<int> worlds = {1, 2};
  std::string python = std::getenv("TROUPE_PYTHON") ? std::getenv("TROUPE_PYTHON") : "/usr/bin/python3";
  std::string peer = TROUPE_TORCH_PEER;
  CLI::App app("TrainerEngine step time (tinylm) at world 1 and 2 vs PyTorch DDP (gloo)");
  app.add_flag("--json", emit_json, "print one JSON object as the last line");
  app.add_option("--worlds", worlds, "world sizes")->delimiter(',');
  app.add_option("--steps", c.steps, "timed steps");
  app.add_option("--warmup", c.warmup, "untimed first steps");
  app.add_option("--global-batch", c.global_batch);
  app.add_option("--micro", c.micro, "max micro-batch rows");
  app.add_option("--context", c.context);
  app.add_option("--d-model", c.d_model);
  app.add_option("--layers", c.layers);
  app.add_option("--heads", c.heads);
  app.add_option("--threads", c.threads, "intra-op threads per rank");
  app.add_option("--bucket-mb", c.bucket_mb);
  app.add_option("--python", python, "interpreter with torch (Debian's python3-torch)");
  app.add_option("--torch-peer", peer);
  app.add_flag("--no-torch", skip_torch, "measure Troupe only");
  app.add_option("--serve-rank", serve)->group("");  // internal: run one Troupe rank
  app.add_option("--world", world)->group("");
  app.add_option("--tokens", tokens)->group("");
  CLI11_PARSE(app, argc, argv);
  if (serve >= 0) return serveRank(c, serve, world, tokens);

  testing::RedisServerProcess redis;
  char pattern[] = "/tmp/troupe-bench-train-XXXXXX";
  const std::string dir = ::mkdtemp(pattern);
  const std::string token_file = dir + "/gpl3.u16";
  auto built = buildTokenFile("/usr/share/common-licenses/GPL-3", token_file, "uint16");
  if (!built) return fail(built.status());
  const std::string self = executableDir() + "/train_step_bench";
  const std::vector<std::string> common = {
      "--steps", std::to_string(c.steps), "--warmup", std::to_string(c.warmup),
      "--global-batch", std::to_string(c.global_batch), "--micro", std::to_string(c.micro),
      "--context", std::to_string(c.context), "--d-model", std::to_string(c.d_model),
      "--layers", std::to_string(c.layers), "--heads", std::to_string(c.heads),
      "--threads", std::to_string(c.threads)};

  json rows = json::array();
  bool ok = true;
  std::printf("tinylm (context %ld, d_model %ld, %ld layers, %ld heads), global batch %ld, micro-batch <= %ld, "
              "%d intra-op thread(s) per rank, AdamW; medians of %d steps after %d warm-up\n",
              static_cast<long>(c.context), static_cast<long>(c.d_model), static_cast<long>(c.layers),
              static_cast<long>(c.heads), static_cast<long>(c.global_batch), static_cast<long>(c.micro),
              c.threads, c.steps, c.warmup);
  std::printf("%5s | %9s %10s %8s %8s %8s %10s %11s | %9s %8s %7s\n", "world", "step ms", "compute ms",
              "comm ms", "data ms", "cpu ms", "samples/s", "overlap KB", "torch ms", "cpu ms", "ratio");
  for (int w : worlds) {
    std::fprintf(stderr, "train_step_bench: troupe, world %d...\n", w);
    auto troupe = bench::runRanks("train_step_bench", w, [&](int r) {
      SpawnOptions spawn;
      spawn.argv = {self, "--serve-rank", std::to_string(r), "--world", std::to_string(w), "--tokens", token_file,
                    "--bucket-mb", fmt::format("{}", c.bucket_mb)};
      spawn.argv.insert(spawn.argv.end(), common.begin(), common.end());
      spawn.env = bench::redisEnvironment(redis.host(), redis.port(), redis.password());
      return spawn;
    }, dir, "troupe");
    if (troupe.size() != static_cast<size_t>(w)) {
      ok = false;
      continue;
    }
    // The slowest rank's medians (a synchronous step is done when every rank is).
    const json* slowest = &troupe[0];
    for (const auto& r : troupe) {
      if (r["step_s"].get<double>() > (*slowest)["step_s"].get<double>()) slowest = &r;
    }
    double torch_s = 0, torch_cpu_s = 0;
    if (!skip_torch) {
      std::fprintf(stderr, "train_step_bench: torch DDP, world %d...\n", w);
      auto port = pickFreePort("127.0.0.1");
      if (!port) return fail(port.status());
      auto torch = bench::runRanks("train_step_bench", w, [&](int r) {
        SpawnOptions spawn;
        spawn.argv = {python, peer, "--rank", std::to_string(r), "--world", std::to_string(w), "--port",
                      std::to_string(*port), "--tokens", token_file};
        spawn.argv.insert(spawn.argv.end(), common.begin(), common.end());
        spawn.env = {"OMP_NUM_THREADS=1"};
        return spawn;
      }, dir, "torch");
      if (torch.empty()) {
        ok = false;
      } else {
        torch_s = torch[0]["step_s"].get<double>();
        torch_cpu_s = torch[0]["cpu_s"].get<double>();
      }
    }
    const double step_ms = (*slowest)["step_s"].get<double>() * 1e3;
    const double samples_per_s = step_ms > 0 ? static_cast<double>(c.global_batch) / (step_ms / 1e3) : 0;
    const double ratio = torch_s > 0 && step_ms > 0 ? torch_s * 1e3 / step_ms : 0;
    const double cpu_ms = (*slowest)["cpu_s"].get<double>() * 1e3;
    std::printf("%5d | %9.1f %10.1f %8.2f %8.2f %8.1f %10.1f %11.1f | %9.1f %8.1f %6.2fx\n", w, step_ms,
                (*slowest)["compute_s"].get<double>() * 1e3, (*slowest)["comm_s"].get<double>() * 1e3,
                (*slowest)["wait_s"].get<double>() * 1e3, cpu_ms, samples_per_s,
                (*slowest)["bytes_reduced_in_backward"].get<double>() / 1024, torch_s * 1e3,
                torch_cpu_s * 1e3, ratio);
    rows.push_back(json{{"world_size", w},
                        {"step_ms", step_ms},
                        {"compute_ms", (*slowest)["compute_s"].get<double>() * 1e3},
                        {"comm_ms", (*slowest)["comm_s"].get<double>() * 1e3},
                        {"wait_ms", (*slowest)["wait_s"].get<double>() * 1e3},
                        {"cpu_ms", cpu_ms},
                        {"samples_per_s", samples_per_s},
                        {"bytes_allreduced", (*slowest)["bytes_allreduced"]},
                        {"bytes_reduced_in_backward", (*slowest)["bytes_reduced_in_backward"]},
                        {"parameters", (*slowest)["parameters"]},
                        {"torch_step_ms", torch_s * 1e3},
                        {"torch_cpu_ms", torch_cpu_s * 1e3},
                        {"ratio", ratio}});
  }
  std::printf("comm = time blocked on all-reduces after backward (not overlapped); cpu = CPU time of the "
              "rank's process per step (all threads; unaffected by other jobs); overlap = bytes whose all-reduce "
              "finished before backward returned; ratio = torch step time / troupe step time (> 1: Troupe is "
              "faster)\n");
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  if (emit_json) {
    json config = {{"model", "tinylm"}, {"context", c.context}, {"d_model", c.d_model}, {"layers", c.layers},
                   {"heads", c.heads}, {"global_batch", c.global_batch}, {"micro_batch", c.micro},
                   {"threads", c.threads}, {"steps", c.steps}, {"warmup", c.warmup}};
    std::printf("%s\n", json{{"benchmark", "train_step"}, {"config", config}, {"rows", rows}}.dump().c_str());
  }
  return ok ? 0 : 1;
}
