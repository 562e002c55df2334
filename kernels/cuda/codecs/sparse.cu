// The selection, sparse payload writer and sparse decoder the CUDA sparse codecs share
// (kernels/cuda/codecs/sparse.cuh), bit-identical to kernels/select.cc:
//
//   exact top-k  3 radix-histogram passes over the keys (digits of 11, 11 and 9 bits: per-block
//                shared-memory histograms with warp-aggregated atomics, flushed to global u64
//                counters), each followed by a one-block kernel that finds the digit holding the
//                k-th largest key; the last gives T, #{key > T} and #{key == T}. When the ties
//                with T are cut, one more pass counts the keys == T per 4096-element tile and a
//                one-block kernel finds the tile, then the element, where the count of ties
//                reaches the number to take: tie_end = its index + 1.
//   encoding     CUB DeviceSelect::If over the chunk-local indices (stable: ascending), a kernel
//                ORing the gaps (w = bit length), and one kernel that writes the header, every
//                packed gap byte (each byte gathers the <= 8 gaps that overlap it: no atomics, no
//                alignment assumption on the output), the padding, the values (fp32 bits, or the
//                saturating fp16 conversion of kernels/dtype.h) and *d_size; for dgc it also
//                masks v' and u' of the sent elements.
//   decoding     one CUB inclusive scan of (gap + 1) over the output range gives index + 1 for
//                every entry; the scan's output iterator adds weight · value there
//                (out = out + weight · value, two roundings).

#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/tabulate_output_iterator.h>
#include <thrust/iterator/transform_iterator.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_scan.cuh>
#include <cub/device/device_select.cuh>

#include <algorithm>
#include <limits>
#include <string>

#include "kernels/cuda/codecs/sparse.cuh"
#include "kernels/payload.h"

