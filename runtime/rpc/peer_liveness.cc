// Socket options that bound how long a connection may hang on a peer that went silent (its host
// cut off or frozen): without them the kernel retransmits for ~15 minutes (tcp_retries2), and an
// idle connection waiting for an answer is never probed at all.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>

#include <kj/debug.h>

#include "troupe/runtime/rpc.h"

namespace troupe {

namespace {
std::chrono::milliseconds limitFrom(long ms) {
  return std::chrono::milliseconds(ms >= 300 && ms <= 600'000 ? ms : kDefaultHeartbeatTtlMs);
}

std::atomic<int64_t>& silenceLimitMs() {
  static std::atomic<int64_t> limit{[]() {
    const char* env = getenv("TROUPE_HEARTBEAT_TTL_MS");
    return static_cast<int64_t>(limitFrom(env != nullptr ? atol(env) : 0).count());
  }()};
  return limit;
}
}  // namespace

std::chrono::milliseconds peerSilenceLimit() { return std::chrono::milliseconds(silenceLimitMs().load()); }

void setPeerSilenceLimit(std::chrono::milliseconds ttl) { silenceLimitMs().store(limitFrom(ttl.count()).count()); }

void detectSilentPeer(kj::AsyncIoStream& stream) {
  auto limit = peerSilenceLimit();
  // TCP_USER_TIMEOUT ends the connection once sent data (or, with keepalive on, probes) stay
  // unacknowledged for `limit`. Keepalive probes an idle connection, which a caller waiting for
  // a reply has: the first probe after `limit` - 1 s of silence, then one a second, so the end
  // comes about `limit` after the peer's last packet. A live peer's kernel answers the probes
  // whatever its process does; an idle connection costs one small packet each way per
  // `limit` - 1 s.
  int userTimeoutMs = static_cast<int>(limit.count());
  int idleS = std::max<int>(1, static_cast<int>(limit.count() / 1000) - 1);
  int intervalS = 1;
  int probes = std::max<int>(1, static_cast<int>((limit.count() + 999) / 1000));
  int on = 1;
  KJ_IF_MAYBE(e, kj::runCatchingExceptions([&]() {
    stream.setsockopt(SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
    stream.setsockopt(IPPROTO_TCP, TCP_KEEPIDLE, &idleS, sizeof idleS);
    stream.setsockopt(IPPROTO_TCP, TCP_KEEPINTVL, &intervalS, sizeof intervalS);
    stream.setsockopt(IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof probes);
    stream.setsockopt(IPPROTO_TCP, TCP_USER_TIMEOUT, &userTimeoutMs, sizeof userTimeoutMs);
  })) {
    (void)e;  // not a TCP stream (tests may use pipes): nothing to tune
  }
}

}  // namespace troupe
