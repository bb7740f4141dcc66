#include "python_zygote.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>
#include <kj/async-unix.h>
#include <kj/debug.h>

#include "troupe/runtime/logging.h"

namespace troupe {

namespace {

// A request is a few hundred bytes and a reply a few dozen; a longer announced length means the
// other end is not the zygote we started.
constexpr uint32_t kMaxReply = 64 * 1024;
constexpr size_t kMaxRequest = 1 << 20;  // _zygote.py MAX_MESSAGE

class LogZygoteTaskErrors final : public kj::TaskSet::ErrorHandler {
 public:
  void taskFailed(kj::Exception&& e) override {
    TROUPE_LOG(kWarning, "Python zygote task failed: {}", e.getDescription().cStr());
  }
};
LogZygoteTaskErrors gLogZygoteTaskErrors;

// A warning the first time in a row something fails, then information only (logged once, not
// once per restart).
void logFailure(int failures, const std::string& text) {
  if (failures == 0) {
    TROUPE_LOG(kWarning, "{}", text);
  } else {
    TROUPE_LOG(kInfo, "{}", text);
  }
}

std::string describeExit(int status) {
  if (WIFSIGNALED(status)) return fmt::format("signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return fmt::format("exit code {}", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
}

void appendLength(std::string& out, size_t size) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((size >> (8 * i)) & 0xff));
}

}  // namespace

bool ForkedWorker::start() {
  const char go = '1';
  ssize_t sent = -1;
  KJ_IF_MAYBE(fd, startLine_->getFd()) {
    do sent = ::send(*fd, &go, 1, MSG_NOSIGNAL); while (sent < 0 && errno == EINTR);
  }
  startLine_ = nullptr;
  return sent == 1;
}

// One zygote process: its pid, its end of the control socket, and the I/O on it (destroyed first).
struct PythonZygote::Running {
  pid_t pid = 0;
  std::shared_ptr<kj::Maybe<pid_t>> unreaped;  // null once its exit has been reaped
  kj::Own<kj::AsyncCapabilityStream> control;
  kj::Promise<void> writing = kj::READY_NOW;  // the requests sent so far, one after the other
  kj::TaskSet io{gLogZygoteTaskErrors};
};

PythonZygote::PythonZygote(kj::AsyncIoContext& io, ZygoteOptions options)
    : io_(io), options_(std::move(options)), tasks_(kj::heap<kj::TaskSet>(gLogZygoteTaskErrors)) {}

PythonZygote::~PythonZygote() {
  if (running_ && *running_->unreaped != nullptr) ::kill(running_->pid, SIGKILL);
  running_ = nullptr;  // its I/O before the queue whose buffers it may use
}

bool PythonZygote::accepting() const {
  return state_ == State::kReady || state_ == State::kIdle || (state_ == State::kStarting && firstStart_);
}

pid_t PythonZygote::pid() const {
  return running_ && *running_->unreaped != nullptr ? running_->pid : 0;
}

kj::Promise<ForkedWorker> PythonZygote::fork(const std::vector<std::string>& args, const SpawnOptions& spawn) {
  if (!accepting()) {
    return KJ_EXCEPTION(DISCONNECTED, fmt::format("the Python zygote is restarting ({})", whyDown_));
  }
  std::vector<std::string> fields = {spawn.outputPath, spawn.errorPath, std::to_string(args.size())};
  fields.insert(fields.end(), args.begin(), args.end());
  fields.insert(fields.end(), spawn.env.begin(), spawn.env.end());
  std::string body;
  for (size_t i = 0; i < fields.size(); ++i) {
    if (fields[i].find('\0') != std::string::npos) return KJ_EXCEPTION(FAILED, "a worker argument holds a NUL byte");
    if (i > 0) body.push_back('\0');
    body += fields[i];
  }
  if (body.size() > kMaxRequest) {
    return KJ_EXCEPTION(FAILED, fmt::format("a fork request of {} bytes (at most {})", body.size(), kMaxRequest));
  }
  std::string message;
  appendLength(message, body.size());
  message += body;
  int line[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, line) != 0) {
    return KJ_EXCEPTION(FAILED, fmt::format("cannot make a worker's start line: {}", std::strerror(errno)));
  }
  kj::AutoCloseFd workerEnd(line[1]);
  kj::AutoCloseFd agentEnd(line[0]);
  kj::Vector<kj::AutoCloseFd> logEnds;
  if (spawn.outputFd >= 0 && spawn.errorFd >= 0) {
    // The worker writes to pipes its agent reads (see LogPump): they ride with the start line.
    for (int fd : {spawn.outputFd, spawn.errorFd}) {
      int copy = ::fcntl(fd, F_DUPFD_CLOEXEC, 3);
      if (copy < 0) return KJ_EXCEPTION(FAILED, fmt::format("cannot pass a worker's output: {}", std::strerror(errno)));
      logEnds.add(copy);
    }
  }
  auto paf = kj::newPromiseAndFulfiller<ForkedWorker>();
  queue_.push_back(Pending{nextSeq_++, std::move(message), kj::mv(workerEnd), kj::mv(agentEnd), kj::mv(logEnds),
                           kj::mv(paf.fulfiller)});
  if (state_ == State::kIdle) {
    start();
  } else {
    pump();
  }
  return kj::mv(paf.promise);
}

