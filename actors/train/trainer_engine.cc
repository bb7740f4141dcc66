// The engine's step: micro-batches, bucketed all-reduce overlapped with backward, optimizer.
// One of the two translation units of actors/train that include LibTorch (~30 s to compile).
#include "troupe/actors/trainer_engine.h"

#include <mutex>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <chrono>
#include <cmath>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <set>

#include <fmt/format.h>

#include "models.h"
#include "troupe/collectives/communicator.h"
#include "troupe/optimizers/adamw.h"
#include "troupe/optimizers/agd.h"
#include "troupe/optimizers/lamb.h"
#include "troupe/optimizers/lars.h"
#include "troupe/optimizers/wsam.h"
#include "troupe/runtime/clock.h"

namespace troupe::actors {
namespace {

using train::NamedTensors;
using train::TrainModel;

double secondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

int64_t wallUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

Status invalid(const std::string& message) {
  return Status(StatusCode::kInvalidArgument, message);
}

const char* dtypeName(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    default: return "unsupported";
  }
}

Result<at::ScalarType> scalarTypeOf(const std::string& dtype) {
  static const std::map<std::string, at::ScalarType> kTypes = {
      {"float32", at::kFloat}, {"float64", at::kDouble}, {"int64", at::kLong},
      {"int32", at::kInt},     {"uint8", at::kByte},     {"bool", at::kBool},
      {"float16", at::kHalf},  {"bfloat16", at::kBFloat16}};
  auto it = kTypes.find(dtype);
  if (it == kTypes.end()) return invalid(fmt::format("unknown dtype '{}'", dtype));
  return it->second;
}

HostTensor toHost(std::string name, const at::Tensor& tensor) {
  const at::Tensor t = tensor.detach().contiguous();
  HostTensor host;
  host.name = std::move(name);
  host.dtype = dtypeName(t.scalar_type());
  host.shape.assign(t.sizes().begin(), t.sizes().end());
  host.bytes.resize(t.numel() * t.element_size());
  if (!host.bytes.empty()) std::memcpy(host.bytes.data(), t.data_ptr(), host.bytes.size());
  return host;
}

HostTensor scalarHost(std::string name, int64_t value) {
  HostTensor host;
  host.name = std::move(name);
  host.dtype = "int64";
  host.bytes.resize(8);
  std::memcpy(host.bytes.data(), &value, 8);
  return host;
}

// A view of a host buffer (no copy): valid while `host` lives and is not modified.
at::Tensor viewOf(const HostTensor& host, at::ScalarType type) {
  return at::from_blob(const_cast<uint8_t*>(host.bytes.data()), host.shape,
                       at::TensorOptions().dtype(type));
}

// Checks a host buffer is a well-formed array: known dtype, bytes matching the shape.
Status checkHost(const HostTensor& host, const std::string& what) {
  const size_t size = dtypeSize(host.dtype);
  if (size == 0) return invalid(fmt::format("{}: unknown dtype '{}'", what, host.dtype));
  for (int64_t d : host.shape) {
    if (d < 0) return invalid(fmt::format("{}: negative dimension in [{}]", what, fmt::join(host.shape, ", ")));
  }
  if (host.bytes.size() != static_cast<size_t>(host.numel()) * size) {
    return invalid(fmt::format("{}: {} bytes for {} [{}] (expected {})", what, host.bytes.size(),
                               host.dtype, fmt::join(host.shape, ", "),
                               static_cast<size_t>(host.numel()) * size));
  }
  return Status::ok();
}

// ---- Optimizer rules: the rules of optimizers/ over states the engine owns, so every state
// field is enumerable for checkpoints ----

using optimizers::StateField;

// A collective failed inside the sharded optimizer step (ZeRO): unwinds to step().
struct CollectiveFailure {
  Status status;
};

class UpdateRule {
 public:
  // ZeRO: turns the per-piece partial norms of LAMB and LARS into whole-tensor norms (a sum
  // across the group); unset when every rank holds whole tensors.
  std::function<void(std::vector<optimizers::SquaredNorms>&)> whole_norms;

  virtual ~UpdateRule() = default;
  // One update of `params` from `grads` (called under a NoGradGuard).
  virtual void step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads) = 0;
  virtual std::vector<StateField> fields(size_t param) = 0;
  virtual double lr() const = 0;
};

template <typename State>
std::vector<State*> pointersTo(std::vector<State>& states) {
  std::vector<State*> out;
  for (auto& s : states) out.push_back(&s);
  return out;
}

// Any rule of optimizers/ (fused_optimizer.h): the same code as the LibTorch classes and
// troupe.optim run, over whole parameters or this rank's ZeRO pieces.
template <typename Rule>
class FusedRule final : public UpdateRule {
 public:
  FusedRule(size_t n, typename Rule::Options o, int threads) : states_(n), o_(std::move(o)), threads_(threads) {}
  void step(const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& g) override {
    optimizers::stepRule<Rule>(p, g, pointersTo(states_), o_, threads_, whole_norms);
  }
  std::vector<StateField> fields(size_t i) override { return fieldsOf(states_[i]); }
  double lr() const override { return o_.lr(); }

 private:
  std::vector<typename Rule::State> states_;
  typename Rule::Options o_;
  int threads_;
};

template <typename Rule>
std::unique_ptr<UpdateRule> fusedRule(const typename Rule::Options& options, size_t n, int threads) {
  optimizers::validate(options);
  return std::make_unique<FusedRule<Rule>>(n, options, threads);
}

// Plain SGD as torch.optim.SGD: d = g + wd * p; buf = d (first step) or momentum * buf + d.
class SgdRule final : public UpdateRule {
 public:
  SgdRule(size_t n, double lr, double momentum, double weight_decay)
      : buffers_(n), lr_(lr), momentum_(momentum), weight_decay_(weight_decay) {}
  void step(const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& g) override {
    for (size_t i = 0; i < p.size(); ++i) {
      at::Tensor d = weight_decay_ != 0 ? g[i].add(p[i], weight_decay_) : g[i];
      if (momentum_ != 0) {
        if (!buffers_[i].defined()) {
          buffers_[i] = d.clone();
        } else {
          buffers_[i].mul_(momentum_).add_(d);
        }
        d = buffers_[i];
      }
      p[i].add_(d, -lr_);
    }
  }
  std::vector<StateField> fields(size_t i) override { return {{"momentum_buffer", &buffers_[i]}}; }
  double lr() const override { return lr_; }

 private:
  std::vector<at::Tensor> buffers_;
  double lr_, momentum_, weight_decay_;
};

