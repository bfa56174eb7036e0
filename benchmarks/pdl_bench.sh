#!/usr/bin/env bash
# Programmatic dependent launch (pagedllm/triton_utils.py: PAGEDLLM_PDL=1 / early / 0) on the GPU, in
# one device call: the bit-equality check (benchmarks/pdl_check.py), then A/B timings per step.
#   bash benchmarks/pdl_bench.sh [STEPS...]   (carry .whl, and .whl_serve on a multi-GPU kind)
# STEPS (default: check W3 W3tp2@1 W3tp2@0 check2):
#   check / check2   pdl_check.py at tp=1 / tp=2 (bf16 dummy Llama-3.1-8B; PDL on == off, tokens and logprobs)
#   checkfp8         pdl_check.py with --quantization fp8 (the FP8 GEMV and its twins)
#   det2 / det2on    pdl_check.py at tp=2, PDL off twice / on twice (whether tp=2 repeats itself at all)
#   W3               W3 at tp=1: the default, PDL off, and each of PDL_VARIANTS (ENV=VALUE each, commas between the
#                    settings of one variant; default PAGEDLLM_PDL=early)
#   W3@M / W3tp2@M   W3 at tp=1 / tp=2 with PAGEDLLM_PDL=M alone (one engine per step)
#   check@M/check2@M pdl_check.py at tp=1 / tp=2, PAGEDLLM_PDL=M against 0
#   W3fp8            W3-FP8 (benchmarks/quant_bench.sh) with PDL on, then off
# Results under $OUT; summary last.
set -uo pipefail
OUT=${OUT:-/tmp/pagedllm_pdl}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # (the machine's rule)
. "$(dirname "$0")/device_wheels.sh" && install_wheels .whl .whl_serve >/dev/null 2>&1
export PYTHONPATH=.:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
ngpu=$(nvidia-smi -L | wc -l)
summary="$OUT/summary_pdl.txt"
echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$ngpu: ${*:-default}" >> "$summary"
w3() {  # name, extra engine flags, variants (gpu_e2e.sh specs)
    local name=$1 extra=$2
    shift 2
    OUT="$OUT/$name" E2E_CORRECTNESS=0 E2E_EXTRA="$extra" timeout "${STEP_TIMEOUT:-300}" \
        bash benchmarks/gpu_e2e.sh run "$@" > "$OUT/$name.log" 2>&1
    grep -E "Error|error:" "$OUT/$name/bench.log" | sort | uniq -c | head -5 | tee -a "$summary"
    grep "Time per output" "$OUT/$name/summary.txt" | sed "s/^/$name: /" | cut -c1-150 | tee -a "$summary"
}
for step in ${*:-check W3 W3tp2@1 W3tp2@0 check2}; do
    t0=$SECONDS
    case $step in
        check) timeout 300 python3 benchmarks/pdl_check.py 2>&1 | grep -E "^pdl_check|Error" | tee -a "$summary" ;;
        check2) [ "$ngpu" -ge 2 ] && timeout 300 python3 benchmarks/pdl_check.py --tp 2 2>&1 \
            | grep -E "^pdl_check|Error" | tee -a "$summary" ;;
        det2|det2on) v=0; [ "$step" = det2on ] && v=1
            [ "$ngpu" -ge 2 ] && timeout 300 python3 benchmarks/pdl_check.py --tp 2 --a PAGEDLLM_PDL=$v --b PAGEDLLM_PDL=$v \
                2>&1 | grep -E "^pdl_check|Error" | tee -a "$summary" ;;
        checkfp8) timeout 300 python3 benchmarks/pdl_check.py --quantization fp8 2>&1 \
            | grep -E "^pdl_check|Error" | tee -a "$summary" ;;
        W3|W3@*)  # W3: the default, PDL off and each of PDL_VARIANTS; W3@MODE: PAGEDLLM_PDL=MODE alone
            if [ "$step" = W3 ]; then
                variants=(W3 W3@PAGEDLLM_PDL=0)
                for v in ${PDL_VARIANTS:-PAGEDLLM_PDL=early}; do variants+=("W3@$v"); done
            else
                variants=("W3@PAGEDLLM_PDL=${step#W3@}")
            fi
            w3 "W3_tp1_${step#W3@}" "" "${variants[@]}" ;;
        W3tp2@*)  # one tp=2 engine per step (a third engine in one gpu_e2e.sh call failed twice: the previous
            # run's workers still held the GPUs)
            [ "$ngpu" -ge 2 ] && w3 "W3_tp2_${step#W3tp2@}" "--tensor-parallel-size 2" "W3@PAGEDLLM_PDL=${step#W3tp2@}" ;;
        check@*) timeout 300 python3 benchmarks/pdl_check.py --a "PAGEDLLM_PDL=${step#check@}" 2>&1 \
            | grep -E "^pdl_check|Error" | tee -a "$summary" ;;
        check2@*) [ "$ngpu" -ge 2 ] && timeout 300 python3 benchmarks/pdl_check.py --tp 2 --a "PAGEDLLM_PDL=${step#check2@}" \
            2>&1 | grep -E "^pdl_check|Error" | tee -a "$summary" ;;
        W3fp8)
            for pdl in ${FP8_PDL:-1 0}; do
                PAGEDLLM_PDL=$pdl OUT="$OUT/fp8_pdl$pdl" timeout 200 bash benchmarks/quant_bench.sh W3-FP8 > /dev/null 2>&1
                python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(f'W3-FP8 PDL=$pdl: {r[\"time_per_output_token_ms\"]:.3f} ms')" \
                    "$OUT/fp8_pdl$pdl/W3-FP8.json" 2>&1 | tail -1 | tee -a "$summary"
            done ;;
    esac
    pkill -9 -f "python3 -m pagedllm|multiprocessing.spawn|multiprocessing.resource_tracker" && sleep 3
    echo "($step: $((SECONDS - t0)) s)" >> "$summary"
done
echo "==== summary ===="
cat "$summary"
