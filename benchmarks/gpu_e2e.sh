#!/usr/bin/env bash
# End-to-end GPU run on the device machine (issue 3): engine correctness against HF on the GPU, then
# the W1..W4 benchmarks. The SmolLM2 GGUF travels in two parts (64 MiB per call):
#   call 1: bash benchmarks/gpu_e2e.sh part1        (carry .gguf/part1; copies it to /tmp)
#   call 2: bash benchmarks/gpu_e2e.sh run [W...]   (carry .gguf/part2 and .whl; within 30 s of call 1;
#           `run none` runs the correctness part alone)
# Prints a short table last and writes JSON/logs under $OUT. E2E_EXTRA="--async-scheduling" (for example) is
# appended to every benchmark command; E2E_TAG names the output files apart; E2E_CORRECTNESS=0 skips the
# correctness part. A workload may carry environment settings for its run alone, for same-call A/B:
#   bash benchmarks/gpu_e2e.sh run W3 W3@PAGEDLLM_FUSED_ROPE_CACHE=0 W3@PAGEDLLM_ROW_GEMV=0
# (several settings: W3@A=1,B=2 -- commas separate the settings, so a value cannot hold one)
# HF3 runs HF transformers' generate on W3 (same-call baseline). W3P profiles W3's decode step (benchmarks/decode_profile.py: linears vs cuBLAS/cuBLASLt/Triton, kernels).
# HOST measures host time per step (benchmarks/host_overhead.py --device cuda with graphs, eager, then cpu).
# W4P replays W4 (prefix caching off) step by step (benchmarks/step_profile.py) with kernel tables of two prefill steps.
set -uo pipefail
OUT=${OUT:-/tmp/pagedllm_gpu_e2e}
mkdir -p "$OUT"
stage=${1:-run}
shift || true
if [ "$stage" = part1 ]; then
    cp .gguf/part1/* /tmp/ && ls -la /tmp/smol.part00 && exit 0
fi
. "$(dirname "$0")/device_wheels.sh" && install_wheels
export PYTHONPATH=.:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
summary="$OUT/summary.txt"
: > "$summary"
if [ "${E2E_CORRECTNESS:-1}" = 0 ]; then
    echo "correctness skipped (E2E_CORRECTNESS=0)" >> "$summary"
elif [ -f /tmp/smol.part00 ] && [ -d .gguf/part2 ]; then
    cat /tmp/smol.part00 .gguf/part2/smol.part01 > /tmp/smollm2.gguf
    if [ "$(sha256sum /tmp/smollm2.gguf | cut -d' ' -f1)" = "$(cat .gguf/part2/sha256)" ]; then
        export PAGEDLLM_DEFAULT_MODEL=/tmp/smollm2.gguf
        timeout 300 python3 -m pytest -m gpu tests/gpu/test_engine_gpu.py -q -s -p no:cacheprovider 2>&1 \
            | grep -v "^INFO" | tee "$OUT/engine_gpu.log"
        echo "engine correctness (pytest rc ${PIPESTATUS[0]}): $(grep -E 'identical, [0-9]+ failing' "$OUT/engine_gpu.log" | cut -c1-110 | tr '\n' ' ')" >> "$summary"
    else
        echo "GGUF sha256 mismatch: correctness skipped" >> "$summary"
    fi
else
    echo "no GGUF parts: correctness skipped" >> "$summary"
fi
W=${*:-W1 W3 W4}
read -r -a extra <<< "${E2E_EXTRA:-}"
base_tag=${E2E_TAG:-}
for spec in $W; do  # "none": the correctness part alone
    [ "$spec" = none ] && continue
    w=${spec%%@*}
    envs=()
    tag=$base_tag
    if [ "$spec" != "$w" ]; then
        IFS=, read -r -a envs <<< "${spec#*@}"
        tag="$base_tag@${spec#*@}"
        tag=${tag//[^A-Za-z0-9_.-]/_}
    fi
    clog=/tmp/compiles_$w${tag}.log
    rm -f "$clog"
    run_env() { env PAGEDLLM_LOG_TRITON_COMPILES="$clog" "${envs[@]}" "$@"; }
    case $w in
        W1) args=(--workload W1 --max-model-len 2048) ;;
        W2) args=(--workload W2 --max-model-len 2048) ;;
        W6) args=(--workload W6 --max-model-len 2048) ;;
        W3) args=() ;;
        W4) args=(--workload W4 --max-model-len 4096) ;;
        W3P) args=() ;;
        W4P) args=() ;;
        HOST) args=() ;;
        HF3) args=() ;;
    esac
    if [ "$w" = HF3 ]; then  # HF transformers generate on W3, same call (benchmarks/hf_baseline.py)
        run_env timeout 300 python3 benchmarks/hf_baseline.py --out "$OUT/hf_W3$tag.json" 2>&1 | tail -2 \
            | tee -a "$OUT/bench.log"
        echo "HF3$tag: $(tail -1 "$OUT/bench.log")" >> "$summary"
    elif [ "$w" = W3P ]; then
        run_env timeout 400 python3 benchmarks/decode_profile.py --out "$OUT/decode_profile$tag.json" 2>&1 \
            | grep -v "^INFO" | tail -45 | tee -a "$OUT/bench.log"
        echo "W3P$tag: $(grep -E '^NVIDIA|copy [0-9]+ GB/s' "$OUT/bench.log" | tail -1)" >> "$summary"
    elif [ "$w" = HOST ]; then  # host time per step, 256 decodes, no-op model on the GPU (issue 3's < 1 ms)
        echo "HOST CPU: $(lscpu | grep 'Model name' | sed 's/.*: *//')" >> "$summary"
        # cuda: decode CUDA graphs capture the no-op (as served), three runs (this host's CPU is noisy).
        for mode in cuda.1 cuda.2 cuda.3 cuda_eager cpu; do
            dev=${mode%%[._]*}
            eager=(); [ "$mode" = cuda_eager ] && eager=(--enforce-eager)
            run_env env HOST_BENCH_VOCAB=32 OMP_NUM_THREADS=1 timeout 150 python3 benchmarks/host_overhead.py \
                --final-only --steps 400 --device "$dev" "${eager[@]}" --json "$OUT/host_$mode$tag.json" 2>&1 \
                | grep -v "^INFO" | tail -1 | tee -a "$OUT/bench.log"
            echo "HOST $mode$tag: $(tail -1 "$OUT/bench.log" | grep -o '[0-9.]* ms') (median step $(python3 -c \
                "import json; print(round(json.load(open('$OUT/host_$mode$tag.json'))['median_ms'], 3))") ms)" >> "$summary"
        done
    elif [ "$w" = W4P ]; then  # W4 (prefix caching off) step by step, with kernel tables of 2 prefill steps
        run_env timeout 300 python3 benchmarks/step_profile.py --workload W4 --max-model-len 4096 --profile-steps 2 \
            --out-dir "$OUT" 2>&1 | grep -v "^INFO" | tee -a "$OUT/w4_profile$tag.log" | tail -8 | tee -a "$OUT/bench.log"
        echo "W4P$tag: $(grep -E '^W4: ' "$OUT/w4_profile$tag.log" | tail -1)" >> "$summary"
    elif [ "$w" = W3 ]; then
        run_env timeout 300 python3 -m pagedllm bench latency --model benchmarks/workloads/llama-3.1-8b --load-format dummy \
            --batch-size 1 --input-len 128 --output-len 256 --num-iters 5 --num-iters-warmup 2 --max-model-len 1024 \
            "${extra[@]}" --output-json "$OUT/W3$tag.json" 2>&1 | tail -5 | tee -a "$OUT/bench.log"
        echo "W3$tag: $(grep -E "Time per output token" "$OUT/bench.log" | tail -1)" >> "$summary"
    elif [ "$w" = W4 ]; then
        for pc in enable no-enable; do
            run_env timeout 300 python3 -m pagedllm bench throughput "${args[@]}" --load-format dummy --$pc-prefix-caching \
                "${extra[@]}" --output-json "$OUT/W4_$pc$tag.json" 2>&1 | tail -3 | tee -a "$OUT/bench.log"
            echo "W4 prefix $pc: $(grep -o '([0-9.]* s;' "$OUT/bench.log" | tail -1)" >> "$summary"
        done
    else
        run_env timeout 400 python3 -m pagedllm bench throughput "${args[@]}" --load-format dummy "${extra[@]}" \
            --output-json "$OUT/$w$tag.json" \
            2>&1 | tail -5 | tee -a "$OUT/bench.log"
        echo "$w$tag: $(grep Throughput "$OUT/bench.log" | tail -1)" >> "$summary"
    fi
    if [ -f "$clog" ]; then  # Triton compiles after start-up = stalls inside the timed run
        n=$(grep -c " serving: " "$clog")
        echo "  $w$tag: $(wc -l < "$clog") Triton compiles, $n after start-up" >> "$summary"
        grep " serving: " "$clog" | cut -c1-300 | head -5
    fi
done
echo "==== summary ($(nvidia-smi --query-gpu=name --format=csv,noheader)) ===="
cat "$summary"
