// Configuration shared by the CLI and the daemons: addresses, the run directory and its
// cluster file, environment overrides. Thread-safety: plain functions and value types.
#pragma once

#include <string>

#include "troupe/runtime/status.h"

namespace troupe {

struct HostPort {
  std::string host;
  int port = 0;
  std::string toString() const;
};

// Parses "HOST:PORT" (port 1..65535). kInvalidArgument with the offending text otherwise.
Result<HostPort> parseHostPort(const std::string& text);

// Root of all run directories: $TROUPE_TEMP_DIR, else /tmp/troupe.
std::string runRoot();
// The newest run directory (runRoot()/latest), if any. kFailedPrecondition when the run root
// or the link is not this user's own (see createRunDir).
Result<std::string> latestRunDir();
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
Result<ClusterFile> readClusterFile(const std::string& runDir);

// Milliseconds since the Unix epoch (wall clock, for records shown to people).
int64_t wallClockMs();

}  // namespace troupe
