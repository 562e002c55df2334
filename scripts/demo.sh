#!/usr/bin/env bash
# The main job: installs the dependencies, builds the release variant, starts 4 lightwire
# sidecars on loopback (world size 4: one per "node", exchanging over TCP; codec dgc at density
# 0.01 by default) and 4 real PyTorch DDP trainer processes, each talking to its own sidecar
# (clients/python/examples/train_ddp.py). Rank 0 prints a live table (step, loss, accuracy,
# compression ratio, bytes sent per step, step time); then the same training runs as plain DDP
# and the two are compared. Knobs: LW_DEMO_CODEC (dgc), LW_DEMO_DENSITY (0.01), LW_DEMO_MOMENTUM
# (0.9, for dgc), LW_DEMO_STEPS (300), LW_DEMO_NODES (4). The codec benchmark table:
# `build-release/proxy/lightwire bench codec --all ...` (bench/README.md).
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
# One BLAS thread per trainer process (the trainers set torch.set_num_threads(1), which Debian's
# torch does not pass on to OpenBLAS): four trainers share the cores.
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
codec=${LW_DEMO_CODEC:-dgc}
nodes=${LW_DEMO_NODES:-4}
codec_args=(--codec "$codec")
# Policies (docs/policies.md): the DGC warm-up, and a full-sync every 100 steps.
read -r -a policy_args <<<"${LW_DEMO_POLICY_ARGS:---warmup-steps 50 --full-sync-every 100}"
codec_args+=("${policy_args[@]}")
[[ "$codec" == dgc || "$codec" == topk || "$codec" == randomk ]] &&
  codec_args+=(--density "${LW_DEMO_DENSITY:-0.01}")
# DGC's momentum correction; the trainers' lightwire.torch.SGD leaves momentum to the sidecars for
# the tensors they compress with it (docs/codecs.md "Momentum with dgc").
[[ "$codec" == dgc ]] && codec_args+=(--momentum "${LW_DEMO_MOMENTUM:-0.9}")
# Free loopback ports for the peer listeners (chosen by the OS, then handed to the sidecars).
mapfile -t ports < <("$python" - "$nodes" <<'PY'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print("\n".join(str(s.getsockname()[1]) for s in socks))
PY
)
peers=$(printf '127.0.0.1:%s,' "${ports[@]}")
peers=${peers%,}
export LIGHTWIRE_PEER__SECRET="demo-$(od -An -N8 -tx8 /dev/urandom | tr -d ' ')"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
sockets=()
for ((r = 0; r < nodes; r++)); do
  sock=$work/node$r.sock
  sockets+=("$sock")
  "$dir/proxy/lightwire" serve --job-id demo --rank "$r" --world-size "$nodes" --peers "$peers" \
    --peer-listen "127.0.0.1:${ports[$r]}" --socket "$sock" --control-tcp "" \
    --admin-listen 127.0.0.1:0 --threads 1 --state-dir "$work/state$r" "${codec_args[@]}" \
    2>"$work/node$r.log" &
  pids+=($!)
done
ready=0
for _ in $(seq 200); do
  ready=0
  for s in "${sockets[@]}"; do
    [[ -S "$s" ]] && curl -sf --unix-socket "$s" http://localhost/readyz >/dev/null 2>&1 &&
      ready=$((ready + 1))
  done
  ((ready == nodes)) && break
  sleep 0.1
done
if ((ready != nodes)); then
  tail -n 5 "$work"/node*.log >&2
  echo "demo: the sidecars did not all become ready" >&2
  exit 1
fi
echo "demo: $nodes sidecars ready (world size $nodes, codec $codec, peers $peers)" >&2
echo "demo: $nodes PyTorch trainers (DDP, gloo, CPU), each through its own sidecar" >&2
PYTHONPATH=clients/python "$python" clients/python/examples/train_ddp.py \
  --sockets "$(IFS=,; echo "${sockets[*]}")" --trainers "$nodes" \
  --steps "${LW_DEMO_STEPS:-300}" --compare
echo "demo: rank 0 sidecar figures:" >&2
curl -s --unix-socket "${sockets[0]}" http://localhost/metrics 2>/dev/null |
  grep -E '^lightwire_(steps_total|raw_bytes_total|wire_bytes_total|fallbacks_total|compression_ratio|peer_rtt|anomalies_total|full_syncs_total|rollbacks_total|bypass_active|cosine_similarity|residual_norm|checkpoints_total)' >&2 || true
echo "demo: rank 0 decision log (the same on every rank; /v1/status policies.log):" >&2
curl -s --unix-socket "${sockets[0]}" http://localhost/v1/status 2>/dev/null |
  "$python" -c 'import json, sys
log = json.load(sys.stdin).get("policies", {}).get("log", [])
for e in log[-12:]:
    print("  step %(step)5d  %(tensor)-10s %(kind)-10s %(detail)s" % e)
if len(log) > 12:
    print("  (%d earlier entries)" % (len(log) - 12))' >&2 || true
