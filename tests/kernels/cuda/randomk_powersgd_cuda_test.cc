// The CUDA randomk and powersgd codecs (kernels/cuda/codecs/randomk.cu, powersgd.cu) against the
// CPU codecs: byte-identical payloads, bit-identical decoded results and committed states.
//
// randomk: densities, seeds, steps, ranks (the shared stream selects the same elements on every
// rank), input kinds and dtypes, fp16 values, several chunks, density overrides, error feedback
// over committed steps and a flush, unaligned payload buffers, the `none` escape, and hostile
// payloads (rejected, output untouched).
// powersgd: W = 1..3 ranks simulated in one process (each rank its own state; every round's
// payloads reduced with the CPU codec's addPayloads in rank order, as tests/kernels/multirank.h),
// several steps (warm start), shapes 64x33, 1x1, 1000x7, flat views with padding, views with more
// than 4096 rows or columns (multi-block sums), ranks 1..12 (several rank tiles), fp16 / bf16
// inputs, a zero matrix, a flush, checkpoints restored across backends (a zeroed warm-start column
// redrawn), view changes, hostile reduced payloads, and the device-side guards.
// Needs a GPU (main.cc skips otherwise).

#include <cuda_runtime_api.h>
#include <doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "kernels/cuda/codec.h"
#include "kernels/payload.h"
#include "kernels/philox.h"
#include "kernels/registry.h"
#include "tests/kernels/cuda/codec_compare.h"

namespace lightwire::kernels::cuda::testing {
namespace test_randomk_powersgd_cuda {

// --- randomk -------------------------------------------------------------------------------------

CodecConfig randomkConfig(double density, DType values = DType::kF32,
                          std::optional<bool> ef = std::nullopt) {
  CodecConfig c;
  c.name = "randomk";
  c.density = density;
  c.sparse_values = values;
  c.error_feedback = ef;
  return c;
}

std::vector<float> inputOfKind(int kind, size_t n, uint64_t seed) {
  switch (kind) {
    case 0:
      return normalInput(n, seed);
    case 1:
      return heavyTailedInput(n, seed);
    case 2:
      return constantInput(n, 0.75f);
    default:
      return tiedInput(n, seed);
  }
}

TEST_CASE("randomk cuda: payloads, decoding and states match the CPU") {
  for (double density : {0.001, 0.01, 0.3, 1.0}) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1001}, size_t{4099}, size_t{70001}}) {
      for (int kind = 0; kind < 4; ++kind) {
        CAPTURE(density);
        CAPTURE(n);
        CAPTURE(kind);
        std::vector<std::vector<float>> inputs;
        for (uint64_t s = 0; s < 2; ++s) inputs.push_back(inputOfKind(kind, n, 10 * n + s));
        CompareOptions opt;
        opt.seed = static_cast<uint32_t>(n + kind);
        checkCudaMatchesCpu(randomkConfig(density), inputs, opt);
      }
    }
  }
}

TEST_CASE("randomk cuda: dtypes, fp16 values, chunks, seeds and steps") {
  const size_t n = 50003;  // odd: the last chunk is short and chunks start mid Philox group
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (DType values : {DType::kF32, DType::kF16}) {
      for (size_t chunk : {size_t{0}, size_t{1001}, size_t{4096}, size_t{20000}}) {
        CAPTURE(int(dtype));
        CAPTURE(int(values));
        CAPTURE(chunk);
        std::vector<std::vector<float>> inputs{heavyTailedInput(n, 1), normalInput(n, 2, 1e5f)};
        CompareOptions opt;
        opt.dtype = dtype;
        opt.chunk_elements = chunk;
        opt.seed = 99;
        opt.first_step = 0xFFFFFFFEull;  // the step's low 32 bits wrap during the run
        checkCudaMatchesCpu(randomkConfig(0.05, values), inputs, opt);
      }
    }
  }
  // Seeds, tensor names and a per-step density override (a schedule).
  for (uint32_t seed : {0u, 1u, 0xDEADBEEFu}) {
    CAPTURE(seed);
    CompareOptions opt;
    opt.seed = seed;
    opt.tensor = "block." + std::to_string(seed) + ".attn";
    opt.density = 0.2;
    opt.chunk_elements = 777;
    checkCudaMatchesCpu(randomkConfig(0.01), {normalInput(5000, seed), normalInput(5000, seed + 1)},
                        opt);
  }
}

TEST_CASE("randomk cuda: every rank selects the same elements (shared stream)") {
  const size_t n = 9000;
  std::vector<std::vector<uint8_t>> first;
  for (uint32_t rank : {0u, 1u, 5u}) {
    CAPTURE(rank);
    CompareOptions opt;
    opt.rank = rank;
    opt.chunk_elements = 2500;
    // Different values per rank, the same selection: the payloads differ only in the values.
    auto last = checkCudaMatchesCpu(randomkConfig(0.1), {normalInput(n, 100 + rank)}, opt);
    REQUIRE(!last.empty());
    if (first.empty()) {
      first = last;
      continue;
    }
    REQUIRE(last.size() == first.size());
    for (size_t c = 0; c < last.size(); ++c) {
      REQUIRE(last[c].size() == first[c].size());
      CHECK(std::memcmp(last[c].data(), first[c].data(), 56) == 0);  // fields and nnz
    }
  }
}

TEST_CASE("randomk cuda: error feedback over committed steps, and a flush") {
  for (DType values : {DType::kF32, DType::kF16}) {
    for (size_t chunk : {size_t{0}, size_t{3000}}) {
      CAPTURE(int(values));
      CAPTURE(chunk);
      const size_t n = 10007;
      std::vector<std::vector<float>> inputs;
      for (uint64_t s = 0; s < 5; ++s) inputs.push_back(heavyTailedInput(n, 500 + s));
      CompareOptions opt;
      opt.chunk_elements = chunk;
      checkCudaMatchesCpu(randomkConfig(0.02, values, true), inputs, opt);
      opt.flush_last = true;
      opt.dtype = DType::kBF16;
      checkCudaMatchesCpu(randomkConfig(0.02, values, true), inputs, opt);
    }
  }
}

