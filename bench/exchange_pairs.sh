#!/usr/bin/env bash
# Pairs two builds on `lightwire bench exchange` (bench/README.md "Statistics along the ring"):
# for each repetition and each configuration, build B then build A, one after the other, so that
# both see the same machine; prints per configuration the DATA frames per step, the wire bytes per
# rank and the median step time of each, and the ratio A / B.
#
#   bench/exchange_pairs.sh A_BIN B_BIN OUT.jsonl [REPS (5)] [CONFIGS]
#
# CONFIGS: a file of lines "world_size codec elements sparse steps" (dgc at density 0.01); the
# default is the set measured in bench/README.md.
set -euo pipefail
a=$1 b=$2 out=$3 reps=${4:-5} cfgs=${5:-}
python=${PYTHON:-/usr/bin/python3}
if [[ -z "$cfgs" ]]; then
  cfgs=$(mktemp)
  trap 'rm -f "$cfgs"' EXIT
  cat >"$cfgs" <<'CFG'
2 none 4096 allgather 100
4 none 4096 allgather 100
8 none 4096 allgather 100
16 none 4096 allgather 40
4 dgc 1000000 allreduce 20
16 dgc 1000000 allreduce 20
32 dgc 1000000 allreduce 10
64 dgc 1000000 allreduce 5
CFG
fi
: >"$out"
for rep in $(seq 1 "$reps"); do
  while read -r w codec n sparse steps; do
    [[ -z "$w" ]] && continue
    for which in b a; do
      bin=$b
      [[ $which == a ]] && bin=$a
      args=(--world-size "$w" --codec "$codec" --elements "$n" --sparse "$sparse" --steps "$steps"
            --json)
      [[ $codec == dgc ]] && args+=(--density 0.01)
      r=$("$bin" bench exchange "${args[@]}" 2>/dev/null </dev/null | tail -1)
      echo "{\"which\":\"$which\",\"rep\":$rep,\"r\":$r}" >>"$out"
      echo "rep $rep: W=$w $codec $n $sparse ($which) done" >&2
    done
  done <"$cfgs"
done
"$python" - "$out" <<'PY'
import collections, json, statistics, sys
runs = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    x = json.loads(line)
    r = x["r"]
    runs[(r["world_size"], r["codec"], r["elements"], r["sparse"])][x["which"]].append(r)
print("W  codec elements  sparse     frames/step B  A   bytes/rank B  A      ms/step B  A   A/B")
for (w, codec, n, sparse), v in sorted(runs.items()):
    med = {k: statistics.median(r["seconds_per_step"] for r in v[k]) * 1e3 for k in "ab"}
    fr = {k: v[k][0].get("data_frames_per_step", float("nan")) for k in "ab"}
    by = {k: statistics.median(r["wire_bytes_per_rank"] for r in v[k]) for k in "ab"}
    print(f"{w:<3}{codec:<6}{n:>9}  {sparse:<10}{fr['b']:>7.0f}{fr['a']:>6.0f}{by['b']:>10.0f}"
          f"{by['a']:>9.0f}{med['b']:>9.2f}{med['a']:>7.2f}{med['a'] / med['b']:>7.3f}")
PY
