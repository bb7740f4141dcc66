// The CPU communicator end to end: ranks are real processes (collectives_test_rank) or threads,
// on real sockets on 127.0.0.1, meeting through a real redis-server (or the fake store for the
// in-process cases). Faults are real: kill -9 of a rank, an epoch advance written to Redis, a
// rank that never joins an operation. Ranks on this machine use shared memory unless a case
// turns it off; the cases check that it was in use and that nothing is left in /dev/shm.
#include <doctest/doctest.h>
#include <signal.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "troupe/testing/redis_server.h"
#include "troupe/collectives/communicator.h"
#include "troupe/runtime/clock.h"
#include "troupe/runtime/cluster_store.h"
#include "troupe/runtime/ids.h"
#include "troupe/runtime/process.h"

namespace troupe::collectives {
namespace {

using namespace std::chrono_literals;

int64_t monotonicNs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

std::string rankExecutable() {
  const char* path = std::getenv("TROUPE_COLLECTIVES_TEST_RANK");
  return path ? path : executableDir() + "/collectives_test_rank";
}

std::string readText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

class TempDir {
 public:
  TempDir() {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "troupe-coll-XXXXXX").string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// One collectives_test_rank process with its stdout and stderr in files.
class RankProcess {
 public:
  RankProcess(const testing::RedisServerProcess& redis, const std::string& dir,
              std::vector<std::string> args, int index, const std::vector<std::string>& env = {})
      : out_(fmt::format("{}/rank{}.out", dir, index)),
        err_(fmt::format("{}/rank{}.err", dir, index)) {
    SpawnOptions spawn;
    spawn.argv = {rankExecutable(), "--cluster", "test"};
    spawn.argv.insert(spawn.argv.end(), args.begin(), args.end());
    spawn.outputPath = out_;
    spawn.errorPath = err_;
    spawn.env = {"TROUPE_TEST_REDIS_HOST=" + redis.host(),
                 fmt::format("TROUPE_TEST_REDIS_PORT={}", redis.port()),
                 "TROUPE_TEST_REDIS_PASSWORD=" + redis.password()};
    spawn.env.insert(spawn.env.end(), env.begin(), env.end());
    auto pid = spawnProcess(spawn);
    REQUIRE_MESSAGE(pid.isOk(), pid.status().toString());
    child_ = ChildProcess(*pid);
  }

  pid_t pid() const { return child_.pid(); }
  std::string output() const { return readText(out_); }
  std::string errors() const { return readText(err_); }

  // The first stdout line starting with `prefix`, waiting up to `timeout` for it.
  std::string waitForLine(const std::string& prefix, std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      std::istringstream lines(output());
      for (std::string line; std::getline(lines, line);) {
        if (line.rfind(prefix, 0) == 0) return line;
      }
      if (Clock::now() >= deadline) return "";
      if (exited_ || child_.wait(0ms)) exited_ = true;
      // Polling the condition (a line in the file), with the deadline above.
      std::this_thread::sleep_for(exited_ ? 0ms : 5ms);
      if (exited_ && Clock::now() < deadline) {
        // The process is gone: one more read catches its last lines, then give up.
        std::istringstream last(output());
        for (std::string line; std::getline(last, line);) {
          if (line.rfind(prefix, 0) == 0) return line;
        }
        return "";
      }
    }
  }

  std::optional<ExitInfo> wait(std::chrono::milliseconds timeout) {
    auto info = child_.wait(timeout);
    if (info) exited_ = true;
    return info;
  }

  void kill9() { ::kill(child_.pid(), SIGKILL); }