/// Encodes one chunk of x on the GPU into a payload buffer at byte offset `misalign`.
std::vector<uint8_t> gpuEncodeAt(const CudaCodec& gpu, const std::vector<float>& x,
                                 const StepContext& ctx, size_t misalign) {
  const size_t n = x.size();
  const Chunking chunking = chunkingFor(gpu.host(), n, 0);
  DeviceMem in(n * 4), ws(gpu.workspaceBytes(chunking));
  DeviceMem out(gpu.maxPayloadBytes(n) + misalign), size(8);
  in.upload(x.data(), n * 4);
  auto st = DeviceState::create(0);
  REQUIRE(st.isOk());
  DeviceState state = std::move(*st);
  const DeviceTensor t{in.as(), n, DType::kF32};
  LW_STATUS_OK(gpu.analyze(ctx, chunking, t, state, ws.span(), nullptr));
  LW_STATUS_OK(gpu.encodeChunk(ctx, chunking, 0, 0, {}, t, state, ws.span(),
                               out.as<uint8_t>() + misalign, size.as<uint64_t>(), nullptr));
  LW_CUDA_CHECK_OK(cudaDeviceSynchronize());
  const uint64_t bytes = size.download<uint64_t>(1)[0];
  const auto all = out.download<uint8_t>(bytes + misalign);
  return {all.begin() + static_cast<ptrdiff_t>(misalign), all.end()};
}

TEST_CASE("randomk cuda: unaligned payload buffers, decoding the none escape") {
  const size_t n = 3001;
  const auto x = normalInput(n, 3);
  StepContext ctx;
  ctx.seed = 5;
  ctx.name_key = tensorNameKey("w");
  ctx.step = 17;
  for (DType values : {DType::kF32, DType::kF16}) {
    auto cpu = createCodec(randomkConfig(0.5, values));
    auto gpu = createCudaCodec(randomkConfig(0.5, values));
    REQUIRE(cpu.isOk());
    REQUIRE(gpu.isOk());
    CodecState none;
    auto cpu_payloads =
        encodeTensor(**cpu, ctx, chunkingFor(**cpu, n, 0), ConstTensor{x.data(), n}, none);
    REQUIRE(cpu_payloads.isOk());
    for (size_t misalign : {0, 1, 2, 3}) {
      CAPTURE(misalign);
      CHECK(gpuEncodeAt(**gpu, x, ctx, misalign) == (*cpu_payloads)[0]);
    }
  }
  // A `none` payload (what a peer may send instead): every randomk decoder accepts it.
  auto cpu = createCodec(randomkConfig(0.1));
  auto gpu = createCudaCodec(randomkConfig(0.1));
  REQUIRE(cpu.isOk());
  REQUIRE(gpu.isOk());
  std::vector<uint8_t> dense(16 + 4 * n);
  REQUIRE(writeDensePayload(ConstTensor{x.data(), n}, dense.data(), nullptr) == dense.size());
  std::vector<float> want = normalInput(n, 4);
  DeviceMem out(n * 4), scratch((*gpu)->decodeScratchBytes(dense.size(), n));
  out.upload(want.data(), n * 4);
  LW_STATUS_OK((*cpu)->decodeChunk(dense, 0.37f, want.data(), n));
  LW_STATUS_OK((*gpu)->decodeChunk(dense, 0.37f, out.as<float>(), n, scratch.span(), nullptr));
  LW_CUDA_CHECK_OK(cudaDeviceSynchronize());
  CHECK(sameBits(out.download<float>(n), want));
}

TEST_CASE("randomk cuda: hostile payloads are rejected, the output untouched") {
  const size_t n = 2000;
  const CodecConfig config = randomkConfig(0.05);
  auto cpu = createCodec(config);
  REQUIRE(cpu.isOk());
  StepContext ctx;
  ctx.seed = 1;
  ctx.name_key = 2;
  ctx.step = 3;
  CodecState state;
  const auto x = normalInput(n, 8);
  auto enc = encodeTensor(**cpu, ctx, chunkingFor(**cpu, n, 0), ConstTensor{x.data(), n}, state);
  REQUIRE(enc.isOk());
  const std::vector<uint8_t> good = (*enc)[0];
  const uint64_t nnz = loadU64(good.data() + 48);
  REQUIRE(nnz > 0);

  std::vector<std::vector<uint8_t>> bad;
  auto mutate = [&](auto&& f) {
    std::vector<uint8_t> p = good;
    f(p);
    bad.push_back(std::move(p));
  };
  mutate([](auto& p) { p.resize(10); });                   // shorter than the header
  mutate([](auto& p) { p.resize(40); });                   // shorter than the fixed fields
  mutate([](auto& p) { p.push_back(0); });                 // trailing byte
  mutate([](auto& p) { p.pop_back(); });                   // truncated values
  mutate([](auto& p) { p[0] = 0; });                       // magic
  mutate([](auto& p) { p[2] = 2; });                       // version
  mutate([](auto& p) { p[3] = 3; });                       // another codec
  mutate([](auto& p) { p[5] = 0x02; });                    // unknown flag
  mutate([](auto& p) { p[6] = 1; });                       // round
  mutate([](auto& p) { p[7] = 1; });                       // reserved header byte
  mutate([](auto& p) { storeU64(p.data() + 8, n + 1); });  // element count
  mutate([](auto& p) { storeU32(p.data() + 28, 1); });     // reserved body field
  mutate([](auto& p) { storeU64(p.data() + 40, (1ull << 32) + 1); });  // t > 2^32
  mutate([](auto& p) { storeU64(p.data() + 32, ~uint64_t{0} - 5); });  // start overflows
  mutate([&](auto& p) {                                                // nnz > n
    storeU64(p.data() + 48, n + 1);
    p.resize(56 + 4 * (n + 1));
  });
  mutate([&](auto& p) {  // one value more than the selection holds (consistent length)
    storeU64(p.data() + 48, nnz + 1);
    p.resize(p.size() + 4);
  });
  mutate([&](auto& p) {  // one value less
    storeU64(p.data() + 48, nnz - 1);
    p.resize(p.size() - 4);
  });
  mutate([](auto& p) { storeU64(p.data() + 40, 0); });  // t = 0 selects nothing, nnz > 0
  mutate([&](auto& p) {                                 // t = 2^32 selects all n
    storeU64(p.data() + 40, 1ull << 32);
  });
  for (size_t k = 0; k < bad.size(); ++k) {
    CAPTURE(k);
    checkRejectedLikeCpu(config, bad[k], n);
  }
  // Changed selection fields (step, seed, start) almost surely select another count; only those
  // the CPU rejects are checked (a coincidentally equal count is a valid payload).
  for (size_t field : {16u, 24u, 32u}) {
    std::vector<uint8_t> p = good;
    p[field] ^= 0x5A;
    std::vector<float> sink(n, 0.0f);
    if (!(*cpu)->decodeChunk(p, 1.0f, sink.data(), n).isOk()) checkRejectedLikeCpu(config, p, n);
  }
}