namespace lightwire::kernels::cuda::sparse {
namespace {

constexpr size_t kSparseHeaderBytes = kHeaderBytes + 8;  // header, nnz u32, w u8, 3 reserved
constexpr uint8_t kFlagF16Values = 0x01;

constexpr size_t kHistWords = 2048 + 2048 + 512;
constexpr size_t kTieTile = 4096;
constexpr unsigned kFindThreads = 1024;
constexpr unsigned kMaxHistBlocks = 512;
constexpr unsigned kMaxGapBlocks = 1024;

size_t tieTiles(size_t n) { return (n + kTieTile - 1) / kTieTile; }

unsigned gridFor(size_t items, size_t cap) {
  const size_t blocks = (items + kBlockThreads - 1) / kBlockThreads;
  return static_cast<unsigned>(std::clamp<size_t>(blocks, 1, cap));
}

/// Radix digit P of a 31-bit key: bits [shift, shift + bits); keys whose bits above the digit
/// equal the prefix decided so far take part (P = 0: all).
template <int P>
struct Digit {
  static constexpr unsigned kBits = P == 2 ? 9 : 11;
  static constexpr unsigned kShift = P == 0 ? 20 : (P == 1 ? 9 : 0);
  static constexpr unsigned kBins = 1u << kBits;
  static constexpr size_t kHistOffset = P == 0 ? 0 : (P == 1 ? 2048 : 4096);
};

// --- exact top-k kernels -------------------------------------------------------------------------

__global__ void setPlanKernel(SelectState* s, uint32_t threshold, unsigned long long tie_end,
                              uint32_t none) {
  s->threshold = threshold;
  s->tie_end = tie_end;
  s->none = none;
}

/// applyMinKey (kernels/select.cc): a threshold below the floor becomes the floor, every tie taken.
__global__ void applyMinKeyKernel(SelectState* s, uint32_t min_key) {
  if (s->none == 0 && s->threshold < min_key) {
    s->threshold = min_key;
    s->tie_end = ~0ull;
  }
}

/// hist[d] += #{i : key_i has the decided prefix and digit P of key_i is d}.
template <DType D, int P>
__global__ void __launch_bounds__(kBlockThreads)
    digitHistogramKernel(const void* __restrict__ x, size_t n, const SelectState* s,
                         unsigned long long* __restrict__ hist, const uint32_t* active) {
  using Dg = Digit<P>;
  __shared__ uint32_t bins[Dg::kBins];
  if (active != nullptr && *active == 0) return;  // uniform over the grid
  for (unsigned b = threadIdx.x; b < Dg::kBins; b += blockDim.x) bins[b] = 0;
  uint32_t prefix = 0;
  if constexpr (P > 0) prefix = s->prefix;
  __syncthreads();
  const unsigned lane = threadIdx.x & 31u;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  // `base` is uniform over the warp: every lane runs the same iterations (the match below needs
  // all 32); lanes past the end contribute nothing.
  for (size_t base = static_cast<size_t>(blockIdx.x) * blockDim.x + (threadIdx.x & ~31u); base < n;
       base += stride) {
    const size_t i = base + lane;
    uint32_t digit = 0xFFFFFFFFu;
    if (i < n) {
      const uint32_t key = keyAt<D>(x, i);
      bool take = true;
      if constexpr (P > 0) take = (key >> (Dg::kShift + Dg::kBits)) == prefix;
      if (take) digit = (key >> Dg::kShift) & (Dg::kBins - 1);
    }
    // Lanes with equal digits add once (ties everywhere would otherwise serialise).
    const unsigned peers = __match_any_sync(0xFFFFFFFFu, digit);
    if (digit != 0xFFFFFFFFu && lane == static_cast<unsigned>(__ffs(peers) - 1)) {
      atomicAdd(&bins[digit], static_cast<uint32_t>(__popc(peers)));
    }
  }
  __syncthreads();
  for (unsigned b = threadIdx.x; b < Dg::kBins; b += blockDim.x) {
    if (bins[b] != 0) atomicAdd(&hist[b], static_cast<unsigned long long>(bins[b]));
  }
}

/// One block: the digit of pass P that holds the target rank, counting from the largest digit.
/// After P = 2 the plan's threshold is the k-th largest key, and `need` the ties to take.
template <int P>
__global__ void __launch_bounds__(kFindThreads)
    findDigitKernel(SelectState* s, const unsigned long long* __restrict__ hist,
                    unsigned long long k, unsigned long long n, const uint32_t* active) {
  using Dg = Digit<P>;
  constexpr unsigned kItems = (Dg::kBins + kFindThreads - 1) / kFindThreads;
  using Scan = cub::BlockScan<unsigned long long, kFindThreads>;
  __shared__ typename Scan::TempStorage temp;
  if (active != nullptr && *active == 0) return;
  unsigned long long remaining = k;
  uint32_t prefix = 0;
  if constexpr (P > 0) {
    remaining = s->remaining;
    prefix = s->prefix;
  }
  // Blocked arrangement, position 0 = the largest digit.
  unsigned long long count[kItems], inclusive[kItems];
  for (unsigned q = 0; q < kItems; ++q) {
    const unsigned pos = threadIdx.x * kItems + q;
    count[q] = pos < Dg::kBins ? hist[Dg::kBins - 1 - pos] : 0ull;
  }
  Scan(temp).InclusiveSum(count, inclusive);  // synchronises: every read above happened
  for (unsigned q = 0; q < kItems; ++q) {
    const unsigned pos = threadIdx.x * kItems + q;
    const unsigned long long before = inclusive[q] - count[q];
    // The intervals (before, inclusive] partition (0, total]: exactly one holds `remaining`.
    if (pos < Dg::kBins && before < remaining && remaining <= inclusive[q]) {
      const uint32_t key_prefix = (prefix << Dg::kBits) | (Dg::kBins - 1 - pos);
      const unsigned long long rest = remaining - before;
      if constexpr (P < 2) {
        s->prefix = key_prefix;
        s->remaining = rest;
      } else {
        s->threshold = key_prefix;
        s->none = 0;
        s->need = rest;  // ties to take, 1 <= rest <= count[q]
        s->tie_end = n;  // every tie, unless the tie search below cuts them
        s->cut = rest == count[q] ? 0u : 1u;
      }
    }
  }
}

/// counts[t] = #{i in tile t : key_i == T} when ties are cut.
template <DType D>
__global__ void __launch_bounds__(kBlockThreads)
    tieCountKernel(const void* __restrict__ x, size_t n, const SelectState* s,
                   uint32_t* __restrict__ counts, size_t tiles, const uint32_t* active) {
  using Reduce = cub::BlockReduce<uint32_t, kBlockThreads>;
  __shared__ typename Reduce::TempStorage temp;
  if (active != nullptr && *active == 0) return;
  if (s->cut == 0) return;
  const uint32_t threshold = s->threshold;
  for (size_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const size_t lo = tile * kTieTile;
    const size_t hi = lo + kTieTile < n ? lo + kTieTile : n;
    uint32_t c = 0;
    for (size_t i = lo + threadIdx.x; i < hi; i += blockDim.x) c += keyAt<D>(x, i) == threshold;
    const uint32_t total = Reduce(temp).Sum(c);
    if (threadIdx.x == 0) counts[tile] = total;
    __syncthreads();  // before temp is reused
  }
}

/// One block: the need-th element (in index order) with key == T; tie_end = its index + 1.
template <DType D>
__global__ void __launch_bounds__(kFindThreads)
    tieFindKernel(const void* __restrict__ x, size_t n, SelectState* s,
                  const uint32_t* __restrict__ counts, size_t tiles, const uint32_t* active) {
  using Scan = cub::BlockScan<unsigned long long, kFindThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ unsigned long long found_tile, found_before;
  if (active != nullptr && *active == 0) return;
  if (s->cut == 0) return;
  const unsigned long long need = s->need;
  const uint32_t threshold = s->threshold;
  if (threadIdx.x == 0) found_tile = ~0ull;
  __syncthreads();
  unsigned long long before = 0;
  for (size_t t0 = 0; t0 < tiles; t0 += kFindThreads) {
    const size_t t = t0 + threadIdx.x;
    const unsigned long long c = t < tiles ? counts[t] : 0ull;
    unsigned long long excl, aggregate;
    Scan(temp).ExclusiveSum(c, excl, aggregate);
    if (c > 0 && before + excl < need && need <= before + excl + c) {
      found_tile = t;
      found_before = before + excl;
    }
    __syncthreads();
    if (found_tile != ~0ull) break;  // shared: uniform
    before += aggregate;
  }
  if (found_tile == ~0ull) return;  // unreachable: the counts hold `need` ties
  const unsigned long long left = need - found_before;
  const size_t lo = static_cast<size_t>(found_tile) * kTieTile;
  const size_t hi = lo + kTieTile < n ? lo + kTieTile : n;
  unsigned long long seen = 0;
  for (size_t b = lo; b < hi; b += kFindThreads) {
    const size_t i = b + threadIdx.x;
    const unsigned long long f = (i < hi && keyAt<D>(x, i) == threshold) ? 1ull : 0ull;
    unsigned long long excl, aggregate;
    Scan(temp).ExclusiveSum(f, excl, aggregate);
    if (f != 0 && seen + excl + 1 == left) s->tie_end = i + 1;
    seen += aggregate;
    __syncthreads();
  }
}

// --- encoding ------------------------------------------------------------------------------------

/// Whether chunk-local index `local` is selected (the plan's rule, in whole-tensor coordinates).
template <DType D>
struct SelectPred {
  const void* x;
  size_t begin;
  PlanArg plan;
  __device__ __forceinline__ bool operator()(uint32_t local) const {
    uint32_t threshold = plan.threshold, none = plan.none;
    uint64_t tie_end = plan.tie_end;
    if (plan.dev != nullptr) {
      threshold = plan.dev->threshold;
      none = plan.dev->none;
      tie_end = plan.dev->tie_end;
    }
    if (none != 0) return false;
    const size_t i = begin + local;
    const uint32_t key = keyAt<D>(x, i);
    return key > threshold || (key == threshold && i < tie_end);
  }
};

template <DType D>
cudaError_t runSelect(void* temp, size_t& bytes, const void* x, size_t begin, size_t len,
                      const PlanArg& plan, uint32_t* out, unsigned long long* nnz,
                      cudaStream_t stream) {
  return cub::DeviceSelect::If(temp, bytes, thrust::counting_iterator<uint32_t>(0u), out, nnz,
                               static_cast<int64_t>(len), SelectPred<D>{x, begin, plan}, stream);
}

size_t selectTempBytes(size_t len) {
  size_t most = 0;
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16}) {
    size_t bytes = 0;
    const cudaError_t e = visitDeviceDType(d, [&](auto t) {
      return runSelect<decltype(t)::value>(nullptr, bytes, nullptr, 0, len, PlanArg{}, nullptr,
                                           nullptr, nullptr);
    });
    // Without a usable device the query fails; nothing can run then, any size will do.
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      bytes = 4096 + len / 16;
    }
    most = std::max(most, bytes);
  }
  return most;
}

