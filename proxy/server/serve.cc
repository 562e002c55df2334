#include "proxy/server/serve.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>

#include <malloc.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <limits>
#include <thread>
#include <vector>

#include "ipc/shm_region.h"
#include "metrics/metrics.h"
#include "proxy/peer/collective.h"
#include "proxy/peer/ps_exchange.h"
#include "proxy/peer/tcp_transport.h"
#include "proxy/server/control_api.h"
#include "proxy/server/http_server.h"
#include "proxy/server/resources.h"
#if LIGHTWIRE_HAVE_UCX
#include "proxy/peer/ucx_transport.h"
#endif
#include "policies/checkpoint.h"
#include "policies/policy.h"
#include "proxy/step/engine.h"
#include "proxy/step/job_state.h"
#include "proxy/version.h"

extern char** environ;

namespace lightwire::proxy {
namespace {

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;
constexpr unsigned kIoThreads = 1;  // HTTP handling is light; steps run on the engine
constexpr auto kDrainLimit = std::chrono::seconds(10);

/// Every other rank may be handshaking at once when the job starts; beyond that (and the
/// transport's default), connections that never authenticate are refused at accept.
size_t pendingHandshakesFor(const ServeConfig& config, size_t transport_default) {
  return std::max<size_t>(transport_default, 2 * static_cast<size_t>(config.peer.world_size));
}

/// The configured peer transport, listening.
Result<std::unique_ptr<peer::Transport>> listenForPeers(const ServeConfig& config,
                                                        metrics::Metrics& metrics) {
  const auto& l = config.peer.listen;
  if (config.peer.transport == "ucx") {
#if LIGHTWIRE_HAVE_UCX
    if (config.peer.rendezvous) {
      return invalidArgument(
          "peer.rendezvous is served by the tcp transport; with ucx give "
          "peer.peers");
    }
    peer::UcxOptions options;
    options.max_pending_handshakes = pendingHandshakesFor(config, options.max_pending_handshakes);
    auto t = peer::UcxTransport::listen(l.host, l.port, options, metrics);
    if (!t) return t.status();
    return std::unique_ptr<peer::Transport>(std::move(*t));
#else
    return failedPrecondition(
        "this lightwire was built without UCX (install libucx-dev and rebuild); use "
        "peer.transport tcp");
#endif
  }
  peer::TcpOptions options;
  options.max_pending_handshakes = pendingHandshakesFor(config, options.max_pending_handshakes);
  const auto& tls = config.peer.tls;
  options.tls = {.enabled = tls.enabled,
                 .cert_file = tls.cert_file,
                 .key_file = tls.key_file,
                 .ca_file = tls.ca_file,
                 .verify_peer = tls.verify};
  auto t = peer::TcpTransport::listen(l.host, l.port, options, metrics);
  if (!t) return t.status();
  return std::unique_ptr<peer::Transport>(std::move(*t));
}

/// A peer's STATE frame: taken while this sidecar has completed nothing (just (re)started): the
/// job's steps and policy state, and then (a restart mid-job) this sidecar's own codec state from
/// its newest checkpoint (docs/policies.md "Durable state: checkpoints").
void takeJobState(StepEngine& engine, policies::PolicyEngine& policy, std::atomic<bool>& restored,
                  uint32_t from, std::span<const uint8_t> bytes) {
  auto state = decodeJobState(bytes);
  if (!state) {
    spdlog::warn("peer: rank {} sent a job state we cannot read: {}", from,
                 state.status().message());
    return;
  }
  // A peer has just resumed from a trainer checkpoint (POST /v1/resume there): its tensors all
  // stand at that step. Resume here from our own checkpoint of the same step. (A peer that
  // resumed long ago and went on is a job this sidecar rejoins: below.)
  if (state->policy && state->policy->is_object()) {
    const auto* rf = state->policy->as_object().if_contains("resumed_from");
    if (rf && (rf->is_uint64() || (rf->is_int64() && rf->as_int64() >= 0))) {
      const uint64_t step =
          rf->is_uint64() ? rf->as_uint64() : static_cast<uint64_t>(rf->as_int64());
      const bool fresh = std::all_of(state->committed.begin(), state->committed.end(),
                                     [&](const auto& kv) { return kv.second == step; });
      if (fresh && policy.resumedFrom() != step) {
        spdlog::info("rank {} resumed from the checkpoint of step {}: resuming here too", from,
                     step);
        engine.resumeLater(step);
        return;
      }
    }
  }
  if (engine.stepsOk() > 0) return;
  if (state->policy) {
    if (auto st = policy.restoreState(*state->policy); !st.isOk()) {
      spdlog::warn("peer: rank {} sent a policy state we cannot take: {}", from, st.message());
    }
  }
  if (const size_t taken = engine.adoptCommittedSteps(state->committed); taken > 0) {
    uint64_t latest = 0;
    for (const auto& [name, step] : state->committed) latest = std::max(latest, step);
    spdlog::info(
        "took the job's step state from rank {} (and its policy state): {} tensor(s), latest "
        "committed step {}; their next steps must come after it",
        from, taken, latest);
    // The job is under way: this sidecar restarted in it. Its own codec state comes from its
    // newest checkpoint (once).
    // Queued, not waited for: this is the transport's thread, which a running step may wait on.
    if (!restored.exchange(true)) {
      engine.postBetweenSteps([&engine]() -> Status {
        auto got = engine.restoreLatest();
        if (!got) {
          return failedPrecondition("could not restore the codec state: " + got.status().message());
        }
        if (!*got) {
          spdlog::warn(
              "no checkpoint of this sidecar to restore: its codec state starts fresh "
              "(the residuals it held are lost)");
        }
        return Status::ok();
      });
    }
  }
}

/// The newest checkpoint of this sidecar must be readable and of this job, unless the sidecar is
/// told to start fresh (state.fresh).
Status checkLatestCheckpoint(const ServeConfig& config) {
  if (config.state.dir.empty() || config.state.fresh) return Status::ok();
  // The one a restart restores (StepEngine::restoreLatest).
  const auto newest = policies::newestCheckpoint({config.state.dir, config.state.dir + "/trainer"},
                                                 config.job_id, config.peer.rank);
  if (!newest) return Status::ok();
  const std::string& path = newest->path;
  policies::CheckpointExpect expect;
  expect.job_id = config.job_id;
  expect.world_size = config.peer.world_size;
  expect.rank = config.peer.rank;
  auto c = policies::readCheckpoint(path, expect);
  if (!c) {
    return failedPrecondition(c.status().message() +
                              " — remove it, or start with --fresh-state (state.fresh) to run "
                              "without the checkpoints in " +
                              config.state.dir);
  }
  return Status::ok();
}
/// `%*`: the message as a JSON string body (quotes, backslashes and control characters escaped).
class JsonEscapedMessage final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm& /*tm*/,
              spdlog::memory_buf_t& dest) override {
    static constexpr char kHex[] = "0123456789abcdef";
    for (const char ch : msg.payload) {
      const auto c = static_cast<unsigned char>(ch);
      switch (c) {
        case '"':
          dest.append(std::string_view("\\\""));
          break;
        case '\\':
          dest.append(std::string_view("\\\\"));
          break;
        case '\n':
          dest.append(std::string_view("\\n"));
          break;
        case '\t':
          dest.append(std::string_view("\\t"));
          break;
        case '\r':
          dest.append(std::string_view("\\r"));
          break;
        default:
          if (c < 0x20) {
            const char esc[6] = {'\\', 'u', '0', '0', kHex[c >> 4], kHex[c & 15]};
            dest.append(std::string_view(esc, 6));
          } else {
            dest.push_back(ch);
          }
      }
    }
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<JsonEscapedMessage>();
  }
};

