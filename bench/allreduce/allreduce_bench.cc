// allreduce_bench (bench/run allreduce [--json]): float32 sum all-reduce, 4 KB to 256 MB, for
// 2 and 4 ranks (processes on this machine), with Troupe's CPU communicator as it runs by default
// (the ranks share a host, so shared memory), again with TCP forced (TROUPE_COLLECTIVES_SHM=0),
// and, in the same invocation, torch.distributed's gloo (gloo_peer.py, ranks started by hand).
// Prints time and bus bandwidth per size and world size and the ratios to gloo, then the spread
// (min, median, max over the timed iterations: 5 at 64 MB) of the 64 MB rows; with --json one
// JSON object on the last line: {"rows": [{"bytes", "world_size", "troupe_ms", "gloo_ms",
// "troupe_busbw_gbps", "gloo_busbw_gbps", "ratio", "troupe_tcp_ms", "troupe_tcp_busbw_gbps",
// "tcp_ratio", "troupe_spread_ms", "troupe_tcp_spread_ms", "gloo_spread_ms"}, ...],
// "ratio_64mb_2", "ratio_64mb_4", ...}. troupe_* is the default (shared-memory) run, ratio is
// gloo time / Troupe time, spreads are [min, median, max] ms.
//
// Method (the same on both sides): two warm-up all-reduces, then per iteration a barrier and one
// timed all-reduce; an iteration's time is its slowest rank's, and the median over iterations is
// reported. bus bandwidth = bytes / time * 2 (n - 1) / n, the traffic per rank of an optimal
// all-reduce.
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
#include "troupe/testing/redis_server.h"
#include "troupe/collectives/communicator.h"
#include "troupe/runtime/clock.h"
#include "troupe/runtime/process.h"

#ifndef TROUPE_GLOO_PEER
#define TROUPE_GLOO_PEER "bench/allreduce/gloo_peer.py"
#endif

