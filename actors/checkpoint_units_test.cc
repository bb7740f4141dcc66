// The Checkpoint actor's units in process, without a cluster: init args, the receiving side of
// replicas (HeldReplicas, each call made twice where a peer may retry it), the restore unit's
// answers about what is held, and the deadlines on peer calls. The units together, across
// processes, are tested in checkpoint_actor_test.cc.
#include <doctest/doctest.h>

#include <kj/async-io.h>

#include <chrono>
#include <cstring>
#include <map>
#include <string>

#include "checkpoint.capnp.h"
#include "troupe/actors/checkpoint_actor.h"
#include "troupe/actors/init_args.h"
#include "troupe/checkpoint/testing.h"
#include "troupe/runtime/rpc.h"
#include "checkpoint_options.h"
#include "checkpoint_peers.h"
#include "checkpoint_replica.h"
#include "checkpoint_restore.h"

namespace troupe::actors::checkpoint_actor {
namespace {

using ck::testing::ScratchDir;
using ck::testing::TestState;

// The options of init args written as a driver writes them: JSON, encoded to the schema's message.
Result<Options> parse(std::string_view json) {
  auto bytes = encodeInitArgs("Checkpoint", json);
  REQUIRE(bytes.isOk());
  return parseOptions(*bytes);
}

Options optionsIn(const ScratchDir& shm) {
  auto o = parse(R"({"group": "g1", "node": "a", "self": "ck-a"})");
  REQUIRE(o.isOk());
  o->shmDir = shm.str();
  return *o;
}

TEST_CASE("checkpoint options: the replica target follows self among the members; bad args are named") {
  auto o = parse(R"({"group": "g", "node": "a", "self": "y", "members": ["x", "y", "z"]})");
  REQUIRE(o.isOk());
  CHECK(o->replicaTo == "z");
  o = parse(R"({"group": "g", "node": "a", "self": "z", "members": ["x", "y", "z"]})");
  REQUIRE(o.isOk());
  CHECK(o->replicaTo == "x");
  CHECK(o->primary(3) != o->replica(3));
  auto self = parse(R"({"group": "g", "node": "a", "self": "x", "replica_to": "x"})");
  CHECK(self.status().code() == StatusCode::kInvalidArgument);
  auto mode = parse(R"({"group": "g", "node": "a", "file_mode": 256})");
  CHECK(mode.status().message().find("file_mode") != std::string::npos);
  CHECK(parse(R"({"group": "bad name", "node": "a"})").status().code() != StatusCode::kOk);
  // JSON itself is not the actor's init args: the driver encodes it (troupe/actors/init_args.h).
  auto raw = parseOptions(R"({"group": "g", "node": "a"})");
  CHECK(raw.status().code() == StatusCode::kInvalidArgument);
  CHECK(raw.status().message().find("not a CheckpointArgs message") != std::string::npos);
  auto none = parse(R"({"group": "g", "node": "a", "replica_to": "", "members": ["x", "y"], "self": "x"})");
  REQUIRE(none.isOk());
  CHECK(none->replicaTo.empty());  // "" turns replicas off; absent picks the next member
}

TEST_CASE("held replicas: an image is held once committed, and only as what was announced") {
  ScratchDir shm("/dev/shm");
  Options options = optionsIn(shm);
  SegmentCache cache(options);
  HeldReplicas held(options);
  TestState state(0, 1);
  state.fill(10);
  auto image = ck::testing::imageOf(state, state.layout(), {10, 1, 2}, "meta");
  capnp::Data::Reader bytes(image.data(), image.size());

  // Rank 1's image announced as rank 0's: written, then refused at commit.
  auto slot = held.begin(0, 10, image.size());
  REQUIRE(slot.isOk());
  CHECK(held.write(0, *slot, 10, 0, bytes).isOk());
  auto wrong = held.commit(0, *slot, 10);
  CHECK(wrong.status().code() == StatusCode::kInvalidArgument);
  CHECK(wrong.status().message().find("holds rank 1 step 10") != std::string::npos);
  CHECK(held.held().empty());
  CHECK(heldSnapshots(options, cache).empty());

  // Announced truthfully: held, and listed as a replica.
  slot = held.begin(1, 10, image.size());
  REQUIRE(slot.isOk());
  CHECK(held.write(1, *slot, 10, 0, bytes).isOk());
  CHECK(held.write(1, *slot, 10, image.size() - 2, capnp::Data::Reader(image.data(), 4)).code() ==
        StatusCode::kInvalidArgument);
  auto committed = held.commit(1, *slot, 10);
  REQUIRE(committed.isOk());
  CHECK(*committed == 10);
  // A commit repeated (a sender that retries) is refused and leaves the replica held.
  CHECK(held.commit(1, *slot, 10).status().code() == StatusCode::kFailedPrecondition);
  CHECK(held.held() == std::map<uint32_t, uint64_t>{{1, 10}});
  auto listed = heldSnapshots(options, cache);
  REQUIRE(listed.size() == 1);
  CHECK(listed[0].rank == 1);
  CHECK(listed[0].replica);
  CHECK(listed[0].imageBytes == image.size());

  // Read back in two pieces, and past the end.
  auto head = readHeld(options, cache, /*replica=*/true, 1, 10, 0, 100);
  REQUIRE(head.isOk());
  CHECK(std::memcmp(head->data(), image.data(), 100) == 0);
  CHECK(readHeld(options, cache, true, 1, 10, image.size() - 1, 2).status().code() == StatusCode::kInvalidArgument);
  CHECK(readHeld(options, cache, true, 1, 11, 0, 1).status().code() == StatusCode::kNotFound);
  CHECK(readHeld(options, cache, false, 1, 10, 0, 1).status().code() == StatusCode::kNotFound);

  // Pinned twice: the same answer.
  CHECK(*held.pin(1, 10) == 10);
  CHECK(*held.pin(1, 10) == 10);
  CHECK(held.pinned() == std::map<uint32_t, uint64_t>{{1, 10}});
  // After the mappings go (an actor restarted), the replica segment is found again.
  held.clear();
  CHECK(*held.pin(1, 10) == 10);
  CHECK(held.pin(5, 10).status().code() == StatusCode::kFailedPrecondition);  // no segment of rank 5
}

TEST_CASE("checkpoint peers: deadlines on the actor's loop; without a cluster every peer call fails") {
  auto io = kj::setupAsyncIo();
  CheckpointPeers peers(nullptr, io.provider->getTimer());
  CHECK_FALSE(peers.connected());
  auto start = std::chrono::steady_clock::now();
  peers.after(std::chrono::milliseconds(20)).wait(io.waitScope);
  CHECK(std::chrono::steady_clock::now() - start >= std::chrono::milliseconds(20));

  // A call that never answers times out, naming the call; one that answers is not held back.
  auto never = kj::newPromiseAndFulfiller<int>();
  auto late = peers.withTimeout(kj::mv(never.promise), std::chrono::milliseconds(30), "replicaWrite");
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() { late.wait(io.waitScope); })) {
    CHECK(std::string(e->getDescription().cStr()).find("replicaWrite timed out after 30 ms") != std::string::npos);
  } else {
    FAIL("a call that never answers did not time out");
  }
  CHECK(peers.withTimeout(kj::Promise<int>(7), std::chrono::seconds(60), "read").wait(io.waitScope) == 7);

  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() { peers.checkpoint("ck-b").wait(io.waitScope); })) {
    CHECK(std::string(e->getDescription().cStr()).find("no cluster connection") != std::string::npos);
  } else {
    FAIL("a peer was found without a cluster");
  }
}

