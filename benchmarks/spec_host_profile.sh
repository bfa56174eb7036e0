#!/usr/bin/env bash
# Where a speculative step's time goes (issue 23), on the device (carry .whl .whl_serve):
# - py-spy raw samples (every thread, idle ones too) of the n-gram bench at batch 1, speculation on and off;
# - the torch profiler's CUDA API table and a cProfile of the same run with speculation on;
# - a cProfile of the 8B-shaped target with the SmolLM2-shaped draft (acceptance forced to 0.8).
# The model: SPEC_MODEL_ARGS (default: a dummy SmolLM2 shape; the real one: --model /tmp/smollm2.gguf, staged
# by benchmarks/gguf_parts.sh). Analyse the samples with benchmarks/pyspy_table.py.
set -uo pipefail
OUT=${OUT:-/tmp/spec_host}
mkdir -p "$OUT"
. "$(dirname "$0")/device_wheels.sh" && install_wheels .whl .whl_serve
export PATH=/tmp/site/bin:$PATH PYTHONPATH=.:${PYTHONPATH:-}
read -r -a model <<< "${SPEC_MODEL_ARGS:---model benchmarks/workloads/smollm2-135m --dummy --ignore-eos}"
bench=(python3 benchmarks/spec_decode_bench.py --mode ngram "${model[@]}" --batches 1 --requests 8 --max-tokens 256)
for s in on off; do
    timeout 200 py-spy record --idle --threads --rate 1000 --nonblocking --format raw -o "$OUT/pyspy_$s.txt" -- \
        "${bench[@]}" --spec "$s" > "$OUT/pyspy_$s.log" 2>&1
    grep -E "^ngram" "$OUT/pyspy_$s.log"
done
SPEC_TORCH_PROFILE=1 timeout 200 "${bench[@]}" --spec on --cprofile "$OUT/prof" > "$OUT/torchprof.log" 2>&1
grep -E "^ngram" "$OUT/torchprof.log"
timeout 300 python3 benchmarks/spec_decode_bench.py --mode draft8b --dummy --spec on --force-accept 0.8 --batches 1 \
    --requests 2 --max-tokens 64 --ignore-eos --cprofile "$OUT/prof8b" > "$OUT/draft8b.log" 2>&1
grep -E "^draft8b" "$OUT/draft8b.log"
