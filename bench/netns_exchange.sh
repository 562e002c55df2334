#!/usr/bin/env bash
# The exchange benchmarks (bench/README.md) on a rate-limited link: a fresh network namespace
# whose `lo` is shaped with `tc qdisc ... tbf`, so every flow between the ranks shares one link of
# the given rate. In the same run, inside the namespace:
#   1. a link check: one TCP bulk transfer, to show the qdisc really limits;
#   2. bench/exchange_vs_gloo.py, dense: torch.distributed gloo allreduce and
#      `lightwire bench exchange --codec none`;
#   3. `lightwire bench exchange --codec dgc --density 0.01` (the ring's sparse allgather);
#   4. with --sparse-allreduce, the same through the sparse allreduce (`--sparse allreduce`).
# Then it prints, against the ring bound of the link (2(W-1)·4N bytes / rate per step), measured /
# bound for gloo and dense lightwire, and gloo's seconds per step / dgc's. Figures only; it never
# passes or fails on time. Method and figures: bench/README.md. Needs root (CAP_NET_ADMIN).
#
#   bench/netns_exchange.sh [--rate 1gbit] [--world-size 4] [--elements 25000000] [--steps 3]
#                           [--quick] [--sparse-allreduce] [--json]
#
#   --rate R      tc rate: NUMBER followed by bit, kbit, mbit, gbit, tbit (bits/s, powers of 1000)
#                 or bps, kbps, mbps, gbps, tbps (bytes/s); "unlimited": no qdisc (for comparison)
#   --quick       4000000 elements (unless --elements is given)
#   --sparse-allreduce  also dgc through the sparse allreduce (peer.sparse), and its step against
#                 the allgather's
#   --json        also print one JSON object with every figure (last line of stdout)
#
# $LIGHTWIRE_BIN: the executable (default build-release/proxy/lightwire); $PYTHON: the interpreter
# with torch (default /usr/bin/python3). Progress goes to stderr, the summary to stdout.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "netns_exchange: $*" >&2; exit 2; }
log() { echo "netns_exchange: $*" >&2; }

rate=1gbit world=4 elements="" steps=3 quick=0 json=0 sparse_allreduce=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rate) rate="${2:?--rate needs a value}"; shift 2 ;;
    --world-size) world="${2:?--world-size needs a value}"; shift 2 ;;
    --elements) elements="${2:?--elements needs a value}"; shift 2 ;;
    --steps) steps="${2:?--steps needs a value}"; shift 2 ;;
    --quick) quick=1; shift ;;
    --sparse-allreduce) sparse_allreduce=1; shift ;;
    --json) json=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done
[[ -z "$elements" ]] && { if ((quick)); then elements=4000000; else elements=25000000; fi; }
if ! [[ "$world" =~ ^[0-9]+$ ]] || ((world < 2 || world > 64)); then die "--world-size: 2..64"; fi
if ! [[ "$elements" =~ ^[0-9]+$ ]] || ((elements < 1)); then die "--elements: a positive integer"; fi
if ! [[ "$steps" =~ ^[0-9]+$ ]] || ((steps < 1)); then die "--steps: a positive integer"; fi

# The rate in bytes per second (tc's units: k/m/g/t are powers of 1000; "bit" is bits, "bps" bytes).
if [[ "$rate" == unlimited ]]; then
  rate_Bps=0
elif [[ "$rate" =~ ^([0-9]+(\.[0-9]+)?)([kmgt]?)(bit|bps)$ ]]; then
  rate_Bps=$(awk -v n="${BASH_REMATCH[1]}" -v p="${BASH_REMATCH[3]}" -v u="${BASH_REMATCH[4]}" 'BEGIN {
    m = (p == "k") ? 1e3 : (p == "m") ? 1e6 : (p == "g") ? 1e9 : (p == "t") ? 1e12 : 1;
    printf "%.0f", n * m / (u == "bit" ? 8 : 1) }')
  ((rate_Bps > 0)) || die "--rate: must be above 0"
