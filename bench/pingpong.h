// The floor every call pays: a TCP ping-pong between two processes on loopback (64 bytes, or a
// payload of any size for the bandwidth floor). Shared by the RPC and actor benchmarks, which
// print their rates against it.
#pragma once

#include <string>

namespace troupe::bench {

// If argv asks for the echo server (`--serve-tcp PORT BYTES [--poll]`), runs it and returns true.
bool maybeServeTcp(int argc, char** argv, int* exitCode);
// Spawns `argv0 --serve-tcp PORT BYTES` and measures `rounds` round trips of `bytes` each way;
// returns microseconds each. `poll`: both sides poll the socket instead of sleeping in recv (no
// wake-ups), the floor of a connection that spins.
double tcpRoundTripUs(const char* argv0, int rounds, size_t bytes = 64, bool poll = false);

}  // namespace troupe::bench
