#include "troupe/checkpoint/flash_segment.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

#include <fmt/format.h>

#include "copy_tensors.h"
#include "troupe/runtime/ids.h"
#include "troupe/runtime/logging.h"
#include "troupe/runtime/safe_open.h"

namespace troupe::checkpoint {
namespace {

namespace fs = std::filesystem;

constexpr char kSegmentMagic[8] = {'T', 'R', 'O', 'U', 'P', 'E', 'S', 'M'};
constexpr uint32_t kSegmentVersion = 2;  // 2: three slots, one of which may be pinned
constexpr uint64_t kSegmentHeaderBytes = 4096;
constexpr int kSlots = FlashSegment::kSlotCount;
constexpr const char* kDefaultShmDir = "/dev/shm";
#ifdef MADV_POPULATE_WRITE
constexpr int kMadvPopulateWrite = MADV_POPULATE_WRITE;
#else
constexpr int kMadvPopulateWrite = 23;
#endif

// The segment's first page. Fields other shared-memory users change are read and written through
// std::atomic_ref.
struct SlotHeader {
  uint64_t seq;
  uint64_t step;
  uint64_t imageBytes;
  uint32_t state;
  uint32_t writerPid;
  uint32_t pinned;  // 1: kept until another slot is pinned (FlashSegment::pin)
  uint8_t reserved[28];
};
struct SegmentHeader {
  char magic[8];
  uint32_t version;
  uint32_t slotCount;
  uint64_t slotBytes;
  uint64_t totalBytes;
  uint32_t creatorPid;
  uint8_t reserved[28];
  SlotHeader slots[kSlots];
};
static_assert(sizeof(SlotHeader) == 64 && sizeof(SegmentHeader) == 64 + 64 * kSlots);

uint64_t alignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

SegmentHeader* headerOf(uint8_t* base) { return reinterpret_cast<SegmentHeader*>(base); }

template <typename T>
T loadShared(const T& field, std::memory_order order = std::memory_order_acquire) {
  return std::atomic_ref<T>(const_cast<T&>(field)).load(order);
}
template <typename T>
void storeShared(T& field, T value, std::memory_order order = std::memory_order_release) {
  std::atomic_ref<T>(field).store(value, order);
}

std::string errnoText(int e) { return fmt::format("{} ({})", strerror(e), e); }

bool validPart(std::string_view part) {
  if (part.empty() || part.size() > 64) return false;
  for (char c : part) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return false;
  }
  return true;
}

// "the checkpoint segment needs ... but only ... are free": the message for a too-small tmpfs.
Status noRoom(const std::string& path, const std::string& dir, uint64_t need, uint64_t avail, uint64_t size) {
  return Status(StatusCode::kResourceExhausted,
                fmt::format("checkpoint segment {} needs {} bytes ({:.1f} MiB) but only {} bytes ({:.1f} MiB) are "
                            "free in {} (filesystem size {:.1f} MiB): enlarge it (docker run --shm-size, or mount -o "
                            "remount,size=... {}), set TROUPE_SHM_DIR to a larger tmpfs, or checkpoint less state per rank",
                            path, need, need / 1048576.0, avail, avail / 1048576.0, dir, size / 1048576.0, dir));
}

// A cluster's workers record each segment they make in their run directory
// (TROUPE_SHM_REGISTRY, set by the node agent), so `troupe stop` removes exactly this cluster's
// segments and never another's.
void recordInRegistry(const std::string& name, const std::string& path) {
  const char* registry = std::getenv("TROUPE_SHM_REGISTRY");
  if (registry == nullptr || *registry == '\0') return;
  std::string entry = std::string(registry) + "/" + name;
  auto fd = openRegularFile(entry, O_WRONLY | O_CREAT | O_TRUNC);
  if (!fd.isOk()) return;  // best effort: the segment works without it; stop then leaves it
  ssize_t written = ::write(fd->get(), path.data(), path.size());
  (void)written;
}

// The segments' directory, made if missing. The per-user default must be this user's and closed
// to others: in /dev/shm anyone may take a name first, and a directory (or FIFO) someone else made
// there is refused with what to do, never used or waited on. A directory the caller chose
// (TROUPE_SHM_DIR, SegmentOptions::dir) is taken as it is; its segments are checked one by one.
Result<std::string> segmentDir(const SegmentOptions& options) {
  if (!options.dir.empty() && options.dir != privateShmDir()) return options.dir;
  std::string dir = defaultShmDir();
  if (dir != privateShmDir()) return dir;
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    int e = errno;
    return Status(e == ENOENT ? StatusCode::kNotFound : StatusCode::kUnavailable,
                  fmt::format("cannot make the checkpoint segments' directory {}: {}", dir, errnoText(e)));
  }
  FileDescriptor fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  struct stat st {};
  bool opened = fd.get() >= 0 && ::fstat(fd.get(), &st) == 0;
  if (!opened) ::lstat(dir.c_str(), &st);
  if (!opened || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("the checkpoint segments' directory {} is not this user's private directory ({} of uid "
                              "{}, mode {:o}): another user made it first; remove it, or set TROUPE_SHM_DIR to a "
                              "directory of yours on a tmpfs",
                              dir, S_ISDIR(st.st_mode) ? "a directory" : "not a directory", st.st_uid,
                              st.st_mode & 07777));
  }
  return dir;
}

