// `dgc`, Deep Gradient Compression, on the GPU (docs/determinism.md §4.4), byte-identical to
// kernels/codecs/dgc.cc, with the same state layout (u then v with momentum, then c with bias
// correction; v alone without momentum).
//
// analyze(), all on the stream, nothing copied to the host:
//   1. clipping (clip_norm > 0): the canonical fp64 sum of squares of x (kernels/cuda/reduce.h),
//      then one thread: N = sqrt, f = (float)(clip_norm / N) when N > clip_norm;
//   n > 32768 (sampled threshold):
//   2. the M sample keys key(v'_idx(j)), v' computed from x, u, v at the sampled index exactly as
//      the fused pass will (the Philox words of §3/§4.4), sorted descending (CUB radix sort);
//   3. the fused pass, the one full pass over the state: v' = v + u' with u' = (m·u) + g (or v' =
//      v + g) into the work area (u' is not stored), and c = #{key(v') >= s_r} counted (r the
//      initial rank);
//   4. acceptance and up to three refinements of §4.4: a one-thread kernel decides, a counting
//      pass over v' recounts (both do nothing once decided);
//   5. the exact top-k fallback on v' (kernels/cuda/codecs/sparse.cuh), whose kernels do nothing
//      unless step 4 chose it;
//   n <= 32768: the fused pass, then exact top-k on v';
//   6. min_magnitude on the plan.
// encodeChunk(): the chunk's compaction and payload from v' (sparse.cuh). Without momentum its
// last kernel also masks what was sent, v'_i = v'_i − value_i (step 6 of §4.4): the work area is
// the whole next state, which the commit copies. With momentum the state is u then v (2n; u, v, c
// with bias correction: 3n) and the work area v' alone (n: docs/cuda.md "Memory"): commitState()
// recomputes u', v' (and c') in place from the state and the input (the fused pass's arithmetic,
// the clipping analyze() decided), then masks what was sent, v_i −= value_i and u_i = c_i = 0,
// read back from the sent payloads — the CPU codec's
// commit, so the state is bit-identical to the host's; the work area is free for the result once
// the step's chunks are encoded.
//
// Arithmetic is spelled out (__fmul_rn, __fadd_rn, __fdiv_rn, __dsqrt_rn, __ddiv_rn,
// __double2float_rn), so
// every finite v' is bit-identical to the CPU's; only NaN payload bits produced by arithmetic may
// differ (determinism.md §1), which never changes which finite elements are selected.

#include <cub/block/block_reduce.cuh>
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>

#include "kernels/cuda/codecs/sparse.cuh"
#include "kernels/cuda/reduce.h"
#include "kernels/philox.h"

