"""Seconds to compile one score-modifier kernel pair (forward and backward of a soft-capped
triangular relation, float64) from an empty cache, under the NUMBA_OPT level this process runs
with. Run it once per level, each with its own empty caches:

    NUMBA_OPT=3 NUMBA_CACHE_DIR=$(mktemp -d) TIGA_NUMBA_CACHE_DIR=$(mktemp -d) python benchmarks/tuning/cpu_compile_opt_level.py
    NUMBA_OPT=1 NUMBA_CACHE_DIR=$(mktemp -d) TIGA_NUMBA_CACHE_DIR=$(mktemp -d) python benchmarks/tuning/cpu_compile_opt_level.py

(tests/conftest.py compiles the suite's kernels at -O1 for this.)"""
import time

import numba
import numpy as np

import tiga_numba as tg

rng = np.random.default_rng(0)
n, heads, dim = 64, 2, 16
q, k, v = (rng.standard_normal((n, heads, dim)) for _ in range(3))
graph = tg.Graph.triangular(n)
t = time.perf_counter()
out, stats = tg.attention(q, k, v, graph, return_stats=True, softcap=5.0)
forward = time.perf_counter() - t
t = time.perf_counter()
tg.attention_backward(rng.standard_normal(out.shape), q, k, v, out, stats, graph, softcap=5.0)
backward = time.perf_counter() - t
print(f"NUMBA_OPT={numba.config.OPT}: forward {forward:.1f} s, backward {backward:.1f} s, "
      f"together {forward + backward:.1f} s (first calls: compile + a tiny run)")
