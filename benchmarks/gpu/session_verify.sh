#!/bin/bash
# Second device call: each GPU test file under its own limit (so every summary is written),
# then the split / decode benchmark if time is left. OUT=dir bash benchmarks/gpu/session_verify.sh
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $OUT/pip.txt 2>&1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:$PYTHONPATH TIGA_NUMBA_CACHE_DIR=/tmp/tiga_cubins
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.txt; }
timeout 150 python3 -m tiga_numba.cuda.tc.prebuild --jobs 15 > $OUT/prebuild.txt 2>&1; stamp "prebuild rc=$?"
for f in test_cuda_split_gpu:50 test_cuda_gpu:110 test_tc_gpu:170; do
  name=${f%%:*}; lim=${f##*:}
  timeout $lim python3 -m pytest -q -p no:cacheprovider -rfE --tb=line tests/$name.py > $OUT/$name.txt 2>&1
  stamp "$name rc=$?"
done
timeout 60 python3 benchmarks/bench_split_gpu.py --out $OUT/bench.txt > $OUT/bench_log.txt 2>&1; stamp "bench rc=$?"
