// troupe._dist: torch.distributed's "troupe" backend (torch 1.13: a c10d::ProcessGroup) over a
// Troupe CPU communicator: shared memory between the ranks of a host, the TCP ring across hosts,
// TLS when a token is given. troupe/dist.py registers it with Backend.register_backend.
//
// Threads: ops are submitted by whichever thread calls them (Python's, or autograd's for DDP's
// hooks), under one lock so the communicator sees one submitter and the completion queue holds
// them in submission order. The communicator runs them in that order, so one completion thread
// per process group waits on them first to last, copies staged results into the caller's tensors
// and completes the c10d Work and its Future: the Future's callbacks (DDP's comm hook `then`s)
// run on that thread, never on the communicator's I/O thread.
//
// Errors: an op that fails completes its Work and Future with a RuntimeError carrying the
// communicator's status (which names the peer); after that the communicator fails every later op
// with the same status (recreate the process group). Bad arguments (unsupported op, reduce op or
// dtype, CUDA tensors) raise at the call.
//
// ClusterStore (troupe.dist.ClusterStore): a c10d::Store whose keys live in a key space of the
// cluster store (ClusterStore::setKey, ...), reached as the worker's node agent handed it over
// (the head's Redis, or the store gateway on a joined node), so ranks on any hosts meet without a
// shared file system or a TCPStore port, whatever the backend.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/utils/pybind.h>

#include <pybind11/chrono.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "troupe/collectives/communicator.h"
#include "troupe/runtime/clock.h"
#include "troupe/runtime/rendezvous_store.h"
#include "troupe/collectives/torch_adapter.h"
#include "troupe/runtime/cluster_store.h"
#include "python_errors.h"

namespace py = pybind11;
using troupe::python::InvalidArgument;
using troupe::python::WrongType;

namespace troupe::collectives {
namespace {

// ---- Rendezvous through the c10d::Store torch hands the backend ----

// Nothing advances the epoch of a process group torch created: the watch only waits (the
// rendezvous spends its polling pauses in next()) until interrupted.
class QuietEpochWatch final : public GroupEpochWatch {
 public:
  Result<std::optional<int64_t>> next(std::chrono::milliseconds timeout) override {
    std::unique_lock lock(mutex_);
    wake_.wait_for(lock, timeout, [this] { return interrupted_; });
    return std::optional<int64_t>();
  }
  void interrupt() override {
    {
      std::lock_guard lock(mutex_);
      interrupted_ = true;
    }
    wake_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable wake_;
  bool interrupted_ = false;
};

// A RendezvousStore over a c10d::Store (set/get/check/add), used only while the communicator
// connects, from the creating thread. Entries do not expire (c10d stores have no TTL; torch's
// PrefixStore gives each process group its own keys). Epochs: torch groups join epoch 0 only;
// an advance reads the counter with add(0) and adds the difference, which two ranks advancing
// concurrently past 0 could overshoot, so the elastic group hands its communicators the cluster
// store instead.
class C10dRendezvousStore final : public RendezvousStore {
 public:
  C10dRendezvousStore(c10::intrusive_ptr<c10d::Store> store, int worldSize)
      : store_(std::move(store)), worldSize_(worldSize) {}

  Result<int64_t> groupEpoch(const std::string& group) override {
    return guarded([&]() -> Result<int64_t> { return store_->add(fmt::format("troupe/{}/epoch", group), 0); });
  }

  Result<int64_t> advanceGroupEpoch(const std::string& group, int64_t epoch) override {
    return guarded([&]() -> Result<int64_t> {
      const std::string key = fmt::format("troupe/{}/epoch", group);
      int64_t current = store_->add(key, 0);
      if (current < epoch) current = store_->add(key, epoch - current);
      return current;
    });
  }
  Result<std::unique_ptr<GroupEpochWatch>> watchGroupEpoch(const std::string&) override {
    return std::unique_ptr<GroupEpochWatch>(std::make_unique<QuietEpochWatch>());
  }
  Status putRendezvousEntry(const std::string& group, int64_t epoch, int32_t rank, const std::string& value,
                            std::chrono::milliseconds) override {
    auto done = guarded([&]() -> Result<int64_t> {
      store_->set(entryKey(group, epoch, rank), std::vector<uint8_t>(value.begin(), value.end()));
      return 0;
    });
    return done.status();
  }
  Result<std::map<int32_t, std::string>> getRendezvous(const std::string& group, int64_t epoch) override {
    std::map<int32_t, std::string> entries;
    Status status = guarded([&]() -> Result<int64_t> {
      for (int32_t r = 0; r < worldSize_; ++r) {
        const std::string key = entryKey(group, epoch, r);
        if (!store_->check({key})) continue;
        std::vector<uint8_t> bytes = store_->get(key);
        entries[r] = std::string(bytes.begin(), bytes.end());
      }
      return 0;
    }).status();
    if (!status.isOk()) return status;
    return entries;
  }

