// `powersgd` on the GPU (docs/determinism.md §4.12, docs/wire-format.md "powersgd"), without
// cuBLAS: the products are tall-skinny (M is rows × cols, the factors rows × r and cols × r with a
// small r), memory-bound, and every sum of §4.12 is a canonical fp64 sum (§2) that the kernels
// below reproduce term for term: the same fp64 products (__dmul_rn), the same accumulator for every
// term (a_(t mod 8) inside 4096-term blocks), the same combination
// ((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7)), block sums added in block order from +0.0, one rounding to
// fp32 at the end. fp64 addition is commutative, so which thread holds which operand of an addition
// does not change a bit; only the association is fixed, and it is the CPU's. Hence the payloads,
// the decoded result and the state are byte-identical to kernels/codecs/powersgd.cc, not merely
// within the 1e-4 tolerance determinism.md allows for cuBLAS.
//
// Kernels (RT = 8 factor columns per launch; larger ranks loop over column tiles):
//   mKernel            M = widen(x) + e (fp32) into the error slot of the work area, as the CPU.
//   initQKernel        one block per factor column j: the committed warm start when the committed
//                      meta block is valid for this view and the column is not all ±0, else the
//                      shared Philox draw; writes Q (the work area) and Qᵀ (workspace), and the
//                      meta block (valid = 0).
//   rowProductKernel   round 0, P[i][j] = Σ_k M[i][k]·Q[k][j]: eight consecutive lanes own one
//                      (row, 4096-column block) pair, lane a is accumulator a_a (columns ≡ a mod 8,
//                      in order, reading Qᵀ rows contiguously); three width-8 shuffles combine.
//                      One block per row (cols <= 4096): the result is stored directly; otherwise
//                      the block sums go to the workspace and finalizeKernel adds them in order.
//   colProductKernel   round 1, Q[k][j] = Σ_i M[i][k]·P̂[i][j]: a CUDA block takes 32 columns of one
//                      4096-row block; warp a is accumulator a_a (rows ≡ a mod 8, in order) and its
//                      32 lanes read 32 consecutive elements of a row (coalesced); the eight
//                      accumulators are combined through shared memory. Block sums as above.
//   orthoKernel        modified Gram–Schmidt, twice per column, in one block of 1024 threads (the
//                      column order is sequential anyway): canonical dots by groups of eight lanes
//                      per 4096-row block, block sums added in order by one thread, the updates
//                      by all threads.
//   productKernel      decode / error update, one thread per element: v = (float) canonical
//                      Σ_j P̂[i][j]·T[k][j] (j < r <= 1024: one canonical block), then
//                      out = out + (w·v), or e = e − (w·v) at commit.
//   finishQKernel      Q' = w·T (fp32) and the meta block (valid = 1) into the work area, after
//                      the error: finishStep keeps P̂, T and w in the workspace for the commit.
//   commitErrorKernel  the commit, in place: e = widen(x) + e (M again, bit for bit), then
//                      productKernel's e = e − (w·v), then copyNextKernel the meta block and Q'.
//
// The work area has the state's layout: M (n), then the next meta block and Q'. M is used up by
// the end of round 1, so the result is decoded over it (the GPU backend decodes after the
// exchange) and the commit recomputes the error from the input, as the CPU's commitState() does
// (docs/determinism.md §4.6c): no result buffer beside the work area.
//
// Checks the CPU makes against device state (encodeChunk: the matrix view analyze() wrote;
// finishStep: a matching analyze() and a single call per step) cannot return a Status without a
// device synchronisation. They are made on the device instead: encodeChunk writes a payload size
// of 0 (an invalid payload every decoder refuses); finishStep without a matching analyze(), or a
// second time, prepares nothing (it stages its factors into the workspace again, so a commit after
// it uses that call's: the GPU backend calls it once per step), and commitState changes nothing
// unless a finishStep prepared the step.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "kernels/codecs/powersgd_layout.h"
#include "kernels/cuda/codec.h"
#include "kernels/cuda/device.cuh"
#include "kernels/cuda/reduce.h"
#include "kernels/payload.h"
#include "kernels/philox.h"

