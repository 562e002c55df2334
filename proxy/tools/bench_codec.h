#pragma once
// `lightwire bench codec`: throughput of one codec on one fp32 tensor, against the baselines that
// say whether it is fast (a parallel memcpy of the same bytes, and std::nth_element for the
// selection codecs). Prints figures; never passes or fails on time. Method: bench/README.md.

#include <boost/json/object.hpp>

#include <cstddef>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "kernels/status.h"

namespace lightwire::proxy {

/// How to measure (the same for every codec of one invocation).
struct BenchSettings {
  size_t elements = 0;        // N, fp32 elements of the input
  unsigned threads = 1;       // CpuStream threads, also the memcpy baseline's
  size_t chunk_elements = 0;  // requested chunk size (0 = kDefaultChunkElements)
  int runs = 5;               // timed runs per figure (>= 5), after one warm-up run
};

/// Chunk size when none is asked for: 1 Mi elements (4 MiB of fp32), the granularity at which the
/// sidecar pipelines compression with sending.
inline constexpr size_t kDefaultChunkElements = size_t{1} << 20;
inline constexpr int kMinRuns = 5;

/// Figures of one codec. Seconds are medians of `runs` timed runs.
struct BenchResult {
  std::string label;  // e.g. "topk density=0.01"
  kernels::CodecConfig config;
  boost::json::object params;  // effective parameters
  size_t elements = 0;
  unsigned threads = 0;
  size_t chunk_elements = 0;
  size_t chunks = 0;
  int runs = 0;
  size_t raw_bytes = 0;   // 4 * elements
  size_t wire_bytes = 0;  // sum of the payload sizes
  double compress_s = 0, decompress_s = 0, memcpy_s = 0;
  std::optional<double> commit_s;       // codecs with state (host, one round): commitState()
  std::optional<double> nth_element_s;  // topk, dgc: single-threaded std::nth_element
  /// "cpu", or "cuda" (bench_codec_cuda.cc): then memcpy_s is a device-to-device cudaMemcpy of the
  /// same bytes, the times are CUDA event times of the kernels, and torch_topk_s is
  /// torch.topk(|x|, k) on the same GPU when PyTorch with CUDA is importable (topk, dgc).
  std::string device = "cpu";
  std::string device_name;
  std::optional<double> torch_topk_s;

  double gbps(double seconds) const { return seconds > 0 ? double(raw_bytes) / seconds / 1e9 : 0; }
  boost::json::object toJson() const;
};

/// Codecs measured against a selection baseline (they select the k largest): topk, dgc.
bool isSelection(const std::string& name);
/// Effective density of a density-configured codec (density, or 1/ratio), as the codec computes
/// it; nullopt for other codecs.
std::optional<double> effectiveDensity(const kernels::CodecConfig& c);
/// The parameters `codec` (built from c) actually uses, as reported in `params`.
boost::json::object effectiveParams(const kernels::CodecConfig& c, const kernels::Codec& codec);
/// The row label of c, e.g. "topk density=0.01".
std::string makeLabel(const kernels::CodecConfig& c);

/// The fixed-seed Gaussian input (mean 0, stddev 1) every codec is measured on.
std::vector<float> makeBenchInput(size_t elements);

/// Builds the codec of `config` (kernels::createCodec; an invalid config is an error carrying the
/// codec's message, code kInvalidArgument) and measures it on `input` with `stream`.
/// `progress` receives one-line notes for stderr (may be empty).
Result<BenchResult> benchCodec(const kernels::CodecConfig& config, std::span<const float> input,
                               const BenchSettings& settings, kernels::CpuStream& stream,
                               const std::function<void(const std::string&)>& progress);

/// The representative list of `bench codec --all`.
std::vector<kernels::CodecConfig> representativeCodecs();

/// Whether this build has the CUDA codecs (kernels/cuda): `bench codec --device cuda` needs them.
bool cudaBenchBuilt();

/// --device cuda: measures the CUDA codec of `config` (kernels/cuda/codec.h) on `input` copied to
/// GPU 0, with CUDA events around the kernels of each run, against a device-to-device copy of the
/// same bytes and (topk, dgc) torch.topk through `python` (skipped with a note when PyTorch with
/// CUDA cannot be imported). failedPrecondition without a GPU, without CUDA codecs in this build,
/// or for a codec without a CUDA implementation.
Result<BenchResult> benchCodecCuda(const kernels::CodecConfig& config, std::span<const float> input,
                                   const BenchSettings& settings, const std::string& python,
                                   const std::function<void(const std::string&)>& progress);

/// Aligned human-readable table (device "cuda": the baseline columns are the device copy and
/// torch.topk).
std::string tableHeader(const std::string& device = "cpu");
std::string tableRow(const BenchResult& r);

}  // namespace lightwire::proxy
