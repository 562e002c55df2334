// The serve configuration (proxy/config/config.h): defaults, precedence of file < environment <
// flags, errors naming key and source, codec rules, the JSON forms and the generated --help.
#include <doctest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "proxy/config/config.h"
#include "tests/temp_dir.h"
#include "tests/text.h"

namespace json = boost::json;
using namespace lightwire::proxy;

namespace {

using lightwire::testing::TempDir;

FlagValues flagsOf(std::map<std::string, std::string> values) {
  FlagValues f;
  f.values = std::move(values);
  return f;
}

/// The JSON value at a dotted path of toJson(c).
json::value at(const ServeConfig& c, const std::string& path) {
  json::value v = toJson(c);
  size_t begin = 0;
  while (true) {
    const size_t dot = path.find('.', begin);
    v = v.as_object().at(path.substr(begin, dot == std::string::npos ? path.npos : dot - begin));
    if (dot == std::string::npos) return v;
    begin = dot + 1;
  }
}

/// A YAML file setting one key (nested maps), the value single-quoted.
std::string yamlFor(const std::string& path, const std::string& value) {
  std::string out, indent;
  size_t begin = 0;
  for (size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', begin)) {
    out += indent + path.substr(begin, dot - begin) + ":\n";
    indent += "  ";
    begin = dot + 1;
  }
  std::string quoted;
  for (char ch : value) quoted += ch == '\'' ? std::string("''") : std::string(1, ch);
  return out + indent + path.substr(begin) + ": '" + quoted + "'\n";
}

const ConfigKey& keyOf(const std::string& path) {
  for (const auto& k : serveConfigKeys()) {
    if (k.path == path) return k;
  }
  FAIL("no key " << path);
  throw 0;
}

using lightwire::testing::contains;

}  // namespace

TEST_CASE("config: defaults") {
  std::vector<std::string> warnings;
  auto c = buildServeConfig(std::nullopt, {}, {}, &warnings);
  REQUIRE_MESSAGE(c.isOk(), c.status().message());
  CHECK(warnings.empty());
  CHECK(c->job_id == "default");
  CHECK(c->local_trainers == 1);
  CHECK(c->threads == 0);
  CHECK(c->log_level == "info");
  CHECK(c->control_socket == "/run/lightwire/lightwire.sock");
  REQUIRE(c->control_tcp);
  CHECK(c->control_tcp->host == "127.0.0.1");
  CHECK(c->control_tcp->port == 4780);
  REQUIRE(c->admin_listen);
  CHECK(c->admin_listen->toString() == "0.0.0.0:4782");
  CHECK(c->limits.max_body_bytes == 1073741824u);
  CHECK(c->limits.max_header_bytes == 16384u);
  CHECK(c->limits.idle_timeout_s == 60);
  CHECK(c->limits.step_timeout_s == 120);
  CHECK(c->limits.max_buffers == 1024);
  CHECK(c->limits.max_pending_steps == 4096);
  CHECK(c->limits.header_timeout_s == 10);
  CHECK(c->limits.min_body_rate == 1048576u);
  CHECK(c->limits.unix_socket.max_connections == 256);
  CHECK(c->limits.unix_socket.max_per_source == 0);
  CHECK(c->limits.control_tcp.max_connections == 256);
  CHECK(c->limits.control_tcp.max_per_source == 0);
  CHECK(c->limits.admin.max_connections == 64);
  CHECK(c->limits.admin.max_per_source == 16);
  CHECK(c->token.empty());
  CHECK(c->compression.chunk_elements == 1048576u);
  CHECK(c->compression.default_codec.name == "none");
  CHECK(!c->compression.default_codec.density);
  CHECK(c->compression.default_codec.sample_fraction == 0.01);
  CHECK(!c->compression.default_codec.error_feedback);
  CHECK(c->compression.rules.empty());
  // The policies' defaults are PolicyConfig's own.
  const lightwire::policies::PolicyConfig pd;
  CHECK(c->policies.anomaly == pd.anomaly);
  CHECK(c->policies.bypass_steps == pd.bypass_steps);
  CHECK(c->policies.explode_factor == pd.explode_factor);
  CHECK(c->policies.vanish_factor == pd.vanish_factor);
  CHECK(c->policies.ewma_alpha == pd.ewma_alpha);
  CHECK(c->policies.full_sync_every == pd.full_sync_every);
  CHECK(c->policies.rollback == pd.rollback);
  CHECK(c->policies.min_magnitude == pd.min_magnitude);
  CHECK(c->policies.decision_log == pd.decision_log);
  // The schedules are on by default (PolicyConfig's own defaults have them off).
  CHECK(pd.warmup_steps == 0);
  CHECK(pd.powersgd_start_step == 0);
  CHECK(c->policies.warmup_steps == lightwire::proxy::kDefaultWarmupSteps);
  CHECK(c->policies.powersgd_start_step == lightwire::proxy::kDefaultPowersgdStartStep);
  CHECK(c->policies.warmup_steps > 0);
  CHECK(c->policies.powersgd_start_step > 0);
  CHECK(c->compression.layers.dense_max_ndim == 1u);
  CHECK(c->compression.layers.dense_max_elements == 8192u);
  CHECK(c->compression.layers.powersgd_min_ratio == 2.0);
  CHECK(c->policies.adaptive == pd.adaptive);
  CHECK(c->policies.adaptive_min_ratio == pd.adaptive_min_ratio);
  CHECK(lightwire::policies::validate(c->policies).isOk());
  CHECK(c->state.dir == "/var/lib/lightwire");
  CHECK(c->state.checkpoint_every == 1000u);
  CHECK(c->state.keep == 3u);
  CHECK(!c->state.fresh);
  // The table's defaults and the struct's initialisers agree.
  const ServeConfig initialised;
  CHECK(json::serialize(toJson(*c)) == json::serialize(toJson(initialised)));
}