// Freed put() objects that their processes keep for reuse (python/troupe/_objects.py: files named
// <pid>-free-<n> in this user's object directory and its fallbacks beside it) hold shared memory
// that nothing uses; a segment short of room takes it back first. Only this user's files in this
// user's private directories on the segment's file system go. Returns the bytes released.
uint64_t releaseKeptObjects(const std::string& segmentDir) {
  struct stat segmentFs {};
  if (::stat(segmentDir.c_str(), &segmentFs) != 0) return 0;
  const char* env = std::getenv("TROUPE_OBJECT_DIR");
  const fs::path canonical = env && *env ? fs::path(env) : fs::path(fmt::format("{}/troupe-objects-{}", kDefaultShmDir, ::getuid()));
  const std::string fallbackPrefix = canonical.filename().string() + ".";
  std::vector<fs::path> dirs = {canonical};
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(canonical.parent_path(), ec)) {
    if (entry.path().filename().string().rfind(fallbackPrefix, 0) == 0) dirs.push_back(entry.path());
  }
  auto isKept = [](const std::string& name) {
    size_t dash = name.find("-free-");
    auto digits = [](std::string_view v) {
      return !v.empty() && std::all_of(v.begin(), v.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
    };
    return dash != std::string::npos && digits(std::string_view(name).substr(0, dash)) &&
           digits(std::string_view(name).substr(dash + 6));
  };
  uint64_t released = 0;
  for (const auto& dir : dirs) {
    struct stat st {};
    if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid() || (st.st_mode & 077) != 0 ||
        st.st_dev != segmentFs.st_dev) {
      continue;
    }
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      if (!isKept(entry.path().filename().string())) continue;
      struct stat file {};
      if (::lstat(entry.path().c_str(), &file) == 0 && S_ISREG(file.st_mode) && file.st_uid == ::geteuid() &&
          ::unlink(entry.path().c_str()) == 0) {
        released += static_cast<uint64_t>(file.st_blocks) * 512;
      }
    }
  }
  return released;
}

}  // namespace

std::string privateShmDir() { return fmt::format("{}/troupe-ckpt-{}", kDefaultShmDir, ::geteuid()); }

std::string defaultShmDir() {
  const char* dir = std::getenv("TROUPE_SHM_DIR");
  return dir && *dir ? std::string(dir) : privateShmDir();
}

const char* slotStateName(SlotState state) {
  switch (state) {
    case SlotState::kEmpty: return "EMPTY";
    case SlotState::kWriting: return "WRITING";
    case SlotState::kComplete: return "COMPLETE";
    case SlotState::kCorrupt: return "CORRUPT";
  }
  return "?";
}

