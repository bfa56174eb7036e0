#!/usr/bin/env bash
# Issue 17, acceptance 4: `pagedllm bench serve` against the built-in default model on this CPU at rate inf,
# before (SERVE_BEFORE, default .carry_before: `git archive` of the baseline commit) and after (this tree),
# alternating before, after, before, after (RUNS pairs, default 2) so both see the same machine. Run on a quiet
# machine. JSON per run and a summary under $OUT.
#   git archive bb48290 | (mkdir -p .carry_before && tar -x -C .carry_before)   # once
#   bash benchmarks/serve_cpu_ab.sh
# SIDES="before after api2" adds this tree with `--api-server-count 2` (side api2).
set -uo pipefail
OUT=${OUT:-/tmp/pagedllm_serve_cpu_ab}
mkdir -p "$OUT"
RUNS=${RUNS:-2}
BEFORE=${SERVE_BEFORE:-.carry_before}
PY=${PY:-$PWD/.venv/bin/python}
PORT=${PORT:-8023}
root=$PWD
for r in $(seq "$RUNS"); do
    for side in ${SIDES:-before after}; do
        tree=$root
        [ $side = before ] && tree=$root/$BEFORE
        extra=()
        [ $side = api2 ] && extra=(--api-server-count 2)
        (cd "$tree" && PYTHONPATH=. exec "$PY" -m pagedllm serve --port $PORT --disable-log-requests "${extra[@]}") \
            > "$OUT/server_${side}_$r.log" 2>&1 &
        spid=$!
        t0=$SECONDS
        until curl -sf "localhost:$PORT/health" > /dev/null; do
            sleep 1
            kill -0 $spid 2>/dev/null || { echo "$side $r: server died"; tail -5 "$OUT/server_${side}_$r.log"; exit 1; }
            [ $((SECONDS - t0)) -gt 180 ] && { echo "$side $r: no /health"; kill $spid; exit 1; }
        done
        PYTHONPATH=. "$PY" -m pagedllm bench serve --base-url "http://127.0.0.1:$PORT" --dataset-name random \
            --random-input-len 256 --random-output-len 64 --random-range-ratio 0 --num-prompts 64 \
            --request-rate inf --seed 0 --ignore-eos --num-warmups 4 --percentile-metrics ttft,tpot,itl \
            --metric-percentiles 50,99 --save-result "$OUT/${side}_$r.json" > "$OUT/bench_${side}_$r.log" 2>&1
        echo "$side $r: $(grep -i 'output token throughput' "$OUT/bench_${side}_$r.log")" | tee -a "$OUT/summary.txt"
        kill $spid
        wait $spid 2>/dev/null
    done
done
"$PY" - "$OUT" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
def vals(side, key):
    return [json.load(open(f))[key] for f in sorted(glob.glob(os.path.join(out, f"{side}_*.json")))]
for key in ("output_throughput", "median_ttft_ms", "median_tpot_ms"):
    b = vals("before", key)
    for side in ("after", "api2"):
        a = vals(side, key)
        if b and a:
            print(f"{key}: before {', '.join(f'{v:.2f}' for v in b)} | {side} {', '.join(f'{v:.2f}' for v in a)} | "
                  f"{side} / before (medians) {statistics.median(a) / statistics.median(b):.3f}")
PY
