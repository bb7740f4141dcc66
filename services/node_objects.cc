#include "node_objects.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <filesystem>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <kj/debug.h>

#include "troupe/runtime/logging.h"
#include "troupe/runtime/process.h"
#include "troupe/runtime/safe_open.h"

namespace troupe {

namespace fs = std::filesystem;

namespace {

// Whether `path` is a directory of this user closed to others, checked on an open descriptor.
bool privateDirectory(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st {};
  bool ok = ::fstat(fd, &st) == 0 && st.st_uid == ::geteuid() && (st.st_mode & 077) == 0;
  ::close(fd);
  return ok;
}

// The pid an object's name starts with ("<pid>-..."), 0 if none.
pid_t ownerOf(std::string_view name) {
  pid_t pid = 0;
  size_t i = 0;
  for (; i < name.size() && i < 10 && name[i] >= '0' && name[i] <= '9'; ++i) pid = pid * 10 + (name[i] - '0');
  return i < name.size() && name[i] == '-' ? pid : 0;
}

// Whether `name` is a result handed over to its caller ("<pid>-h..."): it outlives its writer,
// and only it may be dropped by a peer.
bool handedOver(std::string_view name) {
  return ownerOf(name) > 0 && name.substr(name.find('-') + 1).rfind("h", 0) == 0;
}

bool allOf(std::string_view text, size_t most, bool (*ok)(char)) {
  if (text.empty() || text.size() > most) return false;
  for (char c : text) {
    if (!ok(c)) return false;
  }
  return true;
}
bool isDigit(char c) { return c >= '0' && c <= '9'; }
bool isHex(char c) { return isDigit(c) || (c >= 'a' && c <= 'f'); }

// "<pid>", "<node hex>.<pid>" or "x<hex>.<pid>" (node_objects.h).
bool validHolder(std::string_view holder) {
  size_t dot = holder.find('.');
  if (dot == std::string_view::npos) return allOf(holder, 10, isDigit);
  std::string_view where = holder.substr(0, dot);
  if (!where.empty() && where[0] == 'x') where.remove_prefix(1);
  return allOf(where, 64, isHex) && allOf(holder.substr(dot + 1), 10, isDigit);
}

// A hold file's holder (node_objects.h): its node ("" for this one, "x..." for none) and pid;
// nullopt when malformed.
struct Holder {
  std::string node;
  pid_t pid = 0;
};
std::optional<Holder> parseHolder(std::string_view file) {
  std::string_view holder = file.substr(0, file.find(':'));  // a holder, or its ref in flight
  if (!validHolder(holder)) return std::nullopt;
  size_t dot = holder.find('.');
  std::string_view pid = dot == std::string_view::npos ? holder : holder.substr(dot + 1);
  return Holder{std::string(dot == std::string_view::npos ? "" : holder.substr(0, dot)),
                static_cast<pid_t>(std::strtol(std::string(pid).c_str(), nullptr, 10))};
}

void removeTree(const std::string& directory) {
  std::error_code ec;
  fs::remove_all(directory, ec);
}

Status makePrivateDirectory(const std::string& path) {
  if (::mkdir(path.c_str(), 0700) != 0 && (errno != EEXIST || !privateDirectory(path))) {
    return Status(StatusCode::kResourceExhausted,
                  fmt::format("cannot make {} (a directory of this user, mode 0700): {}", path,
                              errno == EEXIST ? "it exists and is not one" : std::strerror(errno)));
  }
  return Status::ok();
}

// Ray's default: 30% of the machine's memory, and no more than the shared-memory file system holds.
uint64_t defaultLimit(const std::string& parent) {
  uint64_t memory = static_cast<uint64_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  uint64_t limit = memory / 10 * 3;
  struct statvfs vfs {};
  if (::statvfs(parent.c_str(), &vfs) == 0) limit = std::min<uint64_t>(limit, uint64_t{vfs.f_blocks} * vfs.f_frsize);
  return std::max<uint64_t>(limit, NodeObjects::kMinLimit);
}

// Regular files in `directory` not starting with a dot: how many, and the bytes they hold.
std::pair<uint64_t, uint64_t> countFiles(const std::string& directory) {
  std::pair<uint64_t, uint64_t> out{0, 0};
  DIR* dir = ::opendir(directory.c_str());
  if (dir == nullptr) return out;
  while (struct dirent* entry = ::readdir(dir)) {
    struct stat st {};
    if (entry->d_name[0] == '.' || ::fstatat(::dirfd(dir), entry->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
        !S_ISREG(st.st_mode)) {
      continue;
    }
    out.first += 1;
    out.second += static_cast<uint64_t>(st.st_blocks) * 512;  // what it holds, not its length
  }
  ::closedir(dir);
  return out;
}

}  // namespace

bool NodeObjects::validName(std::string_view name) {
  if (name.empty() || name.size() > 200 || name[0] == '.') return false;
  for (char c : name) {
    bool ok = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '-' || c == '_' ||
              c == '.';
    if (!ok) return false;
  }
  return true;
}

// Removes the object directories beside `keep` (troupe-node-*, this user's, private) whose agent
// is gone: it held <dir>/.lock locked while it lived, and the kernel let go of the lock when it
// died, kill -9 included. A directory without a lock file (made before agents took one) goes
// once it is an hour old: its agent cannot be told from a new one still making its lock.
void removeStaleSiblings(const std::string& parent, const std::string& keep) {
  DIR* dir = ::opendir(parent.c_str());
  if (dir == nullptr) return;
  std::vector<std::string> stale;
  const time_t now = ::time(nullptr);
  while (struct dirent* entry = ::readdir(dir)) {
    std::string name = entry->d_name;
    std::string path = parent + "/" + name;
    if (name.rfind("troupe-node-", 0) != 0 || path == keep || !privateDirectory(path)) continue;
    int lock = ::open((path + "/.lock").c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (lock < 0) {
      struct stat st {};
      if (errno == ENOENT && ::stat(path.c_str(), &st) == 0 && now - st.st_mtime > 3600) stale.push_back(path);
      continue;
    }
    if (::flock(lock, LOCK_EX | LOCK_NB) == 0) stale.push_back(path);  // its agent is gone
    ::close(lock);
  }
  ::closedir(dir);
  for (const auto& path : stale) {
    TROUPE_LOG(kInfo, "removing {}: the object directory of an agent that is gone", path);
    removeTree(path);
  }
}

Result<NodeObjects> NodeObjects::open(const NodeId& node, const std::string& runDir, uint64_t limit) {
  if (limit != 0 && limit < kMinLimit) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("an object store of {} bytes is below the smallest, {} bytes", limit, kMinLimit));
  }
  std::string parent = "/dev/shm";
  struct stat st {};
  if (::stat(parent.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    const char* tmp = std::getenv("TMPDIR");
    parent = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
  }
  NodeObjects objects;
  std::string wanted = fmt::format("{}/troupe-node-{}", parent, node.hex());
  if (::mkdir(wanted.c_str(), 0700) == 0 || (errno == EEXIST && privateDirectory(wanted))) {
    objects.directory_ = wanted;
  } else {
    // Another user made the name first (node ids are public in the cluster's records).
    std::string pattern = wanted + ".XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      return Status(StatusCode::kResourceExhausted,
                    fmt::format("cannot make this node's object directory beside {}: {}", wanted, std::strerror(errno)));
    }
    objects.directory_ = pattern;
  }
  // Locked while this agent lives: the next agent of the machine removes the directory if this
  // one dies without doing so (removeStaleSiblings).
  objects.lock_ = ::open((objects.directory_ + "/.lock").c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (objects.lock_ < 0 || ::flock(objects.lock_, LOCK_EX | LOCK_NB) != 0) {
    return Status(StatusCode::kAlreadyExists,
                  fmt::format("cannot lock {}/.lock: {} (is another agent of node {} running?)", objects.directory_,
                              std::strerror(errno), node.hex()));
  }
  removeStaleSiblings(parent, objects.directory_);
  objects.limit_ = limit != 0 ? limit : defaultLimit(parent);
  for (const std::string& dir : {runDir + "/objects", runDir + "/spill", runDir + "/spill/" + node.hex()}) {
    TROUPE_RETURN_IF_ERROR(makePrivateDirectory(dir));
  }
  objects.spill_ = runDir + "/spill/" + node.hex();
  objects.refs_ = objects.directory_ + "/.refs";
  TROUPE_RETURN_IF_ERROR(makePrivateDirectory(objects.refs_));
  objects.record_ = runDir + "/objects/" + node.hex();
  TROUPE_ASSIGN_OR_RETURN(auto out, openRegularFile(objects.record_, O_WRONLY | O_CREAT | O_TRUNC));
  std::string line = objects.directory_ + "\n";
  if (::write(out.get(), line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
    return Status(StatusCode::kResourceExhausted, fmt::format("cannot write {}: {}", objects.record_, std::strerror(errno)));
  }
  return objects;
}

NodeObjects::NodeObjects(NodeObjects&& other) noexcept
    : directory_(std::exchange(other.directory_, {})),
      spill_(std::exchange(other.spill_, {})),
      refs_(std::exchange(other.refs_, {})),
      limit_(other.limit_),
      sources_(std::exchange(other.sources_, {})),
      served_(other.served_),
      record_(std::exchange(other.record_, {})),
      lock_(std::exchange(other.lock_, -1)) {}

NodeObjects& NodeObjects::operator=(NodeObjects&& other) noexcept {
  // What this held goes with `other` (its destructor removes it); only an empty one is assigned to.
  std::swap(directory_, other.directory_);
  std::swap(spill_, other.spill_);
  std::swap(refs_, other.refs_);
  std::swap(limit_, other.limit_);
  std::swap(sources_, other.sources_);
  std::swap(served_, other.served_);
  std::swap(record_, other.record_);
  std::swap(lock_, other.lock_);
  return *this;
}

NodeObjects::~NodeObjects() {
  if (directory_.empty()) return;
  removeTree(directory_);
  removeTree(spill_);
  ::unlink(record_.c_str());
  if (lock_ >= 0) ::close(lock_);  // after the removal: no other agent sweeps it meanwhile
}

NodeObjects::Usage NodeObjects::usage() const {
  Usage usage;
  std::tie(usage.objects, usage.bytes) = countFiles(directory_);
  std::tie(usage.spilledObjects, usage.spilledBytes) = countFiles(spill_);
  return usage;
}

Result<NodeObjects::Opened> NodeObjects::openObject(std::string_view name) const {
  if (!validName(name)) return Status(StatusCode::kInvalidArgument, fmt::format("'{}' names no object", name));
  const std::string path = directory_ + "/" + std::string(name);
  const std::string spilled = spill_ + "/" + std::string(name);
  const pid_t owner = ownerOf(name);
  if (!handedOver(name) && owner > 0 && !processAlive(owner)) {
    ::unlink(path.c_str());  // a put() object of an owner killed before it could delete it
    ::unlink(spilled.c_str());
    return Status(StatusCode::kNotFound,
                  fmt::format("object {} is lost: its owner (pid {}) died, and its objects with it", name, owner));
  }
  // A spiller writes the spilled copy before it deletes the one in memory: one of them is there.
  auto fd = openRegularFile(path, O_RDONLY);
  if (!fd.isOk() && fd.status().code() == StatusCode::kNotFound && !spill_.empty()) fd = openRegularFile(spilled, O_RDONLY);
  if (!fd.isOk()) {
    if (fd.status().code() != StatusCode::kNotFound) return fd.status();
    return Status(StatusCode::kNotFound,
                  fmt::format("object {} was freed by its owner (pid {}): no ref to it was left there", name, owner));
  }
  struct stat st {};
  if (::fstat(fd->get(), &st) != 0) return Status(StatusCode::kUnavailable, std::strerror(errno));
  return Opened{std::move(*fd), static_cast<uint64_t>(st.st_size)};
}

Result<NodeObjects::Read> NodeObjects::read(std::string_view name, uint64_t offset, kj::ArrayPtr<kj::byte> into) const {
  TROUPE_ASSIGN_OR_RETURN(auto opened, openObject(name));
  Read out;
  out.size = opened.size;
  if (offset > out.size) {
    return Status(StatusCode::kInvalidArgument, fmt::format("offset {} is past the end of object {} ({} bytes)", offset, name, out.size));
  }
  size_t want = static_cast<size_t>(std::min<uint64_t>(into.size(), out.size - offset));
  while (out.length < want) {
    ssize_t got = ::pread(opened.fd.get(), into.begin() + out.length, want - out.length,
                          static_cast<off_t>(offset + out.length));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return Status(StatusCode::kUnavailable, fmt::format("cannot read object {}: {}", name, std::strerror(errno)));
    if (got == 0) break;  // shorter than it said: the reader sees the size mismatch
    out.length += static_cast<size_t>(got);
  }
  served_ += out.length;
  return out;
}

namespace {

// A read-only mapping of an object's file, unmapped when the write that sends it is done.
struct Mapping {
  Mapping(void* at, size_t size) : at(at), size(size) {}
  ~Mapping() {
    if (at != MAP_FAILED && size > 0) ::munmap(at, size);
  }
  KJ_DISALLOW_COPY(Mapping);
  void* at;
  size_t size;
};

kj::Array<kj::byte> answerHeader(StatusCode code, uint64_t size, const std::string& message) {
  std::string text = message.substr(0, 4096);
  auto out = kj::heapArray<kj::byte>(1 + 8 + 4 + text.size());
  out[0] = static_cast<kj::byte>(code);
  uint32_t length = static_cast<uint32_t>(text.size());
  memcpy(out.begin() + 1, &size, 8);
  memcpy(out.begin() + 9, &length, 4);
  memcpy(out.begin() + 13, text.data(), text.size());
  return out;
}

}  // namespace

namespace {

// How many bytes of a copy being pulled have arrived (its .ready file), or nullopt when it has
// none (a complete object).
std::optional<uint64_t> arrived(const std::string& path) {
  int fd = ::open((path + ".ready").c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  uint64_t ready = 0;
  ssize_t got = ::pread(fd, &ready, sizeof ready, 0);
  ::close(fd);
  return got == sizeof ready ? ready : 0;
}

// Sends bytes [from, end) of a mapped copy as they arrive (arrived()), waiting a little while
// none are new; fails after NodeObjects::kStall without progress.
kj::Promise<void> sendArriving(kj::AsyncIoStream& s, kj::Timer& timer, std::string path, const kj::byte* base,
                               uint64_t from, uint64_t end, kj::TimePoint progress, uint64_t& served) {
  if (from >= end) return kj::READY_NOW;
  uint64_t ready = arrived(path).value_or(end);
  if (ready > from) {
    uint64_t upTo = std::min(ready, end);
    served += upTo - from;
    return s.write(base + from, upTo - from).then([&s, &timer, path = kj::mv(path), base, upTo, end, &served]() mutable {
      return sendArriving(s, timer, kj::mv(path), base, upTo, end, timer.now(), served);
    });
  }
  if (timer.now() - progress > NodeObjects::kStall) {
    return KJ_EXCEPTION(DISCONNECTED, "the copy being relayed stopped arriving");
  }
  return timer.afterDelay(2 * kj::MILLISECONDS).then([&s, &timer, path = kj::mv(path), base, from, end, progress, &served]() mutable {
    return sendArriving(s, timer, kj::mv(path), base, from, end, progress, served);
  });
}

}  // namespace

std::string NodeObjects::relayFor(std::string_view name, std::string_view offer) const {
  auto& sources = sources_[std::string(name)];
  std::string relay;
  Source* best = nullptr;
  for (auto& source : sources) {
    if (source.offer != offer && (best == nullptr || source.serving < best->serving)) best = &source;
  }
  if (best != nullptr) {
    ++best->serving;
    relay = best->offer;
  }
  // An offer: <host>:<port>/<copy>, the host an address (no path), the copy a plain file name.
  size_t slash = offer.rfind('/'), colon = offer.rfind(':', slash);
  bool valid = slash != std::string_view::npos && colon != std::string_view::npos && colon > 0 &&
               offer.size() <= 300 && allOf(offer.substr(colon + 1, slash - colon - 1), 5, isDigit) &&
               validName(offer.substr(slash + 1)) &&
               offer.substr(0, colon).find_first_not_of("0123456789abcdefABCDEF.:[]") == std::string_view::npos;
  if (valid && sources.size() < 64 &&
      std::none_of(sources.begin(), sources.end(), [&](const Source& s) { return s.offer == offer; })) {
    sources.push_back(Source{std::string(offer), 0});
  }
  if (sources.empty()) sources_.erase(std::string(name));
  if (sources_.size() > 4096) sources_.erase(sources_.begin());  // bounded: the oldest names go
  return relay;
}

void NodeObjects::dropSource(std::string_view name, std::string_view offer) const {
  auto it = sources_.find(std::string(name));
  if (it == sources_.end()) return;
  auto& sources = it->second;
  sources.erase(std::remove_if(sources.begin(), sources.end(), [&](const Source& s) { return s.offer == offer; }),
                sources.end());
  if (sources.empty()) sources_.erase(it);
}

kj::Promise<void> NodeObjects::serve(kj::Own<kj::AsyncIoStream> stream, kj::Timer& timer) const {
  auto& s = *stream;
  auto head = kj::heapArray<kj::byte>(4);
  auto* h = head.begin();
  return s.tryRead(h, 4, 4).then([this, &s, &timer, head = kj::mv(head)](size_t got) mutable -> kj::Promise<void> {
        if (got == 0) return kj::READY_NOW;  // the peer is done
        if (got < 4) return KJ_EXCEPTION(DISCONNECTED, "bulk request cut short");
        uint32_t nameLength = 0;
        memcpy(&nameLength, head.begin(), 4);
        if (nameLength == 0 || nameLength > 200) return KJ_EXCEPTION(FAILED, "bulk request: bad name length");
        auto rest = kj::heapArray<kj::byte>(nameLength + 16);
        auto* r = rest.begin();
        return s.read(r, rest.size()).then([this, &s, &timer, nameLength, rest = kj::mv(rest)]() -> kj::Promise<void> {
          std::string name(reinterpret_cast<const char*>(rest.begin()), nameLength);
          uint64_t offset = 0, length = 0;
          memcpy(&offset, rest.begin() + nameLength, 8);
          memcpy(&length, rest.begin() + nameLength + 8, 8);
          return answer(s, timer, kj::mv(name), offset, length, timer.now());
        }).then([this, &s, &timer]() {
          return serve(kj::Own<kj::AsyncIoStream>(&s, kj::NullDisposer::instance), timer);
        });
      }).attach(kj::mv(stream));
}

kj::Promise<void> NodeObjects::answer(kj::AsyncIoStream& s, kj::Timer& timer, std::string name, uint64_t offset,
                                      uint64_t length, kj::TimePoint since) const {
  auto opened = openObject(name);
  Status problem = opened.status();
  std::string path = directory_ + "/" + name;
  if (problem.isOk() && (offset > opened->size || length > opened->size - offset)) {
    if (arrived(path).has_value() && timer.now() - since < kStall) {
      // A copy being pulled here that has not been sized yet (its first chunk is on the way).
      return timer.afterDelay(2 * kj::MILLISECONDS).then([this, &s, &timer, name = kj::mv(name), offset, length, since]() mutable {
        return answer(s, timer, kj::mv(name), offset, length, since);
      });
    }
    problem = Status(StatusCode::kInvalidArgument, fmt::format("bytes {}..{} are past the end of object {} ({} bytes)",
                                                               offset, offset + length, name, opened->size));
  }
  kj::Own<Mapping> mapping;
  if (problem.isOk() && length > 0) {
    void* at = ::mmap(nullptr, opened->size, PROT_READ, MAP_SHARED, opened->fd.get(), 0);
    mapping = kj::heap<Mapping>(at, at == MAP_FAILED ? 0 : opened->size);
    if (at == MAP_FAILED) {
      problem = Status(StatusCode::kUnavailable, fmt::format("cannot map object {}: {}", name, std::strerror(errno)));
    }
  }
  auto header = answerHeader(problem.code(), problem.isOk() ? opened->size : 0, problem.message());
  auto* hp = header.begin();
  auto sent = s.write(hp, header.size()).attach(kj::mv(header));
  if (!problem.isOk()) return sent;  // the peer reads the error and closes
  return sent.then([this, &s, &timer, path = kj::mv(path), mapping = kj::mv(mapping), offset,
                    length]() mutable -> kj::Promise<void> {
    if (length == 0) return kj::READY_NOW;
    auto* base = static_cast<const kj::byte*>(mapping->at);
    return sendArriving(s, timer, kj::mv(path), base, offset, offset + length, timer.now(), served_)
        .attach(kj::mv(mapping));
  });
}

Status NodeObjects::drop(std::string_view name) const {
  if (!validName(name) || !handedOver(name)) {
    return Status(StatusCode::kInvalidArgument, fmt::format("'{}' names no handed-over result", name));
  }
  for (const std::string& dir : {directory_, spill_}) {
    std::string path = dir + "/" + std::string(name);
    if (!dir.empty() && ::unlink(path.c_str()) != 0 && errno != ENOENT) {
      return Status(StatusCode::kUnavailable, fmt::format("cannot delete {}: {}", path, std::strerror(errno)));
    }
  }
  return Status::ok();
}

namespace {

Status badHold(std::string_view what) {
  return Status(StatusCode::kInvalidArgument, fmt::format("malformed hold: {}", what));
}

// Makes `path` (a holder's file); kNotFound when its directory is gone (the object was freed).
Status touch(const std::string& path, std::string_view name) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd >= 0) {
    ::close(fd);
    return Status::ok();
  }
  if (errno == ENOENT) {
    return Status(StatusCode::kNotFound, fmt::format("object {} was freed: no ref to it was left", name));
  }
  return Status(StatusCode::kUnavailable, fmt::format("cannot record a hold of object {}: {}", name, std::strerror(errno)));
}

}  // namespace

Status NodeObjects::hold(std::string_view name, std::string_view holder, std::string_view landed) const {
  if (!validName(name) || !validHolder(holder)) return badHold(holder);
  size_t colon = landed.find(':');
  if (!landed.empty() && (colon == std::string_view::npos || !validHolder(landed.substr(0, colon)) ||
                          !allOf(landed.substr(colon + 1), 32, isHex))) {
    return badHold(landed);
  }
  std::string dir = refs_ + "/" + std::string(name);
  TROUPE_RETURN_IF_ERROR(touch(dir + "/" + std::string(holder), name));
  if (!landed.empty()) ::unlink((dir + "/" + std::string(landed)).c_str());
  return Status::ok();
}

Status NodeObjects::lend(std::string_view name, std::string_view holder, std::string_view token) const {
  if (!validName(name) || !validHolder(holder) || !allOf(token, 32, isHex)) return badHold(token);
  std::string dir = refs_ + "/" + std::string(name);
  struct stat st {};
  if (::stat((dir + "/" + std::string(holder)).c_str(), &st) != 0) {  // only what it holds
    return Status(StatusCode::kNotFound, fmt::format("object {} is not held by {}: freed, or never lent to it", name, holder));
  }
  return touch(fmt::format("{}/{}:{}", dir, holder, token), name);
}

Status NodeObjects::release(std::string_view name, std::string_view holder) const {
  size_t colon = holder.find(':');  // a holder, or one of its in-flight records
  if (!validName(name) || !validHolder(holder.substr(0, colon)) ||
      (colon != std::string_view::npos && !allOf(holder.substr(colon + 1), 32, isHex))) {
    return badHold(holder);
  }
  std::string dir = refs_ + "/" + std::string(name);
  ::unlink((dir + "/" + std::string(holder)).c_str());
  if (::rmdir(dir.c_str()) == 0) {  // the last holder: the object goes
    ::unlink((directory_ + "/" + std::string(name)).c_str());
    ::unlink((spill_ + "/" + std::string(name)).c_str());
  }
  return Status::ok();
}

std::map<std::string, std::set<int>> NodeObjects::remoteHolders() const {
  std::map<std::string, std::set<int>> out;
  std::error_code ec;
  for (const auto& object : fs::directory_iterator(refs_, ec)) {
    std::error_code inner;
    for (const auto& file : fs::directory_iterator(object.path(), inner)) {
      auto holder = parseHolder(file.path().filename().string());
      if (holder && !holder->node.empty() && holder->node[0] != 'x') out[holder->node].insert(holder->pid);
    }
  }
  return out;
}

void NodeObjects::sweep(const RemoteLiveness& remote) const {
  std::error_code ec;
  for (const auto& object : fs::directory_iterator(refs_, ec)) {
    const std::string name = object.path().filename().string();
    if (name[0] == '.') continue;  // a first holder's directory, before it is renamed into place
    const std::string path = directory_ + "/" + name, spilled = spill_ + "/" + name;
    struct stat st {};
    // Its owner died (the object is lost), or it is gone already (its owner exited): holds go.
    bool gone = !processAlive(ownerOf(name)) || (::stat(path.c_str(), &st) != 0 && ::stat(spilled.c_str(), &st) != 0);
    std::error_code inner;
    for (const auto& file : fs::directory_iterator(object.path(), inner)) {
      auto holder = parseHolder(file.path().filename().string());
      bool dead = gone || !holder;
      if (!dead && holder->node.empty()) {
        dead = !processAlive(holder->pid);
      } else if (!dead && holder->node[0] != 'x') {  // a process of no node is kept until it releases
        auto alive = remote.alive.find(holder->node);
        dead = remote.dead.count(holder->node) > 0 ||
               (alive != remote.alive.end() && alive->second.count(holder->pid) == 0);
      }
      if (dead) ::unlink(file.path().c_str());
    }
    if (::rmdir(object.path().c_str()) == 0) {
      ::unlink(path.c_str());
      ::unlink(spilled.c_str());
    }
  }
}

void removeRecordedObjectDirectories(const std::string& runDir) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(fs::path(runDir) / "objects", ec)) {
    auto recorded = readRegularFile(entry.path().string(), 4096);
    std::string path = recorded.isOk() ? recorded->substr(0, recorded->find('\n')) : "";
    if (fs::path(path).filename().string().rfind("troupe-node-", 0) == 0 && privateDirectory(path)) removeTree(path);
    fs::remove(entry.path(), ec);
  }
  removeTree((fs::path(runDir) / "spill").string());
}

}  // namespace troupe
