// A local cluster for benchmarks, started and stopped with the real `troupe` CLI in a private
// run root, so a benchmark measures exactly what users run.
#pragma once

#include <string>

#include <kj/async-io.h>

#include "troupe/runtime/client.h"

namespace troupe::bench {

class BenchCluster {
 public:
  // Starts a head offering `cpus` logical CPUs; aborts the benchmark with a message on failure.
  explicit BenchCluster(int cpus);
  ~BenchCluster();  // troupe stop

  const HostPort& controller() const { return controller_; }
  const std::string& token() const { return token_; }
  kj::Own<ClusterClient> connect(kj::AsyncIoContext& io) const;

 private:
  std::string root_;
  HostPort controller_;
  std::string token_;
};

}  // namespace troupe::bench
