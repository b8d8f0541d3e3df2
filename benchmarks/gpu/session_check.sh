#!/bin/bash
# One device call: tensor-core cubins, every GPU test (xdist workers: the GPU tests are bound by
# numba-cuda compiles on the host CPU, not by the GPU), compute-sanitizer on the split / decode /
# band kernels. usage (repo root on the GPU machine; wheels, if any, carried in .whl):
#   OUT=dir [WORKERS=12] [FILES="tests/test_cuda_gpu.py ..."] bash benchmarks/gpu/session_check.sh
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > $OUT/pip.txt 2>&1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:$PYTHONPATH TIGA_NUMBA_CACHE_DIR=/tmp/tiga_cubins TIGA_NUMBA_QUIET=1
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.txt; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import numba, cupy, numpy, torch; print('numba', numba.__version__, 'cupy', cupy.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)"
  python3 -m pytest --version; } > $OUT/env.txt 2>&1
if [ "${T_PREBUILD:-170}" != 0 ]; then
  stamp prebuild
  timeout ${T_PREBUILD:-170} python3 -m tiga_numba.cuda.tc.prebuild --jobs 15 > $OUT/prebuild.txt 2>&1; stamp "prebuild rc=$?"
fi
FILES=${FILES:-"tests/test_cuda_split_gpu.py tests/test_cuda_gpu.py tests/test_tc_gpu.py tests/test_layers_gpu.py tests/test_dask_gpu.py tests/test_score_mods_gpu.py"}
timeout ${T_FILES:-300} python3 -m pytest -q -p no:cacheprovider -n ${WORKERS:-12} -rfEs --tb=short $FILES \
  > $OUT/tests.txt 2>&1; stamp "gpu test files rc=$?"
if [ "${T_MIXED:-90}" != 0 ]; then
  timeout ${T_MIXED:-90} python3 -m pytest -q -p no:cacheprovider -n ${WORKERS:-12} -rfE --tb=short -k "cuda or gpu or cupy" \
    tests/test_robustness.py tests/test_score_mods.py tests/test_interop.py tests/test_gat.py tests/test_neighbors.py \
    tests/test_program.py > $OUT/tests_mixed.txt 2>&1
  stamp "mixed tests rc=$?"
fi
if [ "${T_SAN:-60}" != 0 ]; then
  timeout ${T_SAN:-60} compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 benchmarks/gpu/split_sanitize.py \
    > $OUT/sanitizer.txt 2>&1; stamp "memcheck rc=$?"
  timeout ${T_RACE:-40} compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 9 python3 benchmarks/gpu/split_sanitize.py \
    > $OUT/racecheck.txt 2>&1; stamp "racecheck rc=$?"
fi
grep -E "passed|failed|error" $OUT/tests.txt $OUT/tests_mixed.txt | tail -20
