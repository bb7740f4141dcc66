// A node agent's writer of its workers' output: each worker's stdout and stderr are pipes whose
// read ends a thread of the pump drains into the actor's log file, so the cap is checked at every
// read (a flood waits on its full pipe while the pump writes) and never on the agent's event loop.
// A log that would pass the per-file cap is renamed to `<log>.1` (replacing the older one) and
// started anew; while the directory's actor logs exceed the per-run cap, the oldest go.
// Thread-safety: open() and drain() may be called from any thread; the pump's own thread reads.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "troupe/runtime/safe_open.h"
#include "troupe/runtime/status.h"

namespace troupe {

struct LogPumpOptions {
  std::string dir;            // the logs directory: the per-run cap counts its actor-* logs
  uint64_t maxFileBytes = 0;  // a log never grows past it: the next bytes go to a new file
  uint64_t maxRunBytes = 0;   // the oldest actor logs (rotated ones first by age) go above it
};

class LogPump {
 public:
  explicit LogPump(LogPumpOptions options);
  ~LogPump();  // stops the thread; what the pipes still hold is not written
  LogPump(const LogPump&) = delete;
  LogPump& operator=(const LogPump&) = delete;

  // A pipe whose read end this pump drains into `path` (appending to what is there): the caller
  // gives the write end to a worker as its stdout or stderr and closes its own copy; the stream
  // ends when every copy is closed. Errors: kUnavailable (no pipe), or openRegularFile's for the
  // log (kFailedPrecondition when something not a file of ours is at `path`).
  [[nodiscard]] Result<FileDescriptor> open(const std::string& path);

  // Writes what the pipes of `path` hold now (up to 1 MiB), so that a worker's last lines are in
  // its log before its exit is reported with its stderr's tail.
  void drain(const std::string& path);

 private:
  struct File {
    FileDescriptor fd;
    uint64_t size = 0;
    int streams = 0;
  };
  struct Stream {
    FileDescriptor pipe;
    std::string path;
  };

  void run();
  // Reads up to `budget` bytes of `stream` into its file; false once its writers are all gone.
  bool pumpLocked(Stream& stream, size_t budget);
  void appendLocked(const std::string& path, File& file, const char* data, size_t size);
  void rotateLocked(const std::string& path, File& file);
  void closeStreamLocked(int pipe);
  void enforceRunCapLocked();

  const LogPumpOptions options_;
  FileDescriptor epoll_;
  FileDescriptor wake_;
  std::mutex mutex_;
  std::map<int, Stream> streams_;     // by the pipe's read end
  std::map<std::string, File> files_;  // the open logs, by path (incarnations of an actor share one)
  uint64_t writtenSinceSweep_ = 0;
  uint64_t dropped_ = 0;  // logs dropped for the run's cap since lastReport_, and their bytes
  uint64_t droppedBytes_ = 0;
  std::chrono::steady_clock::time_point lastReport_;
  std::thread thread_;  // last: started once the rest is made
};

}  // namespace troupe
