#include "bench_cluster.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include <fmt/format.h>

#include "troupe/runtime/config.h"
#include "troupe/runtime/ids.h"
#include "troupe/runtime/process.h"

namespace troupe::bench {
namespace {

std::string troupeBinary() {
  const char* dir = std::getenv("TROUPE_BIN_DIR");
  return fmt::format("{}/troupe", dir && *dir ? dir : (executableDir() + "/.."));
}

int runTroupe(const std::string& root, std::vector<std::string> args) {
  SpawnOptions o;
  o.argv = {troupeBinary()};
  o.argv.insert(o.argv.end(), args.begin(), args.end());
  o.outputPath = root + "/cli.log";
  o.env = {"TROUPE_TEMP_DIR=" + root};
  auto pid = spawnProcess(o);
  if (!pid.isOk()) return -1;
  ChildProcess child(*pid);
  auto exit = child.wait(std::chrono::seconds(60));
  return exit ? exit->exitCode : -1;
}

}  // namespace

BenchCluster::BenchCluster(int cpus) {
  root_ = fmt::format("/tmp/troupe-bench-{}-{}", getpid(), randomHex(4));
  std::filesystem::create_directories(root_);
  int port = *pickFreePort("127.0.0.1");
  if (runTroupe(root_, {"start", "--head", "--port", std::to_string(port), "--num-cpus", std::to_string(cpus)}) != 0) {
    fprintf(stderr, "bench: troupe start failed (see %s/cli.log)\n", root_.c_str());
    exit(1);
  }
  setenv("TROUPE_TEMP_DIR", root_.c_str(), 1);
  auto file = readClusterFile(*latestRunDir());
  controller_ = *parseHostPort(file->controllerAddress);
  token_ = file->token;
}

BenchCluster::~BenchCluster() {
  runTroupe(root_, {"stop"});
  std::error_code ec;
  std::filesystem::remove_all(root_, ec);
}

kj::Own<ClusterClient> BenchCluster::connect(kj::AsyncIoContext& io) const {
  return ClusterClient::connect(io, controller_, token_).wait(io.waitScope);
}

}  // namespace troupe::bench