Result<std::unique_ptr<UpdateRule>> makeRule(const std::string& name, const TrainerEngineOptions& o,
                                             size_t n) {
  try {
    if (name == "adamw") {
      return fusedRule<optimizers::AdamWRule>(optimizers::AdamWOptions(o.lr).weight_decay(o.weight_decay), n,
                                              o.threads);
    }
    if (name == "agd") {
      return fusedRule<optimizers::AgdRule>(optimizers::AgdOptions(o.lr).weight_decay(o.weight_decay), n, o.threads);
    }
    if (name == "lamb") {
      return fusedRule<optimizers::LambRule>(optimizers::LambOptions(o.lr).weight_decay(o.weight_decay), n, o.threads);
    }
    if (name == "lars") {
      return fusedRule<optimizers::LarsRule>(
          optimizers::LarsOptions(o.lr).weight_decay(o.weight_decay).momentum(o.momentum), n, o.threads);
    }
    if (name == "sgd") {
      if (!(o.lr >= 0) || !(o.momentum >= 0) || !(o.weight_decay >= 0)) {
        return invalid(fmt::format("sgd: lr, momentum and weight_decay must be >= 0, got {}, {}, {}",
                                   o.lr, o.momentum, o.weight_decay));
      }
      return std::unique_ptr<UpdateRule>(std::make_unique<SgdRule>(n, o.lr, o.momentum, o.weight_decay));
    }
  } catch (const c10::Error& e) {
    return invalid(fmt::format("optimizer {}: {}", name, e.what_without_backtrace()));
  }
  return invalid(fmt::format("unknown optimizer '{}': use adamw, agd, lamb, lars, sgd or wsam", name));
}

// Calls back when a parameter's gradient has been accumulated (a post hook on its
// AccumulateGrad node, which runs on the thread running backward).
class GradReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(TrainerEngine::Impl* engine, size_t param) : engine_(engine), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override;

 private:
  TrainerEngine::Impl* engine_;
  size_t param_;
};

}  // namespace

class TrainerEngine::Impl {
 public:
  struct Bucket {
    at::Tensor flat;             // float32; the gradients of `params` are views into it
    std::vector<size_t> params;
    int64_t numel = 0;
    size_t pending = 0;          // gradients of the current pass not yet final
    std::shared_ptr<collectives::Work> work;
    uint64_t bytes = 0;
    int64_t launched_us = 0;  // timeline
    // ZeRO: the parameters of `params` are views into param_flat; this rank owns `shard` of the
    // bucket and its reduced gradient is shard_grad (ZeRO-1: a view into flat; ZeRO-2: a copy
    // taken when the reduction is done, after which flat is freed).
    at::Tensor param_flat;
    collectives::Shard shard;
    at::Tensor shard_grad;
    bool harvested = false;
  };

  // ZeRO: one piece of this rank's shard: elements [lo, hi) of parameter `param` (flattened).
  struct Piece {
    size_t param = 0;
    int64_t lo = 0;
    int64_t hi = 0;
  };

  // What one forward/backward pass over this rank's rows produced.
  struct Pass {
    double loss_sum = 0;  // sum of per-sample losses over the global batch
    double comm_s = 0;
    uint64_t bytes = 0;
    uint64_t bytes_in_backward = 0;
    int64_t micro_batches = 0;
  };

  explicit Impl(const TrainerEngineOptions& o) : options(o), generator(at::detail::createCPUGenerator(o.seed)) {}

  ~Impl() {
    for (size_t i = 0; i < accumulators.size(); ++i) accumulators[i]->del_post_hook(hook_keys[i]);
  }

  Status init() {
    const auto& o = options;
    if (o.global_batch < 1 || o.max_micro_batch < 1 || o.threads < 1 || o.bucket_bytes < 1) {
      return invalid(fmt::format("global_batch, max_micro_batch, threads and bucket_bytes must be >= 1; "
                                 "got {}, {}, {}, {}",
                                 o.global_batch, o.max_micro_batch, o.threads, o.bucket_bytes));
    }
    if (o.zero < 0 || o.zero > 2) {
      return invalid(fmt::format("zero must be 0 (data parallel), 1 or 2, got {}", o.zero));
    }
    if (o.sequence_parallel < 1 || (o.sequence_parallel > 1 && o.model != "tinylm")) {
      return invalid(fmt::format("sequence_parallel must be >= 1, and above 1 only with the built-in tinylm; got {} "
                                 "with model {}",
                                 o.sequence_parallel, o.model));
    }
    if (o.loss != "cross_entropy" && o.loss != "mse") {
      return invalid(fmt::format("unknown loss '{}': use cross_entropy or mse", o.loss));
    }
    setThreads();
    auto m = train::makeModel(o, generator);
    if (!m) return m.status();
    model = std::move(m).value();
    // A parameter shared by two modules is listed under both names: train it once.
    std::set<const void*> seen;
    for (auto& [name, p] : model->parameters()) {
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
      names.push_back(name);
      params.push_back(p);
    }
    if (params.empty()) return invalid(fmt::format("model {} has no trainable parameters", o.model));
    buffers = model->buffers();
    wsam = o.optimizer == "wsam";
    if (wsam) {
      if (o.wsam_base == "wsam") return invalid("wsam_base must be another optimizer than wsam");
      try {
        optimizers::WsamOptions w(o.wsam_rho);
        w.gamma(o.wsam_gamma);
        optimizers::validate(w);
      } catch (const c10::Error& e) {
        return invalid(fmt::format("optimizer wsam: {}", e.what_without_backtrace()));
      }
      for (const auto& p : params) wsam_saved.push_back(at::empty_like(p));
    }
    buildBuckets();
    return layout();
  }

  bool sharded() const { return options.zero > 0; }

  // The optimizer over this rank's part: whole parameters (data parallel), or the pieces of
  // this rank's shard of every bucket (ZeRO). A new layout starts with fresh optimizer state.
  Status layout() {
    size_t n = params.size();
    if (sharded()) {
      pieces.clear();
      piece_params.clear();
      piece_grads.clear();
      for (size_t b = 0; b < buckets.size(); ++b) {
        Bucket& bucket = buckets[b];
        bucket.shard = collectives::shardOf(static_cast<size_t>(bucket.numel), world, rank);
        const auto begin = static_cast<int64_t>(bucket.shard.begin);
        const auto end = static_cast<int64_t>(bucket.shard.end);
        if (options.zero == 1) {
          bucket.shard_grad = bucket.flat.narrow(0, begin, end - begin);
        } else {
          bucket.shard_grad = at::zeros({end - begin}, at::kFloat);
        }
        for (size_t k : bucket.params) {
          const int64_t first = offset_of[k];
          const int64_t lo = std::max(first, begin);
          const int64_t hi = std::min(first + params[k].numel(), end);
          if (lo >= hi) continue;
          pieces.push_back(Piece{k, lo - first, hi - first});
          piece_params.push_back(bucket.param_flat.narrow(0, lo, hi - lo));
          piece_grads.push_back(bucket.shard_grad.narrow(0, lo - begin, hi - lo));
        }
      }
      n = pieces.size();
    }
    if (wsam) wsam_states.assign(n, optimizers::WsamParamState());
    auto r = makeRule(wsam ? options.wsam_base : options.optimizer, options, n);
    if (!r) return r.status();
    rule = std::move(r).value();
    if (sharded()) rule->whole_norms = [this](std::vector<optimizers::SquaredNorms>& norms) { wholeNorms(norms); };
    return Status::ok();
  }

  // The optimizer's tensors: whole parameters, or this rank's pieces.
  const std::vector<at::Tensor>& updateParams() const { return sharded() ? piece_params : params; }
  const std::vector<at::Tensor>& updateGrads() const { return sharded() ? piece_grads : grads; }

