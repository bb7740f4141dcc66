// The Dataloader's and the Trainer's typed interfaces, in process: each actor made by the registry
// as a worker makes it (the trainers with a real Redis for their rendezvous), its capability
// called on a local event loop (typed, and by name through the generic call, as Python calls
// it). The batch's wire checks on bad sizes; the trainer's refusals of bad arguments, and its
// activity answered while a join waits on the compute thread.
#include <doctest/doctest.h>
#include <unistd.h>

#include <capnp/serialize.h>
#include <fmt/format.h>
#include <kj/async-io.h>
#include <kj/async.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "dataloader.capnp.h"
#include "trainer.capnp.h"
#include "troupe/actors/dataset.h"
#include "troupe/actors/init_args.h"
#include "troupe/actors/train_actors.h"
#include "troupe/actors/trainer_engine.h"
#include "troupe/runtime/actor_server.h"
#include "troupe/testing/redis_server.h"

namespace troupe::actors {
namespace {

namespace fs = std::filesystem;

// `type`'s init args as a driver encodes them from JSON (actors/schema/init_args.capnp).
std::string initArgs(std::string_view type, const std::string& json) {
  auto encoded = encodeInitArgs(type, json);
  REQUIRE(encoded.isOk());
  return *encoded;
}

TEST_CASE("init args: an engine spec's defaults are TrainerEngineOptions' and a dataloader's ShardQueue's") {
  auto spec = decodeInitArgs<rpc::TrainerArgs>("Trainer", "");
  REQUIRE(spec.isOk());
  auto e = spec->get().getEngine();
  TrainerEngineOptions o;
  CHECK(o.model == e.getModel().cStr());
  CHECK(o.loss == e.getLoss().cStr());
  CHECK(o.optimizer == e.getOptimizer().cStr());
  CHECK(o.wsam_base == e.getWsamBase().cStr());
  CHECK(o.lr == e.getLr());
  CHECK(o.weight_decay == e.getWeightDecay());
  CHECK(o.momentum == e.getMomentum());
  CHECK(o.wsam_rho == e.getWsamRho());
  CHECK(o.wsam_gamma == e.getWsamGamma());
  CHECK(o.seed == e.getSeed());
  CHECK(o.threads == e.getThreads());
  CHECK(o.global_batch == e.getGlobalBatch());
  CHECK(o.max_micro_batch == e.getMaxMicroBatch());
  CHECK(o.tinylm.context == e.getContext());
  CHECK(o.zero == e.getZero());
  CHECK(o.sequence_parallel == e.getSequenceParallel());
  std::vector<int64_t> sizes;
  for (int64_t width : e.getMlpSizes()) sizes.push_back(width);
  CHECK(o.mlp_sizes == sizes);
  auto loader = decodeInitArgs<rpc::DataloaderArgs>("Dataloader", "");
  REQUIRE(loader.isOk());
  CHECK(TokenDatasetOptions{}.context == loader->get().getContext());
  CHECK(TokenDatasetOptions{}.token_type == loader->get().getData().getDtype().cStr());
}

TEST_CASE("init args: a Trainer or Dataloader given JSON instead of its message is refused at creation") {
  ActorRegistry registry;
  registerTrainActors(registry);
  for (const char* type : {"Trainer", "Dataloader"}) {
    ActorContext context;
    context.type = type;
    auto made = registry.create(context, R"({"group": "g"})");
    REQUIRE(!made.isOk());
    CHECK(made.status().code() == StatusCode::kInvalidArgument);
    CHECK(made.status().message().find(std::string(type) + " init args") != std::string::npos);
  }
}

// A file of `n` uint16 tokens 0, 1, 2, ..., removed at the end of the test.
struct TokenFile {
  fs::path path = fs::temp_directory_path() / ("troupe-tokens-test-" + std::to_string(::getpid()) + ".u16");
  explicit TokenFile(int n) {
    std::ofstream out(path, std::ios::binary);
    for (int i = 0; i < n; ++i) {
      uint16_t t = static_cast<uint16_t>(i % 250);
      out.write(reinterpret_cast<const char*>(&t), 2);
    }
  }
  ~TokenFile() { fs::remove(path); }
};

struct Loader {
  kj::EventLoop loop;
  kj::WaitScope waitScope{loop};
  TokenFile tokens{4096};
  std::unique_ptr<Actor> actor;
  rpc::Dataloader::Client client{nullptr};

