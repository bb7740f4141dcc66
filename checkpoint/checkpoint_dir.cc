#include "troupe/checkpoint/checkpoint_dir.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "troupe/checkpoint/checksum.h"
#include "troupe/runtime/clock.h"
#include "troupe/runtime/ids.h"
#include "troupe/runtime/logging.h"

namespace troupe::checkpoint {
namespace {

namespace fs = std::filesystem;

constexpr const char* kManifest = "MANIFEST.json";
constexpr const char* kLatest = "latest";
constexpr uint64_t kWriteChunk = uint64_t(16) << 20;
constexpr uint64_t kFaultChunk = uint64_t(1) << 20;
constexpr uint64_t kWritebackChunk = uint64_t(64) << 20;

std::string errnoText(int e) { return fmt::format("{} ({})", strerror(e), e); }

// Owns a file descriptor. close() reports the error a write-back may surface there.
class UniqueFd {
 public:
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // 0, or -1 with errno set.
  int close() { return ::close(std::exchange(fd_, -1)); }

 private:
  int fd_;
};

std::string hostName() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

std::string tempPathFor(const std::string& final) {
  static const std::string host = hostName();
  return fmt::format("{}.tmp.{}.{}.{}", final, host, getpid(), randomHex(4));
}

// "<final>.tmp.<host>.<pid>.<hex>" of this host whose process is gone.
bool isDeadTemp(const std::string& name) {
  static const std::string host = hostName();
  auto tmp = name.find(".tmp.");
  if (tmp == std::string::npos) return false;
  auto lastDot = name.rfind('.');
  if (lastDot == std::string::npos || lastDot <= tmp) return false;
  auto pidDot = name.rfind('.', lastDot - 1);
  if (pidDot == std::string::npos || pidDot < tmp + 4) return false;
  std::string nameHost = name.substr(tmp + 5, pidDot - tmp - 5);
  int pid = std::atoi(name.substr(pidDot + 1, lastDot - pidDot - 1).c_str());
  if (nameHost != host || pid <= 0) return false;
  return pid != getpid() && kill(pid, 0) != 0 && errno == ESRCH;
}

Status fsyncPath(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) {
    int e = errno;
    return Status(StatusCode::kUnavailable, fmt::format("cannot open directory {} to sync it: {}", path, errnoText(e)));
  }
  int rc = fsync(fd.get());
  int e = errno;
  if (rc != 0) return Status(StatusCode::kUnavailable, fmt::format("cannot sync directory {}: {}", path, errnoText(e)));
  return Status::ok();
}

// The Status for a failed write: a full disk or file size limit is kResourceExhausted.
Status writeError(int e, const std::string& what, const std::string& path) {
  if (e == ENOSPC || e == EDQUOT) {
    return Status(StatusCode::kResourceExhausted,
                  fmt::format("disk full while {} {}: {}; free space or keep fewer checkpoints (earlier steps are intact)",
                              what, path, errnoText(e)));
  }
  if (e == EFBIG) {
    return Status(StatusCode::kResourceExhausted,
                  fmt::format("file size limit reached while {} {}: {}; raise the limit (ulimit -f) (earlier steps are intact)",
                              what, path, errnoText(e)));
  }
  return Status(StatusCode::kUnavailable, fmt::format("I/O error while {} {}: {}", what, path, errnoText(e)));
}

Status writeAll(int fd, const uint8_t* data, uint64_t size, const std::string& path) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, std::min<uint64_t>(size, kWriteChunk));
    if (n < 0) {
      if (errno == EINTR) continue;
      return writeError(errno, "writing", path);
    }
    if (n == 0) return writeError(ENOSPC, "writing", path);
    data += n;
    size -= static_cast<uint64_t>(n);
  }
  return Status::ok();
}

