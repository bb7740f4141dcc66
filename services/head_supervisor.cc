#include "head_supervisor.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>

#include <fmt/format.h>

#include "troupe/runtime/ids.h"
#include "troupe/runtime/logging.h"
#include "troupe/runtime/process.h"
#include "troupe/runtime/safe_open.h"

namespace troupe::supervisor {

namespace fs = std::filesystem;

namespace {

std::string cmdPath(const std::string& runDir, const std::string& name) {
  return fmt::format("{}/pids/{}.cmd", runDir, name);
}
std::string stoppingPath(const std::string& runDir) { return runDir + "/pids/stopping"; }

struct Recorded {
  std::string logPath;
  std::vector<std::string> argv;
};

// Line 1: the log path; then one argv entry per line (no entry holds a newline).
std::optional<Recorded> readRecord(const std::string& path) {
  // Read on the agent's loop, from a directory the user's actors can write: never a blocking open.
  auto text = readRegularFile(path, 1 << 20);
  if (!text.isOk()) return std::nullopt;
  std::istringstream in(*text);
  Recorded r;
  if (!std::getline(in, r.logPath)) return std::nullopt;
  for (std::string line; std::getline(in, line);) r.argv.push_back(line);
  if (r.argv.empty()) return std::nullopt;
  return r;
}

pid_t readPid(const std::string& path) {
  auto text = readRegularFile(path, 64);
  if (!text.isOk()) return 0;
  std::istringstream in(*text);
  pid_t pid = 0;
  return in >> pid ? pid : 0;
}

// What the loop knows between ticks: the daemons it started itself (its children, reaped here),
// and when it last started each, so a daemon that cannot start is retried once a second.
struct Supervision {
  std::string runDir;
  std::map<std::string, pid_t> children;
  std::map<std::string, std::chrono::steady_clock::time_point> lastStart;
};

bool childRunning(pid_t pid) {
  int status = 0;
  return ::waitpid(pid, &status, WNOHANG) == 0;
}

void superviseOnce(Supervision& s) {
  std::error_code ec;
  if (fs::exists(stoppingPath(s.runDir), ec)) return;
  int lock = ::open((s.runDir + "/pids/replace.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (lock < 0) return;
  // Someone replaces a daemon by hand right now: leave it to them.
  if (::flock(lock, LOCK_EX | LOCK_NB) != 0) {
    ::close(lock);
    return;
  }
  for (const auto& entry : fs::directory_iterator(s.runDir + "/pids", ec)) {
    const auto path = entry.path();
    if (path.extension() != ".cmd") continue;
    const std::string name = path.stem().string();
    auto child = s.children.find(name);
    if (child != s.children.end()) {
      if (childRunning(child->second)) continue;
      s.children.erase(child);
    }
    pid_t pid = readPid(fmt::format("{}/pids/{}.pid", s.runDir, name));
    if (pid > 0 && processAlive(pid)) continue;
    auto now = std::chrono::steady_clock::now();
    if (auto last = s.lastStart.find(name); last != s.lastStart.end() && now - last->second < std::chrono::seconds(1)) {
      continue;
    }
    auto record = readRecord(path.string());
    if (!record) {
      TROUPE_LOG(kWarning, "cannot restart {}: {} is unreadable", name, path.string());
      continue;
    }
    SpawnOptions spawn;
    spawn.argv = record->argv;
    spawn.outputPath = record->logPath;
    std::string startedAs = name;
    // The head's node agent comes back as a new node: the old id is (or soon will be) DEAD, and
    // a node id is never reused. Its record moves to the new name.
    if (name.rfind("node-", 0) == 0) {
      auto idFlag = std::find(spawn.argv.begin(), spawn.argv.end(), "--node-id");
      if (idFlag == spawn.argv.end() || idFlag + 1 == spawn.argv.end()) {
        TROUPE_LOG(kWarning, "cannot restart {}: its record has no --node-id", name);
        continue;
      }
      std::string fresh = NodeId::generate().hex();
      *(idFlag + 1) = fresh;
      startedAs = "node-" + fresh;
      spawn.outputPath = fmt::format("{}/logs/{}.log", s.runDir, startedAs);
      if (auto moved = supervisor::record(s.runDir, startedAs, spawn.argv, spawn.outputPath); !moved.isOk()) {
        TROUPE_LOG(kError, "cannot restart {}: {}", name, moved.toString());
        continue;
      }
      ::unlink(path.c_str());
    }
    spawn.newSession = true;  // it must outlive this agent, as the daemons `troupe start` made do
    s.lastStart[startedAs] = now;
    auto started = spawnProcess(spawn);
    if (!started.isOk()) {
      TROUPE_LOG(kError, "cannot restart {}: {}", name, started.status().toString());
      continue;
    }
    s.children[startedAs] = *started;
    // Daemons of our own write their pid file when they start; redis-server does not.
    std::ofstream(fmt::format("{}/pids/{}.pid", s.runDir, startedAs)) << *started << "\n";
    if (startedAs != name) ::unlink(fmt::format("{}/pids/{}.pid", s.runDir, name).c_str());
    TROUPE_LOG(kWarning, "{} (pid {}) was gone: restarted it as pid {}{}", name, pid, *started,
               startedAs != name ? " (" + startedAs + ")" : std::string());
  }
  ::flock(lock, LOCK_UN);
  ::close(lock);
}

kj::Promise<void> loop(kj::Timer& timer, std::shared_ptr<Supervision> s, kj::Duration interval) {
  return timer.afterDelay(interval).then([&timer, s, interval]() {
    superviseOnce(*s);
    return loop(timer, s, interval);
  });
}

}  // namespace

Status record(const std::string& runDir, const std::string& name, const std::vector<std::string>& argv,
              const std::string& logPath) {
  std::string path = cmdPath(runDir, name);
  std::string temp = path + ".tmp";
  std::ostringstream text;
  text << logPath << "\n";
  for (const auto& a : argv) {
    if (a.find('\n') != std::string::npos) {
      return Status(StatusCode::kInvalidArgument, fmt::format("cannot record {}: an argument holds a newline", name));
    }
    text << a << "\n";
  }
  ::unlink(temp.c_str());
  int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return Status(StatusCode::kFailedPrecondition, fmt::format("cannot write {}", temp));
  std::string data = text.str();
  bool ok = ::write(fd, data.data(), data.size()) == static_cast<ssize_t>(data.size());
  ::close(fd);
  if (!ok || ::rename(temp.c_str(), path.c_str()) != 0) {
    return Status(StatusCode::kFailedPrecondition, fmt::format("cannot write {}", path));
  }
  return Status::ok();
}

void markStopping(const std::string& runDir) {
  int fd = ::open(stoppingPath(runDir).c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd >= 0) ::close(fd);
  // A restart already under way finishes before the caller goes on to stop the daemons.
  ReplaceLock wait(runDir);
}

ReplaceLock::ReplaceLock(const std::string& runDir) {
  fd_ = ::open((runDir + "/pids/replace.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd_ >= 0) ::flock(fd_, LOCK_EX);
}

ReplaceLock::~ReplaceLock() {
  if (fd_ >= 0) ::close(fd_);
}

kj::Promise<void> superviseHeadDaemons(kj::AsyncIoContext& io, std::string runDir, kj::Duration interval) {
  auto s = std::make_shared<Supervision>();
  s->runDir = std::move(runDir);
  return loop(io.provider->getTimer(), s, interval);
}

}  // namespace troupe::supervisor
