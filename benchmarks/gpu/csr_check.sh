#!/bin/bash
# One device call for the CUDA-core CSR kernels: the GPU tests that run them (dask wheels, if any,
# carried in .whl), the CSR benchmark of bench_split_gpu.py and compute-sanitizer memcheck / racecheck
# on benchmarks/gpu/csr_sanitize.py.  usage (repo root on the GPU machine): OUT=dir bash benchmarks/gpu/csr_check.sh
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site TIGA_NUMBA_QUIET=1
T0=$(date +%s); st() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.txt; }
timeout -s INT 170 python3 -m pytest -q -p no:cacheprovider -n 12 -rfEs --tb=short tests/test_cuda_gpu.py tests/test_cuda_split_gpu.py tests/test_layers_gpu.py tests/test_dask_gpu.py tests/test_score_mods_gpu.py > $OUT/tests.txt 2>&1; st "tests rc=$?"; tail -3 $OUT/tests.txt
timeout 120 python3 benchmarks/bench_split_gpu.py --csr --reps 10 > $OUT/bench.txt 2>&1; st "bench rc=$?"; grep -v Warn $OUT/bench.txt | tail -8
for tool in memcheck racecheck; do timeout 50 compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 9 python3 benchmarks/gpu/csr_sanitize.py > $OUT/san_$tool.txt 2>&1; st "$tool rc=$?"; tail -2 $OUT/san_$tool.txt; done