namespace lightwire::kernels::cuda {
namespace {

using sparse::DeviceCarver;
using sparse::SelectState;
using U128 = unsigned __int128;

constexpr size_t kExactMaxElements = 32768;
constexpr size_t kMinSamples = 1024;
constexpr int kMaxRefinements = 3;

/// Steps 1–3 for one element (dgcNext in kernels/select.h, the host's fused pass).
struct Accumulate {
  const float* u;  // momentum (read only with `momentum`)
  const float* v;  // accumulated residual
  const float* c;  // bias correction (read only with `bias`)
  bool momentum;
  bool bias;
  float m;
  float w;  // (float)(1 − m)
  /// v'_i; u'_i and c'_i to *u_prime and *c_prime where kept and asked for.
  template <DType D>
  __device__ __forceinline__ float at(const void* x, size_t i, bool clip, float factor,
                                      float* u_prime = nullptr, float* c_prime = nullptr) const {
    const float xi = loadWidenedDevice<D>(x, i);
    const float g = clip ? __fmul_rn(xi, factor) : xi;
    if (momentum) {
      const float ui = __fadd_rn(__fmul_rn(m, u[i]), g);
      if (u_prime != nullptr) *u_prime = ui;
      if (bias) {  // c' = (m · c) + 1, v' = v + (u' / (c' · w))
        const float ci = __fadd_rn(__fmul_rn(m, c[i]), 1.0f);
        if (c_prime != nullptr) *c_prime = ci;
        return __fadd_rn(v[i], __fdiv_rn(ui, __fmul_rn(ci, w)));
      }
      return __fadd_rn(v[i], ui);
    }
    return __fadd_rn(v[i], g);
  }
};

__device__ __forceinline__ void clipFrom(double total, double clip_norm, uint32_t* clip,
                                         float* factor) {
  const double norm = __dsqrt_rn(total);
  if (norm > clip_norm) {
    *clip = 1;
    *factor = __double2float_rn(__ddiv_rn(clip_norm, norm));
  } else {
    *clip = 0;
    *factor = 1.0f;
  }
}

/// One thread: the clipping decision from the canonical sum of squares.
__global__ void clipFactorKernel(const double* total, double clip_norm, SelectState* s) {
  clipFrom(*total, clip_norm, &s->clip, &s->factor);
}

/// Sample j (< m) of §4.4: word j mod 4 of Philox group j / 4 gives the index (r · n) >> 32; its
/// key is key(v'_index), computed as the fused pass computes it. One thread per group.
template <DType D>
__global__ void __launch_bounds__(kBlockThreads)
    sampleKernel(const void* __restrict__ x, Accumulate acc, const SelectState* s,
                 DevicePhilox philox, size_t n, size_t m, uint32_t* __restrict__ keys) {
  const bool clip = s->clip != 0;
  const float factor = s->factor;
  const size_t groups = (m + 3) / 4;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t g = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += stride) {
    const uint4 w = philox.group(g);
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
    for (size_t q = 0; q < 4 && 4 * g + q < m; ++q) {
      // (r · n) >> 32 for r < 2^32: the high 64 bits of (r · 2^32) · n.
      const size_t index = __umul64hi(static_cast<uint64_t>(words[q]) << 32, n);
      keys[4 * g + q] = sparse::keyOf(acc.at<D>(x, index, clip, factor));
    }
  }
}

/// Adds the block's count to *total (one atomic per block; integer, so exact in any order).
template <typename Reduce>
__device__ __forceinline__ void addCount(typename Reduce::TempStorage& temp, unsigned long long c,
                                         unsigned long long* total) {
  const unsigned long long sum = Reduce(temp).Sum(c);
  if (threadIdx.x == 0 && sum != 0) atomicAdd(total, sum);
}

/// The fused pass: v' everywhere; with Count, *count += #{key(v') >= *threshold}.
template <DType D, bool Count>
__global__ void __launch_bounds__(kBlockThreads)
    fusedPassKernel(const void* __restrict__ x, Accumulate acc, const SelectState* s, size_t n,
                    float* __restrict__ vn, const uint32_t* __restrict__ threshold,
                    unsigned long long* count) {
  using Reduce = cub::BlockReduce<unsigned long long, kBlockThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const bool clip = s->clip != 0;
  const float factor = s->factor;
  uint32_t t = 0;
  if constexpr (Count) t = *threshold;
  unsigned long long c = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float vi = acc.at<D>(x, i, clip, factor);
    vn[i] = vi;
    if constexpr (Count) c += sparse::keyOf(vi) >= t;
  }
  if constexpr (Count) addCount<Reduce>(temp, c, count);
}

/// The commit's pass with momentum (steps 2–3 in place): u = (m·u) + g, v = v + u (with bias
/// correction c = (m·c) + 1 and v = v + (u / (c·w))), with the clipping analyze() decided —
/// Accumulate's arithmetic over the state it reads, so u, v, c are the fused pass's u', v', c'.
template <DType D>
__global__ void __launch_bounds__(kBlockThreads)
    commitPassKernel(const void* __restrict__ x, Accumulate acc, float* u, float* v, float* c,
                     const SelectState* s, size_t n) {
  const bool clip = s->clip != 0;
  const float factor = s->factor;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float ui = 0.0f, ci = 0.0f;
    const float vi = acc.at<D>(x, i, clip, factor, &ui, &ci);
    u[i] = ui;
    if (c != nullptr) c[i] = ci;
    v[i] = vi;
  }
}

/// Recount for a refined threshold: s->count += #{key(v') >= s->sample_threshold}, unless decided.
__global__ void __launch_bounds__(kBlockThreads)
    countKernel(const float* __restrict__ vn, size_t n, SelectState* s) {
  using Reduce = cub::BlockReduce<unsigned long long, kBlockThreads>;
  __shared__ typename Reduce::TempStorage temp;
  if (s->decided != 0) return;  // uniform
  const uint32_t t = s->sample_threshold;
  unsigned long long c = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    c += sparse::keyOf(vn[i]) >= t;
  }
  addCount<Reduce>(temp, c, &s->count);
}

