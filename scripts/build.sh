#!/usr/bin/env bash
# Configures (once) and compiles a build directory.
#
#   scripts/build.sh [release|asan|tsan] [BUILD_DIR]
#
#   release  optimised build; CUDA kernels when the toolkit is found (-Dcuda=auto, which fails
#            loudly if nvcc exists but CUDA cannot be enabled). The test executables that only
#            drive the code under test (proxy_tests, exchange_tests, proxy_cuda_tests) are compiled
#            at -O0 (-Dtest_optimization=0): the code they test stays optimised, and they compile
#            in a quarter to a third of the time; they are unity builds in every variant
#            (tests/meson.build). The codec tests (kernels_tests, kernels_cuda_tests) are compiled
#            at -O1 (-Dcodec_test_optimization=1): the codecs stay at -O3, the tests' own
#            reference computations compile in 60 % of the time and run 10 % longer. The codec tests
#            are unity builds too (kernels_tests 75 instead of 169 CPU-seconds here, under ASan 142
#            instead of 242; kernels_cuda_tests 40 instead of 60).
#            Default dir: build-release.
#   asan     AddressSanitizer + UndefinedBehaviorSanitizer with clang-14 (CC/CXX: LW_ASAN_CC,
#            LW_ASAN_CXX), -O1 (what ASan recommends), with line tables only (-gline-tables-only:
#            reports keep file:line, the build is much faster than with full debug info), no CUDA,
#            and the libFuzzer targets of tests/fuzz (-Dfuzz=true; scripts/fuzz.sh runs them).
#            Two things make it compile in two thirds of the time:
#            - a unity build (--unity=on, six files of a target per translation unit; not
#              kernels/): Asio and Beast are parsed and instantiated once per six files.
#              So file-local names (anonymous namespaces) must be unique within a library or test
#              executable (docs/architecture.md "How to add");
#            - -O0 for the code no test needs fast (-Dtest_optimization=0: proxy_tests,
#              exchange_tests; -Dtools_optimization=0: proxy/tools and main, which only the smoke
#              runs use here). The libraries stay at -O1: the codec tests spend four times as long
#              at -O0, and the fuzz targets' executions per second drop 8 to 25 times (4 to 40
#              times with only proxy/ at -O0, measured 2026-12-07: meson.build).
#            The unit tests' own code goes without the fuzzers' coverage instrumentation
#            (-fno-sanitize=fuzzer-no-link; the library code they link keeps it).
#            UBSan reports and carries on (scripts/test.sh counts them). -fno-sanitize=function:
#            clang 14's function sanitizer cannot compile C++20 coroutines ("Cannot represent a
#            difference across sections", LLVM bug 49689; proxy/peer/tcp_transport.cc). A
#            directory configured otherwise (another compiler, no fuzz targets, not a unity build,
#            other optimisation levels) is configured afresh. Default dir: build-asan.
#   tsan     ThreadSanitizer with clang-14 (LW_ASAN_CC/LW_ASAN_CXX as above), -O1, line tables,
#            a unity build as for asan, no CUDA, no UCX; builds only tests/exchange_tests (the peer
#            transports, collectives and mailboxes: the code where threads meet). Default dir:
#            build-tsan.
#
# An existing build directory is reused (ninja re-runs meson itself when a meson.build changed).
# LW_BUILD_PREFIX changes the default directory prefix ("build"); LW_JOBS the ninja jobs (2).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

variant=${1:-release}
prefix=${LW_BUILD_PREFIX:-build}
dir=${2:-$prefix-$variant}
jobs=${LW_JOBS:-2}

# nvcc lives outside PATH on a stock install of the toolkit.
if [[ -d /usr/local/cuda/bin && ":$PATH:" != *":/usr/local/cuda/bin:"* ]]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
# Meson calls `nvcc` by name: scripts/nvcc/nvcc runs the real one and has it write the dependency
# file ninja reads, so an edited CUDA header rebuilds the objects that include it.
if command -v nvcc >/dev/null 2>&1; then
  export PATH=$PWD/scripts/nvcc:$PATH
fi

targets=()  # all
case "$variant" in
  release)
    options=(--buildtype=release -Dtest_optimization=0 -Dcodec_test_optimization=1 -Dcuda=auto)
    # A build-release configured before these options existed gets them (a reconfigure, not a
    # fresh setup: nothing else changes; ninja first loads the current meson_options.txt).
    if [[ -f "$dir/build.ninja" ]] &&
      ! { grep -qx 'test_optimization = 0' "$dir/meson-private/cmd_line.txt" &&
          grep -qx 'codec_test_optimization = 1' "$dir/meson-private/cmd_line.txt"; } 2>/dev/null
    then
      ninja -C "$dir" build.ninja >/dev/null
      meson configure "$dir" -Dtest_optimization=0 -Dcodec_test_optimization=1 >/dev/null
    fi
    ;;
  asan)
    export CC=${LW_ASAN_CC:-clang-14} CXX=${LW_ASAN_CXX:-clang++-14}
    options=(-Doptimization=1 -Dtools_optimization=0 -Dtest_optimization=0 --unity=on
             -Dunity_size=6 -Ddebug=false -Db_ndebug=false "-Db_sanitize=address,undefined"
             -Db_lundef=false -Dcuda=disabled -Dfuzz=true
             "-Dcpp_args=-gline-tables-only -fno-sanitize=function")
    # An older build-asan (gcc, without the fuzz targets, or all at -O1) is set up again.
    if [[ -f "$dir/build.ninja" ]] &&
      ! { grep -qx 'fuzz = true' "$dir/meson-private/cmd_line.txt" &&
          grep -qx 'tools_optimization = 0' "$dir/meson-private/cmd_line.txt" &&
          grep -qx 'unity = on' "$dir/meson-private/cmd_line.txt"; } 2>/dev/null; then
      rm -f "$dir/build.ninja"
    fi
    ;;
  tsan)
    export CC=${LW_ASAN_CC:-clang-14} CXX=${LW_ASAN_CXX:-clang++-14}
    options=(-Doptimization=1 --unity=on -Dunity_size=6 -Ddebug=false -Db_ndebug=false
             -Db_sanitize=thread -Db_lundef=false -Dcuda=disabled -Ducx=disabled
             "-Dcpp_args=-gline-tables-only")
    # An older build-tsan (not a unity build) is set up again.
    if [[ -f "$dir/build.ninja" ]] &&
      ! grep -qx 'unity = on' "$dir/meson-private/cmd_line.txt" 2>/dev/null; then
      rm -f "$dir/build.ninja"
    fi
    targets=(tests/exchange_tests)
    ;;
  *) echo "usage: $0 [release|asan|tsan] [BUILD_DIR]" >&2; exit 2 ;;
esac

if [[ ! -f "$dir/build.ninja" ]]; then
  # A directory left half-configured by an interrupted setup is configured afresh.
  if [[ -d "$dir/meson-private" ]]; then options+=(--wipe); fi
  setup_log=$(mktemp)
  if ! meson setup "$dir" "${options[@]}" >"$setup_log" 2>&1; then
    cat "$setup_log" >&2
    rm -f "$setup_log"
    echo "build.sh: meson setup of $dir failed" >&2
    exit 1
  fi
  sed -n '/^  lightwire$/,/^$/p' "$setup_log" >&2
  rm -f "$setup_log"
fi
ninja -C "$dir" -j"$jobs" "${targets[@]}"
