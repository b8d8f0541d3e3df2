"""One small forward and backward of each tensor-core kernel family (float16 and float32, the
wgmma and mma.sync engines, dense-rectangular, causal, cu_seqlens, a sliding window and a
bottom-right causal rectangular varlen batch with tails, GQA), for compute-sanitizer. Head dim
64, or $TC_SAN_D (128: the small relations take the narrow-band forward shape there); dtypes
float16 and float32, or the comma-separated names in $TC_SAN_DTYPES (bfloat16 via ml_dtypes). A
backward the package refuses (bfloat16 at D = 256 off the wgmma engine) is reported and skipped. $TC_SAN_SHIPPED=1: no
narrow-band shape, every relation runs the shipped tile shape (D = 128: two warpgroups, 128-key
blocks); $TC_SAN_ENGINES: "wgmma", "mma" or both (default). $TC_SAN_PINGPONG=1: the 16-bit wgmma forward at
D = 96 / 128 / 256 runs its two warpgroups in ping-pong through the mbarrier ring (Variant.pingpong,
as shipped); $TC_SAN_PINGPONG=0: the CTA-barrier pipeline instead."""
import os

import cupy
import numpy as np

import tiga_numba as tg
from tiga_numba import functional
from tiga_numba.cuda.tc import tuning

rng = np.random.default_rng(0)
H, Hkv, D = 4, 2, int(os.environ.get("TC_SAN_D", 64))
graphs = (tg.Graph.dense(150, 70), tg.Graph.triangular(130),
          tg.Graph.cu_seqlens([0, 1, 1, 70, 150]), tg.Graph.band(300, left=50),
          tg.Graph.cu_seqlens([0, 30, 130], cu_seqlens_k=[0, 100, 170]))


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


DTYPES = [_dtype(name) for name in os.environ.get("TC_SAN_DTYPES", "float16,float32").split(",")]
if os.environ.get("TC_SAN_SHIPPED") == "1":
    tuning.NARROW_KEYS = -1   # no band is narrow enough: the shipped shapes
ENGINES = os.environ.get("TC_SAN_ENGINES", "wgmma,mma").split(",")
if "TC_SAN_PINGPONG" in os.environ:
    for d in (96, 128, 256):
        tuning.TUNING_WGMMA[("fwd", d)] = dict(tuning.TUNING_WGMMA[("fwd", d)],
                                               pingpong=os.environ["TC_SAN_PINGPONG"] != "0")
for wgmma in [e == "wgmma" for e in ENGINES]:
    for dtype in DTYPES:
        for g in graphs:
            q, k, v, do = (cupy.asarray(rng.standard_normal(s).astype(dtype)) for s in
                           ((g.num_dst, H, D), (g.num_src, Hkv, D), (g.num_src, Hkv, D), (g.num_dst, H, D)))
            with tg.options(wgmma=wgmma):
                out, st = tg.attention(q, k, v, g, return_stats=True)
                fam = functional.last_plan().family
                try:
                    grads = tg.attention_backward(do, q, k, v, out, st, g)
                    bwd = functional.last_plan().family
                except NotImplementedError:   # bfloat16 at D = 256 on the CUDA cores: no backward
                    bwd = "backward refused (NotImplementedError)"
            print(wgmma, np.dtype(dtype).name, g.kind, fam, bwd)
cupy.cuda.Device().synchronize()
print("sanitize run done")
