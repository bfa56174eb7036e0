#!/usr/bin/env bash
# Issue 16 acceptance 5: plain and structured decode steps (64 requests, W1 shape) in alternating processes, one
# per side and round (ROUNDS, default 3). Sides: A and B (this tree with A_ENV / B_ENV, space-separated VAR=value
# lists, and A_ARGS / B_ARGS for structured_overhead.py), and `before` when `.carry_before` exists (the code before
# a change: git archive REV pagedllm benchmarks/structured_overhead.py benchmarks/workloads
# benchmarks/tp_step_profile.py | tar -x -C .carry_before). Carry .whl .whl_serve .smol_tok (.carry_before);
#   OUT=... A_ENV="X=0" B_ENV="X=1" bash benchmarks/structured_ab_env.sh
. benchmarks/device_wheels.sh && install_wheels .whl .whl_serve >/dev/null 2>&1
export PYTHONPATH=.:$PYTHONPATH
root=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
sides="A B"; [ -d .carry_before ] && sides="before A B"
for r in $(seq "${ROUNDS:-3}"); do for side in $sides; do
  dir=$root; envs="X=1"; args=""
  case $side in before) dir=$root/.carry_before ;; A) envs=${A_ENV:-X=1}; args=${A_ARGS:-} ;; B) envs=${B_ENV:-X=1}; args=${B_ARGS:-} ;; esac
  (cd "$dir" && env $envs timeout 120 python3 benchmarks/structured_overhead.py --model benchmarks/workloads/qwen3-0.6b \
    --device cuda --tokenizer "$root/.smol_tok" --quick --cases plain,structured --repeats 5 $args \
    --json "/tmp/so_$side.$r.json" > "$OUT/$side.$r.log" 2>&1)
  echo "$side $r: $(grep -E '^step_ms_(plain|structured):|^structured_overhead_pct' "$OUT/$side.$r.log" | tr '\n' ' ')"
done; done
