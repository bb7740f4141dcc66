#include "troupe/actors/shard_queue.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "troupe/actors/batch.h"

namespace troupe::actors {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// A permutation of [0, n) keyed by (seed, epoch): a balanced 4-round Feistel network on the
// smallest even number of bits covering n, with cycle walking (values >= n are encrypted again;
// the domain is below 4n, so that takes fewer than 4 rounds on average). Fixed arithmetic only:
// the same on every machine and compiler, unlike std::shuffle with std:: distributions.
class EpochPermutation {
 public:
  EpochPermutation(uint64_t n, uint64_t seed, uint64_t epoch) : n_(n) {
    int bits = 1;
    while (bits < 64 && (uint64_t{1} << bits) < n) ++bits;
    half_ = (bits + 1) / 2;
    mask_ = (uint64_t{1} << half_) - 1;
    for (int r = 0; r < kRounds; ++r) {
      keys_[r] = splitmix64(seed ^ splitmix64(epoch * kRounds + static_cast<uint64_t>(r) + 1));
    }
  }

  uint64_t operator()(uint64_t index) const {
    if (n_ == 1) return 0;
    uint64_t x = index;
    do {
      x = encrypt(x);
    } while (x >= n_);
    return x;
  }

 private:
  static constexpr int kRounds = 4;

  uint64_t encrypt(uint64_t x) const {
    uint64_t left = x >> half_;
    uint64_t right = x & mask_;
    for (int r = 0; r < kRounds; ++r) {
      const uint64_t next = left ^ (splitmix64(right ^ keys_[r]) & mask_);
      left = right;
      right = next;
    }
    return (left << half_) | right;
  }

  uint64_t n_;
  int half_ = 1;
  uint64_t mask_ = 1;
  uint64_t keys_[kRounds]{};
};

// ---- Serialisation: little-endian fixed-width fields ----

constexpr char kMagic[8] = {'T', 'R', 'P', 'E', 'S', 'H', 'Q', '1'};
constexpr uint32_t kVersion = 1;

void putU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

class Reader {
 public:
  explicit Reader(const std::string& bytes) : bytes_(bytes) {}
  bool u64(uint64_t& v) {
    if (bytes_.size() - pos_ < 8) return false;
    v = 0;
    for (int i = 0; i < 8; ++i) {
      v |= static_cast<uint64_t>(static_cast<uint8_t>(bytes_[pos_ + i])) << (8 * i);
    }
    pos_ += 8;
    return true;
  }
  bool u8(uint8_t& v) {
    if (pos_ >= bytes_.size()) return false;
    v = static_cast<uint8_t>(bytes_[pos_++]);
    return true;
  }
  size_t pos() const { return pos_; }

 private:
  const std::string& bytes_;
  size_t pos_ = 0;
};

// FNV-1a over the bytes: catches truncation and corruption of a checkpoint's queue state.
uint64_t checksum(const char* data, size_t size) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < size; ++i) {
    h ^= static_cast<uint8_t>(data[i]);
    h *= 0x100000001b3ULL;
  }
  return h;
}

Status corrupt(const std::string& what) {
  return Status(StatusCode::kInvalidArgument,
                fmt::format("shard queue state: {}; pass the bytes ShardQueue::serialize() wrote",
                            what));
}

}  // namespace

ShardQueue::ShardQueue(const ShardQueueOptions& options) : options_(options) {}

Result<ShardQueue> ShardQueue::create(const ShardQueueOptions& options) {
  if (options.num_samples == 0) {
    return Status(StatusCode::kInvalidArgument, "shard queue: the dataset has no samples");
  }
  if (options.global_batch < 1) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("shard queue: global_batch must be at least 1, got {}",
                              options.global_batch));
  }
  if (options.max_steps_ahead < 1) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("shard queue: max_steps_ahead must be at least 1, got {}",
                              options.max_steps_ahead));
  }
  return ShardQueue(options);
}

uint64_t ShardQueue::sampleAt(uint64_t position) const {
  const uint64_t n = options_.num_samples;
  return EpochPermutation(n, options_.seed, position / n)(position % n);
}

