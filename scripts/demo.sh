#!/usr/bin/env bash
# The main job: installs the dependencies, builds the release variant, starts 4 lightwire
# sidecars (world size 4: one per "node", exchanging over TCP; codec dgc at density 0.01 by
# default) and 4 real PyTorch DDP trainer processes, each talking to its own sidecar
# (clients/python/examples/train_ddp.py).
#
# As root, the nodes share a rate-limited link, as on a cluster whose network is the bottleneck:
# everything runs in a network namespace of its own whose loopback is limited to LW_DEMO_RATE
# (1gbit; tc tbf, as bench/e2e). Plain DDP trains first (LW_DEMO_STEPS, 150, a 1.1 M-parameter
# MLP: 4.4 MB of gradient a step); then lightwire trains until its loss reaches DDP's final loss,
# and the summary says how much sooner it got there and how many bytes per step each sent.
# LW_DEMO_RATE=unlimited, or not root: the loopback as it is, where compression cannot pay (the
# link is not limited, the demo says so): the small 85 k-parameter MLP, lightwire first (rank 0
# prints a live table: step, loss, accuracy, compression ratio, bytes sent per step, step time),
# then the same training as plain DDP, compared (LW_DEMO_STEPS 300).
# Knobs: LW_DEMO_RATE (1gbit), LW_DEMO_CODEC (dgc), LW_DEMO_DENSITY (0.01), LW_DEMO_MOMENTUM (0.9,
# for dgc), LW_DEMO_STEPS, LW_DEMO_HIDDEN (the MLP's width: 1024 limited, 256 otherwise),
# LW_DEMO_NODES (4). The codec benchmark table: `build-release/proxy/lightwire bench codec --all
# ...` (bench/README.md).
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
# The limited link: a network namespace of our own (root only), its loopback shaped by tbf.
rate=${LW_DEMO_RATE:-1gbit}
netns=""
in_ns=()
if [[ "$rate" != unlimited ]]; then
  if [[ ! "$rate" =~ ^[0-9]+(\.[0-9]+)?[kmgt]?bit$ ]]; then
    echo "demo: LW_DEMO_RATE: NUMBER[k|m|g|t]bit (e.g. 1gbit) or unlimited, not '$rate'" >&2
    exit 2
  fi
  if [[ $(id -u) -eq 0 ]] && command -v tc >/dev/null && ip netns add "lightwire-demo-$$" 2>/dev/null; then
    netns=lightwire-demo-$$
    in_ns=(ip netns exec "$netns")
    ip -n "$netns" link set lo up
    # As bench/netns_exchange.sh: burst 2 ms of the rate, at least 256 KiB; latency 100 ms.
    burst=$("$python" -c 'import re, sys
m = re.fullmatch(r"([0-9.]+)([kmgt]?)bit", sys.argv[1])
bps = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)] / 8
print(max(int(bps * 0.002), 262144))' "$rate")
    "${in_ns[@]}" tc qdisc replace dev lo root tbf rate "$rate" burst "$burst" latency 100ms
  else
    echo "demo: the link is NOT limited (limiting it needs root, tc and network namespaces):" \
      "compression cannot pay on an unlimited loopback; see bench/README.md for limited links" >&2
    rate=unlimited
  fi
else
  echo "demo: the link is not limited (LW_DEMO_RATE=unlimited): compression cannot pay here" >&2
fi
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
  if [[ -n "$netns" ]]; then
    for p in $(ip netns pids "$netns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null || true; done
    ip netns del "$netns" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
sockets=()
for ((r = 0; r < nodes; r++)); do
  sock=$work/node$r.sock
  sockets+=("$sock")
  "${in_ns[@]}" "$dir/proxy/lightwire" serve --job-id demo --rank "$r" --world-size "$nodes" --peers "$peers" \
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
if [[ -n "$netns" ]]; then
  echo "demo: the $nodes nodes share one link of $rate (network namespace $netns, tc tbf on its" \
    "loopback)" >&2
  echo "demo: $nodes PyTorch trainers (DDP, gloo, CPU): plain DDP first, then each through its" \
    "own sidecar until lightwire reaches DDP's final loss" >&2
  GLOO_SOCKET_IFNAME=lo PYTHONPATH=clients/python "${in_ns[@]}" "$python" \
    clients/python/examples/train_ddp.py --sockets "$(IFS=,; echo "${sockets[*]}")" \
    --trainers "$nodes" --hidden "${LW_DEMO_HIDDEN:-1024}" --steps "${LW_DEMO_STEPS:-150}" \
    --to-baseline-loss
else
  echo "demo: $nodes PyTorch trainers (DDP, gloo, CPU), each through its own sidecar" >&2
  PYTHONPATH=clients/python "$python" clients/python/examples/train_ddp.py \
    --sockets "$(IFS=,; echo "${sockets[*]}")" --trainers "$nodes" \
    --hidden "${LW_DEMO_HIDDEN:-256}" --steps "${LW_DEMO_STEPS:-300}" --compare
fi
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
