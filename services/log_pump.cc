#include "log_pump.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "troupe/runtime/logging.h"

namespace troupe {

namespace {
constexpr size_t kChunk = 64 * 1024;
constexpr size_t kTurnBudget = 1 << 20;  // per stream and wake-up, so one flood cannot starve the others

bool isActorLog(std::string_view name) {
  return name.rfind("actor-", 0) == 0 && (name.ends_with(".out") || name.ends_with(".err") || name.ends_with(".1"));
}
}  // namespace

LogPump::LogPump(LogPumpOptions options) : options_(std::move(options)) {
  epoll_ = FileDescriptor(::epoll_create1(EPOLL_CLOEXEC));
  wake_ = FileDescriptor(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  TROUPE_CHECK(epoll_.get() >= 0 && wake_.get() >= 0);
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.fd = wake_.get();
  TROUPE_CHECK(::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, wake_.get(), &event) == 0);
  thread_ = std::thread([this]() { run(); });
}

LogPump::~LogPump() {
  uint64_t one = 1;
  if (::write(wake_.get(), &one, sizeof one) < 0) {
    TROUPE_LOG(kWarning, "cannot wake the log pump: {}", std::strerror(errno));
  }
  thread_.join();
}

Result<FileDescriptor> LogPump::open(const std::string& path) {
  int ends[2];
  if (::pipe2(ends, O_CLOEXEC) != 0) {
    return Status(StatusCode::kUnavailable, fmt::format("cannot make a pipe for {}: {}", path, std::strerror(errno)));
  }
  FileDescriptor read(ends[0]), write(ends[1]);
  ::fcntl(read.get(), F_SETFL, O_NONBLOCK);
  std::lock_guard<std::mutex> lock(mutex_);
  auto file = files_.find(path);
  if (file == files_.end()) {
    TROUPE_ASSIGN_OR_RETURN(auto fd, openRegularFile(path, O_WRONLY | O_CREAT | O_APPEND));
    struct stat st {};
    uint64_t size = ::fstat(fd.get(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
    file = files_.emplace(path, File{std::move(fd), size, 0}).first;
  }
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.fd = read.get();
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, read.get(), &event) != 0) {
    if (file->second.streams == 0) files_.erase(file);
    return Status(StatusCode::kUnavailable, fmt::format("cannot watch the pipe of {}: {}", path, std::strerror(errno)));
  }
  ++file->second.streams;
  int key = read.get();
  streams_.emplace(key, Stream{std::move(read), path});
  return write;
}

void LogPump::drain(const std::string& path) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int> ended;
  for (auto& [pipe, stream] : streams_) {
    if (stream.path == path && !pumpLocked(stream, kTurnBudget)) ended.push_back(pipe);
  }
  for (int pipe : ended) closeStreamLocked(pipe);
}

