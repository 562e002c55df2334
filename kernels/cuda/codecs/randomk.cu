// `randomk` on the GPU (docs/determinism.md §4.7, docs/wire-format.md "randomk"), payloads
// byte-identical to kernels/codecs/randomk.cc.
//
// The selection is not a sequential draw: element i (whole-tensor index) is selected iff the word
// serving it in the shared Philox stream (step, 0xFFFFFFFF, purpose 3, group ⌊i/4⌋) is < t, each
// element on its own. So every kernel recomputes the selection of the groups it covers, and the
// only sequential part is the compaction (the value of the p-th selected element goes to slot p):
//
//   tiles     a tile is 1024 consecutive Philox groups (4096 elements), starting at the chunk's
//             first group ⌊start/4⌋; thread `tid` of a 256-thread block takes group
//             tile·1024 + it·256 + tid in iteration it = 0..3, i.e. one Philox call per 4 elements.
//   pass 1    countTilesKernel: the number of selected in-chunk elements of every tile.
//   pass 2    scanTilesKernel (one block of 1024 threads): exclusive prefix sums of the tile counts
//             in place (u64), the total (nnz); when encoding it also writes the 56-byte header and
//             the payload size.
//   pass 3    encodeValuesKernel / applyKernel: each tile recomputes its selection, a block-wide
//             exclusive scan of the per-thread counts (iteration by iteration, in group order)
//             gives every selected element its slot, and the value is written (encode:
//             v = x·s in fp32, or fp16 saturating) or accumulated (decode: out = out + w·v, two
//             roundings, __fmul_rn / __fadd_rn).
// Philox runs twice per element group (passes 1 and 3): 10 rounds of integer work per 4 elements,
// far below the memory traffic of the value pass, so recomputing beats storing the selection.
//
// accumulate() reads everything from the device payload (it is trusted: written by this codec or
// validated on the host first) and still guards itself: a header that does not match the output
// range, or a count of selected elements different from nnz, makes it add nothing, so no byte past
// the payload is ever read. validate() checks a host payload as the CPU decoder does, including
// the count of selected elements against nnz (host Philox over the chunk: O(n) integer work, the
// same pass 1 the CPU decoder runs, but no output buffer and no value decoding).

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/cuda/codec.h"
#include "kernels/cuda/device.cuh"
#include "kernels/payload.h"
#include "kernels/philox.h"
#include "kernels/select.h"

namespace lightwire::kernels::cuda {
namespace {

constexpr size_t kRandomkHeaderBytes = 56;
constexpr uint8_t kFlagF16Values = 0x01;
constexpr uint64_t kFullWord = uint64_t{1} << 32;  // t = 2^32: every element is selected
constexpr uint32_t kStream = 0xFFFFFFFFu;
constexpr uint32_t kPurpose = 3;
static_assert(kStream == kSharedStream);
static_assert(kPurpose == static_cast<uint32_t>(RandomPurpose::kRandomkIndices));

constexpr unsigned kThreads = kBlockThreads;  // 256
constexpr unsigned kWarps = kThreads / 32;
constexpr unsigned kIters = 4;
constexpr uint64_t kTileGroups = uint64_t{kThreads} * kIters;  // 1024 groups = 4096 elements
constexpr unsigned kScanThreads = 1024;
constexpr size_t kAlign = 256;

size_t alignUp(size_t b) { return (b + kAlign - 1) & ~(kAlign - 1); }

/// Tiles covering a chunk of `len` elements whatever its start: it spans at most
/// ⌊(len + 2) / 4⌋ + 1 groups.
uint64_t tilesBound(uint64_t len) {
  return len == 0 ? 0 : ((len + 2) / 4 + 1 + kTileGroups - 1) / kTileGroups;
}

unsigned gridFor(uint64_t tiles) {
  return static_cast<unsigned>(tiles == 0 ? 1 : std::min<uint64_t>(tiles, kMaxBlocks));
}

// --- device helpers ------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t loadU32Dev(const uint8_t* p) {
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}
__device__ __forceinline__ uint64_t loadU64Dev(const uint8_t* p) {
  return uint64_t(loadU32Dev(p)) | (uint64_t(loadU32Dev(p + 4)) << 32);
}
__device__ __forceinline__ void storeU32Dev(uint8_t* p, uint32_t v) {
  if ((reinterpret_cast<uintptr_t>(p) & 3) == 0) {
    *reinterpret_cast<uint32_t*>(p) = v;
  } else {
    p[0] = uint8_t(v);
    p[1] = uint8_t(v >> 8);
    p[2] = uint8_t(v >> 16);
    p[3] = uint8_t(v >> 24);
  }
}
__device__ __forceinline__ void storeU16Dev(uint8_t* p, uint16_t v) {
  if ((reinterpret_cast<uintptr_t>(p) & 1) == 0) {
    *reinterpret_cast<uint16_t*>(p) = v;
  } else {
    p[0] = uint8_t(v);
    p[1] = uint8_t(v >> 8);
  }
}
__device__ __forceinline__ void storeU64Dev(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i));
}
__device__ __forceinline__ float loadF32Dev(const uint8_t* p) {
  if ((reinterpret_cast<uintptr_t>(p) & 3) == 0) return *reinterpret_cast<const float*>(p);
  return __uint_as_float(loadU32Dev(p));
}
__device__ __forceinline__ uint16_t loadU16Dev(const uint8_t* p) {
  return uint16_t(p[0] | (p[1] << 8));
}

