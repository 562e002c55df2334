#pragma once
// Inputs shared by the step engine's tests.
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace lightwire::proxy::testing {

/// n normal values (seeded), with no ±0 (0 + −0 is +0, which would hide a sign).
inline std::vector<float> randomValues(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) {
    x = dist(gen);
    if (x == 0.0f) x = 1.0f;
  }
  return v;
}

}  // namespace lightwire::proxy::testing
