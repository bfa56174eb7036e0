. benchmarks/device_wheels.sh && install_wheels .whl >/dev/null 2>&1; export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gguf_ring_gpu.py -x -k "pdl or graph or (default and (4096x14336 or 1027x14336))" > $OUT/t_ring.log 2>&1
echo "tests rc=$?"; tail -3 $OUT/t_ring.log
timeout 420 python3 benchmarks/gguf_gpu.py --skip-gemv --profile --profile-ab --types Q4_1 Q4_K --json $OUT/w3.json --ab \
  PAGEDLLM_GGUF_RING=8/1024/8/8/2 PAGEDLLM_GGUF_RING=16/1024/6/8/2 PAGEDLLM_GGUF_RING=16/2048/4/8/2 PAGEDLLM_GGUF_RING=32/1024/4/8/1 \
  PAGEDLLM_GGUF_RING=16/1024/8/16/1 PAGEDLLM_GGUF_RING=8/1024/6/4/3 PAGEDLLM_GGUF_RING=32/2048/3/16/1 > $OUT/w3.log 2>&1
echo "rc=$?"; grep "^W3\|copy" $OUT/w3.log; grep -B1 -A6 "critical path per" $OUT/w3.log | grep "GEMV\|gemv\|^W3\|attn\|norm\|silu\|rope" | head -150