TEST_CASE("config: every key: file < environment < flag") {
  // The secret files exist: they are read once all sources are merged.
  TempDir secrets;
  std::vector<std::string> secret_files;
  for (const char* name : {"s1", "s2", "s3"}) {
    secret_files.push_back(secrets.write(name, std::string("secret-") + name));
    ::chmod(secret_files.back().c_str(), 0600);
  }
  // Three valid values per key, for the file, the environment and the flag.
  const std::map<std::string, std::vector<std::string>> values = {
      {"peer.secret_file", secret_files},
      {"security.token_file", secret_files},
      {"job_id", {"a", "b", "c"}},
      {"local_trainers", {"2", "3", "4"}},
      {"threads", {"1", "2", "3"}},
      {"gpu", {"false", "true", "off"}},
      {"log_level", {"debug", "warn", "error"}},
      {"log_format", {"json", "text", "json"}},
      {"control.socket", {"/tmp/a.sock", "/tmp/b.sock", ""}},
      {"control.tcp", {"127.0.0.1:1", "[::1]:2", ""}},
      {"control.socket_mode", {"0600", "0640", "0620"}},
      {"admin.listen", {"0.0.0.0:1", "localhost:0", ""}},
      {"limits.max_body_bytes", {"10", "20", "30"}},
      {"limits.max_inflight_body_bytes", {"4096", "8192", "16384"}},
      {"limits.max_header_bytes", {"2048", "4096", "8192"}},
      {"limits.idle_timeout_s", {"1.5", "2.5", "3.5"}},
      {"limits.step_timeout_s", {"1.5", "2.5", "3.5"}},
      {"limits.max_buffers", {"2", "3", "4"}},
      {"limits.max_buffers_per_client", {"2", "3", "4"}},
      {"limits.max_pending_steps", {"2", "3", "4"}},
      {"limits.header_timeout_s", {"1.5", "2.5", "3.5"}},
      {"limits.min_body_rate", {"0", "1000", "2000"}},
      {"limits.unix.max_connections", {"2", "3", "4"}},
      {"limits.unix.max_per_uid", {"2", "3", "4"}},
      {"limits.control_tcp.max_connections", {"2", "3", "4"}},
      {"limits.control_tcp.max_per_source", {"2", "3", "4"}},
      {"limits.admin.max_connections", {"2", "3", "4"}},
      {"limits.admin.max_per_source", {"0", "3", "4"}},
      {"limits.max_state_bytes", {"1000", "2000", "3000"}},
      {"limits.max_pool_bytes", {"0", "4096", "8192"}},
      {"limits.drop_state_after_steps", {"10", "20", "30"}},
      {"security.token", {"tok-file", "tok-env", "tok-flag"}},
      {"compression.chunk_elements", {"2", "3", "4"}},
      {"compression.layers.dense_max_ndim", {"0", "2", "3"}},
      {"compression.layers.dense_max_elements", {"0", "100", "65536"}},
      {"compression.layers.powersgd_min_ratio", {"0", "1.5", "4"}},
      {"rank", {"1", "2", "3"}},
      {"world_size", {"2", "3", "4"}},
      {"peer.listen", {"0.0.0.0:1", "127.0.0.1:0", "[::]:4781"}},
      {"peer.peers", {"a:1,b:2", "127.0.0.1:1", "h:1,h:2,h:3"}},
      {"peer.secret", {"s-file", "s-env", "s-flag"}},
      {"peer.timeout_s", {"1.5", "2.5", "3.5"}},
      {"peer.checksum_every", {"0", "10", "1000"}},
      {"peer.transport", {"ucx", "tcp", "ucx"}},
      {"schedule.warmup_steps", {"50", "100", "5000"}},
      {"schedule.powersgd_start_step", {"0", "10", "1000"}},
      {"schedule.total_steps", {"100", "1000", "0"}},
      {"schedule.phase_factor", {"1", "2", "8"}},
      {"schedule.adaptive", {"true", "no", "On"}},
      {"schedule.adaptive_tiny", {"0.5", "0.1", "0.001"}},
      {"schedule.adaptive_sparse", {"1", "0.5", "0.99"}},
      {"schedule.adaptive_max_ratio", {"100", "200", "300"}},
      {"schedule.adaptive_min_ratio", {"1", "20", "40"}},
      {"policies.anomaly", {"off", "YES", "0"}},
      {"policies.bypass_steps", {"1", "5", "20"}},
      {"policies.explode_factor", {"1.5", "20", "100"}},
      {"policies.vanish_factor", {"0.5", "0.01", "1e-9"}},
      {"policies.ewma_alpha", {"1", "0.5", "0.01"}},
      {"policies.baseline_steps", {"1", "2", "100"}},
      {"policies.full_sync_every", {"0", "50", "100"}},
      {"policies.rollback", {"false", "1", "no"}},
      {"policies.cosine_drop", {"0.9", "0.5", "0.1"}},
      {"policies.loss_rise", {"0.1", "1", "10"}},
      {"policies.reward_drop", {"0.5", "2", "10"}},
      {"policies.reward_drop_sigma", {"1", "2.5", "4"}},
      {"policies.patience", {"1", "2", "5"}},
      {"policies.cooldown_steps", {"0", "5", "7"}},
      {"policies.known_good_steps", {"0", "1", "2"}},
      {"policies.min_magnitude", {"0", "1e-3", "0.5"}},
      {"policies.decision_log", {"1", "100", "100000"}},
      {"state.dir", {"/tmp/a", "", "rel/dir"}},
      {"state.checkpoint_every", {"0", "10", "20"}},
      {"state.keep", {"1", "5", "1000"}},
      {"state.keep_trainer", {"2", "7", "1000000"}},
      {"state.fresh", {"TRUE", "off", "yes"}},
      {"peer.topology", {"ps", "ring", "ps"}},
      {"peer.sparse", {"allreduce", "allgather", "allreduce"}},
      {"peer.ps_rank", {"1", "2", "3"}},
      {"peer.synchrony", {"bounded-staleness", "sync", "bounded-staleness"}},
      {"peer.staleness", {"1", "4", "9"}},
      {"peer.straggler_wait_s", {"0.5", "0.25", "0.125"}},
      {"peer.rendezvous", {"a:1", "b:2", "c:3"}},
      {"peer.advertise", {"a:4", "b:5", "[::1]:6"}},
      {"peer.tls.enabled", {"true", "no", "on"}},
      {"peer.tls.cert_file", {"/etc/a.pem", "b.pem", ""}},
      {"peer.tls.key_file", {"/etc/a.key", "b.key", ""}},
      {"peer.tls.ca_file", {"/etc/ca.pem", "ca2.pem", ""}},
      {"peer.tls.verify", {"false", "yes", "0"}},
      {"compression.default.codec", {"fp16", "signsgd", "terngrad"}},
      {"compression.default.density", {"0.1", "0.2", "0.3"}},
      {"compression.default.ratio", {"2", "3", "4"}},
      {"compression.default.bits", {"2", "3", "4"}},
      {"compression.default.bucket_size", {"64", "128", "256"}},
      {"compression.default.momentum", {"0.1", "0.2", "0.3"}},
      {"compression.default.clip_norm", {"1", "2", "3"}},
      {"compression.default.sample_fraction", {"0.001", "0.002", "0.003"}},
      {"compression.default.bias_correction", {"true", "false", "on"}},
      {"compression.default.values", {"float16", "float32", "float16"}},
      {"compression.default.threshold", {"0.1", "0.2", "0.3"}},
      {"compression.default.error_feedback", {"true", "off", "on"}},
      {"compression.default.approx_rank", {"2", "3", "4"}},
      {"compression.auto.ladder", {"none,fp16", "direct,none,dgc:0.01@2", "bf16,qsgd:4"}},
      {"compression.auto.period", {"2", "3", "4"}},
      {"compression.auto.hysteresis", {"1", "3", "4"}},
      {"compression.auto.tolerance", {"0.1", "0.2", "0.3"}},
      {"compression.auto.link_change", {"0.1", "0.2", "0.5"}},
      {"compression.auto.momentum_margin", {"0", "0.5", "1"}},
      {"compression.auto.critical_steps", {"5", "10", "100"}},
      {"compression.auto.critical_change", {"0.1", "0.2", "1"}},
      {"compression.auto.critical_hold", {"0", "5", "10"}},
      {"compression.auto.probe_every", {"4", "8", "32"}},
  };
  TempDir dir;
  for (const auto& k : serveConfigKeys()) {
    CAPTURE(k.path);
    auto it = values.find(k.path);
    REQUIRE_MESSAGE(it != values.end(), "no test values for " << k.path);
    const auto& v = it->second;
    const std::string file = dir.write("c.yaml", yamlFor(k.path, v[0]));
    const std::vector<std::string> env = {k.env + "=" + v[1]};
    const FlagValues flag = flagsOf({{k.path, v[2]}});

    auto get = [&](const ServeConfig& c) -> std::string {
      if (k.path == "peer.secret") return c.peer.secret;  // toJson() shows "<redacted>"
      if (k.secret) return c.token;
      return json::serialize(at(c, k.path));
    };
    auto build = [&](bool f, bool e, bool fl) {
      std::vector<std::string> w;
      auto c = buildServeConfig(f ? std::optional(file) : std::nullopt,
                                e ? env : std::vector<std::string>{}, fl ? flag : FlagValues{}, &w);
      REQUIRE_MESSAGE(c.isOk(), c.status().message());
      return get(*c);
    };
    const std::string only_file = build(true, false, false);
    const std::string only_env = build(false, true, false);
    const std::string only_flag = build(false, false, true);
    const std::string none = build(false, false, false);
    CHECK(only_file != none);
    CHECK(only_file != only_env);
    CHECK(only_env != only_flag);
    CHECK(build(true, true, false) == only_env);
    CHECK(build(true, false, true) == only_flag);
    CHECK(build(false, true, true) == only_flag);
    CHECK(build(true, true, true) == only_flag);
  }
}

TEST_CASE("config: bad values name the key and the source, from every source") {
  struct Bad {
    std::string path, raw, says;
  };
  const std::vector<Bad> bad = {
      {"job_id", "", "must not be empty"},
      {"compression.auto.ladder", "direct", "needs a rung through the sidecar"},
      {"compression.auto.ladder", "fp16,direct", "'direct' can only be the first rung"},
      {"compression.auto.ladder", "none,qsgd:9", "rung 2 ('qsgd:9'): qsgd needs its bits"},
      {"compression.auto.ladder", "none,dgc:0.01@0.5", "steps factor"},
      {"compression.auto.period", "0", ""},
      {"compression.auto.tolerance", "-1", "[0, 10]"},
      {"local_trainers", "0", "1..1024"},
      {"local_trainers", "1025", "1..1024"},
      {"local_trainers", "-1", "1..1024"},
      {"local_trainers", "+1", "1..1024"},
      {"local_trainers", "1e3", "1..1024"},
      {"local_trainers", "12abc", "1..1024"},
      {"local_trainers", " 2", "1..1024"},
      {"local_trainers", "99999999999999999999", "1..1024"},
      {"threads", "1025", "0..1024"},
      {"threads", "1.5", "0..1024"},
      {"log_level", "loud", "trace, debug"},
      {"log_level", "INFO", "trace, debug"},
      {"log_format", "xml", "text or json"},
      {"control.tcp", "nohost", "host:port"},
      {"control.socket_mode", "0666", "others"},
      {"control.socket_mode", "0400", "read and write"},
      {"control.socket_mode", "0770", "execute"},
      {"control.socket_mode", "rw", "octal"},
      {"limits.max_buffers_per_client", "0", ""},
      {"control.tcp", "127.0.0.1:70000", "host:port"},
      {"control.tcp", "127.0.0.1:-1", "host:port"},
      {"control.tcp", ":4780", "host:port"},
      {"control.tcp", "::1:4780", "host:port"},
      {"control.tcp", "[::1]", "host:port"},
      {"admin.listen", "0.0.0.0:", "host:port"},
      {"compression.layers.dense_max_ndim", "65", "0..64"},
      {"compression.layers.dense_max_ndim", "-1", "0..64"},
      {"compression.layers.dense_max_elements", "many", "integer"},
      {"compression.layers.powersgd_min_ratio", "-0.5", ">= 0"},
      {"compression.layers.powersgd_min_ratio", "nan", ">= 0"},
      {"schedule.powersgd_start_step", "-1", "integer"},
      {"limits.max_body_bytes", "abc", "must be a positive integer"},
      {"limits.max_body_bytes", "0", "must be a positive integer"},
      {"limits.max_body_bytes", "18446744073709551616", "must be a positive integer"},
      {"limits.max_inflight_body_bytes", "-1", "integer"},
      {"limits.max_inflight_body_bytes", "1e9", "integer"},
      {"limits.max_header_bytes", "100", "1024..1048576"},
      {"limits.idle_timeout_s", "0", "> 0"},
      {"limits.idle_timeout_s", "-1", "> 0"},
      {"limits.idle_timeout_s", "nan", "> 0"},
      {"limits.idle_timeout_s", "inf", "> 0"},
      {"limits.step_timeout_s", "1e300", "> 0"},
      {"limits.max_buffers", "2147483648", "1..2147483647"},
      {"limits.unix.max_connections", "0", "1..2147483647"},
      {"limits.control_tcp.max_connections", "-1", "1..2147483647"},
      {"limits.admin.max_connections", "x", "1..2147483647"},
      {"limits.admin.max_per_source", "-1", "0..2147483647"},
      {"limits.unix.max_per_uid", "1.5", "0..2147483647"},
      {"limits.header_timeout_s", "0", "> 0"},
      {"limits.min_body_rate", "-5", "integer"},
      {"compression.chunk_elements", "0", "positive integer"},
      {"compression.default.density", "2", "(0, 1]"},
      {"compression.default.density", "0", "(0, 1]"},
      {"compression.default.ratio", "0.5", ">= 1"},
      {"compression.default.bits", "-1", "0..2147483647"},
      {"compression.default.bucket_size", "4294967296", "0..4294967295"},
      {"compression.default.momentum", "x", "finite number"},
      {"compression.default.values", "bfloat16", "float32 or float16"},
      {"compression.default.error_feedback", "maybe", "true, false, on or off"},
      {"compression.default.codec", "", "codec name"},
      {"policies.anomaly", "maybe", "true or false"},
      {"policies.anomaly", "", "true or false"},
      {"policies.anomaly", "2", "true or false"},
      {"policies.anomaly", "truee", "true or false"},
      {"policies.anomaly", " true", "true or false"},
      {"policies.rollback", "y", "true or false"},
      {"schedule.adaptive", "enable", "true or false"},
      {"state.fresh", "-1", "true or false"},
      {"policies.bypass_steps", "0", "1..4294967295"},
      {"policies.bypass_steps", "4294967296", "1..4294967295"},
      {"policies.explode_factor", "1", "must be a number > 1"},
      {"policies.explode_factor", "inf", "must be a number > 1"},
      {"policies.vanish_factor", "0", "in (0, 1)"},
      {"policies.vanish_factor", "1", "in (0, 1)"},
      {"policies.ewma_alpha", "0", "in (0, 1]"},
      {"policies.ewma_alpha", "1.01", "in (0, 1]"},
      {"policies.baseline_steps", "0", "1..4294967295"},
      {"policies.full_sync_every", "-1", "non-negative integer"},
      {"policies.cosine_drop", "0", "in (0, 1)"},
      {"policies.cosine_drop", "1", "in (0, 1)"},
      {"policies.loss_rise", "0", "> 0"},
      {"policies.reward_drop", "0", "> 0 (\"\" = unset)"},
      {"policies.reward_drop", "-1", "> 0"},
      {"policies.reward_drop", "inf", "> 0"},
      {"policies.reward_drop_sigma", "0", "> 0 (\"\" = unset)"},
      {"policies.reward_drop_sigma", "x", "> 0"},
      {"policies.patience", "0", "1..4294967295"},
      {"policies.cooldown_steps", "-1", "0..4294967295"},
      {"policies.known_good_steps", "x", "0..4294967295"},
      {"policies.min_magnitude", "-1e-9", ">= 0"},
      {"policies.min_magnitude", "nan", ">= 0"},
      {"policies.decision_log", "0", "1..100000"},
      {"policies.decision_log", "100001", "1..100000"},
      {"schedule.warmup_steps", "-1", "non-negative integer"},
      {"schedule.total_steps", "1.5", "non-negative integer"},
      {"schedule.phase_factor", "0.5", ">= 1"},
      {"schedule.adaptive_tiny", "1", "in (0, 1)"},
      {"schedule.adaptive_sparse", "0", "in (0, 1]"},
      {"schedule.adaptive_max_ratio", "0.5", ">= 1"},
      {"schedule.adaptive_min_ratio", "0", ">= 1"},
      {"state.checkpoint_every", "-5", "non-negative integer"},
      {"state.keep", "0", "1..1000"},
      {"state.keep", "1001", "1..1000"},
      {"state.keep_trainer", "1000001", "0..1000000"},
      {"state.keep_trainer", "-1", "0..1000000"},
  };
  TempDir dir;
  for (const auto& b : bad) {
    CAPTURE(b.path);
    CAPTURE(b.raw);
    const ConfigKey& k = keyOf(b.path);
    const std::string file = dir.write("bad.yaml", yamlFor(b.path, b.raw));
    auto f = buildServeConfig(file, {}, {}, nullptr);
    REQUIRE(!f.isOk());
    const std::string& fm = f.status().message();
    CAPTURE(fm);
    CHECK(fm.rfind("file " + file + ": " + b.path + " ", 0) == 0);
    CHECK(contains(fm, b.says));
    CHECK(contains(fm, "got '" + b.raw + "'"));

    auto e = buildServeConfig(std::nullopt, {k.env + "=" + b.raw}, {}, nullptr);
    REQUIRE(!e.isOk());
    const std::string& em = e.status().message();
    CAPTURE(em);
    CHECK(em.rfind("environment " + k.env + ": " + b.path + " ", 0) == 0);
    CHECK(contains(em, b.says));

    auto fl = buildServeConfig(std::nullopt, {}, flagsOf({{b.path, b.raw}}), nullptr);
    REQUIRE(!fl.isOk());
    const std::string& flm = fl.status().message();
    CAPTURE(flm);
    CHECK(flm.rfind("flag " + k.flag + ": " + b.path + " ", 0) == 0);
    CHECK(contains(flm, b.says));
  }
}

