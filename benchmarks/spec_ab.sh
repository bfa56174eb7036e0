#!/usr/bin/env bash
# Same-lease A/B of n-gram speculation on the real SmolLM2 (issue 23): `spec_decode_bench.py --spec on` on the code
# before a change (BEFORE, default .carry_before; made with `git archive REV | tar -x -C .carry_before`) and on this
# tree, alternately, with the plain baseline (`--spec off`, this tree) in between; each side in its own process.
#   bash benchmarks/spec_ab.sh [ROUNDS]     (the GGUF staged first: benchmarks/gguf_parts.sh; carry .whl)
# SPEC_SIDES overrides the order (entries: before, after, off); SPEC_ARGS passes more bench options. A side may
# carry environment settings for its run alone: `after@PAGEDLLM_ROWS_GEMV_MAX_M=0` (several: comma-separated).
# SPEC_MODEL: the target (a file or a model folder; with a folder of dummy weights add --dummy to SPEC_ARGS).
set -uo pipefail
OUT=${OUT:-/tmp/pagedllm_spec_ab}
mkdir -p "$OUT"
. "$(dirname "$0")/device_wheels.sh" && install_wheels .whl
root=$PWD
BEFORE=${BEFORE:-$root/.carry_before}
model=${SPEC_MODEL:-/tmp/smollm2.gguf}
[ -e "$model" ] || { echo "spec_ab: no $model"; exit 1; }
[[ $model == /* ]] || model=$root/$model  # (the before side runs from its own folder)
i=0
for round in $(seq 1 "${1:-2}"); do
    for side in ${SPEC_SIDES:-off before after}; do
        i=$((i + 1))
        envs=()
        [[ $side == *@* ]] && IFS=, read -r -a envs <<< "${side#*@}"
        side=${side%%@*}
        dir=$root spec=on
        case $side in before) dir=$BEFORE ;; off) spec=off ;; esac
        (cd "$dir" && env "${envs[@]}" PYTHONPATH=.:${PYTHONPATH:-} timeout 240 python3 benchmarks/spec_decode_bench.py \
            --mode ngram --model "$model" --batches 1,16 --spec "$spec" --out "$OUT/${i}_$side.json" \
            ${SPEC_ARGS:-} > "$OUT/${i}_$side.log" 2>&1)
        echo "== run $i ($side ${envs[*]}): rc $?"
        grep -E "^ngram " "$OUT/${i}_$side.log" | sed "s/^/$side $i: /"
    done
done
