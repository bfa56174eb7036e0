. benchmarks/device_wheels.sh && install_wheels .whl >/dev/null 2>&1; export PYTHONPATH=.:$PYTHONPATH
timeout 130 python3 benchmarks/gguf_gpu.py --skip-gemv --types Q4_1 Q4_K --json $OUT/w3.json --ab PAGEDLLM_GRAPH_LOGITS=4 > $OUT/w3.log 2>&1
echo "w3 rc=$?"; grep "^W3\|copy" $OUT/w3.log
timeout 55 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_engine_tiny_gpu.py -k graph_logits > $OUT/t.log 2>&1
echo "test rc=$?"; tail -3 $OUT/t.log