namespace lightwire::kernels::cuda {
namespace {

using powersgd::describe;
using powersgd::Factors;
using powersgd::kFactorOffset;
using powersgd::kMetaFloats;
using powersgd::View;

constexpr uint64_t kBlock = 4096;  // canonical reduction block (docs/determinism.md §2)
static_assert(kBlock == kReduceBlock);
constexpr unsigned kRT = 8;                   // factor columns per product launch
constexpr unsigned kThreads = kBlockThreads;  // 256
constexpr unsigned kOrthoThreads = 1024;
constexpr uint32_t kStream = 0xFFFFFFFFu;
constexpr uint32_t kPurpose = 5;
static_assert(kStream == kSharedStream);
static_assert(kPurpose == static_cast<uint32_t>(RandomPurpose::kPowersgdInit));
constexpr size_t kAlign = 256;

size_t alignUp(size_t b) { return (b + kAlign - 1) & ~(kAlign - 1); }

/// View equality on the device (View's operator== is host-only).
__host__ __device__ __forceinline__ bool sameView(const View& a, const View& b) {
  return a.rows == b.rows && a.cols == b.cols && a.rank == b.rank;
}

/// kernels/codecs/powersgd.cc metaView(): the view a meta block records.
__host__ __device__ __forceinline__ uint64_t metaField(float f) {
  return f >= 0.0f && f < 65536.0f ? static_cast<uint64_t>(f) : uint64_t{1} << 40;
}
__host__ __device__ __forceinline__ View metaView(const float* meta) {
  return View{(metaField(meta[1]) << 16) | metaField(meta[2]),
              (metaField(meta[3]) << 16) | metaField(meta[4]), metaField(meta[5])};
}

/// The meta block's eight floats for a view (writeMeta of the CPU).
struct Meta {
  float v[kMetaFloats];
};
Meta metaFor(const View& v, float valid) {
  Meta m{};
  powersgd::writeMeta(m.v, v, valid);
  return m;
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

/// ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)) of the eight lanes of a width-8 group, in
/// lane 0 of the group (the other lanes hold partial sums). Every lane of the warp must call it.
__device__ __forceinline__ double combineGroupOf8(double acc) {
  acc = __dadd_rn(acc, __shfl_down_sync(0xFFFFFFFFu, acc, 1, 8));
  acc = __dadd_rn(acc, __shfl_down_sync(0xFFFFFFFFu, acc, 2, 8));
  acc = __dadd_rn(acc, __shfl_down_sync(0xFFFFFFFFu, acc, 4, 8));
  return acc;
}

// --- kernels -------------------------------------------------------------------------------------

/// M[i] = widen(x[i]) + e[i] (fp32, one rounding).
template <DType D>
__global__ void __launch_bounds__(kThreads)
    mKernel(const void* __restrict__ x, const float* __restrict__ e, float* __restrict__ m,
            size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    m[i] = __fadd_rn(loadWidenedDevice<D>(x, i), e[i]);
  }
}

/// out[i] = widen(x[i]) + e[i]; en[i] = 0 (flush).
template <DType D>
__global__ void __launch_bounds__(kThreads)
    flushKernel(const void* __restrict__ x, const float* __restrict__ e, float* __restrict__ out,
                float* __restrict__ en, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = __fadd_rn(loadWidenedDevice<D>(x, i), e[i]);
    en[i] = 0.0f;
  }
}

/// Block j = factor column j: Q[k][j] for k < cols into q (the work area) and qt[j·cols + k].
/// The committed column when `warm` (meta valid for this view) and not entirely ±0.0, else
/// (float)(2·u − 1) with u = word(k·r + j)·2^-32 of Philox(step, shared stream, purpose 5).
/// Block 0 also writes the next meta block.
__global__ void __launch_bounds__(kThreads)
    initQKernel(const float* __restrict__ meta_cur, const float* __restrict__ q_cur,
                float* __restrict__ meta_next, float* __restrict__ q, float* __restrict__ qt,
                View view, Meta next_meta, DevicePhilox philox) {
  const uint64_t r = view.rank, cols = view.cols, j = blockIdx.x;
  const bool warm = meta_cur[0] == 1.0f && sameView(metaView(meta_cur), view);
  int nonzero = 0;
  if (warm) {
    for (uint64_t k = threadIdx.x; k < cols; k += blockDim.x) {
      const float v = q_cur[k * r + j];
      q[k * r + j] = v;
      qt[j * cols + k] = v;
      if (v != 0.0f) nonzero = 1;
    }
  }
  // Uniform: every thread of the block gets the same answer.
  if (!__syncthreads_or(nonzero)) {
    for (uint64_t k = threadIdx.x; k < cols; k += blockDim.x) {
      const uint32_t word = philox.word(k * r + j);
      const float v = __double2float_rn(__dsub_rn(__dmul_rn(2.0, unitDoubleDevice(word)), 1.0));
      q[k * r + j] = v;
      qt[j * cols + k] = v;
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    for (unsigned f = 0; f < kMetaFloats; ++f) meta_next[f] = next_meta.v[f];
  }
}

/// Round 0 for factor columns j0 .. j0+jn (jn <= kRT): for every (row i, column block b) pair,
/// s = canonical block sum over k in [4096b, min(cols, 4096b + 4096)) of (double)M(i,k)·Qᵀ[j][k],
/// M(i,k) = m[i·cols + k] below n, +0.0 past it. nbc == 1: the row's value (float)(0.0 + s) goes to
/// the payload body at P[i][j]; else s goes to partial[(i·nbc + b)·kRT + jj].
__global__ void __launch_bounds__(kThreads)
    rowProductKernel(const float* __restrict__ m, uint64_t n, uint64_t rows, uint64_t cols,
                     uint64_t r, const float* __restrict__ qt, uint64_t j0, unsigned jn,
                     uint64_t nbc, uint8_t* __restrict__ body, double* __restrict__ partial) {
  const uint64_t pairs = rows * nbc;
  const uint64_t groups_per_grid = static_cast<uint64_t>(gridDim.x) * (blockDim.x / 8);
  const unsigned a = threadIdx.x & 7;
  // The warp's first pair is uniform across the warp: all 32 lanes reach the shuffles.
  for (uint64_t base = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + (threadIdx.x & ~31u)) / 8;
       base < pairs; base += groups_per_grid) {
    const uint64_t pair = base + (threadIdx.x & 31) / 8;
    const bool live = pair < pairs;
    double acc[kRT];
#pragma unroll
    for (unsigned jj = 0; jj < kRT; ++jj) acc[jj] = 0.0;
    uint64_t i = 0, b = 0;
    if (live) {
      i = pair / nbc;
      b = pair % nbc;
      const uint64_t end = cols < (b + 1) * kBlock ? cols : (b + 1) * kBlock;
      const uint64_t row = i * cols;
#pragma unroll 4
      for (uint64_t k = b * kBlock + a; k < end; k += 8) {
        const double mk = row + k < n ? static_cast<double>(m[row + k]) : 0.0;
#pragma unroll
        for (unsigned jj = 0; jj < kRT; ++jj) {
          if (jj < jn) {
            const double q = static_cast<double>(qt[(j0 + jj) * cols + k]);
            acc[jj] = __dadd_rn(acc[jj], __dmul_rn(mk, q));
          }
        }
      }
    }
#pragma unroll
    for (unsigned jj = 0; jj < kRT; ++jj) acc[jj] = combineGroupOf8(acc[jj]);
    if (live && a == 0) {
#pragma unroll
      for (unsigned jj = 0; jj < kRT; ++jj) {
        if (jj < jn) {
          if (nbc == 1) {
            const float p = __double2float_rn(__dadd_rn(0.0, acc[jj]));
            storeU32Dev(body + 4 * (i * r + j0 + jj), __float_as_uint(p));
          } else {
            partial[pair * kRT + jj] = acc[jj];
          }
        }
      }
    }
  }
}

/// out[o][j0 + jj] = (float)(+0.0 + partial[(o·nb + 0)·kRT + jj] + ... + partial[(o·nb + nb−1)·kRT
/// + jj]) for o < outer, jj < jn: the block sums of round 0 (o = row, b = column block) in order.
__global__ void __launch_bounds__(kThreads)
    finalizeRowsKernel(const double* __restrict__ partial, uint64_t outer, uint64_t nb, uint64_t r,
                       uint64_t j0, unsigned jn, uint8_t* __restrict__ body) {
  const uint64_t total = outer * jn;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t t = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += stride) {
    const uint64_t o = t / jn, jj = t % jn;
    double s = 0.0;
    for (uint64_t b = 0; b < nb; ++b) s = __dadd_rn(s, partial[(o * nb + b) * kRT + jj]);
    storeU32Dev(body + 4 * (o * r + j0 + jj), __float_as_uint(__double2float_rn(s)));
  }
}

