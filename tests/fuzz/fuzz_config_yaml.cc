// Target `config_yaml`: the configuration file of `lightwire serve --config`
// (docs/configuration.md) through buildServeConfig(), written to a scratch file since it reads a
// path; lines
// `#@env KEY=VALUE` and `#@flag key=value` (YAML comments) add environment entries and command-line
// values, the other two sources. An accepted config then goes through checkMembership(), toJson()
// and fuzz_util.h checkCompression() (its compression section reads back and builds).
//
// Input: the YAML text.
#include <boost/json/serialize.hpp>

#include <fstream>
#include <iterator>
#include <sstream>

#include "proxy/config/config.h"
#include "tests/fuzz/targets.h"

#ifndef LW_SOURCE_DIR
#error "LW_SOURCE_DIR (the repository) is defined by tests/fuzz/meson.build"
#endif

namespace lightwire::fuzz::config_yaml {
namespace {

constexpr std::string_view kEnv = "#@env ", kFlag = "#@flag ";

std::string readRepoFile(const std::string& rel) {
  std::ifstream in(std::string(LW_SOURCE_DIR) + "/" + rel, std::ios::binary);
  if (!in) fail("cannot read " + rel);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

int run(const uint8_t* data, size_t size) {
  const ScratchDir& dir = ScratchDir::get();
  const std::string path = dir.write("lightwire.yaml", {data, size});
  std::vector<std::string> environ;
  proxy::FlagValues flags;
  std::istringstream lines{std::string(textOf({data, size}))};
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(kEnv, 0) == 0) environ.push_back(line.substr(kEnv.size()));
    if (line.rfind(kFlag, 0) == 0) {
      const std::string kv = line.substr(kFlag.size());
      const size_t eq = kv.find('=');
      if (eq != std::string::npos) flags.values[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
  }
  std::vector<std::string> warnings;
  auto config = proxy::buildServeConfig(path, environ, flags, &warnings);
  if (!config) {
    check(!config.status().message().empty(), "a config refused without a message");
    return 0;
  }
  (void)proxy::checkMembership(*config);
  (void)boost::json::serialize(proxy::toJson(*config));
  checkCompression(config->compression);
  return 0;
}

void seeds(Seeds& out) {
  // Every ```yaml block of the documentation: the complete file, the rules, the policies.
  for (const char* doc : {"docs/configuration.md", "docs/policies.md"}) {
    const std::string text = readRepoFile(doc);
    size_t at = 0;
    for (int i = 0;; ++i) {
      const size_t begin = text.find("```yaml\n", at);
      if (begin == std::string::npos) break;
      const size_t end = text.find("```", begin + 8);
      if (end == std::string::npos) break;
      std::string name = std::string(doc).substr(5);
      name = name.substr(0, name.size() - 3) + "_" + std::to_string(i);
      out.emplace_back(name, bytesOf(std::string_view(text).substr(begin + 8, end - begin - 8)));
      at = end + 3;
    }
  }
  // The other sources, and a membership of three ranks.
  out.emplace_back("sources", bytesOf("job_id: run-1\n"
                                      "peer:\n  rank: 1\n  world_size: 3\n"
                                      "  peers: [\"10.0.0.1:4781\", \"10.0.0.2:4781\", "
                                      "\"10.0.0.3:4781\"]\n  topology: ps\n"
                                      "#@env LIGHTWIRE_PEER__SECRET=s3cret\n"
                                      "#@env LIGHTWIRE_LIMITS__MAX_BUFFERS=64\n"
                                      "#@flag threads=4\n#@flag compression.default.codec=qsgd\n"));
  // Found by fuzzing: a value that is not UTF-8 made the effective configuration's JSON invalid.
  out.emplace_back("not_utf8", bytesOf("compression:\n  rules:\n    - pattern: \"*emb\xe9*\"\n"
                                       "      codec: none\n#@env LIGHTWIRE_JOB_ID=r\xff\n"));
  // Other YAML of the repository (Prometheus): valid YAML, unknown keys.
  out.emplace_back("prometheus", bytesOf(readRepoFile("docker/prometheus/prometheus.yml")));
}

}  // namespace lightwire::fuzz::config_yaml
