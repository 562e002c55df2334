#include "proxy/config.h"

#include <fcntl.h>
#include <fnmatch.h>
#include <sys/stat.h>
#include <unistd.h>

#include <yaml-cpp/yaml.h>
#include <CLI/CLI.hpp>
#include <boost/json/array.hpp>
#include <boost/json/serialize.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <set>
#include <utility>

#include "kernels/registry.h"
#include "proxy/server/utf8.h"

namespace lightwire::proxy {
namespace {

namespace json = boost::json;
using kernels::CodecConfig;

constexpr char kEnvPrefix[] = "LIGHTWIRE_";
constexpr char kSocketAlias[] = "LIGHTWIRE_SOCKET";
constexpr char kRulesPath[] = "compression.rules";
constexpr char kDefaultCodecPath[] = "compression.default";
constexpr char kRedacted[] = "<redacted>";
constexpr int kMaxDepth = 16;          // far deeper than any key; bounds recursion on hostile input
constexpr size_t kMaxShownValue = 80;  // longer values are cut in error messages
constexpr double kMaxSeconds = 1e9;    // keeps durations representable as int64 nanoseconds
constexpr uint64_t kMaxSyncEvery = 1000000;  // a rule's sync_every
constexpr size_t kMaxGroupChars = 64;        // a rule's group

// --- Parsing one value from its text (the same code for every source) --------------------------
// Each setter returns "" on success, else what the value must be ("must be ..."); the caller adds
// the source, the key and the value.

/// Digits only (no sign, no spaces, no exponent), no overflow.
std::optional<uint64_t> parseDigits(std::string_view s) {
  if (s.empty()) return std::nullopt;
  for (char ch : s) {
    if (ch < '0' || ch > '9') return std::nullopt;
  }
  uint64_t v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc{} || end != s.data() + s.size()) return std::nullopt;
  return v;
}

/// A finite decimal number ("0.5", "-1", "1e-3"); no spaces, no "inf"/"nan", no leading '+'.
std::optional<double> parseNumber(std::string_view s) {
  if (s.empty()) return std::nullopt;
  double v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc{} || end != s.data() + s.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

std::string integerRange(uint64_t lo, uint64_t hi) {
  if (hi == std::numeric_limits<uint64_t>::max()) {
    return lo == 1 ? "must be a positive integer" : "must be a non-negative integer";
  }
  return "must be an integer in " + std::to_string(lo) + ".." + std::to_string(hi);
}

std::string setUnsigned(std::string_view s, uint64_t lo, uint64_t hi, uint64_t& out) {
  const auto v = parseDigits(s);
  if (!v || *v < lo || *v > hi) return integerRange(lo, hi);
  out = *v;
  return "";
}

/// Parses an unsigned integer in [lo, hi] into the field fn(target) refers to.
template <typename Target, typename Field>
auto unsignedSetter(Field field, uint64_t lo, uint64_t hi) {
  return [=](Target& t, std::string_view s) -> std::string {
    uint64_t v = 0;
    std::string e = setUnsigned(s, lo, hi, v);
    if (e.empty()) {
      auto& ref = field(t);
      ref = static_cast<std::remove_reference_t<decltype(ref)>>(v);
    }
    return e;
  };
}

/// A duration in seconds: > 0 and at most kMaxSeconds.
std::string setSeconds(std::string_view s, double& out) {
  const auto v = parseNumber(s);
  if (!v || *v <= 0 || *v > kMaxSeconds) return "must be a number of seconds > 0 (at most 1e9)";
  out = *v;
  return "";
}

std::string setAnyNumber(std::string_view s, double& out) {
  const auto v = parseNumber(s);
  if (!v) return "must be a finite number";
  out = *v;
  return "";
}

/// A finite number for which ok() holds; `must` says which ("must be a number > 0").
std::string setNumber(std::string_view s, double& out, bool (*ok)(double),
                      const std::string& must) {
  const auto v = parseNumber(s);
  if (!v || !ok(*v)) return must;
  out = *v;
  return "";
}

/// The shortest text that parses back to `v` exactly (the key table's defaults).
std::string numberText(double v) {
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return ec == std::errc{} ? std::string(buf, end) : std::string();
}

constexpr char kBoolType[] = "true | false";

/// true, yes, on, 1 / false, no, off, 0 in any case (YAML 1.1's spellings, and the JSON ones).
std::string setBool(std::string_view s, bool& out) {
  std::string v(s.size() <= 5 ? s : std::string_view());  // longer: no spelling matches
  for (char& ch : v) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (v == "true" || v == "yes" || v == "on" || v == "1") {
    out = true;
  } else if (v == "false" || v == "no" || v == "off" || v == "0") {
    out = false;
  } else {
    return "must be true or false (or yes/no, on/off, 1/0)";
  }
  return "";
}

/// A file or directory path ("" allowed: the key's own meaning of unset).
std::string setPath(std::string_view s, std::string& out) {
  if (s.size() > 4095 || s.find('\0') != std::string_view::npos) {
    return "must be a path of at most 4095 bytes";
  }
  out = std::string(s);
  return "";
}

/// "" clears an optional value (so an override can undo the file's setting).
std::string setOptionalNumber(std::string_view s, std::optional<double>& out,
                              const std::function<bool(double)>& ok, const char* what) {
  if (s.empty()) {
    out.reset();
    return "";
  }
  const auto v = parseNumber(s);
  if (!v || !ok(*v)) return what;
  out = *v;
  return "";
}

std::optional<ListenAddress> parseListen(std::string_view s) {
  ListenAddress a;
  std::string_view port;
  if (!s.empty() && s.front() == '[') {
    const size_t close = s.find(']');
    if (close == std::string_view::npos || close + 1 >= s.size() || s[close + 1] != ':') {
      return std::nullopt;
    }
    a.host = std::string(s.substr(1, close - 1));
    if (a.host.find(':') == std::string::npos) return std::nullopt;  // brackets are for IPv6
    port = s.substr(close + 2);
  } else {
    const size_t colon = s.rfind(':');
    if (colon == std::string_view::npos) return std::nullopt;
    a.host = std::string(s.substr(0, colon));
    if (a.host.find(':') != std::string::npos) return std::nullopt;  // IPv6 needs brackets
    port = s.substr(colon + 1);
  }
  if (a.host.empty()) return std::nullopt;
  for (unsigned char ch : a.host) {
    if (std::iscntrl(ch) || std::isspace(ch) || ch == '[' || ch == ']' || ch == '/') {
      return std::nullopt;
    }
  }
  const auto p = parseDigits(port);
  if (!p || *p > 65535) return std::nullopt;
  a.port = static_cast<uint16_t>(*p);
  return a;
}

constexpr std::string_view kRankPlaceholder = "{rank}";

/// `text` with every "{rank}" replaced by `rank`.
std::string expandRank(std::string_view text, uint32_t rank) {
  std::string out;
  for (size_t at = text.find(kRankPlaceholder); at != std::string_view::npos;
       at = text.find(kRankPlaceholder)) {
    out += text.substr(0, at);
    out += std::to_string(rank);
    text.remove_prefix(at + kRankPlaceholder.size());
  }
  return out += text;
}

std::string setListen(std::string_view s, std::optional<ListenAddress>& out) {
  if (s.empty()) {
    out.reset();
    return "";
  }
  auto a = parseListen(s);
  if (!a) return "must be \"host:port\" with port 0..65535 (IPv6 as \"[::1]:4780\", \"\" = off)";
  out = std::move(a);
  return "";
}

json::value listenJson(const std::optional<ListenAddress>& a) {
  return json::value(a ? a->toString() : std::string());
}

json::value optionalJson(const std::optional<double>& v) {
  return v ? json::value(*v) : json::value(nullptr);
}

// --- The codec keys (compression.default.* and each rule) ---------------------------------------

/// One key of a codec section: what `compression.default.<name>` and a rule's `<name>` accept.
struct CodecKey {
  const char* name;
  const char* flag;
  const char* type;
  std::optional<const char*> default_text;  // nullopt = unset
  const char* description;
  std::function<std::string(CodecConfig&, std::string_view)> set;
  std::function<json::value(const CodecConfig&)> get;
};

const std::vector<CodecKey>& codecKeys() {
  static const std::vector<CodecKey> keys = {
      {"codec", "--codec", "codec name", "none",
       "name; one of none, fp16, bf16, topk, randomk, threshold, dgc, qsgd, terngrad, signsgd, "
       "onebit, powersgd",
       [](CodecConfig& c, std::string_view s) -> std::string {
         if (s.empty()) return "must be a codec name";
         c.name = std::string(s);
         return "";
       },
       [](const CodecConfig& c) { return json::value(c.name); }},
      {"density", "--density", "number in (0, 1]", std::nullopt,
       "topk, dgc, randomk: fraction of elements sent (k/n); \"\" = unset",
       [](CodecConfig& c, std::string_view s) {
         return setOptionalNumber(
             s, c.density, [](double v) { return v > 0 && v <= 1; }, "must be a number in (0, 1]");
       },
       [](const CodecConfig& c) { return optionalJson(c.density); }},
      {"ratio", "--ratio", "number >= 1", std::nullopt,
       "topk, dgc, randomk: n/k, the alternative to density; \"\" = unset",
       [](CodecConfig& c, std::string_view s) {
         return setOptionalNumber(
             s, c.ratio, [](double v) { return v >= 1; }, "must be a number >= 1");
       },
       [](const CodecConfig& c) { return optionalJson(c.ratio); }},
      {"bits", "--bits", "integer", "8", "qsgd: bits per element including the sign (2..8)",
       unsignedSetter<CodecConfig>([](CodecConfig& c) -> int& { return c.bits; }, 0, INT_MAX),
       [](const CodecConfig& c) { return json::value(c.bits); }},
      {"bucket_size", "--bucket-size", "integer 0..4294967295", "512",
       "qsgd, terngrad, signsgd, onebit: elements per scale bucket",
       unsignedSetter<CodecConfig>([](CodecConfig& c) -> uint32_t& { return c.bucket_size; }, 0,
                                   UINT32_MAX),
       [](const CodecConfig& c) { return json::value(c.bucket_size); }},
      {"momentum", "--momentum", "number", "0", "dgc: momentum correction factor in [0, 1)",
       [](CodecConfig& c, std::string_view s) { return setAnyNumber(s, c.momentum); },
       [](const CodecConfig& c) { return json::value(c.momentum); }},
      {"clip_norm", "--clip-norm", "number", "0", "dgc: local gradient clipping norm (0 = off)",
       [](CodecConfig& c, std::string_view s) { return setAnyNumber(s, c.clip_norm); },
       [](const CodecConfig& c) { return json::value(c.clip_norm); }},
      {"sample_fraction", "--sample-fraction", "number", "0.01",
       "dgc: fraction sampled to estimate the threshold, in [0.001, 0.01]",
       [](CodecConfig& c, std::string_view s) { return setAnyNumber(s, c.sample_fraction); },
       [](const CodecConfig& c) { return json::value(c.sample_fraction); }},
      {"values", "--values", "float32 | float16", "float32",
       "topk, dgc, randomk, threshold: encoding of the values sent",
       [](CodecConfig& c, std::string_view s) -> std::string {
         if (s == "float32" || s == "fp32") {
           c.sparse_values = kernels::DType::kF32;
         } else if (s == "float16" || s == "fp16") {
           c.sparse_values = kernels::DType::kF16;
         } else {
           return "must be float32 or float16";
         }
         return "";
       },
       [](const CodecConfig& c) {
         return json::value(c.sparse_values == kernels::DType::kF16 ? "float16" : "float32");
       }},
      {"threshold", "--threshold", "number", std::nullopt,
       "threshold: send the elements with |g| >= this; \"\" = unset",
       [](CodecConfig& c, std::string_view s) {
         return setOptionalNumber(
             s, c.threshold, [](double) { return true; }, "must be a finite number");
       },
       [](const CodecConfig& c) { return optionalJson(c.threshold); }},
      {"error_feedback", "--error-feedback", "true | false | on | off", std::nullopt,
       "residual error feedback; unset (\"\") = the codec's default",
       [](CodecConfig& c, std::string_view s) -> std::string {
         if (s.empty()) {
           c.error_feedback.reset();
         } else if (s == "true" || s == "on") {
           c.error_feedback = true;
         } else if (s == "false" || s == "off") {
           c.error_feedback = false;
         } else {
           return "must be true, false, on or off";
         }
         return "";
       },
       [](const CodecConfig& c) {
         return c.error_feedback ? json::value(*c.error_feedback) : json::value(nullptr);
       }},
      {"approx_rank", "--approx-rank", "integer", "1", "powersgd: rank of the approximation",
       unsignedSetter<CodecConfig>([](CodecConfig& c) -> int& { return c.approx_rank; }, 0,
                                   INT_MAX),
       [](const CodecConfig& c) { return json::value(c.approx_rank); }},
  };
  return keys;
}

const CodecKey* findCodecKey(std::string_view name) {
  for (const auto& k : codecKeys()) {
    if (name == k.name) return &k;
  }
  return nullptr;
}

// --- The key table ------------------------------------------------------------------------------

/// A key of the table with the code that reads and shows it.
struct KeyImpl {
  ConfigKey info;
  std::function<std::string(ServeConfig&, std::string_view)> set;
  std::function<json::value(const ServeConfig&)> get;
};

std::string envName(const std::string& path) {
  std::string env = kEnvPrefix;
  for (char ch : path) {
    if (ch == '.') {
      env += "__";
    } else {
      env += static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    }
  }
  return env;
}

std::vector<KeyImpl> makeKeyTable() {
  std::vector<KeyImpl> t;
  auto add = [&](std::string path, std::string flag, std::string type,
                 std::optional<std::string> def, std::string description, auto set, auto get,
                 bool secret = false, bool boolean = false) {
    ConfigKey info;
    info.env = envName(path);
    info.path = std::move(path);
    info.flag = std::move(flag);
    info.type = std::move(type);
    info.has_default = def.has_value();
    info.default_text = def.value_or("");
    info.description = std::move(description);
    info.secret = secret;
    info.boolean = boolean;
    t.push_back({std::move(info), std::move(set), std::move(get)});
  };
  using C = ServeConfig;
  add(
      "job_id", "--job-id", "string", "default", "Job name: metric labels and state file names",
      [](C& c, std::string_view s) -> std::string {
        if (s.empty()) return "must not be empty";
        c.job_id = std::string(s);
        return "";
      },
      [](const C& c) { return json::value(c.job_id); });
  add("local_trainers", "--local-trainers", "integer 1..1024", "1",
      "Trainer processes on this node sending each tensor of a step",
      unsignedSetter<C>([](C& c) -> int& { return c.local_trainers; }, 1, 1024),
      [](const C& c) { return json::value(c.local_trainers); });
  add("threads", "--threads", "integer 0..1024", "0",
      "Codec worker threads (0 = the CPUs this process may use: affinity, cgroup CPU quota)",
      unsignedSetter<C>([](C& c) -> unsigned& { return c.threads; }, 0, 1024),
      [](const C& c) { return json::value(c.threads); });
  add(
      "gpu", "--gpu", kBoolType, "true",
      "Run a step on the GPU when every trainer hands device memory (CUDA IPC) on one GPU and its "
      "codec runs there (false: stage it through the host)",
      [](C& c, std::string_view s) { return setBool(s, c.gpu); },
      [](const C& c) { return json::value(c.gpu); }, /*secret=*/false, /*boolean=*/true);
  add(
      "log_level", "--log-level", "trace | debug | info | warn | error", "info",
      "Least severe level logged",
      [](C& c, std::string_view s) -> std::string {
        static const std::set<std::string_view> kLevels = {"trace", "debug", "info", "warn",
                                                           "error"};
        if (!kLevels.count(s)) return "must be one of trace, debug, info, warn, error";
        c.log_level = std::string(s);
        return "";
      },
      [](const C& c) { return json::value(c.log_level); });
  add(
      "log_format", "--log-format", "text | json", "text",
      "Log lines as text, or as one JSON object per line (time, level, msg)",
      [](C& c, std::string_view s) -> std::string {
        if (s != "text" && s != "json") return "must be text or json";
        c.log_format = std::string(s);
        return "";
      },
      [](const C& c) { return json::value(c.log_format); });
  add(
      "control.socket", "--socket", "path", "/run/lightwire/lightwire.sock",
      "Unix socket of the control API (\"\" = no Unix listener); also LIGHTWIRE_SOCKET",
      [](C& c, std::string_view s) -> std::string {
        // sun_path holds 108 bytes including the terminating NUL.
        if (s.size() > 107 || s.find('\0') != std::string_view::npos) {
          return "must be a path of at most 107 bytes";
        }
        c.control_socket = std::string(s);
        return "";
      },
      [](const C& c) { return json::value(c.control_socket); });
  add(
      "control.socket_mode", "--socket-mode", "octal permissions", "0660",
      "Permissions of the Unix socket: owner read-write, optionally the group (0600 or 0660); "
      "permissions for others are refused, since whoever can connect drives the sidecar",
      [](C& c, std::string_view s) -> std::string {
        unsigned mode = 0;
        const bool octal = !s.empty() && s.size() <= 4 &&
                           s.find_first_not_of("01234567") == std::string_view::npos;
        if (octal) {
          for (char ch : s) mode = mode * 8 + static_cast<unsigned>(ch - '0');
        }
        if (!octal || mode > 0777) return "must be octal permissions such as 0600 or 0660";
        if ((mode & 0600) != 0600) return "must give the owner read and write (0600 or 0660)";
        if ((mode & 0007) != 0) {
          return "must not give others any permission: whoever can connect drives the sidecar";
        }
        if ((mode & 0111) != 0) return "must not set execute bits (0600 or 0660)";
        c.control_socket_mode = mode;
        return "";
      },
      [](const C& c) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "%04o", c.control_socket_mode);
        return json::value(buf);
      });
  add(
      "control.tcp", "--control-tcp", "host:port", "127.0.0.1:4780",
      "TCP listener of the control API (\"\" = off, port 0 = chosen by the OS)",
      [](C& c, std::string_view s) { return setListen(s, c.control_tcp); },
      [](const C& c) { return listenJson(c.control_tcp); });
  add(
      "admin.listen", "--admin-listen", "host:port", "0.0.0.0:4782",
      "Admin listener: /healthz, /readyz, /metrics, /v1/status (\"\" = off)",
      [](C& c, std::string_view s) { return setListen(s, c.admin_listen); },
      [](const C& c) { return listenJson(c.admin_listen); });
  add("limits.max_body_bytes", "--max-body-bytes", "integer >= 1", "1073741824",
      "Largest request body accepted (413 beyond)",
      unsignedSetter<C>([](C& c) -> uint64_t& { return c.limits.max_body_bytes; }, 1,
                        std::numeric_limits<uint64_t>::max()),
      [](const C& c) { return json::value(c.limits.max_body_bytes); });
  add("limits.max_inflight_body_bytes", "--max-inflight-body-bytes", "integer >= 0", "0",
      "Request bodies held at once, all connections together, in bytes (429 beyond); 0 = half of "
      "the memory this process may use (its cgroup memory limit, else the physical memory)",
      unsignedSetter<C>([](C& c) -> uint64_t& { return c.limits.max_inflight_body_bytes; }, 0,
                        std::numeric_limits<uint64_t>::max()),
      [](const C& c) { return json::value(c.limits.max_inflight_body_bytes); });
  add("limits.max_header_bytes", "--max-header-bytes", "integer 1024..1048576", "16384",
      "Largest request header block accepted (431 beyond)",
      unsignedSetter<C>([](C& c) -> uint32_t& { return c.limits.max_header_bytes; }, 1024, 1048576),
      [](const C& c) { return json::value(c.limits.max_header_bytes); });
  add(
      "limits.idle_timeout_s", "--idle-timeout", "seconds > 0", "60",
      "Idle keep-alive connections are closed after this",
      [](C& c, std::string_view s) { return setSeconds(s, c.limits.idle_timeout_s); },
      [](const C& c) { return json::value(c.limits.idle_timeout_s); });
  add(
      "limits.step_timeout_s", "--step-timeout", "seconds > 0", "120",
      "A step not complete after this fails with 504",
      [](C& c, std::string_view s) { return setSeconds(s, c.limits.step_timeout_s); },
      [](const C& c) { return json::value(c.limits.step_timeout_s); });
  add("limits.max_buffers", "--max-buffers", "integer >= 1", "1024",
      "Registered buffers at most (429 beyond)",
      unsignedSetter<C>([](C& c) -> int& { return c.limits.max_buffers; }, 1, INT_MAX),
      [](const C& c) { return json::value(c.limits.max_buffers); });
  add("limits.max_buffers_per_client", "--max-buffers-per-client", "integer >= 1", "256",
      "Registered buffers one client process may hold (429 beyond); clients over TCP count "
      "together as one",
      unsignedSetter<C>([](C& c) -> int& { return c.limits.max_buffers_per_client; }, 1, INT_MAX),
      [](const C& c) { return json::value(c.limits.max_buffers_per_client); });
  add("limits.max_pending_steps", "--max-pending-steps", "integer >= 1", "4096",
      "Steps in flight at most (429 beyond)",
      unsignedSetter<C>([](C& c) -> int& { return c.limits.max_pending_steps; }, 1, INT_MAX),
      [](const C& c) { return json::value(c.limits.max_pending_steps); });
  add("limits.max_state_bytes", "--max-state-bytes", "integer >= 0", "0",
      "Codec state (residuals, momentum, factors) of all tensors together at most, in bytes; a "
      "step whose tensor would need more fails with 507 state_limit (0 = no cap)",
      unsignedSetter<C>([](C& c) -> uint64_t& { return c.limits.max_state_bytes; }, 0,
                        std::numeric_limits<uint64_t>::max()),
      [](const C& c) { return json::value(c.limits.max_state_bytes); });
  add("limits.max_connections", "--max-connections", "integer >= 1", "256",
      "Open client connections at most, all listeners together",
      unsignedSetter<C>([](C& c) -> int& { return c.limits.max_connections; }, 1, INT_MAX),
      [](const C& c) { return json::value(c.limits.max_connections); });
  add(
      "security.token", "--token", "string (secret)", "",
      "Bearer token for the TCP control listener and PUT /v1/config (\"\" = none); prefer the "
      "environment variable to the flag",
      [](C& c, std::string_view s) -> std::string {
        for (unsigned char ch : s) {
          if (ch <= 0x20 || ch >= 0x7F) return "must be printable ASCII without spaces";
        }
        c.token = std::string(s);
        return "";
      },
      [](const C& c) { return json::value(c.token.empty() ? "" : kRedacted); },
      /*secret=*/true);
  add(
      "security.token_file", "--token-file", "path", "",
      "File holding security.token (one trailing newline ignored), read at start; instead of "
      "security.token, e.g. a mounted Kubernetes or Docker secret (\"\" = none)",
      [](C& c, std::string_view s) { return setPath(s, c.token_file); },
      [](const C& c) { return json::value(c.token_file); });
  add("rank", "--rank", "integer 0..65535", "0", "This sidecar's rank among the job's sidecars",
      unsignedSetter<C>([](C& c) -> uint32_t& { return c.peer.rank; }, 0, 65535),
      [](const C& c) { return json::value(c.peer.rank); });
  add("world_size", "--world-size", "integer 1..65536", "1",
      "Sidecars (nodes) in the job; 1 = this node alone",
      unsignedSetter<C>([](C& c) -> uint32_t& { return c.peer.world_size; }, 1, 65536),
      [](const C& c) { return json::value(c.peer.world_size); });
  add(
      "peer.listen", "--peer-listen", "host:port", "0.0.0.0:4781",
      "Listener for the other sidecars' connections",
      [](C& c, std::string_view s) -> std::string {
        std::optional<ListenAddress> a;
        if (std::string e = setListen(s, a); !e.empty()) return e;
        if (!a) return "must not be empty";
        c.peer.listen = *a;
        return "";
      },
      [](const C& c) { return json::value(c.peer.listen.toString()); });
  add(
      "peer.peers", "--peers", "host:port,...", "",
      "Every sidecar's peer address, in rank order (this one's included); or one address with "
      "{rank} in it, standing for world_size addresses (\"node-{rank}.peers:4781\": node-0..., "
      "node-1..., ...)",
      [](C& c, std::string_view s) -> std::string {
        std::vector<std::string> out;
        bool templated = false;
        while (!s.empty()) {
          const size_t comma = s.find(',');
          const std::string_view item = s.substr(0, comma);
          const std::string probe = expandRank(item, 0);
          templated = templated || probe != item;
          if (!parseListen(probe)) {
            return "must be \"host:port\" addresses separated by commas, got '" +
                   std::string(item.substr(0, 64)) + "'";
          }
          out.emplace_back(item);
          if (comma == std::string_view::npos) break;
          s = s.substr(comma + 1);
        }
        if (templated && out.size() != 1) {
          return "must be one address when it is a template with {rank}, got " +
                 std::to_string(out.size());
        }
        c.peer.peers = std::move(out);
        return "";
      },
      [](const C& c) {
        std::string joined;
        for (const auto& p : c.peer.peers) joined += (joined.empty() ? "" : ",") + p;
        return json::value(joined);
      });
  add(
      "peer.secret", "--secret", "string (secret)", "",
      "Job secret the sidecars authenticate each other with (HMAC-SHA256); required when "
      "world_size > 1; prefer the environment variable to the flag",
      [](C& c, std::string_view s) -> std::string {
        if (s.find('\0') != std::string_view::npos) return "must not contain NUL";
        c.peer.secret = std::string(s);
        return "";
      },
      [](const C& c) { return json::value(c.peer.secret.empty() ? "" : kRedacted); },
      /*secret=*/true);
  add(
      "peer.secret_file", "--secret-file", "path", "",
      "File holding peer.secret (one trailing newline ignored), read at start; instead of "
      "peer.secret, e.g. a mounted Kubernetes or Docker secret (\"\" = none)",
      [](C& c, std::string_view s) { return setPath(s, c.peer.secret_file); },
      [](const C& c) { return json::value(c.peer.secret_file); });
  add(
      "peer.timeout_s", "--peer-timeout", "seconds > 0", "30",
      "Deadline of one exchange: a silent or dead peer fails the step everywhere within it",
      [](C& c, std::string_view s) { return setSeconds(s, c.peer.timeout_s); },
      [](const C& c) { return json::value(c.peer.timeout_s); });
  add("peer.checksum_every", "--checksum-every", "integer >= 0", "100",
      "Every N steps of a tensor the sidecars compare checksums of their results (0 = never); a "
      "mismatch is logged and counted in lightwire_result_mismatches_total",
      unsignedSetter<C>([](C& c) -> uint64_t& { return c.peer.checksum_every; }, 0,
                        std::numeric_limits<uint64_t>::max()),
      [](const C& c) { return json::value(c.peer.checksum_every); });
  auto oneOf = [](std::initializer_list<std::string_view> allowed, std::string C::Peer::*field) {
    std::vector<std::string_view> names(allowed);
    return [names, field](C& c, std::string_view s) -> std::string {
      for (auto n : names) {
        if (s == n) {
          c.peer.*field = std::string(s);
          return "";
        }
      }
      std::string list;
      for (auto n : names) list += (list.empty() ? "" : ", ") + std::string(n);
      return "must be one of " + list;
    };
  };
  add("peer.transport", "--transport", "tcp | ucx", "tcp",
      "How the sidecars reach each other: TCP (Boost.Asio) or UCX (its transports as UCX_TLS "
      "allows: RDMA where the hardware has it, else TCP; needs peer.peers)",
      oneOf({"tcp", "ucx"}, &C::Peer::transport),
      [](const C& c) { return json::value(c.peer.transport); });
  add("peer.topology", "--topology", "ring | ps", "ring",
      "ring: allreduce/allgather among the sidecars; ps: every sidecar pushes to the "
      "parameter-server sidecar (peer.ps_rank), which sums, re-compresses and broadcasts",
      oneOf({"ring", "ps"}, &C::Peer::topology),
      [](const C& c) { return json::value(c.peer.topology); });
  add("peer.ps_rank", "--ps-rank", "integer 0..65535", "0",
      "The rank of the parameter-server sidecar (topology ps)",
      unsignedSetter<C>([](C& c) -> uint32_t& { return c.peer.ps_rank; }, 0, 65535),
      [](const C& c) { return json::value(c.peer.ps_rank); });
  add("peer.synchrony", "--synchrony", "sync | bounded-staleness", "sync",
      "sync: every step waits for every sidecar; bounded-staleness (topology ps): the server "
      "closes a step without sidecars at most peer.staleness steps behind",
      oneOf({"sync", "bounded-staleness"}, &C::Peer::synchrony),
      [](const C& c) { return json::value(c.peer.synchrony); });
  add("peer.staleness", "--staleness", "integer 1..1000", "2",
      "bounded-staleness: how many steps a sidecar may run ahead of the slowest",
      unsignedSetter<C>([](C& c) -> uint32_t& { return c.peer.staleness; }, 1, 1000),
      [](const C& c) { return json::value(c.peer.staleness); });
  add(
      "peer.straggler_wait_s", "--straggler-wait", "seconds > 0", "0.02",
      "bounded-staleness: how long the server waits for missing contributions once the others "
      "are in",
      [](C& c, std::string_view s) { return setSeconds(s, c.peer.straggler_wait_s); },
      [](const C& c) { return json::value(c.peer.straggler_wait_s); });
  add(
      "peer.rendezvous", "--rendezvous", "host:port", "",
      "Rank 0's peer address: the sidecars learn each other's addresses there instead of "
      "peer.peers (\"\" = use peer.peers)",
      [](C& c, std::string_view s) { return setListen(s, c.peer.rendezvous); },
      [](const C& c) { return listenJson(c.peer.rendezvous); });
  add(
      "peer.advertise", "--advertise", "host:port", "",
      "This sidecar's peer address as the others reach it, told to the rendezvous (\"\" = the "
      "listener's port on the address rank 0 sees the connection come from)",
      [](C& c, std::string_view s) { return setListen(s, c.peer.advertise); },
      [](const C& c) { return listenJson(c.peer.advertise); });
  // --- TLS on the tcp transport's connections (docs/peer-protocol.md "TLS") ---------------------
  auto tlsBool = [&](std::string path, std::string flag, bool C::Peer::Tls::*field, bool def,
                     std::string what) {
    add(
        std::move(path), std::move(flag), kBoolType, def ? "true" : "false", std::move(what),
        [field](C& c, std::string_view s) { return setBool(s, c.peer.tls.*field); },
        [field](const C& c) { return json::value(c.peer.tls.*field); }, /*secret=*/false,
        /*boolean=*/true);
  };
  auto tlsFile = [&](std::string path, std::string flag, std::string C::Peer::Tls::*field,
                     std::string what) {
    add(
        std::move(path), std::move(flag), "path", "", std::move(what),
        [field](C& c, std::string_view s) { return setPath(s, c.peer.tls.*field); },
        [field](const C& c) { return json::value(c.peer.tls.*field); });
  };
  tlsBool("peer.tls.enabled", "--peer-tls", &C::Peer::Tls::enabled, false,
          "TLS (1.2 or 1.3) on every peer connection of the tcp transport, mutual: each sidecar "
          "presents peer.tls.cert_file and checks the other's against peer.tls.ca_file; the job "
          "secret's handshake runs inside it");
  tlsFile("peer.tls.cert_file", "--peer-tls-cert", &C::Peer::Tls::cert_file,
          "PEM certificate this sidecar presents to its peers (then any intermediate CA "
          "certificates); required with peer.tls.enabled");
  tlsFile("peer.tls.key_file", "--peer-tls-key", &C::Peer::Tls::key_file,
          "PEM private key of peer.tls.cert_file, unencrypted; required with peer.tls.enabled "
          "(its contents are never logged)");
  tlsFile("peer.tls.ca_file", "--peer-tls-ca", &C::Peer::Tls::ca_file,
          "PEM certificate(s) of the CA a peer's certificate must chain to; required with "
          "peer.tls.enabled and peer.tls.verify");
  tlsBool("peer.tls.verify", "--peer-tls-verify", &C::Peer::Tls::verify, true,
          "Check the peers' certificates against peer.tls.ca_file (host names are not checked); "
          "false: any certificate is accepted (encryption only, the job secret still "
          "authenticates)");
  // --- policies (docs/policies.md); the defaults are PolicyConfig's own ------------------------
  const policies::PolicyConfig pd;
  using P = policies::PolicyConfig;
  auto policyBool = [&](std::string path, std::string flag, bool P::*field, std::string what) {
    add(
        std::move(path), std::move(flag), kBoolType, std::string(pd.*field ? "true" : "false"),
        std::move(what),
        [field](C& c, std::string_view s) { return setBool(s, c.policies.*field); },
        [field](const C& c) { return json::value(c.policies.*field); }, /*secret=*/false,
        /*boolean=*/true);
  };
  auto policyNumber = [&](std::string path, std::string flag, double P::*field, bool (*ok)(double),
                          std::string type, std::string what) {
    std::string must = "must be a number " + type.substr(type.find(' ') + 1);
    add(
        std::move(path), std::move(flag), std::move(type), numberText(pd.*field), std::move(what),
        [field, ok, must](C& c, std::string_view s) {
          return setNumber(s, c.policies.*field, ok, must);
        },
        [field](const C& c) { return json::value(c.policies.*field); });
  };
  // An unsigned field of PolicyConfig in [lo, hi] (its type's range at most).
  auto policyUnsigned = [&](std::string path, std::string flag, auto P::*field, uint64_t lo,
                            uint64_t hi, std::string what) {
    using T = std::remove_cvref_t<decltype(pd.*field)>;
    hi = std::min<uint64_t>(hi, std::numeric_limits<T>::max());
    std::string type = hi == std::numeric_limits<uint64_t>::max()
                           ? "integer >= " + std::to_string(lo)
                           : "integer " + std::to_string(lo) + ".." + std::to_string(hi);
    add(std::move(path), std::move(flag), std::move(type), std::to_string(pd.*field),
        std::move(what),
        unsignedSetter<C>([field](C& c) -> T& { return c.policies.*field; }, lo, hi),
        [field](const C& c) { return json::value(static_cast<uint64_t>(c.policies.*field)); });
  };
  constexpr uint64_t kNoMax = std::numeric_limits<uint64_t>::max();
  policyBool("policies.anomaly", "--anomaly", &P::anomaly,
             "Anomaly policy: NaN/Inf, or a global gradient norm exploding or vanishing against "
             "its baseline, bypasses compression (dense exchange) for policies.bypass_steps steps");
  policyUnsigned("policies.bypass_steps", "--bypass-steps", &P::bypass_steps, 1, kNoMax,
                 "Steps of dense exchange after an anomaly");
  policyNumber(
      "policies.explode_factor", "--explode-factor", &P::explode_factor,
      [](double v) { return v > 1; }, "number > 1",
      "Norm explosion: the norm is above this times its baseline mean (and 6 deviations above it)");
  policyNumber(
      "policies.vanish_factor", "--vanish-factor", &P::vanish_factor,
      [](double v) { return v > 0 && v < 1; }, "number in (0, 1)",
      "Norm vanishing: the norm is below this times its baseline mean");
  policyNumber(
      "policies.ewma_alpha", "--ewma-alpha", &P::ewma_alpha,
      [](double v) { return v > 0 && v <= 1; }, "number in (0, 1]",
      "Weight of a new sample in every exponentially weighted baseline");
  policyUnsigned("policies.baseline_steps", "--baseline-steps", &P::baseline_steps, 1, kNoMax,
                 "Samples before a baseline is trusted (no anomaly or rollback decided before)");
  policyUnsigned("policies.full_sync_every", "--full-sync-every", &P::full_sync_every, 0, kNoMax,
                 "Periodic full-sync: steps N, 2N, ... of a tensor are a dense exchange that also "
                 "flushes the residuals (0 = off)");
  policyBool("policies.rollback", "--rollback", &P::rollback,
             "Rollback policy: when the health signals degrade, revert to the last known-good "
             "compression settings");
  policyNumber(
      "policies.cosine_drop", "--cosine-drop", &P::cosine_drop,
      [](double v) { return v > 0 && v < 1; }, "number in (0, 1)",
      "Degraded: the sampled cosine similarity is below its baseline times (1 - this)");
  policyNumber(
      "policies.loss_rise", "--loss-rise", &P::loss_rise, [](double v) { return v > 0; },
      "number > 0", "Degraded: the reported loss is above its baseline times (1 + this)");
  policyUnsigned("policies.patience", "--patience", &P::patience, 1, kNoMax,
                 "Consecutive degraded steps before a rollback");
  policyUnsigned("policies.cooldown_steps", "--cooldown-steps", &P::cooldown_steps, 0, kNoMax,
                 "No further rollback for this many steps after one");
  policyUnsigned("policies.known_good_steps", "--known-good-steps", &P::known_good_steps, 0, kNoMax,
                 "Settings in force this many steps without degradation become known-good");
  policyNumber(
      "policies.min_magnitude", "--min-magnitude", &P::min_magnitude,
      [](double v) { return v >= 0; }, "number >= 0",
      "Selection codecs (topk, dgc, randomk, threshold) never send an element with |g| below this");
  policyUnsigned("policies.decision_log", "--decision-log", &P::decision_log, 1, 100000,
                 "Decision log entries kept (shown in /v1/status)");
  policyUnsigned("schedule.warmup_steps", "--warmup-steps", &P::warmup_steps, 0, kNoMax,
                 "DGC warm-up: over each tensor's first N steps, topk/dgc/randomk send at least "
                 "25 %, 6.25 %, 1.5625 %, 0.39 %, 0.098 % of the elements (five equal stages), "
                 "then their own density (0 = off)");
  policyUnsigned("schedule.total_steps", "--total-steps", &P::total_steps, 0, kNoMax,
                 "Training-phase schedule: the job's length in steps; in its first and last 20 % "
                 "the density is schedule.phase_factor times higher (0 = off)");
  policyNumber(
      "schedule.phase_factor", "--phase-factor", &P::phase_factor, [](double v) { return v >= 1; },
      "number >= 1",
      "Training-phase schedule: density multiplier early and late (the density stays <= 1)");
  policyBool("schedule.adaptive", "--adaptive", &P::adaptive,
             "Adaptive ratio: compress harder or softer from the gradient statistics");
  policyNumber(
      "schedule.adaptive_tiny", "--adaptive-tiny", &P::adaptive_tiny,
      [](double v) { return v > 0 && v < 1; }, "number in (0, 1)",
      "Adaptive: a norm below this times its baseline compresses harder (ratio x2)");
  policyNumber(
      "schedule.adaptive_sparse", "--adaptive-sparse", &P::adaptive_sparse,
      [](double v) { return v > 0 && v <= 1; }, "number in (0, 1]",
      "Adaptive: a fraction of elements below policies.min_magnitude above this compresses "
      "softer (ratio /2)");
  policyNumber(
      "schedule.adaptive_max_ratio", "--adaptive-max-ratio", &P::adaptive_max_ratio,
      [](double v) { return v >= 1; }, "number >= 1", "Adaptive: harder up to this ratio (n/k)");
  policyNumber(
      "schedule.adaptive_min_ratio", "--adaptive-min-ratio", &P::adaptive_min_ratio,
      [](double v) { return v >= 1; }, "number >= 1",
      "Adaptive: softer down to this ratio (n/k); at most schedule.adaptive_max_ratio");
  // --- durable state ----------------------------------------------------------------------------
  add(
      "state.dir", "--state-dir", "path", "/var/lib/lightwire",
      "Directory of the checkpoint files of codec and policy state (\"\" = no durable state)",
      [](C& c, std::string_view s) { return setPath(s, c.state.dir); },
      [](const C& c) { return json::value(c.state.dir); });
  add("state.checkpoint_every", "--checkpoint-every", "integer >= 0", "1000",
      "Periodic checkpoint of the state every N steps (0 = off)",
      unsignedSetter<C>([](C& c) -> uint64_t& { return c.state.checkpoint_every; }, 0, kNoMax),
      [](const C& c) { return json::value(c.state.checkpoint_every); });
  add("state.keep", "--checkpoint-keep", "integer 1..1000", "3",
      "Periodic and on-SIGTERM checkpoint files kept (the oldest are removed)",
      unsignedSetter<C>([](C& c) -> uint32_t& { return c.state.keep; }, 1, 1000),
      [](const C& c) { return json::value(c.state.keep); });
  add("state.keep_trainer", "--trainer-checkpoint-keep", "integer 0..1000000", "0",
      "Trainer-requested checkpoint files (POST /v1/checkpoint) kept, the most recently written "
      "(0 = all: the trainer's own retention decides)",
      unsignedSetter<C>([](C& c) -> uint32_t& { return c.state.keep_trainer; }, 0, 1000000),
      [](const C& c) { return json::value(c.state.keep_trainer); });
  add(
      "state.fresh", "--fresh-state", kBoolType, "false",
      "Start without the checkpoints in state.dir, even when the newest is unreadable or of "
      "another job or world size",
      [](C& c, std::string_view s) { return setBool(s, c.state.fresh); },
      [](const C& c) { return json::value(c.state.fresh); }, /*secret=*/false, /*boolean=*/true);
  add("compression.chunk_elements", "--chunk-elements", "integer >= 1", "1048576",
      "Elements per chunk (rounded up to the codec's alignment)",
      unsignedSetter<C>([](C& c) -> uint64_t& { return c.compression.chunk_elements; }, 1,
                        std::numeric_limits<uint64_t>::max()),
      [](const C& c) { return json::value(c.compression.chunk_elements); });
  for (const CodecKey& k : codecKeys()) {
    auto def = k.default_text ? std::optional<std::string>(*k.default_text) : std::nullopt;
    auto set = k.set;
    auto get = k.get;
    add(
        std::string(kDefaultCodecPath) + "." + k.name, k.flag, k.type, def,
        std::string("Default codec: ") + k.description,
        [set](C& c, std::string_view s) { return set(c.compression.default_codec, s); },
        [get](const C& c) { return get(c.compression.default_codec); });
  }
  return t;
}

