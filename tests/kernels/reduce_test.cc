// Canonical fp64 reductions (docs/determinism.md §2).
#include <doctest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/parallel.h"
#include "kernels/reduce.h"

namespace test_reduce {

using namespace lightwire::kernels;

namespace {
// Written straight from the spec, independently of reduce.cc.
double specSum(const std::vector<float>& x, ReduceTerm term) {
  double total = 0.0;
  for (size_t b = 0; b * 4096 < x.size(); ++b) {
    double a[8] = {};
    for (size_t i = b * 4096; i < std::min(x.size(), (b + 1) * 4096); ++i) {
      const double v = x[i];
      a[i % 8] += term == ReduceTerm::kSquare ? v * v : term == ReduceTerm::kAbs ? std::fabs(v) : v;
    }
    total += ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
  }
  return total;
}
}  // namespace

TEST_CASE("reduce: canonical order, bit-identical for 1 and 2 threads and every length") {
  std::mt19937 gen(42);
  std::lognormal_distribution<float> mag(0.0f, 4.0f);  // wide dynamic range exposes order
  CpuStream one(1), two(2);
  for (size_t n : {0ul, 1ul, 7ul, 8ul, 4095ul, 4096ul, 4097ul, 8192ul, 100003ul}) {
    std::vector<float> x(n);
    for (auto& v : x) v = (gen() & 1 ? -1.0f : 1.0f) * mag(gen);
    std::vector<double> blocks((n + 4095) / 4096);
    for (auto term : {ReduceTerm::kSquare, ReduceTerm::kAbs, ReduceTerm::kValue}) {
      const double want = specSum(x, term);
      CHECK(canonicalSum(x.data(), n, term) == want);
      CHECK(canonicalSum(x.data(), n, term, &one, blocks) == want);
      CHECK(canonicalSum(x.data(), n, term, &two, blocks) == want);
    }
    CHECK(canonicalNorm(x.data(), n, &two, blocks) == std::sqrt(specSum(x, ReduceTerm::kSquare)));
  }
}

TEST_CASE("reduce: the order is not the naive one") {
  // 1e16 + 1 + ... : strided accumulators give a different (documented) result than a plain loop.
  std::vector<float> x = {1e16f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, -1e16f, 1.0f};
  double naive = 0;
  for (float v : x) naive += v;
  CHECK(canonicalSum(x.data(), x.size(), ReduceTerm::kValue) == specSum(x, ReduceTerm::kValue));
  CHECK(specSum(x, ReduceTerm::kValue) != naive);
}

TEST_CASE("reduce: CpuStream partitions cover every index once") {
  for (unsigned t : {1u, 2u, 3u}) {
    CpuStream s(t);
    for (size_t n : {0ul, 1ul, 5ul, 1000ul}) {
      std::vector<int> hits(n, 0);
      s.parallelFor(n, 1, [&](size_t lo, size_t hi) {
        for (size_t i = lo; i < hi; ++i) ++hits[i];
      });
      for (int h : hits) CHECK(h == 1);
    }
  }
}

}  // namespace test_reduce
