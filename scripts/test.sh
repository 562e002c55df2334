#!/usr/bin/env bash
# THE test command (.ci/run runs it): installs the dependencies, builds the release, the
# ASan+UBSan (clang, with the libFuzzer targets) and the ThreadSanitizer (exchange tests only)
# variants (the sanitizer builds in the background, at nice 10, while the release build's tests
# run), and runs
#   - the doctest unit tests in the release and ASan builds, the exchange tests under TSan as well
#     (each test case counts; every sanitizer report is a failure); the codec tests under ASan run
#     beside the others;
#   - every libFuzzer target briefly (scripts/fuzz.sh; each target counts);
#   - the CUDA tests when the CUDA kernels were built: their host-side part, and the GPU part,
#     which counts as skipped on a machine without a GPU (exit 77), never as passed;
#   - the golden payload check of the independent reference implementation (one test);
#   - the Python client and DDP hook tests (pytest) against the real sidecar and PyTorch (the
#     container test, tests/python/test_containers.py, after the others, once the background
#     images are built, while the sanitizer builds finish); they include the deployment files
#     (tests/python/test_deploy.py: docker-compose config of docker/compose.yml, the Dockerfile
#     against the binary's libraries, the Kubernetes manifests and `serve --check-config` of
#     their configuration, the compose job's commands on loopback);
#   - promtool checks of docker/prometheus (config, rules, rule unit tests);
#   - the container test's images are built ahead in the background (at nice 10, from the end of
#     the release build on: scripts/containers.py images), so that the test rebuilds them from the
#     engine's cache in seconds instead of building them on the suite's critical path. Where no
#     engine can run (no docker.io), docker/Dockerfile's sidecar and trainer stages are emulated
#     on a debootstrapped Debian 12 instead (as root; scripts/check-image.py): health check, a
#     gradient, one compose node's trainer. The real engine's test covers all of that, so the
#     emulation does not run beside it;
#   - smoke runs of the `lightwire` executable (release, and `bench codec --all` under ASan);
#   - a 2-minute soak (bench/soak/soak.py): fails on any error, RSS growth or fd growth; it runs
#     beside the fuzzing, which, like it, takes a fixed time, and is judged after it.
# Ends with exactly one line `N passed, M failed[, K skipped]` and exits non-zero when anything
# failed, including a build. Logs: <prefix>-test-logs/ (prefix: LW_BUILD_PREFIX, default "build").
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

python=${PYTHON:-/usr/bin/python3}
prefix=${LW_BUILD_PREFIX:-build}
release_dir=$prefix-release
asan_dir=$prefix-asan
tsan_dir=$prefix-tsan
logs=$prefix-test-logs
rm -rf "$logs" && mkdir -p "$logs"

passed=0 failed=0 skipped=0
failures=()
start=$SECONDS

note() { printf '%s\n' "$*"; }
# Sets cpu to the CPU seconds (user + system) of the processes this shell, or the subshell that
# calls it, has waited for so far: the steps below report their CPU time beside their wall time
# (the suite's processors are busy throughout, so its CPU time is what its duration follows).
# Not through $(...): `times` in a command substitution would count the substitution's children.
cpu_now() {
  local file=$logs/.times.$BASHPID
  times >"$file"
  cpu=$(awk 'NR == 2 { for (i = 1; i <= 2; i++) { split($i, a, "m"); s += a[1] * 60 + a[2] }
                       printf "%.0f\n", s }' "$file")
  rm -f "$file"
}
# Runs CMD in a subshell and sets took="T s, C CPU-s" (only its own processes: bash reaps a
# background job's processes whenever they end, so the calling shell's count would take in the
# jobs that ended meanwhile); returns CMD's status.
# timed CMD...
timed() {
  local t0=$SECONDS rc
  (
    "$@"
    rc=$?
    cpu_now
    echo "$cpu" >"$logs/.step-cpu"
    exit $rc
  )
  rc=$?
  took="$((SECONDS - t0)) s, $(cat "$logs/.step-cpu" 2>/dev/null || echo '?') CPU-s"
  rm -f "$logs/.step-cpu"
  return $rc
}
pass() { passed=$((passed + 1)); note "PASS  $1"; }
fail() { failed=$((failed + 1)); failures+=("$1"); note "FAIL  $1${2:+ ($2)}"; }
skip() { skipped=$((skipped + 1)); note "SKIP  $1${2:+ ($2)}"; }

