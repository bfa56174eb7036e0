#!/usr/bin/env bash
# Issue 24, acceptance 5: tp=1 through the multi-process executor (the worker in its own process) vs the
# in-process executor, on W1 (throughput) and W3 (batch-1 latency), one GPU, same call. Alternates
# uni, mp, uni, mp (RUNS pairs, default 2) so both see the same machine state, then prints each run and the
# mp/uni ratios of the medians (target: < 3% cost, i.e. W1 tok/s ratio > 0.97, W3 ms/token ratio < 1.03).
#   bash benchmarks/mp_executor_ab.sh      (carry .whl and .whl_serve: msgspec, gguf, and pyzmq for the executor)
# Dummy weights. JSON per run under $OUT. The workloads and flags are gpu_e2e.sh's W1 / W3. If one call's
# 10 minutes are too short for both: WORKLOADS=W1 bash benchmarks/mp_executor_ab.sh, then WORKLOADS=W3.
set -uo pipefail
OUT=${OUT:-/tmp/pagedllm_mp_ab}
mkdir -p "$OUT"
RUNS=${RUNS:-2}
. "$(dirname "$0")/device_wheels.sh" && install_wheels .whl .whl_serve
export PYTHONPATH=.:${PYTHONPATH:-}
python3 -c "import zmq" || { echo "pyzmq missing: carry its cp312 wheel in .whl or .whl_serve"; exit 1; }
export PYTHONUNBUFFERED=1
WORKLOADS=${WORKLOADS:-W1 W3}
for r in $(seq "$RUNS"); do
    for backend in uni mp; do
        if [[ " $WORKLOADS " == *" W1 "* ]]; then
            timeout 400 python3 -m pagedllm bench throughput --workload W1 --max-model-len 2048 --load-format dummy \
                --distributed-executor-backend "$backend" --output-json "$OUT/W1_${backend}_$r.json" 2>&1 \
                | grep -E "^Throughput|Error|error" | tail -2 | sed "s/^/W1 $backend $r: /"
        fi
        if [[ " $WORKLOADS " == *" W3 "* ]]; then
            timeout 300 python3 -m pagedllm bench latency --model benchmarks/workloads/llama-3.1-8b --load-format dummy \
                --batch-size 1 --input-len 128 --output-len 256 --num-iters 5 --num-iters-warmup 2 --max-model-len 1024 \
                --distributed-executor-backend "$backend" --output-json "$OUT/W3_${backend}_$r.json" 2>&1 \
                | grep -vE "^INFO|^WARNING" | tail -1 | sed "s/^/W3 $backend $r: /"
        fi
    done
done
python3 - "$OUT" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
def vals(w, backend, key):
    return [json.load(open(f))[key] for f in sorted(glob.glob(os.path.join(out, f"{w}_{backend}_*.json")))]
print("==== multi-process (mp) vs in-process (uni) executor, tp=1 ====")
for w, key, unit, better in (("W1", "output_tokens_per_second", "output tok/s", "higher"),
                             ("W3", "time_per_output_token_ms", "ms/token", "lower")):
    uni, mp = vals(w, "uni", key), vals(w, "mp", key)
    if not uni or not mp:
        print(f"{w}: missing runs (uni {len(uni)}, mp {len(mp)})")
        continue
    mu, mm = statistics.median(uni), statistics.median(mp)
    cost = (mu / mm - 1) if better == "higher" else (mm / mu - 1)
    print(f"{w} {unit}: uni {', '.join(f'{v:.3f}' for v in uni)} | mp {', '.join(f'{v:.3f}' for v in mp)} | "
          f"mp/uni {mm / mu:.4f} -> mp costs {cost * 100:+.2f}% ({'OK' if cost < 0.03 else 'over'} the 3% bound)")
PY