/// One JSON object per line: {"time": ISO 8601 UTC, "level": ..., "msg": ...}.
void setJsonLogFormat() {
  auto formatter = std::make_unique<spdlog::pattern_formatter>(spdlog::pattern_time_type::utc);
  formatter->add_flag<JsonEscapedMessage>('*').set_pattern(
      R"({"time":"%Y-%m-%dT%H:%M:%S.%eZ","level":"%l","msg":"%*"})");
  spdlog::set_formatter(std::move(formatter));
}

constexpr auto kPollAfterWork = std::chrono::microseconds(50);

std::vector<std::string> environment() {
  std::vector<std::string> out;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) out.emplace_back(*e);
  return out;
}

/// io.run(), except that after handling something the thread keeps polling for a short while
/// before it blocks in epoll: a trainer's next request usually follows its last reply within
/// microseconds, and then no wake-up is needed (waking a thread on another core costs tens of
/// microseconds on a VM, most of a small round trip). The window is short, so an idle sidecar
/// does not burn a core.
void runPolling(boost::asio::io_context& io) {
  using Clock = std::chrono::steady_clock;
  while (!io.stopped()) {
    auto until = Clock::now() + kPollAfterWork;
    while (!io.stopped() && Clock::now() < until) {
      if (io.poll() > 0) until = Clock::now() + kPollAfterWork;
    }
    if (io.run_one() == 0) break;  // no work left: stopped
  }
}

