. benchmarks/device_wheels.sh && install_wheels .whl >/dev/null 2>&1; export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gguf_gpu.py -k "variants" > $OUT/t_gguf.log 2>&1
echo "tests rc=$?"; tail -4 $OUT/t_gguf.log
QKV=TUNED:Q4_K:6144x4096; O=TUNED:Q4_K:4096x4096; GU=TUNED:Q4_K:28672x4096; DN=TUNED:Q4_K:4096x14336; HD=TUNED:Q4_K:128256x4096
timeout 420 python3 benchmarks/gguf_gpu.py --skip-gemv --profile --types Q4_K Q4_1 --json $OUT/w3.json --ab \
  $QKV=4/1024/2/1/1/0 $QKV=4/1024/2/1/1/3 $QKV=4/1024/2/1/1/2 $QKV=2/1024/2/1/1/3 $QKV=4/2048/2/1/1/3 \
  $O=4/4096/4/1/1/2 $O=4/4096/4/1/1/3 $O=4/1024/2/1/1/3 $O=4/4096/4/1/1/4 \
  $GU=2/4096/2/1/1/3 $GU=4/1024/2/1/1/3 $DN=1/2048/2/1/1/2 $DN=1/4096/2/1/1/2 $HD=4/512/1/1/1/3 \
  $QKV=4/1024/2/1/1/3,$O=4/4096/4/1/1/2,$DN=1/2048/2/1/1/2 \
  TUNED:Q4_1:4096x4096=2/4096/2/1/1/4 TUNED:Q4_1:6144x4096=4/1024/2/1/1/4 PAGEDLLM_ATTN_Q8_TWIN=0 > $OUT/w3.log 2>&1
echo "w3 rc=$?"; grep "^W3\|copy" $OUT/w3.log | sed 's/TUNED:Q[0-9_K]*:\([0-9x]*\)=/\1=/g'
grep -A10 "critical path per" $OUT/w3.log | grep "us/step" | head -24