namespace troupe::collectives {
namespace {

using json = nlohmann::json;

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
    times.reserve(static_cast<size_t>(s.iterations));
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
    // Each iteration's slowest rank: an all-reduce is done when every rank is.
    if (Status status = (*comm)->allreduce(times.data(), times.size(), DataType::kFloat64, ReduceOp::kMax);
        !status.isOk()) {
      return 1;
    }
    std::sort(times.begin(), times.end());
    const double median = times.size() % 2 ? times[times.size() / 2]
                                           : (times[times.size() / 2 - 1] + times[times.size() / 2]) / 2;
    if (rank == 0) {
      std::printf("%s\n", json{{"bytes", s.bytes}, {"world_size", world}, {"ms", median},
                               {"min_ms", times.front()}, {"max_ms", times.back()}}.dump().c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}

// ---- The driver ----

struct Spread {
  double min = 0, median = 0, max = 0;  // ms
};

struct Measured {
  std::map<std::pair<size_t, int>, Spread> ms;  // (bytes, world) -> ms over the iterations

  Spread at(size_t bytes, int world) const {
    auto it = ms.find({bytes, world});
    return it == ms.end() ? Spread{} : it->second;
  }
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
      const double median = j.at("ms").get<double>();
      measured.ms[{j.at("bytes").get<size_t>(), j.at("world_size").get<int>()}] =
          Spread{j.value("min_ms", median), median, j.value("max_ms", median)};
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
  bool skipGloo = false, skipTcp = false;
  CLI::App app("Troupe all-reduce vs torch.distributed gloo");
  app.add_flag("--json", emitJson, "print one JSON object as the last line");
  app.add_option("--worlds", worlds, "world sizes")->delimiter(',');
  app.add_option("--sizes", specs, "BYTES:ITERATIONS pairs (default 4 KB..256 MB)")->delimiter(',');
  app.add_option("--python", python, "interpreter with torch (Debian's python3-torch)");
  app.add_option("--gloo-script", glooScript);
  app.add_flag("--no-gloo", skipGloo, "measure Troupe only");
  app.add_flag("--no-tcp", skipTcp, "skip the run with TCP forced between the ranks (TROUPE_COLLECTIVES_SHM=0)");
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
  Measured troupe, troupeTcp, gloo;
  bool ok = true;
  const std::string self = executableDir() + "/allreduce_bench";
  for (int w : worlds) {
    for (const bool tcp : {false, true}) {
      if (tcp && skipTcp) continue;
      const std::string side = tcp ? "troupe-tcp" : "troupe";
      std::fprintf(stderr, "allreduce_bench: %s, %d ranks...\n", side.c_str(), w);
      ok &= runRanks(w, [&](int r) {
        SpawnOptions spawn;
        spawn.argv = {self, "--serve-rank", std::to_string(r), "--world", std::to_string(w),
                      "--group", fmt::format("bench-{}-{}", side, w), "--sizes", fmt::format("{}", fmt::join(sizeArgs, ",")),
                      "--chunk-bytes", std::to_string(chunkBytes), "--small-bytes", std::to_string(smallBytes)};
        spawn.env = {"TROUPE_BENCH_REDIS_HOST=" + redis.host(),
                     fmt::format("TROUPE_BENCH_REDIS_PORT={}", redis.port()),
                     "TROUPE_BENCH_REDIS_PASSWORD=" + redis.password(),
                     tcp ? "TROUPE_COLLECTIVES_SHM=0" : "TROUPE_COLLECTIVES_SHM=1"};
        return spawn;
      }, dir, side, tcp ? troupeTcp : troupe, std::chrono::seconds(600));
    }
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

  std::printf("float32 sum all-reduce, median over timed iterations of the slowest rank; busbw in GB/s (1e9 B/s)\n");
  std::printf("%-8s %5s | %9s %7s | %9s %7s | %9s %7s | %7s %7s\n", "size", "ranks", "shm ms", "busbw",
              "tcp ms", "busbw", "gloo ms", "busbw", "shm/gl", "tcp/gl");
  json rows = json::array();
  json summary = json::object();
  auto spreadJson = [](const Spread& s) { return json::array({s.min, s.median, s.max}); };
  for (int w : worlds) {
    for (const SizeSpec& s : sizes) {
      const Spread shm = troupe.at(s.bytes, w), tcp = troupeTcp.at(s.bytes, w), gl = gloo.at(s.bytes, w);
      const double t = shm.median, c = tcp.median, g = gl.median;
      const double tBus = busBandwidth(s.bytes, w, t), cBus = busBandwidth(s.bytes, w, c),
                   gBus = busBandwidth(s.bytes, w, g);
      const double ratio = t > 0 && g > 0 ? g / t : 0;
      const double tcpRatio = c > 0 && g > 0 ? g / c : 0;
      std::printf("%-8s %5d | %9.3f %7.3f | %9.3f %7.3f | %9.3f %7.3f | %6.2fx %6.2fx\n", label(s.bytes).c_str(), w,
                  t, tBus, c, cBus, g, gBus, ratio, tcpRatio);
      rows.push_back(json{{"bytes", s.bytes}, {"world_size", w}, {"troupe_ms", t}, {"gloo_ms", g},
                          {"troupe_busbw_gbps", tBus}, {"gloo_busbw_gbps", gBus}, {"ratio", ratio},
                          {"troupe_tcp_ms", c}, {"troupe_tcp_busbw_gbps", cBus}, {"tcp_ratio", tcpRatio},
                          {"troupe_spread_ms", spreadJson(shm)}, {"troupe_tcp_spread_ms", spreadJson(tcp)},
                          {"gloo_spread_ms", spreadJson(gl)}});
      if (s.bytes == (size_t{64} << 20)) {
        summary[fmt::format("ratio_64mb_{}", w)] = ratio;
        summary[fmt::format("tcp_ratio_64mb_{}", w)] = tcpRatio;
      }
    }
  }
  std::printf("shm/gl, tcp/gl = gloo time / Troupe time (> 1: Troupe is faster); shm: the default run (ranks on one "
              "host use shared memory), tcp: TROUPE_COLLECTIVES_SHM=0\n");
  bool header = false;
  for (int w : worlds) {
    for (const SizeSpec& s : sizes) {
      if (s.bytes != (size_t{64} << 20)) continue;
      if (!header) {
        std::printf("spread at 64 MB over %d iterations, ms (min / median / max):\n", s.iterations);
        header = true;
      }
      auto line = [](const Spread& x) { return fmt::format("{:.2f} / {:.2f} / {:.2f}", x.min, x.median, x.max); };
      std::printf("  %d ranks: shm %s | tcp %s | gloo %s\n", w, line(troupe.at(s.bytes, w)).c_str(),
                  line(troupeTcp.at(s.bytes, w)).c_str(), line(gloo.at(s.bytes, w)).c_str());
    }
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  if (emitJson) {
    json out{{"benchmark", "allreduce"}, {"rows", rows}};
    out.update(summary);
    std::printf("%s\n", out.dump().c_str());
  }
  return ok ? 0 : 1;
}
