#!/usr/bin/env bash
# Issue 16 acceptance 5: plain and structured decode steps in separate processes and in one (the benchmark's
# default, alternating cases), several times on the same machine: OUT=... bash benchmarks/structured_ab_processes.sh
. benchmarks/device_wheels.sh && install_wheels .whl .whl_serve
export PYTHONPATH=.:${PYTHONPATH:-}
for c in ${CASES:-plain structured plain,structured,structured_inline,structured_nodefer,plain_again structured plain}; do
  n=${c//,/_}; timeout 150 python3 benchmarks/structured_overhead.py --model benchmarks/workloads/qwen3-0.6b --device cuda --tokenizer .smol_tok --quick --cases "$c" --repeats 9 --json "$OUT/$n.$RANDOM.json" > "$OUT/$n.log" 2>&1
  echo "== $c"; grep -E "^step_ms_[a-z_]+_runs:|^structured[a-z_]*_overhead_pct" "$OUT/$n.log"
done
nvidia-smi --query-gpu=name --format=csv,noheader
