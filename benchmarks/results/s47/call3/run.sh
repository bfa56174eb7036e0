. benchmarks/device_wheels.sh && install_wheels .whl >/dev/null 2>&1; export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader; uptime
O=TUNED:Q4_1:4096x4096=2/4096/2/1/1/0
timeout 360 python3 benchmarks/gguf_gpu.py --skip-gemv --profile --profile-ab --types Q4_1 Q4_K --json $OUT/w3.json --ab PAGEDLLM_ATTN_LATE_TRIGGER=1 PAGEDLLM_ATTN_LATE_TRIGGER=1,$O PAGEDLLM_ATTN_DECODE_TILE_N=64 PAGEDLLM_ATTN_DECODE_TILE_N=32 PAGEDLLM_QKV_ROPE=1,PAGEDLLM_ATTN_LATE_TRIGGER=1 > $OUT/w3.log 2>&1
echo "w3 rc=$?"; grep "^W3\|copy" $OUT/w3.log
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_triton_attention.py -k "early_metadata or q8_twin or tile_overrides" > $OUT/t.log 2>&1
echo "test rc=$?"; tail -3 $OUT/t.log
cp .device_s47.sh $OUT/run.sh