/// gap_or |= every gap of the chunk's selected indices.
__global__ void __launch_bounds__(kBlockThreads)
    gapOrKernel(const uint32_t* __restrict__ idx, ChunkCounters* c) {
  const unsigned long long nnz = c->nnz;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  uint32_t acc = 0;
  for (size_t j = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < nnz;
       j += stride) {
    acc |= idx[j] - (j == 0 ? 0u : idx[j - 1] + 1u);
  }
  acc = __reduce_or_sync(0xFFFFFFFFu, acc);
  if ((threadIdx.x & 31u) == 0 && acc != 0) atomicOr(&c->gap_or, acc);
}

/// floatToHalfSaturating (kernels/dtype.h).
__device__ __forceinline__ uint16_t halfSaturating(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x477FE000u && abs < 0x7F800000u) {  // finite and > 65504
    return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7BFFu);
  }
  return bits::floatBitsToHalf(u);
}

__device__ __forceinline__ void storeU32Device(uint8_t* p, uint32_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
  p[2] = static_cast<uint8_t>(v >> 16);
  p[3] = static_cast<uint8_t>(v >> 24);
}

/// Header, packed gaps, padding, values and size of the chunk's payload (emitSparse of
/// kernels/select.cc), plus dgc's masking of what was sent. `x` may be `mask_v` (dgc).
template <DType D, bool F16, bool Mask>
__global__ void __launch_bounds__(kBlockThreads)
    emitKernel(const void* x, size_t begin, size_t len, uint8_t codec, uint8_t source,
               const uint32_t* __restrict__ idx, const ChunkCounters* __restrict__ c,
               uint8_t* __restrict__ out, uint64_t* __restrict__ d_size, float* mask_v,
               float* mask_u) {
  const uint64_t nnz = c->nnz;
  const uint32_t gap_or = c->gap_or;
  const unsigned w = gap_or == 0 ? 0u : 32u - static_cast<unsigned>(__clz(gap_or));
  const uint64_t packed = (nnz * w + 7) / 8;
  const uint64_t g = (packed + 3) & ~uint64_t{3};
  constexpr uint64_t kValueBytes = F16 ? 2 : 4;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (tid == 0) {
    out[0] = kMagic0;
    out[1] = kMagic1;
    out[2] = kPayloadVersion;
    out[3] = codec;
    out[4] = source;
    out[5] = F16 ? kFlagF16Values : 0;
    out[6] = 0;  // round
    out[7] = 0;
    storeU32Device(out + 8, static_cast<uint32_t>(static_cast<uint64_t>(len)));
    storeU32Device(out + 12, static_cast<uint32_t>(static_cast<uint64_t>(len) >> 32));
    storeU32Device(out + 16, static_cast<uint32_t>(nnz));
    out[20] = static_cast<uint8_t>(w);
    out[21] = out[22] = out[23] = 0;
    *d_size = kSparseHeaderBytes + g + kValueBytes * nnz;
  }
  uint8_t* gaps = out + kSparseHeaderBytes;
  uint8_t* vals = gaps + g;
  const uint64_t total = g > nnz ? g : nnz;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (uint64_t t = tid; t < total; t += stride) {
    if (t < g) {
      // Byte t holds stream bits [8t, 8t + 8): the gaps j with j·w in (8t − w, 8t + 8).
      uint32_t byte = 0;
      if (t < packed) {  // so w > 0 and nnz > 0
        const uint64_t bit0 = 8 * t;
        const uint64_t j0 = bit0 / w;
        uint64_t j1 = (bit0 + 7) / w;
        if (j1 > nnz - 1) j1 = nnz - 1;
        for (uint64_t j = j0; j <= j1; ++j) {
          const uint64_t gap = idx[j] - (j == 0 ? 0u : idx[j - 1] + 1u);
          const uint64_t pos = j * w;
          byte |= static_cast<uint32_t>(pos >= bit0 ? gap << (pos - bit0) : gap >> (bit0 - pos));
        }
      }
      gaps[t] = static_cast<uint8_t>(byte);  // the low 8 bits; padding stays 0
    }
    if (t < nnz) {
      const size_t i = begin + idx[t];
      const float v = loadWidenedDevice<D>(x, i);
      float sent = v;
      if constexpr (F16) {
        const uint16_t h = halfSaturating(v);
        vals[2 * t] = static_cast<uint8_t>(h);
        vals[2 * t + 1] = static_cast<uint8_t>(h >> 8);
        sent = __uint_as_float(bits::halfToFloatBits(h));
      } else {
        storeU32Device(vals + 4 * t, __float_as_uint(v));
      }
      if constexpr (Mask) {
        mask_v[i] = __fsub_rn(v, sent);  // v' − value as decoded (0 for finite fp32 values)
        if (mask_u != nullptr) mask_u[i] = 0.0f;
      } else {
        (void)sent;
      }
    }
  }
}