/// Round 1 for factor columns j0 .. j0+jn: item = (32-column tile ct, 4096-row block b); warp a of
/// the block is accumulator a_a over rows ≡ a (mod 8) of the block, lane c is column
/// k = 32·ct + c. s = ((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7)) of the terms (double)M(i,k)·P̂[i][j].
/// nbr == 1: Q[k][j] = (float)(0.0 + s) into the body; else s into partial[(b·cols + k)·kRT + jj].
__global__ void __launch_bounds__(kThreads)
    colProductKernel(const float* __restrict__ m, uint64_t n, uint64_t rows, uint64_t cols,
                     uint64_t r, const float* __restrict__ phat, uint64_t j0, unsigned jn,
                     uint64_t nbr, uint8_t* __restrict__ body, double* __restrict__ partial) {
  __shared__ double sh[8][kRT][32];
  const unsigned a = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint64_t tiles = (cols + 31) / 32;
  const uint64_t items = tiles * nbr;
  for (uint64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const uint64_t ct = item % tiles, b = item / tiles;
    const uint64_t k = ct * 32 + lane;
    double acc[kRT];
#pragma unroll
    for (unsigned jj = 0; jj < kRT; ++jj) acc[jj] = 0.0;
    if (k < cols) {
      const uint64_t end = rows < (b + 1) * kBlock ? rows : (b + 1) * kBlock;
#pragma unroll 4
      for (uint64_t i = b * kBlock + a; i < end; i += 8) {
        const uint64_t idx = i * cols + k;
        const double x = idx < n ? static_cast<double>(m[idx]) : 0.0;
#pragma unroll
        for (unsigned jj = 0; jj < kRT; ++jj) {
          if (jj < jn) {
            acc[jj] = __dadd_rn(acc[jj], __dmul_rn(x, static_cast<double>(phat[i * r + j0 + jj])));
          }
        }
      }
    }
#pragma unroll
    for (unsigned jj = 0; jj < kRT; ++jj) sh[a][jj][lane] = acc[jj];
    __syncthreads();
    if (a == 0 && k < cols) {
#pragma unroll
      for (unsigned jj = 0; jj < kRT; ++jj) {
        if (jj < jn) {
          const double s = __dadd_rn(__dadd_rn(__dadd_rn(sh[0][jj][lane], sh[1][jj][lane]),
                                               __dadd_rn(sh[2][jj][lane], sh[3][jj][lane])),
                                     __dadd_rn(__dadd_rn(sh[4][jj][lane], sh[5][jj][lane]),
                                               __dadd_rn(sh[6][jj][lane], sh[7][jj][lane])));
          if (nbr == 1) {
            storeU32Dev(body + 4 * (k * r + j0 + jj),
                        __float_as_uint(__double2float_rn(__dadd_rn(0.0, s))));
          } else {
            partial[(b * cols + k) * kRT + jj] = s;
          }
        }
      }
    }
    __syncthreads();  // sh is reused by the next item
  }
}

