// The "Dataloader" actor (rpc::Dataloader, see train_actors.h) and the batch on the wire. Every
// call is quick (a batch is assembled from a memory-mapped file), so it runs on the RPC thread.
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "troupe/actors/dataset.h"
#include "troupe/actors/init_args.h"
#include "troupe/actors/shard_queue.h"
#include "troupe/actors/train_actors.h"
#include "troupe/runtime/rpc.h"
#include "typed_call.h"

namespace troupe::actors {
namespace {

class Dataloader final : public TypedActor<rpc::Dataloader> {
 public:
  static Result<std::unique_ptr<Actor>> create(const ActorContext&, std::string_view args) {
    TROUPE_ASSIGN_OR_RETURN(auto init, decodeInitArgs<rpc::DataloaderArgs>("Dataloader", args));
    auto spec = init.get();
    auto data = spec.getData();
    auto self = std::unique_ptr<Dataloader>(new Dataloader());
    std::string kind = data.getKind().cStr();
    int64_t context = spec.getContext();
    Result<std::unique_ptr<Dataset>> dataset = Status(StatusCode::kInvalidArgument, "data.kind must be text, tokens or npy");
    if (kind == "text") {
      // Bytes are the tokens: build the token file once per incarnation, in a directory of its
      // own (mkdtemp, 0700): a predictable name in /tmp would let another user plant a link or
      // a FIFO there.
      const char* tmp = std::getenv("TMPDIR");
      std::string dir = fmt::format("{}/troupe-tokens-XXXXXX", tmp != nullptr && *tmp ? tmp : "/tmp");
      if (::mkdtemp(dir.data()) == nullptr) {
        return Status(StatusCode::kResourceExhausted,
                      fmt::format("cannot make a directory for the token file ({}): {}", dir, std::strerror(errno)));
      }
      self->tokenDir_ = dir;
      self->tokenFile_ = dir + "/tokens.u16";
      TROUPE_RETURN_IF_ERROR(buildTokenFile(data.getPath().cStr(), self->tokenFile_, "uint16").status());
      dataset = openTokenDataset({self->tokenFile_, "uint16", context});
    } else if (kind == "tokens") {
      dataset = openTokenDataset({data.getPath().cStr(), data.getDtype().cStr(), context});
    } else if (kind == "npy") {
      dataset = openNpyDataset(data.getFeatures().cStr(), data.getLabels().cStr());
    }
    if (!dataset.isOk()) return dataset.status();
    self->dataset_ = std::move(*dataset);
    ShardQueueOptions q;
    q.num_samples = self->dataset_->size();
    q.global_batch = spec.getGlobalBatch();
    q.seed = spec.getSeed();
    TROUPE_ASSIGN_OR_RETURN(auto queue, ShardQueue::create(q));
    self->queue_.emplace(std::move(queue));
    return std::unique_ptr<Actor>(std::move(self));
  }

  ~Dataloader() override {
    if (!tokenFile_.empty()) ::unlink(tokenFile_.c_str());
    if (!tokenDir_.empty()) ::rmdir(tokenDir_.c_str());
  }

 private:
  // rpc::Dataloader over this actor's queue and dataset; errors are thrown as Status exceptions.
  // The actor keeps a reference, so the server outlives it; once the actor is gone, calls fail.
  class Server final : public ServerFor<rpc::Dataloader, Dataloader> {
   public:
    using ServerFor::ServerFor;

