#!/bin/bash
# One GPU machine call: split / banded tests, compute-sanitizer on one small call per kernel, benchmark.
# usage (repo root on the GPU machine): OUT=dir bash benchmarks/gpu/split_run.sh [tests|bench|all]
export PYTHONPATH=$PWD
what=${1:-all}
nvidia-smi -L > $OUT/env.txt 2>&1
python3 -m pytest --version >> $OUT/env.txt 2>&1
python3 -c "import cupy, numba, torch; print(cupy.__version__, numba.__version__, torch.__version__)" >> $OUT/env.txt 2>&1
if [ "$what" != bench ]; then
  timeout ${T_TESTS:-170} python3 -m pytest -q -p no:cacheprovider -x tests/test_cuda_split_gpu.py \
     > $OUT/tests.txt 2>&1; echo "rc=$?" >> $OUT/tests.txt
  timeout ${T_OLD:-60} python3 -m pytest -q -p no:cacheprovider tests/test_cuda_gpu.py \
     -k "float32 and (triangular or segments or dense_rect)" > $OUT/tests_old.txt 2>&1; echo "rc=$?" >> $OUT/tests_old.txt
  timeout ${T_SAN:-60} compute-sanitizer --tool memcheck python3 benchmarks/gpu/split_sanitize.py \
     > $OUT/sanitizer.txt 2>&1; echo "rc=$?" >> $OUT/sanitizer.txt
fi
if [ "$what" != tests ]; then
  timeout ${T_BENCH:-150} python3 benchmarks/bench_split_gpu.py ${BENCH_ARGS} --out $OUT/bench.txt \
     > $OUT/bench_log.txt 2>&1; echo "rc=$?" >> $OUT/bench_log.txt
fi
