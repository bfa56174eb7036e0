#!/usr/bin/env bash
# Issue 25 on a multi-GPU device machine (nvidia-h200-x2 / -x4): every run of the issue, by step name.
#   bash benchmarks/multi_gpu.sh part1 STEPS...   (carry .gguf/part1 and .whl: copies the GGUF's first part)
#   bash benchmarks/multi_gpu.sh run STEPS...     (carry .gguf/part2, .whl and .whl_serve; within 30 s of part1)
# STEPS (default: ar tests W3 W2 S2):
#   ar     NCCL vs one-shot all-reduce per decode step, copy bandwidth and matmul rate (allreduce_bench.py)
#   tiny   tests/gpu/test_parallel_gpu.py, tiny float32 checkpoints only
#   tests  tests/gpu/test_parallel_gpu.py, all (the SmolLM2 bf16 part needs the GGUF: `run` after `part1`)
#   kernels  the decode path's kernel tests (fused ops, attention, quantized GEMVs, FP8 twin) and the two-rank
#          reductions' tests
#   W3     W3 at tp=1, tp=2 (the default: all-reduce fused with add + RMSNorm), tp=2 with each of TP_AR (other
#          PAGEDLLM_TP_ALLREDUCE values, default "nccl") and of W3_VARIANTS (ENV=VALUE each), the same at tp=4
#          where 4 GPUs
#   W2     W2 at tp=1, tp=2 (default, then NCCL alone), pp=2
#   W2tp4  W2 at tp=4 (4 GPUs);  W3tp4  W3 at tp=4 alone (4 GPUs);  W2pp  W2 at pp=2 alone
#   W2tp   W2 at tp=1 and tp=2 (default, then each of W2_VARIANTS, ENV=VALUE each; default NCCL alone) only
#   prof   a W3-shaped decode profiled at tp=2 and tp=1 (tp_step_profile.py)
#   ovb    a prefill GEMM and its all-reduce overlapped or not (overlap_bench.py), with NCCL's defaults, its stream
#          at high priority, and 4 channels
#   ce     the copy-engine prefill path (distributed/ce_allreduce.py): its two-GPU test, then overlap_bench.py
#          --ce-only for each of CE_CHUNKS (default "2 4")
#   W2ce   W2 at tp=1 and tp=2 with the copy-engine prefill path (default) and without (PAGEDLLM_TP_CE_PREFILL=0)
#   W3log  W3 at tp=2 with PAGEDLLM_TP_ALLREDUCE=symm, the log kept
#   S2     S2 served at rate inf: one engine core, then --data-parallel-size 2 (each with S2_API API servers)
#   pdl@SPEC / pdl2@SPEC   benchmarks/pdl_check.py at tp=1 / tp=2: run A with SPEC against PDL off (greedy tokens
#          and logprobs bit for bit; programmatic dependent launch, pagedllm/triton_utils.py; the PDL-off run is
#          made once a call and reused by the later checks). SPEC: K=V settings separated by ':', or a bare M for
#          PAGEDLLM_PDL=M (pdl2@0: off against off); e.g. to bisect session 38's drift,
#          pdl2@PAGEDLLM_PDL_ROWS=4096:PAGEDLLM_PDL_OFF=pull, pdl2@PAGEDLLM_PDL_ROWS=4096:PAGEDLLM_TP_ALLREDUCE=nccl
#   W3pdl@SPEC / W3tp2pdl@SPEC   W3 at tp=1 / tp=2 with SPEC (as above; one engine per step: a third tp=2 engine in
#          one gpu_e2e.sh call failed twice in session 37, the previous run's workers still holding the GPUs)
#   W3fp8pdl   W3-FP8 (quant_bench.sh) for each PAGEDLLM_PDL value of FP8_PDL (default "1 0")
# Results under $OUT/<step>_<layout>/; a summary last; TAR=1 packs $OUT into $OUT.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/pagedllm_multi_gpu}
mkdir -p "$OUT"
stage=${1:-run}
shift || true
steps=${*:-ar tests W3 W2 S2}
if [ "$stage" = part1 ]; then
    cp .gguf/part1/* /tmp/ || exit 1
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # (the machine's rule)
. "$(dirname "$0")/device_wheels.sh" && install_wheels .whl .whl_serve
export PYTHONPATH=.:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
ngpu=$(nvidia-smi -L | wc -l)
summary="$OUT/summary_multi.txt"
echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$ngpu, stage $stage: $steps" >> "$summary"
if [ "$stage" = run ] && [ -f /tmp/smol.part00 ] && [ -d .gguf/part2 ]; then
    cat /tmp/smol.part00 .gguf/part2/smol.part01 > /tmp/smollm2.gguf
    if [ "$(sha256sum /tmp/smollm2.gguf | cut -d' ' -f1)" = "$(cat .gguf/part2/sha256)" ]; then
        export PAGEDLLM_DEFAULT_MODEL=/tmp/smollm2.gguf
    else
        echo "GGUF sha256 mismatch" >> "$summary"
    fi
fi
e2e() {  # name, extra engine flags, workloads (gpu_e2e.sh), into $OUT/name
    local name=$1 extra=$2
    shift 2
    OUT="$OUT/$name" E2E_CORRECTNESS=0 E2E_EXTRA="$extra" timeout "${STEP_TIMEOUT:-500}" bash benchmarks/gpu_e2e.sh run "$@" > "$OUT/$name.log" 2>&1
    sed "s/^/$name: /" "$OUT/$name/summary.txt" | grep -v "correctness skipped" | tee -a "$summary"
}
pdl_spec() {  # a pdl / W3pdl step's SPEC as comma-joined K=V settings: a bare M means PAGEDLLM_PDL=M
    case $1 in *=*) echo "$1" | tr ':' ',' ;; *) echo "PAGEDLLM_PDL=$1" ;; esac
}
for step in $steps; do
    t0=$SECONDS
    case $step in
        ar)
            for w in 2 4; do
                [ "$ngpu" -ge $w ] || continue
                timeout 300 python3 benchmarks/allreduce_bench.py --world $w --json "$OUT/allreduce_x$w.json" 2>&1 \
                    | grep -E "unavailable|GB/s|KiB|batch 1" | tee -a "$summary"
            done ;;
        tiny|tests)
            sel=(-k "${TESTS_K:-}"); [ "$step" = tiny ] && sel=(-k "tiny ${TESTS_K:+and ($TESTS_K)}")
            timeout "${STEP_TIMEOUT:-560}" python3 -m pytest -m gpu tests/gpu/test_parallel_gpu.py -q -s -p no:cacheprovider "${sel[@]}" \
                > "$OUT/tests_$step.log" 2>&1
            echo "tests ($step) rc $?: $(tail -1 "$OUT/tests_$step.log")" | tee -a "$summary"
            grep -E "^(SmolLM2|llama|qwen3) " "$OUT/tests_$step.log" | cut -c1-240 | tee -a "$summary" ;;
        kernels)  # the single-GPU kernel tests of the decode path and the two-rank reductions (PDL on)
            timeout "${KERNELS_TIMEOUT:-420}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_fused_allreduce_norm_gpu.py \
                tests/gpu/test_ce_allreduce_gpu.py tests/gpu/test_fused_ops.py tests/gpu/test_act_twin_gpu.py \
                tests/gpu/test_quant_gpu.py tests/gpu/test_triton_attention.py > "$OUT/tests_kernels.log" 2>&1
            echo "tests (kernels) rc $?: $(tail -1 "$OUT/tests_kernels.log")" | tee -a "$summary"
            grep -E "^(FAILED|ERROR)" "$OUT/tests_kernels.log" | head -20 | tee -a "$summary" ;;
        W3)
            [ -z "${SKIP_TP1:-}" ] && e2e W3_tp1 "" W3
            variants=(); for v in ${TP_AR:-nccl}; do variants+=("W3@PAGEDLLM_TP_ALLREDUCE=$v"); done
            for v in ${W3_VARIANTS:-}; do variants+=("W3@$v"); done  # e.g. W3_VARIANTS=PAGEDLLM_TP_PUSH=0
            e2e W3_tp2 "--tensor-parallel-size 2" W3 "${variants[@]}"
            [ "$ngpu" -ge 4 ] && e2e W3_tp4 "--tensor-parallel-size 4" W3 "${variants[@]}" ;;
        W2)
            e2e W2_tp1 "" W2
            e2e W2_tp2 "--tensor-parallel-size 2" W2 W2@PAGEDLLM_TP_ALLREDUCE=nccl
            e2e W2_pp2 "--pipeline-parallel-size 2" W2 ;;
        W2tp|W2ce)  # W2_VARIANTS: the tp=2 runs after the default (W2tp: NCCL alone; W2ce: the copy-engine path off)
            [ -z "${SKIP_TP1:-}" ] && e2e W2_tp1 "" W2
            dflt=PAGEDLLM_TP_ALLREDUCE=nccl sfx=""; [ "$step" = W2ce ] && dflt=PAGEDLLM_TP_CE_PREFILL=0 sfx=_ce
            variants=(); for v in ${W2_VARIANTS:-$dflt}; do variants+=("W2@$v"); done
            e2e "W2_tp2$sfx" "--tensor-parallel-size 2" W2 "${variants[@]}" ;;
        prof)  # where a tp=2 / tp=1 W3 decode step's time goes (GPU busy vs idle, top kernels)
            for tp in ${PROF_TPS:-2 2symm 1}; do  # 2symm: tp=2 with the one-shot all-reduce (PAGEDLLM_TP_ALLREDUCE=symm)
                # (PAGEDLLM_TP_ALLREDUCE set only for 2symm: an empty value is not "fused", and turned the fused
                # all-reduce off in every tp=2 profile before session 35)
                ar_env=(); [ "$tp" = 2symm ] && ar_env=(PAGEDLLM_TP_ALLREDUCE=symm)
                echo "-- prof tp=$tp" >> "$summary"
                env "${ar_env[@]}" timeout "${STEP_TIMEOUT:-300}" \
                    python3 benchmarks/tp_step_profile.py --tp "${tp%symm}" --json "$OUT/prof_tp$tp.json" \
                    2>&1 | grep -v "^INFO" | tail -32 | tee -a "$summary"
            done ;;
        ovb)
            for setting in NONE=1 TORCH_NCCL_HIGH_PRIORITY=1 NCCL_MAX_NCHANNELS=4; do
                env "$setting" timeout 200 python3 benchmarks/overlap_bench.py --world 2 --no-ce \
                    --json "$OUT/overlap_${setting%%=*}.json" 2>&1 | grep -E "x2|proj|Error" | tee -a "$summary"
            done ;;
        ce)
            timeout 400 python3 -m pytest -m gpu tests/gpu/test_ce_allreduce_gpu.py -q -p no:cacheprovider \
                > "$OUT/tests_ce.log" 2>&1
            echo "tests (ce) rc $?: $(tail -1 "$OUT/tests_ce.log")" | tee -a "$summary"
            for c in ${CE_CHUNKS:-2 4}; do
                timeout 200 python3 benchmarks/overlap_bench.py --world 2 --ce-only --chunks "$c" \
                    --json "$OUT/overlap_ce_c$c.json" 2>&1 | grep -E "x2|proj|unavailable|Error" | tee -a "$summary"
            done ;;
        W2tp4) [ "$ngpu" -ge 4 ] && e2e W2_tp4 "--tensor-parallel-size 4" W2 ;;
        W3tp4) [ "$ngpu" -ge 4 ] && e2e W3_tp4 "--tensor-parallel-size 4" W3 ;;
        W2pp) e2e W2_pp2 "--pipeline-parallel-size 2" W2 ;;
        W3log)  # W3 at tp=2 with the one-shot all-reduce, the whole log kept (which all-reduce the workers use)
            PAGEDLLM_TP_ALLREDUCE=symm timeout "${STEP_TIMEOUT:-300}" python3 -m pagedllm bench latency \
                --model benchmarks/workloads/llama-3.1-8b --load-format dummy --batch-size 1 --input-len 128 \
                --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 1024 --tensor-parallel-size 2 \
                > "$OUT/W3log.log" 2>&1
            grep -E "tensor parallel|Time per output|Error" "$OUT/W3log.log" | sort | uniq -c | cut -c1-250 | tee -a "$summary" ;;
        S2)  # S2_API: the --api-server-count values to run, each at dp=1 and dp=2
            for api in ${S2_API:-1}; do
                for dp in 1 2; do
                    name=S2_dp${dp}_api$api
                    OUT="$OUT/$name" SERVE_ARGS="--data-parallel-size $dp --api-server-count $api" \
                        timeout "${STEP_TIMEOUT:-400}" bash benchmarks/serve_bench.sh S2:inf > "$OUT/$name.log" 2>&1
                    grep -E -i "server up|output token throughput|P50 TPOT|rc " "$OUT/$name/summary.txt" \
                        | sed "s/^/S2 dp=$dp api=$api: /" | tee -a "$summary"
                done
            done ;;
        pdl@*|pdl2@*)
            tp=1; [ "${step%%@*}" = pdl2 ] && tp=2
            [ "$ngpu" -ge $tp ] && timeout 300 python3 benchmarks/pdl_check.py --tp $tp --a "$(pdl_spec "${step#*@}")" \
                --reuse-b "$OUT/pdl_ref" 2>&1 | grep -E "^pdl_check|Error" | tee -a "$summary" ;;
        W3pdl@*) e2e "W3_tp1_pdl${step#*@}" "" "W3@$(pdl_spec "${step#*@}")" ;;
        W3tp2pdl@*) [ "$ngpu" -ge 2 ] && e2e "W3_tp2_pdl${step#*@}" "--tensor-parallel-size 2" "W3@$(pdl_spec "${step#*@}")" ;;
        W3fp8pdl)
            for pdl in ${FP8_PDL:-1 0}; do
                PAGEDLLM_PDL=$pdl OUT="$OUT/fp8_pdl$pdl" timeout 200 bash benchmarks/quant_bench.sh W3-FP8 > /dev/null 2>&1
                python3 -c "import json,sys; print(f'W3-FP8 PDL=$pdl: {json.load(open(sys.argv[1]))[\"time_per_output_token_ms\"]:.3f} ms')" \
                    "$OUT/fp8_pdl$pdl/W3-FP8.json" 2>&1 | tail -1 | tee -a "$summary"
            done ;;
    esac
    end_step "$step" "$t0" "$summary"
done
echo "==== summary ===="
cat "$summary"
# TAR=1: everything in one file beside $OUT (the device returns at most 8 files a call; logs were lost to it)
if [ -n "${TAR:-}" ]; then
    tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")" && rm -rf "$OUT"
fi
