#include "troupe/checkpoint/flash_segment.h"

#include <doctest/doctest.h>
#include <sys/resource.h>

#include <fstream>

#include "troupe/checkpoint/testing.h"

namespace troupe::checkpoint {
namespace {

using testing::Child;
using testing::ScratchDir;
using testing::TestState;

SegmentOptions optionsIn(const ScratchDir& dir, std::string name = "troupe_ckpt.test.n.r0") {
  SegmentOptions o;
  o.dir = dir.str();
  o.name = std::move(name);
  o.fault = {};
  return o;
}

// Saves `state` filled for `step` through `segment`; the slot it used.
SlotInfo saveStep(FlashSegment& segment, TestState& state, const ImageLayout& layout, uint64_t step) {
  state.fill(step);
  auto slot = segment.save(layout, {step, 0, 1}, state.buffers(), "meta " + std::to_string(step));
  REQUIRE(slot.isOk());
  return *slot;
}

TEST_CASE("flash segment: round trip of many dtypes and shapes, double-buffered") {
  ScratchDir dir("/dev/shm");
  TestState state;
  auto layout = state.layout();
  auto writer = FlashSegment::openForWrite(optionsIn(dir), layout.imageBytes());
  REQUIRE(writer.isOk());
  CHECK(!writer->newestComplete());
  auto first = saveStep(*writer, state, layout, 10);
  auto second = saveStep(*writer, state, layout, 20);
  CHECK(first.index != second.index);  // the previous snapshot is never the one overwritten
  auto third = saveStep(*writer, state, layout, 30);
  CHECK(third.index != first.index);  // an empty slot before any snapshot
  CHECK(third.index != second.index);
  CHECK(saveStep(*writer, state, layout, 40).index == first.index);  // then the oldest
  CHECK(writer->completeAt(20).has_value());
  CHECK(writer->completeAt(30).has_value());

  // Another process's view: a read-only mapping.
  auto reader = FlashSegment::openExisting(optionsIn(dir));
  REQUIRE(reader.isOk());
  auto newest = reader->newestComplete();
  REQUIRE(newest.has_value());
  CHECK(newest->step == 40);
  TestState restored;
  auto header = reader->restoreInto(*newest, restored.targets());
  REQUIRE(header.isOk());
  CHECK(restored.holds(40));
  CHECK(header->meta == "meta 40");
  CHECK(header->layout == layout);
  auto older = reader->newestComplete(29);
  REQUIRE(older.has_value());
  CHECK(older->step == 20);
  REQUIRE(reader->restoreInto(*older, restored.targets()).isOk());
  CHECK(restored.holds(20));
  CHECK(reader->verify(*older).isOk());
}

TEST_CASE("flash segment: the default directory goes through shm_open, and large copies use threads") {
  std::string name = "troupe_ckpt.unit" + randomHex(4) + ".n.r0";
  TestState state(96ull << 20);  // above the threshold for a second copy thread
  auto layout = state.layout();
  SegmentOptions o;
  o.name = name;
  o.dir = "/dev/shm";
  o.fault = {};
  auto writer = FlashSegment::openForWrite(o, layout.imageBytes());
  REQUIRE(writer.isOk());
  CHECK(std::filesystem::exists("/dev/shm/" + name));
  saveStep(*writer, state, layout, 5);
  TestState restored(96ull << 20);
  auto slot = writer->newestComplete();
  REQUIRE(slot.has_value());
  REQUIRE(writer->restoreInto(*slot, restored.targets()).isOk());
  CHECK(restored.holds(5));
  REQUIRE(writer->remove().isOk());
  CHECK(!std::filesystem::exists("/dev/shm/" + name));
}

TEST_CASE("flash segment: one writer at a time; a larger layout re-creates the segment") {
  ScratchDir dir("/dev/shm");
  TestState state;
  auto layout = state.layout();
  auto writer = FlashSegment::openForWrite(optionsIn(dir), layout.imageBytes());
  REQUIRE(writer.isOk());
  saveStep(*writer, state, layout, 1);
  auto second = FlashSegment::openForWrite(optionsIn(dir), layout.imageBytes());
  CHECK(second.status().code() == StatusCode::kFailedPrecondition);
  CHECK(second.status().message().find("being written by another process") != std::string::npos);
  writer = Status(StatusCode::kAborted, "closed");  // releases the lock
  TestState bigger(1 << 20);
  auto biggerLayout = bigger.layout();
  auto grown = FlashSegment::openForWrite(optionsIn(dir), biggerLayout.imageBytes());
  REQUIRE(grown.isOk());
  CHECK(grown->slotCapacity() >= biggerLayout.imageBytes());
  saveStep(*grown, bigger, biggerLayout, 2);
  CHECK(grown->newestComplete()->step == 2);
}

TEST_CASE("flash segment: kill -9 of the writer in the middle of a snapshot leaves the previous one") {
  ScratchDir dir("/dev/shm");
  TestState state(8 << 20);
  auto layout = state.layout();
  Child writer([&]() {
    auto o = optionsIn(dir);
    o.fault = *FaultInjection::parse("snapshot:step=20:after=2097152");
    auto segment = FlashSegment::openForWrite(o, layout.imageBytes());
    if (!segment.isOk()) return 2;
    state.fill(10);
    if (!segment->save(layout, {10, 0, 1}, state.buffers(), "ten").isOk()) return 3;
    state.fill(20);
    (void)segment->save(layout, {20, 0, 1}, state.buffers(), "twenty");  // pauses inside
    return 4;
  });
  REQUIRE(writer.waitForOutput("snapshot of step 20 paused after"));
  writer.kill9();

  auto reader = FlashSegment::openExisting(optionsIn(dir));
  REQUIRE(reader.isOk());
  auto slots = reader->slots();
  int torn = -1;
  for (const auto& s : slots) torn = s.state == SlotState::kWriting ? s.index : torn;
  REQUIRE(torn >= 0);
  CHECK(!slots[torn].complete());
  auto newest = reader->newestComplete();
  REQUIRE(newest.has_value());
  CHECK(newest->step == 10);
  TestState restored(8 << 20);
  REQUIRE(reader->restoreInto(*newest, restored.targets()).isOk());
  CHECK(restored.holds(10));

  // The dead writer's lock is gone; the next save reuses the torn slot and keeps step 10.
  auto next = FlashSegment::openForWrite(optionsIn(dir), layout.imageBytes());
  REQUIRE(next.isOk());
  auto slot = saveStep(*next, state, layout, 30);
  CHECK(slot.index == torn);
  CHECK(next->completeAt(10).has_value());
}

TEST_CASE("flash segment: a reader never takes overwritten or corrupt bytes") {
  ScratchDir dir("/dev/shm");
  TestState state;
  auto layout = state.layout();
  auto writer = FlashSegment::openForWrite(optionsIn(dir), layout.imageBytes());
  REQUIRE(writer.isOk());
  saveStep(*writer, state, layout, 10);
  auto reader = FlashSegment::openExisting(optionsIn(dir), /*writable=*/true);
  REQUIRE(reader.isOk());
  auto ten = *reader->newestComplete();
  saveStep(*writer, state, layout, 20);
  saveStep(*writer, state, layout, 30);
  saveStep(*writer, state, layout, 40);  // reuses step 10's slot
  CHECK(!reader->unchanged(ten));
  TestState restored;
  CHECK(reader->restoreInto(ten, restored.targets()).status().message().find("overwritten") != std::string::npos);
  CHECK(reader->markSlot(ten, SlotState::kCorrupt).code() == StatusCode::kAborted);

  // A flipped byte in the newest snapshot: detected, marked, and the older one is used.
  auto forty = *reader->newestComplete();
  REQUIRE(reader->markSlot(forty, SlotState::kEmpty).isOk());
  auto thirty = *reader->newestComplete();
  reader->mutableSlotData(thirty.index)[layout.tensorOffset(0) + 3] ^= 0x40;
  auto verified = reader->verify(thirty);
  CHECK(verified.status().message().find("weight.f32") != std::string::npos);
  CHECK(reader->restoreInto(thirty, restored.targets()).status().code() == StatusCode::kFailedPrecondition);
  REQUIRE(reader->markSlot(thirty, SlotState::kCorrupt).isOk());
  auto newest = reader->newestComplete();
  REQUIRE(newest.has_value());
  CHECK(newest->step == 20);
  CHECK(reader->slots()[thirty.index].state == SlotState::kCorrupt);
}

TEST_CASE("flash segment: a pinned step survives any number of later saves; a save of an older step drops newer ones") {
  ScratchDir dir("/dev/shm");
  TestState state;
  auto layout = state.layout();
  auto writer = FlashSegment::openForWrite(optionsIn(dir), layout.imageBytes());
  REQUIRE(writer.isOk());
  saveStep(*writer, state, layout, 10);
  CHECK(writer->pin(11).code() == StatusCode::kNotFound);
  REQUIRE(writer->pin(10).isOk());
  for (uint64_t step = 11; step <= 20; ++step) saveStep(*writer, state, layout, step);
  auto ten = writer->completeAt(10);
  REQUIRE(ten.has_value());
  CHECK(ten->pinned);
  CHECK(writer->completeAt(19).has_value());  // and the two newest rotate through the others
  CHECK(writer->completeAt(20).has_value());
  TestState restored;
  REQUIRE(writer->restoreInto(*ten, restored.targets()).isOk());
  CHECK(restored.holds(10));

  // Another process pins (a reader's writable mapping): the pin moves, and step 10 may go.
  auto other = FlashSegment::openExisting(optionsIn(dir), /*writable=*/true);
  REQUIRE(other.isOk());
  REQUIRE(other->pin(20).isOk());
  saveStep(*writer, state, layout, 21);
  saveStep(*writer, state, layout, 22);
  CHECK(!writer->completeAt(10).has_value());
  CHECK(writer->completeAt(20)->pinned);

  // The group went back to step 15 and saves 16 again: what it saved after 15 is dropped.
  other->discardAfter(21);
  CHECK(!writer->completeAt(22).has_value());
  CHECK(writer->newestComplete()->step == 21);
  saveStep(*writer, state, layout, 16);
  CHECK(writer->newestComplete()->step == 16);
  CHECK(!writer->completeAt(20).has_value());
  CHECK(!writer->completeAt(22).has_value());
}

TEST_CASE("flash segment: too little shared memory is a clear error, never a SIGBUS") {
  ScratchDir dir("/dev/shm");
  TestState state(3 << 20);
  auto layout = state.layout();
  SUBCASE("the file size limit stops posix_fallocate") {
    // Under RLIMIT_FSIZE the space check passes but the allocation fails: the second line of
    // defence reports it the same way.
    Child child([&]() {
      signal(SIGXFSZ, SIG_IGN);
      rlimit limit{1 << 20, 1 << 20};
      setrlimit(RLIMIT_FSIZE, &limit);
      auto segment = FlashSegment::openForWrite(optionsIn(dir), layout.imageBytes());
      if (segment.isOk()) return 2;
      fprintf(stderr, "error: %s\n", segment.status().toString().c_str());
      return segment.status().code() == StatusCode::kResourceExhausted ? 0 : 3;
    });
    int rc = child.wait();
    INFO(child.output());
    CHECK(rc == 0);
    CHECK(child.output().find("RESOURCE_EXHAUSTED: checkpoint segment") != std::string::npos);
    CHECK(std::filesystem::is_empty(dir.path()));  // the temporary segment is gone
  }
  SUBCASE("a small tmpfs") {
    if (!testing::canMountTmpfs()) {
      MESSAGE("skipped: cannot mount a tmpfs in a private mount namespace here (needs root)");
      return;
    }
    Child child([&]() {
      return testing::inSmallTmpfs(dir.str(), "4m", [&]() {
        auto segment = FlashSegment::openForWrite(optionsIn(dir), layout.imageBytes());  // needs ~6 MiB
        if (segment.isOk()) return 2;
        fprintf(stderr, "error: %s\n", segment.status().toString().c_str());
        if (segment.status().code() != StatusCode::kResourceExhausted) return 3;
        // A segment that fits is fully allocated up front: filling the tmpfs afterwards cannot
        // make a save fault.
        TestState small(1 << 20);
        auto smallLayout = small.layout();
        auto fits = FlashSegment::openForWrite(optionsIn(dir), smallLayout.imageBytes());
        if (!fits.isOk()) return 4;
        {
          std::ofstream filler(dir.str() + "/filler", std::ios::binary);
          std::string block(1 << 16, 'x');
          while (filler.write(block.data(), static_cast<std::streamsize>(block.size()))) {
          }
        }
        small.fill(1);
        if (!fits->save(smallLayout, {1, 0, 1}, small.buffers(), "").isOk()) return 5;
        fprintf(stderr, "saved into a full tmpfs\n");
        return 0;
      });
    });
    int rc = child.wait();
    INFO(child.output());
    CHECK(rc == 0);
    CHECK(child.output().find("but only") != std::string::npos);
    CHECK(child.output().find("TROUPE_SHM_DIR") != std::string::npos);
    CHECK(child.output().find("saved into a full tmpfs") != std::string::npos);
  }
}

TEST_CASE("flash segment: names, and removing a group's segments") {
  CHECK(*segmentName("job", "node-a", SegmentKind::kPrimary, 3) == "troupe_ckpt.job.node-a.r3");
  CHECK(*segmentName("job", "node-a", SegmentKind::kReplica, 0) == "troupe_ckpt.job.node-a.replica.r0");
  CHECK(segmentName("a.b", "n", SegmentKind::kPrimary, 0).status().code() == StatusCode::kInvalidArgument);
  CHECK(segmentName("g", "", SegmentKind::kPrimary, 0).status().code() == StatusCode::kInvalidArgument);
  ScratchDir dir("/dev/shm");
  TestState state;
  auto layout = state.layout();
  for (const char* name : {"troupe_ckpt.g.a.r0", "troupe_ckpt.g.a.replica.r1", "troupe_ckpt.g.b.r0"}) {
    REQUIRE(FlashSegment::openForWrite(optionsIn(dir, name), layout.imageBytes()).isOk());
  }
  auto removed = removeSegments(dir.str(), segmentPrefix("g", "a"));
  REQUIRE(removed.isOk());
  CHECK(removed->size() == 2);
  CHECK(std::filesystem::exists(dir.path() / "troupe_ckpt.g.b.r0"));
  CHECK(!std::filesystem::exists(dir.path() / "troupe_ckpt.g.a.r0"));
}

}  // namespace
}  // namespace troupe::checkpoint
