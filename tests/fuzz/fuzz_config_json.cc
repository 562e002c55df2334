// Target `config_json`: the body of PUT /v1/config (docs/api.md), as ControlApi::putConfig reads
// it (Boost.JSON, depth at most 16, compressionFromJson()), and then as every peer takes the
// proposal it becomes (fuzz_util.h checkCompression: its JSON reads back the same and every codec
// it can choose builds).
//
// Input: the JSON body.
#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>

#include "proxy/config/config.h"
#include "tests/fuzz/targets.h"

namespace lightwire::fuzz::config_json {

int run(const uint8_t* data, size_t size) {
  boost::system::error_code ec;
  boost::json::parse_options opts;
  opts.max_depth = 16;  // proxy/server/control_api.cc putConfig
  const boost::json::value v = boost::json::parse(textOf({data, size}), ec, {}, opts);
  if (ec) return 0;
  auto c = proxy::compressionFromJson(v);
  if (!c) {
    check(!c.status().message().empty(), "a compression section refused without a message");
    return 0;
  }
  checkCompression(*c);
  return 0;
}

void seeds(Seeds& out) {
  // The bodies of docs/api.md and docs/configuration.md, and each codec with its parameters.
  out.emplace_back("api_example",
                   bytesOf(R"({"default": {"codec": "dgc", "density": 0.01, "momentum": 0.9},
 "rules": [{"pattern": "*.bias", "codec": "none"}, {"max_elements": 4096, "codec": "none"}]})"));
  out.emplace_back("strings_and_null",
                   bytesOf(R"({"chunk_elements": "65536", "default": {"codec": "qsgd", "bits": "4",
 "bucket_size": 256, "error_feedback": null}, "rules": [{"pattern": "decoder.*", "codec": "topk",
 "density": "0.01", "sync_every": 4, "group": "decoder", "min_elements": 10}]})"));
  for (const auto& c : codecConfigs()) {
    proxy::CompressionConfig section;
    section.default_codec = c;
    out.emplace_back("codec_" + c.name + "_" + std::to_string(out.size()),
                     bytesOf(boost::json::serialize(proxy::toJson(section))));
  }
}

}  // namespace lightwire::fuzz::config_json
