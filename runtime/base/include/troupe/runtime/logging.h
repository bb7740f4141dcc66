// Process-wide logging: fmt-formatted lines with time, level, pid and thread, to stderr and,
// once openLogFile() is called, to a per-process file in the run directory's logs/ folder.
// Thread-safety: every function may be called from any thread.
#pragma once

#include <fmt/format.h>

#include <string>
#include <string_view>

namespace troupe {

enum class LogLevel { kDebug = 0, kInfo, kWarning, kError, kFatal };

// Parses "debug", "info", "warning", "error"; anything else gives kInfo.
LogLevel parseLogLevel(std::string_view name);
void setLogLevel(LogLevel level);
LogLevel logLevel();
// Tags every line with `name` (e.g. "controller"); call once from main().
void setLogProcessName(std::string name);
// Appends to `path` from now on (creating it 0600); stderr keeps getting warnings and above
// unless `alsoStderr`. Returns false if the file cannot be opened.
bool openLogFile(const std::string& path, bool alsoStderr);
void logLine(LogLevel level, const char* file, int line, std::string_view message);

}  // namespace troupe

#define TROUPE_LOG(level, ...)                                                             \
  do {                                                                                     \
    if (::troupe::LogLevel::level >= ::troupe::logLevel())                                 \
      ::troupe::logLine(::troupe::LogLevel::level, __FILE__, __LINE__, fmt::format(__VA_ARGS__)); \
  } while (0)

// Invariant check: logs and aborts. Not for errors a caller can handle (use Status).
#define TROUPE_CHECK(cond, ...)                                                            \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      ::troupe::logLine(::troupe::LogLevel::kFatal, __FILE__, __LINE__,                    \
                        fmt::format("check failed: " #cond " " __VA_ARGS__));              \
      ::abort();                                                                           \
    }                                                                                      \
  } while (0)
