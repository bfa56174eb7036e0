#!/usr/bin/env bash
# The correctness call of a device session (after `bash benchmarks/gpu_e2e.sh part1`, within 30 s; carry
# .gguf/part2, .whl and .whl_serve): the GPU tests, the engine against HF on the real SmolLM2 (bf16 and
# float32), then `pagedllm serve` on the GPU (benchmarks/gpu_serve_check.py). Everything it writes goes
# into one tarball under $OUT (the device returns at most 8 files); the summaries print last.
set -uo pipefail
OUT=${OUT:-/tmp/pagedllm_gpu_final}
mkdir -p "$OUT"
work=/tmp/gpu_final && rm -rf "$work" && mkdir -p "$work"
. "$(dirname "$0")/device_wheels.sh" && install_wheels .whl .whl_serve
GPU_CHECK_BENCH=0 OUT=$work/check bash benchmarks/gpu_check.sh > "$work/gpu_check.log" 2>&1
PAGEDLLM_BF16_BASELINES=1 OUT=$work/e2e bash benchmarks/gpu_e2e.sh run none > "$work/e2e.log" 2>&1
PYTHONPATH=.:$PYTHONPATH PYTHONUNBUFFERED=1 timeout 300 python3 benchmarks/gpu_serve_check.py /tmp/smollm2.gguf \
    --out "$work/serve.json" > "$work/serve.log" 2>&1
tar czf "$OUT/gpu_final.tgz" -C "$work" .
grep -E "^tests:|^rc:" "$work/gpu_check.log"
cut -c1-600 "$work/e2e/summary.txt"
grep -A9 "==== pagedllm serve" "$work/serve.log"
