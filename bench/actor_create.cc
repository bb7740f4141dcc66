// bench/run actor_create: time from request to ALIVE for 1 actor and for 8 actors created at
// once (each is a new troupe-worker process), and placement group create+remove per second; each
// measured 5 times in one cluster (min, median, max). Then the Python part (py_actor_start.py,
// found through TROUPE_BENCH_DIR): 50 Python actors at once.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "bench_cluster.h"

#include "troupe/runtime/clock.h"

namespace {
using troupe::Clock;
double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

constexpr int kRuns = 5;
constexpr int kPgBatch = 100, kPgBatches = 5;  // groups in flight at once, batches per run
constexpr int kPgSerial = 200;

struct Spread {
  double min, median, max;
};
Spread spreadOf(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v.front(), v[v.size() / 2], v.back()};
}
std::string jsonSpread(const Spread& s, const char* format) {
  return fmt::format("[{}, {}, {}]", fmt::format(fmt::runtime(format), s.min), fmt::format(fmt::runtime(format), s.median),
                     fmt::format(fmt::runtime(format), s.max));
}

// The last line of a command's output ("" when it fails).
std::string lastLine(const std::string& command) {
  std::string out, line;
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) return "";
  std::array<char, 4096> buffer;
  while (fgets(buffer.data(), buffer.size(), pipe)) {
    line += buffer.data();
    if (!line.empty() && line.back() == '\n') {
      if (line.front() != '{') fputs(line.c_str(), stdout);  // its table; its JSON joins ours
      out = line.substr(0, line.size() - 1);
      line.clear();
    }
  }
  return pclose(pipe) == 0 ? out : "";
}
}  // namespace

int main(int argc, char** argv) {
  bool json = argc > 1 && std::string(argv[1]) == "--json";
  std::vector<double> ready1, ready8, pgRate, pgSerial;
  {
    troupe::bench::BenchCluster cluster(16);
    auto io = kj::setupAsyncIo();
    auto client = cluster.connect(io);
    troupe::ActorOptions counter;
    counter.type = "Counter";
    counter.resources = {{"CPU", 1}};

    // Warm the page cache and the controller's node connection.
    auto warm = client->createActor(counter).wait(io.waitScope);
    client->kill(warm).wait(io.waitScope);

    for (int run = 0; run < kRuns; ++run) {
      auto t0 = Clock::now();
      auto one = client->createActor(counter).wait(io.waitScope);
      ready1.push_back(seconds(Clock::now() - t0));
      client->kill(one).wait(io.waitScope);

      t0 = Clock::now();
      auto eight = kj::heapArrayBuilder<kj::Promise<troupe::ActorHandle>>(8);
      for (int i = 0; i < 8; ++i) eight.add(client->createActor(counter));
      auto handles = kj::joinPromises(eight.finish()).wait(io.waitScope);
      ready8.push_back(seconds(Clock::now() - t0));
      for (auto& h : handles) client->kill(h).wait(io.waitScope);

      // As Ray's microbenchmark (ray_perf.py, "placement group create/removal"): a batch of
      // groups is created without waiting for each, then they are removed the same way.
      t0 = Clock::now();
      for (int batch = 0; batch < kPgBatches; ++batch) {
        auto creates = kj::heapArrayBuilder<kj::Promise<troupe::PlacementGroupRecord>>(kPgBatch);
        for (int i = 0; i < kPgBatch; ++i) {
          creates.add(client->createPlacementGroup(troupe::PlacementStrategy::kPack, {{{"CPU", 0.01}}}));
        }
        auto groups = kj::joinPromises(creates.finish()).wait(io.waitScope);
        auto removes = kj::heapArrayBuilder<kj::Promise<void>>(kPgBatch);
        for (auto& g : groups) removes.add(client->removePlacementGroup(g.id));
        kj::joinPromises(removes.finish()).wait(io.waitScope);
      }
      pgRate.push_back(kPgBatches * kPgBatch / seconds(Clock::now() - t0));

      // One at a time, each waited for: the latency of a pair.
      t0 = Clock::now();
      for (int i = 0; i < kPgSerial; ++i) {
        auto group = client->createPlacementGroup(troupe::PlacementStrategy::kPack, {{{"CPU", 1}}}).wait(io.waitScope);
        client->removePlacementGroup(group.id).wait(io.waitScope);
      }
      pgSerial.push_back(seconds(Clock::now() - t0) / kPgSerial * 1e3);
    }
  }
  Spread r1 = spreadOf(ready1), r8 = spreadOf(ready8), pg = spreadOf(pgRate), pgOne = spreadOf(pgSerial);
  printf("%-44s %10s %10s %10s\n", fmt::format("measure ({} runs)", kRuns).c_str(), "min", "median", "max");
  printf("%-44s %10.3f %10.3f %10.3f\n", "1 actor: request -> ALIVE (s)", r1.min, r1.median, r1.max);
  printf("%-44s %10.3f %10.3f %10.3f\n", "8 actors at once: request -> all ALIVE (s)", r8.min, r8.median, r8.max);
  printf("%-44s %10.0f %10.0f %10.0f   (Ray published 838/s)\n",
         fmt::format("placement groups, {} at once: create+remove (/s)", kPgBatch).c_str(), pg.min, pg.median, pg.max);
  printf("%-44s %10.2f %10.2f %10.2f\n", "one group: create+remove, waited for (ms)", pgOne.min, pgOne.median,
         pgOne.max);
  fflush(stdout);

  std::string python;
  if (const char* dir = std::getenv("TROUPE_BENCH_DIR"); dir && *dir) {
    printf("\n");
    fflush(stdout);
    python = lastLine(fmt::format("/usr/bin/python3 {}/py_actor_start.py --json", dir));
    if (python.size() < 2 || python.front() != '{' || python.back() != '}') {
      fprintf(stderr, "actor_create: the Python part (py_actor_start.py) failed\n");
      return 1;
    }
  }
  if (json) {
    printf("{\"ready_1_s\": %.4f, \"ready_8_s\": %.4f, \"pg_create_remove_per_s\": %.0f, \"ready_1_spread_s\": %s, "
           "\"ready_8_spread_s\": %s, \"pg_create_remove_spread_per_s\": %s, \"pg_create_remove_one_ms\": %.2f%s%s}\n",
           r1.median, r8.median, pg.median, jsonSpread(r1, "{:.4f}").c_str(), jsonSpread(r8, "{:.4f}").c_str(),
           jsonSpread(pg, "{:.0f}").c_str(), pgOne.median, python.empty() ? "" : ", ", python.empty() ? "" : python.substr(1, python.size() - 2).c_str());
  }
  return 0;
}
