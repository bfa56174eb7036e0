#!/usr/bin/env bash
# Issue 19 on the device: quantized Llama-3.1-8B-shaped runs with dummy weights, each beside its bf16
# baseline from the same call.
#   W2 / W3          bf16 baselines (../shared/workloads/README.md's W2 and W3)
#   W2-FP8 / W3-FP8  online FP8 weights (--quantization fp8: e4m3 per-channel, dynamic per-token activations)
#   W2-KV8           bf16 weights, FP8 KV cache (--kv-cache-dtype fp8)
#   W3-AWQ           int4 AWQ-layout checkpoint shape (benchmarks/workloads/llama-3.1-8b-awq, group 128)
# Usage: bash benchmarks/quant_bench.sh [W2 W2-FP8 W2-KV8 W3 W3-FP8 W3-AWQ]   (default: all six)
# Prints output tok/s, ms per token, KV capacity in tokens (and vs bf16), and each figure / its floor: the
# floors come from the bench commands themselves, which measure the copy bandwidth (and the bf16 / FP8
# matmul rates) on this GPU in the same process (pagedllm/benchmarks/floors.py). JSON and logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/pagedllm_quant}
mkdir -p "$OUT"
export PYTHONPATH=.:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
M=benchmarks/workloads/llama-3.1-8b
W=${*:-W2 W2-FP8 W2-KV8 W3 W3-FP8 W3-AWQ}
for w in $W; do
    case $w in
        W2) args=(throughput --workload W2 --model $M) ;;
        W2-FP8) args=(throughput --workload W2 --model $M --quantization fp8) ;;
        W2-KV8) args=(throughput --workload W2 --model $M --kv-cache-dtype fp8) ;;
        W3) args=(latency --model $M) ;;
        W3-FP8) args=(latency --model $M --quantization fp8) ;;
        W3-AWQ) args=(latency --model benchmarks/workloads/llama-3.1-8b-awq) ;;
        *) echo "unknown workload $w"; continue ;;
    esac
    if [ "${args[0]}" = latency ]; then
        args+=(--batch-size 1 --input-len 128 --output-len 256 --num-iters 5 --num-iters-warmup 2 --max-model-len 1024)
    else
        args+=(--max-model-len 2048)
    fi
    echo "==== $w: pagedllm bench ${args[*]}"
    timeout 500 python3 -m pagedllm bench "${args[@]}" --load-format dummy --output-json "$OUT/$w.json" 2>&1 \
        | grep -E "^(Throughput|Time per output|Traceback|[A-Za-z]*Error)|loaded |Profiling:|KV cache:" | tee -a "$OUT/bench.log"
done
python3 - "$OUT" $W <<'PY'
import json, os, sys
out, names = sys.argv[1], sys.argv[2:]
res = {n: json.load(open(os.path.join(out, n + ".json"))) for n in names if os.path.exists(os.path.join(out, n + ".json"))}
def kv(n):
    return res.get(n, {}).get("kv_cache_tokens")
print(f"{'run':8} {'out tok/s':>10} {'ms/token':>9} {'x floor':>8} {'KV tokens':>10} {'KV vs bf16':>10}")
for n, r in res.items():
    base = "W2" if n.startswith("W2") else "W3"
    tps = r.get("output_tokens_per_second")
    ms = r.get("time_per_output_token_ms")
    ratio = f"{kv(n) / kv(base):.2f}x" if kv(n) and kv(base) else "-"
    print(f"{n:8} {tps or 0:10.1f} {ms or 0:9.3f} {r.get('x_floor') or 0:8.3f} {kv(n) or 0:10d} {ratio:>10}")
    if ms and r.get("weight_floor_ms"):
        print(f"         floor {r['weight_floor_ms']:.3f} ms (weights read at copy {r['copy_GBps']:.0f} GB/s)")
    if tps and r.get("floor_s"):
        print(f"         floor {r['floor_s']:.2f} s = max(bytes {r['floor_bytes_s']:.2f} s, FLOPs {r['floor_flops_s']:.2f} s);"
              f" copy {r['copy_GBps']:.0f} GB/s, bf16 {r['matmul_TFLOPs']:.0f} TFLOP/s, fp8 {r.get('fp8_matmul_TFLOPs') or 0:.0f}")
PY
echo "==== $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"