  // Whole-tensor squared norms from the pieces' partial ones: summed per parameter, then
  // across the group.
  void wholeNorms(std::vector<optimizers::SquaredNorms>& norms) {
    std::vector<double> sums(2 * params.size(), 0.0);
    for (size_t i = 0; i < pieces.size(); ++i) {
      sums[2 * pieces[i].param] += norms[i].param;
      sums[2 * pieces[i].param + 1] += norms[i].update;
    }
    if (distributed()) {
      Status s = comm->allreduce(sums.data(), sums.size(), collectives::DataType::kFloat64,
                                 collectives::ReduceOp::kSum);
      if (!s.isOk()) throw CollectiveFailure{s};
    }
    for (size_t i = 0; i < pieces.size(); ++i) {
      norms[i].param = sums[2 * pieces[i].param];
      norms[i].update = sums[2 * pieces[i].param + 1];
    }
  }

  // ZeRO: every rank's updated shard of the parameters to every rank.
  Status gatherParams(uint64_t& bytes) {
    if (!distributed()) return Status::ok();
    const int64_t start_us = wallUs();
    setActivity("allgather wait");
    std::vector<std::shared_ptr<collectives::Work>> works;
    for (auto& b : buckets) {
      float* flat = b.param_flat.data_ptr<float>();
      works.push_back(comm->allgatherAsync(flat + b.shard.begin, flat, static_cast<size_t>(b.numel),
                                           collectives::DataType::kFloat32));
      bytes += b.bytes;
    }
    Status first;
    for (auto& w : works) {
      Status st = w->wait();
      if (!st.isOk() && first.isOk()) first = st;
    }
    span("allgather", start_us);
    return first;
  }

  // ZeRO-2 keeps no whole gradient between passes: parameters accumulate theirs in .grad
  // (as autograd makes them) and each final gradient is moved into its bucket, made when the
  // bucket's first gradient arrives and freed once the bucket is reduced.
  bool freesGradients() const { return options.zero == 2; }

  Bucket& bucketBuffer(size_t index) {
    Bucket& b = buckets[index];
    if (!b.flat.defined()) b.flat = at::zeros({b.numel}, at::kFloat);
    return b;
  }

  // ZeRO-2: parameter k's final gradient into its bucket; .grad is freed.
  void stage(size_t k) {
    at::Tensor& grad = params[k].mutable_grad();
    if (!grad.defined()) return;
    bucketBuffer(bucket_of[k]).flat.narrow(0, offset_of[k], params[k].numel()).copy_(grad.reshape({-1}));
    grad = at::Tensor();
  }

  // ZeRO: the shard's reduced gradient, once bucket `index`'s reduction is done; ZeRO-2 copies
  // it out and frees the bucket.
  void harvest(size_t index) {
    Bucket& b = buckets[index];
    if (b.harvested) return;
    b.harvested = true;
    if (!freesGradients()) return;
    bucketBuffer(index);  // a bucket no gradient reached holds zeros
    b.shard_grad.copy_(b.flat.narrow(0, static_cast<int64_t>(b.shard.begin), static_cast<int64_t>(b.shard.size())));
    b.flat = at::Tensor();
  }

  // Buckets in reverse parameter order (roughly the order backward finishes gradients), each up
  // to bucket_bytes; every gradient becomes a view into its bucket, allocated once (ZeRO-2
  // instead makes a bucket per pass: bucketBuffer).
  void buildBuckets() {
    bucket_of.assign(params.size(), 0);
    offset_of.assign(params.size(), 0);
    std::vector<std::vector<size_t>> groups;
    uint64_t current = 0;
    for (size_t k = params.size(); k-- > 0;) {
      const uint64_t bytes = static_cast<uint64_t>(params[k].numel()) * 4;
      if (groups.empty() || (current > 0 && current + bytes > options.bucket_bytes)) {
        groups.emplace_back();
        current = 0;
      }
      groups.back().push_back(k);
      current += bytes;
    }
    grads.resize(params.size());
    for (auto& members : groups) {
      Bucket bucket;
      int64_t total = 0;
      for (size_t k : members) total += params[k].numel();
      bucket.numel = total;
      // ZeRO-2 makes a bucket's gradient buffer only while a pass needs it (bucketBuffer).
      if (!freesGradients()) bucket.flat = at::zeros({total}, at::kFloat);
      bucket.bytes = static_cast<uint64_t>(total) * 4;
      // ZeRO all-gathers each bucket's parameters in one operation: they move into one buffer.
      if (sharded()) bucket.param_flat = at::empty({total}, at::kFloat);
      int64_t offset = 0;
      for (size_t k : members) {
        if (!freesGradients()) {
          grads[k] = bucket.flat.narrow(0, offset, params[k].numel()).view(params[k].sizes());
          params[k].mutable_grad() = grads[k];
        }
        if (sharded()) {
          at::Tensor place = bucket.param_flat.narrow(0, offset, params[k].numel()).view(params[k].sizes());
          place.copy_(params[k].detach());
          params[k].set_data(place);
        }
        offset_of[k] = offset;
        offset += params[k].numel();
        bucket_of[k] = buckets.size();
      }
      bucket.params = members;
      buckets.push_back(std::move(bucket));
    }
    for (size_t k = 0; k < params.size(); ++k) {
      auto accumulator = torch::autograd::impl::grad_accumulator(params[k]);
      hook_keys.push_back(accumulator->add_post_hook(std::make_unique<GradReadyHook>(this, k)));
      accumulators.push_back(std::move(accumulator));
    }
  }

  void setThreads() {
    if (at::get_num_threads() != options.threads) at::set_num_threads(options.threads);
  }

  bool distributed() const { return comm != nullptr && world > 1; }
  // With sequence parallelism, the data-parallel group of this rank and their number.
  int dpRank() const { return rank / seq_ranks; }
  int dpWorld() const { return world / seq_ranks; }

