#!/usr/bin/env bash
# Alternated A/B runs of `kvrecv serve` alone (TP2, batch 16, 16 in flight by default), two
# binaries, medians of serve's CPU per request. For a change too small for a whole grid to show
# (docs/PERFORMANCE.md): runs drift by more than such a change between invocations, so the
# two builds take turns, and the order alternates.
#
#   benches/ab_serve.sh 8 /tmp/kvrecv-before target/release/kvrecv
#
# A binary may be a wrapper script that adds serve flags (e.g. `--windows 64`) for
# experiments. Environment: PY (python with msgspec and pyzmq, default .venv/bin/python), REQ
# (requests per run, default 100000), BATCH, IN_FLIGHT.
set -euo pipefail
n=$1 a=$2 b=$3
py=${PY:-.venv/bin/python}
cd "$(dirname "$0")/.."
run() {
    "$py" benches/baseline.py --kvrecv "$1" --tp 2 --batch "${BATCH:-16}" \
        --in-flight "${IN_FLIGHT:-16}" --requests "${REQ:-100000}" --pairs 1 --memory 0 \
        --ds serve | awk '$1 == "serve" { print $3 }'
}
ra=() rb=()
for i in $(seq "$n"); do
    if (( i % 2 )); then order="b a"; else order="a b"; fi
    for w in $order; do
        if [[ $w == a ]]; then ra+=("$(run "$a")"); else rb+=("$(run "$b")"); fi
    done
done
python3 - "${ra[*]}" "${rb[*]}" <<'PY'
import statistics, sys
a, b = ([float(x) for x in s.split()] for s in sys.argv[1:3])
ma, mb = statistics.median(a), statistics.median(b)
print(f"A µs/req {sorted(a)} median {ma:.3f}")
print(f"B µs/req {sorted(b)} median {mb:.3f}")
print(f"B/A {mb / ma:.3f}")
PY
