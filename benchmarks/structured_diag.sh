#!/usr/bin/env bash
# Issue 16 acceptance 5, diagnosis: structured_ab_env.sh (A_ENV / B_ENV / B_ARGS as there), then per process the
# step times, the loop's wait for sampled ids, the device's stall on the mask flag and the server's time by part.
# (the device's flag stall and the apply by call need A_ARGS / B_ARGS --breakdown, whose CUDA events add host work)
#   OUT=... B_ARGS="--pin 2,3 --server-variants pin:15:0,poll:0-15:50" ROUNDS=4 bash benchmarks/structured_diag.sh
nproc; lscpu | grep -E "Model name|Thread|Core|Socket|NUMA node0"; cat /sys/devices/system/cpu/cpu2/topology/thread_siblings_list /sys/devices/system/cpu/cpu5/topology/thread_siblings_list
mkdir -p "$OUT/ab"
OUT=$OUT/ab bash benchmarks/structured_ab_env.sh
for f in "$OUT"/ab/*.log; do echo "${f##*/}: $(grep -E '^(step_ms_|loop_wait_ms_|flag_wait_ms_|server_[a-z_]+_ms_|so_srv_[a-z]+_ms_per_step:|so_apply[a-z_]*_ms_per_step:|structured.*overhead_pct)' "$f" | grep -v "_runs:\|_min_\|cpu_overhead" | sed "s/_ms_per_step//" | tr "\n" " ")"; done
