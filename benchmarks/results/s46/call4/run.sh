. benchmarks/device_wheels.sh && install_wheels .whl >/dev/null 2>&1; export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
QKV=TUNED:Q4_K:6144x4096; O=TUNED:Q4_K:4096x4096; GU=TUNED:Q4_K:28672x4096; DN=TUNED:Q4_K:4096x14336
P=TUNED:Q4_1; E=TUNED:Q8_0
timeout 520 python3 benchmarks/gguf_gpu.py --skip-gemv --profile --types Q4_K Q4_1 Q8_0 --json $OUT/w3.json --ab \
  $QKV=4/512/1/1/1/0,$O=4/4096/4/1/1/0,$GU=4/512/1/1/1/0 $O=2/4096/2/1/1/6 $GU=2/1024/2/1/1/1 $GU=2/2048/2/1/1/3 \
  $GU=1/1024/2/1/1/3 $GU=2/512/1/1/1/3 $DN=1/1024/2/1/1/3 \
  $P:6144x4096=4/1024/2/1/1/0,$P:4096x4096=2/4096/2/1/1/0 $P:28672x4096=2/1024/2/1/1/1 $P:28672x4096=2/1024/2/1/1/0 \
  $P:28672x4096=2/4096/2/1/1/4 $P:4096x14336=1/2048/2/1/1/4 $E:4096x4096=2/1024/2/1/1/4 $E:6144x4096=2/2048/4/1/1/4 > $OUT/w3.log 2>&1
echo "w3 rc=$?"; grep "^W3\|copy" $OUT/w3.log | sed 's/TUNED:Q[0-9_K]*:\([0-9x]*\)=/\1=/g'
grep -A10 "critical path per" $OUT/w3.log | grep "us/step" | head -30