 private:
  static std::string entryKey(const std::string& group, int64_t epoch, int32_t rank) {
    return fmt::format("troupe/{}/{}/rank/{}", group, epoch, rank);
  }
  // c10d stores throw; the rendezvous expects a Status.
  template <typename F>
  Result<int64_t> guarded(F&& call) {
    try {
      return call();
    } catch (const std::exception& e) {
      return Status(StatusCode::kUnavailable, fmt::format("the torch.distributed store failed: {}", e.what()));
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
  const int worldSize_;
};

// ---- troupe.dist.ClusterStore ----

// A c10d::Store over one key space of the cluster store. get() and wait() poll the store until
// the keys exist or the timeout passes (TODO(perf): a pub/sub wake-up instead of polling; the
// pause grows from 1 to 20 ms, a few round trips per rendezvous). A store of a group's epoch
// (groupStore) also fails a wait as soon as the group has moved past the epoch: the peers it
// waits for will not come. Thread-safety: any thread (torch's, Python's); the cluster store is
// used under `mutex_`, never held across a poll's pause.
class ClusterC10dStore final : public c10d::Store {
 public:
  ClusterC10dStore(std::unique_ptr<ClusterStore> store, std::string space, std::chrono::milliseconds timeout,
                   std::chrono::milliseconds ttl, std::string group = {}, int64_t epoch = 0)
      : c10d::Store(timeout),
        store_(std::move(store)),
        space_(std::move(space)),
        ttl_(ttl),
        group_(std::move(group)),
        epoch_(epoch) {}

  // The cluster store of this worker process, for the store of `space`. Throws when this
  // process is no worker of a cluster, or cannot reach its store.
  static std::unique_ptr<ClusterStore> connect(const std::string& space) {
    auto options = workerRedisOptions();
    if (!options.isOk()) {
      failStore(space, fmt::format("needs the cluster this process is a worker of (create the store in a "
                                   "Troupe actor): {}",
                                   options.status().message()));
    }
    auto store = connectRedisStore(*options);
    if (!store.isOk()) failStore(space, fmt::format("cannot reach the cluster store: {}", store.status().message()));
    return std::move(store).value();
  }

  // Throws the store's error (a RuntimeError in Python) naming the space.
  [[noreturn]] static void failStore(const std::string& space, const std::string& message) {
    C10_THROW_ERROR(Error, fmt::format("troupe.dist.ClusterStore '{}': {}", space, message));
  }

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    std::lock_guard lock(mutex_);
    check(store_->setKey(space_, key, text(value), ttl_), "set", key);
  }

  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    std::lock_guard lock(mutex_);
    auto value = store_->compareSetKey(space_, key, text(expected), text(desired), ttl_);
    check(value.status(), "compareSet", key);
    return bytes(*value);
  }

  // Waits (the store's timeout) for the key, as torch's stores do.
  std::vector<uint8_t> get(const std::string& key) override {
    for (;;) {
      waitFor({key}, timeout_, "get");
      std::lock_guard lock(mutex_);
      auto values = store_->getKeys(space_, {key});
      check(values.status(), "get", key);
      if ((*values)[0]) return bytes(*(*values)[0]);
      // Deleted between the wait and the read: wait again.
    }
  }

  int64_t add(const std::string& key, int64_t value) override {
    std::lock_guard lock(mutex_);
    auto sum = store_->addToKey(space_, key, value, ttl_);
    check(sum.status(), "add", key);
    return *sum;
  }

  bool deleteKey(const std::string& key) override {
    std::lock_guard lock(mutex_);
    auto deleted = store_->deleteKey(space_, key);
    check(deleted.status(), "deleteKey", key);
    return *deleted;
  }

  bool check(const std::vector<std::string>& keys) override { return absent(keys, "check").empty(); }

  int64_t getNumKeys() override {
    std::lock_guard lock(mutex_);
    auto count = store_->countKeys(space_);
    check(count.status(), "getNumKeys", "");
    return *count;
  }

  void wait(const std::vector<std::string>& keys) override { waitFor(keys, timeout_, "wait"); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    waitFor(keys, timeout, "wait");
  }

  // Deletes every key of the space (for a user done with it early; the ttl removes it anyway).
  void deleteAll() {
    std::lock_guard lock(mutex_);
    check(store_->deleteKeySpace(space_), "delete_all", "");
  }

  const std::string& space() const { return space_; }
  std::chrono::milliseconds ttl() const { return ttl_; }

 private:
  [[noreturn]] void fail(const std::string& message) const { failStore(space_, message); }
  void check(const Status& status, const char* op, const std::string& key) const {
    if (!status.isOk()) fail(fmt::format("{}('{}') failed: {}", op, key, status.message()));
  }
  static std::string text(const std::vector<uint8_t>& value) { return std::string(value.begin(), value.end()); }
  static std::vector<uint8_t> bytes(const std::string& value) { return std::vector<uint8_t>(value.begin(), value.end()); }

  // The keys of `keys` the space lacks, in order.
  std::vector<std::string> absent(const std::vector<std::string>& keys, const char* op) {
    std::lock_guard lock(mutex_);
    auto values = store_->getKeys(space_, keys);
    check(values.status(), op, keys.empty() ? "" : keys[0]);
    std::vector<std::string> missing;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!(*values)[i]) missing.push_back(keys[i]);
    }
    return missing;
  }

