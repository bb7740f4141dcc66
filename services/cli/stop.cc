#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "cli.h"
#include "../head_supervisor.h"
#include "../node_objects.h"
#include "troupe/runtime/safe_open.h"

namespace troupe::cli {

namespace fs = std::filesystem;

std::string siblingExecutable(const std::string& name) {
  const char* dir = std::getenv("TROUPE_BIN_DIR");
  return fmt::format("{}/{}", dir && *dir ? dir : executableDir().c_str(), name);
}

// The checkpoint segments this run's workers made (recorded in <runDir>/shm, see
// flash_segment.cc), and only those: another cluster's live segments stay. A recorded path is
// removed only if it is a file of ours named troupe_*.
static void removeRecordedSegments(const std::string& runDir) {
  std::error_code ec;
  fs::path registry = fs::path(runDir) / "shm";
  for (const auto& entry : fs::directory_iterator(registry, ec)) {
    // A worker wrote it: whatever is there is read without blocking (a FIFO is skipped).
    auto recorded = readRegularFile(entry.path().string(), 4096);
    std::string path = recorded.isOk() ? recorded->substr(0, recorded->find('\n')) : "";
    struct stat st {};
    if (fs::path(path).filename().string().rfind("troupe_", 0) == 0 && ::lstat(path.c_str(), &st) == 0 &&
        S_ISREG(st.st_mode) && st.st_uid == ::geteuid()) {
      fs::remove(path, ec);
    }
    fs::remove(entry.path(), ec);
  }
}

// Daemons of this run that no pid file names, e.g. a controller the head's supervisor started
// in the same moment as `troupe restart-controller` started another: every process of ours
// whose argv holds `--run-dir <runDir>`.
static std::vector<pid_t> unrecordedDaemons(const std::string& runDir) {
  std::vector<pid_t> out;
  std::error_code ec;
  const std::string arg = "--run-dir " + runDir + " ";
  for (const auto& entry : fs::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || !std::all_of(name.begin(), name.end(), [](unsigned char c) { return std::isdigit(c); })) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(name));
    struct stat st {};
    if (pid == ::getpid() || ::stat(entry.path().c_str(), &st) != 0 || st.st_uid != ::geteuid()) continue;
    if ((processCommandLine(pid) + " ").find(arg) != std::string::npos) out.push_back(pid);
  }
  return out;
}

int stopRunDir(const std::string& runDir, bool verbose) {
  struct Daemon {
    std::string name;
    fs::path pidFile;
    pid_t pid;
  };
  // Node agents first (they record a clean stop in Redis), then the controller and the store
  // gateway, then Redis.
  std::vector<Daemon> waves[3];
  std::error_code ec;
  // The head's agent must not start again what we stop.
  supervisor::markStopping(runDir);
  for (const auto& entry : fs::directory_iterator(fs::path(runDir) / "pids", ec)) {
    if (entry.path().extension() != ".pid") {
      if (entry.path().extension() == ".ready") fs::remove(entry.path(), ec);
      continue;
    }
    std::string name = entry.path().stem().string();
    pid_t pid = 0;
    std::ifstream(entry.path()) >> pid;
    // Daemons name the run directory in argv; redis-server rewrites its title but runs in it.
    fs::path cwd = fs::read_symlink(fmt::format("/proc/{}/cwd", pid), ec);
    bool ours = processAlive(pid) && (processCommandLine(pid).find(runDir) != std::string::npos ||
                                      cwd.string().rfind(runDir, 0) == 0);
    if (!ours) {
      fs::remove(entry.path(), ec);  // stale: the process is gone or the pid was reused
      continue;
    }
    int wave = name.rfind("node-", 0) == 0 || name == "dashboard" ? 0 : name == "controller" || name == "gateway" ? 1 : 2;
    waves[wave].push_back({name, entry.path(), pid});
  }
  int stopped = 0;
  for (auto& wave : waves) {
    for (auto& d : wave) ::kill(d.pid, SIGTERM);
    for (auto& d : wave) {
      auto gone = waitReady(d.name, 0, "", std::chrono::seconds(5), [&]() { return !processAlive(d.pid); });
      if (!gone.isOk()) {
        ::kill(d.pid, SIGKILL);
        (void)waitReady(d.name, 0, "", std::chrono::seconds(5), [&]() { return !processAlive(d.pid); });
      }
      fs::remove(d.pidFile, ec);
      if (verbose) std::cout << "Stopped " << d.name << " (pid " << d.pid << ")" << std::endl;
      ++stopped;
    }
  }
  for (pid_t pid : unrecordedDaemons(runDir)) {
    std::string what = processCommandLine(pid).substr(0, processCommandLine(pid).find(' '));
    ::kill(pid, SIGTERM);
    auto gone = waitReady(what, 0, "", std::chrono::seconds(5), [&]() { return !processAlive(pid); });
    if (!gone.isOk()) {
      ::kill(pid, SIGKILL);
      (void)waitReady(what, 0, "", std::chrono::seconds(5), [&]() { return !processAlive(pid); });
    }
    if (verbose) std::cout << "Stopped " << what << " (pid " << pid << "), which no pid file named" << std::endl;
    ++stopped;
  }
  // The token dies with the cluster; actor logs stay for post-mortems.
  if (stopped > 0) fs::remove(fs::path(runDir) / "cluster.json", ec);
  removeRecordedSegments(runDir);
  removeRecordedObjectDirectories(runDir);
  // Jobs' scripts and driver logs (job.py keeps them in <runDir>/jobs) and workers' temporary
  // files (TMPDIR, set by the agents) go with the cluster.
  for (const char* dir : {"jobs", "tmp"}) {
    fs::path path = fs::path(runDir) / dir;
    if (fs::is_directory(fs::symlink_status(path, ec))) fs::remove_all(path, ec);
  }
  return stopped;
}

int stopCommand() {
  std::error_code ec;
  int stopped = 0;
  for (const auto& entry : fs::directory_iterator(runRoot(), ec)) {
    if (entry.is_directory() && entry.path().filename().string().rfind("run_", 0) == 0 && !entry.is_symlink()) {
      stopped += stopRunDir(entry.path().string(), true);
    }
  }
  std::cout << (stopped ? fmt::format("Stopped {} Troupe process(es).", stopped)
                        : std::string("No Troupe processes were running."))
            << std::endl;
  return 0;
}

}  // namespace troupe::cli
