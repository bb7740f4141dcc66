#include "troupe/runtime/process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>
#include <tuple>

#include <fmt/format.h>

#include "troupe/runtime/safe_open.h"

extern char** environ;

namespace troupe {

std::string ExitInfo::toString() const {
  if (signal != 0) return fmt::format("signal {} ({})", signal, strsignal(signal));
  return fmt::format("exit code {}", exitCode);
}

Result<pid_t> spawnProcess(const SpawnOptions& options) {
  if (options.argv.empty()) return Status(StatusCode::kInvalidArgument, "spawnProcess: empty argv");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  short flags = POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF;
  if (options.newSession) flags |= POSIX_SPAWN_SETSID;
  posix_spawnattr_setflags(&attr, flags);
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  // The log files are opened here, not in the child: posix_spawn waits for the child's exec, so
  // a FIFO someone put at a log's path would block this process in the child's open().
  FileDescriptor output, error;
  for (auto [path, given, fd, target] : {std::tuple{&options.outputPath, options.outputFd, &output, 1},
                                         std::tuple{&options.errorPath, options.errorFd, &error, 2}}) {
    if (path->empty() && given < 0) continue;
    // A given descriptor is copied at 3 or above: dup2 onto its own place would keep close-on-exec.
    Result<FileDescriptor> opened = given >= 0 ? Result<FileDescriptor>(FileDescriptor(::fcntl(given, F_DUPFD_CLOEXEC, 3)))
                                               : openRegularFile(*path, O_WRONLY | O_CREAT | O_APPEND);
    if (given < 0 && opened.isOk() && opened->get() < 3) {  // below 3, dup2 onto its own place would keep close-on-exec
      opened = FileDescriptor(::fcntl(opened->get(), F_DUPFD_CLOEXEC, 3));
    }
    if (!opened.isOk() || opened->get() < 0) {
      posix_spawn_file_actions_destroy(&actions);
      posix_spawnattr_destroy(&attr);
      std::string what = path->empty() ? "a copy of the given descriptor" : *path;
      return opened.isOk() ? Status(StatusCode::kResourceExhausted,
                                    fmt::format("cannot open {}: {}", what, std::strerror(errno)))
                           : opened.status();
    }
    *fd = std::move(*opened);
    posix_spawn_file_actions_adddup2(&actions, fd->get(), target);
  }
  if ((!options.outputPath.empty() || options.outputFd >= 0) && options.errorPath.empty() && options.errorFd < 0) {
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
  }
  // dup2 clears close-on-exec on the copy; a descriptor already at its place is moved out of the
  // way first (dup2 onto itself would keep the flag).
  std::vector<int> moved;
  for (size_t i = 0; i < options.inheritFds.size(); ++i) {
    int fd = options.inheritFds[i];
    if (fd < 3 + static_cast<int>(options.inheritFds.size())) {
      fd = ::fcntl(fd, F_DUPFD_CLOEXEC, 3 + static_cast<int>(options.inheritFds.size()));
      if (fd < 0) {
        for (int m : moved) ::close(m);
        posix_spawn_file_actions_destroy(&actions);
        posix_spawnattr_destroy(&attr);
        return Status(StatusCode::kResourceExhausted, fmt::format("cannot pass a descriptor: {}", strerror(errno)));
      }
      moved.push_back(fd);
    }
    posix_spawn_file_actions_adddup2(&actions, fd, 3 + static_cast<int>(i));
  }
  std::vector<char*> argv;
  for (const auto& a : options.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  // The overrides replace inherited variables of the same name (getenv reads the first one).
  auto overridden = [&](const char* entry) {
    const char* eq = std::strchr(entry, '=');
    size_t len = eq ? static_cast<size_t>(eq - entry) + 1 : std::strlen(entry);
    for (const auto& o : options.env) {
      if (o.size() >= len && o.compare(0, len, entry, len) == 0) return true;
    }
    return false;
  };
  std::vector<char*> env;
  for (char** e = environ; *e; ++e) {
    if (!overridden(*e)) env.push_back(*e);
  }
  for (const auto& e : options.env) env.push_back(const_cast<char*>(e.c_str()));
  env.push_back(nullptr);
  pid_t pid = 0;
  int rc = posix_spawnp(&pid, argv[0], &actions, &attr, argv.data(), env.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  for (int m : moved) ::close(m);
  if (rc != 0) {
    return Status(StatusCode::kNotFound,
                  fmt::format("cannot start '{}': {}", options.argv[0], strerror(rc)));
  }
  return pid;
}

namespace {
ExitInfo decode(int status) {
  ExitInfo info;
  if (WIFEXITED(status)) info.exitCode = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) info.signal = WTERMSIG(status);
  return info;
}
}  // namespace

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    if (pid_ > 0) stop(SIGKILL, std::chrono::milliseconds(5000));
    pid_ = other.pid_;
    other.pid_ = 0;
  }
  return *this;
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0) stop(SIGKILL, std::chrono::milliseconds(5000));
}