const std::vector<KeyImpl>& keyTable() {
  static const std::vector<KeyImpl> table = makeKeyTable();
  return table;
}

const KeyImpl* findKey(std::string_view path) {
  for (const auto& k : keyTable()) {
    if (k.info.path == path) return &k;
  }
  return nullptr;
}

/// Whether `path` is a section (a proper prefix of some key path, or compression.rules' parent).
bool isSection(std::string_view path) {
  if (path.empty()) return true;
  for (const auto& k : keyTable()) {
    const std::string& p = k.info.path;
    if (p.size() > path.size() && p.compare(0, path.size(), path) == 0 && p[path.size()] == '.') {
      return true;
    }
  }
  return false;
}

std::string shown(std::string_view raw) {
  if (raw.size() <= kMaxShownValue) return std::string(raw);
  return std::string(raw.substr(0, kMaxShownValue)) + "...";
}

std::string withSource(const std::string& source, const std::string& message) {
  return source.empty() ? message : source + ": " + message;
}

// --- A source-neutral tree (YAML and JSON are both read into it) -------------------------------

/// A parsed document: null, scalar text, map (keys + items) or list (items).
struct Tree {
  enum class Kind { kNull, kScalar, kMap, kList };
  Kind kind = Kind::kNull;
  std::string scalar;
  std::vector<std::string> keys;  // kMap: keys[i] names items[i]
  std::vector<Tree> items;

