#!/usr/bin/env bash
# One device call for the tensor-core backward (H200): the tensor-core GPU tests, compute-sanitizer
# memcheck and racecheck on the backward kernels (small segments/tails/GQA case, fp16 and float32),
# then the fused-vs-two-kernel A/B table (benchmarks/tuning/bench_tc_bwd.py) with torch SDPA as the anchor.
# Cubins: carry .tccubin built off-device with
#   TIGA_NUMBA_CACHE_DIR=$PWD/.tccubin python benchmarks/tuning/bench_tc_bwd.py --build sm_90
#   TIGA_NUMBA_CACHE_DIR=$PWD/.tccubin python -m tiga_numba.cuda.tc.prebuild --dtypes bfloat16
# Usage, from the repository root: bash benchmarks/tuning/gpu_bwd.sh   (outputs under $OUT)
set -u
. "$(dirname "$0")/gpu_env.sh" gpu_bwd

stamp "tensor-core GPU tests"
timeout ${BWD_TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider tests/test_tc_gpu.py > "$OUT/tests_tc.txt" 2>&1
rc=$?; tail -n 15 "$OUT/tests_tc.txt"; stamp "tests rc=$rc"; [ $rc -eq 0 ] || status=1

if [ "${BWD_SANITIZE:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    stamp "compute-sanitizer $tool"
    timeout ${BWD_SAN_S:-100} compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 9 \
      --print-limit 20 python3 benchmarks/bench_tc.py --sanitize --sanitize-dtypes float16,float32 \
      > "$OUT/sanitize_$tool.txt" 2>&1
    rc=$?; tail -n 6 "$OUT/sanitize_$tool.txt"; stamp "$tool rc=$rc"; [ $rc -eq 0 ] || status=1
  done
fi

stamp "backward A/B"
timeout ${BWD_BENCH_S:-240} python3 benchmarks/tuning/bench_tc_bwd.py --dtypes ${BWD_DTYPES:-float16,float32} \
  --N ${BWD_N:-4096,16384} > "$OUT/bwd_ab.txt" 2>&1
rc=$?; cat "$OUT/bwd_ab.txt" | grep -v Warning | tail -n 40; stamp "A/B rc=$rc"; [ $rc -eq 0 ] || status=1
echo "status=$status"
exit $status