template <DType D, bool Mask>
void launchEmit(bool f16, unsigned grid, const void* x, size_t begin, size_t len, uint8_t codec,
                uint8_t source, const EncodeWs& ws, uint8_t* d_out, uint64_t* d_size, float* mask_v,
                float* mask_u, cudaStream_t stream) {
  if (f16) {
    emitKernel<D, true, Mask><<<grid, kBlockThreads, 0, stream>>>(
        x, begin, len, codec, source, ws.indices, ws.counters, d_out, d_size, mask_v, mask_u);
  } else {
    emitKernel<D, false, Mask><<<grid, kBlockThreads, 0, stream>>>(
        x, begin, len, codec, source, ws.indices, ws.counters, d_out, d_size, mask_v, mask_u);
  }
}

// --- decoding ------------------------------------------------------------------------------------

__host__ __device__ __forceinline__ uint32_t loadU32Any(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

/// Bits [bit, bit + w) of an LSB-first stream, 1 <= w <= 32; reads only the bytes they occupy.
__device__ __forceinline__ uint64_t readBits(const uint8_t* stream, uint64_t bit, unsigned w) {
  const uint64_t first = bit >> 3, last = (bit + w - 1) >> 3;
  uint64_t acc = 0;
  for (uint64_t b = first; b <= last; ++b)
    acc |= static_cast<uint64_t>(stream[b]) << (8 * (b - first));
  return (acc >> (bit & 7)) & ((uint64_t{1} << w) - 1);
}

/// Scan input j: gap_j + 1 for the payload's entries (1 for every element of a `none` escape),
/// 0 past them, so the inclusive scan at j is index_j + 1.
struct GapPlusOne {
  const uint8_t* p;
  uint64_t n;
  __host__ __device__ unsigned long long operator()(unsigned long long j) const {
    if (p[3] == static_cast<uint8_t>(CodecId::kNone)) return j < n ? 1ull : 0ull;
    const uint64_t nnz = loadU32Any(p + 16);
    if (j >= nnz) return 0ull;
    const unsigned w = p[20];
    if (w == 0) return 1ull;
#if defined(__CUDA_ARCH__)
    return 1ull + readBits(p + kSparseHeaderBytes, j * w, w);
#else
    return 0ull;  // never evaluated on the host
#endif
  }
};

/// Scan output (j, index_j + 1): out[index_j] = out[index_j] + weight · value_j, and
/// zero[index_j] = 0 (zero2[index_j] = 0) when `zero` (`zero2`) is set (dgc's masking of the
/// momentum and of its bias correction at commit).
struct AddEntry {
  const uint8_t* p;
  uint64_t n;
  float weight;
  float* out;
  float* zero;
  float* zero2;
  __device__ void operator()(ptrdiff_t jj, unsigned long long s) const {
    const uint64_t j = static_cast<uint64_t>(jj);
    float value;
    if (p[3] == static_cast<uint8_t>(CodecId::kNone)) {
      if (j >= n) return;
      value = __uint_as_float(loadU32Any(p + kHeaderBytes + 4 * j));
    } else {
      const uint64_t nnz = loadU32Any(p + 16);
      if (j >= nnz) return;
      const unsigned w = p[20];
      const uint64_t g = (((nnz * w + 7) / 8) + 3) & ~uint64_t{3};
      const uint8_t* vals = p + kSparseHeaderBytes + g;
      if ((p[5] & kFlagF16Values) != 0) {
        const uint16_t h = static_cast<uint16_t>(vals[2 * j] | (vals[2 * j + 1] << 8));
        value = __uint_as_float(bits::halfToFloatBits(h));
      } else {
        value = __uint_as_float(loadU32Any(vals + 4 * j));
      }
    }
    const size_t i = static_cast<size_t>(s - 1);
    out[i] = __fadd_rn(out[i], __fmul_rn(weight, value));
    if (zero != nullptr) zero[i] = 0.0f;
    if (zero2 != nullptr) zero2[i] = 0.0f;
  }
};

cudaError_t runDecodeScan(void* temp, size_t& bytes, const uint8_t* p, float weight, float* out,
                          float* zero, float* zero2, size_t n, cudaStream_t stream) {
  using Counting = thrust::counting_iterator<unsigned long long>;
  const thrust::transform_iterator<GapPlusOne, Counting, unsigned long long> in(Counting(0ull),
                                                                                GapPlusOne{p, n});
  const thrust::tabulate_output_iterator<AddEntry> sink(AddEntry{p, n, weight, out, zero, zero2});
  return cub::DeviceScan::InclusiveSum(temp, bytes, in, sink, static_cast<uint64_t>(n), stream);
}

}  // namespace