// --- powersgd ------------------------------------------------------------------------------------

CodecConfig powersgdConfig(int rank) {
  CodecConfig c;
  c.name = "powersgd";
  c.approx_rank = rank;
  return c;
}

/// rows × cols matrix A·Bᵀ of rank r plus a little noise (row-major, n elements, flat padding cut).
std::vector<float> lowRankInput(size_t n, size_t cols, size_t r, uint64_t seed) {
  const size_t rows = cols == 0 ? 0 : (n + cols - 1) / cols;
  const auto a = normalInput(rows * r, seed), b = normalInput(cols * r, seed + 1);
  const auto noise = normalInput(n, seed + 2, 0.01f);
  std::vector<float> m(n);
  for (size_t idx = 0; idx < n; ++idx) {
    const size_t i = idx / cols, k = idx % cols;
    double s = 0;
    for (size_t j = 0; j < r; ++j) s += double(a[i * r + j]) * double(b[k * r + j]);
    m[idx] = float(s) + noise[idx];
  }
  return m;
}

double relL2(const std::vector<float>& want, const std::vector<float>& got) {
  double d = 0, w = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    d += (double(want[i]) - double(got[i])) * (double(want[i]) - double(got[i]));
    w += double(want[i]) * double(want[i]);
  }
  return w == 0 ? std::sqrt(d) : std::sqrt(d / w);
}

struct PsgdCase {
  int approx_rank = 1;
  std::vector<uint64_t> shape;  // empty: the flat view
  size_t n = 0;
  size_t world = 1;
  size_t steps = 3;
  DType dtype = DType::kF32;
  int kind = 0;  // 0 low rank + noise, 1 normal, 2 heavy tailed, 3 zero, 4 constant
  bool flush_last = false;
  std::function<std::vector<float>(size_t step, size_t rank)> input;  // overrides `kind`
};

std::vector<float> psgdInput(const PsgdCase& pc, size_t step, size_t rank) {
  if (pc.input) return pc.input(step, rank);
  const uint64_t seed = 1000 * step + 17 * rank + pc.n;
  const size_t cols = pc.shape.size() >= 2 && pc.shape[0] > 0
                          ? pc.n / pc.shape[0]
                          : size_t(std::ceil(std::sqrt(double(pc.n))));
  switch (pc.kind) {
    case 0:
      return lowRankInput(pc.n, std::max<size_t>(cols, 1), 3, seed);
    case 1:
      return normalInput(pc.n, seed);
    case 2:
      return heavyTailedInput(pc.n, seed);
    case 3:
      return std::vector<float>(pc.n, 0.0f);
    default:
      return constantInput(pc.n, 0.5f + float(rank));
  }
}

struct GpuRank {
  DeviceState state;
  std::unique_ptr<DeviceMem> ws, input, payload, size;
};

std::vector<float> hostState(const CodecState& s) {
  return {s.currentSpan().begin(), s.currentSpan().end()};
}

/// Sums payloads with the CPU codec's addPayloads in rank order ((p0 + p1) + p2 ...).
std::vector<uint8_t> reduceInRankOrder(const Codec& cpu,
                                       const std::vector<std::vector<uint8_t>>& sent) {
  std::vector<uint8_t> sum = sent[0];
  for (size_t rank = 1; rank < sent.size(); ++rank) {
    std::vector<uint8_t> next(std::max(sum.size(), sent[rank].size()));
    auto size = cpu.addPayloads(sum, sent[rank], next);
    REQUIRE_MESSAGE(size.isOk(), size.status().message());
    next.resize(*size);
    sum = std::move(next);
  }
  return sum;
}

