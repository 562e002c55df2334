#pragma once
// `lightwire serve`: the sidecar process (docs/architecture.md "One step of one tensor",
// docs/api.md). Builds the config, the metrics, the buffer table, the step engine and the
// listeners, serves until SIGTERM/SIGINT, then shuts down gracefully (steps in flight finish or
// fail with 503, socket files removed).

#include <optional>
#include <string>

#include "proxy/config/config.h"

namespace lightwire::proxy {

/// Runs the sidecar with `flags` (and the process environment). Returns the exit code: 0 after a
/// clean shutdown, 2 for a bad configuration, 1 when a listener cannot be opened.
int runServe(const FlagValues& flags, const std::optional<std::string>& check_config);

}  // namespace lightwire::proxy
