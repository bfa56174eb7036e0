. benchmarks/device_wheels.sh && install_wheels .whl >/dev/null 2>&1; export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gguf_gpu.py -k "variants or cuda_graph" > $OUT/t_gguf.log 2>&1
echo "tests rc=$?"; tail -4 $OUT/t_gguf.log
Q41="TUNED:Q4_1:6144x4096=4/1024/2/1/1/1,TUNED:Q4_1:4096x4096=2/4096/2/1/1/1,TUNED:Q4_1:28672x4096=2/4096/2/1/1/1,TUNED:Q4_1:4096x14336=1/2048/2/1/1/1,TUNED:Q4_1:128256x4096=4/512/1/1/1/1"
Q41b="TUNED:Q4_1:6144x4096=4/1024/2/1/1/1,TUNED:Q4_1:128256x4096=4/512/1/1/1/1"
K3="TUNED:Q4_K:6144x4096=4/512/1/1/1/3,TUNED:Q4_K:4096x4096=4/4096/4/1/1/3,TUNED:Q4_K:28672x4096=4/512/1/1/1/3,TUNED:Q4_K:4096x14336=1/2048/2/1/1/3,TUNED:Q4_K:128256x4096=4/512/1/1/1/3"
K2="TUNED:Q4_K:6144x4096=4/512/1/1/1/2,TUNED:Q4_K:4096x4096=4/4096/4/1/1/2,TUNED:Q4_K:28672x4096=4/512/1/1/1/2,TUNED:Q4_K:4096x14336=1/2048/2/1/1/2,TUNED:Q4_K:128256x4096=4/512/1/1/1/2"
K3t="TUNED:Q4_K:6144x4096=4/1024/2/1/1/3,TUNED:Q4_K:4096x4096=4/4096/4/1/1/3,TUNED:Q4_K:28672x4096=2/4096/2/1/1/3,TUNED:Q4_K:4096x14336=1/2048/2/1/1/3,TUNED:Q4_K:128256x4096=4/512/1/1/1/3"
Q8="TUNED:Q8_0:6144x4096=2/2048/4/1/1/1,TUNED:Q8_0:4096x4096=2/1024/2/1/1/1,TUNED:Q8_0:28672x4096=1/2048/2/1/1/1,TUNED:Q8_0:4096x14336=1/2048/2/1/1/1,TUNED:Q8_0:128256x4096=1/2048/2/1/1/1"
timeout 400 python3 benchmarks/gguf_gpu.py --skip-gemv --profile --profile-ab --types Q4_1 Q4_K Q8_0 --json $OUT/w3.json --ab "$Q41" "$Q41b" "$K3" "$K2" "$K3t" "$Q8" PAGEDLLM_NORM_SPLIT_WARPS=4 PAGEDLLM_NORM_SPLIT_WARPS=2 > $OUT/w3.log 2>&1
echo "w3 rc=$?"; grep "^W3\|copy" $OUT/w3.log | sed 's/TUNED:Q[0-9_K]*:\([0-9x]*\)=/\1=/g'
grep -B1 -A9 "critical path per" $OUT/w3.log | grep "us/step\|span" | head -120