/// Round 1's block sums in order: Q[k][j0 + jj] = (float)(+0.0 + Σ_b partial[(b·cols + k)·kRT +
/// jj]).
__global__ void __launch_bounds__(kThreads)
    finalizeColsKernel(const double* __restrict__ partial, uint64_t cols, uint64_t nb, uint64_t r,
                       uint64_t j0, unsigned jn, uint8_t* __restrict__ body) {
  const uint64_t total = cols * jn;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t t = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += stride) {
    const uint64_t k = t / jn, jj = t % jn;
    double s = 0.0;
    for (uint64_t b = 0; b < nb; ++b) s = __dadd_rn(s, partial[(b * cols + k) * kRT + jj]);
    storeU32Dev(body + 4 * (k * r + j0 + jj), __float_as_uint(__double2float_rn(s)));
  }
}

/// Canonical Σ_i (double)A[i][l]·(double)A[i][j] over i < rows, the same value returned to every
/// thread of the (single, kOrthoThreads) block. bs: one double per 4096-row block. Synchronises.
__device__ double columnDot(const float* a, uint64_t rows, uint64_t r, uint64_t l, uint64_t j,
                            double* bs, double* sh_result) {
  const uint64_t nbr = (rows + kBlock - 1) / kBlock;
  const unsigned lane8 = threadIdx.x & 7;
  constexpr uint64_t kGroups = kOrthoThreads / 8;
  for (uint64_t base = (threadIdx.x & ~31u) / 8; base < nbr; base += kGroups) {
    const uint64_t cb = base + (threadIdx.x & 31) / 8;
    const bool live = cb < nbr;
    double acc = 0.0;
    if (live) {
      const uint64_t end = rows < (cb + 1) * kBlock ? rows : (cb + 1) * kBlock;
#pragma unroll 8
      for (uint64_t i = cb * kBlock + lane8; i < end; i += 8) {
        acc = __dadd_rn(
            acc, __dmul_rn(static_cast<double>(a[i * r + l]), static_cast<double>(a[i * r + j])));
      }
    }
    acc = combineGroupOf8(acc);
    if (live && lane8 == 0) bs[cb] = acc;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0.0;
    for (uint64_t cb = 0; cb < nbr; ++cb) t = __dadd_rn(t, bs[cb]);
    *sh_result = t;
  }
  __syncthreads();
  return *sh_result;  // rewritten only after the next call's first __syncthreads()
}

/// Orthonormalises the columns of the rows × r matrix `a` (row-major) in place, as the CPU's
/// orthonormalize(): for each column j in order, two passes of projections on columns 0..j−1
/// (A_j = (float)((double)A_j − d·(double)A_l)), then A_j = (float)((double)A_j / ν) unless ν = 0.
__global__ void __launch_bounds__(kOrthoThreads)
    orthoKernel(float* a, uint64_t rows, uint64_t r, double* bs) {
  __shared__ double result;
  for (uint64_t j = 0; j < r; ++j) {
    for (int pass = 0; pass < 2; ++pass) {
      for (uint64_t l = 0; l < j; ++l) {
        const double d = columnDot(a, rows, r, l, j, bs, &result);
        for (uint64_t i = threadIdx.x; i < rows; i += blockDim.x) {
          const double t = __dmul_rn(d, static_cast<double>(a[i * r + l]));
          a[i * r + j] = __double2float_rn(__dsub_rn(static_cast<double>(a[i * r + j]), t));
        }
        __syncthreads();
      }
    }
    const double norm = __dsqrt_rn(columnDot(a, rows, r, j, j, bs, &result));
    if (norm == 0.0) continue;  // uniform: every thread has the same norm
    for (uint64_t i = threadIdx.x; i < rows; i += blockDim.x) {
      a[i * r + j] = __double2float_rn(__ddiv_rn(static_cast<double>(a[i * r + j]), norm));
    }
    __syncthreads();
  }
}

/// For every real element idx = i·cols + k < n: v = (float)(0.0 + canonical Σ_j P̂[i][j]·T[k][j])
/// (j < r <= 1024, one canonical block), then dst[idx] = dst[idx] + (w·v), or − (w·v) when
/// kSubtract. `w_dev`: when non-null, w is read there (the commit: finishStep stored it). `meta`:
/// when non-null, the kernel does nothing unless it records `view` with valid = 1 (the commit's
/// guard: finishStep ran for this view).
template <bool kSubtract>
__global__ void __launch_bounds__(kThreads)
    productKernel(const float* __restrict__ phat, const float* __restrict__ t, uint64_t n,
                  uint64_t cols, uint64_t r, float w, const float* w_dev, float* dst,
                  const float* meta, View view) {
  if (meta != nullptr && (meta[0] != 1.0f || !sameView(metaView(meta), view))) return;
  if (w_dev != nullptr) w = *w_dev;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t idx = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
       idx += stride) {
    const uint64_t i = idx / cols, k = idx - i * cols;
    const float* prow = phat + i * r;
    const float* trow = t + k * r;
    double acc[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    for (uint64_t j0 = 0; j0 < r; j0 += 8) {
#pragma unroll
      for (unsigned q = 0; q < 8; ++q) {
        if (j0 + q < r) {
          acc[q] = __dadd_rn(acc[q], __dmul_rn(static_cast<double>(prow[j0 + q]),
                                               static_cast<double>(trow[j0 + q])));
        }
      }
    }
    const double s = __dadd_rn(__dadd_rn(__dadd_rn(acc[0], acc[1]), __dadd_rn(acc[2], acc[3])),
                               __dadd_rn(__dadd_rn(acc[4], acc[5]), __dadd_rn(acc[6], acc[7])));
    const float v = __double2float_rn(__dadd_rn(0.0, s));
    const float sw = __fmul_rn(w, v);
    dst[idx] = kSubtract ? __fsub_rn(dst[idx], sw) : __fadd_rn(dst[idx], sw);
  }
}

