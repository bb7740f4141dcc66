// The `troupe` command line: one function per subcommand, each returning the process exit
// code after printing either its result or one line "troupe: error: ..." to stderr.
// Internal to the CLI; runs on the main thread with its own KJ event loop per command.
#pragma once

#include <string>
#include <vector>

#include <kj/async-io.h>

#include "troupe.capnp.h"
#include "troupe/runtime/cluster_store.h"
#include "troupe/runtime/config.h"
#include "troupe/runtime/status.h"

namespace troupe::cli {

struct StartFlags {
  bool head = false;
  std::string address;          // --address: join this controller
  std::string token;            // --token / TROUPE_TOKEN
  int port = 6380;
  int dashboardPort = 8265;  // tried first; a free port if it is taken
  std::string redisAddress;     // --redis-address: use this Redis instead of an embedded one
  std::string redisPassword;    // --redis-password / TROUPE_REDIS_PASSWORD
  std::string clusterName = "default";
  double numCpus = -1;
  std::string resources;
  uint64_t objectStoreMemory = 0;  // --object-store-memory (0: 30% of RAM)
  std::string nodeIp;           // "": loopback on a head, the route to the head when joining
  int heartbeatTtlMs = 3000;
  bool block = false;
  bool tls = false;             // --tls (head): encrypt RPC, the store gateway and collectives
  int watchPid = 0;             // --block: stop everything once this process is gone
};

struct StatusFlags {
  std::string address;
  std::string token;
  bool json = false;
  uint32_t limit = 1000;  // actors shown (0: all)
  uint32_t offset = 0;
  std::string state;      // only actors in this state
  std::string node;       // only actors on nodes whose id starts with this
};

int startCommand(const StartFlags& flags);
int statusCommand(const StatusFlags& flags);
int stopCommand();
// `troupe job ARGS`, `troupe timeline ARGS`: runs `python3 -m troupe.<module> ARGS` (argv[first..];
// exec: returns only on failure).
int pythonCommand(const std::string& module, int argc, char** argv, int first);
// Prints an actor's captured stdout and stderr (by id, id prefix or name), fetched from its node.
int logsCommand(const std::string& actor, const std::string& address, const std::string& token, size_t maxBytes);
int restartControllerCommand();
// Prints the dashboard's login URL (and where Prometheus's credentials are) from this machine's
// newest run directory; an error if no dashboard runs there.
int dashboardCommand();
// The login URL the dashboard wrote to runDir/dashboard.login, or "" if none.
std::string dashboardLoginUrl(const std::string& runDir);

// Prints "troupe: error: <message>" and returns 1 (2 for bad usage).
int fail(const Status& status);

// Where a command finds the cluster: explicit flags first, then the newest run directory.
struct ClusterTarget {
  HostPort controller;
  std::string token;
  std::string runDir;  // empty when the cluster was named only by flags
};
Result<ClusterTarget> resolveCluster(const std::string& address, const std::string& token);
// The cluster token kept in `path` (what `troupe start --head` writes as <run_dir>/token): a
// regular file of this user's, 0600, at most 4 KiB; surrounding whitespace dropped.
// kFailedPrecondition saying what is wrong, kNotFound when missing.
Result<std::string> readTokenFile(const std::string& path);

// Everything Controller.status returns.
struct ClusterSnapshot {
  std::vector<NodeRecord> nodes;
  std::vector<ActorRecord> actors;            // all, or the page asked for
  uint64_t actorsMatching = 0;                // actors that pass the filters
  std::map<std::string, uint64_t> actorCounts;  // every actor, by state name
  std::vector<PlacementGroupRecord> placementGroups;
  std::vector<ElasticGroupRecord> groups;
};
// Which actors a status call returns: none, all (limit 0), or one filtered page.
struct StatusQuery {
  bool actors = true;
  uint32_t limit = 0;
  uint32_t offset = 0;
  std::string state;
  std::string node;
};
// Calls Controller.status on an authenticated connection, within `timeout`.
Result<ClusterSnapshot> fetchStatus(kj::AsyncIoContext& io, const ClusterTarget& target, kj::Duration timeout,
                                    const StatusQuery& query = {});
Result<std::vector<NodeRecord>> fetchNodes(kj::AsyncIoContext& io, const ClusterTarget& target,
                                           kj::Duration timeout);

// The last `lines` lines of a log file, for error messages about a daemon that died.
std::string logTail(const std::string& path, int lines);

}  // namespace troupe::cli

namespace troupe::cli {

// Stops the daemons listed in <runDir>/pids (node agents, then the controller, then Redis):
// SIGTERM, then SIGKILL after a grace period. Only processes whose command line names this run
// directory are signalled, so a recycled pid is never hit. Returns how many were stopped.
int stopRunDir(const std::string& runDir, bool verbose);

// Polls `ready` until it returns true. Fails early with kAborted on a pending SIGINT/SIGTERM,
// with the log's last lines if process `pid` exits, and with kDeadlineExceeded after `limit`.
template <typename Ready>
Status waitReady(const std::string& what, pid_t pid, const std::string& logPath,
                 std::chrono::milliseconds limit, Ready ready);

// The path of a sibling executable (troupe-controller, troupe-node): $TROUPE_BIN_DIR, else the
// directory of the running `troupe`.
std::string siblingExecutable(const std::string& name);

}  // namespace troupe::cli

#include <signal.h>

#include <thread>

#include <fmt/format.h>

#include "troupe/runtime/process.h"

template <typename Ready>
troupe::Status troupe::cli::waitReady(const std::string& what, pid_t pid, const std::string& logPath,
                                      std::chrono::milliseconds limit, Ready ready) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  auto pause = std::chrono::milliseconds(10);
  for (;;) {
    if (ready()) return Status::ok();
    sigset_t pending;
    sigpending(&pending);
    if (sigismember(&pending, SIGINT) || sigismember(&pending, SIGTERM)) {
      return Status(StatusCode::kAborted, fmt::format("interrupted while waiting for {}", what));
    }
    if (pid > 0 && !processAlive(pid)) {
      return Status(StatusCode::kUnavailable,
                    fmt::format("{} exited during start-up: {} (log: {})", what, logTail(logPath, 3), logPath));
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return Status(StatusCode::kDeadlineExceeded,
                    fmt::format("{} did not become ready within {} s (log: {})", what, limit.count() / 1000, logPath));
    }
    std::this_thread::sleep_for(pause);  // polling a condition with a deadline, backing off
    pause = std::min(pause * 2, std::chrono::milliseconds(200));
  }
}
