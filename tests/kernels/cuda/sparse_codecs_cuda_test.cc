// The CUDA sparse codecs (kernels/cuda/codecs/{topk,threshold,dgc}.cu) against the CPU codecs:
// byte-identical payloads for every chunk, bit-identical committed states (error feedback's
// residual, dgc's u and v) and residual norms over several committed steps, bit-identical
// decode-accumulate into a non-zero base, flushes, and hostile payloads rejected with the output
// untouched. Inputs cover densities from 0.001 to 1, fp32 and fp16 values, min_magnitude, ties
// everywhere and many equal keys around the threshold, lengths 0, 1, 2, 4097 and 100003, several
// chunkings, fp16 / bf16 inputs, dgc's exact and sampled paths (acceptance, refinement and the
// exact fallback), and NaN / Inf (compared up to NaN payload bits, docs/determinism.md §1). Needs
// a GPU (main.cc skips otherwise).

#include <cuda_runtime_api.h>
#include <doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/payload.h"
#include "kernels/select.h"
#include "tests/kernels/cuda/codec_compare.h"

namespace lightwire::kernels::cuda::testing {
namespace test_sparse_codecs_cuda {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// --- configurations ------------------------------------------------------------------------------

CodecConfig topkConfig(double density, DType values = DType::kF32, double min_magnitude = 0.0) {
  CodecConfig c;
  c.name = "topk";
  c.density = density;
  c.sparse_values = values;
  c.min_magnitude = min_magnitude;
  return c;
}

CodecConfig thresholdConfig(double t, DType values = DType::kF32, double min_magnitude = 0.0) {
  CodecConfig c;
  c.name = "threshold";
  c.threshold = t;
  c.sparse_values = values;
  c.min_magnitude = min_magnitude;
  return c;
}

CodecConfig dgcConfig(double density, double momentum, double clip_norm, double fraction = 0.01,
                      DType values = DType::kF32, double min_magnitude = 0.0) {
  CodecConfig c;
  c.name = "dgc";
  c.density = density;
  c.momentum = momentum;
  c.clip_norm = clip_norm;
  c.sample_fraction = fraction;
  c.sparse_values = values;
  c.min_magnitude = min_magnitude;
  return c;
}

CodecConfig withoutErrorFeedback(CodecConfig c) {
  c.error_feedback = false;
  return c;
}

// --- inputs --------------------------------------------------------------------------------------

enum class Kind { kNormal, kHeavy, kTied, kConstant, kEqualAroundThreshold };

std::vector<float> inputOf(Kind kind, size_t n, uint64_t seed) {
  switch (kind) {
    case Kind::kHeavy:
      return heavyTailedInput(n, seed);
    case Kind::kTied:
      return tiedInput(n, seed);
    case Kind::kConstant:
      return constantInput(n, 1.0f);
    case Kind::kEqualAroundThreshold: {
      // A third of the elements are exactly ±0.75: at density 0.4 the k-th largest key is
      // key(0.75), and the ties with it are cut in the middle of the tensor.
      std::vector<float> x = normalInput(n, seed);
      for (size_t i = 0; i < n; i += 3) x[i] = (i / 3) % 2 == 0 ? 0.75f : -0.75f;
      return x;
    }
    case Kind::kNormal:
      break;
  }
  return normalInput(n, seed);
}

/// `steps` inputs of n elements (one per step).
std::vector<std::vector<float>> stepsOf(Kind kind, size_t n, size_t steps, uint64_t seed = 1) {
  std::vector<std::vector<float>> inputs;
  for (size_t s = 0; s < steps; ++s) inputs.push_back(inputOf(kind, n, seed + 101 * s));
  return inputs;
}

/// Adds a few NaN and ±Inf (one NaN bit pattern: see checkNonFiniteMatchesCpu).
std::vector<std::vector<float>> withNonFinite(std::vector<std::vector<float>> inputs) {
  for (auto& x : inputs) {
    const size_t n = x.size();
    if (n == 0) continue;
    x[n / 7] = kNaN;
    x[n / 3] = kInf;
    x[n / 2] = -kInf;
    x[n - 1] = -kNaN;
  }
  return inputs;
}

// --- payload fields ------------------------------------------------------------------------------

uint64_t nnzOf(const std::vector<uint8_t>& p) {
  return p.size() >= 24 ? loadU32(p.data() + 16) : 0;
}

uint64_t totalNnz(const std::vector<std::vector<uint8_t>>& payloads) {
  uint64_t t = 0;
  for (const auto& p : payloads) t += nnzOf(p);
  return t;
}

// --- comparison up to NaN payload bits -----------------------------------------------------------

bool sameOrBothNaN(float a, float b) {
  return floatBits(a) == floatBits(b) || (std::isnan(a) && std::isnan(b));
}

bool floatsMatch(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!sameOrBothNaN(a[i], b[i])) return false;
  }
  return true;
}