/// kernels/dtype.h floatToHalfSaturating: a finite value beyond ±65504 becomes ±65504.
__device__ __forceinline__ uint16_t halfSaturating(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x477FE000u && abs < 0x7F800000u) {
    return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7BFFu);
  }
  return bits::floatBitsToHalf(u);
}

/// What decides the selection of one chunk (the payload body fields of §4.7).
struct Selection {
  uint32_t seed = 0, name_key = 0, step = 0;
  uint64_t start = 0;  // whole-tensor index of the chunk's first element
  uint64_t len = 0;    // chunk elements
  uint64_t t = 0;      // selected iff word < t; 0..2^32

  __device__ uint64_t firstGroup() const { return start / 4; }

  /// Bit q (0..3) set iff element 4g + q lies in the chunk and is selected. g >= firstGroup().
  __device__ __forceinline__ unsigned mask(uint64_t g) const {
    if (len == 0 || t == 0 || g > (start + len - 1) / 4) return 0;
    const bool full = t >= kFullWord;
    uint32_t w[4] = {0, 0, 0, 0};
    if (!full) {
      const DevicePhilox philox{seed, name_key, step, kStream, kPurpose};
      const uint4 r = philox.group(g);  // counter word 3 = low 32 bits of g
      w[0] = r.x;
      w[1] = r.y;
      w[2] = r.z;
      w[3] = r.w;
    }
    unsigned m = 0;
#pragma unroll
    for (unsigned q = 0; q < 4; ++q) {
      const uint64_t i = 4 * g + q;  // no overflow: g <= (2^64 - 1) / 4
      const bool in_chunk = i >= start && i - start < len;
      if (in_chunk && (full || uint64_t{w[q]} < t)) m |= 1u << q;
    }
    return m;
  }
};

/// A randomk (or `none`) payload's fields, read on the device.
struct Parsed {
  Selection sel;
  uint64_t nnz = 0;
  bool ok = false;     // the structural guards hold (the payload can be applied)
  bool dense = false;  // the `none` layout (header codec id 0)
  bool f16 = false;
};

/// Where a kernel takes the selection from: when encoding, the chunk's fields (host) and t (device
/// workspace, written by analyze); when decoding, the device payload itself.
struct Job {
  uint32_t seed = 0, name_key = 0, step = 0;
  uint64_t start = 0, len = 0;
  const uint64_t* d_t = nullptr;
  const uint8_t* d_payload = nullptr;  // decoding when non-null
  uint64_t out_elements = 0;
};