 private:
  std::string out_;
  std::string err_;
  ChildProcess child_;
  bool exited_ = false;
};

std::vector<std::unique_ptr<RankProcess>> spawnRanks(const testing::RedisServerProcess& redis,
                                                     const std::string& dir, int world,
                                                     const std::vector<std::string>& common,
                                                     const std::vector<std::string>& env = {}) {
  std::vector<std::unique_ptr<RankProcess>> ranks;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> args = common;
    args.insert(args.end(), {"--rank", std::to_string(r), "--world", std::to_string(world)});
    ranks.push_back(std::make_unique<RankProcess>(redis, dir, args, r, env));
  }
  return ranks;
}

// The shared-memory segments of `group` still named in /dev/shm (shm_transport.cc names them
// troupe-coll-<group, at most 24 characters>-<epoch>-<random>). The segment is unlinked once every
// rank of the host mapped it, so this must be empty once a communicator exists, and after any end.
std::vector<std::string> shmLeftovers(const std::string& group) {
  std::vector<std::string> found;
  const std::string prefix = "troupe-coll-" + group.substr(0, 24) + "-";
  std::error_code ignored;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ignored)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) == 0) found.push_back(name);
  }
  return found;
}

// Waits for one rank to end: within `timeout`, with exit code 0, having printed `ok`.
void expectRankOk(RankProcess& rank, std::chrono::seconds timeout, const std::string& ok) {
  auto exit = rank.wait(timeout);
  REQUIRE_MESSAGE(exit.has_value(), fmt::format("rank did not finish within {} s", timeout.count()));
  INFO(rank.errors());
  CHECK(exit->exitCode == 0);
  CHECK(rank.output().find(ok) != std::string::npos);
}

// "ERROR <ns> <CODE> <message>" -> its parts.
struct ErrorLine {
  int64_t ns = 0;
  std::string code;
  std::string message;
};
ErrorLine parseError(const std::string& line) {
  ErrorLine error;
  std::istringstream in(line);
  std::string tag;
  in >> tag >> error.ns >> error.code;
  std::getline(in, error.message);
  return error;
}

// Every rank reported READY with the host's shared-memory segment mapped.
void requireReadyWithSharedMemory(const std::vector<std::unique_ptr<RankProcess>>& ranks) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    CAPTURE(r);
    const std::string ready = ranks[r]->waitForLine("READY", 30s);
    REQUIRE_MESSAGE(!ready.empty(), ranks[r]->errors());
    CHECK(ready == "READY shm=1");
  }
}

// A survivor's ERROR line after rank `victim` was killed at `killedAt`: within 2 s, UNAVAILABLE,
// naming the victim and its pid.
ErrorLine requireDeathReported(RankProcess& survivor, const RankProcess& killed, int victim, int64_t killedAt) {
  const std::string line = survivor.waitForLine("ERROR", 10s);
  REQUIRE_MESSAGE(!line.empty(), survivor.errors());
  const ErrorLine error = parseError(line);
  INFO(line);
  CHECK(error.ns - killedAt < 2'000'000'000);
  CHECK(error.code == "UNAVAILABLE");
  CHECK(error.message.find(fmt::format("rank {} (pid {}", victim, killed.pid())) != std::string::npos);
  return error;
}

// ---- Processes, real Redis ----

TEST_CASE("every operation, type and reduction matches the reference for 1 to 5 ranks") {
  testing::RedisServerProcess redis;
  TempDir dir;
  for (int world = 1; world <= 5; ++world) {
    CAPTURE(world);
    // Small thresholds so these sizes exercise both the one-hop and the chunked ring algorithms.
    auto ranks = spawnRanks(redis, dir.path(), world,
                            {"--mode", "matrix", "--group", fmt::format("matrix-{}", world),
                             "--small-bytes", "4096", "--chunk-bytes", "8192"});
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      expectRankOk(*ranks[r], 90s, "MATRIX OK");
      // Ranks on one host exchange data through shared memory.
      CHECK(ranks[r]->output().find(world > 1 ? " shm=1" : " shm=0") != std::string::npos);
    }
    CHECK(shmLeftovers(fmt::format("matrix-{}", world)).empty());
  }
}

