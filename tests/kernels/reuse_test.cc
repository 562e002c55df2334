// kernels/reuse.h: which kept buffer a pool reuses for a request.
#include <doctest.h>

#include <cstdint>
#include <vector>

#include "kernels/reuse.h"

using lightwire::kernels::bestReuse;

namespace {

/// A buffer of `size` elements with room for `capacity`.
std::vector<uint8_t> buffer(size_t size, size_t capacity) {
  std::vector<uint8_t> b;
  b.reserve(capacity);
  b.resize(size);
  return b;
}

}  // namespace

TEST_CASE("bestReuse: the smallest buffer that holds n, else the largest, else none") {
  std::vector<std::vector<uint8_t>> pool;
  CHECK(bestReuse(pool, 10, true) == 0);  // empty: none
  CHECK(bestReuse(pool, 10, false) == 0);
  pool.push_back(buffer(100, 100));
  pool.push_back(buffer(20, 20));
  pool.push_back(buffer(50, 50));
  CHECK(bestReuse(pool, 10, true) == 1);    // 20 holds 10 and is the smallest that does
  CHECK(bestReuse(pool, 30, true) == 2);    // 50
  CHECK(bestReuse(pool, 100, true) == 0);   // 100: exactly
  CHECK(bestReuse(pool, 101, true) == 3);   // no capacity holds 101: none (pool.size())
  CHECK(bestReuse(pool, 101, false) == 0);  // the largest, to grow it
  // Among buffers whose capacity holds n but whose size does not, the largest size: the least
  // growth to write.
  std::vector<std::vector<uint8_t>> spare;
  spare.push_back(buffer(10, 64));
  spare.push_back(buffer(40, 64));
  spare.push_back(buffer(8, 8));
  CHECK(bestReuse(spare, 50, true) == 1);
  CHECK(bestReuse(spare, 50, false) == 1);
  CHECK(bestReuse(spare, 40, true) == 1);  // size 40 holds 40
}