  // Waits until every key exists; `timeout` 0 (kNoTimeout) waits without end.
  void waitFor(const std::vector<std::string>& keys, std::chrono::milliseconds timeout, const char* op) {
    const auto start = Clock::now();
    const bool bounded = timeout != kNoTimeout;
    auto pause = std::chrono::milliseconds(1);
    auto nextEpochCheck = start;
    for (;;) {
      std::vector<std::string> missing = absent(keys, op);
      if (missing.empty()) return;
      const auto now = Clock::now();
      if (!group_.empty() && now >= nextEpochCheck) {
        checkEpochCurrent(missing, op);
        nextEpochCheck = now + std::chrono::milliseconds(100);
      }
      if (bounded && now - start >= timeout) {
        fail(fmt::format("{} timed out after {:.3f} s; missing {} of {} key(s): {}", op,
                         std::chrono::duration<double>(timeout).count(), missing.size(), keys.size(),
                         quoted(missing)));
      }
      auto sleepFor = pause;
      if (bounded) {
        sleepFor = std::min(sleepFor, std::chrono::duration_cast<std::chrono::milliseconds>(start + timeout - now) +
                                          std::chrono::milliseconds(1));
      }
      std::this_thread::sleep_for(sleepFor);  // polling the store for the keys, with the deadline above
      pause = std::min(pause * 2, std::chrono::milliseconds(20));
    }
  }

  // A group's epoch store: fails when the group has moved past the epoch.
  void checkEpochCurrent(const std::vector<std::string>& missing, const char* op) {
    std::lock_guard lock(mutex_);
    auto current = store_->groupEpoch(group_);
    check(current.status(), op, missing[0]);
    if (*current > epoch_) {
      fail(fmt::format("{}: group '{}' is already at epoch {}: epoch {} is over, and its ranks will not set "
                       "the missing key(s) {}",
                       op, group_, *current, epoch_, quoted(missing)));
    }
  }

  static std::string quoted(const std::vector<std::string>& keys) {
    constexpr size_t kShown = 8;
    std::string out;
    for (size_t i = 0; i < keys.size() && i < kShown; ++i) out += fmt::format("{}'{}'", i ? ", " : "", keys[i]);
    if (keys.size() > kShown) out += fmt::format(" and {} more", keys.size() - kShown);
    return out;
  }

  std::mutex mutex_;  // guards store_
  std::unique_ptr<ClusterStore> store_;
  const std::string space_;
  const std::chrono::milliseconds ttl_;
  const std::string group_;  // empty unless a group's epoch store
  const int64_t epoch_;
};

// A space's ttl: at least an hour, and at least twice the timeout (a slow rank may still read it).
std::chrono::milliseconds ttlFor(std::chrono::milliseconds timeout, std::optional<std::chrono::milliseconds> ttl) {
  if (ttl) {
    if (ttl->count() <= 0) throw InvalidArgument("troupe.dist.ClusterStore: ttl must be positive");
    return *ttl;
  }
  return std::max<std::chrono::milliseconds>(std::chrono::hours(1), 2 * timeout);
}

c10::intrusive_ptr<ClusterC10dStore> openStore(const std::string& prefix, std::chrono::milliseconds timeout,
                                               std::optional<std::chrono::milliseconds> ttl) {
  if (prefix.empty()) throw InvalidArgument("troupe.dist.ClusterStore: the prefix must not be empty");
  const auto keep = ttlFor(timeout, ttl);
  py::gil_scoped_release noGil;
  return c10::make_intrusive<ClusterC10dStore>(ClusterC10dStore::connect(prefix), prefix, timeout, keep);
}

// Joins epoch `epoch` of collective group `group` (raising the group's epoch to it, as a
// communicator's join does: the epochs before it are over) and returns the store of that epoch,
// in the key space groupKeySpace(group, epoch), deleted with the elastic group.
c10::intrusive_ptr<ClusterC10dStore> groupStore(const std::string& group, int64_t epoch,
                                                std::chrono::milliseconds timeout,
                                                std::chrono::milliseconds ttl) {
  if (group.empty()) throw InvalidArgument("troupe.dist.group_store: the group must not be empty");
  const std::string space = groupKeySpace(group, epoch);
  std::unique_ptr<ClusterStore> store = ClusterC10dStore::connect(space);
  auto current = store->advanceGroupEpoch(group, epoch);
  if (!current.isOk()) {
    ClusterC10dStore::failStore(space, fmt::format("joining epoch {} of group '{}' failed: {}", epoch, group,
                                                   current.status().message()));
  }
  if (*current > epoch) {
    ClusterC10dStore::failStore(space, fmt::format("group '{}' is already at epoch {}: epoch {} is over; join epoch {}",
                                                   group, *current, epoch, *current));
  }
  return c10::make_intrusive<ClusterC10dStore>(std::move(store), space, timeout, ttl, group, epoch);
}

// ---- Work ----

// A c10d Work whose Future holds the op's output tensors; completed by the completion thread.
class TroupeWork final : public c10d::Work {
 public:
  TroupeWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
      : c10d::Work(rank, type),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }

  // Wakes wait()ers, then runs the Future's callbacks on this thread.
  void complete(std::exception_ptr error) {
    finish(error);
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
  }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// RuntimeError in Python, as torch's own argument checks.
[[noreturn]] void fail(const std::string& message) { C10_THROW_ERROR(Error, "troupe process group: " + message); }

void check(const Status& status, const char* op) {
  if (!status.isOk()) fail(fmt::format("{}: {}", op, status.message()));
}

DataType reducible(const at::Tensor& tensor, const char* op) {
  auto type = dataTypeOf(tensor);
  check(type.status(), op);
  return *type;
}

ReduceOp reduceOpOf(const c10d::ReduceOp& op, const char* name) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return ReduceOp::kSum;
    case c10d::ReduceOp::AVG: return ReduceOp::kAvg;
    case c10d::ReduceOp::MIN: return ReduceOp::kMin;
    case c10d::ReduceOp::MAX: return ReduceOp::kMax;
    default:
      fail(fmt::format("{} does not support reduce op {} (SUM, AVG, MIN and MAX are supported)", name,
                       static_cast<int>(op.op_)));
  }
}

