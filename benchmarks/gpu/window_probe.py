"""Where a sliding-window forward's time goes, and which tile shape serves it best (H200; fp16,
N = 16384, H = 16, D = 128, causal window of 1024 keys, Graph.band).

    python benchmarks/gpu/window_probe.py --prebuild --jobs 15   # the probe's cubins (no GPU needed)
    python benchmarks/gpu/window_probe.py [--reps 20]

Per D = 128 wgmma forward shape (warps NW: 4 = one warpgroup of 64 query rows, 8 = two; key block
BN; the narrow-band rule, tuning.NARROW, is switched off so that each shape runs as given), four
times in ms, each the median or mean over --reps:
  call    CUDA events around one tg.attention call (what bench_score_mods_gpu.py reports);
  stream  CUDA events around --reps back-to-back calls, per call (host work hidden when the host
          issues faster than the GPU runs);
  kernel  the forward kernel alone, relaunched back to back with the arguments of a real call;
  host    the host's seconds per call (perf_counter, no synchronisation inside the loop).
The same four for the plain causal forward (same shape) are the reference.

    python benchmarks/gpu/window_probe.py --kind dq --prebuild --jobs 8
    python benchmarks/gpu/window_probe.py --kind dq [--reps 20]

With --kind dq (or dkdv) the shapes are those of the D = 128 wgmma dQ (or dK/dV) kernel, the
other backward kernel keeping its shipped shape (the narrow-band rule off): the backward's GPU
time per call (CUDA events around --reps back-to-back attention_backward calls, the forward's
outputs given) and the largest difference of dq (dk) to the first shape's, for the window and for
plain causal.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tiga_numba as tg  # noqa: E402
from tiga_numba.cuda.tc import api, tuning  # noqa: E402
from bench_score_mods_gpu import timed  # noqa: E402
from run import gpu_seconds  # noqa: E402

#: (NW, BN) of the D = 128 16-bit wgmma kernel of each kind; the first is the shipped one
SHAPES = {"fwd": [(8, 128), (4, 128), (4, 64), (8, 64)],
          "dq": [(8, 128), (4, 128), (4, 64), (8, 64)],
          "dkdv": [(4, 64), (4, 32), (8, 64), (8, 32)]}
SHIPPED = {kind: dict(tuning.TUNING_WGMMA[(kind, 128)]) for kind in SHAPES}


def _use(kind, shape):
    """run `kind` with `shape` whatever the relation (the narrow-band rule off); the shipped
    entry's other fields (a_smem, overlap) kept, unless --serial (SERIAL: overlap=False)."""
    NW, BN = shape
    tuning.NARROW.clear()
    tuning.TUNING_WGMMA[(kind, 128)] = dict(SHIPPED[kind], NW=NW, BN=BN, **({"overlap": False} if SERIAL else {}))


#: --serial: every chain waited for at once (the forward's serial key loop)
SERIAL = False


def _build(job):
    from tiga_numba.cuda.tc import build
    kind, shape = job
    _use(kind, shape)
    vr = tuning.variant(kind, 128, 128, "float16", wgmma=True)
    t = time.time()
    build.kernel(vr)[0].cubin("sm_90a")
    return f"built {vr.name()} in {time.time() - t:.0f} s"


def _backward_shapes(kind, q, k, v, graphs, reps):
    """the --kind dq / dkdv table: the backward per shape of that kernel."""
    import cupy
    do = cupy.random.default_rng(1).standard_normal(q.shape, dtype=cupy.float32).astype(cupy.float16)
    which = 0 if kind == "dq" else 1
    print(f"| {kind} shape NW, BN | relation | backward ms (GPU, back to back) | max |{kind[:2]} - first shape's| |")
    print("|---|---|---|---|")
    fwd = {name: tg.attention(q, k, v, g, return_stats=True) for name, g in graphs.items()}
    first = {}
    for shape in SHAPES[kind]:
        _use(kind, shape)
        for name, g in graphs.items():
            out, st = fwd[name]

            def fn(g=g, out=out, st=st):
                return tg.attention_backward(do, q, k, v, out, st, g)
            ms = gpu_seconds(fn, reps) * 1e3
            got = fn()[which].astype(cupy.float32)
            diff = float(cupy.abs(got - first.setdefault(name, got)).max())
            tiles = [x for x in tg.explain().splitlines() if x.startswith("tiles:")]
            print(f"| {shape} | {name} | {ms:.3f} | {diff:.2e} |  {tiles[0] if tiles else ''}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--prebuild", action="store_true")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--kind", choices=sorted(SHAPES), default="fwd",
                    help="whose shapes: the forward's, or the backward's dQ or dK/dV kernel")
    ap.add_argument("--shapes", default="", help="NWxBN list replacing the kind's shapes, e.g. 4x64,8x128")
    ap.add_argument("--serial", action="store_true", help="overlap=False: every wgmma chain waited for at once")
    a = ap.parse_args()
    kind = a.kind
    global SERIAL
    SERIAL = a.serial
    if a.shapes:
        SHAPES[kind] = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    if a.prebuild:
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(a.jobs) as pool:
            for line in pool.map(_build, [(kind, shape) for shape in SHAPES[kind]]):
                print(line, flush=True)
        return
    import cupy
    N, H, D, W = a.n, a.heads, 128, a.window
    rng = cupy.random.default_rng(0)
    q, k, v = (rng.standard_normal((N, H, D), dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
    graphs = {"window": tg.Graph.band(N, left=W - 1, right=0), "causal": tg.Graph.triangular(N)}
    print(f"# {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, N={N} H={H} D={D} fp16, window {W}, "
          f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if kind != "fwd":
        return _backward_shapes(kind, q, k, v, graphs, a.reps)
    print("| shape NW, BN | relation | call ms | stream ms | kernel ms | host ms | TF/s (kernel) | max diff to the shipped shape |")
    print("|---|---|---|---|---|---|---|---|")
    first = {}
    launched = {}
    real_launch = api.launch_forward

    def spy(*args, **kw):
        launched["call"] = (args, kw)
        return real_launch(*args, **kw)
    api.launch_forward = spy
    for shape in SHAPES["fwd"]:
        _use("fwd", shape)
        for name, g in graphs.items():
            def fn(g=g):
                return tg.attention(q, k, v, g)
            call = timed(fn, a.reps)
            stream = gpu_seconds(fn, a.reps) * 1e3
            args, kw = launched["call"]
            kernel = gpu_seconds(lambda: real_launch(*args, **kw), a.reps) * 1e3
            cupy.cuda.Device().synchronize()
            t = time.perf_counter()
            for _ in range(a.reps):
                fn()
            host = (time.perf_counter() - t) / a.reps * 1e3
            cupy.cuda.Device().synchronize()
            keys = W * N - W * (W - 1) / 2 if name == "window" else N * (N + 1) / 2
            tf = 4 * keys * D * H / (kernel * 1e-3) / 1e12
            out = fn().astype(cupy.float32)
            diff = float(cupy.abs(out - first.setdefault(name, out)).max())
            print(f"| {shape} | {name} | {call:.3f} | {stream:.3f} | {kernel:.3f} | {host:.3f} | {tf:.0f} | {diff:.2e} |",
                  flush=True)


if __name__ == "__main__":
    main()
