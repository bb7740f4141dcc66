// TrainerEngine: the compute half of a trainer of the elastic group. It owns a model (a
// TorchScript file, or the built-in "tinylm" or "mlp"), a loss and an optimizer, and runs one
// synchronous data-parallel step at a time: forward and backward over this rank's slice of the
// global batch in micro-batches, gradients all-reduced in buckets while backward still runs,
// then the optimizer step. No LibTorch in this header: batches and state are plain buffers.
//
// Global batch. The global batch size G is fixed whatever the world size W: rank r computes rows
// rankSlice(G, W, r) of each step (batch.h) in micro-batches of at most max_micro_batch rows,
// accumulating gradients. The loss is the sum of per-sample losses divided by G (a per-sample
// loss is the mean over that sample's positions), so the all-reduced SUM of the ranks' gradients
// is the gradient of the mean over the global batch, however the samples are split.
//
// Determinism. Parameters are initialised from `seed` with the engine's own generator (never the
// global one), identically on every rank. Bitwise equal results need the same options (seed,
// threads, world size, max_micro_batch) and the same data: every kernel runs in a fixed order
// for fixed shapes and thread counts, and the CPU ring's reductions are bit-identical on every
// rank. Across world sizes the result is the same sum in another order, so it matches within
// float rounding; it is bitwise equal where the order cannot differ: with world sizes 1 and 2
// when each rank computes whole micro-batches the single rank also computes (float addition of
// two terms is commutative), e.g. G = 8, max_micro_batch = 4.
//
// ZeRO (options.zero = 1 or 2). Each gradient bucket is reduce-scattered instead of all-reduced:
// rank r owns shardOf(bucket elements, W, r) of every bucket (communicator.h) and keeps the
// optimizer state of that shard only; it updates its shard of the parameters, which are then
// all-gathered, so every rank still holds the whole model. ZeRO-2 also frees each bucket's
// full gradient as soon as its reduction is done, keeping only the shard. Every optimizer works:
// the whole-tensor norms of LAMB, LARS and WSAM are the sums of the shards' partial norms. A
// join() that changes (rank, world) re-shards: the optimizer state is dropped, so load a state
// after it (the trainer always restores after joining). state() then holds the parameters whole
// and the optimizer state of the shard, as ranged entries that loadState() re-assembles at any
// world size (pass it the states of every rank of the old world).
//
// Sequence parallelism (options.sequence_parallel = S > 1, tinylm only). The W ranks form W/S
// data-parallel groups of S consecutive ranks: ranks d*S .. d*S+S-1 compute the same rows,
// rankSlice(G, W/S, d), each the positions of its zigzag share of every sequence (chunks s and
// 2S-1-s of 2S), with attention as a ring over the S ranks (ring attention: forward and backward
// equal full attention within float rounding). Batches still carry whole sequences (T a
// multiple of 2S); the engine takes its positions. Gradients are summed over all W ranks as
// before, which also sums the sequence's shares. evaluate() runs whole sequences locally.
//
// Failures. A communicator error (a peer died or left, the epoch moved on, a timeout) makes
// step() return that error as soon as the communicator reports it; the parameters, optimizer
// state and step count are those from before the step, so the group can restore or retry after
// join()ing a new communicator. The communicator itself is then unusable (recreate it at
// epoch + 1). Under ZeRO a communicator error after the gradients are reduced (a norm reduction
// or the parameters' all-gather) leaves the shard updated but not the whole model: step() then
// refuses to run (kFailedPrecondition) until loadState().
//
// Thread-safety: not thread-safe; one thread at a time calls the engine (the trainer's compute
// thread). LibTorch's intra-op thread count is set to `threads` on each thread that calls step().
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "troupe/actors/batch.h"
#include "troupe/runtime/status.h"

namespace troupe::collectives {
class Communicator;
}

