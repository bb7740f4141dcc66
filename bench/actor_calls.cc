// bench/run actor_calls: actor method calls through Troupe (caller -> worker over Cap'n Proto,
// token-authenticated, another process) against the floor: a raw 64-byte TCP ping-pong, blocking
// in recv (the target's floor), and the same ping-pong polling (no wake-ups), for comparison with
// actor connections, which poll for a while before they sleep.
//   1:1 sync       one caller, one call at a time
//   1:1 pipelined  one caller, 256 calls in flight
//   n:n pipelined  n caller processes, each with its own actor (n = 2: this machine's cores)
//   payload sweep  sync calls of 64 B .. 1 MB through the Echo actor
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "bench_cluster.h"
#include "pingpong.h"
#include "troupe/runtime/process.h"
#include "troupe/runtime/clock.h"

namespace {

using troupe::Clock;
using troupe::ActorHandle;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double syncRate(kj::AsyncIoContext& io, ActorHandle& actor, const std::string& payload, int calls) {
  int warmUp = payload.size() >= (size_t(1) << 20) ? 2 : 50;
  for (int i = 0; i < warmUp; ++i) actor.call("echo", payload).wait(io.waitScope);
  auto t0 = Clock::now();
  for (int i = 0; i < calls; ++i) actor.call("echo", payload).wait(io.waitScope);
  return calls / seconds(Clock::now() - t0);
}

// Large echoes as a program moving its own buffers would make them: each argument made before
// the clock starts and moved into its call (the TCP ping-pong reuses one buffer), the result
// read where it arrived (callReply). The echo actor's copy of its argument stays in.
double largeRate(kj::AsyncIoContext& io, ActorHandle& actor, const std::string& payload, int calls) {
  const int warmUp = 2;
  std::vector<std::string> arguments(warmUp + calls, payload);
  for (int i = 0; i < warmUp; ++i) actor.callReply("echo", std::move(arguments[i])).wait(io.waitScope);
  size_t received = 0;
  auto t0 = Clock::now();
  for (int i = warmUp; i < warmUp + calls; ++i) {
    received += actor.callReply("echo", std::move(arguments[i])).wait(io.waitScope).size();
  }
  double rate = calls / seconds(Clock::now() - t0);
  return received == payload.size() * calls ? rate : 0;
}

double pipelinedRate(kj::AsyncIoContext& io, ActorHandle& actor, int calls, int window) {
  std::string payload(64, 'x');
  auto t0 = Clock::now();
  for (int sent = 0; sent < calls; sent += window) {
    auto batch = kj::heapArrayBuilder<kj::Promise<std::string>>(window);
    for (int i = 0; i < window; ++i) batch.add(actor.call("echo", payload));
    kj::joinPromises(batch.finish()).wait(io.waitScope);
  }
  return calls / seconds(Clock::now() - t0);
}

// --nn-client HOST:PORT TOKEN ACTOR_ID CALLS: one of the n callers; prints its rate.
int nnClient(char** argv) {
  auto io = kj::setupAsyncIo();
  auto client = troupe::ClusterClient::connect(io, *troupe::parseHostPort(argv[2]), argv[3]).wait(io.waitScope);
  auto actor = client->actor(troupe::ActorId(argv[4]));
  actor.ready().wait(io.waitScope);
  printf("%f\n", pipelinedRate(io, actor, std::stoi(argv[5]), 256));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int rc = 0;
  if (troupe::bench::maybeServeTcp(argc, argv, &rc)) return rc;
  if (argc == 6 && std::string(argv[1]) == "--nn-client") return nnClient(argv);
  if (argc > 1 && std::string(argv[1]) == "--floor") {  // for the Python benchmark: --floor [ROUNDS]
    int rounds = argc > 2 ? std::max(100, atoi(argv[2])) : 3000;
    printf("{\"pingpong_per_s\": %.0f}\n", 1e6 / troupe::bench::tcpRoundTripUs(argv[0], rounds));
    return 0;
  }
  const std::string mode = argc > 1 ? argv[1] : "";
  bool json = mode == "--json";
  const int kSync = 2000, kPipelined = 30000, kWindow = 256, kCallers = 2, kRuns = 5, kBigEchoes = 12;
  const size_t kBig = size_t(16) << 20;

  troupe::bench::BenchCluster cluster(8);
  auto io = kj::setupAsyncIo();
  auto client = cluster.connect(io);
  troupe::ActorOptions echo;
  echo.type = "Echo";
  auto actor = client->createActor(echo).wait(io.waitScope);

  // For profiling one path alone: --big-only [CALLS] (16 MB echo calls), --sync-only [CALLS]
  // (64 B sync calls).
  if (mode == "--big-only") {
    const std::string payload(kBig, 'p');
    double rate = largeRate(io, actor, payload, argc > 2 ? atoi(argv[2]) : 20);
    printf("16 MB echo: actor call MB/s (both ways): %.0f\n", rate * 2.0 * kBig / 1e6);
    return 0;
  }
  if (mode == "--sync-only") {
    printf("64 B sync calls/s: %.0f\n", syncRate(io, actor, std::string(64, 'x'), argc > 2 ? atoi(argv[2]) : 20000));
    return 0;
  }

  // Each run measures the floor and the calls back to back, so each ratio is of one moment.
  std::vector<double> floors, pollFloors, syncs, ratios, pollRatios, tcpMb, callMb, mbRatios;
  const std::string big(kBig, 'p');
  for (int run = 0; run < kRuns; ++run) {
    floors.push_back(1e6 / troupe::bench::tcpRoundTripUs(argv[0], kSync));
    syncs.push_back(syncRate(io, actor, std::string(64, 'x'), kSync));
    ratios.push_back(syncs.back() / floors.back());
    pollFloors.push_back(1e6 / troupe::bench::tcpRoundTripUs(argv[0], kSync, 64, /*poll=*/true));
    pollRatios.push_back(syncs.back() / pollFloors.back());
    // 12 echoes a side (0.2-0.3 s): with 4, one stall of the VM decided the run.
    tcpMb.push_back(2.0 * kBig / troupe::bench::tcpRoundTripUs(argv[0], kBigEchoes, kBig));
    callMb.push_back(largeRate(io, actor, big, kBigEchoes) * 2.0 * kBig / 1e6);
    mbRatios.push_back(callMb.back() / tcpMb.back());
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  auto spread = [](std::vector<double> v, const char* format) {
    std::sort(v.begin(), v.end());
    return fmt::format(fmt::runtime(format), v.front(), v[v.size() / 2], v.back());
  };
  double floorPerS = median(floors), sync = median(syncs);
  double pipelined = pipelinedRate(io, actor, kPipelined, kWindow);

  std::vector<troupe::ActorHandle> nnActors;
  std::vector<troupe::ChildProcess> callers;
  std::vector<std::string> outputs;
  for (int i = 0; i < kCallers; ++i) nnActors.push_back(client->createActor(echo).wait(io.waitScope));
  auto t0 = Clock::now();
  for (int i = 0; i < kCallers; ++i) {
    troupe::SpawnOptions o;
    outputs.push_back(fmt::format("/tmp/troupe-bench-nn-{}-{}", getpid(), i));
    o.argv = {argv[0], "--nn-client", cluster.controller().toString(), cluster.token(), nnActors[i].id().hex(),
              std::to_string(kPipelined / kCallers)};
    o.outputPath = outputs.back();
    callers.emplace_back(*troupe::spawnProcess(o));
  }
  for (auto& c : callers) c.wait(std::chrono::minutes(5));
  double nn = kPipelined / seconds(Clock::now() - t0);  // total across callers, wall clock
  for (auto& path : outputs) std::remove(path.c_str());

  printf("%-44s %14s %10s\n", fmt::format("measure (median of {} runs)", kRuns).c_str(), "calls/s", "vs floor");
  printf("%-44s %14.0f %10s\n", "floor: raw TCP 64 B ping-pong (2 processes)", floorPerS, "1.00");
  printf("%-44s %14.0f %10.2f\n", "1:1 sync calls (64 B)", sync, median(ratios));
  printf("%-44s %14.0f %10.2f\n", "polling floor: the ping-pong never sleeping", median(pollFloors),
         median(pollFloors) / floorPerS);
  printf("%-44s %14.0f %10.2f\n", fmt::format("1:1 pipelined calls ({} in flight)", kWindow).c_str(), pipelined,
         pipelined / floorPerS);
  printf("%-44s %14.0f %10.2f\n", fmt::format("{}:{} pipelined calls", kCallers, kCallers).c_str(), nn, nn / floorPerS);
  printf("\n%-12s %14s %12s\n", "payload", "sync calls/s", "MB/s");
  std::string sweep;
  for (size_t size : {size_t(64), size_t(4096), size_t(65536), size_t(1) << 20}) {
    int calls = size >= (size_t(1) << 20) ? 100 : 1000;
    double rate = syncRate(io, actor, std::string(size, 'p'), calls);
    printf("%-12zu %14.0f %12.1f\n", size, rate, rate * 2 * size / 1e6);
    sweep += fmt::format("{}{{\"bytes\": {}, \"calls_per_s\": {:.0f}}}", sweep.empty() ? "" : ", ", size, rate);
  }
  printf("\npipelined / sync: %.1fx\n", pipelined / sync);
  printf("\n%-44s %10s %10s %10s\n", fmt::format("spread over {} runs", kRuns).c_str(), "min", "median", "max");
  printf("%-44s %s\n", "1:1 sync calls vs floor", spread(ratios, "{:10.2f} {:10.2f} {:10.2f}").c_str());
  printf("%-44s %s\n", "1:1 sync calls vs polling floor", spread(pollRatios, "{:10.2f} {:10.2f} {:10.2f}").c_str());
  printf("%-44s %s\n", "16 MB echo: raw TCP MB/s (both ways)", spread(tcpMb, "{:10.0f} {:10.0f} {:10.0f}").c_str());
  printf("%-44s %s\n", "16 MB echo: actor call MB/s (both ways)", spread(callMb, "{:10.0f} {:10.0f} {:10.0f}").c_str());
  printf("%-44s %s\n", "16 MB echo: actor call / raw TCP", spread(mbRatios, "{:10.2f} {:10.2f} {:10.2f}").c_str());
  if (json) {
    printf("{\"sync_calls_per_s\": %.0f, \"pipelined_calls_per_s\": %.0f, \"nn_calls_per_s\": %.0f, "
           "\"pingpong_per_s\": %.0f, \"sync_vs_floor\": %.3f, \"sync_vs_floor_spread\": [%s], "
           "\"polling_pingpong_per_s\": %.0f, \"sync_vs_polling_floor\": %.3f, \"pipelined_vs_sync\": %.2f, \"payload_mb_per_s\": %.0f, \"tcp_mb_per_s\": %.0f, "
           "\"payload_vs_tcp\": %.3f, \"payload_vs_tcp_spread\": [%s], \"payload_sweep\": [%s]}\n",
           sync, pipelined, nn, floorPerS, median(ratios), spread(ratios, "{:.3f}, {:.3f}, {:.3f}").c_str(),
           median(pollFloors), median(pollRatios), pipelined / sync, median(callMb), median(tcpMb), median(mbRatios),
           spread(mbRatios, "{:.3f}, {:.3f}, {:.3f}").c_str(), sweep.c_str());
  }
  return 0;
}
