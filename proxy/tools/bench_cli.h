#pragma once
// The command lines of the `lightwire` executable's tools: `bench codec|ingest|exchange`,
// `status`, `health` (the sidecar itself is `serve`, proxy/server/serve.h).

#include <CLI/CLI.hpp>

namespace lightwire::proxy::tools {

/// Adds the tools' subcommands to `app`; the one that runs sets `rc` (0 success, 1 a failure, 2
/// bad usage). `argv0`: the executable, where /proc/self/exe cannot tell.
void addToolCommands(CLI::App& app, const char* argv0, int& rc);

}  // namespace lightwire::proxy::tools