  // A gradient is final (last micro-batch of the pass): launch every bucket that is complete,
  // in bucket order, so all ranks issue the same all-reduces in the same order.
  void gradReady(size_t param) {
    if (!collecting) return;
    if (freesGradients()) stage(param);
    Bucket& bucket = buckets[bucket_of[param]];
    if (bucket.pending > 0) --bucket.pending;
    while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) launch(next_bucket++);
    if (freesGradients()) {
      for (size_t i = 0; i < next_bucket; ++i) {
        if (!buckets[i].harvested && buckets[i].work && buckets[i].work->done() && buckets[i].work->wait().isOk()) {
          harvest(i);
        }
      }
    }
  }

  void launch(size_t index) {
    Bucket& b = bucketBuffer(index);
    b.launched_us = wallUs();
    if (sharded()) {
      float* flat = b.flat.data_ptr<float>();
      b.work = comm->reduceScatterAsync(flat, flat + b.shard.begin, static_cast<size_t>(b.numel),
                                        collectives::DataType::kFloat32, collectives::ReduceOp::kSum);
      return;
    }
    b.work = comm->allreduceAsync(b.flat.data_ptr(), b.flat.data_ptr(), static_cast<size_t>(b.flat.numel()),
                                  collectives::DataType::kFloat32, collectives::ReduceOp::kSum);
  }

  // Waits for every launched all-reduce; the first error wins. Each one's span runs from its
  // launch to its finish (as the communicator saw it, else when the wait returned).
  Status waitLaunched() {
    Status first;
    for (size_t i = 0; i < buckets.size(); ++i) {
      auto& b = buckets[i];
      if (!b.work) continue;
      if (!b.work->done()) setActivity("allreduce wait", static_cast<int32_t>(i), b.bytes);
      Status s = b.work->wait();
      span(sharded() ? "reduce-scatter" : "allreduce", b.launched_us, static_cast<int32_t>(i), b.bytes,
           b.work->finishedAtUs());
      if (!s.isOk() && first.isOk()) first = s;
    }
    return first;
  }

  Status checkBatch(const Batch& batch, int64_t expected_rows) const {
    TROUPE_RETURN_IF_ERROR(checkHost(batch.inputs, "batch inputs"));
    TROUPE_RETURN_IF_ERROR(checkHost(batch.targets, "batch targets"));
    const int64_t rows = batch.rows();
    if (expected_rows >= 0 && rows != expected_rows) {
      return invalid(fmt::format("batch has {} rows but rank {} of world {} computes {} of the global "
                                 "batch of {}",
                                 rows, rank, world, expected_rows, options.global_batch));
    }
    if (batch.targets.shape.empty() || batch.targets.shape[0] != rows) {
      return invalid(fmt::format("batch targets [{}] do not have one row per input row ({})",
                                 fmt::join(batch.targets.shape, ", "), rows));
    }
    if (!batch.sample_ids.empty() && static_cast<int64_t>(batch.sample_ids.size()) != rows) {
      return invalid(fmt::format("batch has {} sample ids for {} rows", batch.sample_ids.size(), rows));
    }
    const std::string want = model->inputDtype();
    if (!want.empty() && batch.inputs.dtype != want) {
      return invalid(fmt::format("model {} takes {} inputs, got {}", options.model, want, batch.inputs.dtype));
    }
    const std::string target = options.loss == "cross_entropy" ? "int64" : "float32";
    if (batch.targets.dtype != target) {
      return invalid(fmt::format("loss {} takes {} targets, got {}", options.loss, target, batch.targets.dtype));
    }
    // Ids out of range would throw inside forward or the loss; refuse them before anything runs.
    auto inRange = [](const HostTensor& t, int64_t limit, const char* what) -> Status {
      const auto* v = reinterpret_cast<const int64_t*>(t.bytes.data());
      for (int64_t i = 0; i < t.numel(); ++i) {
        if (v[i] < 0 || v[i] >= limit) {
          return invalid(fmt::format("{} {} at element {} is outside [0, {})", what, v[i], i, limit));
        }
      }
      return Status::ok();
    };
    if (model->vocab() > 0) {
      TROUPE_RETURN_IF_ERROR(inRange(batch.inputs, model->vocab(), "token id"));
      if (options.loss == "cross_entropy") TROUPE_RETURN_IF_ERROR(inRange(batch.targets, model->vocab(), "target"));
    } else if (options.model == "mlp" && options.loss == "cross_entropy") {
      TROUPE_RETURN_IF_ERROR(inRange(batch.targets, options.mlp_sizes.back(), "class label"));
    }
    return Status::ok();
  }

  // The sum over the rows of per-sample losses (each the mean over that sample's positions; rows
  // holding 1/share of each sequence divide by the whole sequence's positions).
  at::Tensor lossSum(const at::Tensor& logits, const at::Tensor& targets, int64_t share = 1) const {
    const int64_t rows = targets.size(0);
    const double positions = static_cast<double>(targets.numel()) / static_cast<double>(rows);
    if (options.loss == "cross_entropy") {
      const int64_t classes = logits.size(-1);
      TORCH_CHECK(logits.numel() == targets.numel() * classes, "cross_entropy: logits ", logits.sizes(),
                  " do not match targets ", targets.sizes(), " (logits need one more, last dimension)");
      return at::cross_entropy_loss(logits.reshape({-1, classes}), targets.reshape({-1}), c10::nullopt,
                                    at::Reduction::Sum) /
             (positions * static_cast<double>(share));
    }
    TORCH_CHECK(logits.sizes() == targets.sizes(), "mse: logits ", logits.sizes(), " and targets ",
                targets.sizes(), " differ");
    return (logits - targets).square().sum() / (positions * static_cast<double>(share));
  }

  // Forward and backward over this rank's rows in micro-batches; on the last micro-batch the
  // buckets are all-reduced as their gradients become final, then the loss. Parameters are not
  // touched.
  Result<Pass> runPass(const at::Tensor& inputs, const at::Tensor& targets) {
    Pass pass;
    for (auto& b : buckets) {
      if (freesGradients()) {
        b.flat = at::Tensor();
        for (size_t k : b.params) params[k].mutable_grad() = at::Tensor();
      } else {
        b.flat.zero_();
      }
      b.pending = b.params.size();
      b.work.reset();
      b.harvested = false;
    }
    next_bucket = 0;
    const int64_t rows = inputs.size(0);
    const int64_t micro = options.max_micro_batch;
    pass.micro_batches = (rows + micro - 1) / micro;
    const double global = static_cast<double>(options.global_batch);
    try {
      for (int64_t m = 0; m < pass.micro_batches; ++m) {
        const int64_t begin = m * micro;
        const int64_t size = std::min(micro, rows - begin);
        collecting = distributed() && m + 1 == pass.micro_batches;
        const int64_t forward_us = wallUs();
        setActivity("forward");
        const at::Tensor sum = lossSum(model->forward(inputs.narrow(0, begin, size)),
                                       targets.narrow(0, begin, size), seq_ranks);
        const int64_t backward_us = wallUs();
        span("forward", forward_us, -1, 0, backward_us);
        setActivity("backward");
        (sum / global).backward();
        span("backward", backward_us);
        pass.loss_sum += sum.item<double>();
      }
    } catch (const train::RingFailure& failure) {
      collecting = false;
      (void)waitLaunched();
      return failure.status;
    } catch (const std::exception& e) {
      collecting = false;
      // Launched all-reduces write into the buckets: wait for them before reporting.
      (void)waitLaunched();
      const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
      return invalid(fmt::format("forward/backward failed: {}",
                                 c10_error ? c10_error->what_without_backtrace() : e.what()));
    }
    collecting = false;
    if (!distributed()) {
      if (freesGradients()) {
        for (size_t k = 0; k < params.size(); ++k) stage(k);
      }
      for (size_t i = 0; i < buckets.size(); ++i) harvest(i);
      return pass;
    }
    for (const auto& b : buckets) {
      if (b.work && b.work->done()) pass.bytes_in_backward += b.bytes;
    }
    // Buckets of parameters that got no gradient this pass (or all of them, for an empty slice).
    while (next_bucket < buckets.size()) launch(next_bucket++);
    double loss = pass.loss_sum;
    const int64_t loss_us = wallUs();
    auto loss_work = comm->allreduceAsync(&loss, &loss, 1, collectives::DataType::kFloat64,
                                          collectives::ReduceOp::kSum);
    const auto wait_start = Clock::now();
    Status status = waitLaunched();
    setActivity("allreduce wait (loss)");
    Status loss_status = loss_work->wait();
    span("allreduce loss", loss_us, -1, sizeof(double), loss_work->finishedAtUs());
    pass.comm_s = secondsSince(wait_start);
    if (status.isOk()) status = loss_status;
    if (!status.isOk()) return status;
    for (size_t i = 0; i < buckets.size(); ++i) harvest(i);
    pass.loss_sum = loss;
    for (const auto& b : buckets) pass.bytes += b.bytes;
    pass.bytes += sizeof(double);
    return pass;
  }

  Result<StepMetrics> step(const Batch& batch) {
    const auto start = Clock::now();
    if (comm) {
      Status health = comm->health();
      if (!health.isOk()) return health;
    }
    if (!torn.empty()) {
      return Status(StatusCode::kFailedPrecondition,
                    fmt::format("a sharded step failed half way ({}): load a state before training on", torn));
    }
    const RankSlice mine = rankSlice(options.global_batch, dpWorld(), dpRank());
    TROUPE_RETURN_IF_ERROR(checkBatch(batch, mine.size()));
    auto input_type = scalarTypeOf(batch.inputs.dtype);
    auto target_type = scalarTypeOf(batch.targets.dtype);
    if (!input_type) return input_type.status();
    if (!target_type) return target_type.status();
    setThreads();
    at::Tensor inputs = viewOf(batch.inputs, *input_type);
    at::Tensor targets = viewOf(batch.targets, *target_type);
    if (seq_ranks > 1) {  // this rank's zigzag share of every sequence
      const int64_t length = inputs.dim() >= 2 ? inputs.size(1) : 0;
      if (length % (2 * seq_ranks) != 0 || targets.dim() < 2 || targets.size(1) != length) {
        return invalid(fmt::format("sequence parallelism over {} ranks needs sequences of a multiple of {} tokens "
                                   "(inputs and targets alike); got inputs [{}]",
                                   seq_ranks, 2 * seq_ranks, fmt::join(batch.inputs.shape, ", ")));
      }
      const at::Tensor positions = train::zigzagPositions(length, seq_ranks, seq_ring.index);
      inputs = inputs.index_select(1, positions);
      targets = targets.index_select(1, positions);
      TROUPE_RETURN_IF_ERROR(model->setSequenceParallel(&seq_ring, positions));
    }

    auto first = runPass(inputs, targets);
    if (!first) return first.status();
    StepMetrics metrics;
    metrics.comm_s = first->comm_s;
    metrics.bytes_allreduced = first->bytes;
    metrics.bytes_reduced_in_backward = first->bytes_in_backward;
    metrics.micro_batches = first->micro_batches;
    const int64_t optimizer_us = wallUs();
    setActivity("optimizer");
    try {
      torch::NoGradGuard no_grad;
      if (wsam) {
        auto second = wsamStep(inputs, targets);
        if (!second) return second.status();
        metrics.comm_s += second->comm_s;
        metrics.bytes_allreduced += second->bytes;
        metrics.bytes_reduced_in_backward += second->bytes_in_backward;
      } else {
        rule->step(updateParams(), updateGrads());
      }
    } catch (const c10::Error& e) {
      return Status(StatusCode::kInternal,
                    fmt::format("optimizer {} step failed: {}", options.optimizer, e.what_without_backtrace()));
    } catch (const CollectiveFailure& failure) {
      torn = failure.status.message();
      return failure.status;
    }
    span("optimizer", optimizer_us);
    if (sharded()) {
      const auto gather_start = Clock::now();
      Status gathered = gatherParams(metrics.bytes_allreduced);
      metrics.comm_s += secondsSince(gather_start);
      if (!gathered.isOk()) {
        torn = gathered.message();
        return gathered;
      }
    }
    ++steps;
    setActivity("idle");
    metrics.step = steps;
    metrics.loss = first->loss_sum / static_cast<double>(options.global_batch);
    metrics.samples = options.global_batch;
    metrics.local_samples = mine.size();
    metrics.buckets = distributed() ? static_cast<int64_t>(buckets.size()) : 0;
    metrics.compute_s = secondsSince(start) - metrics.comm_s;
    return metrics;
  }

  // WSAM with the gradients already averaged over the global batch: e comes from the global
  // gradient (so every rank perturbs identically), and the second pass's gradients are
  // all-reduced too; the GradientReducer of the rule is the bucketed all-reduce itself. The
  // parameters are copied before the perturbation so that a failed second pass restores them
  // bit for bit (w + e - e need not equal w).
  // Under ZeRO each rank perturbs, restores and corrects its pieces; the perturbed parameters
  // are all-gathered for the second pass, and the norm is summed across the group.
  Result<Pass> wsamStep(const at::Tensor& inputs, const at::Tensor& targets) {
    const int t = options.threads;
    auto states = pointersTo(wsam_states);
    const auto& p = updateParams();
    const auto& g = updateGrads();
    for (size_t i = 0; i < params.size(); ++i) wsam_saved[i].copy_(params[i]);
    double squared = optimizers::wsamGradSquaredNorm(p, g, false, t);
    if (sharded() && distributed()) {
      Status s = comm->allreduce(&squared, 1, collectives::DataType::kFloat64, collectives::ReduceOp::kSum);
      if (!s.isOk()) return s;
    }
    const double norm = std::sqrt(squared);
    optimizers::wsamPerturb(p, g, states, false, options.wsam_rho / (norm + 1e-12), t);
    if (sharded()) {
      uint64_t ignored = 0;
      Status gathered = gatherParams(ignored);
      if (!gathered.isOk()) {
        for (size_t i = 0; i < params.size(); ++i) params[i].copy_(wsam_saved[i]);
        return gathered;
      }
    }
    optimizers::wsamSaveGrad(p, g, states, t);
    Result<Pass> second = [&] {
      torch::AutoGradMode enable(true);
      return runPass(inputs, targets);
    }();
    if (!second) {
      for (size_t i = 0; i < params.size(); ++i) params[i].copy_(wsam_saved[i]);
      return second.status();
    }
    const double alpha = options.wsam_gamma / (1 - options.wsam_gamma);
    optimizers::wsamRestore(p, g, states, true, alpha, t);
    rule->step(p, g);
    optimizers::wsamCorrect(p, states, rule->lr() * alpha, t);
    return second;
  }

  Result<double> evaluate(const Batch& batch) {
    TROUPE_RETURN_IF_ERROR(checkBatch(batch, -1));
    if (batch.rows() == 0) return invalid("evaluate: the batch is empty");
    auto input_type = scalarTypeOf(batch.inputs.dtype);
    auto target_type = scalarTypeOf(batch.targets.dtype);
    if (!input_type) return input_type.status();
    if (!target_type) return target_type.status();
    setThreads();
    TROUPE_RETURN_IF_ERROR(model->setSequenceParallel(nullptr, at::Tensor()));  // whole sequences, locally
    try {
      torch::NoGradGuard no_grad;
      const at::Tensor sum = lossSum(model->forward(viewOf(batch.inputs, *input_type)),
                                     viewOf(batch.targets, *target_type));
      return sum.item<double>() / static_cast<double>(batch.rows());
    } catch (const c10::Error& e) {
      return invalid(fmt::format("evaluate failed: {}", e.what_without_backtrace()));
    }
  }

  Status checkReplicas() {
    if (!distributed()) return Status::ok();
    const uint64_t hash = parameterHash();
    int64_t range[2];
    std::memcpy(&range[0], &hash, 8);
    range[1] = range[0];
    auto low = comm->allreduceAsync(&range[0], &range[0], 1, collectives::DataType::kInt64,
                                    collectives::ReduceOp::kMin);
    auto high = comm->allreduceAsync(&range[1], &range[1], 1, collectives::DataType::kInt64,
                                     collectives::ReduceOp::kMax);
    Status s1 = low->wait();
    Status s2 = high->wait();
    TROUPE_RETURN_IF_ERROR(s1);
    TROUPE_RETURN_IF_ERROR(s2);
    if (range[0] != range[1]) {
      return Status(StatusCode::kFailedPrecondition,
                    fmt::format("the ranks of the group hold different parameters (hash of rank {}: {:016x}); "
                                "load the same checkpoint on every rank",
                                rank, hash));
    }
    return Status::ok();
  }

  std::string optimizerName() const {
    return wsam ? "wsam/" + options.wsam_base : options.optimizer;
  }

  std::vector<HostTensor> state() const {
    std::vector<HostTensor> out;
    const std::string optimizer = optimizerName();
    HostTensor meta;
    meta.name = "meta/optimizer";
    meta.dtype = "uint8";
    meta.shape = {static_cast<int64_t>(optimizer.size())};
    meta.bytes.assign(optimizer.begin(), optimizer.end());
    out.push_back(std::move(meta));
    out.push_back(scalarHost("engine/step", steps));
    for (size_t i = 0; i < params.size(); ++i) out.push_back(toHost("param/" + names[i], params[i]));
    for (const auto& [name, b] : buffers) out.push_back(toHost("buffer/" + name, b));
    for (size_t i = 0; i < updateParams().size(); ++i) {
      for (const auto& f : rule->fields(i)) {
        const std::string name = optimEntry(i, f.name);
        if (f.counter != nullptr) {
          out.push_back(scalarHost(name, *f.counter));
        } else if (f.tensor->defined()) {
          out.push_back(toHost(name, *f.tensor));
        }
      }
    }
    out.push_back(toHost("rng/engine", generator.get_state()));
    return out;
  }

  // The state entry of field `field` of update index i (a parameter, or a ZeRO piece).
  std::string optimEntry(size_t i, const std::string& field) const {
    if (!sharded()) return fmt::format("optim/{}/{}", names[i], field);
    const Piece& p = pieces[i];
    return fmt::format("optim/{}/{}@{}:{}", names[p.param], field, p.lo, p.hi);
  }

  // One optimizer entry as loadState reads it: elements [lo, hi) of the flattened parameter.
  struct Part {
    int64_t lo = 0;
    int64_t hi = 0;
    const HostTensor* entry = nullptr;
  };

  Status loadState(const std::vector<HostTensor>& entries) {
    std::map<std::string, const HostTensor*> by_name;
    for (const auto& e : entries) {
      TROUPE_RETURN_IF_ERROR(checkHost(e, "state entry " + e.name));
      auto [it, added] = by_name.emplace(e.name, &e);
      // The states of several ranks repeat what every rank holds (parameters, step, rng).
      if (!added && (it->second->dtype != e.dtype || it->second->shape != e.shape || it->second->bytes != e.bytes)) {
        return invalid(fmt::format("state entry {} appears twice with different contents", e.name));
      }
    }
    auto take = [&](const std::string& name) -> const HostTensor* {
      auto it = by_name.find(name);
      if (it == by_name.end()) return nullptr;
      const HostTensor* e = it->second;
      by_name.erase(it);
      return e;
    };
    auto matches = [](const HostTensor& e, const at::Tensor& like) -> Status {
      if (e.dtype != dtypeName(like.scalar_type()) ||
          e.shape != std::vector<int64_t>(like.sizes().begin(), like.sizes().end())) {
        return invalid(fmt::format("state entry {} is {} [{}] but this engine has {} [{}]", e.name, e.dtype,
                                   fmt::join(e.shape, ", "), dtypeName(like.scalar_type()),
                                   fmt::join(like.sizes(), ", ")));
      }
      return Status::ok();
    };
    auto isScalar = [](const HostTensor& e) {
      return e.dtype == "int64" && e.shape.empty();
    };

    // Check everything first; nothing changes on error.
    const HostTensor* meta = take("meta/optimizer");
    const std::string optimizer = optimizerName();
    if (meta == nullptr || std::string(meta->bytes.begin(), meta->bytes.end()) != optimizer) {
      return invalid(fmt::format("the state is of optimizer '{}' but this engine runs '{}'",
                                 meta ? std::string(meta->bytes.begin(), meta->bytes.end()) : "(none)",
                                 optimizer));
    }
    const HostTensor* step_entry = take("engine/step");
    if (step_entry == nullptr || !isScalar(*step_entry)) return invalid("state entry engine/step is missing or not an int64 scalar");
    std::vector<const HostTensor*> param_entries, buffer_entries;
    std::map<std::string, size_t> index_of;
    for (size_t i = 0; i < params.size(); ++i) {
      const HostTensor* e = take("param/" + names[i]);
      if (e == nullptr) return invalid(fmt::format("state entry param/{} is missing", names[i]));
      TROUPE_RETURN_IF_ERROR(matches(*e, params[i]));
      param_entries.push_back(e);
      index_of[names[i]] = i;
    }
    for (const auto& [name, b] : buffers) {
      const HostTensor* e = take("buffer/" + name);
      if (e == nullptr) return invalid(fmt::format("state entry buffer/{} is missing", name));
      TROUPE_RETURN_IF_ERROR(matches(*e, b));
      buffer_entries.push_back(e);
    }
    // Optimizer entries, whole ("optim/<param>/<field>") or pieces ("...@<lo>:<hi>"), by
    // parameter and field. Which fields are counters: the rule says (the same for every index).
    std::map<std::string, bool> counter_field;
    if (!updateParams().empty()) {
      for (const auto& f : rule->fields(0)) counter_field[f.name] = f.counter != nullptr;
    }
    std::map<std::pair<size_t, std::string>, std::vector<Part>> parts;
    for (auto it = by_name.begin(); it != by_name.end();) {
      const std::string& name = it->first;
      const HostTensor& e = *it->second;
      const size_t slash = name.rfind('/');
      if (name.rfind("optim/", 0) != 0 || slash < 6) {
        ++it;
        continue;
      }
      auto param = index_of.find(name.substr(6, slash - 6));
      std::string field = name.substr(slash + 1);
      const size_t at_sign = field.find('@');
      const std::string range = at_sign == std::string::npos ? "" : field.substr(at_sign + 1);
      field = field.substr(0, at_sign);
      auto kind = counter_field.find(field);
      if (param == index_of.end() || (!counter_field.empty() && kind == counter_field.end())) {
        ++it;  // not this engine's: reported below
        continue;
      }
      if (counter_field.empty()) {  // this rank owns no piece: nothing to take
        it = by_name.erase(it);
        continue;
      }
      const int64_t numel = params[param->second].numel();
      Part part{0, numel, &e};
      if (!range.empty()) {
        long long lo = -1, hi = -1;
        char tail = 0;
        if (std::sscanf(range.c_str(), "%lld:%lld%c", &lo, &hi, &tail) != 2 || lo < 0 || lo >= hi || hi > numel) {
          return invalid(fmt::format("state entry {}: range '{}' is not within [0, {})", name, range, numel));
        }
        part.lo = lo;
        part.hi = hi;
      }
      const bool counter = kind != counter_field.end() && kind->second;
      if (counter) {
        if (!isScalar(e)) return invalid(fmt::format("state entry {} must be an int64 scalar", name));
      } else if (!range.empty()) {
        if (e.dtype != "float32" || e.shape != std::vector<int64_t>{part.hi - part.lo}) {
          return invalid(fmt::format("state entry {} is {} [{}] but its range holds float32 [{}]", name, e.dtype,
                                     fmt::join(e.shape, ", "), part.hi - part.lo));
        }
      } else {
        TROUPE_RETURN_IF_ERROR(matches(e, params[param->second]));
      }
      parts[{param->second, field}].push_back(part);
      it = by_name.erase(it);
    }
    // What each of this engine's optimizer fields takes: the parts overlapping its elements,
    // which must cover them all (or none: a field not created yet).
    std::vector<std::vector<std::vector<Part>>> field_parts(updateParams().size());
    for (size_t i = 0; i < updateParams().size(); ++i) {
      const size_t param = sharded() ? pieces[i].param : i;
      const int64_t lo = sharded() ? pieces[i].lo : 0;
      const int64_t hi = sharded() ? pieces[i].hi : params[i].numel();
      for (const auto& f : rule->fields(i)) {
        std::vector<Part> overlapping;
        auto found = parts.find({param, f.name});
        if (found != parts.end()) {
          for (const auto& part : found->second) {
            if (part.lo < hi && part.hi > lo) overlapping.push_back(part);
          }
        }
        std::sort(overlapping.begin(), overlapping.end(), [](const Part& a, const Part& b) { return a.lo < b.lo; });
        int64_t covered = lo;
        for (const auto& part : overlapping) {
          if (part.lo > covered) break;
          covered = std::max(covered, part.hi);
        }
        if (found != parts.end() && covered < hi) {
          return invalid(fmt::format("the state's entries optim/{}/{} cover elements [{}, {}) of this engine's [{}, {}) "
                                     "only up to {}: give the states of every rank of the group that saved it",
                                     names[param], f.name, lo, hi, lo, hi, covered));
        }
        field_parts[i].push_back(std::move(overlapping));
      }
    }
    const HostTensor* rng = take("rng/engine");
    const at::Tensor rng_now = generator.get_state();
    if (rng == nullptr) return invalid("state entry rng/engine is missing");
    TROUPE_RETURN_IF_ERROR(matches(*rng, rng_now));
    if (!by_name.empty()) {
      return invalid(fmt::format("state entry {} is not part of this engine's state (another model?)",
                                 by_name.begin()->first));
    }

    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(viewOf(*param_entries[i], at::kFloat));
    for (size_t i = 0; i < buffers.size(); ++i) {
      buffers[i].second.copy_(viewOf(*buffer_entries[i], buffers[i].second.scalar_type()));
    }
    for (size_t i = 0; i < updateParams().size(); ++i) {
      auto fields = rule->fields(i);
      const int64_t lo = sharded() ? pieces[i].lo : 0;
      for (size_t k = 0; k < fields.size(); ++k) {
        const std::vector<Part>& from = field_parts[i][k];
        if (fields[k].counter != nullptr) {
          int64_t v = 0;
          if (!from.empty()) std::memcpy(&v, from.front().entry->bytes.data(), 8);
          *fields[k].counter = v;
          continue;
        }
        if (from.empty()) {
          *fields[k].tensor = at::Tensor();
          continue;
        }
        const at::Tensor& like = updateParams()[i];
        at::Tensor value = at::empty(like.sizes(), at::kFloat);
        at::Tensor flat = value.view({-1});
        const int64_t hi = lo + flat.numel();
        for (const auto& part : from) {
          const int64_t a = std::max(lo, part.lo);
          const int64_t b = std::min(hi, part.hi);
          flat.narrow(0, a - lo, b - a).copy_(viewOf(*part.entry, at::kFloat).reshape({-1}).narrow(0, a - part.lo, b - a));
        }
        *fields[k].tensor = value;
      }
    }
    generator.set_state(viewOf(*rng, at::kByte).clone());
    std::memcpy(&steps, step_entry->bytes.data(), 8);
    torn.clear();
    return Status::ok();
  }

  uint64_t optimizerStateBytes() const {
    uint64_t bytes = 0;
    for (size_t i = 0; i < updateParams().size(); ++i) {
      for (const auto& f : rule->fields(i)) {
        if (f.tensor != nullptr && f.tensor->defined()) bytes += f.tensor->numel() * f.tensor->element_size();
      }
    }
    return bytes;
  }

  // FNV-1a over 32-bit words (one multiply per float, not per byte: a 100M-parameter model
  // hashes in about 0.1 s).
  uint64_t parameterHash() const {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (const auto& p : params) {
      const auto* words = static_cast<const uint32_t*>(p.data_ptr());
      const int64_t n = p.numel();
      for (int64_t i = 0; i < n; ++i) {
        h ^= words[i];
        h *= 0x100000001b3ULL;
      }
    }
    return h;
  }

  TrainerEngineOptions options;
  at::Generator generator;
  std::unique_ptr<TrainModel> model;
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> grads;  // views into the buckets
  NamedTensors buffers;
  std::vector<Bucket> buckets;
  std::vector<size_t> bucket_of;
  std::vector<int64_t> offset_of;  // where each parameter's gradient starts in its bucket
  size_t next_bucket = 0;
  bool collecting = false;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  std::vector<uintptr_t> hook_keys;
  std::unique_ptr<UpdateRule> rule;
  bool wsam = false;
  std::vector<optimizers::WsamParamState> wsam_states;
  std::vector<at::Tensor> wsam_saved;
  // ZeRO: this rank's pieces and the optimizer's views of them.
  std::vector<Piece> pieces;
  std::vector<at::Tensor> piece_params;
  std::vector<at::Tensor> piece_grads;
  std::string torn;  // why a sharded step stopped half way; cleared by loadState
  // Sequence parallelism: the ring of this rank's data-parallel group (seq_ranks members once
  // joined; each holds 1/seq_ranks of every sequence it trains on).
  train::Ring seq_ring;
  int seq_ranks = 1;
  std::shared_ptr<collectives::Communicator> comm;
  int rank = 0;
  int world = 1;
  int64_t steps = 0;

  // The timeline's ring (TrainerEngine::timeline): spans of the step in progress are tagged
  // with steps + 1.
  mutable std::mutex timeline_mutex;
  std::vector<TimelineSpan> ring = std::vector<TimelineSpan>(kTimelineSpans);
  size_t ring_next = 0;
  size_t ring_size = 0;

  TimelineSpan now{"idle", 0, 0, 0, -1, 0};  // the current activity

  void setActivity(const char* name, int32_t bucket = -1, uint64_t bytes = 0) {
    std::lock_guard lock(timeline_mutex);
    now = TimelineSpan{name, wallUs(), 0, steps + 1, bucket, bytes};
  }

  void record(const TimelineSpan& span) {
    std::lock_guard lock(timeline_mutex);
    ring[ring_next] = span;
    ring_next = (ring_next + 1) % ring.size();
    ring_size = std::min(ring_size + 1, ring.size());
  }
  void span(const char* name, int64_t start_us, int32_t bucket = -1, uint64_t bytes = 0, int64_t end_us = 0) {
    record(TimelineSpan{name, start_us, (end_us ? end_us : wallUs()) - start_us, steps + 1, bucket, bytes});
  }
};