/// Runs pc.steps steps of W = pc.world ranks on the CPU and the GPU side by side (each side
/// reduces its own payloads) and CHECKs every sent payload, every reduced payload, the decoded
/// result (into a non-zero base, weight 1/W), every committed state and residual norm for bit
/// equality. `carried_cpu` / `carried_gpu` may carry states in (checkpoints); they carry them out.
/// Returns the CPU's reduced payloads of the last step that was not a flush.
std::vector<std::vector<uint8_t>> comparePowerSgd(
    const PsgdCase& pc, std::vector<CodecState>* carried_cpu = nullptr,
    std::vector<std::vector<float>>* carried_gpu = nullptr, uint64_t first_step = 1) {
  CAPTURE(pc.approx_rank);
  CAPTURE(pc.n);
  CAPTURE(pc.world);
  CAPTURE(int(pc.dtype));
  CAPTURE(pc.kind);
  auto cpu_r = createCodec(powersgdConfig(pc.approx_rank));
  REQUIRE_MESSAGE(cpu_r.isOk(), cpu_r.status().message());
  auto gpu_r = createCudaCodec(powersgdConfig(pc.approx_rank));
  REQUIRE_MESSAGE(gpu_r.isOk(), gpu_r.status().message());
  const Codec& cpu = **cpu_r;
  const CudaCodec& gpu = **gpu_r;
  const size_t n = pc.n, world = pc.world;
  const Chunking chunking = chunkingFor(cpu, n, 0);
  REQUIRE(chunking.count() == 1);
  const float weight = 1.0f / float(world);
  cudaStream_t stream = nullptr;
  LW_CUDA_CHECK_OK(cudaStreamCreate(&stream));

  std::vector<CodecState> cpu_states(world, CodecState(cpu.stateFloats(n, pc.shape)));
  std::vector<std::vector<std::byte>> cpu_ws(world,
                                             std::vector<std::byte>(cpu.workspaceBytes(chunking)));
  std::vector<GpuRank> gpu_ranks;
  std::vector<std::vector<uint8_t>> last_reduced;
  for (size_t rank = 0; rank < world; ++rank) {
    auto st = DeviceState::create(gpu.stateFloats(n, pc.shape));
    REQUIRE_MESSAGE(st.isOk(), st.status().message());
    GpuRank g{std::move(*st)};
    g.ws = std::make_unique<DeviceMem>(gpu.workspaceBytes(chunking));
    g.input = std::make_unique<DeviceMem>(n * dtypeSize(pc.dtype));
    g.payload = std::make_unique<DeviceMem>(gpu.maxPayloadBytes(n));
    g.size = std::make_unique<DeviceMem>(sizeof(uint64_t));
    gpu_ranks.push_back(std::move(g));
  }
  if (carried_cpu != nullptr && !carried_cpu->empty()) {
    REQUIRE(carried_cpu->size() == world);
    REQUIRE(carried_gpu->size() == world);
    for (size_t rank = 0; rank < world; ++rank) {
      // A change of shape resizes the state (the error kept, the warm start drawn afresh).
      CodecState& carried = (*carried_cpu)[rank];
      carried.resize(cpu.stateFloats(n, pc.shape), n);
      std::vector<float>& g = (*carried_gpu)[rank];
      g.resize(cpu.stateFloats(n, pc.shape), 0.0f);
      std::fill(g.begin() + static_cast<std::ptrdiff_t>(std::min(n, g.size())), g.end(), 0.0f);
      LW_STATUS_OK(cpu_states[rank].restore(hostState(carried)));
      LW_STATUS_OK(gpu_ranks[rank].state.upload(g, stream));
    }
  }

  for (size_t s = 0; s < pc.steps; ++s) {
    CAPTURE(s);
    StepContext ctx;
    ctx.seed = 7;
    ctx.name_key = tensorNameKey("layer" + std::to_string(n));
    ctx.step = first_step + s;
    ctx.shape = pc.shape;
    std::vector<std::vector<uint8_t>> host_in(world);
    for (size_t rank = 0; rank < world; ++rank) {
      host_in[rank] = asDType(psgdInput(pc, s, rank), pc.dtype);
      gpu_ranks[rank].input->upload(host_in[rank].data(), host_in[rank].size());
    }
    auto cin = [&](size_t rank) { return ConstTensor{host_in[rank].data(), n, pc.dtype}; };
    auto gin = [&](size_t rank) { return DeviceTensor{gpu_ranks[rank].input->as(), n, pc.dtype}; };
    auto rankCtx = [&](size_t rank) {
      StepContext c = ctx;
      c.rank = static_cast<uint32_t>(rank);
      return c;
    };

    if (pc.flush_last && s + 1 == pc.steps) {
      for (size_t rank = 0; rank < world; ++rank) {
        std::vector<float> cpu_out(n);
        DeviceMem gpu_out(n * sizeof(float));
        LW_STATUS_OK(
            cpu.flush(rankCtx(rank), chunking, cin(rank), cpu_states[rank], cpu_out.data()));
        LW_STATUS_OK(gpu.flush(rankCtx(rank), chunking, gin(rank), gpu_ranks[rank].state,
                               gpu_out.as<float>(), stream));
        LW_CUDA_CHECK_OK(cudaStreamSynchronize(stream));
        CHECK_MESSAGE(sameBits(gpu_out.download<float>(n), cpu_out), "flush output differs");
        cpu.commitFlush(cpu_states[rank], n);
        LW_STATUS_OK(gpu.commitFlush(gpu_ranks[rank].state, stream));
      }
    } else {
      for (size_t rank = 0; rank < world; ++rank) {
        LW_STATUS_OK(
            cpu.analyze(rankCtx(rank), chunking, cin(rank), cpu_states[rank], cpu_ws[rank]));
        LW_STATUS_OK(gpu.analyze(rankCtx(rank), chunking, gin(rank), gpu_ranks[rank].state,
                                 gpu_ranks[rank].ws->span(), stream));
      }
      std::vector<std::vector<uint8_t>> cpu_reduced, gpu_reduced;
      std::vector<std::vector<uint8_t>> cpu_round0(world);  // each rank's round-0 payload
      for (int round = 0; round < 2; ++round) {
        CAPTURE(round);
        std::vector<std::vector<uint8_t>> cpu_sent(world), gpu_sent(world);
        const std::span<const uint8_t> cpu_prev =
            round == 0 ? std::span<const uint8_t>{} : std::span<const uint8_t>(cpu_reduced.back());
        const std::span<const uint8_t> gpu_prev =
            round == 0 ? std::span<const uint8_t>{} : std::span<const uint8_t>(gpu_reduced.back());
        for (size_t rank = 0; rank < world; ++rank) {
          CAPTURE(rank);
          cpu_sent[rank].resize(cpu.maxPayloadBytes(n));
          auto size = cpu.encodeChunk(rankCtx(rank), chunking, 0, round, cpu_prev, cin(rank),
                                      cpu_states[rank], cpu_ws[rank], cpu_sent[rank]);
          REQUIRE_MESSAGE(size.isOk(), size.status().message());
          cpu_sent[rank].resize(*size);
          GpuRank& g = gpu_ranks[rank];
          LW_STATUS_OK(gpu.encodeChunk(rankCtx(rank), chunking, 0, round, gpu_prev, gin(rank),
                                       g.state, g.ws->span(), g.payload->as<uint8_t>(),
                                       g.size->as<uint64_t>(), stream));
          LW_CUDA_CHECK_OK(cudaStreamSynchronize(stream));
          const uint64_t gpu_size = g.size->download<uint64_t>(1)[0];
          REQUIRE(gpu_size <= gpu.maxPayloadBytes(n));
          REQUIRE(gpu_size >= 32);
          gpu_sent[rank] = g.payload->download<uint8_t>(gpu_size);
          CHECK_MESSAGE(gpu_sent[rank] == cpu_sent[rank],
                        firstDifference(gpu_sent[rank], cpu_sent[rank]));
        }
        cpu_reduced.push_back(reduceInRankOrder(cpu, cpu_sent));
        gpu_reduced.push_back(reduceInRankOrder(cpu, gpu_sent));
        if (round == 0) cpu_round0 = cpu_sent;
      }
      const std::vector<std::span<const uint8_t>> cpu_views(cpu_reduced.begin(), cpu_reduced.end());
      const std::vector<std::span<const uint8_t>> gpu_views(gpu_reduced.begin(), gpu_reduced.end());
      // Decoding on both sides, from each side's own reduced payloads, into the same base.
      const std::vector<float> base = normalInput(n, 4242 + s);
      std::vector<float> cpu_out = base;
      LW_STATUS_OK(cpu.decodeRounds(cpu_views, weight, cpu_out.data(), n));
      DeviceMem gpu_out(n * sizeof(float));
      gpu_out.upload(base.data(), n * sizeof(float));
      DeviceMem scratch(gpu.accumulateScratchBytes(n));
      LW_STATUS_OK(
          gpu.decodeRounds(gpu_views, weight, gpu_out.as<float>(), n, scratch.span(), stream));
      LW_CUDA_CHECK_OK(cudaStreamSynchronize(stream));
      const std::vector<float> gpu_decoded = gpu_out.download<float>(n);
      const std::string decode_note = "decoded result differs, relative L2 error " +
                                      std::to_string(relL2(cpu_out, gpu_decoded));
      CHECK_MESSAGE(sameBits(gpu_decoded, cpu_out), decode_note);
      // The GPU decoding the CPU's reduced payloads (a peer on the other backend).
      if (!sameBits(gpu_decoded, cpu_out)) {
        gpu_out.upload(base.data(), n * sizeof(float));
        LW_STATUS_OK(
            gpu.decodeRounds(cpu_views, weight, gpu_out.as<float>(), n, scratch.span(), stream));
        LW_CUDA_CHECK_OK(cudaStreamSynchronize(stream));
        CHECK_MESSAGE(sameBits(gpu_out.download<float>(n), cpu_out),
                      "decoding the CPU's reduced payloads differs");
      }
      last_reduced = cpu_reduced;
      for (size_t rank = 0; rank < world; ++rank) {
        LW_STATUS_OK(cpu.finishStep(rankCtx(rank), chunking, cpu_views, weight, cin(rank),
                                    cpu_states[rank], cpu_ws[rank]));
        const std::vector<std::span<const uint8_t>> sent{cpu_round0[rank]};
        LW_STATUS_OK(cpu.commitState(rankCtx(rank), chunking, cin(rank), sent, {}, cpu_states[rank],
                                     cpu_ws[rank]));
        LW_STATUS_OK(gpu.finishStep(rankCtx(rank), chunking, gpu_views, weight, gin(rank),
                                    gpu_ranks[rank].state, gpu_ranks[rank].ws->span(), stream));
        // The commit recomputes the error from the input and what finishStep() kept; the work
        // area's M is overwritten first, as the GPU backend decodes the result there.
        LW_CUDA_CHECK_OK(
            cudaMemsetAsync(gpu_ranks[rank].state.work(), 0xFF, n * sizeof(float), stream));
        LW_STATUS_OK(commitOnGpu(gpu, rankCtx(rank), chunking, gin(rank), {}, gpu_ranks[rank].state,
                                 gpu_ranks[rank].ws->span(), stream));
      }
    }
    for (size_t rank = 0; rank < world; ++rank) {
      CAPTURE(rank);
      auto committed = gpu_ranks[rank].state.download(stream);
      REQUIRE_MESSAGE(committed.isOk(), committed.status().message());
      CHECK_MESSAGE(sameBits(*committed, hostState(cpu_states[rank])), "committed state differs");
      DeviceMem norm_scratch(CudaCodec::residualScratchBytes(n));
      auto g_norm = gpu.residualNorm2(gpu_ranks[rank].state, n, norm_scratch.span(), stream);
      REQUIRE_MESSAGE(g_norm.isOk(), g_norm.status().message());
      CHECK(*g_norm == cpu.residualNorm2(cpu_states[rank], n));
    }
  }
  if (carried_cpu != nullptr) {
    carried_cpu->clear();
    carried_gpu->clear();
    for (size_t rank = 0; rank < world; ++rank) {
      carried_cpu->push_back(cpu_states[rank]);
      auto committed = gpu_ranks[rank].state.download(stream);
      REQUIRE(committed.isOk());
      carried_gpu->push_back(std::move(*committed));
    }
  }
  gpu_ranks.clear();
  LW_CUDA_CHECK_OK(cudaStreamDestroy(stream));
  return last_reduced;
}