std::vector<uint64_t> ShardQueue::stepSamples(int64_t step) const {
  std::vector<uint64_t> ids(static_cast<size_t>(options_.global_batch));
  const uint64_t n = options_.num_samples;
  uint64_t position = static_cast<uint64_t>(step) * options_.global_batch;
  // One permutation object per epoch the step touches (a step spans at most a few).
  EpochPermutation perm(n, options_.seed, position / n);
  uint64_t epoch = position / n;
  for (auto& id : ids) {
    if (position / n != epoch) {
      epoch = position / n;
      perm = EpochPermutation(n, options_.seed, epoch);
    }
    id = perm(position % n);
    ++position;
  }
  return ids;
}

ShardLease ShardQueue::leaseOf(int64_t step, int rank, int world) const {
  const RankSlice slice = rankSlice(options_.global_batch, world, rank);
  ShardLease lease;
  lease.step = step;
  lease.rank = rank;
  lease.world = world;
  lease.first_position = static_cast<uint64_t>(step) * options_.global_batch + slice.begin;
  const uint64_t n = options_.num_samples;
  lease.sample_ids.reserve(static_cast<size_t>(slice.size()));
  for (int64_t i = 0; i < slice.size(); ++i) {
    const uint64_t position = lease.first_position + static_cast<uint64_t>(i);
    lease.sample_ids.push_back(EpochPermutation(n, options_.seed, position / n)(position % n));
  }
  return lease;
}

Result<ShardLease> ShardQueue::take(int64_t step, int rank, int world) {
  if (world < 1 || rank < 0 || rank >= world) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("shard queue: rank {} of world {} is out of range", rank, world));
  }
  if (step < 0) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("shard queue: step must be >= 0, got {}", step));
  }
  if (step < committed_) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("shard queue: step {} is already committed (committed through step "
                              "{}); a trainer asking for it is behind the group",
                              step, committed_ - 1));
  }
  if (step >= committed_ + options_.max_steps_ahead) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("shard queue: step {} is {} or more steps past the first uncommitted "
                              "step {}; complete or commit earlier steps first",
                              step, options_.max_steps_ahead, committed_));
  }
  auto it = splits_.find(step);
  if (it != splits_.end() && it->second.world != world) {
    StepSplit& split = it->second;
    for (int r = 0; r < split.world; ++r) {
      if (split.ranks[r] != LeaseState::kFree) {
        return Status(StatusCode::kFailedPrecondition,
                      fmt::format("shard queue: step {} is split for world {} and rank {} {} its "
                                  "rows; a take for world {} is refused (requeue or rewind first)",
                                  step, split.world, r,
                                  split.ranks[r] == LeaseState::kHeld ? "holds" : "completed",
                                  world));
      }
    }
    splits_.erase(it);
    it = splits_.end();
  }
  if (it == splits_.end()) {
    StepSplit split;
    split.world = world;
    split.ranks.assign(static_cast<size_t>(world), LeaseState::kFree);
    it = splits_.emplace(step, std::move(split)).first;
  }
  LeaseState& state = it->second.ranks[rank];
  if (state == LeaseState::kCompleted) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("shard queue: rank {} already completed step {}", rank, step));
  }
  state = LeaseState::kHeld;
  return leaseOf(step, rank, world);
}

Result<int64_t> ShardQueue::complete(int64_t step, int rank) {
  if (step < committed_) return committed_;
  auto it = splits_.find(step);
  if (it == splits_.end() || rank < 0 || rank >= it->second.world ||
      it->second.ranks[rank] == LeaseState::kFree) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("shard queue: rank {} completed step {} but holds no lease of it "
                              "(released by requeue or rewind?)",
                              rank, step));
  }
  it->second.ranks[rank] = LeaseState::kCompleted;
  commitReady();
  return committed_;
}

void ShardQueue::commitReady() {
  for (;;) {
    auto it = splits_.find(committed_);
    if (it == splits_.end()) return;
    const auto& ranks = it->second.ranks;
    if (!std::all_of(ranks.begin(), ranks.end(),
                     [](LeaseState s) { return s == LeaseState::kCompleted; })) {
      return;
    }
    splits_.erase(it);
    ++committed_;
  }
}

Status ShardQueue::commit(int64_t step) {
  if (step < 0) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("shard queue: commit of step {} (must be >= 0)", step));
  }
  if (step < committed_) return Status::ok();
  committed_ = step + 1;
  splits_.erase(splits_.begin(), splits_.lower_bound(committed_));
  commitReady();
  return Status::ok();
}

