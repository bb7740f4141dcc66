#include "troupe/runtime/metrics.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <doctest/doctest.h>

namespace troupe::metrics {
namespace {

// A fresh 0700 directory for this test's files.
std::string tempDir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "troupe-metrics-XXXXXX").string();
  REQUIRE(::mkdtemp(pattern.data()) != nullptr);
  return pattern;
}

// A child process with TROUPE_METRICS_FILE=path that runs parts(0), parts(1), ... one per
// step(): its counters are made on first use, so it publishes them to that file.
struct Child {
  pid_t pid = -1;
  int toChild = -1;
  int fromChild = -1;
  void step() {  // lets the child do its next part and waits until it did
    char c = 1;
    REQUIRE(::write(toChild, &c, 1) == 1);
    REQUIRE(::read(fromChild, &c, 1) == 1);
  }
  int finish() {
    ::close(toChild);
    int status = 0;
    ::waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
};

template <typename Parts>
Child spawn(const std::string& path, Parts parts) {
  int down[2], up[2];
  REQUIRE(::pipe(down) == 0);
  REQUIRE(::pipe(up) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(down[1]);  // else its own read never sees the parent close it
    ::close(up[0]);
    ::setenv("TROUPE_METRICS_FILE", path.c_str(), 1);
    char c;
    for (int part = 0; ::read(down[0], &c, 1) == 1; ++part) {
      parts(part);
      if (::write(up[1], &c, 1) != 1) _exit(3);
    }
    _exit(0);
  }
  ::close(down[0]);
  ::close(up[1]);
  return Child{pid, down[1], up[0]};
}

double valueOf(const std::vector<Sample>& samples, const std::string& name, const std::string& labels = "") {
  for (const auto& s : samples) {
    if (s.name == name && s.labels == labels) return s.value;
  }
  FAIL("no sample ", name, "{", labels, "}");
  return -1;
}

TEST_CASE("a worker's counters are read live from its file, and only its own process writes it") {
  std::string dir = tempDir();
  std::string path = dir + "/actor-1.0";
  auto child = spawn(path, [](int part) {
    auto& calls = counter("troupe_test_calls_total");
    auto& time = counter("troupe_test_seconds_total", "op=\"allreduce\"", Unit::kSeconds);
    if (part == 0) {
      calls.add(3);
      time.addTime(std::chrono::milliseconds(1500));
    } else {
      calls.add(2);
    }
  });
  child.step();
  auto first = read(path);
  REQUIRE(first.isOk());
  CHECK(valueOf(*first, "troupe_test_calls_total") == 3);
  CHECK(valueOf(*first, "troupe_test_seconds_total", "op=\"allreduce\"") == doctest::Approx(1.5));
  child.step();  // still running: the reader sees the new value without asking the process
  CHECK(valueOf(*read(path), "troupe_test_calls_total") == 5);
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);

  // A process that inherits the variable (a worker's child) never takes the file over.
  auto second = spawn(path, [](int) { counter("troupe_test_calls_total").add(100); });
  second.step();
  CHECK(second.finish() == 0);
  CHECK(valueOf(*read(path), "troupe_test_calls_total") == 5);
  CHECK(child.finish() == 0);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a file that is not a counter file is an error, and a slot with bad text is skipped") {
  std::string dir = tempDir();
  CHECK(read(dir + "/missing").status().code() == StatusCode::kNotFound);

  std::string shortFile = dir + "/short";
  std::ofstream(shortFile) << "TRPMET01";
  CHECK(read(shortFile).status().code() == StatusCode::kFailedPrecondition);

  // A real file, then damaged: one slot's name loses its terminator, then the header's count.
  std::string path = dir + "/actor-2.0";
  auto child = spawn(path, [](int) {
    counter("troupe_a_total").add(1);
    counter("troupe_b_total").add(2);
  });
  child.step();
  CHECK(child.finish() == 0);
  REQUIRE(read(path)->size() == 2);
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  const size_t header = 64;  // then 192-byte slots: name[96], labels[80], unit, value
  file.seekp(static_cast<std::streamoff>(header));
  file << std::string(96, 'x');  // slot 0's whole name field, no NUL
  file.flush();
  auto damaged = read(path);
  REQUIRE(damaged.isOk());
  REQUIRE(damaged->size() == 1);
  CHECK((*damaged)[0].name == "troupe_b_total");
  file.seekp(16);  // the slots-used count: more than the file has
  uint32_t huge = 100000;
  file.write(reinterpret_cast<const char*>(&huge), sizeof(huge));
  file.flush();
  CHECK(read(path).status().code() == StatusCode::kFailedPrecondition);
  file.seekp(0);
  file << "NOTMETRC";
  file.flush();
  CHECK(read(path).status().code() == StatusCode::kFailedPrecondition);
  std::filesystem::remove_all(dir);
}

TEST_CASE("label values are escaped for the Prometheus text format") {
  CHECK(escapeLabel("py:Counter") == "py:Counter");
  CHECK(escapeLabel("a\"b\\c\nd") == "a\\\"b\\\\c\\nd");
  CHECK(labelText({{"op", "a\"b\\c\nd"}, {"rank", "0"}}) == "op=\"a\\\"b\\\\c\\nd\",rank=\"0\"");
  CHECK(parseLabels(labelText({{"op", "a\"b\\c\nd"}})) == Labels{{"op", "a\"b\\c\nd"}});
  CHECK(parseLabels("") == Labels{});
  for (const char* bad : {"op=\"a\"b\"", "op=\"a", "op=\"a\\x\"", "op=a", "9op=\"a\"", "op=\"a\"x", "op=\"a\",", "op=\"a\nb\""}) {
    CHECK_MESSAGE(!parseLabels(bad).has_value(), bad);
  }
}

TEST_CASE("a slot whose label text a worker forged is dropped; escaped text comes back as written") {
  std::string dir = tempDir();
  std::string path = dir + "/actor-3.0";
  const std::string tricky = labelText({{"op", "a\"b\\c\nd"}});
  auto child = spawn(path, [&tricky](int) {
    counter("troupe_a_total", tricky).add(1);
    counter("troupe_b_total", "op=\"x\"").add(2);
  });
  child.step();
  CHECK(child.finish() == 0);
  CHECK(valueOf(*read(path), "troupe_a_total", tricky) == 1);
  // The worker owns the file and can write any printable text where slot 1's labels are.
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  const size_t header = 64, slot = 192, labels = 96;
  file.seekp(static_cast<std::streamoff>(header + slot + labels));
  file << std::string("op=\"x\"} 1\\nfake 9 \"") << '\0';
  file.flush();
  auto samples = read(path);
  REQUIRE(samples.isOk());
  REQUIRE(samples->size() == 1);
  CHECK((*samples)[0].name == "troupe_a_total");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace troupe::metrics