/// The same payload, except that a value may be another NaN where the CPU's is a NaN.
bool payloadsMatch(const std::vector<uint8_t>& gpu, const std::vector<uint8_t>& cpu) {
  if (gpu.size() != cpu.size()) return false;
  if (cpu.size() < 24 || cpu[3] == 0) return gpu == cpu;
  const uint64_t nnz = loadU32(cpu.data() + 16);
  const unsigned w = cpu[20];
  const size_t values = 24 + ((packedBytes(nnz, w) + 3) & ~size_t{3});
  if (values > cpu.size() || !std::equal(cpu.begin(), cpu.begin() + values, gpu.begin())) {
    return false;
  }
  const bool f16 = (cpu[5] & 1) != 0;
  for (uint64_t j = 0; j < nnz; ++j) {
    if (f16) {
      const uint16_t a = loadU16(gpu.data() + values + 2 * j);
      const uint16_t b = loadU16(cpu.data() + values + 2 * j);
      if (a != b && !((a & 0x7FFF) > 0x7C00 && (b & 0x7FFF) > 0x7C00)) return false;
    } else if (!sameOrBothNaN(loadF32(gpu.data() + values + 4 * j),
                              loadF32(cpu.data() + values + 4 * j))) {
      return false;
    }
  }
  return true;
}

/// checkCudaMatchesCpu for inputs with NaN / Inf: where arithmetic produces or propagates a NaN
/// (error feedback's x + e, dgc's accumulation and masking, the weighted decode) the two backends
/// may disagree on its payload bits (docs/determinism.md §1), so NaN matches any NaN; everything
/// else — sizes, gaps, finite values, ±Inf, states — must be bit-identical.
void checkNonFiniteMatchesCpu(const CodecConfig& config,
                              const std::vector<std::vector<float>>& inputs,
                              const CompareOptions& opt = {}) {
  auto cpu_r = createCodec(config);
  REQUIRE_MESSAGE(cpu_r.isOk(), cpu_r.status().message());
  auto gpu_r = createCudaCodec(config);
  REQUIRE_MESSAGE(gpu_r.isOk(), gpu_r.status().message());
  const Codec& cpu = **cpu_r;
  const CudaCodec& gpu = **gpu_r;
  const size_t n = inputs.at(0).size();
  const Chunking chunking = chunkingFor(cpu, n, opt.chunk_elements);
  CodecState cpu_state(cpu.stateFloats(n));
  auto gs = DeviceState::create(gpu.stateFloats(n));
  REQUIRE_MESSAGE(gs.isOk(), gs.status().message());
  DeviceState gpu_state = std::move(*gs);
  std::vector<std::byte> cpu_ws(cpu.workspaceBytes(chunking));
  DeviceMem gpu_ws(gpu.workspaceBytes(chunking));
  const size_t max_payload = cpu.maxPayloadBytes(chunking.chunk_elements);
  DeviceMem d_payload(max_payload);
  DeviceMem d_size(sizeof(uint64_t));
  DeviceMem d_input(n * dtypeSize(opt.dtype));
  for (size_t s = 0; s < inputs.size(); ++s) {
    CAPTURE(s);
    const std::vector<uint8_t> host_in = asDType(inputs[s], opt.dtype);
    d_input.upload(host_in.data(), host_in.size());
    StepContext ctx;
    ctx.seed = opt.seed;
    ctx.name_key = tensorNameKey(opt.tensor);
    ctx.step = opt.first_step + s;
    ctx.rank = opt.rank;
    ctx.density = opt.density;
    const ConstTensor cin{host_in.data(), n, opt.dtype};
    const DeviceTensor gin{d_input.as(), n, opt.dtype};
    LW_STATUS_OK(cpu.analyze(ctx, chunking, cin, cpu_state, cpu_ws));
    LW_STATUS_OK(gpu.analyze(ctx, chunking, gin, gpu_state, gpu_ws.span(), nullptr));
    std::vector<std::vector<uint8_t>> sent;  // the CPU payloads, for its commit
    for (size_t c = 0; c < chunking.count(); ++c) {
      CAPTURE(c);
      std::vector<uint8_t> cpu_payload(max_payload);
      auto size = cpu.encodeChunk(ctx, chunking, c, 0, {}, cin, cpu_state, cpu_ws, cpu_payload);
      REQUIRE_MESSAGE(size.isOk(), size.status().message());
      cpu_payload.resize(*size);
      LW_STATUS_OK(gpu.encodeChunk(ctx, chunking, c, 0, {}, gin, gpu_state, gpu_ws.span(),
                                   d_payload.as<uint8_t>(), d_size.as<uint64_t>(), nullptr));
      LW_CUDA_CHECK_OK(cudaStreamSynchronize(nullptr));
      const uint64_t gpu_size = d_size.download<uint64_t>(1)[0];
      REQUIRE(gpu_size <= max_payload);
      const std::vector<uint8_t> gpu_payload = d_payload.download<uint8_t>(gpu_size);
      CHECK_MESSAGE(payloadsMatch(gpu_payload, cpu_payload),
                    firstDifference(gpu_payload, cpu_payload));
      const size_t len = chunking.size(c);
      const std::vector<float> base = normalInput(len, 500 + s * 7 + c);
      std::vector<float> cpu_out = base;
      LW_STATUS_OK(cpu.decodeChunk(cpu_payload, opt.weight, cpu_out.data(), len));
      DeviceMem gpu_out(len * sizeof(float));
      gpu_out.upload(base.data(), len * sizeof(float));
      DeviceMem scratch(gpu.decodeScratchBytes(cpu_payload.size(), len));
      LW_STATUS_OK(gpu.decodeChunk(cpu_payload, opt.weight, gpu_out.as<float>(), len,
                                   scratch.span(), nullptr));
      LW_CUDA_CHECK_OK(cudaStreamSynchronize(nullptr));
      CHECK_MESSAGE(floatsMatch(gpu_out.download<float>(len), cpu_out), "decoded result differs");
      sent.push_back(std::move(cpu_payload));
    }
    const std::vector<std::span<const uint8_t>> sent_views(sent.begin(), sent.end());
    LW_STATUS_OK(cpu.commitState(ctx, chunking, cin, sent_views, {}, cpu_state, cpu_ws));
    LW_STATUS_OK(
        commitOnGpu(gpu, ctx, chunking, gin, sent_views, gpu_state, gpu_ws.span(), nullptr));
    auto gpu_committed = gpu_state.download(nullptr);
    REQUIRE_MESSAGE(gpu_committed.isOk(), gpu_committed.status().message());
    const auto cpu_committed = cpu_state.currentSpan();
    CHECK_MESSAGE(
        floatsMatch(*gpu_committed, std::vector<float>(cpu_committed.begin(), cpu_committed.end())),
        "committed state differs");
    DeviceMem norm_scratch(CudaCodec::residualScratchBytes(n));
    auto g_norm = gpu.residualNorm2(gpu_state, n, norm_scratch.span(), nullptr);
    REQUIRE_MESSAGE(g_norm.isOk(), g_norm.status().message());
    const double c_norm = cpu.residualNorm2(cpu_state, n);
    CHECK((*g_norm == c_norm || (std::isnan(*g_norm) && std::isnan(c_norm))));
  }
}

