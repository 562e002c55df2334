// The canonical fp64 reduction on the GPU (kernels/cuda/reduce.h). Eight consecutive threads own
// one 4096-element block: thread j of the eight is accumulator a_j and adds the terms of elements
// j, j+8, j+16, ... in increasing order (exactly the CPU's scalar definition), then three shuffle
// steps combine the eight as ((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7)). fp64 addition is commutative,
// so which lane holds which operand does not change a bit. A warp's load touches four 32-byte
// sectors, each fully used.

#include "kernels/cuda/device.cuh"
#include "kernels/cuda/reduce.h"

namespace lightwire::kernels::cuda {
namespace {

template <ReduceTerm T>
__device__ __forceinline__ double termOf(float v) {
  const double d = static_cast<double>(v);
  if constexpr (T == ReduceTerm::kSquare) {
    return __dmul_rn(d, d);
  } else if constexpr (T == ReduceTerm::kAbs) {
    return fabs(d);
  } else {
    return d;
  }
}

/// Block sums of a segmented array: segment s covers [s·segment, min((s+1)·segment, n)); its
/// canonical blocks are numbered s·bps + b (bps = blocks per full segment). out[s·bps + b] = sum.
template <DType D, ReduceTerm T>
__global__ void __launch_bounds__(kBlockThreads)
    blockSumsKernel(const void* __restrict__ x, size_t n, size_t segment, size_t bps,
                    size_t total_blocks, double* __restrict__ out) {
  const size_t groups_per_grid = static_cast<size_t>(gridDim.x) * (blockDim.x / 8);
  const unsigned j = threadIdx.x & 7;
  // `base` is the warp's first group: uniform across the warp, so every lane runs the same
  // iterations and the shuffles below always have all 32 lanes; lanes past the end add nothing.
  for (size_t base = (static_cast<size_t>(blockIdx.x) * blockDim.x + (threadIdx.x & ~31u)) / 8;
       base < total_blocks; base += groups_per_grid) {
    const size_t cb = base + (threadIdx.x & 31) / 8;
    const bool live = cb < total_blocks;
    double acc = 0.0;
    if (live) {
      const size_t s = cb / bps, b = cb % bps;
      const size_t seg_begin = s * segment;
      const size_t seg_end = seg_begin + segment < n ? seg_begin + segment : n;
      const size_t begin = seg_begin + b * kReduceBlock;
      const size_t end = begin + kReduceBlock < seg_end ? begin + kReduceBlock : seg_end;
      for (size_t i = begin + j; i < end; i += 8) {
        acc = __dadd_rn(acc, termOf<T>(loadWidenedDevice<D>(x, i)));
      }
    }
    // (a0+a1), (a2+a3), (a4+a5), (a6+a7) in lanes 0, 2, 4, 6 of the eight; then
    // ((a0+a1)+(a2+a3)) and ((a4+a5)+(a6+a7)) in lanes 0 and 4; then their sum in lane 0.
    acc = __dadd_rn(acc, __shfl_down_sync(0xFFFFFFFFu, acc, 1, 8));
    acc = __dadd_rn(acc, __shfl_down_sync(0xFFFFFFFFu, acc, 2, 8));
    acc = __dadd_rn(acc, __shfl_down_sync(0xFFFFFFFFu, acc, 4, 8));
    if (live && j == 0) out[cb] = acc;
  }
}

/// out[s] = +0.0 + in[s·bps] + ... + in[s·bps + blocks_s − 1], one thread per segment.
__global__ void segmentTotalsKernel(const double* __restrict__ in, size_t n, size_t segment,
                                    size_t bps, size_t segments, double* __restrict__ out) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t s = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; s < segments;
       s += stride) {
    const size_t len = (s + 1) * segment <= n ? segment : n - s * segment;
    const size_t blocks = (len + kReduceBlock - 1) / kReduceBlock;
    double t = 0.0;
    for (size_t b = 0; b < blocks; ++b) t = __dadd_rn(t, in[s * bps + b]);
    out[s] = t;
  }
}

