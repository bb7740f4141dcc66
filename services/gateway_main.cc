// troupe-gateway: the head's store gateway daemon (store_gateway.h), started by
// `troupe start --head` next to Redis. A process of its own, so that neither a controller
// restart nor the loss of the head's node agent cuts other nodes off the store.
#include <CLI/CLI.hpp>

#include "daemon.h"
#include "head_supervisor.h"
#include "troupe/runtime/store_gateway.h"
#include "troupe/runtime/logging.h"

int main(int argc, char** argv) {
  using namespace troupe;
  CLI::App app{"Troupe store gateway (started by `troupe start --head`)"};
  std::string runDir, host = "127.0.0.1", logLevelName = "info";
  int port = 0;
  app.add_option("--run-dir", runDir, "Run directory holding cluster.json")->required();
  app.add_option("--host", host, "Address to bind: the head node's address");
  app.add_option("--port", port, "Port to bind (0: a free one)")->check(CLI::Range(0, 65535));
  app.add_option("--log-level", logLevelName)->envname("TROUPE_LOG_LEVEL");
  CLI11_PARSE(app, argc, argv);
  setLogLevel(parseLogLevel(logLevelName));

  DaemonFiles files(runDir, "gateway");
  auto head = headRedis(runDir);
  if (!head.isOk()) {
    TROUPE_LOG(kError, "{}", head.status().message());
    return 1;
  }
  const auto& [redis, token] = *head;

  captureStopSignals();
  auto io = kj::setupAsyncIo();
  auto gateway = StoreGateway::listen(io, HostPort{host, port}, token, redis);
  if (!gateway.isOk()) {
    TROUPE_LOG(kError, "{}", gateway.status().message());
    return 1;
  }
  // Advertised only once listening, so the address in Redis always answers.
  std::string address = HostPort{host, (*gateway)->port()}.toString();
  auto store = connectRedisStore(redis);
  Status put = store.isOk() ? (*store)->putStoreGateway(address) : store.status();
  if (!put.isOk()) {
    TROUPE_LOG(kError, "cannot record the gateway's address: {}", put.message());
    return 1;
  }
  store->reset();  // one connection per relayed client from here on
  files.markReady();
  TROUPE_LOG(kInfo, "store gateway listening on {}, relaying to Redis at {}:{}", address, redis.host, redis.port);
  // A second supervisor of the head's daemons, beside the head's agent: either may die and the
  // other starts it again (and the rest). Both take the run directory's replace lock per round.
  kj::Promise<void> supervision = supervisor::superviseHeadDaemons(io, runDir, 200 * kj::MILLISECONDS)
                                      .eagerlyEvaluate([](kj::Exception&& e) {
                                        TROUPE_LOG(kError, "supervision ended: {}", e.getDescription().cStr());
                                      });
  std::string why = onStopSignal(io).wait(io.waitScope);
  TROUPE_LOG(kInfo, "stopping on {}", why);
  return 0;
}
