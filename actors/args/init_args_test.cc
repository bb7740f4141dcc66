#include "troupe/actors/init_args.h"

#include <capnp/message.h>
#include <doctest/doctest.h>

#include <string>

namespace troupe::actors {
namespace {

// The error's message for `json` as `type`'s init args (fails the test if it encodes).
std::string refusal(std::string_view type, std::string_view json) {
  auto encoded = encodeInitArgs(type, json);
  REQUIRE(!encoded.isOk());
  CHECK(encoded.status().code() == StatusCode::kInvalidArgument);
  return encoded.status().message();
}

bool has(const std::string& text, std::string_view part) { return text.find(part) != std::string::npos; }

TEST_CASE("init args: the JSON keys are the schema's snake_case names, and decode to its struct") {
  auto bytes = encodeInitArgs("Trainer", R"({"group": "g", "snapshot_every": 5, "min_workers": 2,
      "fault_kill_in_join": true, "engine": {"model": "mlp", "lr": 0.5, "global_batch": 64,
      "mlp_sizes": [3, 7, 2], "seed": 18446744073709549568}})");
  REQUIRE(bytes.isOk());
  auto args = decodeInitArgs<rpc::TrainerArgs>("Trainer", *bytes);
  REQUIRE(args.isOk());
  auto t = args->get();
  CHECK(std::string(t.getGroup().cStr()) == "g");
  CHECK(t.getSnapshotEvery() == 5);
  CHECK(t.getMinWorkers() == 2);
  CHECK(t.getFaultKillInJoin());
  CHECK(t.getFaultKillAtStep() == -1);  // absent: the schema's default
  auto e = t.getEngine();
  CHECK(std::string(e.getModel().cStr()) == "mlp");
  CHECK(e.getLr() == 0.5);
  CHECK(e.getGlobalBatch() == 64);
  CHECK(e.getMaxMicroBatch() == 32);
  CHECK(e.getSeed() == 18446744073709549568ull);
  REQUIRE(e.getMlpSizes().size() == 3);
  CHECK(e.getMlpSizes()[1] == 7);
}

TEST_CASE("init args: empty bytes and an empty object read as every default") {
  for (std::string_view json : {"", "  \n", "{}"}) {
    auto bytes = encodeInitArgs("Checkpoint", json);
    REQUIRE(bytes.isOk());
    auto args = decodeInitArgs<rpc::CheckpointArgs>("Checkpoint", *bytes);
    REQUIRE(args.isOk());
    CHECK(args->get().getKeep() == 3);
    CHECK(args->get().getFileMode() == 0600);
    CHECK(!args->get().hasReplicaTo());
  }
  auto none = decodeInitArgs<rpc::TrainerArgs>("Trainer", "");
  REQUIRE(none.isOk());
  CHECK(std::string(none->get().getEngine().getModel().cStr()) == "tinylm");
  CHECK(none->get().getEngine().getMlpSizes().size() == 3);
}

TEST_CASE("init args: a text given empty is told from one not given") {
  auto bytes = encodeInitArgs("Checkpoint", R"({"replica_to": ""})");
  REQUIRE(bytes.isOk());
  auto args = decodeInitArgs<rpc::CheckpointArgs>("Checkpoint", *bytes);
  REQUIRE(args.isOk());
  CHECK(args->get().hasReplicaTo());
  CHECK(args->get().getReplicaTo().size() == 0);
}

TEST_CASE("init args: an unknown key is refused, naming the type, the field and the known ones") {
  auto why = refusal("Counter", R"({"strat": 3})");
  CHECK(has(why, "Counter init args"));
  CHECK(has(why, "unknown field \"strat\" (CounterArgs has: start)"));
  why = refusal("Trainer", R"({"engine": {"lr": 0.1, "learning_rate": 0.1}})");
  CHECK(has(why, "unknown field \"engine.learning_rate\""));
  // The field's own (camelCase) name is not its JSON key.
  CHECK(has(refusal("Checkpoint", R"({"shmDir": "/x"})"), "unknown field \"shmDir\""));
  CHECK(has(refusal("Counter", R"({"start": 1, "start": 2})"), "\"start\" is given twice"));
}

TEST_CASE("init args: a value of the wrong type or range is refused, naming the field") {
  CHECK(has(refusal("Counter", R"({"start": "7"})"), "Counter init args: \"start\" must be an integer, got a string"));
  CHECK(has(refusal("Counter", R"({"start": 1.5})"), "\"start\" must be an integer, got 1.5"));
  CHECK(has(refusal("Counter", R"({"start": 1e30})"), "\"start\" is 1e+30, outside"));
  CHECK(has(refusal("Counter", R"({"start": null})"), "\"start\" must be an integer, got null"));
  CHECK(has(refusal("Checkpoint", R"({"keep": -1})"), "\"keep\" is -1, outside [0, 4294967295]"));
  CHECK(has(refusal("Checkpoint", R"({"members": ["a", 2]})"), "\"members[1]\" must be a string, got a number"));
  CHECK(has(refusal("Crasher", R"({"fail_on_start": 1})"), "\"fail_on_start\" must be a boolean, got a number"));
  CHECK(has(refusal("Trainer", R"({"engine": {"lr": "fast"}})"), "\"engine.lr\" must be a number, got a string"));
  CHECK(has(refusal("Trainer", R"({"engine": 3})"), "\"engine\" must be an object of the fields of EngineSpec"));
  CHECK(has(refusal("Dataloader", R"({"data": {"kind": "npy", "labels": ["x"]}})"), "\"data.labels\" must be a string"));
}

TEST_CASE("init args: text that is not a JSON object is refused") {
  CHECK(has(refusal("Counter", "100"), "Counter init args: must be an object of the fields of CounterArgs, got a number"));
  CHECK(has(refusal("Crasher", "fail_on_start"), "Crasher init args: not valid JSON"));
  CHECK(has(refusal("Checkpoint", R"({"group": "g",})"), "not valid JSON"));
  std::string deep(100, '[');
  CHECK(has(refusal("Checkpoint", deep), "not valid JSON"));
}

TEST_CASE("init args: a type without a schema passes its bytes unchanged") {
  CHECK(initArgsSchema("Echo") == nullptr);
  CHECK(initArgsSchema("py:Model") == nullptr);
  CHECK(initArgsSchema("Trainer") != nullptr);
  std::string raw("\x80\x04pickle\0", 9);
  auto same = encodeInitArgs("py:Model", raw);
  REQUIRE(same.isOk());
  CHECK(*same == raw);
}

TEST_CASE("init args: a C++ caller's own message decodes") {
  capnp::MallocMessageBuilder message;
  message.initRoot<rpc::CounterArgs>().setStart(-42);
  auto args = decodeInitArgs<rpc::CounterArgs>("Counter", initArgsBytes(message));
  REQUIRE(args.isOk());
  CHECK(args->get().getStart() == -42);
}

TEST_CASE("init args: truncated, corrupt or oversized bytes are refused, never read") {
  auto good = encodeInitArgs("Checkpoint", R"({"group": "g", "node": "a", "members": ["x", "y"], "dir": "/d"})");
  REQUIRE(good.isOk());
  auto refused = [](std::string_view bytes) {
    auto args = decodeInitArgs<rpc::CheckpointArgs>("Checkpoint", bytes);
    REQUIRE(!args.isOk());
    CHECK(args.status().code() == StatusCode::kInvalidArgument);
    CHECK(has(args.status().message(), "Checkpoint init args"));
    CHECK(has(args.status().message(), "not a CheckpointArgs message"));
    return args.status().message();
  };
  // JSON where a message belongs (a caller that skipped encodeInitArgs).
  refused(R"({"group": "g", "node": "a"})");
  CHECK(has(refused(good->substr(0, good->size() - 3)), "whole number of 8-byte words"));
  // Whole words, but fewer than the segment table says.
  refused(good->substr(0, good->size() - 8));
  refused(good->substr(0, 8));
  CHECK(has(refused(*good + std::string(8, '\0')), "bytes after the message"));
  // A segment table claiming a huge segment.
  std::string huge = *good;
  huge[4] = '\xff';
  huge[5] = '\xff';
  huge[6] = '\xff';
  refused(huge);
  // Every single-byte corruption of the pointers either decodes or is refused: none crashes.
  for (size_t i = 8; i < good->size(); ++i) {
    std::string bad = *good;
    bad[i] = static_cast<char>(bad[i] ^ 0xa5);
    auto args = decodeInitArgs<rpc::CheckpointArgs>("Checkpoint", bad);
    if (args.isOk()) {
      (void)args->get().getMembers().size();
    } else {
      CHECK(args.status().code() == StatusCode::kInvalidArgument);
    }
  }
}

TEST_CASE("init args: a pointer of another kind than its field's is refused, not thrown in the actor") {
  // DataloaderArgs' first pointer is a struct (data); TrainerArgs' is text (group). Bounds and
  // sizes are all fine: only the kind is wrong, which reading `group` would throw on.
  capnp::MallocMessageBuilder message;
  message.initRoot<rpc::DataloaderArgs>().initData().setKind("text");
  auto args = decodeInitArgs<rpc::TrainerArgs>("Trainer", initArgsBytes(message));
  REQUIRE(!args.isOk());
  CHECK(args.status().code() == StatusCode::kInvalidArgument);
  CHECK(has(args.status().message(), "not a TrainerArgs message"));
}

}  // namespace
}  // namespace troupe::actors