# Runs a step quietly into a log; on failure shows the log's tail.
# quiet NAME LOG CMD...
quiet() {
  local name=$1 log=$2
  shift 2
  if timed "$@" >"$log" 2>&1; then
    note "ok    $name ($took)"
    return 0
  fi
  tail -n 40 "$log"
  return 1
}

# Runs a doctest binary and adds its test-case counts.
# doctest_run NAME BINARY [ENV=VALUE...]
doctest_run() {
  local name=$1 binary=$2 rc
  shift 2
  timed env "$@" "$binary" -r=console --no-version >"$logs/$name.log" 2>&1
  rc=$?
  doctest_report "$name" $rc "$took"
}

# Runs a command in the background, beside the steps that follow: output to $logs/NAME.log, its
# wall and CPU time to $logs/NAME.took ("T s, C CPU-s"). beside_wait NAME waits for it and returns
# its status.
# beside NAME CMD...
declare -A beside_pids
beside() {
  local name=$1
  shift
  (
    t0=$SECONDS
    "$@" >"$logs/$name.log" 2>&1
    rc=$?
    cpu_now
    echo "$((SECONDS - t0)) s, $cpu CPU-s" >"$logs/$name.took"
    exit $rc
  ) &
  beside_pids[$name]=$!
}
beside_wait() { wait "${beside_pids[$1]}"; }
beside_took() { cat "$logs/$1.took" 2>/dev/null || echo '? s'; }

# A doctest binary beside the other tests; doctest_wait reports it.
# doctest_start NAME BINARY [ENV=VALUE...]
doctest_start() {
  local name=$1 binary=$2
  shift 2
  beside "$name" env "$@" "$binary" -r=console --no-version
}
# doctest_wait NAME
doctest_wait() {
  local name=$1 rc
  beside_wait "$name"
  rc=$?
  doctest_report "$name" $rc "$(beside_took "$name")" "beside the others"
}

# Adds the test-case counts of a finished doctest run (its log: $logs/NAME.log).
# doctest_report NAME EXIT_CODE TOOK [HOW]   (TOOK: "T s, C CPU-s")
doctest_report() {
  local name=$1 rc=$2 took=$3 how=${4:+, $4}
  local log=$logs/$name.log
  local summary
  summary=$(grep -E '^\[doctest\] test cases:' "$log" | tail -n 1)
  if [[ -z "$summary" ]]; then
    tail -n 40 "$log"
    fail "$name" "no doctest summary, exit code $rc"
    return
  fi
  # [doctest] test cases: X | Y passed | Z failed | W skipped
  local p f s
  p=$(sed -E 's/.*\| *([0-9]+) passed.*/\1/' <<<"$summary")
  f=$(sed -E 's/.*\| *([0-9]+) failed.*/\1/' <<<"$summary")
  s=$(sed -E 's/.*\| *([0-9]+) skipped.*/\1/' <<<"$summary")
  passed=$((passed + p))
  failed=$((failed + f))
  skipped=$((skipped + s))
  note "      $name: $p passed, $f failed, $s skipped ($took$how)"
  if ((f > 0)); then
    grep -E 'ERROR|FATAL' "$log" | head -n 20
    failures+=("$name: $f test case(s)")
  fi
  if ((rc != 0 && f == 0)); then
    # All test cases passed but the process failed: a sanitizer report, a leak, a crash at exit.
    grep -E 'ERROR: |runtime error|SUMMARY' "$log" | head -n 20
    fail "$name (process)" "exit code $rc after the tests, see $log"
  elif grep -q 'runtime error:' "$log"; then
    # UBSan reports and carries on (so every test case still runs); each report is a failure.
    grep -A3 'runtime error:' "$log" | head -n 20
    fail "$name (UBSan)" "$(grep -c 'runtime error:' "$log") report(s), see $log"
  elif grep -q 'WARNING: ThreadSanitizer' "$log"; then
    # Likewise ThreadSanitizer (halt_on_error=0): every data race or lock-order report fails.
    grep -A12 'WARNING: ThreadSanitizer' "$log" | head -n 40
    fail "$name (TSan)" "$(grep -c 'WARNING: ThreadSanitizer' "$log") report(s), see $log"
  fi
}

