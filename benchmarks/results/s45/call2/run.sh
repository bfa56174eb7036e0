. benchmarks/device_wheels.sh && install_wheels .whl >/dev/null 2>&1; export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gguf_ring_gpu.py -x > $OUT/t_ring.log 2>&1
echo "tests rc=$?"; tail -25 $OUT/t_ring.log
timeout 330 python3 benchmarks/gguf_gpu.py --skip-gemv --profile --profile-ab --types Q4_1 Q4_K --json $OUT/w3.json --ab \
  PAGEDLLM_GGUF_RING=1 PAGEDLLM_GGUF_RING=1,PAGEDLLM_GGUF_RING_TRIGGER=2 PAGEDLLM_GGUF_RING=8/1024/12/4/2 PAGEDLLM_GGUF_RING=4/1024/8/4/3 > $OUT/w3.log 2>&1
echo "rc=$?"; grep "^W3\|copy\|critical path per\|decode step\|between\|  .*us/step  _" $OUT/w3.log | head -200
