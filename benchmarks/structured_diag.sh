#!/usr/bin/env bash
# Issue 16 acceptance 5, diagnosis: structured_ab_env.sh (A_ENV / B_ENV / B_ARGS as there), then per process the
# step times, the loop's wait for sampled ids, the device's stall on the mask flag and the server's time by part.
#   OUT=... B_ENV=PAGEDLLM_GRAMMAR_SERVER_CPUS=5 B_ARGS="--pin 2,3" ROUNDS=4 bash benchmarks/structured_diag.sh
nproc; lscpu | grep -E "Model name|Thread|Core|Socket|NUMA node0"; cat /sys/devices/system/cpu/cpu2/topology/thread_siblings_list /sys/devices/system/cpu/cpu5/topology/thread_siblings_list
mkdir -p "$OUT/ab"
OUT=$OUT/ab bash benchmarks/structured_ab_env.sh
for f in "$OUT"/ab/*.log; do echo "${f##*/}: $(grep -E '^(step_ms_plain|step_ms_structured|loop_wait_ms_plain|loop_wait_ms_structured|flag_wait_ms_structured|server_[a-z_]+_ms_structured|so_srv_[a-z]+_ms_per_step|so_apply_ms_per_step):' "$f" | sed 's/_ms_structured//;s/_ms_per_step//' | tr '\n' ' ')"; done
