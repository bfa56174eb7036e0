. benchmarks/device_wheels.sh && install_wheels .whl >/dev/null 2>&1; export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 benchmarks/gguf_gpu.py --skip-gemv --profile --types Q4_1 Q4_K Q8_0 --json $OUT/w3.json > $OUT/w3.log 2>&1
echo "w3 rc=$?"; grep "^W3\|copy" $OUT/w3.log; grep -A10 "critical path per" $OUT/w3.log | grep -v "critical path per\|Captured\|INFO" | head -60
E2E_CORRECTNESS=0 OUT=$OUT/e2e timeout 110 bash benchmarks/gpu_e2e.sh run W1 > $OUT/w1.log 2>&1; echo "w1 rc=$?"; grep "^W1:" $OUT/w1.log | head -2
pkill -9 -f "[m]ultiprocessing.spawn|[m]ultiprocessing.resource_tracker"; sleep 2
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_fused_ops.py -k "norm" > $OUT/t_norm.log 2>&1
echo "tests rc=$?"; tail -3 $OUT/t_norm.log