  const char* kindName() const {
    switch (kind) {
      case Kind::kNull:
        return "null";
      case Kind::kScalar:
        return "a single value";
      case Kind::kMap:
        return "a map";
      case Kind::kList:
        return "a list";
    }
    return "?";
  }
};

std::string childPath(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}

Result<Tree> fromYaml(const YAML::Node& n, const std::string& path, int depth) {
  if (depth > kMaxDepth) return invalidArgument(path + ": nested too deeply");
  Tree t;
  switch (n.Type()) {
    case YAML::NodeType::Undefined:
    case YAML::NodeType::Null:
      return t;
    case YAML::NodeType::Scalar:
      t.kind = Tree::Kind::kScalar;
      t.scalar = n.Scalar();
      return t;
    case YAML::NodeType::Sequence: {
      t.kind = Tree::Kind::kList;
      size_t i = 0;
      for (const auto& item : n) {
        auto child = fromYaml(item, path + "[" + std::to_string(i++) + "]", depth + 1);
        if (!child) return child.status();
        t.items.push_back(std::move(child).value());
      }
      return t;
    }
    case YAML::NodeType::Map: {
      t.kind = Tree::Kind::kMap;
      for (const auto& kv : n) {
        if (!kv.first.IsScalar()) {
          return invalidArgument((path.empty() ? std::string("the top level") : path) +
                                 " has a key that is not a plain name");
        }
        const std::string key = kv.first.Scalar();
        auto child = fromYaml(kv.second, childPath(path, key), depth + 1);
        if (!child) return child.status();
        t.keys.push_back(key);
        t.items.push_back(std::move(child).value());
      }
      return t;
    }
  }
  return t;
}

