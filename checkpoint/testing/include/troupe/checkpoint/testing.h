// Helpers for the checkpoint unit tests: a state of many dtypes and shapes whose bytes depend on
// the step, scratch directories, and child processes stopped by the fault seam and killed -9.
// Thread-safety: test-only, one thread.
#pragma once

#include <doctest/doctest.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "troupe/checkpoint/checksum.h"
#include "troupe/checkpoint/image.h"
#include "troupe/checkpoint/tensor_state.h"
#include "troupe/checkpoint/test_state.h"
#include "troupe/runtime/ids.h"

namespace troupe::checkpoint::testing {

namespace fs = std::filesystem;

// A temporary directory removed at the end of the test.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& base = fs::temp_directory_path().string())
      : path_(fs::path(base) / ("troupe_ckpt_test_" + randomHex(6))) {
    fs::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string str() const { return path_.string(); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// A whole rank image in memory for `state` at `stamp`.
inline std::vector<uint8_t> imageOf(const TestState& state, const ImageLayout& layout, ImageStamp stamp,
                                    std::string_view meta) {
  std::vector<uint8_t> image(layout.imageBytes(), 0);
  std::vector<uint32_t> crcs;
  for (size_t i = 0; i < state.data.size(); ++i) {
    std::memcpy(image.data() + layout.tensorOffset(i), state.data[i].data(), state.data[i].size());
    crcs.push_back(crc32c(state.data[i].data(), state.data[i].size()));
  }
  REQUIRE(layout.encodeHeader(image.data(), stamp, crcs, meta).isOk());
  return image;
}

// A forked child whose stderr comes back through a pipe; killed -9 and reaped by the destructor.
class Child {
 public:
  explicit Child(const std::function<int()>& body) {
    int fds[2];
    REQUIRE(pipe2(fds, O_CLOEXEC) == 0);
    pid_ = fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      dup2(fds[1], 2);
      _exit(body());
    }
    close(fds[1]);
    err_ = fds[0];
  }
  ~Child() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (err_ >= 0) close(err_);
  }
  // Waits until the child's stderr contains `text` (true) or the deadline passes.
  bool waitForOutput(const std::string& text, std::chrono::milliseconds limit = std::chrono::seconds(20)) {
    auto deadline = std::chrono::steady_clock::now() + limit;
    while (output_.find(text) == std::string::npos) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd p{err_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(left.count())) <= 0) return false;
      char buf[4096];
      ssize_t n = read(err_, buf, sizeof(buf));
      if (n <= 0) return false;
      output_.append(buf, static_cast<size_t>(n));
    }
    return true;
  }
  // SIGKILL, then reap.
  void kill9() {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = 0;
  }
  // Waits for the child to exit; its exit code, or -signal.
  int wait() {
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = 0;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  }
  const std::string& output() {
    char buf[4096];
    int flags = fcntl(err_, F_GETFL);
    fcntl(err_, F_SETFL, flags | O_NONBLOCK);
    ssize_t n;
    while ((n = read(err_, buf, sizeof(buf))) > 0) output_.append(buf, static_cast<size_t>(n));
    return output_;
  }
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = 0;
  int err_ = -1;
  std::string output_;
};

// In a child with a private mount namespace (root only), mounts a tmpfs of `size` at `dir`
// and runs `body` there; the mount goes with the child. Returns false (and the caller skips)
// when namespaces or tmpfs mounts are not allowed here.
inline bool canMountTmpfs() {
  Child probe([]() {
    if (unshare(CLONE_NEWNS) != 0) return 10;
    if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return 11;
    std::string dir = fs::temp_directory_path() / ("troupe_mnt_probe_" + std::to_string(getpid()));
    fs::create_directories(dir);
    int rc = mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=1m") == 0 ? 0 : 12;
    umount(dir.c_str());
    fs::remove(dir);
    return rc;
  });
  return probe.wait() == 0;
}

inline int inSmallTmpfs(const std::string& dir, const std::string& size, const std::function<int()>& body) {
  if (unshare(CLONE_NEWNS) != 0) return 10;
  if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return 11;
  if (mount("tmpfs", dir.c_str(), "tmpfs", 0, ("size=" + size).c_str()) != 0) return 12;
  return body();
}

}  // namespace troupe::checkpoint::testing
