. benchmarks/device_wheels.sh && install_wheels .whl >/dev/null 2>&1; export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 420 python3 benchmarks/gguf_gpu.py --skip-gemv --profile --types Q4_1 Q4_K --json $OUT/w3.json --ab \
  PAGEDLLM_PDL_EARLY=norm,silu,rope,attn,gemv,push,recv,pull PAGEDLLM_ATTN_DECODE_SPLITS=4 > $OUT/w3.log 2>&1
echo "rc=$?"; grep "^W3\|copy\|us/step\|critical\|decode step\|between" $OUT/w3.log | head -150
