// Configuration shared by the CLI and the daemons: addresses, the run directory and its
// cluster file, environment overrides. Thread-safety: plain functions and value types.
#pragma once

#include <sys/types.h>

#include <string>

#include "troupe/runtime/clock.h"  // wallClockMs(), which most readers of the config use too
#include "troupe/runtime/status.h"

namespace troupe {

struct HostPort {
  std::string host;
  int port = 0;
  std::string toString() const;
};

// Parses "HOST:PORT" (port 1..65535). kInvalidArgument with the offending text otherwise.
Result<HostPort> parseHostPort(const std::string& text);

// Root of all run directories: $TROUPE_TEMP_DIR, else /tmp/troupe-<euid> (one per user).
std::string runRoot();

// The one owner-and-mode check for the run root, run directories and cluster files (the Python
// package calls it through troupe._core): `path` itself (not followed if a link) must be of
// `kind`, owned by the effective user, with none of the `forbidden` mode bits.
// kFailedPrecondition saying what is wrong and what to do; kNotFound when it does not exist.
enum class PathKind { kDirectory, kRegularFile };
Status checkPrivate(const std::string& path, PathKind kind, mode_t forbidden);

// The newest run directory (`root`/latest, root defaulting to runRoot()), if any.
// kFailedPrecondition when the root, the link or the run directory is not this user's own
// (see createRunDir); kNotFound when there is none.
Result<std::string> latestRunDir();
Result<std::string> latestRunDir(const std::string& root);
// Creates runRoot()/run_<UTC time>_<pid> (0700) with logs/ and pids/. The run root is created
// 0700 if missing; an existing one must be a directory (not a link) owned by this user and not
// writable by group or others, else kFailedPrecondition: another user could read the token.
Result<std::string> createRunDir();
// Points runRoot()/latest at `runDir`: call once a start has succeeded, so a failed start
// never redirects later commands to a dead cluster.
Status markLatest(const std::string& runDir);

// What a client needs to reach a cluster; stored as <run_dir>/cluster.json, mode 0600.
struct ClusterFile {
  std::string controllerAddress;
  std::string token;
  std::string redisAddress;
  std::string redisPassword;
  std::string cluster = "default";
  bool embeddedRedis = false;
  bool tls = false;               // --tls: every RPC, gateway and collective connection speaks TLS
  int heartbeatTtlMs = 3000;      // the controller's, kept so a restart uses the same
};
Status writeClusterFile(const std::string& runDir, const ClusterFile& file);
// Reads <runDir>/cluster.json after checkPrivate on the directory (0700) and on the file (a
// regular file of ours, 0600, at most kMaxClusterFileBytes), opened without following links or
// blocking on a FIFO. kNotFound when missing, kFailedPrecondition when foreign, open or corrupt.
constexpr off_t kMaxClusterFileBytes = 64 * 1024;
Result<ClusterFile> readClusterFile(const std::string& runDir);

}  // namespace troupe
