#pragma once
// Which kept buffer to reuse for a request of n elements (the transports' receive pool, the step
// pool, the request bodies, the GPU's step buffers): the rule in one place.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace lightwire::kernels {

/// The index in `pool` of the buffer to reuse for n elements, pool.size() when none: among those
/// whose capacity holds n, the smallest capacity (ties: the largest size, the least growth to
/// write) — never a larger one while a smaller one fits, so a large buffer stays free for a large
/// request instead of being spent on a small one and a second large one allocated (a pool that
/// did so would hold more and more large buffers for the same requests). When none holds n, the
/// largest capacity, to grow it (the least new memory); with `capacity_only`, none.
template <typename Buffer>
size_t bestReuse(const std::vector<Buffer>& pool, size_t n, bool capacity_only) {
  size_t best = pool.size();
  for (size_t i = 0; i < pool.size(); ++i) {
    const auto& b = pool[i];
    const bool holds = b.capacity() >= n;
    if (capacity_only && !holds) continue;
    if (best == pool.size()) {
      best = i;
      continue;
    }
    const auto& cur = pool[best];
    const bool cur_holds = cur.capacity() >= n;
    bool better;
    if (holds != cur_holds) {
      better = holds;
    } else if (!holds) {
      better = b.capacity() > cur.capacity();
    } else if (b.capacity() != cur.capacity()) {
      better = b.capacity() < cur.capacity();
    } else {
      better = b.size() > cur.size();
    }
    if (better) best = i;
  }
  return best;
}

/// Removes from `pool` the buffer bestReuse() picks and returns it (an empty buffer when none),
/// its capacity in bytes taken off `pooled_bytes`. The caller resizes it to what it needs.
template <typename Buffer>
Buffer takeReused(std::vector<Buffer>& pool, size_t n, bool capacity_only, uint64_t& pooled_bytes) {
  const size_t best = bestReuse(pool, n, capacity_only);
  if (best == pool.size()) return Buffer{};
  Buffer b = std::move(pool[best]);
  pool[best] = std::move(pool.back());
  pool.pop_back();
  pooled_bytes -= b.capacity() * sizeof(typename Buffer::value_type);
  return b;
}

}  // namespace lightwire::kernels