// --- exact top-k ---------------------------------------------------------------------------------

size_t selectWsBytes(size_t n) {
  return alignUp(sizeof(SelectState)) + alignUp(kHistWords * sizeof(unsigned long long)) +
         alignUp(tieTiles(n) * sizeof(uint32_t));
}

SelectWs carveSelectWs(DeviceCarver& carver, size_t n) {
  SelectWs ws;
  ws.state = carver.take<SelectState>(1);
  ws.hist = carver.take<unsigned long long>(kHistWords);
  ws.tile_counts = carver.take<uint32_t>(tieTiles(n));
  return ws;
}

cudaError_t setPlan(SelectState* state, uint32_t threshold, uint64_t tie_end, bool none,
                    cudaStream_t stream) {
  setPlanKernel<<<1, 1, 0, stream>>>(state, threshold, tie_end, none ? 1u : 0u);
  return cudaGetLastError();
}

cudaError_t applyMinKey(SelectState* state, uint32_t min_key, cudaStream_t stream) {
  if (min_key == 0) return cudaSuccess;
  applyMinKeyKernel<<<1, 1, 0, stream>>>(state, min_key);
  return cudaGetLastError();
}

cudaError_t exactTopk(const void* x, DType dtype, size_t n, size_t k, const SelectWs& ws,
                      const uint32_t* active, cudaStream_t stream) {
  if (n == 0 || k == 0 || k > n) return cudaErrorInvalidValue;
  LW_CUDA_TRY(cudaMemsetAsync(ws.hist, 0, kHistWords * sizeof(unsigned long long), stream));
  const unsigned grid = gridFor(n, kMaxHistBlocks);
  const size_t tiles = tieTiles(n);
  const unsigned tile_grid = static_cast<unsigned>(std::min<size_t>(tiles, kMaxBlocks));
  visitDeviceDType(dtype, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    digitHistogramKernel<D, 0><<<grid, kBlockThreads, 0, stream>>>(
        x, n, ws.state, ws.hist + Digit<0>::kHistOffset, active);
    findDigitKernel<0>
        <<<1, kFindThreads, 0, stream>>>(ws.state, ws.hist + Digit<0>::kHistOffset, k, n, active);
    digitHistogramKernel<D, 1><<<grid, kBlockThreads, 0, stream>>>(
        x, n, ws.state, ws.hist + Digit<1>::kHistOffset, active);
    findDigitKernel<1>
        <<<1, kFindThreads, 0, stream>>>(ws.state, ws.hist + Digit<1>::kHistOffset, k, n, active);
    digitHistogramKernel<D, 2><<<grid, kBlockThreads, 0, stream>>>(
        x, n, ws.state, ws.hist + Digit<2>::kHistOffset, active);
    findDigitKernel<2>
        <<<1, kFindThreads, 0, stream>>>(ws.state, ws.hist + Digit<2>::kHistOffset, k, n, active);
    tieCountKernel<D>
        <<<tile_grid, kBlockThreads, 0, stream>>>(x, n, ws.state, ws.tile_counts, tiles, active);
    tieFindKernel<D><<<1, kFindThreads, 0, stream>>>(x, n, ws.state, ws.tile_counts, tiles, active);
  });
  return cudaGetLastError();
}