// --- hand-made payloads --------------------------------------------------------------------------

enum class Pad { kNone, kFullByte, kPartialByte };

/// A sparse payload of `codec` for a chunk of n elements with the given gaps (each written with w
/// bits, so w may exceed the minimal width), values 1.5, 2.5, ... (fp16: their negation); `pad`
/// sets a bit in the first all-padding byte or in the unused top of the last gap byte.
std::vector<uint8_t> craftSparse(CodecId codec, uint64_t n, const std::vector<uint32_t>& gaps,
                                 unsigned w, bool f16 = false, Pad pad = Pad::kNone) {
  const size_t nnz = gaps.size();
  const size_t packed = packedBytes(nnz, w);
  const size_t g = (packed + 3) & ~size_t{3};
  std::vector<uint8_t> p(24 + g + (f16 ? 2 : 4) * nnz, 0);
  writeHeader(p.data(), {codec, DType::kF32, static_cast<uint8_t>(f16 ? 1 : 0), 0, n});
  storeU32(p.data() + 16, static_cast<uint32_t>(nnz));
  p[20] = static_cast<uint8_t>(w);
  if (w > 0) {
    BitWriter writer(p.data() + 24);
    for (uint32_t gap : gaps) writer.put(gap, w);
    writer.flush();
  }
  if (pad == Pad::kFullByte) {
    REQUIRE(packed < g);
    p[24 + packed] |= 0x01;
  } else if (pad == Pad::kPartialByte) {
    REQUIRE((nnz * w) % 8 != 0);
    p[24 + packed - 1] |= 0x80;
  }
  uint8_t* vals = p.data() + 24 + g;
  for (size_t j = 0; j < nnz; ++j) {
    const float v = 1.5f + static_cast<float>(j);
    if (f16) {
      storeU16(vals + 2 * j, floatToHalf(-v));
    } else {
      storeF32(vals + 4 * j, v);
    }
  }
  return p;
}

/// Decodes `payload` on both sides into the same non-zero base with weight 0.37: both accept it
/// and the results are bit-identical.
void checkDecodeMatches(const CodecConfig& config, const std::vector<uint8_t>& payload, size_t n) {
  auto cpu_r = createCodec(config);
  REQUIRE(cpu_r.isOk());
  auto gpu_r = createCudaCodec(config);
  REQUIRE_MESSAGE(gpu_r.isOk(), gpu_r.status().message());
  const std::vector<float> base = normalInput(n, 99);
  std::vector<float> cpu_out = base;
  LW_STATUS_OK((*cpu_r)->decodeChunk(payload, 0.37f, cpu_out.data(), n));
  DeviceMem out(n * sizeof(float));
  out.upload(base.data(), n * sizeof(float));
  DeviceMem scratch((*gpu_r)->decodeScratchBytes(payload.size(), n));
  LW_STATUS_OK((*gpu_r)->decodeChunk(payload, 0.37f, out.as<float>(), n, scratch.span(), nullptr));
  LW_CUDA_CHECK_OK(cudaDeviceSynchronize());
  CHECK(sameBits(out.download<float>(n), cpu_out));
}

// --- topk ----------------------------------------------------------------------------------------

TEST_CASE("topk (cuda): densities, value encodings and chunkings match the CPU byte for byte") {
  const size_t n = 100003;
  const auto inputs = stepsOf(Kind::kNormal, n, 3);
  for (double density : {0.001, 0.01, 0.5, 1.0}) {
    for (DType values : {DType::kF32, DType::kF16}) {
      for (size_t chunk : {size_t{0}, size_t{16384}}) {
        CAPTURE(density);
        CAPTURE(static_cast<int>(values));
        CAPTURE(chunk);
        CompareOptions opt;
        opt.chunk_elements = chunk;
        const auto last = checkCudaMatchesCpu(topkConfig(density, values), inputs, opt);
        // All finite, no min_magnitude: exactly k elements, whatever the chunking.
        CHECK(totalNnz(last) == selectionSize(n, density));
      }
    }
  }
}