void PythonZygote::start() {
  uint64_t generation = ++generation_;
  state_ = State::kStarting;
  int control[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, control) != 0) {
    fail(generation, fmt::format("cannot make its control socket: {}", std::strerror(errno)));
    return;
  }
  kj::AutoCloseFd ours(control[0]);
  kj::AutoCloseFd theirs(control[1]);
  SpawnOptions spawn;
  spawn.argv = {options_.python, "-m", "troupe._zygote", "--log-dir", options_.logDir, "--parent-pid",
                std::to_string(::getpid())};
  spawn.env = options_.env;
  spawn.outputPath = fmt::format("{}/{}.out", options_.logDir, options_.logName);
  spawn.errorPath = fmt::format("{}/{}.err", options_.logDir, options_.logName);
  spawn.inheritFds = {theirs.get()};
  auto pid = spawnProcess(spawn);
  theirs = nullptr;
  if (!pid.isOk()) {
    fail(generation, pid.status().message());
    return;
  }
  running_ = kj::heap<Running>();
  running_->pid = *pid;
  running_->unreaped = std::make_shared<kj::Maybe<pid_t>>(*pid);
  auto unreaped = running_->unreaped;
  tasks_->add(io_.unixEventPort.onChildExit(*unreaped).then([this, generation, unreaped, pid = *pid](int status) {
    exited(generation, pid, status);
  }));
  running_->control = io_.lowLevelProvider->wrapUnixSocketFd(kj::mv(ours));
  auto timeout = io_.provider->getTimer().afterDelay(options_.startTimeout).then([]() -> std::string {
    KJ_FAIL_REQUIRE("it did not say it was ready in time");
  });
  running_->io.add(readMessage(*running_).exclusiveJoin(kj::mv(timeout)).then(
      [this, generation, pid = *pid](std::string ready) {
        if (generation != generation_ || state_ != State::kStarting) return;
        if (ready.rfind("ready ", 0) != 0) {
          fail(generation, fmt::format("it said '{}' instead of ready", ready.substr(0, 80)));
          return;
        }
        state_ = State::kReady;
        firstStart_ = false;
        TROUPE_LOG(kInfo, "Python zygote ready (pid {}): Python workers are forked from it", pid);
        failures_ = 0;
        auto& running = *running_;
        running.io.add(readReplies(running, generation).catch_([this, generation](kj::Exception&& e) {
          fail(generation, e.getDescription().cStr());
        }));
        pump();
      },
      [this, generation](kj::Exception&& e) { fail(generation, e.getDescription().cStr()); }));
}

kj::Promise<std::string> PythonZygote::readMessage(Running& running) {
  auto header = kj::heapArray<kj::byte>(4);
  auto& stream = *running.control;
  auto read = stream.read(header.begin(), header.size());
  return read.then([&stream, header = kj::mv(header)]() mutable {
    uint32_t size = 0;
    for (int i = 0; i < 4; ++i) size |= static_cast<uint32_t>(header[i]) << (8 * i);
    KJ_REQUIRE(size <= kMaxReply, "a reply longer than allowed", size, kMaxReply);
    auto body = kj::heapArray<char>(size);
    auto read = stream.read(body.begin(), body.size());
    return read.then([body = kj::mv(body)]() { return std::string(body.begin(), body.size()); });
  });
}

void PythonZygote::pump() {
  if (state_ != State::kReady) return;
  auto& running = *running_;
  uint64_t generation = generation_;
  // Requests go out back to back (the zygote forks one after the other without waiting for this
  // process to be scheduled); its answers come in the same order.
  while (!queue_.empty()) {
    Pending next = kj::mv(queue_.front());
    queue_.pop_front();
    // The bytes and the worker's end of its start line live until sent (closed here then).
    auto bytes = kj::heapArray<kj::byte>(reinterpret_cast<const kj::byte*>(next.message.data()), next.message.size());
    kj::Vector<int> sent;
    sent.add(next.workerEnd.get());
    for (auto& log : next.logEnds) sent.add(log.get());
    auto fds = sent.releaseAsArray();
    running.writing = running.writing
                          .then([&running, bytes = kj::mv(bytes), fds = kj::mv(fds), workerEnd = kj::mv(next.workerEnd),
                                 logEnds = kj::mv(next.logEnds)]() mutable {
                            auto write = running.control->writeWithFds(bytes, nullptr, fds);
                            return write.attach(kj::mv(bytes), kj::mv(fds), kj::mv(workerEnd), kj::mv(logEnds));
                          })
                          .catch_([this, generation](kj::Exception&& e) { fail(generation, e.getDescription().cStr()); })
                          .eagerlyEvaluate(nullptr);
    uint64_t seq = next.seq;
    running.io.add(io_.provider->getTimer().afterDelay(options_.replyTimeout).then([this, generation, seq]() {
      if (generation == generation_ && !sent_.empty() && sent_.front().seq <= seq) {
        fail(generation, "it did not answer a fork request in time");
      }
    }));
    sent_.push_back(kj::mv(next));
  }
}

