#pragma once
// `lightwire status`: a readable summary of a running sidecar from its GET /v1/status (rank,
// peers, codec settings per group, policy state and decision log, tensors and recent steps).

#include <boost/json/object.hpp>

#include <optional>
#include <string>

namespace lightwire::proxy {

struct StatusOptions {
  std::optional<std::string> socket;  // control socket (default: LIGHTWIRE_SOCKET, then the
                                      // serve default)
  std::optional<std::string> url;     // http://host:port of a control or admin listener
  std::string token;                  // bearer token (default: LIGHTWIRE_TOKEN)
  bool json = false;                  // print the status JSON as it came
  double timeout_s = 10;
  int decisions = 10;  // decision-log entries shown
};

/// Fetches and prints; returns the process exit code (0, 1 unreachable / bad reply, 2 usage).
int runStatus(const StatusOptions& options);

/// The human-readable summary of a /v1/status document (exposed for tests).
std::string formatStatus(const boost::json::object& status, int decisions);

}  // namespace lightwire::proxy