std::string jsonNumberText(const json::value& v) {
  if (v.is_int64()) return std::to_string(v.get_int64());
  if (v.is_uint64()) return std::to_string(v.get_uint64());
  const double d = v.get_double();
  // 5.0 from a JSON encoder that always writes doubles still reads as the integer 5.
  if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9007199254740992.0) {
    return std::to_string(static_cast<int64_t>(d));
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", d);
  return buf;
}

Result<Tree> fromJson(const json::value& v, const std::string& path, int depth) {
  if (depth > kMaxDepth) return invalidArgument(path + ": nested too deeply");
  Tree t;
  switch (v.kind()) {
    case json::kind::null:
      return t;
    case json::kind::bool_:
      t.kind = Tree::Kind::kScalar;
      t.scalar = v.get_bool() ? "true" : "false";
      return t;
    case json::kind::int64:
    case json::kind::uint64:
    case json::kind::double_:
      t.kind = Tree::Kind::kScalar;
      t.scalar = jsonNumberText(v);
      return t;
    case json::kind::string:
      t.kind = Tree::Kind::kScalar;
      t.scalar = std::string(v.get_string());
      return t;
    case json::kind::array: {
      t.kind = Tree::Kind::kList;
      size_t i = 0;
      for (const auto& item : v.get_array()) {
        auto child = fromJson(item, path + "[" + std::to_string(i++) + "]", depth + 1);
        if (!child) return child.status();
        t.items.push_back(std::move(child).value());
      }
      return t;
    }
    case json::kind::object: {
      t.kind = Tree::Kind::kMap;
      for (const auto& kv : v.get_object()) {
        const std::string key(kv.key());
        auto child = fromJson(kv.value(), childPath(path, key), depth + 1);
        if (!child) return child.status();
        t.keys.push_back(key);
        t.items.push_back(std::move(child).value());
      }
      return t;
    }
  }
  return t;
}

