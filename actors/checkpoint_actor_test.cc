// Checkpoint actors as real processes: a real redis-server, controller, two node agents (two
// "nodes" on this machine), Checkpoint actors on each, and checkpoint_writer processes standing in
// for trainers. Faults are injected through the library's seam and processes killed with -9.
// The actors are called through their typed interface (rpc::Checkpoint), as trainers and peers
// call them; the generic path (the Python driver's) is checked at the end.
#include <doctest/doctest.h>
#include <sys/mount.h>

#include <cstring>
#include <fstream>

#include <capnp/serialize.h>
#include <nlohmann/json.hpp>

#include "checkpoint.capnp.h"
#include "troupe/checkpoint/testing.h"
#include "troupe/testing/cluster_fixture.h"
#include "troupe/actors/init_args.h"
#include "troupe/checkpoint/checkpoint_dir.h"
#include "troupe/checkpoint/flash_segment.h"
#include "troupe/runtime/client.h"

namespace troupe {
namespace {

namespace ck = troupe::checkpoint;
namespace fs = std::filesystem;
using ck::testing::ScratchDir;
using ck::testing::TestState;
using nlohmann::json;
using testing::eventually;

constexpr uint64_t kBytes = 4 << 20;  // the large tensor of each test state

// A tmpfs mounted (as root) for the length of a test; unmounted even when the test fails.
class TmpfsMount {
 public:
  TmpfsMount(const std::string& path, const std::string& size) : path_(path) {
    mounted_ = geteuid() == 0 && mount("tmpfs", path.c_str(), "tmpfs", 0, ("size=" + size).c_str()) == 0;
  }
  ~TmpfsMount() {
    if (mounted_) umount2(path_.c_str(), MNT_DETACH);
  }
  bool mounted() const { return mounted_; }

 private:
  std::string path_;
  bool mounted_ = false;
};

struct CheckpointCluster {
  testing::Cluster cluster{1000};
  std::vector<NodeId> nodes;
  kj::Own<ClusterClient> client;
  ScratchDir shm{"/dev/shm"};
  ScratchDir disk;
  std::string group = "g" + randomHex(3);

  CheckpointCluster() {
    cluster.startController();
    nodes.push_back(cluster.startNode(2, "ckA=1"));
    nodes.push_back(cluster.startNode(2, "ckB=1"));
    client = ClusterClient::connect(io(), cluster.controllerAddress(), cluster.token()).wait(io().waitScope);
  }
  kj::AsyncIoContext& io() { return cluster.io(); }
  template <typename T>
  T wait(kj::Promise<T>&& p) {
    return p.wait(io().waitScope);
  }

