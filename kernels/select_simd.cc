// Highway kernels of the sparse selection (kernels/select.h, "SIMD kernels"), compiled for every
// x86 target Highway knows and chosen at run time (HWY_DYNAMIC_DISPATCH): one binary is fast on
// AVX2/AVX-512 and still runs on SSE2. Every kernel computes exactly what its scalar reference in
// select.h describes — element-wise fp32 adds, multiplies and divides (no MulAdd, determinism.md
// §1), integer compares and counts — so the results never depend on the target.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/select_simd.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include "kernels/select.h"

HWY_BEFORE_NAMESPACE();
namespace lightwire::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

/// Keys of x[i..i+N) (sign bit cleared), as i32 lanes (keys are < 2^31: signed compares exact).
template <class DI>
HWY_INLINE hn::Vec<DI> keysOf(DI di, hn::Vec<hn::Rebind<float, DI>> v) {
  return hn::And(hn::BitCast(di, v), hn::Set(di, 0x7FFFFFFF));
}

uint64_t CollectComposites(const float* HWY_RESTRICT x, size_t lo, size_t hi, uint32_t a,
                           uint64_t* HWY_RESTRICT dst, uint64_t cap) {
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const size_t N = hn::Lanes(df);
  const auto va = hn::Set(di, static_cast<int32_t>(a) - 1);  // key >= a <=> key > a - 1
  const hn::RebindToUnsigned<decltype(df)> du;
  // Compressed keys and indices of one block (each vector's are stored whole).
  HWY_ALIGN uint32_t kbuf[5 * HWY_MAX_BYTES / sizeof(uint32_t)];
  HWY_ALIGN uint32_t ibuf[5 * HWY_MAX_BYTES / sizeof(uint32_t)];
  uint64_t c = 0;
  auto emit = [&](size_t i, uint32_t key) {
    if (c < cap) dst[c] = compositeKey(key, i);
    ++c;
  };
  auto compress = [&](hn::Vec<decltype(di)> k, size_t at, size_t filled) -> size_t {
    const auto m = hn::Gt(k, va);
    if (hn::AllFalse(di, m)) return filled;
    // Compress + StoreU (whole vectors; the buffers have room) beats a masked compress-store.
    const auto mu = hn::RebindMask(du, m);
    hn::StoreU(hn::Compress(hn::BitCast(du, k), mu), du, kbuf + filled);
    hn::StoreU(hn::Compress(hn::Iota(du, static_cast<uint32_t>(at)), mu), du, ibuf + filled);
    return filled + hn::CountTrue(du, mu);
  };
  size_t i = lo;
  for (; i + 4 * N <= hi; i += 4 * N) {
    const auto k0 = keysOf(di, hn::LoadU(df, x + i));
    const auto k1 = keysOf(di, hn::LoadU(df, x + i + N));
    const auto k2 = keysOf(di, hn::LoadU(df, x + i + 2 * N));
    const auto k3 = keysOf(di, hn::LoadU(df, x + i + 3 * N));
    const auto hit =
        hn::Or(hn::Or(hn::Gt(k0, va), hn::Gt(k1, va)), hn::Or(hn::Gt(k2, va), hn::Gt(k3, va)));
    if (hn::AllFalse(di, hit)) continue;
    size_t filled = compress(k0, i, 0);
    filled = compress(k1, i + N, filled);
    filled = compress(k2, i + 2 * N, filled);
    filled = compress(k3, i + 3 * N, filled);
    for (size_t j = 0; j < filled; ++j) emit(ibuf[j], kbuf[j]);
  }
  for (; i < hi; ++i) {
    const uint32_t key = magnitudeKey(x[i]);
    if (key >= a) emit(i, key);
  }
  return c;
}

/// dgcNext for the N lanes at i, in its operation order: u' goes to put_u (with momentum), c' to
/// put_c (with bias correction); returns v'.
template <class DF, class PutU, class PutC>
HWY_INLINE hn::Vec<DF> DgcNextLanes(DF df, const DgcPass& p, size_t i, PutU&& put_u, PutC&& put_c) {
  auto g = hn::LoadU(df, p.x + i);
  if (p.clip) g = hn::Mul(g, hn::Set(df, p.factor));
  if (!p.momentum) return hn::Add(hn::LoadU(df, p.v + i), g);
  const auto vm = hn::Set(df, p.m);
  const auto ui = hn::Add(hn::Mul(vm, hn::LoadU(df, p.u + i)), g);
  put_u(ui);
  if (!p.bias) return hn::Add(hn::LoadU(df, p.v + i), ui);
  // c' = (m · c) + 1, v' = v + (u' / (c' · w)); Div is IEEE division.
  const auto ci = hn::Add(hn::Mul(vm, hn::LoadU(df, p.c + i)), hn::Set(df, 1.0f));
  put_c(ci);
  return hn::Add(hn::LoadU(df, p.v + i), hn::Div(ui, hn::Mul(ci, hn::Set(df, p.w))));
}