else
  die "--rate: NUMBER[k|m|g|t]bit, NUMBER[k|m|g|t]bps or unlimited (got '$rate')"
fi

((EUID == 0)) || die "needs root (ip netns, tc)"
if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then die "needs ip and tc (iproute2)"; fi
BIN="${LIGHTWIRE_BIN:-build-release/proxy/lightwire}"
PY="${PYTHON:-/usr/bin/python3}"
[[ -x "$BIN" ]] || die "no lightwire executable at $BIN (bash scripts/build.sh release, or set LIGHTWIRE_BIN)"
"$PY" -c 'import torch' 2>/dev/null || die "$PY cannot import torch (set PYTHON)"
here="$(cd "$(dirname "$0")" && pwd)"

NS="lightwire-bench-$$-$RANDOM"
work="$(mktemp -d /tmp/lightwire-netns-XXXXXX)"
cleanup() {
  local rc=$?
  trap - EXIT INT TERM HUP
  if ip netns list 2>/dev/null | grep -qw "^$NS"; then
    # Stop whatever still runs in our namespace (an interrupted phase), by pid, then remove it.
    # A killed `lightwire bench exchange` leaves its shared-memory segments
    # (/dev/shm/lightwire-exchange-PID-RANK) and its temporary directory (the one holding the
    # sidecars' sockets, named on their command lines): remove those of the pids killed here.
    local pids p d leftovers=()
    pids="$(ip netns pids "$NS" 2>/dev/null || true)"
    if [[ -n "$pids" ]]; then
      for p in $pids; do
        leftovers+=(/dev/shm/lightwire-exchange-"$p"-*)
        d="$(tr '\0' '\n' <"/proc/$p/cmdline" 2>/dev/null |
          grep -m1 '^/tmp/lightwire-exchange-[A-Za-z0-9]*/r[0-9]*\.sock$' || true)"
        [[ -n "$d" ]] && leftovers+=("$(dirname "$d")")
      done
      # shellcheck disable=SC2086 # $pids: one pid per word
      kill -TERM $pids 2>/dev/null || true
      sleep 1
      pids="$(ip netns pids "$NS" 2>/dev/null || true)"
      # shellcheck disable=SC2086
      if [[ -n "$pids" ]]; then kill -KILL $pids 2>/dev/null || true; fi
      rm -rf "${leftovers[@]}"
    fi
    ip netns del "$NS" && log "namespace $NS removed"
  fi
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

