// troupe-controller: the head's controller daemon, started by `troupe start --head`.
#include <CLI/CLI.hpp>

#include "controller.h"
#include "daemon.h"
#include "troupe/runtime/logging.h"

int main(int argc, char** argv) {
  using namespace troupe;
  CLI::App app{"Troupe controller (started by `troupe start --head`)"};
  std::string runDir, host = "127.0.0.1", logLevelName = "info";
  int port = 6380, ttlMs = 3000;
  app.add_option("--run-dir", runDir, "Run directory holding cluster.json")->required();
  app.add_option("--host", host, "Address to bind");
  app.add_option("--port", port, "RPC port");
  app.add_option("--heartbeat-ttl-ms", ttlMs, "A node missing heartbeats this long is dead")->check(CLI::Range(300, 600000));
  app.add_option("--log-level", logLevelName)->envname("TROUPE_LOG_LEVEL");
  CLI11_PARSE(app, argc, argv);
  setLogLevel(parseLogLevel(logLevelName));

  DaemonFiles files(runDir, "controller");
  auto head = headRedis(runDir);
  if (!head.isOk()) {
    TROUPE_LOG(kError, "{}", head.status().message());
    return 1;
  }
  ControllerOptions options;
  options.bind = HostPort{host, port};
  std::tie(options.redis, options.token) = *head;
  options.heartbeatTtl = std::chrono::milliseconds(ttlMs);

  captureStopSignals();
  auto io = kj::setupAsyncIo();
  IoThread ioThread;
  auto controller = Controller::start(io, ioThread, options);
  if (!controller.isOk()) {
    TROUPE_LOG(kError, "{}", controller.status().message());
    return 1;
  }
  std::string why = onStopSignal(io).wait(io.waitScope);
  TROUPE_LOG(kInfo, "stopping on {}", why);
  return 0;
}