uint64_t DgcFusedPass(const DgcPass& p, size_t lo, size_t hi, uint32_t* HWY_RESTRICT list) {
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const size_t N = hn::Lanes(df);
  // x may be v' itself (widened fp16/bf16 input under clipping): read before written.
  float* un = p.un;
  float* vn = p.vn;
  const auto vt = hn::Set(di, static_cast<int32_t>(p.threshold) - 1);  // >= T <=> > T - 1
  const hn::RebindToUnsigned<decltype(df)> du;
  uint64_t c = 0;

  // One element, exactly as the vector body computes it.
  auto scalar = [&](size_t i) {
    const float g = p.clip ? p.x[i] * p.factor : p.x[i];
    const DgcNext next = dgcNext(p, i, g);
    if (p.momentum && un != nullptr) un[i] = next.u;
    const float vi = next.v;
    vn[i] = vi;
    list[c] = static_cast<uint32_t>(i);
    c += magnitudeKey(vi) >= p.threshold;
  };

  // Non-temporal stores need aligned un + i and vn + i; they bypass the cache (the outputs are
  // far larger than it, and only the selected ~1 % are read again).
  const size_t bytes = N * sizeof(float);
  size_t i = lo;
  const bool keep_u = p.momentum && un != nullptr;
  const bool stream = (!keep_u || (reinterpret_cast<uintptr_t>(un) % bytes) ==
                                      (reinterpret_cast<uintptr_t>(vn) % bytes)) &&
                      reinterpret_cast<uintptr_t>(vn) % sizeof(float) == 0;
  if (stream) {
    while (i < hi && reinterpret_cast<uintptr_t>(vn + i) % bytes != 0) scalar(i++);
  }
  for (; i + N <= hi; i += N) {
    const auto vi = DgcNextLanes(
        df, p, i,
        [&](hn::Vec<decltype(df)> ui) {
          if (keep_u && stream) {
            hn::Stream(ui, df, un + i);
          } else if (keep_u) {
            hn::StoreU(ui, df, un + i);
          }
        },
        [](hn::Vec<decltype(df)>) {});
    if (stream) {
      hn::Stream(vi, df, vn + i);
    } else {
      hn::StoreU(vi, df, vn + i);
    }
    const auto hit = hn::Gt(keysOf(di, vi), vt);
    if (HWY_LIKELY(hn::AllFalse(di, hit))) continue;
    // Writes N entries from list[c]: within the caller's hi − lo, as c <= i − lo.
    const auto mu = hn::RebindMask(du, hit);
    hn::StoreU(hn::Compress(hn::Iota(du, static_cast<uint32_t>(i)), mu), du, list + c);
    c += hn::CountTrue(du, mu);
  }
  for (; i < hi; ++i) scalar(i);
  if (stream) hwy::FlushStream();
  return c;
}

void DgcStatePass(const DgcPass& p, float* cn, size_t lo, size_t hi) {
  const hn::ScalableTag<float> df;
  const size_t N = hn::Lanes(df);
  size_t i = lo;
  // Every lane's inputs are loaded before its outputs are stored: in place is safe.
  for (; i + N <= hi; i += N) {
    const auto vi = DgcNextLanes(
        df, p, i, [&](hn::Vec<decltype(df)> ui) { hn::StoreU(ui, df, p.un + i); },
        [&](hn::Vec<decltype(df)> ci) { hn::StoreU(ci, df, cn + i); });
    hn::StoreU(vi, df, p.vn + i);
  }
  for (; i < hi; ++i) dgcStoreNext(p, cn, i, p.x[i]);
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace lightwire::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace lightwire::kernels {

HWY_EXPORT(CollectComposites);
HWY_EXPORT(DgcFusedPass);
HWY_EXPORT(DgcStatePass);

uint64_t collectCompositesF32(const float* x, size_t lo, size_t hi, uint32_t a, uint64_t* dst,
                              uint64_t cap) {
  return HWY_DYNAMIC_DISPATCH(CollectComposites)(x, lo, hi, a, dst, cap);
}

uint64_t dgcFusedPassF32(const DgcPass& p, size_t lo, size_t hi, uint32_t* list) {
  return HWY_DYNAMIC_DISPATCH(DgcFusedPass)(p, lo, hi, list);
}

void dgcStatePassF32(const DgcPass& p, float* cn, size_t lo, size_t hi) {
  HWY_DYNAMIC_DISPATCH(DgcStatePass)(p, cn, lo, hi);
}

}  // namespace lightwire::kernels
#endif  // HWY_ONCE
