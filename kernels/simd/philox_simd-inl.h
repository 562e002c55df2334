// Philox4x32-10 (Random123's philox4x32_R<10>, docs/determinism.md §3), vectorised with Highway:
// one group (one 128-bit counter) per 64-bit lane, the 32x32 -> 64-bit products formed with
// MulEven. Integer arithmetic only, so every target gives the words of kernels/philox.cc bit for
// bit (tests/kernels/simd_test.cc).
//
// Per-target header: include it after <hwy/highway.h> inside a foreach_target.h translation unit
// (the guard toggles with HWY_TARGET_TOGGLE, as Highway's own -inl.h headers do).

#if defined(LIGHTWIRE_KERNELS_SIMD_PHILOX_SIMD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef LIGHTWIRE_KERNELS_SIMD_PHILOX_SIMD_INL_H_
#undef LIGHTWIRE_KERNELS_SIMD_PHILOX_SIMD_INL_H_
#else
#define LIGHTWIRE_KERNELS_SIMD_PHILOX_SIMD_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace lightwire::kernels::simd::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

inline constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
inline constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
inline constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
inline constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;

inline void philoxMulHiLoScalar(uint32_t a, uint32_t m, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = uint64_t{a} * m;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

/// One Philox block, scalar (tails and the HWY_SCALAR target).
inline void philoxBlockScalar(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
  uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3], k0 = key[0], k1 = key[1];
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    philoxMulHiLoScalar(c0, kPhiloxM0, hi0, lo0);
    philoxMulHiLoScalar(c2, kPhiloxM1, hi1, lo1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

/// out[4k + j] = word j of Philox4x32-10 at counter (ctr[0], ctr[1], ctr[2], (uint32)(g0 + k))
/// and `key`, for k < count.
///
/// One group per 64-bit lane: each counter word lives in the low half of a lane, and MulEven (on
/// the 32-bit view) forms the full 32x32 -> 64-bit product of the low halves, so the product is at
/// once lo (low half) and, shifted, hi. Upper halves carry garbage that no multiplication reads and
/// the final packing drops. Counter words 0..2 are the same in every lane: rounds 0 to 2 have four
/// of their six products lane-independent, computed once in scalar code.
inline void philoxGroupsImpl(const uint32_t ctr[3], const uint32_t key[2], uint64_t g0,
                             size_t count, uint32_t* HWY_RESTRICT out) {
  size_t k = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::ScalableTag<uint64_t> d;
  const hn::Repartition<uint32_t, decltype(d)> d32;
  const size_t lanes = hn::Lanes(d);
  using V = decltype(hn::Zero(d));
  const auto m0 = hn::BitCast(d32, hn::Set(d, uint64_t{kPhiloxM0}));
  const auto m1 = hn::BitCast(d32, hn::Set(d, uint64_t{kPhiloxM1}));
  auto mul = [&](V a, decltype(m0) m) { return hn::MulEven(hn::BitCast(d32, a), m); };
  auto set = [&](uint32_t v) { return hn::Set(d, uint64_t{v}); };
  // The high half of a product into the low half (the other half is don't-care): a 32-bit lane
  // swap, which runs on a different port than the multiplications (unlike a 64-bit shift on x86).
  auto hi = [&](V p) { return hn::BitCast(d, hn::Shuffle2301(hn::BitCast(d32, p))); };

  uint32_t keys0[10], keys1[10];
  keys0[0] = key[0];
  keys1[0] = key[1];
  for (int r = 1; r < 10; ++r) {
    keys0[r] = keys0[r - 1] + kPhiloxW0;
    keys1[r] = keys1[r - 1] + kPhiloxW1;
  }
  // Round 0: (c0, c1, c3) lane-independent; c2 = a2 ^ g.
  uint32_t h0, l0, h1, l1;
  philoxMulHiLoScalar(ctr[0], kPhiloxM0, h0, l0);
  philoxMulHiLoScalar(ctr[2], kPhiloxM1, h1, l1);
  const uint32_t r0_c0 = h1 ^ ctr[1] ^ keys0[0], r0_c1 = l1, r0_c3 = l0;
  const uint32_t r0_a2 = h0 ^ keys1[0];
  // Round 1: the c0 product is lane-independent; c2 and c3 of its result too.
  philoxMulHiLoScalar(r0_c0, kPhiloxM0, h0, l0);
  const uint32_t r1_c2 = h0 ^ r0_c3 ^ keys1[1], r1_c3 = l0;
  const auto r1_x0 = set(r0_c1 ^ keys0[1]);
  // Round 2: the c2 product is lane-independent.
  philoxMulHiLoScalar(r1_c2, kPhiloxM1, h1, l1);
  const auto r2_x0 = set(h1 ^ keys0[2]);
  const auto r2_c1 = set(l1);
  const auto r2_x2 = set(r1_c3 ^ keys1[2]);
  V key_v0[10], key_v1[10];  // rounds 3..9
  for (int r = 3; r < 10; ++r) {
    key_v0[r] = set(keys0[r]);
    key_v1[r] = set(keys1[r]);
  }
  const auto a2 = set(r0_a2);
  const auto iota = hn::Iota(d, 0);
  const auto low = hn::Set(d, uint64_t{0xFFFFFFFFu});
  HWY_ALIGN uint32_t tail[4 * HWY_MAX_BYTES / sizeof(uint64_t)];
  // The stores take uint64_t lanes: straight into `out` only when it is aligned for them (the
  // emulated target stores them as uint64_t; a misaligned one is undefined behaviour), else
  // through `tail`.
  const bool out_aligned = reinterpret_cast<uintptr_t>(out) % alignof(uint64_t) == 0;
  for (; k < count; k += lanes) {
    const V g = hn::Add(iota, hn::Set(d, g0 + k));
    // Round 1.
    V p1 = mul(hn::Xor(a2, g), m1);
    V c0 = hn::Xor(hi(p1), r1_x0);
    V c1 = p1;
    // Round 2.
    V p0 = mul(c0, m0);
    c0 = hn::Xor(c1, r2_x0);
    c1 = r2_c1;
    V c2 = hn::Xor(hi(p0), r2_x2);
    V c3 = p0;
    for (int r = 3; r < 10; ++r) {
      p0 = mul(c0, m0);
      p1 = mul(c2, m1);
      c0 = hn::Xor(hn::Xor(hi(p1), c1), key_v0[r]);
      c1 = p1;
      c2 = hn::Xor(hn::Xor(hi(p0), c3), key_v1[r]);
      c3 = p0;
    }
    const V w01 = hn::Or(hn::And(c0, low), hn::ShiftLeft<32>(c1));
    const V w23 = hn::Or(hn::And(c2, low), hn::ShiftLeft<32>(c3));
    if (k + lanes <= count && out_aligned) {
      hn::StoreInterleaved2(w01, w23, d, reinterpret_cast<uint64_t*>(out + 4 * k));
    } else {
      hn::StoreInterleaved2(w01, w23, d, reinterpret_cast<uint64_t*>(tail));
      std::memcpy(out + 4 * k, tail, 4 * sizeof(uint32_t) * std::min<size_t>(lanes, count - k));
      if (k + lanes >= count) return;
    }
  }
#endif
  for (; k < count; ++k) {
    const uint32_t c[4] = {ctr[0], ctr[1], ctr[2], static_cast<uint32_t>(g0 + k)};
    philoxBlockScalar(c, key, out + 4 * k);
  }
}

}  // namespace lightwire::kernels::simd::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
