#!/usr/bin/env bash
# Builds and packs what a GPU machine needs to run the GPU checks (scripts/device-check.sh): the
# release build with the CUDA kernels, then the binaries, stripped, with the shared libraries they
# resolve to (ldd; glibc's family excluded), into one directory small enough to carry (< 64 MiB).
#
#   scripts/pack-device.sh [BUILD_DIR] [PACK_DIR]      defaults: build-release build-device
#
# Then, on the GPU machine, from a checkout of the same tree (the Python client, the checks and the
# golden files come from the working tree):
#   bash scripts/device-check.sh [OUTDIR]              (results in OUTDIR: default $OUT, else build-device/out)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build=${1:-build-release}
pack=${2:-build-device}

if [[ -d /usr/local/cuda/bin && ":$PATH:" != *":/usr/local/cuda/bin:"* ]]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
if ! command -v nvcc >/dev/null 2>&1; then
  echo "pack-device: nvcc not found: the GPU checks need the CUDA kernels, built with the CUDA" \
    "toolkit (/usr/local/cuda)" >&2
  exit 1
fi
echo "pack-device: building $build (release, CUDA kernels)"
bash scripts/build.sh release "$build"
for t in kernels_cuda_tests proxy_cuda_tests; do
  if [[ ! -x "$build/tests/$t" ]]; then
    echo "pack-device: $build has no $t (configured without the CUDA kernels? remove $build and" \
      "run again)" >&2
    exit 1
  fi
done
bash scripts/device-check.sh --prepare "$build" "$pack"
