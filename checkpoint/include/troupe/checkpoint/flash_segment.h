// FlashSegment: one rank's snapshots in a POSIX shared-memory segment, so a save is a memory copy
// and the snapshot outlives the process that wrote it (the node's checkpoint actor owns it and
// removes it when the group ends).
//
// The segment is a 4 KiB header and three slots, each big enough for one rank image (image.h).
// A save writes neither the slot holding the newest complete snapshot nor the pinned one, so the
// newest stays loadable while the next is written, a save never waits for a persist or replica
// of the previous one, and a step that the whole group holds (the trainers pin the step whose
// replicas every rank has confirmed) survives however fast snapshots come. Each slot carries a sequence number (odd while being written) and a state
// (EMPTY, WRITING, COMPLETE, CORRUPT): a slot torn by a crash stays WRITING and is never loaded;
// a reader that copied a slot checks the sequence number afterwards (a seqlock) and the CRC32C of
// every tensor, so bytes overwritten meanwhile are never taken for a snapshot.
//
// Space is claimed before use: the free space of the segment's filesystem is checked (statvfs),
// then the whole segment is allocated with posix_fallocate and mapped pre-faulted
// (MAP_POPULATE), so a /dev/shm that is too small gives a kResourceExhausted Status, never a
// SIGBUS, and no save pays first-touch page faults.
//
// Thread-safety: an object belongs to one thread. Processes share a segment through the slot
// sequence numbers; one writer at a time holds the segment's flock (released when it dies).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "troupe/checkpoint/fault.h"
#include "troupe/checkpoint/image.h"
#include "troupe/checkpoint/tensor_state.h"
#include "troupe/runtime/status.h"

namespace troupe::checkpoint {

// "/dev/shm/troupe-ckpt-<euid>": this user's directory for segments, made 0700 on first use. A
// segment operation refuses it (kFailedPrecondition, saying what to do) when another user made it.
std::string privateShmDir();
// privateShmDir(), or $TROUPE_SHM_DIR when set (tests point it at a small tmpfs).
std::string defaultShmDir();

enum class SegmentKind { kPrimary, kReplica };
// "troupe_ckpt.<group>.<node>.r<rank>" for the snapshots a rank on `node` wrote, or
// "troupe_ckpt.<group>.<node>.replica.r<rank>" for the copy of another node's rank that `node`
// keeps. `troupe stop` removes the segments its cluster's workers recorded. kInvalidArgument when group or
// node is empty, longer than 64 bytes, or has characters other than [A-Za-z0-9_-].
Result<std::string> segmentName(std::string_view group, std::string_view node, SegmentKind kind, uint32_t rank);
// "troupe_ckpt.<group>.<node>.": every segment of `group` on `node` starts with it.
std::string segmentPrefix(std::string_view group, std::string_view node);

struct SegmentOptions {
  std::string dir;   // empty: defaultShmDir()
  std::string name;  // a file name inside dir (see segmentName)
  FaultInjection fault = FaultInjection::fromEnvironment();
  // Threads copying a large snapshot or restore (the caller's thread and copyThreads - 1 more).
  unsigned copyThreads = 2;
};

enum class SlotState : uint32_t { kEmpty = 0, kWriting = 1, kComplete = 2, kCorrupt = 3 };
const char* slotStateName(SlotState state);

// One slot as read at one moment.
struct SlotInfo {
  int index = -1;
  SlotState state = SlotState::kEmpty;
  uint64_t step = 0;
  uint64_t seq = 0;  // even when stable; changes with every write
  uint64_t imageBytes = 0;
  uint32_t writerPid = 0;
  bool pinned = false;
  bool complete() const { return state == SlotState::kComplete && seq % 2 == 0; }
};

class FlashSegment {
 public:
  static constexpr int kSlotCount = 3;

  FlashSegment(FlashSegment&& other) noexcept;
  FlashSegment& operator=(FlashSegment&& other) noexcept;
  FlashSegment(const FlashSegment&) = delete;
  FlashSegment& operator=(const FlashSegment&) = delete;
  // Unmaps and closes (releasing the writer lock); the segment itself stays until remove().
  ~FlashSegment();

  // Opens the segment for writing images of up to `imageBytes`, creating it, or re-creating it
  // when its slots are too small (created under a temporary name and renamed, so no reader ever
  // sees a half-made segment). Takes the writer lock for this object's lifetime.
  // kResourceExhausted when the filesystem lacks the room (the message gives both sizes and
  // what to do); kFailedPrecondition when another live process holds the writer lock.
  static Result<FlashSegment> openForWrite(const SegmentOptions& options, uint64_t imageBytes);
  // Maps an existing segment without the writer lock: read-only, or writable when the caller
  // must mark slots (markSlot). kNotFound when absent; kFailedPrecondition when not a segment.
  static Result<FlashSegment> openExisting(const SegmentOptions& options, bool writable = false);

