#include "troupe/runtime/config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
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

Result<std::string> latestRunDir() {
  fs::path latest = fs::path(runRoot()) / "latest";
  std::error_code ec;
  fs::path target = fs::read_symlink(latest, ec);
  if (ec) {
    return Status(StatusCode::kNotFound,
                  fmt::format("no running Troupe cluster found ({} does not exist); start one with "
                              "'troupe start --head' or pass --address",
                              latest.string()));
  }
  if (target.is_relative()) target = fs::path(runRoot()) / target;
  return target.string();
}

Result<std::string> createRunDir() {
  std::error_code ec;
  fs::create_directories(runRoot(), ec);
  if (ec) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("cannot create {}: {}; set TROUPE_TEMP_DIR to a writable directory",
                              runRoot(), ec.message()));
  }
  auto now = std::chrono::system_clock::now();
  time_t secs = std::chrono::system_clock::to_time_t(now);
  struct tm tm;
  gmtime_r(&secs, &tm);
  std::string name = fmt::format("run_{:04}{:02}{:02}_{:02}{:02}{:02}_{}", tm.tm_year + 1900,
                                 tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, getpid());
  fs::path dir = fs::path(runRoot()) / name;
  fs::create_directories(dir / "logs", ec);
  if (!ec) fs::create_directories(dir / "pids", ec);
  if (ec) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("cannot create run directory {}: {}", dir.string(), ec.message()));
  }
  ::chmod(dir.c_str(), 0700);
  // Swap the `latest` link atomically so readers never see it missing.
  fs::path tmp = fs::path(runRoot()) / fmt::format(".latest.{}", getpid());
  fs::remove(tmp, ec);
  fs::create_symlink(name, tmp, ec);
  if (!ec) fs::rename(tmp, fs::path(runRoot()) / "latest", ec);
  if (ec) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("cannot update {}/latest: {}", runRoot(), ec.message()));
  }
  return dir.string();
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
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
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