TEST_CASE("topk (cuda): ties everywhere and many equal keys around the threshold") {
  for (bool ef : {true, false}) {
    CAPTURE(ef);
    auto config = [&](double d, DType v) {
      return ef ? topkConfig(d, v) : withoutErrorFeedback(topkConfig(d, v));
    };
    for (DType values : {DType::kF32, DType::kF16}) {
      CAPTURE(static_cast<int>(values));
      for (double density : {0.01, 0.5}) {
        CAPTURE(density);
        const auto last =
            checkCudaMatchesCpu(config(density, values), stepsOf(Kind::kConstant, 4097, 3));
        CHECK(totalNnz(last) == selectionSize(4097, density));
      }
      CompareOptions chunked;
      chunked.chunk_elements = 7001;
      checkCudaMatchesCpu(config(0.2, values), stepsOf(Kind::kTied, 100003, 3), chunked);
      checkCudaMatchesCpu(config(0.4, values), stepsOf(Kind::kEqualAroundThreshold, 100003, 3),
                          chunked);
      checkCudaMatchesCpu(config(0.4, values), stepsOf(Kind::kEqualAroundThreshold, 4097, 2));
    }
  }
}

TEST_CASE("topk (cuda): min_magnitude") {
  const auto normal = stepsOf(Kind::kNormal, 100003, 3);
  for (DType values : {DType::kF32, DType::kF16}) {
    CAPTURE(static_cast<int>(values));
    // The k-th largest magnitude (~0.67) is below the floor: the floor decides.
    checkCudaMatchesCpu(topkConfig(0.5, values, 1.0), normal);
    // Far below the threshold: no effect.
    checkCudaMatchesCpu(topkConfig(0.001, values, 1e-30), normal);
    // Above every magnitude at density 1: nothing is sent.
    const auto none = checkCudaMatchesCpu(topkConfig(1.0, values, 1e6), normal);
    CHECK(totalNnz(none) == 0);
    // Exactly at the constant magnitude (kept), and just above it (all removed).
    const auto at = stepsOf(Kind::kConstant, 4097, 2);
    checkCudaMatchesCpu(withoutErrorFeedback(topkConfig(0.3, values, 1.0)), at);
    const auto above =
        checkCudaMatchesCpu(withoutErrorFeedback(topkConfig(0.3, values, 1.0000001)), at);
    CHECK(totalNnz(above) == 0);
  }
}

TEST_CASE("topk (cuda): lengths, chunkings and input dtypes") {
  for (size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{4097}, size_t{100003}}) {
    for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
      for (bool ef : {true, false}) {
        for (double density : {0.01, 0.3}) {
          CAPTURE(n);
          CAPTURE(static_cast<int>(dtype));
          CAPTURE(ef);
          CAPTURE(density);
          CompareOptions opt;
          opt.dtype = dtype;
          opt.chunk_elements = n > 50000 ? 16384 : (n > 1000 ? 1000 : 0);
          const CodecConfig c =
              ef ? topkConfig(density) : withoutErrorFeedback(topkConfig(density));
          checkCudaMatchesCpu(c, stepsOf(Kind::kHeavy, n, 3), opt);
        }
      }
    }
  }
}

TEST_CASE("topk (cuda): fp16 value saturation, a step density override, flush") {
  auto inputs = stepsOf(Kind::kHeavy, 100003, 3);
  for (auto& x : inputs) {
    for (auto& v : x) v *= 3000.0f;  // many magnitudes beyond fp16's 65504
  }
  checkCudaMatchesCpu(topkConfig(0.01, DType::kF16), inputs);
  CompareOptions opt;
  opt.density = 0.05;
  const auto last = checkCudaMatchesCpu(topkConfig(0.01), inputs, opt);
  CHECK(totalNnz(last) == selectionSize(100003, 0.05));
  opt.flush_last = true;
  opt.chunk_elements = 30000;
  checkCudaMatchesCpu(topkConfig(0.01, DType::kF16), inputs, opt);
}

TEST_CASE("topk (cuda): NaN and Inf") {
  const auto inputs = withNonFinite(stepsOf(Kind::kNormal, 4097, 3));
  for (DType values : {DType::kF32, DType::kF16}) {
    CAPTURE(static_cast<int>(values));
    // Without error feedback no arithmetic touches the selected values: exact bytes.
    CompareOptions chunked;
    chunked.chunk_elements = 1000;
    checkNonFiniteMatchesCpu(withoutErrorFeedback(topkConfig(0.01, values)), inputs, chunked);
    checkNonFiniteMatchesCpu(topkConfig(0.01, values), inputs);
    checkNonFiniteMatchesCpu(topkConfig(0.5, values, 0.5), inputs, chunked);
  }
}

// --- threshold -----------------------------------------------------------------------------------

TEST_CASE("threshold (cuda): thresholds, value encodings, min_magnitude and chunkings") {
  const auto normal = stepsOf(Kind::kNormal, 100003, 3);
  const auto tied = stepsOf(Kind::kTied, 100003, 3);
  for (DType values : {DType::kF32, DType::kF16}) {
    for (size_t chunk : {size_t{0}, size_t{16384}}) {
      CAPTURE(static_cast<int>(values));
      CAPTURE(chunk);
      CompareOptions opt;
      opt.chunk_elements = chunk;
      for (double t : {0.01, 0.5, 2.5, 10.0}) {
        CAPTURE(t);
        checkCudaMatchesCpu(thresholdConfig(t, values), normal, opt);
      }
      // Keys exactly equal to key(τ): all taken.
      checkCudaMatchesCpu(thresholdConfig(2.0, values), tied, opt);
      checkCudaMatchesCpu(withoutErrorFeedback(thresholdConfig(2.0, values)), tied, opt);
      // min_magnitude above τ raises the key threshold.
      checkCudaMatchesCpu(thresholdConfig(0.5, values, 1.5), normal, opt);
      checkCudaMatchesCpu(thresholdConfig(0.5, values, 1e-3), normal, opt);
    }
  }
}