TEST_CASE("TCP still works when shared memory is turned off (option or TROUPE_COLLECTIVES_SHM=0)") {
  testing::RedisServerProcess redis;
  TempDir dir;
  const int world = 3;
  for (const bool byEnvironment : {false, true}) {
    CAPTURE(byEnvironment);
    const std::string group = byEnvironment ? "tcp-env" : "tcp-option";
    std::vector<std::string> args = {"--mode", "matrix", "--group", group, "--small-bytes", "4096",
                                     "--chunk-bytes", "8192"};
    std::vector<std::string> env;
    if (byEnvironment) {
      env.push_back("TROUPE_COLLECTIVES_SHM=0");
    } else {
      args.insert(args.end(), {"--shm", "0"});
    }
    auto ranks = spawnRanks(redis, dir.path(), world, args, env);
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      expectRankOk(*ranks[r], 90s, "MATRIX OK");
      CHECK(ranks[r]->output().find(" shm=0") != std::string::npos);
    }
  }
}

TEST_CASE("shared memory gives the same bytes as TCP for every operation, type and reduction") {
  testing::RedisServerProcess redis;
  TempDir dir;
  struct Case {
    int world;
    std::vector<std::string> tuning;  // small thresholds: both algorithms, pipes that wrap and fill
    const char* count;
  };
  const Case cases[] = {
      {2, {"--small-bytes", "4096", "--chunk-bytes", "8192"}, "300007"},
      {3, {"--small-bytes", "4096", "--chunk-bytes", "8192"}, "300007"},
      {4, {"--small-bytes", "4096", "--chunk-bytes", "8192"}, "300007"},
      {4, {}, "3000017"},  // the default sizes: 1 MiB pipes, 256 KiB chunks
  };
  for (const Case& c : cases) {
    CAPTURE(c.world);
    CAPTURE(c.count);
    const std::string group = fmt::format("compare-{}-{}", c.world, c.count);
    std::vector<std::string> args = {"--mode", "compare", "--group", group, "--count", c.count};
    args.insert(args.end(), c.tuning.begin(), c.tuning.end());
    auto ranks = spawnRanks(redis, dir.path(), c.world, args);
    for (int r = 0; r < c.world; ++r) {
      CAPTURE(r);
      expectRankOk(*ranks[r], 120s, "COMPARE OK");
      CHECK(ranks[r]->output().find(fmt::format(" shm=1 host_ranks={}", c.world)) != std::string::npos);
    }
    CHECK(shmLeftovers(group).empty());
  }
}

TEST_CASE("a ring over several hosts: shared memory within each host, TCP between them, same bytes") {
  testing::RedisServerProcess redis;
  // The seam splits this machine into hosts. "aabb": two hosts of two ranks; the ring's hops 0->1
  // and 2->3 go through each host's segment, 1->2 and 3->0 through TCP. "aaab": rank 1 has pipes
  // on both sides (bigger chunks) while ranks 0 and 2 chunk as TCP does, so the two ends of the
  // pipes 0->1 and 1->2 cut the stream differently.
  for (const std::string hosts : {"aabb", "aaab"}) {
    CAPTURE(hosts);
    TempDir dir;
    const int world = 4;
    const std::string group = "compare-hosts-" + hosts;
    std::vector<std::unique_ptr<RankProcess>> ranks;
    for (int r = 0; r < world; ++r) {
      ranks.push_back(std::make_unique<RankProcess>(
          redis, dir.path(),
          std::vector<std::string>{"--mode", "compare", "--group", group, "--count", "300007", "--small-bytes",
                                   "4096", "--chunk-bytes", "8192", "--rank", std::to_string(r), "--world",
                                   std::to_string(world)},
          r, std::vector<std::string>{std::string("TROUPE_COLLECTIVES_HOST_ID=") + hosts[static_cast<size_t>(r)]}));
    }
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      expectRankOk(*ranks[r], 120s, "COMPARE OK");
      const size_t onHost = static_cast<size_t>(std::count(hosts.begin(), hosts.end(), hosts[static_cast<size_t>(r)]));
      // A segment per host with at least two ranks; a rank alone on its host has none.
      CHECK(ranks[r]->output().find(onHost > 1 ? fmt::format(" shm=1 host_ranks={}", onHost) : std::string(" shm=0"))
            != std::string::npos);
    }
    CHECK(shmLeftovers(group).empty());
  }
}

