// GPU tests of the CUDA `none`, `fp16`, `bf16`, `qsgd`, `terngrad`, `signsgd` and `onebit` codecs
// (kernels/cuda/codecs/dense.cu, qsgd.cu, bucket.cu) against their CPU codecs: byte-identical
// payloads, bit-identical decode-accumulate (weight 0.37 into a non-zero base) and error-feedback
// states over several committed steps (tests/kernels/cuda/codec_compare.h), for fp32 / fp16 / bf16
// inputs, lengths 0, 1, odd and above 4096, one and several chunks (chunk starts that are not
// multiples of 8 or 4, so Philox groups straddle octets and tiles), buckets of 1, 7, 512 and 5000
// (more than one canonical block), qsgd bits 2..8, ranks / seeds / steps (step >= 2^32 too);
// the `none` escape of chunks with NaN / ±Inf / fp32-overflowing norms; unaligned input, payload
// and output pointers; payloads of other parameters; hostile payloads refused with the output
// untouched. Needs a GPU (main.cc skips otherwise).

#include <doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "kernels/cuda/codec.h"
#include "kernels/dtype.h"
#include "kernels/payload.h"
#include "kernels/philox.h"
#include "tests/kernels/cuda/codec_compare.h"

namespace lightwire::kernels::cuda {
namespace test_dense_codecs_cuda {

using testing::checkCudaMatchesCpu;
using testing::checkRejectedLikeCpu;
using testing::CompareOptions;
using testing::DeviceMem;

constexpr DType kDTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

CodecConfig configOf(const std::string& name, int bits = 8, uint32_t bucket = 512,
                     std::optional<bool> error_feedback = std::nullopt) {
  CodecConfig c;
  c.name = name;
  c.bits = bits;
  c.bucket_size = bucket;
  c.error_feedback = error_feedback;
  return c;
}

// --- inputs --------------------------------------------------------------------------------------

enum class Family { kNormal, kHeavy, kTied, kSpecial, kConstant };
constexpr Family kFamilies[] = {Family::kNormal, Family::kHeavy, Family::kTied, Family::kSpecial,
                                Family::kConstant};

/// Edge values mixed with normal ones: ±0, subnormals, the smallest normal, fp16 / bf16 rounding
/// ties and boundaries, repeated magnitudes. Finite in fp16 and bf16 and after a round trip
/// through either (60000, not 65504, which bf16 rounds to 65536: Inf in fp16), so error-feedback
/// states stay finite (their NaN bits would be the hardware's, §1).
std::vector<float> specialInput(size_t n, uint64_t seed) {
  static const float kValues[] = {0.0f,
                                  -0.0f,
                                  1e-45f,
                                  -1e-45f,
                                  1e-40f,
                                  -3e-42f,
                                  1.17549435e-38f,
                                  6e-8f,
                                  -6e-8f,
                                  2.98e-8f,
                                  60000.0f,
                                  -60000.0f,
                                  1.0f + 0x1p-11f,
                                  -(1.0f + 0x1p-11f),
                                  1.0f + 0x1p-8f,
                                  -1.0f - 0x1p-8f - 0x1p-10f,
                                  3.0f,
                                  -3.0f,
                                  0.5f,
                                  2.5f,
                                  1e4f,
                                  -1e-30f};
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<size_t> pick(0, std::size(kValues) - 1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = i % 3 == 0 ? normal(gen) : kValues[pick(gen)];
  return x;
}

std::vector<float> familyInput(Family f, size_t n, uint64_t seed) {
  switch (f) {
    case Family::kNormal:
      return testing::normalInput(n, seed);
    case Family::kHeavy:
      return testing::heavyTailedInput(n, seed);
    case Family::kTied:
      return testing::tiedInput(n, seed);
    case Family::kSpecial:
      return specialInput(n, seed);
    case Family::kConstant:
      break;
  }
  return testing::constantInput(n, seed % 2 == 0 ? 0.75f : -1.5f);
}

const char* familyName(Family f) {
  switch (f) {
    case Family::kNormal:
      return "normal";
    case Family::kHeavy:
      return "heavy-tailed";
    case Family::kTied:
      return "tied";
    case Family::kSpecial:
      return "special";
    case Family::kConstant:
      break;
  }
  return "constant";
}

/// `steps` inputs of family f and length n (one per step).
std::vector<std::vector<float>> stepsOf(Family f, size_t n, size_t steps, uint64_t seed) {
  std::vector<std::vector<float>> inputs;
  for (size_t s = 0; s < steps; ++s) inputs.push_back(familyInput(f, n, seed * 131 + s));
  return inputs;
}

/// Runs every family over `steps` steps of n elements with the given chunk request and dtype, with
/// the step identity (seed, tensor, rank, first step) varied from call to call.
void checkFamilies(const CodecConfig& config, size_t n, size_t chunk, DType dtype, size_t steps,
                   uint64_t salt) {
  uint64_t k = salt;
  for (Family f : kFamilies) {
    CAPTURE(familyName(f));
    ++k;
    CompareOptions opt;
    opt.chunk_elements = chunk;
    opt.dtype = dtype;
    opt.seed = static_cast<uint32_t>(k * 2654435761u);
    opt.tensor = "layer" + std::to_string(k % 5) + ".weight";
    opt.rank = static_cast<uint32_t>(k % 4);
    opt.first_step = k % 3 == 0 ? (uint64_t{1} << 32) + k : k;  // only the low 32 bits count
    checkCudaMatchesCpu(config, stepsOf(f, n, steps, k), opt);
  }
}

/// A chunk request giving several chunks of 12007 elements for bucket size d: 1001 and 2107
/// (d = 1, 7) start chunks at odd indices and at indices that are not multiples of 4 or 8, so
/// Philox groups straddle octets; 1536 = 3 buckets of 512; one bucket of 5000.
size_t chunkFor(uint32_t d) {
  switch (d) {
    case 1:
      return 1001;
    case 7:
      return 7 * 301;
    case 512:
      return 3 * 512;
    default:
      return d;
  }
}

// --- direct GPU runs (for NaN-aware comparisons and unaligned buffers) ---------------------------

bool sameOrBothNan(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    if (floatBits(a[i]) != floatBits(b[i])) return false;
  }
  return true;
}

/// One step of a codec without state on the CPU and the GPU, the GPU's input at `in_offset`
/// elements into its buffer and each payload at `payload_offset` bytes into its buffer; CHECKs the
/// payloads are identical, then decodes each chunk's payload (CPU decodeChunk vs GPU decodeChunk of
/// the same bytes into an output at `out_offset` floats, and GPU accumulate() straight from the
/// GPU's own, possibly unaligned, device payload) into the same base. Decoded values compare
/// bit for bit, except that a NaN matches any NaN (§1: NaN payloads after arithmetic are the
/// hardware's).
void checkStepDirect(const CodecConfig& config, const std::vector<float>& x, DType dtype,
                     size_t chunk_request, size_t in_offset, size_t payload_offset,
                     size_t out_offset) {
  auto cpu_r = createCodec(config);
  REQUIRE_MESSAGE(cpu_r.isOk(), cpu_r.status().message());
  auto gpu_r = createCudaCodec(config);
  REQUIRE_MESSAGE(gpu_r.isOk(), gpu_r.status().message());
  const Codec& cpu = **cpu_r;
  const CudaCodec& gpu = **gpu_r;
  REQUIRE(cpu.stateFloats(x.size()) == 0);
  const size_t n = x.size();
  const Chunking chunking = chunkingFor(cpu, n, chunk_request);

  StepContext ctx;
  ctx.seed = 99;
  ctx.name_key = tensorNameKey("direct");
  ctx.step = 12;
  ctx.rank = 3;
  const std::vector<uint8_t> host_in = testing::asDType(x, dtype);
  const size_t width = dtypeSize(dtype);
  CodecState cpu_state;
  auto cpu_payloads =
      encodeTensor(cpu, ctx, chunking, ConstTensor{host_in.data(), n, dtype}, cpu_state);
  REQUIRE_MESSAGE(cpu_payloads.isOk(), cpu_payloads.status().message());

  DeviceMem d_in((n + in_offset) * width);
  if (n > 0) {
    LW_CUDA_CHECK_OK(cudaMemcpy(d_in.as<uint8_t>() + in_offset * width, host_in.data(),
                                host_in.size(), cudaMemcpyHostToDevice));
  }
  const DeviceTensor gin{d_in.as<uint8_t>() + in_offset * width, n, dtype};
  DeviceState no_state;
  DeviceMem ws(gpu.workspaceBytes(chunking));
  const size_t max_payload = cpu.maxPayloadBytes(chunking.chunk_elements);
  DeviceMem d_payload(max_payload + payload_offset);
  uint8_t* payload_at = d_payload.as<uint8_t>() + payload_offset;
  DeviceMem d_size(sizeof(uint64_t));
  LW_STATUS_OK(gpu.analyze(ctx, chunking, gin, no_state, ws.span(), nullptr));
  for (size_t c = 0; c < chunking.count(); ++c) {
    CAPTURE(c);
    LW_STATUS_OK(gpu.encodeChunk(ctx, chunking, c, 0, {}, gin, no_state, ws.span(), payload_at,
                                 d_size.as<uint64_t>(), nullptr));
    LW_CUDA_CHECK_OK(cudaDeviceSynchronize());
    const uint64_t size = d_size.download<uint64_t>(1)[0];
    REQUIRE(size <= max_payload);
    std::vector<uint8_t> gpu_payload(size);
    LW_CUDA_CHECK_OK(cudaMemcpy(gpu_payload.data(), payload_at, size, cudaMemcpyDeviceToHost));
    const std::vector<uint8_t>& cpu_payload = (*cpu_payloads)[c];
    CHECK_MESSAGE(gpu_payload == cpu_payload, testing::firstDifference(gpu_payload, cpu_payload));

    const size_t len = chunking.size(c);
    const std::vector<float> base = testing::normalInput(len, 77 + c);
    std::vector<float> cpu_out = base;
    LW_STATUS_OK(cpu.decodeChunk(cpu_payload, 0.37f, cpu_out.data(), len));
    DeviceMem out((len + out_offset) * sizeof(float));
    float* out_at = out.as<float>() + out_offset;
    // decodeChunk (host bytes, validated, staged).
    LW_CUDA_CHECK_OK(cudaMemcpy(out_at, base.data(), len * sizeof(float), cudaMemcpyHostToDevice));
    DeviceMem scratch(gpu.decodeScratchBytes(cpu_payload.size(), len));
    LW_STATUS_OK(gpu.decodeChunk(cpu_payload, 0.37f, out_at, len, scratch.span(), nullptr));
    LW_CUDA_CHECK_OK(cudaDeviceSynchronize());
    std::vector<float> got(len);
    LW_CUDA_CHECK_OK(cudaMemcpy(got.data(), out_at, len * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK_MESSAGE(sameOrBothNan(got, cpu_out), "decodeChunk differs");
    // accumulate() of the device payload the GPU wrote.
    LW_CUDA_CHECK_OK(cudaMemcpy(out_at, base.data(), len * sizeof(float), cudaMemcpyHostToDevice));
    DeviceMem acc_scratch(gpu.accumulateScratchBytes(len));
    LW_STATUS_OK(gpu.accumulate(payload_at, 0.37f, out_at, len, acc_scratch.span(), nullptr));
    LW_CUDA_CHECK_OK(cudaDeviceSynchronize());
    LW_CUDA_CHECK_OK(cudaMemcpy(got.data(), out_at, len * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK_MESSAGE(sameOrBothNan(got, cpu_out), "accumulate differs");
  }
}

/// The CPU payloads of one step (no state) of `config` on x.
std::vector<std::vector<uint8_t>> cpuPayloads(const CodecConfig& config,
                                              const std::vector<float>& x, size_t chunk_request,
                                              uint64_t step = 5) {
  auto cpu_r = createCodec(config);
  REQUIRE_MESSAGE(cpu_r.isOk(), cpu_r.status().message());
  const Chunking chunking = chunkingFor(**cpu_r, x.size(), chunk_request);
  StepContext ctx;
  ctx.seed = 3;
  ctx.name_key = tensorNameKey("hostile");
  ctx.step = step;
  CodecState state((*cpu_r)->stateFloats(x.size()));
  auto p =
      encodeTensor(**cpu_r, ctx, chunking, ConstTensor{x.data(), x.size(), DType::kF32}, state);
  REQUIRE_MESSAGE(p.isOk(), p.status().message());
  return *p;
}

/// Decoding `payload` (of other parameters than the decoder's, but valid) on the GPU with the
/// codec of `config` gives the CPU decoder's bits.
void checkForeignDecode(const CodecConfig& config, const std::vector<uint8_t>& payload, size_t n) {
  auto cpu_r = createCodec(config);
  REQUIRE(cpu_r.isOk());
  auto gpu_r = createCudaCodec(config);
  REQUIRE(gpu_r.isOk());
  const std::vector<float> base = testing::normalInput(n, 5);
  std::vector<float> cpu_out = base;
  LW_STATUS_OK((*cpu_r)->decodeChunk(payload, -1.25f, cpu_out.data(), n));
  DeviceMem out(n * sizeof(float));
  out.upload(base.data(), n * sizeof(float));
  DeviceMem scratch((*gpu_r)->decodeScratchBytes(payload.size(), n));
  LW_STATUS_OK((*gpu_r)->decodeChunk(payload, -1.25f, out.as<float>(), n, scratch.span(), nullptr));
  LW_CUDA_CHECK_OK(cudaDeviceSynchronize());
  CHECK(testing::sameBits(out.download<float>(n), cpu_out));
}

// --- registry ------------------------------------------------------------------------------------

TEST_CASE("dense and quantising CUDA codecs are registered and validate their configuration") {
  for (const char* name : {"none", "fp16", "bf16", "qsgd", "terngrad", "signsgd", "onebit"}) {
    CAPTURE(name);
    CHECK(hasCudaCodec(name));
    auto c = createCudaCodec(configOf(name));
    REQUIRE_MESSAGE(c.isOk(), c.status().message());
    CHECK(std::string((*c)->traits().name) == name);
  }
  CHECK_FALSE(createCudaCodec(configOf("qsgd", 9)).isOk());
  CHECK_FALSE(createCudaCodec(configOf("qsgd", 1)).isOk());
  CHECK_FALSE(createCudaCodec(configOf("qsgd", 8, 0)).isOk());
  CHECK_FALSE(createCudaCodec(configOf("onebit", 8, 0)).isOk());
  CHECK_FALSE(createCudaCodec(configOf("terngrad", 8, (1u << 24) + 1)).isOk());
  // signsgd and onebit carry error feedback by default, as on the CPU.
  auto s = createCudaCodec(configOf("signsgd"));
  REQUIRE(s.isOk());
  CHECK((*s)->stateFloats(100) == 100);
  auto t = createCudaCodec(configOf("terngrad"));
  REQUIRE(t.isOk());
  CHECK((*t)->stateFloats(100) == 0);
}

// --- none, fp16, bf16 ----------------------------------------------------------------------------

TEST_CASE("none fp16 bf16: the CPU's payloads and decoding for every dtype length and chunking") {
  uint64_t salt = 0;
  for (const char* name : {"none", "fp16", "bf16"}) {
    CAPTURE(name);
    for (DType dtype : kDTypes) {
      CAPTURE(dtypeName(dtype));
      for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{4097}, size_t{20011}}) {
        CAPTURE(n);
        checkFamilies(configOf(name), n, 0, dtype, 2, salt += 10);
        if (n > 1000) checkFamilies(configOf(name), n, 1001, dtype, 2, salt += 10);
      }
    }
  }
}

TEST_CASE("none fp16 bf16 with error feedback: the CPU's payloads states and flush") {
  uint64_t salt = 500;
  for (const char* name : {"none", "fp16", "bf16"}) {
    CAPTURE(name);
    for (DType dtype : kDTypes) {
      CAPTURE(dtypeName(dtype));
      CompareOptions opt;
      opt.dtype = dtype;
      opt.chunk_elements = 3001;
      opt.flush_last = true;
      opt.rank = 1;
      checkCudaMatchesCpu(configOf(name, 8, 512, true), stepsOf(Family::kHeavy, 10007, 5, ++salt),
                          opt);
      checkCudaMatchesCpu(configOf(name, 8, 512, true), stepsOf(Family::kSpecial, 4097, 4, ++salt),
                          opt);
    }
  }
}

TEST_CASE("none fp16 bf16: NaN payloads pinned and ±Inf and overflow converted as on the CPU") {
  std::vector<float> x = specialInput(1003, 11);
  const uint32_t nans[] = {0x7FC00000u, 0xFFC00001u, 0x7F800001u, 0xFF812345u, 0x7FBFFFFFu};
  for (size_t i = 0; i < std::size(nans); ++i) x[17 * i + 5] = bitsFloat(nans[i]);
  x[200] = std::numeric_limits<float>::infinity();
  x[201] = -std::numeric_limits<float>::infinity();
  x[202] = 65520.0f;     // fp16: Inf
  x[203] = 65519.996f;   // fp16: 65504
  x[204] = 3.4e38f;      // bf16: rounds to Inf
  x[205] = -3.3961e38f;  // bf16: the largest finite
  for (const char* name : {"none", "fp16", "bf16"}) {
    CAPTURE(name);
    for (DType dtype : kDTypes) {
      CAPTURE(dtypeName(dtype));
      checkStepDirect(configOf(name), x, dtype, 0, 0, 0, 0);
      checkStepDirect(configOf(name), x, dtype, 300, 0, 0, 0);
    }
  }
}

// --- qsgd ----------------------------------------------------------------------------------------

TEST_CASE("qsgd: the CPU's payloads and decoding for bits 2..8 and buckets 1 7 512 5000") {
  uint64_t salt = 1000;
  for (int bits : {2, 3, 4, 5, 7, 8}) {
    for (uint32_t bucket : {1u, 7u, 512u, 5000u}) {
      CAPTURE(bits);
      CAPTURE(bucket);
      const CodecConfig config = configOf("qsgd", bits, bucket);
      // One chunk, then several: chunk starts that are not multiples of 8 (buckets 1 and 7).
      const size_t chunk = chunkFor(bucket);
      for (size_t n : {size_t{1}, size_t{4097}, size_t{12007}}) {
        CAPTURE(n);
        checkFamilies(config, n, 0, DType::kF32, 2, salt += 10);
        if (n > chunk) checkFamilies(config, n, chunk, DType::kF32, 2, salt += 10);
      }
      if (bits == 4 || bits == 8) {
        checkFamilies(config, 12007, chunk, DType::kF16, 2, salt += 10);
        checkFamilies(config, 12007, chunk, DType::kBF16, 2, salt += 10);
      }
    }
  }
  // Empty tensors: the 24-byte header alone.
  checkCudaMatchesCpu(configOf("qsgd", 4, 7), {{}, {}});
}

TEST_CASE("qsgd with error feedback: the CPU's payloads states and flush over several steps") {
  uint64_t salt = 2000;
  for (int bits : {2, 8}) {
    for (uint32_t bucket : {7u, 512u, 5000u}) {
      CAPTURE(bits);
      CAPTURE(bucket);
      for (DType dtype : kDTypes) {
        CAPTURE(dtypeName(dtype));
        CompareOptions opt;
        opt.dtype = dtype;
        opt.chunk_elements = size_t{bucket} * 2;
        opt.rank = static_cast<uint32_t>(++salt % 4);
        opt.seed = static_cast<uint32_t>(salt);
        opt.flush_last = bits == 8;
        checkCudaMatchesCpu(configOf("qsgd", bits, bucket, true),
                            stepsOf(Family::kNormal, 12007, 5, salt), opt);
      }
    }
  }
}

TEST_CASE("qsgd edge inputs: zero buckets and subnormal norms (F = FLT_MAX) and escapes") {
  const size_t n = 3 * 512 + 100;
  // All ±0: norm 0, codes 0, no random word used.
  std::vector<float> zeros(n, 0.0f);
  for (size_t i = 0; i < n; i += 3) zeros[i] = -0.0f;
  // Subnormal values: norms of a few 1e-45, so (float)s / norm is +Inf and F = FLT_MAX.
  std::vector<float> tiny(n);
  for (size_t i = 0; i < n; ++i) {
    tiny[i] = bitsFloat(static_cast<uint32_t>(i % 5)) * (i % 2 == 0 ? 1.0f : -1.0f);
  }
  // Values whose norm overflows fp32 (finite input): the chunk is escaped.
  std::vector<float> huge = testing::normalInput(n, 3);
  huge[700] = 3.0e38f;
  huge[701] = -3.0e38f;
  // ±Inf in the second chunk only: that chunk escapes, the others are quantised.
  std::vector<float> inf = testing::normalInput(n, 4);
  inf[600] = std::numeric_limits<float>::infinity();
  inf[n - 1] = -std::numeric_limits<float>::infinity();
  for (int bits : {2, 5, 8}) {
    for (uint32_t bucket : {7u, 512u, 5000u}) {
      CAPTURE(bits);
      CAPTURE(bucket);
      const CodecConfig config = configOf("qsgd", bits, bucket);
      for (size_t chunk : {size_t{0}, size_t{bucket}}) {
        CAPTURE(chunk);
        CompareOptions opt;
        opt.chunk_elements = chunk;
        checkCudaMatchesCpu(config, {zeros, tiny}, opt);
        checkCudaMatchesCpu(config, {huge, inf}, opt);
        opt.dtype = DType::kF16;  // Inf stays Inf; 3e38 becomes Inf
        checkCudaMatchesCpu(config, {huge, inf}, opt);
      }
    }
  }
  // The subnormal norms with error feedback (state stays finite).
  CompareOptions opt;
  opt.chunk_elements = 512;
  checkCudaMatchesCpu(configOf("qsgd", 3, 512, true), {tiny, zeros, tiny}, opt);
}

TEST_CASE("qsgd and the bucket codecs escape chunks with NaN to the none layout as the CPU") {
  std::vector<float> x = testing::normalInput(3000, 8);
  x[1500] = bitsFloat(0x7FC00123u);
  x[2999] = bitsFloat(0xFF800001u);  // a signalling NaN: bits kept in the payload
  const std::vector<CodecConfig> configs = {configOf("qsgd", 4, 7),
                                            configOf("qsgd", 8, 512),
                                            configOf("terngrad", 8, 7),
                                            configOf("terngrad", 8, 5000),
                                            configOf("signsgd", 8, 7, false),
                                            configOf("onebit", 8, 512, false),
                                            configOf("signsgd", 8, 5000, false)};
  for (const CodecConfig& config : configs) {
    CAPTURE(config.name);
    CAPTURE(config.bucket_size);
    for (DType dtype : kDTypes) {
      CAPTURE(dtypeName(dtype));
      checkStepDirect(config, x, dtype, 0, 0, 0, 0);
      checkStepDirect(config, x, dtype, 1000, 0, 0, 0);
    }
  }
}

// --- terngrad, signsgd, onebit -------------------------------------------------------------------

TEST_CASE("terngrad signsgd onebit (their default error feedback): the CPU's payloads and states") {
  uint64_t salt = 3000;
  for (const char* name : {"terngrad", "signsgd", "onebit"}) {
    for (uint32_t bucket : {1u, 7u, 512u, 5000u}) {
      CAPTURE(name);
      CAPTURE(bucket);
      const CodecConfig config = configOf(name, 8, bucket);
      // Chunk starts that are not multiples of 4 or 8 for buckets 1 and 7.
      const size_t chunk = chunkFor(bucket);
      for (size_t n : {size_t{0}, size_t{1}, size_t{4097}, size_t{12007}}) {
        CAPTURE(n);
        checkFamilies(config, n, 0, DType::kF32, 3, salt += 10);
        if (n > chunk) checkFamilies(config, n, chunk, DType::kF32, 3, salt += 10);
      }
      checkFamilies(config, 12007, chunk, DType::kF16, 2, salt += 10);
      checkFamilies(config, 12007, chunk, DType::kBF16, 2, salt += 10);
    }
  }
}

TEST_CASE(
    "terngrad with error feedback and signsgd onebit without: the CPU's payloads and states") {
  uint64_t salt = 4000;
  for (uint32_t bucket : {7u, 512u, 5000u}) {
    CAPTURE(bucket);
    CompareOptions opt;
    opt.chunk_elements = size_t{bucket} * 2;
    opt.flush_last = true;
    opt.seed = static_cast<uint32_t>(++salt);
    checkCudaMatchesCpu(configOf("terngrad", 8, bucket, true),
                        stepsOf(Family::kHeavy, 12007, 5, salt), opt);
    opt.flush_last = false;
    checkCudaMatchesCpu(configOf("signsgd", 8, bucket, false),
                        stepsOf(Family::kNormal, 12007, 3, salt), opt);
    checkCudaMatchesCpu(configOf("onebit", 8, bucket, false),
                        stepsOf(Family::kSpecial, 12007, 3, salt), opt);
  }
}

TEST_CASE("bucket codecs: one-signed and zero and ±Inf buckets as on the CPU") {
  const size_t n = 2 * 512 + 37;
  std::vector<float> positive = testing::normalInput(n, 1);
  for (float& v : positive) v = std::fabs(v);  // onebit: no negatives (neg = 0)
  std::vector<float> negative = positive;
  for (float& v : negative) v = -v - 1e-3f;  // onebit: no non-negatives (pos = 0)
  std::vector<float> zeros(n, 0.0f);
  for (size_t i = 1; i < n; i += 2) zeros[i] = -0.0f;
  std::vector<float> with_inf = testing::normalInput(n, 2);
  with_inf[600] = std::numeric_limits<float>::infinity();
  for (const char* name : {"terngrad", "signsgd", "onebit"}) {
    for (uint32_t bucket : {7u, 512u}) {
      CAPTURE(name);
      CAPTURE(bucket);
      CompareOptions opt;
      opt.chunk_elements = bucket;
      // Error feedback on where it is the default: the states stay finite.
      checkCudaMatchesCpu(configOf(name, 8, bucket), {positive, negative, zeros, positive}, opt);
      // ±Inf: the chunk holding it goes in the none layout (no error feedback: its residual would
      // be Inf − Inf, a NaN whose bits are the hardware's).
      checkCudaMatchesCpu(configOf(name, 8, bucket, false), {with_inf, zeros}, opt);
    }
  }
}

// --- pointers, foreign parameters, hostile payloads ----------------------------------------------

TEST_CASE("unaligned input and payload and output pointers give the same bytes") {
  const std::vector<float> x = testing::heavyTailedInput(5003, 21);
  const std::vector<CodecConfig> configs = {configOf("none"),
                                            configOf("fp16"),
                                            configOf("bf16"),
                                            configOf("qsgd", 3, 7),
                                            configOf("qsgd", 8, 512),
                                            configOf("terngrad", 8, 7),
                                            configOf("terngrad", 8, 5000),
                                            configOf("signsgd", 8, 1, false),
                                            configOf("onebit", 8, 512, false)};
  for (const CodecConfig& config : configs) {
    CAPTURE(config.name);
    CAPTURE(config.bits);
    CAPTURE(config.bucket_size);
    for (DType dtype : kDTypes) {
      CAPTURE(dtypeName(dtype));
      // Offsets of the input (elements), the payload (bytes) and the output (floats).
      static const size_t kOffsets[][3] = {{0, 0, 0}, {1, 1, 1}, {3, 2, 2}, {5, 4, 3}, {8, 16, 4}};
      for (const auto& o : kOffsets) {
        const size_t in_off = o[0], payload_off = o[1], out_off = o[2];
        CAPTURE(in_off);
        CAPTURE(payload_off);
        CAPTURE(out_off);
        checkStepDirect(config, x, dtype, 0, in_off, payload_off, out_off);
        checkStepDirect(config, x, dtype, 2107, in_off, payload_off, out_off);
      }
    }
  }
}

TEST_CASE("payloads of other parameters decode as on the CPU") {
  const std::vector<float> x = testing::normalInput(1001, 31);
  // qsgd decoders read b and d from the payload.
  for (int bits : {2, 3, 6, 8}) {
    for (uint32_t bucket : {1u, 7u, 5000u}) {
      CAPTURE(bits);
      CAPTURE(bucket);
      const auto p = cpuPayloads(configOf("qsgd", bits, bucket), x, 0);
      checkForeignDecode(configOf("qsgd", 8, 512), p[0], x.size());
      checkForeignDecode(configOf("qsgd", 2, 3), p[0], x.size());
    }
  }
  // bucket codecs read d from the payload.
  for (const char* name : {"terngrad", "signsgd", "onebit"}) {
    for (uint32_t bucket : {1u, 7u, 5000u}) {
      CAPTURE(name);
      CAPTURE(bucket);
      const auto p = cpuPayloads(configOf(name, 8, bucket, false), x, 0);
      checkForeignDecode(configOf(name, 8, 512), p[0], x.size());
    }
  }
  // Every decoder accepts the none layout.
  const auto dense = cpuPayloads(configOf("none"), x, 0);
  for (const char* name : {"none", "fp16", "bf16", "qsgd", "terngrad", "signsgd", "onebit"}) {
    CAPTURE(name);
    checkForeignDecode(configOf(name), dense[0], x.size());
  }
}

/// Mutations common to every single-round codec: truncations, a trailing byte, header fields,
/// other output counts.
void refuseCommon(const CodecConfig& config, const std::vector<uint8_t>& good, size_t n,
                  CodecId own) {
  auto gpu = createCudaCodec(config);
  REQUIRE(gpu.isOk());
  REQUIRE_MESSAGE((*gpu)->validate(good, n).isOk(), "the unmutated payload must be accepted");
  const auto mutated = [&](auto edit) {
    std::vector<uint8_t> p = good;
    edit(p);
    return p;
  };
  for (size_t len = 0; len < good.size(); ++len) {
    CAPTURE(len);
    checkRejectedLikeCpu(config, std::vector<uint8_t>(good.begin(), good.begin() + len), n);
  }
  checkRejectedLikeCpu(config, mutated([](auto& p) { p.push_back(0); }), n);
  checkRejectedLikeCpu(config, mutated([](auto& p) { p[0] = 0x4D; }), n);
  checkRejectedLikeCpu(config, mutated([](auto& p) { p[1] = 0; }), n);
  checkRejectedLikeCpu(config, mutated([](auto& p) { p[2] = 2; }), n);
  for (int id = 1; id <= 12; ++id) {
    if (id == static_cast<int>(own)) continue;
    CAPTURE(id);
    checkRejectedLikeCpu(config, mutated([id](auto& p) { p[3] = static_cast<uint8_t>(id); }), n);
  }
  if (own != CodecId::kNone) {  // the none id on this codec's body: a wrong length
    checkRejectedLikeCpu(config, mutated([](auto& p) { p[3] = 0; }), n);
  }
  checkRejectedLikeCpu(config, mutated([](auto& p) { p[4] = 3; }), n);
  for (int bit = 0; bit < 8; ++bit) {
    checkRejectedLikeCpu(config, mutated([bit](auto& p) { p[5] = static_cast<uint8_t>(1 << bit); }),
                         n);
  }
  checkRejectedLikeCpu(config, mutated([](auto& p) { p[6] = 1; }), n);
  checkRejectedLikeCpu(config, mutated([](auto& p) { p[7] = 0x10; }), n);
  checkRejectedLikeCpu(config, good, n - 1);
  checkRejectedLikeCpu(config, good, n + 1);
  checkRejectedLikeCpu(config, mutated([n](auto& p) { storeU64(p.data() + 8, n + 1); }), n);
}

TEST_CASE("hostile payloads are refused like on the CPU and leave the output untouched") {
  const size_t n = 51;  // 51 codes of 1, 2 or 4 bits leave unused bits in the last byte
  std::vector<float> x = testing::normalInput(n, 41);

  SUBCASE("none, fp16, bf16") {
    for (const char* name : {"none", "fp16", "bf16"}) {
      CAPTURE(name);
      const CodecConfig config = configOf(name);
      const auto good = cpuPayloads(config, x, 0)[0];
      auto id = createCodec(config);
      REQUIRE(id.isOk());
      refuseCommon(config, good, n, (*id)->traits().id);
    }
    // A none-layout payload of the wrong length for fp16 / bf16 decoders.
    const auto dense = cpuPayloads(configOf("none"), x, 0)[0];
    std::vector<uint8_t> short_dense(dense.begin(), dense.end() - 2);
    checkRejectedLikeCpu(configOf("fp16"), short_dense, n);
    checkRejectedLikeCpu(configOf("bf16"), short_dense, n);
  }

  SUBCASE("qsgd") {
    const CodecConfig config = configOf("qsgd", 4, 7);
    const auto good = cpuPayloads(config, x, 0)[0];
    refuseCommon(config, good, n, CodecId::kQsgd);
    const auto mutated = [&](auto edit) {
      std::vector<uint8_t> p = good;
      edit(p);
      return p;
    };
    checkRejectedLikeCpu(config, mutated([](auto& p) { p[16] = 1; }), n);
    checkRejectedLikeCpu(config, mutated([](auto& p) { p[16] = 9; }), n);
    checkRejectedLikeCpu(config, mutated([](auto& p) { p[16] = 8; }), n);  // wrong length
    for (size_t r = 17; r < 20; ++r) {
      checkRejectedLikeCpu(config, mutated([r](auto& p) { p[r] = 1; }), n);
    }
    checkRejectedLikeCpu(config, mutated([](auto& p) { storeU32(p.data() + 20, 0); }), n);
    checkRejectedLikeCpu(config, mutated([](auto& p) { storeU32(p.data() + 20, 8); }), n);
    checkRejectedLikeCpu(config, mutated([](auto& p) { storeF32(p.data() + 24, -1.0f); }), n);
    checkRejectedLikeCpu(config, mutated([](auto& p) { storeF32(p.data() + 28, NAN); }), n);
    checkRejectedLikeCpu(config,
                         mutated([](auto& p) { storeF32(p.data() + 24 + 4 * 7, INFINITY); }), n);
    checkRejectedLikeCpu(config, mutated([](auto& p) { p.back() |= 0x80; }), n);  // padding bit
    checkRejectedLikeCpu(config,
                         mutated([](auto& p) { storeU64(p.data() + 8, uint64_t{1} << 62); }), n);
  }

  SUBCASE("terngrad, signsgd, onebit") {
    for (const char* name : {"terngrad", "signsgd", "onebit"}) {
      CAPTURE(name);
      const CodecConfig config = configOf(name, 8, 7, false);
      const auto good = cpuPayloads(config, x, 0)[0];
      auto cpu = createCodec(config);
      REQUIRE(cpu.isOk());
      refuseCommon(config, good, n, (*cpu)->traits().id);
      const auto mutated = [&](auto edit) {
        std::vector<uint8_t> p = good;
        edit(p);
        return p;
      };
      const bool two_scales = std::string(name) == "onebit";
      const size_t scales = 4 * (two_scales ? 2 : 1) * ((n + 6) / 7);
      checkRejectedLikeCpu(config, mutated([](auto& p) { storeU32(p.data() + 16, 0); }), n);
      checkRejectedLikeCpu(config, mutated([](auto& p) { storeU32(p.data() + 16, 8); }), n);
      checkRejectedLikeCpu(config, mutated([](auto& p) { storeF32(p.data() + 20, -1.0f); }), n);
      checkRejectedLikeCpu(config, mutated([](auto& p) { storeF32(p.data() + 20, NAN); }), n);
      checkRejectedLikeCpu(config, mutated([](auto& p) { storeF32(p.data() + 20, INFINITY); }), n);
      if (two_scales) {  // onebit's neg scale must be <= 0
        checkRejectedLikeCpu(config, mutated([](auto& p) { storeF32(p.data() + 24, 0.5f); }), n);
      }
      checkRejectedLikeCpu(config, mutated([](auto& p) { p.back() |= 0x80; }), n);  // padding
      if (std::string(name) == "terngrad") {  // code 3 in the first byte of codes
        checkRejectedLikeCpu(config, mutated([scales](auto& p) { p[20 + scales] |= 0x03; }), n);
        checkRejectedLikeCpu(config, mutated([scales](auto& p) { p[20 + scales + 5] |= 0x30; }), n);
      }
    }
  }
}

TEST_CASE("encodeChunk and decodeChunk refuse bad arguments") {
  auto gpu = createCudaCodec(configOf("qsgd", 4, 512));
  REQUIRE(gpu.isOk());
  const CudaCodec& codec = **gpu;
  const size_t n = 2000;
  const Chunking chunking = chunkingFor(codec.host(), n, 1024);
  REQUIRE(chunking.chunk_elements == 1024);
  DeviceMem in(n * sizeof(float));
  DeviceMem ws(codec.workspaceBytes(chunking));
  DeviceMem out(codec.maxPayloadBytes(chunking.chunk_elements));
  DeviceMem size(sizeof(uint64_t));
  DeviceState state;
  const DeviceTensor input{in.as(), n, DType::kF32};
  StepContext ctx;
  CHECK(codec.workspaceBytes(chunking) > 0);
  CHECK_FALSE(codec
                  .analyze(ctx, chunking, input, state,
                           DeviceBytes{ws.as(), codec.workspaceBytes(chunking) - 1}, nullptr)
                  .isOk());
  CHECK_FALSE(codec
                  .encodeChunk(ctx, chunking, 2, 0, {}, input, state, ws.span(), out.as<uint8_t>(),
                               size.as<uint64_t>(), nullptr)
                  .isOk());
  CHECK_FALSE(codec
                  .encodeChunk(ctx, Chunking{n, 1000}, 0, 0, {}, input, state, ws.span(),
                               out.as<uint8_t>(), size.as<uint64_t>(), nullptr)
                  .isOk());
  CHECK_FALSE(codec
                  .encodeChunk(ctx, chunking, 0, 0, {}, input, state, ws.span(), nullptr,
                               size.as<uint64_t>(), nullptr)
                  .isOk());
  const std::vector<uint8_t> payload(30, 0);
  DeviceMem scratch(codec.decodeScratchBytes(payload.size(), 10));
  CHECK_FALSE(
      codec.decodeChunk(payload, 1.0f, out.as<float>(), 10, DeviceBytes{scratch.as(), 1}, nullptr)
          .isOk());
  LW_CUDA_CHECK_OK(cudaDeviceSynchronize());
}

}  // namespace test_dense_codecs_cuda
}  // namespace lightwire::kernels::cuda
