#pragma once
// Canonical fp64 reductions (docs/determinism.md §2): 4096-element blocks, eight strided fp64
// accumulators per block, block sums added in index order. The result is independent of threads
// and SIMD width.

#include <cstddef>
#include <span>

#include "kernels/dtype.h"

namespace lightwire::kernels {

class CpuStream;

inline constexpr size_t kReduceBlock = 4096;

enum class ReduceTerm { kSquare, kAbs, kValue };

/// Sum of one block (at most kReduceBlock elements) in the canonical order.
double canonicalBlockSum(const float* x, size_t n, ReduceTerm term);

/// Canonical sum over x[0..n). Uses `stream` (may be null) to compute block sums in parallel;
/// `block_sums` must hold ceil(n / kReduceBlock) doubles when stream is non-null.
double canonicalSum(const float* x, size_t n, ReduceTerm term, CpuStream* stream = nullptr,
                    std::span<double> block_sums = {});

/// fp64 L2 norm: sqrt(canonical sum of squares).
double canonicalNorm(const float* x, size_t n, CpuStream* stream = nullptr,
                     std::span<double> block_sums = {});

/// The fast squared-norm statistic of the policies (not a payload; docs/policies.md): per
/// 4096-value block, 16 fp32 lanes (lane j: the squares of the block's values i ≡ j mod 16 among
/// its first floor(len/16)·16, in order), then (((+0.0 + the tail's squares in fp64, in order) +
/// lane 0) + ... + lane 15). Half the cost of the canonical reduction, and as deterministic: the
/// GPU path computes the same bits (kernels/cuda/engine_ops.h statsSquareBlockSums).
inline constexpr size_t kStatsBlock = 4096;
double statsSquareBlockSum(const float* x, size_t len);

}  // namespace lightwire::kernels