__device__ Parsed resolve(const Job& job) {
  Parsed r;
  if (job.d_payload == nullptr) {
    r.sel = Selection{job.seed, job.name_key, job.step, job.start, job.len, *job.d_t};
    r.ok = true;
    return r;
  }
  const uint8_t* p = job.d_payload;
  const uint64_t n = loadU64Dev(p + 8);
  if (n != job.out_elements) return r;
  if (p[3] == 0) {  // `none`: n fp32 values (validated on the host)
    r.dense = true;
    r.sel.len = n;
    r.ok = true;
    return r;
  }
  r.f16 = (p[5] & kFlagF16Values) != 0;
  r.sel =
      Selection{loadU32Dev(p + 16), loadU32Dev(p + 20), loadU32Dev(p + 24), loadU64Dev(p + 32), n,
                loadU64Dev(p + 40)};
  r.nnz = loadU64Dev(p + 48);
  r.ok = r.sel.t <= kFullWord && r.sel.start <= ~uint64_t{0} - n && r.nnz <= n;
  return r;
}

/// Exclusive prefix of `c` over the block's threads in thread order; *total = the block's sum.
/// Every thread of the block must call it (it synchronises).
__device__ __forceinline__ unsigned blockExclusiveScan(unsigned c, unsigned* sh, unsigned* total) {
  const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned inc = c;
#pragma unroll
  for (unsigned o = 1; o < 32; o <<= 1) {
    const unsigned v = __shfl_up_sync(0xFFFFFFFFu, inc, o);
    if (lane >= o) inc += v;
  }
  if (lane == 31) sh[warp] = inc;
  __syncthreads();
  unsigned before = 0, sum = 0;
#pragma unroll
  for (unsigned w = 0; w < kWarps; ++w) {
    if (w < warp) before += sh[w];
    sum += sh[w];
  }
  __syncthreads();  // sh may be reused by the next call
  *total = sum;
  return before + inc - c;
}

// --- kernels -------------------------------------------------------------------------------------

__global__ void setWordKernel(uint64_t* d, uint64_t v) { *d = v; }

/// Pass 1: counts[b] = selected in-chunk elements of tile b, for b < tiles.
__global__ void __launch_bounds__(kThreads)
    countTilesKernel(Job job, uint64_t* __restrict__ counts, uint64_t tiles) {
  __shared__ unsigned sh[kWarps];
  const Parsed pr = resolve(job);
  const bool live = pr.ok && !pr.dense;
  const uint64_t g0 = pr.sel.firstGroup();
  for (uint64_t b = blockIdx.x; b < tiles; b += gridDim.x) {
    unsigned c = 0;
    if (live) {
#pragma unroll
      for (unsigned it = 0; it < kIters; ++it) {
        c += __popc(pr.sel.mask(g0 + b * kTileGroups + it * kThreads + threadIdx.x));
      }
    }
    unsigned total = 0;
    blockExclusiveScan(c, sh, &total);
    if (threadIdx.x == 0) counts[b] = total;
  }
}

/// Host-known header fields of an encoded chunk.
struct HeaderArgs {
  uint8_t dtype = 0, flags = 0;
  uint32_t seed = 0, name_key = 0, step = 0;
  uint64_t start = 0, len = 0;
  unsigned value_bytes = 4;
};

