// The Dataloader actor's typed interface, in process: a token file on disk, the actor made by the
// registry as a worker makes it, and its capability called on a local event loop (typed, and by
// name through the generic call, as Python calls it). The batch's wire checks on bad sizes.
#include <doctest/doctest.h>
#include <unistd.h>

#include <capnp/serialize.h>
#include <kj/async.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "dataloader.capnp.h"
#include "troupe/actors/train_actors.h"

namespace troupe::actors {
namespace {

namespace fs = std::filesystem;

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
    std::string args = R"({"group": "t", "node": "a", "data": {"kind": "tokens", "path": ")" + tokens.path.string() +
                       R"(", "dtype": "uint16"}, "global_batch": 4, "context": 8, "seed": 1})";
    auto made = registry.create(context, args);
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

}  // namespace
}  // namespace troupe::actors