// Writes a small file under a temporary name, syncs it, renames it into place, syncs the directory.
Status writeFileAtomically(const std::string& dir, const std::string& name, const std::string& content,
                           uint32_t mode) {
  std::string final = dir + "/" + name;
  std::string temp = tempPathFor(final);
  UniqueFd fd(::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, mode));
  if (!fd.valid()) return writeError(errno, "creating", temp);
  Status status = writeAll(fd.get(), reinterpret_cast<const uint8_t*>(content.data()), content.size(), temp);
  if (status.isOk() && fsync(fd.get()) != 0) status = writeError(errno, "syncing", temp);
  if (fd.close() != 0 && status.isOk()) status = writeError(errno, "closing", temp);
  if (status.isOk() && rename(temp.c_str(), final.c_str()) != 0) status = writeError(errno, "renaming", temp);
  if (!status.isOk()) {
    unlink(temp.c_str());
    return status;
  }
  return fsyncPath(dir);
}

std::optional<uint64_t> stepOfDirName(const std::string& name) {
  if (name.size() != 25 || name.rfind("step-", 0) != 0) return std::nullopt;
  uint64_t step = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    step = step * 10 + static_cast<uint64_t>(name[i] - '0');
  }
  return step;
}

// Removes a step's directory so that a crash half-way never leaves a step that looks complete:
// the manifest goes first, and is synced away before the files.
void removeStepDir(const std::string& dir) {
  std::error_code ec;
  if (fs::remove(fs::path(dir) / kManifest, ec)) (void)fsyncPath(dir);
  fs::remove_all(dir, ec);
  if (ec) TROUPE_LOG(kWarning, "could not remove old checkpoint {}: {}", dir, ec.message());
}

}  // namespace

CheckpointDirectory::CheckpointDirectory(DirectoryOptions options) : options_(std::move(options)) {}

Status CheckpointDirectory::open() {
  std::error_code ec;
  fs::path path(options_.path);
  if (path.has_parent_path()) fs::create_directories(path.parent_path(), ec);
  ec.clear();
  if (::mkdir(options_.path.c_str(), dirMode()) != 0 && errno != EEXIST) {
    ec = std::error_code(errno, std::generic_category());
  }
  if (ec) {
    return Status(StatusCode::kUnavailable,
                  fmt::format("cannot create checkpoint directory {}: {}", options_.path, ec.message()));
  }
  for (const auto& removed : removeTemporaryFiles()) {
    TROUPE_LOG(kInfo, "removed {}, left by a checkpoint writer that is gone", removed);
  }
  return Status::ok();
}

std::string CheckpointDirectory::stepPath(uint64_t step) const {
  return fmt::format("{}/step-{:020d}", options_.path, step);
}

std::string CheckpointDirectory::rankPath(uint64_t step, uint32_t rank) const {
  return fmt::format("{}/rank-{:05d}.tckpt", stepPath(step), rank);
}

