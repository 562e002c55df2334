#include "proxy/tools/bench_codec.h"

#include <boost/json/array.hpp>
#include <boost/json/value.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>

#include "kernels/parallel.h"
#include "kernels/philox.h"
#include "kernels/registry.h"
#include "kernels/select.h"

namespace lightwire::proxy {
namespace {

using kernels::Chunking;
using kernels::Codec;
using kernels::CodecConfig;
using kernels::CodecState;
using kernels::ConstTensor;
using kernels::DType;
using kernels::StepContext;
using Clock = std::chrono::steady_clock;

/// Codecs configured by density or ratio.
bool usesDensity(const std::string& name) {
  const auto traits = kernels::findCodecTraits(name);
  return traits && traits->uses_density;
}

std::string formatNumber(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

}  // namespace

bool isSelection(const std::string& name) { return name == "topk" || name == "dgc"; }

std::optional<double> effectiveDensity(const CodecConfig& c) {
  if (!usesDensity(c.name)) return std::nullopt;
  auto d = kernels::configuredDensity(
      c, c.name, c.name == "dgc" ? std::optional(kernels::kDgcDefaultDensity) : std::nullopt);
  if (!d) return std::nullopt;
  return *d;
}

boost::json::object effectiveParams(const CodecConfig& c, const Codec& codec) {
  boost::json::object p;
  const auto& t = codec.traits();
  if (usesDensity(c.name) || c.name == "threshold") {
    if (auto d = effectiveDensity(c)) p["density"] = *d;
    if (c.threshold) p["threshold"] = *c.threshold;
    if (c.ratio) p["ratio"] = *c.ratio;
    p["values"] = std::string(kernels::dtypeName(c.sparse_values));
  }
  if (c.name == "dgc") {
    p["momentum"] = c.momentum;
    p["clip_norm"] = c.clip_norm;
    p["sample_fraction"] = c.sample_fraction;
  }
  if (c.name == "qsgd") p["bits"] = c.bits;
  if (c.name == "qsgd" || c.name == "terngrad" || c.name == "signsgd" || c.name == "onebit") {
    p["bucket_size"] = c.bucket_size;
  }
  if (c.name == "powersgd") p["approx_rank"] = c.approx_rank;
  p["error_feedback"] = !t.own_memory && c.error_feedback.value_or(t.default_error_feedback);
  return p;
}

std::string makeLabel(const CodecConfig& c) {
  std::string label = c.name;
  if (c.name == "threshold" && c.threshold) label += " t=" + formatNumber(*c.threshold);
  if (usesDensity(c.name)) {
    if (c.ratio && !c.density) {
      label += " ratio=" + formatNumber(*c.ratio);
    } else if (auto d = effectiveDensity(c)) {
      label += " density=" + formatNumber(*d);
    }
    if (c.sparse_values == DType::kF16) label += " values=fp16";
  }
  if (c.name == "dgc" && c.momentum > 0) label += " momentum=" + formatNumber(c.momentum);
  if (c.name == "qsgd") {
    label += " bits=" + std::to_string(c.bits);
    if (c.bucket_size != CodecConfig{}.bucket_size) {
      label += " bucket=" + std::to_string(c.bucket_size);
    }
  }
  if (c.name == "powersgd") label += " rank=" + std::to_string(c.approx_rank);
  if (c.error_feedback) label += *c.error_feedback ? " ef=on" : " ef=off";
  return label;
}

namespace {

/// Median wall time of `runs` calls of `body`, after one untimed warm-up call. `before` runs
/// untimed ahead of every call (resetting buffers). Stops at the first error.
Result<double> medianSeconds(int runs, const std::function<void()>& before,
                             const std::function<Status()>& body) {
  std::vector<double> times;
  for (int r = 0; r <= runs; ++r) {
    if (before) before();
    const auto t0 = Clock::now();
    Status s = body();
    const auto t1 = Clock::now();
    if (!s.isOk()) return s;
    if (r > 0) times.push_back(std::chrono::duration<double>(t1 - t0).count());
  }
  std::sort(times.begin(), times.end());
  const size_t m = times.size() / 2;
  return times.size() % 2 ? times[m] : 0.5 * (times[m - 1] + times[m]);
}

}  // namespace

std::vector<float> makeBenchInput(size_t elements) {
  std::vector<float> x(elements);
  std::mt19937_64 rng(0x6c69676874776972ull);  // "lightwir"
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  for (float& v : x) v = gauss(rng);
  return x;
}

Result<BenchResult> benchCodec(const CodecConfig& config, std::span<const float> input,
                               const BenchSettings& settings, kernels::CpuStream& stream,
                               const std::function<void(const std::string&)>& progress) {
  auto made = kernels::createCodec(config);
  if (!made) return made.status();
  const Codec& codec = **made;
  const size_t n = input.size();
  const int runs = std::max(settings.runs, kMinRuns);

  BenchResult r;
  r.label = makeLabel(config);
  r.config = config;
  r.params = effectiveParams(config, codec);
  r.elements = n;
  r.threads = stream.threads();
  r.runs = runs;
  r.raw_bytes = n * sizeof(float);

  const Chunking chunking = kernels::chunkingFor(
      codec, n, settings.chunk_elements ? settings.chunk_elements : kDefaultChunkElements);
  r.chunk_elements = chunking.chunk_elements;
  r.chunks = chunking.count();
  auto note = [&](const std::string& what) {
    if (progress) progress(r.label + ": " + what);
  };

  // Every buffer is allocated value-initialised, i.e. written once, so its pages are faulted in
  // before anything is timed.
  const ConstTensor tensor{input.data(), n, DType::kF32};
  CodecState state(codec.stateFloats(n));
  std::vector<float> work(codec.workFloats(n));  // the step's work area, as the sidecar lends it
  state.attachWork(work);
  std::vector<std::byte> workspace(codec.workspaceBytes(chunking));
  std::vector<size_t> offsets(chunking.count() + 1, 0);
  for (size_t c = 0; c < chunking.count(); ++c) {
    offsets[c + 1] = offsets[c] + codec.maxPayloadBytes(chunking.size(c));
  }
  std::vector<uint8_t> payloads(offsets.back());
  std::vector<size_t> sizes(chunking.count(), 0);
  // Multi-round codecs (PowerSGD) run as one rank: each round's reduced payload is its own.
  const int rounds = codec.traits().rounds;
  std::vector<std::vector<uint8_t>> round_payloads(rounds > 1 ? rounds : 0,
                                                   std::vector<uint8_t>(codec.maxPayloadBytes(n)));
  std::vector<float> output(n);
  std::vector<float> copy(n);

  StepContext ctx;
  ctx.seed = 0;
  ctx.name_key = kernels::tensorNameKey("lightwire.bench");
  ctx.step = 1;
  ctx.rank = 0;
  ctx.stream = &stream;

  // memcpy baseline: the same bytes, cut into one contiguous range per thread.
  note("memcpy baseline");
  auto memcpy_s = medianSeconds(runs, nullptr, [&] {
    stream.parallelFor(n, 1, [&](size_t lo, size_t hi) {
      std::memcpy(copy.data() + lo, input.data() + lo, (hi - lo) * sizeof(float));
    });
    return Status::ok();
  });
  if (!memcpy_s) return memcpy_s.status();
  r.memcpy_s = *memcpy_s;

  // Compress: analyze + encodeChunk of every chunk. State is never committed, so every run starts
  // from the same (zero) state and does the same work, also for dgc and error feedback.
  note("compress");
  auto compress_s = medianSeconds(runs, nullptr, [&]() -> Status {
    LW_RETURN_IF_ERROR(codec.analyze(ctx, chunking, tensor, state, workspace));
    if (rounds > 1) {  // one chunk (chunkingFor); round r reads round r-1's reduced payload
      sizes.assign(rounds, 0);
      for (int round = 0; round < rounds; ++round) {
        std::span<const uint8_t> previous;
        if (round > 0) previous = {round_payloads[round - 1].data(), sizes[round - 1]};
        auto size = codec.encodeChunk(ctx, chunking, 0, round, previous, tensor, state, workspace,
                                      round_payloads[round]);
        if (!size) return size.status();
        sizes[round] = *size;
      }
      return Status::ok();
    }
    for (size_t c = 0; c < chunking.count(); ++c) {
      std::span<uint8_t> out(payloads.data() + offsets[c], offsets[c + 1] - offsets[c]);
      auto size = codec.encodeChunk(ctx, chunking, c, 0, {}, tensor, state, workspace, out);
      if (!size) return size.status();
      sizes[c] = *size;
    }
    return Status::ok();
  });
  if (!compress_s) return compress_s.status();
  r.compress_s = *compress_s;
  for (size_t s : sizes) r.wire_bytes += s;

  // Commit (codecs with state, one round): the last compression applied to the state in place
  // (docs/determinism.md "4.6c Atomic steps (one copy of the state)"); a whole step is compress
  // plus commit. Each run applies it again to the state the previous run left: the same work.
  if (rounds == 1 && codec.stateFloats(n) > 0) {
    note("commit");
    std::vector<std::span<const uint8_t>> sent(chunking.count());
    for (size_t c = 0; c < chunking.count(); ++c)
      sent[c] = {payloads.data() + offsets[c], sizes[c]};
    auto commit_s = medianSeconds(runs, nullptr, [&]() -> Status {
      return codec.commitState(ctx, chunking, tensor, sent, {}, state, workspace);
    });
    if (!commit_s) return commit_s.status();
    r.commit_s = *commit_s;
  }

  // Decompress: every chunk's payload into a zeroed fp32 output with weight 1. decodeChunk has no
  // stream of its own; chunks write disjoint ranges, so the stream's threads take chunks.
  note("decompress");
  std::vector<Status> chunk_status(chunking.count());
  auto decompress_s = medianSeconds(
      runs,
      [&] {
        stream.parallelFor(n, 1, [&](size_t lo, size_t hi) {
          std::memset(output.data() + lo, 0, (hi - lo) * sizeof(float));
        });
      },
      [&]() -> Status {
        if (rounds > 1) {
          std::vector<std::span<const uint8_t>> reduced;
          for (int round = 0; round < rounds; ++round) {
            reduced.emplace_back(round_payloads[round].data(), sizes[round]);
          }
          return codec.decodeRounds(reduced, 1.0f, output.data(), n);
        }
        stream.parallelFor(chunking.count(), 1, [&](size_t lo, size_t hi) {
          for (size_t c = lo; c < hi; ++c) {
            std::span<const uint8_t> payload(payloads.data() + offsets[c], sizes[c]);
            chunk_status[c] = codec.decodeChunk(payload, 1.0f, output.data() + chunking.begin(c),
                                                chunking.size(c));
          }
        });
        for (size_t c = 0; c < chunk_status.size(); ++c) {
          if (!chunk_status[c].isOk()) {
            return {chunk_status[c].code(),
                    "decoding chunk " + std::to_string(c) + ": " + chunk_status[c].message()};
          }
        }
        return Status::ok();
      });
  if (!decompress_s) return decompress_s.status();
  r.decompress_s = *decompress_s;

  // nth_element baseline (selection codecs): k largest of |x|, on a copy made outside the timing;
  // single-threaded, as std::nth_element is.
  if (isSelection(config.name)) {
    if (auto density = effectiveDensity(config); density && n > 0) {
      note("nth_element baseline");
      const size_t k = kernels::selectionSize(n, *density);
      auto nth_s = medianSeconds(
          runs,
          [&] {
            for (size_t i = 0; i < n; ++i) copy[i] = std::fabs(input[i]);
          },
          [&] {
            std::nth_element(copy.begin(), copy.begin() + std::ptrdiff_t(k - 1), copy.end(),
                             std::greater<float>());
            return Status::ok();
          });
      if (!nth_s) return nth_s.status();
      r.nth_element_s = *nth_s;
    }
  }
  return r;
}

boost::json::object BenchResult::toJson() const {
  boost::json::object o;
  o["codec"] = config.name;
  o["label"] = label;
  o["params"] = params;
  o["elements"] = elements;
  o["threads"] = threads;
  o["chunk_elements"] = chunk_elements;
  o["chunks"] = chunks;
  o["runs"] = runs;
  o["raw_bytes"] = raw_bytes;
  o["wire_bytes"] = wire_bytes;
  o["ratio"] = wire_bytes ? double(raw_bytes) / double(wire_bytes) : 0.0;
  o["compress_gbps"] = gbps(compress_s);
  o["decompress_gbps"] = gbps(decompress_s);
  o["memcpy_gbps"] = gbps(memcpy_s);
  o["compress_vs_memcpy"] = memcpy_s > 0 && compress_s > 0 ? memcpy_s / compress_s : 0.0;
  o["decompress_vs_memcpy"] = memcpy_s > 0 && decompress_s > 0 ? memcpy_s / decompress_s : 0.0;
  if (nth_element_s) {
    o["nth_element_gbps"] = gbps(*nth_element_s);
    o["nth_element_threads"] = 1;
  }
  o["device"] = device;
  if (device == "cuda") {
    o["device_name"] = device_name;
    o["d2d_copy_gbps"] = gbps(memcpy_s);
    if (torch_topk_s) {
      o["torch_topk_gbps"] = gbps(*torch_topk_s);
      o["torch_topk_seconds"] = *torch_topk_s;
    }
  }
  if (commit_s) {
    o["commit_gbps"] = gbps(*commit_s);
    o["commit_seconds"] = *commit_s;
    // The whole step on the sending side: compression and the state's commit.
    o["step_vs_memcpy"] = memcpy_s > 0 ? memcpy_s / (compress_s + *commit_s) : 0.0;
  }
  o["compress_seconds"] = compress_s;
  o["decompress_seconds"] = decompress_s;
  o["memcpy_seconds"] = memcpy_s;
  return o;
}

std::vector<CodecConfig> representativeCodecs() {
  auto make = [](const char* name) {
    CodecConfig c;
    c.name = name;
    return c;
  };
  std::vector<CodecConfig> list;
  list.push_back(make("none"));
  list.push_back(make("fp16"));
  list.push_back(make("bf16"));
  for (double d : {0.01, 0.001}) {
    CodecConfig c = make("topk");
    c.density = d;
    list.push_back(c);
  }
  for (double m : {0.0, 0.9}) {
    CodecConfig c = make("dgc");
    c.density = 0.001;
    c.momentum = m;
    list.push_back(c);
  }
  {
    CodecConfig c = make("dgc");
    c.density = 0.01;
    list.push_back(c);
    c.momentum = 0.9;
    list.push_back(c);
  }
  for (int b : {8, 4}) {
    CodecConfig c = make("qsgd");
    c.bits = b;
    list.push_back(c);
  }
  {
    CodecConfig c = make("randomk");
    c.density = 0.01;
    list.push_back(c);
  }
  {
    CodecConfig c = make("threshold");
    c.threshold = 2.5;  // about 1.2 % of a standard Gaussian
    list.push_back(c);
  }
  list.push_back(make("terngrad"));
  list.push_back(make("signsgd"));
  list.push_back(make("onebit"));
  for (int r : {1, 4}) {
    CodecConfig c = make("powersgd");
    c.approx_rank = r;
    list.push_back(c);
  }
  return list;
}

namespace {
constexpr const char* kRowFormat = "%-34s %7s %10s %13s %15s %11s %9s %15s\n";
}

std::string tableHeader(const std::string& device) {
  char buf[256];
  if (device == "cuda") {
    std::snprintf(buf, sizeof buf, kRowFormat, "codec (cuda)", "ratio", "wire MB", "compress GB/s",
                  "decompress GB/s", "d2d GB/s", "c/d2d", "torch.topk GB/s");
  } else {
    std::snprintf(buf, sizeof buf, kRowFormat, "codec", "ratio", "wire MB", "compress GB/s",
                  "decompress GB/s", "memcpy GB/s", "c/memcpy", "nth_elem GB/s");
  }
  return buf;
}

std::string tableRow(const BenchResult& r) {
  auto fixed = [](double v, int digits) {
    char b[32];
    std::snprintf(b, sizeof b, "%.*f", digits, v);
    return std::string(b);
  };
  const double ratio = r.wire_bytes ? double(r.raw_bytes) / double(r.wire_bytes) : 0.0;
  std::string nth = r.nth_element_s ? fixed(r.gbps(*r.nth_element_s), 2) + " (1 thr)" : "-";
  if (r.device == "cuda") nth = r.torch_topk_s ? fixed(r.gbps(*r.torch_topk_s), 2) : "-";
  char buf[512];
  std::snprintf(
      buf, sizeof buf, kRowFormat, r.label.c_str(), fixed(ratio, 1).c_str(),
      fixed(double(r.wire_bytes) / 1e6, 2).c_str(), fixed(r.gbps(r.compress_s), 2).c_str(),
      fixed(r.gbps(r.decompress_s), 2).c_str(), fixed(r.gbps(r.memcpy_s), 2).c_str(),
      fixed(r.memcpy_s > 0 && r.compress_s > 0 ? r.memcpy_s / r.compress_s : 0.0, 3).c_str(),
      nth.c_str());
  return buf;
}

}  // namespace lightwire::proxy
