#!/usr/bin/env bash
# Checks the Prometheus configuration and alert rules under docker/prometheus/ with promtool
# (Debian's `prometheus` package, scripts/install-deps.sh): the config (and the rule files it
# loads), the rules, and their unit tests (alerts_test.yml). Quiet on success; on failure prints
# what promtool said and exits non-zero. PROMTOOL overrides the promtool binary.
set -uo pipefail
cd "$(dirname "$0")/.."

promtool=${PROMTOOL:-promtool}
if ! command -v "$promtool" >/dev/null 2>&1; then
  echo "check-prometheus: $promtool not found (install Debian's prometheus package: scripts/install-deps.sh)" >&2
  exit 1
fi

dir=docker/prometheus
status=0
run() {
  local out
  if ! out=$("$promtool" "$@" 2>&1); then
    echo "check-prometheus: promtool $* failed:" >&2
    echo "$out" >&2
    status=1
  fi
}
run check config "$dir/prometheus.yml"
run check rules "$dir/alerts.yml"
# promtool resolves rule_files relative to the test file.
run test rules "$dir/alerts_test.yml"
exit $status