__device__ __forceinline__ unsigned long long clampRank(U128 r, unsigned long long m) {
  return static_cast<unsigned long long>(r < 1 ? U128{1} : (r > m ? U128{m} : r));
}

/// One thread, refinement `iter` of §4.4 (refine() in kernels/codecs/dgc.cc) on the count c of
/// threshold s_r: accept, or choose the next rank (the recount follows), or fall back to exact.
__global__ void decideKernel(SelectState* s, const uint32_t* sorted, int iter,
                             unsigned long long r0, unsigned long long k, unsigned long long m,
                             unsigned long long lo, unsigned long long hi, unsigned long long n) {
  if (iter == 0) {
    s->rank = r0;
    s->sample_threshold = sorted[r0 - 1];
  }
  if (s->decided != 0) return;
  const unsigned long long c = s->count;
  const unsigned long long r = s->rank;
  if (lo <= c && c <= hi) {  // S = {i : key(v'_i) >= T}
    s->decided = 1;
    s->threshold = s->sample_threshold;
    s->tie_end = n;
    s->none = 0;
    return;
  }
  if (iter == kMaxRefinements) {
    s->decided = 1;
    s->exact = 1;
    return;
  }
  // c >= 1 always (the sampled element qualifies); guarded anyway.
  const unsigned long long cc = c == 0 ? 1 : c;
  unsigned long long next = clampRank((U128{2} * r * k + c) / (U128{2} * cc), m);
  if (next == r) {
    if (c > hi) {
      if (r == 1) {
        s->decided = 1;
        s->exact = 1;
        return;
      }
      next = r - 1;
    } else {
      if (r == m) {
        s->decided = 1;
        s->exact = 1;
        return;
      }
      next = r + 1;
    }
  }
  s->rank = next;
  s->sample_threshold = sorted[next - 1];
  s->count = 0;
}

// --- flush ---------------------------------------------------------------------------------------

/// n <= 4096 (one canonical block), one block of threads: the clipping decision computed in place
/// (no scratch needed), then out = v'.
template <DType D>
__global__ void __launch_bounds__(kBlockThreads)
    smallFlushKernel(const void* __restrict__ x, Accumulate acc, size_t n, double clip_norm,
                     float* __restrict__ out) {
  __shared__ double a[8];
  __shared__ uint32_t clip;
  __shared__ float factor;
  if (clip_norm > 0.0) {
    if (threadIdx.x < 8) {  // accumulator j: the elements ≡ j (mod 8), in increasing order
      double sum = 0.0;
      for (size_t i = threadIdx.x; i < n; i += 8) {
        const double d = static_cast<double>(loadWidenedDevice<D>(x, i));
        sum = __dadd_rn(sum, __dmul_rn(d, d));
      }
      a[threadIdx.x] = sum;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      const double block = __dadd_rn(__dadd_rn(__dadd_rn(a[0], a[1]), __dadd_rn(a[2], a[3])),
                                     __dadd_rn(__dadd_rn(a[4], a[5]), __dadd_rn(a[6], a[7])));
      clipFrom(__dadd_rn(0.0, block), clip_norm, &clip, &factor);
    }
  } else if (threadIdx.x == 0) {
    clip = 0;
    factor = 1.0f;
  }
  __syncthreads();
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
    out[i] = acc.at<D>(x, i, clip != 0, factor);
  }
}

/// One thread: total = +0.0 + s_0 + s_1 + ..., then the clipping decision, written over the
/// block sums' first eight bytes (read first): {u32 clip, f32 factor}.
__global__ void flushClipKernel(double* block_sums, size_t blocks, double clip_norm) {
  double t = 0.0;
  for (size_t b = 0; b < blocks; ++b) t = __dadd_rn(t, block_sums[b]);
  uint32_t clip;
  float factor;
  clipFrom(t, clip_norm, &clip, &factor);
  auto* words = reinterpret_cast<uint32_t*>(block_sums);
  words[0] = clip;
  words[1] = __float_as_uint(factor);
}

/// out = v' (steps 1–3); clip_info: {clip, factor bits} or null (no clipping).
template <DType D>
__global__ void __launch_bounds__(kBlockThreads)
    flushKernel(const void* __restrict__ x, Accumulate acc, size_t n,
                const uint32_t* __restrict__ clip_info, float* __restrict__ out) {
  const bool clip = clip_info != nullptr && clip_info[0] != 0;
  const float factor = clip_info != nullptr ? __uint_as_float(clip_info[1]) : 1.0f;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = acc.at<D>(x, i, clip, factor);
  }
}

