#include <fmt/format.h>

#include <fstream>
#include <iostream>

#include "cli.h"

namespace troupe::cli {

std::string dashboardLoginUrl(const std::string& runDir) {
  std::ifstream in(runDir + "/dashboard.login");
  std::string url;
  if (runDir.empty() || !std::getline(in, url)) return "";
  return url;
}

int dashboardCommand() {
  // Only the local run directory holds the login URL (0600, written by troupe.dashboard): the
  // dashboard listens on the head's loopback, so this runs on the head, as its user.
  auto runDir = latestRunDir();
  if (!runDir.isOk()) return fail(runDir.status());
  std::string url = dashboardLoginUrl(*runDir);
  if (url.empty()) {
    return fail(Status(StatusCode::kNotFound,
                       fmt::format("no dashboard runs for the cluster in {} (only the head runs one; see "
                                   "{}/logs/dashboard.log)",
                                   *runDir, *runDir)));
  }
  std::string base = url.substr(0, url.find("/login"));
  std::cout << url << "\n"
            << "  Open it in a browser on this machine (or through ssh -L to it): it sets the dashboard's session\n"
            << "  cookie. Every other request without that cookie is refused.\n"
            << "  Prometheus: scrape " << base << "/metrics with the bearer credentials in " << *runDir
            << "/dashboard.metrics-token (authorization: credentials_file)." << std::endl;
  return 0;
}

}  // namespace troupe::cli