Result<PersistOutcome> CheckpointDirectory::persistRank(const PersistRequest& request) {
  auto started = std::chrono::steady_clock::now();
  PersistOutcome outcome;
  const uint64_t step = request.stamp.step;
  std::string stepDir = stepPath(step);
  if (::mkdir(stepDir.c_str(), dirMode()) == 0) {
    TROUPE_RETURN_IF_ERROR(fsyncPath(options_.path));
  } else if (errno != EEXIST) {
    return writeError(errno, "creating", stepDir);
  }
  std::string final = rankPath(step, request.stamp.rank);
  if (auto existing = RankFile::open(final); existing.isOk() && existing->header().headerCrc == request.headerCrc &&
                                             existing->header().layout.imageBytes() == request.imageBytes) {
    outcome.alreadyPresent = true;
  } else if (std::error_code ec; fs::exists(fs::path(stepDir) / kManifest, ec)) {
    // A complete step is never rewritten: a snapshot saved again at a persisted step (a ZeRO
    // group's re-sharded state: the same values in another layout) would make one of its files
    // disagree with its manifest.
    outcome.alreadyPresent = true;
  } else {
    std::string temp = tempPathFor(final);
    UniqueFd fd(::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, options_.fileMode));
    if (!fd.valid()) return writeError(errno, "creating", temp);
    Status status;
    const bool faulty = options_.fault.armed(FaultStage::kPersist, step);
    bool paused = false;
    uint64_t written = 0, flushed = 0;
    for (const auto& piece : request.pieces) {
      for (uint64_t off = 0; off < piece.size && status.isOk();) {
        uint64_t n = std::min(piece.size - off, faulty ? kFaultChunk : kWriteChunk);
        status = writeAll(fd.get(), piece.data + off, n, temp);
        off += n;
        written += n;
        // Start writeback of what is written so far while the rest is copied, so the fsync at the
        // end waits for the tail only (errors surface there).
        if (written - flushed >= kWritebackChunk) {
          (void)sync_file_range(fd.get(), static_cast<off_t>(flushed), static_cast<off_t>(written - flushed),
                                SYNC_FILE_RANGE_WRITE);
          flushed = written;
        }
        if (faulty && !paused && written >= options_.fault.afterBytes) {
          paused = true;
          options_.fault.pauseHere(step, written, options_.stop);
        }
        if (status.isOk() && options_.stop != nullptr && options_.stop->load()) {
          status = Status(StatusCode::kAborted, fmt::format("persisting {} was stopped", final));
        }
      }
      if (!status.isOk()) break;
    }
    if (status.isOk() && written != request.imageBytes) {
      status = Status(StatusCode::kInternal,
                      fmt::format("image pieces hold {} bytes, the image {}", written, request.imageBytes));
    }
    if (status.isOk() && request.stillValid && !request.stillValid()) {
      status = Status(StatusCode::kAborted,
                      fmt::format("the snapshot of step {} rank {} was overwritten by a newer save while being persisted",
                                  step, request.stamp.rank));
    }
    if (status.isOk() && fsync(fd.get()) != 0) status = writeError(errno, "syncing", temp);
    if (fd.close() != 0 && status.isOk()) status = writeError(errno, "closing", temp);
    if (status.isOk() && rename(temp.c_str(), final.c_str()) != 0) status = writeError(errno, "renaming", temp);
    if (!status.isOk()) {
      unlink(temp.c_str());
      return status;
    }
    TROUPE_RETURN_IF_ERROR(fsyncPath(stepDir));
    outcome.bytes = written;
  }
  TROUPE_ASSIGN_OR_RETURN(auto complete, commitIfComplete(step, request.stamp.worldSize));
  outcome.stepComplete = complete;
  outcome.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return outcome;
}

Result<bool> CheckpointDirectory::commitIfComplete(uint64_t step, uint32_t worldSize) {
  std::string stepDir = stepPath(step);
  std::error_code ec;
  bool already = fs::exists(fs::path(stepDir) / kManifest, ec);
  if (!already) {
    for (uint32_t r = 0; r < worldSize; ++r) {
      if (!fs::exists(rankPath(step, r), ec)) return false;
    }
    nlohmann::json manifest = {{"format", "troupe-checkpoint"}, {"version", 1},          {"step", step},
                               {"world_size", worldSize},       {"created_ms", wallClockMs()}, {"ranks", nlohmann::json::array()}};
    for (uint32_t r = 0; r < worldSize; ++r) {
      auto file = RankFile::open(rankPath(step, r));
      if (!file.isOk()) {
        TROUPE_LOG(kWarning, "step {} is not recorded as complete: {}", step, file.status().message());
        return false;
      }
      const auto& h = file->header();
      if (h.stamp.step != step || h.stamp.rank != r || h.stamp.worldSize != worldSize) {
        TROUPE_LOG(kWarning, "step {} is not recorded as complete: {} holds rank {} of {} at step {}", step,
                   rankPath(step, r), h.stamp.rank, h.stamp.worldSize, h.stamp.step);
        return false;
      }
      manifest["ranks"].push_back({{"rank", r},
                                   {"file", fs::path(rankPath(step, r)).filename().string()},
                                   {"bytes", h.layout.imageBytes()},
                                   {"header_crc", fmt::format("{:08x}", h.headerCrc)}});
    }
    TROUPE_RETURN_IF_ERROR(writeFileAtomically(stepDir, kManifest, manifest.dump(2) + "\n", options_.fileMode));
  }
  auto current = latest();
  if (!current || *current <= step) {
    TROUPE_RETURN_IF_ERROR(writeFileAtomically(options_.path, kLatest, fmt::format("{}\n", step), options_.fileMode));
  }
  applyRetention();
  return true;
}

