// Shared-memory pipes between the ranks of one host (see shm_transport.h for the design).
#include "shm_transport.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include <fmt/format.h>

#include "troupe/runtime/ids.h"
#include "troupe/runtime/clock.h"
#include "troupe/runtime/logging.h"

namespace troupe::collectives {

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "the pipes' counters are shared between processes and must be lock-free");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "a futex word is 32 bits");


namespace {


constexpr uint64_t kSegmentMagic = 0x314d485343525454;  // "TTRCSHM1"
constexpr uint32_t kSegmentVersion = 2;  // 2: life locks
constexpr size_t kPage = 4096;
constexpr size_t kPublishBytes = 256 << 10;  // a producer publishes at least this often
constexpr int kMaxLocalRanks = 1024;
constexpr auto kProducerWaitSlice = std::chrono::milliseconds(100);

struct SegmentHeader {
  uint64_t magic;
  uint32_t version;
  int32_t localCount;
  uint64_t pipeBytes;
  uint64_t totalBytes;
  char nonce[32];
};
static_assert(sizeof(SegmentHeader) == 64);

struct alignas(64) DoorbellSlot {
  std::atomic<uint32_t> seq;
};

uint64_t alignPage(uint64_t bytes) { return (bytes + kPage - 1) & ~uint64_t{kPage - 1}; }
uint64_t pairsOf(int localCount) { return uint64_t(localCount) * uint64_t(localCount - 1); }
struct alignas(64) LifeLockSlot {
  pthread_mutex_t lock;
  std::atomic<uint32_t> died;  // 1 once a watcher found the owner dead (life_locks.cc)
};
static_assert(sizeof(LifeLockSlot) == 64);

// The header, a doorbell slot per rank, a life lock slot per rank, then (page-aligned) the pipes'
// controls and their data.
uint64_t lifeLocksOffset(int localCount) { return 64 + 64 * uint64_t(localCount); }
uint64_t controlsOffset(int localCount) { return alignPage(64 + 128 * uint64_t(localCount)); }
uint64_t dataOffset(int localCount) {
  return controlsOffset(localCount) + alignPage(sizeof(PipeControl) * pairsOf(localCount));
}

// The handshake of the setup, sent whole over a data connection.
struct ShmHello {
  enum Kind : uint8_t { kOffer = 1, kAnswer = 2, kVerdict = 3 };
  uint32_t magic = 0x4d485354;  // "TSHM"
  uint16_t version = 1;
  uint8_t kind = 0;
  uint8_t ok = 0;
  int32_t localCount = 0;
  int32_t localIndex = 0;
  uint64_t pipeBytes = 0;
  uint64_t totalBytes = 0;
  char name[128] = {};
  char nonce[32] = {};
};
static_assert(sizeof(ShmHello) == 192);

constexpr const char* kNamePrefix = "/troupe-coll-";

// A name we create or accept: our prefix, then [A-Za-z0-9._-] only, NUL-terminated in place.
bool validName(const char* name, size_t capacity) {
  const size_t length = ::strnlen(name, capacity);
  if (length == capacity || length <= std::strlen(kNamePrefix)) return false;
  if (std::strncmp(name, kNamePrefix, std::strlen(kNamePrefix)) != 0) return false;
  for (size_t i = 1; i < length; ++i) {
    const char c = name[i];
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) return false;
  }
  return true;
}

std::string groupPart(const std::string& group) {
  std::string part;
  for (char c : group) {
    if (part.size() == 24) break;
    part.push_back(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' ? c : '_');
  }
  return part;
}

std::string segmentName(const CommunicatorOptions& options) {
  return fmt::format("{}{}-{}-{}", kNamePrefix, groupPart(options.group), options.epoch, randomHex(8));
}

// Names are unlinked once every rank mapped them, so one stays only when its creator died during
// a setup. Such a name of this group from an earlier epoch is removed here: that epoch is over
// (this rank advanced the group past it), so its setup, if any still runs, can only fall back to
// TCP for ranks that are about to fail anyway.
void removeStaleSegments(const CommunicatorOptions& options) {
  const std::string prefix = std::string(kNamePrefix + 1) + groupPart(options.group) + "-";
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name.rfind(prefix, 0) != 0) continue;
    // <prefix><epoch>-<16 hex digits>: the epoch is what remains between the prefix and the random part.
    const size_t dash = name.rfind('-');
    if (dash == std::string::npos || dash <= prefix.size() || name.size() - dash - 1 != 16) continue;
    const std::string epoch = name.substr(prefix.size(), dash - prefix.size());
    if (epoch.empty() || epoch.size() > 18 || epoch.find_first_not_of("0123456789") != std::string::npos) continue;
    if (std::stoll(epoch) < options.epoch) ::shm_unlink(("/" + name).c_str());
  }
  ::closedir(dir);
}

