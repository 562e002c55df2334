#!/usr/bin/env bash
# The main job, for now: installs the dependencies, builds the release variant and prints the
# codec benchmark table (`lightwire bench codec --all`) on a 25M-element fp32 tensor (100 MB).
# Extra arguments go to the benchmark, e.g. `bash scripts/demo.sh --threads 2` or `--json`.
# Later issues replace this with the multi-node sidecar demo. Method: bench/README.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/install-deps.sh
dir=${LW_BUILD_PREFIX:-build}-release
echo "demo: building $dir ..." >&2
build_log=$(mktemp)
if ! bash scripts/build.sh release "$dir" >"$build_log" 2>&1; then
  cat "$build_log" >&2
  rm -f "$build_log"
  exit 1
fi
rm -f "$build_log"

echo "demo: $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p' | head -n 1)" >&2
exec "$dir/proxy/lightwire" bench codec --all --elements "${LW_DEMO_ELEMENTS:-25000000}" "$@"
