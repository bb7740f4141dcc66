// The "Trainer" actor (rpc::Trainer, see train_actors.h): a TrainerEngine driven from a compute
// thread. Threads: the worker's RPC thread receives calls and hands each to the compute thread,
// which runs them one at a time in arrival order (activity and timeline answer on the RPC
// thread at once); the compute thread reaches other actors (the node's dataloader and
// checkpoint actor) through the RPC thread's executor, and Redis (the communicator's
// rendezvous) through a store it owns.
#include <fmt/format.h>
#include <kj/async.h>
#include <kj/function.h>

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <iterator>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <utility>
#include <unistd.h>

#include "troupe/actors/init_args.h"
#include "troupe/actors/train_actors.h"
#include "troupe/actors/trainer_engine.h"
#include "troupe/checkpoint/checkpoint_dir.h"
#include "troupe/checkpoint/flash_segment.h"
#include "troupe/checkpoint/image.h"
#include "troupe/collectives/communicator.h"
#include "troupe/runtime/client.h"
#include "troupe/runtime/clock.h"
#include "troupe/runtime/cluster_store.h"
#include "troupe/runtime/metrics.h"
#include "troupe/runtime/rpc.h"
#include "troupe/runtime/tls.h"
#include "checkpoint.capnp.h"
#include "trainer.capnp.h"
#include "typed_call.h"

namespace troupe::actors {

void registerDataloaderActor(ActorRegistry& registry);

namespace {

int64_t wallUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

using Json = nlohmann::json;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

TrainerEngineOptions engineOptions(rpc::EngineSpec::Reader e) {
  TrainerEngineOptions o;
  o.model = e.getModel().cStr();
  o.loss = e.getLoss().cStr();
  o.optimizer = e.getOptimizer().cStr();
  o.wsam_base = e.getWsamBase().cStr();
  o.lr = e.getLr();
  o.weight_decay = e.getWeightDecay();
  o.momentum = e.getMomentum();
  o.wsam_rho = e.getWsamRho();
  o.wsam_gamma = e.getWsamGamma();
  o.seed = e.getSeed();
  o.threads = e.getThreads();
  o.global_batch = e.getGlobalBatch();
  o.max_micro_batch = e.getMaxMicroBatch();
  o.tinylm.context = e.getContext();
  o.zero = e.getZero();
  o.sequence_parallel = e.getSequenceParallel();
  o.mlp_sizes.clear();
  for (int64_t width : e.getMlpSizes()) o.mlp_sizes.push_back(width);
  return o;
}

// An empty buffer for a checkpoint image's tensor.
HostTensor hostFor(const checkpoint::TensorSpec& spec) {
  HostTensor t;
  t.name = spec.name;
  t.dtype = spec.dtype;
  t.shape = spec.shape;
  t.bytes.resize(spec.bytes);
  return t;
}

// What the compute thread hands back to the RPC thread, which writes it into the results.
struct Joined {
  int rank = 0;
  int world = 1;
};
struct Restored {
  int64_t step = 0;
  std::string source;
  uint64_t hash = 0;
};
struct StepReport {
  StepMetrics metrics;  // wait_s filled in by the trainer
  double snapshot_s = 0;
  std::vector<uint64_t> sample_ids;
};
struct Trained {
  std::vector<StepReport> steps;
  uint64_t hash = 0;
  std::optional<int64_t> pinned;
};
struct Settings {
  int64_t snapshotEvery = 0;
  int threads = 1;
  int prefetch = 0;
};
struct Hashed {
  uint64_t hash = 0;
  int64_t step = 0;
};

void spanToWire(const TimelineSpan& span, rpc::TimelineSpan::Builder out) {
  out.setName(span.name);
  out.setStartUs(span.start_us);
  out.setDurUs(span.dur_us);
  out.setStep(span.step);
  out.setBucket(span.bucket);
  out.setBytes(span.bytes);
}

class Trainer final : public TypedActor<rpc::Trainer> {
 public:
  static Result<std::unique_ptr<Actor>> create(const ActorContext& context, std::string_view args) {
    TROUPE_ASSIGN_OR_RETURN(auto init, decodeInitArgs<rpc::TrainerArgs>("Trainer", args));
    auto spec = init.get();
    // tests: a member whose first start fails (its restart starts again)
    if (context.incarnation == 1 && spec.getFaultKillAtStart()) ::raise(SIGKILL);
    auto options = engineOptions(spec.getEngine());
    TROUPE_ASSIGN_OR_RETURN(auto engine, TrainerEngine::create(options));
    TROUPE_ASSIGN_OR_RETURN(auto redis, workerRedisOptions());
    TROUPE_ASSIGN_OR_RETURN(auto store, connectRedisStore(redis));
    auto self = std::unique_ptr<Trainer>(new Trainer(context, spec, options));
    self->engine_ = std::move(engine);
    self->store_ = std::move(store);
    return std::unique_ptr<Actor>(std::move(self));
  }

  ~Trainer() noexcept override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (compute_.joinable()) compute_.join();
  }

  // What it is doing (and its recent spans) is answered on the RPC thread, out of turn: a
  // coordinator asks while a `run` hangs.
  bool answersAtOnce(const std::string& method) const override { return method == "activity" || method == "timeline"; }

 private:
  struct JoinArgs {
    int64_t epoch;
    int rank;
    int world;
    std::string dataloader;  // "" keeps the current one
    std::string checkpoint;
  };

  // rpc::Trainer: reads the params on the RPC thread, hands the work to the compute thread
  // (onCompute) and writes what comes back into the results; errors are thrown as Status
  // exceptions. activity and timeline answer on the RPC thread at once. The actor keeps a
  // reference, so the server outlives it; once the actor is gone, calls fail.
  class Server final : public ServerFor<rpc::Trainer, Trainer> {
   public:
    using ServerFor::ServerFor;