/// `serve --check-config FILE`: the file alone (no flags, the environment), checked.
int checkConfigFile(const std::string& path) {
  std::vector<std::string> warnings;
  FlagValues only_file;
  auto c = buildServeConfig(path, environment(), only_file, &warnings);
  for (const auto& w : warnings) spdlog::warn("{}", w);
  if (!c) {
    spdlog::error("{}", c.status().message());
    return kExitUsage;
  }
  if (auto st = checkMembership(*c); !st.isOk()) {
    spdlog::error("{}", st.message());
    return kExitUsage;
  }
  std::printf("%s: ok\n", path.c_str());
  return 0;
}

/// The configuration from every source (docs/configuration.md "Sources and precedence"), its
/// warnings logged; nullopt (logged) when it is not usable.
std::optional<ServeConfig> loadConfig(const FlagValues& flags) {
  std::vector<std::string> warnings;
  auto built = buildServeConfig(flags.config_file, environment(), flags, &warnings);
  // The log format first, so that even the configuration's warnings come in it (a configuration
  // that fails to build is reported as text: its format is unknown).
  if (built) {
    spdlog::set_level(spdlog::level::from_str(built->log_level));
    if (built->log_format == "json") setJsonLogFormat();
  }
  for (const auto& w : warnings) spdlog::warn("{}", w);
  if (!built) {
    spdlog::error("{}", built.status().message());
    return std::nullopt;
  }
  if (auto st = checkMembership(*built); !st.isOk()) {
    spdlog::error("{}", st.message());
    return std::nullopt;
  }
  return std::move(*built);
}

/// The listeners' connection budgets together (those that are open).
rlim_t connectionBudgets(const ServeConfig& config) {
  rlim_t n = 0;
  if (!config.control_socket.empty()) n += config.limits.unix_socket.max_connections;
  if (config.control_tcp) n += config.limits.control_tcp.max_connections;
  if (config.admin_listen) n += config.limits.admin.max_connections;
  return n;
}

/// The process settings a long-running sidecar wants: the heap and the open-file limit. Fails
/// when even the hard open-file limit cannot hold the listeners' connection budgets.
Status tuneProcess(const ServeConfig& config) {
  // Large request bodies and step buffers come and go at every step: keep freed memory in the
  // heap instead of unmapping it, so the next 100 MB body does not page-fault its way in again
  // (the resident size stays at its peak, which the largest tensors set anyway).
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());

  // Every registered shared-memory buffer and every connection holds a descriptor: lift the soft
  // limit on open files to the hard one (often 1024 and 524288).
  struct rlimit nofile {};
  if (::getrlimit(RLIMIT_NOFILE, &nofile) != 0) return Status::ok();
  if (nofile.rlim_cur < nofile.rlim_max) {
    nofile.rlim_cur = nofile.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &nofile);
    ::getrlimit(RLIMIT_NOFILE, &nofile);
  }
  if (nofile.rlim_cur == RLIM_INFINITY) return Status::ok();
  // The connection budgets must fit, with room for the peers and the process's own files: a
  // budget the process cannot hold would turn into accept errors under load, not 503s.
  const rlim_t base = static_cast<rlim_t>(2 * config.peer.world_size) + 64;
  const rlim_t connections = connectionBudgets(config);
  if (nofile.rlim_cur < connections + base) {
    return failedPrecondition(fmt::format(
        "open files are limited to {} (ulimit -n), fewer than the listeners' connection budgets "
        "(limits.unix.max_connections + limits.control_tcp.max_connections + "
        "limits.admin.max_connections of the listeners that are open: {}) and {} more for peers "
        "and the process's own files need: lower the budgets or raise the limit",
        static_cast<unsigned long long>(nofile.rlim_cur),
        static_cast<unsigned long long>(connections), static_cast<unsigned long long>(base)));
  }
  const rlim_t needed = connections + base + static_cast<rlim_t>(config.limits.max_buffers);
  if (nofile.rlim_cur < needed) {
    spdlog::warn(
        "open files are limited to {} (ulimit -n), fewer than limits.max_buffers + the "
        "listeners' connection budgets + peers need ({}): registrations may fail with 'too many "
        "open files'",
        static_cast<unsigned long long>(nofile.rlim_cur), static_cast<unsigned long long>(needed));
  }
  return Status::ok();
}