void LogPump::run() {
  epoll_event events[64];
  while (true) {
    int n = ::epoll_wait(epoll_.get(), events, 64, 2000);
    if (n < 0 && errno != EINTR) {
      TROUPE_LOG(kError, "the log pump stops: epoll_wait: {}", std::strerror(errno));
      return;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    for (int i = 0; i < n; ++i) {
      if (events[i].data.fd == wake_.get()) return;
      auto it = streams_.find(events[i].data.fd);
      if (it != streams_.end() && !pumpLocked(it->second, kTurnBudget)) closeStreamLocked(it->first);
    }
    if (writtenSinceSweep_ > 0 && (writtenSinceSweep_ >= options_.maxRunBytes / 16 || n == 0)) {
      enforceRunCapLocked();
    }
  }
}

bool LogPump::pumpLocked(Stream& stream, size_t budget) {
  char buffer[kChunk];
  File& file = files_.at(stream.path);
  for (size_t done = 0; done < budget;) {
    ssize_t n = ::read(stream.pipe.get(), buffer, sizeof buffer);
    if (n > 0) {
      appendLocked(stream.path, file, buffer, static_cast<size_t>(n));
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return n < 0 && errno == EAGAIN;  // 0: every writer has closed it
  }
  return true;
}

void LogPump::appendLocked(const std::string& path, File& file, const char* data, size_t size) {
  while (size > 0) {
    if (file.size >= options_.maxFileBytes) rotateLocked(path, file);
    size_t piece = std::min<uint64_t>(size, options_.maxFileBytes - std::min(file.size, options_.maxFileBytes));
    if (piece == 0) piece = size;  // the rotation failed and so did the truncation: write anyway
    ssize_t wrote = ::write(file.fd.get(), data, piece);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) return;  // a full disk: the output is dropped rather than the worker held
    file.size += static_cast<uint64_t>(wrote);
    writtenSinceSweep_ += static_cast<uint64_t>(wrote);
    data += wrote;
    size -= static_cast<size_t>(wrote);
  }
}

void LogPump::rotateLocked(const std::string& path, File& file) {
  std::string rotated = path + ".1";
  if (::rename(path.c_str(), rotated.c_str()) == 0) {
    // The name is the agent's: whatever is there now (a link an actor made) goes.
    ::unlink(path.c_str());
    auto fresh = openRegularFile(path, O_WRONLY | O_CREAT | O_EXCL | O_APPEND);
    if (fresh.isOk()) {
      TROUPE_LOG(kDebug, "rotated {} at {} bytes to {}", path, file.size, rotated);
      file.fd = std::move(*fresh);
      file.size = 0;
      return;
    }
    TROUPE_LOG(kWarning, "cannot start {} anew ({}): writing on in {}", path, fresh.status().toString(), rotated);
  }
  // Still within the cap, at the cost of what the log held.
  if (::ftruncate(file.fd.get(), 0) == 0) file.size = 0;
}

void LogPump::closeStreamLocked(int pipe) {
  auto it = streams_.find(pipe);
  if (it == streams_.end()) return;
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, pipe, nullptr);
  auto file = files_.find(it->second.path);
  if (file != files_.end() && --file->second.streams == 0) files_.erase(file);
  streams_.erase(it);
}

void LogPump::enforceRunCapLocked() {
  writtenSinceSweep_ = 0;
  struct Log {
    std::string name;
    uint64_t size;
    timespec written;
  };
  std::vector<Log> logs;
  uint64_t total = 0;
  DIR* dir = ::opendir(options_.dir.c_str());
  if (dir == nullptr) return;
  while (dirent* entry = ::readdir(dir)) {
    struct stat st {};
    if (!isActorLog(entry->d_name) || ::fstatat(::dirfd(dir), entry->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
        !S_ISREG(st.st_mode)) {
      continue;
    }
    logs.push_back({entry->d_name, static_cast<uint64_t>(st.st_size), st.st_mtim});
    total += static_cast<uint64_t>(st.st_size);
  }
  ::closedir(dir);
  if (total <= options_.maxRunBytes) return;
  std::sort(logs.begin(), logs.end(), [](const Log& a, const Log& b) {
    return std::tie(a.written.tv_sec, a.written.tv_nsec) < std::tie(b.written.tv_sec, b.written.tv_nsec);
  });
  for (const auto& log : logs) {
    if (total <= options_.maxRunBytes) break;
    std::string path = options_.dir + "/" + log.name;
    if (log.name.ends_with(".1")) {
      if (::unlink(path.c_str()) != 0) continue;
    } else if (auto open = files_.find(path); open != files_.end()) {
      // A live log is emptied, not removed: its writers would fill an unnamed file.
      if (::ftruncate(open->second.fd.get(), 0) != 0) continue;
      open->second.size = 0;
    } else {
      auto fd = openRegularFile(path, O_WRONLY);
      if (!fd.isOk() || ::ftruncate(fd->get(), 0) != 0) continue;
    }
    total -= log.size;
    ++dropped_;
    droppedBytes_ += log.size;
  }
  // Once a minute at most: a flood drops logs all the time, and this agent's own log has no cap.
  auto now = std::chrono::steady_clock::now();
  if (dropped_ > 0 && now - lastReport_ >= std::chrono::minutes(1)) {
    TROUPE_LOG(kInfo, "dropped the oldest actor logs in {} ({} files, {} bytes) since the last report: the run's "
               "actor logs exceed TROUPE_LOG_RUN_MAX_BYTES ({} bytes)", options_.dir, dropped_, droppedBytes_,
               options_.maxRunBytes);
    dropped_ = droppedBytes_ = 0;
    lastReport_ = now;
  }
}

}  // namespace troupe
