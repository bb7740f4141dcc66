// collectives_test_rank: one rank of a multi-process communicator test (communicator_test.cc
// spawns several). Redis comes from the environment (TROUPE_TEST_REDIS_HOST, _PORT, _PASSWORD:
// the password never travels in argv). Reports on stdout, one line each, flushed:
//   READY                      the first operation succeeded (loop mode)
//   BLOCKING                   an operation that cannot finish was submitted (block mode)
//   DEAD <ranks>               the peers the communicator saw die, comma-separated (idle mode)
//   ERROR <monotonic ns> <CODE> <message>   an operation failed, and when
//   REJOINED OK                the rank re-formed epoch + 1 without the victim and checked it
//   MATRIX OK <operations> shm=<0|1>   every operation of the matrix matched the reference;
//                              shm=1 when this rank had the shared-memory segment mapped
//   COMPARE OK <operations> shm=<0|1>  every operation gave the same bytes through shared memory
//                              as through TCP (compare mode)
// Exit code 0 when the mode's expectations held, 1 otherwise (with the reasons on stderr).
#include <time.h>

#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "reduce.h"
#include "shm_transport.h"
#include "troupe/collectives/communicator.h"
#include "troupe/runtime/cluster_store.h"

namespace troupe::collectives {
namespace {

struct Args {
  std::string mode = "matrix";
  std::string cluster = "test";
  std::string group = "g";
  int64_t epoch = 1;
  int rank = 0;
  int world = 1;
  int victim = -1;
  size_t count = 1 << 20;
  size_t ballastMb = 0;
  bool victimExits = false;
  size_t chunkBytes = 256 * 1024;
  size_t smallBytes = 64 * 1024;
  bool sharedMemory = true;
};

int64_t monotonicNs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

void report(const std::string& line) {
  std::fputs((line + "\n").c_str(), stdout);
  std::fflush(stdout);
}

void reportError(const Status& status) {
  std::string message = status.message();
  for (char& c : message) {
    if (c == '\n') c = ' ';
  }
  report(fmt::format("ERROR {} {} {}", monotonicNs(), statusCodeName(status.code()), message));
}

Result<std::unique_ptr<ClusterStore>> openStore(const Args& args) {
  RedisOptions options;
  const char* host = std::getenv("TROUPE_TEST_REDIS_HOST");
  const char* port = std::getenv("TROUPE_TEST_REDIS_PORT");
  const char* password = std::getenv("TROUPE_TEST_REDIS_PASSWORD");
  if (!host || !port || !password) {
    return Status(StatusCode::kInvalidArgument,
                  "set TROUPE_TEST_REDIS_HOST, TROUPE_TEST_REDIS_PORT and "
                  "TROUPE_TEST_REDIS_PASSWORD");
  }
  options.host = host;
  options.port = std::atoi(port);
  options.password = password;
  options.cluster = args.cluster;
  return connectRedisStore(options);
}

CommunicatorOptions communicatorOptions(const Args& args, int64_t epoch, int rank, int world) {
  CommunicatorOptions options;
  options.group = args.group;
  options.epoch = epoch;
  options.rank = rank;
  options.worldSize = world;
  options.rendezvousTimeout = std::chrono::seconds(30);
  options.operationTimeout = std::chrono::seconds(60);
  options.chunkBytes = args.chunkBytes;
  options.smallMessageBytes = args.smallBytes;
  options.sharedMemory = args.sharedMemory;
  return options;
}

// Whether this process maps a communicator segment of `group` (shm_transport.cc names them
// /troupe-coll-<group, at most 24 characters>-...; unlinked, so the map line ends "(deleted)").
// Returns the mapping's size in bytes, 0 when there is none.
uint64_t sharedMemoryMapped(const std::string& group) {
  std::ifstream maps("/proc/self/maps");
  const std::string needle = "/dev/shm/troupe-coll-" + group.substr(0, 24) + "-";
  for (std::string line; std::getline(maps, line);) {
    if (line.find(needle) == std::string::npos) continue;
    uint64_t begin = 0, end = 0;
    if (std::sscanf(line.c_str(), "%" SCNx64 "-%" SCNx64, &begin, &end) == 2) return end - begin;
  }
  return 0;
}

// How many ranks share the segment of `bytes` (its layout's size for that many ranks), 0: none.
int segmentRanks(uint64_t bytes, size_t chunkBytes) {
  for (int ranks = 2; ranks <= 64 && bytes > 0; ++ranks) {
    if (segmentBytes(ranks, pipeBytesFor(ranks, shmChunkBytes(chunkBytes))) == bytes) return ranks;
  }
  return 0;
}

// ---- Values and references ----

// Small integers: exact in every type, and sums of five stay exact even in bfloat16.
int valueOf(int rank, size_t i, int salt) {
  return static_cast<int>((i * 7 + static_cast<size_t>(rank) * 13 + salt * 5) % 17) - 8;
}

void store(DataType type, void* buffer, size_t i, double value) {
  switch (type) {
    case DataType::kFloat32: static_cast<float*>(buffer)[i] = static_cast<float>(value); break;
    case DataType::kFloat64: static_cast<double*>(buffer)[i] = value; break;
    case DataType::kBFloat16:
      static_cast<uint16_t*>(buffer)[i] = floatToBfloat16(static_cast<float>(value));
      break;
    case DataType::kFloat16:
      static_cast<uint16_t*>(buffer)[i] = floatToFloat16(static_cast<float>(value));
      break;
    case DataType::kInt32: static_cast<int32_t*>(buffer)[i] = static_cast<int32_t>(value); break;
    case DataType::kInt64: static_cast<int64_t*>(buffer)[i] = static_cast<int64_t>(value); break;
  }
}

double load(DataType type, const void* buffer, size_t i) {
  switch (type) {
    case DataType::kFloat32: return static_cast<const float*>(buffer)[i];
    case DataType::kFloat64: return static_cast<const double*>(buffer)[i];
    case DataType::kBFloat16: return bfloat16ToFloat(static_cast<const uint16_t*>(buffer)[i]);
    case DataType::kFloat16: return float16ToFloat(static_cast<const uint16_t*>(buffer)[i]);
    case DataType::kInt32: return static_cast<const int32_t*>(buffer)[i];
    case DataType::kInt64: return static_cast<const int64_t*>(buffer)[i];
  }
  return 0;
}

bool isInteger(DataType type) { return type == DataType::kInt32 || type == DataType::kInt64; }

// The straightforward reference: reduce element i over the ranks' inputs.
double reference(DataType type, ReduceOp op, int world, size_t i, int salt) {
  int64_t sum = 0, low = valueOf(0, i, salt), high = low;
  for (int r = 0; r < world; ++r) {
    const int64_t v = valueOf(r, i, salt);
    sum += v;
    low = std::min(low, v);
    high = std::max(high, v);
  }
  switch (op) {
    case ReduceOp::kSum: return static_cast<double>(sum);
    case ReduceOp::kMin: return static_cast<double>(low);
    case ReduceOp::kMax: return static_cast<double>(high);
    case ReduceOp::kAvg:
      return isInteger(type) ? static_cast<double>(sum / world)  // C++ truncation, as documented
                             : static_cast<double>(sum) / world;
  }
  return 0;
}

double tolerance(DataType type, double expected) {
  switch (type) {
    case DataType::kBFloat16: return std::max(1.0, std::fabs(expected)) / 128;
    case DataType::kFloat16: return std::max(1.0, std::fabs(expected)) / 1024;
    case DataType::kFloat32: return std::max(1.0, std::fabs(expected)) * 1e-6;
    case DataType::kFloat64: return std::max(1.0, std::fabs(expected)) * 1e-12;
    default: return 0;
  }
}

class Matrix {
 public:
  Matrix(Communicator& comm) : comm_(comm), n_(comm.worldSize()), me_(comm.rank()) {}