  // A Checkpoint actor named `name` on node "a" (resource ckA) or "b" (ckB).
  ActorHandle actor(const std::string& name, const std::string& node, json args = json::object()) {
    args["group"] = group;
    args["node"] = node;
    args["self"] = name;
    args["shm_dir"] = shm.str();
    if (!args.contains("members")) args["members"] = json::array({name});
    ActorOptions o;
    o.type = "Checkpoint";
    o.name = name;
    o.resources = {{"CPU", 0.5}, {node == "a" ? "ckA" : "ckB", 0.5}};
    auto encoded = actors::encodeInitArgs(o.type, args.dump());
    REQUIRE(encoded.isOk());
    o.initArgs = *encoded;
    return wait(client->createActor(o));
  }
  // Calls `method` through rpc::Checkpoint with the arguments in `args` and shows the results as
  // JSON (the tests' view: ranks as keys of "persisted" and the like).
  json call(ActorHandle& actor, const std::string& method, const json& args = json::object()) {
    auto c = wait(actor.typed<actors::rpc::Checkpoint>());
    auto rankSteps = [](capnp::List<actors::rpc::RankStep>::Reader list) {
      json out = json::object();
      for (auto e : list) out[std::to_string(e.getRank())] = e.getStep();
      return out;
    };
    auto texts = [](capnp::List<capnp::Text>::Reader list) {
      json out = json::array();
      for (auto t : list) out.push_back(t.cStr());
      return out;
    };
    auto state = [](actors::rpc::JobState s) {
      return s == actors::rpc::JobState::RUNNING ? "running" : s == actors::rpc::JobState::DONE ? "done" : "none";
    };
    if (method == "attach") {
      auto r = c.attachRequest();
      r.setRank(args.at("rank"));
      auto reply = wait(r.send());
      return json{{"segment", reply.getSegment().cStr()}, {"shm_dir", reply.getShmDir().cStr()}};
    }
    if (method == "saved") {
      auto r = c.savedRequest();
      r.setRank(args.at("rank"));
      r.setStep(args.at("step"));
      wait(r.send());
      return json::object();
    }
    if (method == "status") {
      auto reply = wait(c.statusRequest().send());
      auto s = reply.getStatus();
      return json{{"pid", s.getPid()},
                  {"group", s.getGroup().cStr()},
                  {"node", s.getNode().cStr()},
                  {"persisted", rankSteps(s.getPersisted())},
                  {"persist_errors", texts(s.getPersistErrors())},
                  {"replicated", rankSteps(s.getReplicated())},
                  {"replica_errors", texts(s.getReplicaErrors())},
                  {"replicas_held", rankSteps(s.getReplicasHeld())},
                  {"replicas_pinned", rankSteps(s.getReplicasPinned())}};
    }
    if (method == "inventory") {
      auto reply = wait(c.inventoryRequest().send());
      json holdings = json::array();
      for (auto h : reply.getHoldings()) {
        holdings.push_back({{"rank", h.getRank()},
                            {"step", h.getStep()},
                            {"world_size", h.getWorldSize()},
                            {"kind", h.getKind() == actors::rpc::SnapshotKind::REPLICA ? "replica" : "memory"},
                            {"image_bytes", h.getImageBytes()}});
      }
      return json{{"actor", reply.getActor().cStr()}, {"node", reply.getNode().cStr()}, {"holdings", holdings}};
    }
    if (method == "restore") {
      auto r = c.restoreRequest();
      r.setRank(args.at("rank"));
      if (args.contains("max_step")) r.setMaxStep(args.at("max_step"));
      auto reply = wait(r.send());
      json out{{"state", state(reply.getState())}, {"skipped", texts(reply.getSkipped())}};
      if (reply.getState() == actors::rpc::JobState::DONE) {
        out["step"] = reply.getStep();
        out["source"] = reply.getSource().cStr();
        out["segment"] = reply.getSegment().cStr();
      }
      return out;
    }
    if (method == "release") return json{{"removed", texts(wait(c.releaseRequest().send()).getRemoved())}};
    if (method == "read") {
      auto r = c.readRequest();
      r.setKind(args.at("kind") == "replica" ? actors::rpc::SnapshotKind::REPLICA : actors::rpc::SnapshotKind::MEMORY);
      r.setRank(args.at("rank"));
      r.setStep(args.at("step"));
      r.setOffset(args.at("offset"));
      r.setLength(args.at("length"));
      return json{{"bytes", wait(r.send()).getData().size()}};
    }
    if (method == "replicaBegin") {
      auto r = c.replicaBeginRequest();
      r.setRank(args.at("rank"));
      r.setStep(args.at("step"));
      r.setImageBytes(args.at("image_bytes"));
      return json{{"slot", wait(r.send()).getSlot()}};
    }
    if (method == "replicaCommit") {
      auto r = c.replicaCommitRequest();
      r.setRank(args.at("rank"));
      r.setSlot(args.value("slot", 0u));
      r.setStep(args.at("step"));
      return json{{"step", wait(r.send()).getStep()}};
    }
    FAIL("the test calls no method '" << method << "'");
    return json();
  }
  std::string error(ActorHandle& actor, const std::string& method, const json& args) {
    std::string out = "(no error)";
    KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() { call(actor, method, args); })) {
      out = e->getDescription().cStr();
    }
    return out;
  }
  // A replica chunk, as a peer sends it.
  std::string write(ActorHandle& actor, uint32_t rank, uint32_t slot, uint64_t step, uint64_t offset,
                    std::string_view bytes) {
    std::string out = "(no error)";
    KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
      auto r = wait(actor.typed<actors::rpc::Checkpoint>()).replicaWriteRequest();
      r.setRank(rank);
      r.setSlot(slot);
      r.setStep(step);
      r.setOffset(offset);
      r.setData(kj::arrayPtr(reinterpret_cast<const kj::byte*>(bytes.data()), bytes.size()));
      wait(r.send());
    })) {
      out = e->getDescription().cStr();
    }
    return out;
  }
  // Polls restore until it is not running (the actor stages in the background).
  json restore(ActorHandle& actor, uint32_t rank, json extra = json::object()) {
    extra["rank"] = rank;
    json reply;
    REQUIRE(eventually(std::chrono::seconds(30), [&]() {
      reply = call(actor, "restore", extra);
      return reply["state"] != "running";
    }));
    return reply;
  }

  // Runs checkpoint_writer for `steps` ("10,20") of `rank` into `segment`.
  ChildProcess writer(const std::string& segment, uint32_t rank, uint32_t world, const std::string& steps,
                      const std::string& fault = "", const std::string& shmDir = "") {
    const char* bin = std::getenv("TROUPE_CHECKPOINT_WRITER");
    REQUIRE(bin != nullptr);
    SpawnOptions o;
    o.argv = {bin,         "--shm-dir", shmDir.empty() ? shm.str() : shmDir, "--segment", segment, "--rank",
              std::to_string(rank), "--world-size", std::to_string(world), "--steps", steps, "--bytes",
              std::to_string(kBytes)};
    o.outputPath = writerLog(segment);
    o.env = {"TROUPE_CHECKPOINT_FAULT=" + fault};
    fs::remove(o.outputPath);
    return ChildProcess(*spawnProcess(o));
  }
  std::string writerLog(const std::string& segment) { return (cluster.runDir() / ("writer-" + segment + ".log")).string(); }
  void runWriter(const std::string& segment, uint32_t rank, uint32_t world, const std::string& steps) {
    auto w = writer(segment, rank, world, steps);
    auto exit = w.wait(std::chrono::seconds(30));
    REQUIRE(exit.has_value());
    INFO(readFile(writerLog(segment)));
    REQUIRE(exit->exitCode == 0);
  }
  static std::string readFile(const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  // The snapshot of `step` in segment `name`, read and checked as a trainer would.
  bool segmentHolds(const std::string& name, uint32_t rank, uint64_t step) {
    ck::SegmentOptions o;
    o.dir = shm.str();
    o.name = name;
    auto segment = ck::FlashSegment::openExisting(o);
    if (!segment.isOk()) return false;
    auto slot = segment->completeAt(step);
    if (!slot) return false;
    TestState state(kBytes, rank);
    auto header = segment->restoreInto(*slot, state.targets());
    return header.isOk() && header->stamp.rank == rank && state.holds(step);
  }
  // The actor's log (its stderr), for failure messages.
  std::string actorLog(const ActorHandle& actor) {
    return readFile((cluster.runDir() / "logs" / ("actor-" + actor.id().hex() + ".err")).string());
  }
  std::vector<std::string> groupSegments() {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(shm.path())) {
      std::string name = e.path().filename().string();
      if (name.rfind("troupe_ckpt." + group + ".", 0) == 0) out.push_back(name);
    }
    return out;
  }
  std::vector<std::string> tempFiles(const fs::path& root) {
    std::vector<std::string> out;
    std::error_code ec;
    for (const auto& e : fs::recursive_directory_iterator(root, ec)) {  // none while root does not exist
      if (e.path().filename().string().find(".tmp.") != std::string::npos) out.push_back(e.path().string());
    }
    return out;
  }
};