template <ReduceTerm T>
cudaError_t launchBlockSums(const void* d_x, DType dtype, size_t n, size_t segment, size_t bps,
                            size_t total_blocks, double* out, cudaStream_t stream) {
  // 32 canonical blocks (of 8 threads each) per CUDA block of 256 threads.
  const size_t cuda_blocks = (total_blocks + 31) / 32;
  const unsigned grid = static_cast<unsigned>(
      cuda_blocks < kMaxBlocks ? (cuda_blocks == 0 ? 1 : cuda_blocks) : kMaxBlocks);
  visitDeviceDType(dtype, [&](auto d) {
    blockSumsKernel<decltype(d)::value, T>
        <<<grid, kBlockThreads, 0, stream>>>(d_x, n, segment, bps, total_blocks, out);
  });
  return cudaGetLastError();
}

cudaError_t blockSumsFor(const void* d_x, DType dtype, size_t n, size_t segment, size_t bps,
                         size_t total_blocks, ReduceTerm term, double* out, cudaStream_t stream) {
  switch (term) {
    case ReduceTerm::kSquare:
      return launchBlockSums<ReduceTerm::kSquare>(d_x, dtype, n, segment, bps, total_blocks, out,
                                                  stream);
    case ReduceTerm::kAbs:
      return launchBlockSums<ReduceTerm::kAbs>(d_x, dtype, n, segment, bps, total_blocks, out,
                                               stream);
    case ReduceTerm::kValue:
      break;
  }
  return launchBlockSums<ReduceTerm::kValue>(d_x, dtype, n, segment, bps, total_blocks, out,
                                             stream);
}

}  // namespace

cudaError_t canonicalBlockSums(const void* d_x, DType dtype, size_t n, ReduceTerm term,
                               double* d_block_sums, cudaStream_t stream) {
  const size_t blocks = canonicalBlocks(n);
  if (blocks == 0) return cudaSuccess;
  if (d_x == nullptr || d_block_sums == nullptr) return cudaErrorInvalidValue;
  // One segment as long as the array: block b of segment 0 is canonical block b.
  return blockSumsFor(d_x, dtype, n, n, blocks, blocks, term, d_block_sums, stream);
}

cudaError_t sumBlockSums(const double* d_block_sums, size_t blocks, double* d_total,
                         cudaStream_t stream) {
  if (d_total == nullptr || (blocks != 0 && d_block_sums == nullptr)) return cudaErrorInvalidValue;
  // One segment of `blocks` "elements" of one block each.
  segmentTotalsKernel<<<1, 1, 0, stream>>>(d_block_sums, blocks * kReduceBlock,
                                           blocks * kReduceBlock, blocks, 1, d_total);
  return cudaGetLastError();
}

cudaError_t canonicalSum(const void* d_x, DType dtype, size_t n, ReduceTerm term,
                         double* d_block_sums, double* d_total, cudaStream_t stream) {
  LW_CUDA_TRY(canonicalBlockSums(d_x, dtype, n, term, d_block_sums, stream));
  return sumBlockSums(d_block_sums, canonicalBlocks(n), d_total, stream);
}

size_t canonicalSegmentScratch(size_t n, size_t segment) {
  if (segment <= kReduceBlock || n == 0) return 0;
  const size_t segments = (n + segment - 1) / segment;
  return segments * canonicalBlocks(segment);
}

cudaError_t canonicalSegmentSums(const void* d_x, DType dtype, size_t n, size_t segment,
                                 ReduceTerm term, double* d_sums, double* d_scratch,
                                 cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (segment == 0 || d_x == nullptr || d_sums == nullptr) return cudaErrorInvalidValue;
  const size_t segments = (n + segment - 1) / segment;
  if (segment <= kReduceBlock) {
    return blockSumsFor(d_x, dtype, n, segment, 1, segments, term, d_sums, stream);
  }
  if (d_scratch == nullptr) return cudaErrorInvalidValue;
  const size_t bps = canonicalBlocks(segment);
  // Canonical blocks are numbered s·bps + b; a short last segment leaves its tail numbers unused.
  LW_CUDA_TRY(blockSumsFor(d_x, dtype, n, segment, bps, segments * bps, term, d_scratch, stream));
  segmentTotalsKernel<<<blocksFor(segments), kBlockThreads, 0, stream>>>(d_scratch, n, segment, bps,
                                                                         segments, d_sums);
  return cudaGetLastError();
}

}  // namespace lightwire::kernels::cuda