   protected:
    kj::Promise<void> join(JoinContext context) override {
      auto p = context.getParams();
      JoinArgs args{p.getEpoch(), static_cast<int>(p.getRank()), static_cast<int>(p.getWorld()),
                    p.getDataloader().cStr(), p.getCheckpoint().cStr()};
      if (args.rank >= args.world) {
        throwStatus(Status(StatusCode::kInvalidArgument,
                           fmt::format("join: rank {} is outside a world of {}", args.rank, args.world)));
      }
      auto& a = actor();
      return a.onCompute<Joined>([&a, args = std::move(args)]() { return a.join(args); })
          .then([context](Joined joined) mutable {
            context.getResults().setRank(static_cast<uint32_t>(joined.rank));
            context.getResults().setWorld(static_cast<uint32_t>(joined.world));
          });
    }
    kj::Promise<void> snapshots(SnapshotsContext context) override {
      auto& a = actor();
      return a.onCompute<std::vector<int64_t>>([&a]() { return a.snapshots(); })
          .then([context](std::vector<int64_t> steps) mutable {
            auto out = context.getResults().initSteps(steps.size());
            for (size_t i = 0; i < steps.size(); ++i) out.set(i, steps[i]);
          });
    }
    kj::Promise<void> restore(RestoreContext context) override {
      auto p = context.getParams();
      int64_t step = p.getStep();
      int fromBundle = p.getFromBundle();
      std::vector<int> fromBundles;
      for (uint32_t b : p.getFromBundles()) fromBundles.push_back(static_cast<int>(b));
      int root = p.getBroadcastFrom();
      bool fromBroadcast = p.getFromBroadcast();
      auto& a = actor();
      return a
          .onCompute<Restored>([&a, step, fromBundle, fromBundles = std::move(fromBundles), root, fromBroadcast]() {
            return a.restoreOrBroadcast(step, fromBundle, fromBundles, root, fromBroadcast);
          })
          .then([context](Restored r) mutable { restoredToWire(r, context.getResults()); });
    }
    kj::Promise<void> run(RunContext context) override {
      auto p = context.getParams();
      int64_t from = p.getFromStep();
      int64_t steps = p.getSteps();
      if (steps < 0) throwStatus(Status(StatusCode::kInvalidArgument, fmt::format("run: {} steps", steps)));
      auto& a = actor();
      return a.onCompute<Trained>([&a, from, steps]() { return a.train(from, steps); })
          .then([context](Trained t) mutable {
            auto r = context.getResults();
            auto rows = r.initMetrics(t.steps.size());
            for (size_t i = 0; i < t.steps.size(); ++i) {
              const StepReport& s = t.steps[i];
              auto row = rows[i];
              row.setStep(s.metrics.step);
              row.setLoss(s.metrics.loss);
              row.setComputeS(s.metrics.compute_s);
              row.setCommS(s.metrics.comm_s);
              row.setWaitS(s.metrics.wait_s);
              row.setSnapshotS(s.snapshot_s);
              row.setSamples(s.metrics.samples);
              row.setBytesAllreduced(s.metrics.bytes_allreduced);
              auto ids = row.initSampleIds(s.sample_ids.size());
              for (size_t k = 0; k < s.sample_ids.size(); ++k) ids.set(k, s.sample_ids[k]);
            }
            r.setHash(t.hash);
            r.setHasPinned(t.pinned.has_value());
            r.setPinned(t.pinned.value_or(0));
          });
    }
    kj::Promise<void> loadDir(LoadDirContext context) override {
      auto p = context.getParams();
      std::string dir = p.getDir().cStr();
      int64_t step = p.getStep();
      if (dir.empty()) throwStatus(Status(StatusCode::kInvalidArgument, "loadDir: no checkpoint directory given"));
      auto& a = actor();
      return a.onCompute<Restored>([&a, dir = std::move(dir), step]() { return a.loadDirectory(dir, step); })
          .then([context](Restored r) mutable { restoredToWire(r, context.getResults()); });
    }
    kj::Promise<void> configure(ConfigureContext context) override {
      auto p = context.getParams();
      int64_t snapshotEvery = p.getSnapshotEvery();
      int threads = p.getThreads();
      int prefetch = p.getPrefetch();
      for (auto [name, value] : {std::pair{"snapshotEvery", snapshotEvery}, std::pair{"threads", int64_t{threads}},
                                 std::pair{"prefetch", int64_t{prefetch}}}) {
        if (value < -1) {
          throwStatus(Status(StatusCode::kInvalidArgument,
                             fmt::format("configure: {} is {} (-1 keeps the current value)", name, value)));
        }
      }
      auto& a = actor();
      return a.onCompute<Settings>([&a, snapshotEvery, threads, prefetch]() {
                return a.configure(snapshotEvery, threads, prefetch);
              })
          .then([context](Settings s) mutable {
            auto r = context.getResults();
            r.setSnapshotEvery(s.snapshotEvery);
            r.setThreads(s.threads);
            r.setPrefetch(s.prefetch);
          });
    }
    kj::Promise<void> pin(PinContext context) override {
      bool snapshotFirst = context.getParams().getSnapshot();
      auto& a = actor();
      return a
          .onCompute<std::optional<int64_t>>([&a, snapshotFirst]() -> Result<std::optional<int64_t>> {
            if (snapshotFirst) TROUPE_RETURN_IF_ERROR(a.snapshotCurrentStep());
            return a.pin();
          })
          .then([context](std::optional<int64_t> pinned) mutable {
            context.getResults().setHasPinned(pinned.has_value());
            context.getResults().setPinned(pinned.value_or(0));
          });
    }
    kj::Promise<void> hash(HashContext context) override {
      auto& a = actor();
      return a.onCompute<Hashed>([&a]() {
                return Result<Hashed>(Hashed{a.engine_->parameterHash(), a.engine_->stepCount()});
              })
          .then([context](Hashed h) mutable {
            context.getResults().setHash(h.hash);
            context.getResults().setStep(h.step);
          });
    }
    // Who answers: the head of the activity and timeline results.
    template <typename Results>
    static void identify(Results r, TrainerEngine& engine) {
      r.setRank(engine.rank());
      r.setWorld(engine.worldSize());
      r.setPid(::getpid());
    }
    // The engine is thread-safe for these two (its timeline mutex); engineMutex_ keeps a restore
    // from the seed from swapping it meanwhile.
    kj::Promise<void> activity(ActivityContext context) override {
      auto& a = actor();
      std::lock_guard lock(a.engineMutex_);
      TrainerEngine& engine = *a.engine_;
      auto r = context.getResults();
      identify(r, engine);
      auto now = engine.activity();
      spanToWire(now, r.initActivity());
      r.setForS(now.start_us ? static_cast<double>(wallUs() - now.start_us) / 1e6 : 0.0);
      r.setWaitingOn(engine.waitingOn());
      return kj::READY_NOW;
    }
    kj::Promise<void> timeline(TimelineContext context) override {
      auto& a = actor();
      std::lock_guard lock(a.engineMutex_);
      TrainerEngine& engine = *a.engine_;
      auto r = context.getResults();
      identify(r, engine);
      auto spans = engine.timeline();
      auto out = r.initSpans(spans.size());
      for (size_t i = 0; i < spans.size(); ++i) spanToWire(spans[i], out[i]);
      return kj::READY_NOW;
    }