  int failures() const { return failures_; }
  int operations() const { return operations_; }

  void run() {
    const size_t counts[] = {0, 1, 5, 1000, 4099, 50021};
    const DataType types[] = {DataType::kFloat32, DataType::kFloat64, DataType::kBFloat16,
                              DataType::kFloat16, DataType::kInt32,   DataType::kInt64};
    const ReduceOp ops[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax};
    int salt = 0;
    for (size_t count : counts) {
      for (DataType type : types) {
        const size_t elem = dataTypeSize(type);
        std::vector<char> in(count * elem + 8), out(count * elem + 8);
        for (ReduceOp op : ops) {
          for (bool inPlace : {false, true}) {
            ++salt;
            fill(type, in.data(), count, me_, salt);
            std::memset(out.data(), 0x7f, out.size());
            char* target = inPlace ? in.data() : out.data();
            check(comm_.allreduce(in.data(), target, count, type, op), "allreduce", type, op,
                  count, [&](size_t i) { return reference(type, op, n_, i, salt); }, target, 0,
                  count);
          }
          // reduce-scatter: out-of-place, then in place (the shard's place inside the input)
          const Shard mine = shardOf(count, n_, me_);
          for (bool inPlace : {false, true}) {
            ++salt;
            fill(type, in.data(), count, me_, salt);
            char* target = inPlace ? in.data() + mine.begin * elem : out.data();
            check(comm_.reduceScatter(in.data(), target, count, type, op), "reduce_scatter",
                  type, op, count,
                  [&](size_t i) { return reference(type, op, n_, mine.begin + i, salt); },
                  target, 0, mine.size());
          }
        }
        // all-gather: out-of-place, then in place
        const Shard mine = shardOf(count, n_, me_);
        for (bool inPlace : {false, true}) {
          ++salt;
          std::vector<char> shard(mine.size() * elem + 8);
          for (size_t i = 0; i < mine.size(); ++i) {
            store(type, shard.data(), i, valueOf(me_, mine.begin + i, salt));
          }
          std::memset(out.data(), 0x7f, out.size());
          const char* source = shard.data();
          if (inPlace) {
            std::memcpy(out.data() + mine.begin * elem, shard.data(), mine.size() * elem);
            source = out.data() + mine.begin * elem;
          }
          check(comm_.allgather(source, out.data(), count, type), "allgather", type,
                ReduceOp::kSum, count,
                [&](size_t i) {
                  for (int r = 0; r < n_; ++r) {
                    const Shard s = shardOf(count, n_, r);
                    if (i >= s.begin && i < s.end) return double(valueOf(r, i, salt));
                  }
                  return -1000.0;
                },
                out.data(), 0, count);
        }
        // broadcast from a root that moves with the count
        {
          ++salt;
          const int root = static_cast<int>(count % static_cast<size_t>(n_));
          fill(type, in.data(), count, me_, salt);
          check(comm_.broadcast(in.data(), count, type, root), "broadcast", type, ReduceOp::kSum,
                count, [&](size_t i) { return double(valueOf(root, i, salt)); }, in.data(), 0,
                count);
        }
        // send/recv around the ring; even ranks send first so nobody waits on a full socket
        if (n_ > 1) {
          ++salt;
          const int right = (me_ + 1) % n_, left = (me_ + n_ - 1) % n_;
          fill(type, in.data(), count, me_, salt);
          std::memset(out.data(), 0x7f, out.size());
          Status sent, received;
          if (me_ % 2 == 0) {
            sent = comm_.send(in.data(), count, type, right);
            received = comm_.recv(out.data(), count, type, left);
          } else {
            received = comm_.recv(out.data(), count, type, left);
            sent = comm_.send(in.data(), count, type, right);
          }
          check(sent, "send", type, ReduceOp::kSum, count, [](size_t) { return 0.0; }, nullptr, 0,
                0);
          check(received, "recv", type, ReduceOp::kSum, count,
                [&](size_t i) { return double(valueOf(left, i, salt)); }, out.data(), 0, count);
          // the same ring in one duplex step each way: right, then back to the left
          for (const bool rightwards : {true, false}) {
            ++salt;
            const int to = rightwards ? right : left, from = rightwards ? left : right;
            fill(type, in.data(), count, me_, salt);
            std::memset(out.data(), 0x7f, out.size());
            check(comm_.sendRecv(in.data(), to, out.data(), from, count, type), "sendrecv", type, ReduceOp::kSum,
                  count, [&](size_t i) { return double(valueOf(from, i, salt)); }, out.data(), 0, count);
          }
        }
      }
      check(comm_.barrier(), "barrier", DataType::kFloat32, ReduceOp::kSum, 0,
            [](size_t) { return 0.0; }, nullptr, 0, 0);
    }
  }

