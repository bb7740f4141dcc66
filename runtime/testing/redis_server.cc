#include "troupe/testing/redis_server.h"

#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

#include "troupe/runtime/clock.h"
#include "troupe/runtime/ids.h"

namespace troupe::testing {
namespace {

constexpr std::chrono::seconds kStartDeadline{10};
constexpr int kPortAttempts = 3;

// hiredis objects freed with their owners (the store's own helpers are its library's internals).
using ContextPtr = std::unique_ptr<redisContext, decltype(&redisFree)>;
using ReplyPtr = std::unique_ptr<redisReply, decltype(&freeReplyObject)>;

std::string readFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void writePrivateFile(const std::string& path, const std::string& text) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) throw std::runtime_error(fmt::format("cannot create {}: {}", path, strerror(errno)));
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int err = errno;
      ::close(fd);
      throw std::runtime_error(fmt::format("cannot write {}: {}", path, strerror(err)));
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
}

// True once the server answers PING, after AUTH when it has a password.
bool answersPing(const std::string& host, int port, const std::string& password) {
  const timeval timeout{0, 200 * 1000};
  ContextPtr context(redisConnectWithTimeout(host.c_str(), port, timeout), &redisFree);
  if (!context || context->err) return false;
  if (redisSetTimeout(context.get(), timeout) != REDIS_OK) return false;
  if (!password.empty()) {
    ReplyPtr auth(static_cast<redisReply*>(
        redisCommand(context.get(), "AUTH %b", password.data(), password.size())), &freeReplyObject);
    if (!auth || auth->type == REDIS_REPLY_ERROR) return false;
  }
  ReplyPtr pong(static_cast<redisReply*>(redisCommand(context.get(), "PING")), &freeReplyObject);
  return pong && pong->type == REDIS_REPLY_STATUS && std::string(pong->str, pong->len) == "PONG";
}

}  // namespace

RedisServerProcess::TempDir::TempDir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "troupe-redis-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) {
    throw std::runtime_error(fmt::format("mkdtemp {}: {}", pattern, strerror(errno)));
  }
  path_ = pattern;
}

RedisServerProcess::TempDir::~TempDir() {
  std::error_code ignored;  // best effort: a leftover dir in /tmp must not fail a test
  std::filesystem::remove_all(path_, ignored);
}

RedisServerProcess::RedisServerProcess(RedisServerOptions options) : options_(options) {
  if (options_.requirePassword) password_ = randomHex(16);
  std::string failure;
  for (int attempt = 0; attempt < kPortAttempts; ++attempt) {
    if (tryStart(failure)) return;
  }
  throw std::runtime_error(fmt::format("redis-server did not start after {} ports: {}",
                                       kPortAttempts, failure));
}

RedisServerProcess::~RedisServerProcess() { kill9(); }

bool RedisServerProcess::tryStart(std::string& failure) {
  auto port = pickFreePort(host_);
  if (!port) throw std::runtime_error(port.status().toString());
  port_ = *port;

  const std::string configPath = dir_.path() + "/redis.conf";
  const std::string logPath = dir_.path() + "/redis.log";
  std::string config = fmt::format(
      "bind {}\nport {}\nprotected-mode yes\ndaemonize no\nappendonly no\nsave \"\"\n"
      "dir {}\nlogfile \"\"\n",
      host_, port_, dir_.path());
  if (options_.requirePassword) config += fmt::format("requirepass {}\n", password_);
  writePrivateFile(configPath, config);

  SpawnOptions spawn;
  spawn.argv = {"redis-server", configPath};
  spawn.outputPath = logPath;
  auto pid = spawnProcess(spawn);
  if (!pid) throw std::runtime_error(pid.status().toString());
  child_ = ChildProcess(*pid);

  const auto deadline = Clock::now() + kStartDeadline;
  auto pause = std::chrono::milliseconds(1);
  while (Clock::now() < deadline) {
    if (answersPing(host_, port_, password_)) return true;
    if (auto exit = child_.wait(std::chrono::milliseconds(0))) {
      const std::string log = readFile(logPath);
      // Another process took the port between pickFreePort() and redis' bind(): try another.
      if (log.find("Address already in use") != std::string::npos) {
        failure = fmt::format("port {} was taken", port_);
        return false;
      }
      throw std::runtime_error(fmt::format("redis-server exited ({}) before answering PING; "
                                           "its log:\n{}",
                                           exit->toString(), log));
    }
    // Polling the condition (it answers PING), with a short back-off.
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(20));
  }
  child_.stop(SIGKILL, std::chrono::seconds(5));
  throw std::runtime_error(fmt::format("redis-server on port {} did not answer PING within {} s; "
                                       "its log:\n{}",
                                       port_, kStartDeadline.count(), readFile(logPath)));
}

RedisOptions RedisServerProcess::options(std::string cluster) const {
  RedisOptions options;
  options.host = host_;
  options.port = port_;
  options.password = password_;
  options.cluster = std::move(cluster);
  return options;
}

void RedisServerProcess::kill9() { child_.stop(SIGKILL, std::chrono::seconds(5)); }

namespace {

RedisServerProcess* shared = nullptr;
pid_t sharedOwner = 0;

// At exit of the process that started it (a forked child's exit leaves it running).
void stopShared() {
  if (::getpid() == sharedOwner) delete shared;
}

RedisServerProcess& sharedServer() {
  static std::once_flag once;
  std::call_once(once, [] {
    shared = new RedisServerProcess();
    sharedOwner = ::getpid();
    std::atexit(stopShared);
  });
  return *shared;
}

}  // namespace

std::string newTestCluster() {
  sharedServer();
  return "t" + randomHex(8);
}

std::unique_ptr<ClusterStore> openTestStore(const std::string& cluster) {
  auto store = connectRedisStore(sharedServer().options(cluster));
  if (!store.isOk()) throw std::runtime_error("cannot open the test cluster store: " + store.status().toString());
  return std::move(store).value();
}

}  // namespace troupe::testing