namespace troupe::actors {

// The built-in character-level transformer (pre-LayerNorm GPT blocks, causal attention, learned
// positions, untied output head): inputs int64 [B, T] token ids (T <= context), logits
// float32 [B, T, vocab].
struct TinyLmOptions {
  int64_t vocab = 256;
  int64_t context = 64;
  int64_t d_model = 64;
  int64_t layers = 2;
  int64_t heads = 4;
};

struct TrainerEngineOptions {
  // "tinylm", "mlp", or the path of a TorchScript file (torch.jit.script/trace in Python,
  // torch.jit.save) whose forward(inputs) returns the logits. Parameters must be float32.
  std::string model = "tinylm";
  TinyLmOptions tinylm;
  // The built-in MLP: layer widths from inputs to outputs, ReLU between layers: float32 [B, F]
  // features -> [B, K] (F = front, K = back).
  std::vector<int64_t> mlp_sizes = {16, 64, 4};
  // "cross_entropy" (over the last dimension; int64 class targets of the logits' shape without
  // it) or "mse" (float32 targets of the logits' shape).
  std::string loss = "cross_entropy";
  // "adamw", "agd", "lamb", "lars", "sgd", or "wsam" (around `wsam_base`, one of the others).
  // Defaults of each are those of optimizers/ except lr, weight_decay and momentum below.
  std::string optimizer = "adamw";
  std::string wsam_base = "sgd";
  double lr = 1e-3;
  double weight_decay = 0.0;
  double momentum = 0.0;   // sgd and lars
  double wsam_rho = 0.05;
  double wsam_gamma = 0.9;
  uint64_t seed = 0;
  // LibTorch intra-op threads (at::set_num_threads) and the optimizer kernels' threads.
  int threads = 1;
  int64_t global_batch = 32;
  int64_t max_micro_batch = 32;
  // Gradients are all-reduced in buckets of about this many bytes, in reverse parameter order
  // (the order backward produces them); a parameter larger than this is a bucket of its own.
  size_t bucket_bytes = size_t{25} << 20;
  // 0: data parallel (every rank holds the whole optimizer state); 1: ZeRO-1 (optimizer state
  // sharded); 2: ZeRO-2 (gradients sharded too). See the header comment.
  int zero = 0;
  // Ranks per sequence (ring attention); must divide the world size. See the header comment.
  int sequence_parallel = 1;
};

// What one step did. Times are wall-clock seconds on the calling thread.
struct StepMetrics {
  int64_t step = 0;          // steps done after this one
  double loss = 0;           // mean per-sample loss over the global batch (all ranks)
  double compute_s = 0;      // the step's time not spent waiting on collectives
  double comm_s = 0;         // time blocked on all-reduces after backward (not overlapped)
  double wait_s = 0;         // waiting for data: measured and filled in by the caller
  int64_t samples = 0;       // global batch size
  int64_t local_samples = 0; // rows this rank computed
  int64_t micro_batches = 0;
  uint64_t bytes_allreduced = 0;          // gradient and loss bytes this rank all-reduced
  uint64_t bytes_reduced_in_backward = 0; // of which finished before the last backward returned
  int64_t buckets = 0;                    // gradient all-reduces per backward pass
};

// One span of a rank's recent activity (the timeline): forward, backward, an all-reduce of a
// gradient bucket (bucket >= 0) or of the loss, the optimizer, and the caller's data wait and
// snapshot. Times are microseconds of the system clock, so ranks on one host line up.
struct TimelineSpan {
  const char* name = "";  // a string literal
  int64_t start_us = 0;
  int64_t dur_us = 0;
  int64_t step = 0;        // the step it belongs to (1-based, as StepMetrics::step)
  int32_t bucket = -1;
  uint64_t bytes = 0;
};

class TrainerEngine {
 public:
  // Builds the model (initialised from options.seed, or loaded from the TorchScript file), the
  // gradient buckets and the optimizer. kInvalidArgument names a bad option (unknown model,
  // loss or optimizer, sizes < 1, a model whose parameters are not float32), kNotFound a missing
  // TorchScript file.
  static Result<std::unique_ptr<TrainerEngine>> create(const TrainerEngineOptions& options);
  ~TrainerEngine();
  TrainerEngine(const TrainerEngine&) = delete;
  TrainerEngine& operator=(const TrainerEngine&) = delete;

  const TrainerEngineOptions& options() const;
  // LibTorch's intra-op thread count from the next step on (the resource tuner's choice; the
  // optimizer kernels keep theirs). kInvalidArgument below 1.
  Status setThreads(int threads);