// An owned mapping until handed to a ShmSegment.
struct Mapping {
  void* base = MAP_FAILED;
  size_t bytes = 0;
  ~Mapping() {
    if (base != MAP_FAILED) ::munmap(base, bytes);
  }
  void* release() {
    void* b = base;
    base = MAP_FAILED;
    return b;
  }
};

// Creates, sizes, reserves and maps the segment and writes its header.
// `exists` tells whether the name was created (and must be unlinked), even when a later step failed.
Status createSegment(const std::string& name, int localCount, size_t pipeBytes, uint64_t total,
                     const std::string& nonce, Mapping& mapping, bool& exists) {
  Fd fd(::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600));
  if (!fd) return Status(StatusCode::kUnavailable, fmt::format("shm_open({}): {}", name, std::strerror(errno)));
  exists = true;
  if (::ftruncate(fd.get(), static_cast<off_t>(total)) != 0) {
    return Status(StatusCode::kResourceExhausted, fmt::format("ftruncate({} bytes): {}", total, std::strerror(errno)));
  }
  // Reserve the pages now: a full /dev/shm then fails here instead of raising SIGBUS mid-operation.
  if (int rc = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(total)); rc != 0) {
    return Status(StatusCode::kResourceExhausted,
                  fmt::format("reserving {} bytes of /dev/shm: {}", total, std::strerror(rc)));
  }
  mapping.base = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd.get(), 0);
  if (mapping.base == MAP_FAILED) {
    return Status(StatusCode::kResourceExhausted, fmt::format("mmap({} bytes): {}", total, std::strerror(errno)));
  }
  mapping.bytes = total;
  auto* header = static_cast<SegmentHeader*>(mapping.base);
  header->magic = kSegmentMagic;
  header->version = kSegmentVersion;
  header->localCount = localCount;
  header->pipeBytes = pipeBytes;
  header->totalBytes = total;
  std::memcpy(header->nonce, nonce.data(), sizeof(header->nonce));
  for (int local = 0; local < localCount; ++local) {
    auto* slot = reinterpret_cast<LifeLockSlot*>(static_cast<char*>(mapping.base) + lifeLocksOffset(localCount) +
                                                 64 * uint64_t(local));
    TROUPE_RETURN_IF_ERROR(initLifeLock(&slot->lock));
    slot->died.store(0);
  }
  return Status::ok();
}

// Opens and maps the segment `offer` names, checking that it is the one offered.
Status openSegment(const ShmHello& offer, Mapping& mapping) {
  Fd fd(::shm_open(offer.name, O_RDWR | O_CLOEXEC, 0));
  if (!fd) return Status(StatusCode::kUnavailable, fmt::format("shm_open({}): {}", offer.name, std::strerror(errno)));
  struct stat info {};
  if (::fstat(fd.get(), &info) != 0 || static_cast<uint64_t>(info.st_size) != offer.totalBytes) {
    return Status(StatusCode::kUnavailable, fmt::format("{} is {} bytes, not the {} offered", offer.name,
                                                        static_cast<int64_t>(info.st_size), offer.totalBytes));
  }
  mapping.base = ::mmap(nullptr, offer.totalBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd.get(), 0);
  if (mapping.base == MAP_FAILED) {
    return Status(StatusCode::kResourceExhausted, fmt::format("mmap({}): {}", offer.name, std::strerror(errno)));
  }
  mapping.bytes = offer.totalBytes;
  const auto* header = static_cast<const SegmentHeader*>(mapping.base);
  if (header->magic != kSegmentMagic || header->version != kSegmentVersion ||
      header->localCount != offer.localCount || header->pipeBytes != offer.pipeBytes ||
      header->totalBytes != offer.totalBytes || std::memcmp(header->nonce, offer.nonce, sizeof(offer.nonce)) != 0) {
    return Status(StatusCode::kUnavailable,
                  fmt::format("{} is not the segment offered (another /dev/shm, or a stale name)", offer.name));
  }
  return Status::ok();
}

