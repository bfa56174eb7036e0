#!/usr/bin/env bash
# GPU check, run on the device machine from the repo root:  bash benchmarks/gpu_check.sh
# Installs carried wheels (.whl/) if present, runs the GPU tests (pytest -m gpu tests/gpu) and the
# attention microbenchmark, writes logs + JSON under $OUT, and prints a short table last.
#   GPU_CHECK_TESTS=0   skip the tests        GPU_CHECK_BENCH=0   skip the microbenchmark
#   GPU_CHECK_BENCH_ARGS="--quick"            extra microbenchmark arguments
set -uo pipefail
OUT=${OUT:-/tmp/pagedllm_gpu_check}
mkdir -p "$OUT"
. "$(dirname "$0")/device_wheels.sh" && install_wheels
export PYTHONPATH=.:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/device.txt"

tests_rc=-1
if [ "${GPU_CHECK_TESTS:-1}" != "0" ]; then
    xdist=()
    if python3 -c "import xdist" 2>/dev/null; then xdist=(-n 8); fi  # parallel Triton compiles
    python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider -p no:benchmark "${xdist[@]}" --junitxml="$OUT/gpu_tests.xml" 2>&1 \
        | tee "$OUT/gpu_tests.log"
    tests_rc=${PIPESTATUS[0]}
fi

bench_rc=-1
if [ "${GPU_CHECK_BENCH:-1}" != "0" ]; then
    # shellcheck disable=SC2086
    python3 benchmarks/attn_microbench.py --out "$OUT/attn_microbench.json" ${GPU_CHECK_BENCH_ARGS:-} 2>&1 \
        | tee "$OUT/attn_microbench.log"
    bench_rc=${PIPESTATUS[0]}
fi

python3 - "$OUT" "$tests_rc" "$bench_rc" <<'EOF'
import json, os, sys
import xml.etree.ElementTree as ET

out, tests_rc, bench_rc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
summary = {"tests_rc": tests_rc, "bench_rc": bench_rc}
dev = os.path.join(out, "device.txt")
if os.path.exists(dev):
    summary["device"] = open(dev).read().strip()
xml = os.path.join(out, "gpu_tests.xml")
if os.path.exists(xml):
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    a = suite.attrib
    fails = int(a.get("failures", 0)) + int(a.get("errors", 0))
    skipped = int(a.get("skipped", 0))
    summary["tests"] = {"total": int(a.get("tests", 0)), "failed": fails, "skipped": skipped,
                        "passed": int(a.get("tests", 0)) - fails - skipped, "seconds": float(a.get("time", 0))}
bench = os.path.join(out, "attn_microbench.json")
if os.path.exists(bench):
    b = json.load(open(bench))
    summary["floors"] = b.get("floors")
    summary["decode"] = {r["case"]: [round(r["ms"] * 1e3, 1), round(r["GBps"]), round(r["pct_copy"], 1)]
                         for r in b.get("decode", [])}
    summary["prefill_16x1024_TFLOPs"] = {k: round(v["TFLOPs"], 1) for k, v in b.get("prefill_16x1024", {}).items()
                                         if isinstance(v, dict)}
json.dump(summary, open(os.path.join(out, "gpu_check.json"), "w"), indent=1)
print("\n==== gpu_check summary ====")
print("device:", summary.get("device"))
t = summary.get("tests")
if t:
    print(f"tests: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped ({t['seconds']:.0f} s)")
if summary.get("floors"):
    f = summary["floors"]
    print(f"floors: copy {f['copy_GBps']:.0f} GB/s, bf16 matmul {f['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
for k, (us, gbs, pct) in (summary.get("decode") or {}).items():
    print(f"{k:48s} {us:9.1f} us {gbs:6d} GB/s {pct:5.1f}%")
for k, v in (summary.get("prefill_16x1024_TFLOPs") or {}).items():
    print(f"prefill 16x1024 {k:32s} {v:6.1f} TFLOP/s")
print(f"rc: tests {tests_rc}, bench {bench_rc}")
EOF
[ "$tests_rc" -le 0 ] && [ "$bench_rc" -le 0 ]
