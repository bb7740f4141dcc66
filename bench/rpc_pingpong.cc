// bench/run rpc: the cost of one control-plane call. A Troupe RPC (token-authenticated Cap'n
// Proto over loopback TCP, to another process) against the peer every call pays at least: a raw
// 64-byte TCP ping-pong between two processes. Sync calls show latency; pipelined calls (many
// in flight) show what batching buys on a machine where each round trip costs ~240 us.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include <fmt/format.h>

#include "pingpong.h"
#include "troupe.capnp.h"
#include "troupe/runtime/process.h"
#include "troupe/runtime/clock.h"
#include "troupe/runtime/rpc.h"

namespace {

using troupe::Clock;
constexpr const char* kToken = "bench-token";

class PingService final : public troupe::rpc::NodeAgent::Server {
 protected:
  kj::Promise<void> ping(PingContext context) override {
    context.getResults().setPid(getpid());
    return kj::READY_NOW;
  }
};

int serveRpc(int port) {
  auto io = kj::setupAsyncIo();
  auto server = troupe::RpcServer::listen(io, troupe::HostPort{"127.0.0.1", port}, kToken,
                                          troupe::rpc::NodeAgent::Client(kj::heap<PingService>()));
  if (!server.isOk()) return 1;
  kj::NEVER_DONE.wait(io.waitScope);
}

troupe::ChildProcess spawnSelf(const char* argv0, const char* mode, int port) {
  troupe::SpawnOptions o;
  o.argv = {argv0, mode, std::to_string(port)};
  return troupe::ChildProcess(*troupe::spawnProcess(o));
}

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--serve-rpc") return serveRpc(std::stoi(argv[2]));
  int rc = 0;
  if (troupe::bench::maybeServeTcp(argc, argv, &rc)) return rc;
  bool json = argc > 1 && std::string(argv[1]) == "--json";
  signal(SIGPIPE, SIG_IGN);
  const int kSync = 3000, kPipelined = 20000, kWindow = 256;

  // Peer: raw 64-byte ping-pong between two processes.
  double tcpRttUs = troupe::bench::tcpRoundTripUs(argv[0], kSync);

  // Troupe RPC to another process.
  int rpcPort = *troupe::pickFreePort("127.0.0.1");
  auto rpcServer = spawnSelf(argv[0], "--serve-rpc", rpcPort);
  auto io = kj::setupAsyncIo();
  kj::Own<troupe::RpcClient> client;
  auto deadline = Clock::now() + std::chrono::seconds(10);
  while (!client) {
    KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
      client = troupe::RpcClient::connect(io, troupe::HostPort{"127.0.0.1", rpcPort}, kToken, 2 * kj::SECONDS)
                   .wait(io.waitScope);
    })) {
      if (Clock::now() > deadline) {
        fprintf(stderr, "bench: %s\n", e->getDescription().cStr());
        return 1;
      }
      usleep(10000);
    }
  }
  auto cap = client->bootstrap<troupe::rpc::NodeAgent>();
  for (int i = 0; i < 200; ++i) cap.pingRequest().send().wait(io.waitScope);
  auto t0 = Clock::now();
  for (int i = 0; i < kSync; ++i) cap.pingRequest().send().wait(io.waitScope);
  double rpcRttUs = seconds(Clock::now() - t0) / kSync * 1e6;

  t0 = Clock::now();
  for (int sent = 0; sent < kPipelined; sent += kWindow) {
    auto calls = kj::heapArrayBuilder<kj::Promise<void>>(kWindow);
    for (int i = 0; i < kWindow; ++i) calls.add(cap.pingRequest().send().ignoreResult());
    kj::joinPromises(calls.finish()).wait(io.waitScope);
  }
  double pipelinedPerS = kPipelined / seconds(Clock::now() - t0);

  printf("%-40s %12s\n", "measure", "value");
  printf("%-40s %10.1f us\n", "raw TCP 64 B round trip (peer)", tcpRttUs);
  printf("%-40s %10.1f us\n", "Troupe RPC sync call round trip", rpcRttUs);
  printf("%-40s %12.2f\n", "RPC / TCP round-trip ratio", rpcRttUs / tcpRttUs);
  printf("%-40s %10.0f /s\n", "Troupe RPC sync calls", 1e6 / rpcRttUs);
  printf("%-40s %10.0f /s\n", fmt::format("Troupe RPC pipelined calls ({} in flight)", kWindow).c_str(), pipelinedPerS);
  if (json) {
    printf("{\"tcp_rtt_us\": %.2f, \"rpc_rtt_us\": %.2f, \"rpc_to_tcp_ratio\": %.3f, \"rpc_sync_calls_per_s\": %.0f, "
           "\"rpc_pipelined_calls_per_s\": %.0f}\n",
           tcpRttUs, rpcRttUs, rpcRttUs / tcpRttUs, 1e6 / rpcRttUs, pipelinedPerS);
  }
  return 0;
}