TEST_CASE("checkpoint actor: needs its loop's timer; a caller holding its interface after it ended gets UNAVAILABLE") {
  auto io = kj::setupAsyncIo();
  ScratchDir shm;
  ActorRegistry registry;
  registerCheckpointActor(registry);
  auto encoded = encodeInitArgs("Checkpoint", R"({"group": "g1", "node": "a", "self": "ck-a", "shm_dir": ")" + shm.str() + R"("})");
  REQUIRE(encoded.isOk());
  std::string args = *encoded;
  ActorContext context;
  context.type = "Checkpoint";
  auto refused = registry.create(context, args);
  REQUIRE_FALSE(refused.isOk());
  CHECK(refused.status().code() == StatusCode::kFailedPrecondition);

  context.timer = &io.provider->getTimer();
  auto actor = registry.create(context, args);
  REQUIRE(actor.isOk());
  auto cap = (*actor)->typed();
  REQUIRE(cap != nullptr);
  auto checkpoint = KJ_ASSERT_NONNULL(cap).castAs<rpc::Checkpoint>();
  auto attach = [&]() {
    auto request = checkpoint.attachRequest();
    request.setRank(0);
    return request.send();
  };
  CHECK(std::string(attach().wait(io.waitScope).getShmDir().cStr()) == shm.str());

  actor->reset();
  Status status;
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() { attach().wait(io.waitScope); })) {
    status = statusFromException(*e, "");
  }
  CHECK(status.code() == StatusCode::kUnavailable);
  CHECK(status.message().find("the Checkpoint actor has ended") != std::string::npos);
}

}  // namespace
}  // namespace troupe::actors::checkpoint_actor