TEST_CASE("config: a bad token is refused without showing it") {
  auto c = buildServeConfig(std::nullopt, {"LIGHTWIRE_SECURITY__TOKEN=has space"}, {}, nullptr);
  REQUIRE(!c.isOk());
  CHECK(contains(c.status().message(), "environment LIGHTWIRE_SECURITY__TOKEN: security.token"));
  CHECK(!contains(c.status().message(), "has space"));
}

TEST_CASE("config: YAML structure errors name the key, never throw") {
  TempDir dir;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"limits: 5\n", "limits must be a map"},
      {"limits:\n  max_buffers: [1, 2]\n", "limits.max_buffers must be a single value"},
      {"limits:\n  max_buffers: {a: 1}\n", "limits.max_buffers must be a single value"},
      {"job_id:\n  x: 1\n", "job_id must be a single value"},
      {"compression:\n  rules: {a: 1}\n", "compression.rules must be a list"},
      {"compression:\n  rules: [5]\n", "compression.rules[0] must be a map"},
      {"- a\n- b\n", "the top level must be a map"},
      {"limits: [\n", "invalid YAML at line"},
      {"? [a, b]\n: 1\n", "not a plain name"},
      {"limits:\n  max_bodies: 1\n", "unknown key 'limits.max_bodies'"},
      {"peer:\n  port: 1\n", "unknown key 'peer.port'"},
      {"compression:\n  default:\n    desnity: 0.1\n", "unknown key 'compression.default.desnity'"},
  };
  for (const auto& entry : cases) {
    // Not a structured binding: clang 14 cannot capture one in CAPTURE's lambda.
    const auto& text = entry.first;
    const auto& says = entry.second;
    CAPTURE(text);
    const std::string file = dir.write("s.yaml", text);
    auto c = buildServeConfig(file, {}, {}, nullptr);
    REQUIRE(!c.isOk());
    CHECK(c.status().message().rfind("file " + file + ": ", 0) == 0);
    CHECK_MESSAGE(contains(c.status().message(), says), c.status().message());
  }
  // An empty file and a null value are fine (nothing set).
  auto empty = buildServeConfig(dir.write("e.yaml", ""), {}, {}, nullptr);
  CHECK_MESSAGE(empty.isOk(), empty.status().message());
  auto null_section = buildServeConfig(dir.write("n.yaml", "limits:\n"), {}, {}, nullptr);
  CHECK(null_section.isOk());
}

TEST_CASE("config: a missing or unreadable file is an error naming it") {
  TempDir dir;
  const std::string missing = dir.path() + "/nope.yaml";
  auto c = buildServeConfig(missing, {}, {}, nullptr);
  REQUIRE(!c.isOk());
  CHECK(contains(c.status().message(), missing));
  auto d = buildServeConfig(dir.path(), {}, {}, nullptr);  // a directory
  REQUIRE(!d.isOk());
  CHECK(contains(d.status().message(), dir.path()));
}

TEST_CASE("config: a full file") {
  TempDir dir;
  const std::string file = dir.write("full.yaml", R"(
job_id: resnet
local_trainers: 8
threads: 16
log_level: debug
control:
  socket: /tmp/lw.sock
  tcp: "[::1]:0"
admin:
  listen: ""
limits:
  max_body_bytes: 2147483648
  idle_timeout_s: 30
security:
  token: abc
compression:
  chunk_elements: 262144
  default:
    codec: topk
    density: 0.01
    values: float16
    error_feedback: on
)");
  auto c = buildServeConfig(file, {}, {}, nullptr);
  REQUIRE_MESSAGE(c.isOk(), c.status().message());
  CHECK(c->job_id == "resnet");
  CHECK(c->local_trainers == 8);
  CHECK(c->threads == 16);
  CHECK(c->control_socket == "/tmp/lw.sock");
  REQUIRE(c->control_tcp);
  CHECK(c->control_tcp->host == "::1");
  CHECK(c->control_tcp->port == 0);
  CHECK(!c->admin_listen);
  CHECK(c->limits.max_body_bytes == 2147483648u);
  CHECK(c->limits.idle_timeout_s == 30);
  CHECK(c->token == "abc");
  CHECK(c->compression.chunk_elements == 262144u);
  CHECK(c->compression.default_codec.name == "topk");
  CHECK(c->compression.default_codec.density == 0.01);
  CHECK(c->compression.default_codec.sparse_values == lightwire::kernels::DType::kF16);
  CHECK(c->compression.default_codec.error_feedback == true);
}

TEST_CASE("config: unknown LIGHTWIRE_* variables are warnings; others are ignored") {
  std::vector<std::string> w;
  auto c = buildServeConfig(std::nullopt,
                            {"LIGHTWIRE_BOGUS=1", "PATH=/bin", "LIGHTWIRE_THREADS=2",
                             "LIGHTWIRE_COMPRESSION__RULES=x", "NOEQUALS", "LIGHTWIRE_JOB_ID"},
                            {}, &w);
  REQUIRE_MESSAGE(c.isOk(), c.status().message());
  CHECK(c->threads == 2);
  REQUIRE(w.size() == 2);
  CHECK(contains(w[0] + w[1], "LIGHTWIRE_BOGUS"));
  CHECK(contains(w[0] + w[1], "LIGHTWIRE_COMPRESSION__RULES"));
  // Null warnings pointer is allowed.
  CHECK(buildServeConfig(std::nullopt, {"LIGHTWIRE_BOGUS=1"}, {}, nullptr).isOk());
}