TEST_CASE("threshold (cuda): lengths, input dtypes, heavy tails, flush") {
  for (size_t n : {size_t{0}, size_t{1}, size_t{4097}, size_t{100003}}) {
    for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
      for (bool ef : {true, false}) {
        CAPTURE(n);
        CAPTURE(static_cast<int>(dtype));
        CAPTURE(ef);
        CompareOptions opt;
        opt.dtype = dtype;
        opt.chunk_elements = n > 50000 ? 16383 : (n > 1000 ? 999 : 0);
        const CodecConfig c = ef ? thresholdConfig(1.0, DType::kF16)
                                 : withoutErrorFeedback(thresholdConfig(1.0, DType::kF16));
        checkCudaMatchesCpu(c, stepsOf(Kind::kHeavy, n, 3), opt);
      }
    }
  }
  CompareOptions flush;
  flush.flush_last = true;
  checkCudaMatchesCpu(thresholdConfig(1.0), stepsOf(Kind::kNormal, 4097, 3), flush);
}

TEST_CASE("threshold (cuda): NaN and Inf") {
  const auto inputs = withNonFinite(stepsOf(Kind::kNormal, 4097, 3));
  for (DType values : {DType::kF32, DType::kF16}) {
    CompareOptions chunked;
    chunked.chunk_elements = 1000;
    checkNonFiniteMatchesCpu(withoutErrorFeedback(thresholdConfig(1.0, values)), inputs, chunked);
    checkNonFiniteMatchesCpu(thresholdConfig(1.0, values), inputs);
  }
}

// --- dgc -----------------------------------------------------------------------------------------

TEST_CASE("dgc (cuda): sampled threshold: momentum, clipping, sample fraction, value encodings") {
  const size_t n = 100003;  // > 32768: the sampled threshold
  const auto inputs = stepsOf(Kind::kNormal, n, 4);
  for (double momentum : {0.0, 0.9}) {
    for (double clip : {0.0, 50.0}) {
      for (double fraction : {0.001, 0.01}) {
        for (DType values : {DType::kF32, DType::kF16}) {
          CAPTURE(momentum);
          CAPTURE(clip);
          CAPTURE(fraction);
          CAPTURE(static_cast<int>(values));
          const auto last =
              checkCudaMatchesCpu(dgcConfig(0.01, momentum, clip, fraction, values), inputs);
          const uint64_t k = selectionSize(n, 0.01);
          const uint64_t got = totalNnz(last);
          CHECK(got >= (8 * k + 9) / 10);
          CHECK(got <= 13 * k / 10);
        }
      }
    }
  }
}

TEST_CASE("dgc (cuda): densities, chunkings, rank, seed, flush") {
  const size_t n = 100003;
  const auto inputs = stepsOf(Kind::kHeavy, n, 4);
  for (double density : {0.001, 0.01, 0.3, 1.0}) {
    CAPTURE(density);
    CompareOptions opt;
    opt.chunk_elements = 16384;
    opt.rank = 3;
    opt.seed = 12345;
    opt.first_step = 0xFFFFFFFEull;  // the counter keeps the low 32 bits
    checkCudaMatchesCpu(dgcConfig(density, 0.9, 0.0), inputs, opt);
  }
  CompareOptions flush;
  flush.flush_last = true;
  flush.chunk_elements = 30000;
  checkCudaMatchesCpu(dgcConfig(0.01, 0.9, 50.0), inputs, flush);
  checkCudaMatchesCpu(dgcConfig(0.01, 0.0, 1e9), inputs, flush);  // clip_norm never reached
  CompareOptions override_density;
  override_density.density = 0.02;
  checkCudaMatchesCpu(dgcConfig(0.01, 0.5, 0.0), inputs, override_density);
}

TEST_CASE("dgc (cuda): bias correction: sampled and exact paths, chunkings, flush, fp16 input") {
  auto biased = [](CodecConfig c) {
    c.bias_correction = true;
    return c;
  };
  const auto inputs = stepsOf(Kind::kNormal, 100003, 5);
  for (DType values : {DType::kF32, DType::kF16}) {
    CAPTURE(static_cast<int>(values));
    checkCudaMatchesCpu(biased(dgcConfig(0.01, 0.9, 0.0, 0.01, values)), inputs);
    CompareOptions chunked;
    chunked.chunk_elements = 16384;
    checkCudaMatchesCpu(biased(dgcConfig(0.05, 0.5, 50.0, 0.001, values)), inputs, chunked);
  }
  CompareOptions flush;
  flush.flush_last = true;
  checkCudaMatchesCpu(biased(dgcConfig(0.01, 0.9, 50.0)), inputs, flush);
  CompareOptions exact;
  exact.dtype = DType::kF16;
  exact.chunk_elements = 1000;
  checkCudaMatchesCpu(biased(dgcConfig(0.05, 0.9, 20.0)), stepsOf(Kind::kHeavy, 4097, 4), exact);
}