std::optional<ExitInfo> ChildProcess::wait(std::chrono::milliseconds timeout) {
  if (pid_ <= 0) return ExitInfo{};
  auto deadline = std::chrono::steady_clock::now() + timeout;
  // waitpid has no timeout; poll with a short back-off (children exit within milliseconds
  // of a signal, so the back-off stays small).
  auto pause = std::chrono::microseconds(200);
  for (;;) {
    int status = 0;
    pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      pid_ = 0;
      return decode(status);
    }
    if (r < 0 && errno != EINTR) {  // not our child any more
      pid_ = 0;
      return ExitInfo{};
    }
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(20000));
  }
}

ExitInfo ChildProcess::stop(int signal, std::chrono::milliseconds timeout) {
  if (pid_ <= 0) return ExitInfo{};
  ::kill(pid_, signal);
  if (auto info = wait(timeout)) return *info;
  ::kill(pid_, SIGKILL);
  if (auto info = wait(std::chrono::milliseconds(5000))) return *info;
  return ExitInfo{};
}

pid_t ChildProcess::release() {
  pid_t p = pid_;
  pid_ = 0;
  return p;
}

bool processAlive(pid_t pid) {
  if (pid <= 0) return false;
  std::ifstream stat(fmt::format("/proc/{}/stat", pid));
  if (!stat) return false;
  std::string line;
  std::getline(stat, line);
  auto close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return false;
  char state = line[close + 2];
  return state != 'Z' && state != 'X';
}

std::string processCommandLine(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/cmdline", pid), std::ios::binary);
  std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (char& c : raw) if (c == '\0') c = ' ';
  while (!raw.empty() && raw.back() == ' ') raw.pop_back();
  return raw;
}

Result<int> pickFreePort(const std::string& host) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status(StatusCode::kInternal, fmt::format("socket: {}", strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    ::close(fd);
    return Status(StatusCode::kInvalidArgument, fmt::format("'{}' is not an IPv4 address", host));
  }
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    int err = errno;
    ::close(fd);
    return Status(StatusCode::kUnavailable, fmt::format("cannot bind {}: {}", host, strerror(err)));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return static_cast<int>(ntohs(addr.sin_port));
}

Status checkBindable(const std::string& host, int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) return Status::ok();  // a name: the listener says
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status::ok();
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  int err = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 ? 0 : errno;
  ::close(fd);
  switch (err) {
    case 0:
      return Status::ok();
    case EADDRINUSE:
      return Status(StatusCode::kAlreadyExists, fmt::format("port {} on {} is already in use", port, host));
    case EADDRNOTAVAIL:
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("{} is not an address of this machine (EADDRNOTAVAIL): pass --node-ip-address "
                                "with one of its own addresses ('ip -brief address' lists them)",
                                host));
    case EACCES:
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("port {} on {} needs privileges to bind (EACCES): pass a port above 1023", port, host));
    default:
      return Status(StatusCode::kUnavailable, fmt::format("cannot bind {}:{}: {}", host, port, std::strerror(err)));
  }
}

Result<int> connectTcp(const HostPort& address, std::chrono::milliseconds timeout) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int rc = ::getaddrinfo(address.host.c_str(), std::to_string(address.port).c_str(), &hints, &found); rc != 0) {
    return Status(StatusCode::kUnavailable, fmt::format("cannot resolve {}: {}", address.host, gai_strerror(rc)));
  }
  sockaddr_in target{};
  memcpy(&target, found->ai_addr, sizeof(target));
  ::freeaddrinfo(found);
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return Status(StatusCode::kInternal, fmt::format("socket: {}", strerror(errno)));
  auto fail = [&](const std::string& why) {
    ::close(fd);
    return Status(StatusCode::kUnavailable, fmt::format("cannot connect to {}: {}", address.toString(), why));
  };
  if (::connect(fd, reinterpret_cast<sockaddr*>(&target), sizeof(target)) != 0) {
    if (errno != EINPROGRESS) return fail(strerror(errno));
    pollfd p{fd, POLLOUT, 0};
    int ready;
    do ready = ::poll(&p, 1, static_cast<int>(timeout.count())); while (ready < 0 && errno == EINTR);
    if (ready == 0) return fail(fmt::format("no answer within {} ms", timeout.count()));
    int err = 0;
    socklen_t len = sizeof(err);
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (ready < 0 || err != 0) return fail(strerror(ready < 0 ? errno : err));
  }
  int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

Result<std::string> localAddressToward(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), "9", &hints, &found); rc != 0) {
    return Status(StatusCode::kUnavailable, fmt::format("cannot resolve {}: {}", host, gai_strerror(rc)));
  }
  // Connecting a UDP socket only picks the route and source address; nothing is sent.
  int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  int rc = fd < 0 ? -1 : ::connect(fd, found->ai_addr, found->ai_addrlen);
  int err = errno;
  ::freeaddrinfo(found);
  sockaddr_in local{};
  socklen_t len = sizeof(local);
  if (rc != 0 || ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return Status(StatusCode::kUnavailable, fmt::format("no route to {}: {}", host, strerror(err)));
  }
  ::close(fd);
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &local.sin_addr, text, sizeof(text));
  return std::string(text);
}

std::string executableDir() {
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : exe.parent_path().string();
}

}  // namespace troupe
