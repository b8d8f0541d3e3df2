"""One small forward and backward of the tensor-core kernels with a score modifier compiled in
(soft-cap, ALiBi bottom-right aligned on cu_seqlens, and on cu_seqlens flash-attn's per-sequence
(batch, H) slopes: a per-row slope field), float16, wgmma, causal and varlen relations with
tails and GQA, for compute-sanitizer."""
import cupy
import numpy as np

import tiga_numba as tg
from tiga_numba import functional

rng = np.random.default_rng(0)
H, Hkv, D = 4, 2, 128
graphs = (tg.Graph.triangular(130), tg.Graph.cu_seqlens([0, 1, 70, 150], cu_seqlens_k=[0, 90, 95, 300]))
slopes = cupy.asarray(rng.uniform(0.05, 0.5, H).astype(np.float32))
for g in graphs:
    q, k, v, do = (cupy.asarray(rng.standard_normal(s).astype(np.float16)) for s in
                   ((g.num_dst, H, D), (g.num_src, Hkv, D), (g.num_src, Hkv, D), (g.num_dst, H, D)))
    per_sequence = dict(alibi_slopes=cupy.asarray(rng.uniform(0.05, 0.5, (3, H)).astype(np.float32)))
    for kw in (dict(softcap=30.0), dict(alibi_slopes=slopes)) + ((per_sequence,) if g.kind == "segments" else ()):
        out, st = tg.attention(q, k, v, g, return_stats=True, **kw)
        fam = functional.last_plan().family
        grads = tg.attention_backward(do, q, k, v, out, st, g, **kw)
        print(g.kind, list(kw), fam, functional.last_plan().family)
cupy.cuda.Device().synchronize()
print("sanitize run done")
