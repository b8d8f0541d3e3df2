#!/bin/bash
# One device call: every GPU test (pytest -m gpu over tests/, xdist workers: the GPU tests are
# bound by numba-cuda compiles on the host CPU, not by the GPU), then compute-sanitizer memcheck
# and racecheck on the split / decode / merge / band kernels and on the score-modifier kernels.
# usage (repo root on the GPU machine; wheels, if any, carried in .whl; a cubin cache prebuilt
# elsewhere carried in .tccubin, else T_PREBUILD=150 builds it here):
#   OUT=dir [WORKERS=15] [T_PREBUILD=0] [PREBUILD_ARGS="--modifiers softcap,alibi"] [T_TESTS=300] [FIRST="pytest selection"] \
#     [SAN_SCRIPTS="split_sanitize mods_sanitize tc_sanitize"] [SAN_TOOLS="memcheck racecheck synccheck"] [KEEP_CUBINS=1] \
#     [BENCH="python benchmarks/bench_score_mods_gpu.py" T_BENCH=200 [BENCH_FIRST=1]] bash benchmarks/gpu/check.sh
# Writes up to seven files (the device returns at most eight): env.txt, prebuild.txt, bench.txt,
# tests.txt (FIRST's run with full tracebacks first, then every GPU test), san.txt, steps.txt,
# tccubin.tgz. The default prebuild does not hold the modifier kernels that tests/test_tc_modifiers_gpu.py
# runs: unless the carried cache has them, add PREBUILD_ARGS="--modifiers softcap,alibi,alibi-aligned
# --dims 64,128 --dtypes float16,bfloat16" (T_PREBUILD=200), or the tests compile them one by one and
# need minutes more.
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > $OUT/env.txt 2>&1
  export PYTHONPATH=/tmp/site
fi
CACHE=/tmp/tiga_cubins
[ -d .tccubin ] && CACHE=$PWD/.tccubin
export PYTHONPATH=$PWD:$PYTHONPATH TIGA_NUMBA_CACHE_DIR=$CACHE TIGA_NUMBA_QUIET=1
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.txt; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import numba, cupy, numpy, torch; print('numba', numba.__version__, 'cupy', cupy.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)"
  python3 -m pytest --version; } >> $OUT/env.txt 2>&1
if [ "${T_PREBUILD:-0}" != 0 ]; then
  stamp prebuild
  timeout ${T_PREBUILD} python3 -m tiga_numba.cuda.tc.prebuild --jobs 15 $PREBUILD_ARGS > $OUT/prebuild.txt 2>&1; stamp "prebuild rc=$?"
fi
bench() { timeout ${T_BENCH:-200} bash -c "$BENCH" > $OUT/bench.txt 2>&1; stamp "bench rc=$?"; }
# BENCH_FIRST=1: the benchmark commands (BENCH) before the tests, while nothing else has run on the GPU
[ -n "$BENCH" ] && [ -n "$BENCH_FIRST" ] && bench
if [ -n "$FIRST" ]; then
  timeout -s INT -k 20 ${T_FIRST:-120} python3 -m pytest -q -p no:cacheprovider -n ${FIRST_WORKERS:-4} -rA --tb=long $FIRST \
    > $OUT/tests.txt 2>&1; stamp "first tests rc=$?"
fi
# BENCH: benchmark commands (a bash command line) run after FIRST's selection and before the whole
# suite (output in bench.txt)
[ -n "$BENCH" ] && [ -z "$BENCH_FIRST" ] && bench
# SIGINT at the limit: pytest stops and still prints what ran and what failed (-rA: a line per test,
# so a run cut at its limit still says which tests passed)
if [ "${T_TESTS:-300}" != 0 ]; then
  timeout -s INT -k 20 ${T_TESTS:-300} python3 -m pytest -q -p no:cacheprovider -n ${WORKERS:-15} -rA --tb=short -m gpu tests \
    >> $OUT/tests.txt 2>&1; stamp "gpu tests rc=$?"
fi
if [ "${T_SAN:-30}" != 0 ]; then
  for s in ${SAN_SCRIPTS:-split_sanitize mods_sanitize tc_sanitize}; do
    for tool in ${SAN_TOOLS:-memcheck racecheck}; do
      echo "=== $tool $s" >> $OUT/san.txt
      timeout ${T_SAN:-30} compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 9 \
        python3 benchmarks/gpu/$s.py 2>&1 | tail -30 >> $OUT/san.txt; stamp "$tool $s rc=${PIPESTATUS[0]}"
    done
  done
fi
# the cubin cache back to the caller (carry it in the next call: no rebuild)
[ -n "$KEEP_CUBINS" ] && tar czf $OUT/tccubin.tgz -C $(dirname $CACHE) $(basename $CACHE) && stamp "cubins kept"
if [ -f $OUT/tests.txt ]; then grep -E "^(FAILED|ERROR)|passed|failed" $OUT/tests.txt | tail -40; fi
