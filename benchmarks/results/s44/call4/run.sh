. benchmarks/device_wheels.sh && install_wheels .whl >/dev/null 2>&1; export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
t(){ local name=$1; shift; local t0=$SECONDS; timeout "$@" > $OUT/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t0)) s: $(tail -1 $OUT/$name.log)"; }
t w3 220 python3 benchmarks/gguf_gpu.py --types Q4_1 Q4_K Q8_0 --json $OUT/w3.json --ab PAGEDLLM_ATTN_DECODE_SPLITS=4
grep "^W3\|us  floor" $OUT/w3.log
E2E_CORRECTNESS=0 OUT=$OUT/e2e timeout 110 bash benchmarks/gpu_e2e.sh run W1 > $OUT/w1.log 2>&1; echo "== w1 rc=$?"; grep "^W1:" $OUT/w1.log | head -2
pkill -9 -f "[m]ultiprocessing.spawn|[m]ultiprocessing.resource_tracker"; sleep 2
t t_early 110 python3 -m pytest -q -m gpu tests/gpu/test_triton_attention.py -k "early_metadata and dtype1"
