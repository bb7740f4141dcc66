// Child processes and local ports: spawning daemons (redis-server, troupe-controller,
// troupe-node) with their output in log files, and reaping or killing them.
// Thread-safety: plain functions; a ChildProcess is owned by one thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "troupe/runtime/config.h"
#include "troupe/runtime/status.h"

namespace troupe {

struct SpawnOptions {
  std::vector<std::string> argv;   // argv[0] is a path or a name looked up on PATH
  std::string outputPath;          // stdout (and stderr, unless errorPath) appended here; empty: inherit
  std::string errorPath;           // stderr appended here when set
  int outputFd = -1;               // when >= 0, stdout is a copy of it instead (the caller keeps its own)
  int errorFd = -1;                // when >= 0, stderr is a copy of it instead
  bool newSession = false;         // setsid(): survives the parent's terminal and group
  std::vector<std::string> env;    // extra "NAME=value" entries on top of the parent's
  std::vector<int> inheritFds;     // open in the child as fds 3, 4, ... in this order
};

// Starts a process. kNotFound when argv[0] cannot be executed.
Result<pid_t> spawnProcess(const SpawnOptions& options);

// How a process ended: exitCode >= 0, or the signal that killed it.
struct ExitInfo {
  int exitCode = -1;
  int signal = 0;
  std::string toString() const;  // "exit code 1" / "signal 9 (Killed)"
};

// Owns a child: the destructor kills it (SIGKILL) and reaps it unless release()d.
class ChildProcess {
 public:
  ChildProcess() = default;
  explicit ChildProcess(pid_t pid) : pid_(pid) {}
  ChildProcess(ChildProcess&& other) noexcept : pid_(other.pid_) { other.pid_ = 0; }
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ~ChildProcess();

  pid_t pid() const { return pid_; }
  // Waits up to `timeout` for it to exit; nullopt if still running.
  std::optional<ExitInfo> wait(std::chrono::milliseconds timeout);
  // Sends `signal`, then waits up to `timeout` (SIGKILL after that).
  ExitInfo stop(int signal, std::chrono::milliseconds timeout);
  // Forget the child (it keeps running).
  pid_t release();

 private:
  pid_t pid_ = 0;
};

// True when a process with this pid exists and is not a zombie.
bool processAlive(pid_t pid);
// Command line of a live process (argv joined by spaces), empty if gone.
std::string processCommandLine(pid_t pid);
// A TCP port on `host` that was free a moment ago (bind to port 0, read it, close).
Result<int> pickFreePort(const std::string& host);
// Whether host:port (an IPv4 literal; a name is not checked) can be bound, by binding it: OK, or
// why not from bind's errno: kAlreadyExists (EADDRINUSE), kInvalidArgument for an address this
// machine does not have (EADDRNOTAVAIL) or a privileged port (EACCES), kUnavailable otherwise.
[[nodiscard]] Status checkBindable(const std::string& host, int port);
// A blocking TCP connection to host:port (IPv4 literal or name), made within `timeout`, with
// TCP_NODELAY set. kUnavailable naming the address and the reason otherwise.
Result<int> connectTcp(const HostPort& address, std::chrono::milliseconds timeout);
// This machine's address on the interface that routes to `host` (no packet is sent): what a
// joining node advertises when no --node-ip-address is given. kUnavailable without a route.
Result<std::string> localAddressToward(const std::string& host);
// Directory holding the running executable (for finding troupe-controller next to troupe).
std::string executableDir();

}  // namespace troupe
