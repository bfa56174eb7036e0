. benchmarks/device_wheels.sh && install_wheels .whl >/dev/null 2>&1; export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 400 python3 benchmarks/gguf_gpu.py --skip-gemv --profile --profile-ab --types Q4_1 Q4_K Q8_0 --json $OUT/w3.json --ab \
  PAGEDLLM_GGUF_GEMV_TAIL_TRIGGER=1 > $OUT/w3.log 2>&1
echo "rc=$?"; grep "^W3\|copy" $OUT/w3.log; grep -A9 "critical path per" $OUT/w3.log | grep -v "critical path per" | head -80
