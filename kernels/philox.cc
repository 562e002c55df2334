#include "kernels/philox.h"

#include <Random123/philox.h>
#include <xxhash.h>

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

}  // namespace lightwire::kernels