Result<std::string> segmentName(std::string_view group, std::string_view node, SegmentKind kind, uint32_t rank) {
  if (!validPart(group) || !validPart(node)) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("checkpoint group '{}' and node '{}' must be 1-64 characters of [A-Za-z0-9_-]", group, node));
  }
  return segmentPrefix(group, node) + (kind == SegmentKind::kReplica ? "replica." : "") + fmt::format("r{}", rank);
}

std::string segmentPrefix(std::string_view group, std::string_view node) {
  return fmt::format("troupe_ckpt.{}.{}.", group, node);
}

FlashSegment::FlashSegment(FlashSegment&& other) noexcept { *this = std::move(other); }

FlashSegment& FlashSegment::operator=(FlashSegment&& other) noexcept {
  if (this != &other) {
    this->~FlashSegment();
    options_ = std::move(other.options_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    base_ = std::exchange(other.base_, nullptr);
    totalBytes_ = std::exchange(other.totalBytes_, 0);
    slotBytes_ = other.slotBytes_;
    fileId_ = other.fileId_;
    writable_ = other.writable_;
  }
  return *this;
}

FlashSegment::~FlashSegment() {
  if (base_ != nullptr) munmap(base_, totalBytes_);
  if (fd_ >= 0) close(fd_);
  base_ = nullptr;
  fd_ = -1;
}

Result<FlashSegment> FlashSegment::openForWrite(const SegmentOptions& options, uint64_t imageBytes) {
  TROUPE_ASSIGN_OR_RETURN(auto checkedDir, segmentDir(options));
  const std::string& dir = checkedDir;
  if (options.name.empty() || options.name.find('/') != std::string::npos) {
    return Status(StatusCode::kInvalidArgument, fmt::format("bad segment name '{}'", options.name));
  }
  if (imageBytes > kMaxImageBytes) {  // a peer's replicaBegin names it: the slots' sizes must not wrap
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("a {}-byte image is larger than any checkpoint segment holds ({} bytes)", imageBytes,
                              kMaxImageBytes));
  }
  uint64_t slotBytes = alignUp(std::max<uint64_t>(imageBytes, kPageBytes), kPageBytes);
  auto existing = openExisting(options, /*writable=*/true);
  if (existing.isOk()) {
    if (flock(existing->fd_, LOCK_EX | LOCK_NB) != 0) {
      uint32_t pid = loadShared(headerOf(existing->base_)->creatorPid);
      for (const auto& s : existing->slots()) pid = s.writerPid ? s.writerPid : pid;
      return Status(StatusCode::kFailedPrecondition,
                    fmt::format("checkpoint segment {} is being written by another process (pid {}); one writer per rank",
                                existing->path_, pid));
    }
    if (existing->slotBytes_ >= slotBytes) {
      // Pre-fault the writer's mapping so its first save pays no page faults (best effort:
      // MADV_POPULATE_WRITE needs Linux 5.14).
      (void)madvise(existing->base_, existing->totalBytes_, kMadvPopulateWrite);
      return std::move(*existing);
    }
    TROUPE_LOG(kInfo, "checkpoint segment {} has {}-byte slots; re-creating it for {}-byte images", existing->path_,
               existing->slotBytes_, imageBytes);
  } else if (existing.status().code() != StatusCode::kNotFound &&
             existing.status().code() != StatusCode::kFailedPrecondition) {
    return existing.status();
  }
  return create(options, dir, slotBytes);
}

