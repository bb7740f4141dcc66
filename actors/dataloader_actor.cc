// The "Dataloader" actor and the batch wire format (see train_actors.h). Every call is quick
// (a batch is assembled from a memory-mapped file), so it runs on the RPC thread.
#include <fmt/format.h>
#include <unistd.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "troupe/actors/dataset.h"
#include "troupe/actors/shard_queue.h"
#include "troupe/actors/train_actors.h"

namespace troupe::actors {
namespace {

using Json = nlohmann::json;

Result<Json> parseJson(std::string_view payload) {
  Json j = Json::parse(payload.empty() ? std::string_view("{}") : payload, nullptr, false);
  if (!j.is_object()) return Status(StatusCode::kInvalidArgument, "payload is not a JSON object");
  return j;
}

class Dataloader final : public Actor {
 public:
  static Result<std::unique_ptr<Actor>> create(const ActorContext&, std::string_view args) {
    auto j = parseJson(args);
    if (!j.isOk()) return j.status();
    auto self = std::unique_ptr<Dataloader>(new Dataloader());
    const Json& data = (*j)["data"];
    std::string kind = data.value("kind", "");
    int64_t context = j->value("context", 64);
    Result<std::unique_ptr<Dataset>> dataset = Status(StatusCode::kInvalidArgument, "data.kind must be text, tokens or npy");
    if (kind == "text") {
      // Bytes are the tokens: build the token file once per incarnation, next to nothing shared.
      self->tokenFile_ = fmt::format("/tmp/troupe-tokens-{}-{}.u16", j->value("group", "g"), getpid());
      auto built = buildTokenFile(data.value("path", ""), self->tokenFile_, "uint16");
      if (!built.isOk()) return built.status();
      dataset = openTokenDataset({self->tokenFile_, "uint16", context});
    } else if (kind == "tokens") {
      dataset = openTokenDataset({data.value("path", ""), data.value("dtype", "uint16"), context});
    } else if (kind == "npy") {
      dataset = openNpyDataset(data.value("features", ""), data.value("labels", ""));
    }
    if (!dataset.isOk()) return dataset.status();
    self->dataset_ = std::move(*dataset);
    ShardQueueOptions q;
    q.num_samples = self->dataset_->size();
    q.global_batch = j->value("global_batch", 32);
    q.seed = j->value("seed", 0);
    auto queue = ShardQueue::create(q);
    if (!queue.isOk()) return queue.status();
    self->queue_.emplace(std::move(*queue));
    return std::unique_ptr<Actor>(std::move(self));
  }

  ~Dataloader() override {
    if (!tokenFile_.empty()) ::unlink(tokenFile_.c_str());
  }

  Result<std::string> call(const std::string& method, std::string_view payload) override {
    auto j = parseJson(payload);
    if (!j.isOk()) return j.status();
    ShardQueue& q = *queue_;
    if (method == "take") {
      auto lease = q.take(j->value("step", int64_t{0}), j->value("rank", 0), j->value("world", 1));
      if (!lease.isOk()) return lease.status();
      auto batch = dataset_->batch(lease->sample_ids);
      if (!batch.isOk()) return batch.status();
      return encodeBatch(*batch);
    }
    if (method == "complete") {
      auto committed = q.complete(j->value("step", int64_t{0}), j->value("rank", 0));
      if (!committed.isOk()) return committed.status();
      return Json{{"committed", *committed}}.dump();
    }
    if (method == "commit") {
      // Every rank finished steps before `step` (the driver gathered their replies): a node's
      // queue hears completions from its own ranks only, so the driver commits for the group.
      int64_t step = j->value("step", int64_t{0});
      if (step > 0) TROUPE_RETURN_IF_ERROR(q.commit(step - 1));
      return Json{{"committed", q.committedSteps()}}.dump();
    }
    if (method == "rewind") {
      int64_t step = j->value("step", int64_t{0});
      // Every rank holds a snapshot of `step`, so steps before it finished everywhere even if
      // some completions were lost with a dead rank.
      if (step > q.committedSteps()) TROUPE_RETURN_IF_ERROR(q.commit(step - 1));
      TROUPE_RETURN_IF_ERROR(q.rewind(step));
      return Json{{"committed", q.committedSteps()}}.dump();
    }
    if (method == "info") {
      return Json{{"samples", dataset_->size()},
                  {"committed", q.committedSteps()},
                  {"data_epoch", q.dataEpoch()},
                  {"in_flight", q.inFlight().size()},
                  {"dataset", dataset_->describe()}}
          .dump();
    }
    if (method == "step_samples") return Json{{"ids", q.stepSamples(j->value("step", int64_t{0}))}}.dump();
    return Status(StatusCode::kNotFound, fmt::format("Dataloader has no method '{}'", method));
  }

 private:
  Dataloader() = default;
  std::unique_ptr<Dataset> dataset_;
  std::optional<ShardQueue> queue_;
  std::string tokenFile_;
};

Json tensorHeader(const HostTensor& t) { return Json{{"dtype", t.dtype}, {"shape", t.shape}}; }

}  // namespace

std::string encodeBatch(const Batch& batch) {
  std::string header =
      Json{{"inputs", tensorHeader(batch.inputs)}, {"targets", tensorHeader(batch.targets)}, {"ids", batch.sample_ids}}
          .dump();
  std::string out(4, '\0');
  uint32_t n = static_cast<uint32_t>(header.size());
  std::memcpy(out.data(), &n, 4);
  out += header;
  out.append(reinterpret_cast<const char*>(batch.inputs.bytes.data()), batch.inputs.bytes.size());
  out.append(reinterpret_cast<const char*>(batch.targets.bytes.data()), batch.targets.bytes.size());
  return out;
}

Result<Batch> decodeBatch(std::string_view bytes) {
  auto bad = [](const std::string& why) { return Status(StatusCode::kInvalidArgument, "malformed batch: " + why); };
  if (bytes.size() < 4) return bad("shorter than its header length");
  uint32_t n = 0;
  std::memcpy(&n, bytes.data(), 4);
  if (bytes.size() < 4 + n) return bad("truncated header");
  Json h = Json::parse(bytes.substr(4, n), nullptr, false);
  if (!h.is_object()) return bad("header is not JSON");
  Batch batch;
  size_t offset = 4 + n;
  for (auto [key, tensor] : {std::pair{"inputs", &batch.inputs}, std::pair{"targets", &batch.targets}}) {
    tensor->dtype = h[key].value("dtype", "");
    tensor->shape = h[key].value("shape", std::vector<int64_t>{});
    size_t size = static_cast<size_t>(tensor->numel()) * dtypeSize(tensor->dtype);
    if (offset + size > bytes.size()) return bad(fmt::format("{} needs {} bytes", key, size));
    tensor->bytes.assign(reinterpret_cast<const uint8_t*>(bytes.data()) + offset,
                         reinterpret_cast<const uint8_t*>(bytes.data()) + offset + size);
    offset += size;
  }
  batch.sample_ids = h.value("ids", std::vector<uint64_t>{});
  return batch;
}

void registerDataloaderActor(ActorRegistry& registry) { registry.add("Dataloader", &Dataloader::create); }

}  // namespace troupe::actors