TEST_CASE("config: LIGHTWIRE_SOCKET is an alias of control.socket") {
  auto a = buildServeConfig(std::nullopt, {"LIGHTWIRE_SOCKET=/tmp/alias.sock"}, {}, nullptr);
  REQUIRE(a.isOk());
  CHECK(a->control_socket == "/tmp/alias.sock");

  std::vector<std::string> w;
  auto both = buildServeConfig(
      std::nullopt,
      {"LIGHTWIRE_CONTROL__SOCKET=/tmp/specific.sock", "LIGHTWIRE_SOCKET=/tmp/a.sock"}, {}, &w);
  REQUIRE(both.isOk());
  CHECK(both->control_socket == "/tmp/specific.sock");
  REQUIRE(w.size() == 1);
  CHECK(contains(w[0], "overrides LIGHTWIRE_SOCKET"));

  auto flag = buildServeConfig(std::nullopt, {"LIGHTWIRE_SOCKET=/tmp/a.sock"},
                               flagsOf({{"control.socket", "/tmp/flag.sock"}}), nullptr);
  REQUIRE(flag.isOk());
  CHECK(flag->control_socket == "/tmp/flag.sock");

  auto bad =
      buildServeConfig(std::nullopt, {"LIGHTWIRE_SOCKET=/" + std::string(200, 'x')}, {}, nullptr);
  REQUIRE(!bad.isOk());
  CHECK(bad.status().message().rfind("environment LIGHTWIRE_SOCKET: control.socket", 0) == 0);
}

TEST_CASE("config: IPv6 listen addresses") {
  auto c = buildServeConfig(std::nullopt, {"LIGHTWIRE_ADMIN__LISTEN=[::]:9000"},
                            flagsOf({{"control.tcp", "[::1]:4780"}}), nullptr);
  REQUIRE(c.isOk());
  CHECK(c->control_tcp->host == "::1");
  CHECK(c->control_tcp->port == 4780);
  CHECK(c->admin_listen->host == "::");
  CHECK(c->admin_listen->port == 9000);
  CHECK(at(*c, "control.tcp").as_string() == "[::1]:4780");
  CHECK(at(*c, "admin.listen").as_string() == "[::]:9000");
  CHECK(ListenAddress{"127.0.0.1", 80}.toString() == "127.0.0.1:80");
}

TEST_CASE("config: rules: pattern, size bounds, first match wins, no inheritance") {
  TempDir dir;
  const std::string file = dir.write("rules.yaml", R"(
compression:
  default:
    codec: topk
    density: 0.01
    values: float16
    error_feedback: off
  rules:
    - pattern: "embed*"
      codec: qsgd
      bits: 4
    - min_elements: 0
      max_elements: 1000
      codec: none
    - pattern: "*.bias"
      min_elements: 2000
      codec: topk
      ratio: 10
    - pattern: "*.bias"
      codec: randomk
      density: 0.5
)");
  auto c = buildServeConfig(file, {}, {}, nullptr);
  REQUIRE_MESSAGE(c.isOk(), c.status().message());
  const CompressionConfig& cc = c->compression;
  REQUIRE(cc.rules.size() == 4);
  CHECK(cc.codecFor("embed.weight", 10).name == "qsgd");  // rule 0 before rule 1
  CHECK(cc.codecFor("embed.weight", 10).bits == 4);
  CHECK(cc.codecFor("fc.bias", 10).name == "none");  // size bounds, inclusive
  CHECK(cc.codecFor("fc.bias", 1000).name == "none");
  CHECK(cc.codecFor("fc.bias", 1001).name == "randomk");  // rule 2 needs >= 2000
  const auto& topk = cc.codecFor("fc.bias", 5000);
  CHECK(topk.name == "topk");
  CHECK(topk.ratio == 10);
  CHECK(!topk.density);                                          // not the default's 0.01
  CHECK(topk.sparse_values == lightwire::kernels::DType::kF32);  // not the default's float16
  CHECK(!topk.error_feedback);                                   // not the default's off
  CHECK(&cc.codecFor("fc.weight", 5000) == &cc.default_codec);
  CHECK(cc.codecFor("fc.weight", 5000).density == 0.01);
  CHECK(cc.codecFor("xembed", 1u << 20).name == "topk");  // the glob is anchored
}

TEST_CASE("config: bad rules name compression.rules[i]") {
  TempDir dir;
  const std::string good_rule = "    - {pattern: 'a*', codec: none}\n";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"    - {codec: topk, density: 2}\n", "compression.rules[1].density must be"},
      {"    - {codec: qsgd, bits: 9}\n", "compression.rules[1]: qsgd"},
      {"    - {codec: topk}\n", "compression.rules[1]: topk"},
      {"    - {codec: zip}\n", "compression.rules[1]: unknown codec 'zip'"},
      {"    - {pattern: 'x*'}\n", "compression.rules[1].codec is required"},
      {"    - {codec: none, bogus: 1}\n", "unknown key 'compression.rules[1].bogus'"},
      {"    - {codec: none, min_elements: -1}\n", "compression.rules[1].min_elements"},
      {"    - {codec: none, min_elements: 5, max_elements: 4}\n", "compression.rules[1]: min"},
      {"    - {codec: none, pattern: ''}\n", "compression.rules[1].pattern"},
      {"    - {codec: [none]}\n", "compression.rules[1].codec must be a single value"},
      {"    - {codec: none, sync_every: 0}\n",
       "compression.rules[1].sync_every must be an integer in 1..1000000, got '0'"},
      {"    - {codec: none, sync_every: 1000001}\n", "compression.rules[1].sync_every must be"},
      {"    - {codec: none, sync_every: -1}\n", "compression.rules[1].sync_every must be"},
      {"    - {codec: none, sync_every: 1.5}\n", "compression.rules[1].sync_every must be"},
      {"    - {codec: none, sync_every: [2]}\n",
       "compression.rules[1].sync_every must be a single"},
      {"    - {codec: none, group: 'has space'}\n",
       "compression.rules[1].group must be 1..64 characters of A-Z a-z 0-9 _ . -"},
      {"    - {codec: none, group: 'a/b'}\n", "compression.rules[1].group must be"},
      {"    - {codec: none, group: 'a:b'}\n", "compression.rules[1].group must be"},
      {"    - {codec: none, group: 'a\"b'}\n", "compression.rules[1].group must be"},
      {"    - {codec: none, group: 'gr\u00fcn'}\n", "compression.rules[1].group must be"},
      {"    - {codec: none, group: '" + std::string(65, 'g') + "'}\n",
       "compression.rules[1].group must be"},
  };
  for (const auto& entry : cases) {
    // Not a structured binding: clang 14 cannot capture one in CAPTURE's lambda.
    const auto& rule = entry.first;
    const auto& says = entry.second;
    CAPTURE(rule);
    const std::string file = dir.write("r.yaml", "compression:\n  rules:\n" + good_rule + rule);
    auto c = buildServeConfig(file, {}, {}, nullptr);
    REQUIRE(!c.isOk());
    CHECK(c.status().message().rfind("file " + file + ": ", 0) == 0);
    CHECK_MESSAGE(contains(c.status().message(), says), c.status().message());
  }
}

TEST_CASE("config: the default codec is validated with createCodec, naming the sources") {
  TempDir dir;
  const std::string file =
      dir.write("d.yaml", "compression:\n  default:\n    codec: topk\n    density: 0.1\n");
  auto c = buildServeConfig(file, {}, flagsOf({{"compression.default.ratio", "10"}}), nullptr);
  REQUIRE(!c.isOk());
  const std::string& m = c.status().message();
  CHECK(m.rfind("compression.default: topk", 0) == 0);
  CHECK(contains(m, "density from file " + file));
  CHECK(contains(m, "ratio from flag --ratio"));

  auto q = buildServeConfig(std::nullopt, {"LIGHTWIRE_COMPRESSION__DEFAULT__CODEC=qsgd"},
                            flagsOf({{"compression.default.bits", "1"}}), nullptr);
  REQUIRE(!q.isOk());
  CHECK(contains(q.status().message(), "bits"));
  CHECK(contains(q.status().message(), "environment LIGHTWIRE_COMPRESSION__DEFAULT__CODEC"));

  // An override can clear an optional value the file set ("" = unset).
  auto ok = buildServeConfig(file, {"LIGHTWIRE_COMPRESSION__DEFAULT__DENSITY="},
                             flagsOf({{"compression.default.ratio", "10"}}), nullptr);
  REQUIRE_MESSAGE(ok.isOk(), ok.status().message());
  CHECK(!ok->compression.default_codec.density);
  CHECK(ok->compression.default_codec.ratio == 10);
}

TEST_CASE("config: compressionFromJson") {
  auto good = compressionFromJson(json::parse(R"({
    "chunk_elements": 4096,
    "default": {"codec": "topk", "density": 0.05, "error_feedback": false, "bits": 8.0},
    "rules": [{"pattern": "a*", "max_elements": 100, "codec": "qsgd", "bits": 4}]
  })"));
  REQUIRE_MESSAGE(good.isOk(), good.status().message());
  CHECK(good->chunk_elements == 4096u);
  CHECK(good->default_codec.name == "topk");
  CHECK(good->default_codec.density == 0.05);
  CHECK(good->default_codec.error_feedback == false);
  REQUIRE(good->rules.size() == 1);
  CHECK(good->codecFor("ab", 100).bits == 4);
  CHECK(good->codecFor("ab", 101).name == "topk");

  // Round trip through toJson.
  auto again = compressionFromJson(toJson(*good));
  REQUIRE_MESSAGE(again.isOk(), again.status().message());
  CHECK(json::serialize(toJson(*again)) == json::serialize(toJson(*good)));

  auto empty = compressionFromJson(json::object());
  REQUIRE(empty.isOk());
  CHECK(empty->default_codec.name == "none");
  CHECK(empty->chunk_elements == 1048576u);

  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"({"default": {"density": "x"}})", "compression.default.density must be"},
      {R"({"default": {"density": 1.5}})", "compression.default.density must be"},
      {R"({"default": {"codec": "topk"}})", "compression.default: topk"},
      {R"({"default": {"bits": -3}})", "compression.default.bits"},
      {R"({"default": {"bits": 2.5}})", "compression.default.bits"},
      {R"({"default": 3})", "compression.default must be a map"},
      {R"({"rules": [{"codec": "qsgd", "bits": 9}]})", "compression.rules[0]: qsgd"},
      {R"({"rules": [{"codec": "none", "x": 1}]})", "unknown key 'compression.rules[0].x'"},
      {R"({"rules": {}})", "compression.rules must be a list"},
      {R"({"bogus": 1})", "unknown key 'compression.bogus'"},
      {R"({"chunk_elements": 0})", "compression.chunk_elements"},
      {R"({"rules": [{"codec": "none", "sync_every": 0}]})", "compression.rules[0].sync_every"},
      {R"({"rules": [{"codec": "none", "sync_every": 2.5}]})", "compression.rules[0].sync_every"},
      {R"({"rules": [{"codec": "none", "sync_every": true}]})", "compression.rules[0].sync_every"},
      {R"({"rules": [{"codec": "none", "group": "a b"}]})", "compression.rules[0].group must be"},
      {R"({"rules": [{"codec": "none", "group": "a,b"}]})", "compression.rules[0].group must be"},
      {R"({"rules": [{"codec": "none", "group": ["a"]}]})",
       "compression.rules[0].group must be a single value"},
      {R"([1])", "compression must be a JSON object"},
  };
  for (const auto& entry : bad) {
    // Not a structured binding: clang 14 cannot capture one in CAPTURE's lambda.
    const auto& text = entry.first;
    const auto& says = entry.second;
    CAPTURE(text);
    auto r = compressionFromJson(json::parse(text));
    REQUIRE(!r.isOk());
    CHECK_MESSAGE(contains(r.status().message(), says), r.status().message());
  }
}

