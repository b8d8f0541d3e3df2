#!/usr/bin/env bash
# One script for the H200: memcheck/racecheck on small cases of every CUDA-core kernel, the GPU
# test suite, and the benchmark. SUITE_RACECHECK=1 adds a racecheck pass (slow);
# SUITE_SANITIZE_DTYPES=float32,float16,float64 widens memcheck (default float32);
# SUITE_SANITIZE=0 / SUITE_TESTS=0 skip memcheck / the GPU tests (SUITE_TESTS=all runs every
# GPU-marked test, not only the CUDA-core ones); SUITE_TC=1 adds the tensor-core benchmark;
# SUITE_QUICK=1 shrinks the
# benchmark grid (N <= 4096, D = 64, 200k-node CSR). Measured 2026-11-29 on a warm H200:
# memcheck 25 s + tests 82 s + benchmark 163 s = 296 s wall.
# Writes logs under $OUT (default /tmp/gpu_suite); the last lines printed are the tables.
#   bash benchmarks/tuning/gpu_suite.sh            (from the repository root)
#   SUITE_QUICK=1 bash benchmarks/tuning/gpu_suite.sh   (smaller benchmark grid)
set -u
. "$(dirname "$0")/gpu_env.sh" gpu_suite

echo "== compute-sanitizer memcheck (small cases of every kernel)"
if [ "${SUITE_SANITIZE:-1}" = "0" ]; then
  echo "skipped (SUITE_SANITIZE=0)"
elif command -v compute-sanitizer >/dev/null; then
  SD=${SUITE_SANITIZE_DTYPES:-float32}
  timeout 300 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    --print-limit 20 python3 benchmarks/bench_cuda.py --parts sanitize --sanitize-dtypes "$SD" \
    > "$OUT/sanitize.txt" 2>&1
  rc=$?; tail -n 4 "$OUT/sanitize.txt"; echo "memcheck rc=$rc"; [ $rc -eq 0 ] || status=1
  if [ "${SUITE_RACECHECK:-0}" = "1" ]; then
    timeout 300 compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 9 \
      --print-limit 20 python3 benchmarks/bench_cuda.py --parts sanitize --sanitize-dtypes float32 \
      >> "$OUT/sanitize.txt" 2>&1
    rc=$?; tail -n 3 "$OUT/sanitize.txt"; echo "racecheck rc=$rc"; [ $rc -eq 0 ] || status=1
  fi
else
  echo "compute-sanitizer not found: skipped"
fi

echo "== GPU tests"
if [ "${SUITE_TESTS:-1}" = "0" ]; then
  echo "skipped (SUITE_TESTS=0)"
else
  # SUITE_TESTS=all: every GPU-marked test of the repository (CUDA-core, tensor cores, program,
  # GAT, neighbours); default: the CUDA-core backend's tests only
  if [ "${SUITE_TESTS:-1}" = "all" ]; then TESTS="-m gpu tests"; else TESTS="tests/test_cuda_gpu.py"; fi
  timeout 600 python3 -m pytest $TESTS -q --maxfail=8 -p no:cacheprovider -rs > "$OUT/tests.txt" 2>&1
  rc=$?; tail -n 15 "$OUT/tests.txt"; echo "pytest rc=$rc"; [ $rc -eq 0 ] || status=1
fi

echo "== benchmark"
Q=""; [ "${SUITE_QUICK:-0}" = "1" ] && Q="--quick"
timeout 480 python3 benchmarks/bench_cuda.py $Q --out "$OUT/bench.txt" > "$OUT/bench_log.txt" 2>&1
rc=$?; [ $rc -eq 0 ] || status=1
cat "$OUT/bench.txt" 2>/dev/null || tail -n 40 "$OUT/bench_log.txt"
echo "bench rc=$rc"
# SUITE_TC=1: the tensor-core benchmark too (dense cells, fp32 section, varlen vs FlexAttention;
# shipped tile shapes, no sweep)
if [ "${SUITE_TC:-0}" = "1" ]; then
  echo "== tensor-core benchmark"
  timeout 600 python3 benchmarks/bench_tc.py --no-sweep --out "$OUT/tc" > "$OUT/tc_log.txt" 2>&1
  rc=$?; [ $rc -eq 0 ] || status=1
  tail -n 60 "$OUT/tc_log.txt"; echo "tc bench rc=$rc"
fi
echo "suite status=$status"
exit $status