// --- the codec -----------------------------------------------------------------------------------

size_t sortTempBytes(size_t m) {
  if (m == 0) return 0;
  size_t bytes = 0;
  if (cub::DeviceRadixSort::SortKeysDescending(
          nullptr, bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr), m,
          0, 31, nullptr) != cudaSuccess) {
    (void)cudaGetLastError();
    bytes = 4096 + 16 * m;  // no usable device: nothing will run
  }
  return bytes;
}

class DgcCuda final : public sparse::SparseCudaCodec {
 public:
  DgcCuda(std::unique_ptr<Codec> host, double density)
      : SparseCudaCodec(std::move(host), CodecId::kDgc), density_(density) {
    const CodecConfig& c = host_->config();
    momentum_ = c.momentum > 0.0;
    bias_ = momentum_ && c.bias_correction;
    m_ = static_cast<float>(c.momentum);
    w_ = static_cast<float>(1.0 - c.momentum);
    clip_norm_ = c.clip_norm;
    sample_fraction_ = c.sample_fraction;
  }

  /// The plan and the exact selection's counters, one chunk's encoding scratch, the clipping
  /// norm's block sums (+ total), the sample keys (unsorted, sorted) and the sort's storage.
  size_t workspaceBytes(const Chunking& c) const override {
    const size_t n = c.elements, m = samples(n);
    return sparse::kAlign + sparse::selectWsBytes(n) + sparse::encodeWsBytes(largestChunk(c)) +
           sparse::alignUp((canonicalBlocks(n) + 1) * sizeof(double)) +
           2 * sparse::alignUp(m * sizeof(uint32_t)) + sparse::alignUp(sortTempBytes(m));
  }

  /// The work area holds v' (n), with or without momentum.
  size_t workFloats(size_t n, std::span<const uint64_t>) const override { return n; }
  /// With momentum the commit recomputes u' and v' from the input and masks what was sent.
  bool commitReadsInput() const override { return momentum_; }
  size_t commitScratchBytes(size_t payload_bytes, size_t chunk_elements) const override {
    return momentum_ ? decodeScratchBytes(payload_bytes, chunk_elements) : 0;
  }

  /// Without momentum: the masked v' over v. With momentum: steps 2–3 in place (u = u', v = v'),
  /// then step 6 from the payloads as sent: v_i = v_i − value_i (decoded with weight −1, the
  /// same operation) and u_i = 0 for every entry.
  Status commitState(const StepContext& ctx, const Chunking& chunking, DeviceTensor input,
                     std::span<const std::span<const uint8_t>> sent, DeviceState& state,
                     DeviceBytes workspace, DeviceBytes scratch,
                     cudaStream_t stream) const override {
    if (!momentum_) {
      return CudaCodec::commitState(ctx, chunking, input, sent, state, workspace, scratch, stream);
    }
    const size_t n = chunking.elements;
    if (n == 0) return Status::ok();
    const std::string name = "dgc (cuda): commit";
    if (state.floats() != stateFloats(n) || input.elements != n ||
        workspace.size < workspaceBytes(chunking) || workspace.data == nullptr) {
      return invalidArgument(name + ": the state, input or workspace is not the step's");
    }
    if (sent.size() != chunking.count()) {
      return invalidArgument(name + ": " + std::to_string(sent.size()) + " sent payloads for " +
                             std::to_string(chunking.count()) + " chunks");
    }
    // The payloads are this codec's own, but the device reads them without bounds: checked on
    // the host first (O(entries)), before anything changes.
    for (size_t c = 0; c < sent.size(); ++c) {
      if (Status st = sparse::validateSparse(sent[c], CodecId::kDgc, chunking.size(c));
          !st.isOk()) {
        return invalidArgument(name + ": chunk " + std::to_string(c) + ": " + st.message());
      }
      const size_t need = commitScratchBytes(sent[c].size(), chunking.size(c));
      if (scratch.size < need || scratch.data == nullptr) {
        return invalidArgument(name + ": scratch of " + std::to_string(scratch.size) +
                               " bytes, chunk " + std::to_string(c) + " needs " +
                               std::to_string(need));
      }
    }
    const Carved w = carve(workspace, chunking);
    float* u = state.mutableCurrent();
    float* v = u + n;
    float* cb = bias_ ? v + n : nullptr;
    const Accumulate acc = accumulation(u, n);
    visitDeviceDType(input.dtype, [&](auto d) {
      commitPassKernel<decltype(d)::value><<<blocksFor(n), kBlockThreads, 0, stream>>>(
          input.data, acc, u, v, cb, w.select.state, n);
    });
    LW_RETURN_IF_ERROR(cudaStatus(cudaGetLastError(), name));
    for (size_t c = 0; c < sent.size(); ++c) {
      const size_t begin = chunking.begin(c), len = chunking.size(c);
      // The stream orders this chunk's staging after the previous chunk's masking, which read
      // the same scratch.
      auto staged = stage(sent[c], scratch, stream, name + ": staging a sent payload");
      if (!staged) return staged.status();
      LW_RETURN_IF_ERROR(cudaStatus(
          sparse::accumulateSparse(staged->payload, -1.0f, v + begin, len, staged->rest, stream,
                                   u + begin, cb == nullptr ? nullptr : cb + begin),
          name + ": masking what was sent"));
    }
    return Status::ok();
  }