in_ns() { ip netns exec "$NS" "$@"; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
# Bytes and packets the qdisc of lo has sent so far, and its drops ("0 0 0" without a qdisc).
qstats() {
  in_ns tc -s qdisc show dev lo | awk '/Sent/ { b = $2; p = $4; d = $7; sub(",", "", d) }
    END { printf "%.0f %.0f %.0f\n", b, p, d }'
}

ip netns add "$NS"
in_ns ip link set lo up
if ((rate_Bps > 0)); then
  # burst: the bucket must hold at least one whole packet (lo's MTU is 64 KiB, and TSO/GSO hands
  # the qdisc up to 64 KiB skbs), and enough tokens to cover the delay of the qdisc watchdog timer
  # and of softirq scheduling on a loaded 2-core VM (about a millisecond), or the link idles while
  # tokens go to waste; so 2 ms of the rate, at least 256 KiB (2 ms at 1 Gbit/s). A burst sent at
  # full speed after an idle link is at most 256 KiB against ~600 MB per dense step (< 0.1 %).
  burst=$(awk -v r="$rate_Bps" 'BEGIN { b = r * 0.002; if (b < 262144) b = 262144; printf "%.0f", b }')
  # latency: the queue (limit = rate·latency + burst). Every drop on lo makes TCP back off, so the
  # queue holds what the flows have in flight (TCP small queues lets each socket put up to
  # tcp_limit_output_bytes, 1-4 MiB, into the qdisc; the ring has W flows, gloo more): 100 ms is
  # 12.5 MB at 1 Gbit/s. Queueing delay adds RTT but does not lower a bulk transfer's rate.
  in_ns tc qdisc add dev lo root tbf rate "$rate" burst "$burst" latency 100ms
  log "namespace $NS: lo limited to $rate ($rate_Bps bytes/s), burst $burst bytes, latency 100 ms"
else
  log "namespace $NS: lo not limited (--rate unlimited)"
fi
in_ns tc -s qdisc show dev lo | sed 's/^/  /' >&2

log "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg); binary $BIN; python $PY"
log "world size $world, $elements fp32 elements ($(awk -v n="$elements" 'BEGIN { printf "%.1f", 4 * n / 1e6 }') MB), $steps timed steps after one warm-up"

declare -A secs bytes pkts drops
phase() {  # phase NAME COMMAND...: runs it in the namespace, with the qdisc's counters around it
  local name="$1"; shift
  local t0 s0 s1
  s0=$(qstats); t0=$(now)
  log "[$name] started (load average $(cut -d' ' -f1-3 /proc/loadavg))"
  # In the background and waited for: bash runs a trap only once the foreground command is done,
  # while `wait` returns at once on a signal, so a TERM stops the phase (cleanup kills its pids).
  in_ns "$@" &
  wait $!
  secs[$name]=$(elapsed "$t0"); s1=$(qstats)
  read -r b0 p0 d0 <<<"$s0"; read -r b1 p1 d1 <<<"$s1"
  bytes[$name]=$((b1 - b0)); pkts[$name]=$((p1 - p0)); drops[$name]=$((d1 - d0))
  log "[$name] done in ${secs[$name]} s; lo qdisc sent ${bytes[$name]} bytes, ${pkts[$name]} packets, ${drops[$name]} dropped"
}

# 1. Link check: one TCP flow sending ~2 s worth of the rate (64 MB without a limit).
check_bytes=$(awk -v r="$rate_Bps" 'BEGIN { b = (r > 0) ? 2 * r : 64e6; if (b > 256e6) b = 256e6; printf "%.0f", b }')
cat >"$work/linkcheck.py" <<'EOF'
import json, socket, sys, threading, time
total = int(sys.argv[1])
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
got = [0, 0.0]
def recv():
    c, _ = srv.accept(); n = 0
    while True:
        d = c.recv(1 << 20)
        if not d: break
        n += len(d)
    got[0], got[1] = n, time.perf_counter()
t = threading.Thread(target=recv); t.start()
s = socket.create_connection(srv.getsockname()); buf = bytes(1 << 20)
t0 = time.perf_counter(); left = total
while left > 0:
    left -= s.send(buf[:min(left, len(buf))])
s.close(); t.join()
print(json.dumps({"bytes": got[0], "seconds": got[1] - t0}))
EOF
phase link-check sh -c "\"$PY\" \"$work/linkcheck.py\" $check_bytes >\"$work/linkcheck.json\""

# 2. Dense: gloo and lightwire codec none (their progress goes to stderr, their table to stdout).
# TMPDIR: exchange_vs_gloo.py's temporary directory (gloo's file store) then lies in $work, which
# cleanup removes even when the phase is killed. GLOO_SOCKET_IFNAME: the namespace has only lo.
export LIGHTWIRE_BIN="$BIN" GLOO_SOCKET_IFNAME=lo TMPDIR="$work"
phase dense "$PY" "$here/exchange_vs_gloo.py" --world-size "$world" --elements "$elements" \
  --steps "$steps" --second-codec "" --json >"$work/dense.out"
sed '$d' "$work/dense.out" | sed 's/^/  /' >&2
tail -n 1 "$work/dense.out" >"$work/dense.json"

# 3. dgc at density 0.01.
phase dgc "$BIN" bench exchange --world-size "$world" --codec dgc --density 0.01 \
  --elements "$elements" --steps "$steps" --json >"$work/dgc.json"
# 4. dgc through the sparse allreduce.
secs[dgc-allreduce]="-"
if ((sparse_allreduce)); then
  phase dgc-allreduce "$BIN" bench exchange --world-size "$world" --codec dgc --density 0.01 \
    --elements "$elements" --steps "$steps" --sparse allreduce --json >"$work/dgc-allreduce.json"
fi

in_ns tc -s qdisc show dev lo | sed 's/^/  /' >&2

# Summary (the arithmetic in Python: it is there anyway for gloo).
"$PY" - "$work" "$world" "$elements" "$steps" "$rate" "$rate_Bps" "$json" \
  "${secs[link-check]} ${bytes[link-check]} ${drops[link-check]}" \
  "${secs[dense]} ${bytes[dense]} ${drops[dense]}" \
  "${secs[dgc]} ${bytes[dgc]} ${drops[dgc]}" \
  "${secs[dgc-allreduce]} ${bytes[dgc-allreduce]:-0} ${drops[dgc-allreduce]:-0}" <<'EOF'
import json, os, sys
work, W, N, K, rate, R, want_json = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4]), sys.argv[5], float(sys.argv[6]), sys.argv[7] == "1"
ph = {}
for name, v in zip(("link-check", "dense", "dgc", "dgc-allreduce"), sys.argv[8:12]):
    s, b, d = v.split()
    if s != "-":
        ph[name] = {"seconds": float(s), "qdisc_bytes": int(b), "qdisc_drops": int(d)}
