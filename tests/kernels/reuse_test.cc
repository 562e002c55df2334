// kernels/reuse.h: which kept buffer a pool reuses for a request.
#include <doctest.h>

#include <cstdint>
#include <vector>

#include "kernels/reuse.h"

namespace test_reuse {

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

TEST_CASE("bestReuse: the smallest capacity that holds n, else the largest, else none") {
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

TEST_CASE("bestReuse: a large buffer last used for a small request is not spent on a small one") {
  // Capacity 400 (last used for 4 elements) and capacity 100: a request for 200 reuses the first
  // rather than growing the second (two buffers of 200 or more where one does), and a request for
  // 50 takes the second, keeping the first for a large one.
  std::vector<std::vector<uint8_t>> pool;
  pool.push_back(buffer(4, 400));
  pool.push_back(buffer(100, 100));
  CHECK(bestReuse(pool, 200, false) == 0);
  CHECK(bestReuse(pool, 200, true) == 0);
  CHECK(bestReuse(pool, 50, false) == 1);
  CHECK(bestReuse(pool, 3, false) == 1);
  CHECK(bestReuse(pool, 500, false) == 0);  // none holds 500: the largest capacity grows
  CHECK(bestReuse(pool, 500, true) == 2);
}

TEST_CASE(
    "bestReuse: requests cycling through sizes hold no more than the largest set in use at once") {
  // Replays a pool's take/give pattern: each round takes one small and one large buffer at once
  // and gives both back; what the pool holds stays two buffers, one of each size, whatever the
  // order of the requests within the round.
  std::vector<std::vector<uint8_t>> pool;
  auto take = [&](size_t n) {
    std::vector<uint8_t> b;
    const size_t best = bestReuse(pool, n, false);
    if (best < pool.size()) {
      b = std::move(pool[best]);
      pool.erase(pool.begin() + static_cast<std::ptrdiff_t>(best));
    }
    b.resize(n);
    return b;
  };
  for (int round = 0; round < 20; ++round) {
    const bool small_first = round % 3 != 0;
    std::vector<uint8_t> a = take(small_first ? 16 : 4096);
    std::vector<uint8_t> b = take(small_first ? 4096 : 16);
    pool.push_back(std::move(a));
    pool.push_back(std::move(b));
    size_t total = 0;
    for (const auto& p : pool) total += p.capacity();
    CHECK(pool.size() == 2);
    CHECK(total <= 4096 + 64);
  }
}

}  // namespace test_reuse
