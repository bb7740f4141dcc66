#include "control_channel.h"

#include <sys/socket.h>

#include <cerrno>

#include "wire.h"

namespace troupe::collectives {

ControlChannel::Event ControlChannel::drain() {
  if (!socket_.is_open()) return {};
  char buffer[4096];
  while (!ended_) {
    const ssize_t n = ::recv(socket_.native_handle(), buffer, sizeof(buffer), MSG_DONTWAIT);
    if (n > 0) {
      bytes_.append(buffer, static_cast<size_t>(n));
    } else if (n == 0) {
      ended_ = true;
    } else if (errno == EINTR) {
      continue;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      break;
    } else {
      ended_ = true;  // reset: the peer's kernel closed it (the process died)
    }
  }
  for (;;) {
    ControlMessage message = parseControlMessage(bytes_);
    if (message.kind == ControlMessage::Kind::kIncomplete) break;
    if (message.kind == ControlMessage::Kind::kGoodbye) {
      saidGoodbye_ = true;
      bytes_.erase(0, message.bytes);
      continue;
    }
    if (message.kind == ControlMessage::Kind::kMalformed) {
      return Event{Event::Kind::kMalformed, StatusCode::kInternal, std::move(message.text)};
    }
    return Event{Event::Kind::kAborted, message.code, std::move(message.text)};
  }
  if (!ended_) return {};
  if (saidGoodbye_) {
    left_ = true;  // a clean leave: operations that still need the peer fail when they reach it
    asio::error_code ignored;
    socket_.close(ignored);
    return {};
  }
  return Event{Event::Kind::kDied, StatusCode::kUnavailable, {}};
}

void ControlChannel::send(const std::string& message) {
  asio::error_code ignored;
  socket_.non_blocking(true, ignored);
  socket_.send(asio::buffer(message), 0, ignored);
}

void ControlChannel::close() {
  asio::error_code ignored;
  socket_.shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
  socket_.close(ignored);
}

}  // namespace troupe::collectives