/// finishStep: qn[i] = w · T[i] (fp32) for i < count, unless the guard fails (as productKernel).
__global__ void __launch_bounds__(kThreads)
    finishQKernel(const float* __restrict__ t, uint64_t count, float w, float* __restrict__ qn,
                  const float* __restrict__ meta, View view) {
  if (meta[0] != 0.0f || !sameView(metaView(meta), view)) return;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    qn[i] = __fmul_rn(w, t[i]);
  }
}

/// finishStep: the step's weight for the commit (one thread), under the same guard.
__global__ void finishWeightKernel(const float* meta, View view, float w, float* w_dev) {
  if (meta[0] != 0.0f || !sameView(metaView(meta), view)) return;
  *w_dev = w;
}

/// The commit's first pass: e = widen(x) + e (M of analyze, bit for bit), unless the work area's
/// meta block `next` says finishStep() has not run for `view`.
template <DType D>
__global__ void __launch_bounds__(kThreads)
    commitErrorKernel(const void* __restrict__ x, float* e, size_t n, const float* next,
                      View view) {
  if (next[0] != 1.0f || !sameView(metaView(next), view)) return;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    e[i] = __fadd_rn(loadWidenedDevice<D>(x, i), e[i]);
  }
}

/// The commit's last pass: the meta block and Q' (`count` floats from `next`) into the state,
/// under the same guard.
__global__ void __launch_bounds__(kThreads)
    copyNextKernel(const float* __restrict__ next, float* __restrict__ dst, uint64_t count,
                   View view) {
  if (next[0] != 1.0f || !sameView(metaView(next), view)) return;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    dst[i] = next[i];
  }
}

/// finishStep, last: the meta block (valid = 1), under the same guard. One thread.
__global__ void finishMetaKernel(float* meta, View view, Meta next) {
  if (meta[0] != 0.0f || !sameView(metaView(meta), view)) return;
  for (unsigned f = 0; f < kMetaFloats; ++f) meta[f] = next.v[f];
}

/// The 32 header bytes of a factor payload and its size. `meta` (the work area's meta block, null
/// for n = 0): unless it records `view`, the size is 0 (analyze() used another view).
struct FactorHeader {
  uint8_t bytes[kFactorOffset];
};
__global__ void headerKernel(FactorHeader h, uint64_t size, const float* meta, View view,
                             uint8_t* out, uint64_t* d_size) {
  if (meta != nullptr && !sameView(metaView(meta), view)) {
    *d_size = 0;
    return;
  }
  for (size_t b = 0; b < kFactorOffset; ++b) out[b] = h.bytes[b];
  *d_size = size;
}

// --- host side -----------------------------------------------------------------------------------

unsigned gridOf(uint64_t work, uint64_t per_block) {
  const uint64_t blocks = (work + per_block - 1) / per_block;
  return static_cast<unsigned>(blocks == 0 ? 1 : std::min<uint64_t>(blocks, kMaxBlocks));
}

class CudaPowerSgd final : public CudaCodec {
 public:
  explicit CudaPowerSgd(std::unique_ptr<Codec> host) : host_(std::move(host)) {}

  const Codec& host() const override { return *host_; }

  /// F1 (Qᵀ, then P̂), F2 (the reduced Q in finishStep), the orthonormalisation's block sums,
  /// the products' block sums (views with more than 4096 columns or rows) and the step's weight
  /// (finishStep to the commit).
  size_t workspaceBytes(const Chunking& c) const override {
    return decodeBytes(c.elements) + alignUp(8 * partialDoubles(c.elements)) + kAlign;
  }
  /// decodeRounds(): the two staged factors and the orthonormalisation's block sums.
  size_t accumulateScratchBytes(size_t n) const override { return decodeBytes(n); }

  Status accumulate(const uint8_t*, float, float*, size_t, DeviceBytes,
                    cudaStream_t) const override {
    return failedPrecondition(
        "powersgd has two rounds: decode a step with decodeRounds() and the reduced payloads of "
        "both rounds, not decodeChunk()");
  }
  Status validate(std::span<const uint8_t>, size_t) const override {
    return failedPrecondition(
        "powersgd has two rounds: decode a step with decodeRounds() and the reduced payloads of "
        "both rounds, not decodeChunk()");
  }

  Status decodeRounds(std::span<const std::span<const uint8_t>> rounds, float weight, float* d_out,
                      size_t out_elements, DeviceBytes scratch,
                      cudaStream_t stream) const override {
    auto f = parseRounds(rounds, out_elements);
    if (!f) return f.status();
    const auto& [p, q] = *f;
    if (out_elements == 0) return Status::ok();
    if (d_out == nullptr) return invalidArgument("powersgd (cuda): output is null");
    if (scratch.size < decodeBytes(out_elements) || scratch.data == nullptr) {
      return invalidArgument("powersgd (cuda): decode scratch of " + std::to_string(scratch.size) +
                             " bytes, needs " + std::to_string(decodeBytes(out_elements)));
    }
    const Areas ar = areas(scratch.data, out_elements);
    LW_RETURN_IF_ERROR(stageAndOrthonormalize(p, ar, stream));
    LW_RETURN_IF_ERROR(stage(q, ar.f2, stream));
    productKernel<false><<<blocksFor(out_elements), kThreads, 0, stream>>>(
        ar.f1, ar.f2, out_elements, p.view.cols, p.view.rank, weight, nullptr, d_out, nullptr,
        p.view);
    return cudaStatus(cudaGetLastError(), "powersgd (cuda): decoding");
  }

