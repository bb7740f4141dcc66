// The node agent's Python fork server (python/troupe/_zygote.py): a Python process that has
// imported troupe once and forks each Python worker on request, so a Python actor starts in a few
// milliseconds instead of paying ~100 ms of CPU for the interpreter and its imports.
//
// Each worker is forked through a short-lived middle process, so it is reparented to this process
// at once: the process must be a child subreaper (prctl PR_SET_CHILD_SUBREAPER) and must have
// called kj::UnixEventPort::captureChildExit(); it then watches a forked worker with onChildExit
// like one it spawned, and a kill of the zygote leaves the workers running.
// Thread-safety: created, used and destroyed on one KJ thread (the node agent's).
#pragma once

#include <sys/types.h>

#include <deque>
#include <memory>
#include <string>
#include <vector>

#include <kj/async-io.h>
#include <kj/io.h>
#include <kj/vector.h>

#include "troupe/runtime/process.h"

namespace troupe {

struct ZygoteOptions {
  std::string python = "/usr/bin/python3";
  // Its environment on top of this process's: what a worker gets that is read when Python
  // starts or troupe is imported (PYTHONPATH, PYTHONUNBUFFERED, TROUPE_TLS). The zygote refuses a
  // fork whose environment sets one of those (PYTHON*, TROUPE_TLS) to another value.
  std::vector<std::string> env;
  std::string logDir;      // its output (<logDir>/<logName>.{out,err}); workers' output may go only here
  std::string logName = "python-zygote";
  kj::Duration startTimeout = 20 * kj::SECONDS;  // from spawning it to its "ready" (forks wait for it)
  kj::Duration replyTimeout = 10 * kj::SECONDS;  // for each fork; past it the zygote is killed
};

// A worker the zygote forked: already this process's child, waiting (doing nothing) for start().
// Dropped without start(), the worker leaves at once without running anything.
class ForkedWorker {
 public:
  ForkedWorker(pid_t pid, kj::Own<kj::AsyncIoStream> startLine) : pid_(pid), startLine_(kj::mv(startLine)) {}
  pid_t pid() const { return pid_; }
  // Lets the worker run; call it once its exit is watched (onChildExit). False when the worker
  // has ended already (killed meanwhile), in which case its exit status may be lost.
  [[nodiscard]] bool start();

 private:
  pid_t pid_;
  kj::Own<kj::AsyncIoStream> startLine_;  // the agent's end of a socketpair; the worker holds the other
};

class PythonZygote {
 public:
  PythonZygote(kj::AsyncIoContext& io, ZygoteOptions options);
  // SIGKILLs the zygote; the workers it forked keep running.
  ~PythonZygote();
  KJ_DISALLOW_COPY(PythonZygote);

  // Whether fork() may be tried now: the zygote is ready, or is starting for the first time (the
  // fork then waits for it). False while it restarts after a failure.
  bool accepting() const;
  // Forks a Python worker that runs as `python -m troupe._worker <args>` would, with `spawn.env`
  // on top of this process's environment, stdout and stderr appended to spawn.outputPath and
  // spawn.errorPath (spawn.argv is not used). Starts the zygote on the first call. Rejects when
  // the zygote is down, fails meanwhile or does not answer within replyTimeout; the caller then
  // spawns the worker itself. Any number may be pending; the zygote forks them in order.
  kj::Promise<ForkedWorker> fork(const std::vector<std::string>& args, const SpawnOptions& spawn);
  // The zygote's pid while it runs, else 0.
  pid_t pid() const;

 private:
  struct Running;
  struct Pending {
    uint64_t seq;         // in the order of fork() calls
    std::string message;  // length-prefixed request
    kj::AutoCloseFd workerEnd;  // the worker's end of its start line, sent with the request
    kj::AutoCloseFd agentEnd;
    kj::Vector<kj::AutoCloseFd> logEnds;  // copies of the worker's stdout and stderr (pipes), sent with it
    kj::Own<kj::PromiseFulfiller<ForkedWorker>> fulfiller;
  };
  enum class State { kIdle, kStarting, kReady, kDown };

  void start();
  // Sends the queued requests (once the zygote is ready).
  void pump();
  // Matches the zygote's answers to the requests sent, in order, until it fails.
  kj::Promise<void> readReplies(Running& running, uint64_t generation);
  // Ends the current zygote (SIGKILL) after `why`; pending forks are rejected, and it restarts
  // once its exit has been seen.
  void fail(uint64_t generation, std::string why);
  void exited(uint64_t generation, pid_t pid, int status);
  kj::Promise<std::string> readMessage(Running& running);
  // Once the zygote has forked the middle process: the worker's pid, from its start line.
  kj::Promise<void> awaitPid(Pending forked);

  kj::AsyncIoContext& io_;
  ZygoteOptions options_;
  State state_ = State::kIdle;
  bool firstStart_ = true;  // forks wait for the first start; later restarts fall back at once
  uint64_t generation_ = 0;
  int failures_ = 0;        // in a row, for the restart back-off
  std::string whyDown_;
  std::deque<Pending> queue_;  // not sent yet (the zygote is starting)
  std::deque<Pending> sent_;   // sent, waiting for the zygote's answer
  uint64_t nextSeq_ = 0;
  kj::Own<Running> running_;
  kj::Own<kj::TaskSet> tasks_;
};

}  // namespace troupe
