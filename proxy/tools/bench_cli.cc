// The tools of the `lightwire` executable beside the sidecar: `bench codec` (bench_codec.h),
// `bench ingest` (bench_ingest.h), `bench exchange` (bench_exchange.h), `status` and `health`
// (status_cli.h): their command lines.

#include "proxy/tools/bench_cli.h"

#include <boost/json/serialize.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>

#include "kernels/parallel.h"
#include "kernels/registry.h"
#include "proxy/server/resources.h"
#include "proxy/tools/bench_codec.h"
#include "proxy/tools/bench_exchange.h"
#include "proxy/tools/bench_ingest.h"
#include "proxy/tools/status_cli.h"
#include "proxy/version.h"

namespace lightwire::proxy::tools {
namespace {

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

/// Flags of `lightwire bench codec`, as parsed.
struct BenchCodecFlags {
  bool all = false;
  std::string codec;
  std::optional<double> density, ratio, momentum, threshold;
  std::optional<int> bits, approx_rank;
  std::optional<uint32_t> bucket_size;
  std::string values;
  std::string error_feedback;
  size_t elements = 0;
  unsigned threads = 0;
  size_t chunk_elements = 0;
  int runs = kMinRuns;
  bool json = false;
  std::string device = "cpu";
  std::string python;
};

kernels::CodecConfig toConfig(const BenchCodecFlags& f) {
  kernels::CodecConfig c;
  c.name = f.codec;
  c.density = f.density;
  c.ratio = f.ratio;
  if (f.bits) c.bits = *f.bits;
  if (f.bucket_size) c.bucket_size = *f.bucket_size;
  if (f.momentum) c.momentum = *f.momentum;
  if (f.approx_rank) c.approx_rank = *f.approx_rank;
  c.threshold = f.threshold;
  if (f.values == "fp16") c.sparse_values = kernels::DType::kF16;
  if (f.error_feedback == "on") c.error_feedback = true;
  if (f.error_feedback == "off") c.error_feedback = false;
  return c;
}

int runBenchCodec(const BenchCodecFlags& f) {
  std::vector<kernels::CodecConfig> configs;
  if (f.all) {
    configs = representativeCodecs();
  } else {
    configs.push_back(toConfig(f));
  }
  BenchSettings settings;
  settings.elements = f.elements;
  settings.threads = f.threads ? f.threads : cpuBudget().usable();
  settings.chunk_elements = f.chunk_elements;
  settings.runs = f.runs;

  const bool cuda = f.device == "cuda";
  if (cuda && !cudaBenchBuilt()) {
    std::fprintf(stderr, "lightwire: %s\n",
                 benchCodecCuda({}, {}, settings, f.python, nullptr).status().message().c_str());
    return kExitFailure;
  }
  // Parameters are checked before the (slow) input is made: a typo costs nothing.
  for (const auto& c : configs) {
    auto codec = kernels::createCodec(c);
    if (!codec) {
      std::fprintf(stderr, "lightwire: %s\n", codec.status().message().c_str());
      return kExitUsage;
    }
  }

  if (cuda) {
    std::fprintf(stderr,
                 "lightwire bench codec --device cuda: %zu elements (%.1f MB fp32), %d runs\n",
                 settings.elements, double(settings.elements) * 4 / 1e6, settings.runs);
  } else {
    std::fprintf(
        stderr, "lightwire bench codec: %zu elements (%.1f MB fp32), %u threads, %d runs\n",
        settings.elements, double(settings.elements) * 4 / 1e6, settings.threads, settings.runs);
  }
  const std::vector<float> input = makeBenchInput(settings.elements);
  kernels::CpuStream stream(settings.threads);
  auto progress = [](const std::string& line) { std::fprintf(stderr, "  %s\n", line.c_str()); };

  if (!f.json) std::fputs(tableHeader(f.device).c_str(), stdout);
  for (const auto& c : configs) {
    if (cuda && f.all && c.name == "powersgd") continue;  // two rounds: --device cpu only
    auto result = cuda ? benchCodecCuda(c, input, settings, f.python, progress)
                       : benchCodec(c, input, settings, stream, progress);
    if (!result) {
      std::fprintf(stderr, "lightwire: %s: %s\n", c.name.c_str(),
                   result.status().message().c_str());
      return result.status().code() == StatusCode::kInvalidArgument ? kExitUsage : kExitFailure;
    }
    if (f.json) {
      std::cout << boost::json::serialize(result->toJson()) << '\n';
    } else {
      std::fputs(tableRow(*result).c_str(), stdout);
    }
    std::fflush(stdout);
    std::cout.flush();
  }
  return 0;
}

/// The running executable, for the benchmarks that start sidecars of it.
std::string selfExe(const char* argv0) {
  std::error_code ec;
  std::string exe = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  return ec ? std::string(argv0) : exe;
}

std::string knownCodecs() {
  std::string known;
  for (const auto& n : kernels::codecNames()) known += (known.empty() ? "" : ", ") + n;
  return known;
}

void addBenchCodec(CLI::App& bench, int& rc) {
  auto state = std::make_shared<BenchCodecFlags>();
  BenchCodecFlags& f = *state;
  const std::string known = knownCodecs();
  CLI::App* codec =
      bench.add_subcommand("codec", "Throughput of a codec on a Gaussian fp32 tensor");

  auto* all = codec->add_flag("--all", f.all, "Run the representative codec list");
  auto* name = codec->add_option("--codec", f.codec, "Codec name: " + known);
  name->excludes(all);
  auto* density = codec->add_option("--density", f.density, "topk/dgc/randomk: k/n in (0, 1]");
  auto* ratio =
      codec->add_option("--ratio", f.ratio, "topk/dgc/randomk: n/k (alternative to --density)");
  codec->add_option("--threshold", f.threshold, "threshold: send elements with |g| >= this");
  density->excludes(ratio);
  codec->add_option("--bits", f.bits, "qsgd: bits per element including sign (2..8)");
  codec->add_option("--bucket-size", f.bucket_size,
                    "qsgd/terngrad/signsgd/onebit: elements per scale bucket");
  codec->add_option("--momentum", f.momentum, "dgc: momentum correction factor in [0, 1)");
  codec->add_option("--approx-rank", f.approx_rank, "powersgd: rank");
  codec->add_option("--values", f.values, "topk/dgc/randomk/threshold: value encoding")
      ->check(CLI::IsMember({"fp32", "fp16"}));
  codec->add_option("--error-feedback", f.error_feedback, "on|off (default: the codec's)")
      ->check(CLI::IsMember({"on", "off"}));
  codec->add_option("--elements", f.elements, "Input elements (fp32)")
      ->required()
      ->check(CLI::Range(size_t{1}, size_t{1} << 34));
  codec
      ->add_option("--threads", f.threads,
                   "CpuStream threads (default: the CPUs this process may use)")
      ->check(CLI::Range(1u, 1024u));
  codec
      ->add_option("--chunk-elements", f.chunk_elements,
                   "Elements per chunk (default 1048576; rounded up to the codec's alignment)")
      ->check(CLI::Range(size_t{1}, size_t{1} << 34));
  codec->add_option("--runs", f.runs, "Timed runs per figure; the median is reported (>= 5)")
      ->check(CLI::Range(kMinRuns, 1000000));
  codec->add_flag("--json", f.json, "One JSON object per line");
  codec
      ->add_option("--device", f.device,
                   "cpu (default) or cuda: the CUDA codecs on GPU 0, against a device copy and "
                   "torch.topk")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  {
    const char* py = std::getenv("PYTHON");
    f.python = py != nullptr && *py != '\0' ? py : "/usr/bin/python3";
  }
  codec->add_option("--python", f.python,
                    "Python with PyTorch for the torch.topk baseline of --device cuda "
                    "(default $PYTHON or /usr/bin/python3)");

  codec->callback([state, &rc] {
    const BenchCodecFlags& f = *state;
    if (!f.all && f.codec.empty())
      throw CLI::ValidationError("--codec", "give --codec NAME or --all");
    rc = runBenchCodec(f);
  });
}

void addBenchIngest(CLI::App& bench, const char* argv0, int& rc) {
  struct State {
    IngestBenchSettings is;
    bool no_python = false;
    size_t large_mb = 100;
  };
  auto state = std::make_shared<State>();
  IngestBenchSettings& is = state->is;
  bool& no_python = state->no_python;
  size_t& large_mb = state->large_mb;
  CLI::App* ingest = bench.add_subcommand(
      "ingest", "Round trips through a real `lightwire serve` child process (codec none)");
  const char* py_env = std::getenv("PYTHON");
  is.python = py_env != nullptr && *py_env != '\0' ? py_env : "/usr/bin/python3";
  is.python_path = std::string(LIGHTWIRE_SOURCE_DIR) + "/clients/python";
  ingest->add_option("--runs", is.small_runs, "Timed 4 KiB round trips per client")
      ->check(CLI::Range(10, 10000000));
  ingest->add_option("--large-mb", large_mb, "Size of the large tensor in MB (default 100)")
      ->check(CLI::Range(size_t{1}, size_t{1900}));
  ingest->add_option("--large-runs", is.large_runs, "Timed large round trips (median)")
      ->check(CLI::Range(1, 1000));
  ingest->add_option("--python", is.python, "Python interpreter for the Python client's figures");
  ingest->add_option("--python-path", is.python_path, "Directory holding the lightwire package");
  ingest->add_flag("--no-python", no_python, "Skip the Python client");
  ingest->add_flag("--json", is.json, "One JSON object");
  ingest
      ->add_option("--concurrency", is.concurrency,
                   "Load figures: clients at once, e.g. 1,8,64,256 (half on the Unix socket, half "
                   "on TCP), 4 KiB and 4 MiB steps, against one client")
      ->delimiter(',')
      ->check(CLI::Range(1, 4096));
  ingest->add_option("--load-seconds", is.load_seconds, "Timed seconds per load cell (default 3)")
      ->check(CLI::Range(0.5, 600.0));
  ingest->add_flag("--load-only", is.load_only, "Only the load figures (with --concurrency)");

  ingest->callback([state, argv0, &rc] {
    IngestBenchSettings& is = state->is;
    is.large_bytes = state->large_mb * 1000000;
    if (state->no_python) is.python.clear();
    is.self_exe = selfExe(argv0);
    rc = runIngestBench(is);
  });
}

void addBenchExchange(CLI::App& bench, const char* argv0, int& rc) {
  struct State {
    BenchCodecFlags xf;
    int x_world = 0, x_steps = 5;
    std::string x_transport = "tcp", x_topology = "ring", x_sparse = "allgather";
    uint64_t x_warmup = 0;
  };
  auto state = std::make_shared<State>();
  BenchCodecFlags& xf = state->xf;
  int& x_world = state->x_world;
  int& x_steps = state->x_steps;
  std::string& x_transport = state->x_transport;
  std::string& x_topology = state->x_topology;
  const std::string known = knownCodecs();
  CLI::App* exchange = bench.add_subcommand(
      "exchange", "Allreduce steps through W `lightwire serve` child processes on loopback TCP");
  exchange->add_option("--world-size", x_world, "Sidecars (ranks), 2..64")
      ->required()
      ->check(CLI::Range(2, 64));
  exchange->add_option("--codec", xf.codec, "Codec name: " + known)->required();
  auto* x_density =
      exchange->add_option("--density", xf.density, "topk/dgc/randomk: k/n in (0, 1]");
  auto* x_ratio = exchange->add_option("--ratio", xf.ratio, "topk/dgc/randomk: n/k");
  x_density->excludes(x_ratio);
  exchange->add_option("--threshold", xf.threshold, "threshold: send elements with |g| >= this");
  exchange->add_option("--bits", xf.bits, "qsgd: bits per element including sign (2..8)");
  exchange->add_option("--bucket-size", xf.bucket_size,
                       "qsgd/terngrad/signsgd/onebit: elements per scale bucket");
  exchange->add_option("--momentum", xf.momentum, "dgc: momentum correction factor in [0, 1)");
  exchange->add_option("--approx-rank", xf.approx_rank, "powersgd: rank");
  exchange->add_option("--values", xf.values, "topk/dgc/randomk/threshold: value encoding")
      ->check(CLI::IsMember({"fp32", "fp16", "float32", "float16"}));
  exchange->add_option("--error-feedback", xf.error_feedback, "on|off (default: the codec's)")
      ->check(CLI::IsMember({"on", "off"}));
  exchange
      ->add_option("--chunk-elements", xf.chunk_elements,
                   "Elements per chunk (default: the sidecar's, 1048576)")
      ->check(CLI::Range(size_t{1}, size_t{1} << 34));
  exchange->add_option("--elements", xf.elements, "fp32 elements of the tensor (1..2^28)")
      ->required()
      ->check(CLI::Range(size_t{1}, size_t{1} << 28));
  exchange
      ->add_option("--steps", x_steps, "Timed steps (after one untimed); the median is reported")
      ->check(CLI::Range(1, 100000));
  exchange->add_flag("--json", xf.json, "One JSON object");
  exchange->add_option("--transport", x_transport, "Peer transport of the sidecars (tcp, ucx)")
      ->check(CLI::IsMember({"tcp", "ucx"}));
  exchange->add_option("--topology", x_topology, "ring, or ps (parameter server: rank 0)")
      ->check(CLI::IsMember({"ring", "ps"}));
  exchange
      ->add_option(
          "--sparse", state->x_sparse,
          "How the ring exchanges topk, dgc and threshold: allgather or allreduce (peer.sparse)")
      ->check(CLI::IsMember({"allgather", "allreduce"}));
  exchange
      ->add_option("--warmup-steps", state->x_warmup,
                   "The sidecars' DGC warm-up (schedule.warmup_steps; default 0: topk and dgc send "
                   "at their own density from the first step)")
      ->check(CLI::Range(uint64_t{0}, uint64_t{1} << 40));

  exchange->callback([state, argv0, &rc] {
    BenchCodecFlags& xf = state->xf;
    if (xf.values == "float32") xf.values = "fp32";
    if (xf.values == "float16") xf.values = "fp16";
    // Parameters are checked here, as the sidecars would, before anything is started.
    auto check = kernels::createCodec(toConfig(xf));
    if (!check) {
      std::fprintf(stderr, "lightwire: %s\n", check.status().message().c_str());
      rc = kExitUsage;
      return;
    }
    ExchangeBenchSettings xs;
    xs.world_size = state->x_world;
    xs.codec = xf.codec;
    xs.elements = xf.elements;
    xs.steps = state->x_steps;
    xs.json = xf.json;
    xs.transport = state->x_transport;
    xs.topology = state->x_topology;
    xs.sparse = state->x_sparse;
    xs.warmup_steps = state->x_warmup;
    auto param = [&](const char* flag, const std::string& value) {
      xs.codec_args.push_back(std::string("--") + flag);
      xs.codec_args.push_back(value);
      xs.codec_params.emplace_back(flag, value);
    };
    auto num = [](double v) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.17g", v);
      return std::string(buf);
    };
    if (xf.density) param("density", num(*xf.density));
    if (xf.ratio) param("ratio", num(*xf.ratio));
    if (xf.threshold) param("threshold", num(*xf.threshold));
    if (xf.bits) param("bits", std::to_string(*xf.bits));
    if (xf.bucket_size) param("bucket-size", std::to_string(*xf.bucket_size));
    if (xf.momentum) param("momentum", num(*xf.momentum));
    if (xf.approx_rank) param("approx-rank", std::to_string(*xf.approx_rank));
    if (!xf.values.empty()) param("values", xf.values == "fp16" ? "float16" : "float32");
    if (!xf.error_feedback.empty()) param("error-feedback", xf.error_feedback);
    if (xf.chunk_elements) param("chunk-elements", std::to_string(xf.chunk_elements));
    xs.self_exe = selfExe(argv0);
    rc = runExchangeBench(xs);
  });
}

void addStatus(CLI::App& app, int& rc) {
  auto so_state = std::make_shared<StatusOptions>();
  StatusOptions& so = *so_state;
  CLI::App* status = app.add_subcommand(
      "status", "Summary of a running sidecar: rank, peers, codec settings, policies, tensors");
  status->add_option(
      "--socket", so.socket,
      "Control socket (default: $LIGHTWIRE_SOCKET, else /run/lightwire/lightwire.sock)");
  status->add_option("--url", so.url, "http://HOST:PORT of a control or admin listener instead");
  status->add_option("--token", so.token, "Bearer token (default: $LIGHTWIRE_TOKEN)");
  status->add_option("--decisions", so.decisions, "Decision-log entries shown")
      ->capture_default_str()
      ->check(CLI::Range(0, 100000));
  status->add_option("--timeout", so.timeout_s, "Seconds to wait for the sidecar")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  status->add_flag("--json", so.json, "Print the /v1/status JSON as it is");
  status->callback([so_state, &rc] { rc = runStatus(*so_state); });
}

void addHealth(CLI::App& app, int& rc) {
  auto ho_state = std::make_shared<HealthOptions>();
  HealthOptions& ho = *ho_state;
  CLI::App* health = app.add_subcommand(
      "health",
      "Probe a sidecar: GET /healthz (or /readyz) of its admin listener; exit 0 when it answers "
      "200 (a container health check that needs no curl)");
  health->add_option("--url", ho.url,
                     "http://HOST:PORT (default: the admin listener from $LIGHTWIRE_ADMIN__LISTEN, "
                     "else http://127.0.0.1:4782)");
  health->add_option("--socket", ho.socket, "Probe through the control socket instead");
  health->add_flag("--ready", ho.ready, "GET /readyz: every listener up and every peer connected");
  health->add_flag("--quiet,-q", ho.quiet, "Print nothing when healthy");
  health->add_option("--timeout", ho.timeout_s, "Seconds to wait for the answer")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  health->callback([ho_state, &rc] { rc = runHealth(*ho_state); });
}

}  // namespace

void addToolCommands(CLI::App& app, const char* argv0, int& rc) {
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks that print figures");
  bench->require_subcommand(1);
  addBenchCodec(*bench, rc);
  addBenchIngest(*bench, argv0, rc);
  addBenchExchange(*bench, argv0, rc);
  addStatus(app, rc);
  addHealth(app, rc);
}

}  // namespace lightwire::proxy::tools