TEST_CASE("dgc (cuda): refinement and exact fallback on tied and constant inputs") {
  for (double momentum : {0.0, 0.9}) {
    for (DType values : {DType::kF32, DType::kF16}) {
      CAPTURE(momentum);
      CAPTURE(static_cast<int>(values));
      // Constant input: every sampled key is equal, no rank is accepted, exact top-k with its
      // ties cut decides.
      const auto constant = checkCudaMatchesCpu(dgcConfig(0.01, momentum, 0.0, 0.01, values),
                                                stepsOf(Kind::kConstant, 100003, 4));
      const uint64_t k = selectionSize(100003, 0.01);
      CHECK(totalNnz(constant) >= (8 * k + 9) / 10);
      CHECK(totalNnz(constant) <= 13 * k / 10);
      CompareOptions chunked;
      chunked.chunk_elements = 7001;
      checkCudaMatchesCpu(dgcConfig(0.05, momentum, 0.0, 0.001, values),
                          stepsOf(Kind::kTied, 100003, 4), chunked);
      checkCudaMatchesCpu(dgcConfig(0.4, momentum, 100.0, 0.01, values),
                          stepsOf(Kind::kEqualAroundThreshold, 100003, 4), chunked);
    }
  }
}

TEST_CASE("dgc (cuda): exact path, lengths, input dtypes, min_magnitude") {
  for (size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{4097}, size_t{32768}, size_t{32769}}) {
    for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
      for (double clip : {0.0, 20.0}) {
        CAPTURE(n);
        CAPTURE(static_cast<int>(dtype));
        CAPTURE(clip);
        CompareOptions opt;
        opt.dtype = dtype;
        opt.chunk_elements = n > 1000 ? 1000 : 0;
        checkCudaMatchesCpu(dgcConfig(0.01, 0.9, clip), stepsOf(Kind::kNormal, n, 3), opt);
        opt.flush_last = true;
        checkCudaMatchesCpu(dgcConfig(0.3, 0.0, clip, 0.01, DType::kF16),
                            stepsOf(Kind::kHeavy, n, 3), opt);
      }
    }
  }
  for (DType values : {DType::kF32, DType::kF16}) {
    CAPTURE(static_cast<int>(values));
    // The floor removes part of the sampled selection (it stays in v', u' unmasked).
    checkCudaMatchesCpu(dgcConfig(0.3, 0.9, 0.0, 0.01, values, 1.0),
                        stepsOf(Kind::kNormal, 100003, 3));
    checkCudaMatchesCpu(dgcConfig(0.3, 0.0, 0.0, 0.01, values, 1.0),
                        stepsOf(Kind::kNormal, 4097, 3));
  }
}

TEST_CASE("dgc (cuda): NaN and Inf") {
  for (size_t n : {size_t{4097}, size_t{100003}}) {
    for (double momentum : {0.0, 0.9}) {
      CAPTURE(n);
      CAPTURE(momentum);
      const auto inputs = withNonFinite(stepsOf(Kind::kNormal, n, 3));
      checkNonFiniteMatchesCpu(dgcConfig(0.01, momentum, 0.0), inputs);
      // The norm is NaN (NaN and Inf in x): no clipping, on both sides.
      checkNonFiniteMatchesCpu(dgcConfig(0.01, momentum, 10.0, 0.01, DType::kF16), inputs);
    }
  }
}

// --- decoding ------------------------------------------------------------------------------------

TEST_CASE("sparse codecs (cuda): hand-made payloads decode as on the CPU") {
  const size_t n = 300;
  for (const CodecConfig& config : {topkConfig(0.1), thresholdConfig(1.0), dgcConfig(0.1, 0, 0)}) {
    const CodecId id = createCodec(config).value()->traits().id;
    CAPTURE(config.name);
    // Wider than needed (w = 32), odd widths crossing bytes, empty, fp16 values, dense gaps.
    checkDecodeMatches(config, craftSparse(id, n, {0, 5, 2, 200}, 32), n);
    std::vector<uint32_t> gaps;
    for (uint32_t j = 0; j < 40; ++j) gaps.push_back(j % 5);
    checkDecodeMatches(config, craftSparse(id, n, gaps, 7), n);
    checkDecodeMatches(config, craftSparse(id, n, gaps, 3, /*f16=*/true), n);
    checkDecodeMatches(config, craftSparse(id, n, {}, 0), n);
    checkDecodeMatches(config, craftSparse(id, n, std::vector<uint32_t>(n, 0), 0), n);
    checkDecodeMatches(config, craftSparse(id, n, {299}, 9), n);
    // The universal dense escape.
    const std::vector<float> dense = normalInput(n, 5);
    std::vector<uint8_t> escape(16 + 4 * n);
    writeDensePayload(ConstTensor{dense.data(), n, DType::kF32}, escape.data(), nullptr);
    checkDecodeMatches(config, escape, n);
  }
}

