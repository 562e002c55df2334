// The canonical fp64 block sum of docs/determinism.md §2 ("Canonical reductions"), written once
// for every Highway kernel that reduces: eight fp64 accumulators, element i's term into
// accumulator i mod 8, combined ((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7)). K = 8 / lanes vectors of fp64
// accumulators hold the eight accumulators in order (accumulator j * lanes + l is lane l of vector
// j), so each lane adds the same terms in the same order as the scalar loop, on every target.
//
// Per-target header: include it after <hwy/highway.h> inside a foreach_target.h translation unit
// (the guard toggles with HWY_TARGET_TOGGLE, as Highway's own -inl.h headers do).

#if defined(LIGHTWIRE_KERNELS_SIMD_BLOCK_SUM_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef LIGHTWIRE_KERNELS_SIMD_BLOCK_SUM_INL_H_
#undef LIGHTWIRE_KERNELS_SIMD_BLOCK_SUM_INL_H_
#else
#define LIGHTWIRE_KERNELS_SIMD_BLOCK_SUM_INL_H_
#endif

#include <cstddef>

#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace lightwire::kernels::simd::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

/// The fp64 vectors the block sums work on (as many lanes as fit, at most eight).
using BlockSumTag = hn::CappedTag<double, 8>;
using BlockSumVec = hn::Vec<BlockSumTag>;

/// x[i .. i + Lanes(dd)) widened to fp64 (exact).
HWY_INLINE BlockSumVec LoadPromoted(BlockSumTag dd, const float* HWY_RESTRICT x) {
  const hn::Rebind<float, BlockSumTag> df;
  return hn::PromoteTo(dd, hn::LoadU(df, x));
}

inline double CombineAccumulators(const double* a) {
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/// kSums canonical block sums over elements [0, n) (n <= 4096, one §2 block) in one pass:
/// sums[s] = the combined accumulators of term s. vec_terms(dd, i, t) sets t[s] to the fp64 terms
/// of elements i .. i + Lanes(dd); scalar_terms(i, t) sets t[s] to the term of element i; both
/// must compute the same values. Each sum's own additions are in the scalar order.
template <size_t kSums, class VecTerms, class ScalarTerms>
HWY_INLINE void CanonicalBlockSums(size_t n, const VecTerms& vec_terms,
                                   const ScalarTerms& scalar_terms, double* sums) {
  double a[kSums][8] = {};
  size_t i = 0;
#if HWY_TARGET != HWY_SCALAR
  const BlockSumTag dd;
  const size_t lanes = hn::Lanes(dd);
  const size_t vecs = 8 / lanes;
  BlockSumVec acc[kSums][8];
  for (size_t s = 0; s < kSums; ++s) {
    for (size_t j = 0; j < vecs; ++j) acc[s][j] = hn::Zero(dd);
  }
  for (; i + 8 <= n; i += 8) {
    for (size_t j = 0; j < vecs; ++j) {
      BlockSumVec t[kSums];
      vec_terms(dd, i + j * lanes, t);
      for (size_t s = 0; s < kSums; ++s) acc[s][j] = hn::Add(acc[s][j], t[s]);
    }
  }
  for (size_t s = 0; s < kSums; ++s) {
    for (size_t j = 0; j < vecs; ++j) hn::StoreU(acc[s][j], dd, a[s] + j * lanes);
  }
#else
  (void)vec_terms;  // HWY_SCALAR: the scalar loop does every element
#endif
  for (; i < n; ++i) {
    double t[kSums];
    scalar_terms(i, t);
    for (size_t s = 0; s < kSums; ++s) a[s][i & 7] = a[s][i & 7] + t[s];
  }
  for (size_t s = 0; s < kSums; ++s) sums[s] = CombineAccumulators(a[s]);
}

/// One canonical block sum (n <= 4096): vec_term(dd, i) is the vector of fp64 terms of elements
/// i .. i + Lanes(dd), scalar_term(i) the term of element i.
template <class VecTerm, class ScalarTerm>
HWY_INLINE double CanonicalBlockSum(size_t n, const VecTerm& vec_term,
                                    const ScalarTerm& scalar_term) {
  double sum;
  CanonicalBlockSums<1>(
      n, [&](BlockSumTag dd, size_t i, BlockSumVec* t) HWY_ATTR { t[0] = vec_term(dd, i); },
      [&](size_t i, double* t) HWY_ATTR { t[0] = scalar_term(i); }, &sum);
  return sum;
}

}  // namespace lightwire::kernels::simd::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
