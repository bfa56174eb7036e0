. benchmarks/device_wheels.sh && install_wheels .whl >/dev/null 2>&1; export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader; uptime
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_triton_attention.py -k "segment_min or q8_twin or early_metadata" > $OUT/t.log 2>&1
echo "test rc=$?"; tail -3 $OUT/t.log
E=PAGEDLLM_PDL_EARLY=norm+silu+rope+attn+push+recv+pull+qkv_rope
timeout 470 python3 benchmarks/gguf_gpu.py --skip-gemv --profile --profile-ab --types Q4_1 Q4_K --json $OUT/w3.json --ab PAGEDLLM_QKV_ROPE=1 PAGEDLLM_QKV_ROPE=1,$E PAGEDLLM_ATTN_SEG_MIN_TILES=4 PAGEDLLM_ATTN_SEG_MIN_TILES=2 PAGEDLLM_QKV_ROPE=1,$E,PAGEDLLM_ATTN_SEG_MIN_TILES=4 > $OUT/w3.log 2>&1
echo "w3 rc=$?"; grep "^W3\|copy" $OUT/w3.log
cp .device_s47.sh $OUT/run.sh