  Status finishStep(const StepContext& ctx, const Chunking& chunking,
                    std::span<const std::span<const uint8_t>> rounds, float weight,
                    DeviceTensor input, DeviceState& state, DeviceBytes workspace,
                    cudaStream_t stream) const override {
    const size_t n = chunking.elements;
    const powersgd::FinishArgs args{.input_elements = input.elements,
                                    .state_floats = state.floats(),
                                    .state_needed = stateFloats(n, ctx.shape),
                                    .workspace_bytes = workspace.size,
                                    .workspace_needed = workspaceBytes(chunking),
                                    .workspace_null = workspace.data == nullptr};
    auto f = powersgd::parseFinishStep(ctx, chunking, rounds, args, host_->config().approx_rank);
    if (!f) return f.status();
    const auto& [p, q] = *f;
    if (n == 0) return Status::ok();
    float* m = state.work();
    if (m == nullptr) return failedPrecondition("powersgd (cuda): finishStep() before analyze()");
    float* meta = m + n;
    const Areas ar = areas(workspace.data, n);
    // P̂ and T stay in the workspace, and the weight beside them, for commitState()'s
    // e' = (x + e) − weight · (P̂·Tᵀ); Q' = weight · T (the warm start) and the meta block go to
    // the work area: each only when it holds a matching analyze() that no finishStep() has
    // completed. M (the work area's first n floats) is not read: the result may be there now.
    LW_RETURN_IF_ERROR(stageAndOrthonormalize(p, ar, stream));
    LW_RETURN_IF_ERROR(stage(q, ar.f2, stream));
    finishWeightKernel<<<1, 1, 0, stream>>>(meta, p.view, weight, ar.weight);
    finishQKernel<<<blocksFor(q.count), kThreads, 0, stream>>>(ar.f2, q.count, weight,
                                                               meta + kMetaFloats, meta, p.view);
    finishMetaKernel<<<1, 1, 0, stream>>>(meta, p.view, metaFor(p.view, 1.0f));
    return cudaStatus(cudaGetLastError(), "powersgd (cuda): finishStep");
  }

  /// The commit rereads the input (the error is recomputed in place).
  bool commitReadsInput() const override { return true; }

  /// e = (x + e) − weight · (P̂·Tᵀ) in place with what finishStep() kept in the workspace (the
  /// arithmetic of the double-buffered form, bit for bit), then the meta block and Q' of the work
  /// area. Guarded on the device: nothing changes unless finishStep() ran for this view.
  Status commitState(const StepContext& ctx, const Chunking& chunking, DeviceTensor input,
                     std::span<const std::span<const uint8_t>>, DeviceState& state,
                     DeviceBytes workspace, DeviceBytes, cudaStream_t stream) const override {
    auto view = stepView(ctx, chunking);
    if (!view) return view.status();
    const size_t n = chunking.elements;
    if (n == 0) return Status::ok();
    const View v = *view;
    const size_t q_floats = v.cols * v.rank;
    if (state.floats() != n + kMetaFloats + q_floats || input.elements != n ||
        workspace.size < workspaceBytes(chunking) || workspace.data == nullptr) {
      return invalidArgument(
          "powersgd (cuda): commit: the state, input or workspace is not the step's");
    }
    const float* next = state.work();
    if (next == nullptr) return failedPrecondition("powersgd (cuda): commit before analyze()");
    next += n;
    float* e = state.mutableCurrent();
    const Areas ar = areas(workspace.data, n);
    visitDeviceDType(input.dtype, [&](auto d) {
      commitErrorKernel<decltype(d)::value>
          <<<blocksFor(n), kThreads, 0, stream>>>(input.data, e, n, next, v);
    });
    productKernel<true><<<blocksFor(n), kThreads, 0, stream>>>(ar.f1, ar.f2, n, v.cols, v.rank,
                                                               0.0f, ar.weight, e, next, v);
    copyNextKernel<<<blocksFor(kMetaFloats + q_floats), kThreads, 0, stream>>>(
        next, e + n, kMetaFloats + q_floats, v);
    return cudaStatus(cudaGetLastError(), "powersgd (cuda): commit");
  }