namespace {
torch::autograd::variable_list GradReadyHook::operator()(const torch::autograd::variable_list& outputs,
                                                         const torch::autograd::variable_list&) {
  engine_->gradReady(param_);
  return outputs;
}
}  // namespace

TrainerEngine::TrainerEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TrainerEngine::~TrainerEngine() = default;

Result<std::unique_ptr<TrainerEngine>> TrainerEngine::create(const TrainerEngineOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  try {
    TROUPE_RETURN_IF_ERROR(impl->init());
  } catch (const c10::Error& e) {
    return invalid(fmt::format("cannot build the trainer engine: {}", e.what_without_backtrace()));
  }
  return std::unique_ptr<TrainerEngine>(new TrainerEngine(std::move(impl)));
}

const TrainerEngineOptions& TrainerEngine::options() const { return impl_->options; }

Status TrainerEngine::setThreads(int threads) {
  if (threads < 1) return Status(StatusCode::kInvalidArgument, fmt::format("threads must be >= 1, got {}", threads));
  impl_->options.threads = threads;
  return Status::ok();
}

Status TrainerEngine::join(std::shared_ptr<collectives::Communicator> comm) {
  if (comm) {
    Status health = comm->health();
    if (!health.isOk()) {
      return Status(StatusCode::kFailedPrecondition,
                    fmt::format("join: the communicator is already unusable: {}", health.message()));
    }
  }
  const int rank = comm ? comm->rank() : 0;
  const int world = comm ? comm->worldSize() : 1;
  const int seq = impl_->options.sequence_parallel;
  if (world > 1 && world % seq != 0) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("join: sequence_parallel {} does not divide the world size {}", seq, world));
  }
  const int seq_ranks = world > 1 ? seq : 1;
  impl_->seq_ranks = seq_ranks;
  impl_->seq_ring.comm = comm.get();
  impl_->seq_ring.ranks.clear();
  for (int i = 0; i < seq_ranks; ++i) impl_->seq_ring.ranks.push_back(rank / seq_ranks * seq_ranks + i);
  impl_->seq_ring.index = rank % seq_ranks;
  const bool reshard = impl_->sharded() && (rank != impl_->rank || world != impl_->world);
  impl_->rank = rank;
  impl_->world = world;
  {
    std::lock_guard lock(impl_->timeline_mutex);  // waitingOn reads it out of turn
    impl_->comm = std::move(comm);
  }
  if (reshard) {
    try {
      return impl_->layout();
    } catch (const c10::Error& e) {
      return Status(StatusCode::kInternal, fmt::format("join: re-sharding failed: {}", e.what_without_backtrace()));
    }
  }
  return Status::ok();
}