TEST_CASE("checkpoint actors: persist in the background, replicate to the peer, restore, release") {
  CheckpointCluster c;
  json members = json::array({"ck-a", "ck-b"});
  auto a = c.actor("ck-a", "a", {{"dir", c.disk.str()}, {"members", members}});
  auto b = c.actor("ck-b", "b", {{"dir", c.disk.str()}, {"members", members}});
  std::string segA = c.call(a, "attach", {{"rank", 0}})["segment"];
  std::string segB = c.call(b, "attach", {{"rank", 1}})["segment"];
  CHECK(segA == "troupe_ckpt." + c.group + ".a.r0");
  c.runWriter(segA, 0, 2, "10");
  c.runWriter(segB, 1, 2, "10");
  c.call(a, "saved", {{"rank", 0}, {"step", 10}});
  c.call(b, "saved", {{"rank", 1}, {"step", 10}});
  // Each actor persists its rank; the second to finish writes the manifest. Each sends its rank
  // to the other as a replica.
  REQUIRE(eventually(std::chrono::seconds(30), [&]() {
    json sa = c.call(a, "status"), sb = c.call(b, "status");
    return sa["persisted"].value("0", 0) == 10 && sb["persisted"].value("1", 0) == 10 &&
           sa["replicated"].value("0", 0) == 10 && sb["replicas_held"].value("0", 0) == 10 &&
           sa["replicas_held"].value("1", 0) == 10;
  }));
  ck::CheckpointDirectory dir(ck::DirectoryOptions{c.disk.str(), 3, {}, nullptr});
  REQUIRE(eventually(std::chrono::seconds(10), [&]() { return dir.latest() == 10u; }));
  CHECK(*dir.completeSteps() == std::vector<uint64_t>{10});
  CHECK(dir.readManifest(10)->worldSize == 2);
  json inventory = c.call(b, "inventory");
  int replicas = 0;
  for (const auto& h : inventory["holdings"]) replicas += h["kind"] == "replica" && h["rank"] == 0 && h["step"] == 10;
  CHECK(replicas == 1);

  json restored = c.restore(a, 0);
  CHECK(restored["state"] == "done");
  CHECK(restored["step"] == 10);
  CHECK(restored["source"] == "memory");
  CHECK(c.segmentHolds(segA, 0, 10));
  CHECK(c.segmentHolds("troupe_ckpt." + c.group + ".b.replica.r0", 0, 10));

  // The group ends: nothing of it is left in shared memory or as a temporary file.
  CHECK(c.call(a, "release")["removed"].size() >= 2);
  c.call(b, "release");
  CHECK(c.groupSegments().empty());
  CHECK(c.tempFiles(c.disk.path()).empty());
  CHECK(dir.latest() == 10u);  // the persisted checkpoint stays
}