TEST_CASE("kill -9 of a rank mid-allreduce: the others fail within 2 s naming it, then epoch+1 "
          "works without it") {
  testing::RedisServerProcess redis;
  struct Case {
    int world;
    int victim;
    const char* count;
  };
  // 2M floats (8 MB) at 4 ranks and 16M floats (64 MB) at 2: each all-reduce takes tens of ms,
  // so the kill lands inside one, with pipes full and a survivor's writer blocked on one.
  for (const Case c : {Case{4, 2, "2000000"}, Case{2, 0, "16000000"}}) {
    const int world = c.world, victim = c.victim;
    CAPTURE(world);
    TempDir dir;  // per case: waitForLine must not read an earlier case's files
    const std::string group = fmt::format("killed-{}", world);
    auto ranks = spawnRanks(redis, dir.path(), world,
                            {"--mode", "loop", "--group", group, "--epoch", "5", "--count", c.count, "--victim",
                             std::to_string(victim)});
    requireReadyWithSharedMemory(ranks);
    const int64_t killedAt = monotonicNs();
    ranks[victim]->kill9();
    for (int r = 0; r < world; ++r) {
      if (r == victim) continue;
      CAPTURE(r);
      const ErrorLine error = requireDeathReported(*ranks[r], *ranks[victim], victim, killedAt);
      INFO(error.message);
      CHECK(error.message.find("recreate it at epoch 6") != std::string::npos);
    }
    for (int r = 0; r < world; ++r) {
      if (r == victim) continue;
      CAPTURE(r);
      CHECK_MESSAGE(!ranks[r]->waitForLine("REJOINED OK", 30s).empty(), ranks[r]->errors());
      auto exit = ranks[r]->wait(10s);
      REQUIRE(exit.has_value());
      CHECK(exit->exitCode == 0);
    }
    CHECK(shmLeftovers(group).empty());
  }
}

TEST_CASE("kill -9 of a rank with 1 GB of memory: its host mates learn of it from its life lock, before its "
          "sockets close, and name it among the dead") {
  // Its 1 GB in 4 KiB pages takes the kernel tens of milliseconds to tear down, and its sockets
  // close only after that; its robust life lock is released as its threads begin to exit.
  testing::RedisServerProcess redis;
  TempDir dir;
  auto ranks = spawnRanks(redis, dir.path(), 3,
                          {"--mode", "idle", "--group", "life", "--count", "1000", "--victim", "1", "--ballast-mb",
                           "1024"});
  requireReadyWithSharedMemory(ranks);
  const int64_t killedAt = monotonicNs();
  ranks[1]->kill9();
  for (int r : {0, 2}) {
    CAPTURE(r);
    const ErrorLine error = requireDeathReported(*ranks[r], *ranks[1], 1, killedAt);
    INFO(error.message);
    CHECK(error.message.find("released its life lock") != std::string::npos);
    CHECK(ranks[r]->waitForLine("DEAD", 10s) == "DEAD 1");
    auto exit = ranks[r]->wait(10s);
    REQUIRE(exit.has_value());
    CHECK(exit->exitCode == 0);
  }
  CHECK(shmLeftovers("life").empty());
}

TEST_CASE("a rank that exits without closing its communicator is not a crash: its peers learn of it from its "
          "connections, after what it sent") {
  testing::RedisServerProcess redis;
  TempDir dir;
  auto ranks = spawnRanks(redis, dir.path(), 2,
                          {"--mode", "idle", "--group", "exits", "--count", "1000", "--victim", "1",
                           "--victim-exits"});
  const std::string line = ranks[0]->waitForLine("ERROR", 30s);
  REQUIRE_MESSAGE(!line.empty(), ranks[0]->errors());
  INFO(line);
  CHECK(line.find("closed its connection without a goodbye") != std::string::npos);
  CHECK(line.find("life lock") == std::string::npos);
  auto exit = ranks[1]->wait(10s);
  REQUIRE(exit.has_value());
  CHECK(exit->exitCode == 0);
}