  Result<double> residualNorm2(const DeviceState& state, size_t n, DeviceBytes scratch,
                               cudaStream_t stream) const override {
    if (!powersgd::stateHolds(state.floats(), n, host_->config().approx_rank)) return 0.0;
    if (scratch.size < residualScratchBytes(n) || scratch.data == nullptr) {
      return invalidArgument("powersgd (cuda): residual norm scratch of " +
                             std::to_string(scratch.size) + " bytes, needs " +
                             std::to_string(residualScratchBytes(n)));
    }
    auto* sums = static_cast<double*>(scratch.data);
    double* total = sums + canonicalBlocks(n);
    LW_RETURN_IF_ERROR(cudaStatus(
        canonicalSum(state.current(), DType::kF32, n, ReduceTerm::kSquare, sums, total, stream),
        "powersgd (cuda): residual norm"));
    double host = 0.0;
    cudaError_t e = cudaMemcpyAsync(&host, total, sizeof(double), cudaMemcpyDeviceToHost, stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    if (e != cudaSuccess) return cudaStatus(e, "powersgd (cuda): residual norm");
    return host;
  }

 protected:
  Status doAnalyze(const StepContext& ctx, const Chunking& chunking, DeviceTensor input,
                   DeviceState& state, DeviceBytes workspace, cudaStream_t stream) const override {
    auto view = stepView(ctx, chunking);
    if (!view) return view.status();
    const size_t n = chunking.elements;
    if (n == 0) return Status::ok();
    const View v = *view;
    const float* e = state.current();
    float* m = state.work();
    visitDeviceDType(input.dtype, [&](auto d) {
      mKernel<decltype(d)::value><<<blocksFor(n), kThreads, 0, stream>>>(input.data, e, m, n);
    });
    const Areas ar = areas(workspace.data, n);
    const DevicePhilox philox{ctx.seed, ctx.name_key, static_cast<uint32_t>(ctx.step), kStream,
                              kPurpose};
    initQKernel<<<static_cast<unsigned>(v.rank), kThreads, 0, stream>>>(
        e + n, e + n + kMetaFloats, m + n, m + n + kMetaFloats, ar.f1, v, metaFor(v, 0.0f), philox);
    return cudaStatus(cudaGetLastError(), "powersgd (cuda): analyze");
  }

  Status doEncodeChunk(const StepContext& ctx, const Chunking& chunking, size_t, int round,
                       std::span<const uint8_t> previous, DeviceTensor input, DeviceState& state,
                       DeviceBytes workspace, uint8_t* d_out, uint64_t* d_size,
                       cudaStream_t stream) const override {
    auto view = stepView(ctx, chunking);
    if (!view) return view.status();
    const View v = *view;
    const size_t n = chunking.elements;
    const uint64_t r = v.rank, rows = v.rows, cols = v.cols;
    const float* m = state.work();
    const float* meta = n == 0 ? nullptr : m + n;
    uint8_t* body = d_out + kFactorOffset;
    const Areas ar = areas(workspace.data, n);
    if (round == 0) {
      if (n > 0) {
        const uint64_t nbc = (cols + kBlock - 1) / kBlock;
        LW_RETURN_IF_ERROR(checkPartials(nbc > 1 ? rows * nbc : 0, n));
        for (uint64_t j0 = 0; j0 < r; j0 += kRT) {
          const unsigned jn = static_cast<unsigned>(std::min<uint64_t>(kRT, r - j0));
          rowProductKernel<<<gridOf(rows * nbc, kThreads / 8), kThreads, 0, stream>>>(
              m, n, rows, cols, r, ar.f1, j0, jn, nbc, body, ar.partial);
          if (nbc > 1) {
            finalizeRowsKernel<<<gridOf(rows * jn, kThreads), kThreads, 0, stream>>>(
                ar.partial, rows, nbc, r, j0, jn, body);
          }
        }
      }
      headerKernel<<<1, 1, 0, stream>>>(headerFor(input.dtype, 0, n, v),
                                        kFactorOffset + 4 * rows * r, meta, v, d_out, d_size);
      return cudaStatus(cudaGetLastError(), "powersgd (cuda): round 0");
    }
    // Round 1: P̂ = orthonormalise(reduced P), then Q[k][j] = canonical Σ_i M[i][k]·P̂[i][j].
    auto p = parseFactors(previous, n, 0, "powersgd: the reduced round-0 payload");
    if (!p) return p.status();
    if (p->view != v) {
      return dataLoss("powersgd: the reduced round-0 payload is for a " + describe(p->view) +
                      " view, this rank uses " + describe(v));
    }
    if (n > 0) {
      LW_RETURN_IF_ERROR(stageAndOrthonormalize(*p, ar, stream));
      const uint64_t nbr = (rows + kBlock - 1) / kBlock;
      LW_RETURN_IF_ERROR(checkPartials(nbr > 1 ? nbr * cols : 0, n));
      const uint64_t items = (cols + 31) / 32 * nbr;
      for (uint64_t j0 = 0; j0 < r; j0 += kRT) {
        const unsigned jn = static_cast<unsigned>(std::min<uint64_t>(kRT, r - j0));
        colProductKernel<<<gridOf(items, 1), kThreads, 0, stream>>>(m, n, rows, cols, r, ar.f1, j0,
                                                                    jn, nbr, body, ar.partial);
        if (nbr > 1) {
          finalizeColsKernel<<<gridOf(cols * jn, kThreads), kThreads, 0, stream>>>(
              ar.partial, cols, nbr, r, j0, jn, body);
        }
      }
    }
    headerKernel<<<1, 1, 0, stream>>>(headerFor(input.dtype, 1, n, v), kFactorOffset + 4 * cols * r,
                                      meta, v, d_out, d_size);
    return cudaStatus(cudaGetLastError(), "powersgd (cuda): round 1");
  }

  /// out = x + e (M of analyze, bit for bit); the prepared error is zero, the committed meta block
  /// and warm-start Q are kept.
  Status doFlush(const StepContext&, const Chunking& chunking, DeviceTensor input,
                 DeviceState& state, float* d_out, cudaStream_t stream) const override {
    const size_t n = chunking.elements;
    if (n == 0) return Status::ok();
    const float* e = state.current();
    float* en = state.work();
    visitDeviceDType(input.dtype, [&](auto d) {
      flushKernel<decltype(d)::value>
          <<<blocksFor(n), kThreads, 0, stream>>>(input.data, e, d_out, en, n);
    });
    LW_RETURN_IF_ERROR(cudaStatus(cudaGetLastError(), "powersgd (cuda): flush"));
    return cudaStatus(cudaMemcpyAsync(en + n, e + n, (state.floats() - n) * sizeof(float),
                                      cudaMemcpyDeviceToDevice, stream),
                      "powersgd (cuda): flush");
  }

 private:
  /// Room for one factor (rows·r or cols·r values) of any view of n elements (the CPU's bound).
  size_t capFactor(size_t n) const { return powersgd::capFactor(n, host_->config().approx_rank); }
  /// Block sums of the orthonormalisation: ⌈rows/4096⌉ <= n/4096 + 1 for any view.
  static size_t orthoDoubles(size_t n) { return n / kBlock + 2; }
  /// Block sums of one product launch (kRT factor columns), used when cols > 4096 (round 0:
  /// rows·⌈cols/4096⌉ < 2·rows·cols/4096 <= 2·(2n − 1)/4096 < n/1024 pairs) or rows > 4096
  /// (round 1: ⌈rows/4096⌉·cols < n/1024 likewise), as rows·cols < n + cols <= 2n.
  static size_t partialDoubles(size_t n) { return kRT * (n / 1024 + 1); }
  /// Guards the bound above (a violation would be a bug here, never the caller's).
  static Status checkPartials(uint64_t sums, size_t n) {
    if (sums * kRT <= partialDoubles(n)) return Status::ok();
    return internalError("powersgd (cuda): " + std::to_string(sums) +
                         " block sums exceed the workspace bound for " + std::to_string(n) +
                         " elements");
  }
  size_t decodeBytes(size_t n) const {
    if (n == 0) return 0;
    return 2 * alignUp(4 * capFactor(n)) + alignUp(8 * orthoDoubles(n));
  }

  /// The workspace's areas (decodeRounds' scratch: the first three).
  struct Areas {
    float* f1 = nullptr;
    float* f2 = nullptr;
    double* ortho = nullptr;
    double* partial = nullptr;
    float* weight = nullptr;
  };
  Areas areas(void* base, size_t n) const {
    auto* p = static_cast<uint8_t*>(base);
    Areas a;
    const size_t f = alignUp(4 * capFactor(n));
    a.f1 = reinterpret_cast<float*>(p);
    a.f2 = reinterpret_cast<float*>(p + f);
    a.ortho = reinterpret_cast<double*>(p + 2 * f);
    a.partial = reinterpret_cast<double*>(p + 2 * f + alignUp(8 * orthoDoubles(n)));
    a.weight = reinterpret_cast<float*>(p + decodeBytes(n) + alignUp(8 * partialDoubles(n)));
    return a;
  }

  /// Copies a factor payload's values (host) into `dst` (device). Pageable host memory: staged
  /// before cudaMemcpyAsync returns, so the payload may go when the call returns.
  static Status stage(const Factors& f, float* dst, cudaStream_t stream) {
    if (f.count == 0) return Status::ok();
    return cudaStatus(cudaMemcpyAsync(dst, f.values, 4 * f.count, cudaMemcpyHostToDevice, stream),
                      "powersgd (cuda): staging a reduced payload");
  }
  /// P̂ of the reduced round-0 payload, in ar.f1.
  static Status stageAndOrthonormalize(const Factors& p, const Areas& ar, cudaStream_t stream) {
    if (p.count == 0) return Status::ok();
    if ((p.view.rows + kBlock - 1) / kBlock > orthoDoubles(p.header.elements)) {
      return internalError("powersgd (cuda): orthonormalisation block sums exceed the bound");
    }
    LW_RETURN_IF_ERROR(stage(p, ar.f1, stream));
    orthoKernel<<<1, kOrthoThreads, 0, stream>>>(ar.f1, p.view.rows, p.view.rank, ar.ortho);
    return cudaStatus(cudaGetLastError(), "powersgd (cuda): orthonormalisation");
  }

  static FactorHeader headerFor(DType dtype, int round, size_t n, const View& v) {
    FactorHeader h{};
    powersgd::writeFactorHeaders(h.bytes, dtype, round, n, v);
    return h;
  }

  /// The matrix view of §4.12, exactly as the CPU codec's.
  Result<View> stepView(const StepContext& ctx, const Chunking& chunking) const {
    return powersgd::stepView(ctx, chunking, host_->config().approx_rank);
  }

  Result<Factors> parseFactors(std::span<const uint8_t> payload, uint64_t n, int round,
                               const std::string& what) const {
    return powersgd::parseFactors(payload, n, round, what, host_->config().approx_rank);
  }

  Result<std::pair<Factors, Factors>> parseRounds(std::span<const std::span<const uint8_t>> rounds,
                                                  size_t n) const {
    return powersgd::parseRounds(rounds, n, host_->config().approx_rank);
  }

  std::unique_ptr<Codec> host_;
};

LW_REGISTER_CUDA_CODEC(powersgd, CodecId::kPowersgd,
                       [](std::unique_ptr<Codec> host) -> Result<std::unique_ptr<CudaCodec>> {
                         return std::unique_ptr<CudaCodec>(new CudaPowerSgd(std::move(host)));
                       });

}  // namespace
}  // namespace lightwire::kernels::cuda
