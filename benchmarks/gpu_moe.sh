#!/usr/bin/env bash
# Issue 18 on the device machine, one call: the fused MoE kernel and MoE engine GPU tests, W6 (Qwen3-30B-A3B
# shape, dummy bf16) through `pagedllm bench throughput` with its floor, the kernel tile sweep
# (benchmarks/moe_tune.py), and W1 again (no-regression check). Carry the cp312 wheels (msgspec, gguf) in
# .whl (or MOE_WHL). Stages: MOE_STAGES="tests W6 tune W1" (default, in that order); also `W6T` (W6 with the
# table just tuned, PAGEDLLM_MOE_CONFIG=$OUT/E128_N768_K2048.json), `split` (benchmarks/moe_step_split.py), W3,
# `route` (benchmarks/moe_route_micro.py) and `W6OFF` (W6 with the deferred sum off).
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
            timeout 240 python3 benchmarks/moe_tune.py --out "$OUT/E128_N768_K2048.json" 2>&1 | tee "$OUT/tune.log" | tail -25
            grep -E '^T=' "$OUT/tune.log" | cut -c1-140 >> "$summary" ;;
        split)
            timeout 200 python3 benchmarks/moe_step_split.py --out "$OUT/w6_split.json" 2>&1 | grep -v "^INFO" \
                | tee "$OUT/split.log" | tail -45
            echo "split: $(tr -d '\n ' < "$OUT/w6_split.json")" >> "$summary" ;;
        route)  # the routing and the sum over k, old way against new, in CUDA graphs (us per layer)
            timeout 200 python3 benchmarks/moe_route_micro.py --out "$OUT/route_micro.json" 2>&1 | grep -v "^INFO" \
                | tee "$OUT/route.log" | tail -12
            grep -E '^T=' "$OUT/route.log" >> "$summary" ;;
        W6OFF)  # A/B in the same lease: the sum over k in a launch of its own
            PAGEDLLM_MOE_DEFER_SUM=0 timeout 300 python3 -m pagedllm bench throughput \
                --workload W6 --max-model-len 2048 --load-format dummy --output-json "$OUT/W6OFF_$(date +%s).json" 2>&1 \
                | grep -v "^INFO" | tail -5 | tee -a "$OUT/bench.log"
            echo "W6 (deferred sum off): $(grep Throughput "$OUT/bench.log" | tail -1)" >> "$summary" ;;
        W6OLD)  # A/B in the same lease: the fused-MoE options as first measured (call 3)
            PAGEDLLM_MOE_FUSED_SILU=0 PAGEDLLM_MOE_PLACE_BLOCK=256 timeout 300 python3 -m pagedllm bench throughput \
                --workload W6 --max-model-len 2048 --load-format dummy --output-json "$OUT/W6OLD.json" 2>&1 \
                | grep -v "^INFO" | tail -5 | tee -a "$OUT/bench.log"
            echo "W6 (SiLU unfused, place block 256): $(grep Throughput "$OUT/bench.log" | tail -1)" >> "$summary" ;;
        W6T)
            PAGEDLLM_MOE_CONFIG=$OUT/E128_N768_K2048.json timeout 300 python3 -m pagedllm bench throughput --workload W6 \
                --max-model-len 2048 --load-format dummy --output-json "$OUT/W6T.json" 2>&1 | grep -v "^INFO" | tail -5 \
                | tee -a "$OUT/bench.log"
            echo "W6 tuned: $(grep Throughput "$OUT/bench.log" | tail -1)" >> "$summary" ;;
        W3)
            timeout 300 python3 -m pagedllm bench latency --model benchmarks/workloads/llama-3.1-8b --load-format dummy \
                --batch-size 1 --input-len 128 --output-len 256 --num-iters 5 --num-iters-warmup 2 --max-model-len 1024 \
                --output-json "$OUT/W3.json" 2>&1 | tail -3 | tee -a "$OUT/bench.log"
            echo "W3: $(tail -1 "$OUT/bench.log")" >> "$summary" ;;
        W6|W1)
            timeout 300 python3 -m pagedllm bench throughput --workload "$stage" --max-model-len 2048 --load-format dummy \
                --output-json "$OUT/${stage}_$(date +%s).json" 2>&1 | grep -v "^INFO" | tail -5 | tee -a "$OUT/bench.log"
            echo "$stage: $(grep Throughput "$OUT/bench.log" | tail -1)" >> "$summary" ;;
    esac
done
echo "==== summary ($(nvidia-smi --query-gpu=name --format=csv,noheader)) ===="
cat "$summary"
