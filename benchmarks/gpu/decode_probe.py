"""Decode kernel probe: for a few split-key geometries, the latency of one synchronised call,
the host time to issue a call, and the GPU time per call when calls run back to back
(events around 20 calls), on the benchmark's decode shapes. Prints one line per variant."""
import time

import cupy
import numpy as np

import tiga_numba as tg
from tiga_numba import functional
from tiga_numba.cuda import decode

Hq, Hkv, D = 32, 8, 128
_orig = decode.decode_tiles


def run(B, L, variant):
    rng = np.random.default_rng(0)
    q = cupy.asarray(rng.standard_normal((B, Hq, D)).astype(np.float16))
    k = cupy.asarray(rng.standard_normal((B * L, Hkv, D)).astype(np.float16))
    v = cupy.asarray(rng.standard_normal((B * L, Hkv, D)).astype(np.float16))
    g = tg.Graph.dense(L, 1) if B == 1 else \
        tg.Graph.cu_seqlens(np.arange(B + 1), cu_seqlens_k=np.arange(B + 1) * L, causal=True)
    for _ in range(3):
        tg.attention(q, k, v, g)
    cupy.cuda.Device().synchronize()
    lat = []
    for _ in range(10):
        t0 = time.perf_counter()
        tg.attention(q, k, v, g)
        cupy.cuda.Device().synchronize()
        lat.append(time.perf_counter() - t0)
    s = cupy.cuda.get_current_stream()
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    e0.record(s)
    t0 = time.perf_counter()
    for _ in range(20):
        tg.attention(q, k, v, g)
    host = (time.perf_counter() - t0) / 20
    e1.record(s)
    e1.synchronize()
    gpu = cupy.cuda.get_elapsed_time(e0, e1) / 1e3 / 20
    kv = 2 * B * L * Hkv * D * 2
    print(f"{variant:<22} {B:>3} x {L:<7} latency {np.median(lat) * 1e3:7.3f} ms  host/call "
          f"{host * 1e3:6.3f} ms  gpu/call back-to-back {gpu * 1e3:6.3f} ms ({kv / gpu / 1e12:4.2f} TB/s)  "
          f"{functional.last_plan().run_info['kernel'][-60:]}", flush=True)


# (16-byte loads per lane and row, keys per lane group and step, warps per CTA)
VARIANTS = {"scalar": None, "vec L1 T8 NW4": (1, 8, 4), "vec L1 T8 NW2": (1, 8, 2),
            "vec L2 T4 NW4": (2, 4, 4), "vec L2 T8 NW4": (2, 8, 4), "vec L4 T4 NW4": (4, 4, 4),
            "vec L2 T4 NW2": (2, 4, 2), "vec L1 T16 NW2": (1, 16, 2)}
_fit = decode.vector_loads_fit
for name, var in VARIANTS.items():
    if var is None:
        decode.vector_loads_fit = lambda *a: False
    else:
        decode.vector_loads_fit = _fit
        decode.VEC_LOADS, decode.VEC_KEYS, NW = var

        def tiles(dtype, D_, DV, rows, vec=False, NW=NW):
            t = _orig(dtype, D_, DV, rows, vec=vec)
            if vec:
                from dataclasses import replace
                t = replace(t, NW=NW)
            return t
        decode.decode_tiles = tiles
    for B, L in ((1, 131072), (16, 8192)):
        run(B, L, name)