TEST_CASE("config: toJson redacts the token") {
  const std::string secret = "s3cr3t-T0KEN-value";
  std::vector<std::string> w;
  auto c = buildServeConfig(std::nullopt, {"LIGHTWIRE_SECURITY__TOKEN=" + secret}, {}, &w);
  REQUIRE(c.isOk());
  CHECK(c->token == secret);
  const std::string text = json::serialize(toJson(*c));
  CHECK(!contains(text, secret));
  CHECK(!contains(text, "s3cr3t"));
  CHECK(at(*c, "security.token").as_string() == "<redacted>");

  auto unset = buildServeConfig(std::nullopt, {}, {}, nullptr);
  REQUIRE(unset.isOk());
  CHECK(at(*unset, "security.token").as_string() == "");

  // A token given as a flag works but is warned about.
  auto flag = buildServeConfig(std::nullopt, {}, flagsOf({{"security.token", secret}}), &w);
  REQUIRE(flag.isOk());
  REQUIRE(w.size() == 1);
  CHECK(contains(w[0], "LIGHTWIRE_SECURITY__TOKEN"));
  CHECK(!contains(w[0], secret));
}

TEST_CASE("config: CLI11 flags and --help come from the table") {
  CLI::App app{"test", "lightwire"};
  CLI::App* serve = app.add_subcommand("serve", "Run the sidecar");
  FlagValues flags;
  addServeFlags(*serve, flags);
  const std::string help = serve->help();
  CHECK(contains(help, "--config"));
  for (const auto& k : serveConfigKeys()) {
    CAPTURE(k.flag);
    CHECK(contains(help, k.flag));
    CHECK(contains(help, k.env));
  }

  const char* argv[] = {"lightwire", "serve",       "--threads",    "4", "--socket", "",
                        "--config",  "/etc/x.yaml", "--density=0.5"};
  app.parse(static_cast<int>(std::size(argv)), argv);
  CHECK(flags.config_file == "/etc/x.yaml");
  CHECK(flags.values.at("threads") == "4");
  CHECK(flags.values.at("control.socket") == "");
  CHECK(flags.values.at("compression.default.density") == "0.5");
  CHECK(flags.values.size() == 3);
  auto c = buildServeConfig(std::nullopt, {}, flags, nullptr);
  REQUIRE(c.isOk());
  CHECK(c->threads == 4);
  CHECK(c->control_socket.empty());

  CLI::App app2{"test", "lightwire"};
  FlagValues flags2;
  addServeFlags(app2, flags2);
  const char* unknown[] = {"lightwire", "--max-bodies", "1"};
  CHECK_THROWS_AS(app2.parse(3, unknown), CLI::ParseError);
}

TEST_CASE("config: membership keys agree with each other; the job secret is never shown") {
  auto build = [](std::map<std::string, std::string> v) {
    auto c = buildServeConfig(std::nullopt, {}, flagsOf(std::move(v)), nullptr);
    REQUIRE_MESSAGE(c.isOk(), c.status().message());
    return *c;
  };
  CHECK(checkMembership(build({})).isOk());  // world size 1
  const auto rank_too_big = checkMembership(build({{"rank", "2"}, {"world_size", "2"}}));
  CHECK(contains(rank_too_big.message(), "rank 2 is not below world_size 2"));
  const auto few_peers = checkMembership(
      build({{"world_size", "3"}, {"peer.peers", "a:1,b:2"}, {"peer.secret", "x"}}));
  CHECK(contains(few_peers.message(), "peer.peers must list 3 addresses"));
  const auto no_secret = checkMembership(build({{"world_size", "2"}, {"peer.peers", "a:1,b:2"}}));
  CHECK(contains(no_secret.message(), "peer.secret must be set"));
  const auto ps_rank = checkMembership(build({{"world_size", "2"},
                                              {"peer.peers", "a:1,b:2"},
                                              {"peer.secret", "x"},
                                              {"peer.topology", "ps"},
                                              {"peer.ps_rank", "2"}}));
  CHECK(contains(ps_rank.message(), "peer.ps_rank 2 is not below world_size 2"));
  const auto stale_ring = checkMembership(build({{"world_size", "2"},
                                                 {"peer.peers", "a:1,b:2"},
                                                 {"peer.secret", "x"},
                                                 {"peer.synchrony", "bounded-staleness"}}));
  CHECK(contains(stale_ring.message(), "needs peer.topology ps"));
  // codec auto's ladder under bounded staleness: at least one rung the server can close a step
  // with, judged by the codecs' traits (powersgd: two rounds; randomk: payloads scaled once).
  auto stale_ladder = [&](const std::string& ladder) {
    return checkMembership(build({{"world_size", "2"},
                                  {"peer.peers", "a:1,b:2"},
                                  {"peer.secret", "x"},
                                  {"peer.topology", "ps"},
                                  {"peer.synchrony", "bounded-staleness"},
                                  {"compression.auto.ladder", ladder}}));
  };
  const auto unsafe = stale_ladder("direct,powersgd:1,randomk:0.01");
  CHECK(contains(unsafe.message(),
                 "compression.auto.ladder direct,powersgd:1,randomk:0.01 has no "
                 "rung a parameter server under bounded staleness"));
  CHECK(stale_ladder("powersgd:1,dgc:0.01").isOk());
  CHECK(stale_ladder("powersgd:1,randomk:0.01,qsgd:4").isOk());
  const auto sparse_ps = checkMembership(build({{"world_size", "2"},
                                                {"peer.peers", "a:1,b:2"},
                                                {"peer.secret", "x"},
                                                {"peer.topology", "ps"},
                                                {"peer.sparse", "allreduce"}}));
  CHECK(contains(sparse_ps.message(), "peer.sparse allreduce needs peer.topology ring"));
  const auto bad_sparse =
      buildServeConfig(std::nullopt, {}, flagsOf({{"peer.sparse", "allscatter"}}), nullptr);
  REQUIRE_FALSE(bad_sparse.isOk());
  CHECK(contains(bad_sparse.status().message(), "allgather, allreduce"));
  const auto both = checkMembership(build({{"world_size", "2"},
                                           {"peer.peers", "a:1,b:2"},
                                           {"peer.secret", "x"},
                                           {"peer.rendezvous", "a:1"}}));
  CHECK(contains(both.message(), "not both"));
  const auto ucx_rendezvous = checkMembership(build({{"world_size", "2"},
                                                     {"peer.secret", "x"},
                                                     {"peer.transport", "ucx"},
                                                     {"peer.rendezvous", "a:1"}}));
  CHECK(contains(ucx_rendezvous.message(), "served by the tcp transport"));
  const ServeConfig rdv = build({{"rank", "3"},
                                 {"world_size", "4"},
                                 {"peer.secret", "x"},
                                 {"peer.rendezvous", "10.0.0.1:4781"},
                                 {"peer.topology", "ps"},
                                 {"peer.synchrony", "bounded-staleness"},
                                 {"peer.staleness", "3"}});
  CHECK(checkMembership(rdv).isOk());
  CHECK(rdv.peer.rendezvous->toString() == "10.0.0.1:4781");
  CHECK(rdv.peer.topology == "ps");
  CHECK(rdv.peer.staleness == 3);
  auto bad_transport =
      buildServeConfig(std::nullopt, {}, flagsOf({{"peer.transport", "carrier-pigeon"}}), nullptr);
  REQUIRE_FALSE(bad_transport.isOk());
  CHECK(contains(bad_transport.status().message(), "must be one of tcp, ucx"));
  const ServeConfig ok = build({{"rank", "1"},
                                {"world_size", "2"},
                                {"peer.peers", "127.0.0.1:5001,127.0.0.1:5002"},
                                {"peer.secret", "hunter2-job-secret"}});
  CHECK(checkMembership(ok).isOk());
  CHECK(ok.peer.peers.size() == 2);
  const std::string shown = json::serialize(toJson(ok));
  CHECK_FALSE(contains(shown, "hunter2-job-secret"));
  CHECK(contains(shown, "<redacted>"));
  auto bad = buildServeConfig(std::nullopt, {}, flagsOf({{"peer.peers", "a:1,nocolon"}}), nullptr);
  REQUIRE_FALSE(bad.isOk());
  CHECK(contains(bad.status().message(), "peer.peers"));
}