/// threads 0: the CPUs this process may use (affinity mask and cgroup CPU quota), not the node's.
unsigned codecThreads(const ServeConfig& config) {
  if (config.threads != 0) return config.threads;
  const CpuBudget cpus = cpuBudget();
  const unsigned threads = cpus.usable();
  spdlog::info("codec threads: {} (threads 0: the CPUs this process may use: {})", threads,
               cpus.describe());
  return threads;
}

/// The job seed of the codecs' random streams: the same on every sidecar of the job.
uint32_t jobSeed(const ServeConfig& config) {
  return static_cast<uint32_t>(XXH3_64bits(config.job_id.data(), config.job_id.size()));
}

/// The exchange with the other sidecars: none at world size 1 (LocalExchange), else the
/// configured topology over the configured transport, listening but not yet started.
struct PeerExchange {
  LocalExchange local;
  std::unique_ptr<peer::Transport> transport;
  std::unique_ptr<Exchange> collective;  // peer::RingExchange or peer::PsExchange
  peer::Membership membership;           // started once the engine exists (it gives job state)
  Exchange& exchange() { return collective ? *collective : local; }
};

Status makePeerExchange(const ServeConfig& config, metrics::Metrics& metrics, PeerExchange& out) {
  if (config.peer.world_size <= 1) return Status::ok();
  auto t = listenForPeers(config, metrics);
  if (!t) {
    return failedPrecondition("peer listener " + config.peer.listen.toString() + " (" +
                              config.peer.transport + "): " + t.status().message());
  }
  out.transport = std::move(*t);
  peer::Membership& m = out.membership;
  m.job_id = config.job_id;
  m.rank = config.peer.rank;
  m.world_size = config.peer.world_size;
  m.peers = config.peer.peers;
  m.secret = config.peer.secret;
  if (config.peer.rendezvous) m.rendezvous = config.peer.rendezvous->toString();
  if (config.peer.advertise) m.advertise = config.peer.advertise->toString();
  const std::chrono::milliseconds peer_timeout(
      static_cast<int64_t>(config.peer.timeout_s * 1000.0));
  if (config.peer.topology == "ps") {
    peer::PsOptions po;
    po.server_rank = config.peer.ps_rank;
    po.bounded_staleness = config.peer.synchrony == "bounded-staleness";
    po.staleness = config.peer.staleness;
    po.straggler_wait =
        std::chrono::milliseconds(static_cast<int64_t>(config.peer.straggler_wait_s * 1000.0));
    po.seed = jobSeed(config);
    spdlog::info("topology ps: parameter server rank {}, {}", po.server_rank,
                 config.peer.synchrony);
    out.collective = std::make_unique<peer::PsExchange>(*out.transport, peer_timeout, po);
  } else {
    out.collective = std::make_unique<peer::RingExchange>(*out.transport, peer_timeout);
  }
  return Status::ok();
}