load = lambda f: json.load(open(os.path.join(work, f)))
link = load("linkcheck.json")
dense = load("dense.json")
gloo, none = dense["gloo"], dense["lightwire"][0]
dgc = load("dgc.json")
dgc_ar = load("dgc-allreduce.json") if "dgc-allreduce" in ph else None
B = 4 * N
ring_bytes = 2 * (W - 1) * B  # every rank sends 2(W-1)/W·B; all W share the one link
bound = ring_bytes / R if R else None
link_Bps = link["bytes"] / link["seconds"]

def fmt(x, spec):
    return "-" if x is None else format(x, spec)

print(f"lightwire exchange in a network namespace, lo rate {rate}"
      + (f" ({R * 8 / 1e9:.3g} Gbit/s = {R / 1e6:.1f} MB/s)" if R else "") +
      f", world size {W}, {N} fp32 elements ({B / 1e6:.1f} MB), median of {K} steps after one warm-up")
print(f"link check: one TCP flow, {link['bytes'] / 1e6:.1f} MB in {link['seconds']:.3f} s = "
      f"{link_Bps / 1e6:.1f} MB/s" + (f" ({link_Bps / R:.3f} of the rate)" if R else ""))
if bound:
    print(f"ring bound: 2(W-1)·B / rate = {ring_bytes / 1e6:.1f} MB / {R / 1e6:.1f} MB/s = {bound:.3f} s per step")
print()
hdr = f"{'':24} {'s/step':>9} {'algbw GB/s':>10} {'wire MB/rank':>12} {'link s':>8} {'/ bound':>8} {'x gloo':>7}"
print(hdr)
rows = []
table = [("gloo allreduce (dense)", gloo, None),
         ("lightwire none (dense)", none, none["wire_bytes_per_rank"]),
         ("lightwire dgc 0.01", dgc, dgc["wire_bytes_per_rank"])]
if dgc_ar:
    table.append(("dgc 0.01 allreduce", dgc_ar, dgc_ar["wire_bytes_per_rank"]))
for name, r, wire in table:
    sps = r["seconds_per_step"]
    # The link time of what this row sends: W ranks' wire bytes through one link (dense rows: the
    # ring bound; gloo's wire bytes are not reported, the ring's are assumed).
    link_s = (W * wire / R if wire is not None else bound) if R else None
    vs_bound = sps / bound if bound and "dgc" not in name else None
    x = gloo["seconds_per_step"] / sps
    rows.append({"name": name, "seconds_per_step": sps, "algbw_gbps": r["algbw_gbps"],
                 "wire_bytes_per_rank": wire, "link_seconds": link_s,
                 "measured_vs_ring_bound": vs_bound, "x_gloo": x})
    print(f"{name:24} {sps:9.4f} {r['algbw_gbps']:10.4f} "
          f"{fmt(None if wire is None else wire / 1e6, '12.2f'):>12} "
          f"{fmt(link_s, '8.3f'):>8} {fmt(vs_bound, '8.3f'):>8} {x:7.2f}")