  Loader() {
    ActorRegistry registry;
    registerTrainActors(registry);
    ActorContext context;
    context.type = "Dataloader";
    std::string args = R"({"data": {"kind": "tokens", "path": ")" + tokens.path.string() +
                       R"(", "dtype": "uint16"}, "global_batch": 4, "context": 8, "seed": 1})";
    auto made = registry.create(context, initArgs("Dataloader", args));
    REQUIRE(made.isOk());
    actor = std::move(*made);
    KJ_IF_MAYBE(cap, actor->typed()) { client = cap->castAs<rpc::Dataloader>(); }
  }
  ~Loader() {
    client = nullptr;  // the capability goes before the actor it serves
    actor.reset();
  }
  // The generic call: `method` by name, params encoded with the schema.
  Result<std::string> generic(const std::string& method, std::string payload) {
    return actor->callAsync(method, payload).wait(waitScope);
  }
};

std::string encoded(capnp::MessageBuilder& message) {
  auto flat = capnp::messageToFlatArray(message);
  return std::string(reinterpret_cast<const char*>(flat.asBytes().begin()), flat.asBytes().size());
}

TEST_CASE("dataloader: typed take, complete and info; the generic call reaches the same methods") {
  Loader l;
  auto take = l.client.takeRequest();
  take.setStep(0);
  take.setRank(1);
  take.setWorld(2);
  auto reply = take.send().wait(l.waitScope);
  auto batch = batchFromWire(reply.getBatch());
  REQUIRE(batch.isOk());
  CHECK(batch->rows() == 2);  // rank 1's half of a global batch of 4
  CHECK(batch->inputs.shape == std::vector<int64_t>{2, 8});
  CHECK(batch->inputs.dtype == "int64");
  CHECK(batch->sample_ids.size() == 2);

  auto leased = l.client.infoRequest().send().wait(l.waitScope);
  CHECK(leased.getInFlight() == 1);
  CHECK(leased.getSamples() > 0);
  auto complete = l.client.completeRequest();
  complete.setStep(0);
  complete.setRank(1);
  CHECK(complete.send().wait(l.waitScope).getCommitted() == 0);  // rank 0 has not finished step 0
  CHECK(l.client.infoRequest().send().wait(l.waitScope).getInFlight() == 0);

  // A rank outside its world: the queue's error, with its code, reaches the caller.
  auto outside = l.client.takeRequest();
  outside.setStep(0);
  outside.setRank(3);
  outside.setWorld(2);
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() { outside.send().wait(l.waitScope); })) {
    CHECK(std::string(e->getDescription().cStr()).find("rank 3 of world 2 is out of range") != std::string::npos);
  } else {
    FAIL("a take for rank 3 of 2 succeeded");
  }

  // By name: the params and the results are the schema's messages.
  capnp::MallocMessageBuilder params;
  params.initRoot<rpc::Dataloader::StepSamplesParams>().setStep(0);
  auto samples = l.generic("stepSamples", encoded(params));
  REQUIRE(samples.isOk());
  auto words = kj::heapArray<capnp::word>(samples->size() / sizeof(capnp::word));
  std::memcpy(words.begin(), samples->data(), samples->size());
  capnp::FlatArrayMessageReader results(words);
  CHECK(results.getRoot<rpc::Dataloader::StepSamplesResults>().getIds().size() == 4);
  auto unknown = l.generic("take_json", "{}");
  CHECK(unknown.status().message().find("Dataloader has no method 'take_json' (take, complete,") != std::string::npos);
  CHECK(l.generic("stepSamples", "{\"step\": 0}").status().code() == StatusCode::kInvalidArgument);
}