 private:
  static void fill(DataType type, void* buffer, size_t count, int rank, int salt) {
    for (size_t i = 0; i < count; ++i) store(type, buffer, i, valueOf(rank, i, salt));
  }

  template <typename Expected>
  void check(const Status& status, const char* what, DataType type, ReduceOp op, size_t count,
             Expected expected, const void* got, size_t from, size_t to) {
    ++operations_;
    if (!status.isOk()) {
      ++failures_;
      std::fprintf(stderr, "rank %d: %s(%s, %s, %zu) failed: %s\n", me_, what,
                   dataTypeName(type), reduceOpName(op), count, status.toString().c_str());
      return;
    }
    for (size_t i = from; i < to; ++i) {
      const double want = expected(i);
      const double have = load(type, got, i);
      if (std::fabs(have - want) > tolerance(type, want)) {
        ++failures_;
        std::fprintf(stderr, "rank %d of %d: %s(%s, %s, %zu elements): element %zu is %g, "
                     "expected %g\n",
                     me_, n_, what, dataTypeName(type), reduceOpName(op), count, i, have, want);
        return;
      }
    }
  }

  Communicator& comm_;
  int n_;
  int me_;
  int failures_ = 0;
  int operations_ = 0;
};

// ---- Modes ----

int runMatrix(RendezvousStore& store, const Args& args) {
  auto comm = connectCpuCommunicator(store, communicatorOptions(args, args.epoch, args.rank,
                                                                args.world));
  if (!comm) {
    reportError(comm.status());
    return 1;
  }
  Matrix matrix(**comm);
  matrix.run();
  if (matrix.failures() > 0) return 1;
  report(fmt::format("MATRIX OK {} shm={}", matrix.operations(), sharedMemoryMapped(args.group) ? 1 : 0));
  return 0;
}

// Random values whose sums depend on the order of the additions (floats of mixed magnitudes), so
// a different reduction order would show in the bytes.
void fillRandom(DataType type, void* buffer, size_t count, std::mt19937_64& random) {
  std::uniform_real_distribution<double> mantissa(-1.0, 1.0);
  std::uniform_int_distribution<int> exponent(-12, 12);
  std::uniform_int_distribution<int64_t> integer(-1'000'000, 1'000'000);
  for (size_t i = 0; i < count; ++i) {
    if (isInteger(type)) {
      store(type, buffer, i, static_cast<double>(integer(random)));
    } else {
      store(type, buffer, i, std::ldexp(mantissa(random), exponent(random)));
    }
  }
}

// Every operation on the same random inputs through a shared-memory communicator and a TCP one
// (the same ranks, options and algorithms): the outputs must be the same bytes.
int runCompare(RendezvousStore& store, const Args& args) {
  CommunicatorOptions shmOptions = communicatorOptions(args, args.epoch, args.rank, args.world);
  CommunicatorOptions tcpOptions = shmOptions;
  tcpOptions.group += "-tcp";
  tcpOptions.sharedMemory = false;
  auto shm = connectCpuCommunicator(store, shmOptions);
  if (!shm) {
    reportError(shm.status());
    return 1;
  }
  auto tcp = connectCpuCommunicator(store, tcpOptions);
  if (!tcp) {
    reportError(tcp.status());
    return 1;
  }
  Communicator& a = **shm;
  Communicator& b = **tcp;
  const int n = args.world, me = args.rank;
  int operations = 0, failures = 0;
  auto same = [&](const Status& sa, const Status& sb, const char* what, DataType type, size_t count,
                  const std::vector<char>& x, const std::vector<char>& y) {
    ++operations;
    if (!sa.isOk() || !sb.isOk()) {
      std::fprintf(stderr, "rank %d: %s(%s, %zu): %s / %s\n", me, what, dataTypeName(type), count,
                   sa.toString().c_str(), sb.toString().c_str());
      ++failures;
    } else if (x != y) {
      size_t at = 0;
      while (at < x.size() && x[at] == y[at]) ++at;
      std::fprintf(stderr, "rank %d of %d: %s(%s, %zu elements): shared memory and TCP differ at byte %zu\n",
                   me, n, what, dataTypeName(type), count, at);
      ++failures;
    }
  };
  const DataType types[] = {DataType::kFloat32, DataType::kFloat64, DataType::kBFloat16,
                            DataType::kFloat16, DataType::kInt32,   DataType::kInt64};
  const ReduceOp ops[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax};
  std::mt19937_64 random(static_cast<uint64_t>(me) * 7919 + 17);
  for (size_t count : {size_t{1}, size_t{7}, size_t{1000}, size_t{50021}, args.count}) {
    for (DataType type : types) {
      const size_t elem = dataTypeSize(type);
      const Shard mine = shardOf(count, n, me);
      // A few spare bytes: a rank whose shard is empty still passes a valid pointer.
      std::vector<char> in(count * elem + 8), x(count * elem + 8), y(count * elem + 8);
      for (ReduceOp op : ops) {
        fillRandom(type, in.data(), count, random);
        same(a.allreduce(in.data(), x.data(), count, type, op), b.allreduce(in.data(), y.data(), count, type, op),
             "allreduce", type, count, x, y);
        std::vector<char> xs(mine.size() * elem + 8), ys(mine.size() * elem + 8);
        same(a.reduceScatter(in.data(), xs.data(), count, type, op),
             b.reduceScatter(in.data(), ys.data(), count, type, op), "reduce_scatter", type, count, xs, ys);
        // The ZeRO identity: reduce-scatter then all-gather is the all-reduce, bit for bit.
        std::vector<char> gathered(count * elem + 8);
        same(a.allgather(xs.data(), gathered.data(), count, type), Status::ok(), "reduce_scatter+allgather", type,
             count, gathered, x);
      }
      fillRandom(type, in.data(), count, random);
      std::vector<char> shard(in.begin() + static_cast<ptrdiff_t>(mine.begin * elem),
                              in.begin() + static_cast<ptrdiff_t>(mine.end * elem));
      shard.resize(shard.size() + 8);
      same(a.allgather(shard.data(), x.data(), count, type), b.allgather(shard.data(), y.data(), count, type),
           "allgather", type, count, x, y);
      const int root = static_cast<int>(count % static_cast<size_t>(n));
      x = in;
      y = in;
      same(a.broadcast(x.data(), count, type, root), b.broadcast(y.data(), count, type, root), "broadcast", type,
           count, x, y);
      if (n > 1) {
        const int right = (me + 1) % n, left = (me + n - 1) % n;
        same(a.sendRecv(in.data(), right, x.data(), left, count, type),
             b.sendRecv(in.data(), right, y.data(), left, count, type), "sendrecv", type, count, x, y);
      }
    }
  }
  Status barrierA = a.barrier(), barrierB = b.barrier();
  if (!barrierA.isOk() || !barrierB.isOk()) ++failures;
  if (failures > 0) return 1;
  const uint64_t mapped = sharedMemoryMapped(args.group);
  report(fmt::format("COMPARE OK {} shm={} host_ranks={}", operations, mapped > 0 ? 1 : 0,
                     segmentRanks(mapped, args.chunkBytes)));
  return 0;
}

// A sum all-reduce of `count` floats whose result is checked; returns the status.
Status checkedAllreduce(Communicator& comm, std::vector<float>& buffer) {
  for (size_t i = 0; i < buffer.size(); ++i) {
    buffer[i] = static_cast<float>(valueOf(comm.rank(), i, 1));
  }
  Status status = comm.allreduce(buffer.data(), buffer.size(), DataType::kFloat32, ReduceOp::kSum);
  if (!status.isOk()) return status;
  for (size_t i = 0; i < buffer.size(); i += 997) {
    const double want = reference(DataType::kFloat32, ReduceOp::kSum, comm.worldSize(), i, 1);
    if (buffer[i] != want) {
      return Status(StatusCode::kInternal,
                    fmt::format("element {} is {}, expected {}", i, buffer[i], want));
    }
  }
  return Status::ok();
}

// Loops all-reduces until one fails (a peer was killed), then re-forms epoch + 1 without the
// victim and checks an all-reduce there.
int runLoop(RendezvousStore& store, const Args& args) {
  std::vector<float> buffer(args.count);
  Status failure;
  {
    auto comm = connectCpuCommunicator(store, communicatorOptions(args, args.epoch, args.rank,
                                                                  args.world));
    if (!comm) {
      reportError(comm.status());
      return 1;
    }
    bool ready = false;
    for (;;) {
      Status status = checkedAllreduce(**comm, buffer);
      if (!status.isOk()) {
        failure = status;
        reportError(status);
        break;
      }
      if (!ready) report(fmt::format("READY shm={}", sharedMemoryMapped(args.group) ? 1 : 0));
      ready = true;
    }
    // Later operations fail at once, with the same error.
    Status later = (*comm)->barrier();
    if (later.isOk() || later.message() != failure.message()) {
      std::fprintf(stderr, "rank %d: an operation after the failure returned %s\n", args.rank,
                   later.toString().c_str());
      return 1;
    }
  }
  if (args.victim < 0) return 0;
  const int newRank = args.rank > args.victim ? args.rank - 1 : args.rank;
  auto comm = connectCpuCommunicator(
      store, communicatorOptions(args, args.epoch + 1, newRank, args.world - 1));
  if (!comm) {
    reportError(comm.status());
    return 1;
  }
  Status status = checkedAllreduce(**comm, buffer);
  if (!status.isOk()) {
    reportError(status);
    return 1;
  }
  report("REJOINED OK");
  return 0;
}

// Submits an operation that cannot finish (rank `victim` receives from rank 0 instead of
// joining the all-reduce) and reports how it ends.
int runBlock(RendezvousStore& store, const Args& args) {
  auto comm = connectCpuCommunicator(store, communicatorOptions(args, args.epoch, args.rank,
                                                                args.world));
  if (!comm) {
    reportError(comm.status());
    return 1;
  }
  std::vector<float> buffer(args.count, 1.0f);
  auto work = args.rank == args.victim
                  ? (*comm)->recvAsync(buffer.data(), buffer.size(), DataType::kFloat32, 0)
                  : (*comm)->allreduceAsync(buffer.data(), buffer.data(), buffer.size(),
                                            DataType::kFloat32, ReduceOp::kSum);
  report("BLOCKING");
  Status status = work->wait();
  if (status.isOk()) {
    std::fprintf(stderr, "rank %d: the blocked operation succeeded\n", args.rank);
    return 1;
  }
  reportError(status);
  return 0;
}

// One all-reduce, then the victim fills `ballastMb` of memory (4 KiB pages: slow to tear down)
// and every rank reports READY; the others wait, idle, until the communicator fails (the test
// kills the victim) and report how, and which peers it saw die.
int runIdle(RendezvousStore& store, const Args& args) {
  auto comm = connectCpuCommunicator(store, communicatorOptions(args, args.epoch, args.rank, args.world));
  if (!comm) {
    reportError(comm.status());
    return 1;
  }
  std::vector<float> buffer(args.count);
  if (Status status = checkedAllreduce(**comm, buffer); !status.isOk()) {
    reportError(status);
    return 1;
  }
  std::vector<char> ballast;
  if (args.rank == args.victim) {
    ballast.resize(args.ballastMb << 20);
    for (size_t i = 0; i < ballast.size(); i += 4096) ballast[i] = 1;  // every page, faulted in
  }
  report(fmt::format("READY shm={}", sharedMemoryMapped(args.group) ? 1 : 0));
  if (args.rank == args.victim && args.victimExits) std::exit(0);  // its communicator still open
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  Status health;
  while ((health = (*comm)->health()).isOk() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));  // polls the condition, with the deadline
  }
  if (health.isOk()) {
    std::fprintf(stderr, "rank %d: the communicator stayed healthy\n", args.rank);
    return 1;
  }
  reportError(health);
  std::string dead;
  for (int rank : (*comm)->deadPeers()) dead += (dead.empty() ? "" : ",") + std::to_string(rank);
  report("DEAD " + dead);
  return 0;
}

}  // namespace
}  // namespace troupe::collectives