Status sendHello(const RendezvousPeer& peer, const ShmHello& hello, Clock::time_point deadline) {
  Status sent = sendAllBefore(peer.data.get(), &hello, sizeof(hello), deadline);
  if (!sent.isOk()) {
    return Status(sent.code(), fmt::format("shared-memory setup with {}: {}", peer.name, sent.message()));
  }
  return Status::ok();
}

Result<ShmHello> receiveHello(const RendezvousPeer& peer, ShmHello::Kind kind, Clock::time_point deadline) {
  ShmHello hello;
  Status received = recvAllBefore(peer.data.get(), &hello, sizeof(hello), deadline);
  if (!received.isOk()) {
    return Status(received.code(), fmt::format("shared-memory setup with {}: {}", peer.name, received.message()));
  }
  const ShmHello expected;
  if (hello.magic != expected.magic || hello.version != expected.version || hello.kind != kind || hello.ok > 1) {
    return Status(StatusCode::kUnavailable,
                  fmt::format("shared-memory setup with {}: got bytes that are not the expected handshake "
                              "(kind {}, version {})",
                              peer.name, hello.kind, hello.version));
  }
  return hello;
}

}  // namespace

std::string localHostIdentity() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string bootId;
  std::getline(in, bootId);
  struct stat netns {};
  if (bootId.empty() || ::stat("/proc/self/ns/net", &netns) != 0) return "";
  std::string id = fmt::format("{}/netns:{}:{}", bootId, static_cast<uint64_t>(netns.st_dev),
                               static_cast<uint64_t>(netns.st_ino));
  // The tests' seam: ranks given different values act as ranks on different hosts.
  if (const char* split = std::getenv("TROUPE_COLLECTIVES_HOST_ID"); split != nullptr && *split != '\0') {
    id += fmt::format("/as:{}", std::string(split).substr(0, 64));
  }
  return id;
}

bool sharedMemoryEnabled(const CommunicatorOptions& options) {
  const char* env = std::getenv("TROUPE_COLLECTIVES_SHM");
  return options.sharedMemory && !(env != nullptr && std::string(env) == "0");
}