TEST_CASE("config: a peer.peers template with {rank} stands for world_size addresses") {
  auto build = [](std::map<std::string, std::string> v) {
    return buildServeConfig(std::nullopt, {}, flagsOf(std::move(v)), nullptr);
  };
  auto c = build({{"rank", "2"},
                  {"world_size", "3"},
                  {"peer.secret", "x"},
                  {"peer.peers", "lightwire-{rank}.lightwire-peers:4781"}});
  REQUIRE_MESSAGE(c.isOk(), c.status().message());
  CHECK(c->peer.peers == std::vector<std::string>{"lightwire-0.lightwire-peers:4781",
                                                  "lightwire-1.lightwire-peers:4781",
                                                  "lightwire-2.lightwire-peers:4781"});
  CHECK(checkMembership(*c).isOk());
  CHECK(at(*c, "peer.peers").as_string() ==
        "lightwire-0.lightwire-peers:4781,lightwire-1.lightwire-peers:4781,"
        "lightwire-2.lightwire-peers:4781");
  // Every occurrence, the port too; the file's template expanded with the environment's size.
  TempDir dir;
  const std::string file = dir.write("c.yaml", "peer:\n  peers: 'n{rank}-{rank}:47{rank}0'\n");
  auto from_file =
      buildServeConfig(file, {"LIGHTWIRE_WORLD_SIZE=2"}, flagsOf({{"peer.secret", "x"}}), nullptr);
  REQUIRE_MESSAGE(from_file.isOk(), from_file.status().message());
  CHECK(from_file->peer.peers == std::vector<std::string>{"n0-0:4700", "n1-1:4710"});
  // A template among other addresses, or one that is no address, is refused by the key itself.
  auto mixed = build({{"peer.peers", "a:1,b{rank}:2"}});
  REQUIRE_FALSE(mixed.isOk());
  CHECK(contains(mixed.status().message(), "must be one address when it is a template"));
  auto broken = build({{"peer.peers", "node-{rank}"}});
  REQUIRE_FALSE(broken.isOk());
  CHECK(contains(broken.status().message(), "must be \"host:port\" addresses"));
  CHECK(contains(broken.status().message(), "got 'node-{rank}'"));
  // Without a placeholder a single address is a plain list of one.
  auto one = build({{"peer.peers", "a:1"}});
  REQUIRE(one.isOk());
  CHECK(one->peer.peers == std::vector<std::string>{"a:1"});
}

TEST_CASE("config: peer.secret_file and security.token_file read the secrets from files") {
  TempDir dir;
  auto build = [](std::map<std::string, std::string> v,
                  std::vector<std::string>* warnings = nullptr) {
    return buildServeConfig(std::nullopt, {}, flagsOf(std::move(v)), warnings);
  };
  const std::string secret = dir.write("secret", "s3cret-from-a-file\n");
  const std::string token = dir.write("token", "tok-from-a-file\r\n");
  ::chmod(secret.c_str(), 0400);
  ::chmod(token.c_str(), 0440);
  std::vector<std::string> warnings;
  auto c = build({{"world_size", "2"},
                  {"peer.peers", "a:1,b:2"},
                  {"peer.secret_file", secret},
                  {"security.token_file", token}},
                 &warnings);
  REQUIRE_MESSAGE(c.isOk(), c.status().message());
  CHECK(c->peer.secret == "s3cret-from-a-file");  // the trailing newline is not part of it
  CHECK(c->token == "tok-from-a-file");
  CHECK(checkMembership(*c).isOk());
  CHECK(warnings.empty());
  const std::string shown = json::serialize(toJson(*c));
  CHECK_FALSE(contains(shown, "s3cret-from-a-file"));
  CHECK(at(*c, "peer.secret").as_string() == "<redacted>");
  CHECK(at(*c, "peer.secret_file").as_string() == secret);
  // Only one trailing newline goes; inner ones stay (the HMAC key is the bytes as written).
  const std::string two = dir.write("two", "a\nb\n\n");
  ::chmod(two.c_str(), 0600);
  auto kept = build({{"peer.secret_file", two}});
  REQUIRE(kept.isOk());
  CHECK(kept->peer.secret == "a\nb\n");
  // A file others may read works, with a warning naming the mode.
  const std::string open_file = dir.write("open", "x");
  ::chmod(open_file.c_str(), 0644);
  warnings.clear();
  REQUIRE(build({{"peer.secret_file", open_file}}, &warnings).isOk());
  REQUIRE(warnings.size() == 1);
  CHECK(contains(warnings[0], "other users may read it (mode 0644)"));
  // Errors name the key and the file, never the contents, and nothing else is built.
  auto refused = [&](std::map<std::string, std::string> v, const std::string& says) {
    auto r = build(std::move(v));
    REQUIRE_FALSE(r.isOk());
    CHECK_MESSAGE(contains(r.status().message(), says), r.status().message());
    CHECK_FALSE(contains(r.status().message(), "s3cret"));
  };
  refused({{"peer.secret_file", dir.path() + "/missing"}},
          "peer.secret_file " + dir.path() + "/missing: cannot open");
  refused({{"peer.secret_file", dir.path()}}, "is not a regular file");
  refused({{"peer.secret_file", dir.write("empty", "\n")}}, "the file is empty");
  refused({{"peer.secret_file", dir.write("big", std::string(5000, 'k'))}},
          "is 5000 bytes; a secret file holds at most 4096");
  refused({{"peer.secret_file", secret}, {"peer.secret", "s3cret-inline"}},
          "give peer.secret or peer.secret_file, not both (peer.secret from flag --secret)");
  refused({{"security.token_file", dir.write("spaced", "has space")}},
          "security.token must be printable ASCII without spaces (value not shown)");
  refused({{"peer.secret_file", dir.write("nul", std::string("a\0b", 3))}},
          "peer.secret must not contain NUL (value not shown)");
  // The file is read after every source: an environment variable can name it.
  auto env = buildServeConfig(std::nullopt, {"LIGHTWIRE_PEER__SECRET_FILE=" + secret}, {}, nullptr);
  REQUIRE(env.isOk());
  CHECK(env->peer.secret == "s3cret-from-a-file");
  // And no file at all leaves the secrets unset.
  auto none = build({});
  REQUIRE(none.isOk());
  CHECK(none->peer.secret.empty());
  CHECK(none->token.empty());
}

TEST_CASE("config: peer.tls needs its files when enabled, and the tcp transport") {
  auto check = [](std::map<std::string, std::string> v) {
    v.emplace("peer.tls.enabled", "true");
    auto c = buildServeConfig(std::nullopt, {}, flagsOf(std::move(v)), nullptr);
    REQUIRE_MESSAGE(c.isOk(), c.status().message());  // each key alone is fine
    return checkMembership(*c).message();
  };
  const std::map<std::string, std::string> files = {{"peer.tls.cert_file", "/etc/lw/node.pem"},
                                                    {"peer.tls.key_file", "/etc/lw/node.key"},
                                                    {"peer.tls.ca_file", "/etc/lw/ca.pem"}};
  CHECK(check(files).empty());
  for (const auto& entry : files) {
    // Not a structured binding: clang 14 cannot capture one in CAPTURE's lambda.
    const auto& key = entry.first;
    CAPTURE(key);
    auto without = files;
    without.erase(key);
    CHECK(contains(check(without), key + " must be set when peer.tls.enabled is true"));
  }
  // Without verification the CA is optional.
  auto no_ca = files;
  no_ca.erase("peer.tls.ca_file");
  no_ca.emplace("peer.tls.verify", "false");
  CHECK(check(no_ca).empty());
  auto ucx = files;
  ucx.emplace("peer.transport", "ucx");
  CHECK(check(ucx) == "peer.tls applies to the tcp transport only (peer.transport is ucx)");
  // Checked whatever the world size, and not at all while disabled.
  CHECK(contains(check({{"world_size", "2"}, {"peer.peers", "a:1,b:2"}, {"peer.secret", "x"}}),
                 "peer.tls.cert_file must be set"));
  auto off = buildServeConfig(
      std::nullopt, {"LIGHTWIRE_PEER__TLS__ENABLED=false", "LIGHTWIRE_PEER__TRANSPORT=ucx"},
      flagsOf({{"peer.tls.cert_file", "x.pem"}}), nullptr);
  REQUIRE(off.isOk());
  CHECK(checkMembership(*off).isOk());
  // Paths are shown; the key file's contents are never read here.
  auto on = buildServeConfig(std::nullopt, {}, flagsOf(files), nullptr);
  REQUIRE(on.isOk());
  CHECK(at(*on, "peer.tls.key_file").as_string() == "/etc/lw/node.key");
  CHECK(at(*on, "peer.tls.verify").as_bool());
  CHECK(keyOf("peer.tls.enabled").flag == "--peer-tls");
  CHECK(keyOf("peer.tls.enabled").env == "LIGHTWIRE_PEER__TLS__ENABLED");
  CHECK(keyOf("peer.tls.cert_file").flag == "--peer-tls-cert");
  CHECK(keyOf("peer.tls.key_file").flag == "--peer-tls-key");
  CHECK(keyOf("peer.tls.ca_file").flag == "--peer-tls-ca");
  CHECK(keyOf("peer.tls.verify").default_text == "true");
}

TEST_CASE("config: bool keys: true/false, yes/no, on/off, 1/0 in any case; nothing else") {
  const std::vector<std::pair<std::string, bool>> good = {
      {"true", true}, {"True", true}, {"TRUE", true}, {"yes", true},    {"Yes", true},
      {"on", true},   {"ON", true},   {"1", true},    {"false", false}, {"False", false},
      {"no", false},  {"NO", false},  {"off", false}, {"Off", false},   {"0", false},
  };
  for (const auto& entry : good) {
    // Not a structured binding: clang 14 cannot capture one in CAPTURE's lambda.
    const auto& raw = entry.first;
    const auto& want = entry.second;
    CAPTURE(raw);
    auto c = buildServeConfig(std::nullopt, {"LIGHTWIRE_POLICIES__ANOMALY=" + raw},
                              flagsOf({{"state.fresh", raw}, {"schedule.adaptive", raw}}), nullptr);
    REQUIRE_MESSAGE(c.isOk(), c.status().message());
    CHECK(c->policies.anomaly == want);
    CHECK(c->state.fresh == want);
    CHECK(c->policies.adaptive == want);
    CHECK(at(*c, "policies.anomaly") == json::value(want));  // a JSON boolean, not text
  }
  for (const std::string raw :
       {"", "2", "-1", "t", "y", "n", "yess", "enabled", "true ", "0x1", "01", "null", "~"}) {
    CAPTURE(raw);
    auto c = buildServeConfig(std::nullopt, {}, flagsOf({{"policies.rollback", raw}}), nullptr);
    REQUIRE(!c.isOk());
    CHECK(c.status().message().rfind("flag --rollback: policies.rollback must be true or false",
                                     0) == 0);
  }

  // Unquoted YAML booleans read as their text.
  TempDir dir;
  const std::string file = dir.write("b.yaml",
                                     "policies:\n  anomaly: no\n  rollback: False\n"
                                     "schedule:\n  adaptive: yes\nstate:\n  fresh: ON\n");
  auto c = buildServeConfig(file, {}, {}, nullptr);
  REQUIRE_MESSAGE(c.isOk(), c.status().message());
  CHECK(!c->policies.anomaly);
  CHECK(!c->policies.rollback);
  CHECK(c->policies.adaptive);
  CHECK(c->state.fresh);
  auto bad = buildServeConfig(dir.write("bb.yaml", "state:\n  fresh: maybe\n"), {}, {}, nullptr);
  REQUIRE(!bad.isOk());
  CHECK(contains(bad.status().message(), "state.fresh must be true or false"));
  CHECK(contains(bad.status().message(), "got 'maybe'"));
}

