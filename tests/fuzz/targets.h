#pragma once
// The fuzz targets (tests/fuzz/README.md): one namespace each with run() (one input) and seeds()
// (its seed corpus). LW_FUZZ_TARGETS(X) calls X(name) for every one; tests/fuzz/meson.build
// builds one libFuzzer executable `fuzz_<name>` per name, and corpus_tool.cc writes and replays
// the seed corpora tests/fuzz/corpus/<name>/.

#include <cstddef>
#include <cstdint>

#include "tests/fuzz/fuzz_util.h"

#define LW_FUZZ_TARGETS(X) \
  X(payload)               \
  X(frame)                 \
  X(stats)                 \
  X(job_state)             \
  X(http)                  \
  X(config_yaml)           \
  X(config_json)           \
  X(checkpoint)

#define LW_FUZZ_DECLARE(name)                \
  namespace lightwire::fuzz::name {          \
  int run(const uint8_t* data, size_t size); \
  void seeds(Seeds& out);                    \
  }
LW_FUZZ_TARGETS(LW_FUZZ_DECLARE)
#undef LW_FUZZ_DECLARE