// --- Applying a tree ----------------------------------------------------------------------------

/// Which source last set each key (for messages about several keys together: the default codec,
/// the policies).
using Origins = std::map<std::string, std::string>;

std::string valueError(const std::string& source, const std::string& key, const std::string& what,
                       std::string_view raw, bool secret) {
  std::string m = key + " " + what;
  m += secret ? " (value not shown)" : ", got '" + shown(raw) + "'";
  return withSource(source, m);
}

Status setKey(const KeyImpl& k, std::string_view raw, ServeConfig& cfg, const std::string& source,
              const std::string& name_in_message, Origins* origins) {
  // Values end up in JSON (/v1/status, the settings proposed to the peers): UTF-8 only.
  const std::string e = isValidUtf8(raw) ? k.set(cfg, raw) : "is not UTF-8 text";
  if (!e.empty())
    return invalidArgument(valueError(source, name_in_message, e, raw, k.info.secret));
  if (origins) (*origins)[k.info.path] = source;
  return Status::ok();
}

Status validateCodec(const CodecConfig& c, const std::string& where) {
  auto codec = kernels::createCodec(c);
  if (!codec) return invalidArgument(where + ": " + codec.status().message());
  return Status::ok();
}

/// A rule's `group`: "" (the codec name) or 1..64 of [A-Za-z0-9_.-] (a metrics label value).
bool validGroup(std::string_view g) {
  if (g.size() > kMaxGroupChars) return false;
  for (unsigned char ch : g) {
    if (!std::isalnum(ch) && ch != '_' && ch != '.' && ch != '-') return false;
  }
  return true;
}

