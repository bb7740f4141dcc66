// PythonZygote against the real python/troupe/_zygote.py (from $TROUPE_BIN_DIR/python): forked
// workers are this process's children, run only once started, and survive a kill of the zygote,
// which is restarted. A test binary of its own: it must be a child subreaper and capture SIGCHLD
// before any thread exists, which other suites' processes must not inherit.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>

#include <kj/async-unix.h>

#include "python_zygote.h"

namespace troupe {
namespace {

namespace fs = std::filesystem;

std::string readFile(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

struct ZygoteFixture {
  ZygoteFixture() {
    const char* bin = std::getenv("TROUPE_BIN_DIR");
    pythonPath = fs::path(bin ? bin : ".") / "python";
    for (const auto& entry : fs::directory_iterator(pythonPath / "troupe", ec)) {
      if (entry.path().filename().string().rfind("_core", 0) == 0) haveCore = true;
    }
    char pattern[] = "/tmp/troupe-zygote-test-XXXXXX";
    root = ::mkdtemp(pattern);
    fs::create_directories(root / "logs");
    ZygoteOptions options;
    options.env = {"PYTHONPATH=" + pythonPath.string(), "PYTHONUNBUFFERED=1"};
    options.logDir = (root / "logs").string();
    zygote = kj::heap<PythonZygote>(io, options);
  }
  ~ZygoteFixture() {
    zygote = nullptr;
    fs::remove_all(root, ec);
  }

  // Runs the event loop until `done()` holds or `seconds` pass; whether it held.
  bool waitUntil(const std::function<bool()>& done, int seconds) {
    auto deadline = io.provider->getTimer().now() + seconds * kj::SECONDS;
    while (!done()) {
      if (io.provider->getTimer().now() >= deadline) return false;
      io.provider->getTimer().afterDelay(10 * kj::MILLISECONDS).wait(io.waitScope);
    }
    return true;
  }

  SpawnOptions files(const std::string& name) {
    SpawnOptions spawn;
    spawn.outputPath = (root / "logs" / (name + ".out")).string();
    spawn.errorPath = (root / "logs" / (name + ".err")).string();
    spawn.env = {"ZYGOTE_TEST=1"};
    return spawn;
  }

  // Forks a worker whose arguments the worker refuses (argparse: exit code 2, usage on stderr).
  ForkedWorker forkRefused(const std::string& name) {
    return zygote->fork({"--no-such-flag"}, files(name)).wait(io.waitScope);
  }

  std::error_code ec;
  fs::path pythonPath;
  fs::path root;
  bool haveCore = false;
  kj::AsyncIoContext io = kj::setupAsyncIo();
  kj::Own<PythonZygote> zygote;
};

TEST_CASE_FIXTURE(ZygoteFixture, "a forked worker runs only once started, as `python -m troupe._worker` would") {
  if (!haveCore) {
    MESSAGE("troupe._core is not built: skipped");
    return;
  }
  auto worker = forkRefused("w");
  pid_t pid = worker.pid();
  CHECK(pid != zygote->pid());
  kj::Maybe<pid_t> watched = pid;
  auto exit = io.unixEventPort.onChildExit(watched);  // our child: the zygote's middle process has ended
  // Waiting for its start, it has written nothing.
  CHECK(::kill(pid, 0) == 0);
  CHECK(readFile(root / "logs" / "w.err").empty());
  REQUIRE(worker.start());
  int status = exit.wait(io.waitScope);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 2);
  auto err = readFile(root / "logs" / "w.err");
  CHECK(err.find("usage: troupe._worker") != std::string::npos);
  CHECK(err.find("arguments are required") != std::string::npos);
  CHECK(readFile(root / "logs" / "python-zygote.err").find("usage") == std::string::npos);
}

TEST_CASE_FIXTURE(ZygoteFixture, "forks requested together are answered in order, each with its own worker") {
  if (!haveCore) return;
  constexpr int kWorkers = 12;
  auto forks = kj::heapArrayBuilder<kj::Promise<ForkedWorker>>(kWorkers);
  for (int i = 0; i < kWorkers; ++i) forks.add(zygote->fork({"--no-such-flag"}, files("many" + std::to_string(i))));
  auto workers = kj::joinPromises(forks.finish()).wait(io.waitScope);
  std::set<pid_t> pids;
  std::vector<kj::Maybe<pid_t>> watched(kWorkers);
  auto exits = kj::heapArrayBuilder<kj::Promise<int>>(kWorkers);
  for (int i = 0; i < kWorkers; ++i) {
    pids.insert(workers[i].pid());
    watched[i] = workers[i].pid();
    exits.add(io.unixEventPort.onChildExit(watched[i]));
    REQUIRE(workers[i].start());
  }
  CHECK(pids.size() == kWorkers);
  for (int status : kj::joinPromises(exits.finish()).wait(io.waitScope)) {
    CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 2));
  }
  // Each wrote its own file, and only that one.
  for (int i = 0; i < kWorkers; ++i) {
    auto err = readFile(root / "logs" / ("many" + std::to_string(i) + ".err"));
    auto first = err.find("usage: troupe._worker");
    CHECK(first != std::string::npos);
    CHECK(err.find("usage: troupe._worker", first + 1) == std::string::npos);
  }
}

