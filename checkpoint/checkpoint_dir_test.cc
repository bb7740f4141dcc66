#include "troupe/checkpoint/checkpoint_dir.h"

#include <doctest/doctest.h>
#include <sys/resource.h>

#include <fmt/format.h>

#include <fstream>

#include "troupe/checkpoint/testing.h"

namespace troupe::checkpoint {
namespace {

using testing::Child;
using testing::imageOf;
using testing::ScratchDir;
using testing::TestState;
namespace fs = std::filesystem;

DirectoryOptions optionsFor(const std::string& path, uint32_t keep = 3) {
  DirectoryOptions o;
  o.path = path;
  o.keep = keep;
  o.fault = {};
  return o;
}

Result<PersistOutcome> persist(CheckpointDirectory& dir, TestState& state, uint64_t step, uint32_t rank,
                               uint32_t world) {
  state.fill(step * 10 + rank);
  auto layout = state.layout();
  auto image = imageOf(state, layout, {step, rank, world}, fmt::format("meta {} {}", step, rank));
  PersistRequest request;
  request.stamp = {step, rank, world};
  request.headerCrc = peekImage(image.data(), image.size())->headerCrc;
  request.imageBytes = image.size();
  request.pieces = {ImagePiece{image.data(), image.size()}};
  return dir.persistRank(request);
}

// Loads `rank` into a fresh state; the step loaded (or the error).
Result<LoadedRank> load(const CheckpointDirectory& dir, TestState& into, uint32_t rank, uint64_t maxStep = UINT64_MAX) {
  return loadRank(
      dir, rank, [&](size_t i, const TensorSpec&) -> Result<void*> { return static_cast<void*>(into.data[i].data()); },
      maxStep);
}

std::vector<std::string> tempFiles(const fs::path& root) {
  std::vector<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    if (e.path().filename().string().find(".tmp.") != std::string::npos) out.push_back(e.path().string());
  }
  return out;
}

TEST_CASE("checkpoint dir: a step counts once every rank is persisted; latest and retention follow") {
  ScratchDir scratch;
  CheckpointDirectory dir(optionsFor(scratch.str() + "/ckpt", 2));
  REQUIRE(dir.open().isOk());
  TestState state;
  auto r0 = persist(dir, state, 10, 0, 2);
  REQUIRE(r0.isOk());
  CHECK(!r0->stepComplete);
  CHECK(dir.completeSteps()->empty());  // rank 1 missing: not a checkpoint yet
  CHECK(!dir.latest());
  auto r1 = persist(dir, state, 10, 1, 2);
  REQUIRE(r1.isOk());
  CHECK(r1->stepComplete);
  CHECK(dir.latest() == 10u);
  auto again = persist(dir, state, 10, 1, 2);  // a retried persist writes nothing
  REQUIRE(again.isOk());
  CHECK(again->alreadyPresent);
  for (uint64_t step : {20, 30}) {
    REQUIRE(persist(dir, state, step, 0, 2).isOk());
    REQUIRE(persist(dir, state, step, 1, 2).isOk());
  }
  CHECK(*dir.completeSteps() == std::vector<uint64_t>{30, 20});  // keep = 2
  CHECK(!fs::exists(dir.stepPath(10)));
  CHECK(dir.latest() == 30u);
  auto manifest = dir.readManifest(30);
  REQUIRE(manifest.isOk());
  CHECK(manifest->worldSize == 2);
  CHECK(manifest->ranks[1].file == "rank-00001.tckpt");
  CHECK(tempFiles(scratch.path()).empty());

  TestState loaded;
  auto got = load(dir, loaded, 1);
  REQUIRE(got.isOk());
  CHECK(got->step == 30);
  CHECK(got->header.meta == "meta 30 1");
  CHECK(loaded.holds(301));
  CHECK(load(dir, loaded, 1, 25)->step == 20);
  CHECK(load(dir, loaded, 5).status().code() == StatusCode::kNotFound);
}

TEST_CASE("checkpoint dir: a flipped byte on disk is detected and the older checkpoint used") {
  ScratchDir scratch;
  CheckpointDirectory dir(optionsFor(scratch.str()));
  REQUIRE(dir.open().isOk());
  TestState state;
  REQUIRE(persist(dir, state, 10, 0, 1).isOk());
  REQUIRE(persist(dir, state, 20, 0, 1).isOk());
  {
    std::fstream f(dir.rankPath(20, 0), std::ios::in | std::ios::out | std::ios::binary);
    auto header = RankFile::open(dir.rankPath(20, 0));
    REQUIRE(header.isOk());
    f.seekg(static_cast<std::streamoff>(header->header().layout.tensorOffset(7) + 100));
    char c = 0;
    f.read(&c, 1);
    c ^= 0x04;
    f.seekp(static_cast<std::streamoff>(header->header().layout.tensorOffset(7) + 100));
    f.write(&c, 1);
  }
  TestState loaded;
  auto got = load(dir, loaded, 0);
  REQUIRE(got.isOk());
  CHECK(got->step == 10);
  CHECK(loaded.holds(100));
  REQUIRE(got->skipped.size() == 1);
  CHECK(got->skipped[0].find("step 20") != std::string::npos);
  CHECK(got->skipped[0].find("tensor 'bytes' checksum") != std::string::npos);

  // Quarantine makes every later reader skip the step, and `latest` stops naming it.
  REQUIRE(dir.quarantine(20).isOk());
  CHECK(*dir.completeSteps() == std::vector<uint64_t>{10});
  CHECK(dir.latest() == 10u);
  CHECK(fs::exists(dir.stepPath(20) + "/MANIFEST.json.corrupt"));
}

TEST_CASE("checkpoint dir: a rank file replaced after its manifest is refused; partial later steps dropped") {
  ScratchDir scratch;
  CheckpointDirectory dir(optionsFor(scratch.str()));
  REQUIRE(dir.open().isOk());
  TestState state;
  REQUIRE(persist(dir, state, 10, 0, 1).isOk());
  REQUIRE(persist(dir, state, 20, 0, 1).isOk());
  fs::copy_file(dir.rankPath(10, 0), dir.rankPath(20, 0), fs::copy_options::overwrite_existing);
  TestState loaded;
  auto got = load(dir, loaded, 0);
  REQUIRE(got.isOk());
  CHECK(got->step == 10);
  CHECK(got->skipped.at(0).find("not the one its manifest recorded") != std::string::npos);

  REQUIRE(persist(dir, state, 30, 0, 2).isOk());  // rank 1 of step 30 never arrives
  REQUIRE(dir.dropIncompleteAfter(20).isOk());
  CHECK(!fs::exists(dir.stepPath(30)));
  CHECK(fs::exists(dir.stepPath(20)));
}

TEST_CASE("checkpoint dir: a source overwritten during the persist is discarded") {
  ScratchDir scratch;
  CheckpointDirectory dir(optionsFor(scratch.str()));
  REQUIRE(dir.open().isOk());
  TestState state;
  state.fill(1);
  auto layout = state.layout();
  auto image = imageOf(state, layout, {5, 0, 1}, "");
  PersistRequest request;
  request.stamp = {5, 0, 1};
  request.headerCrc = peekImage(image.data(), image.size())->headerCrc;
  request.imageBytes = image.size();
  request.pieces = {ImagePiece{image.data(), 4096}, ImagePiece{image.data() + 4096, image.size() - 4096}};
  request.stillValid = []() { return false; };
  CHECK(dir.persistRank(request).status().code() == StatusCode::kAborted);
  CHECK(!fs::exists(dir.rankPath(5, 0)));
  CHECK(tempFiles(scratch.path()).empty());
  request.stillValid = {};
  REQUIRE(dir.persistRank(request).isOk());
  CHECK(*dir.completeSteps() == std::vector<uint64_t>{5});
}

TEST_CASE("checkpoint dir: kill -9 in the middle of a persist leaves the previous step; the partial file is ignored and removed") {
  ScratchDir scratch;
  TestState state(4 << 20);
  {
    CheckpointDirectory dir(optionsFor(scratch.str()));
    REQUIRE(dir.open().isOk());
    REQUIRE(persist(dir, state, 10, 0, 1).isOk());
  }
  Child persister([&]() {
    auto o = optionsFor(scratch.str());
    o.fault = *FaultInjection::parse("persist:step=20:after=1048576");
    CheckpointDirectory dir(o);
    (void)persist(dir, state, 20, 0, 1);  // pauses half-way
    return 2;
  });
  REQUIRE(persister.waitForOutput("persist of step 20 paused after"));
  auto temps = tempFiles(scratch.path());
  REQUIRE(temps.size() == 1);
  CHECK(fs::file_size(temps[0]) >= (1u << 20));
  persister.kill9();

  CheckpointDirectory dir(optionsFor(scratch.str()));
  CHECK(*dir.completeSteps() == std::vector<uint64_t>{10});
  TestState loaded(4 << 20);
  auto got = load(dir, loaded, 0);
  REQUIRE(got.isOk());
  CHECK(got->step == 10);
  CHECK(loaded.holds(100));
  REQUIRE(dir.open().isOk());  // start-up removes what the dead process left
  CHECK(tempFiles(scratch.path()).empty());
  REQUIRE(persist(dir, state, 20, 0, 1).isOk());
  CHECK(dir.latest() == 20u);
}

TEST_CASE("checkpoint dir: a full disk reports an error and loses nothing") {
  ScratchDir scratch;
  TestState state(4 << 20);
  auto check = [&](Child& child) {
    int rc = child.wait();
    INFO(child.output());
    CHECK(rc == 0);
    CHECK(child.output().find("RESOURCE_EXHAUSTED") != std::string::npos);
  };
  SUBCASE("file size limit (RLIMIT_FSIZE)") {
    {
      CheckpointDirectory dir(optionsFor(scratch.str()));
      REQUIRE(dir.open().isOk());
      REQUIRE(persist(dir, state, 10, 0, 1).isOk());
    }
    Child child([&]() {
      signal(SIGXFSZ, SIG_IGN);
      rlimit limit{2 << 20, 2 << 20};
      setrlimit(RLIMIT_FSIZE, &limit);
      CheckpointDirectory dir(optionsFor(scratch.str()));
      auto r = persist(dir, state, 20, 0, 1);
      if (r.isOk()) return 2;
      fprintf(stderr, "%s\n", r.status().toString().c_str());
      return r.status().code() == StatusCode::kResourceExhausted ? 0 : 3;
    });
    check(child);
    CHECK(child.output().find("file size limit") != std::string::npos);
  }
  SUBCASE("a small filesystem (ENOSPC)") {
    if (!testing::canMountTmpfs()) {
      MESSAGE("skipped: cannot mount a tmpfs in a private mount namespace here (needs root)");
      return;
    }
    Child child([&]() {
      return testing::inSmallTmpfs(scratch.str(), "6m", [&]() {
        CheckpointDirectory dir(optionsFor(scratch.str()));
        if (!dir.open().isOk() || !persist(dir, state, 10, 0, 1).isOk()) return 2;  // ~4 MiB fits
        auto r = persist(dir, state, 20, 0, 1);                                     // the next does not
        if (r.isOk()) return 3;
        fprintf(stderr, "%s\n", r.status().toString().c_str());
        if (r.status().code() != StatusCode::kResourceExhausted) return 4;
        if (!tempFiles(scratch.path()).empty()) return 5;
        if (*dir.completeSteps() != std::vector<uint64_t>{10} || dir.latest() != 10u) return 6;
        TestState loaded(4 << 20);
        auto got = load(dir, loaded, 0);
        if (!got.isOk() || got->step != 10 || !loaded.holds(100)) return 7;
        return 0;
      });
    });
    check(child);
    CHECK(child.output().find("disk full") != std::string::npos);
    return;
  }
  // After the file size limit: nothing half-written, step 10 intact.
  CheckpointDirectory dir(optionsFor(scratch.str()));
  CHECK(tempFiles(scratch.path()).empty());
  CHECK(*dir.completeSteps() == std::vector<uint64_t>{10});
  TestState loaded(4 << 20);
  auto got = load(dir, loaded, 0);
  REQUIRE(got.isOk());
  CHECK(got->step == 10);
  CHECK(loaded.holds(100));
}

}  // namespace
}  // namespace troupe::checkpoint

