"""One small call of the split-key decode kernel per tensor-core geometry of decode_probe.py
(several key chunks, a chunk end inside a step, GQA), for compute-sanitizer.

    compute-sanitizer --tool memcheck python benchmarks/gpu/decode_sanitize.py [--variants NAME,...]
"""
import argparse
import os
import sys

import cupy
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import decode_probe  # noqa: E402
import tiga_numba as tg  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--variants", default=",".join(n for n in decode_probe.VARIANTS if n.startswith("mma")))
a = ap.parse_args()
rng = np.random.default_rng(0)
for name in a.variants.split(","):
    decode_probe.set_variant(decode_probe.VARIANTS[name])
    for g in (tg.Graph.dense(3001, 1),
              tg.Graph.cu_seqlens([0, 1, 3, 3, 4], cu_seqlens_k=[0, 700, 1533, 1533, 1600], causal=True)):
        q = cupy.asarray(rng.standard_normal((g.num_dst, 8, 128)).astype(np.float16))
        k = cupy.asarray(rng.standard_normal((g.num_src, 2, 128)).astype(np.float16))
        v = cupy.asarray(rng.standard_normal((g.num_src, 2, 128)).astype(np.float16))
        tg.attention(q, k, v, g)
        print(name, tg.functional.last_plan().run_info["kernel"][-120:])
cupy.cuda.Device().synchronize()
print("sanitize run done")
