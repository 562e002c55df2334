#!/usr/bin/env bash
# Runs every libFuzzer target of tests/fuzz (tests/fuzz/README.md) for a while, side by side.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET (10)] [BUILD_DIR (build-asan)]
#
# Builds the ASan+UBSan variant with the fuzz targets if needed (scripts/build.sh asan; a build
# directory configured without -Dfuzz=true gets it), then runs each target on a scratch copy of its
# committed corpus (BUILD_DIR/fuzz/<target>/corpus: tests/fuzz/corpus is never written), with
# -rss_limit_mb=2048 (also the largest single allocation), -timeout=10 and the target's -max_len,
# and UBSan reports made fatal. Prints one line per target: executions, exec/s, final coverage
# (libFuzzer's cov: and ft:), corpus units before and after, new units, peak RSS. Exits non-zero
# when any target crashed, leaked, timed out or ran out of memory; its input (crash-*, leak-*,
# timeout-*, oom-*) and log stay in BUILD_DIR/fuzz/<target>/, and the line says where.
# Reproduce one: BUILD_DIR/tests/fuzz/fuzz_<target> BUILD_DIR/fuzz/<target>/crash-<sha1>.
# LW_FUZZ_TARGETS="payload http" runs only those; LW_FUZZ_ARGS adds libFuzzer flags; LW_FUZZ_JOBS
# how many run at once (default: the processors, nproc).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

seconds=${1:-10}
dir=${2:-${LW_BUILD_PREFIX:-build}-asan}
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || ((seconds == 0)); then
  echo "usage: $0 [SECONDS_PER_TARGET] [BUILD_DIR]" >&2
  exit 2
fi

# Largest input per target (bytes): room for the seeds and some growth, no more (larger inputs
# only make every execution slower).
declare -A max_len=(
  [payload]=65536 [frame]=65536 [stats]=16384 [job_state]=16384 [http]=65536
  [config_yaml]=16384 [config_json]=8192 [checkpoint]=65536
)

if ! bash scripts/build.sh asan "$dir" >"${TMPDIR:-/tmp}/lightwire-fuzz-build.$$.log" 2>&1; then
  tail -n 40 "${TMPDIR:-/tmp}/lightwire-fuzz-build.$$.log"
  rm -f "${TMPDIR:-/tmp}/lightwire-fuzz-build.$$.log"
  echo "fuzz.sh: building $dir failed" >&2
  exit 1
fi
rm -f "${TMPDIR:-/tmp}/lightwire-fuzz-build.$$.log"
if [[ ! -x "$dir/tests/fuzz/fuzz_corpus" ]]; then
  echo "fuzz.sh: $dir has no fuzz targets: configure it with -Dfuzz=true (clang)" >&2
  exit 1
fi

targets=${LW_FUZZ_TARGETS:-$("$dir/tests/fuzz/fuzz_corpus" list)}
results=$dir/fuzz
failed=0
# UBSan is built to recover (scripts/test.sh counts its reports); a fuzzer must stop at the first.
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}

# One target: its line (and, when it failed, the first lines of its report) into $out/line.
run_target() {
  local t=$1 out=$results/$1
  rm -rf "$out" && mkdir -p "$out/corpus"
  cp tests/fuzz/corpus/"$t"/* "$out/corpus/" 2>/dev/null
  local before after rc last artifacts result
  before=$(find "$out/corpus" -type f | wc -l)
  local dict=()
  [[ -f tests/fuzz/$t.dict ]] && dict=(-dict=tests/fuzz/"$t".dict)
  # shellcheck disable=SC2086  # LW_FUZZ_ARGS: flags, split on purpose
  "$dir/tests/fuzz/fuzz_$t" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 \
    -max_len="${max_len[$t]:-65536}" -print_final_stats=1 -artifact_prefix="$out/" "${dict[@]}" \
    ${LW_FUZZ_ARGS:-} "$out/corpus" >"$out/log" 2>&1
  rc=$?
  stat() { sed -nE "s/^stat::$1: *([0-9]+).*/\1/p" "$out/log" | tail -n 1; }
  last=$(grep -E '^#[0-9]+' "$out/log" | grep 'cov:' | tail -n 1)
  field() { sed -nE "s/.* $1: ([0-9]+).*/\1/p" <<<"$last"; }
  after=$(find "$out/corpus" -type f | wc -l)
  artifacts=$(find "$out" -maxdepth 1 -type f \( -name 'crash-*' -o -name 'leak-*' -o \
    -name 'timeout-*' -o -name 'oom-*' \) | sort | tr '\n' ' ')
  if ((rc != 0)) || [[ -n "$artifacts" ]]; then
    result="FAILED (exit $rc): ${artifacts:-no input saved} log $out/log"
  else
    result=ok
  fi
  {
    printf '%-12s %10s %8s %6s %7s %9s %5s %6sM  %s\n' "$t" "$(stat number_of_executed_units)" \
      "$(stat average_exec_per_sec)" "$(field cov)" "$(field ft)" "$before->$after" \
      "$(stat new_units_added)" "$(stat peak_rss_mb)" "$result"
    if [[ "$result" != ok ]]; then
      grep -E 'ERROR: |runtime error|fuzz invariant broken|SUMMARY' "$out/log" | head -n 5 |
        sed 's/^/    /'
    fi
  } >"$out/line"
}

# Targets run side by side, as many at once as there are processors (LW_FUZZ_JOBS): each still
# gets its SECONDS of run time on a processor of its own; the lines come out in target order.
jobs=${LW_FUZZ_JOBS:-$(nproc)}
running=0
for t in $targets; do
  run_target "$t" &
  running=$((running + 1))
  if ((running >= jobs)); then
    wait -n
    running=$((running - 1))
  fi
done
wait

printf '%-12s %10s %8s %6s %7s %9s %5s %7s  %s\n' target runs exec/s cov ft corpus new rss result
for t in $targets; do
  if [[ -f $results/$t/line ]]; then
    cat "$results/$t/line"
    grep -q ' ok$' "$results/$t/line" || failed=$((failed + 1))
  else
    echo "$t (no result) FAILED: the target's run left no line"
    failed=$((failed + 1))
  fi
done
((failed == 0)) || echo "fuzz.sh: $failed target(s) failed; inputs and logs under $results/" >&2
((failed == 0))
