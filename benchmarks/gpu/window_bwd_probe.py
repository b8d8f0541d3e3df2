"""Which dQ tile shape serves a sliding window's backward (H200; fp16, N = 16384, H = 16, D = 128,
causal window of 1024 keys, Graph.band), next to plain causal with the same shape.

    python benchmarks/gpu/window_bwd_probe.py --prebuild --jobs 8   # the probe's cubins (no GPU needed)
    python benchmarks/gpu/window_bwd_probe.py [--reps 20]

Per D = 128 wgmma dQ shape (warps NW, key block BN; the first is the shipped one), the backward's
GPU time per call (CUDA events around --reps back-to-back attention_backward calls, the forward's
outputs given) and the largest difference of dq to the shipped shape's. The dK/dV kernel keeps its
shipped shape.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tiga_numba as tg  # noqa: E402
from tiga_numba.cuda.tc import tuning  # noqa: E402
from run import gpu_seconds  # noqa: E402

#: (NW, BN) of the D = 128 16-bit wgmma dQ kernel; the first is the shipped one
SHAPES = [(8, 128), (4, 128), (4, 64), (8, 64)]


def _use(shape):
    NW, BN = shape
    tuning.TUNING_WGMMA[("dq", 128)] = dict(NW=NW, MT=1, BN=BN, a_smem=True, wgmma=True)


def _build(shape):
    from tiga_numba.cuda.tc import build
    _use(shape)
    vr = tuning.variant("dq", 128, 128, "float16", wgmma=True)
    t = time.time()
    build.kernel(vr)[0].cubin("sm_90a")
    return f"built {vr.name()} in {time.time() - t:.0f} s"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--prebuild", action="store_true")
    ap.add_argument("--jobs", type=int, default=4)
    a = ap.parse_args()
    if a.prebuild:
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(a.jobs) as pool:
            for line in pool.map(_build, SHAPES):
                print(line, flush=True)
        return
    import cupy
    N, H, D, W = a.n, a.heads, 128, a.window
    rng = cupy.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((N, H, D), dtype=cupy.float32).astype(cupy.float16) for _ in range(4))
    graphs = {"window": tg.Graph.band(N, left=W - 1, right=0), "causal": tg.Graph.triangular(N)}
    print(f"# {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, N={N} H={H} D={D} fp16, window {W}, "
          f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| dQ shape NW, BN | relation | backward ms (GPU, back to back) | max |dq - shipped dq| |")
    print("|---|---|---|---|")
    fwd = {name: tg.attention(q, k, v, g, return_stats=True) for name, g in graphs.items()}
    first = {}
    for shape in SHAPES:
        _use(shape)
        for name, g in graphs.items():
            out, st = fwd[name]

            def fn(g=g, out=out, st=st):
                return tg.attention_backward(do, q, k, v, out, st, g)
            ms = gpu_seconds(fn, a.reps) * 1e3
            dq = fn()[0].astype(cupy.float32)
            diff = float(cupy.abs(dq - first.setdefault(name, dq)).max())
            kern = [x for x in tg.explain().splitlines() if x.startswith("tiles:")]
            print(f"| {shape} | {name} | {ms:.3f} | {diff:.2e} |  {kern[0] if kern else ''}", flush=True)


if __name__ == "__main__":
    main()