TEST_CASE("checkpoint actors: kill -9 of the writer in the middle of a snapshot restores the previous step") {
  CheckpointCluster c;
  auto a = c.actor("ck-a", "a");
  std::string seg = c.call(a, "attach", {{"rank", 0}})["segment"];
  c.runWriter(seg, 0, 1, "10");
  c.call(a, "saved", {{"rank", 0}, {"step", 10}});
  auto torn = c.writer(seg, 0, 1, "20", "snapshot:step=20:after=1048576");
  REQUIRE(eventually(std::chrono::seconds(20), [&]() {
    return c.readFile(c.writerLog(seg)).find("snapshot of step 20 paused after") != std::string::npos;
  }));
  torn.stop(SIGKILL, std::chrono::seconds(5));

  json restored = c.restore(a, 0);
  CHECK(restored["state"] == "done");
  CHECK(restored["step"] == 10);
  CHECK(c.segmentHolds(seg, 0, 10));
  ck::SegmentOptions o;
  o.dir = c.shm.str();
  o.name = seg;
  auto segment = ck::FlashSegment::openExisting(o);
  REQUIRE(segment.isOk());
  int writing = 0;
  for (const auto& slot : segment->slots()) writing += slot.state == ck::SlotState::kWriting;
  CHECK(writing == 1);  // the torn copy is there, and never loaded
  c.call(a, "release");
}