Result<CodecRule> parseRule(const Tree& t, const std::string& where, const std::string& source) {
  if (t.kind != Tree::Kind::kMap) {
    return invalidArgument(
        withSource(source, where + " must be a map of codec keys, got " + t.kindName()));
  }
  CodecRule rule;
  bool has_codec = false;
  for (size_t i = 0; i < t.keys.size(); ++i) {
    const std::string& key = t.keys[i];
    const Tree& item = t.items[i];
    const std::string name = where + "." + key;
    if (item.kind == Tree::Kind::kMap || item.kind == Tree::Kind::kList) {
      return invalidArgument(
          withSource(source, name + " must be a single value, got " + item.kindName()));
    }
    const std::string& raw = item.scalar;
    if (key == "pattern") {
      if (raw.empty() || raw.find('\0') != std::string::npos) {
        return invalidArgument(valueError(source, name, "must be a non-empty glob", raw, false));
      }
      rule.pattern = raw;
    } else if (key == "min_elements" || key == "max_elements") {
      uint64_t v = 0;
      const std::string e = setUnsigned(raw, 0, std::numeric_limits<uint64_t>::max(), v);
      if (!e.empty()) return invalidArgument(valueError(source, name, e, raw, false));
      (key == "min_elements" ? rule.min_elements : rule.max_elements) = v;
    } else if (key == "sync_every") {
      uint64_t v = 0;
      const std::string e = setUnsigned(raw, 1, kMaxSyncEvery, v);
      if (!e.empty()) return invalidArgument(valueError(source, name, e, raw, false));
      rule.sync_every = static_cast<uint32_t>(v);
    } else if (key == "group") {
      if (!validGroup(raw)) {
        return invalidArgument(valueError(
            source, name, "must be 1..64 characters of A-Z a-z 0-9 _ . - (\"\" = the codec name)",
            raw, false));
      }
      rule.group = raw;
    } else if (const CodecKey* ck = findCodecKey(key)) {
      const std::string e = ck->set(rule.codec, raw);
      if (!e.empty()) return invalidArgument(valueError(source, name, e, raw, false));
      has_codec = has_codec || key == "codec";
    } else {
      return invalidArgument(withSource(source, "unknown key '" + name + "'"));
    }
  }
  if (!has_codec) return invalidArgument(withSource(source, where + ".codec is required"));
  if (rule.min_elements && rule.max_elements && *rule.min_elements > *rule.max_elements) {
    return invalidArgument(
        withSource(source, where + ": min_elements " + std::to_string(*rule.min_elements) +
                               " is above max_elements " + std::to_string(*rule.max_elements)));
  }
  LW_RETURN_IF_ERROR(validateCodec(rule.codec, withSource(source, where)));
  return rule;
}

Result<std::vector<CodecRule>> parseRules(const Tree& t, const std::string& source) {
  std::vector<CodecRule> rules;
  if (t.kind == Tree::Kind::kNull) return rules;
  if (t.kind != Tree::Kind::kList) {
    return invalidArgument(
        withSource(source, std::string(kRulesPath) + " must be a list, got " + t.kindName()));
  }
  for (size_t i = 0; i < t.items.size(); ++i) {
    auto rule =
        parseRule(t.items[i], std::string(kRulesPath) + "[" + std::to_string(i) + "]", source);
    if (!rule) return rule.status();
    rules.push_back(std::move(rule).value());
  }
  return rules;
}

