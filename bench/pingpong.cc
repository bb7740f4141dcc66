#include "pingpong.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>
#include <algorithm>

#include "troupe/runtime/process.h"

namespace troupe::bench {
namespace {

sockaddr_in loopback(int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  return addr;
}

// Sends or receives all of [data, data + size).
bool sendAll(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = send(fd, data, size, 0);
    if (n <= 0) return false;
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}
// `poll`: never sleep in the kernel; ask again until the bytes are there (as a spinning actor
// connection does, but for as long as it takes).
bool recvAll(int fd, char* data, size_t size, bool poll = false) {
  while (size > 0) {
    ssize_t n = recv(fd, data, size, poll ? MSG_DONTWAIT : MSG_WAITALL);
    if (n < 0 && poll && errno == EAGAIN) continue;
    if (n <= 0) return false;
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

int serve(int port, size_t bytes, bool poll) {
  int listener = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  auto addr = loopback(port);
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(listener, 4) != 0) return 1;
  int fd = accept(listener, nullptr, nullptr);
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  std::vector<char> buf(bytes);
  while (recvAll(fd, buf.data(), bytes, poll) && sendAll(fd, buf.data(), bytes)) {
  }
  return 0;
}

}  // namespace

bool maybeServeTcp(int argc, char** argv, int* exitCode) {
  if ((argc == 4 || argc == 5) && std::string(argv[1]) == "--serve-tcp") {
    *exitCode = serve(std::stoi(argv[2]), std::stoull(argv[3]), argc == 5);
    return true;
  }
  return false;
}

double tcpRoundTripUs(const char* argv0, int rounds, size_t bytes, bool poll) {
  int port = *pickFreePort("127.0.0.1");
  SpawnOptions o;
  o.argv = {argv0, "--serve-tcp", std::to_string(port), std::to_string(bytes)};
  if (poll) o.argv.push_back("--poll");
  ChildProcess server(*spawnProcess(o));
  auto addr = loopback(port);
  int fd = -1;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (fd < 0 && std::chrono::steady_clock::now() < deadline) {
    fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      close(fd);
      fd = -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));  // the child is still binding
    }
  }
  if (fd < 0) return -1;
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  std::vector<char> buf(bytes, 'p');
  auto once = [&]() { return sendAll(fd, buf.data(), bytes) && recvAll(fd, buf.data(), bytes, poll); };
  for (int i = 0; i < std::min(rounds, 200); ++i) once();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < rounds; ++i) once();
  double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / rounds;
  close(fd);
  return us;
}

}  // namespace troupe::bench