void checkCpu(const std::vector<at::Tensor>& tensors, const char* op) {
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || !t.device().is_cpu()) {
      fail(fmt::format("{}: CPU tensors only (use backend 'nccl' for CUDA tensors)", op));
    }
  }
}

size_t bytesOf(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

// How data-movement ops (broadcast, allgather, send/recv) carry `bytes` bytes of any dtype: as
// the tensor's own type when collectives know it, else as int64 or int32 words, padding to a
// whole word (the padding is staged and never reaches the caller's tensor).
struct Carrier {
  DataType type;
  size_t unitBytes;
};
Carrier carrierOf(const at::Tensor& t) {
  if (auto type = dataTypeOf(t)) return {*type, static_cast<size_t>(t.element_size())};
  if (bytesOf(t) % 8 == 0) return {DataType::kInt64, 8};
  return {DataType::kInt32, 4};
}
size_t unitsFor(size_t bytes, size_t unitBytes) { return (bytes + unitBytes - 1) / unitBytes; }

// A flat byte view of a staged buffer's [offset, offset + bytes) as `like`'s dtype and shape.
at::Tensor viewAs(const at::Tensor& bytesBuffer, size_t offset, const at::Tensor& like) {
  return bytesBuffer.narrow(0, static_cast<int64_t>(offset), static_cast<int64_t>(bytesOf(like)))
      .view(like.scalar_type())
      .view(like.sizes());
}

// A contiguous tensor to hand to the communicator in place of `t` (itself when contiguous).
at::Tensor contiguousFor(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

class ProcessGroupTroupe final : public c10d::ProcessGroup {
 public:
  ProcessGroupTroupe(int rank, int size, std::unique_ptr<Communicator> comm)
      : c10d::ProcessGroup(rank, size), comm_(std::move(comm)) {
    completer_ = std::thread([this] { completeInOrder(); });
  }

  ~ProcessGroupTroupe() override {
    // Python drops the last reference holding the GIL, and a failed op's Future may run a Python
    // callback on the completion thread, which needs it: release it while that thread drains.
    std::optional<py::gil_scoped_release> noGil;
    if (Py_IsInitialized() && PyGILState_Check()) noGil.emplace();
    // Destroying the communicator fails what is still queued, so the completion thread drains.
    {
      std::lock_guard submit(submitMutex_);
      comm_.reset();
    }
    {
      std::lock_guard lock(queueMutex_);
      stopping_ = true;
    }
    queueReady_.notify_one();
    completer_.join();
  }

  const std::string getBackendName() const override { return "troupe"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    return allreduceTensors(tensors, opts.reduceOp, c10d::OpType::ALLREDUCE, "allreduce");
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override {
    return allreduceTensors(tensors, opts.reduceOp, c10d::OpType::ALLREDUCE_COALESCED, "allreduce_coalesced");
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    const char* op = "broadcast";
    if (tensors.size() != 1) fail("broadcast takes a list of one tensor");
    checkCpu(tensors, op);
    checkRank(opts.rootRank, "root", op);
    at::Tensor& t = tensors[0];
    const Carrier carrier = carrierOf(t);
    const size_t bytes = bytesOf(t);
    at::Tensor buffer;
    if (t.is_contiguous() && bytes % carrier.unitBytes == 0) {
      buffer = t;
    } else {
      buffer = at::zeros({static_cast<int64_t>(unitsFor(bytes, carrier.unitBytes) * carrier.unitBytes)}, at::kByte);
      if (getRank() == opts.rootRank) viewAs(buffer, 0, t).copy_(t);
    }
    std::function<void()> after;
    if (!buffer.is_same(t)) after = [t, buffer]() mutable { t.copy_(viewAs(buffer, 0, t)); };
    return submit(c10d::OpType::BROADCAST, op, tensors, std::move(after), [&] {
      return std::vector{comm_->broadcastAsync(buffer.data_ptr(), unitsFor(bytes, carrier.unitBytes), carrier.type,
                                               static_cast<int>(opts.rootRank))};
    });
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions&) override {
    const char* op = "allgather";
    if (inputs.size() != 1 || outputs.size() != 1) fail("allgather takes one input tensor and one output list");
    std::vector<at::Tensor>& outs = outputs[0];
    if (static_cast<int>(outs.size()) != getSize()) {
      fail(fmt::format("allgather: the output list has {} tensors; it needs one per rank ({})", outs.size(),
                       getSize()));
    }
    checkCpu(inputs, op);
    checkCpu(outs, op);
    const at::Tensor& in = inputs[0];
    for (const at::Tensor& o : outs) {
      if (o.scalar_type() != in.scalar_type()) fail("allgather: every output tensor needs the input's dtype");
    }
    if (outs[getRank()].numel() != in.numel()) {
      fail(fmt::format("allgather: this rank's output tensor has {} elements, its input {}", outs[getRank()].numel(),
                       in.numel()));
    }
    bool even = true;
    for (const at::Tensor& o : outs) even = even && o.numel() == in.numel();
    if (even) return gatherEven(in, outs, c10d::OpType::ALLGATHER, op);
    return gatherByBroadcasts(in, outs);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions&) override {
    const char* op = "_allgather_base";
    checkCpu({output, input}, op);
    if (output.scalar_type() != input.scalar_type() || output.numel() != input.numel() * getSize()) {
      fail(fmt::format("_allgather_base: the output needs the input's dtype and world size ({}) times its "
                       "elements ({}), got {}",
                       getSize(), input.numel(), output.numel()));
    }
    auto type = dataTypeOf(input);
    if (type && input.is_contiguous() && output.is_contiguous()) {
      return submit(c10d::OpType::_ALLGATHER_BASE, op, {output}, {}, [&] {
        return std::vector{comm_->allgatherAsync(input.data_ptr(), output.data_ptr(),
                                                 static_cast<size_t>(output.numel()), *type)};
      });
    }
    if (!output.is_contiguous()) fail("_allgather_base: the output tensor must be contiguous");
    std::vector<at::Tensor> outs = output.view({-1}).chunk(getSize());
    return gatherEven(input, outs, c10d::OpType::_ALLGATHER_BASE, op, output);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    const char* op = "reduce_scatter";
    if (outputs.size() != 1 || inputs.size() != 1) fail("reduce_scatter takes one output tensor and one input list");
    std::vector<at::Tensor>& ins = inputs[0];
    at::Tensor& out = outputs[0];
    if (static_cast<int>(ins.size()) != getSize()) {
      fail(fmt::format("reduce_scatter: the input list has {} tensors; it needs one per rank ({})", ins.size(),
                       getSize()));
    }
    checkCpu(ins, op);
    checkCpu(outputs, op);
    const DataType type = reducible(out, op);
    const ReduceOp reduceOp = reduceOpOf(opts.reduceOp, op);
    for (const at::Tensor& t : ins) {
      if (t.scalar_type() != out.scalar_type()) fail("reduce_scatter: every input tensor needs the output's dtype");
    }
    if (ins[getRank()].numel() != out.numel()) {
      fail(fmt::format("reduce_scatter: the output has {} elements, this rank's input {}", out.numel(),
                       ins[getRank()].numel()));
    }
    std::vector<at::Tensor> flatParts;
    size_t total = 0;
    bool shardLayout = true;
    for (const at::Tensor& t : ins) flatParts.push_back(t.reshape({-1}));
    for (const at::Tensor& t : ins) total += static_cast<size_t>(t.numel());
    for (int r = 0; r < getSize(); ++r) {
      shardLayout = shardLayout && shardOf(total, getSize(), r).size() == static_cast<size_t>(ins[r].numel());
    }
    at::Tensor flat = at::cat(flatParts);
    if (shardLayout) {
      at::Tensor result = contiguousFor(out);
      std::function<void()> after;
      if (!result.is_same(out)) after = [out, result]() mutable { out.copy_(result); };
      return submit(c10d::OpType::REDUCE_SCATTER, op, outputs, std::move(after), [&] {
        // `flat` stays alive in the callback's capture until the op is done.
        return std::vector{comm_->reduceScatterAsync(flat.data_ptr(), result.data_ptr(), total, type, reduceOp)};
      }, {flat});
    }
    // Splits other than shardOf's (torch lets every rank's part have its own size): reduce the
    // whole and keep this rank's part.
    size_t offset = 0;
    for (int r = 0; r < getRank(); ++r) offset += static_cast<size_t>(ins[r].numel());
    std::function<void()> after = [out, flat, offset]() mutable {
      out.copy_(flat.narrow(0, static_cast<int64_t>(offset), out.numel()).view(out.sizes()));
    };
    return submit(c10d::OpType::REDUCE_SCATTER, op, outputs, std::move(after), [&] {
      return std::vector{comm_->allreduceAsync(flat.data_ptr(), flat.data_ptr(), total, type, reduceOp)};
    }, {flat});
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    const char* op = "_reduce_scatter_base";
    checkCpu({output, input}, op);
    const DataType type = reducible(output, op);
    const ReduceOp reduceOp = reduceOpOf(opts.reduceOp, op);
    if (output.scalar_type() != input.scalar_type() || input.numel() != output.numel() * getSize()) {
      fail(fmt::format("_reduce_scatter_base: the input needs the output's dtype and world size ({}) times its "
                       "elements ({}), got {}",
                       getSize(), output.numel(), input.numel()));
    }
    at::Tensor in = contiguousFor(input);
    at::Tensor result = contiguousFor(output);
    std::function<void()> after;
    if (!result.is_same(output)) after = [output, result]() mutable { output.copy_(result); };
    return submit(c10d::OpType::_REDUCE_SCATTER_BASE, op, {output}, std::move(after), [&] {
      return std::vector{comm_->reduceScatterAsync(in.data_ptr(), result.data_ptr(),
                                                   static_cast<size_t>(in.numel()), type, reduceOp)};
    }, {in});
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    return submit(c10d::OpType::BARRIER, "barrier", {}, {}, [&] { return std::vector{comm_->barrierAsync()}; });
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int) override {
    return pointToPoint(tensors, dstRank, true);
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int) override {
    return pointToPoint(tensors, srcRank, false);
  }

  // The rest of c10d's ops: one clear error each.
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>&, const c10d::ReduceOptions&) override {
    unsupported("reduce");
  }
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>&, std::vector<at::Tensor>&,
                                                     const c10d::AllgatherOptions&) override {
    unsupported("allgather_coalesced");
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>&, std::vector<at::Tensor>&,
                                        const c10d::GatherOptions&) override {
    unsupported("gather");
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>&, std::vector<std::vector<at::Tensor>>&,
                                         const c10d::ScatterOptions&) override {
    unsupported("scatter");
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor&, at::Tensor&, std::vector<int64_t>&, std::vector<int64_t>&,
                                               const c10d::AllToAllOptions&) override {
    unsupported("alltoall_base (all_to_all_single)");
  }
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>&, std::vector<at::Tensor>&,
                                          const c10d::AllToAllOptions&) override {
    unsupported("alltoall");
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>&, int) override {
    unsupported("recvAnysource (recv without a source rank)");
  }
  void monitoredBarrier(const c10d::BarrierOptions&, bool) override { unsupported("monitoredBarrier"); }

  // The communicator's health ("ok" or its error), for tests and error reports.
  std::string health() {
    std::lock_guard submit(submitMutex_);
    return comm_ ? comm_->health().toString() : "destroyed";
  }

  // The ranks the communicator saw die (a recovery need not wait for the cluster to say so).
  std::vector<int> deadPeers() {
    std::lock_guard submit(submitMutex_);
    return comm_ ? comm_->deadPeers() : std::vector<int>{};
  }

  // For hang reports: the peers the collective in progress waits for ("" when none runs).
  std::string waitingOn() {
    std::lock_guard submit(submitMutex_);  // held for the report only: a hang's, not a step's
    return comm_ ? comm_->waitingOn() : "";
  }

 private:
  struct Pending {
    std::vector<std::shared_ptr<Work>> works;
    c10::intrusive_ptr<TroupeWork> work;
    std::function<void()> after;       // copies staged results out, on the completion thread
    std::vector<at::Tensor> keepAlive;  // buffers the communicator reads or writes
    const char* op;
  };

  [[noreturn]] static void unsupported(const std::string& op) {
    fail(fmt::format("{} is not supported (supported: allreduce, broadcast, allgather, _allgather_base, "
                     "reduce_scatter, _reduce_scatter_base, barrier, send, recv); use backend 'gloo' for it",
                     op));
  }

  void checkRank(int64_t rank, const char* what, const char* op) const {
    if (rank < 0 || rank >= getSize()) {
      fail(fmt::format("{}: {} rank {} is not in [0, {})", op, what, rank, getSize()));
    }
  }

  // Submits the communicator ops `issue` returns (under the submit lock, so they are queued in
  // the order the communicator runs them) and returns their c10d Work.
  template <typename Issue>
  c10::intrusive_ptr<c10d::Work> submit(c10d::OpType type, const char* op, std::vector<at::Tensor> outputs,
                                        std::function<void()> after, Issue&& issue,
                                        std::vector<at::Tensor> keepAlive = {}) {
    auto work = c10::make_intrusive<TroupeWork>(getRank(), type, outputs);
    {
      std::lock_guard submit(submitMutex_);
      if (!comm_) fail(fmt::format("{}: the process group was destroyed", op));
      // A group whose peer died fails each new op at once, not only its Work: DDP issues its
      // all-reduces from the backward's hooks, so the backward stops at the next bucket instead
      // of computing every gradient only to fail when it waits for them.
      if (Status health = comm_->health(); !health.isOk()) fail(fmt::format("{}: {}", op, health.message()));
      Pending pending{issue(), work, std::move(after), std::move(keepAlive), op};
      for (at::Tensor& t : outputs) pending.keepAlive.push_back(t);
      {
        std::lock_guard lock(queueMutex_);
        queue_.push_back(std::move(pending));
      }
    }
    queueReady_.notify_one();
    return work;
  }

  c10::intrusive_ptr<c10d::Work> allreduceTensors(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& opts,
                                                  c10d::OpType opType, const char* op) {
    if (tensors.empty()) fail(fmt::format("{}: no tensors", op));
    checkCpu(tensors, op);
    const DataType type = reducible(tensors[0], op);
    const ReduceOp reduceOp = reduceOpOf(opts, op);
    for (const at::Tensor& t : tensors) {
      if (t.scalar_type() != tensors[0].scalar_type()) fail(fmt::format("{}: every tensor needs the same dtype", op));
    }
    at::Tensor buffer;
    std::function<void()> after;
    if (tensors.size() == 1) {
      at::Tensor t = tensors[0];
      buffer = contiguousFor(t);
      if (!buffer.is_same(t)) after = [t, buffer]() mutable { t.copy_(buffer); };
    } else {
      // Several tensors travel as one flat buffer (one op, not one per tensor).
      std::vector<at::Tensor> parts;
      for (const at::Tensor& t : tensors) parts.push_back(t.reshape({-1}));
      buffer = at::cat(parts);
      after = [tensors, buffer]() mutable {
        int64_t offset = 0;
        for (at::Tensor& t : tensors) {
          t.copy_(buffer.narrow(0, offset, t.numel()).view(t.sizes()));
          offset += t.numel();
        }
      };
    }
    return submit(opType, op, tensors, std::move(after), [&] {
      return std::vector{comm_->allreduceAsync(buffer.data_ptr(), buffer.data_ptr(),
                                               static_cast<size_t>(buffer.numel()), type, reduceOp)};
    }, {buffer});
  }

  // Every rank gives in.numel() elements: one allgather, directly into `whole` (when given) or
  // through a staged buffer copied out into `outs`.
  c10::intrusive_ptr<c10d::Work> gatherEven(const at::Tensor& in, std::vector<at::Tensor> outs, c10d::OpType opType,
                                            const char* op, at::Tensor whole = {}) {
    const Carrier carrier = carrierOf(in);
    const size_t bytes = bytesOf(in);
    const size_t units = unitsFor(bytes, carrier.unitBytes);
    const size_t slot = units * carrier.unitBytes;
    at::Tensor staged = at::empty({static_cast<int64_t>(slot * getSize())}, at::kByte);
    at::Tensor mine = staged.narrow(0, static_cast<int64_t>(slot * getRank()), static_cast<int64_t>(slot));
    if (bytes > 0) viewAs(staged, slot * getRank(), in).copy_(in);
    std::function<void()> after = [outs, staged, slot]() mutable {
      for (size_t r = 0; r < outs.size(); ++r) outs[r].copy_(viewAs(staged, slot * r, outs[r]));
    };
    std::vector<at::Tensor> outputs = whole.defined() ? std::vector<at::Tensor>{whole} : outs;
    return submit(opType, op, outputs, std::move(after), [&] {
      return std::vector{comm_->allgatherAsync(mine.data_ptr(), staged.data_ptr(), units * getSize(), carrier.type)};
    }, {staged});
  }

  // Ranks give different sizes: one broadcast from each rank.
  c10::intrusive_ptr<c10d::Work> gatherByBroadcasts(const at::Tensor& in, std::vector<at::Tensor> outs) {
    std::vector<at::Tensor> staged;
    std::vector<Carrier> carriers;
    for (int r = 0; r < getSize(); ++r) {
      const Carrier carrier = carrierOf(outs[r]);
      at::Tensor buffer = at::zeros(
          {static_cast<int64_t>(unitsFor(bytesOf(outs[r]), carrier.unitBytes) * carrier.unitBytes)}, at::kByte);
      if (r == getRank() && in.numel() > 0) viewAs(buffer, 0, in).copy_(in);
      staged.push_back(buffer);
      carriers.push_back(carrier);
    }
    std::function<void()> after = [outs, staged]() mutable {
      for (size_t r = 0; r < outs.size(); ++r) outs[r].copy_(viewAs(staged[r], 0, outs[r]));
    };
    return submit(c10d::OpType::ALLGATHER, "allgather", outs, std::move(after), [&] {
      std::vector<std::shared_ptr<Work>> works;
      for (int r = 0; r < getSize(); ++r) {
        works.push_back(comm_->broadcastAsync(staged[r].data_ptr(),
                                              static_cast<size_t>(staged[r].numel()) / carriers[r].unitBytes,
                                              carriers[r].type, r));
      }
      return works;
    }, staged);
  }

  c10::intrusive_ptr<c10d::Work> pointToPoint(std::vector<at::Tensor>& tensors, int peer, bool sending) {
    const char* op = sending ? "send" : "recv";
    if (tensors.size() != 1) fail(fmt::format("{} takes a list of one tensor", op));
    checkCpu(tensors, op);
    checkRank(peer, "peer", op);
    if (peer == getRank()) fail(fmt::format("{}: the peer is this rank ({})", op, peer));
    at::Tensor t = tensors[0];
    const Carrier carrier = carrierOf(t);
    const size_t bytes = bytesOf(t);
    at::Tensor buffer;
    if (t.is_contiguous() && bytes % carrier.unitBytes == 0) {
      buffer = t;
    } else {
      buffer = at::zeros({static_cast<int64_t>(unitsFor(bytes, carrier.unitBytes) * carrier.unitBytes)}, at::kByte);
      if (sending) viewAs(buffer, 0, t).copy_(t);
    }
    std::function<void()> after;
    if (!sending && !buffer.is_same(t)) after = [t, buffer]() mutable { t.copy_(viewAs(buffer, 0, t)); };
    const size_t units = unitsFor(bytes, carrier.unitBytes);
    return submit(sending ? c10d::OpType::SEND : c10d::OpType::RECV, op, tensors, std::move(after), [&] {
      return std::vector{sending ? comm_->sendAsync(buffer.data_ptr(), units, carrier.type, peer)
                                 : comm_->recvAsync(buffer.data_ptr(), units, carrier.type, peer)};
    }, {buffer});
  }

  // The completion thread: ops finish in submission order, so waiting on them first to last
  // completes each as soon as it is done.
  void completeInOrder() {
    for (;;) {
      Pending pending;
      {
        std::unique_lock lock(queueMutex_);
        queueReady_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        pending = std::move(queue_.front());
        queue_.pop_front();
      }
      Status status = Status::ok();
      for (const auto& w : pending.works) {
        Status s = w->wait();
        if (status.isOk() && !s.isOk()) status = s;
      }
      std::exception_ptr error;
      if (!status.isOk()) {
        error = std::make_exception_ptr(
            std::runtime_error(fmt::format("troupe process group: {} failed: {} (this process group is unusable: destroy it "
                        "and create another)",
                        pending.op, status.message())));
      } else if (pending.after) {
        try {
          pending.after();
        } catch (const std::exception& e) {
          error = std::make_exception_ptr(std::runtime_error(
              fmt::format("troupe process group: {}: copying the result out failed: {}", pending.op, e.what())));
        }
      }
      pending.keepAlive.clear();
      pending.work->complete(error);
    }
  }

  std::mutex submitMutex_;  // one submitter at a time; guards comm_
  std::unique_ptr<Communicator> comm_;
  std::mutex queueMutex_;
  std::condition_variable queueReady_;
  std::deque<Pending> queue_;
  bool stopping_ = false;
  std::thread completer_;
};