Status applyTree(const Tree& t, const std::string& path, ServeConfig& cfg,
                 const std::string& source, Origins* origins) {
  if (path == kRulesPath) {
    auto rules = parseRules(t, source);
    if (!rules) return rules.status();
    cfg.compression.rules = std::move(rules).value();
    return Status::ok();
  }
  if (const KeyImpl* k = findKey(path)) {
    if (t.kind == Tree::Kind::kMap || t.kind == Tree::Kind::kList) {
      return invalidArgument(
          withSource(source, path + " must be a single value, got " + t.kindName()));
    }
    return setKey(*k, t.scalar, cfg, source, path, origins);  // null reads as ""
  }
  if (!isSection(path)) return invalidArgument(withSource(source, "unknown key '" + path + "'"));
  if (t.kind == Tree::Kind::kNull) return Status::ok();
  if (t.kind != Tree::Kind::kMap) {
    return invalidArgument(withSource(source, (path.empty() ? std::string("the top level") : path) +
                                                  " must be a map, got " + t.kindName()));
  }
  for (size_t i = 0; i < t.keys.size(); ++i) {
    LW_RETURN_IF_ERROR(applyTree(t.items[i], childPath(path, t.keys[i]), cfg, source, origins));
  }
  return Status::ok();
}

/// The defaults, applied from the table's text through the same setters as every source.
ServeConfig defaults() {
  ServeConfig c;
  for (const auto& k : keyTable()) {
    if (!k.info.has_default) continue;
    const std::string e = k.set(c, k.info.default_text);
    assert(e.empty() && "a default in the key table does not parse");
    (void)e;
  }
  return c;
}

Status validateDefaultCodec(const ServeConfig& cfg, const Origins& origins) {
  auto codec = kernels::createCodec(cfg.compression.default_codec);
  if (codec) return Status::ok();
  std::string m = std::string(kDefaultCodecPath) + ": " + codec.status().message();
  const std::string prefix = std::string(kDefaultCodecPath) + ".";
  std::string from;
  for (const auto& [path, source] : origins) {
    if (path.rfind(prefix, 0) != 0) continue;
    from += (from.empty() ? "" : "; ") + path.substr(prefix.size()) + " from " + source;
  }
  if (!from.empty()) m += " (" + from + ")";
  return invalidArgument(m);
}

/// A key's value as shown in messages ("0.5", not JSON's "5E-1").
std::string valueText(const json::value& v) {
  if (v.is_double()) return numberText(v.get_double());
  if (v.is_string()) return std::string(v.get_string());
  return json::serialize(v);
}

/// Whether `message` names the key `path` as a whole word ("schedule.adaptive" is not named by
/// "schedule.adaptive_tiny").
bool names(std::string_view message, std::string_view path) {
  auto word = [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_'; };
  for (size_t pos = message.find(path); pos != std::string_view::npos;
       pos = message.find(path, pos + 1)) {
    const size_t end = pos + path.size();
    if ((pos == 0 || !word(message[pos - 1])) && (end == message.size() || !word(message[end]))) {
      return true;
    }
  }
  return false;
}

/// policies::validate() on the merged config; its error gets the value and the source of every
/// key it names.
Status validatePolicies(const ServeConfig& cfg, const Origins& origins) {
  const Status st = policies::validate(cfg.policies);
  if (st.isOk()) return st;
  std::string m = st.message();
  std::string values;
  for (const auto& k : keyTable()) {
    if (k.info.secret || !names(st.message(), k.info.path)) continue;
    values += (values.empty() ? "" : "; ") + k.info.path + " " + valueText(k.get(cfg));
    const auto it = origins.find(k.info.path);
    values += it == origins.end() ? " (default)" : " from " + it->second;
  }
  if (!values.empty()) m += " (" + values + ")";
  return invalidArgument(m);
}

Result<std::string> readFile(const std::string& path) {
  const std::string source = "file " + path;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return invalidArgument(source + ": cannot open: " + std::strerror(errno));
  std::string text;
  char buf[65536];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
  const bool failed = std::ferror(f);
  const int err = errno;
  std::fclose(f);
  if (failed) return invalidArgument(source + ": cannot read: " + std::strerror(err));
  return text;
}

constexpr size_t kMaxSecretFileBytes = 4096;

/// Reads `file_key`'s file into the secret key `value_key` (one trailing "\n" or "\r\n"
/// dropped), checked by that key's own rules; the contents never appear in a message. A file
/// others may read is allowed (a Kubernetes secret volume's default mode is 0644) with a warning.
Status readSecretFile(const std::string& file_key, const std::string& file,
                      const std::string& value_key, ServeConfig& cfg, Origins& origins,
                      std::vector<std::string>& warnings) {
  if (file.empty()) return Status::ok();
  const KeyImpl& value = *findKey(value_key);
  const json::value current = value.get(cfg);
  if (!current.is_string() || !current.as_string().empty()) {
    return invalidArgument("give " + value_key + " or " + file_key + ", not both (" + value_key +
                           " from " + origins[value_key] + ")");
  }
  const std::string source = file_key + " " + file;
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) return invalidArgument(source + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  std::string text;
  std::string error;
  if (::fstat(fd, &st) != 0) {
    error = std::string("cannot stat: ") + std::strerror(errno);
  } else if (!S_ISREG(st.st_mode)) {
    error = "is not a regular file";
  } else if (static_cast<uint64_t>(st.st_size) > kMaxSecretFileBytes) {
    error = "is " + std::to_string(st.st_size) + " bytes; a secret file holds at most " +
            std::to_string(kMaxSecretFileBytes);
  } else {
    text.resize(kMaxSecretFileBytes + 1);
    size_t got = 0;
    while (got < text.size()) {
      const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) error = std::string("cannot read: ") + std::strerror(errno);
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    text.resize(got);
    if (error.empty() && got > kMaxSecretFileBytes) error = "grew past the limit while read";
  }
  ::close(fd);
  if (!error.empty()) return invalidArgument(source + ": " + error);
  if (text.size() >= 1 && text.back() == '\n') text.pop_back();
  if (text.size() >= 1 && text.back() == '\r') text.pop_back();
  if (text.empty()) return invalidArgument(source + ": the file is empty");
  if (st.st_mode & S_IROTH) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    warnings.push_back(source + ": other users may read it (mode " + mode + "); chmod o-r");
  }
  return setKey(value, text, cfg, source, value_key, &origins);
}

/// A peer.peers template ("node-{rank}.peers:4781") as world_size addresses.
void expandPeerTemplate(ServeConfig& cfg) {
  auto& p = cfg.peer;
  if (p.peers.size() != 1 || p.peers[0].find(kRankPlaceholder) == std::string::npos) return;
  const std::string pattern = p.peers[0];
  p.peers.clear();
  for (uint32_t r = 0; r < p.world_size; ++r) p.peers.push_back(expandRank(pattern, r));
}

Status applyFile(const std::string& path, ServeConfig& cfg, Origins& origins) {
  const std::string source = "file " + path;
  auto text = readFile(path);
  if (!text) return text.status();
  // Values end up in JSON (/v1/status, the settings proposed to the peers): UTF-8 only.
  if (!isValidUtf8(*text)) return invalidArgument(source + ": the file is not UTF-8 text");
  Tree tree;
  try {
    const YAML::Node root = YAML::Load(*text);
    auto t = fromYaml(root, "", 0);
    if (!t) return invalidArgument(withSource(source, t.status().message()));
    tree = std::move(t).value();
  } catch (const YAML::Exception& e) {
    return invalidArgument(source + ": invalid YAML at line " + std::to_string(e.mark.line + 1) +
                           ", column " + std::to_string(e.mark.column + 1) + ": " + e.msg);
  } catch (const std::exception& e) {
    return invalidArgument(source + ": " + e.what());
  }
  return applyTree(tree, "", cfg, source, &origins);
}

