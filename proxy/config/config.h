#pragma once
// The validated, immutable configuration of `lightwire serve` (docs/configuration.md).
//
// Sources, later ones winning: the defaults < one YAML file (--config) < `LIGHTWIRE_<KEY>`
// environment variables < command-line flags. One table of keys (serveConfigKeys()) drives all of
// them, the `--help` text and toJson(), so the sources cannot disagree. Every value is parsed from
// its text by the same code whichever source it came from; errors name the key and the source.

#include <boost/json/object.hpp>
#include <boost/json/value.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/codec.h"
#include "kernels/status.h"
#include "policies/policy.h"
#include "proxy/step/tensor_facts.h"

namespace CLI {
class App;
}  // namespace CLI

namespace lightwire::proxy {

/// One codec rule of `compression.rules`: matches a tensor by name glob, size and dimensions.
/// Immutable.
struct CodecRule {
  std::optional<std::string> pattern;  // fnmatch(3) glob on the tensor name, no flags
  std::optional<uint64_t> min_elements, max_elements;  // inclusive bounds
  std::optional<uint32_t> ndim;  // dimensions of the shape (a tensor without one: 1), 1..64
  kernels::CodecConfig codec;    // validated by createCodec; unset parameters = codec's defaults
  uint32_t sync_every = 1;  // delayed sync: exchanged every k steps, accumulated between (1..1e6)
  std::string group;        // metrics label, 1..64 of [A-Za-z0-9_.-]; "" = the codec name

  /// Whether this rule applies to the tensor.
  bool matches(const TensorFacts& t) const;
};

/// What the layers of a layout get when no rule names them (docs/configuration.md "Layers").
/// The serve defaults of schedule.warmup_steps and schedule.powersgd_start_step
/// (docs/policies.md "Schedules": how they were chosen).
inline constexpr uint64_t kDefaultWarmupSteps = 20;
inline constexpr uint64_t kDefaultPowersgdStartStep = 20;

struct LayerDefaults {
  uint32_t dense_max_ndim = 1;         // layers of at most this many dimensions: dense (0 = off)
  uint64_t dense_max_elements = 8192;  // layers of at most this many elements: dense (0 = off)
  double powersgd_min_ratio = 2.0;     // powersgd only where n·m > this·(n + m)·r (0 = always)
};

/// The `compression` section: the default codec, the rules, the layer defaults, the chunk size.
/// Immutable once built.
struct CompressionConfig {
  kernels::CodecConfig default_codec;
  std::vector<CodecRule> rules;
  LayerDefaults layers;
  uint64_t chunk_elements = 1048576;

  /// The first rule matching a tensor, or nullptr when none does.
  const CodecRule* ruleFor(const TensorFacts& t) const;
  /// The same for a 1-D tensor that is not a layer.
  const CodecRule* ruleFor(std::string_view name, uint64_t elements) const {
    return ruleFor(TensorFacts{name, elements});
  }
  /// The codec settings of a 1-D tensor that is not a layer (first matching rule, else the
  /// default).
  const kernels::CodecConfig& codecFor(std::string_view name, uint64_t elements) const {
    const CodecRule* r = ruleFor(name, elements);
    return r ? r->codec : default_codec;
  }
};

/// Why a layer of a layout goes dense (codec `none`) rather than with `codec` (nullptr: it does
/// not): without a rule of its own (`by_rule` false), at most dense_max_ndim dimensions or at
/// most dense_max_elements elements; with or without one, powersgd that would not compress its
/// (shape[0], -1) matrix by more than powersgd_min_ratio. Never for a tensor that is not a layer.
const char* denseLayerReason(const LayerDefaults& d, const TensorFacts& t,
                             const kernels::CodecConfig& codec, bool by_rule);

/// A parsed "host:port" (IPv6 as "[::1]:4780"; host stored without brackets; port 0 = OS-chosen).
struct ListenAddress {
  std::string host;
  uint16_t port = 0;