TEST_CASE("sparse codecs (cuda): hostile payloads are rejected, the output untouched") {
  const size_t n = 64;
  for (const CodecConfig& config : {topkConfig(0.1), thresholdConfig(1.0), dgcConfig(0.1, 0, 0)}) {
    const CodecId id = createCodec(config).value()->traits().id;
    CAPTURE(config.name);
    const std::vector<uint8_t> good = craftSparse(id, n, {1, 2, 3, 4, 5}, 3);
    checkDecodeMatches(config, good, n);

    auto bad = good;
    storeU32(bad.data() + 16, n + 1);  // nnz > n
    checkRejectedLikeCpu(config, bad, n);
    bad = craftSparse(id, n, std::vector<uint32_t>(n + 1, 0), 0);  // nnz > n, consistent size
    checkRejectedLikeCpu(config, bad, n);
    bad = good;
    bad[20] = 33;  // w > 32
    checkRejectedLikeCpu(config, bad, n);
    checkRejectedLikeCpu(config, craftSparse(id, n, {10, 60}, 6), n);  // index 71 >= n
    checkRejectedLikeCpu(config, craftSparse(id, n, {64}, 7), n);      // index 64 == n
    // Non-zero padding: 9 used bits, a partial byte and two whole padding bytes.
    checkRejectedLikeCpu(config, craftSparse(id, n, {1, 2, 3}, 3, false, Pad::kFullByte), n);
    checkRejectedLikeCpu(config, craftSparse(id, n, {1, 2, 3}, 3, false, Pad::kPartialByte), n);
    bad = good;
    bad.push_back(0);  // too long
    checkRejectedLikeCpu(config, bad, n);
    bad = good;
    bad.pop_back();  // too short
    checkRejectedLikeCpu(config, bad, n);
    checkRejectedLikeCpu(config, std::vector<uint8_t>(good.begin(), good.begin() + 20), n);
    bad = good;
    bad[21] = 1;  // reserved byte
    checkRejectedLikeCpu(config, bad, n);
    bad = good;
    bad[5] = 0x02;  // unknown flag
    checkRejectedLikeCpu(config, bad, n);
    bad = good;
    bad[3] = static_cast<uint8_t>(CodecId::kQsgd);  // another codec
    checkRejectedLikeCpu(config, bad, n);
    checkRejectedLikeCpu(config, good, n + 1);  // element count mismatch
    std::vector<uint8_t> escape(16 + 4 * n, 0);
    writeHeader(escape.data(), {CodecId::kNone, DType::kF32, 0, 0, n});
    escape.pop_back();  // a truncated dense escape
    checkRejectedLikeCpu(config, escape, n);
  }
}