TEST_CASE("an epoch advance in Redis aborts blocked operations within 2 s") {
  testing::RedisServerProcess redis;
  TempDir dir;
  const int world = 3;
  // Rank 2 waits for a message from rank 0, while ranks 0 and 1 wait for rank 2 in a ring
  // all-reduce (100000 floats: the ring, where rank 0 sends only to rank 1, so rank 2 sees no
  // mismatched header). Nothing can finish until the epoch moves on.
  auto ranks = spawnRanks(redis, dir.path(), world,
                          {"--mode", "block", "--group", "bumped", "--epoch", "1", "--count",
                           "100000", "--victim", "2"});
  for (int r = 0; r < world; ++r) {
    REQUIRE_MESSAGE(!ranks[r]->waitForLine("BLOCKING", 30s).empty(), ranks[r]->errors());
  }
  auto store = connectRedisStore(redis.options("test"));
  REQUIRE(store.isOk());
  const int64_t advancedAt = monotonicNs();
  auto epoch = (*store)->advanceGroupEpoch("bumped", 2);
  REQUIRE(epoch.isOk());
  CHECK(*epoch == 2);
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    const std::string line = ranks[r]->waitForLine("ERROR", 10s);
    REQUIRE_MESSAGE(!line.empty(), ranks[r]->errors());
    const ErrorLine error = parseError(line);
    INFO(line);
    CHECK(error.ns - advancedAt < 2'000'000'000);
    // Each rank either saw the advance itself or was told by a peer that did.
    CHECK(error.message.find("advanced to epoch 2") != std::string::npos);
    auto exit = ranks[r]->wait(10s);
    REQUIRE(exit.has_value());
    CHECK(exit->exitCode == 0);
  }
  CHECK(shmLeftovers("bumped").empty());
}

// ---- Threads, fake store: fast checks of the error paths ----

// Connects `world` ranks on threads; rank r gets options from `tweak`.
std::vector<std::unique_ptr<Communicator>> connectAll(
    const std::string& cluster, const std::string& group, int64_t epoch, int world,
    std::function<void(CommunicatorOptions&)> tweak = nullptr) {
  std::vector<std::future<Result<std::unique_ptr<Communicator>>>> pending;
  for (int r = 0; r < world; ++r) {
    pending.push_back(std::async(std::launch::async, [cluster, group, epoch, world, r, tweak] {
      auto store = testing::openTestStore(cluster);
      CommunicatorOptions options;
      options.group = group;
      options.epoch = epoch;
      options.rank = r;
      options.worldSize = world;
      options.rendezvousTimeout = 10s;
      if (tweak) tweak(options);
      return connectCpuCommunicator(*store, options);
    }));
  }
  std::vector<std::unique_ptr<Communicator>> comms;
  for (auto& f : pending) {
    auto comm = f.get();
    REQUIRE_MESSAGE(comm.isOk(), comm.status().toString());
    comms.push_back(std::move(comm).value());
  }
  return comms;
}

TEST_CASE("asynchronous operations run in submission order and all complete") {
  auto cluster = testing::newTestCluster();
  auto comms = connectAll(cluster, "async", 1, 3);
  // Three buckets per rank, submitted back to back, of both algorithms' sizes.
  const size_t sizes[] = {10, 100'000, 7};
  std::vector<std::vector<std::vector<float>>> buffers(3);
  std::vector<std::shared_ptr<Work>> works;
  for (int r = 0; r < 3; ++r) {
    for (size_t b = 0; b < 3; ++b) {
      buffers[r].emplace_back(sizes[b], static_cast<float>(r + 1));
    }
  }
  for (int r = 0; r < 3; ++r) {
    for (size_t b = 0; b < 3; ++b) {
      works.push_back(comms[r]->allreduceAsync(buffers[r][b].data(), buffers[r][b].data(),
                                               sizes[b], DataType::kFloat32, ReduceOp::kMax));
    }
  }
  for (auto& work : works) CHECK(work->wait().isOk());
  for (int r = 0; r < 3; ++r) {
    for (size_t b = 0; b < 3; ++b) {
      CHECK(buffers[r][b].front() == 3.0f);
      CHECK(buffers[r][b].back() == 3.0f);
    }
  }
}

TEST_CASE("a timeout fails the operation naming the missing peer, and the peer hears of it") {
  auto cluster = testing::newTestCluster();
  auto comms = connectAll(cluster, "timeout", 1, 2,
                          [](CommunicatorOptions& o) { o.operationTimeout = 300ms; });
  std::vector<float> data(16, 1.0f);
  const auto start = Clock::now();
  Status status = comms[0]->allreduce(data.data(), data.size(), DataType::kFloat32,
                                      ReduceOp::kSum);  // rank 1 never joins
  CHECK(Clock::now() - start < 2s);
  CHECK(status.code() == StatusCode::kDeadlineExceeded);
  CHECK(status.message().find("still waiting for rank 1") != std::string::npos);
  // Later operations fail with the same error; rank 1 is told and fails too.
  CHECK(comms[0]->barrier().message() == status.message());
  const auto deadline = Clock::now() + 2s;
  while (comms[1]->health().isOk() && Clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);  // polling the condition, 2 s deadline
  }
  Status told = comms[1]->barrier();
  CHECK(told.code() == StatusCode::kDeadlineExceeded);
  CHECK(told.message().find("rank 0") != std::string::npos);
}

