. benchmarks/device_wheels.sh && install_wheels .whl >/dev/null 2>&1; export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 230 python3 benchmarks/gguf_gpu.py --skip-gemv --profile --types Q4_1 Q4_K Q8_0 --json $OUT/w3.json --ab \
  TUNED:Q4_K:4096x14336=1/2048/2/1/1/1 TUNED:Q4_K:128256x4096=2/1024/2/1/1/1 TUNED:Q4_1:128256x4096=2/1024/2/1/1/1 > $OUT/w3.log 2>&1
echo "w3 rc=$?"; grep "^W3\|copy" $OUT/w3.log | sed 's/TUNED:Q[0-9_K]*:\([0-9x]*\)=/\1=/g'
grep -B3 -A11 "critical path per" $OUT/w3.log | grep "us/step\|between" | cut -c1-150 | head -48
timeout 250 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gguf_gpu.py tests/gpu/test_act_twin_gpu.py -k "not engine_packed" > $OUT/t_gguf.log 2>&1
echo "tests rc=$?"; tail -3 $OUT/t_gguf.log