int main(int argc, char** argv) {
  using namespace troupe::collectives;
  Args args;
  CLI::App app("One rank of a Troupe collectives test");
  app.add_option("--mode", args.mode)->check(CLI::IsMember({"matrix", "loop", "block", "compare", "idle"}));
  app.add_option("--cluster", args.cluster);
  app.add_option("--group", args.group);
  app.add_option("--epoch", args.epoch);
  app.add_option("--rank", args.rank);
  app.add_option("--world", args.world);
  app.add_option("--victim", args.victim);
  app.add_option("--count", args.count);
  app.add_option("--ballast-mb", args.ballastMb, "idle mode: the victim's memory before READY");
  app.add_flag("--victim-exits", args.victimExits, "idle mode: the victim exits after READY instead of waiting");
  app.add_option("--chunk-bytes", args.chunkBytes);
  app.add_option("--small-bytes", args.smallBytes);
  app.add_option("--shm", args.sharedMemory, "use shared memory between the ranks of this host (1) or not (0)");
  CLI11_PARSE(app, argc, argv);

  auto store = openStore(args);
  if (!store) {
    reportError(store.status());
    return 1;
  }
  if (args.mode == "matrix") return runMatrix(**store, args);
  if (args.mode == "loop") return runLoop(**store, args);
  if (args.mode == "compare") return runCompare(**store, args);
  if (args.mode == "idle") return runIdle(**store, args);
  return runBlock(**store, args);
}
