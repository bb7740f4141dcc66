// troupe: start, join, inspect and stop a Troupe cluster.
#include <CLI/CLI.hpp>
#include <iostream>

#include "cli.h"
#include "troupe/runtime/logging.h"

namespace {
// --token and --token-file for a command; TROUPE_TOKEN fills --token from the environment.
void addTokenOptions(CLI::App* cmd, std::string& token, std::string& tokenFile) {
  cmd->add_option("--token", token, "Cluster token (visible to every local user in ps: prefer --token-file or "
                                    "TROUPE_TOKEN)")
      ->envname("TROUPE_TOKEN");
  cmd->add_option("--token-file", tokenFile, "File holding the cluster token (the head's <run_dir>/token, 0600)");
}

// Reads --token-file into `token`; says once that a token in argv is visible to others.
bool settleToken(int argc, char** argv, std::string& token, const std::string& tokenFile) {
  for (int i = 1; i < argc; ++i) {
    std::string_view a(argv[i]);
    if (a == "--token" || a.rfind("--token=", 0) == 0) {
      std::cerr << "troupe: warning: a token given with --token is visible to every local user (ps) for this "
                   "process's life; use --token-file FILE or TROUPE_TOKEN instead"
                << std::endl;
      break;
    }
  }
  if (tokenFile.empty()) return true;
  auto read = troupe::cli::readTokenFile(tokenFile);
  if (!read.isOk()) {
    troupe::cli::fail(read.status());
    return false;
  }
  token = *read;
  return true;
}
}  // namespace

int main(int argc, char** argv) {
  using namespace troupe::cli;
  // Jobs (python/troupe/job.py) and timelines (timeline.py) are Python, which parses its own flags.
  if (argc >= 2 && std::string(argv[1]) == "job") return pythonCommand("job", argc, argv, 2);
  if (argc >= 2 && std::string(argv[1]) == "timeline") return pythonCommand("timeline", argc, argv, 2);
  CLI::App app{"Troupe: an actor runtime for elastic distributed training"};
  app.require_subcommand(1);

  StartFlags start;
  auto* startCmd = app.add_subcommand("start", "Start a head node (--head) or join a cluster (--address)");
  startCmd->add_flag("--head", start.head, "Start a new cluster with this machine as its head");
  startCmd->add_option("--address", start.address, "Join the cluster whose controller is at HOST:PORT");
  std::string startTokenFile, statusTokenFile, logsTokenFile;
  addTokenOptions(startCmd, start.token, startTokenFile);
  startCmd->add_option("--port", start.port, "Controller RPC port (head)")->check(CLI::Range(1, 65535));
  startCmd->add_option("--dashboard-port", start.dashboardPort,
                       "Dashboard and /metrics port on 127.0.0.1 (head; default 8265, a free one if taken)")
      ->check(CLI::Range(1, 65535));
  startCmd->add_option("--redis-address", start.redisAddress, "Use this Redis (HOST:PORT) instead of an embedded one");
  startCmd->add_option("--redis-password", start.redisPassword, "Password of --redis-address")
      ->envname("TROUPE_REDIS_PASSWORD");
  startCmd->add_option("--cluster-name", start.clusterName, "Key prefix of this cluster in Redis");
  startCmd->add_option("--num-cpus", start.numCpus, "CPUs this node offers (default: detected)")
      ->check(CLI::NonNegativeNumber);
  startCmd->add_option("--resources", start.resources, "Custom resources NAME=QTY,...");
  startCmd->add_option("--object-store-memory", start.objectStoreMemory,
                       "Bytes of shared memory this node's objects may use before they spill to disk (default: 30% "
                       "of RAM)");
  startCmd->add_option("--node-ip-address", start.nodeIp, "Address this machine's servers bind and advertise (default: 127.0.0.1 on a head; when joining, this machine's address on the route to the head)");
  startCmd->add_option("--heartbeat-ttl-ms", start.heartbeatTtlMs, "A node silent this long is dead (head)")
      ->check(CLI::Range(300, 600000));
  startCmd->add_flag("--tls", start.tls,
                     "Head: encrypt every connection of the cluster (TLS keyed by the cluster token); joining "
                     "nodes and drivers learn it from the cluster");
  startCmd->add_flag("--block", start.block, "Stay in the foreground; Ctrl-C stops what was started");
  startCmd->add_option("--watch-pid", start.watchPid, "With --block: stop when this process exits (embedded clusters)")
      ->group("");

  StatusFlags status;
  auto* statusCmd = app.add_subcommand("status", "Show nodes, actors and groups");
  statusCmd->add_option("--address", status.address, "Controller HOST:PORT (default: this machine's cluster)");
  addTokenOptions(statusCmd, status.token, statusTokenFile);
  statusCmd->add_flag("--json", status.json, "Print one JSON object");
  statusCmd->add_option("--limit", status.limit, "Actors to show, oldest first (0: all)")->capture_default_str();
  statusCmd->add_option("--offset", status.offset, "Actors to skip before the first shown");
  statusCmd->add_option("--state", status.state, "Only actors in this state")
      ->check(CLI::IsMember({"PENDING", "ALIVE", "RESTARTING", "DEAD"}, CLI::ignore_case));
  statusCmd->add_option("--node", status.node, "Only actors on nodes whose id starts with this");

  auto* stopCmd = app.add_subcommand("stop", "Stop every Troupe process this machine started");
  std::string logsActor, logsAddress, logsToken;
  size_t logsBytes = 64 * 1024;
  auto* logsCmd = app.add_subcommand("logs", "Print an actor's captured stdout and stderr");
  logsCmd->add_option("actor", logsActor, "Actor id, id prefix, NAMESPACE/NAME, or a NAME only one namespace has")->required();
  logsCmd->add_option("--address", logsAddress, "Controller HOST:PORT (default: this machine's cluster)");
  addTokenOptions(logsCmd, logsToken, logsTokenFile);
  logsCmd->add_option("--bytes", logsBytes, "At most this much from the end of each stream");
  app.add_subcommand("job", "Run driver scripts on the cluster: job submit|list|status|logs|stop (see job --help)");
  app.add_subcommand("timeline", "Write a training group's recent steps as a Chrome trace: timeline [--group G] [-o FILE]");
  auto* dashboardCmd = app.add_subcommand("dashboard", "Print the dashboard's login URL (on the head, as its user)");
  auto* restartCmd = app.add_subcommand("restart-controller",
                                        "Restart this machine's controller; it recovers the cluster from Redis");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string what = e.what();
    std::replace(what.begin(), what.end(), '\n', ' ');
    std::cerr << "troupe: error: " << what << "; run 'troupe --help' for usage" << std::endl;
    return 2;
  }
  troupe::setLogLevel(troupe::LogLevel::kWarning);
  if (startCmd->parsed()) return settleToken(argc, argv, start.token, startTokenFile) ? startCommand(start) : 1;
  if (statusCmd->parsed()) return settleToken(argc, argv, status.token, statusTokenFile) ? statusCommand(status) : 1;
  if (stopCmd->parsed()) return stopCommand();
  if (logsCmd->parsed()) {
    if (!settleToken(argc, argv, logsToken, logsTokenFile)) return 1;
    return logsCommand(logsActor, logsAddress, logsToken, logsBytes);
  }
  if (dashboardCmd->parsed()) return dashboardCommand();
  if (restartCmd->parsed()) return restartControllerCommand();
  return 2;
}