  /// Back to "host:port", bracketing an IPv6 host.
  std::string toString() const;
};

/// The policies' and schedules' defaults of `lightwire serve` (docs/configuration.md): those of
/// PolicyConfig, with the DGC warm-up and the PowerSGD start step on (PolicyConfig's own
/// defaults, every schedule off, are what the step engine assumes without a configuration).
inline policies::PolicyConfig servePolicyDefaults() {
  policies::PolicyConfig p;
  p.warmup_steps = kDefaultWarmupSteps;
  p.powersgd_start_step = kDefaultPowersgdStartStep;
  return p;
}

/// Everything `lightwire serve` is configured with. Built once by buildServeConfig(), then shared
/// read-only (thread-safe as long as nobody mutates it).
struct ServeConfig {
  std::string job_id = "default";
  int local_trainers = 1;
  unsigned threads =
      0;  // 0 = the CPUs this process may use (proxy/server/resources.h; resolved by the caller)
  bool gpu = true;  // the step engine's GPU path for CUDA IPC buffers (EngineOptions::gpu)
  std::string log_level = "info";
  std::string log_format = "text";  // text | json (one object per line)
  std::string control_socket = "/run/lightwire/lightwire.sock";  // "" = no Unix listener
  unsigned control_socket_mode = 0660;  // its permissions: owner and group, never others
  std::optional<ListenAddress> control_tcp = ListenAddress{"127.0.0.1", 4780};  // nullopt = off
  std::optional<ListenAddress> admin_listen = ListenAddress{"0.0.0.0", 4782};   // nullopt = off

  /// The connection budget of one listener.
  struct ListenerBudget {
    int max_connections = 256;
    int max_per_source = 0;  // a TCP source address's, or a Unix-socket uid's (0 = no cap)
  };
  /// Resource limits of the listeners and the step engine.
  struct Limits {
    uint64_t max_body_bytes = 1073741824;
    uint64_t max_inflight_body_bytes = 0;  // bodies held at once (0 = half the memory budget)
    uint32_t max_header_bytes = 16384;
    double idle_timeout_s = 60;
    double header_timeout_s = 10;
    uint64_t min_body_rate = 1048576;  // bytes per second (0 = only idle_timeout_s)
    double step_timeout_s = 120;
    int max_buffers = 1024;
    int max_buffers_per_client = 256;  // per registering process (Unix socket), or TCP together
    int max_pending_steps = 4096;
    ListenerBudget unix_socket{256, 0};
    ListenerBudget control_tcp{256, 0};
    ListenerBudget admin{64, 16};
    uint64_t max_state_bytes = 0;  // codec state of all tensors together (0 = no cap)
    uint64_t max_pool_bytes = uint64_t{1} << 30;  // step buffers kept between steps
    uint64_t drop_state_after_steps = 0;          // idle tensors lose their state (0 = never)
  } limits;

  std::string token;       // secret: "" = no bearer token
  std::string token_file;  // file holding `token`, read by buildServeConfig ("" = none)
  CompressionConfig compression;

  /// The `policies` and `schedule` sections (docs/policies.md): anomaly bypass, full-sync,
  /// rollback, schedules. Its own initialisers are the defaults of these keys.
  policies::PolicyConfig policies = servePolicyDefaults();

  /// Durable state (docs/policies.md "Durable state: checkpoints"): the checkpoint files of codec
  /// and policy state.
  struct State {
    std::string dir = "/var/lib/lightwire";  // "" = no durable state
    uint64_t checkpoint_every = 1000;        // periodic checkpoint every N steps (0 = off)
    uint32_t keep = 3;                       // periodic and on-SIGTERM files kept (1..1000)
    uint32_t keep_trainer = 0;               // trainer-requested files kept (0 = all)
    bool fresh = false;  // start without the checkpoints in `dir` (even unreadable/foreign ones)
  } state;