  // Joins a group epoch: rank and world size come from `comm` (shared: the trainer may also use
  // it); nullptr or a world of 1 trains alone without all-reduce. Parameters are not exchanged:
  // every rank must hold the same state (same seed, or the same checkpoint loaded).
  // kFailedPrecondition when `comm` is already unusable; kInvalidArgument when
  // sequence_parallel does not divide its world size.
  Status join(std::shared_ptr<collectives::Communicator> comm);
  int rank() const;
  int worldSize() const;
  // The rows of each step this rank computes: rankSlice(global_batch, worldSize(), rank()), or
  // with sequence parallelism S, those of its data-parallel group (see the header comment).
  RankSlice slice() const;

  // One training step on this rank's rows of the step (slice().size() rows; sample_ids may be
  // empty or one per row). Errors: kInvalidArgument (a batch of the wrong rows, dtype or shape,
  // token ids out of range: nothing changed), the communicator's error (nothing changed).
  // A rank whose batch is refused issues no all-reduce, so its peers wait in theirs until the
  // group's epoch moves on (or the communicator's operation timeout): report the error to the
  // group rather than retrying alone.
  Result<StepMetrics> step(const Batch& batch);
  // The mean per-sample loss over `batch` (any number of rows) without changing anything; local,
  // no collectives. kInvalidArgument as step().
  Result<double> evaluate(const Batch& batch);
  int64_t stepCount() const;
  int64_t parameterCount() const;
  // The timeline: the newest spans (a ring of kTimelineSpans, always recording; about a clock
  // read and a copy per span), oldest first. record() adds the caller's own spans. Thread-safe.
  static constexpr size_t kTimelineSpans = 4096;
  std::vector<TimelineSpan> timeline() const;
  void record(const TimelineSpan& span);
  // What the rank is doing now and since when (start_us; dur_us unused): the engine sets it at
  // each phase (forward, backward, an all-reduce it waits for, optimizer, "idle" after a
  // step), the caller for its own (data wait, snapshot). A hung step shows where it hangs.
  TimelineSpan activity() const;
  void setActivity(const char* name, int32_t bucket = -1, uint64_t bytes = 0);
  // The peers the collective in progress waits for (Communicator::waitingOn). Thread-safe.
  std::string waitingOn() const;
  // FNV-1a over every parameter's 32-bit words in order: equal on all ranks while they agree.
  uint64_t parameterHash() const;
  // A collective (every rank calls it): Ok when every rank's parameterHash() is the same, e.g.
  // after each rank loaded its checkpoint. kFailedPrecondition when they differ; the
  // communicator's error when it fails. Ok at once without a group.
  Status checkReplicas();

  // Everything that decides the next steps, as plain buffers: "param/<name>" and
  // "buffer/<name>" (the model), "optim/<param>/<field>" (optimizer state; counters are int64
  // scalars), "rng/engine" (the generator's state), "engine/step" and "meta/optimizer". Loading it
  // into an engine with the same options makes the next steps bitwise equal to the saver's.
  // Under ZeRO the optimizer entries are this rank's pieces, "optim/<param>/<field>@<lo>:<hi>":
  // elements [lo, hi) of the flattened parameter (1-D; counters stay scalars).
  std::vector<HostTensor> state() const;
  // Loads state() output, or the concatenated states of every rank of a ZeRO group of any world
  // size (an entry given more than once must be identical each time). Whole and ranged optimizer
  // entries are cut and joined to this engine's pieces. Checks everything first (every parameter
  // present, names, dtypes, shapes, the optimizer, pieces that cover only part of what this
  // engine needs) and changes nothing on error: kInvalidArgument naming the entry.
  Status loadState(const std::vector<HostTensor>& state);
  // The ranks of a group of `oldWorld` whose states hold optimizer state this rank needs: under
  // ZeRO those whose shards overlap this rank's, else every rank (a state saved by a ZeRO group
  // of that size is spread over all of them). Every rank's state holds the whole model.
  std::vector<int> shardSources(int oldWorld) const;
  // Bytes of optimizer state this rank holds (every defined state tensor; not counters).
  uint64_t optimizerStateBytes() const;
  // Bytes of gradient buffers this rank holds between steps: the whole buckets (data parallel,
  // ZeRO-1) or this rank's shards of them (ZeRO-2).
  uint64_t gradientBytes() const;

  class Impl;  // internal (trainer_engine.cc); public only for its gradient hooks

 private:
  explicit TrainerEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace troupe::actors
