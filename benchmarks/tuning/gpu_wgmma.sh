#!/usr/bin/env bash
# One device call for the wgmma (sm_90a) tensor-core kernels on the H200: the tensor-core GPU tests
# with them (default on compute capability 9.0) and again with TIGA_NUMBA_WGMMA=0 (the mma.sync
# kernels), compute-sanitizer memcheck and racecheck on a small segments/tails/GQA case, then
# benchmarks/tuning/bench_wgmma.py (shape sweep; wgmma vs mma.sync vs torch SDPA flash table).
# Cubins: carry .tccubin built off-device with
#   TIGA_NUMBA_CACHE_DIR=$PWD/.tccubin python benchmarks/tuning/bench_wgmma.py --build sm_90
#   TIGA_NUMBA_CACHE_DIR=$PWD/.tccubin python -m tiga_numba.cuda.tc.prebuild --jobs 2
#   TIGA_NUMBA_CACHE_DIR=$PWD/.tccubin python benchmarks/tuning/bench_tc_bwd.py --build sm_90
# Usage, from the repository root: bash benchmarks/tuning/gpu_wgmma.sh   (outputs under $OUT)
set -u
. "$(dirname "$0")/gpu_env.sh" gpu_wgmma

for flag in 1 0; do
  stamp "tensor-core GPU tests, TIGA_NUMBA_WGMMA=$flag"
  TIGA_NUMBA_WGMMA=$flag timeout ${WG_TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider tests/test_tc_gpu.py \
    > "$OUT/tests_tc_wgmma$flag.txt" 2>&1
  rc=$?; tail -n 12 "$OUT/tests_tc_wgmma$flag.txt"; stamp "tests rc=$rc"; [ $rc -eq 0 ] || status=1
done

if [ "${WG_SANITIZE:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do sanitize $tool float16 ${WG_SAN_S:-120}; done
fi

stamp "wgmma sweep + table"
timeout ${WG_BENCH_S:-300} python3 benchmarks/tuning/bench_wgmma.py --out "$OUT" ${WG_BENCH_ARGS:-} > "$OUT/bench.txt" 2>&1
rc=$?; grep -v Warning "$OUT/bench.txt" | tail -n 60; stamp "bench rc=$rc"; [ $rc -eq 0 ] || status=1
if [ "${WG_TC_BENCH:-0}" = 1 ]; then
  stamp "bench_tc.py tables, plot, bf16, varlen vs FlexAttention (shipped shapes)"
  timeout ${WG_TC_BENCH_S:-300} python3 benchmarks/bench_tc.py --no-sweep --no-fp32 --out "$OUT" > "$OUT/bench_tc.txt" 2>&1
  rc=$?; grep -v Warning "$OUT/bench_tc.txt" | tail -n 40; stamp "bench_tc rc=$rc"; [ $rc -eq 0 ] || status=1
fi
echo "status=$status"
exit $status
