#pragma once
// Counter-based randomness (docs/determinism.md §3): Philox4x32-10 from Random123, keyed by
// (seed, tensor-name hash) and countered by (step, stream, purpose, group).

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace lightwire::kernels {

/// Philox purposes (counter word 2).
enum class RandomPurpose : uint32_t {
  kQsgdRounding = 1,
  kDgcSampling = 2,
  kRandomkIndices = 3,
  kTerngradRounding = 4,
  kPowersgdInit = 5,
};

/// Stream value for randomness every rank must share.
inline constexpr uint32_t kSharedStream = 0xFFFFFFFFu;

/// Low 32 bits of XXH3-64 (seed 0) of the tensor name.
uint32_t tensorNameKey(std::string_view name);

/// Raw Philox4x32-10: four words for (counter, key). Pure function, thread-safe.
std::array<uint32_t, 4> philoxBlock(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

/// Batch of philoxBlock (SIMD, kernels/simd/kernels.h; the same words on every target):
/// out[4k + j] = philoxBlock({c0, c1, c2, (uint32_t)(g0 + k)}, key)[j] for k < count.
void philoxBlocks(std::array<uint32_t, 3> counter_head, std::array<uint32_t, 2> key, uint64_t g0,
                  size_t count, uint32_t* out);

/// The random words one tensor's step draws for one purpose and stream. Cheap to copy; thread-safe.
class PhiloxStream {
 public:
  PhiloxStream(uint32_t seed, uint32_t name_key, uint64_t step, uint32_t stream,
               RandomPurpose purpose)
      : key_{seed, name_key},
        step_(static_cast<uint32_t>(step)),
        stream_(stream),
        purpose_(static_cast<uint32_t>(purpose)) {}

  /// The four words of group g (serving items 4g..4g+3).
  std::array<uint32_t, 4> group(uint64_t g) const {
    return philoxBlock({step_, stream_, purpose_, static_cast<uint32_t>(g)}, key_);
  }
  /// The word serving item i.
  uint32_t word(uint64_t i) const { return group(i >> 2)[i & 3]; }

  /// out[4k .. 4k+4) = group(g0 + k), for k < count (vectorised).
  void groups(uint64_t g0, size_t count, uint32_t* out) const {
    philoxBlocks({step_, stream_, purpose_}, key_, g0, count, out);
  }
  /// w[k] = word(first + k), for k < len (vectorised; any alignment of `first`).
  void words(uint64_t first, size_t len, uint32_t* w) const;

 private:
  std::array<uint32_t, 2> key_;
  uint32_t step_, stream_, purpose_;
};

/// u32 word -> uniform double in [0, 1), exact.
inline double unitDouble(uint32_t r) { return static_cast<double>(r) * 0x1p-32; }

}  // namespace lightwire::kernels
