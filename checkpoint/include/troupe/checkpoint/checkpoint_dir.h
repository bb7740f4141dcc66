// The persist tier: checkpoints in a directory, one file per rank per step plus a manifest, and
// a `latest` tracker (docs/checkpoint_format.md):
//
//   <dir>/latest                              "<step>\n", the newest step with a manifest
//   <dir>/step-<20-digit step>/rank-<5-digit rank>.tckpt   the rank image (image.h), byte for byte
//   <dir>/step-<...>/MANIFEST.json            written once every rank's file is in place
//
// Every file is written under a temporary name ("<final>.tmp.<host>.<pid>.<hex>"), fsynced,
// renamed into place, and its directory fsynced; a step counts only once its manifest exists,
// and only then is `latest` moved and older steps removed (keeping the newest `keep`). A crash,
// a full disk (ENOSPC) or a file size limit (EFBIG) in the middle leaves the previous steps
// untouched and no temporary file (they are removed on error, and on open() for processes of
// this host that are gone). Several processes (one checkpoint actor per node) may persist the
// ranks of one step into a shared directory; whichever completes the set writes the manifest.
// Thread-safety: an object belongs to one thread; several objects (and processes) may use one
// directory.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string_view>
#include <string>
#include <vector>

#include "troupe/checkpoint/fault.h"
#include "troupe/checkpoint/flash_segment.h"
#include "troupe/checkpoint/image.h"
#include "troupe/runtime/status.h"

namespace troupe::checkpoint {

struct DirectoryOptions {
  std::string path;
  uint32_t keep = 3;  // complete steps kept; 0 keeps all
  FaultInjection fault = FaultInjection::fromEnvironment();
  // When set and it becomes true, a persist in progress stops with kAborted (and cleans up).
  const std::atomic<bool>* stop = nullptr;
  // Weights are user data: files 0600 and directories 0700 unless the caller asks otherwise
  // (e.g. 0640 to share with a group); directories get x wherever files get r.
  uint32_t fileMode = 0600;
};

// One contiguous part of an image, in order.
struct ImagePiece {
  const uint8_t* data = nullptr;
  uint64_t size = 0;
};

struct PersistRequest {
  ImageStamp stamp;
  uint32_t headerCrc = 0;  // the image header's CRC (peekImage), recorded in the manifest
  uint64_t imageBytes = 0;
  std::vector<ImagePiece> pieces;  // imageBytes in total
  // Called once every byte is written, before the file is kept: false (the source was
  // overwritten meanwhile) discards it with kAborted.
  std::function<bool()> stillValid;
};

struct PersistOutcome {
  bool alreadyPresent = false;  // the same image was already persisted: nothing written
  bool stepComplete = false;    // every rank of the step is on disk and the manifest written
  uint64_t bytes = 0;
  double seconds = 0;
};

struct ManifestRank {
  uint32_t rank = 0;
  std::string file;
  uint64_t bytes = 0;
  uint32_t headerCrc = 0;
};
struct Manifest {
  uint64_t step = 0;
  uint32_t worldSize = 0;
  int64_t createdMs = 0;
  std::vector<ManifestRank> ranks;
};

// The manifest of `step` held in `text` (read from `path`, named in errors): kFailedPrecondition
// when it is not one: not this format, a field missing, of another type or out of range (a float
// where an integer belongs), ranks that are not 0..world_size-1 in order, each in its own file.
Result<Manifest> parseManifest(std::string_view text, uint64_t step, const std::string& path);

class CheckpointDirectory {
 public:
  explicit CheckpointDirectory(DirectoryOptions options);

  // Creates the directory if needed and removes the temporary files of this host's dead
  // processes. kUnavailable when it cannot be created.
  Status open();
  // Writes one rank's image of a step (see the file comment). kResourceExhausted on a full disk
  // or file size limit, kUnavailable on other I/O errors, kAborted when the source changed or
  // `stop` was set; in every error case the temporary file is gone and earlier steps untouched.
  Result<PersistOutcome> persistRank(const PersistRequest& request);

