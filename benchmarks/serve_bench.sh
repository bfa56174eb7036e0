#!/usr/bin/env bash
# Online serving workloads S1 / S2 (benchmarks/workloads/README.md) on the device: `pagedllm serve` of the
# dummy-weight model loaded by `pagedllm bench serve` (512 in / 128 out exactly, 400 prompts, Poisson seed 0,
# 64 warm-up requests), one server per model, rates in order. Carry .whl and .whl_serve.
#   bash benchmarks/serve_bench.sh S2:inf,64 S1:inf,16
# PROFILE=1: py-spy samples the API server and the engine core for PROFILE_S seconds (default 12) during the
# first run of each model (raw collapsed stacks + a self-time table per process, under $OUT); PYSPY_ARGS adds
# py-spy flags (e.g. "--idle" to see where a thread blocks).
# TRACE=1: the engine core writes PAGEDLLM_STEP_TRACE ($OUT/trace_<w>.jsonl), the client saves every request's times
# (--save-detailed), and benchmarks/tail_analysis.py splits each rate's TTFTs (tail_<w>_<rate>.txt).
# SERVE_ARGS: extra `pagedllm serve` flags (e.g. "--api-server-count 2"); CLIENT_ARGS: extra `bench serve` flags
# (e.g. "--client-processes 4").
# SERVE_ROOT: serve from another tree (e.g. .carry_before, for a same-lease A/B; the client stays this tree's).
set -uo pipefail
OUT=${OUT:-/tmp/pagedllm_serve_bench}
mkdir -p "$OUT"
. "$(dirname "$0")/device_wheels.sh" && install_wheels .whl .whl_serve
export PYTHONPATH=.:${PYTHONPATH:-}
export PATH=/tmp/site/bin:$PATH  # py-spy (carried in .whl_serve)
export PYTHONUNBUFFERED=1
PORT=8013
root=$PWD
read -r -a serve_args <<< "${SERVE_ARGS:-}"
for spec in "$@"; do
    w=${spec%%:*}
    rates=${spec#*:}
    model=benchmarks/workloads/serve-$(echo "$w" | tr 'A-Z' 'a-z')
    t0=$SECONDS
    trace_env=()
    detailed=()
    if [ "${TRACE:-0}" = 1 ]; then
        trace_env=(env "PAGEDLLM_STEP_TRACE=$OUT/trace_$w.jsonl")
        detailed=(--save-detailed)
    fi
    (cd "${SERVE_ROOT:-.}" && PYTHONPATH=.:$PYTHONPATH exec "${trace_env[@]}" python3 -m pagedllm serve "$root/$model" \
        --load-format dummy --dtype bfloat16 --max-model-len 4096 --port $PORT --disable-log-requests "${serve_args[@]}") \
        > "$OUT/server_$w.log" 2>&1 &
    spid=$!
    until curl -sf "localhost:$PORT/health" > /dev/null; do
        sleep 1
        kill -0 $spid 2>/dev/null || { echo "$w: server died"; tail -20 "$OUT/server_$w.log"; continue 2; }
        [ $((SECONDS - t0)) -gt 240 ] && { echo "$w: no /health after 240 s"; kill $spid; continue 2; }
    done
    echo "$w: server up in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
    first=1
    for rate in ${rates//,/ }; do
        prof=
        if [ "${PROFILE:-0}" = 1 ] && [ $first = 1 ]; then
            (sleep 8
             for pid in $spid $(pgrep -P $spid); do
                 py-spy record --pid "$pid" --duration "${PROFILE_S:-12}" --rate 200 --format raw ${PYSPY_ARGS:-} \
                     -o "$OUT/pyspy_${w}_$pid.txt" --nonblocking > "$OUT/pyspy_${w}_$pid.log" 2>&1 &
             done; wait) &
            prof=$!
        fi
        python3 -m pagedllm bench serve --base-url "http://127.0.0.1:$PORT" --dataset-name random \
            --random-input-len 512 --random-output-len 128 --random-range-ratio 0 --num-prompts 400 \
            --request-rate "$rate" --seed 0 --ignore-eos --num-warmups 64 \
            --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
            --save-result "$OUT/${w}_rate_${rate}.json" "${detailed[@]}" ${CLIENT_ARGS:-} > "$OUT/bench_${w}_$rate.log" 2>&1
        echo "== $w rate $rate (rc $?)" | tee -a "$OUT/summary.txt"
        grep -E -i "output token throughput|TTFT|TPOT|ITL|E2EL" "$OUT/bench_${w}_$rate.log" | head -12 | tee -a "$OUT/summary.txt"
        if [ "${TRACE:-0}" = 1 ]; then
            sleep 1  # the core flushes its trace every 512 events: take what is written
            python3 benchmarks/tail_analysis.py --bench "$OUT/${w}_rate_${rate}.json" --trace "$OUT/trace_$w.jsonl" \
                > "$OUT/tail_${w}_$rate.txt" 2>&1
            head -12 "$OUT/tail_${w}_$rate.txt" | tee -a "$OUT/summary.txt"
        fi
        [ -n "$prof" ] && { timeout 60 tail --pid="$prof" -f /dev/null; }  # the profiler only, not the server
        first=0
    done
    kill $spid; wait $spid 2>/dev/null
done
if ls "$OUT"/pyspy_*.txt > /dev/null 2>&1; then
    python3 benchmarks/pyspy_table.py "$OUT"/pyspy_*.txt | tee "$OUT/pyspy_tables.txt" | head -120
fi
cat "$OUT/summary.txt"
