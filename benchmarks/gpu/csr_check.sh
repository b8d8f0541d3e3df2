#!/bin/bash
# One device call for the CUDA-core CSR kernels: check.sh with the GPU tests that run them (dask
# wheels, if any, carried in .whl) and compute-sanitizer memcheck / racecheck on csr_sanitize.py,
# then the CSR benchmark of bench_split_gpu.py.
# usage (repo root on the GPU machine): OUT=dir bash benchmarks/gpu/csr_check.sh
OUT=$OUT T_PREBUILD=0 T_TESTS=0 T_FIRST=170 FIRST_WORKERS=12 T_SAN=50 SAN_SCRIPTS=csr_sanitize \
  FIRST="tests/test_cuda_gpu.py tests/test_cuda_split_gpu.py tests/test_layers_gpu.py tests/test_dask_gpu.py tests/test_score_mods_gpu.py" \
  bash benchmarks/gpu/check.sh
[ -d .whl ] && SITE=:/tmp/site
PYTHONPATH=$PWD$SITE TIGA_NUMBA_QUIET=1 timeout 120 python3 benchmarks/bench_split_gpu.py --csr --reps 10 \
  > $OUT/bench.txt 2>&1
echo "bench rc=$?"; grep -v Warn $OUT/bench.txt | tail -8