// --- encoding ------------------------------------------------------------------------------------

size_t encodeWsBytes(size_t chunk_elements) {
  return alignUp(chunk_elements * sizeof(uint32_t)) + alignUp(sizeof(ChunkCounters)) +
         alignUp(selectTempBytes(chunk_elements));
}

EncodeWs carveEncodeWs(DeviceCarver& carver, size_t chunk_elements) {
  EncodeWs ws;
  ws.indices = carver.take<uint32_t>(chunk_elements);
  ws.counters = carver.take<ChunkCounters>(1);
  ws.cub_bytes = alignUp(selectTempBytes(chunk_elements));
  ws.cub_temp = carver.take<uint8_t>(ws.cub_bytes);
  return ws;
}

cudaError_t encodeChunk(CodecId codec, DType source, DType values, const PlanArg& plan,
                        DeviceTensor x, size_t begin, size_t len, const EncodeWs& ws,
                        uint8_t* d_out, uint64_t* d_size, float* mask_v, float* mask_u,
                        cudaStream_t stream) {
  if (len > size_t{0xFFFFFFFFu} || (mask_v != nullptr && x.dtype != DType::kF32)) {
    return cudaErrorInvalidValue;
  }
  LW_CUDA_TRY(cudaMemsetAsync(ws.counters, 0, sizeof(ChunkCounters), stream));
  const bool f16 = values == DType::kF16;
  const auto codec_byte = static_cast<uint8_t>(codec);
  const auto source_byte = static_cast<uint8_t>(source);
  return visitDeviceDType(x.dtype, [&](auto d) -> cudaError_t {
    constexpr DType D = decltype(d)::value;
    if (len > 0) {
      size_t bytes = ws.cub_bytes;
      LW_CUDA_TRY(runSelect<D>(ws.cub_temp, bytes, x.data, begin, len, plan, ws.indices,
                               &ws.counters->nnz, stream));
    }
    gapOrKernel<<<gridFor(len, kMaxGapBlocks), kBlockThreads, 0, stream>>>(ws.indices, ws.counters);
    const unsigned grid = gridFor(len, kMaxBlocks);
    if constexpr (D == DType::kF32) {
      if (mask_v != nullptr) {
        launchEmit<D, true>(f16, grid, x.data, begin, len, codec_byte, source_byte, ws, d_out,
                            d_size, mask_v, mask_u, stream);
        return cudaGetLastError();
      }
    }
    launchEmit<D, false>(f16, grid, x.data, begin, len, codec_byte, source_byte, ws, d_out, d_size,
                         nullptr, nullptr, stream);
    return cudaGetLastError();
  });
}