namespace troupe::checkpoint {
namespace {

TEST_CASE("checkpoint dir: snapshots persist straight from shared memory; plain buffers give the same file") {
  testing::ScratchDir scratch;
  testing::ScratchDir shm("/dev/shm");
  CheckpointDirectory dir(optionsFor(scratch.str() + "/a"));
  CheckpointDirectory other(optionsFor(scratch.str() + "/b"));
  REQUIRE(dir.open().isOk());
  REQUIRE(other.open().isOk());
  testing::TestState state;
  auto layout = state.layout();
  SegmentOptions o;
  o.dir = shm.str();
  o.name = "troupe_ckpt.g.n.r0";
  o.fault = {};
  auto segment = FlashSegment::openForWrite(o, layout.imageBytes());
  REQUIRE(segment.isOk());
  state.fill(7);
  auto slot = segment->save(layout, {7, 0, 1}, state.buffers(), "m");
  REQUIRE(slot.isOk());
  auto persisted = persistSnapshot(dir, *segment, *slot);
  REQUIRE(persisted.isOk());
  CHECK(persisted->stepComplete);
  REQUIRE(persistTensors(other, layout, {7, 0, 1}, state.buffers(), "m").isOk());
  auto read = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  CHECK(read(dir.rankPath(7, 0)) == read(other.rankPath(7, 0)));
  // A slot overwritten by newer saves is not persisted.
  state.fill(8);
  for (uint64_t step : {8, 9, 10}) REQUIRE(segment->save(layout, {step, 0, 1}, state.buffers(), "").isOk());
  CHECK(persistSnapshot(dir, *segment, *slot).status().code() == StatusCode::kAborted);
}

// A manifest is read from disk: numbers that are floats or out of range are refused, never converted
// (get<uint64_t>() of 1e300 was undefined behaviour; a negative "bytes" wrapped to a huge size).
TEST_CASE("manifest: a crafted MANIFEST.json is refused with a message, never converted") {
  auto manifest = [](const std::string& step, const std::string& world, const std::string& bytes,
                     const std::string& crc = "\"1a2b3c4d\"", const std::string& extra = "") {
    return R"({"format":"troupe-checkpoint","version":1,"step":)" + step + R"(,"world_size":)" + world + extra +
           R"(,"ranks":[{"rank":0,"file":"rank-00000.tckpt","bytes":)" + bytes + R"(,"header_crc":)" + crc + "}]}";
  };
  auto good = parseManifest(manifest("10", "1", "12288"), 10, "m");
  REQUIRE(good.isOk());
  CHECK(good->ranks[0].bytes == 12288);
  CHECK(good->ranks[0].headerCrc == 0x1a2b3c4du);
  auto refused = [&](const std::string& text) {
    auto m = parseManifest(text, 10, "/ck/step-10/MANIFEST.json");
    if (m.isOk()) return std::string("(parsed)");
    CHECK(m.status().code() == StatusCode::kFailedPrecondition);
    return m.status().message();
  };
  CHECK(refused(manifest("1e300", "1", "1")).find("\"step\" is not an integer") != std::string::npos);
  CHECK(refused(manifest("10", "1", "-1e30")).find("\"bytes\" is not an integer") != std::string::npos);
  CHECK(refused(manifest("10", "1", "-1")).find("\"bytes\" is out of range") != std::string::npos);
  CHECK(refused(manifest("10", "4294967296", "1")).find("\"world_size\" is out of range") != std::string::npos);
  CHECK(refused(manifest("10", "2", "1")).find("world size 2 with 1 ranks") != std::string::npos);
  CHECK(refused(manifest("10", "1", "1", "\"123456789\"")).find("header_crc") != std::string::npos);
  CHECK(refused(manifest("10", "1", "1", "\"xyz\"")).find("header_crc") != std::string::npos);
  CHECK(refused(manifest("10", "1", "1", "\"1a\"", R"(,"created_ms":1e300)")).find("created_ms") != std::string::npos);
  CHECK(refused(manifest("11", "1", "1")).find("expected step 10") != std::string::npos);
  CHECK(refused("[1,2]").find("/ck/step-10/MANIFEST.json") != std::string::npos);
  CHECK(refused("{\"format\":") != "(parsed)");
}

}  // namespace
}  // namespace troupe::checkpoint
