"""One small call of the tensor-core decode kernel with a deeper copy ring than the shipped one
(decode.MMA_STAGES = 3 at 32 keys per warp step and 4 at 16), for compute-sanitizer: a long
single-row block split into key chunks, and varlen blocks whose bands cut steps (the cell-by-cell
P V path), float16, D = 128, GQA.

    compute-sanitizer --tool memcheck python benchmarks/gpu/decode_sanitize.py
"""
import cupy
import numpy as np

import tiga_numba as tg
from tiga_numba import functional
from tiga_numba.cuda import decode

rng = np.random.default_rng(0)
for stages, keys in ((3, 32), (4, 16)):
    decode.MMA_STAGES, decode.MMA_KEYS = stages, keys
    for g in (tg.Graph.dense(9000, 1), tg.Graph.cu_seqlens([0, 3, 5, 9], cu_seqlens_k=[0, 700, 1500, 1571], causal=True)):
        q, k, v = (cupy.asarray(rng.standard_normal((n, h, 128)).astype(np.float16))
                   for n, h in ((g.num_dst, 8), (g.num_src, 2), (g.num_src, 2)))
        out = tg.attention(q, k, v, g)
        print(stages, keys, functional.last_plan().run_info["kernel"][-160:])
cupy.cuda.Device().synchronize()
print("sanitize run done")
