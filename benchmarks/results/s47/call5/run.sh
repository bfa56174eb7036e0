. benchmarks/device_wheels.sh && install_wheels .whl >/dev/null 2>&1; export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader; uptime
timeout 130 python3 benchmarks/gguf_gpu.py --skip-gemv --profile --types Q4_1 Q4_K Q8_0 --json $OUT/w3.json > $OUT/w3.log 2>&1
echo "w3 rc=$?"; grep "^W3\|copy\|decode step\|between" $OUT/w3.log | cut -c1-150
E2E_CORRECTNESS=0 OUT=$OUT/e2e timeout 110 bash benchmarks/gpu_e2e.sh run W1 > $OUT/w1.log 2>&1
echo "w1 rc=$?"; pkill -9 -f "[m]ultiprocessing.spawn|[m]ultiprocessing.resource_tracker"; tail -4 $OUT/w1.log; cat $OUT/e2e/*summary* 2>/dev/null | tail -5
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_quant_gpu.py -k "fp8_kv" tests/gpu/test_engine_tiny_gpu.py > $OUT/t.log 2>&1
echo "test rc=$?"; tail -3 $OUT/t.log
cp .device_s47.sh $OUT/run.sh
