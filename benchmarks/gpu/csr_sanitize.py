"""One small call of each CUDA-core CSR kernel (forward with and without split rows, edge bias,
float16 / float32 / float64, GQA; backward), for compute-sanitizer."""
import numpy as np
import cupy
import tiga_numba as tg

rng = np.random.default_rng(0)
n, H, Hkv, D = 3000, 4, 2, 32
deg = rng.integers(0, 9, n)
deg[7] = 2 * n   # a hub row: split into pieces and merged
indptr = np.concatenate([[0], np.cumsum(deg)])
indices = rng.integers(0, n, int(indptr[-1]), dtype=np.int32)
g = tg.Graph.from_csr(cupy.asarray(indptr), cupy.asarray(indices), num_src=n)
for dt in (np.float16, np.float32, np.float64):
    q = cupy.asarray(rng.standard_normal((n, H, D)).astype(dt))
    k = cupy.asarray(rng.standard_normal((n, Hkv, D)).astype(dt))
    v = cupy.asarray(rng.standard_normal((n, Hkv, D + 8)).astype(dt))
    out, st = tg.attention(q, k, v, g, return_stats=True)
    tg.attention_backward(out, q, k, v, out, st, g)
    print(tg.functional.last_plan().run_info["kernel"])
bias = cupy.asarray(rng.standard_normal((g.num_edges, H)).astype(np.float32))
q = cupy.asarray(rng.standard_normal((n, H, D)).astype(np.float32))
k = cupy.asarray(rng.standard_normal((n, Hkv, D)).astype(np.float32))
out, st, _ = tg.functional.run_forward(q, k, k, g, edge_bias=bias)
cupy.cuda.Device().synchronize()
print("sanitize run done")