TEST_CASE("powersgd cuda: W ranks, shapes and ranks match the CPU bit for bit") {
  struct Shape {
    std::vector<uint64_t> shape;
    size_t n;
  };
  const std::vector<Shape> shapes = {
      {{64, 33}, 64 * 33},
      {{1, 1}, 1},
      {{1000, 7}, 7000},
      {{}, 1000},
      {{20, 3, 5}, 300},
      {{}, 1},  // flat 1 x 1
      {{}, 3},  // flat 2 x 2 with one padding element
  };
  for (const Shape& sh : shapes) {
    for (int rank : {1, 2, 4}) {
      for (size_t world : {1, 2, 3}) {
        PsgdCase pc;
        pc.approx_rank = rank;
        pc.shape = sh.shape;
        pc.n = sh.n;
        pc.world = world;
        pc.steps = 3;
        comparePowerSgd(pc);
      }
    }
  }
}

TEST_CASE("powersgd cuda: input kinds, dtypes, an empty tensor and a flush") {
  for (int kind = 0; kind < 5; ++kind) {
    PsgdCase pc;
    pc.approx_rank = 3;
    pc.shape = {48, 40};
    pc.n = 48 * 40;
    pc.world = 2;
    pc.kind = kind;
    comparePowerSgd(pc);
  }
  for (DType dtype : {DType::kF16, DType::kBF16}) {
    PsgdCase pc;
    pc.approx_rank = 2;
    pc.n = 2500;  // flat 50 x 50
    pc.world = 2;
    pc.dtype = dtype;
    pc.kind = 2;
    pc.flush_last = true;
    pc.steps = 4;
    comparePowerSgd(pc);
  }
  PsgdCase empty;
  empty.approx_rank = 2;
  empty.n = 0;
  empty.world = 2;
  comparePowerSgd(empty);
  empty.shape = {0, 5};
  comparePowerSgd(empty);
}

TEST_CASE("powersgd cuda: multi-block sums (> 4096 rows or columns) and several rank tiles") {
  {  // cols > 4096: round 0 sums two column blocks per row
    PsgdCase pc;
    pc.approx_rank = 2;
    pc.shape = {3, 9000};
    pc.n = 27000;
    pc.world = 2;
    pc.kind = 1;
    comparePowerSgd(pc);
  }
  {  // rows > 4096: round 1 and the orthonormalisation sum several row blocks
    PsgdCase pc;
    pc.approx_rank = 3;
    pc.shape = {9000, 5};
    pc.n = 45000;
    pc.world = 2;
    pc.kind = 0;
    comparePowerSgd(pc);
  }
  {  // rank 12: two rank tiles of the products; a flat view with padding
    PsgdCase pc;
    pc.approx_rank = 12;
    pc.n = 1234;  // flat 36 x 35 (26 padding elements)
    pc.world = 3;
    pc.kind = 1;
    comparePowerSgd(pc);
  }
  {  // a larger flat view
    PsgdCase pc;
    pc.approx_rank = 4;
    pc.n = 300000;
    pc.world = 2;
    pc.steps = 2;
    comparePowerSgd(pc);
  }
}

