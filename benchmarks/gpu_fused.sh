#!/usr/bin/env bash
# One device call for the fused wgmma backward (16-bit, sm_90a: dK/dV/dQ in one kernel, dQ units as st
# chains, ordered or float-atomic dQ accumulation): its GPU tests, compute-sanitizer memcheck and
# racecheck over every candidate shape (bench_tc_bwd.py --wgmma --sanitize: segments with length-0/1
# blocks, tails, GQA), then the A/B benchmark against the shipped two-kernel wgmma backward and torch
# SDPA flash (bench_tc_bwd.py --wgmma).
# Cubins: carry .tccubin built off-device with
#   TIGA_NUMBA_CACHE_DIR=$PWD/.tccubin python benchmarks/bench_tc_bwd.py --wgmma --dtypes float16 --build sm_90
#   TIGA_NUMBA_CACHE_DIR=$PWD/.tccubin python -m tiga_numba.cuda.tc.prebuild --jobs 2
# Usage: FU_TESTS=1 FU_SANITIZE=1 FU_BENCH_ARGS="--N 16384" bash benchmarks/gpu_fused.sh   (outputs under $OUT)
set -u
. "$(dirname "$0")/gpu_env.sh" gpu_fused

if [ "${FU_TESTS:-1}" = 1 ]; then
  stamp "GPU tests -k ${FU_K:-wgmma_fused}"
  timeout ${FU_TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider tests/test_tc_gpu.py -k "${FU_K:-wgmma_fused}" \
    > "$OUT/tests.txt" 2>&1
  rc=$?; tail -n 15 "$OUT/tests.txt"; stamp "tests rc=$rc"; [ $rc -eq 0 ] || status=1
fi
if [ "${FU_SANITIZE:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    sanitize $tool float16 ${FU_SAN_S:-150} benchmarks/bench_tc_bwd.py --wgmma --dtypes float16 \
      --dims ${FU_SAN_DIMS:-32,64,128} --sanitize
  done
fi
if [ "${FU_BENCH:-1}" = 1 ]; then
  stamp "bench_tc_bwd.py --wgmma ${FU_BENCH_ARGS:-}"
  timeout ${FU_BENCH_S:-300} python3 benchmarks/bench_tc_bwd.py --wgmma --dtypes float16 ${FU_BENCH_ARGS:-} > "$OUT/bench.txt" 2>&1
  rc=$?; grep -v Warning "$OUT/bench.txt" | tail -n 30; stamp "bench rc=$rc"; [ $rc -eq 0 ] || status=1
fi
echo "status=$status"
exit $status
