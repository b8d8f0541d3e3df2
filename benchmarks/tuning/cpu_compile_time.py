"""First-call (compile) time of the float32 CPU block kernels with each tile product: a fresh
process per product, with empty numba and package caches, times one forward and one backward
(N = 300 causal, H = 2, D = 64, 64 x 128 tiles); the calls are tiny, so the times are the
compilations (and, for "own" under "auto", the once-per-machine timing of the products); then
the same calls with a soft-cap, which compile the kernels' score-modifier variants.

    python benchmarks/tuning/cpu_compile_time.py [--products own,blas]
"""
import argparse
import os
import subprocess
import sys
import tempfile

_CALL = r"""
import time, numpy as np, tiga_numba as tg
rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((300, 2, 64)).astype(np.float32) for _ in range(4))
g = tg.Graph.triangular(300)
with tg.options(cpu_tiles=(64, 128), cpu_products=PRODUCTS):
    t = time.perf_counter()
    o, st = tg.attention(q, k, v, g, return_stats=True)
    t1 = time.perf_counter()
    tg.attention_backward(do, q, k, v, o, st, g)
    t2 = time.perf_counter()
print(f"{PRODUCTS:>5}: forward {t1 - t:5.1f} s, backward {t2 - t1:5.1f} s (first calls, empty caches)")
with tg.options(cpu_tiles=(64, 128), cpu_products=PRODUCTS):   # a score-modifier variant of both
    t = time.perf_counter()
    o, st = tg.attention(q, k, v, g, return_stats=True, softcap=30.0)
    t1 = time.perf_counter()
    tg.attention_backward(do, q, k, v, o, st, g, softcap=30.0)
    t2 = time.perf_counter()
print(f"{PRODUCTS:>5}: soft-cap variant forward {t1 - t:5.1f} s, backward {t2 - t1:5.1f} s (compiled next)")
"""


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--products", default="own,blas")
    a = p.parse_args()
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    for name in a.products.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, NUMBA_CACHE_DIR=os.path.join(tmp, "numba"),
                       TIGA_NUMBA_CACHE_DIR=os.path.join(tmp, "tiga"), TIGA_NUMBA_QUIET="1",
                       PYTHONPATH=os.pathsep.join([root] + [x for x in [os.environ.get("PYTHONPATH")] if x]))
            out = subprocess.run([sys.executable, "-c", _CALL.replace("PRODUCTS", repr(name))], env=env,
                                 capture_output=True, text=True)
            print(out.stdout.strip() or out.stderr[-2000:], flush=True)


if __name__ == "__main__":
    main()
