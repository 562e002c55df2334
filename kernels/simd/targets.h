#pragma once
// The Highway SIMD targets the kernels are compiled for (docs/determinism.md: payload bytes do not
// depend on the target), which of them this CPU can run, and a way for tests to force one.

#include <cstdint>
#include <string>
#include <vector>

namespace lightwire::kernels::simd {

/// Highway target bits (HWY_AVX3, HWY_AVX2, ...) compiled into this binary that this CPU supports,
/// best first. Never empty.
std::vector<int64_t> availableTargets();

/// Printable name of one target bit ("AVX3", "AVX2", "SSE4", "EMU128", ...).
std::string targetName(int64_t target);

/// The target HWY_DYNAMIC_DISPATCH picks now (the best available unless forced).
int64_t currentTarget();

/// Forces dynamic dispatch onto one target for the lifetime of the object, then restores the
/// CPU's own choice. For tests: process-wide and not reentrant (construct one at a time, while no
/// kernel runs on another thread).
class ScopedTargetForTest {
 public:
  explicit ScopedTargetForTest(int64_t target);
  ~ScopedTargetForTest();
  ScopedTargetForTest(const ScopedTargetForTest&) = delete;
  ScopedTargetForTest& operator=(const ScopedTargetForTest&) = delete;
};

}  // namespace lightwire::kernels::simd