// --- decoding ------------------------------------------------------------------------------------

size_t accumulateBytes(size_t n) {
  if (n == 0) return 0;
  size_t bytes = 0;
  if (runDecodeScan(nullptr, bytes, nullptr, 0.0f, nullptr, nullptr, nullptr, n, nullptr) !=
      cudaSuccess) {
    (void)cudaGetLastError();
    bytes = 4096 + n / 16;  // no usable device: nothing will run
  }
  return bytes;
}

cudaError_t accumulateSparse(const uint8_t* d_payload, float weight, float* d_out, size_t n,
                             DeviceBytes scratch, cudaStream_t stream, float* d_zero,
                             float* d_zero2) {
  if (n == 0) return cudaSuccess;
  size_t bytes = scratch.size;
  return runDecodeScan(scratch.data, bytes, d_payload, weight, d_out, d_zero, d_zero2, n, stream);
}

Status validateSparse(std::span<const uint8_t> payload, CodecId codec, size_t out_elements) {
  auto layout = parseSparsePayload(payload, codec, out_elements);
  if (!layout) return layout.status();
  if (layout->dense) return Status::ok();
  const std::string name = codecIdName(codec);
  const uint64_t n = layout->header.elements, nnz = layout->nnz;
  const unsigned w = layout->w;
  const uint8_t* gaps = layout->gaps;
  // Indices strictly increase: every one is < n iff the last one is. O(nnz), no output touched.
  BitReader reader(gaps);
  uint64_t next = 0;
  for (uint64_t j = 0; j < nnz; ++j) {
    const uint64_t i = next + reader.get(w);
    if (i >= n) {
      return dataLoss(name + " payload index " + std::to_string(i) + " (entry " +
                      std::to_string(j) + ") is outside the chunk of " + std::to_string(n) +
                      " elements");
    }
    next = i + 1;
  }
  return Status::ok();
}

Status SparseCudaCodec::accumulate(const uint8_t* d_payload, float weight, float* d_out,
                                   size_t out_elements, DeviceBytes scratch,
                                   cudaStream_t stream) const {
  if (out_elements == 0) return Status::ok();
  const std::string name = std::string(traits().name) + " (cuda)";
  if (d_payload == nullptr || d_out == nullptr) {
    return invalidArgument(name + ": payload or output is null");
  }
  return cudaStatus(accumulateSparse(d_payload, weight, d_out, out_elements, scratch, stream),
                    name + ": decoding a payload");
}

Status SparseCudaCodec::checkChunk(size_t len) const {
  if (len > size_t{0xFFFFFFFFu}) {
    return outOfRange(std::string(traits().name) + " (cuda): chunk of " + std::to_string(len) +
                      " elements exceeds the sparse layout's u32 index range");
  }
  return Status::ok();
}

}  // namespace lightwire::kernels::cuda::sparse
