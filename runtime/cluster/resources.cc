#include "troupe/runtime/resources.h"

#include <sched.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <cmath>
#include <sstream>

#include <fmt/format.h>

namespace troupe {

Resources detectLocalResources() {
  Resources r;
  cpu_set_t set;
  CPU_ZERO(&set);
  r["CPU"] = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  double kib = 0;
  while (meminfo >> key >> kib) {
    if (key == "MemTotal:") {
      r["memory"] = kib * 1024;
      break;
    }
    meminfo.ignore(256, '\n');
  }
  int gpus = 0;
  std::error_code ec;
  static const std::regex kGpu("nvidia[0-9]+");
  for (const auto& entry : std::filesystem::directory_iterator("/dev", ec)) {
    if (std::regex_match(entry.path().filename().string(), kGpu)) ++gpus;
  }
  r["GPU"] = gpus;
  return r;
}

Status checkResources(const Resources& resources, const std::string& what) {
  for (const auto& [name, qty] : resources) {
    if (name.empty()) return Status(StatusCode::kInvalidArgument, fmt::format("{}: a resource has an empty name", what));
    if (!std::isfinite(qty) || qty < 0 || qty > 1e18) {
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("{}: quantity {} of resource '{}' is not a finite number in [0, 1e18]", what, qty, name));
    }
  }
  return Status::ok();
}

Result<Resources> parseResources(const std::string& text) {
  Resources r;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (item.empty()) continue;
    auto eq = item.find('=');
    std::string name = item.substr(0, eq);
    if (eq == std::string::npos || name.empty()) {
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("resource '{}' is not NAME=QUANTITY (e.g. --resources GPU=1,ssd=2)", item));
    }
    std::string qty = item.substr(eq + 1);
    try {
      size_t used = 0;
      double q = std::stod(qty, &used);
      if (used != qty.size() || !std::isfinite(q) || q < 0 || q > 1e18) throw std::invalid_argument(qty);
      r[name] = q;
    } catch (const std::exception&) {
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("quantity '{}' of resource '{}' is not a finite number in [0, 1e18]", qty, name));
    }
  }
  return r;
}

std::string formatResources(const Resources& resources) {
  std::string out;
  for (const auto& [name, qty] : resources) {
    if (!out.empty()) out += ", ";
    if (name == "memory") out += fmt::format("memory {:.1f} GiB", qty / (1024.0 * 1024 * 1024));
    else out += fmt::format("{} {:g}", name, qty);
  }
  return out;
}

}  // namespace troupe