// A text data set's token file was built at /tmp/troupe-tokens-<group>-<pid>.u16 (through
// <that>.tmp.<pid>): another user could plant a link there and have the actor overwrite a file of
// its user's. It is built in a directory of its own now, gone with the actor.
TEST_CASE("dataloader: a text data set's token file is private, not at a name another user can plant") {
  fs::path scratch = fs::temp_directory_path() / fmt::format("troupe-plant-test-{}", ::getpid());
  fs::create_directories(scratch);
  fs::path victim = scratch / "precious";
  std::ofstream(victim) << "precious";
  fs::path text = scratch / "corpus.txt";
  std::ofstream(text) << std::string(4096, 'x');
  std::string old = fmt::format("/tmp/troupe-tokens-planted-{}.u16", ::getpid());
  fs::path planted = fmt::format("{}.tmp.{}", old, ::getpid());
  fs::remove(planted);
  fs::create_symlink(victim, planted);
  {
    ActorRegistry registry;
    registerTrainActors(registry);
    ActorContext context;
    context.type = "Dataloader";
    auto made = registry.create(context, initArgs("Dataloader", R"({"data": {"kind": "text", "path": ")" +
                                                                    text.string() + R"("}, "global_batch": 4, "context": 8})"));
    REQUIRE(made.isOk());
  }
  std::ifstream in(victim);
  std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(content == "precious");
  CHECK_FALSE(fs::exists(old));
  fs::remove(planted);
  fs::remove_all(scratch);
}

TEST_CASE("dataloader: a batch from a peer is refused unless its sizes match its shapes") {
  Batch batch;
  batch.inputs = HostTensor{"", "int64", {2, 3}, std::vector<uint8_t>(2 * 3 * 8, 1)};
  batch.targets = HostTensor{"", "int64", {2, 3}, std::vector<uint8_t>(2 * 3 * 8, 2)};
  batch.sample_ids = {7, 9};
  auto check = [&](auto change) {
    capnp::MallocMessageBuilder message;
    auto wire = message.initRoot<rpc::Batch>();
    batchToWire(batch, wire);
    change(wire);
    return batchFromWire(wire.asReader());
  };
  auto same = check([](rpc::Batch::Builder) {});
  REQUIRE(same.isOk());
  CHECK(same->inputs.bytes == batch.inputs.bytes);
  CHECK(same->targets.shape == batch.targets.shape);
  CHECK(same->sample_ids == batch.sample_ids);

  auto shortData = check([](rpc::Batch::Builder w) { w.getInputs().setData(kj::heapArray<kj::byte>(40)); });
  CHECK(shortData.status().message().find("inputs: 6 elements of int64 are 48 bytes, the batch carries 40") !=
        std::string::npos);
  auto negative = check([](rpc::Batch::Builder w) { w.getTargets().getShape().set(1, -3); });
  CHECK(negative.status().message().find("targets has a dimension -3 out of range") != std::string::npos);
  auto wraps = check([](rpc::Batch::Builder w) {
    auto shape = w.getInputs().initShape(3);
    for (int i = 0; i < 3; ++i) shape.set(i, int64_t(1) << 30);  // 2^90 elements
  });
  CHECK(wraps.status().message().find("out of range") != std::string::npos);
  auto dtype = check([](rpc::Batch::Builder w) { w.getInputs().setDtype("complex1024"); });
  CHECK(dtype.status().message().find("unknown dtype 'complex1024'") != std::string::npos);
  auto ids = check([](rpc::Batch::Builder w) { w.initSampleIds(3); });
  CHECK(ids.status().message().find("3 sample ids for inputs of 2 rows") != std::string::npos);
}

// Trainers of the tiny built-in MLP, made by the registry, with a real Redis for their
// rendezvous (a worker's environment). The event loop can take the compute threads' replies.
struct Trainers {
  kj::AsyncIoContext io = kj::setupAsyncIo();
  testing::RedisServerProcess redis;
  ActorRegistry registry;

