#!/usr/bin/env bash
# The main job: installs the dependencies, builds the release variant, starts a lightwire sidecar
# (codec dgc at density 0.01 by default, two local trainers) and a real PyTorch DDP training run
# of two trainer processes whose gradients go through it (clients/python/examples/train_ddp.py),
# printing loss, accuracy, compression ratio and bytes every 25 steps; then stops the sidecar.
# Knobs: LW_DEMO_CODEC (dgc), LW_DEMO_DENSITY (0.01), LW_DEMO_STEPS (300), LW_DEMO_TRAINERS (2).
# The codec benchmark table is `build-release/proxy/lightwire bench codec --all ...`
# (bench/README.md). Multi-node comes with the peer-exchange issue.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/install-deps.sh
dir=${LW_BUILD_PREFIX:-build}-release
python=${PYTHON:-/usr/bin/python3}
echo "demo: building $dir ..." >&2
build_log=$(mktemp)
if ! bash scripts/build.sh release "$dir" >"$build_log" 2>&1; then
  cat "$build_log" >&2
  rm -f "$build_log"
  exit 1
fi
rm -f "$build_log"

work=$(mktemp -d)
sock=$work/lightwire.sock
codec=${LW_DEMO_CODEC:-dgc}
trainers=${LW_DEMO_TRAINERS:-2}
args=(--socket "$sock" --control-tcp "" --admin-listen 127.0.0.1:0 --codec "$codec"
      --local-trainers "$trainers")
[[ "$codec" == dgc || "$codec" == topk || "$codec" == randomk ]] &&
  args+=(--density "${LW_DEMO_DENSITY:-0.01}")
"$dir/proxy/lightwire" serve "${args[@]}" 2>"$work/sidecar.log" &
sidecar=$!
cleanup() {
  kill -TERM "$sidecar" 2>/dev/null && wait "$sidecar" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
for _ in $(seq 100); do [[ -S "$sock" ]] && break; sleep 0.1; done
if [[ ! -S "$sock" ]]; then
  cat "$work/sidecar.log" >&2
  echo "demo: the sidecar did not start" >&2
  exit 1
fi
sed 's/^/sidecar: /' "$work/sidecar.log" >&2
echo "demo: $trainers PyTorch trainers (DDP, gloo, CPU) through the sidecar, codec $codec" >&2
PYTHONPATH=clients/python "$python" clients/python/examples/train_ddp.py --socket "$sock" \
  --trainers "$trainers" --steps "${LW_DEMO_STEPS:-300}"
echo "demo: sidecar figures:" >&2
curl -s --unix-socket "$sock" http://localhost/metrics 2>/dev/null |
  grep -E '^lightwire_(steps_total|raw_bytes_total|fallbacks_total|compression_ratio)' >&2 || true