TEST_CASE("checkpoint actors: kill -9 of the actor during a persist keeps the previous step; the partial file is ignored and cleaned") {
  CheckpointCluster c;
  auto a = c.actor("ck-a", "a", {{"dir", c.disk.str()}, {"fault", "persist:step=20:after=1048576"}});
  std::string seg = c.call(a, "attach", {{"rank", 0}})["segment"];
  c.runWriter(seg, 0, 1, "10");
  c.call(a, "saved", {{"rank", 0}, {"step", 10}});
  REQUIRE(eventually(std::chrono::seconds(20), [&]() { return c.call(a, "status")["persisted"].value("0", 0) == 10; }));
  c.runWriter(seg, 0, 1, "20");
  c.call(a, "saved", {{"rank", 0}, {"step", 20}});
  ck::CheckpointDirectory dir(ck::DirectoryOptions{c.disk.str(), 3, {}, nullptr});
  REQUIRE(eventually(std::chrono::seconds(20), [&]() {
    auto temps = c.tempFiles(dir.stepPath(20));
    return temps.size() == 1 && fs::file_size(temps[0]) >= (1u << 20);
  }));
  int pid = c.call(a, "status")["pid"];
  REQUIRE(::kill(pid, SIGKILL) == 0);
  REQUIRE(eventually(std::chrono::seconds(10), [&]() {
    return c.wait(c.client->actorInfo(a.id())).state == ActorState::kDead;
  }));

  CHECK(*dir.completeSteps() == std::vector<uint64_t>{10});
  CHECK(dir.latest() == 10u);
  TestState loaded(kBytes, 0);
  auto got = ck::loadRank(dir, 0, [&](size_t i, const ck::TensorSpec&) -> Result<void*> {
    return static_cast<void*>(loaded.data[i].data());
  });
  REQUIRE(got.isOk());
  CHECK(got->step == 10);
  CHECK(loaded.holds(10));
  CHECK(c.tempFiles(c.disk.path()).size() == 1);  // the dead actor's partial file, ignored
  // The segment outlived the actor that owned it.
  CHECK(c.segmentHolds(seg, 0, 20));

  // A new actor for the node removes the partial file at start-up, and persists step 20.
  auto again = c.actor("ck-a2", "a", {{"dir", c.disk.str()}});
  REQUIRE(eventually(std::chrono::seconds(10), [&]() { return c.tempFiles(c.disk.path()).empty(); }));
  c.call(again, "saved", {{"rank", 0}, {"step", 20}});
  REQUIRE(eventually(std::chrono::seconds(20), [&]() { return dir.latest() == 20u; }));
  CHECK(*dir.completeSteps() == std::vector<uint64_t>{20, 10});
  c.call(again, "release");
}

TEST_CASE("checkpoint actors: restore from a peer's replica after the local segment is gone") {
  CheckpointCluster c;
  json members = json::array({"ck-a", "ck-b"});
  auto a = c.actor("ck-a", "a", {{"members", members}});  // no directory: memory tiers only
  auto b = c.actor("ck-b", "b", {{"members", members}});
  std::string seg = c.call(a, "attach", {{"rank", 0}})["segment"];
  c.runWriter(seg, 0, 1, "10");
  c.call(a, "saved", {{"rank", 0}, {"step", 10}});
  REQUIRE(eventually(std::chrono::seconds(20), [&]() { return c.call(a, "status")["replicated"].value("0", 0) == 10; }));

  // Node a's shared memory is lost; its actor fetches the replica node b keeps.
  fs::remove(c.shm.path() / seg);
  json restored = c.restore(a, 0);
  INFO(restored.dump());
  INFO(c.actorLog(a));
  CHECK(restored["state"] == "done");
  CHECK(restored["step"] == 10);
  CHECK(restored["source"] == "peer replica of ck-b");
  CHECK(c.segmentHolds(seg, 0, 10));

  // Node a dies altogether (its agent and actor killed -9); rank 0 moves to node b, whose actor
  // restores from the replica it keeps.
  c.cluster.nodeProcesses()[0].stop(SIGKILL, std::chrono::seconds(5));
  fs::remove(c.shm.path() / seg);
  std::string segOnB = c.call(b, "attach", {{"rank", 0}})["segment"];
  json moved = c.restore(b, 0);
  CHECK(moved["state"] == "done");
  CHECK(moved["step"] == 10);
  CHECK(moved["source"] == "local replica");
  CHECK(c.segmentHolds(segOnB, 0, 10));
  c.call(b, "release");
  CHECK(c.groupSegments().empty());
}