  // Steps that have a manifest, newest first.
  Result<std::vector<uint64_t>> completeSteps() const;
  // The step `latest` names, if the tracker exists and parses.
  std::optional<uint64_t> latest() const;
  // kNotFound when the step has no manifest; kFailedPrecondition when it does not parse.
  Result<Manifest> readManifest(uint64_t step) const;
  std::string stepPath(uint64_t step) const;
  std::string rankPath(uint64_t step, uint32_t rank) const;
  // Moves a step's manifest aside (to MANIFEST.json.corrupt) so nobody restores the step again,
  // after one of its rank files failed its checks.
  Status quarantine(uint64_t step);
  // Removes step directories newer than `step` that have no manifest: partial steps of a
  // timeline abandoned by a restore to `step`, which must never be completed by a later save.
  Status dropIncompleteAfter(uint64_t step);
  // Removes temporary files left by processes of this host that are gone; returns their paths.
  std::vector<std::string> removeTemporaryFiles() const;
  const std::string& path() const { return options_.path; }

 private:
  Result<bool> commitIfComplete(uint64_t step, uint32_t worldSize);
  void applyRetention();

  uint32_t dirMode() const { return options_.fileMode | ((options_.fileMode & 0444) >> 2); }
  DirectoryOptions options_;
};

// A rank file opened for reading, its header checked (and against the manifest, if given).
// Thread-safety: one thread.
class RankFile {
 public:
  RankFile(RankFile&& other) noexcept;
  RankFile& operator=(RankFile&& other) noexcept;
  ~RankFile();
  // kNotFound when absent; kFailedPrecondition ("corrupt ...") when the header is bad, the file
  // is shorter than its image, or it is not the file the manifest recorded.
  static Result<RankFile> open(const std::string& path, const ManifestRank* expected = nullptr);
  const ImageHeader& header() const { return header_; }
  // Reads tensor i into `dst` (its spec's bytes) and checks its CRC32C.
  Status readTensor(size_t i, void* dst) const;
  // Reads the whole image (imageBytes) into `dst` and checks every tensor's CRC32C.
  Status readImage(uint8_t* dst) const;

 private:
  RankFile() = default;
  Status readAt(uint64_t offset, uint64_t size, uint8_t* dst) const;
  std::string path_;
  int fd_ = -1;
  ImageHeader header_;
};

// Persists the snapshot in `slot` of `segment` (straight from shared memory; the slot's sequence
// number is checked once written, so a snapshot overwritten meanwhile is discarded with kAborted).
Result<PersistOutcome> persistSnapshot(CheckpointDirectory& dir, const FlashSegment& segment, const SlotInfo& slot);
// Persists tensors from plain buffers (one per layout tensor, sizes equal): CRCs computed, then
// written as the same image a snapshot would be. For saving without shared memory.
Result<PersistOutcome> persistTensors(CheckpointDirectory& dir, const ImageLayout& layout, const ImageStamp& stamp,
                                      std::span<const ConstBuffer> tensors, std::string_view meta);

// Allocates the buffer tensor `index` is read into; an error stops the load.
using TensorAllocator = std::function<Result<void*>(size_t index, const TensorSpec& spec)>;

struct LoadedRank {
  uint64_t step = 0;
  ImageHeader header;
  std::vector<std::string> skipped;  // why newer candidates were not used
};
// Loads rank `rank` of the newest complete step (at most `maxStep`) whose files pass every
// check; a corrupt or incomplete candidate is reported in `skipped` (and logged) and the next
// older one tried. kNotFound when no step is usable (the message lists why each was skipped).
Result<LoadedRank> loadRank(const CheckpointDirectory& dir, uint32_t rank, const TensorAllocator& allocate,
                            uint64_t maxStep = UINT64_MAX);

}  // namespace troupe::checkpoint