Result<FlashSegment> FlashSegment::create(const SegmentOptions& options, const std::string& dir, uint64_t slotBytes) {
  FlashSegment segment;
  segment.options_ = options;
  segment.path_ = dir + "/" + options.name;
  segment.slotBytes_ = slotBytes;
  segment.totalBytes_ = kSegmentHeaderBytes + kSlots * slotBytes;
  segment.writable_ = true;
  const uint64_t need = segment.totalBytes_;

  struct statvfs vfs {};
  if (statvfs(dir.c_str(), &vfs) != 0) {
    int e = errno;
    return Status(e == ENOENT ? StatusCode::kNotFound : StatusCode::kUnavailable,
                  fmt::format("cannot use shared-memory directory {}: {}", dir, errnoText(e)));
  }
  uint64_t avail = uint64_t(vfs.f_bavail) * vfs.f_frsize;
  if (avail < need) {
    if (uint64_t released = releaseKeptObjects(dir); released > 0 && statvfs(dir.c_str(), &vfs) == 0) {
      TROUPE_LOG(kInfo, "checkpoint segment {} is short of room: released {} bytes of freed objects kept for reuse",
                 segment.path_, released);
      avail = uint64_t(vfs.f_bavail) * vfs.f_frsize;
    }
  }
  if (avail < need) return noRoom(segment.path_, dir, need, avail, uint64_t(vfs.f_blocks) * vfs.f_frsize);

  // Made under a temporary name and renamed once complete: readers never see a partial segment.
  std::string tmpName = fmt::format("{}.tmp.{}.{}", options.name, getpid(), randomHex(4));
  std::string tmpPath = dir + "/" + tmpName;
  auto created = openRegularFile(tmpPath, O_RDWR | O_CREAT | O_EXCL);
  if (!created.isOk()) {
    return Status(StatusCode::kUnavailable,
                  fmt::format("cannot create checkpoint segment {}: {}", tmpPath, created.status().message()));
  }
  int fd = segment.fd_ = created->release();
  struct stat st {};
  if (fstat(fd, &st) == 0) segment.fileId_ = static_cast<uint64_t>(st.st_ino);
  auto fail = [&](Status status) {
    unlink(tmpPath.c_str());
    return status;
  };
  flock(fd, LOCK_EX | LOCK_NB);  // new and private: cannot be held by anyone else
  // posix_fallocate reserves every page now, so no later write into the mapping can hit a full
  // tmpfs (which would be a SIGBUS).
  if (int e = posix_fallocate(fd, 0, static_cast<off_t>(need)); e != 0) {
    if (e == ENOSPC || e == EFBIG) {
      if (fstatvfs(fd, &vfs) == 0) avail = uint64_t(vfs.f_bavail) * vfs.f_frsize;
      return fail(noRoom(segment.path_, dir, need, avail, uint64_t(vfs.f_blocks) * vfs.f_frsize));
    }
    return fail(Status(StatusCode::kUnavailable,
                       fmt::format("cannot allocate {} bytes for checkpoint segment {}: {}", need, tmpPath, errnoText(e))));
  }
  void* base = mmap(nullptr, need, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (base == MAP_FAILED) {
    int e = errno;
    return fail(Status(StatusCode::kResourceExhausted,
                       fmt::format("cannot map checkpoint segment {} ({} bytes): {}", tmpPath, need, errnoText(e))));
  }
  segment.base_ = static_cast<uint8_t*>(base);
  SegmentHeader* h = headerOf(segment.base_);
  std::memcpy(h->magic, kSegmentMagic, sizeof(kSegmentMagic));
  h->version = kSegmentVersion;
  h->slotCount = kSlots;
  h->slotBytes = slotBytes;
  h->totalBytes = need;
  h->creatorPid = static_cast<uint32_t>(getpid());
  std::atomic_thread_fence(std::memory_order_release);
  if (rename(tmpPath.c_str(), segment.path_.c_str()) != 0) {
    int e = errno;
    return fail(Status(StatusCode::kUnavailable,
                       fmt::format("cannot rename checkpoint segment {} to {}: {}", tmpPath, segment.path_, errnoText(e))));
  }
  recordInRegistry(options.name, segment.path_);
  return segment;
}

Result<FlashSegment> FlashSegment::openExisting(const SegmentOptions& options, bool writable) {
  FlashSegment segment;
  TROUPE_ASSIGN_OR_RETURN(auto dir, segmentDir(options));
  segment.options_ = options;
  segment.path_ = dir + "/" + options.name;
  // Never a blocking open: a FIFO someone made at the name would hang the restore. Owner and
  // mode are checked by mapAndCheck, with what to do.
  auto opened = openRegularFile(segment.path_, writable ? O_RDWR : O_RDONLY, RegularFileOptions{.mustBeMine = false});
  if (!opened.isOk()) {
    return Status(opened.status().code(),
                  fmt::format("cannot open checkpoint segment {}: {}", segment.path_, opened.status().message()));
  }
  segment.fd_ = opened->release();
  TROUPE_RETURN_IF_ERROR(segment.mapAndCheck(writable));
  return segment;
}

Status FlashSegment::mapAndCheck(bool writable) {
  struct stat st {};
  if (fstat(fd_, &st) != 0) return Status(StatusCode::kUnavailable, fmt::format("cannot stat {}", path_));
  // Weights go into it: a segment someone else made (or can read) is not ours to use.
  if (st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("refusing checkpoint segment {}: it belongs to uid {} with mode {:o}, and must be yours "
                              "(uid {}) with mode 600; remove it",
                              path_, st.st_uid, st.st_mode & 07777, ::geteuid()));
  }
  uint64_t size = static_cast<uint64_t>(st.st_size);
  fileId_ = static_cast<uint64_t>(st.st_ino);
  if (size < kSegmentHeaderBytes) {
    return Status(StatusCode::kFailedPrecondition, fmt::format("{} is not a checkpoint segment ({} bytes)", path_, size));
  }
  // Not pre-faulted: the pages exist already (a reader's faults only map them), and a reader that
  // looks at one slot's header must not pay for mapping the whole segment.
  void* base = mmap(nullptr, size, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd_, 0);
  if (base == MAP_FAILED) {
    int e = errno;
    return Status(StatusCode::kUnavailable, fmt::format("cannot map checkpoint segment {}: {}", path_, errnoText(e)));
  }
  base_ = static_cast<uint8_t*>(base);
  totalBytes_ = size;
  writable_ = writable;
  const SegmentHeader* h = headerOf(base_);
  if (std::memcmp(h->magic, kSegmentMagic, sizeof(kSegmentMagic)) != 0 || h->version != kSegmentVersion ||
      h->slotCount != kSlots || h->totalBytes != size || h->slotBytes % kPageBytes != 0 ||
      h->slotBytes > (size - kSegmentHeaderBytes) / kSlots || kSegmentHeaderBytes + kSlots * h->slotBytes != size) {
    return Status(StatusCode::kFailedPrecondition, fmt::format("{} is not a valid checkpoint segment", path_));
  }
  slotBytes_ = h->slotBytes;
  return Status::ok();
}