  /// After a flush everything accumulated was sent: u = v = 0.
  Status commitFlush(DeviceState& state, cudaStream_t stream) const override {
    return state.reset(stream);
  }

  /// Σ v_i² of the committed accumulated velocity (not the momentum u).
  Result<double> residualNorm2(const DeviceState& state, size_t n, DeviceBytes scratch,
                               cudaStream_t stream) const override {
    if (n == 0 || state.floats() != stateFloats(n)) return 0.0;
    if (scratch.size < residualScratchBytes(n) || scratch.data == nullptr) {
      return invalidArgument("dgc (cuda): residual norm scratch of " +
                             std::to_string(scratch.size) + " bytes, needs " +
                             std::to_string(residualScratchBytes(n)));
    }
    const float* v = momentum_ ? state.current() + n : state.current();
    auto* sums = static_cast<double*>(scratch.data);
    double* total = sums + canonicalBlocks(n);
    double host = 0.0;
    cudaError_t e = canonicalSum(v, DType::kF32, n, ReduceTerm::kSquare, sums, total, stream);
    if (e == cudaSuccess) {
      e = cudaMemcpyAsync(&host, total, sizeof(double), cudaMemcpyDeviceToHost, stream);
    }
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    if (e != cudaSuccess) return cudaStatus(e, "dgc (cuda): residual norm");
    return host;
  }

 protected:
  Status doAnalyze(const StepContext& ctx, const Chunking& chunking, DeviceTensor input,
                   DeviceState& state, DeviceBytes workspace, cudaStream_t stream) const override {
    const size_t n = chunking.elements;
    double density = density_;
    if (ctx.density) {
      LW_RETURN_IF_ERROR(checkDensity(*ctx.density, "dgc: step density"));
      density = *ctx.density;
    }
    const Carved w = carve(workspace, chunking);
    if (n == 0) {
      return cudaStatus(sparse::setPlan(w.select.state, 0, 0, /*none=*/true, stream),
                        "dgc (cuda): selection");
    }
    return cudaStatus(analyzeOn(ctx, n, density, input, state, w, stream), "dgc (cuda): analyze");
  }

  Status doEncodeChunk(const StepContext&, const Chunking& chunking, size_t chunk, int,
                       std::span<const uint8_t>, DeviceTensor input, DeviceState& state,
                       DeviceBytes workspace, uint8_t* d_out, uint64_t* d_size,
                       cudaStream_t stream) const override {
    const size_t n = chunking.elements;
    const size_t begin = chunking.begin(chunk), len = chunking.size(chunk);
    LW_RETURN_IF_ERROR(checkChunk(len));
    const Carved w = carve(workspace, chunking);
    float* vn = n == 0 ? nullptr : state.work();
    sparse::PlanArg plan;
    plan.dev = w.select.state;
    // Without momentum the work area is the next state: what is sent is masked there now. With
    // momentum the commit masks the state itself.
    return cudaStatus(sparse::encodeChunk(CodecId::kDgc, input.dtype, values_, plan,
                                          DeviceTensor{vn, n, DType::kF32}, begin, len, w.encode,
                                          d_out, d_size, momentum_ ? nullptr : vn, nullptr, stream),
                      "dgc (cuda): encoding a chunk");
  }

