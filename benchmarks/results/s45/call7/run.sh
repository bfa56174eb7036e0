. benchmarks/device_wheels.sh && install_wheels .whl >/dev/null 2>&1; export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 benchmarks/gguf_gpu.py --skip-gemv --profile --types Q4_1 Q4_K Q8_0 --json $OUT/w3.json > $OUT/w3.log 2>&1
echo "w3 rc=$?"; grep "^W3\|copy" $OUT/w3.log; grep -A7 "critical path per" $OUT/w3.log | grep -v "critical path per\|Captured\|INFO" | head -40
timeout 75 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gguf_gpu.py -k "int8 or cuda_graph" > $OUT/t_gguf.log 2>&1
echo "tests rc=$?"; tail -3 $OUT/t_gguf.log