void CheckpointDirectory::applyRetention() {
  if (options_.keep == 0) return;
  auto steps = completeSteps();
  if (!steps.isOk() || steps->size() < options_.keep) return;
  uint64_t oldestKept = (*steps)[options_.keep - 1];
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(options_.path, ec)) {
    auto step = stepOfDirName(entry.path().filename().string());
    if (step && *step < oldestKept) removeStepDir(entry.path().string());
  }
}

Result<std::vector<uint64_t>> CheckpointDirectory::completeSteps() const {
  std::vector<uint64_t> steps;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(options_.path, ec)) {
    auto step = stepOfDirName(entry.path().filename().string());
    std::error_code e2;
    if (step && fs::exists(entry.path() / kManifest, e2)) steps.push_back(*step);
  }
  if (ec) {
    return Status(ec == std::errc::no_such_file_or_directory ? StatusCode::kNotFound : StatusCode::kUnavailable,
                  fmt::format("cannot list checkpoint directory {}: {}", options_.path, ec.message()));
  }
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

std::optional<uint64_t> CheckpointDirectory::latest() const {
  std::ifstream in(options_.path + "/" + kLatest);
  uint64_t step = 0;
  if (in >> step) return step;
  return std::nullopt;
}

Result<Manifest> CheckpointDirectory::readManifest(uint64_t step) const {
  std::string path = stepPath(step) + "/" + kManifest;
  std::ifstream in(path);
  if (!in) return Status(StatusCode::kNotFound, fmt::format("step {} has no manifest ({})", step, path));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return parseManifest(text, step, path);
}

Status CheckpointDirectory::quarantine(uint64_t step) {
  std::string dir = stepPath(step);
  std::string from = dir + "/" + kManifest;
  std::string to = from + ".corrupt";
  if (rename(from.c_str(), to.c_str()) != 0 && errno != ENOENT) return writeError(errno, "renaming", from);
  TROUPE_RETURN_IF_ERROR(fsyncPath(dir));
  TROUPE_LOG(kWarning, "checkpoint step {} in {} is corrupt; moved its manifest to {}", step, options_.path, to);
  // `latest` must not name a step nobody can load.
  auto current = latest();
  if (current && *current == step) {
    auto steps = completeSteps();
    if (steps.isOk() && !steps->empty()) {
      return writeFileAtomically(options_.path, kLatest, fmt::format("{}\n", steps->front()), options_.fileMode);
    }
    std::error_code ec;
    fs::remove(options_.path + "/" + kLatest, ec);
    return fsyncPath(options_.path);
  }
  return Status::ok();
}

Status CheckpointDirectory::dropIncompleteAfter(uint64_t step) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(options_.path, ec)) {
    auto s = stepOfDirName(entry.path().filename().string());
    std::error_code e2;
    if (s && *s > step && !fs::exists(entry.path() / kManifest, e2)) {
      TROUPE_LOG(kInfo, "removing {}: a partial step after the restored step {}", entry.path().string(), step);
      removeStepDir(entry.path().string());
    }
  }
  return Status::ok();
}

std::vector<std::string> CheckpointDirectory::removeTemporaryFiles() const {
  std::vector<std::string> removed;
  std::vector<fs::path> dirs{options_.path};
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(options_.path, ec)) {
    if (stepOfDirName(entry.path().filename().string())) dirs.push_back(entry.path());
  }
  for (const auto& dir : dirs) {
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      if (isDeadTemp(entry.path().filename().string())) {
        std::error_code e2;
        if (fs::remove(entry.path(), e2)) removed.push_back(entry.path().string());
      }
    }
  }
  return removed;
}

RankFile::RankFile(RankFile&& other) noexcept { *this = std::move(other); }

RankFile& RankFile::operator=(RankFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    header_ = std::move(other.header_);
  }
  return *this;
}

RankFile::~RankFile() {
  if (fd_ >= 0) close(fd_);
}

Status RankFile::readAt(uint64_t offset, uint64_t size, uint8_t* dst) const {
  while (size > 0) {
    ssize_t n = pread(fd_, dst, std::min<uint64_t>(size, kWriteChunk), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      return Status(StatusCode::kUnavailable, fmt::format("cannot read {}: {}", path_, errnoText(e)));
    }
    if (n == 0) {
      return Status(StatusCode::kFailedPrecondition, fmt::format("corrupt checkpoint file {}: shorter than its image", path_));
    }
    dst += n;
    offset += static_cast<uint64_t>(n);
    size -= static_cast<uint64_t>(n);
  }
  return Status::ok();
}

