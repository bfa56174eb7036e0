. benchmarks/device_wheels.sh && install_wheels .whl >/dev/null 2>&1; export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gguf_ring_gpu.py -x -k "pdl or graph or (default and (4096x14336 or 1027x14336 or 333x2048))" > $OUT/t_ring.log 2>&1
echo "tests rc=$?"; tail -3 $OUT/t_ring.log
timeout 380 python3 benchmarks/gguf_gpu.py --skip-gemv --profile --profile-ab --types Q4_1 Q4_K --json $OUT/w3.json --ab \
  PAGEDLLM_GGUF_RING=1 PAGEDLLM_GGUF_RING=16/2048/4/8/2/1 PAGEDLLM_GGUF_RING=16/2048/4/8/2/0 PAGEDLLM_GGUF_RING=16/2048/3/8/2 \
  PAGEDLLM_GGUF_RING=32/2048/3/16/1 > $OUT/w3.log 2>&1
echo "rc=$?"; grep "^W3\|copy" $OUT/w3.log; grep -A10 "critical path per" $OUT/w3.log | grep -v "critical path per\|Captured\|INFO" | head -120
