#!/usr/bin/env bash
# Configures (once) and compiles a build directory.
#
#   scripts/build.sh [release|asan] [BUILD_DIR]
#
#   release  optimised build; CUDA kernels when the toolkit is found (-Dcuda=auto, which fails
#            loudly if nvcc exists but CUDA cannot be enabled). Default dir: build-release.
#   asan     AddressSanitizer + UndefinedBehaviorSanitizer, -O1 with debug info (what ASan
#            recommends; it also compiles about a third faster than -O2), no CUDA.
#            Default dir: build-asan.
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

case "$variant" in
  release) options=(--buildtype=release -Dcuda=auto) ;;
  asan) options=(-Doptimization=1 -Ddebug=true -Db_ndebug=false "-Db_sanitize=address,undefined"
                 -Db_lundef=false -Dcuda=disabled) ;;
  *) echo "usage: $0 [release|asan] [BUILD_DIR]" >&2; exit 2 ;;
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
ninja -C "$dir" -j"$jobs"
