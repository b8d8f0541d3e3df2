#!/usr/bin/env bash
# One device call for float32 on the H200's wgmma (bf16 x 3 splits): the tensor-core GPU tests (every
# dtype: the 16-bit wgmma kernels share the chain intrinsic), compute-sanitizer memcheck and racecheck
# on float32 (segments, tails, GQA, pruned forward), then benchmarks/tuning/bench_fp32_wgmma.py (sweep and/or
# the table vs 3xTF32 and torch SDPA efficient fp32).
# Cubins: carry .tccubin built off-device with
#   TIGA_NUMBA_CACHE_DIR=$PWD/.tccubin python benchmarks/tuning/bench_fp32_wgmma.py --build sm_90
#   TIGA_NUMBA_CACHE_DIR=$PWD/.tccubin python -m tiga_numba.cuda.tc.prebuild --jobs 2
# Usage: FP_TESTS=1 FP_SANITIZE=1 FP_BENCH_ARGS="--sweep-only" bash benchmarks/tuning/gpu_fp32.sh   (outputs under $OUT)
set -u
. "$(dirname "$0")/gpu_env.sh" gpu_fp32

if [ "${FP_TESTS:-1}" = 1 ]; then
  stamp "tensor-core GPU tests ${FP_TESTS_K:+(-k $FP_TESTS_K)}"
  timeout ${FP_TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider tests/test_tc_gpu.py ${FP_TESTS_K:+-k "$FP_TESTS_K"} \
    > "$OUT/tests_tc.txt" 2>&1
  rc=$?; tail -n 15 "$OUT/tests_tc.txt"; stamp "tests rc=$rc"; [ $rc -eq 0 ] || status=1
fi
if [ "${FP_SANITIZE:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do sanitize $tool float32 ${FP_SAN_S:-120}; done
fi
if [ "${FP_BENCH:-1}" = 1 ]; then
  stamp "bench_fp32_wgmma.py ${FP_BENCH_ARGS:-}"
  timeout ${FP_BENCH_S:-300} python3 benchmarks/tuning/bench_fp32_wgmma.py --out "$OUT" ${FP_BENCH_ARGS:-} > "$OUT/bench.txt" 2>&1
  rc=$?; grep -v Warning "$OUT/bench.txt" | tail -n 40; stamp "bench rc=$rc"; [ $rc -eq 0 ] || status=1
fi
echo "status=$status"
exit $status
