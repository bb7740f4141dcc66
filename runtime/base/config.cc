#include "troupe/runtime/config.h"
#include "troupe/runtime/safe_open.h"

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
  // Per user: one shared /tmp/troupe would let the first user's directory (or a planted one)
  // stand for everyone's.
  return env && *env ? std::string(env) : fmt::format("/tmp/troupe-{}", ::geteuid());
}

Status checkPrivate(const std::string& path, PathKind kind, mode_t forbidden) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    return Status(StatusCode::kNotFound, fmt::format("{} does not exist", path));
  }
  bool rightKind = kind == PathKind::kDirectory ? S_ISDIR(st.st_mode) : S_ISREG(st.st_mode);
  if (!rightKind) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("{} is not a {} (a link, a FIFO?); remove it or set TROUPE_TEMP_DIR", path,
                              kind == PathKind::kDirectory ? "directory" : "regular file"));
  }
  if (st.st_uid != ::geteuid()) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("{} belongs to uid {}, not to you (uid {}): another user could read the cluster's "
                              "secrets there or plant a cluster of theirs; remove it or set TROUPE_TEMP_DIR to a "
                              "directory of your own",
                              path, st.st_uid, ::geteuid()));
  }
  if ((st.st_mode & forbidden) != 0) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("{} is {} (mode {:o}); run 'chmod {} {}' or set TROUPE_TEMP_DIR", path,
                              (forbidden & 044) != 0 ? "open to group or others" : "writable by group or others",
                              st.st_mode & 07777, (forbidden & 044) != 0 ? "go-rwx" : "go-w", path));
  }
  return Status::ok();
}

namespace {
// The run root holds tokens and passwords: ours and not writable by others (readable is the
// user's choice: the run directories inside are 0700).
Status checkOwnRoot(const std::string& root) { return checkPrivate(root, PathKind::kDirectory, 022); }
}  // namespace

Result<std::string> latestRunDir() { return latestRunDir(runRoot()); }

Result<std::string> latestRunDir(const std::string& root) {
  fs::path latest = fs::path(root) / "latest";
  std::error_code ec;
  if (auto own = checkOwnRoot(root); !own.isOk() && own.code() != StatusCode::kNotFound) return own;
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
                              root));
  }
  std::string dir = (fs::path(root) / target).string();
  // The run directory itself: ours and closed (created 0700), or not followed.
  if (auto own = checkPrivate(dir, PathKind::kDirectory, 077); !own.isOk()) {
    if (own.code() == StatusCode::kNotFound) {
      return Status(StatusCode::kNotFound,
                    fmt::format("no running Troupe cluster found ({} points at {}, which is gone); start one with "
                                "'troupe start --head' or pass --address",
                                latest.string(), dir));
    }
    return own;
  }
  return dir;
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
  if (auto own = checkOwnRoot(runRoot()); !own.isOk()) return own;
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
  auto missing = [&path]() {
    return Status(StatusCode::kNotFound, fmt::format("no running Troupe cluster found ({} is missing); start one "
                                                     "with 'troupe start --head' or pass --address",
                                                     path));
  };
  // The file names the cluster a client will trust and hand its code to: it must be ours and
  // private, in a directory that is ours and private, or another user could have planted it.
  if (auto own = checkPrivate(runDir, PathKind::kDirectory, 077); !own.isOk()) {
    return own.code() == StatusCode::kNotFound ? missing() : own;
  }
  if (auto own = checkPrivate(path, PathKind::kRegularFile, 077); !own.isOk()) {
    if (own.code() == StatusCode::kNotFound) return missing();
    return Status(own.code(), fmt::format("a cluster file must be yours and 0600; not trusting it: {}", own.message()));
  }
  // Opened without following a link or blocking on a FIFO swapped in since the check.
  auto text = readRegularFile(path, kMaxClusterFileBytes);
  if (!text.isOk()) return text.status().code() == StatusCode::kNotFound ? missing() : text.status();
  try {
    nlohmann::json j = nlohmann::json::parse(*text);
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

}  // namespace troupe
