#!/usr/bin/env bash
# GPU check from carried binaries. Builds nothing: the binaries are built on a development machine
# (which has the CUDA toolkit but no GPU) and carried to a machine with a GPU, where this script
# runs them and writes the results under $OUT. Exits non-zero on any failure, including "no GPU"
# (kernels_cuda_tests runs with LW_REQUIRE_CUDA=1, so a missing device fails instead of skipping).
#
# 1. Prepare the carry here, from a release build that has the CUDA kernels:
#
#      bash scripts/build.sh release                      # build-release/, CUDA auto
#      bash scripts/device-check.sh --prepare build-release build-device
#
#    --prepare copies kernels_cuda_tests, kernels_tests and lightwire into build-device/ (ignored
#    by git through .gitignore's /build*/, so it travels only when carried), then runs `ldd` on
#    each and copies every shared library they resolve to into build-device/lib/ — except the
#    glibc family (libc, libm, libdl, librt, libpthread, ld-linux), which every Linux has and which
#    must match the target's kernel interface. libstdc++/libgcc_s are carried: the target's may be
#    older. The CUDA runtime is linked statically (cudart_static), so only the driver (libcuda,
#    on the GPU machine) is needed. Binaries are stripped. The carry must stay under 64 MiB in all
#    (the device tool's limit for the working tree plus carried paths); --prepare prints the size
#    and fails above 60 MiB.
#
# 2. Run it there, from the repository root (the golden payload files come from the working tree):
#
#      device run: command "bash scripts/device-check.sh build-device", carry ["build-device"],
#                  timeout_s 300
#
#    It sets LD_LIBRARY_PATH=build-device/lib, runs nvidia-smi (information), kernels_cuda_tests
#    (must pass on the GPU), kernels_tests (the CPU suite, on that machine's CPU), and
#    `lightwire --version` and a `lightwire bench codec --all` at 25M elements (figures only,
#    never judged). Logs and a summary land in $OUT (or build-device/out when OUT is unset).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

binaries=(kernels_cuda_tests kernels_tests lightwire)

prepare() {
  local build=$1 dest=$2
  local -A source=([kernels_cuda_tests]=$build/tests/kernels_cuda_tests
                   [kernels_tests]=$build/tests/kernels_tests
                   [lightwire]=$build/proxy/lightwire)
  rm -rf "$dest" && mkdir -p "$dest/lib" || return 1
  for b in "${binaries[@]}"; do
    if [[ ! -x "${source[$b]}" ]]; then
      echo "device-check: ${source[$b]} missing (a release build with CUDA kernels?)" >&2
      return 1
    fi
    cp "${source[$b]}" "$dest/$b" && strip "$dest/$b" || return 1
    ldd "${source[$b]}" | awk '/=> \// { print $3 }' | while read -r lib; do
      case "$(basename "$lib")" in
        libc.so.* | libm.so.* | libdl.so.* | librt.so.* | libpthread.so.* | ld-linux*) ;;
        *) cp -L "$lib" "$dest/lib/" ;;
      esac
    done
  done
  # Where the binaries look for the golden files (LW_TEST_DATA_DIR, compiled in).
  echo "$PWD/tests" >"$dest/test-data-dir.txt"
  local bytes
  bytes=$(du -sb "$dest" | cut -f1)
  echo "device-check: prepared $dest: $(ls "$dest" "$dest/lib" | tr '\n' ' ')"
  echo "device-check: $((bytes / 1024 / 1024)) MiB ($bytes bytes) to carry (limit 64 MiB in all)"
  if ((bytes > 60 * 1024 * 1024)); then
    echo "device-check: too large to carry" >&2
    return 1
  fi
}

if [[ "${1:-}" == "--prepare" ]]; then
  prepare "${2:-build-release}" "${3:-build-device}"
  exit
fi

dir=${1:-build-device}
[[ "$dir" == /* ]] || dir=$PWD/$dir
out=${OUT:-$dir/out}
mkdir -p "$out"
export LD_LIBRARY_PATH="$dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
summary=$out/summary.txt
: >"$summary"
failed=0

record() { echo "$1" | tee -a "$summary"; }
check() {  # check NAME LOG CMD...: runs CMD, logs its output, records PASS/FAIL
  local name=$1 log=$out/$2
  shift 2
  local t0=$SECONDS
  if "$@" >"$log" 2>&1; then
    record "PASS  $name ($((SECONDS - t0)) s)"
  else
    record "FAIL  $name (exit $?, $((SECONDS - t0)) s; $log)"
    tail -n 30 "$log"
    failed=$((failed + 1))
  fi
}

for b in "${binaries[@]}"; do
  if [[ ! -x "$dir/$b" ]]; then
    record "FAIL  $dir/$b missing: prepare the carry with --prepare (see the top of this script)"
    exit 1
  fi
done

{
  echo "host: $(hostname), $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p' | head -n 1)"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>&1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  else
    echo "nvidia-smi: not installed"
  fi
} | tee "$out/machine.txt"

# The golden payload files: the binaries read them from the path compiled in at build time; point
# that path at this working tree when it differs.
if [[ -f "$dir/test-data-dir.txt" ]]; then
  data_dir=$(cat "$dir/test-data-dir.txt")
  if [[ ! -d "$data_dir" && -d tests ]]; then
    mkdir -p "$(dirname "$data_dir")" && ln -s "$PWD/tests" "$data_dir" ||
      record "WARN  could not link $data_dir to $PWD/tests: the golden tests will fail"
  fi
fi

check "kernels_cuda_tests (GPU)" kernels_cuda_tests.log \
  env LW_REQUIRE_CUDA=1 "$dir/kernels_cuda_tests" -r=console
check "kernels_tests (CPU suite)" kernels_tests.log "$dir/kernels_tests" -r=console
check "lightwire --version" version.log "$dir/lightwire" --version
check "lightwire bench codec --all --elements 25000000" bench.txt \
  "$dir/lightwire" bench codec --all --elements 25000000
cat "$out/bench.txt"

grep -h '^\[doctest\] test cases' "$out"/kernels_cuda_tests.log "$out"/kernels_tests.log \
  >>"$summary" 2>/dev/null
record "device-check: $failed failed"
((failed == 0))