TEST_CASE("checkpoint actors: a rank moved to another node restores from its old node's memory") {
  CheckpointCluster c;
  json members = json::array({"ck-a", "ck-b"});
  auto a = c.actor("ck-a", "a", {{"members", members}, {"replica_to", ""}});  // no replicas
  auto b = c.actor("ck-b", "b", {{"members", members}, {"replica_to", ""}});
  std::string seg = c.call(a, "attach", {{"rank", 0}})["segment"];
  c.runWriter(seg, 0, 1, "10,20");
  std::string segOnB = c.call(b, "attach", {{"rank", 0}})["segment"];
  json moved = c.restore(b, 0);
  CHECK(moved["state"] == "done");
  CHECK(moved["step"] == 20);
  CHECK(moved["source"] == "peer memory of ck-a");
  CHECK(c.segmentHolds(segOnB, 0, 20));
  // Asking for an older step (ranks that restored different steps agree on the smaller one).
  json older = c.restore(b, 0, {{"max_step", 15}});
  CHECK(older["step"] == 10);
  c.call(a, "release");
  c.call(b, "release");
  CHECK(c.groupSegments().empty());
}

TEST_CASE("checkpoint actors: a flipped byte on disk is detected and the older checkpoint used") {
  CheckpointCluster c;
  auto a = c.actor("ck-a", "a", {{"dir", c.disk.str()}});
  std::string seg = c.call(a, "attach", {{"rank", 0}})["segment"];
  ck::CheckpointDirectory dir(ck::DirectoryOptions{c.disk.str(), 3, {}, nullptr});
  for (uint64_t step : {10, 20}) {
    c.runWriter(seg, 0, 1, std::to_string(step));
    c.call(a, "saved", {{"rank", 0}, {"step", step}});
    REQUIRE(eventually(std::chrono::seconds(20), [&]() { return dir.latest() == step; }));
  }
  c.call(a, "release");  // memory gone: only the disk is left
  {
    auto file = ck::RankFile::open(dir.rankPath(20, 0));
    REQUIRE(file.isOk());
    uint64_t at = file->header().layout.tensorOffset(file->header().layout.tensors().size() - 1) + 12345;
    std::fstream f(dir.rankPath(20, 0), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(at));
    char byte = 0;
    f.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x20);
    f.seekp(static_cast<std::streamoff>(at));
    f.write(&byte, 1);
  }
  json restored = c.restore(a, 0);
  CHECK(restored["state"] == "done");
  CHECK(restored["step"] == 10);
  CHECK(restored["source"] == "disk");
  REQUIRE(restored["skipped"].size() == 1);
  std::string why = restored["skipped"][0];
  CHECK(why.find("step 20 from disk") != std::string::npos);
  CHECK(why.find("checksum") != std::string::npos);
  CHECK(c.segmentHolds(seg, 0, 10));
  CHECK(*dir.completeSteps() == std::vector<uint64_t>{10});  // step 20 quarantined for every rank
  c.call(a, "release");
}

TEST_CASE("checkpoint actors: a full disk is reported and loses nothing") {
  CheckpointCluster c;
  TmpfsMount small(c.disk.str(), "6m");
  if (!small.mounted()) {
    MESSAGE("skipped: mounting a tmpfs needs root (the unit tests cover ENOSPC in a private namespace)");
    return;
  }
  auto a = c.actor("ck-a", "a", {{"dir", c.disk.str()}});
  std::string seg = c.call(a, "attach", {{"rank", 0}})["segment"];
  ck::CheckpointDirectory dir(ck::DirectoryOptions{c.disk.str(), 3, {}, nullptr});
  c.runWriter(seg, 0, 1, "10");
  c.call(a, "saved", {{"rank", 0}, {"step", 10}});
  REQUIRE(eventually(std::chrono::seconds(20), [&]() { return dir.latest() == 10u; }));
  c.runWriter(seg, 0, 1, "20");  // a second 4 MiB file does not fit
  c.call(a, "saved", {{"rank", 0}, {"step", 20}});
  json status;
  REQUIRE(eventually(std::chrono::seconds(20), [&]() {
    status = c.call(a, "status");
    return !status["persist_errors"].empty();
  }));
  std::string error = status["persist_errors"][0];
  CHECK(error.find("RESOURCE_EXHAUSTED") != std::string::npos);
  CHECK(error.find("disk full") != std::string::npos);
  CHECK(*dir.completeSteps() == std::vector<uint64_t>{10});
  CHECK(dir.latest() == 10u);
  CHECK(c.tempFiles(c.disk.path()).empty());
  TestState loaded(kBytes, 0);
  auto got = ck::loadRank(dir, 0, [&](size_t i, const ck::TensorSpec&) -> Result<void*> {
    return static_cast<void*>(loaded.data[i].data());
  });
  REQUIRE(got.isOk());
  CHECK(loaded.holds(10));
  // Memory still has the newest step.
  CHECK(c.restore(a, 0)["step"] == 20);
  c.call(a, "release");
}