  /// Steps 1–3 of analyze, bit for bit, then everything accumulated is sent: out = v'
  /// (commitFlush() zeroes u and v). No workspace: the clipping norm's block sums go to
  /// state.work() (n > 4096), a one-block kernel does it all for n <= 4096.
  Status doFlush(const StepContext&, const Chunking& chunking, DeviceTensor input,
                 DeviceState& state, float* d_out, cudaStream_t stream) const override {
    const size_t n = chunking.elements;
    if (n == 0) return Status::ok();
    const Accumulate acc = accumulation(state.current(), n);
    const bool clip = clip_norm_ > 0.0;
    cudaError_t e = cudaSuccess;
    if (n <= kReduceBlock) {
      visitDeviceDType(input.dtype, [&](auto d) {
        smallFlushKernel<decltype(d)::value>
            <<<1, kBlockThreads, 0, stream>>>(input.data, acc, n, clip_norm_, d_out);
      });
      e = cudaGetLastError();
    } else {
      auto* sums = reinterpret_cast<double*>(state.work());  // cudaMalloc'd: aligned
      if (clip) {
        e = canonicalBlockSums(input.data, input.dtype, n, ReduceTerm::kSquare, sums, stream);
        if (e == cudaSuccess) {
          flushClipKernel<<<1, 1, 0, stream>>>(sums, canonicalBlocks(n), clip_norm_);
          e = cudaGetLastError();
        }
      }
      if (e == cudaSuccess) {
        const auto* clip_info = clip ? reinterpret_cast<const uint32_t*>(sums) : nullptr;
        visitDeviceDType(input.dtype, [&](auto d) {
          flushKernel<decltype(d)::value>
              <<<blocksFor(n), kBlockThreads, 0, stream>>>(input.data, acc, n, clip_info, d_out);
        });
        e = cudaGetLastError();
      }
    }
    return cudaStatus(e, "dgc (cuda): flush");
  }

 private:
  struct Carved {
    sparse::SelectWs select;
    sparse::EncodeWs encode;
    double* block_sums;  // canonicalBlocks(n), then the total
    uint32_t* keys;      // samples(n)
    uint32_t* sorted;    // samples(n)
    void* sort_temp;
    size_t sort_bytes;
  };

  static size_t largestChunk(const Chunking& c) { return std::min(c.chunk_elements, c.elements); }

  Carved carve(DeviceBytes workspace, const Chunking& chunking) const {
    const size_t n = chunking.elements, m = samples(n);
    DeviceCarver carver(workspace);
    Carved w;
    w.select = sparse::carveSelectWs(carver, n);
    w.encode = sparse::carveEncodeWs(carver, largestChunk(chunking));
    w.block_sums = carver.take<double>(canonicalBlocks(n) + 1);
    w.keys = carver.take<uint32_t>(m);
    w.sorted = carver.take<uint32_t>(m);
    w.sort_bytes = sparse::alignUp(sortTempBytes(m));
    w.sort_temp = carver.take<uint8_t>(w.sort_bytes);
    return w;
  }

  /// M = max(1024, ceil(f · n)); 0 where the exact path is always taken.
  size_t samples(size_t n) const {
    if (n <= kExactMaxElements) return 0;
    const double m = std::ceil(sample_fraction_ * static_cast<double>(n));
    return std::max(kMinSamples, static_cast<size_t>(m));
  }

  Accumulate accumulation(const float* current, size_t n) const {
    Accumulate acc;
    acc.momentum = momentum_;
    acc.bias = bias_;
    acc.m = m_;
    acc.w = w_;
    acc.u = momentum_ ? current : nullptr;
    acc.v = momentum_ ? current + n : current;
    acc.c = bias_ ? current + 2 * n : nullptr;
    return acc;
  }

