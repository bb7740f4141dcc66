// A peer's control connection: the goodbye a rank sends when it closes its communicator and the
// ABORT it sends when it fails (wire.h). Read with readiness waits and non-blocking reads (not
// async_read), so a failure noticed elsewhere can first pick up what already arrived here: a
// peer's ABORT (the root cause) or the end of a peer that died. Internal to collectives/; used on
// the communicator's I/O thread only.
#pragma once

#include <string>

#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>

#include "troupe/runtime/status.h"

namespace troupe::collectives {

class ControlChannel {
 public:
  explicit ControlChannel(asio::io_context& io) : socket_(io) {}

  asio::ip::tcp::socket& socket() { return socket_; }
  bool isOpen() const { return socket_.is_open(); }
  // The peer said goodbye (it is closing its communicator).
  bool saidGoodbye() const { return saidGoodbye_; }
  // ... and its connection has ended since: later operations that need it fail.
  bool left() const { return left_; }

  // What drain() found, beyond goodbyes (which only change saidGoodbye() and left()).
  struct Event {
    enum class Kind {
      kNothing,    // no ABORT, and the connection is open or ended after a goodbye
      kAborted,    // the peer sent an ABORT: code and text are its own
      kMalformed,  // bytes that are no control message: text says what is wrong
      kDied,       // the connection ended without a goodbye: the process died or was killed
    };
    Kind kind = Kind::kNothing;
    StatusCode code = StatusCode::kOk;
    std::string text;
  };
  // Reads what the connection holds without blocking and reports the first message that is not a
  // goodbye, or the end of the connection.
  Event drain();

  // Best effort: a few bytes on a socket nobody else writes to; a dead peer just fails it.
  void send(const std::string& message);
  // Shuts the connection down both ways and closes it.
  void close();

 private:
  asio::ip::tcp::socket socket_;
  std::string bytes_;  // read but not yet parsed
  bool ended_ = false;
  bool saidGoodbye_ = false;
  bool left_ = false;
};

}  // namespace troupe::collectives