int TrainerEngine::rank() const { return impl_->rank; }
int TrainerEngine::worldSize() const { return impl_->world; }
RankSlice TrainerEngine::slice() const {
  return rankSlice(impl_->options.global_batch, impl_->dpWorld(), impl_->dpRank());
}
Result<StepMetrics> TrainerEngine::step(const Batch& batch) { return impl_->step(batch); }
Result<double> TrainerEngine::evaluate(const Batch& batch) { return impl_->evaluate(batch); }
int64_t TrainerEngine::stepCount() const { return impl_->steps; }

std::vector<TimelineSpan> TrainerEngine::timeline() const {
  std::lock_guard lock(impl_->timeline_mutex);
  std::vector<TimelineSpan> out;
  out.reserve(impl_->ring_size);
  size_t first = (impl_->ring_next + impl_->ring.size() - impl_->ring_size) % impl_->ring.size();
  for (size_t i = 0; i < impl_->ring_size; ++i) out.push_back(impl_->ring[(first + i) % impl_->ring.size()]);
  return out;
}

void TrainerEngine::record(const TimelineSpan& span) { impl_->record(span); }

std::string TrainerEngine::waitingOn() const {
  std::shared_ptr<collectives::Communicator> comm;
  {
    std::lock_guard lock(impl_->timeline_mutex);
    comm = impl_->comm;
  }
  return comm ? comm->waitingOn() : "";
}