// torch's creator: rendezvous through torch's store, connect, wrap. Called without the GIL.
c10::intrusive_ptr<c10d::ProcessGroup> createProcessGroup(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                          int size, double timeoutSeconds, const std::string& host,
                                                          const std::string& tlsToken, bool sharedMemory) {
  CommunicatorOptions options;
  options.group = "torch";
  options.epoch = 0;
  options.rank = rank;
  options.worldSize = size;
  options.host = host;
  options.tlsToken = tlsToken;
  options.sharedMemory = sharedMemory;
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeoutSeconds * 1000));
  options.rendezvousTimeout = timeout;
  options.operationTimeout = timeout;
  C10dRendezvousStore rendezvousStore(store, size);
  auto comm = connectCpuCommunicator(rendezvousStore, options);
  if (!comm) {
    throw std::runtime_error(fmt::format("troupe process group: rank {} of {} could not connect: {}", rank, size,
                                         comm.status().message()));
  }
  return c10::make_intrusive<ProcessGroupTroupe>(rank, size, std::move(comm).value());
}

}  // namespace
}  // namespace troupe::collectives

PYBIND11_MODULE(_dist, m) {
  troupe::python::registerErrors();
  m.doc() = "torch.distributed's 'troupe' backend over Troupe's CPU communicators (see troupe.dist)";
  py::module_::import("torch.distributed");  // registers c10d's ProcessGroup and Store types
  m.def("create_process_group", &troupe::collectives::createProcessGroup, py::arg("store"), py::arg("rank"),
        py::arg("size"), py::arg("timeout_seconds"), py::arg("host"), py::arg("tls_token") = "",
        py::arg("shared_memory") = true, py::call_guard<py::gil_scoped_release>(),
        "Joins the ranks through `store` (a torch.distributed Store) and returns the process group.");
  py::class_<troupe::collectives::ClusterC10dStore, c10::intrusive_ptr<troupe::collectives::ClusterC10dStore>,
             c10d::Store>(m, "ClusterStore",
                          "A torch.distributed Store whose keys live in the cluster's store (see troupe.dist).")
      .def(py::init(&troupe::collectives::openStore), py::arg("prefix"),
           py::arg("timeout") = std::chrono::milliseconds(c10d::Store::kDefaultTimeout),
           py::arg("ttl") = std::optional<std::chrono::milliseconds>())
      .def_property_readonly("prefix", &troupe::collectives::ClusterC10dStore::space)
      .def_property_readonly("ttl", &troupe::collectives::ClusterC10dStore::ttl)
      .def("delete_all", &troupe::collectives::ClusterC10dStore::deleteAll, py::call_guard<py::gil_scoped_release>(),
           "Deletes every key of this store's prefix (the ttl deletes them anyway).");
  m.def(
      "group_store",
      [](const std::string& group, int64_t epoch, std::chrono::milliseconds timeout,
         std::optional<std::chrono::milliseconds> ttl) {
        const auto keep = troupe::collectives::ttlFor(timeout, ttl);
        py::gil_scoped_release noGil;
        return troupe::collectives::groupStore(group, epoch, timeout, keep);
      },
      py::arg("group"), py::arg("epoch"), py::arg("timeout") = std::chrono::milliseconds(c10d::Store::kDefaultTimeout),
      py::arg("ttl") = std::optional<std::chrono::milliseconds>(),
      "Joins epoch `epoch` of the cluster's collective group `group` and returns its ClusterStore.");
  m.def(
      "health",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
        auto* troupe = dynamic_cast<troupe::collectives::ProcessGroupTroupe*>(pg.get());
        if (troupe == nullptr) throw WrongType("not a troupe process group");
        return troupe->health();
      },
      py::arg("process_group"), "'OK' or the error that made the group's communicator unusable.");
  m.def(
      "dead_peers",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
        auto* troupe = dynamic_cast<troupe::collectives::ProcessGroupTroupe*>(pg.get());
        if (troupe == nullptr) throw WrongType("not a troupe process group");
        return troupe->deadPeers();
      },
      py::arg("process_group"), "The ranks whose death the group's communicator saw (their process ended).");
  m.def(
      "waiting_on",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
        auto* troupe = dynamic_cast<troupe::collectives::ProcessGroupTroupe*>(pg.get());
        if (troupe == nullptr) throw WrongType("not a troupe process group");
        py::gil_scoped_release noGil;  // may take up to a second
        return troupe->waitingOn();
      },
      py::arg("process_group"), "The peers the collective in progress waits for, or '' when none runs.");
}
