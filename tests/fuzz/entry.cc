// The libFuzzer entry point of one target: compiled once per target with
// -DLW_FUZZ_TARGET=<name> (tests/fuzz/meson.build).
#include "tests/fuzz/targets.h"

#ifndef LW_FUZZ_TARGET
#error "LW_FUZZ_TARGET must name a target of tests/fuzz/targets.h"
#endif

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  lightwire::fuzz::quiet();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return lightwire::fuzz::LW_FUZZ_TARGET::run(data, size);
}
