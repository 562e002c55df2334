#pragma once
// `lightwire status`: a readable summary of a running sidecar from its GET /v1/status (rank,
// peers, codec settings per group, policy state and decision log, tensors and recent steps), and
// `lightwire health`, a probe of /healthz or /readyz.

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

/// `lightwire health`: GET /healthz (or /readyz) and exit 0 on 200, 1 otherwise; a container
/// health check or exec probe that needs no curl in the image.
struct HealthOptions {
  std::optional<std::string> socket;  // control socket instead of the admin listener
  std::optional<std::string> url;     // http://host:port (default: defaultHealthUrl)
  bool ready = false;                 // /readyz instead of /healthz
  bool quiet = false;                 // print nothing on success
  double timeout_s = 5;
};

/// Probes; returns the process exit code (0 healthy/ready, 1 not, or unreachable, 2 usage).
int runHealth(const HealthOptions& options);

/// The admin listener's URL as seen from the same host: `admin.listen` (LIGHTWIRE_ADMIN__LISTEN,
/// null or empty = the default 0.0.0.0:4782), a wildcard address replaced by loopback.
std::string defaultHealthUrl(const char* admin_listen);

/// The human-readable summary of a /v1/status document (exposed for tests).
std::string formatStatus(const boost::json::object& status, int decisions);

}  // namespace lightwire::proxy
