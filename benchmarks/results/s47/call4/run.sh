. benchmarks/device_wheels.sh && install_wheels .whl >/dev/null 2>&1; export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader; uptime
S1=PAGEDLLM_QKV_ROPE=1,PAGEDLLM_ATTN_LATE_TRIGGER=1
S2=$S1,PAGEDLLM_ATTN_ONE_ROW_TILE_N=32
timeout 330 python3 benchmarks/gguf_gpu.py --skip-gemv --types Q4_1 Q4_K Q8_0 --json $OUT/w3.json --ab $S1 $S2 $S2,TUNED:Q4_K:4096x4096=2/4096/2/1/1/4 PAGEDLLM_ATTN_LATE_TRIGGER=1,PAGEDLLM_ATTN_ONE_ROW_TILE_N=32 > $OUT/w3.log 2>&1
echo "w3 rc=$?"; grep "^W3\|copy" $OUT/w3.log
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_triton_attention.py -k "one_row_tile" > $OUT/t.log 2>&1
echo "test rc=$?"; tail -3 $OUT/t.log
cp .device_s47.sh $OUT/run.sh