Status applyEnvironment(const std::vector<std::string>& entries, ServeConfig& cfg, Origins& origins,
                        std::vector<std::string>& warnings) {
  std::map<std::string, std::string> vars;  // the last of duplicate entries wins, as in getenv
  for (const auto& entry : entries) {
    const size_t eq = entry.find('=');
    if (eq == std::string::npos || entry.rfind(kEnvPrefix, 0) != 0) continue;
    vars[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  // The alias first, so the specific name wins when both are set.
  if (auto it = vars.find(kSocketAlias); it != vars.end()) {
    LW_RETURN_IF_ERROR(setKey(*findKey("control.socket"), it->second, cfg,
                              std::string("environment ") + kSocketAlias, "control.socket",
                              &origins));
    const auto specific = vars.find(envName("control.socket"));
    if (specific != vars.end() && specific->second != it->second) {
      warnings.push_back("environment: " + specific->first + " overrides " + kSocketAlias);
    }
  }
  std::set<std::string> known = {kSocketAlias};
  for (const auto& k : keyTable()) {
    known.insert(k.info.env);
    auto it = vars.find(k.info.env);
    if (it == vars.end()) continue;
    LW_RETURN_IF_ERROR(
        setKey(k, it->second, cfg, "environment " + k.info.env, k.info.path, &origins));
  }
  for (const auto& [name, value] : vars) {
    if (known.count(name)) continue;
    if (name == envName(kRulesPath)) {
      warnings.push_back("environment " + name + ": ignored; " + kRulesPath +
                         " can only be set in the file or with PUT /v1/config");
    } else {
      warnings.push_back("environment " + name + ": unknown variable, ignored");
    }
  }
  return Status::ok();
}

Status applyFlags(const FlagValues& flags, ServeConfig& cfg, Origins& origins,
                  std::vector<std::string>& warnings) {
  for (const auto& [path, raw] : flags.values) {
    const KeyImpl* k = findKey(path);
    if (!k) return invalidArgument("flag for an unknown key '" + path + "'");
    LW_RETURN_IF_ERROR(setKey(*k, raw, cfg, "flag " + k->info.flag, k->info.path, &origins));
    if (k->info.secret && !raw.empty()) {
      warnings.push_back("flag " + k->info.flag +
                         ": other local users can read it in the process " + "list; prefer " +
                         k->info.env);
    }
  }
  return Status::ok();
}

void insertAt(json::object& root, const std::string& path, json::value v) {
  json::object* o = &root;
  size_t begin = 0;
  for (size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', begin)) {
    json::value& child = (*o)[path.substr(begin, dot - begin)];
    if (!child.is_object()) child = json::object();
    o = &child.get_object();
    begin = dot + 1;
  }
  (*o)[path.substr(begin)] = std::move(v);
}

json::object codecJson(const CodecConfig& c) {
  json::object o;
  for (const auto& k : codecKeys()) o[k.name] = k.get(c);
  return o;
}

}  // namespace

bool CodecRule::matches(std::string_view name, uint64_t elements) const {
  if (min_elements && elements < *min_elements) return false;
  if (max_elements && elements > *max_elements) return false;
  if (pattern && fnmatch(pattern->c_str(), std::string(name).c_str(), 0) != 0) return false;
  return true;
}

const CodecRule* CompressionConfig::ruleFor(std::string_view name, uint64_t elements) const {
  for (const auto& r : rules) {
    if (r.matches(name, elements)) return &r;
  }
  return nullptr;
}

const kernels::CodecConfig& CompressionConfig::codecFor(std::string_view name,
                                                        uint64_t elements) const {
  const CodecRule* r = ruleFor(name, elements);
  return r ? r->codec : default_codec;
}

std::string ListenAddress::toString() const {
  const std::string p = std::to_string(port);
  return host.find(':') != std::string::npos ? "[" + host + "]:" + p : host + ":" + p;
}

const std::vector<ConfigKey>& serveConfigKeys() {
  static const std::vector<ConfigKey> keys = [] {
    std::vector<ConfigKey> v;
    for (const auto& k : keyTable()) v.push_back(k.info);
    return v;
  }();
  return keys;
}

void addServeFlags(CLI::App& app, FlagValues& flags) {
  app.add_option_function<std::string>(
         "--config", [&flags](const std::string& v) { flags.config_file = v; },
         "YAML configuration file (docs/configuration.md)")
      ->type_name("FILE");
  for (const auto& k : keyTable()) {
    const ConfigKey& info = k.info;
    std::string help = info.description + " [" + info.path + ", " + info.env + "; default ";
    help += info.has_default ? (info.default_text.empty() ? "\"\"" : info.default_text) : "unset";
    help += "]";
    const std::string path = info.path;
    CLI::Option* opt =
        app.add_option_function<std::string>(
               info.flag, [&flags, path](const std::string& v) { flags.values[path] = v; }, help)
            ->type_name(info.type);
    // A bool key's flag alone means true ("--fresh-state"); "--anomaly false" and "--anomaly=no"
    // give the value.
    if (info.boolean) opt->expected(0, 1)->default_str("true")->option_text("[true | false]");
  }
}

namespace {

/// peer.tls: complete when enabled, and for the tcp transport only.
Status checkPeerTls(const ServeConfig::Peer& p) {
  if (!p.tls.enabled) return Status::ok();
  if (p.transport != "tcp") {
    return invalidArgument("peer.tls applies to the tcp transport only (peer.transport is " +
                           p.transport + ")");
  }
  const std::pair<const char*, const std::string*> files[] = {
      {"peer.tls.cert_file", &p.tls.cert_file},
      {"peer.tls.key_file", &p.tls.key_file},
      {"peer.tls.ca_file", p.tls.verify ? &p.tls.ca_file : nullptr},
  };
  for (const auto& [key, path] : files) {
    if (path && path->empty()) {
      return invalidArgument(std::string(key) + " must be set when peer.tls.enabled is true" +
                             (path == &p.tls.ca_file ? " and peer.tls.verify is true" : ""));
    }
  }
  return Status::ok();
}

}  // namespace

Status checkMembership(const ServeConfig& c) {
  const auto& p = c.peer;
  LW_RETURN_IF_ERROR(checkPeerTls(p));
  if (p.rank >= p.world_size) {
    return invalidArgument("rank " + std::to_string(p.rank) + " is not below world_size " +
                           std::to_string(p.world_size));
  }
  if (p.world_size == 1) return Status::ok();
  if (p.topology == "ps" && p.ps_rank >= p.world_size) {
    return invalidArgument("peer.ps_rank " + std::to_string(p.ps_rank) +
                           " is not below world_size " + std::to_string(p.world_size));
  }
  if (p.synchrony == "bounded-staleness" && p.topology != "ps") {
    return invalidArgument("peer.synchrony bounded-staleness needs peer.topology ps");
  }
  if (p.rendezvous && !p.peers.empty()) {
    return invalidArgument("give peer.peers or peer.rendezvous, not both");
  }
  if (p.rendezvous && p.transport == "ucx") {
    return invalidArgument(
        "peer.rendezvous is served by the tcp transport: with peer.transport "
        "ucx give peer.peers");
  }
  if (p.secret.empty()) {
    return invalidArgument(
        "peer.secret must be set when world_size > 1 (LIGHTWIRE_PEER__SECRET, or a file named "
        "by peer.secret_file)");
  }
  if (p.rendezvous) return Status::ok();
  if (p.peers.size() != p.world_size) {
    return invalidArgument("peer.peers must list " + std::to_string(p.world_size) +
                           " addresses (one per rank, this sidecar's included), got " +
                           std::to_string(p.peers.size()));
  }
  return Status::ok();
}

Result<ServeConfig> buildServeConfig(const std::optional<std::string>& file_path,
                                     const std::vector<std::string>& environ_entries,
                                     const FlagValues& flags, std::vector<std::string>* warnings) {
  std::vector<std::string> local_warnings;
  std::vector<std::string>& w = warnings ? *warnings : local_warnings;
  ServeConfig cfg = defaults();
  Origins origins;
  if (file_path) LW_RETURN_IF_ERROR(applyFile(*file_path, cfg, origins));
  LW_RETURN_IF_ERROR(applyEnvironment(environ_entries, cfg, origins, w));
  LW_RETURN_IF_ERROR(applyFlags(flags, cfg, origins, w));
  LW_RETURN_IF_ERROR(
      readSecretFile("peer.secret_file", cfg.peer.secret_file, "peer.secret", cfg, origins, w));
  LW_RETURN_IF_ERROR(
      readSecretFile("security.token_file", cfg.token_file, "security.token", cfg, origins, w));
  expandPeerTemplate(cfg);
  LW_RETURN_IF_ERROR(validateDefaultCodec(cfg, origins));
  // Each key was checked alone; now the policies as a whole (adaptive_min_ratio <= max, ...).
  LW_RETURN_IF_ERROR(validatePolicies(cfg, origins));
  return cfg;
}

Result<CompressionConfig> compressionFromJson(const boost::json::value& v) {
  const std::string path = "compression";
  if (!v.is_object()) return invalidArgument(path + " must be a JSON object");
  auto tree = fromJson(v, path, 0);
  if (!tree) return tree.status();
  ServeConfig cfg = defaults();
  Origins origins;
  LW_RETURN_IF_ERROR(applyTree(*tree, path, cfg, "", &origins));
  LW_RETURN_IF_ERROR(validateDefaultCodec(cfg, {}));
  return std::move(cfg.compression);
}

boost::json::object toJson(const ServeConfig& c) {
  json::object root;
  for (const auto& k : keyTable()) insertAt(root, k.info.path, k.get(c));
  json::array rules;
  for (const auto& r : c.compression.rules) {
    json::object o;
    if (r.pattern) o["pattern"] = *r.pattern;
    if (r.min_elements) o["min_elements"] = *r.min_elements;
    if (r.max_elements) o["max_elements"] = *r.max_elements;
    for (auto& kv : codecJson(r.codec)) o[kv.key()] = kv.value();
    o["sync_every"] = r.sync_every;
    if (!r.group.empty()) o["group"] = r.group;
    rules.push_back(std::move(o));
  }
  insertAt(root, kRulesPath, std::move(rules));
  return root;
}

boost::json::object toJson(const CompressionConfig& c) {
  ServeConfig s;
  s.compression = c;
  json::object all = toJson(s);
  return std::move(all["compression"].get_object());
}

}  // namespace lightwire::proxy
