#!/usr/bin/env bash
# One short device call that re-checks the whole tree on the H200 when device time is scarce
# (gpu_suite.sh is the long form): every GPU-marked test, the tensor-core float32 table at
# N = 4096 (16384 while time allows) and the per-call overhead.
#   1. every shipped tensor-core kernel (fp16/bf16 and float32) in the cubin cache: found there
#      when .tccubin was built off-device (`TIGA_NUMBA_CACHE_DIR=$PWD/.tccubin python -m
#      tiga_numba.cuda.tc.prebuild`) and carried, else compiled by 12 processes;
#   2. tests/test_tc_gpu.py + the float32 table (bench_tc.py --fp32-only), kernels from the cache;
#   3. the other GPU tests (CUDA-core, program, GAT, neighbours);
#   4. bench_overhead.py --gpu (tiny-call host overhead).
# Outputs under $OUT (default /tmp/gpu_check). Usage, from the repository root:
#   bash benchmarks/tuning/gpu_check.sh
set -u
. "$(dirname "$0")/gpu_env.sh" gpu_check

stamp "tensor-core cubins (carried .tccubin: a check; else compiled, 12 processes)"
timeout 300 python3 -m tiga_numba.cuda.tc.prebuild --jobs 12 > "$OUT/precompile.txt" 2>&1
tail -c 300 "$OUT/precompile.txt"; echo
stamp "tensor-core GPU tests + float32 table"
timeout ${CHECK_TC_S:-240} python3 benchmarks/bench_tc.py --fp32-only --with-tests --no-sweep \
  --budget ${CHECK_TC_BUDGET:-90} --out "$OUT/tc" > "$OUT/tc_fp32.txt" 2>&1
rc=$?; grep -E "passed|failed|error|exit code|^fp32|rel L2|^routing|FAILED" "$OUT/tc_fp32.txt" | tail -n 40
stamp "tc rc=$rc"; [ $rc -eq 0 ] || status=1

stamp "GPU tests other than tensor cores"
timeout ${CHECK_TESTS_S:-330} python3 -m pytest -m gpu tests --ignore=tests/test_tc_gpu.py -q -p no:cacheprovider -rs \
  > "$OUT/tests_other.txt" 2>&1
rc=$?; tail -n 6 "$OUT/tests_other.txt"; stamp "other GPU tests rc=$rc"; [ $rc -eq 0 ] || status=1

stamp "per-call overhead"
timeout 90 python3 benchmarks/tuning/bench_overhead.py --gpu --no-cpu > "$OUT/overhead.txt" 2>&1
rc=$?; tail -n 25 "$OUT/overhead.txt"; stamp "overhead rc=$rc"
echo "check status=$status"
exit $status