TEST_CASE("mismatched operations are reported, not silently mixed") {
  auto cluster = testing::newTestCluster();
  auto comms = connectAll(cluster, "mismatch", 1, 2);
  std::vector<float> a(10, 1.0f), b(10, 1.0f), out(10);
  auto first = comms[0]->allreduceAsync(a.data(), a.data(), 10, DataType::kFloat32,
                                        ReduceOp::kSum);
  auto second = comms[1]->allgatherAsync(b.data(), out.data(), 10, DataType::kFloat32);
  Status one = first->wait(), two = second->wait();
  CHECK(one.code() == StatusCode::kFailedPrecondition);
  CHECK(one.message().find("operation mismatch") != std::string::npos);
  CHECK(one.message().find("allgather") != std::string::npos);
  CHECK_FALSE(two.isOk());
}

TEST_CASE("a rank that closes its communicator makes later operations of the others fail") {
  auto cluster = testing::newTestCluster();
  auto comms = connectAll(cluster, "leave", 1, 3);
  comms[2].reset();  // leaves cleanly (goodbye)
  std::vector<float> data(4, 1.0f);
  auto w0 = comms[0]->allreduceAsync(data.data(), data.data(), 4, DataType::kFloat32,
                                     ReduceOp::kSum);
  auto w1 = comms[1]->allreduceAsync(data.data(), data.data(), 4, DataType::kFloat32,
                                     ReduceOp::kSum);
  Status s0 = w0->wait();
  CHECK(s0.code() == StatusCode::kUnavailable);
  CHECK(s0.message().find("rank 2") != std::string::npos);
  // Usually "closed its communicator (it left the group)"; if the data connection's end is
  // seen before the goodbye, "lost the connection to rank 2": either names the rank.
  CHECK_FALSE(w1->wait().isOk());
}

TEST_CASE("a rank that closes its communicator while another waits for it there fails that operation") {
  auto cluster = testing::newTestCluster();
  auto comms = connectAll(cluster, "left-mid-op", 1, 2);
  // Rank 0 waits in an all-reduce that rank 1 never joins (one-hop and ring sizes); rank 1 then
  // leaves cleanly. Over shared memory nothing ends like a socket would: the goodbye must do it.
  for (const size_t count : {size_t{16}, size_t{1} << 20}) {
    CAPTURE(count);
    if (count > 16) comms = connectAll(cluster, "left-mid-op-ring", 1, 2);
    std::vector<float> data(count, 1.0f);
    auto waiting = comms[0]->allreduceAsync(data.data(), data.data(), count, DataType::kFloat32, ReduceOp::kSum);
    CHECK_FALSE(waiting->done());
    const auto leftAt = Clock::now();
    comms[1].reset();
    Status status = waiting->wait();
    CHECK(Clock::now() - leftAt < 2s);
    CHECK(status.code() == StatusCode::kUnavailable);
    CHECK(status.message().find("rank 1") != std::string::npos);
    CHECK(status.message().find("left the group") != std::string::npos);
  }
}