/// The policies as configured; under bounded staleness the statistics reach the ranks at
/// different steps, so the policies that decide from them are off.
policies::PolicyConfig policyConfig(const ServeConfig& config) {
  policies::PolicyConfig pc = config.policies;
  if (config.peer.synchrony != "bounded-staleness") return pc;
  if (pc.anomaly || pc.rollback || pc.adaptive) {
    spdlog::warn(
        "bounded staleness: the statistics reach the ranks at different steps, so anomaly "
        "bypass, rollback and the adaptive schedule are off (policies need synchrony sync)");
  }
  pc.anomaly = false;
  pc.rollback = false;
  pc.adaptive = false;
  // codec auto's ladder without the rungs the server cannot close a step with (their traits;
  // docs/exchange.md "bounded-staleness"); the configuration rules keep at least one other.
  auto& ladder = pc.auto_codec.ladder;
  std::string dropped;
  std::erase_if(ladder, [&](const policies::Rung& r) {
    if (policies::rungStalenessSafe(r)) return false;
    dropped += (dropped.empty() ? "" : ", ") + r.text;
    return true;
  });
  if (!dropped.empty()) {
    pc.auto_codec.ladder_text = policies::ladderText(ladder);
    spdlog::warn(
        "bounded staleness: codec auto's ladder leaves out {} (the parameter server cannot close "
        "a step with them): {}",
        dropped, pc.auto_codec.ladder_text);
  }
  return pc;
}

EngineOptions engineOptions(const ServeConfig& config, unsigned threads,
                            policies::PolicyEngine* policy) {
  EngineOptions eo;
  eo.local_trainers = static_cast<unsigned>(config.local_trainers);
  eo.threads = threads;
  eo.gpu = config.gpu;
  eo.chunk_elements = config.compression.chunk_elements;
  eo.step_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(config.limits.step_timeout_s * 1000.0));
  eo.max_pending_steps = static_cast<size_t>(config.limits.max_pending_steps);
  eo.seed = jobSeed(config);
  eo.rank = config.peer.rank;
  eo.checksum_every = config.peer.checksum_every;
  eo.sparse = config.peer.sparse == "allreduce" ? EngineOptions::Sparse::kAllreduce
              : config.peer.sparse == "auto"    ? EngineOptions::Sparse::kAuto
                                                : EngineOptions::Sparse::kAllgather;
  eo.warmup_steps = config.policies.warmup_steps;
  eo.powersgd_start_step = config.policies.powersgd_start_step;
  eo.max_state_bytes = config.limits.max_state_bytes;
  eo.max_pool_bytes = config.limits.max_pool_bytes;
  eo.drop_state_after_steps = config.limits.drop_state_after_steps;
  eo.policy = policy;
  eo.settings = [](uint64_t version, const std::string& json) -> CodecChooser {
    boost::system::error_code ec;
    const auto v = boost::json::parse(json, ec);
    auto c = ec ? Result<CompressionConfig>(invalidArgument(ec.message())) : compressionFromJson(v);
    if (!c) {
      spdlog::error("settings version {} cannot be used ({}): the configured ones stay", version,
                    c.status().message());
      return nullptr;
    }
    return chooserFor(std::make_shared<const CompressionConfig>(std::move(*c)));
  };
  eo.state_dir = config.state.dir;
  eo.job_id = config.job_id;
  eo.world_size = config.peer.world_size;
  eo.checkpoint_every = config.state.checkpoint_every;
  eo.checkpoint_keep = config.state.keep;
  eo.trainer_checkpoint_keep = config.state.keep_trainer;
  return eo;
}

/// The CUDA driver, loaded at run time: absent, the sidecar is CPU-only (docs/cuda.md "The CUDA
/// driver, loaded at run time").
void attachCuda(ControlApi& api) {
  std::string why_not;
  auto cuda = ipc::CudaDriver::load(&why_not);
  if (cuda) {
    std::string gpus;
    for (const auto& d : cuda->devices()) {
      gpus += (gpus.empty() ? "" : "; ") + std::to_string(d.ordinal) + ": " + d.name + " (" +
              d.pci_bus_id + ")";
    }
    spdlog::info("CUDA driver {}.{}: {} GPU(s){}{}", cuda->version() / 1000,
                 cuda->version() % 1000 / 10, cuda->devices().size(), gpus.empty() ? "" : ": ",
                 gpus);
  } else {
    spdlog::info("CUDA: {}; CPU only", why_not);
  }
  api.setCuda(std::move(cuda), why_not);
}

