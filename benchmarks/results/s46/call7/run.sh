. benchmarks/device_wheels.sh && install_wheels .whl >/dev/null 2>&1; export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader; grep -m1 "model name" /proc/cpuinfo; uptime
timeout 200 python3 benchmarks/gguf_gpu.py --skip-gemv --profile --types Q4_K Q4_1 Q4_K --json $OUT/w3.json > $OUT/w3.log 2>&1
echo "w3 rc=$?"; grep "^W3\|copy\|decode step\|between" $OUT/w3.log | cut -c1-120
