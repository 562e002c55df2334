#!/usr/bin/env bash
# Configures (once) and compiles a build directory.
#
#   scripts/build.sh [release|asan|tsan] [BUILD_DIR]
#
#   release  optimised build; CUDA kernels when the toolkit is found (-Dcuda=auto, which fails
#            loudly if nvcc exists but CUDA cannot be enabled). Default dir: build-release.
#   asan     AddressSanitizer + UndefinedBehaviorSanitizer with clang-14 (CC/CXX: LW_ASAN_CC,
#            LW_ASAN_CXX), -O1 (what ASan recommends; it also compiles about a third faster than
#            -O2) with line tables only (-gline-tables-only: reports keep file:line, the build is
#            much faster than with full debug info), no CUDA, and the libFuzzer targets of
#            tests/fuzz (-Dfuzz=true; scripts/fuzz.sh runs them). UBSan reports and carries on
#            (scripts/test.sh counts them). -fno-sanitize=function: clang 14's function sanitizer
#            cannot compile C++20 coroutines ("Cannot represent a difference across sections",
#            LLVM bug 49689; proxy/peer/tcp_transport.cc). A directory configured otherwise
#            (another compiler, no fuzz targets) is configured afresh. Default dir: build-asan.
#   tsan     ThreadSanitizer with clang-14 (LW_ASAN_CC/LW_ASAN_CXX as above), -O1, line tables,
#            no CUDA, no UCX; builds only tests/exchange_tests (the peer transports, collectives
#            and mailboxes: the code where threads meet). Default dir: build-tsan.
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

targets=()  # all
case "$variant" in
  release) options=(--buildtype=release -Dcuda=auto) ;;
  asan)
    export CC=${LW_ASAN_CC:-clang-14} CXX=${LW_ASAN_CXX:-clang++-14}
    options=(-Doptimization=1 -Ddebug=false -Db_ndebug=false "-Db_sanitize=address,undefined"
             -Db_lundef=false -Dcuda=disabled -Dfuzz=true
             "-Dcpp_args=-gline-tables-only -fno-sanitize=function")
    # An older build-asan (gcc, or without the fuzz targets) is set up again.
    if [[ -f "$dir/build.ninja" ]] &&
      ! grep -qx 'fuzz = true' "$dir/meson-private/cmd_line.txt" 2>/dev/null; then
      rm -f "$dir/build.ninja"
    fi
    ;;
  tsan)
    export CC=${LW_ASAN_CC:-clang-14} CXX=${LW_ASAN_CXX:-clang++-14}
    options=(-Doptimization=1 -Ddebug=false -Db_ndebug=false -Db_sanitize=thread -Db_lundef=false
             -Dcuda=disabled -Ducx=disabled "-Dcpp_args=-gline-tables-only")
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