TEST_CASE("config: a bool key's flag alone means true") {
  CLI::App app{"test", "lightwire"};
  FlagValues flags;
  addServeFlags(app, flags);
  const std::string help = app.help();
  CHECK(contains(help, "--fresh-state"));
  CHECK(contains(help, "LIGHTWIRE_STATE__FRESH"));
  const char* argv[] = {"lightwire",  "--fresh-state", "--anomaly", "false",       "--adaptive=no",
                        "--rollback", "--threads",     "2",         "--state-dir", ""};
  app.parse(static_cast<int>(std::size(argv)), argv);
  CHECK(flags.values.at("state.fresh") == "true");
  CHECK(flags.values.at("policies.anomaly") == "false");
  CHECK(flags.values.at("schedule.adaptive") == "no");
  CHECK(flags.values.at("policies.rollback") == "true");
  CHECK(flags.values.at("threads") == "2");
  CHECK(flags.values.at("state.dir") == "");
  auto c = buildServeConfig(std::nullopt, {"LIGHTWIRE_STATE__FRESH=false"}, flags, nullptr);
  REQUIRE_MESSAGE(c.isOk(), c.status().message());
  CHECK(c->state.fresh);  // the flag wins over the environment
  CHECK(!c->policies.anomaly);
  CHECK(!c->policies.adaptive);
  CHECK(c->policies.rollback);
  CHECK(c->state.dir.empty());  // "" = no durable state

  // A key that is not a bool still needs its value.
  CLI::App app2{"test", "lightwire"};
  FlagValues flags2;
  addServeFlags(app2, flags2);
  const char* missing[] = {"lightwire", "--bypass-steps"};
  CHECK_THROWS_AS(app2.parse(2, missing), CLI::ParseError);
}

TEST_CASE("config: the policies and state keys reach ServeConfig") {
  TempDir dir;
  const std::string file = dir.write("p.yaml", R"(
policies:
  anomaly: false
  bypass_steps: 7
  explode_factor: 12.5
  vanish_factor: 0.0001
  ewma_alpha: 0.25
  baseline_steps: 20
  full_sync_every: 500
  rollback: false
  cosine_drop: 0.3
  loss_rise: 0.75
  patience: 4
  cooldown_steps: 200
  known_good_steps: 60
  min_magnitude: 1e-7
  decision_log: 1024
schedule:
  warmup_steps: 300
  total_steps: 90000
  phase_factor: 3
  adaptive: true
  adaptive_tiny: 0.02
  adaptive_sparse: 0.8
  adaptive_max_ratio: 5000
  adaptive_min_ratio: 20
state:
  dir: /data/lw
  checkpoint_every: 250
  keep: 5
  fresh: true
)");
  auto c = buildServeConfig(file, {}, flagsOf({{"policies.full_sync_every", "0"}}), nullptr);
  REQUIRE_MESSAGE(c.isOk(), c.status().message());
  const auto& p = c->policies;
  CHECK(!p.anomaly);
  CHECK(p.bypass_steps == 7u);
  CHECK(p.explode_factor == 12.5);
  CHECK(p.vanish_factor == 0.0001);
  CHECK(p.ewma_alpha == 0.25);
  CHECK(p.baseline_steps == 20u);
  CHECK(p.full_sync_every == 0u);  // the flag wins
  CHECK(!p.rollback);
  CHECK(p.cosine_drop == 0.3);
  CHECK(p.loss_rise == 0.75);
  CHECK(p.patience == 4u);
  CHECK(p.cooldown_steps == 200u);
  CHECK(p.known_good_steps == 60u);
  CHECK(p.min_magnitude == 1e-7);
  CHECK(p.decision_log == 1024u);
  CHECK(p.warmup_steps == 300u);
  CHECK(p.total_steps == 90000u);
  CHECK(p.phase_factor == 3);
  CHECK(p.adaptive);
  CHECK(p.adaptive_tiny == 0.02);
  CHECK(p.adaptive_sparse == 0.8);
  CHECK(p.adaptive_max_ratio == 5000);
  CHECK(p.adaptive_min_ratio == 20);
  CHECK(c->state.dir == "/data/lw");
  CHECK(c->state.checkpoint_every == 250u);
  CHECK(c->state.keep == 5u);
  CHECK(c->state.fresh);
  CHECK(at(*c, "schedule.warmup_steps") == json::value(300));
  CHECK(at(*c, "policies.explode_factor") == json::value(12.5));
  CHECK(at(*c, "state.dir") == json::value("/data/lw"));
  CHECK(at(*c, "state.fresh") == json::value(true));

  // state.dir: at most 4095 bytes, no NUL.
  auto long_dir =
      buildServeConfig(std::nullopt, {}, flagsOf({{"state.dir", std::string(4096, 'd')}}), nullptr);
  REQUIRE(!long_dir.isOk());
  CHECK(long_dir.status().message().rfind(
            "flag --state-dir: state.dir must be a path of at most 4095 bytes", 0) == 0);
  auto nul_dir =
      buildServeConfig(std::nullopt, {}, flagsOf({{"state.dir", std::string("a\0b", 3)}}), nullptr);
  REQUIRE(!nul_dir.isOk());
  CHECK(contains(nul_dir.status().message(), "state.dir must be a path"));
}

TEST_CASE("config: policies::validate() runs once every source is merged") {
  TempDir dir;
  const std::string file = dir.write("v.yaml", "schedule:\n  adaptive_max_ratio: 50\n");
  // Each value alone is fine...
  REQUIRE(buildServeConfig(file, {}, {}, nullptr).isOk());
  REQUIRE(
      buildServeConfig(std::nullopt, {}, flagsOf({{"schedule.adaptive_min_ratio", "100"}}), nullptr)
          .isOk());
  // ...together min > max is refused, naming the keys.
  auto c = buildServeConfig(file, {}, flagsOf({{"schedule.adaptive_min_ratio", "100"}}), nullptr);
  REQUIRE(!c.isOk());
  CHECK(c.status().code() == lightwire::StatusCode::kInvalidArgument);
  const std::string& m = c.status().message();
  CAPTURE(m);
  CHECK(m.rfind("schedule.adaptive_min_ratio must be", 0) == 0);
  CHECK(contains(m, "schedule.adaptive_max_ratio"));
  // The keys it names, with their values and where they came from.
  CHECK(contains(m, "(schedule.adaptive_max_ratio 50 from file " + file +
                        "; schedule.adaptive_min_ratio 100 from flag --adaptive-min-ratio)"));
  // Against a default too: a max below the default min (10).
  auto e =
      buildServeConfig(std::nullopt, {"LIGHTWIRE_SCHEDULE__ADAPTIVE_MAX_RATIO=5"}, {}, nullptr);
  REQUIRE(!e.isOk());
  CHECK(
      contains(e.status().message(),
               "schedule.adaptive_max_ratio 5 from environment "
               "LIGHTWIRE_SCHEDULE__ADAPTIVE_MAX_RATIO; schedule.adaptive_min_ratio 10 (default)"));
  // Equal is fine.
  auto eq = buildServeConfig(std::nullopt, {"LIGHTWIRE_SCHEDULE__ADAPTIVE_MAX_RATIO=5"},
                             flagsOf({{"schedule.adaptive_min_ratio", "5"}}), nullptr);
  CHECK_MESSAGE(eq.isOk(), eq.status().message());
}

TEST_CASE("config: the reward rule takes one form: an absolute drop or a drop of deviations") {
  // Neither set: three deviations.
  auto none = buildServeConfig(std::nullopt, {}, {}, nullptr);
  REQUIRE(none.isOk());
  CHECK(!none->policies.reward_drop);
  CHECK(!none->policies.reward_drop_sigma);
  CHECK(lightwire::policies::rewardDropSigma(none->policies) == std::optional<double>(3.0));
  CHECK(at(*none, "policies.reward_drop").is_null());
  // One set: that form.
  auto absolute =
      buildServeConfig(std::nullopt, {}, flagsOf({{"policies.reward_drop", "2"}}), nullptr);
  REQUIRE(absolute.isOk());
  CHECK(absolute->policies.reward_drop == std::optional<double>(2.0));
  CHECK(!lightwire::policies::rewardDropSigma(absolute->policies));
  TempDir dir;
  const std::string file = dir.write("r.yaml", "policies:\n  reward_drop_sigma: 1.5\n");
  auto sigma = buildServeConfig(file, {}, {}, nullptr);
  REQUIRE(sigma.isOk());
  CHECK(lightwire::policies::rewardDropSigma(sigma->policies) == std::optional<double>(1.5));
  // Both: refused, naming both keys with their values and sources.
  auto both = buildServeConfig(file, {"LIGHTWIRE_POLICIES__REWARD_DROP=0.5"}, {}, nullptr);
  REQUIRE(!both.isOk());
  const std::string& m = both.status().message();
  CAPTURE(m);
  CHECK(m.rfind("policies.reward_drop and policies.reward_drop_sigma are both set", 0) == 0);
  CHECK(contains(m,
                 "(policies.reward_drop 0.5 from environment LIGHTWIRE_POLICIES__REWARD_DROP; "
                 "policies.reward_drop_sigma 1.5 from file " +
                     file + ")"));
  // A flag of "" unsets the one the file set: then the other form alone is fine.
  auto unset = buildServeConfig(file, {"LIGHTWIRE_POLICIES__REWARD_DROP=0.5"},
                                flagsOf({{"policies.reward_drop_sigma", ""}}), nullptr);
  REQUIRE_MESSAGE(unset.isOk(), unset.status().message());
  CHECK(unset->policies.reward_drop == std::optional<double>(0.5));
  CHECK(!unset->policies.reward_drop_sigma);
}

