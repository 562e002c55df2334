// The key table (docs/configuration.md "Keys"): every key of `lightwire serve` with its YAML path,
// environment variable, flag, type, default and the code that reads and shows it; and the codec
// keys of compression.default and of each rule.

#include <boost/json/value.hpp>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstdio>
#include <limits>
#include <set>
#include <utility>

#include "proxy/config/config_impl.h"

namespace lightwire::proxy {
namespace config_detail {

namespace json = boost::json;
using kernels::CodecConfig;

// --- The codec keys (compression.default.* and each rule) ---------------------------------------

const std::vector<CodecKey>& codecKeys() {
  static const std::vector<CodecKey> keys = {
      {"codec", "--codec", "codec name", "none",
       "name; one of none, fp16, bf16, topk, randomk, threshold, dgc, qsgd, terngrad, signsgd, "
       "onebit, powersgd, or auto (chosen at run time: compression.auto)",
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
      {"bias_correction", "--bias-correction", kBoolType, "false",
       "dgc with momentum: divide each element's momentum by 1 - momentum^a (a: steps since the "
       "element was last sent) before accumulating it, so an element sent often is not slowed "
       "by the masking of its momentum (one more fp32 of state per element)",
       [](CodecConfig& c, std::string_view s) { return setBool(s, c.bias_correction); },
       [](const CodecConfig& c) { return json::value(c.bias_correction); }},
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

namespace {

constexpr uint64_t kNoMax = std::numeric_limits<uint64_t>::max();

/// Appends keys to the table being built, in the order of `--help` and toJson(). Used by one
/// thread while the table is built (keyTable()).
class KeyAdder {
 public:
  explicit KeyAdder(std::vector<KeyImpl>& table) : table_(table) {}

  void operator()(std::string path, std::string flag, std::string type,
                  std::optional<std::string> def, std::string description,
                  decltype(KeyImpl::set) set, decltype(KeyImpl::get) get, bool secret = false,
                  bool boolean = false) {
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
    table_.push_back({std::move(info), std::move(set), std::move(get)});
  }

 private:
  std::vector<KeyImpl>& table_;
};

// The job, the worker threads, logging.
void addGeneralKeys(KeyAdder& add) {
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
}

// The control API (Unix socket, TCP) and the admin listener.
void addListenerKeys(KeyAdder& add) {
  using C = ServeConfig;
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
}

// limits.*: the listeners' and the step engine's resource limits.
void addLimitsKeys(KeyAdder& add) {
  using C = ServeConfig;
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
      "A kept-alive connection that completed a request is closed when idle this long; a reply "
      "must be read within it",
      [](C& c, std::string_view s) { return setSeconds(s, c.limits.idle_timeout_s); },
      [](const C& c) { return json::value(c.limits.idle_timeout_s); });
  add(
      "limits.header_timeout_s", "--header-timeout", "seconds > 0", "10",
      "A request's headers must arrive within this from its first byte (a new connection's: "
      "from its accept); slower clients are cut off",
      [](C& c, std::string_view s) { return setSeconds(s, c.limits.header_timeout_s); },
      [](const C& c) { return json::value(c.limits.header_timeout_s); });
  add("limits.min_body_rate", "--min-body-rate", "integer >= 0", "1048576",
      "A request body must arrive at this average rate, bytes per second, after "
      "limits.header_timeout_s of grace; slower clients are cut off (0 = only "
      "limits.idle_timeout_s bounds a body)",
      unsignedSetter<C>([](C& c) -> uint64_t& { return c.limits.min_body_rate; }, 0,
                        std::numeric_limits<uint64_t>::max()),
      [](const C& c) { return json::value(c.limits.min_body_rate); });
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
  add("limits.drop_state_after_steps", "--drop-state-after-steps", "integer >= 0", "0",
      "A tensor that has not stepped while another tensor completed this many later steps loses "
      "its codec state and buffers (logged; it starts fresh if it comes back; 0 = never)",
      unsignedSetter<C>([](C& c) -> uint64_t& { return c.limits.drop_state_after_steps; }, 0,
                        std::numeric_limits<uint64_t>::max()),
      [](const C& c) { return json::value(c.limits.drop_state_after_steps); });
  add("limits.max_pool_bytes", "--max-pool-bytes", "integer >= 0", "1073741824",
      "Step buffers (results, local sums; on the GPU path work areas too) kept after a step for "
      "the next steps of any tensor, in bytes, on the host and on the GPUs each; beyond it a "
      "step's buffers are freed when it ends (0 = none kept)",
      unsignedSetter<C>([](C& c) -> uint64_t& { return c.limits.max_pool_bytes; }, 0,
                        std::numeric_limits<uint64_t>::max()),
      [](const C& c) { return json::value(c.limits.max_pool_bytes); });
  // Each listener's connection budget: its own, so that exhausting one leaves the others serving.
  using Budget = ServeConfig::ListenerBudget;
  auto budget = [&](const std::string& listener, const std::string& flag, Budget C::Limits::*field,
                    int connections, int per_source, const char* what, const char* source) {
    add("limits." + listener + ".max_connections", "--" + flag + "-max-connections", "integer >= 1",
        std::to_string(connections),
        std::string("Open connections at most on ") + what +
            "; when full, a new one evicts the oldest that has not completed a request, else it "
            "is answered 503",
        unsignedSetter<C>([field](C& c) -> int& { return (c.limits.*field).max_connections; }, 1,
                          INT_MAX),
        [field](const C& c) { return json::value((c.limits.*field).max_connections); });
    add("limits." + listener + "." + (listener == "unix" ? "max_per_uid" : "max_per_source"),
        "--" + flag + (listener == "unix" ? "-max-per-uid" : "-max-per-source"), "integer >= 0",
        std::to_string(per_source),
        std::string("Open connections at most from one ") + source + " on " + what +
            " (0 = no cap)",
        unsignedSetter<C>([field](C& c) -> int& { return (c.limits.*field).max_per_source; }, 0,
                          INT_MAX),
        [field](const C& c) { return json::value((c.limits.*field).max_per_source); });
  };
  budget("unix", "unix", &C::Limits::unix_socket, 256, 0, "the control socket",
         "user id (SO_PEERCRED)");
  budget("control_tcp", "control-tcp", &C::Limits::control_tcp, 256, 0, "the TCP control listener",
         "source address");
  budget("admin", "admin", &C::Limits::admin, 64, 16, "the admin listener", "source address");
}

// security.*: the bearer token of the control API.
void addSecurityKeys(KeyAdder& add) {
  using C = ServeConfig;
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
}

// The membership of the job: rank, world size, the peers, the job secret.
void addPeerKeys(KeyAdder& add) {
  using C = ServeConfig;
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
}

// How the sidecars exchange: transport, topology, synchrony, rendezvous.
void addExchangeKeys(KeyAdder& add) {
  using C = ServeConfig;
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
  add("peer.sparse", "--sparse", "allgather | allreduce | auto", "allgather",
      "How the ring exchanges topk, dgc and threshold: allgather (every rank's selection to "
      "every rank: the result has up to W x k entries, a rank's traffic grows with W), allreduce "
      "(each chunk's owner sums the selections and keeps the largest, its share of k by the "
      "entries the ranks sent for the chunk, or for threshold the sums whose mean reaches it: at "
      "most k entries, traffic independent of W; what a rank sent but the global selection dropped "
      "stays in its residual) or auto (per "
      "layer and step, whichever moves fewer bytes by the configuration: allreduce from 3 "
      "sidecars on while a selection is smaller than the dense layer; threshold from 3 on)",
      oneOf({"allgather", "allreduce", "auto"}, &C::Peer::sparse),
      [](const C& c) { return json::value(c.peer.sparse); });
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
}

// TLS on the tcp transport's connections (docs/peer-protocol.md "TLS").
void addTlsKeys(KeyAdder& add) {
  using C = ServeConfig;
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
}

// --- policies (docs/policies.md); the defaults are PolicyConfig's own ------------------------

using P = policies::PolicyConfig;

void policyBool(KeyAdder& add, std::string path, std::string flag, bool P::*field,
                std::string what) {
  using C = ServeConfig;
  const P pd = servePolicyDefaults();
  add(
      std::move(path), std::move(flag), kBoolType, std::string(pd.*field ? "true" : "false"),
      std::move(what), [field](C& c, std::string_view s) { return setBool(s, c.policies.*field); },
      [field](const C& c) { return json::value(c.policies.*field); }, /*secret=*/false,
      /*boolean=*/true);
}

void policyNumber(KeyAdder& add, std::string path, std::string flag, double P::*field,
                  bool (*ok)(double), std::string type, std::string what) {
  using C = ServeConfig;
  const P pd = servePolicyDefaults();
  std::string must = "must be a number " + type.substr(type.find(' ') + 1);
  add(
      std::move(path), std::move(flag), std::move(type), numberText(pd.*field), std::move(what),
      [field, ok, must](C& c, std::string_view s) {
        return setNumber(s, c.policies.*field, ok, must);
      },
      [field](const C& c) { return json::value(c.policies.*field); });
}

// An optional number field of PolicyConfig, unset by default ("" unsets it).
void policyOptionalNumber(KeyAdder& add, std::string path, std::string flag,
                          std::optional<double> P::*field, bool (*ok)(double), std::string type,
                          std::string what) {
  using C = ServeConfig;
  std::string must = "must be a number " + type.substr(type.find(' ') + 1) + " (\"\" = unset)";
  add(
      std::move(path), std::move(flag), std::move(type), std::nullopt, std::move(what),
      [field, ok, must](C& c, std::string_view s) {
        return setOptionalNumber(s, c.policies.*field, ok, must.c_str());
      },
      [field](const C& c) { return optionalJson(c.policies.*field); });
}

// An unsigned field of PolicyConfig in [lo, hi] (its type's range at most).
template <typename Field>
void policyUnsigned(KeyAdder& add, std::string path, std::string flag, Field P::*field, uint64_t lo,
                    uint64_t hi, std::string what) {
  using C = ServeConfig;
  const P pd = servePolicyDefaults();
  using T = std::remove_cvref_t<decltype(pd.*field)>;
  hi = std::min<uint64_t>(hi, std::numeric_limits<T>::max());
  std::string type = hi == std::numeric_limits<uint64_t>::max()
                         ? "integer >= " + std::to_string(lo)
                         : "integer " + std::to_string(lo) + ".." + std::to_string(hi);
  add(std::move(path), std::move(flag), std::move(type), std::to_string(pd.*field), std::move(what),
      unsignedSetter<C>([field](C& c) -> T& { return c.policies.*field; }, lo, hi),
      [field](const C& c) { return json::value(static_cast<uint64_t>(c.policies.*field)); });
}

// The anomaly policy and periodic full-sync.
void addAnomalyKeys(KeyAdder& add) {
  policyBool(add, "policies.anomaly", "--anomaly", &P::anomaly,
             "Anomaly policy: NaN/Inf, or a global gradient norm exploding or vanishing against "
             "its baseline, bypasses compression (dense exchange) for policies.bypass_steps steps");
  policyUnsigned(add, "policies.bypass_steps", "--bypass-steps", &P::bypass_steps, 1, kNoMax,
                 "Steps of dense exchange after an anomaly");
  policyNumber(
      add, "policies.explode_factor", "--explode-factor", &P::explode_factor,
      [](double v) { return v > 1; }, "number > 1",
      "Norm explosion: the norm is above this times its baseline mean (and 6 deviations above it)");
  policyNumber(
      add, "policies.vanish_factor", "--vanish-factor", &P::vanish_factor,
      [](double v) { return v > 0 && v < 1; }, "number in (0, 1)",
      "Norm vanishing: the norm is below this times its baseline mean");
  policyNumber(
      add, "policies.ewma_alpha", "--ewma-alpha", &P::ewma_alpha,
      [](double v) { return v > 0 && v <= 1; }, "number in (0, 1]",
      "Weight of a new sample in every exponentially weighted baseline");
  policyUnsigned(add, "policies.baseline_steps", "--baseline-steps", &P::baseline_steps, 1, kNoMax,
                 "Samples before a baseline is trusted (no anomaly or rollback decided before)");
  policyUnsigned(add, "policies.full_sync_every", "--full-sync-every", &P::full_sync_every, 0,
                 kNoMax,
                 "Periodic full-sync: steps N, 2N, ... of a tensor are a dense exchange that also "
                 "flushes the residuals (0 = off)");
}

// The rollback policy and the selection floor.
void addRollbackKeys(KeyAdder& add) {
  policyBool(add, "policies.rollback", "--rollback", &P::rollback,
             "Rollback policy: when the health signals degrade, revert to the last known-good "
             "compression settings");
  policyNumber(
      add, "policies.cosine_drop", "--cosine-drop", &P::cosine_drop,
      [](double v) { return v > 0 && v < 1; }, "number in (0, 1)",
      "Degraded: the sampled cosine similarity is below its baseline times (1 - this)");
  policyNumber(
      add, "policies.loss_rise", "--loss-rise", &P::loss_rise, [](double v) { return v > 0; },
      "number > 0", "Degraded: the reported loss is above its baseline times (1 + this)");
  policyOptionalNumber(
      add, "policies.reward_drop", "--reward-drop", &P::reward_drop, [](double v) { return v > 0; },
      "number > 0",
      "Degraded: the reported reward is below its baseline by more than this (the absolute form "
      "of the reward rule; unset: policies.reward_drop_sigma's form)");
  policyOptionalNumber(
      add, "policies.reward_drop_sigma", "--reward-drop-sigma", &P::reward_drop_sigma,
      [](double v) { return v > 0; }, "number > 0",
      "Degraded: the reported reward is below its baseline by more than this many deviations of "
      "the baseline (unset, and policies.reward_drop unset too: 3); not with "
      "policies.reward_drop");
  policyUnsigned(add, "policies.patience", "--patience", &P::patience, 1, kNoMax,
                 "Consecutive degraded steps before a rollback");
  policyUnsigned(add, "policies.cooldown_steps", "--cooldown-steps", &P::cooldown_steps, 0, kNoMax,
                 "No further rollback for this many steps after one");
  policyUnsigned(add, "policies.known_good_steps", "--known-good-steps", &P::known_good_steps, 0,
                 kNoMax, "Settings in force this many steps without degradation become known-good");
  policyNumber(
      add, "policies.min_magnitude", "--min-magnitude", &P::min_magnitude,
      [](double v) { return v >= 0; }, "number >= 0",
      "Selection codecs (topk, dgc, randomk, threshold) never send an element with |g| below this");
  policyUnsigned(add, "policies.decision_log", "--decision-log", &P::decision_log, 1, 100000,
                 "Decision log entries kept (shown in /v1/status)");
}

// schedule.*: warm-up, training phases, adaptive ratio.
void addScheduleKeys(KeyAdder& add) {
  policyUnsigned(add, "schedule.warmup_steps", "--warmup-steps", &P::warmup_steps, 0, kNoMax,
                 "DGC warm-up: over each tensor's first N steps, topk/dgc/randomk send at least "
                 "25 %, 6.25 %, 1.5625 %, 0.39 %, 0.098 % of the elements (five equal stages), "
                 "then their own density (0 = off)");
  policyUnsigned(add, "schedule.powersgd_start_step", "--powersgd-start-step",
                 &P::powersgd_start_step, 0, kNoMax,
                 "PowerSGD start: a powersgd tensor's steps before this one are exchanged dense "
                 "(its state untouched); compression starts at it (0 = from the first step)");
  policyUnsigned(add, "schedule.total_steps", "--total-steps", &P::total_steps, 0, kNoMax,
                 "Training-phase schedule: the job's length in steps; in its first and last 20 % "
                 "the density is schedule.phase_factor times higher (0 = off)");
  policyNumber(
      add, "schedule.phase_factor", "--phase-factor", &P::phase_factor,
      [](double v) { return v >= 1; }, "number >= 1",
      "Training-phase schedule: density multiplier early and late (the density stays <= 1)");
  policyBool(add, "schedule.adaptive", "--adaptive", &P::adaptive,
             "Adaptive ratio: compress harder or softer from the gradient statistics");
  policyNumber(
      add, "schedule.adaptive_tiny", "--adaptive-tiny", &P::adaptive_tiny,
      [](double v) { return v > 0 && v < 1; }, "number in (0, 1)",
      "Adaptive: a norm below this times its baseline compresses harder (ratio x2)");
  policyNumber(
      add, "schedule.adaptive_sparse", "--adaptive-sparse", &P::adaptive_sparse,
      [](double v) { return v > 0 && v <= 1; }, "number in (0, 1]",
      "Adaptive: a fraction of elements below policies.min_magnitude above this compresses "
      "softer (ratio /2)");
  policyNumber(
      add, "schedule.adaptive_max_ratio", "--adaptive-max-ratio", &P::adaptive_max_ratio,
      [](double v) { return v >= 1; }, "number >= 1", "Adaptive: harder up to this ratio (n/k)");
  policyNumber(
      add, "schedule.adaptive_min_ratio", "--adaptive-min-ratio", &P::adaptive_min_ratio,
      [](double v) { return v >= 1; }, "number >= 1",
      "Adaptive: softer down to this ratio (n/k); at most schedule.adaptive_max_ratio");
}

// compression.auto.*: codec auto (docs/policies.md "codec: auto"); the defaults are AutoConfig's.
void addAutoKeys(KeyAdder& add) {
  using C = ServeConfig;
  using A = policies::AutoConfig;
  const A ad;
  add(
      "compression.auto.ladder", "--auto-ladder", "comma-separated rungs", ad.ladder_text,
      "codec auto: the rungs from least to most lossy: direct (first only: the trainers' own "
      "process group), none, fp16, bf16, qsgd:BITS, topk:D, dgc:D, randomk:D, powersgd:RANK, each "
      "optionally @FACTOR (its steps factor)",
      [](C& c, std::string_view s) -> std::string {
        auto l = policies::parseLadder(s);
        if (!l) return l.status().message();
        c.policies.auto_codec.ladder_text = std::string(s);
        c.policies.auto_codec.ladder = std::move(*l);
        return "";
      },
      [](const C& c) { return json::value(c.policies.auto_codec.ladder_text); });
  auto unsignedKey = [&add]<typename T>(std::string path, std::string flag, T A::*field,
                                        uint64_t lo, std::string what) {
    const A d;
    add(std::move(path), std::move(flag), "integer >= " + std::to_string(lo),
        std::to_string(d.*field), std::move(what),
        unsignedSetter<C>([field](C& c) -> T& { return c.policies.auto_codec.*field; }, lo,
                          std::numeric_limits<T>::max()),
        [field](const C& c) { return json::value(uint64_t{c.policies.auto_codec.*field}); });
  };
  auto numberKey = [&add](std::string path, std::string flag, double A::*field, bool (*ok)(double),
                          std::string type, std::string what) {
    const A d;
    std::string must = "must be a number " + type.substr(type.find(' ') + 1);
    add(
        std::move(path), std::move(flag), std::move(type), numberText(d.*field), std::move(what),
        [field, ok, must](C& c, std::string_view s) {
          return setNumber(s, c.policies.auto_codec.*field, ok, must);
        },
        [field](const C& c) { return json::value(c.policies.auto_codec.*field); });
  };
  unsignedKey("compression.auto.period", "--auto-period", &A::period, 1,
              "codec auto: each layer's rung is re-evaluated every N steps");
  unsignedKey("compression.auto.hysteresis", "--auto-hysteresis", &A::hysteresis, 1,
              "codec auto: evaluations in a row that must agree before a move to more compression");
  numberKey(
      "compression.auto.tolerance", "--auto-tolerance", &A::tolerance,
      [](double v) { return v >= 0 && v <= 10; }, "number in [0, 10]",
      "codec auto: the least lossy rung whose score (step time x steps factor) is within (1 + "
      "this) of the best rung's");
  numberKey(
      "compression.auto.link_change", "--auto-link-change", &A::link_change,
      [](double v) { return v > 0 && v <= 10; }, "number in (0, 10]",
      "codec auto: a relative change of the rung in force's modelled exchange time with the "
      "measured link that re-decides at once (seen at two updates of the layer in a row)");
  numberKey(
      "compression.auto.momentum_margin", "--auto-momentum-margin", &A::momentum_margin,
      [](double v) { return v >= 0 && v <= 10; }, "number in [0, 10]",
      "codec auto: a move onto or off a rung with momentum correction (dgc:D:M) needs a score "
      "better than the best rung of the other side by (1 + this): such a move loses the layer's "
      "velocity");
  unsignedKey("compression.auto.critical_steps", "--auto-critical-steps", &A::critical_steps, 0,
              "codec auto: over the first N steps no layer moves to more compression (0 = off: "
              "the DGC warm-up of selection rungs covers early training)");
  numberKey(
      "compression.auto.critical_change", "--auto-critical-change", &A::critical_change,
      [](double v) { return v > 0; }, "number > 0",
      "codec auto: a layer whose gradient norm moves by more than this (relative) against its "
      "baseline enters a critical phase: one rung less compressed, and no more, for "
      "compression.auto.critical_hold steps");
  unsignedKey("compression.auto.critical_hold", "--auto-critical-hold", &A::critical_hold, 0,
              "codec auto: steps a critical phase lasts");
  unsignedKey("compression.auto.probe_every", "--auto-probe-every", &A::probe_every, 1,
              "codec auto: steps of a direct window, after which the sidecars measure the link "
              "again (a chain's windows: twice the one before, up to 8x)");
}

// Durable state (docs/policies.md "Durable state: checkpoints").
void addStateKeys(KeyAdder& add) {
  using C = ServeConfig;
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
}

// compression.*: the chunk size and the default codec (the rules are not keys).
void addCompressionKeys(KeyAdder& add) {
  using C = ServeConfig;
  add("compression.chunk_elements", "--chunk-elements", "integer >= 1", "1048576",
      "Elements per chunk (rounded up to the codec's alignment)",
      unsignedSetter<C>([](C& c) -> uint64_t& { return c.compression.chunk_elements; }, 1,
                        std::numeric_limits<uint64_t>::max()),
      [](const C& c) { return json::value(c.compression.chunk_elements); });
  // compression.layers.*: the layers of a layout that no rule names (docs/configuration.md
  // "Layers").
  const LayerDefaults ld;
  add("compression.layers.dense_max_ndim", "--dense-max-ndim", "integer 0..64",
      std::to_string(ld.dense_max_ndim),
      "Layers of a layout with at most this many dimensions (biases, norm weights) are exchanged "
      "dense unless a rule names them (0 = off)",
      unsignedSetter<C>([](C& c) -> uint32_t& { return c.compression.layers.dense_max_ndim; }, 0,
                        64),
      [](const C& c) { return json::value(c.compression.layers.dense_max_ndim); });
  add("compression.layers.dense_max_elements", "--dense-max-elements", "integer >= 0",
      std::to_string(ld.dense_max_elements),
      "Layers of a layout with at most this many elements are exchanged dense unless a rule "
      "names them (0 = off)",
      unsignedSetter<C>([](C& c) -> uint64_t& { return c.compression.layers.dense_max_elements; },
                        0, std::numeric_limits<uint64_t>::max()),
      [](const C& c) { return json::value(c.compression.layers.dense_max_elements); });
  add(
      "compression.layers.powersgd_min_ratio", "--powersgd-min-ratio", "number >= 0",
      numberText(ld.powersgd_min_ratio),
      "powersgd compresses a layer (its shape[0] x rest matrix n x m, rank r) only where "
      "n*m > this * (n + m) * r; other layers are exchanged dense (0 = always compress)",
      [](C& c, std::string_view s) {
        return setNumber(
            s, c.compression.layers.powersgd_min_ratio, [](double v) { return v >= 0; },
            "must be a number >= 0");
      },
      [](const C& c) { return json::value(c.compression.layers.powersgd_min_ratio); });
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
}

std::vector<KeyImpl> makeKeyTable() {
  std::vector<KeyImpl> t;
  KeyAdder add(t);
  addGeneralKeys(add);
  addListenerKeys(add);
  addLimitsKeys(add);
  addSecurityKeys(add);
  addPeerKeys(add);
  addExchangeKeys(add);
  addTlsKeys(add);
  addAnomalyKeys(add);
  addRollbackKeys(add);
  addScheduleKeys(add);
  addStateKeys(add);
  addCompressionKeys(add);
  addAutoKeys(add);
  return t;
}

}  // namespace

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

}  // namespace config_detail

using config_detail::keyTable;

const std::vector<ConfigKey>& serveConfigKeys() {
  static const std::vector<ConfigKey> keys = [] {
    std::vector<ConfigKey> v;
    for (const auto& k : keyTable()) v.push_back(k.info);
    return v;
  }();
  return keys;
}

}  // namespace lightwire::proxy