print("link s: the link time of the row's wire bytes from all ranks (gloo: the ring bound); "
      "/ bound: s/step / ring bound; x gloo: gloo's s/step / the row's")
print()
K1 = K + 1
gloo_link = None
if R:
    for name in ("dense", "dgc", "dgc-allreduce"):
        if name not in ph:
            continue
        p = ph[name]
        print(f"phase {name}: {p['seconds']:.1f} s, lo qdisc sent {p['qdisc_bytes'] / 1e6:.1f} MB "
              f"({p['qdisc_bytes'] / K1 / 1e6:.1f} MB per step over {K1} steps incl. warm-up"
              + (", both runs" if name == "dense" else "") + f"), {p['qdisc_drops']} dropped")
    # gloo reports no wire bytes: what the dense phase put through the qdisc, less lightwire's own
    # (W ranks' wire bytes, every step), is gloo's plus TCP/IP headers, ACKs and set-up.
    gloo_link = (ph["dense"]["qdisc_bytes"] - W * none["wire_bytes_per_rank"] * K1) / K1
    print(f"gloo on the link, estimated: {gloo_link / 1e6:.1f} MB per step (the ring moves "
          f"{ring_bytes / 1e6:.1f} MB)")
else:
    print(f"phases: dense {ph['dense']['seconds']:.1f} s, dgc {ph['dgc']['seconds']:.1f} s (no qdisc)")
if "stage_ms" in dgc:
    st = dgc["stage_ms"]
    print("dgc stage_ms (medians, mean over ranks): " +
          ", ".join(f"{k} {v:.1f}" for k, v in st.items()))
targets = []
if R:
    dgc_link = W * dgc["wire_bytes_per_rank"] / R
    sps = dgc["seconds_per_step"]
    print(f"dgc step {sps:.3f} s: link time of its wire bytes {dgc_link:.3f} s "
          f"({dgc_link / sps:.0%} of the step), the rest {sps - dgc_link:.3f} s; link-bound it "
          f"would be {gloo['seconds_per_step'] / dgc_link:.1f} x gloo")
    print()
    v = none["seconds_per_step"] / bound
    targets.append(("dense lightwire within 15 % of the ring bound (measured / bound <= 1.15)",
                    f"{v:.3f}", v <= 1.15))
    x = gloo["seconds_per_step"] / sps
    targets.append(("dgc 0.01 >= 25 x faster per step than gloo's dense allreduce",
                    f"{x:.1f} x", x >= 25))
    note = "" if R == 125e6 else " (they are stated for 1 Gbit/s)"
    if dgc_ar:
        x = sps / dgc_ar["seconds_per_step"]
        targets.append(("dgc 0.01: the sparse allreduce's step >= 3 x faster than the allgather's",
                        f"{x:.2f} x", x >= 3))
    for t, v, ok in targets:
        print(f"target{note}: {t}: {v}: {'met' if ok else 'NOT met'}")
if want_json:
    print(json.dumps({"rate": rate, "rate_bytes_per_s": R or None, "world_size": W, "elements": N,
                      "steps": K, "ring_bound_s": bound,
                      "link_check": {**link, "bytes_per_s": link_Bps}, "phases": ph,
                      "gloo": gloo, "gloo_link_bytes_per_step_estimated": gloo_link, "lightwire_none": none, "lightwire_dgc": dgc,
                      "lightwire_dgc_allreduce": dgc_ar, "rows": rows,
                      "targets": [{"target": t, "value": v, "met": ok} for t, v, ok in targets]}))
EOF