TEST_CASE("a segment name left by a rank killed during an earlier epoch's setup is removed by the next setup") {
  // What a creator killed between shm_open and the unlink leaves (the name of epoch 1), and a
  // name of another group that must stay.
  const std::string stale = "/dev/shm/troupe-coll-stale-seg-1-0123456789abcdef";
  const std::string other = "/dev/shm/troupe-coll-stale-other-1-0123456789abcdef";
  for (const std::string& path : {stale, other}) std::ofstream(path) << "x";
  REQUIRE(std::filesystem::exists(stale));
  auto cluster = testing::newTestCluster();
  auto comms = connectAll(cluster, "stale-seg", 2, 2);
  CHECK_FALSE(std::filesystem::exists(stale));
  CHECK(std::filesystem::exists(other));
  std::filesystem::remove(other);
  CHECK(shmLeftovers("stale-seg").empty());
}

TEST_CASE("rendezvous: missing ranks are named after the timeout; a finished epoch is refused") {
  auto cluster = testing::newTestCluster();
  auto store = testing::openTestStore(cluster);
  CommunicatorOptions options;
  options.group = "partial";
  options.epoch = 3;
  options.rank = 0;
  options.worldSize = 3;
  options.rendezvousTimeout = 300ms;
  auto alone = connectCpuCommunicator(*store, options);
  REQUIRE_FALSE(alone.isOk());
  CHECK(alone.status().code() == StatusCode::kDeadlineExceeded);
  CHECK(alone.status().message().find("rank(s) 1, 2") != std::string::npos);

  REQUIRE(store->advanceGroupEpoch("partial", 4).isOk());
  auto late = connectCpuCommunicator(*store, options);
  REQUIRE_FALSE(late.isOk());
  CHECK(late.status().code() == StatusCode::kAborted);
  CHECK(late.status().message().find("already at epoch 4") != std::string::npos);

  options.rank = 3;
  CHECK(connectCpuCommunicator(*store, options).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("an epoch advance during the rendezvous ends the wait with kAborted") {
  testing::RedisServerProcess redis;
  auto store = connectRedisStore(redis.options("test"));
  REQUIRE(store.isOk());
  auto waiting = std::async(std::launch::async, [&redis] {
    auto own = connectRedisStore(redis.options("test"));
    REQUIRE(own.isOk());
    CommunicatorOptions options;
    options.group = "early";
    options.epoch = 1;
    options.worldSize = 2;  // rank 1 never comes
    options.rendezvousTimeout = 30s;
    return connectCpuCommunicator(**own, options).status();
  });
  const auto deadline = Clock::now() + 10s;
  while ((*store)->getRendezvous("early", 1)->empty() && Clock::now() < deadline) {
    std::this_thread::sleep_for(2ms);  // polling the condition (rank 0 published), 10 s deadline
  }
  REQUIRE_FALSE((*store)->getRendezvous("early", 1)->empty());
  const auto advancedAt = Clock::now();
  REQUIRE((*store)->advanceGroupEpoch("early", 2).isOk());
  Status status = waiting.get();
  CHECK(Clock::now() - advancedAt < 2s);
  CHECK(status.code() == StatusCode::kAborted);
  CHECK(status.message().find("advanced to epoch 2") != std::string::npos);
}

TEST_CASE("bad arguments fail the call only; the communicator stays usable") {
  auto cluster = testing::newTestCluster();
  auto comms = connectAll(cluster, "args", 1, 2);
  std::vector<float> data(4, 1.0f);
  CHECK(comms[0]->send(data.data(), 4, DataType::kFloat32, 0).code() ==
        StatusCode::kInvalidArgument);  // to itself
  CHECK(comms[0]->broadcast(data.data(), 4, DataType::kFloat32, 7).code() ==
        StatusCode::kInvalidArgument);
  CHECK(comms[0]->health().isOk());
  auto w0 = comms[0]->barrierAsync();
  auto w1 = comms[1]->barrierAsync();
  CHECK(w0->wait().isOk());
  CHECK(w1->wait().isOk());
}

}  // namespace
}  // namespace troupe::collectives