  Trainers() {
    ::setenv("TROUPE_REDIS_ADDRESS", fmt::format("{}:{}", redis.host(), redis.port()).c_str(), 1);
    ::setenv("TROUPE_REDIS_PASSWORD", redis.password().c_str(), 1);
    ::setenv("TROUPE_CLUSTER", "train-actors-test", 1);
    registerTrainActors(registry);
  }
  std::unique_ptr<Actor> make() {
    ActorContext context;
    context.type = "Trainer";
    auto made = registry.create(context, initArgs("Trainer", R"({"group": "g", "engine": {"model": "mlp", "seed": 7}})"));
    REQUIRE(made.isOk());
    return std::move(*made);
  }
  static rpc::Trainer::Client typed(Actor& actor) {
    KJ_IF_MAYBE(cap, actor.typed()) { return cap->castAs<rpc::Trainer>(); }
    FAIL("the Trainer has no typed interface");
    return nullptr;
  }
  // What a typed call threw (its description), or "" when it succeeded.
  template <typename Request>
  std::string error(Request&& request) {
    KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() { request.send().wait(io.waitScope); })) {
      return e->getDescription().cStr();
    }
    return "";
  }
};

// The results of a generic call, read as `Results`.
template <typename Results>
struct Decoded {
  kj::Array<capnp::word> words;
  std::unique_ptr<capnp::FlatArrayMessageReader> reader;
  explicit Decoded(const std::string& bytes) : words(kj::heapArray<capnp::word>(bytes.size() / sizeof(capnp::word))) {
    std::memcpy(words.begin(), bytes.data(), bytes.size());
    reader = std::make_unique<capnp::FlatArrayMessageReader>(words);
  }
  typename Results::Reader get() { return reader->getRoot<Results>(); }
};

TEST_CASE("trainer: typed join, restore, configure and hash run on the compute thread; by name too") {
  Trainers t;
  auto actor = t.make();
  auto client = Trainers::typed(*actor);

  auto join = client.joinRequest();
  join.setRank(0);
  join.setWorld(1);
  auto joined = join.send().wait(t.io.waitScope);
  CHECK(joined.getRank() == 0);
  CHECK(joined.getWorld() == 1);

  auto hash = client.hashRequest().send().wait(t.io.waitScope);
  CHECK(hash.getStep() == 0);
  CHECK(hash.getHash() != 0);
  auto restore = client.restoreRequest();
  restore.setStep(0);
  auto restored = restore.send().wait(t.io.waitScope);
  CHECK(restored.getStep() == 0);
  CHECK(std::string(restored.getSource().cStr()) == "seed");
  CHECK(restored.getHash() == hash.getHash());  // re-made from the same seed

  auto configure = client.configureRequest();
  configure.setThreads(2);
  auto settings = configure.send().wait(t.io.waitScope);
  CHECK(settings.getThreads() == 2);
  CHECK(settings.getPrefetch() == 2);       // -1: kept
  CHECK(settings.getSnapshotEvery() == 1);  // the init args' default

  auto activity = client.activityRequest().send().wait(t.io.waitScope);
  CHECK(activity.getPid() == ::getpid());
  CHECK(activity.getWorld() == 1);
  CHECK(client.timelineRequest().send().wait(t.io.waitScope).getPid() == ::getpid());

  // By name, as Python calls it: no params bytes leave every param at its default.
  auto generic = actor->callAsync("hash", "").wait(t.io.waitScope);
  REQUIRE(generic.isOk());
  CHECK(Decoded<rpc::Trainer::HashResults>(*generic).get().getHash() == hash.getHash());
  auto unknown = actor->callAsync("load_dir", "{}").wait(t.io.waitScope);
  CHECK(unknown.status().message().find("Trainer has no method 'load_dir' (join, snapshots, restore, run, loadDir") !=
        std::string::npos);
  CHECK(actor->call("hash", "").status().code() == StatusCode::kInternal);  // typed actors are never synchronous
  client = nullptr;
}

