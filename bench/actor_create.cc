// bench/run actor_create: time from request to ALIVE for 1 actor and for 8 actors created at
// once (each is a new troupe-worker process), and placement group create+remove per second.
#include <chrono>
#include <cstdio>
#include <string>

#include "bench_cluster.h"

namespace {
using Clock = std::chrono::steady_clock;
double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

int main(int argc, char** argv) {
  bool json = argc > 1 && std::string(argv[1]) == "--json";
  troupe::bench::BenchCluster cluster(16);
  auto io = kj::setupAsyncIo();
  auto client = cluster.connect(io);
  troupe::ActorOptions counter;
  counter.type = "Counter";
  counter.resources = {{"CPU", 1}};

  // Warm the page cache and the controller's node connection.
  auto warm = client->createActor(counter).wait(io.waitScope);
  client->kill(warm).wait(io.waitScope);

  auto t0 = Clock::now();
  auto one = client->createActor(counter).wait(io.waitScope);
  double ready1 = seconds(Clock::now() - t0);
  client->kill(one).wait(io.waitScope);

  t0 = Clock::now();
  auto eight = kj::heapArrayBuilder<kj::Promise<troupe::ActorHandle>>(8);
  for (int i = 0; i < 8; ++i) eight.add(client->createActor(counter));
  auto handles = kj::joinPromises(eight.finish()).wait(io.waitScope);
  double ready8 = seconds(Clock::now() - t0);
  for (auto& h : handles) client->kill(h).wait(io.waitScope);

  const int kGroups = 500;
  t0 = Clock::now();
  for (int i = 0; i < kGroups; ++i) {
    auto group = client->createPlacementGroup(troupe::PlacementStrategy::kPack, {{{"CPU", 1}}}).wait(io.waitScope);
    client->removePlacementGroup(group.id).wait(io.waitScope);
  }
  double pgPerS = kGroups / seconds(Clock::now() - t0);

  printf("%-44s %12s\n", "measure", "value");
  printf("%-44s %10.3f s\n", "1 actor: request -> ALIVE", ready1);
  printf("%-44s %10.3f s\n", "8 actors at once: request -> all ALIVE", ready8);
  printf("%-44s %10.0f /s   (Ray published 838/s)\n", "placement group create+remove", pgPerS);
  if (json) printf("{\"ready_1_s\": %.4f, \"ready_8_s\": %.4f, \"pg_create_remove_per_s\": %.0f}\n", ready1, ready8, pgPerS);
  return 0;
}