  cudaError_t analyzeOn(const StepContext& ctx, size_t n, double density, DeviceTensor input,
                        DeviceState& state, const Carved& w, cudaStream_t stream) const {
    SelectState* s = w.select.state;
    LW_CUDA_TRY(cudaMemsetAsync(s, 0, sizeof(SelectState), stream));
    const Accumulate acc = accumulation(state.current(), n);
    float* vn = state.work();

    // 1. Clipping.
    if (clip_norm_ > 0.0) {
      double* total = w.block_sums + canonicalBlocks(n);
      LW_CUDA_TRY(canonicalSum(input.data, input.dtype, n, ReduceTerm::kSquare, w.block_sums, total,
                               stream));
      clipFactorKernel<<<1, 1, 0, stream>>>(total, clip_norm_, s);
      LW_CUDA_TRY(cudaGetLastError());
    }

    const size_t k = selectionSize(n, density);
    if (n <= kExactMaxElements) {
      // 2–3, then exact selection of k (§4.3) on v'.
      visitDeviceDType(input.dtype, [&](auto d) {
        fusedPassKernel<decltype(d)::value, false><<<blocksFor(n), kBlockThreads, 0, stream>>>(
            input.data, acc, s, n, vn, nullptr, nullptr);
      });
      LW_CUDA_TRY(cudaGetLastError());
      if (k >= n) {
        LW_CUDA_TRY(sparse::setPlan(s, 0, n, /*none=*/false, stream));
      } else {
        LW_CUDA_TRY(sparse::exactTopk(vn, DType::kF32, n, k, w.select, nullptr, stream));
      }
      return sparse::applyMinKey(s, min_key_, stream);
    }

    // Sampled threshold: the sample (keys of v' computed from x, u, v), sorted descending.
    const size_t m = samples(n);
    const uint64_t r0 =
        static_cast<uint64_t>(std::clamp<U128>((U128{k} * m + n - 1) / n, U128{1}, U128{m}));
    const DevicePhilox philox{ctx.seed, ctx.name_key, static_cast<uint32_t>(ctx.step), ctx.rank,
                              static_cast<uint32_t>(RandomPurpose::kDgcSampling)};
    visitDeviceDType(input.dtype, [&](auto d) {
      sampleKernel<decltype(d)::value><<<blocksFor((m + 3) / 4), kBlockThreads, 0, stream>>>(
          input.data, acc, s, philox, n, m, w.keys);
    });
    LW_CUDA_TRY(cudaGetLastError());
    size_t sort_bytes = w.sort_bytes;
    LW_CUDA_TRY(cub::DeviceRadixSort::SortKeysDescending(w.sort_temp, sort_bytes, w.keys, w.sorted,
                                                         m, 0, 31, stream));

    // 2–3 fused with the first count, at T = s_r0.
    visitDeviceDType(input.dtype, [&](auto d) {
      fusedPassKernel<decltype(d)::value, true><<<blocksFor(n), kBlockThreads, 0, stream>>>(
          input.data, acc, s, n, vn, w.sorted + (r0 - 1), &s->count);
    });
    LW_CUDA_TRY(cudaGetLastError());

    // 4. Acceptance in [lo, hi] and up to kMaxRefinements recounts.
    const uint64_t lo = static_cast<uint64_t>((U128{8} * k + 9) / 10);
    const uint64_t hi = static_cast<uint64_t>((U128{13} * k) / 10);
    for (int iter = 0; iter <= kMaxRefinements; ++iter) {
      decideKernel<<<1, 1, 0, stream>>>(s, w.sorted, iter, r0, k, m, lo, hi, n);
      LW_CUDA_TRY(cudaGetLastError());
      if (iter < kMaxRefinements) {
        countKernel<<<blocksFor(n), kBlockThreads, 0, stream>>>(vn, n, s);
        LW_CUDA_TRY(cudaGetLastError());
      }
    }
    // 5. Exact fallback (only when step 4 chose it).
    LW_CUDA_TRY(sparse::exactTopk(vn, DType::kF32, n, k, w.select, &s->exact, stream));
    // 6. min_magnitude, whichever path selected.
    return sparse::applyMinKey(s, min_key_, stream);
  }

  double density_;
  bool momentum_ = false;
  bool bias_ = false;  // bias correction: the state is u, v, then c
  float m_ = 0.0f;
  float w_ = 1.0f;  // (float)(1 − m)
  double clip_norm_ = 0.0;
  double sample_fraction_ = 0.01;
};

Result<std::unique_ptr<CudaCodec>> makeDgcCuda(std::unique_ptr<Codec> host) {
  auto density = configuredDensity(host->config(), "dgc", kDgcDefaultDensity);
  if (!density) return density.status();
  return std::unique_ptr<CudaCodec>(new DgcCuda(std::move(host), *density));
}

}  // namespace

LW_REGISTER_CUDA_CODEC(dgc, CodecId::kDgc, makeDgcCuda);

}  // namespace lightwire::kernels::cuda