/// Pass 2 (one block of kScanThreads): counts[0..tiles) becomes its exclusive prefix sums (slot
/// offsets), *d_total = the sum (nnz). When d_out is non-null (encoding), also the payload header
/// (t from *d_t) and *d_size.
__global__ void __launch_bounds__(kScanThreads)
    scanTilesKernel(uint64_t* __restrict__ counts, uint64_t tiles, uint64_t* __restrict__ d_total,
                    HeaderArgs h, const uint64_t* __restrict__ d_t, uint8_t* __restrict__ d_out,
                    uint64_t* __restrict__ d_size) {
  __shared__ uint64_t warp_sums[kScanThreads / 32];
  const unsigned tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint64_t per = (tiles + kScanThreads - 1) / kScanThreads;
  const uint64_t lo = per * tid < tiles ? per * tid : tiles;
  const uint64_t hi = lo + per < tiles ? lo + per : tiles;
  uint64_t local = 0;
  for (uint64_t k = lo; k < hi; ++k) local += counts[k];
  uint64_t inc = local;
#pragma unroll
  for (unsigned o = 1; o < 32; o <<= 1) {
    const uint64_t v = __shfl_up_sync(0xFFFFFFFFu, inc, o);
    if (lane >= o) inc += v;
  }
  if (lane == 31) warp_sums[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    uint64_t s = warp_sums[lane];
#pragma unroll
    for (unsigned o = 1; o < 32; o <<= 1) {
      const uint64_t v = __shfl_up_sync(0xFFFFFFFFu, s, o);
      if (lane >= o) s += v;
    }
    warp_sums[lane] = s;  // inclusive over warps
  }
  __syncthreads();
  uint64_t run = (warp == 0 ? 0 : warp_sums[warp - 1]) + inc - local;
  for (uint64_t k = lo; k < hi; ++k) {
    const uint64_t c = counts[k];
    counts[k] = run;
    run += c;
  }
  if (tid == 0) {
    const uint64_t nnz = warp_sums[kScanThreads / 32 - 1];
    *d_total = nnz;
    if (d_out != nullptr) {
      uint8_t* p = d_out;
      p[0] = kMagic0;
      p[1] = kMagic1;
      p[2] = kPayloadVersion;
      p[3] = static_cast<uint8_t>(CodecId::kRandomk);
      p[4] = h.dtype;
      p[5] = h.flags;
      p[6] = 0;
      p[7] = 0;
      storeU64Dev(p + 8, h.len);
      storeU32Dev(p + 16, h.seed);
      storeU32Dev(p + 20, h.name_key);
      storeU32Dev(p + 24, h.step);
      storeU32Dev(p + 28, 0);
      storeU64Dev(p + 32, h.start);
      storeU64Dev(p + 40, *d_t);
      storeU64Dev(p + 48, nnz);
      *d_size = kRandomkHeaderBytes + uint64_t{h.value_bytes} * nnz;
    }
  }
}

/// Pass 3 of encoding: the value of every selected element of the chunk at its slot:
/// v = widen(x[i]) · s (fp32), stored as fp32 or fp16 (saturating).
template <DType D, bool kF16>
__global__ void __launch_bounds__(kThreads)
    encodeValuesKernel(Job job, const void* __restrict__ x, const uint64_t* __restrict__ offsets,
                       uint64_t tiles, uint8_t* __restrict__ vals) {
  __shared__ unsigned sh[kWarps];
  const Parsed pr = resolve(job);
  const Selection& sel = pr.sel;
  // s = (float)(2^32 / (double)t): fp64 division (correctly rounded), then to fp32 (nearest even).
  const float scale =
      sel.t == 0 ? 1.0f : __double2float_rn(__ddiv_rn(4294967296.0, __ull2double_rn(sel.t)));
  const uint64_t g0 = sel.firstGroup();
  for (uint64_t b = blockIdx.x; b < tiles; b += gridDim.x) {
    uint64_t slot0 = offsets[b];
#pragma unroll 1
    for (unsigned it = 0; it < kIters; ++it) {
      const uint64_t g = g0 + b * kTileGroups + it * kThreads + threadIdx.x;
      const unsigned m = sel.mask(g);
      unsigned total = 0;
      uint64_t slot = slot0 + blockExclusiveScan(__popc(m), sh, &total);
#pragma unroll
      for (unsigned q = 0; q < 4; ++q) {
        if ((m >> q) & 1u) {
          const float v = __fmul_rn(loadWidenedDevice<D>(x, 4 * g + q), scale);
          if constexpr (kF16) {
            storeU16Dev(vals + 2 * slot, halfSaturating(v));
          } else {
            storeU32Dev(vals + 4 * slot, __float_as_uint(v));
          }
          ++slot;
        }
      }
      slot0 += total;
    }
  }
}