kj::Promise<void> PythonZygote::readReplies(Running& running, uint64_t generation) {
  return readMessage(running).then([this, &running, generation](std::string reply) -> kj::Promise<void> {
    if (generation != generation_ || state_ != State::kReady) return kj::READY_NOW;
    if (sent_.empty()) {
      fail(generation, fmt::format("it answered '{}' to no request", reply.substr(0, 80)));
      return kj::READY_NOW;
    }
    Pending done = kj::mv(sent_.front());
    sent_.pop_front();
    if (reply.rfind("ok ", 0) == 0) {
      // The worker's pid comes on its start line, from the middle process; this zygote may fail
      // meanwhile without losing it.
      tasks_->add(awaitPid(kj::mv(done)));
    } else if (reply.rfind("error ", 0) == 0) {
      done.fulfiller->reject(KJ_EXCEPTION(FAILED, "the Python zygote could not fork: " + reply.substr(6)));
    } else {
      done.fulfiller->reject(KJ_EXCEPTION(FAILED, "the Python zygote answered '" + reply.substr(0, 80) + "'"));
      fail(generation, fmt::format("it answered '{}' to a fork request", reply.substr(0, 80)));
      return kj::READY_NOW;
    }
    return readReplies(running, generation);
  });
}

kj::Promise<void> PythonZygote::awaitPid(Pending forked) {
  auto line = io_.lowLevelProvider->wrapSocketFd(kj::mv(forked.agentEnd));
  auto pid = kj::heapArray<kj::byte>(4);
  auto read = line->tryRead(pid.begin(), pid.size(), pid.size());
  auto timeout = io_.provider->getTimer().afterDelay(options_.replyTimeout).then([]() -> size_t { return 0; });
  return read.exclusiveJoin(kj::mv(timeout))
      .then([line = kj::mv(line), pid = kj::mv(pid), fulfiller = kj::mv(forked.fulfiller)](size_t got) mutable {
        pid_t worker = 0;
        for (int i = 0; i < 4; ++i) worker |= static_cast<pid_t>(static_cast<uint32_t>(pid[i]) << (8 * i));
        if (got != pid.size() || worker <= 0) {
          fulfiller->reject(KJ_EXCEPTION(FAILED, "the Python zygote's middle process did not name the worker it "
                                                 "forked in time"));
          return;
        }
        fulfiller->fulfill(ForkedWorker(worker, kj::mv(line)));
      });
}

void PythonZygote::fail(uint64_t generation, std::string why) {
  if (generation != generation_ || state_ == State::kDown) return;
  state_ = State::kDown;
  firstStart_ = false;
  whyDown_ = why;
  for (auto* pendings : {&sent_, &queue_}) {
    for (auto& pending : *pendings) {
      pending.fulfiller->reject(KJ_EXCEPTION(DISCONNECTED, "the Python zygote failed: " + why));
    }
    pendings->clear();
  }
  if (!running_) {
    // It never ran (it could not be spawned): no exit will come to restart it.
    logFailure(failures_, fmt::format("cannot start the Python zygote: {}; Python workers start as new processes "
                                      "until it runs", why));
    exited(generation, 0, 0);
    return;
  }
  if (*running_->unreaped != nullptr) ::kill(running_->pid, SIGKILL);
  // Its I/O is torn down from a later turn: this may run inside one of its tasks.
  tasks_->add(kj::evalLater([running = kj::mv(running_)]() mutable { running = nullptr; }));
}

void PythonZygote::exited(uint64_t generation, pid_t pid, int status) {
  if (generation != generation_) return;
  if (pid != 0) {
    bool running = state_ != State::kDown;  // else it failed first (and was killed): say why
    fail(generation, describeExit(status));
    logFailure(failures_, fmt::format("the Python zygote (pid {}) ended with {}{}; restarting it, Python workers "
                                      "start as new processes meanwhile",
                                      pid, describeExit(status), running ? "" : " after " + whyDown_));
  }
  // Back-off: 0.1 s, doubling to 30 s while starts keep failing.
  auto delay = std::min<int64_t>(100ll << std::min(failures_, 9), 30000) * kj::MILLISECONDS;
  ++failures_;
  tasks_->add(io_.provider->getTimer().afterDelay(delay).then([this, generation]() {
    if (generation == generation_ && state_ == State::kDown) start();
  }));
}

}  // namespace troupe
