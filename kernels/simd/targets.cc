#include "kernels/simd/targets.h"

#include <hwy/highway.h>
#include <hwy/targets.h>

namespace lightwire::kernels::simd {

std::vector<int64_t> availableTargets() { return hwy::SupportedAndGeneratedTargets(); }

std::string targetName(int64_t target) { return hwy::TargetName(target); }

int64_t currentTarget() {
  const std::vector<int64_t> t = availableTargets();
  return t.empty() ? HWY_STATIC_TARGET : t.front();
}

ScopedTargetForTest::ScopedTargetForTest(int64_t target) {
  hwy::SetSupportedTargetsForTest(target);
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
}

ScopedTargetForTest::~ScopedTargetForTest() {
  hwy::SetSupportedTargetsForTest(0);
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
}

}  // namespace lightwire::kernels::simd