TimelineSpan TrainerEngine::activity() const {
  std::lock_guard lock(impl_->timeline_mutex);
  return impl_->now;
}

void TrainerEngine::setActivity(const char* name, int32_t bucket, uint64_t bytes) {
  impl_->setActivity(name, bucket, bytes);
}
int64_t TrainerEngine::parameterCount() const {
  int64_t n = 0;
  for (const auto& p : impl_->params) n += p.numel();
  return n;
}
uint64_t TrainerEngine::parameterHash() const { return impl_->parameterHash(); }
Status TrainerEngine::checkReplicas() { return impl_->checkReplicas(); }
std::vector<HostTensor> TrainerEngine::state() const { return impl_->state(); }
uint64_t TrainerEngine::optimizerStateBytes() const { return impl_->optimizerStateBytes(); }
uint64_t TrainerEngine::gradientBytes() const {
  uint64_t bytes = 0;
  for (const auto& b : impl_->buckets) {
    if (b.flat.defined()) bytes += static_cast<uint64_t>(b.flat.numel()) * 4;
    if (impl_->freesGradients()) bytes += static_cast<uint64_t>(b.shard_grad.numel()) * 4;
  }
  for (const auto& p : impl_->params) {
    if (impl_->freesGradients() && p.grad().defined()) bytes += static_cast<uint64_t>(p.grad().numel()) * 4;
  }
  return bytes;
}
std::vector<int> TrainerEngine::shardSources(int oldWorld) const {
  std::vector<int> out;
  for (int r = 0; r < oldWorld; ++r) {
    bool needed = !impl_->sharded();
    for (const auto& b : impl_->buckets) {
      const auto theirs = collectives::shardOf(static_cast<size_t>(b.numel), oldWorld, r);
      needed = needed || (theirs.begin < b.shard.end && b.shard.begin < theirs.end);
    }
    if (needed) out.push_back(r);
  }
  if (out.empty() && oldWorld > 0) out.push_back(0);  // this rank owns no element: the model alone
  return out;
}
Status TrainerEngine::loadState(const std::vector<HostTensor>& state) {
  try {
    return impl_->loadState(state);
  } catch (const c10::Error& e) {
    return invalid(fmt::format("loadState failed: {}", e.what_without_backtrace()));
  }
}

}  // namespace troupe::actors