TEST_CASE("DeviceState: one copy; a step prepares the next in the work area, commit copies it") {
  CodecConfig config;
  config.name = "dgc";
  config.density = 0.05;  // error feedback alone: the work area is the whole next state
  auto gpu_r = createCudaCodec(config);
  REQUIRE_MESSAGE(gpu_r.isOk(), gpu_r.status().message());
  const CudaCodec& gpu = **gpu_r;
  const size_t n = 10000;
  const Chunking chunking = chunkingFor(gpu.host(), n, 4096);
  auto made = DeviceState::create(gpu.stateFloats(n));
  REQUIRE(made.isOk());
  DeviceState state = std::move(*made);
  CHECK(state.bytes() == gpu.stateFloats(n) * sizeof(float));
  DeviceMem ws(gpu.workspaceBytes(chunking));
  DeviceMem d_payload(gpu.maxPayloadBytes(chunking.chunk_elements));
  DeviceMem d_size(sizeof(uint64_t));
  const std::vector<float> x = normalInput(n, 77);
  DeviceMem d_input(n * sizeof(float));
  d_input.upload(x.data(), n * sizeof(float));
  const DeviceTensor gin{d_input.as(), n, DType::kF32};
  StepContext ctx;
  ctx.seed = 1;
  ctx.step = 1;
  // Nothing prepared yet: no commit, no encode.
  CHECK(gpu.commitState(ctx, chunking, gin, {}, state, ws.span(), {}, nullptr).code() ==
        StatusCode::kFailedPrecondition);
  CHECK_FALSE(gpu.encodeChunk(ctx, chunking, 0, 0, {}, gin, state, ws.span(),
                              d_payload.as<uint8_t>(), d_size.as<uint64_t>(), nullptr)
                  .isOk());
  // A lent work area is used as is; a step that is not committed leaves the state at zero.
  DeviceMem lent(gpu.stateFloats(n) * sizeof(float));
  state.attachWork(lent.as<float>());
  CHECK(state.work() == lent.as<float>());
  auto step = [&] {
    LW_STATUS_OK(gpu.analyze(ctx, chunking, gin, state, ws.span(), nullptr));
    for (size_t c = 0; c < chunking.count(); ++c) {
      LW_STATUS_OK(gpu.encodeChunk(ctx, chunking, c, 0, {}, gin, state, ws.span(),
                                   d_payload.as<uint8_t>(), d_size.as<uint64_t>(), nullptr));
    }
  };
  step();
  auto after = state.download(nullptr);
  REQUIRE(after.isOk());
  CHECK(std::all_of(after->begin(), after->end(), [](float f) { return f == 0.0f; }));
  // Committed: the state is what the work area held.
  const std::vector<float> prepared = [&] {
    std::vector<float> h(gpu.stateFloats(n));
    LW_CUDA_CHECK_OK(
        cudaMemcpy(h.data(), lent.as<float>(), h.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return h;
  }();
  LW_STATUS_OK(gpu.commitState(ctx, chunking, gin, {}, state, ws.span(), {}, nullptr));
  auto committed = state.download(nullptr);
  REQUIRE(committed.isOk());
  CHECK(std::memcmp(committed->data(), prepared.data(), prepared.size() * sizeof(float)) == 0);
  CHECK(std::any_of(committed->begin(), committed->end(), [](float f) { return f != 0.0f; }));
  // Detached: the state allocates a work area of its own at the next analyze.
  state.detachWork();
  CHECK(state.work() == nullptr);
  ctx.step = 2;
  step();
  CHECK(state.work() != nullptr);
  CHECK(state.work() != lent.as<float>());
}

TEST_CASE(
    "dgc with momentum on the GPU: a work area of n floats, the commit recomputes u and v in place "
    "from the input and what was sent, bit-identical to the CPU's") {
  CodecConfig config;
  config.name = "dgc";
  config.density = 0.02;
  config.momentum = 0.9;
  config.clip_norm = 40.0;
  auto gpu_r = createCudaCodec(config);
  REQUIRE_MESSAGE(gpu_r.isOk(), gpu_r.status().message());
  auto cpu_r = createCodec(config);
  REQUIRE_MESSAGE(cpu_r.isOk(), cpu_r.status().message());
  const CudaCodec& gpu = **gpu_r;
  const Codec& cpu = **cpu_r;
  const size_t n = 70001;  // the sampled threshold, chunks of 16384 and a short last one
  const Chunking chunking = chunkingFor(cpu, n, 16384);
  REQUIRE(gpu.stateFloats(n) == 2 * n);
  CHECK(gpu.workFloats(n) == n);
  CHECK(gpu.commitReadsInput());
  auto made = DeviceState::create(gpu.stateFloats(n), gpu.workFloats(n));
  REQUIRE(made.isOk());
  DeviceState state = std::move(*made);
  // A state whose work area is smaller than the codec works in is refused.
  {
    auto small = DeviceState::create(gpu.stateFloats(n), n - 1);
    REQUIRE(small.isOk());
    DeviceMem ws(gpu.workspaceBytes(chunking));
    DeviceMem d_in(n * sizeof(float));
    StepContext ctx;
    CHECK(gpu.analyze(ctx, chunking, {d_in.as(), n, DType::kF32}, *small, ws.span(), nullptr)
              .code() == StatusCode::kInvalidArgument);
  }
  CodecState cpu_state(cpu.stateFloats(n));
  std::vector<std::byte> cpu_ws(cpu.workspaceBytes(chunking));
  DeviceMem ws(gpu.workspaceBytes(chunking));
  DeviceMem d_payload(gpu.maxPayloadBytes(chunking.chunk_elements));
  DeviceMem d_size(sizeof(uint64_t));
  DeviceMem d_input(n * sizeof(float));
  for (uint64_t step = 1; step <= 6; ++step) {
    CAPTURE(step);
    const std::vector<float> x = normalInput(n, static_cast<uint32_t>(300 + step));
    d_input.upload(x.data(), n * sizeof(float));
    const DeviceTensor gin{d_input.as(), n, DType::kF32};
    const ConstTensor cin{x.data(), n, DType::kF32};
    StepContext ctx;
    ctx.seed = 5;
    ctx.step = step;
    const auto before = state.download(nullptr);
    REQUIRE(before.isOk());
    LW_STATUS_OK(cpu.analyze(ctx, chunking, cin, cpu_state, cpu_ws));
    LW_STATUS_OK(gpu.analyze(ctx, chunking, gin, state, ws.span(), nullptr));
    std::vector<std::vector<uint8_t>> sent;
    for (size_t c = 0; c < chunking.count(); ++c) {
      LW_STATUS_OK(gpu.encodeChunk(ctx, chunking, c, 0, {}, gin, state, ws.span(),
                                   d_payload.as<uint8_t>(), d_size.as<uint64_t>(), nullptr));
      LW_CUDA_CHECK_OK(cudaStreamSynchronize(nullptr));
      sent.push_back(d_payload.download<uint8_t>(d_size.download<uint64_t>(1)[0]));
      std::vector<uint8_t> cpu_payload(cpu.maxPayloadBytes(chunking.size(c)));
      auto size = cpu.encodeChunk(ctx, chunking, c, 0, {}, cin, cpu_state, cpu_ws, cpu_payload);
      REQUIRE(size.isOk());
      cpu_payload.resize(*size);
      CHECK(sent.back() == cpu_payload);
    }
    // Analysis and encoding wrote neither the state nor the input.
    const auto during = state.download(nullptr);
    REQUIRE(during.isOk());
    CHECK(sameBits(*during, *before));
    CHECK(sameBits(d_input.download<float>(n), x));
    if (step == 3) continue;  // a step that failed elsewhere: nothing committed on either side
    const std::vector<std::span<const uint8_t>> views(sent.begin(), sent.end());
    LW_STATUS_OK(cpu.commitState(ctx, chunking, cin, views, {}, cpu_state, cpu_ws));
    LW_STATUS_OK(commitOnGpu(gpu, ctx, chunking, gin, views, state, ws.span(), nullptr));
    const auto committed = state.download(nullptr);
    REQUIRE(committed.isOk());
    const auto want = cpu_state.currentSpan();
    CHECK_MESSAGE(sameBits(*committed, std::vector<float>(want.begin(), want.end())),
                  "committed state differs from the CPU's");
  }
  // After a flush the state is zero.
  LW_STATUS_OK(gpu.commitFlush(state, nullptr));
  LW_CUDA_CHECK_OK(cudaStreamSynchronize(nullptr));
  const auto flushed = state.download(nullptr);
  REQUIRE(flushed.isOk());
  CHECK(std::all_of(flushed->begin(), flushed->end(), [](float f) { return f == 0.0f; }));
}

}  // namespace test_sparse_codecs_cuda
}  // namespace lightwire::kernels::cuda::testing