/// Pass 3 of decoding: out[j] = out[j] + (w · v) for every selected chunk-local j, v the payload's
/// value at j's slot; or the `none` layout's n values. Adds nothing when the payload fails the
/// guards or its selection count differs from nnz.
__global__ void __launch_bounds__(kThreads)
    applyKernel(Job job, const uint64_t* __restrict__ offsets, const uint64_t* __restrict__ d_total,
                uint64_t tiles, float w, float* __restrict__ out) {
  __shared__ unsigned sh[kWarps];
  const Parsed pr = resolve(job);
  if (!pr.ok) return;  // uniform over the grid: every thread read the same header
  if (pr.dense) {
    const uint8_t* vals = job.d_payload + kHeaderBytes;
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t j = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < pr.sel.len;
         j += stride) {
      out[j] = __fadd_rn(out[j], __fmul_rn(w, loadF32Dev(vals + 4 * j)));
    }
    return;
  }
  if (*d_total != pr.nnz) return;
  const Selection& sel = pr.sel;
  const uint8_t* vals = job.d_payload + kRandomkHeaderBytes;
  const uint64_t g0 = sel.firstGroup();
  for (uint64_t b = blockIdx.x; b < tiles; b += gridDim.x) {
    uint64_t slot0 = offsets[b];
#pragma unroll 1
    for (unsigned it = 0; it < kIters; ++it) {
      const uint64_t g = g0 + b * kTileGroups + it * kThreads + threadIdx.x;
      const unsigned m = sel.mask(g);
      unsigned total = 0;
      uint64_t slot = slot0 + blockExclusiveScan(__popc(m), sh, &total);
#pragma unroll
      for (unsigned q = 0; q < 4; ++q) {
        if (((m >> q) & 1u) && slot < pr.nnz) {
          const float v = pr.f16
                              ? __uint_as_float(bits::halfToFloatBits(loadU16Dev(vals + 2 * slot)))
                              : loadF32Dev(vals + 4 * slot);
          const uint64_t j = 4 * g + q - sel.start;
          out[j] = __fadd_rn(out[j], __fmul_rn(w, v));
        }
        if ((m >> q) & 1u) ++slot;
      }
      slot0 += total;
    }
  }
}

// --- host side -----------------------------------------------------------------------------------

/// §4.7 step 2: 0 if n = 0, else max(1, ⌊(k·2^32 + ⌊n/2⌋) / n⌋), exactly.
uint64_t selectionWord(uint64_t n, uint64_t k) {
  if (n == 0) return 0;
  const unsigned __int128 num = (static_cast<unsigned __int128>(k) << 32) + (n / 2);
  const uint64_t t = static_cast<uint64_t>(num / n);
  return t == 0 ? 1 : t;
}

/// Selected elements of a chunk, counted on the host (validation of untrusted payloads).
uint64_t hostSelectedCount(uint32_t seed, uint32_t name_key, uint32_t step, uint64_t start,
                           uint64_t n, uint64_t t) {
  if (n == 0 || t == 0) return 0;
  if (t >= kFullWord) return n;
  const PhiloxStream philox(seed, name_key, step, kSharedStream, RandomPurpose::kRandomkIndices);
  constexpr size_t kBatch = 4096;
  thread_local std::vector<uint32_t> words(kBatch);
  uint64_t count = 0;
  for (uint64_t off = 0; off < n; off += kBatch) {
    const size_t len = static_cast<size_t>(std::min<uint64_t>(kBatch, n - off));
    philox.words(start + off, len, words.data());
    for (size_t q = 0; q < len; ++q) count += uint64_t{words[q]} < t ? 1 : 0;
  }
  return count;
}

class CudaRandomk final : public CudaCodec {
 public:
  CudaRandomk(std::unique_ptr<Codec> host, double density)
      : host_(std::move(host)), density_(density) {}

  const Codec& host() const override { return *host_; }

  /// t (and a spare slot), then one u64 offset per tile of the largest chunk.
  size_t workspaceBytes(const Chunking& c) const override {
    return kAlign + alignUp(8 * tilesBound(std::min(c.chunk_elements, c.elements)));
  }
  /// The tile offsets, then the selection count.
  size_t accumulateScratchBytes(size_t n) const override {
    return n == 0 ? 0 : alignUp(8 * tilesBound(n)) + kAlign;
  }

