#pragma once
// The canonical fp64 reduction of docs/determinism.md §2 on the GPU, bit-identical to
// kernels/reduce.h: 4096-element blocks, eight fp64 accumulators per block (accumulator j takes the
// elements ≡ j mod 8 in increasing order), combined ((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7)), block
// sums added in block order. CUB style: caller-owned device memory, explicit stream, no sync.

#include <cuda_runtime_api.h>

#include <cstddef>

#include "kernels/dtype.h"
#include "kernels/reduce.h"

namespace lightwire::kernels::cuda {

/// Number of 4096-element blocks of n elements (the block_sums d_canonicalSum needs).
inline size_t canonicalBlocks(size_t n) { return (n + kReduceBlock - 1) / kReduceBlock; }

/// d_block_sums[b] = the canonical sum of block b of the terms of x[0..n) (x of `dtype`, widened
/// to fp32 exactly, the term computed in fp64), for b < canonicalBlocks(n).
cudaError_t canonicalBlockSums(const void* d_x, DType dtype, size_t n, ReduceTerm term,
                               double* d_block_sums, cudaStream_t stream);

/// *d_total = +0.0 + s_0 + s_1 + ... (in block order) over `blocks` block sums; one thread.
cudaError_t sumBlockSums(const double* d_block_sums, size_t blocks, double* d_total,
                         cudaStream_t stream);

/// Both: *d_total = canonical sum of the terms of x[0..n). d_block_sums holds canonicalBlocks(n).
cudaError_t canonicalSum(const void* d_x, DType dtype, size_t n, ReduceTerm term,
                         double* d_block_sums, double* d_total, cudaStream_t stream);

/// Device doubles canonicalSegmentSums needs as scratch (0 when segment <= 4096).
size_t canonicalSegmentScratch(size_t n, size_t segment);

/// Segmented version for per-bucket scales (QSGD and the bucket codecs): for each of the
/// ceil(n / segment) segments s of x[0..n) (the last one may be shorter; indices relative to the
/// segment's start, as if each segment were its own array), d_sums[s] = its canonical sum.
/// d_scratch holds canonicalSegmentScratch(n, segment) doubles (may be null when that is 0).
cudaError_t canonicalSegmentSums(const void* d_x, DType dtype, size_t n, size_t segment,
                                 ReduceTerm term, double* d_sums, double* d_scratch,
                                 cudaStream_t stream);

}  // namespace lightwire::kernels::cuda