SlotInfo FlashSegment::slotInfo(int index) const {
  const SlotHeader& s = headerOf(base_)->slots[index];
  SlotInfo info;
  info.index = index;
  info.seq = loadShared(s.seq);
  info.state = static_cast<SlotState>(loadShared(s.state));
  info.step = loadShared(s.step);
  info.imageBytes = loadShared(s.imageBytes);
  info.writerPid = loadShared(s.writerPid);
  info.pinned = loadShared(s.pinned) != 0;
  // A writer that started after the first load changed seq: report the slot as being written.
  if (loadShared(s.seq) != info.seq) info.seq |= 1;
  return info;
}

std::array<SlotInfo, FlashSegment::kSlotCount> FlashSegment::slots() const {
  return {slotInfo(0), slotInfo(1), slotInfo(2)};
}

std::optional<SlotInfo> FlashSegment::newestComplete(uint64_t maxStep) const {
  std::optional<SlotInfo> best;
  for (const auto& s : slots()) {
    if (s.complete() && s.step <= maxStep && (!best || s.step > best->step)) best = s;
  }
  return best;
}

std::optional<SlotInfo> FlashSegment::completeAt(uint64_t step) const {
  for (const auto& s : slots()) {
    if (s.complete() && s.step == step) return s;
  }
  return std::nullopt;
}

const uint8_t* FlashSegment::slotData(int slot) const {
  return base_ + kSegmentHeaderBytes + static_cast<uint64_t>(slot) * slotBytes_;
}

uint8_t* FlashSegment::mutableSlotData(int slot) {
  TROUPE_CHECK(writable_, "segment {} is mapped read-only", path_);
  return base_ + kSegmentHeaderBytes + static_cast<uint64_t>(slot) * slotBytes_;
}