void futexWait(std::atomic<uint32_t>& word, uint32_t expected, std::chrono::milliseconds timeout) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  ts.tv_nsec = static_cast<long>((timeout.count() % 1000) * 1'000'000);
  // A shared (not FUTEX_PRIVATE) wait: the word lives in memory other processes map. EAGAIN (the
  // word already changed), EINTR and ETIMEDOUT all just return; callers re-check their condition.
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futexWakeAll(std::atomic<uint32_t>& word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

// ---- ShmPipe ----

void ShmPipe::publishHead() {
  control_->head.store(head_, std::memory_order_seq_cst);
  const uint64_t want = control_->consumerWant.load(std::memory_order_seq_cst);
  if (want != 0 && head_ >= want) {
    uint64_t expected = want;
    if (control_->consumerWant.compare_exchange_strong(expected, 0)) {
      consumerDoorbell_->fetch_add(1, std::memory_order_seq_cst);
      futexWakeAll(*consumerDoorbell_);
    }
  }
}

ShmPipe::WriteResult ShmPipe::write(std::vector<iovec>& iovs, bool block, const std::atomic<bool>& stop) {
  size_t first = 0;
  WriteResult result = WriteResult::kDone;
  while (first < iovs.size()) {
    iovec& item = iovs[first];
    if (item.iov_len == 0) {
      ++first;
      continue;
    }
    const uint64_t tail = control_->tail.load(std::memory_order_acquire);
    if (tail > head_ || head_ - tail > capacity_ || tail % kPipeAlign != 0) {
      result = WriteResult::kCorrupt;
      break;
    }
    const size_t free = capacity_ - static_cast<size_t>(head_ - tail);
    const size_t padded = roundUpToPipeAlign(item.iov_len);
    if (free == 0 || (free < padded && free < kPublishBytes && free < capacity_ / 2)) {
      // Too little room: wait until the consumer frees what this item (or half the pipe) needs.
      if (!block) {
        result = WriteResult::kFull;
        break;
      }
      const size_t need = std::min(padded, capacity_ / 2);
      const uint32_t seq = control_->tailSeq.load(std::memory_order_seq_cst);
      control_->producerWant.store(head_ + need - capacity_, std::memory_order_seq_cst);
      const uint64_t now = control_->tail.load(std::memory_order_seq_cst);
      if (capacity_ - (head_ - std::min(now, head_)) >= need) {
        control_->producerWant.store(0, std::memory_order_relaxed);
        continue;
      }
      if (stop.load()) {
        control_->producerWant.store(0, std::memory_order_relaxed);
        result = WriteResult::kStopped;
        break;
      }
      futexWait(control_->tailSeq, seq, kProducerWaitSlice);
      continue;
    }
    // A piece that ends the item may leave padding; one that does not is a multiple of kPipeAlign
    // (free and kPublishBytes are), so every item still starts aligned.
    const size_t piece = std::min({item.iov_len, free, kPublishBytes});
    const size_t at = static_cast<size_t>(head_ % capacity_);
    const size_t firstPart = std::min(piece, capacity_ - at);
    std::memcpy(data_ + at, item.iov_base, firstPart);
    if (piece > firstPart) {
      std::memcpy(data_, static_cast<const char*>(item.iov_base) + firstPart, piece - firstPart);
    }
    head_ += piece == item.iov_len ? roundUpToPipeAlign(piece) : piece;
    item.iov_base = static_cast<char*>(item.iov_base) + piece;
    item.iov_len -= piece;
    publishHead();
    if (item.iov_len == 0) ++first;
  }
  iovs.erase(iovs.begin(), iovs.begin() + static_cast<ptrdiff_t>(first));
  return result;
}

void ShmPipe::wakeProducer() {
  control_->tailSeq.fetch_add(1, std::memory_order_seq_cst);
  futexWakeAll(control_->tailSeq);
}

size_t ShmPipe::unread() const {
  const uint64_t tail = control_->tail.load(std::memory_order_acquire);
  const uint64_t head = control_->head.load(std::memory_order_acquire);
  return head >= tail && head - tail <= capacity_ ? static_cast<size_t>(head - tail) : 0;
}

std::optional<size_t> ShmPipe::available() const {
  const uint64_t head = control_->head.load(std::memory_order_acquire);
  if (head < tail_ || head - tail_ > capacity_ || head % kPipeAlign != 0) return std::nullopt;
  return static_cast<size_t>(head - tail_);
}

void ShmPipe::consume(size_t bytes) {
  tail_ += bytes;
  control_->tail.store(tail_, std::memory_order_seq_cst);
  const uint64_t want = control_->producerWant.load(std::memory_order_seq_cst);
  if (want != 0 && tail_ >= want) {
    uint64_t expected = want;
    if (control_->producerWant.compare_exchange_strong(expected, 0)) wakeProducer();
  }
}

bool ShmPipe::armWake(size_t bytes) {
  const uint64_t target = tail_ + bytes;
  control_->consumerWant.store(target, std::memory_order_seq_cst);
  if (control_->head.load(std::memory_order_seq_cst) >= target) {
    uint64_t expected = target;
    control_->consumerWant.compare_exchange_strong(expected, 0);
    return false;
  }
  return true;
}

// ---- ShmSegment ----

uint64_t segmentBytes(int localCount, size_t pipeBytes) {
  if (localCount < 2 || localCount > kMaxLocalRanks || pipeBytes == 0) return 0;
  const uint64_t pairs = pairsOf(localCount);
  if (pipeBytes > kMaxSegmentBytes / pairs) return 0;
  const uint64_t total = dataOffset(localCount) + pairs * pipeBytes;
  return total > kMaxSegmentBytes ? 0 : total;
}

size_t shmChunkBytes(size_t chunkBytes) {
  return std::max(chunkBytes, std::min<size_t>(size_t{1} << 20, 4 * chunkBytes));
}

size_t pipeBytesFor(int localCount, size_t chunkBytes) {
  if (localCount < 2 || localCount > kMaxLocalRanks) return 0;
  const size_t wanted = std::clamp<size_t>(chunkBytes <= kMaxPipeBytes / 4 ? 4 * chunkBytes : kMaxPipeBytes,
                                           kMinPipeBytes, kMaxPipeBytes);
  const uint64_t room = (kMaxSegmentBytes - dataOffset(localCount)) / pairsOf(localCount);
  size_t bytes = std::min<uint64_t>(wanted, room);
  bytes &= ~(kMinPipeBytes - 1);  // a multiple of 64 KiB: pages and kPipeAlign divide it
  return bytes >= kMinPipeBytes ? bytes : 0;
}

ShmSegment::ShmSegment(void* base, size_t bytes, int localCount, size_t pipeBytes)
    : base_(static_cast<char*>(base)), bytes_(bytes), localCount_(localCount), pipeBytes_(pipeBytes) {}

ShmSegment::~ShmSegment() { ::munmap(base_, bytes_); }

ShmPipe ShmSegment::pipe(int from, int to) const {
  const uint64_t index = uint64_t(from) * uint64_t(localCount_ - 1) + uint64_t(to < from ? to : to - 1);
  auto* control = reinterpret_cast<PipeControl*>(base_ + controlsOffset(localCount_) + index * sizeof(PipeControl));
  char* data = base_ + dataOffset(localCount_) + index * pipeBytes_;
  return ShmPipe(control, data, pipeBytes_, &doorbell(to));
}

std::atomic<uint32_t>& ShmSegment::doorbell(int local) const {
  return reinterpret_cast<DoorbellSlot*>(base_ + 64 + 64 * size_t(local))->seq;
}

pthread_mutex_t* ShmSegment::lifeLock(int local) const {
  return &reinterpret_cast<LifeLockSlot*>(base_ + lifeLocksOffset(localCount_) + 64 * size_t(local))->lock;
}

std::atomic<uint32_t>* ShmSegment::lifeDied(int local) const {
  return &reinterpret_cast<LifeLockSlot*>(base_ + lifeLocksOffset(localCount_) + 64 * size_t(local))->died;
}

int ShmLink::localOf(int rank) const {
  auto it = std::find(localRanks.begin(), localRanks.end(), rank);
  return it == localRanks.end() ? -1 : static_cast<int>(it - localRanks.begin());
}

// ---- Setup ----

Result<std::optional<ShmLink>> setUpSharedMemory(const CommunicatorOptions& options,
                                                 std::vector<RendezvousPeer>& peers,
                                                 const std::string& myHostId, Clock::time_point deadline) {
  ShmLink link;
  if (myHostId.empty()) return std::optional<ShmLink>();
  for (int r = 0; r < options.worldSize; ++r) {
    if (r == options.rank || peers[r].hostId == myHostId) link.localRanks.push_back(r);
  }
  const int localCount = static_cast<int>(link.localRanks.size());
  if (localCount < 2) return std::optional<ShmLink>();
  link.myLocal = link.localOf(options.rank);
  const bool enabled = sharedMemoryEnabled(options);
  const std::string where = fmt::format("group '{}' epoch {} rank {}", options.group, options.epoch, options.rank);
  Mapping mapping;
  size_t pipeBytes = 0;
  // Once this rank has mapped the segment: it holds its life lock from then on, so by the end of
  // the setup every rank of the host holds its own.
  auto holdLife = [&]() -> Status {
    const size_t bytes = mapping.bytes;
    link.segment = std::make_shared<ShmSegment>(mapping.release(), bytes, localCount, pipeBytes);
    TROUPE_ASSIGN_OR_RETURN(auto life, LifeLocks::hold(link.segment, link.segment->lifeLock(link.myLocal)));
    link.life = std::move(life);
    return Status::ok();
  };

  if (link.myLocal == 0) {
    // The host's lowest rank: create, offer, collect the answers, send the verdict, unlink.
    ShmHello offer;
    offer.kind = ShmHello::kOffer;
    offer.localCount = localCount;
    std::string name;
    struct Unlink {
      std::string name;
      ~Unlink() {
        if (!name.empty()) ::shm_unlink(name.c_str());
      }
    } unlink;
    pipeBytes = pipeBytesFor(localCount, shmChunkBytes(std::max<size_t>(options.chunkBytes & ~size_t{63}, 4096)));
    const uint64_t total = segmentBytes(localCount, pipeBytes);
    if (enabled && total > 0) {
      removeStaleSegments(options);
      name = segmentName(options);
      const std::string nonce = randomHex(sizeof(offer.nonce) / 2);
      bool exists = false;
      Status created = createSegment(name, localCount, pipeBytes, total, nonce, mapping, exists);
      if (exists) unlink.name = name;
      if (created.isOk()) created = holdLife();
      if (created.isOk()) {
        offer.ok = 1;
        offer.pipeBytes = pipeBytes;
        offer.totalBytes = total;
        std::memcpy(offer.name, name.c_str(), name.size() + 1);
        std::memcpy(offer.nonce, nonce.data(), sizeof(offer.nonce));
      } else {
        TROUPE_LOG(kWarning, "{}: no shared memory for the ranks on this host, using TCP: {}", where,
                   created.message());
      }
    }
    bool everyone = offer.ok == 1;
    for (int local = 1; local < localCount; ++local) {
      offer.localIndex = local;
      TROUPE_RETURN_IF_ERROR(sendHello(peers[link.localRanks[local]], offer, deadline));
    }
    for (int local = 1; local < localCount; ++local) {
      const RendezvousPeer& peer = peers[link.localRanks[local]];
      auto answer = receiveHello(peer, ShmHello::kAnswer, deadline);
      if (!answer) return answer.status();
      if (offer.ok == 1 && answer->ok != 1) {
        TROUPE_LOG(kWarning, "{}: {} could not map the shared memory; the ranks on this host use TCP", where,
                   peer.name);
      }
      everyone = everyone && answer->ok == 1;
    }
    ShmHello verdict;
    verdict.kind = ShmHello::kVerdict;
    verdict.ok = everyone ? 1 : 0;
    for (int local = 1; local < localCount; ++local) {
      TROUPE_RETURN_IF_ERROR(sendHello(peers[link.localRanks[local]], verdict, deadline));
    }
    if (!everyone) return std::optional<ShmLink>();
  } else {
    const RendezvousPeer& leader = peers[link.localRanks[0]];
    auto offer = receiveHello(leader, ShmHello::kOffer, deadline);
    if (!offer) return offer.status();
    ShmHello answer;
    answer.kind = ShmHello::kAnswer;
    if (offer->ok == 1) {
      const bool consistent = offer->localCount == localCount && offer->localIndex == link.myLocal &&
                              validName(offer->name, sizeof(offer->name)) &&
                              offer->pipeBytes >= kMinPipeBytes && offer->pipeBytes <= kMaxPipeBytes &&
                              offer->pipeBytes % kMinPipeBytes == 0 &&
                              offer->totalBytes == segmentBytes(localCount, offer->pipeBytes);
      if (!consistent) {
        TROUPE_LOG(kWarning, "{}: {} offered shared memory that does not fit this host's {} ranks "
                   "(count {}, index {}, {} bytes); using TCP",
                   where, leader.name, localCount, offer->localCount, offer->localIndex, offer->totalBytes);
      } else if (!enabled) {
        // Declined: TROUPE_COLLECTIVES_SHM=0 or options.sharedMemory = false here.
      } else if (Status opened = openSegment(*offer, mapping); !opened.isOk()) {
        TROUPE_LOG(kWarning, "{}: cannot map the shared memory {} offered, using TCP: {}", where, leader.name,
                   opened.message());
      } else {
        pipeBytes = offer->pipeBytes;
        if (Status held = holdLife(); held.isOk()) {
          answer.ok = 1;
        } else {
          TROUPE_LOG(kWarning, "{}: the shared memory {} offered is unusable, using TCP: {}", where, leader.name,
                     held.message());
        }
      }
    }
    TROUPE_RETURN_IF_ERROR(sendHello(leader, answer, deadline));
    auto verdict = receiveHello(leader, ShmHello::kVerdict, deadline);
    if (!verdict) return verdict.status();
    if (verdict->ok != 1 || answer.ok != 1) return std::optional<ShmLink>();
  }
  return std::optional<ShmLink>(std::move(link));
}

}  // namespace troupe::collectives