  // Writer: snapshots `tensors` (one per layout tensor, in layout order, sizes equal) and `meta`
  // into the slot that does not hold the newest complete snapshot, computing each tensor's
  // CRC32C on the way. kInvalidArgument when a size differs from the layout or `meta` exceeds
  // its capacity; kFailedPrecondition when the layout does not fit the slots.
  Result<SlotInfo> save(const ImageLayout& layout, const ImageStamp& stamp, std::span<const ConstBuffer> tensors,
                        std::string_view meta);

  // Writer, image level (replicas and restores): beginImage marks a slot WRITING (never the
  // newest complete one) and returns it; the caller writes the image into mutableSlotData();
  // commitImage checks the header (and, if asked, every tensor's CRC) and marks it COMPLETE.
  Result<SlotInfo> beginImage(uint64_t imageBytes);
  uint8_t* mutableSlotData(int slot);
  Result<SlotInfo> commitImage(int slot, bool verifyData);

  // Pins the complete slot holding `step` (unpinning any other): saves leave it alone until
  // another step is pinned. Needs a writable mapping. kNotFound when no complete slot holds it.
  Status pin(uint64_t step);

  // Empties the complete slots newer than `step`: the writer's state went back to `step`, and
  // what it saved after it belongs to an abandoned timeline. Needs a writable mapping.
  void discardAfter(uint64_t step);

  std::array<SlotInfo, kSlotCount> slots() const;
  // The complete slot with the highest step not above `maxStep`, if any.
  std::optional<SlotInfo> newestComplete(uint64_t maxStep = UINT64_MAX) const;
  std::optional<SlotInfo> completeAt(uint64_t step) const;
  const uint8_t* slotData(int slot) const;
  uint64_t slotCapacity() const { return slotBytes_; }
  // True while the slot still holds what `info` described: call after copying its bytes.
  bool unchanged(const SlotInfo& info) const;

  // Parses the slot's header and checks every tensor's CRC, then that the slot did not change.
  // kFailedPrecondition when corrupt or overwritten meanwhile.
  Result<ImageHeader> verify(const SlotInfo& info) const;
  // Copies slot `info` into `targets` (one per image tensor, in order, sizes equal), checking
  // each tensor's CRC on the way and that the slot did not change. Returns the header.
  // kInvalidArgument when the targets do not match; kFailedPrecondition when corrupt or
  // overwritten meanwhile.
  Result<ImageHeader> restoreInto(const SlotInfo& info, std::span<const MutableBuffer> targets) const;

  // Sets the state of slot `info` if it is unchanged (e.g. kCorrupt after a failed check,
  // kEmpty to drop a snapshot newer than the step restored). Needs a writable mapping.
  Status markSlot(const SlotInfo& info, SlotState state);

  const std::string& path() const { return path_; }
  uint64_t totalBytes() const { return totalBytes_; }
  // The file's inode number: a segment re-created under the same name has another.
  uint64_t fileId() const { return fileId_; }
  // Deletes the segment's file; the mapping stays usable until this object goes.
  Status remove();

 private:
  FlashSegment() = default;
  static Result<FlashSegment> create(const SegmentOptions& options, const std::string& dir, uint64_t slotBytes);
  Status mapAndCheck(bool writable);
  SlotInfo slotInfo(int index) const;
  int slotToWrite() const;
  void startWrite(int index);
  void finishWrite(int index, SlotState state, uint64_t step, uint64_t imageBytes);
  // Empties complete slots other than `keep` at `step` or later: a save of `step` means the
  // group went back to it, and what was saved after it belongs to an abandoned timeline.
  void dropFrom(uint64_t step, int keep);

  SegmentOptions options_;
  std::string path_;
  int fd_ = -1;
  uint8_t* base_ = nullptr;
  uint64_t totalBytes_ = 0;
  uint64_t slotBytes_ = 0;
  uint64_t fileId_ = 0;
  bool writable_ = false;
};

// Removes the segments in `dir` (empty: defaultShmDir()) whose names start with `prefix`, and
// temporary segments of processes that are gone; returns the names removed.
Result<std::vector<std::string>> removeSegments(const std::string& dir, const std::string& prefix);

}  // namespace troupe::checkpoint
