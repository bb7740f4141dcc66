// What the multi-process benchmarks share (header-only, benchmark code): ranks as child
// processes that meet through the benchmark's redis-server, and medians.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "troupe/collectives/communicator.h"
#include "troupe/runtime/cluster_store.h"
#include "troupe/runtime/process.h"

namespace troupe::bench {

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

inline std::string readText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The environment a rank process needs to reach the benchmark's redis-server.
inline std::vector<std::string> redisEnvironment(const std::string& host, int port, const std::string& password) {
  return {"TROUPE_BENCH_REDIS_HOST=" + host, fmt::format("TROUPE_BENCH_REDIS_PORT={}", port),
          "TROUPE_BENCH_REDIS_PASSWORD=" + password, "OMP_NUM_THREADS=1"};
}

// In a rank process: the store of the benchmark's redis-server (redisEnvironment).
inline Result<std::unique_ptr<ClusterStore>> connectBenchStore() {
  RedisOptions redis;
  redis.host = std::getenv("TROUPE_BENCH_REDIS_HOST");
  redis.port = std::atoi(std::getenv("TROUPE_BENCH_REDIS_PORT"));
  redis.password = std::getenv("TROUPE_BENCH_REDIS_PASSWORD");
  redis.cluster = "bench";
  return connectRedisStore(redis);
}

// In a rank process: joins (group, epoch 1) as `rank` of `world` over the CPU ring.
inline Result<std::shared_ptr<collectives::Communicator>> joinRanks(const std::string& group, int rank, int world) {
  auto store = connectBenchStore();
  if (!store) return store.status();
  collectives::CommunicatorOptions options;
  options.group = group;
  options.epoch = 1;
  options.rank = rank;
  options.worldSize = world;
  auto connected = collectives::connectCpuCommunicator(**store, options);
  if (!connected) return connected.status();
  return std::shared_ptr<collectives::Communicator>(std::move(connected).value());
}

// Starts `world` processes and returns each one's "RESULT {json}" line, parsed (empty when one
// failed, with its stderr printed under `program`'s name).
inline std::vector<nlohmann::json> runRanks(const char* program, int world,
                                            const std::function<SpawnOptions(int)>& spawnFor,
                                            const std::string& dir, const std::string& side) {
  std::vector<ChildProcess> children;
  std::vector<std::string> outputs, errors;
  for (int r = 0; r < world; ++r) {
    SpawnOptions spawn = spawnFor(r);
    spawn.outputPath = fmt::format("{}/{}-{}-{}.out", dir, side, world, r);
    spawn.errorPath = fmt::format("{}/{}-{}-{}.err", dir, side, world, r);
    outputs.push_back(spawn.outputPath);
    errors.push_back(spawn.errorPath);
    auto pid = spawnProcess(spawn);
    if (!pid) {
      std::fprintf(stderr, "%s: %s\n", program, pid.status().toString().c_str());
      return {};
    }
    children.emplace_back(*pid);
  }
  std::vector<nlohmann::json> results;
  for (int r = 0; r < world; ++r) {
    auto exit = children[r].wait(std::chrono::seconds(900));
    if (!exit || exit->exitCode != 0) {
      std::fprintf(stderr, "%s: %s rank %d of %d failed (%s): %s\n", program, side.c_str(), r, world,
                   exit ? exit->toString().c_str() : "timed out", readText(errors[r]).c_str());
      return {};
    }
    std::istringstream lines(readText(outputs[r]));
    for (std::string line; std::getline(lines, line);) {
      if (line.rfind("RESULT ", 0) == 0) results.push_back(nlohmann::json::parse(line.substr(7)));
    }
  }
  return results;
}

}  // namespace troupe::bench
