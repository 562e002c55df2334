#include "kernels/philox.h"

#include <Random123/philox.h>
#include <xxhash.h>

#include <cstring>

#include "kernels/simd/kernels.h"

namespace lightwire::kernels {

uint32_t tensorNameKey(std::string_view name) {
  return static_cast<uint32_t>(XXH3_64bits(name.data(), name.size()) & 0xFFFFFFFFu);
}

std::array<uint32_t, 4> philoxBlock(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key) {
  r123::Philox4x32_R<10> rng;
  r123::Philox4x32_R<10>::ctr_type c = {{counter[0], counter[1], counter[2], counter[3]}};
  r123::Philox4x32_R<10>::key_type k = {{key[0], key[1]}};
  const auto r = rng(c, k);
  return {r[0], r[1], r[2], r[3]};
}

void philoxBlocks(std::array<uint32_t, 3> counter_head, std::array<uint32_t, 2> key, uint64_t g0,
                  size_t count, uint32_t* out) {
  simd::philoxGroups(counter_head.data(), key.data(), g0, count, out);
}

void PhiloxStream::words(uint64_t first, size_t len, uint32_t* w) const {
  size_t k = 0;
  uint64_t i = first;
  if ((i & 3) != 0 && len != 0) {  // the rest of a group started before `first`
    const std::array<uint32_t, 4> g = group(i >> 2);
    for (; (i & 3) != 0 && k < len; ++i, ++k) w[k] = g[i & 3];
  }
  const size_t whole = (len - k) / 4;
  if (whole != 0) {  // whole groups, straight into w
    groups(i >> 2, whole, w + k);
    k += 4 * whole;
    i += 4 * whole;
  }
  if (k < len) {
    const std::array<uint32_t, 4> g = group(i >> 2);
    for (; k < len; ++i, ++k) w[k] = g[i & 3];
  }
}

}  // namespace lightwire::kernels
