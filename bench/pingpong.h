// The floor every call pays: a 64-byte TCP ping-pong between two processes on loopback.
// Shared by the RPC and actor benchmarks, which print their rates against it.
#pragma once

#include <string>

namespace troupe::bench {

// If argv asks for the echo server (`--serve-tcp PORT`), runs it and returns true.
bool maybeServeTcp(int argc, char** argv, int* exitCode);
// Spawns `argv0 --serve-tcp PORT` and measures `rounds` round trips; returns microseconds each.
double tcpRoundTripUs(const char* argv0, int rounds);

}  // namespace troupe::bench