bool FlashSegment::unchanged(const SlotInfo& info) const {
  std::atomic_thread_fence(std::memory_order_acquire);
  return loadShared(headerOf(base_)->slots[info.index].seq) == info.seq;
}

int FlashSegment::slotToWrite() const {
  // Never the newest complete snapshot nor the pinned one; of the rest, a slot holding nothing
  // loadable (empty, torn, corrupt) first, else the oldest snapshot. With three slots there is
  // always one.
  auto all = slots();
  auto newest = newestComplete();
  int pick = -1;
  for (const auto& s : all) {
    if (newest && s.index == newest->index) continue;
    if (!s.complete()) return s.index;
    if (s.pinned) continue;
    if (pick < 0 || s.step < all[pick].step) pick = s.index;
  }
  TROUPE_CHECK(pick >= 0, "segment {}: no slot to write", path_);
  return pick;
}

void FlashSegment::startWrite(int index) {
  SlotHeader& s = headerOf(base_)->slots[index];
  uint64_t seq = loadShared(s.seq);
  storeShared<uint64_t>(s.seq, seq % 2 == 0 ? seq + 1 : seq + 2, std::memory_order_relaxed);
  storeShared<uint32_t>(s.state, static_cast<uint32_t>(SlotState::kWriting), std::memory_order_relaxed);
  storeShared<uint32_t>(s.writerPid, static_cast<uint32_t>(getpid()), std::memory_order_relaxed);
  storeShared<uint32_t>(s.pinned, 0, std::memory_order_relaxed);
  // Readers that see the new bytes also see the odd sequence number.
  std::atomic_thread_fence(std::memory_order_release);
}

void FlashSegment::finishWrite(int index, SlotState state, uint64_t step, uint64_t imageBytes) {
  SlotHeader& s = headerOf(base_)->slots[index];
  storeShared<uint64_t>(s.step, step, std::memory_order_relaxed);
  storeShared<uint64_t>(s.imageBytes, imageBytes, std::memory_order_relaxed);
  storeShared<uint32_t>(s.state, static_cast<uint32_t>(state), std::memory_order_relaxed);
  uint64_t seq = loadShared(s.seq, std::memory_order_relaxed);
  storeShared<uint64_t>(s.seq, seq + 1, std::memory_order_release);
}

Result<SlotInfo> FlashSegment::save(const ImageLayout& layout, const ImageStamp& stamp,
                                    std::span<const ConstBuffer> tensors, std::string_view meta) {
  TROUPE_CHECK(writable_, "save on a read-only segment {}", path_);
  const auto& specs = layout.tensors();
  if (tensors.size() != specs.size()) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{} tensors given for a layout of {}", tensors.size(), specs.size()));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    if (tensors[i].size != specs[i].bytes || (tensors[i].data == nullptr && specs[i].bytes != 0)) {
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("tensor '{}' is {} bytes; the layout says {}", specs[i].name, tensors[i].size,
                                specs[i].bytes));
    }
  }
  if (meta.size() > layout.metaCapacity()) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("checkpoint metadata is {} bytes; the layout has room for {}", meta.size(),
                              layout.metaCapacity()));
  }
  if (layout.imageBytes() > slotBytes_) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("a {}-byte image does not fit segment {} ({}-byte slots): open it again for this layout",
                              layout.imageBytes(), path_, slotBytes_));
  }
  int index = slotToWrite();
  startWrite(index);
  uint8_t* image = mutableSlotData(index);
  std::vector<TensorTransfer> transfers(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    transfers[i] = {image + layout.tensorOffset(i), static_cast<const uint8_t*>(tensors[i].data), specs[i].bytes};
  }
  std::function<void(uint64_t)> progress;
  if (options_.fault.armed(FaultStage::kSnapshot, stamp.step)) {
    progress = [this, step = stamp.step, paused = false](uint64_t done) mutable {
      if (!paused && done >= options_.fault.afterBytes) {
        paused = true;
        options_.fault.pauseHere(step, done);
      }
    };
  }
  std::vector<uint32_t> crcs = copyTensors(transfers, options_.copyThreads, progress);
  TROUPE_RETURN_IF_ERROR(layout.encodeHeader(image, stamp, crcs, meta));
  finishWrite(index, SlotState::kComplete, stamp.step, layout.imageBytes());
  dropFrom(stamp.step, index);
  return slotInfo(index);
}

