"""One small call of each CUDA-core kernel that compiles a score modifier (block forward, dq,
dk/dv; CSR forward, dq, dk/dv with split rows and their merges), for compute-sanitizer."""
import cupy
import numpy as np

import tiga_numba as tg

rng = np.random.default_rng(0)
H, Hkv, D = 4, 2, 64
n = 300
indptr = np.concatenate([[0], np.cumsum(np.r_[2500, rng.integers(0, 6, n - 1)])]).astype(np.int64)
indices = rng.integers(0, n, int(indptr[-1])).astype(np.int32)
graphs = (tg.Graph.cu_seqlens([0, 70, 71, 200], causal=True, window=(40, 0)),
          tg.Graph.from_csr(indptr, indices, num_src=n))
for g in graphs:
    q = cupy.asarray(rng.standard_normal((g.num_dst, H, D)).astype(np.float32))
    k = cupy.asarray(rng.standard_normal((g.num_src, Hkv, D)).astype(np.float32))
    v = cupy.asarray(rng.standard_normal((g.num_src, Hkv, D)).astype(np.float32))
    slopes = cupy.asarray(rng.uniform(0.01, 0.1, H).astype(np.float32))
    out, st = tg.attention(q, k, v, g, softcap=20.0, alibi_slopes=slopes, return_stats=True)
    print(tg.explain().splitlines()[0] if tg.explain() else "")
    grads = tg.attention_backward(out, q, k, v, out, st, g, softcap=20.0, alibi_slopes=slopes)
cupy.cuda.Device().synchronize()
print("sanitize run done")
