#!/usr/bin/env bash
# GPU check from carried binaries. Builds nothing: the binaries are built on a development machine
# (which has the CUDA toolkit but no GPU) and carried to a machine with a GPU, where this script
# runs them and writes the results under $OUT. Exits non-zero on any failure, including "no GPU"
# (kernels_cuda_tests and proxy_cuda_tests run with LW_REQUIRE_CUDA=1, so a missing device fails
# instead of skipping).
#
# 1. Prepare the carry here, from a release build that has the CUDA kernels:
#
#      bash scripts/pack-device.sh                        # builds build-release/, packs build-device/
#   (or: bash scripts/build.sh release && bash scripts/device-check.sh --prepare build-release
#    build-device)
#
#    --prepare copies kernels_cuda_tests, proxy_cuda_tests, kernels_tests and lightwire into
#    build-device/ (ignored by git through .gitignore's /build*/, so it travels only when carried),
#    then runs `ldd` on each and copies every shared library they resolve to into build-device/lib/
#    — except the glibc family (libc, libm, libdl, librt, libpthread, ld-linux), which every Linux
#    has and which must match the target's kernel interface. libstdc++/libgcc_s are carried: the
#    target's may be older. The CUDA runtime is linked statically (cudart_static), so only the
#    driver (libcuda, on the GPU machine) is needed. Binaries are stripped. The carry must stay
#    under 64 MiB in all (the device tool's limit for the working tree plus carried paths);
#    --prepare prints the size and fails above 60 MiB.
#
# 2. Run it there, from the repository root (the golden payload files come from the working tree):
#
#      bash scripts/device-check.sh [OUTDIR]     (OUTDIR default: $OUT, else build-device/out)
#      device run: command "bash scripts/device-check.sh \"$OUT\"", carry ["build-device"],
#                  timeout_s 300
#
#    It sets LD_LIBRARY_PATH=build-device/lib, runs nvidia-smi (information), kernels_cuda_tests
#    (every CUDA codec against the CPU one, byte for byte; must pass on the GPU), proxy_cuda_tests
#    (the step engine's GPU path against its host path, bit for bit; must pass), kernels_tests
#    (the CPU suite, on that machine's CPU), `lightwire --version`, the CUDA IPC checks
#    (tests/python/cuda_ipc_check.py: this machine's python3 with PyTorch CUDA as the trainer,
#    `lightwire serve` as the sidecar), the device memory per codec (bench/memory_gpu.py: fails
#    only when a row cannot run), and, for figures only (never judged),
#    `lightwire bench codec --device cuda --all` at 100M elements (with the device copy and
#    torch.topk baselines) and the CPU `bench codec --all` at 25M elements. Logs, summary.txt and
#    summary.json land in OUTDIR. The packed binaries are read from LW_DEVICE_DIR (default
#    build-device).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

binaries=(kernels_cuda_tests proxy_cuda_tests kernels_tests lightwire)

prepare() {
  local build=$1 dest=$2
  local -A source=([kernels_cuda_tests]=$build/tests/kernels_cuda_tests
                   [proxy_cuda_tests]=$build/tests/proxy_cuda_tests
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

dir=${LW_DEVICE_DIR:-build-device}
[[ "$dir" == /* ]] || dir=$PWD/$dir
out=${1:-${OUT:-$dir/out}}
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

python=${PYTHON:-python3}
check "kernels_cuda_tests (GPU)" kernels_cuda_tests.log \
  env LW_REQUIRE_CUDA=1 "$dir/kernels_cuda_tests" -r=console
check "proxy_cuda_tests (GPU: step engine, GPU path vs host path)" proxy_cuda_tests.log \
  env LW_REQUIRE_CUDA=1 "$dir/proxy_cuda_tests" -r=console
check "kernels_tests (CPU suite)" kernels_tests.log "$dir/kernels_tests" -r=console
check "lightwire --version" version.log "$dir/lightwire" --version
check "CUDA IPC: trainer process -> lightwire serve, results in place" cuda_ipc.log \
  "$python" tests/python/cuda_ipc_check.py "$dir/lightwire" "$out/cuda_ipc.json"
cat "$out/cuda_ipc.log"
# Device memory per codec (docs/cuda.md "Memory"): figures, and a failure only if a row cannot run.
check "bench/memory_gpu.py: device memory per codec, 100 MB tensor" memory_gpu.log \
  "$python" bench/memory_gpu.py "$dir/lightwire" --steps 3 --json "$out/memory_gpu.json"
cat "$out/memory_gpu.log"
# One JSON object per codec on stdout (bench_cuda.jsonl), progress on stderr (bench_cuda.log).
t0=$SECONDS
if "$dir/lightwire" bench codec --device cuda --all --elements 100000000 --python "$python" \
  --json >"$out/bench_cuda.jsonl" 2>"$out/bench_cuda.log"; then
  record "PASS  lightwire bench codec --device cuda --all --elements 100000000 ($((SECONDS - t0)) s)"
else
  record "FAIL  lightwire bench codec --device cuda (exit $?; $out/bench_cuda.log)"
  tail -n 30 "$out/bench_cuda.log"
  failed=$((failed + 1))
fi
cat "$out/bench_cuda.jsonl"
check "lightwire bench codec --all --elements 25000000 (CPU)" bench.txt \
  "$dir/lightwire" bench codec --all --elements 25000000
cat "$out/bench.txt"

grep -h '^\[doctest\] test cases' "$out"/kernels_cuda_tests.log "$out"/proxy_cuda_tests.log \
  "$out"/kernels_tests.log \
  >>"$summary" 2>/dev/null
record "device-check: $failed failed"
# summary.json: every check's line, and the GPU figures (one JSON object per codec).
"$python" - "$summary" "$out/bench_cuda.jsonl" "$out/summary.json" <<'PY' || true
import json, sys
lines = [l.rstrip("\n") for l in open(sys.argv[1])]
checks = [{"status": l.split()[0], "check": l[6:]} for l in lines if l[:4] in ("PASS", "FAIL")]
bench = []
try:
    for l in open(sys.argv[2]):
        l = l.strip()
        if l.startswith("{"):
            bench.append(json.loads(l))
except OSError:
    pass
json.dump({"checks": checks, "bench_cuda": bench, "summary": lines}, open(sys.argv[3], "w"), indent=1)
PY
((failed == 0))