void FlashSegment::dropFrom(uint64_t step, int keep) {
  for (const auto& s : slots()) {
    if (s.index != keep && s.complete() && s.step >= step) (void)markSlot(s, SlotState::kEmpty);
  }
}

void FlashSegment::discardAfter(uint64_t step) {
  for (const auto& s : slots()) {
    if (s.complete() && s.step > step) (void)markSlot(s, SlotState::kEmpty);
  }
}

Status FlashSegment::pin(uint64_t step) {
  if (!writable_) return Status(StatusCode::kFailedPrecondition, fmt::format("segment {} is mapped read-only", path_));
  auto target = completeAt(step);
  if (!target) {
    return Status(StatusCode::kNotFound, fmt::format("cannot pin step {} in {}: no complete snapshot of it", step, path_));
  }
  SegmentHeader* h = headerOf(base_);
  storeShared<uint32_t>(h->slots[target->index].pinned, 1);
  for (int i = 0; i < kSlots; ++i) {
    if (i != target->index) storeShared<uint32_t>(h->slots[i].pinned, 0);
  }
  // Pinned while still holding that step: otherwise a writer took the slot meanwhile.
  if (!unchanged(*target)) {
    return Status(StatusCode::kAborted, fmt::format("step {} in {} was overwritten while being pinned", step, path_));
  }
  return Status::ok();
}

Result<SlotInfo> FlashSegment::beginImage(uint64_t imageBytes) {
  TROUPE_CHECK(writable_, "beginImage on a read-only segment {}", path_);
  if (imageBytes > slotBytes_) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("a {}-byte image does not fit segment {} ({}-byte slots)", imageBytes, path_, slotBytes_));
  }
  int index = slotToWrite();
  startWrite(index);
  return slotInfo(index);
}

Result<SlotInfo> FlashSegment::commitImage(int slot, bool verifyData) {
  const uint8_t* image = slotData(slot);
  TROUPE_ASSIGN_OR_RETURN(auto header, parseImageHeader(image, slotBytes_));
  if (header.layout.imageBytes() > slotBytes_) {
    return Status(StatusCode::kFailedPrecondition, fmt::format("image in {} is larger than its slot", path_));
  }
  if (verifyData) TROUPE_RETURN_IF_ERROR(verifyImageData(header, image));
  finishWrite(slot, SlotState::kComplete, header.stamp.step, header.layout.imageBytes());
  dropFrom(header.stamp.step, slot);
  return slotInfo(slot);
}

Result<ImageHeader> FlashSegment::verify(const SlotInfo& info) const {
  if (!info.complete()) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("slot {} of {} is {}, not a complete snapshot", info.index, path_, slotStateName(info.state)));
  }
  const uint8_t* image = slotData(info.index);
  auto header = parseImageHeader(image, std::min(info.imageBytes, slotBytes_));
  if (header.isOk() && header->stamp.step != info.step) {
    header = Status(StatusCode::kFailedPrecondition,
                    fmt::format("corrupt checkpoint image: slot says step {}, image says {}", info.step, header->stamp.step));
  }
  if (header.isOk() && header->layout.imageBytes() != info.imageBytes) {
    header = Status(StatusCode::kFailedPrecondition, "corrupt checkpoint image: size differs from its slot's");
  }
  if (header.isOk()) {
    Status data = verifyImageData(*header, image);
    if (!data.isOk()) header = data;
  }
  if (!unchanged(info)) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("slot {} of {} (step {}) was overwritten while being read", info.index, path_, info.step));
  }
  if (!header.isOk()) {
    return Status(header.status().code(), fmt::format("{} (slot {} of {})", header.status().message(), info.index, path_));
  }
  return header;
}