TEST_CASE("checkpoint actors: too little shared memory is a clear error, not a SIGBUS") {
  CheckpointCluster c;
  fs::create_directories(c.shm.path() / "small");
  TmpfsMount small((c.shm.path() / "small").string(), "4m");
  if (!small.mounted()) {
    MESSAGE("skipped: mounting a tmpfs needs root (the unit tests cover it in a private namespace)");
    return;
  }
  auto w = c.writer("troupe_ckpt.x.a.r0", 0, 1, "10", "", (c.shm.path() / "small").string());
  auto exit = w.wait(std::chrono::seconds(30));
  REQUIRE(exit.has_value());
  std::string out = c.readFile(c.writerLog("troupe_ckpt.x.a.r0"));
  INFO(out);
  CHECK(exit->signal == 0);  // no SIGBUS
  CHECK(exit->exitCode == 1);
  CHECK(out.find("RESOURCE_EXHAUSTED: checkpoint segment") != std::string::npos);
  CHECK(out.find("but only") != std::string::npos);
  CHECK(fs::is_empty(c.shm.path() / "small"));
}

// A replica arrives from a peer: its sizes are checked without arithmetic that wraps, and it is
// held only if its header is the image announced (this rank, this step, these bytes).
TEST_CASE("checkpoint actors: a peer's replica is refused unless it is the image it announced") {
  CheckpointCluster c;
  auto b = c.actor("ck-b", "b");
  int pid = c.call(b, "status")["pid"];
  auto write = [&](uint32_t rank, uint32_t slot, uint64_t step, uint64_t offset, std::string_view bytes) {
    return c.write(b, rank, slot, step, offset, bytes);
  };
  // Two slots of 2^63 bytes wrap to a few pages: the segment was mapped that small, and a write
  // far into the announced image killed the actor (SIGSEGV).
  std::string huge = c.error(b, "replicaBegin", {{"rank", 0}, {"step", 10}, {"image_bytes", uint64_t(1) << 63}});
  CHECK(huge.find("larger than any checkpoint segment holds") != std::string::npos);
  CHECK(write(0, 0, 10, uint64_t(1) << 62, "boom").find("no replica of rank 0 step 10") != std::string::npos);
  CHECK(c.call(b, "status")["pid"] == pid);

  // Rank 1's image, announced as rank 0's: it parses and its checksums hold, but it is not rank 0's.
  TestState state(0, 1);
  state.fill(10);
  auto image = ck::testing::imageOf(state, state.layout(), {10, 1, 2}, "meta");
  std::string_view bytes(reinterpret_cast<const char*>(image.data()), image.size());
  int slot = c.call(b, "replicaBegin", {{"rank", 0}, {"step", 10}, {"image_bytes", image.size()}})["slot"];
  CHECK(write(0, slot, 10, 0, bytes) == "(no error)");
  // Committed under another slot than the one begun: refused before anything is read.
  CHECK(c.error(b, "replicaCommit", {{"rank", 0}, {"slot", slot + 1}, {"step", 10}}).find("no replica of rank 0 step 10")
        != std::string::npos);
  std::string refused = c.error(b, "replicaCommit", {{"rank", 0}, {"slot", slot}, {"step", 10}});
  CHECK(refused.find("holds rank 1 step 10") != std::string::npos);
  CHECK(refused.find("not the rank 0 step 10") != std::string::npos);
  CHECK(c.call(b, "inventory")["holdings"].empty());
  // Announced as a smaller image than its header claims: only the announced bytes are read.
  slot = c.call(b, "replicaBegin", {{"rank", 1}, {"step", 10}, {"image_bytes", ck::kPageBytes}})["slot"];
  CHECK(write(1, slot, 10, 0, bytes.substr(0, ck::kPageBytes)) == "(no error)");
  // A chunk that runs past the announced image is refused, naming the bytes and the image.
  CHECK(write(1, slot, 10, ck::kPageBytes - 2, "four").find("outside the") != std::string::npos);
  CHECK(c.error(b, "replicaCommit", {{"rank", 1}, {"slot", slot}, {"step", 10}}).find("corrupt checkpoint image") != std::string::npos);
  CHECK(c.call(b, "inventory")["holdings"].empty());
  // The same image announced truthfully is held.
  slot = c.call(b, "replicaBegin", {{"rank", 1}, {"step", 10}, {"image_bytes", image.size()}})["slot"];
  CHECK(write(1, slot, 10, 0, bytes) == "(no error)");
  CHECK(c.call(b, "replicaCommit", {{"rank", 1}, {"slot", slot}, {"step", 10}})["step"] == 10);
  json holdings = c.call(b, "inventory")["holdings"];
  REQUIRE(holdings.size() == 1);
  CHECK(holdings[0]["rank"] == 1);
  CHECK(holdings[0]["kind"] == "replica");
  CHECK(c.call(b, "status")["pid"] == pid);
}