# ---------------------------------------------------------------------------------------------
note "== dependencies"
# What the release build needs first; everything else (PyTorch, clang, Docker, Prometheus, ...)
# is installed in the background while it compiles: on a fresh machine that is mostly waiting on
# the mirror's downloads, which the compiler's work fills.
quiet "install-deps build" "$logs/install-deps.log" bash scripts/install-deps.sh build ||
  fail "install-deps build"
beside install-deps-all bash scripts/install-deps.sh all

note "== build"
release_ok=0 asan_ok=0
quiet "build $release_dir" "$logs/build-release.log" bash scripts/build.sh release "$release_dir" \
  && release_ok=1 || fail "build release" "see $logs/build-release.log"
if beside_wait install-deps-all; then
  note "ok    install-deps all ($(beside_took install-deps-all), beside the build)"
else
  tail -n 40 "$logs/install-deps-all.log"
  fail "install-deps all" "see $logs/install-deps-all.log"
fi
# Where a real engine can run (root and docker.io), the container test's images
# (tests/python/test_containers.py) are built in the background from here on: they need only the
# release binary and mostly wait on the Debian mirror and the disk (debootstrap, apt-get in the
# builds); at nice 10 they take little from the builds beside them and use what the tests leave
# idle. The test then finds them in its engine's data root (build-image-cache/docker). Only with
# the default prefix (the test takes build-release's binary and build-image-cache); a failure
# there is the test's to report, when it builds them itself.
# Where no engine can run, the image emulation (scripts/check-image.py, root only) runs in the
# background instead and is reported in its place below.
engine_why=$("$python" -c 'import sys; sys.path.insert(0, "scripts"); import containers
ok, why = containers.available(); print("" if ok else why)' 2>&1)
images_in_background() {
  if [[ -z "$engine_why" ]]; then
    nice -n 10 "$python" scripts/containers.py images >"$logs/images-ahead.log" 2>&1
    echo "container test's images built ahead: exit $?" >>"$logs/images-ahead.log"
    return 0
  fi
  nice -n 10 "$python" scripts/check-image.py --bin "$release_dir/proxy/lightwire" \
    --cache "$prefix-image-cache"
}
image_started=0
# (With an engine and another prefix there is nothing to do ahead: the test builds its images.)
if ((release_ok)) && [[ $(id -u) -eq 0 ]] && [[ -n "$engine_why" || "$prefix" == build ]]; then
  beside image images_in_background
  image_started=1
  if [[ -z "$engine_why" ]]; then
    note "      (the container test's images: built in the background, pid ${beside_pids[image]})"
  else
    note "      (image emulation started in the background, pid ${beside_pids[image]}: no engine, $engine_why)"
  fi
fi
tsan_ok=0
# The sanitizer builds run in the background, one after the other at nice 10, beside the release
# build's tests below (unit tests, golden check, pytest), which keep about one of the two
# processors busy and wait on sockets, timers and PyTorch's start-up the rest of the time: the
# builds take what they leave (pytest measured 122 % of one processor over its 447 s). Each
# build's exit code and time go to $logs/build-VARIANT.{rc,took}; they are reported before the
# sanitizer tests, which wait for them.
sanitizer_builds() {
  local variant dir t0 c0
  for variant in asan tsan; do
    dir=$asan_dir
    [[ $variant == tsan ]] && dir=$tsan_dir
    t0=$SECONDS
    cpu_now && c0=$cpu
    nice -n 10 bash scripts/build.sh "$variant" "$dir" >"$logs/build-$variant.log" 2>&1
    echo $? >"$logs/build-$variant.rc"
    cpu_now
    echo "$((SECONDS - t0)) s, $((cpu - c0)) CPU-s" >"$logs/build-$variant.took"
  done
}
beside sanitizer-builds sanitizer_builds
note "      (sanitizer builds started in the background, pid ${beside_pids[sanitizer-builds]})"
# Reports a background sanitizer build: report_build VARIANT LABEL; exit 0 when it succeeded.
report_build() {
  local variant=$1 label=$2
  local rc
  rc=$(cat "$logs/build-$variant.rc" 2>/dev/null || echo '?')
  if [[ "$rc" == 0 ]]; then
    note "ok    build $label ($(cat "$logs/build-$variant.took"), in the background)"
    return 0
  fi
  tail -n 40 "$logs/build-$variant.log"
  fail "build $variant" "exit code $rc, see $logs/build-$variant.log"
  return 1
}

# Runs pytest on the Python tests (tests/python/run.sh ARGS) into LOG and adds its counts.
# pytest_run LABEL LOG ARGS...
pytest_run() {
  local label=$1 log=$2
  shift 2
  timed env LIGHTWIRE_BIN="$PWD/$release_dir/proxy/lightwire" PYTHON="$python" \
    bash tests/python/run.sh "$@" >"$log" 2>&1
  local rc=$?
  # pytest's last line: "N passed, M failed, K skipped in T s" (any subset, any order).
  local line
  line=$(grep -E '^[=]* *[0-9]+ (passed|failed|skipped|error|deselected)' "$log" | tail -n 1)
  count() { grep -oE "[0-9]+ $1" <<<"$line" | grep -oE '[0-9]+' || echo 0; }
  # An expected failure (xfail: a known gap, named in its reason) counts as skipped, not passed.
  local p f s
  p=$(( $(count passed) + $(count xpassed) )) f=$(( $(count failed) + $(count error) ))
  s=$(( $(count skipped) + $(count xfailed) ))
  passed=$((passed + p)) failed=$((failed + f)) skipped=$((skipped + s))
  note "      $label: $p passed, $f failed, $s skipped ($took)"
  if ((f > 0)); then
    grep -E '^(FAILED|ERROR)' "$log" | head -n 20
    failures+=("$label: $f test(s), see $log")
  elif ((rc != 0)) || [[ -z "$line" ]]; then
    tail -n 30 "$log"
    fail "$label" "exit code $rc, see $log"
  fi
}

note "== unit tests (release)"
if ((release_ok)); then
  doctest_run kernels-release "$release_dir/tests/kernels_tests"
  if [[ -x "$release_dir/tests/kernels_cuda_tests" ]]; then
    # The GPU tests: the CUDA kernels, and the step engine's GPU path (proxy_cuda_tests). Without
    # a GPU each exits 77 and counts as one skipped, never as passed.
    for cuda_test in kernels_cuda proxy_cuda; do
      name=${cuda_test/_/-}
      binary=$release_dir/tests/${cuda_test}_tests
      if [[ ! -x "$binary" ]]; then
        fail "$name" "$binary was not built"
        continue
      fi
      "$binary" >"$logs/$name.log" 2>&1
      rc=$?
      if ((rc == 77)); then
        skip "$name" "$(head -n 1 "$logs/$name.log")"
      else
        doctest_run "$name" "$binary"
      fi
    done
  else
    note "      (CUDA kernels not built in $release_dir: no CUDA toolkit)"
  fi
  doctest_run proxy-release "$release_dir/tests/proxy_tests"
  doctest_run exchange-release "$release_dir/tests/exchange_tests"
fi

note "== golden payloads (independent reference implementation)"
golden=tests/reference/make_golden.py
if [[ ! -f "$golden" ]]; then
  fail "golden check" "$golden is missing"
elif "$python" "$golden" --check >"$logs/golden.log" 2>&1; then
  pass "golden check ($(tail -n 1 "$logs/golden.log"))"
else
  tail -n 40 "$logs/golden.log"
  fail "golden check" "see $logs/golden.log"
fi

note "== Prometheus configuration and alert rules (promtool)"
if bash scripts/check-prometheus.sh >"$logs/promtool.log" 2>&1; then
  pass "promtool check config, check rules, test rules (docker/prometheus)"
else
  tail -n 40 "$logs/promtool.log"
  fail "promtool" "see $logs/promtool.log"
fi

note "== formatting (.clang-format)"
mapfile -t sources < <(git ls-files '*.h' '*.cc' '*.cu' 2>/dev/null)
if ((${#sources[@]} == 0)); then
  skip "clang-format" "not a git checkout"
elif clang-format --dry-run --Werror "${sources[@]}" >"$logs/format.log" 2>&1; then
  pass "clang-format: ${#sources[@]} files formatted"
else
  grep -E '^[^ ].*(warning|error):' "$logs/format.log" | cut -d: -f1 | sort -u | head -n 20
  fail "clang-format" "run: clang-format -i \$(git ls-files '*.h' '*.cc' '*.cu')"
fi

note "== lightwire smoke"
if ((release_ok)); then
  lw=$release_dir/proxy/lightwire
  version=$("$lw" --version 2>&1)
  expected=$(sed -nE "s/^ *version: *'([^']+)'.*/\1/p" meson.build | head -n 1)
  if [[ "$version" == "lightwire $expected" ]]; then
    pass "lightwire --version ($version)"
  else
    fail "lightwire --version" "printed '$version', expected 'lightwire $expected'"
  fi

  if "$lw" bench codec --codec topk --density 0.01 --elements 100000 --json \
      >"$logs/bench-smoke.json" 2>"$logs/bench-smoke.err" &&
    /usr/bin/python3 - "$logs/bench-smoke.json" >"$logs/bench-smoke.check" 2>&1 <<'PY'; then
import json, sys
lines = [l for l in open(sys.argv[1]).read().splitlines() if l.strip()]
assert len(lines) == 1, f"expected one JSON line, got {len(lines)}"
o = json.loads(lines[0])
required = ["codec", "params", "elements", "threads", "raw_bytes", "wire_bytes", "compress_gbps",
            "decompress_gbps", "memcpy_gbps", "nth_element_gbps", "ratio", "compress_vs_memcpy"]
missing = [k for k in required if k not in o]
assert not missing, f"missing keys {missing}"
assert o["codec"] == "topk" and o["elements"] == 100000 and o["raw_bytes"] == 400000, o
assert isinstance(o["params"], dict) and abs(o["params"]["density"] - 0.01) < 1e-12, o["params"]
assert 0 < o["wire_bytes"] < o["raw_bytes"], o
for k in ["compress_gbps", "decompress_gbps", "memcpy_gbps", "nth_element_gbps"]:
    assert o[k] > 0, (k, o[k])
print("ok")
PY
    pass "lightwire bench codec --codec topk --json"
  else
    cat "$logs/bench-smoke.err" "$logs/bench-smoke.check" 2>/dev/null | tail -n 20
    fail "lightwire bench codec --codec topk --json" "see $logs/bench-smoke.*"
  fi

  "$lw" bench codec --codec no-such-codec --elements 10 >"$logs/bench-bad.log" 2>&1
  rc=$?
  if ((rc == 2)) && grep -q "no-such-codec" "$logs/bench-bad.log"; then
    pass "lightwire bench codec: an unknown codec is a usage error (exit 2)"
  else
    fail "lightwire bench codec: unknown codec" "exit code $rc, see $logs/bench-bad.log"
  fi
fi

# The container test waits for the background images (it starts an engine on the data root their
# builds use): it runs after the others, on its own.
note "== Python client and DDP hook (pytest, real sidecar, real PyTorch; the container test after)"
if ((release_ok)); then
  pytest_run pytest "$logs/python.log" --durations=20 --ignore=tests/python/test_containers.py
fi

# The container test runs while the sanitizer builds finish: most of its time is the engine's
# start, the compose stack's start and its trainers' paced steps (at least 32 s), waits that
# leave the processors to the builds; at nice 0 it comes first when it does compute. The
# background images are done (their engine stopped) before it starts its own engine.
image_ok=0
if ((image_started)); then
  beside_wait image && image_ok=1
  if [[ -z "$engine_why" ]]; then
    note "      (the container test's images: $(beside_took image) in the background; $(tail -n 1 "$logs/images-ahead.log" 2>/dev/null))"
  else
    note "      (image emulation: $(beside_took image) in the background)"
  fi
fi
note "== the images and the compose stack on a real Docker engine (pytest)"
if ((release_ok)); then
  pytest_run "pytest (containers)" "$logs/python-containers.log" tests/python/test_containers.py
fi

# Only where no engine can run: the real engine's test above covers what the emulation checks.
if [[ -n "$engine_why" ]]; then
  note "== the sidecar and trainer images, emulated (docker/Dockerfile on a debootstrapped Debian 12)"
  if [[ $(id -u) -ne 0 ]]; then
    skip "image emulation" "needs root (debootstrap, chroot): sudo $python scripts/check-image.py"
  elif ((!image_started)); then
    fail "image emulation" "no $release_dir/proxy/lightwire"
  elif ((image_ok)); then
    pass "image emulation: sidecar and trainer stages, health check, a compose node's training (in the background)"
  else
    grep '^check-image' "$logs/image.log" | tail -n 20
    fail "image emulation" "see $logs/image.log"
  fi
fi

note "== sanitizer builds (in the background since the release build)"
t0=$SECONDS
beside_wait sanitizer-builds
note "      (waited $((SECONDS - t0)) s for them)"
report_build asan "$asan_dir" && asan_ok=1
report_build tsan "$tsan_dir (exchange tests)" && tsan_ok=1

note "== unit tests (sanitizers)"
# The codec tests under ASan keep one processor busy for about 80 s; the others mostly wait on
# sockets and timers (the exchange tests use a quarter to three quarters of one), so they run
# beside it.
if ((asan_ok)); then
  doctest_start kernels-asan "$asan_dir/tests/kernels_tests" \
    ASAN_OPTIONS=detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1 \
    UBSAN_OPTIONS=print_stacktrace=1
  doctest_run proxy-asan "$asan_dir/tests/proxy_tests" \
    ASAN_OPTIONS=detect_leaks=1:strict_string_checks=1 UBSAN_OPTIONS=print_stacktrace=1
  doctest_run exchange-asan "$asan_dir/tests/exchange_tests" \
    ASAN_OPTIONS=detect_leaks=1:strict_string_checks=1 UBSAN_OPTIONS=print_stacktrace=1
fi
if ((tsan_ok)); then
  # The peer transports, collectives and mailboxes (several threads per rank, real sockets).
  doctest_run exchange-tsan "$tsan_dir/tests/exchange_tests" \
    TSAN_OPTIONS=halt_on_error=0:second_deadlock_stack=1:history_size=4
fi
if ((asan_ok)); then
  doctest_wait kernels-asan
fi

note "== lightwire smoke (ASan)"
if ((asan_ok)); then
  # Every codec (the representative list) through compress and decompress, under ASan+UBSan.
  if ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    "$asan_dir/proxy/lightwire" bench codec --all --elements 70001 --chunk-elements 16384 --json \
    >"$logs/bench-asan.json" 2>"$logs/bench-asan.err" &&
    "$python" -c '
import json, sys
names = {json.loads(l)["codec"] for l in open(sys.argv[1]) if l.strip()}
want = {"none", "fp16", "bf16", "topk", "randomk", "threshold", "dgc", "qsgd", "terngrad",
        "signsgd", "onebit", "powersgd"}
sys.exit(0 if names == want else f"codecs measured {sorted(names)}, want {sorted(want)}")
' "$logs/bench-asan.json" && ! grep -q 'runtime error:' "$logs/bench-asan.err"; then
    pass "asan: lightwire bench codec --all (every codec)"
  else
    grep -E 'ERROR|runtime error|lightwire:' "$logs/bench-asan.err" | head -n 20
    fail "asan: lightwire bench codec --all" "see $logs/bench-asan.*"
  fi
fi

# The soak runs for a fixed time, as does the fuzzing: it runs beside the fuzzing, and nothing
# else. Under the shared processors each does fewer steps or executions in its time; the soak's
# verdict (errors, RSS and descriptor growth, progress) does not depend on its rate, but its RSS
# is judged at a steady load: when the work beside it ends, its sidecars speed up and their
# buffer pools may keep one more buffer for the faster pace (a 2 MiB step of 94 MiB was seen
# when the checks beside it ended mid-judgement), so the warm-up outlasts the fuzzing.
soak_started=0
if ((release_ok)); then
  # A warm-up of at least 60 s: the first checkpoint and full-sync leave their memory for good
  # early on (docs/RELIABILITY.md "Soak"); and longer than the fuzzing beside it (its targets run
  # nproc at a time, LW_FUZZ_SECONDS each), plus 15 s. Judged over the 60 s after it.
  fuzz_targets=0
  if ((asan_ok)); then
    fuzz_targets=$("$asan_dir/tests/fuzz/fuzz_corpus" list 2>/dev/null | wc -w)
  fi
  fuzz_rounds=$(( (fuzz_targets + $(nproc) - 1) / $(nproc) ))
  soak_warmup=$(( fuzz_rounds * ${LW_FUZZ_SECONDS:-10} + 15 ))
  ((soak_warmup < 60)) && soak_warmup=60
  beside soak "$python" bench/soak/soak.py --duration $((soak_warmup + 60)) \
    --warmup "$soak_warmup" --bin "$release_dir/proxy/lightwire" --json "$logs/soak.json"
  soak_started=1
  note "      (soak started in the background, pid ${beside_pids[soak]}; warm-up $soak_warmup s)"
fi

note "== fuzzing (libFuzzer, ASan+UBSan, every target ${LW_FUZZ_SECONDS:-10} s)"
if ((asan_ok)); then
  timed bash scripts/fuzz.sh "${LW_FUZZ_SECONDS:-10}" "$asan_dir" >"$logs/fuzz.log" 2>&1
  rc=$?
  # One line per target: "<target> <runs> ... <result>", result "ok" or "FAILED ...".
  # A failed target's statistics may be missing: its line is recognised by "FAILED".
  mapfile -t fuzz_lines < <(awk 'NR > 1 && $1 ~ /^[a-z_]+$/ && (/ ok$/ || /FAILED/)' \
    "$logs/fuzz.log")
  fuzz_failed=0
  for line in "${fuzz_lines[@]}"; do
    read -r target runs _ cov _ <<<"$line"
    if [[ "$line" == *" ok" ]]; then
      pass "fuzz $target ($runs runs, cov $cov)"
    else
      fuzz_failed=$((fuzz_failed + 1))
      fail "fuzz $target" "FAILED${line#*FAILED}"
    fi
  done
  if ((${#fuzz_lines[@]} == 0)); then
    tail -n 30 "$logs/fuzz.log"
    fail "fuzz" "no target ran (exit code $rc), see $logs/fuzz.log"
  elif ((rc != 0 && fuzz_failed == 0)); then
    fail "fuzz" "exit code $rc, see $logs/fuzz.log"
  fi
  note "      ($took)"
fi

note "== soak (3 sidecars x 2 trainers at full rate, beside the fuzzing; judged over 60 s)"
if ((soak_started)); then
  if beside_wait soak; then
    pass "soak $((soak_warmup + 60)) s: $(grep -E '^VERDICT:' "$logs/soak.log" | tail -n 1) ($(beside_took soak))"
  else
    tail -n 25 "$logs/soak.log"
    fail "soak $((soak_warmup + 60)) s" "see $logs/soak.log"
  fi
fi

cpu_now
note "== $((SECONDS - start)) s, $cpu CPU-s (every process the steps waited for)"
for f in "${failures[@]}"; do note "failed: $f"; done
summary="$passed passed, $failed failed"
((skipped > 0)) && summary+=", $skipped skipped"
echo "$summary"
((failed == 0))