Result<ImageHeader> FlashSegment::restoreInto(const SlotInfo& info, std::span<const MutableBuffer> targets) const {
  if (!info.complete()) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("slot {} of {} is {}, not a complete snapshot", info.index, path_, slotStateName(info.state)));
  }
  const uint8_t* image = slotData(info.index);
  auto header = parseImageHeader(image, std::min(info.imageBytes, slotBytes_));
  if (!header.isOk() || !unchanged(info)) {
    if (!unchanged(info)) {
      return Status(StatusCode::kFailedPrecondition,
                    fmt::format("slot {} of {} (step {}) was overwritten while being read", info.index, path_, info.step));
    }
    return Status(header.status().code(), fmt::format("{} (slot {} of {})", header.status().message(), info.index, path_));
  }
  const auto& specs = header->layout.tensors();
  if (targets.size() != specs.size()) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{} targets for a snapshot of {} tensors", targets.size(), specs.size()));
  }
  std::vector<TensorTransfer> transfers(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    if (targets[i].size != specs[i].bytes) {
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("target for tensor '{}' is {} bytes; the snapshot has {}", specs[i].name, targets[i].size,
                                specs[i].bytes));
    }
    transfers[i] = {static_cast<uint8_t*>(targets[i].data), image + header->layout.tensorOffset(i), specs[i].bytes};
  }
  prefaultDestinations(transfers);
  std::vector<uint32_t> crcs = copyTensors(transfers, options_.copyThreads);
  if (!unchanged(info)) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("slot {} of {} (step {}) was overwritten while being read", info.index, path_, info.step));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    if (crcs[i] != header->crcs[i]) {
      return Status(StatusCode::kFailedPrecondition,
                    fmt::format("corrupt checkpoint image: tensor '{}' of rank {} step {} in slot {} of {}: checksum "
                                "{:08x} != recorded {:08x}",
                                specs[i].name, header->stamp.rank, header->stamp.step, info.index, path_, crcs[i],
                                header->crcs[i]));
    }
  }
  return header;
}

Status FlashSegment::markSlot(const SlotInfo& info, SlotState state) {
  if (!writable_) return Status(StatusCode::kFailedPrecondition, fmt::format("segment {} is mapped read-only", path_));
  SlotHeader& s = headerOf(base_)->slots[info.index];
  uint64_t expected = info.seq;
  // Moves seq on by two (stays even) only if nobody wrote the slot since `info` was read.
  if (!std::atomic_ref<uint64_t>(s.seq).compare_exchange_strong(expected, info.seq + 1)) {
    return Status(StatusCode::kAborted, fmt::format("slot {} of {} changed meanwhile", info.index, path_));
  }
  storeShared<uint32_t>(s.state, static_cast<uint32_t>(state));
  storeShared<uint64_t>(s.seq, info.seq + 2);
  return Status::ok();
}

Status FlashSegment::remove() {
  int rc = unlink(path_.c_str());
  if (rc != 0 && errno != ENOENT) {
    int e = errno;
    return Status(StatusCode::kUnavailable, fmt::format("cannot remove checkpoint segment {}: {}", path_, errnoText(e)));
  }
  return Status::ok();
}

Result<std::vector<std::string>> removeSegments(const std::string& dirArg, const std::string& prefix) {
  std::string dir = dirArg.empty() ? defaultShmDir() : dirArg;
  std::vector<std::string> removed;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    // "<name>.tmp.<pid>.<hex>": only a dead process's.
    auto tmp = name.find(".tmp.");
    if (tmp != std::string::npos) {
      int pid = std::atoi(name.c_str() + tmp + 5);
      if (pid > 0 && (kill(pid, 0) == 0 || errno != ESRCH)) continue;
    }
    if (fs::remove(entry.path(), ec)) removed.push_back(name);
  }
  if (ec && ec != std::errc::no_such_file_or_directory) {
    return Status(StatusCode::kUnavailable, fmt::format("cannot list {}: {}", dir, ec.message()));
  }
  return removed;
}

}  // namespace troupe::checkpoint