Result<RankFile> RankFile::open(const std::string& path, const ManifestRank* expected) {
  RankFile file;
  file.path_ = path;
  file.fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (file.fd_ < 0) {
    int e = errno;
    return Status(e == ENOENT ? StatusCode::kNotFound : StatusCode::kUnavailable,
                  fmt::format("cannot open checkpoint file {}: {}", path, errnoText(e)));
  }
  posix_fadvise(file.fd_, 0, 0, POSIX_FADV_SEQUENTIAL);
  struct stat st {};
  fstat(file.fd_, &st);
  uint64_t size = static_cast<uint64_t>(st.st_size);
  std::vector<uint8_t> fixed(kFixedHeaderBytes);
  auto inFile = [&](Status s) { return Status(s.code(), fmt::format("{} ({})", s.message(), path)); };
  if (size < kFixedHeaderBytes) return inFile(Status(StatusCode::kFailedPrecondition, "corrupt checkpoint file: too short"));
  TROUPE_RETURN_IF_ERROR(file.readAt(0, kFixedHeaderBytes, fixed.data()));
  auto extent = peekImage(fixed.data(), fixed.size());
  if (!extent.isOk()) return inFile(extent.status());
  if (size != extent->imageBytes) {
    return inFile(Status(StatusCode::kFailedPrecondition,
                         fmt::format("corrupt checkpoint file: {} bytes, its header says {}", size, extent->imageBytes)));
  }
  if (expected != nullptr && (expected->headerCrc != extent->headerCrc || expected->bytes != extent->imageBytes)) {
    return inFile(Status(StatusCode::kFailedPrecondition,
                         "corrupt checkpoint: the rank file is not the one its manifest recorded"));
  }
  std::vector<uint8_t> region(extent->headerBytes);
  TROUPE_RETURN_IF_ERROR(file.readAt(0, region.size(), region.data()));
  auto header = parseImageHeader(region.data(), region.size());
  if (!header.isOk()) return inFile(header.status());
  file.header_ = std::move(*header);
  return file;
}

Status RankFile::readTensor(size_t i, void* dstArg) const {
  const auto& spec = header_.layout.tensors().at(i);
  auto* dst = static_cast<uint8_t*>(dstArg);
  uint64_t offset = header_.layout.tensorOffset(i);
  uint32_t crc = 0;
  // Checksummed chunk by chunk while each is still in cache.
  for (uint64_t done = 0; done < spec.bytes;) {
    uint64_t n = std::min(kWriteChunk, spec.bytes - done);
    TROUPE_RETURN_IF_ERROR(readAt(offset + done, n, dst + done));
    crc = crc32c(dst + done, n, crc);
    done += n;
  }
  if (crc != header_.crcs[i]) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("corrupt checkpoint file {}: tensor '{}' checksum {:08x} != recorded {:08x}", path_,
                              spec.name, crc, header_.crcs[i]));
  }
  return Status::ok();
}

Status RankFile::readImage(uint8_t* dst) const {
  TROUPE_RETURN_IF_ERROR(readAt(0, header_.layout.imageBytes(), dst));
  auto extent = peekImage(dst, header_.layout.imageBytes());
  if (!extent.isOk() || extent->headerCrc != header_.headerCrc) {
    return Status(StatusCode::kFailedPrecondition, fmt::format("checkpoint file {} changed while being read", path_));
  }
  Status data = verifyImageData(header_, dst);
  if (!data.isOk()) return Status(data.code(), fmt::format("{} ({})", data.message(), path_));
  return Status::ok();
}

