. benchmarks/device_wheels.sh && install_wheels .whl >/dev/null 2>&1; export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 175 python3 benchmarks/gguf_gpu.py --skip-gemv --types Q4_1 Q4_K Q8_0 --json $OUT/w3.json --ab \
 TUNED:Q4_1:28672x4096=2/1024/2/1/1,TUNED:Q4_1:4096x4096=4/1024/2/1/1 TUNED:Q4_K:4096x4096=4/1024/2/1/1 > $OUT/w3.log 2>&1
echo "rc=$?"; grep "^W3\|copy" $OUT/w3.log