/// Connects to the peers. The job's step and policy state travel to every peer that connects; a
/// sidecar that has just (re)started takes them (docs/peer-protocol.md "After the handshake",
/// STATE), so its tensors go on from the job's steps.
Status startPeers(const ServeConfig& config, PeerExchange& peers, StepEngine& engine,
                  policies::PolicyEngine& policy, ControlApi& api, std::atomic<bool>& restored) {
  peer::Transport* t = peers.transport.get();
  if (t == nullptr) return Status::ok();
  t->setJobState([&engine, &policy] { return encodeJobState(engine.committedSteps(), &policy); },
                 [&engine, &policy, &restored](uint32_t from, std::span<const uint8_t> bytes) {
                   takeJobState(engine, policy, restored, from, bytes);
                 });
  if (auto st = t->start(std::move(peers.membership)); !st.isOk()) {
    return failedPrecondition("peer transport: " + st.message());
  }
  spdlog::info("rank {} of {}: peers on {}:{}", config.peer.rank, config.peer.world_size,
               config.peer.listen.host, t->port());
  api.setPeers([t] { return t->peersUp(); });
  api.setPeerTls([t]() -> boost::json::value {
    const auto c = t->tlsCertificate();
    if (!c) return nullptr;
    return boost::json::object{{"certificate", c->file},
                               {"subject", c->subject},
                               {"not_after", c->not_after_utc},
                               {"not_after_unix", c->not_after}};
  });
  // A resume at this sidecar is told to the others at once: they resume from their own
  // checkpoint of the same step (takeJobState).
  api.setAfterResume([t] { t->broadcastState(); });
  return Status::ok();
}

HttpLimits httpLimits(const ServeConfig& config) {
  HttpLimits limits;
  limits.max_body_bytes = config.limits.max_body_bytes;
  limits.max_inflight_body_bytes = config.limits.max_inflight_body_bytes;
  if (limits.max_inflight_body_bytes == 0) {
    // Half of what this process may use: the rest is for the steps' working memory and state.
    const MemoryBudget memory = memoryBudget();
    if (memory.usable() == 0) {
      spdlog::warn(
          "request bodies held at once: no cap (limits.max_inflight_body_bytes 0 and this "
          "process's memory is unknown)");
    } else {
      limits.max_inflight_body_bytes = std::max<uint64_t>(memory.usable() / 2, uint64_t{64} << 20);
      spdlog::info(
          "request bodies held at once: at most {} bytes (limits.max_inflight_body_bytes 0: half "
          "of the memory this process may use, {})",
          limits.max_inflight_body_bytes, memory.describe());
    }
  }
  limits.max_header_bytes = config.limits.max_header_bytes;
  limits.idle_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(config.limits.idle_timeout_s * 1000.0));
  limits.header_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(config.limits.header_timeout_s * 1000.0));
  limits.min_body_rate = config.limits.min_body_rate;
  return limits;
}

ListenerLimits listenerLimits(const ServeConfig::ListenerBudget& b) {
  return ListenerLimits{static_cast<size_t>(b.max_connections),
                        static_cast<size_t>(b.max_per_source)};
}

/// Opens the control socket, the control TCP listener and the admin listener as configured.
Status openListeners(const ServeConfig& config, HttpServer& server, ControlApi& api) {
  BoundListeners bound;
  if (!config.control_socket.empty()) {
    if (std::string e = server.listenUnix(config.control_socket, ListenerKind::kControl,
                                          config.control_socket_mode,
                                          listenerLimits(config.limits.unix_socket));
        !e.empty()) {
      return failedPrecondition("control socket: " + e);
    }
    bound.control_socket = config.control_socket;
    spdlog::info("control API on unix:{}", config.control_socket);
  }
  auto listenTcp = [&](const std::optional<ListenAddress>& a, ListenerKind kind, const char* what,
                       std::optional<uint16_t>* bound_port,
                       const ServeConfig::ListenerBudget& budget) -> Status {
    if (!a) return Status::ok();
    uint16_t port = 0;
    if (std::string e = server.listenTcp(a->host, a->port, kind, &port, listenerLimits(budget));
        !e.empty()) {
      return failedPrecondition(std::string(what) + " listener: " + e);
    }
    *bound_port = port;
    spdlog::info("{} on {}:{}", what, a->host, port);
    return Status::ok();
  };
  LW_RETURN_IF_ERROR(listenTcp(config.control_tcp, ListenerKind::kControl, "control API",
                               &bound.control_tcp_port, config.limits.control_tcp));
  LW_RETURN_IF_ERROR(listenTcp(config.admin_listen, ListenerKind::kAdmin, "admin (metrics, health)",
                               &bound.admin_port, config.limits.admin));
  api.setListeners(bound);
  return Status::ok();
}