Result<PersistOutcome> persistSnapshot(CheckpointDirectory& dir, const FlashSegment& segment, const SlotInfo& slot) {
  if (!slot.complete()) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("slot {} of {} holds no complete snapshot", slot.index, segment.path()));
  }
  const uint8_t* image = segment.slotData(slot.index);
  auto header = parseImageHeader(image, std::min(slot.imageBytes, segment.slotCapacity()));
  if (!segment.unchanged(slot)) {
    return Status(StatusCode::kAborted, fmt::format("slot {} of {} was overwritten", slot.index, segment.path()));
  }
  if (!header.isOk()) return header.status();
  PersistRequest request;
  request.stamp = header->stamp;
  request.headerCrc = header->headerCrc;
  request.imageBytes = header->layout.imageBytes();
  request.pieces = {ImagePiece{image, request.imageBytes}};
  request.stillValid = [&segment, slot]() { return segment.unchanged(slot); };
  return dir.persistRank(request);
}

Result<PersistOutcome> persistTensors(CheckpointDirectory& dir, const ImageLayout& layout, const ImageStamp& stamp,
                                      std::span<const ConstBuffer> tensors, std::string_view meta) {
  const auto& specs = layout.tensors();
  if (tensors.size() != specs.size()) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{} tensors given for a layout of {}", tensors.size(), specs.size()));
  }
  std::vector<uint32_t> crcs(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    if (tensors[i].size != specs[i].bytes) {
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("tensor '{}' is {} bytes; the layout says {}", specs[i].name, tensors[i].size,
                                specs[i].bytes));
    }
    crcs[i] = crc32c(tensors[i].data, tensors[i].size);
  }
  std::vector<uint8_t> header(layout.headerBytes());
  TROUPE_RETURN_IF_ERROR(layout.encodeHeader(header.data(), stamp, crcs, meta));
  static const std::vector<uint8_t> zeros(kPageBytes, 0);  // padding between and after tensors
  PersistRequest request;
  request.stamp = stamp;
  request.headerCrc = peekImage(header.data(), header.size())->headerCrc;
  request.imageBytes = layout.imageBytes();
  request.pieces.push_back({header.data(), header.size()});
  uint64_t at = layout.headerBytes();
  for (size_t i = 0; i < specs.size(); ++i) {
    if (layout.tensorOffset(i) > at) request.pieces.push_back({zeros.data(), layout.tensorOffset(i) - at});
    request.pieces.push_back({static_cast<const uint8_t*>(tensors[i].data), specs[i].bytes});
    at = layout.tensorOffset(i) + specs[i].bytes;
  }
  if (layout.imageBytes() > at) request.pieces.push_back({zeros.data(), layout.imageBytes() - at});
  return dir.persistRank(request);
}

Result<LoadedRank> loadRank(const CheckpointDirectory& dir, uint32_t rank, const TensorAllocator& allocate,
                            uint64_t maxStep) {
  TROUPE_ASSIGN_OR_RETURN(auto steps, dir.completeSteps());
  LoadedRank loaded;
  auto skip = [&](uint64_t step, const std::string& why) {
    TROUPE_LOG(kWarning, "checkpoint step {} in {} skipped: {}", step, dir.path(), why);
    loaded.skipped.push_back(fmt::format("step {}: {}", step, why));
  };
  for (uint64_t step : steps) {
    if (step > maxStep) continue;
    auto manifest = dir.readManifest(step);
    if (!manifest.isOk()) {
      skip(step, manifest.status().message());
      continue;
    }
    if (rank >= manifest->worldSize) {
      skip(step, fmt::format("it has {} ranks; rank {} is not one of them", manifest->worldSize, rank));
      continue;
    }
    auto file = RankFile::open(dir.rankPath(step, rank), &manifest->ranks[rank]);
    if (!file.isOk()) {
      skip(step, file.status().message());
      continue;
    }
    Status status;
    const auto& specs = file->header().layout.tensors();
    for (size_t i = 0; i < specs.size() && status.isOk(); ++i) {
      TROUPE_ASSIGN_OR_RETURN(auto dst, allocate(i, specs[i]));
      status = file->readTensor(i, dst);
    }
    if (!status.isOk()) {
      skip(step, status.message());
      continue;
    }
    loaded.step = step;
    loaded.header = file->header();
    return loaded;
  }
  std::string why = loaded.skipped.empty() ? "no step has a manifest" : fmt::format("{}", fmt::join(loaded.skipped, "; "));
  return Status(StatusCode::kNotFound, fmt::format("no usable checkpoint for rank {} in {}: {}", rank, dir.path(), why));
}

}  // namespace troupe::checkpoint