   private:
    template <typename Results>
    static void restoredToWire(const Restored& r, Results out) {
      out.setStep(r.step);
      out.setSource(r.source);
      out.setHash(r.hash);
    }
  };

  Trainer(const ActorContext& context, rpc::TrainerArgs::Reader spec, TrainerEngineOptions options)
      : context_(context),
        executor_(kj::getCurrentThreadExecutor().addRef()),
        group_(spec.getGroup().cStr()),
        dataloader_(spec.getDataloader().cStr()),
        checkpoint_(spec.getCheckpoint().cStr()),
        snapshotEvery_(spec.getSnapshotEvery()),
        persistEvery_(spec.getPersistEvery()),
        slotRank_(spec.getBundle()),
        minWorld_(std::max(1, spec.getMinWorkers())),
        killAtStep_(context.incarnation == 1 ? spec.getFaultKillAtStep() : -1),
        slowMs_(spec.getFaultSlowMs()),
        hangAtStep_(context.incarnation == 1 ? spec.getFaultHangAtStep() : -1),
        killInJoin_(context.incarnation == 1 && spec.getFaultKillInJoin()),
        options_(std::move(options)) {
    serve<Server>(*this);
    compute_ = std::thread([this]() { computeLoop(); });
  }

  // Runs `work` (returning Result<T>) on the compute thread after every job queued before it;
  // the value comes back to the RPC thread, an error as a Status exception.
  template <typename T, typename Work>
  kj::Promise<T> onCompute(Work work) {
    auto done = kj::newPromiseAndCrossThreadFulfiller<Result<T>>();
    {
      std::lock_guard lock(mutex_);
      jobs_.push_back([work = std::move(work), fulfiller = kj::mv(done.fulfiller)]() mutable {
        Result<T> r = Status(StatusCode::kInternal, "unreached");
        try {
          r = work();
        } catch (const kj::Exception& e) {
          r = statusFromException(e, "");  // the code that crossed the RPC edge, or UNAVAILABLE/INTERNAL
        } catch (const std::exception& e) {
          r = Status(StatusCode::kInternal, e.what());
        }
        fulfiller->fulfill(kj::mv(r));
      });
    }
    wake_.notify_all();
    return done.promise.then([](Result<T> r) -> T {
      if (!r.isOk()) throwStatus(r.status());
      return std::move(r).value();
    });
  }

