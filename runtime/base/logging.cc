#include "troupe/runtime/logging.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>

#include "troupe/runtime/safe_open.h"

namespace troupe {
namespace {

// One sink per process; guarded so lines from several threads never interleave.
struct Sink {
  std::mutex mutex;
  int fd = -1;
  bool alsoStderr = true;
  bool stderrIsLog = false;  // a daemon's stderr is its log file: warnings are not written twice
  std::string processName = "troupe";
};

Sink& sink() {
  static Sink s;
  return s;
}

std::atomic<LogLevel> gLevel{LogLevel::kInfo};

const char* levelLetter(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "D";
    case LogLevel::kInfo: return "I";
    case LogLevel::kWarning: return "W";
    case LogLevel::kError: return "E";
    case LogLevel::kFatal: return "F";
  }
  return "?";
}

void writeAll(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

}  // namespace

LogLevel parseLogLevel(std::string_view name) {
  if (name == "debug") return LogLevel::kDebug;
  if (name == "warning" || name == "warn") return LogLevel::kWarning;
  if (name == "error") return LogLevel::kError;
  return LogLevel::kInfo;
}

void setLogLevel(LogLevel level) { gLevel = level; }
LogLevel logLevel() { return gLevel; }

void setLogProcessName(std::string name) {
  std::lock_guard lock(sink().mutex);
  sink().processName = std::move(name);
}

bool openLogFile(const std::string& path, bool alsoStderr) {
  // Actors of this user can write the logs directory: never block on a FIFO put at the path.
  auto opened = openRegularFile(path, O_WRONLY | O_CREAT | O_APPEND);
  if (!opened.isOk()) return false;
  int fd = opened->release();
  std::lock_guard lock(sink().mutex);
  if (sink().fd >= 0) ::close(sink().fd);
  sink().fd = fd;
  sink().alsoStderr = alsoStderr;
  struct stat logStat {}, errStat {};
  sink().stderrIsLog = ::fstat(fd, &logStat) == 0 && ::fstat(2, &errStat) == 0 && logStat.st_dev == errStat.st_dev &&
                       logStat.st_ino == errStat.st_ino;
  return true;
}

void logLine(LogLevel level, const char* file, int line, std::string_view message) {
  auto now = std::chrono::system_clock::now();
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count();
  time_t secs = static_cast<time_t>(ms / 1000);
  struct tm tm;
  gmtime_r(&secs, &tm);
  const char* base = std::strrchr(file, '/');
  base = base ? base + 1 : file;
  Sink& s = sink();
  std::lock_guard lock(s.mutex);
  std::string text = fmt::format("{} {:02}:{:02}:{:02}.{:03} {}[{}:{}] {}:{}] {}\n", levelLetter(level),
                                 tm.tm_hour, tm.tm_min, tm.tm_sec, ms % 1000, s.processName,
                                 getpid(), static_cast<long>(syscall(SYS_gettid)), base, line, message);
  if (s.fd >= 0) writeAll(s.fd, text);
  if (s.fd < 0 || ((s.alsoStderr || level >= LogLevel::kWarning) && !s.stderrIsLog)) writeAll(2, text);
}

}  // namespace troupe
