#include "troupe/runtime/config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include <fmt/format.h>

namespace troupe {

namespace fs = std::filesystem;

std::string HostPort::toString() const { return fmt::format("{}:{}", host, port); }

Result<HostPort> parseHostPort(const std::string& text) {
  auto colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size()) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("'{}' is not an address of the form HOST:PORT", text));
  }
  HostPort hp;
  hp.host = text.substr(0, colon);
  const std::string portText = text.substr(colon + 1);
  try {
    size_t used = 0;
    int port = std::stoi(portText, &used);
    if (used != portText.size() || port < 1 || port > 65535) throw std::out_of_range("port");
    hp.port = port;
  } catch (const std::exception&) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("'{}' in '{}' is not a port number (1-65535)", portText, text));
  }
  return hp;
}

std::string runRoot() {
  const char* env = std::getenv("TROUPE_TEMP_DIR");
  return env && *env ? std::string(env) : std::string("/tmp/troupe");
}

namespace {

// The run root holds tokens and passwords: it must be ours and closed to others.
Status checkOwnDirectory(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    return Status(StatusCode::kNotFound, fmt::format("{} does not exist", path));
  }
  if (!S_ISDIR(st.st_mode)) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("{} is not a directory (a link?); remove it or set TROUPE_TEMP_DIR", path));
  }
  if (st.st_uid != ::geteuid()) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("{} belongs to uid {}, not to you (uid {}): another user could read the cluster's "
                              "secrets there; remove it or set TROUPE_TEMP_DIR to a directory of your own",
                              path, st.st_uid, ::geteuid()));
  }
  if ((st.st_mode & 022) != 0) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("{} is writable by group or others (mode {:o}); run 'chmod go-w {}' or set "
                              "TROUPE_TEMP_DIR",
                              path, st.st_mode & 07777, path));
  }
  return Status::ok();
}

}  // namespace

Result<std::string> latestRunDir() {
  fs::path latest = fs::path(runRoot()) / "latest";
  std::error_code ec;
  if (auto own = checkOwnDirectory(runRoot()); !own.isOk() && own.code() != StatusCode::kNotFound) return own;
  struct stat link {};
  if (::lstat(latest.c_str(), &link) == 0 && link.st_uid != ::geteuid()) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("{} belongs to uid {}, not to you: not following it", latest.string(), link.st_uid));
  }
  fs::path target = fs::read_symlink(latest, ec);
  if (ec) {
    return Status(StatusCode::kNotFound,
                  fmt::format("no running Troupe cluster found ({} does not exist); start one with "
                              "'troupe start --head' or pass --address",
                              latest.string()));
  }
  // Only a run directory of this root: "run_..." with no path in it.
  if (target.has_parent_path() || target.string().rfind("run_", 0) != 0) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("{} points at '{}', not at a run directory of {}", latest.string(), target.string(),
                              runRoot()));
  }
  return (fs::path(runRoot()) / target).string();
}

Result<std::string> createRunDir() {
  std::error_code ec;
  fs::path root(runRoot());
  if (root.has_parent_path()) fs::create_directories(root.parent_path(), ec);
  if (::mkdir(root.c_str(), 0700) != 0 && errno != EEXIST) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("cannot create {}: {}; set TROUPE_TEMP_DIR to a writable directory", runRoot(),
                              strerror(errno)));
  }
  if (auto own = checkOwnDirectory(runRoot()); !own.isOk()) return own;
  auto now = std::chrono::system_clock::now();
  time_t secs = std::chrono::system_clock::to_time_t(now);
  struct tm tm;
  gmtime_r(&secs, &tm);
  std::string name = fmt::format("run_{:04}{:02}{:02}_{:02}{:02}{:02}_{}", tm.tm_year + 1900,
                                 tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, getpid());
  fs::path dir = fs::path(runRoot()) / name;
  // mkdir, not create_directories: a directory that already exists (someone else's) is refused.
  for (const fs::path& d : {dir, dir / "logs", dir / "pids"}) {
    if (::mkdir(d.c_str(), 0700) != 0) {
      return Status(StatusCode::kFailedPrecondition,
                    fmt::format("cannot create run directory {}: {}", d.string(), strerror(errno)));
    }
  }
  return dir.string();
}

Status markLatest(const std::string& runDir) {
  std::error_code ec;
  std::string name = fs::path(runDir).filename().string();
  // Swap the `latest` link atomically so readers never see it missing.
  fs::path tmp = fs::path(runRoot()) / fmt::format(".latest.{}", getpid());
  fs::remove(tmp, ec);
  fs::create_symlink(name, tmp, ec);
  if (!ec) fs::rename(tmp, fs::path(runRoot()) / "latest", ec);
  if (ec) {
    return Status(StatusCode::kFailedPrecondition, fmt::format("cannot update {}/latest: {}", runRoot(), ec.message()));
  }
  return Status::ok();
}

Status writeClusterFile(const std::string& runDir, const ClusterFile& file) {
  nlohmann::json j = {{"controller_address", file.controllerAddress},
                      {"token", file.token},
                      {"redis_address", file.redisAddress},
                      {"redis_password", file.redisPassword},
                      {"cluster", file.cluster},
                      {"embedded_redis", file.embeddedRedis},
                      {"tls", file.tls},
                      {"heartbeat_ttl_ms", file.heartbeatTtlMs}};
  std::string path = runDir + "/cluster.json";
  std::string tmp = path + ".tmp";
  ::unlink(tmp.c_str());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    return Status(StatusCode::kFailedPrecondition, fmt::format("cannot write {}: {}", tmp, strerror(errno)));
  }
  std::string text = j.dump(2) + "\n";
  bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ok = ::fsync(fd) == 0 && ok;
  ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    return Status(StatusCode::kFailedPrecondition, fmt::format("cannot write {}: {}", path, strerror(errno)));
  }
  return Status::ok();
}

Result<ClusterFile> readClusterFile(const std::string& runDir) {
  std::string path = runDir + "/cluster.json";
  std::ifstream in(path);
  if (!in) {
    return Status(StatusCode::kNotFound,
                  fmt::format("no running Troupe cluster found ({} is missing); start one with "
                              "'troupe start --head' or pass --address",
                              path));
  }
  try {
    nlohmann::json j = nlohmann::json::parse(in);
    ClusterFile f;
    f.controllerAddress = j.at("controller_address").get<std::string>();
    f.token = j.at("token").get<std::string>();
    f.redisAddress = j.value("redis_address", "");
    f.redisPassword = j.value("redis_password", "");
    f.cluster = j.value("cluster", "default");
    f.embeddedRedis = j.value("embedded_redis", false);
    f.tls = j.value("tls", false);
    f.heartbeatTtlMs = j.value("heartbeat_ttl_ms", 3000);
    return f;
  } catch (const std::exception& e) {
    return Status(StatusCode::kFailedPrecondition, fmt::format("{} is corrupt: {}", path, e.what()));
  }
}

int64_t wallClockMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace troupe
