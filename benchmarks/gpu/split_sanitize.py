"""One small call of each kernel touched by the banded / split-key work, for compute-sanitizer."""
import numpy as np
import cupy
import tiga_numba as tg

rng = np.random.default_rng(0)
for g, dt, D in ((tg.Graph.band(90, 70, left=9, right=3), np.float32, 64),
                 (tg.Graph.cu_seqlens([0, 3, 5], cu_seqlens_k=[0, 700, 1500], causal=True), np.float16, 128),
                 (tg.Graph.dense(5000, 1), np.float16, 128),
                 # the split-key decode kernels with several chunks and their merge: scalar loads
                 # (float32) and 16-byte loads (float16, D = 32); the tensor-core one is the line above
                 (tg.Graph.dense(3000, 1), np.float32, 64), (tg.Graph.dense(3000, 1), np.float16, 32)):
    q = cupy.asarray(rng.standard_normal((g.num_dst, 8, D)).astype(dt))
    k = cupy.asarray(rng.standard_normal((g.num_src, 2, D)).astype(dt))
    v = cupy.asarray(rng.standard_normal((g.num_src, 2, D)).astype(dt))
    out, st = tg.attention(q, k, v, g, return_stats=True)
    tg.attention_backward(out, q, k, v, out, st, g)
    print(tg.functional.last_plan().run_info["kernel"] if hasattr(tg, "functional") else "")
cupy.cuda.Device().synchronize()
print("sanitize run done")
