// ShardQueue: the fixed order, leases, and exactly-once accounting of a simulated group that is
// killed, requeued, rewound, restored from checkpoints and resized.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "troupe/actors/batch.h"
#include "troupe/actors/shard_queue.h"

namespace troupe::actors {
namespace {

ShardQueue makeQueue(uint64_t n, int64_t g, uint64_t seed, int64_t ahead = 64) {
  ShardQueueOptions options;
  options.num_samples = n;
  options.global_batch = g;
  options.seed = seed;
  options.max_steps_ahead = ahead;
  auto queue = ShardQueue::create(options);
  REQUIRE_MESSAGE(queue.isOk(), queue.status().toString());
  return std::move(queue).value();
}

// A deterministic generator for the simulation (not std:: distributions: same on every machine).
struct TestRng {
  uint64_t state;
  uint64_t next() {
    state += 0x9e3779b97f4a7c15ULL;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  int below(int n) { return static_cast<int>(next() % static_cast<uint64_t>(n)); }
};

// Order-independent hash of a multiset of ids (sum of mixed values) and its size.
struct MultisetHash {
  uint64_t sum = 0;
  uint64_t count = 0;
  void add(uint64_t id) {
    TestRng mix{id};
    sum += mix.next();
    ++count;
  }
  bool operator==(const MultisetHash& other) const { return sum == other.sum && count == other.count; }
};

TEST_CASE("rankSlice splits the global batch with the remainder on the first ranks") {
  for (int64_t g : {1, 7, 8, 33}) {
    for (int world = 1; world <= 5; ++world) {
      int64_t next = 0;
      for (int r = 0; r < world; ++r) {
        const RankSlice s = rankSlice(g, world, r);
        CHECK(s.begin == next);
        CHECK(s.size() == g / world + (r < g % world ? 1 : 0));
        next = s.end;
      }
      CHECK(next == g);
    }
  }
}

TEST_CASE("every epoch is a permutation fixed by (seed, epoch); steps span epochs") {
  const uint64_t n = 37;
  ShardQueue a = makeQueue(n, 8, 42);
  ShardQueue b = makeQueue(n, 8, 42);
  ShardQueue other = makeQueue(n, 8, 43);
  std::vector<std::vector<uint64_t>> epochs(3);
  for (uint64_t p = 0; p < 3 * n; ++p) {
    CHECK(a.sampleAt(p) == b.sampleAt(p));
    epochs[a.epochOf(p)].push_back(a.sampleAt(p));
  }
  for (auto& e : epochs) {
    std::vector<uint64_t> sorted = e;
    std::sort(sorted.begin(), sorted.end());
    for (uint64_t i = 0; i < n; ++i) CHECK(sorted[i] == i);
  }
  CHECK(epochs[0] != epochs[1]);
  bool differs = false;
  for (uint64_t p = 0; p < n; ++p) differs |= a.sampleAt(p) != other.sampleAt(p);
  CHECK(differs);
  // Step 4 covers positions 32..39: the end of epoch 0 and the start of epoch 1.
  const auto step4 = a.stepSamples(4);
  REQUIRE(step4.size() == 8);
  for (int i = 0; i < 8; ++i) CHECK(step4[i] == a.sampleAt(32 + i));
  // A large dataset costs nothing up front and still permutes.
  ShardQueue big = makeQueue(uint64_t{1} << 40, 4, 1);
  CHECK(big.sampleAt(5) < (uint64_t{1} << 40));
}

TEST_CASE("leases: takes are idempotent, a step keeps its world while leased, requeue releases") {
  ShardQueue q = makeQueue(100, 10, 7, 4);
  auto l0 = q.take(0, 0, 2);
  REQUIRE(l0.isOk());
  CHECK(l0->sample_ids.size() == 5);
  CHECK(l0->first_position == 0);
  auto again = q.take(0, 0, 2);
  REQUIRE(again.isOk());
  CHECK(again->sample_ids == l0->sample_ids);
  // Another world while rank 0 of world 2 holds its rows: refused.
  auto other = q.take(0, 0, 3);
  CHECK(other.status().code() == StatusCode::kFailedPrecondition);
  CHECK(other.status().message().find("split for world 2") != std::string::npos);
  CHECK(q.inFlight().size() == 1);
  CHECK(q.requeue(0) == 5);
  CHECK(q.inFlight().empty());
  // Every lease released: the step may be split for world 3 now, and covers the same samples.
  std::vector<uint64_t> all;
  for (int r = 0; r < 3; ++r) {
    auto l = q.take(0, r, 3);
    REQUIRE(l.isOk());
    all.insert(all.end(), l->sample_ids.begin(), l->sample_ids.end());
  }
  CHECK(all == q.stepSamples(0));
  // Completion commits the step once every rank completed; repeats are no-ops.
  CHECK(*q.complete(0, 0) == 0);
  CHECK(*q.complete(0, 1) == 0);
  CHECK(q.take(0, 1, 3).status().code() == StatusCode::kFailedPrecondition);  // already completed
  CHECK(*q.complete(0, 2) == 1);
  CHECK(*q.complete(0, 2) == 1);
  CHECK(q.take(0, 0, 3).status().message().find("already committed") != std::string::npos);
  // Prefetch is bounded; completing without a lease is refused; rewinding forward is refused.
  CHECK(q.take(5, 0, 1).status().code() == StatusCode::kFailedPrecondition);
  CHECK(q.take(4, 0, 1).isOk());
  CHECK(q.complete(2, 0).status().code() == StatusCode::kFailedPrecondition);
  CHECK(q.rewind(2).code() == StatusCode::kFailedPrecondition);
  CHECK(q.take(1, 3, 3).status().code() == StatusCode::kInvalidArgument);
  // A later step completed first commits when the earlier one does.
  REQUIRE(q.take(1, 0, 1).isOk());
  REQUIRE(q.take(2, 0, 1).isOk());
  CHECK(*q.complete(2, 0) == 1);
  CHECK(*q.complete(1, 0) == 3);
  CHECK(q.commit(5).isOk());
  CHECK(q.committedSteps() == 6);
  CHECK(q.inFlight().empty());
  CHECK(q.committedSamples() == 60);
}

TEST_CASE("serialize restores exactly; corrupt bytes are refused with the reason") {
  ShardQueue q = makeQueue(53, 6, 9);
  REQUIRE(q.take(0, 0, 2).isOk());
  REQUIRE(q.take(0, 1, 2).isOk());
  REQUIRE(q.complete(0, 0).isOk());
  REQUIRE(q.complete(0, 1).isOk());
  REQUIRE(q.take(1, 1, 2).isOk());
  REQUIRE(q.take(2, 0, 2).isOk());
  REQUIRE(q.complete(2, 0).isOk());
  const std::string bytes = q.serialize();
  auto back = ShardQueue::deserialize(bytes);
  REQUIRE_MESSAGE(back.isOk(), back.status().toString());
  CHECK(back->serialize() == bytes);
  CHECK(back->committedSteps() == 1);
  CHECK(back->inFlight().size() == 1);
  CHECK(back->stepSamples(7) == q.stepSamples(7));
  // The restored queue behaves as the original: rank 0 completed step 2, rank 1 holds step 1.
  CHECK(back->take(2, 1, 3).status().code() == StatusCode::kFailedPrecondition);

  std::string flipped = bytes;
  flipped[20] ^= 1;
  auto bad = ShardQueue::deserialize(flipped);
  CHECK(bad.status().code() == StatusCode::kInvalidArgument);
  CHECK(bad.status().message().find("checksum") != std::string::npos);
  auto cut = ShardQueue::deserialize(bytes.substr(0, 30));
  CHECK(cut.status().code() == StatusCode::kInvalidArgument);
  auto junk = ShardQueue::deserialize("not a queue");
  CHECK(junk.status().message().find("magic") != std::string::npos);
}

// A simulated group: trainers take and complete steps; the "model" is the list of samples
// applied so far. Faults: a rank dies mid-step (its leases are requeued, the group restores the
// newest checkpoint of model + queue, possibly at another world size); the dataloader dies (the
// queue comes back from the checkpoint's bytes); resizes at step boundaries (prefetched leases
// are dropped by rewinding to the committed step). Committed samples per epoch must be every
// sample exactly once.
TEST_CASE("exactly once per epoch across kills, requeues, rewinds, restores and resizes") {
  const uint64_t n = 37;   // not a multiple of the global batch: steps span epochs
  const int64_t g = 8;
  const int64_t target_steps = 60;  // about 13 epochs
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    CAPTURE(seed);
    TestRng rng{seed * 1000};
    ShardQueue queue = makeQueue(n, g, seed, 3);
    struct Model {
      std::vector<std::pair<uint64_t, uint64_t>> applied;  // (data epoch, sample id)
      int64_t steps = 0;
    };
    Model model;
    struct Checkpoint {
      Model model;
      std::string queue;
    };
    Checkpoint checkpoint{model, queue.serialize()};
    int world = 2;
    int kills = 0, loader_deaths = 0, resizes = 0, handed_twice = 0;
    std::set<uint64_t> ever_handed;  // positions handed out at least once
    while (model.steps < target_steps) {
      const int64_t step = queue.committedSteps();
      REQUIRE(step == model.steps);
      // Every rank takes this step, and some prefetch the next one.
      std::vector<ShardLease> leases;
      for (int r = 0; r < world; ++r) {
        auto lease = queue.take(step, r, world);
        REQUIRE_MESSAGE(lease.isOk(), lease.status().toString());
        for (size_t i = 0; i < lease->sample_ids.size(); ++i) {
          if (!ever_handed.insert(lease->first_position + i).second) ++handed_twice;
        }
        leases.push_back(std::move(lease).value());
        if (rng.below(2) == 0) REQUIRE(queue.take(step + 1, r, world).isOk());
      }
      const int event = rng.below(10);
      if (event < 2) {
        // A trainer dies mid-step: the all-reduce fails everywhere; its leases go back; the
        // group restores the newest checkpoint, with a replacement or one rank fewer.
        ++kills;
        const int victim = rng.below(world);
        CHECK(queue.requeue(victim) >= 0);
        if (rng.below(3) == 0) {
          // The dataloader died with it: the queue comes back from the checkpoint's bytes.
          ++loader_deaths;
          auto restored = ShardQueue::deserialize(checkpoint.queue);
          REQUIRE(restored.isOk());
          queue = std::move(restored).value();
        }
        model = checkpoint.model;
        REQUIRE(queue.rewind(model.steps).isOk());
        if (world > 1 && rng.below(2) == 0) --world;
        continue;
      }
      // The step finishes on every rank: the model applies every rank's rows.
      for (const auto& lease : leases) {
        for (size_t i = 0; i < lease.sample_ids.size(); ++i) {
          model.applied.emplace_back(queue.epochOf(lease.first_position + i), lease.sample_ids[i]);
        }
        auto committed = queue.complete(lease.step, lease.rank);
        REQUIRE(committed.isOk());
      }
      ++model.steps;
      REQUIRE(queue.committedSteps() == model.steps);
      if (rng.below(3) == 0) checkpoint = Checkpoint{model, queue.serialize()};
      if (event == 9) {
        // Resize at the step boundary: prefetched leases of the old world are dropped.
        ++resizes;
        REQUIRE(queue.rewind(queue.committedSteps()).isOk());
        world = 1 + rng.below(4);
      }
    }
    CHECK(kills > 0);
    CHECK(resizes > 0);
    CHECK(handed_twice > 0);  // some samples really were handed out again
    MESSAGE("seed " << seed << ": " << kills << " kills (" << loader_deaths << " with the dataloader), "
                    << resizes << " resizes, " << handed_twice << " samples handed out again");

    std::map<uint64_t, MultisetHash> per_epoch;
    std::map<uint64_t, std::set<uint64_t>> distinct;
    for (const auto& [epoch, id] : model.applied) {
      per_epoch[epoch].add(id);
      distinct[epoch].insert(id);
    }
    MultisetHash full;
    for (uint64_t id = 0; id < n; ++id) full.add(id);
    const uint64_t complete_epochs = static_cast<uint64_t>(target_steps * g) / n;
    REQUIRE(model.applied.size() == static_cast<size_t>(target_steps * g));
    for (uint64_t e = 0; e < complete_epochs; ++e) {
      CAPTURE(e);
      CHECK(per_epoch[e] == full);
      CHECK(distinct[e].size() == n);
    }
    // The epoch in progress: no sample twice.
    const uint64_t last = complete_epochs;
    CHECK(distinct[last].size() == per_epoch[last].count);
  }
}

TEST_CASE("bad options are refused") {
  ShardQueueOptions options;
  options.num_samples = 0;
  options.global_batch = 4;
  CHECK(ShardQueue::create(options).status().code() == StatusCode::kInvalidArgument);
  options.num_samples = 4;
  options.global_batch = 0;
  CHECK(ShardQueue::create(options).status().code() == StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace troupe::actors