TEST_CASE("config: rules match ndim; layers of a layout get the layer defaults") {
  TempDir dir;
  const std::string file = dir.write("nd.yaml", R"(
compression:
  default:
    codec: powersgd
    approx_rank: 2
  layers:
    dense_max_elements: 100
  rules:
    - ndim: 4
      codec: fp16
    - pattern: "*.bias"
      ndim: 1
      codec: topk
      density: 0.1
)");
  auto c = buildServeConfig(file, {}, {}, nullptr);
  REQUIRE_MESSAGE(c.isOk(), c.status().message());
  const CompressionConfig& cc = c->compression;
  REQUIRE(cc.rules.size() == 2);
  CHECK(cc.rules[0].ndim == 4u);
  CHECK(cc.layers.dense_max_elements == 100u);
  CHECK(cc.layers.dense_max_ndim == 1u);  // the default
  const std::vector<uint64_t> conv = {8, 4, 3, 3}, mat = {64, 32}, vec = {64}, thin = {3, 1000};
  CHECK(cc.ruleFor(TensorFacts{"c.weight", 288, conv}) == &cc.rules[0]);
  CHECK(cc.ruleFor(TensorFacts{"fc.bias", 64, vec}) == &cc.rules[1]);
  CHECK(cc.ruleFor(TensorFacts{"fc.bias", 64}) == &cc.rules[1]);  // no shape: 1-D
  CHECK(cc.ruleFor(TensorFacts{"fc.bias", 2048, mat}) == nullptr);
  CHECK(cc.ruleFor(TensorFacts{"fc.weight", 2048, mat}) == nullptr);

  const auto reason = [&](const TensorFacts& t) {
    const CodecRule* r = cc.ruleFor(t);
    const char* why = denseLayerReason(cc.layers, t, r ? r->codec : cc.default_codec, r);
    return std::string(why ? why : "");
  };
  // Not a layer: nothing changes.
  CHECK(reason(TensorFacts{"fc.norm", 64, vec}).empty());
  CHECK(reason(TensorFacts{"fc.norm", 50, {}}).empty());
  // Layers without a rule of their own.
  CHECK(reason(TensorFacts{"fc.norm", 64, vec, true}) == "dense_max_ndim");
  CHECK(reason(TensorFacts{"fc.small", 100, std::vector<uint64_t>{10, 10}, true}) ==
        "dense_max_elements");
  CHECK(reason(TensorFacts{"fc.weight", 2048, mat, true}).empty());  // 64·32 > 2·96·2
  CHECK(reason(TensorFacts{"fc.thin", 3000, thin, true}) == "powersgd_min_ratio");  // 3·1000 <
  // A rule decides, even for a 1-D layer; a conv kernel's rule is fp16.
  CHECK(reason(TensorFacts{"fc.bias", 64, vec, true}).empty());
  CHECK(reason(TensorFacts{"c.weight", 288, conv, true}).empty());
  // Off.
  LayerDefaults off{0, 0, 0};
  CHECK(denseLayerReason(off, TensorFacts{"fc.norm", 64, vec, true}, cc.default_codec, false) ==
        nullptr);
  CHECK(denseLayerReason(off, TensorFacts{"fc.thin", 3000, thin, true}, cc.default_codec, false) ==
        nullptr);

  // toJson shows ndim and the layer keys; compressionFromJson reads them back.
  auto back = compressionFromJson(toJson(cc));
  REQUIRE_MESSAGE(back.isOk(), back.status().message());
  CHECK(back->rules[0].ndim == 4u);
  CHECK(!back->rules[0].pattern);
  CHECK(back->layers.dense_max_elements == 100u);

  // Bad ndim values name the rule.
  for (const char* bad : {"0", "65", "two", "-1"}) {
    CAPTURE(bad);
    const std::string f =
        dir.write("bad.yaml", std::string("compression:\n  rules:\n    - ndim: ") + bad +
                                  "\n      codec: none\n");
    auto b = buildServeConfig(f, {}, {}, nullptr);
    REQUIRE(!b.isOk());
    CHECK_MESSAGE(b.status().message().find("compression.rules[0].ndim") != std::string::npos,
                  b.status().message());
  }
}

TEST_CASE("config: rules: sync_every, group and ruleFor") {
  TempDir dir;
  const std::string file = dir.write("sg.yaml", R"(
compression:
  default:
    codec: topk
    density: 0.01
  rules:
    - pattern: "embed*"
      codec: qsgd
      bits: 4
      sync_every: 4
      group: embeddings
    - max_elements: 1000
      codec: none
      group: small.Dense-1_x
    - pattern: "*.bias"
      codec: fp16
      sync_every: 1000000
)");
  auto c = buildServeConfig(file, {}, {}, nullptr);
  REQUIRE_MESSAGE(c.isOk(), c.status().message());
  const CompressionConfig& cc = c->compression;
  REQUIRE(cc.rules.size() == 3);
  CHECK(cc.rules[0].sync_every == 4u);
  CHECK(cc.rules[0].group == "embeddings");
  CHECK(cc.rules[1].sync_every == 1u);  // the default
  CHECK(cc.rules[1].group == "small.Dense-1_x");
  CHECK(cc.rules[2].sync_every == 1000000u);
  CHECK(cc.rules[2].group.empty());  // "" = the codec name

  CHECK(cc.ruleFor("embed.weight", 10) == &cc.rules[0]);  // first match wins
  CHECK(cc.ruleFor("fc.weight", 1000) == &cc.rules[1]);
  CHECK(cc.ruleFor("fc.bias", 5000) == &cc.rules[2]);
  CHECK(cc.ruleFor("fc.weight", 5000) == nullptr);
  CHECK(&cc.codecFor("fc.weight", 5000) == &cc.default_codec);
  CHECK(&cc.codecFor("fc.bias", 5000) == &cc.rules[2].codec);
  CompressionConfig none;
  CHECK(none.ruleFor("x", 1) == nullptr);
  CHECK(&none.codecFor("x", 1) == &none.default_codec);

  // toJson shows sync_every always and group when set; compressionFromJson reads them back.
  const json::object j = toJson(cc);
  const auto& rules = j.at("rules").as_array();
  REQUIRE(rules.size() == 3);
  CHECK(rules[0].as_object().at("sync_every") == json::value(4));
  CHECK(rules[0].as_object().at("group") == json::value("embeddings"));
  CHECK(rules[2].as_object().at("sync_every") == json::value(1000000));
  CHECK(!rules[2].as_object().contains("group"));
  CHECK(at(*c, "compression.rules").as_array()[1].as_object().at("group") ==
        json::value("small.Dense-1_x"));
  auto back = compressionFromJson(j);
  REQUIRE_MESSAGE(back.isOk(), back.status().message());
  REQUIRE(back->rules.size() == 3);
  CHECK(back->rules[0].sync_every == 4u);
  CHECK(back->rules[0].group == "embeddings");
  CHECK(back->rules[1].group == "small.Dense-1_x");
  CHECK(back->rules[2].group.empty());
  CHECK(json::serialize(toJson(*back)) == json::serialize(j));

  // From PUT /v1/config JSON: numbers or strings; null and "" = no group.
  auto put = compressionFromJson(json::parse(R"({"rules": [
      {"pattern": "a*", "codec": "none", "sync_every": 8, "group": "g-1"},
      {"codec": "fp16", "sync_every": "2", "group": null},
      {"codec": "fp16", "sync_every": 3.0, "group": ""},
      {"codec": "none", "group": ")" + std::string(64, 'z') +
                                             R"("}]})"));
  REQUIRE_MESSAGE(put.isOk(), put.status().message());
  REQUIRE(put->rules.size() == 4);
  CHECK(put->rules[0].sync_every == 8u);
  CHECK(put->rules[0].group == "g-1");
  CHECK(put->rules[1].sync_every == 2u);
  CHECK(put->rules[1].group.empty());
  CHECK(put->rules[2].sync_every == 3u);
  CHECK(put->rules[2].group.empty());
  CHECK(put->rules[3].sync_every == 1u);
  CHECK(put->rules[3].group == std::string(64, 'z'));
  CHECK(put->ruleFor("ab", 1) == &put->rules[0]);
  CHECK(put->ruleFor("b", 1) == &put->rules[1]);
}

TEST_CASE("config: codec auto as the default and in rules; compression.auto reaches the policies") {
  TempDir dir;
  const std::string file =
      dir.write("a.yaml",
                "compression:\n  default: {codec: auto}\n  rules:\n"
                "    - {pattern: \"emb*\", codec: auto, group: emb}\n"
                "  auto:\n    ladder: \"direct,none,dgc:0.01@1.8\"\n    period: 4\n");
  auto c = buildServeConfig(file, {"LIGHTWIRE_COMPRESSION__AUTO__PROBE_EVERY=32"}, {}, nullptr);
  REQUIRE_MESSAGE(c.isOk(), c.status().message());
  CHECK(c->compression.default_codec.name == "auto");
  CHECK(c->compression.rules.at(0).codec.name == "auto");
  const auto& a = c->policies.auto_codec;
  CHECK(a.period == 4);
  CHECK(a.probe_every == 32);
  REQUIRE(a.ladder.size() == 3);
  CHECK(a.ladder[2].steps_factor == 1.8);
  CHECK(json::serialize(at(*c, "compression.auto.ladder")) == "\"direct,none,dgc:0.01@1.8\"");
}
