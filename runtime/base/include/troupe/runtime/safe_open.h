// Opening a file that another process could have replaced: a FIFO (whose open() blocks until a
// peer opens the other end), a symbolic link, or another user's file. Every file an agent,
// worker or trainer opens in a directory another process writes to goes through openRegularFile.
// Thread-safety: free functions and a move-only value type; safe from any thread.
#pragma once

#include <sys/types.h>

#include <string>
#include <utility>

#include "troupe/runtime/status.h"

namespace troupe {

// An owned file descriptor, closed when it goes.
class FileDescriptor {
 public:
  FileDescriptor() = default;
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(FileDescriptor&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  FileDescriptor& operator=(FileDescriptor&& other) noexcept;
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor();

  int get() const { return fd_; }
  // Hands the descriptor to the caller, who closes it.
  [[nodiscard]] int release() { return std::exchange(fd_, -1); }

 private:
  int fd_ = -1;
};

struct RegularFileOptions {
  mode_t mode = 0600;      // for O_CREAT
  bool mustBeMine = true;  // refuse a file whose owner is not this process's effective uid
};

// Opens `path` with `flags` (O_RDONLY, O_WRONLY | O_CREAT | O_APPEND, ...) plus O_NOFOLLOW,
// O_NONBLOCK and O_CLOEXEC, then checks on the open descriptor that it is a regular file (and
// this user's, unless options say otherwise); O_NONBLOCK is cleared again before it returns.
// Never blocks on what it finds at the path. Errors: kNotFound (nothing there),
// kFailedPrecondition (a link, FIFO, socket, device, directory or another user's file: the
// message names what was found), kUnavailable (any other open error, with errno's text).
[[nodiscard]] Result<FileDescriptor> openRegularFile(const std::string& path, int flags,
                                                     const RegularFileOptions& options = {});

// The whole of a regular file of this user opened as above, at most `maxBytes` of it (a longer
// one is kResourceExhausted).
[[nodiscard]] Result<std::string> readRegularFile(const std::string& path, size_t maxBytes);

}  // namespace troupe
