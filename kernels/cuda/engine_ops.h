#pragma once
// Element-wise device operations of a step on the GPU (proxy/step/gpu_backend_cuda.cc, docs/cuda.md
// "Steps on the GPU"), each the exact counterpart of what the CPU engine does on the host: the
// local trainers' sum, the delayed-sync accumulation, and the value counts of the statistics and
// the non-finite check. CUB style like kernels/cuda/cast.h: caller-owned device memory, explicit
// stream, nothing allocates or synchronises, the launch status is returned; n = 0 is a no-op.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/dtype.h"
#include "kernels/reduce.h"

namespace lightwire::kernels::cuda {

/// Inputs one sumWidened launch takes; more are added by further launches (same result).
inline constexpr unsigned kSumInputsPerLaunch = 8;

/// d_out[i] = ((widen(in[0][i]) + widen(in[1][i])) + widen(in[2][i])) + ... for i < n: fp32
/// additions in input order, as the CPU engine sums its local trainers (widen: exact fp16/bf16 to
/// fp32). `inputs` is a host array of `count` >= 1 device pointers of `dtype` elements; d_out must
/// not overlap them.
cudaError_t sumWidened(const void* const* inputs, unsigned count, DType dtype, size_t n,
                       float* d_out, cudaStream_t stream);

/// d_out[i] = d_a[i] + d_b[i] (one fp32 rounding) for i < n; d_out may be d_a or d_b.
cudaError_t addFloats(const float* d_a, const float* d_b, float* d_out, size_t n,
                      cudaStream_t stream);

/// Adds to d_counts[0] the number of non-finite values of x[0..n) and to d_counts[1] the number
/// of finite values with |x| < tiny (the caller zeroes both first).
cudaError_t countValues(const float* d_x, size_t n, float tiny, unsigned long long* d_counts,
                        cudaStream_t stream);

/// d_block_sums[b] = kernels::statsSquareBlockSum of 4096-value block b of x[0..n)
/// (kernels/reduce.h: the policies' squared-norm statistic), bit for bit. d_block_sums holds ceil(n
/// / kStatsBlock) doubles; add them in order with sumBlockSums (kernels/cuda/reduce.h).
cudaError_t statsSquareBlockSums(const float* d_x, size_t n, double* d_block_sums,
                                 cudaStream_t stream);

/// d_out[0..n) = x narrowed to `dtype` (fp32: a copy; fp16/bf16: as kernels/cuda/cast.h, bit-exact
/// with the CPU). d_out must not overlap d_x unless they are the same fp32 array (then nothing).
cudaError_t narrowFloats(const float* d_x, size_t n, DType dtype, void* d_out, cudaStream_t stream);

}  // namespace lightwire::kernels::cuda
