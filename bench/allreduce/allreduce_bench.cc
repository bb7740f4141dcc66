// allreduce_bench (bench/run allreduce [--json]): float32 sum all-reduce, 4 KB to 256 MB, for
// 2 and 4 ranks (processes on this machine), with Troupe's CPU communicator and, in the same
// invocation, torch.distributed's gloo (gloo_peer.py, ranks started by hand). Prints time,
// algorithm bandwidth and bus bandwidth per size and world size and the ratio; with --json one
// JSON object on the last line: {"rows": [{"bytes", "world_size", "troupe_ms", "gloo_ms",
// "troupe_busbw_gbps", "gloo_busbw_gbps", "ratio"}, ...]}.
//
// Method (the same on both sides): two warm-up all-reduces, then per iteration a barrier and one
// timed all-reduce; each rank takes its median, and the slowest rank's median is reported.
// bus bandwidth = bytes / time * 2 (n - 1) / n, the traffic per rank of an optimal all-reduce.
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "../bench_ranks.h"
#include "testing/redis_server.h"
#include "troupe/collectives/communicator.h"
#include "troupe/runtime/process.h"

#ifndef TROUPE_GLOO_PEER
#define TROUPE_GLOO_PEER "bench/allreduce/gloo_peer.py"
#endif

namespace troupe::collectives {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

struct SizeSpec {
  size_t bytes;
  int iterations;
};

std::vector<SizeSpec> defaultSizes() {
  std::vector<SizeSpec> sizes;
  for (size_t bytes = 4 << 10; bytes <= (size_t{256} << 20); bytes *= 4) {
    int iterations = bytes <= (size_t{1} << 20) ? 100 : bytes <= (size_t{16} << 20) ? 15 : 5;
    if (bytes == (size_t{256} << 20)) iterations = 3;
    sizes.push_back({bytes, iterations});
  }
  return sizes;
}

std::vector<SizeSpec> parseSpecs(const std::vector<std::string>& specs) {
  std::vector<SizeSpec> sizes;
  for (const std::string& spec : specs) {
    auto colon = spec.find(':');
    sizes.push_back({std::stoull(spec.substr(0, colon)), std::stoi(spec.substr(colon + 1))});
  }
  return sizes;
}

std::string label(size_t bytes) {
  if (bytes >= (size_t{1} << 20)) return fmt::format("{} MB", bytes >> 20);
  return fmt::format("{} KB", bytes >> 10);
}

using bench::readText;

// ---- One Troupe rank (a child process) ----

size_t chunkBytes = CommunicatorOptions{}.chunkBytes;
size_t smallBytes = CommunicatorOptions{}.smallMessageBytes;

int serveRank(int rank, int world, const std::string& group, const std::vector<SizeSpec>& sizes) {
  auto store = bench::connectBenchStore();
  if (!store) {
    std::fprintf(stderr, "%s\n", store.status().toString().c_str());
    return 1;
  }
  CommunicatorOptions options;
  // bench/multihost runs ranks on several hosts, each binding its own address, with or without TLS.
  if (const char* host = std::getenv("TROUPE_BENCH_HOST")) options.host = host;
  if (const char* token = std::getenv("TROUPE_BENCH_TLS_TOKEN")) options.tlsToken = token;
  options.group = group;
  options.epoch = 1;
  options.rank = rank;
  options.worldSize = world;
  options.chunkBytes = chunkBytes;
  options.smallMessageBytes = smallBytes;
  auto comm = connectCpuCommunicator(**store, options);
  if (!comm) {
    std::fprintf(stderr, "%s\n", comm.status().toString().c_str());
    return 1;
  }
  size_t largest = 0;
  for (const SizeSpec& s : sizes) largest = std::max(largest, s.bytes);
  std::vector<float> buffer(largest / 4, 1.0f);  // allocated and touched once
  for (const SizeSpec& s : sizes) {
    const size_t count = s.bytes / 4;
    for (int i = 0; i < 2; ++i) {
      Status status = (*comm)->allreduce(buffer.data(), count, DataType::kFloat32, ReduceOp::kSum);
      if (!status.isOk()) {
        std::fprintf(stderr, "%s\n", status.toString().c_str());
        return 1;
      }
    }
    std::vector<double> times;
    for (int i = 0; i < s.iterations; ++i) {
      if (Status status = (*comm)->barrier(); !status.isOk()) return 1;
      const auto start = Clock::now();
      Status status = (*comm)->allreduce(buffer.data(), count, DataType::kFloat32, ReduceOp::kSum);
      times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
      if (!status.isOk()) {
        std::fprintf(stderr, "%s\n", status.toString().c_str());
        return 1;
      }
    }
    std::sort(times.begin(), times.end());
    double median = times.size() % 2 ? times[times.size() / 2]
                                     : (times[times.size() / 2 - 1] + times[times.size() / 2]) / 2;
    if (Status status = (*comm)->allreduce(&median, 1, DataType::kFloat64, ReduceOp::kMax);
        !status.isOk()) {
      return 1;
    }
    if (rank == 0) {
      std::printf("%s\n", json{{"bytes", s.bytes}, {"world_size", world}, {"ms", median}}.dump().c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}

// ---- The driver ----

struct Measured {
  std::map<std::pair<size_t, int>, double> ms;  // (bytes, world) -> median ms
};

// Starts `world` processes with `argvFor(rank)` and `envFor(rank)`, waits for all, and parses
// rank 0's JSON lines.
bool runRanks(int world, const std::function<SpawnOptions(int)>& spawnFor, const std::string& dir,
              const std::string& side, Measured& measured, std::chrono::seconds timeout) {
  std::vector<ChildProcess> children;
  std::vector<std::string> outputs;
  for (int r = 0; r < world; ++r) {
    SpawnOptions spawn = spawnFor(r);
    spawn.outputPath = fmt::format("{}/{}-{}-{}.out", dir, side, world, r);
    spawn.errorPath = fmt::format("{}/{}-{}-{}.err", dir, side, world, r);
    outputs.push_back(spawn.outputPath);
    auto pid = spawnProcess(spawn);
    if (!pid) {
      std::fprintf(stderr, "allreduce_bench: %s\n", pid.status().toString().c_str());
      return false;
    }
    children.emplace_back(*pid);
  }
  bool ok = true;
  for (int r = 0; r < world; ++r) {
    auto exit = children[r].wait(timeout);
    if (!exit || exit->exitCode != 0) {
      std::fprintf(stderr, "allreduce_bench: %s rank %d of %d failed (%s): %s\n", side.c_str(), r,
                   world, exit ? exit->toString().c_str() : "timed out",
                   readText(fmt::format("{}/{}-{}-{}.err", dir, side, world, r)).c_str());
      ok = false;
    }
  }
  std::istringstream lines(readText(outputs[0]));
  for (std::string line; std::getline(lines, line);) {
    try {
      json j = json::parse(line);
      measured.ms[{j.at("bytes").get<size_t>(), j.at("world_size").get<int>()}] =
          j.at("ms").get<double>();
    } catch (const json::exception&) {
    }
  }
  return ok;
}

double busBandwidth(size_t bytes, int world, double ms) {
  if (ms <= 0) return 0;
  return static_cast<double>(bytes) / (ms * 1e6) * 2.0 * (world - 1) / world;
}

}  // namespace
}  // namespace troupe::collectives

int main(int argc, char** argv) {
  using namespace troupe;
  using namespace troupe::collectives;
  bool emitJson = false;
  int serve = -1, world = 0;
  std::string group;
  std::vector<int> worlds = {2, 4};
  std::vector<std::string> specs;
  std::string python = std::getenv("TROUPE_PYTHON") ? std::getenv("TROUPE_PYTHON") : "/usr/bin/python3";
  std::string glooScript = TROUPE_GLOO_PEER;
  bool skipGloo = false;
  CLI::App app("Troupe all-reduce vs torch.distributed gloo");
  app.add_flag("--json", emitJson, "print one JSON object as the last line");
  app.add_option("--worlds", worlds, "world sizes")->delimiter(',');
  app.add_option("--sizes", specs, "BYTES:ITERATIONS pairs (default 4 KB..256 MB)")->delimiter(',');
  app.add_option("--python", python, "interpreter with torch (Debian's python3-torch)");
  app.add_option("--gloo-script", glooScript);
  app.add_flag("--no-gloo", skipGloo, "measure Troupe only");
  app.add_option("--chunk-bytes", chunkBytes, "Troupe's ring chunk size");
  app.add_option("--small-bytes", smallBytes, "Troupe's one-hop algorithm threshold");
  app.add_option("--serve-rank", serve)->group("");  // internal: run one Troupe rank
  app.add_option("--world", world)->group("");
  app.add_option("--group", group)->group("");
  CLI11_PARSE(app, argc, argv);
  const std::vector<SizeSpec> sizes = specs.empty() ? defaultSizes() : parseSpecs(specs);
  if (serve >= 0) return serveRank(serve, world, group, sizes);

  testing::RedisServerProcess redis;
  char dirPattern[] = "/tmp/troupe-bench-XXXXXX";
  const std::string dir = ::mkdtemp(dirPattern);
  std::vector<std::string> sizeArgs;
  for (const SizeSpec& s : sizes) sizeArgs.push_back(fmt::format("{}:{}", s.bytes, s.iterations));
  Measured troupe, gloo;
  bool ok = true;
  const std::string self = executableDir() + "/allreduce_bench";
  for (int w : worlds) {
    std::fprintf(stderr, "allreduce_bench: troupe, %d ranks...\n", w);
    ok &= runRanks(w, [&](int r) {
      SpawnOptions spawn;
      spawn.argv = {self, "--serve-rank", std::to_string(r), "--world", std::to_string(w),
                    "--group", fmt::format("bench-{}", w), "--sizes", fmt::format("{}", fmt::join(sizeArgs, ",")),
                    "--chunk-bytes", std::to_string(chunkBytes), "--small-bytes", std::to_string(smallBytes)};
      spawn.env = {"TROUPE_BENCH_REDIS_HOST=" + redis.host(),
                   fmt::format("TROUPE_BENCH_REDIS_PORT={}", redis.port()),
                   "TROUPE_BENCH_REDIS_PASSWORD=" + redis.password()};
      return spawn;
    }, dir, "troupe", troupe, std::chrono::seconds(600));
    if (skipGloo) continue;
    std::fprintf(stderr, "allreduce_bench: gloo, %d ranks...\n", w);
    auto port = pickFreePort("127.0.0.1");
    if (!port) return 1;
    ok &= runRanks(w, [&](int r) {
      SpawnOptions spawn;
      spawn.argv = {python, glooScript};
      spawn.argv.insert(spawn.argv.end(), sizeArgs.begin(), sizeArgs.end());
      spawn.env = {"MASTER_ADDR=127.0.0.1", fmt::format("MASTER_PORT={}", *port),
                   fmt::format("RANK={}", r), fmt::format("WORLD_SIZE={}", w),
                   "OMP_NUM_THREADS=1"};
      return spawn;
    }, dir, "gloo", gloo, std::chrono::seconds(900));
  }

  std::printf("float32 sum all-reduce, median of timed iterations (slowest rank); GB/s = 1e9 B/s\n");
  std::printf("%-8s %5s | %10s %8s %8s | %10s %8s %8s | %7s\n", "size", "ranks", "troupe ms",
              "algbw", "busbw", "gloo ms", "algbw", "busbw", "ratio");
  json rows = json::array();
  for (int w : worlds) {
    for (const SizeSpec& s : sizes) {
      const double t = troupe.ms.count({s.bytes, w}) ? troupe.ms[{s.bytes, w}] : 0;
      const double g = gloo.ms.count({s.bytes, w}) ? gloo.ms[{s.bytes, w}] : 0;
      const double algbw = t > 0 ? static_cast<double>(s.bytes) / (t * 1e6) : 0;
      const double tBus = busBandwidth(s.bytes, w, t), gBus = busBandwidth(s.bytes, w, g);
      const double ratio = t > 0 && g > 0 ? g / t : 0;
      const double gAlgbw = g > 0 ? static_cast<double>(s.bytes) / (g * 1e6) : 0;
      std::printf("%-8s %5d | %10.3f %8.3f %8.3f | %10.3f %8.3f %8.3f | %6.2fx\n",
                  label(s.bytes).c_str(), w, t, algbw, tBus, g, gAlgbw, gBus, ratio);
      rows.push_back(json{{"bytes", s.bytes}, {"world_size", w}, {"troupe_ms", t}, {"gloo_ms", g},
                          {"troupe_busbw_gbps", tBus}, {"gloo_busbw_gbps", gBus},
                          {"ratio", ratio}});
    }
  }
  std::printf("ratio = gloo time / troupe time (> 1: Troupe is faster)\n");
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  if (emitJson) std::printf("%s\n", json{{"benchmark", "allreduce"}, {"rows", rows}}.dump().c_str());
  return ok ? 0 : 1;
}
