#!/usr/bin/env bash
# Issue 16 acceptance 5: where the step loop's time goes with 64 JSON-schema requests, from py-spy samples of
# every thread (idle ones too) over many decode runs, plain and structured in separate processes.
#   bash benchmarks/structured_pyspy.sh        (device; carry .whl .whl_serve .smol_tok)
set -uo pipefail
OUT=${OUT:-/tmp/pagedllm_so_pyspy}
mkdir -p "$OUT"
. "$(dirname "$0")/device_wheels.sh" && install_wheels .whl .whl_serve
export PATH=/tmp/site/bin:$PATH PYTHONPATH=.:${PYTHONPATH:-}
for case in plain structured; do
    timeout 200 python3 benchmarks/structured_overhead.py --model benchmarks/workloads/qwen3-0.6b --device cuda \
        --tokenizer .smol_tok --quick --cases "$case" --repeats "${REPEATS:-12}" --pyspy "$OUT/pyspy_$case.txt" \
        --json "$OUT/$case.json" > "$OUT/$case.log" 2>&1
    grep -E "^step_ms_$case(_runs)?:" "$OUT/$case.log"
    python3 benchmarks/pyspy_threads.py "$OUT/pyspy_$case.txt" > "$OUT/table_$case.txt" 2>&1
    head -80 "$OUT/table_$case.txt"
done