TEST_CASE("powersgd cuda: checkpoints restore across backends; a zeroed column is redrawn") {
  PsgdCase pc;
  pc.approx_rank = 3;
  pc.shape = {30, 20};
  pc.n = 600;
  pc.world = 2;
  pc.steps = 2;
  std::vector<CodecState> cpu_states;
  std::vector<std::vector<float>> gpu_states;
  comparePowerSgd(pc, &cpu_states, &gpu_states, 1);
  // Swap the backends' checkpoints: the CPU continues from the GPU's state and vice versa (they are
  // bitwise equal, so this also checks the upload / restore paths).
  std::vector<CodecState> from_gpu;
  for (size_t rank = 0; rank < pc.world; ++rank) {
    CodecState s(cpu_states[rank].floats());
    LW_STATUS_OK(s.restore(gpu_states[rank]));
    from_gpu.push_back(std::move(s));
    gpu_states[rank] = hostState(cpu_states[rank]);
  }
  comparePowerSgd(pc, &from_gpu, &gpu_states, 3);
  // Zero warm-start column 1 (valid meta kept): both backends draw it afresh.
  const size_t n = pc.n, r = 3;
  for (size_t rank = 0; rank < pc.world; ++rank) {
    std::vector<float> s = gpu_states[rank];
    REQUIRE(s[n] == 1.0f);
    for (size_t k = 0; k < 20; ++k) s[n + 8 + k * r + 1] = (k % 2 == 0) ? 0.0f : -0.0f;
    gpu_states[rank] = s;
    CodecState c(s.size());
    LW_STATUS_OK(c.restore(s));
    from_gpu[rank] = std::move(c);
  }
  comparePowerSgd(pc, &from_gpu, &gpu_states, 5);
  // A view change (another shape for the same n) discards the warm start on both.
  pc.shape = {20, 30};
  comparePowerSgd(pc, &from_gpu, &gpu_states, 7);
  pc.shape = {};
  comparePowerSgd(pc, &from_gpu, &gpu_states, 9);
}

// --- summation order -----------------------------------------------------------------------------
//
// With random inputs, a different association of the fp64 sums almost never changes the fp32
// result (the fp64 rounding errors are ~2^-29 of an fp32 ulp), so the tests above cannot tell a
// wrong summation order from the canonical one. These inputs can: terms 2^60, 0.25 and −2^60
// placed in chosen accumulators, 4096-blocks or combination slots sum to exactly 0 in the
// canonical order (the 0.25 is absorbed by 2^60 first) and to a non-zero value in any other.

constexpr float kBig = 0x1p60f;

/// A committed powersgd state for n elements with a valid warm start Q (cols × r) for the view.
std::vector<float> warmCheckpoint(const Codec& cpu, size_t n, uint64_t rows, uint64_t cols,
                                  uint64_t r, const std::vector<float>& q) {
  std::vector<float> s(cpu.stateFloats(n, std::vector<uint64_t>{rows, cols}), 0.0f);
  REQUIRE(q.size() == cols * r);
  REQUIRE(s.size() >= n + 8 + q.size());
  const float meta[8] = {1.0f,
                         float(rows >> 16),
                         float(rows & 0xFFFF),
                         float(cols >> 16),
                         float(cols & 0xFFFF),
                         float(r),
                         0.0f,
                         0.0f};
  std::copy(meta, meta + 8, s.begin() + static_cast<ptrdiff_t>(n));
  std::copy(q.begin(), q.end(), s.begin() + static_cast<ptrdiff_t>(n + 8));
  return s;
}

float factorValue(const std::vector<uint8_t>& payload, size_t index) {
  return loadF32(payload.data() + 32 + 4 * index);
}

TEST_CASE("powersgd cuda: round 0 sums in the canonical order (accumulators, tree, blocks)") {
  // Q = 1 (warm start, r = 1): P[i] is the canonical sum of row i; 4 column blocks per row.
  const uint64_t rows = 4, cols = 3 * 4096 + 100, n = rows * cols;
  auto cpu = createCodec(powersgdConfig(1));
  REQUIRE(cpu.isOk());
  PsgdCase pc;
  pc.approx_rank = 1;
  pc.shape = {rows, cols};
  pc.n = n;
  pc.input = [&](size_t step, size_t) {
    std::vector<float> m = normalInput(n, 70 + step);
    std::fill(m.begin(), m.begin() + 3 * cols, 0.0f);
    m[0 * cols + 0] = kBig;  // row 0: the combination ((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7))
    m[0 * cols + 1] = 0.25f;
    m[0 * cols + 4] = -kBig;
    m[1 * cols + 2] = 0.25f;  // row 1: accumulator a2 adds its terms in index order
    m[1 * cols + 10] = kBig;
    m[1 * cols + 18] = -kBig;
    m[2 * cols + 0] = 0.25f;  // row 2: block sums added in block order
    m[2 * cols + 4096] = kBig;
    m[2 * cols + 8192] = -kBig;
    return m;
  };
  std::vector<CodecState> cs;
  cs.emplace_back((*cpu)->stateFloats(n, pc.shape));
  std::vector<std::vector<float>> gs{
      warmCheckpoint(**cpu, n, rows, cols, 1, std::vector<float>(cols, 1.0f))};
  LW_STATUS_OK(cs[0].restore(gs[0]));
  pc.steps = 1;
  const auto reduced = comparePowerSgd(pc, &cs, &gs, 1);
  REQUIRE(reduced.size() == 2);
  for (size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(factorValue(reduced[0], i) == 0.0f);  // the construction is adversarial on the CPU
  }
  pc.steps = 2;  // and further steps from the committed (warm) state
  comparePowerSgd(pc, &cs, &gs, 2);
}

