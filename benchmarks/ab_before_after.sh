#!/usr/bin/env bash
# Same-lease A/B on the device: workloads of benchmarks/gpu_e2e.sh run on the code before a change
# (`.carry_before`, made here with `git archive REV | tar -x -C .carry_before`, named in `carry`) and on
# this tree, alternately (before, after, before, after for each workload), so machine drift hits both.
#   bash benchmarks/ab_before_after.sh W1 W3 HOST
# Needs `.whl` carried (msgspec, gguf). Prints each run's summary lines; everything else is in $OUT/ab.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/pagedllm_ab}
mkdir -p "$OUT/runs"
. "$(dirname "$0")/device_wheels.sh" && install_wheels
root=$PWD
for w in "${@:-W1 W3}"; do
    for side in before after after_2 before_2; do
        dir=$root
        case $side in before*) dir=$root/.carry_before ;; esac
        [ "$w" = HOST ] && [ "${side%_2}" != "$side" ] && continue  # HOST already runs 3x per side
        run_out="$OUT/runs/${w}_$side"
        mkdir -p "$run_out"
        (cd "$dir" && E2E_CORRECTNESS=0 E2E_TAG="_$side" OUT="$run_out" bash benchmarks/gpu_e2e.sh run "$w" \
            >"$run_out/log.txt" 2>&1)
        sed "s/^/$side: /" "$run_out/summary.txt"
    done
done
tar -czf "$OUT/ab.tgz" -C "$OUT" runs && rm -rf "$OUT/runs"