  Status accumulate(const uint8_t* d_payload, float weight, float* d_out, size_t out_elements,
                    DeviceBytes scratch, cudaStream_t stream) const override {
    if (d_payload == nullptr) return invalidArgument("randomk (cuda): payload is null");
    if (out_elements == 0) return Status::ok();
    if (d_out == nullptr) return invalidArgument("randomk (cuda): output is null");
    if (scratch.size < accumulateScratchBytes(out_elements) || scratch.data == nullptr) {
      return invalidArgument("randomk (cuda): accumulate scratch of " +
                             std::to_string(scratch.size) + " bytes, needs " +
                             std::to_string(accumulateScratchBytes(out_elements)));
    }
    const uint64_t tiles = tilesBound(out_elements);
    auto* offsets = static_cast<uint64_t*>(scratch.data);
    auto* total =
        reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(scratch.data) + alignUp(8 * tiles));
    Job job;
    job.d_payload = d_payload;
    job.out_elements = out_elements;
    const unsigned grid = gridFor(tiles);
    countTilesKernel<<<grid, kThreads, 0, stream>>>(job, offsets, tiles);
    scanTilesKernel<<<1, kScanThreads, 0, stream>>>(offsets, tiles, total, HeaderArgs{}, nullptr,
                                                    nullptr, nullptr);
    applyKernel<<<grid, kThreads, 0, stream>>>(job, offsets, total, tiles, weight, d_out);
    return cudaStatus(cudaGetLastError(), "randomk (cuda): decoding");
  }

  /// The CPU decoder's checks, without decoding: header, body fields, exact length, and the
  /// number of elements the selection fields select against nnz.
  Status validate(std::span<const uint8_t> payload, size_t out_elements) const override {
    auto h = readHeader(payload, CodecId::kRandomk, out_elements, kFlagF16Values);
    if (!h) return h.status();
    const uint64_t n = h->elements;
    if (h->codec == CodecId::kNone) {
      const uint64_t need = kHeaderBytes + 4 * n;
      if (n > payload.size() / 4 || payload.size() != need) {
        return dataLoss("none payload of " + std::to_string(n) + " elements must be " +
                        std::to_string(need) + " bytes, got " + std::to_string(payload.size()));
      }
      return Status::ok();
    }
    if (payload.size() < kRandomkHeaderBytes) {
      return dataLoss("randomk payload truncated: " + std::to_string(payload.size()) +
                      " bytes, its fixed fields need " + std::to_string(kRandomkHeaderBytes));
    }
    const uint8_t* p = payload.data();
    const uint32_t seed = loadU32(p + 16), name_key = loadU32(p + 20), step = loadU32(p + 24);
    if (loadU32(p + 28) != 0) return dataLoss("randomk payload has a non-zero reserved field");
    const uint64_t start = loadU64(p + 32), t = loadU64(p + 40), nnz = loadU64(p + 48);
    const uint64_t value_bytes = (h->flags & kFlagF16Values) ? 2 : 4;
    if (t > kFullWord) {
      return dataLoss("randomk payload selection word " + std::to_string(t) + " exceeds 2^32");
    }
    if (start > std::numeric_limits<uint64_t>::max() - n) {
      return dataLoss("randomk payload start " + std::to_string(start) + " plus " +
                      std::to_string(n) + " elements overflows");
    }
    if (nnz > n) {
      return dataLoss("randomk payload claims nnz " + std::to_string(nnz) + " > " +
                      std::to_string(n) + " elements");
    }
    const uint64_t need = kRandomkHeaderBytes + value_bytes * nnz;
    if (payload.size() != need) {
      return dataLoss("randomk payload with nnz " + std::to_string(nnz) + " must be " +
                      std::to_string(need) + " bytes, got " + std::to_string(payload.size()));
    }
    const uint64_t count = hostSelectedCount(seed, name_key, step, start, n, t);
    if (count != nnz) {
      return dataLoss("randomk payload carries " + std::to_string(nnz) +
                      " values but its selection fields select " + std::to_string(count));
    }
    return Status::ok();
  }

 protected:
  Status doAnalyze(const StepContext& ctx, const Chunking& chunking, DeviceTensor, DeviceState&,
                   DeviceBytes workspace, cudaStream_t stream) const override {
    double density = density_;
    if (ctx.density) {
      LW_RETURN_IF_ERROR(checkDensity(*ctx.density, "randomk: step density"));
      density = *ctx.density;
    }
    const size_t n = chunking.elements;
    const uint64_t t = selectionWord(n, selectionSize(n, density));
    setWordKernel<<<1, 1, 0, stream>>>(static_cast<uint64_t*>(workspace.data), t);
    return cudaStatus(cudaGetLastError(), "randomk (cuda): analyze");
  }

  Status doEncodeChunk(const StepContext& ctx, const Chunking& chunking, size_t chunk, int,
                       std::span<const uint8_t>, DeviceTensor input, DeviceState&,
                       DeviceBytes workspace, uint8_t* d_out, uint64_t* d_size,
                       cudaStream_t stream) const override {
    const uint64_t begin = chunking.begin(chunk), len = chunking.size(chunk);
    auto* ws = static_cast<uint8_t*>(workspace.data);
    const auto* d_t = reinterpret_cast<const uint64_t*>(ws);
    auto* d_total = reinterpret_cast<uint64_t*>(ws + 8);
    auto* offsets = reinterpret_cast<uint64_t*>(ws + kAlign);
    // The chunk's groups ⌊begin/4⌋ .. ⌊(begin+len−1)/4⌋, in tiles (<= tilesBound(len)).
    const uint64_t tiles = len == 0 ? 0 : ((begin + len - 1) / 4 - begin / 4) / kTileGroups + 1;
    const bool f16 = host_->config().sparse_values == DType::kF16;
    Job job;
    job.seed = ctx.seed;
    job.name_key = ctx.name_key;
    job.step = static_cast<uint32_t>(ctx.step);
    job.start = begin;
    job.len = len;
    job.d_t = d_t;
    HeaderArgs h;
    h.dtype = static_cast<uint8_t>(input.dtype);
    h.flags = f16 ? kFlagF16Values : uint8_t{0};
    h.seed = job.seed;
    h.name_key = job.name_key;
    h.step = job.step;
    h.start = begin;
    h.len = len;
    h.value_bytes = f16 ? 2 : 4;
    const unsigned grid = gridFor(tiles);
    if (tiles > 0) countTilesKernel<<<grid, kThreads, 0, stream>>>(job, offsets, tiles);
    scanTilesKernel<<<1, kScanThreads, 0, stream>>>(offsets, tiles, d_total, h, d_t, d_out, d_size);
    if (tiles > 0) {
      uint8_t* vals = d_out + kRandomkHeaderBytes;
      visitDeviceDType(input.dtype, [&](auto d) {
        constexpr DType D = decltype(d)::value;
        if (f16) {
          encodeValuesKernel<D, true>
              <<<grid, kThreads, 0, stream>>>(job, input.data, offsets, tiles, vals);
        } else {
          encodeValuesKernel<D, false>
              <<<grid, kThreads, 0, stream>>>(job, input.data, offsets, tiles, vals);
        }
      });
    }
    return cudaStatus(cudaGetLastError(), "randomk (cuda): encoding");
  }

 private:
  std::unique_ptr<Codec> host_;
  double density_;
};

LW_REGISTER_CUDA_CODEC(randomk, CodecId::kRandomk,
                       [](std::unique_ptr<Codec> host) -> Result<std::unique_ptr<CudaCodec>> {
                         auto density = configuredDensity(host->config(), "randomk");
                         if (!density) return density.status();
                         return std::unique_ptr<CudaCodec>(
                             new CudaRandomk(std::move(host), *density));
                       });

}  // namespace
}  // namespace lightwire::kernels::cuda