/// The state as it stands, for a restart (docs/policies.md "Durable state: checkpoints"): the
/// engine has stopped, nothing runs.
void checkpointOnShutdown(const ServeConfig& config, StepEngine& engine) {
  if (config.state.dir.empty() || engine.stepsOk() == 0) return;
  uint64_t latest = 0;
  for (const auto& [name, step] : engine.committedSteps()) latest = std::max(latest, step);
  if (auto saved = engine.saveCheckpoint(latest, "sigterm"); !saved) {
    spdlog::error("checkpoint on shutdown: {}", saved.status().message());
  }
}

/// Serves until SIGINT/SIGTERM, then shuts down gracefully: stop accepting, fail the steps still
/// waiting for trainers (503), let the running step finish, flush the replies, remove the socket
/// files, checkpoint. Meanwhile buffers of trainers that exited are released, and SIGHUP reloads
/// the peer TLS files.
void serveUntilSignalled(const ServeConfig& config, boost::asio::io_context& io, HttpServer& server,
                         ControlApi& api, StepEngine& engine, peer::Transport* transport) {
  // Buffers of trainers that exited while holding them (a crash, kill -9) are released within a
  // second, so a dead trainer never pins memory or the buffer limits.
  boost::asio::steady_timer reaper(boost::asio::make_strand(io));  // its handlers, serialised
  std::atomic<bool> reaping{true};
  std::function<void()> reapLater = [&] {
    reaper.expires_after(std::chrono::seconds(1));
    reaper.async_wait([&](const boost::system::error_code& ec) {
      if (ec || !reaping.load()) return;
      api.releaseExitedOwners();
      reapLater();
    });
  };
  reapLater();

  // SIGHUP: read the peer TLS files again (a renewed certificate); the default action would end
  // the process.
  boost::asio::signal_set hangups(io, SIGHUP);
  std::function<void()> onHangup = [&] {
    hangups.async_wait([&](const boost::system::error_code& ec, int) {
      if (ec) return;
      if (!transport || !config.peer.tls.enabled) {
        spdlog::info("SIGHUP received: nothing to reload (peer.tls is off)");
      } else if (auto r = transport->reloadTls(); r.isOk()) {
        spdlog::info("SIGHUP received: peer TLS reloaded: {}; new connections use it", *r);
      } else {
        spdlog::error(
            "SIGHUP received: peer TLS not reloaded, the previous certificate stays in "
            "use: {}",
            r.status().message());
      }
      onHangup();
    });
  };
  onHangup();

  boost::asio::signal_set signals(io, SIGINT, SIGTERM);
  std::thread watcher;
  std::atomic<bool> abandoned{false};
  boost::asio::steady_timer drain(io);
  std::signal(SIGPIPE, SIG_IGN);
  signals.async_wait([&](const boost::system::error_code& ec, int sig) {
    if (ec) return;
    spdlog::info("signal {} received: shutting down", sig);
    boost::system::error_code ignored;
    hangups.cancel(ignored);
    api.setStopping();
    reaping = false;
    boost::asio::post(reaper.get_executor(), [&] { reaper.cancel(); });
    server.stop();
    engine.shutdown();
    drain.expires_after(kDrainLimit);
    drain.async_wait([&](const boost::system::error_code& tec) {
      if (!tec) {
        spdlog::warn("connections still open after {} s: closing them", kDrainLimit.count());
        io.stop();
      }
    });
    // The timer is the last piece of work once every session has closed.
    watcher = std::thread([&] {
      while (server.connections() > 0 && !abandoned.load()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      boost::asio::post(io, [&] { drain.cancel(); });
    });
  });

  std::vector<std::thread> io_threads;
  for (unsigned i = 1; i < kIoThreads; ++i) io_threads.emplace_back([&] { io.run(); });
  runPolling(io);
  for (auto& t : io_threads) t.join();
  abandoned = true;
  if (watcher.joinable()) watcher.join();
  engine.shutdown();
  checkpointOnShutdown(config, engine);  // still under the signal sets: a second SIGTERM waits
}

}  // namespace