TEST_CASE("powersgd cuda: round 1 and the orthonormalisation sum in the canonical order") {
  // Warm Q = unit columns: S's columns are M's columns 6 (all 1.0), 0, 2 and 4 exactly, so P̂'s
  // column 0 is a constant c and the dots of columns 1..3 with it, and round 1's sums over the
  // rows of columns 0, 2, 4, meet the adversarial terms. 3 row blocks (nbr = 3).
  const uint64_t rows = 2 * 4096 + 64, cols = 8, n = rows * cols, r = 4;
  auto cpu = createCodec(powersgdConfig(4));
  REQUIRE(cpu.isOk());
  PsgdCase pc;
  pc.approx_rank = 4;
  pc.shape = {rows, cols};
  pc.n = n;
  pc.input = [&](size_t, size_t) {
    std::vector<float> m(n, 0.0f);
    auto at = [&](uint64_t i, uint64_t k) -> float& { return m[i * cols + k]; };
    for (uint64_t i = 0; i < rows; ++i) at(i, 6) = 1.0f;
    at(0, 0) = kBig;  // column 0: the combination of the eight accumulators
    at(1, 0) = 0.25f;
    at(4, 0) = -kBig;
    at(2, 2) = 0.25f;  // column 2: accumulator a2 in row order
    at(10, 2) = kBig;
    at(18, 2) = -kBig;
    at(5, 4) = 0.25f;  // column 4: the row blocks' sums in block order
    at(4096 + 5, 4) = kBig;
    at(8192 + 5, 4) = -kBig;
    // Columns 1, 3, 5 cancel 0, 2, 4 pairwise, so every row sums to exactly 1.
    for (uint64_t i = 0; i < rows; ++i) {
      for (uint64_t k : {0u, 2u, 4u}) at(i, k + 1) = -at(i, k);
    }
    return m;
  };
  std::vector<float> q(cols * r, 0.0f);
  q[6 * r + 0] = 1.0f;
  q[0 * r + 1] = 1.0f;
  q[2 * r + 2] = 1.0f;
  q[4 * r + 3] = 1.0f;
  std::vector<CodecState> cs;
  cs.emplace_back((*cpu)->stateFloats(n, pc.shape));
  std::vector<std::vector<float>> gs{warmCheckpoint(**cpu, n, rows, cols, r, q)};
  LW_STATUS_OK(cs[0].restore(gs[0]));
  pc.steps = 1;
  const auto reduced = comparePowerSgd(pc, &cs, &gs, 1);
  REQUIRE(reduced.size() == 2);
  for (uint64_t k : {0u, 2u, 4u}) {
    CAPTURE(k);
    CHECK(factorValue(reduced[1], k * r + 0) == 0.0f);  // adversarial on the CPU
  }
  pc.steps = 2;
  comparePowerSgd(pc, &cs, &gs, 2);
}

TEST_CASE("powersgd cuda: decoding sums the rank terms in the canonical order") {
  // S = a 32 x 32 Hadamard matrix: orthogonal columns (every dot exactly 0), so P̂ = S / √32 and
  // row 0 of P̂ is a constant c. T's rows 0 and 1 put 2^62, 1, −2^62 in the combination and in
  // one accumulator (r = 32: four terms per accumulator).
  const uint32_t rows = 32, cols = 32, r = 32;
  const size_t n = size_t{rows} * cols;
  const CodecConfig config = powersgdConfig(32);
  auto cpu = createCodec(config);
  auto gpu = createCudaCodec(config);
  REQUIRE(cpu.isOk());
  REQUIRE(gpu.isOk());
  auto payload = [&](int round, const std::vector<float>& v) {
    std::vector<uint8_t> p(32 + 4 * v.size());
    writeHeader(p.data(), {CodecId::kPowersgd, DType::kF32, 0, static_cast<uint8_t>(round), n});
    storeU32(p.data() + 16, rows);
    storeU32(p.data() + 20, cols);
    storeU32(p.data() + 24, r);
    storeU32(p.data() + 28, 0);
    for (size_t i = 0; i < v.size(); ++i) storeF32(p.data() + 32 + 4 * i, v[i]);
    return p;
  };
  std::vector<float> s(size_t{rows} * r), t = normalInput(size_t{cols} * r, 5);
  for (uint32_t i = 0; i < rows; ++i) {
    for (uint32_t j = 0; j < r; ++j) s[i * r + j] = (std::popcount(i & j) % 2) ? -1.0f : 1.0f;
  }
  std::fill(t.begin(), t.begin() + 2 * r, 0.0f);
  t[0 * r + 0] = 0x1p62f;  // k = 0: ((a0 + a1) + ...) + ((a4 + ...) ...)
  t[0 * r + 1] = 1.0f;
  t[0 * r + 4] = -0x1p62f;
  t[1 * r + 2] = 1.0f;  // k = 1: accumulator a2 takes j = 2, 10, 18, 26 in order
  t[1 * r + 10] = 0x1p62f;
  t[1 * r + 18] = -0x1p62f;
  const std::vector<std::vector<uint8_t>> rounds{payload(0, s), payload(1, t)};
  const std::vector<std::span<const uint8_t>> views(rounds.begin(), rounds.end());
  const std::vector<float> base = normalInput(n, 6);
  std::vector<float> cpu_out = base;
  LW_STATUS_OK((*cpu)->decodeRounds(views, 0.37f, cpu_out.data(), n));
  CHECK(cpu_out[0] == base[0]);  // v = 0 exactly: adversarial on the CPU
  CHECK(cpu_out[1] == base[1]);
  DeviceMem out(n * 4), scratch((*gpu)->accumulateScratchBytes(n));
  out.upload(base.data(), n * 4);
  LW_STATUS_OK((*gpu)->decodeRounds(views, 0.37f, out.as<float>(), n, scratch.span(), nullptr));
  LW_CUDA_CHECK_OK(cudaDeviceSynchronize());
  CHECK(sameBits(out.download<float>(n), cpu_out));
}

