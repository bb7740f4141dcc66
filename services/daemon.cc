#include "daemon.h"

#include <kj/async-unix.h>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include <fmt/format.h>

#include "troupe/runtime/config.h"
#include "troupe/runtime/logging.h"
#include "troupe/runtime/safe_open.h"

namespace troupe {

Result<std::pair<RedisOptions, std::string>> headRedis(const std::string& runDir) {
  auto cluster = readClusterFile(runDir);
  if (!cluster.isOk()) return cluster.status();
  TROUPE_ASSIGN_OR_RETURN(auto address, parseHostPort(cluster->redisAddress));
  RedisOptions redis;
  redis.host = address.host;
  redis.port = address.port;
  redis.password = cluster->redisPassword;
  redis.cluster = cluster->cluster;
  return std::make_pair(redis, cluster->token);
}

void captureStopSignals() {
  kj::UnixEventPort::captureSignal(SIGTERM);
  kj::UnixEventPort::captureSignal(SIGINT);
  signal(SIGPIPE, SIG_IGN);
}

kj::Promise<std::string> onStopSignal(kj::AsyncIoContext& io) {
  auto term = io.unixEventPort.onSignal(SIGTERM).then([](siginfo_t) { return std::string("SIGTERM"); });
  auto intr = io.unixEventPort.onSignal(SIGINT).then([](siginfo_t) { return std::string("SIGINT"); });
  return term.exclusiveJoin(kj::mv(intr));
}

namespace {
// The run directory's pids/ is writable by the user's actors: what is at the name goes (a FIFO
// there would block the open), and the file is made anew.
void writePidFile(const std::string& path) {
  ::unlink(path.c_str());
  auto fd = openRegularFile(path, O_WRONLY | O_CREAT | O_EXCL);
  if (!fd.isOk()) {
    TROUPE_LOG(kWarning, "cannot write {}: {}", path, fd.status().toString());
    return;
  }
  std::string text = fmt::format("{}\n", getpid());
  if (::write(fd->get(), text.data(), text.size()) != static_cast<ssize_t>(text.size())) {
    TROUPE_LOG(kWarning, "cannot write {}: {}", path, std::strerror(errno));
  }
}
}  // namespace

DaemonFiles::DaemonFiles(const std::string& runDir, const std::string& name)
    : pidPath_(fmt::format("{}/pids/{}.pid", runDir, name)), readyPath_(fmt::format("{}/pids/{}.ready", runDir, name)) {
  setLogProcessName(name);
  std::string logPath = fmt::format("{}/logs/{}.log", runDir, name);
  if (!openLogFile(logPath, false)) TROUPE_LOG(kWarning, "cannot open log file {}", logPath);
  writePidFile(pidPath_);
}

DaemonFiles::~DaemonFiles() {
  std::remove(readyPath_.c_str());
  std::remove(pidPath_.c_str());
}

void DaemonFiles::markReady() { writePidFile(readyPath_); }

}  // namespace troupe