TEST_CASE("checkpoint actors: a clean exit removes the node's segments; calls are checked") {
  CheckpointCluster c;
  auto a = c.actor("ck-a", "a");
  std::string seg = c.call(a, "attach", {{"rank", 0}})["segment"];
  c.runWriter(seg, 0, 1, "10");
  CHECK(c.groupSegments().size() == 1);
  CHECK(c.error(a, "read", {{"kind", "memory"}, {"rank", 0}, {"step", 99}, {"offset", 0}, {"length", 1}})
            .find("no longer held") != std::string::npos);
  CHECK(c.error(a, "read", {{"kind", "memory"}, {"rank", 0}, {"step", 10}, {"offset", 0}, {"length", 9 << 20}})
            .find("at most 8388608 per call") != std::string::npos);
  // The generic path (the Python driver's): a method by name, its params as a message.
  auto generic = [&](const std::string& method, std::string payload) {
    std::string out;
    KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() { out = c.wait(a.call(method, kj::mv(payload))); })) {
      out = std::string("error: ") + e->getDescription().cStr();
    }
    return out;
  };
  capnp::MallocMessageBuilder params;
  params.initRoot<actors::rpc::Checkpoint::AttachParams>().setRank(0);
  auto flat = capnp::messageToFlatArray(params);
  std::string encoded(reinterpret_cast<const char*>(flat.asBytes().begin()), flat.asBytes().size());
  std::string reply = generic("attach", encoded);
  REQUIRE(reply.size() % sizeof(capnp::word) == 0);
  auto words = kj::heapArray<capnp::word>(reply.size() / sizeof(capnp::word));
  std::memcpy(words.begin(), reply.data(), reply.size());
  capnp::FlatArrayMessageReader results(words);
  CHECK(std::string(results.getRoot<actors::rpc::Checkpoint::AttachResults>().getSegment().cStr()) == seg);
  CHECK(generic("nope", encoded).find("Checkpoint has no method 'nope' (attach, saved,") != std::string::npos);
  CHECK(generic("attach", "{\"rank\": 0}").find("not whole 8-byte words") != std::string::npos);
  CHECK(generic("attach", encoded.substr(0, 8)).find("Checkpoint.attach: the params are not a message") != std::string::npos);
  int pid = c.call(a, "status")["pid"];
  REQUIRE(::kill(pid, SIGTERM) == 0);
  CHECK(eventually(std::chrono::seconds(10), [&]() { return c.groupSegments().empty(); }));
}

}  // namespace
}  // namespace troupe
