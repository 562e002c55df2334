#pragma once
// CUDA fp32 <-> fp16/bf16 conversion kernels, bit-exact with kernels/dtype.h (floatToHalf,
// floatToBf16, halfToFloat, bf16ToFloat; docs/determinism.md §4.1), CUB style: the caller owns
// every buffer (device memory), the stream is explicit, nothing allocates, nothing synchronises
// the device; the status of the launch is returned (cudaGetLastError after the launch, so a launch
// error is reported once and does not leak into later calls). Errors of the asynchronous execution
// surface, as always in CUDA, at the caller's next synchronisation with the stream.
//
// Buffers need no particular alignment beyond their element type; in and out must not overlap.
// n = 0 is a no-op that returns cudaSuccess. Safe to call from several host threads.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace lightwire::kernels::cuda {

/// d_out[i] = floatToHalf(d_in[i]) for i < n (binary16 bits).
cudaError_t castFloatToHalf(const float* d_in, uint16_t* d_out, size_t n, cudaStream_t stream);

/// d_out[i] = floatToBf16(d_in[i]) for i < n (bf16 bits).
cudaError_t castFloatToBf16(const float* d_in, uint16_t* d_out, size_t n, cudaStream_t stream);

/// d_out[i] = d_out[i] + (weight * halfToFloat(d_in[i])) for i < n: two fp32 roundings, no FMA
/// (docs/determinism.md §1).
cudaError_t accumulateHalf(const uint16_t* d_in, float weight, float* d_out, size_t n,
                           cudaStream_t stream);

/// d_out[i] = d_out[i] + (weight * bf16ToFloat(d_in[i])) for i < n, as accumulateHalf.
cudaError_t accumulateBf16(const uint16_t* d_in, float weight, float* d_out, size_t n,
                           cudaStream_t stream);

}  // namespace lightwire::kernels::cuda
