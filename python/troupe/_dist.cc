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
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/utils/pybind.h>

#include <pybind11/chrono.h>

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
#include "troupe/collectives/rendezvous_store.h"
#include "troupe/collectives/torch_adapter.h"

namespace py = pybind11;

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
// store (ClusterRendezvousStore) instead.
class C10dRendezvousStore final : public RendezvousStore {
 public:
  C10dRendezvousStore(c10::intrusive_ptr<c10d::Store> store, int worldSize)
      : store_(std::move(store)), worldSize_(worldSize) {}

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
  m.doc() = "torch.distributed's 'troupe' backend over Troupe's CPU communicators (see troupe.dist)";
  py::module_::import("torch.distributed");  // registers c10d's ProcessGroup and Store types
  m.def("create_process_group", &troupe::collectives::createProcessGroup, py::arg("store"), py::arg("rank"),
        py::arg("size"), py::arg("timeout_seconds"), py::arg("host"), py::arg("tls_token") = "",
        py::arg("shared_memory") = true, py::call_guard<py::gil_scoped_release>(),
        "Joins the ranks through `store` (a torch.distributed Store) and returns the process group.");
  m.def(
      "health",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
        auto* troupe = dynamic_cast<troupe::collectives::ProcessGroupTroupe*>(pg.get());
        if (troupe == nullptr) throw py::type_error("not a troupe process group");
        return troupe->health();
      },
      py::arg("process_group"), "'OK' or the error that made the group's communicator unusable.");
}
