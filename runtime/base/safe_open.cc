#include "troupe/runtime/safe_open.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

namespace troupe {

FileDescriptor& FileDescriptor::operator=(FileDescriptor&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

FileDescriptor::~FileDescriptor() {
  if (fd_ >= 0) ::close(fd_);
}

namespace {

const char* kindOf(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

}  // namespace

Result<FileDescriptor> openRegularFile(const std::string& path, int flags, const RegularFileOptions& options) {
  // O_NONBLOCK: opening a FIFO for reading returns at once (for writing it fails with ENXIO)
  // instead of waiting for a peer that may never come.
  FileDescriptor fd(::open(path.c_str(), flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, options.mode));
  if (fd.get() < 0) {
    const int e = errno;
    if (e == ENOENT) return Status(StatusCode::kNotFound, fmt::format("{}: no such file", path));
    struct stat st {};
    if (e == ELOOP || e == ENXIO || e == EISDIR || e == EWOULDBLOCK) {
      const bool known = ::lstat(path.c_str(), &st) == 0;
      return Status(StatusCode::kFailedPrecondition,
                    fmt::format("refusing {}: it is {}, not a regular file (did another process replace it?)", path,
                                known ? kindOf(st.st_mode) : std::strerror(e)));
    }
    return Status(StatusCode::kUnavailable, fmt::format("cannot open {}: {}", path, std::strerror(e)));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    return Status(StatusCode::kUnavailable, fmt::format("cannot stat {}: {}", path, std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("refusing {}: it is {}, not a regular file (did another process replace it?)", path,
                              kindOf(st.st_mode)));
  }
  if (options.mustBeMine && st.st_uid != ::geteuid()) {
    return Status(StatusCode::kFailedPrecondition,
                  fmt::format("refusing {}: it belongs to uid {}, not to this user (uid {})", path, st.st_uid,
                              ::geteuid()));
  }
  const int status = ::fcntl(fd.get(), F_GETFL);
  if (status >= 0) (void)::fcntl(fd.get(), F_SETFL, status & ~O_NONBLOCK);
  return fd;
}

Result<std::string> readRegularFile(const std::string& path, size_t maxBytes) {
  TROUPE_ASSIGN_OR_RETURN(auto fd, openRegularFile(path, O_RDONLY));
  std::string out;
  char buf[65536];
  for (;;) {
    ssize_t got = ::read(fd.get(), buf, sizeof(buf));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return Status(StatusCode::kUnavailable, fmt::format("cannot read {}: {}", path, std::strerror(errno)));
    if (got == 0) return out;
    if (out.size() + static_cast<size_t>(got) > maxBytes) {
      return Status(StatusCode::kResourceExhausted, fmt::format("{} is larger than {} bytes", path, maxBytes));
    }
    out.append(buf, static_cast<size_t>(got));
  }
}

}  // namespace troupe