int64_t ShardQueue::requeue(int rank) {
  int64_t released = 0;
  for (auto& [step, split] : splits_) {
    if (rank < 0 || rank >= split.world || split.ranks[rank] != LeaseState::kHeld) continue;
    split.ranks[rank] = LeaseState::kFree;
    released += rankSlice(options_.global_batch, split.world, rank).size();
  }
  return released;
}

Status ShardQueue::rewind(int64_t step) {
  if (step < 0 || step > committed_) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("shard queue: cannot rewind to step {}: steps [0, {}) are committed "
                              "(restore the queue state saved with that checkpoint instead)",
                              step, committed_));
  }
  committed_ = step;
  splits_.clear();
  return Status::ok();
}

std::vector<ShardLease> ShardQueue::inFlight() const {
  std::vector<ShardLease> leases;
  for (const auto& [step, split] : splits_) {
    for (int r = 0; r < split.world; ++r) {
      if (split.ranks[r] == LeaseState::kHeld) leases.push_back(leaseOf(step, r, split.world));
    }
  }
  return leases;
}

std::string ShardQueue::serialize() const {
  std::string out(kMagic, sizeof(kMagic));
  putU64(out, kVersion);
  putU64(out, options_.num_samples);
  putU64(out, static_cast<uint64_t>(options_.global_batch));
  putU64(out, options_.seed);
  putU64(out, static_cast<uint64_t>(options_.max_steps_ahead));
  putU64(out, static_cast<uint64_t>(committed_));
  putU64(out, splits_.size());
  for (const auto& [step, split] : splits_) {
    putU64(out, static_cast<uint64_t>(step));
    putU64(out, static_cast<uint64_t>(split.world));
    for (LeaseState s : split.ranks) out.push_back(static_cast<char>(s));
  }
  putU64(out, checksum(out.data(), out.size()));
  return out;
}

Result<ShardQueue> ShardQueue::deserialize(const std::string& bytes) {
  if (bytes.size() < sizeof(kMagic) + 8 * 8 || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return corrupt(fmt::format("{} bytes without the magic 'TRPESHQ1'", bytes.size()));
  }
  uint64_t stored = 0;
  for (int i = 0; i < 8; ++i) {
    stored |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[bytes.size() - 8 + i])) << (8 * i);
  }
  if (stored != checksum(bytes.data(), bytes.size() - 8)) {
    return corrupt("checksum mismatch (truncated or corrupted)");
  }
  const std::string body = bytes.substr(sizeof(kMagic), bytes.size() - sizeof(kMagic) - 8);
  Reader in(body);
  uint64_t version = 0, n = 0, g = 0, seed = 0, ahead = 0, committed = 0, count = 0;
  if (!in.u64(version) || version != kVersion) {
    return corrupt(fmt::format("version {} (this build reads {})", version, kVersion));
  }
  if (!in.u64(n) || !in.u64(g) || !in.u64(seed) || !in.u64(ahead) || !in.u64(committed) ||
      !in.u64(count)) {
    return corrupt("truncated header");
  }
  ShardQueueOptions options;
  options.num_samples = n;
  options.global_batch = static_cast<int64_t>(g);
  options.seed = seed;
  options.max_steps_ahead = static_cast<int64_t>(ahead);
  auto queue = create(options);
  if (!queue) return corrupt(queue.status().message());
  queue->committed_ = static_cast<int64_t>(committed);
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t step = 0, world = 0;
    if (!in.u64(step) || !in.u64(world) || world == 0 || world > (1u << 20)) {
      return corrupt(fmt::format("truncated or bad split {}", i));
    }
    StepSplit split;
    split.world = static_cast<int>(world);
    for (uint64_t r = 0; r < world; ++r) {
      uint8_t s = 0;
      if (!in.u8(s) || s > 2) return corrupt(fmt::format("bad lease state in split {}", i));
      split.ranks.push_back(static_cast<LeaseState>(s));
    }
    queue->splits_.emplace(static_cast<int64_t>(step), std::move(split));
  }
  if (in.pos() != body.size()) {
    return corrupt(fmt::format("{} bytes left over", body.size() - in.pos()));
  }
  return queue;
}

}  // namespace troupe::actors
