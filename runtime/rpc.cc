#include "troupe/runtime/rpc.h"

#include <netinet/in.h>
#include <netinet/tcp.h>

#include <cstring>
#include <memory>

#include <capnp/rpc.h>
#include <kj/debug.h>

#include <fmt/format.h>

#include "handshake.h"
#include "troupe/runtime/logging.h"

namespace troupe {
namespace {


class RpcServerImpl final : public RpcServer {
 public:
  RpcServerImpl(kj::AsyncIoContext& io, kj::Own<kj::ConnectionReceiver> listener, std::string token,
                capnp::Capability::Client bootstrap)
      : twoParty_(kj::mv(bootstrap)),
        acceptor_(io, kj::mv(listener), kj::mv(token), handshake::Purpose::kRpc, "RPC server",
                  [this](kj::Own<kj::AsyncIoStream> stream) {
                    twoParty_.accept(kj::mv(stream));
                    return kj::READY_NOW;
                  }) {}

  int port() const override { return acceptor_.port(); }
  uint64_t refusedConnections() const override { return acceptor_.refused(); }

 private:
  capnp::TwoPartyServer twoParty_;  // owns the authenticated connections
  handshake::Acceptor acceptor_;
};

}  // namespace

Result<kj::Own<RpcServer>> RpcServer::listen(kj::AsyncIoContext& io, const HostPort& bind,
                                             std::string token, capnp::Capability::Client bootstrap) {
  auto listener = handshake::listen(io, bind);
  if (!listener.isOk()) return listener.status();
  kj::Own<RpcServer> server =
      kj::heap<RpcServerImpl>(io, kj::mv(*listener), kj::mv(token), kj::mv(bootstrap));
  return server;
}

RpcClient::RpcClient(kj::Own<kj::AsyncIoStream> stream)
    : stream_(kj::mv(stream)),
      client_(*stream_),
      bootstrap_(client_.bootstrap()),
      disconnected_(kj::heap<bool>(false)),
      watch_(client_.onDisconnect()
                 .then([flag = disconnected_.get()]() { *flag = true; },
                       [flag = disconnected_.get()](kj::Exception&&) { *flag = true; })
                 .eagerlyEvaluate(nullptr)) {}

namespace {

// One attempt: TCP, then TLS when `secure`, then the token handshake.
kj::Promise<kj::Own<kj::AsyncIoStream>> connectOnce(kj::AsyncIoContext& io, const HostPort& address,
                                                    std::shared_ptr<const std::string> token, bool secure) {
  return io.provider->getNetwork()
      .parseAddress(address.host, address.port)
      .then([](kj::Own<kj::NetworkAddress> addr) { return addr->connect().attach(kj::mv(addr)); })
      .then([token, secure](kj::Own<kj::AsyncIoStream> stream) {
        handshake::setNoDelay(*stream);
        auto streams = secure ? kj::heap<tls::Streams>(*token) : kj::Own<tls::Streams>();
        auto* tls = streams.get();
        return handshake::connectStream(kj::mv(stream), *token, handshake::Purpose::kRpc, tls)
            .then([streams = kj::mv(streams), token](kj::Own<kj::AsyncIoStream> ready) mutable {
              return ready.attach(kj::mv(streams));
            });
      });
}

}  // namespace

kj::Promise<kj::Own<RpcClient>> RpcClient::connect(kj::AsyncIoContext& io, const HostPort& address,
                                                  std::string token, kj::Duration timeout) {
  std::string where = address.toString();
  auto shared = std::make_shared<const std::string>(kj::mv(token));
  auto connected =
      connectOnce(io, address, shared, tls::required())
          .catch_([&io, address, shared](kj::Exception&& e) -> kj::Promise<kj::Own<kj::AsyncIoStream>> {
            // A --tls cluster said so (the handshake's only FAILED_PRECONDITION): speak TLS from
            // now on in this process.
            if (tls::required() || statusFromException(e, "").code() != StatusCode::kFailedPrecondition) {
              return kj::mv(e);
            }
            tls::require();
            return connectOnce(io, address, shared, true);
          })
          .then([](kj::Own<kj::AsyncIoStream> stream) { return kj::heap<RpcClient>(kj::mv(stream)); });
  auto expired = io.provider->getTimer().afterDelay(timeout).then([]() -> kj::Own<RpcClient> {
    kj::throwFatalException(exceptionFromStatus(Status(StatusCode::kDeadlineExceeded, "no answer in time"),
                                                kj::Exception::Type::DISCONNECTED));
  });
  return connected.exclusiveJoin(kj::mv(expired))
      .catch_([where](kj::Exception&& e) -> kj::Own<RpcClient> {
        // Ours (the handshake's refusals, the deadline) carry their code; KJ's socket and TLS
        // errors have only an OS or OpenSSL text, read here for a shorter reason and no more.
        Status s = statusFromException(e, "");
        std::string reason = s.message();
        StatusCode code = s.code() == StatusCode::kUnauthenticated || s.code() == StatusCode::kDeadlineExceeded
                              ? s.code()
                              : StatusCode::kUnavailable;
        if (code == StatusCode::kUnavailable) {
          if (reason.find("ECONNREFUSED") != std::string::npos || reason.find("refused") != std::string::npos) {
            reason = "connection refused";
          } else if (reason.find("certificate") != std::string::npos || reason.find("TLS") != std::string::npos) {
            reason = "TLS failed (not this cluster's certificate): " + reason;
          }
        }
        kj::throwFatalException(exceptionFromStatus(Status(code, fmt::format("cannot connect to {}: {}", where, reason)),
                                                    kj::Exception::Type::DISCONNECTED));
      });
}

}  // namespace troupe

