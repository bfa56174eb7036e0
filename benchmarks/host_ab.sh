#!/usr/bin/env bash
# Host time per step, A/B on the device machine: two source trees (e.g. `git archive` snapshots of two
# commits under .snap/), interleaved runs of benchmarks/host_overhead.py --device cuda (decode CUDA graphs
# capturing the no-op model), so that both see the same machine state. Prints one line per run and a
# table of means and medians last; JSON per run under $OUT.
#   bash benchmarks/host_ab.sh .snap/old .snap/new [runs=3]
set -uo pipefail
OUT=${OUT:-/tmp/pagedllm_host_ab}
mkdir -p "$OUT"
a=$1 b=$2 runs=${3:-3}
. "$(dirname "$0")/device_wheels.sh" && install_wheels
export PYTHONPATH=/tmp/site HOST_BENCH_VOCAB=32 OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
for r in $(seq "$runs"); do
    for tree in "$a" "$b"; do
        tag=$(basename "$tree")_$r
        (cd "$tree" && PYTHONPATH=.:$PYTHONPATH python3 benchmarks/host_overhead.py --device cuda --final-only \
            --steps 400 --json "$OUT/host_$tag.json" 2>&1 | grep -v "^INFO" | tail -1 | sed "s/^/$tag: /")
    done
done
python3 - "$OUT" "$a" "$b" <<'PY'
import glob, json, os, statistics, sys
out, *trees = sys.argv[1:]
print("==== host time per step, 256 decodes, CUDA graphs (ms) ====")
for t in trees:
    runs = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(out, f"host_{os.path.basename(t)}_*.json")))]
    if runs:
        means = [r["mean_ms"] for r in runs]
        meds = [r["median_ms"] for r in runs]
        print(f"{t:16s} mean {statistics.median(means):.3f} (runs {', '.join(f'{m:.3f}' for m in means)}), "
              f"median step {statistics.median(meds):.3f}")
PY
