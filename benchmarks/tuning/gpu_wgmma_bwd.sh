#!/usr/bin/env bash
# One device call for the wgmma backward (sm_90a): the tensor-core GPU tests, compute-sanitizer memcheck
# and racecheck over the backward kernels (bench_tc_bwd.py --wgmma --sanitize: the shipped two-kernel
# backward, its serial A/B twin and the fused dK/dV/dQ candidates on segments with length-0/1 blocks,
# tails, GQA), then bench_tc_bwd.py --wgmma (shipped vs candidates vs torch SDPA, same run).
# Cubins: carry .tccubin built off-device with
#   TIGA_NUMBA_CACHE_DIR=$PWD/.tccubin python benchmarks/tuning/bench_tc_bwd.py --wgmma ... --build sm_90   (each arg set below)
#   TIGA_NUMBA_CACHE_DIR=$PWD/.tccubin python -m tiga_numba.cuda.tc.prebuild --jobs 2
# Knobs: BW_K (pytest -k for tests/test_tc_gpu.py; default all), BW_TESTS_S, BW_SAN=0 (skip sanitizers),
# BW_SAN_ARGS, BW_BENCH="args;args;..." (one bench_tc_bwd.py --wgmma run per ';'-separated arg set).
# Usage: bash benchmarks/tuning/gpu_wgmma_bwd.sh   (outputs under $OUT)
set -u
. "$(dirname "$0")/gpu_env.sh" gpu_wgmma_bwd

stamp "tensor-core GPU tests ${BW_K:+(-k $BW_K)}"
timeout ${BW_TESTS_S:-300} python3 -m pytest -q -p no:cacheprovider tests/test_tc_gpu.py ${BW_K:+-k "$BW_K"} \
  > "$OUT/tests.txt" 2>&1
rc=$?; tail -n 15 "$OUT/tests.txt"; stamp "tests rc=$rc"; [ $rc -eq 0 ] || status=1
if [ "${BW_SAN:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    # shellcheck disable=SC2086
    sanitize $tool - ${BW_SAN_S:-150} benchmarks/tuning/bench_tc_bwd.py --wgmma --sanitize ${BW_SAN_ARGS:---dtypes float16,float32 --dims 32,64}
  done
fi
IFS=';' read -ra sets <<< "${BW_BENCH:---dtypes float16}"
for i in "${!sets[@]}"; do
  stamp "bench_tc_bwd.py --wgmma ${sets[$i]}"
  # shellcheck disable=SC2086
  timeout ${BW_BENCH_S:-300} python3 benchmarks/tuning/bench_tc_bwd.py --wgmma ${sets[$i]} > "$OUT/bench_$i.txt" 2>&1
  rc=$?; grep -v "Warning\|api.launch_backward" "$OUT/bench_$i.txt" | tail -n 40; stamp "bench rc=$rc"; [ $rc -eq 0 ] || status=1
done
echo "status=$status"
exit $status
