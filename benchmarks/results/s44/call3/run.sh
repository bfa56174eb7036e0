. benchmarks/device_wheels.sh && install_wheels .whl >/dev/null 2>&1; export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
t(){ local name=$1; shift; local t0=$SECONDS; timeout "$@" > $OUT/$name.log 2>&1; echo "== $name rc=$? $((SECONDS-t0)) s: $(tail -1 $OUT/$name.log)"; }
t t_early 150 python3 -m pytest -q -m gpu tests/gpu/test_triton_attention.py -k "early_metadata or merge_in_chunks or q8_twin"
t t_fused 80 python3 -m pytest -q -m gpu tests/gpu/test_fused_ops.py -k "rotary or norm"
t w3 330 python3 benchmarks/gguf_gpu.py --skip-gemv --profile --types Q4_1 Q4_K Q8_0 --json $OUT/w3.json --ab \
 PAGEDLLM_ATTN_EARLY=0 PAGEDLLM_NORM_COL_SPLIT=1,PAGEDLLM_ATTN_MERGE_CHUNK=0 PAGEDLLM_ATTN_DECODE_SPLITS=4 \
 TUNED:Q4_1:28672x4096=2/4096/2/1/1 TUNED:Q4_1:4096x4096=2/4096/2/1/1 TUNED:Q4_1:28672x4096=2/4096/2/1/1,TUNED:Q4_1:4096x4096=2/4096/2/1/1 \
 TUNED:Q4_K:28672x4096=2/1024/2/1/1 TUNED:Q4_K:4096x4096=4/4096/4/1/1
grep "^W3\|decode step\|between\|critical" $OUT/w3.log
