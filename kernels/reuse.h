#pragma once
// Which kept buffer to reuse for a request of n elements (the transports' receive pool, the step
// pool): the rule in one place.

#include <cstddef>
#include <vector>

namespace lightwire::kernels {

/// The index in `pool` of the buffer to reuse for n elements, pool.size() when none: the smallest
/// that already holds n (shrinking writes nothing), else the largest (growing writes only the
/// growth, within its capacity); with `capacity_only`, only buffers whose capacity holds n are
/// candidates (no reallocation).
template <typename T, typename A>
size_t bestReuse(const std::vector<std::vector<T, A>>& pool, size_t n, bool capacity_only) {
  size_t best = pool.size();
  for (size_t i = 0; i < pool.size(); ++i) {
    const auto& b = pool[i];
    if (capacity_only && b.capacity() < n) continue;
    if (best == pool.size()) {
      best = i;
      continue;
    }
    const auto& cur = pool[best];
    const bool fits = b.size() >= n, cur_fits = cur.size() >= n;
    if (fits != cur_fits ? fits : fits ? b.size() < cur.size() : b.size() > cur.size()) best = i;
  }
  return best;
}

}  // namespace lightwire::kernels