TEST_CASE("trainer: a bad argument is refused with an error naming it, and changes nothing") {
  Trainers t;
  auto actor = t.make();
  auto client = Trainers::typed(*actor);

  auto threads = client.configureRequest();
  threads.setThreads(0);
  threads.setPrefetch(5);
  CHECK(t.error(threads).find("threads must be >= 1, got 0") != std::string::npos);
  auto kept = client.configureRequest().send().wait(t.io.waitScope);
  CHECK(kept.getThreads() == 1);
  CHECK(kept.getPrefetch() == 2);  // refused as a whole: the prefetch given with it was not applied

  auto prefetch = client.configureRequest();
  prefetch.setPrefetch(-3);
  CHECK(t.error(prefetch).find("configure: prefetch is -3 (-1 keeps the current value)") != std::string::npos);

  auto join = client.joinRequest();
  join.setRank(3);
  join.setWorld(2);
  CHECK(t.error(join).find("join: rank 3 is outside a world of 2") != std::string::npos);

  auto run = client.runRequest();
  run.setFromStep(5);
  run.setSteps(1);
  CHECK(t.error(run).find("trainer is at step 0, asked to run from step 5") != std::string::npos);

  auto load = client.loadDirRequest();
  CHECK(t.error(load).find("loadDir: no checkpoint directory given") != std::string::npos);

  // By name, params that are not a message of the method's params struct (the old JSON).
  auto json = actor->callAsync("configure", "{\"threads\": 2}").wait(t.io.waitScope);
  CHECK(json.status().code() == StatusCode::kInvalidArgument);
  CHECK(json.status().message().find("Trainer.configure: the params are") != std::string::npos);
  client = nullptr;
}

TEST_CASE("trainer: activity answers at once while a join waits for its peer on the compute thread") {
  Trainers t;
  // Rank 0 behind the actor server, as a worker serves it; rank 1 called directly.
  troupe::rpc::Actor::Client rank0 = actorServer(t.make(), "Trainer");
  auto rank1 = t.make();
  auto byName = [&](const std::string& method, capnp::MessageBuilder* params) {
    auto request = rank0.callRequest();
    request.setMethod(method);
    if (params != nullptr) {
      auto flat = capnp::messageToFlatArray(*params);
      request.setPayload(flat.asBytes());
    }
    return request.send();
  };
  capnp::MallocMessageBuilder joinParams;
  auto p = joinParams.initRoot<rpc::Trainer::JoinParams>();
  p.setEpoch(1);
  p.setRank(0);
  p.setWorld(2);
  auto joining = byName("join", &joinParams);
  // Rank 1 has not joined: rank 0's join waits in the rendezvous, yet its activity answers.
  auto activity = byName("activity", nullptr).wait(t.io.waitScope);
  Decoded<rpc::Trainer::ActivityResults> now(std::string(reinterpret_cast<const char*>(activity.getResult().begin()),
                                                         activity.getResult().size()));
  CHECK(now.get().getPid() == ::getpid());
  CHECK(!joining.poll(t.io.waitScope));

  auto client1 = Trainers::typed(*rank1);
  auto join1 = client1.joinRequest();
  join1.setEpoch(1);
  join1.setRank(1);
  join1.setWorld(2);
  auto joined1 = join1.send();
  joining.wait(t.io.waitScope);
  CHECK(joined1.wait(t.io.waitScope).getWorld() == 2);
  // In one world: a hash by name on rank 0 (in turn, after its join) equals rank 1's.
  auto hash0 = byName("hash", nullptr).wait(t.io.waitScope);
  Decoded<rpc::Trainer::HashResults> h0(
      std::string(reinterpret_cast<const char*>(hash0.getResult().begin()), hash0.getResult().size()));
  CHECK(h0.get().getHash() == client1.hashRequest().send().wait(t.io.waitScope).getHash());
  client1 = nullptr;
}

}  // namespace
}  // namespace troupe::actors
