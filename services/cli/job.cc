// `troupe job ...` and `troupe timeline ...` are written in Python (python/troupe/job.py: jobs
// are supervised by a Python actor; timeline.py): the command hands its arguments to
// `python3 -m troupe.<module>`, with the package that sits next to this executable
// (build/python/) first on PYTHONPATH.
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "cli.h"

namespace troupe::cli {

int pythonCommand(const std::string& module, int argc, char** argv, int first) {
  char self[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  std::string package;
  if (n > 0) {
    std::string exe(self, static_cast<size_t>(n));
    package = exe.substr(0, exe.rfind('/')) + "/python";
  }
  if (!package.empty() && ::access((package + "/troupe/" + module + ".py").c_str(), R_OK) == 0) {
    const char* old = std::getenv("PYTHONPATH");
    std::string path = old && *old ? package + ":" + old : package;
    ::setenv("PYTHONPATH", path.c_str(), 1);
  }
  const char* python = std::getenv("TROUPE_PYTHON");
  std::string interpreter = python && *python ? python : "/usr/bin/python3";
  std::string dotted = "troupe." + module;
  std::vector<char*> args{interpreter.data(), const_cast<char*>("-m"), dotted.data()};
  for (int i = first; i < argc; ++i) args.push_back(argv[i]);
  args.push_back(nullptr);
  ::execv(interpreter.c_str(), args.data());
  std::cerr << "troupe: error: cannot run " << interpreter << " for `troupe " << module << "`: " << strerror(errno)
            << std::endl;
  return 1;
}

}  // namespace troupe::cli