TEST_CASE("powersgd cuda: hostile reduced payloads, decodeChunk and the device-side guards") {
  const size_t n = 600;
  const std::vector<uint64_t> shape{30, 20};
  const CodecConfig config = powersgdConfig(2);
  auto cpu = createCodec(config);
  auto gpu = createCudaCodec(config);
  REQUIRE(cpu.isOk());
  REQUIRE(gpu.isOk());
  // A valid step on the CPU gives reduced payloads to mutate.
  StepContext ctx;
  ctx.shape = shape;
  ctx.step = 4;
  const Chunking chunking = chunkingFor(**cpu, n, 0);
  CodecState cs((*cpu)->stateFloats(n));
  std::vector<std::byte> ws((*cpu)->workspaceBytes(chunking));
  const auto x = normalInput(n, 31);
  const ConstTensor cin{x.data(), n};
  LW_STATUS_OK((*cpu)->analyze(ctx, chunking, cin, cs, ws));
  std::vector<std::vector<uint8_t>> reduced(2);
  for (int round = 0; round < 2; ++round) {
    reduced[round].resize((*cpu)->maxPayloadBytes(n));
    auto size = (*cpu)->encodeChunk(
        ctx, chunking, 0, round,
        round == 0 ? std::span<const uint8_t>{} : std::span<const uint8_t>(reduced[0]), cin, cs, ws,
        reduced[round]);
    REQUIRE(size.isOk());
    reduced[round].resize(*size);
  }
  auto gpuDecodeRejected = [&](const std::vector<std::vector<uint8_t>>& rounds) {
    const std::vector<std::span<const uint8_t>> views(rounds.begin(), rounds.end());
    std::vector<float> cpu_out(n, 1.5f);
    CHECK_FALSE((*cpu)->decodeRounds(views, 1.0f, cpu_out.data(), n).isOk());
    DeviceMem out(n * 4), scratch((*gpu)->accumulateScratchBytes(n));
    const std::vector<float> base(n, 1.5f);
    out.upload(base.data(), n * 4);
    CHECK_FALSE(
        (*gpu)->decodeRounds(views, 1.0f, out.as<float>(), n, scratch.span(), nullptr).isOk());
    LW_CUDA_CHECK_OK(cudaDeviceSynchronize());
    CHECK(sameBits(out.download<float>(n), base));
  };
  auto mutated = [&](int round, auto&& f) {
    auto rounds = reduced;
    f(rounds[round]);
    return rounds;
  };
  gpuDecodeRejected({reduced[0]});                                              // one round only
  gpuDecodeRejected({reduced[1], reduced[0]});                                  // rounds swapped
  gpuDecodeRejected(mutated(0, [](auto& p) { p.pop_back(); }));                 // truncated
  gpuDecodeRejected(mutated(1, [](auto& p) { p.push_back(0); }));               // trailing byte
  gpuDecodeRejected(mutated(0, [](auto& p) { p[3] = 0; }));                     // no dense escape
  gpuDecodeRejected(mutated(0, [](auto& p) { p[5] = 1; }));                     // flags
  gpuDecodeRejected(mutated(1, [](auto& p) { p[6] = 2; }));                     // round 2
  gpuDecodeRejected(mutated(0, [](auto& p) { storeU64(p.data() + 8, 601); }));  // elements
  gpuDecodeRejected(mutated(0, [](auto& p) { storeU32(p.data() + 28, 1); }));   // reserved
  gpuDecodeRejected(mutated(0, [](auto& p) { storeU32(p.data() + 24, 1); }));   // rank
  gpuDecodeRejected(mutated(1, [](auto& p) { storeU32(p.data() + 16, 1); }));   // view
  gpuDecodeRejected(mutated(0, [](auto& p) {  // another view (20 x 30) in round 0 only
    storeU32(p.data() + 16, 20);
    storeU32(p.data() + 20, 30);
  }));

  // decodeChunk is refused (two rounds), as on the CPU.
  {
    std::vector<float> sink(n);
    CHECK_FALSE((*cpu)->decodeChunk(reduced[0], 1.0f, sink.data(), n).isOk());
    DeviceMem out(n * 4), scratch((*gpu)->decodeScratchBytes(reduced[0].size(), n));
    const Status st =
        (*gpu)->decodeChunk(reduced[0], 1.0f, out.as<float>(), n, scratch.span(), nullptr);
    CHECK_FALSE(st.isOk());
    CHECK(st.message().find("decodeRounds") != std::string::npos);
  }

  // Device-side guards: encoding with another view than analyze() used gives a 0-byte payload
  // (the CPU refuses); a second finishStep() changes nothing (the CPU refuses it).
  auto st = DeviceState::create((*gpu)->stateFloats(n));
  REQUIRE(st.isOk());
  DeviceState gs = std::move(*st);
  DeviceMem d_in(n * 4), gws((*gpu)->workspaceBytes(chunking));
  DeviceMem d_payload((*gpu)->maxPayloadBytes(n)), d_size(8);
  d_in.upload(x.data(), n * 4);
  const DeviceTensor gin{d_in.as(), n, DType::kF32};
  LW_STATUS_OK((*gpu)->analyze(ctx, chunking, gin, gs, gws.span(), nullptr));
  StepContext other = ctx;
  const std::vector<uint64_t> other_shape{20, 30};
  other.shape = other_shape;
  LW_STATUS_OK((*gpu)->encodeChunk(other, chunking, 0, 0, {}, gin, gs, gws.span(),
                                   d_payload.as<uint8_t>(), d_size.as<uint64_t>(), nullptr));
  LW_CUDA_CHECK_OK(cudaDeviceSynchronize());
  CHECK(d_size.download<uint64_t>(1)[0] == 0);
  {
    CodecState c2((*cpu)->stateFloats(n));
    std::vector<std::byte> w2((*cpu)->workspaceBytes(chunking));
    LW_STATUS_OK((*cpu)->analyze(ctx, chunking, cin, c2, w2));
    std::vector<uint8_t> out((*cpu)->maxPayloadBytes(n));
    CHECK_FALSE((*cpu)->encodeChunk(other, chunking, 0, 0, {}, cin, c2, w2, out).isOk());
  }
  // The real step, then finishStep twice on the GPU (once on the CPU): the same committed state.
  const std::vector<std::span<const uint8_t>> views(reduced.begin(), reduced.end());
  LW_STATUS_OK((*cpu)->finishStep(ctx, chunking, views, 1.0f, cin, cs, ws));
  CHECK_FALSE((*cpu)->finishStep(ctx, chunking, views, 1.0f, cin, cs, ws).isOk());
  LW_STATUS_OK((*gpu)->finishStep(ctx, chunking, views, 1.0f, gin, gs, gws.span(), nullptr));
  LW_STATUS_OK((*gpu)->finishStep(ctx, chunking, views, 1.0f, gin, gs, gws.span(), nullptr));
  const std::vector<std::span<const uint8_t>> sent{reduced[0]};  // W = 1: round 0 as sent
  LW_STATUS_OK((*cpu)->commitState(ctx, chunking, cin, sent, {}, cs, ws));
  LW_STATUS_OK(commitOnGpu(**gpu, ctx, chunking, gin, sent, gs, gws.span(), nullptr));
  auto committed = gs.download(nullptr);
  REQUIRE(committed.isOk());
  CHECK(sameBits(*committed, hostState(cs)));
  // finishStep with reduced payloads of another view is refused before anything is enqueued.
  const auto bad = mutated(0, [](auto& p) {
    storeU32(p.data() + 16, 20);
    storeU32(p.data() + 20, 30);
  });
  const std::vector<std::span<const uint8_t>> bad_views(bad.begin(), bad.end());
  CHECK_FALSE(
      (*gpu)->finishStep(ctx, chunking, bad_views, 1.0f, gin, gs, gws.span(), nullptr).isOk());
  // More than one chunk is refused.
  const Chunking two{n, 300};
  CHECK_FALSE((*gpu)->analyze(ctx, two, gin, gs, gws.span(), nullptr).isOk());
  // error_feedback = true is refused (powersgd keeps its own memory).
  CodecConfig ef = config;
  ef.error_feedback = true;
  CHECK_FALSE(createCudaCodec(ef).isOk());
}

}  // namespace test_randomk_powersgd_cuda
}  // namespace lightwire::kernels::cuda::testing