  /// Membership of the job (docs/exchange.md "Membership"): sidecars, i.e. nodes, not trainers.
  struct Peer {
    uint32_t rank = 0;
    uint32_t world_size = 1;
    ListenAddress listen{"0.0.0.0", 4781};
    /// "host:port" of every rank, index = rank. One address with "{rank}" in it is a template
    /// that buildServeConfig expands to world_size addresses.
    std::vector<std::string> peers;
    std::string secret;             // job secret (HMAC key); required when world_size > 1
    std::string secret_file;        // file holding `secret`, read by buildServeConfig ("" = none)
    double timeout_s = 30;          // deadline of one exchange
    uint64_t checksum_every = 100;  // compare result checksums every N steps (0 = never)
    std::string transport = "tcp";  // tcp | ucx
    std::string topology = "ring";  // ring | ps
    // allgather | allreduce | auto: how the ring exchanges topk and dgc (docs/exchange.md "Sparse
    // allreduce"): every rank's selection to every rank, a global selection of their sums, or
    // per layer whichever moves fewer bytes.
    std::string sparse = "allgather";
    uint32_t ps_rank = 0;            // the parameter-server sidecar (topology ps)
    std::string synchrony = "sync";  // sync | bounded-staleness (topology ps only)
    uint32_t staleness = 2;          // bounded-staleness: a sidecar runs at most S steps ahead
    double straggler_wait_s = 0.02;  // bounded-staleness: the server's wait for late contributions
    std::optional<ListenAddress> rendezvous;  // rank 0's peer address; instead of `peers`
    std::optional<ListenAddress> advertise;   // this rank's address for the rendezvous
    /// TLS on the tcp transport's connections (peer::TcpOptions::Tls, docs/peer-protocol.md).
    struct Tls {
      bool enabled = false;
      std::string cert_file, key_file, ca_file;  // PEM paths (the key's contents never logged)
      bool verify = true;                        // check the peers' certificates against ca_file
    } tls;
  } peer;
};

/// One configuration key as documented: YAML path, environment variable, flag, type, default.
struct ConfigKey {
  std::string path;          // "limits.max_body_bytes"
  std::string env;           // "LIGHTWIRE_LIMITS__MAX_BODY_BYTES"
  std::string flag;          // "--max-body-bytes"
  std::string type;          // human-readable type and range
  std::string default_text;  // "" with has_default = false means unset
  bool has_default = true;   // false: unset unless given
  std::string description;
  bool secret = false;   // never shown: "<redacted>" in toJson(), not echoed in errors
  bool boolean = false;  // true | false: the flag may be given without a value (= true)
};

/// The key table every source, `--help` and docs/configuration.md follow (compression.rules is
/// file/JSON only and not in it).
const std::vector<ConfigKey>& serveConfigKeys();

/// Raw values of the serve flags given on the command line (absent = not given).
struct FlagValues {
  std::optional<std::string> config_file;     // --config FILE
  std::map<std::string, std::string> values;  // key path -> raw text, e.g. "threads" -> "4"
};

/// Registers --config and one flag per key on `app` (the `serve` subcommand), storing raw strings
/// into `flags`; values are checked by buildServeConfig(), not by CLI11.
void addServeFlags(CLI::App& app, FlagValues& flags);

/// Builds the config: defaults < file (YAML, read from `file_path`) < environment ("KEY=VALUE"
/// entries) < flags. Unknown `LIGHTWIRE_*` variables and other non-fatal findings are appended to
/// `warnings` (may be null) for the caller to log. Then the secret files (peer.secret_file,
/// security.token_file) are read and a peer.peers template is expanded to world_size addresses.
Result<ServeConfig> buildServeConfig(const std::optional<std::string>& file_path,
                                     const std::vector<std::string>& environ_entries,
                                     const FlagValues& flags, std::vector<std::string>* warnings);

/// rank, world_size, peer.peers and peer.secret agree with each other, and peer.tls is complete
/// and used with the tcp transport (checked by `serve` and `--check-config` after
/// buildServeConfig(), which checks each key alone).
Status checkMembership(const ServeConfig& c);

/// Compression section from JSON (PUT /v1/config body): same keys, same validation as the YAML one;
/// keys not given take their defaults.
Result<CompressionConfig> compressionFromJson(const boost::json::value& v);

/// The effective config as JSON, secrets ("security.token") shown as "<redacted>" when set.
boost::json::object toJson(const ServeConfig& c);

/// The compression section as JSON, in the shape compressionFromJson() reads.
boost::json::object toJson(const CompressionConfig& c);

}  // namespace lightwire::proxy
