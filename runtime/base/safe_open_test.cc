#include "troupe/runtime/safe_open.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <doctest/doctest.h>

namespace troupe {
namespace {

struct TempDir {
  std::string path;
  TempDir() {
    path = (std::filesystem::temp_directory_path() / "troupe-safe-open-XXXXXX").string();
    REQUIRE(::mkdtemp(path.data()) != nullptr);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

TEST_CASE("openRegularFile: a FIFO, a link or a directory at the path is refused at once, never waited on") {
  TempDir dir;
  const std::string fifo = dir.path + "/fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  // Without O_NONBLOCK each of these opens would wait for a peer forever.
  for (int flags : {O_RDONLY, O_WRONLY | O_APPEND, O_WRONLY | O_CREAT | O_APPEND, O_RDWR}) {
    auto opened = openRegularFile(fifo, flags);
    REQUIRE(!opened.isOk());
    CHECK(opened.status().code() == StatusCode::kFailedPrecondition);
    CHECK(opened.status().message().find("FIFO") != std::string::npos);
  }
  const std::string target = dir.path + "/target";
  std::ofstream(target) << "x";
  const std::string link = dir.path + "/link";
  REQUIRE(::symlink(target.c_str(), link.c_str()) == 0);
  auto viaLink = openRegularFile(link, O_RDONLY);
  REQUIRE(!viaLink.isOk());
  CHECK(viaLink.status().message().find("symbolic link") != std::string::npos);
  CHECK(openRegularFile(dir.path, O_RDONLY).status().code() == StatusCode::kFailedPrecondition);
  CHECK(openRegularFile(dir.path + "/missing", O_RDONLY).status().code() == StatusCode::kNotFound);
}

TEST_CASE("openRegularFile: a file of this user opens, blocking again; another user's only when allowed") {
  TempDir dir;
  const std::string path = dir.path + "/log";
  auto made = openRegularFile(path, O_WRONLY | O_CREAT | O_APPEND);
  REQUIRE(made.isOk());
  CHECK((::fcntl(made->get(), F_GETFL) & O_NONBLOCK) == 0);
  CHECK((::fcntl(made->get(), F_GETFD) & FD_CLOEXEC) != 0);
  REQUIRE(::write(made->get(), "hello", 5) == 5);
  auto read = readRegularFile(path, 16);
  REQUIRE(read.isOk());
  CHECK(*read == "hello");
  CHECK(readRegularFile(path, 4).status().code() == StatusCode::kResourceExhausted);
  if (::geteuid() == 0) {
    REQUIRE(::chown(path.c_str(), 65534, 65534) == 0);
    auto theirs = openRegularFile(path, O_RDONLY);
    REQUIRE(!theirs.isOk());
    CHECK(theirs.status().message().find("belongs to uid 65534") != std::string::npos);
    CHECK(openRegularFile(path, O_RDONLY, RegularFileOptions{.mustBeMine = false}).isOk());
  }
}

}  // namespace
}  // namespace troupe