  void computeLoop() {
    for (;;) {
      kj::Function<void()> job;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [this]() { return stopping_ || !jobs_.empty(); });
        if (stopping_) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  // Calls actor `id`'s typed interface `Interface` from the compute thread, through the RPC
  // thread: `call` sends its request on the client and returns what it reads from the reply.
  template <typename Interface, typename T, typename Call>
  Result<T> callTyped(const std::string& id, const char* method, Call call) {
    try {
      return executor_->executeSync([this, &id, &call]() {
        // The handle owns the connection the capability lives on: kept until the reply is read.
        ActorHandle handle = context_.cluster->actor(ActorId(id));
        auto typed = handle.typed<Interface>();
        return typed.then([&call](typename Interface::Client c) { return call(c); }).attach(kj::mv(handle));
      });
    } catch (const kj::Exception& e) {
      return statusFromException(e, fmt::format("{} of actor {}", method, id));  // its code: ACTOR_DIED, ...
    }
  }
  // The node's checkpoint actor (rpc::Checkpoint).
  template <typename T, typename Call>
  Result<T> callCheckpoint(const char* method, Call call) {
    return callTyped<rpc::Checkpoint, T>(checkpoint_, method, std::move(call));
  }

  Result<Restored> restoreOrBroadcast(int64_t step, int fromBundle, const std::vector<int>& fromBundles, int root,
                                      bool fromBroadcast) {
    // A member that joined a grow on a host with no other member gets its state by a broadcast
    // from a live rank over the new communicator; every rank takes part.
    if (!fromBroadcast) {
      auto restored = restore(step, fromBundle, fromBundles);
      if (root < 0 || !restored.isOk()) return restored;
    }
    TROUPE_RETURN_IF_ERROR(broadcastState(root));
    return Restored{engine_->stepCount(), fmt::format("broadcast from rank {}", root), engine_->parameterHash()};
  }

  // -1 keeps a setting (the server refused values below it).
  Result<Settings> configure(int64_t snapshotEvery, int threads, int prefetch) {
    if (threads != -1) TROUPE_RETURN_IF_ERROR(engine_->setThreads(threads));
    if (snapshotEvery != -1) snapshotEvery_ = snapshotEvery;
    if (prefetch != -1) prefetch_ = prefetch;
    return Settings{snapshotEvery_, engine_->options().threads, prefetch_};
  }

  Result<Joined> join(const JoinArgs& j) {
    if (killInJoin_) ::raise(SIGKILL);  // a member lost while the group joins a new epoch
    collectives::CommunicatorOptions o;
    o.group = group_;
    o.host = context_.nodeIp;  // peers on other hosts connect to it
    if (tls::required()) {
      const char* token = std::getenv("TROUPE_TOKEN");
      o.tlsToken = token ? token : "";
    }
    o.epoch = j.epoch;
    o.rank = j.rank;
    o.worldSize = j.world;
    o.rendezvousTimeout = std::chrono::milliseconds(30'000);
    comm_.reset();
    dropTakes();  // batches asked for as another rank or world are not ours any more
    // A restarted trainer may be on another node now: the driver names that node's services.
    if (!j.dataloader.empty()) dataloader_ = j.dataloader;
    if (!j.checkpoint.empty() && j.checkpoint != checkpoint_) {
      checkpoint_ = j.checkpoint;
      ownSegment_ = {};
      segment_.reset();
      layout_.reset();
    }
    std::shared_ptr<collectives::Communicator> comm;
    if (o.worldSize > 1) {
      TROUPE_ASSIGN_OR_RETURN(auto c, collectives::connectCpuCommunicator(*store_, o));
      comm = std::move(c);
    }
    TROUPE_RETURN_IF_ERROR(engine_->join(comm));
    comm_ = comm;
    rank_ = o.rank;
    world_ = o.worldSize;
    return Joined{rank_, world_};
  }

  // The segment a bundle's trainer on this node snapshots to (owned by the node's checkpoint
  // actor); this trainer's own is asked for once.
  Result<checkpoint::SegmentOptions> segmentOptions(int bundle) {
    bool own = bundle == slotRank_;
    if (!own || ownSegment_.name.empty()) {
      auto reply = callCheckpoint<checkpoint::SegmentOptions>("attach", [bundle](rpc::Checkpoint::Client& c) {
        auto request = c.attachRequest();
        request.setRank(static_cast<uint32_t>(bundle));
        return request.send().then([](capnp::Response<rpc::Checkpoint::AttachResults> r) {
          checkpoint::SegmentOptions o;
          o.name = r.getSegment();
          o.dir = r.getShmDir();
          return o;
        });
      });
      if (!reply.isOk()) return reply.status();
      checkpoint::SegmentOptions o = *reply;
      if (!own) return o;
      ownSegment_ = o;
    }
    return ownSegment_;
  }
  Result<checkpoint::SegmentOptions> segmentOptions() { return segmentOptions(slotRank_); }

  // The segment to read `bundle`'s snapshots from: this trainer's open writer, else the
  // existing segment mapped read-only into `holder` (nullptr when there is none).
  const checkpoint::FlashSegment* readableSegment(const checkpoint::SegmentOptions& o, int bundle,
                                                  std::optional<checkpoint::FlashSegment>& holder) {
    if (segment_ && bundle == slotRank_) return &*segment_;
    auto opened = checkpoint::FlashSegment::openExisting(o);
    if (!opened.isOk()) return nullptr;
    holder.emplace(std::move(*opened));
    return &*holder;
  }

  Result<std::vector<int64_t>> snapshots() {
    std::vector<int64_t> steps = {0};  // the initial state is re-made from the seed
    TROUPE_ASSIGN_OR_RETURN(auto o, segmentOptions());
    std::optional<checkpoint::FlashSegment> existing;
    if (const auto* s = readableSegment(o, slotRank_, existing)) {
      for (const auto& slot : s->slots()) {
        if (slot.complete()) steps.push_back(static_cast<int64_t>(slot.step));
      }
    }
    return steps;
  }

  Status stageFromCheckpointActor(int64_t step, int bundle) {
    auto deadline = Clock::now() + std::chrono::seconds(60);
    for (auto pause = std::chrono::milliseconds(2); Clock::now() < deadline; pause = std::min(pause * 2, std::chrono::milliseconds(50))) {
      struct Staged {
        rpc::JobState state;
        std::string skipped;
      };
      auto reply = callCheckpoint<Staged>("restore", [bundle, step](rpc::Checkpoint::Client& c) {
        auto request = c.restoreRequest();
        request.setRank(static_cast<uint32_t>(bundle));
        request.setMaxStep(static_cast<uint64_t>(step));
        return request.send().then([](capnp::Response<rpc::Checkpoint::RestoreResults> r) {
          std::string skipped;
          for (auto why : r.getSkipped()) skipped += (skipped.empty() ? "" : "; ") + std::string(why.cStr());
          return Staged{r.getState(), skipped};
        });
      });
      if (!reply.isOk()) return reply.status();
      if (reply->state == rpc::JobState::DONE) return Status::ok();
      if (reply->state != rpc::JobState::RUNNING) {
        return Status(StatusCode::kNotFound, fmt::format("the checkpoint actor has no step {} for bundle {} (skipped: {})",
                                                         step, bundle, reply->skipped.empty() ? "none" : reply->skipped));
      }
      std::this_thread::sleep_for(pause);  // staging runs on the actor's own threads; ask again
    }
    return Status(StatusCode::kDeadlineExceeded, fmt::format("staging step {} for bundle {} took over 60 s", step, bundle));
  }

  // The tensors of `bundle`'s complete snapshot of `step`: from this node's memory, else staged
  // by the node's checkpoint actor over the network from a peer's memory or replica, or from
  // disk (the trainer moved here with its node lost, or joined a grow on a host where no member
  // runs). `source` says which.
  Result<std::vector<HostTensor>> readSnapshot(int64_t step, int bundle, std::string& source) {
    TROUPE_ASSIGN_OR_RETURN(auto o, segmentOptions(bundle));
    std::optional<checkpoint::FlashSegment> existing;
    const checkpoint::FlashSegment* seg = readableSegment(o, bundle, existing);
    auto slot = seg ? seg->completeAt(static_cast<uint64_t>(step)) : std::nullopt;
    source = "memory";
    if (!slot) {
      if (bundle == slotRank_) {  // the checkpoint actor stages into this trainer's own segment
        segment_.reset();
        layout_.reset();
      }
      TROUPE_RETURN_IF_ERROR(stageFromCheckpointActor(step, bundle));
      source = "staged by the checkpoint actor";
      seg = readableSegment(o, bundle, existing);
      slot = seg ? seg->completeAt(static_cast<uint64_t>(step)) : std::nullopt;
    }
    if (!slot) return Status(StatusCode::kNotFound, fmt::format("no complete snapshot of step {} for bundle {}", step, bundle));
    // The snapshot's own table says what it holds (a fresh engine has no optimizer state yet).
    TROUPE_ASSIGN_OR_RETURN(auto header, seg->verify(*slot));
    std::vector<HostTensor> state;
    for (const auto& spec : header.layout.tensors()) state.push_back(hostFor(spec));
    std::vector<checkpoint::MutableBuffer> targets;
    for (auto& t : state) targets.push_back({t.bytes.data(), t.bytes.size()});
    TROUPE_ASSIGN_OR_RETURN(auto restored, seg->restoreInto(*slot, targets));
    return state;
  }

  // Restores `step`: from the seed (0), this bundle's snapshot, `fromBundle`'s (a new member
  // copying one on its node), or, under ZeRO after the world changed, the snapshots of the old
  // world's bundles `fromBundles` (in old rank order) whose shards overlap this rank's new one.
  // A re-sharded state is snapshotted in the new layout at the next pin (called once every rank
  // has restored: before, a peer may still be reading this bundle's old snapshot of `step`), so
  // that this bundle's snapshot of `step` holds the pieces its rank now owns.
  Result<Restored> restore(int64_t step, int fromBundle, const std::vector<int>& fromBundles) {
    std::string source;
    if (step == 0) {
      TROUPE_ASSIGN_OR_RETURN(auto fresh, TrainerEngine::create(options_));
      auto comm = comm_;
      std::unique_ptr<TrainerEngine> old;  // destroyed outside the lock
      {
        std::lock_guard lock(engineMutex_);
        old = std::exchange(engine_, std::move(fresh));
      }
      TROUPE_RETURN_IF_ERROR(engine_->join(comm));
      source = "seed";
    } else if (!fromBundles.empty()) {
      std::vector<HostTensor> state;
      std::vector<int> read;
      for (int r : engine_->shardSources(static_cast<int>(fromBundles.size()))) {
        std::string from;
        TROUPE_ASSIGN_OR_RETURN(auto part, readSnapshot(step, fromBundles[static_cast<size_t>(r)], from));
        std::move(part.begin(), part.end(), std::back_inserter(state));
        read.push_back(fromBundles[static_cast<size_t>(r)]);
      }
      TROUPE_RETURN_IF_ERROR(engine_->loadState(state));
      layout_.reset();
      resnapshot_ = true;
      source = fmt::format("re-sharded from the snapshots of bundle(s) {}", fmt::join(read, ", "));
    } else {
      const int bundle = fromBundle >= 0 ? fromBundle : slotRank_;
      TROUPE_ASSIGN_OR_RETURN(auto state, readSnapshot(step, bundle, source));
      TROUPE_RETURN_IF_ERROR(engine_->loadState(state));
      if (fromBundle >= 0) source = fmt::format("snapshot of bundle {} ({})", fromBundle, source);
    }
    return Restored{engine_->stepCount(), source, engine_->parameterHash()};
  }

  // Loads step `step` (at most; the newest complete one at or below it) of the persisted
  // checkpoint in `dir`, written by a group of any world size: rank 0's file, and under ZeRO
  // (ranged optimizer entries) every rank's, of which the engine takes what its pieces need.
  // The state is snapshotted in this group's layout at the next pin.
  Result<Restored> loadDirectory(const std::string& dir, int64_t step) {
    checkpoint::DirectoryOptions o;
    o.path = dir;
    checkpoint::CheckpointDirectory directory(o);
    std::vector<HostTensor> state;
    auto readRank = [&](uint32_t rank, uint64_t maxStep) -> Result<checkpoint::LoadedRank> {
      std::vector<HostTensor> tensors;
      auto loaded = checkpoint::loadRank(
          directory, rank,
          [&](size_t index, const checkpoint::TensorSpec& spec) -> Result<void*> {
            if (index == 0) tensors.clear();  // a newer candidate failed its checks: start again
            tensors.push_back(hostFor(spec));
            return static_cast<void*>(tensors.back().bytes.data());
          },
          maxStep);
      if (loaded.isOk()) std::move(tensors.begin(), tensors.end(), std::back_inserter(state));
      return loaded;
    };
    TROUPE_ASSIGN_OR_RETURN(auto first, readRank(0, step > 0 ? static_cast<uint64_t>(step) : UINT64_MAX));
    const bool sharded = std::any_of(state.begin(), state.end(),
                                     [](const HostTensor& t) { return t.name.find('@') != std::string::npos; });
    for (uint32_t r = 1; sharded && r < first.header.stamp.worldSize; ++r) {
      TROUPE_ASSIGN_OR_RETURN(auto other, readRank(r, first.step));
      if (other.step != first.step) {
        return Status(StatusCode::kFailedPrecondition,
                      fmt::format("{}: rank {} of step {} fails its checks (its newest usable step is {})", dir, r,
                                  first.step, other.step));
      }
    }
    TROUPE_RETURN_IF_ERROR(engine_->loadState(state));
    layout_.reset();
    resnapshot_ = true;
    return Restored{engine_->stepCount(), fmt::format("{} step {}", dir, first.step), engine_->parameterHash()};
  }

  // The engine's whole state as one blob: a JSON table (name, dtype, shape, bytes per tensor),
  // its length first, then the tensors' bytes in order.
  static std::string packState(const std::vector<HostTensor>& state) {
    Json table = Json::array();
    for (const auto& t : state) table.push_back({{"name", t.name}, {"dtype", t.dtype}, {"shape", t.shape}, {"bytes", t.bytes.size()}});
    std::string head = table.dump();
    uint64_t headBytes = head.size();
    std::string blob(reinterpret_cast<const char*>(&headBytes), sizeof(headBytes));
    blob += head;
    for (const auto& t : state) blob.append(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
    return blob;
  }

  // Every size in the blob is checked against the blob before it is used.
  static Result<std::vector<HostTensor>> unpackState(std::string_view blob) {
    auto bad = [](const std::string& why) { return Status(StatusCode::kInternal, "broadcast state: " + why); };
    uint64_t headBytes = 0;
    if (blob.size() < sizeof(headBytes)) return bad("shorter than its header length");
    memcpy(&headBytes, blob.data(), sizeof(headBytes));
    if (headBytes > blob.size() - sizeof(headBytes)) return bad("header length beyond the blob");
    Json table = Json::parse(blob.substr(sizeof(headBytes), headBytes), nullptr, false);
    if (!table.is_array()) return bad("the tensor table is not a JSON array");
    size_t at = sizeof(headBytes) + headBytes;
    std::vector<HostTensor> state;
    for (const auto& e : table) {
      if (!e.is_object() || !e.contains("bytes") || !e["bytes"].is_number_unsigned()) return bad("malformed tensor entry");
      uint64_t n = e["bytes"].get<uint64_t>();
      if (n > blob.size() - at) return bad(fmt::format("tensor '{}' runs past the blob", e.value("name", "?")));
      HostTensor t;
      t.name = e.value("name", "");
      t.dtype = e.value("dtype", "");
      t.shape = e.value("shape", std::vector<int64_t>{});
      t.bytes.assign(blob.begin() + static_cast<std::ptrdiff_t>(at), blob.begin() + static_cast<std::ptrdiff_t>(at + n));
      at += n;
      state.push_back(std::move(t));
    }
    if (at != blob.size()) return bad("trailing bytes after the last tensor");
    return state;
  }

  Status broadcastState(int root) {
    if (!comm_ || root < 0 || root >= world_) {
      return Status(StatusCode::kFailedPrecondition, fmt::format("cannot broadcast state from rank {} of world {}", root, world_));
    }
    std::string blob = rank_ == root ? packState(engine_->state()) : std::string();
    int64_t size = static_cast<int64_t>(blob.size());
    TROUPE_RETURN_IF_ERROR(comm_->broadcast(&size, 1, collectives::DataType::kInt64, root));
    constexpr int64_t kMaxStateBytes = int64_t{1} << 40;
    if (size < 0 || size > kMaxStateBytes) return Status(StatusCode::kInternal, fmt::format("broadcast state of {} bytes", size));
    blob.resize(static_cast<size_t>((size + 7) / 8 * 8));
    TROUPE_RETURN_IF_ERROR(comm_->broadcast(blob.data(), blob.size() / 8, collectives::DataType::kInt64, root));
    if (rank_ == root) return Status::ok();
    blob.resize(static_cast<size_t>(size));
    TROUPE_ASSIGN_OR_RETURN(auto state, unpackState(blob));
    return engine_->loadState(state);
  }

  Status snapshot() {
    auto state = engine_->state();
    if (!layout_) {
      std::vector<checkpoint::TensorSpec> specs;
      for (const auto& t : state) {
        TROUPE_ASSIGN_OR_RETURN(auto spec, checkpoint::makeTensorSpec(t.name, t.dtype, t.shape));
        specs.push_back(spec);
      }
      TROUPE_ASSIGN_OR_RETURN(auto layout, checkpoint::ImageLayout::plan(std::move(specs)));
      layout_.emplace(std::move(layout));
    }
    // A re-sharded state may need bigger slots (re-creating the segment drops its snapshots).
    if (segment_ && segment_->slotCapacity() < layout_->imageBytes()) segment_.reset();
    if (!segment_) {
      TROUPE_ASSIGN_OR_RETURN(auto o, segmentOptions());
      // Under ZeRO a rank's share grows as the world shrinks: room for the smallest world.
      uint64_t room = layout_->imageBytes();
      if (options_.zero > 0 && minWorld_ < world_) room = room / static_cast<uint64_t>(minWorld_) * static_cast<uint64_t>(world_);
      TROUPE_ASSIGN_OR_RETURN(auto seg, checkpoint::FlashSegment::openForWrite(o, room));
      segment_.emplace(std::move(seg));
    }
    std::vector<checkpoint::ConstBuffer> buffers;
    for (const auto& t : state) buffers.push_back({t.bytes.data(), t.bytes.size()});
    // Snapshots are keyed by bundle; after a shrink that removed a lower bundle, bundle indices
    // reach past the world size, and an image's rank must stay below its world.
    checkpoint::ImageStamp stamp{static_cast<uint64_t>(engine_->stepCount()), static_cast<uint32_t>(slotRank_),
                                 static_cast<uint32_t>(std::max(world_, slotRank_ + 1))};
    auto saved = segment_->save(*layout_, stamp, buffers, "");
    if (!saved.isOk()) return saved.status();
    // The checkpoint actor persists and replicates it in the background.
    if (persistEvery_ > 0 && engine_->stepCount() % persistEvery_ != 0) return Status::ok();
    auto told = callCheckpoint<bool>("saved", [rank = slotRank_, step = engine_->stepCount()](rpc::Checkpoint::Client& c) {
      auto request = c.savedRequest();
      request.setRank(static_cast<uint32_t>(rank));
      request.setStep(static_cast<uint64_t>(step));
      return request.send().then([](auto) { return true; });
    });
    return told.isOk() ? Status::ok() : told.status();
  }

  // Sequence parallelism: trainers per ring in this world, and this trainer's data-parallel
  // group among world / ringSize() (the dataloader's rank and world).
  int ringSize() const { return world_ > 1 ? options_.sequence_parallel : 1; }
  int dataRank() const { return rank_ / ringSize(); }
  int dataWorld() const { return world_ / ringSize(); }

  // Batches are asked for up to prefetch_ steps ahead; the requests live on the RPC thread.
  void startTakes(int64_t from, int64_t until) {
    executor_->executeSync([this, from, until]() {
      for (int64_t k = from; k < until; ++k) {
        if (takes_.count(k)) continue;
        // A ring of sequence parallelism shares its data-parallel group's rows.
        ActorHandle handle = context_.cluster->actor(ActorId(dataloader_));
        auto typed = handle.typed<rpc::Dataloader>();
        auto batch = typed.then([k, rank = dataRank(), world = dataWorld()](rpc::Dataloader::Client loader) {
          auto request = loader.takeRequest();
          request.setStep(k);
          request.setRank(static_cast<uint32_t>(rank));
          request.setWorld(static_cast<uint32_t>(world));
          return request.send().then([](capnp::Response<rpc::Dataloader::TakeResults> reply) {
            auto batch = batchFromWire(reply.getBatch());
            if (!batch.isOk()) throwStatus(batch.status());
            return kj::mv(*batch);
          });
        });
        // The handle owns the connection the capability lives on: kept until the batch is read.
        takes_.emplace(k, batch.attach(kj::mv(handle)).fork());
      }
    });
  }

  Result<Batch> finishTake(int64_t step) {
    try {
      return executor_->executeSync([this, step]() {
        auto it = takes_.find(step);
        auto branch = it->second.addBranch();
        takes_.erase(it);
        return branch;
      });
    } catch (const kj::Exception& e) {
      return statusFromException(e, fmt::format("take of step {}", step));
    }
  }

  void dropTakes() {
    executor_->executeSync([this]() { takes_.clear(); });
  }

  Result<Trained> train(int64_t from, int64_t steps) {
    auto result = trainSteps(from, steps);
    if (!result.isOk()) dropTakes();  // the group rewinds; the leases are released there
    return result;
  }

  Result<Trained> trainSteps(int64_t from, int64_t steps) {
    if (engine_->stepCount() != from) {
      return Status(StatusCode::kFailedPrecondition,
                    fmt::format("trainer is at step {}, asked to run from step {}", engine_->stepCount(), from));
    }
    Trained trained;
    for (int64_t s = from; s < from + steps; ++s) {
      auto t0 = Clock::now();
      engine_->setActivity("data wait");
      startTakes(s, std::min(from + steps, s + 1 + prefetch_));
      TROUPE_ASSIGN_OR_RETURN(auto batch, finishTake(s));
      double wait = since(t0);
      if (s == hangAtStep_) {  // tests: this rank stops making progress (until killed)
        engine_->setActivity("hung (test fault)");
        for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
      }
      engine_->record({"data wait", wallUs() - static_cast<int64_t>(wait * 1e6), static_cast<int64_t>(wait * 1e6), s + 1});
      if (s == killAtStep_) ::raise(SIGKILL);  // holding a lease, before the all-reduce: the worst time
      auto slow0 = Clock::now();
      if (slowMs_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(slowMs_));  // tests: a straggler
      double slow = since(slow0);
      TROUPE_ASSIGN_OR_RETURN(auto m, engine_->step(batch));
      m.compute_s += slow;  // the delay stands for a slower machine: it counts as compute
      // One member of each ring completes the rows (every member took them before the step's
      // ring could run).
      if (rank_ % ringSize() == 0) {
        auto done = callTyped<rpc::Dataloader, int64_t>(
            dataloader_, "complete", [s, rank = dataRank()](rpc::Dataloader::Client& c) {
              auto request = c.completeRequest();
              request.setStep(s);
              request.setRank(static_cast<uint32_t>(rank));
              return request.send().then([](capnp::Response<rpc::Dataloader::CompleteResults> r) {
                return r.getCommitted();
              });
            });
        if (!done.isOk()) return done.status();
      }
      auto t1 = Clock::now();
      if (snapshotEvery_ > 0 && m.step % snapshotEvery_ == 0) {
        int64_t snapshot_us = wallUs();
        engine_->setActivity("snapshot");
        TROUPE_RETURN_IF_ERROR(snapshot());
        engine_->record({"snapshot", snapshot_us, wallUs() - snapshot_us, m.step});
        static metrics::Counter& snapshots = metrics::counter("troupe_checkpoint_snapshots_total");
        static metrics::Counter& snapshotBytes = metrics::counter("troupe_checkpoint_snapshot_bytes_total");
        static metrics::Counter& snapshotTime =
            metrics::counter("troupe_checkpoint_snapshot_seconds_total", "", metrics::Unit::kSeconds);
        snapshots.add();
        snapshotBytes.add(layout_->imageBytes());
        snapshotTime.addTime(std::chrono::microseconds(wallUs() - snapshot_us));
      }
      m.wait_s = wait;
      trained.steps.push_back(StepReport{m, since(t1), std::move(batch.sample_ids)});
    }
    TROUPE_ASSIGN_OR_RETURN(auto pinned, pin());
    trained.hash = engine_->parameterHash();
    trained.pinned = pinned;
    return trained;
  }

  // Makes sure this bundle's segment holds a complete snapshot of the current step, taking one
  // now unless a step's snapshot already did. A resize restores the current step on every rank
  // (and, under ZeRO, reads the leaving ranks' snapshots of it; a new member copies a node mate's),
  // while snapshot_every > 1 skips the steps between its multiples, chunk ends included.
  Status snapshotCurrentStep() {
    const int64_t step = engine_->stepCount();
    if (step == 0) return Status::ok();  // step 0 is re-made from the seed
    if (!resnapshot_ && segment_ && segment_->completeAt(static_cast<uint64_t>(step))) return Status::ok();
    TROUPE_RETURN_IF_ERROR(snapshot());
    resnapshot_ = false;
    return Status::ok();
  }

  // Pins this rank's newest snapshot (in memory and, once the checkpoint actor confirms it, in
  // its replica on the next node), at the end of a chunk and after a restore. Every rank does
  // this before the driver starts the next chunk, so whatever fails later, every rank (or its
  // replica, if its node is lost) still holds that step: restores always find a common step.
  // Returns the step pinned, or none when there is no snapshot.
  Result<std::optional<int64_t>> pin() {
    if (snapshotEvery_ <= 0) return std::optional<int64_t>();
    if (resnapshot_) {
      TROUPE_RETURN_IF_ERROR(snapshot());
      resnapshot_ = false;
    }
    TROUPE_ASSIGN_OR_RETURN(auto o, segmentOptions());
    std::optional<checkpoint::FlashSegment> opened;
    checkpoint::FlashSegment* seg = segment_ ? &*segment_ : nullptr;
    if (seg == nullptr) {  // not written since this process started: pin what is there
      auto existing = checkpoint::FlashSegment::openExisting(o, /*writable=*/true);
      if (!existing.isOk()) {
        if (existing.status().code() == StatusCode::kNotFound) return std::optional<int64_t>();
        return existing.status();
      }
      seg = &opened.emplace(std::move(*existing));
    }
    // Snapshots after this rank's step are of a timeline the group left (a failure undid them):
    // were they kept, the checkpoint actor would replicate them instead of this one.
    seg->discardAfter(static_cast<uint64_t>(engine_->stepCount()));
    auto newest = seg->newestComplete(static_cast<uint64_t>(engine_->stepCount()));
    if (!newest) return std::optional<int64_t>();
    // The checkpoint actor answers at once; its job ends when the replica is pinned.
    for (auto pause = std::chrono::milliseconds(1);; pause = std::min(pause * 2, std::chrono::milliseconds(20))) {
      auto reply = callCheckpoint<bool>("pin", [rank = slotRank_, step = newest->step](rpc::Checkpoint::Client& c) {
        auto request = c.pinRequest();
        request.setRank(static_cast<uint32_t>(rank));
        request.setStep(step);
        return request.send().then(
            [](capnp::Response<rpc::Checkpoint::PinResults> r) { return r.getState() == rpc::JobState::RUNNING; });
      });
      if (!reply.isOk()) return reply.status();
      if (!*reply) break;
      std::this_thread::sleep_for(pause);
    }
    TROUPE_RETURN_IF_ERROR(seg->pin(newest->step));
    return std::optional<int64_t>(static_cast<int64_t>(newest->step));
  }

  ActorContext context_;
  kj::Own<const kj::Executor> executor_;  // the RPC thread's
  std::string group_;
  std::string dataloader_;
  std::string checkpoint_;
  int64_t snapshotEvery_;
  int64_t persistEvery_;  // tell the checkpoint actor (persist, replicate) every n snapshots' steps
  int slotRank_;
  int minWorld_;  // the smallest world the group may shrink to (ZeRO sizes its snapshots' room)
  int64_t killAtStep_;  // tests: SIGKILL itself in the middle of this step (first incarnation only)
  int64_t slowMs_;  // tests: every step's compute is this much longer (a straggler)
  int64_t hangAtStep_;  // tests: the step at which this rank hangs
  bool killInJoin_;     // tests: SIGKILL itself on its first join (first incarnation only)
  int prefetch_ = 2;                                             // batches asked for ahead
  std::map<int64_t, kj::ForkedPromise<Batch>> takes_;            // RPC thread only
  TrainerEngineOptions options_;
  // Compute thread only, but for activity and timeline, which read engine_ on the RPC thread
  // under engineMutex_ (the compute thread takes it to replace the engine):
  std::mutex engineMutex_;
  std::unique_ptr<TrainerEngine> engine_;
  std::unique_ptr<RendezvousStore> store_;  // the communicators' rendezvous: its one role
  std::shared_ptr<collectives::Communicator> comm_;
  int rank_ = 0;
  int world_ = 1;
  checkpoint::SegmentOptions ownSegment_;  // this bundle's segment; empty until asked for
  std::optional<checkpoint::ImageLayout> layout_;
  std::optional<checkpoint::FlashSegment> segment_;
  bool resnapshot_ = false;  // ZeRO: the state was re-sharded; snapshot it at the next pin
  // The job queue (RPC thread -> compute thread):
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<kj::Function<void()>> jobs_;
  bool stopping_ = false;
  std::thread compute_;
};

}  // namespace

void registerTrainActors(ActorRegistry& registry) {
  registry.add("Trainer", &Trainer::create);
  registerDataloaderActor(registry);
}

}  // namespace troupe::actors