int runServe(const FlagValues& flags, const std::optional<std::string>& check_config) {
  auto logger = spdlog::stderr_color_mt("lightwire");
  spdlog::set_default_logger(logger);
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");
  if (check_config) return checkConfigFile(*check_config);
  const std::optional<ServeConfig> loaded = loadConfig(flags);
  if (!loaded) return kExitUsage;
  const ServeConfig& config = *loaded;
  if (auto st = tuneProcess(config); !st.isOk()) {
    spdlog::error("{}", st.message());
    return kExitUsage;
  }
  const unsigned threads = codecThreads(config);

  metrics::Metrics metrics;
  metrics.setInfo({{"job_id", config.job_id},
                   {"rank", std::to_string(config.peer.rank)},
                   {"world_size", std::to_string(config.peer.world_size)},
                   {"version", LIGHTWIRE_VERSION},
                   {"transport", config.peer.transport},
                   {"topology", config.peer.topology}});
  ipc::BufferTable buffers(static_cast<size_t>(config.limits.max_buffers),
                           static_cast<size_t>(config.limits.max_buffers_per_client));
  PeerExchange peers;
  if (auto st = makePeerExchange(config, metrics, peers); !st.isOk()) {
    spdlog::error("{}", st.message());
    return kExitFailure;
  }
  if (auto st = checkLatestCheckpoint(config); !st.isOk()) {
    spdlog::error("{}", st.message());
    return kExitFailure;
  }
  policies::PolicyEngine policy(policyConfig(config),
                                boost::json::serialize(toJson(config.compression)), &metrics);
  StepEngine engine(engineOptions(config, threads, &policy),
                    chooserFor(std::make_shared<const CompressionConfig>(config.compression)),
                    metrics, peers.exchange());
  ControlApi api(config, metrics, buffers, engine, &policy);
  attachCuda(api);
  std::atomic<bool> restored{false};
  if (auto st = startPeers(config, peers, engine, policy, api, restored); !st.isOk()) {
    spdlog::error("{}", st.message());
    return kExitFailure;
  }

  boost::asio::io_context io;
  HttpServer server(io, httpLimits(config),
                    [&api](Request&& req, const RequestInfo& info, Reply reply) {
                      api.handle(std::move(req), info, std::move(reply));
                    });
  server.onRefused(
      [&api](std::string_view target, unsigned status) { api.countRefused(target, status); });
  server.onLimit([&metrics](std::string_view limit, std::string_view listener) {
    metrics.limitHits(limit, listener).Increment();
  });
  server.onHeader([&api](const Request& header, const RequestInfo& info, bool has_body) {
    return api.checkHeader(header, info, has_body);
  });
  if (auto st = openListeners(config, server, api); !st.isOk()) {
    spdlog::error("{}", st.message());
    return kExitFailure;
  }
  api.setBeforeScrape([&metrics, &server, t = peers.transport.get()] {
    metrics.receive_pool_bytes.Set(t != nullptr ? static_cast<double>(t->pooledBytes()) : 0.0);
    metrics.body_pool_bytes.Set(static_cast<double>(server.keptBodyBytes()));
  });
  spdlog::info(
      "lightwire {} serving: job '{}', {} local trainer(s), default codec {}, {} compute "
      "thread(s)",
      LIGHTWIRE_VERSION, config.job_id, config.local_trainers,
      config.compression.default_codec.name, threads);
  serveUntilSignalled(config, io, server, api, engine, peers.transport.get());
  spdlog::info("stopped");
  return 0;
}

}  // namespace lightwire::proxy
