"""Decode kernel probe: for a few split-key geometries, the latency of one synchronised call,
the host time to issue a call, and the GPU time per call when calls run back to back
(events around 20 calls), on the benchmark's decode shapes; each variant's output is checked
against the scalar geometry's. Prints one line per variant, then a profile of the host path.

    python benchmarks/gpu/decode_probe.py [--variants NAME,...] [--profile]
"""
import argparse
import cProfile
import pstats
import time
from dataclasses import replace

import cupy
import numpy as np

import tiga_numba as tg
from tiga_numba.cuda import decode

Hq, Hkv, D = 32, 8, 128
_tiles = decode.decode_tiles
_fit = decode.vector_loads_fit


def inputs(B, L):
    rng = np.random.default_rng(0)
    q = cupy.asarray(rng.standard_normal((B, Hq, D)).astype(np.float16))
    k = cupy.asarray(rng.standard_normal((B * L, Hkv, D)).astype(np.float16))
    v = cupy.asarray(rng.standard_normal((B * L, Hkv, D)).astype(np.float16))
    g = tg.Graph.dense(L, 1) if B == 1 else \
        tg.Graph.cu_seqlens(np.arange(B + 1), cu_seqlens_k=np.arange(B + 1) * L, causal=True)
    return q, k, v, g


def run(B, L, variant, ref):
    q, k, v, g = inputs(B, L)
    for _ in range(3):
        out = tg.attention(q, k, v, g)
    err = float(cupy.abs(out.astype(np.float32) - ref[(B, L)]).max()) if (B, L) in ref else 0.0
    ref.setdefault((B, L), out.astype(np.float32))
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
          f"max|diff| vs scalar {err:.1e}", flush=True)


# name: ("scalar",) for the scalar geometry, ("vec", 16-byte loads per lane and row, keys per lane
# group and step, warps per CTA) for the CUDA-core vector geometry, ("mma", warps per CTA, CTAs an
# SM holds at once (for the split rule's waves), keys per warp and step) for the tensor-core kernel
VARIANTS = {"scalar": ("scalar",), "mma NW4 K32 C1": ("mma", 4, 1, 32), "mma NW4 K16 C2": ("mma", 4, 2, 16),
            "mma NW2 K32 C2": ("mma", 2, 2, 32), "mma NW8 K16 C1": ("mma", 8, 1, 16),
            "mma NW2 K16 C4": ("mma", 2, 4, 16), "vec L2 T4 NW4": ("vec", 2, 4, 4)}
_mma_fits = decode.mma_fits


def set_variant(var):
    decode.vector_loads_fit = _fit if var[0] == "vec" else (lambda *a: False)
    decode.mma_fits = _mma_fits if var[0] == "mma" else (lambda *a: False)
    decode.decode_tiles = _tiles
    if var[0] == "mma":
        decode.MMA_WARPS, decode.MMA_CTAS_PER_SM, decode.MMA_KEYS = var[1:]
    elif var[0] == "vec":
        decode.VEC_LOADS, decode.VEC_KEYS, NW = var[1:]

        def tiles(dtype, D_, DV, rows, vec=False):
            t = _tiles(dtype, D_, DV, rows, vec=vec)
            return replace(t, NW=NW) if vec else t
        decode.decode_tiles = tiles


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    ref = {}
    for name in a.variants.split(","):
        set_variant(VARIANTS[name])
        for B, L in ((1, 131072), (16, 8192)):
            try:
                run(B, L, name, ref)
            except Exception as exc:  # noqa: BLE001
                print(f"{name:<22} {B:>3} x {L:<7} {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    if a.profile:
        set_variant(VARIANTS["mma NW4 K32 C1"])
        q, k, v, g = inputs(1, 131072)
        tg.attention(q, k, v, g)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            tg.attention(q, k, v, g)
        pr.disable()
        cupy.cuda.Device().synchronize()
        pstats.Stats(pr).sort_stats("tottime").print_stats(30)
        pstats.Stats(pr).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
