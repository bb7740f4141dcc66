// Helpers for the train suite's tests (header-only, test code only).
#pragma once

#include <stdlib.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include "troupe/runtime/process.h"

namespace troupe::actors::testing {

// Real English text present on every Debian machine.
inline constexpr const char* kEnglishText = "/usr/share/common-licenses/GPL-3";

// A fresh directory under $TMPDIR, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "troupe-train-XXXXXX").string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The interpreter the tests export models and arrays with ($TROUPE_TEST_PYTHON, default
// /usr/bin/python3: Debian's, which has python3-torch and python3-numpy).
inline std::string python() {
  const char* p = std::getenv("TROUPE_TEST_PYTHON");
  return p != nullptr ? p : "/usr/bin/python3";
}

// True when `python -c "import <module>"` succeeds (python3-torch, python3-numpy).
inline bool pythonHas(const std::string& module) {
  SpawnOptions spawn;
  spawn.argv = {python(), "-c", "import " + module};
  spawn.outputPath = "/dev/null";
  auto pid = spawnProcess(spawn);
  if (!pid.isOk()) return false;
  ChildProcess child(*pid);
  auto exit = child.wait(std::chrono::seconds(120));
  return exit.has_value() && exit->exitCode == 0;
}

// Writes `script` to dir/script.py (torch.jit.script needs the source in a file) and runs it
// with `args`; returns "" when it exits 0 within 120 s, else its output (stdout and stderr).
inline std::string runPython(const std::string& dir, const std::string& script,
                             const std::vector<std::string>& args) {
  const std::string path = dir + "/script.py";
  const std::string log = dir + "/script.log";
  {
    std::ofstream file(path);
    file << script;
  }
  SpawnOptions spawn;
  spawn.argv = {python(), path};
  spawn.argv.insert(spawn.argv.end(), args.begin(), args.end());
  spawn.outputPath = log;
  auto pid = spawnProcess(spawn);
  if (!pid.isOk()) return pid.status().toString();
  ChildProcess child(*pid);
  auto exit = child.wait(std::chrono::seconds(120));
  if (exit.has_value() && exit->exitCode == 0) return "";
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  return "python failed (" + (exit ? exit->toString() : std::string("timeout")) + "): " + text.str();
}

}  // namespace troupe::actors::testing
