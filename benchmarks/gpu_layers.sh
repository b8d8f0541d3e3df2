#!/usr/bin/env bash
# Device check of the GNN layers on the H200: the layer/interop tests (CPU paths, PyG and JAX
# present there), the GPU layer tests (cupy paths vs numpy, CUDA tensors through the adapter vs
# PyG on the GPU), then bench_layers.py --device cuda (100k nodes, 1.6M edges) vs PyG.
# Outputs under $OUT (default /tmp/gpu_layers). Usage, from the repository root:
#   bash benchmarks/gpu_layers.sh
set -u
. "$(dirname "$0")/gpu_env.sh" gpu_layers
stamp "layer and interop tests"
timeout ${LAYERS_TESTS_S:-300} python3 -m pytest -q -p no:cacheprovider -rs tests/test_layers_gpu.py \
  tests/test_layers.py tests/test_interop.py > "$OUT/tests.txt" 2>&1
rc=$?; tail -n 25 "$OUT/tests.txt"; stamp "tests rc=$rc"; [ $rc -eq 0 ] || status=1
stamp "bench_layers --device cuda"
timeout ${LAYERS_BENCH_S:-240} python3 benchmarks/bench_layers.py --device cuda --reps ${LAYERS_REPS:-5} \
  --json "$OUT/bench_layers_cuda.json" > "$OUT/bench.txt" 2>&1
rc=$?; cat "$OUT/bench.txt"; stamp "bench rc=$rc"; [ $rc -eq 0 ] || status=1
exit $status
