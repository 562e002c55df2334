// The `lightwire` executable: `serve` (the sidecar, proxy/server/serve.h) and the tools
// (proxy/tools/bench_cli.h: `bench codec|ingest|exchange`, `status`, `health`).
//
// Exit codes: 0 success, 1 a failure while running, 2 bad usage or bad parameters.

#include <CLI/CLI.hpp>

#include <memory>
#include <optional>
#include <string>

#include "proxy/config/config.h"
#include "proxy/server/serve.h"
#include "proxy/tools/bench_cli.h"
#include "proxy/version.h"

namespace lightwire::proxy {
namespace {

constexpr int kExitUsage = 2;

/// `serve`: the sidecar (proxy/server/serve.h).
void addServeCommand(CLI::App& app, int& rc) {
  struct State {
    FlagValues flags;
    std::optional<std::string> check_config;
  };
  auto state = std::make_shared<State>();
  CLI::App* serve = app.add_subcommand(
      "serve", "Run the sidecar (configuration: --config FILE < LIGHTWIRE_* < flags)");
  addServeFlags(*serve, state->flags);
  serve->add_option("--check-config", state->check_config,
                    "Validate a configuration file (with the environment) and exit");
  serve->callback([state, &rc] { rc = runServe(state->flags, state->check_config); });
}

int run(int argc, char** argv) {
  CLI::App app{"lightwire: gradient-compression sidecar for distributed training", "lightwire"};
  app.set_version_flag("--version", "lightwire " LIGHTWIRE_VERSION);
  app.require_subcommand(1);
  int rc = 0;
  addServeCommand(app, rc);
  tools::addToolCommands(app, argv[0], rc);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : kExitUsage;
  }
  return rc;
}

}  // namespace
}  // namespace lightwire::proxy

int main(int argc, char** argv) { return lightwire::proxy::run(argc, argv); }