TEST_CASE_FIXTURE(ZygoteFixture, "a worker that is never started leaves without a trace") {
  if (!haveCore) return;
  pid_t pid = 0;
  kj::Maybe<pid_t> watched;
  kj::Promise<int> exit = nullptr;
  {
    auto worker = forkRefused("dropped");
    pid = worker.pid();
    watched = pid;
    exit = io.unixEventPort.onChildExit(watched);
  }  // dropped: its start line closes
  int status = exit.wait(io.waitScope);
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  CHECK(readFile(root / "logs" / "dropped.err").empty());
  CHECK(readFile(root / "logs" / "dropped.out").empty());
}

TEST_CASE_FIXTURE(ZygoteFixture, "a killed zygote leaves its workers running and is restarted") {
  if (!haveCore) return;
  auto worker = forkRefused("survivor");
  kj::Maybe<pid_t> watched = worker.pid();
  auto exit = io.unixEventPort.onChildExit(watched);
  pid_t first = zygote->pid();
  REQUIRE(first > 0);
  REQUIRE(::kill(first, SIGKILL) == 0);
  REQUIRE(waitUntil([&]() { return !zygote->accepting(); }, 10));
  // Meanwhile forks are refused at once (the agent spawns the worker itself).
  auto refused = zygote->fork({"--no-such-flag"}, files("refused")).then([](ForkedWorker) { return false; },
                                                                         [](kj::Exception&&) { return true; });
  CHECK(refused.wait(io.waitScope));
  // The worker forked before the kill still runs, and its exit still comes here.
  CHECK(::kill(worker.pid(), 0) == 0);
  REQUIRE(worker.start());
  int status = exit.wait(io.waitScope);
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 2));
  // A new zygote forks the next ones.
  REQUIRE(waitUntil([&]() { return zygote->accepting() && zygote->pid() != 0 && zygote->pid() != first; }, 60));
  auto next = forkRefused("next");
  kj::Maybe<pid_t> nextWatched = next.pid();
  auto nextExit = io.unixEventPort.onChildExit(nextWatched);
  REQUIRE(next.start());
  status = nextExit.wait(io.waitScope);
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 2));
}

TEST_CASE_FIXTURE(ZygoteFixture, "requests the zygote cannot honour are refused, and it goes on") {
  if (!haveCore) return;
  SpawnOptions outside = files("x");
  outside.outputPath = (root / "elsewhere.out").string();
  auto refused = zygote->fork({"--no-such-flag"}, outside).then(
      [](ForkedWorker) { return std::string(); }, [](kj::Exception&& e) { return std::string(e.getDescription().cStr()); });
  CHECK(refused.wait(io.waitScope).find("outside") != std::string::npos);
  CHECK(!fs::exists(root / "elsewhere.out"));
  // A variable Python reads when it starts cannot be given to a forked interpreter.
  SpawnOptions seeded = files("seeded");
  seeded.env.push_back("PYTHONHASHSEED=7");
  auto unseeded = zygote->fork({"--no-such-flag"}, seeded).then(
      [](ForkedWorker) { return std::string(); }, [](kj::Exception&& e) { return std::string(e.getDescription().cStr()); });
  CHECK(unseeded.wait(io.waitScope).find("PYTHONHASHSEED") != std::string::npos);
  auto worker = forkRefused("after");
  kj::Maybe<pid_t> watched = worker.pid();
  auto exit = io.unixEventPort.onChildExit(watched);
  REQUIRE(worker.start());
  int status = exit.wait(io.waitScope);
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 2));
}

}  // namespace
}  // namespace troupe

int main(int argc, char** argv) {
  kj::UnixEventPort::captureChildExit();
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);
  doctest::Context context(argc, argv);
  return context.run();
}