   protected:
    kj::Promise<void> take(TakeContext context) override {
      auto p = context.getParams();
      auto lease = queue().take(p.getStep(), static_cast<int>(p.getRank()), static_cast<int>(p.getWorld()));
      if (!lease.isOk()) throwStatus(lease.status());
      auto batch = actor().dataset_->batch(lease->sample_ids);
      if (!batch.isOk()) throwStatus(batch.status());
      batchToWire(*batch, context.getResults().initBatch());
      return kj::READY_NOW;
    }
    kj::Promise<void> complete(CompleteContext context) override {
      auto p = context.getParams();
      auto committed = queue().complete(p.getStep(), static_cast<int>(p.getRank()));
      if (!committed.isOk()) throwStatus(committed.status());
      context.getResults().setCommitted(*committed);
      return kj::READY_NOW;
    }
    kj::Promise<void> commit(CommitContext context) override {
      // A node's queue hears completions from its own ranks only, so the driver commits for the group.
      int64_t step = context.getParams().getStep();
      if (step > 0) throwIfError(queue().commit(step - 1));
      context.getResults().setCommitted(queue().committedSteps());
      return kj::READY_NOW;
    }
    kj::Promise<void> rewind(RewindContext context) override {
      int64_t step = context.getParams().getStep();
      // Every rank holds a snapshot of `step`, so steps before it finished everywhere even if
      // some completions were lost with a dead rank.
      if (step > queue().committedSteps()) throwIfError(queue().commit(step - 1));
      throwIfError(queue().rewind(step));
      context.getResults().setCommitted(queue().committedSteps());
      return kj::READY_NOW;
    }
    kj::Promise<void> info(InfoContext context) override {
      auto r = context.getResults();
      r.setSamples(actor().dataset_->size());
      r.setCommitted(queue().committedSteps());
      r.setDataEpoch(queue().dataEpoch());
      r.setInFlight(queue().inFlight().size());
      r.setDataset(actor().dataset_->describe());
      return kj::READY_NOW;
    }
    kj::Promise<void> stepSamples(StepSamplesContext context) override {
      auto ids = queue().stepSamples(context.getParams().getStep());
      auto out = context.getResults().initIds(ids.size());
      for (size_t i = 0; i < ids.size(); ++i) out.set(i, ids[i]);
      return kj::READY_NOW;
    }

   private:
    static void throwIfError(const Status& s) {
      if (!s.isOk()) throwStatus(s);
    }
    ShardQueue& queue() { return *actor().queue_; }
  };

  Dataloader() {
    serve<Server>(*this);
  }
  std::unique_ptr<Dataset> dataset_;
  std::optional<ShardQueue> queue_;
  std::string tokenDir_;  // private, made by mkdtemp; holds tokenFile_
  std::string tokenFile_;
};

}  // namespace

void batchToWire(const Batch& batch, rpc::Batch::Builder out) {
  for (auto [tensor, wire] : {std::pair{&batch.inputs, out.initInputs()}, std::pair{&batch.targets, out.initTargets()}}) {
    wire.setDtype(tensor->dtype);
    auto shape = wire.initShape(tensor->shape.size());
    for (size_t i = 0; i < tensor->shape.size(); ++i) shape.set(i, tensor->shape[i]);
    wire.setData(kj::arrayPtr(tensor->bytes.data(), tensor->bytes.size()));
  }
  auto ids = out.initSampleIds(batch.sample_ids.size());
  for (size_t i = 0; i < batch.sample_ids.size(); ++i) ids.set(i, batch.sample_ids[i]);
}

Result<Batch> batchFromWire(rpc::Batch::Reader wire) {
  auto bad = [](const std::string& why) { return Status(StatusCode::kInvalidArgument, "malformed batch: " + why); };
  Batch batch;
  for (auto [name, tensor, in] : {std::tuple{"inputs", &batch.inputs, wire.getInputs()},
                                  std::tuple{"targets", &batch.targets, wire.getTargets()}}) {
    tensor->dtype = in.getDtype();
    size_t element = dtypeSize(tensor->dtype);
    if (element == 0) return bad(fmt::format("{} has an unknown dtype '{}'", name, tensor->dtype));
    // The product of the dims, refused before it could wrap: no batch holds 2^48 bytes.
    uint64_t numel = 1;
    for (int64_t d : in.getShape()) {
      if (d < 0 || (d > 0 && numel > (uint64_t(1) << 48) / static_cast<uint64_t>(d))) {
        return bad(fmt::format("{} has a dimension {} out of range", name, d));
      }
      numel *= static_cast<uint64_t>(d);
      tensor->shape.push_back(d);
    }
    auto data = in.getData();
    if (data.size() != numel * element) {
      return bad(fmt::format("{}: {} elements of {} are {} bytes, the batch carries {}", name, numel, tensor->dtype,
                             numel * element, data.size()));
    }
    tensor->bytes.assign(data.begin(), data.end());
  }
  for (uint64_t id : wire.getSampleIds()) batch.sample_ids.push_back(id);
  if (batch.inputs.shape.empty() || batch.inputs.shape[0] != static_cast<int64_t>(batch.sample_ids.size())) {
    return bad(fmt::format("{} sample ids for inputs of {} rows", batch.sample_ids.size(), batch.rows()));
  }
  return batch;
}

void registerDataloaderActor(ActorRegistry& registry) { registry.add("Dataloader", &Dataloader::create); }

}  // namespace troupe::actors
