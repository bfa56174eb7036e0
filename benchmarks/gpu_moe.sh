#!/usr/bin/env bash
# Issue 18 on the device machine, one call: the fused MoE kernel and MoE engine GPU tests, W6 (Qwen3-30B-A3B
# shape, dummy bf16) through `pagedllm bench throughput` with its floor, the kernel tile sweep
# (benchmarks/moe_tune.py), and W1 again (no-regression check). Carry the cp312 wheels (msgspec, gguf) in
# .whl (or MOE_WHL). Stages: MOE_STAGES="tests W6 tune W1" (default all, in that order).
set -uo pipefail
OUT=${OUT:-/tmp/pagedllm_gpu_moe}
mkdir -p "$OUT"
. "$(dirname "$0")/device_wheels.sh" && install_wheels "${MOE_WHL:-.whl}"
export PYTHONPATH=.:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
summary="$OUT/summary.txt"
: > "$summary"
for stage in ${MOE_STAGES:-tests W6 tune W1}; do
    case $stage in
        tests)
            timeout 240 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_fused_moe.py \
                tests/gpu/test_moe_engine_gpu.py 2>&1 | grep -v "^INFO" | tail -25 | tee "$OUT/tests.log"
            echo "tests: $(tail -1 "$OUT/tests.log") | $(grep -E 'identical' "$OUT/tests.log" | tr '\n' ' ')" >> "$summary" ;;
        tune)
            timeout 200 python3 benchmarks/moe_tune.py --out "$OUT/moe_tune.json" 2>&1 | tee "$OUT/tune.log" | tail -25
            grep -E '^T=' "$OUT/tune.log" >> "$summary" ;;
        W6|W1)
            timeout 300 python3 -m pagedllm bench throughput --workload "$stage" --max-model-len 2048 --load-format dummy \
                --output-json "$OUT/$stage.json" 2>&1 | grep -v "^INFO" | tail -5 | tee -a "$OUT/bench.log"
            echo "$stage: $(grep Throughput "$OUT/bench.log" | tail -1)" >> "$summary" ;;
    esac
done
echo "==== summary ($(nvidia-smi --query-gpu=name --format=csv,noheader)) ===="
cat "$summary"
