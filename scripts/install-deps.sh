#!/usr/bin/env bash
# Installs the Debian 12 packages lightwire needs. Idempotent and quiet: when everything is
# installed it does nothing at all (not even `apt-get update`).
#
#   scripts/install-deps.sh [all|build|runtime]
#
#   all      (default) everything to build, test and run the demo and benchmarks
#   build    only what building the sidecar needs (the build stage of docker/Dockerfile)
#   runtime  only the shared libraries the built binary links (the runtime stage of
#            docker/Dockerfile; tests/python/test_deploy.py checks that they cover `ldd`)
#
# Runs as root, or through sudo otherwise. The CUDA toolkit is optional and not a Debian package:
# when /usr/local/cuda exists, scripts/build.sh builds the CUDA kernels too (docker/Dockerfile
# adds NVIDIA's repository for it).
set -euo pipefail

what=${1:-all}

# The shared libraries of build-release/proxy/lightwire (the CUDA runtime is linked statically;
# the driver, libcuda.so.1, is loaded at run time when present).
runtime=(
  libboost-json1.81.0 libfmt9 libhwy1 libprometheus-cpp-core1.0 libspdlog1.10 libssl3 libucx0
  libxxhash0 libyaml-cpp0.7
)

build=(
  meson ninja-build pkg-config g++
  libboost1.81-dev libboost-json1.81-dev prometheus-cpp-dev libyaml-cpp-dev libcli11-dev
  libspdlog-dev libxxhash-dev libssl-dev libhwy-dev librandom123-dev libucx-dev
  # the unit tests are built with everything else (meson needs doctest's headers to configure)
  doctest-dev
)

tests=(
  # tests (the numpy reference implementation behind the golden payloads; the Python
  # client's tests and the demo's trainer: PyTorch and pytest). OpenBLAS: Debian's torch and
  # numpy link libblas.so.3, which is otherwise the reference BLAS (about 5 GFLOPS a core against
  # OpenBLAS's 30: the trainers of the demo and of bench/e2e spend 5-7 times longer per step)
  python3-numpy python3-xxhash python3-torch python3-pytest libopenblas0-pthread
  # source formatting check (.clang-format)
  clang-format
  # the asan build (scripts/build.sh asan) and its libFuzzer targets (tests/fuzz): clang and its
  # sanitizer and libFuzzer runtimes
  clang-14 libclang-rt-14-dev
  # observability: promtool (config, alert rules and their unit tests) and the Prometheus server
  # the observability test scrapes the sidecars with
  prometheus
  # benchmarks: network namespaces and the rate limit (ip, tc) of bench/netns_exchange.sh and
  # bench/e2e; the plots of docs/BENCHMARKS.md; instruction counts (callgrind) of
  # bench/compare_builds.py
  iproute2 python3-matplotlib valgrind
  # deployment: `docker-compose config` checks docker/compose.yml (no engine needed); PyYAML
  # reads the Kubernetes manifests and the compose file (tests/python/test_deploy.py,
  # scripts/check-image.py)
  docker-compose python3-yaml
  # the image emulation (scripts/check-image.py) and the container test's base image: a Debian 12
  # root file system; the real engine the container test starts (tests/python/test_containers.py)
  debootstrap docker.io
  # peer TLS tests with real sidecars make their CA and certificates with the openssl command,
  # as docs/peer-protocol.md shows
  openssl
)

case "$what" in
  all) packages=("${build[@]}" "${tests[@]}") ;;
  build) packages=("${build[@]}") ;;
  runtime) packages=("${runtime[@]}") ;;
  *) echo "usage: $0 [all|build|runtime]" >&2; exit 2 ;;
esac

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

if [[ $(id -u) -eq 0 ]]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1; then
  as_root=(sudo)
else
  echo "install-deps: missing ${missing[*]}; run as root (no sudo here)" >&2
  exit 1
fi

echo "install-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  "${missing[@]}" >/dev/null
echo "install-deps: done" >&2
