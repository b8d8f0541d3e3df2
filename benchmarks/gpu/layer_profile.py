"""Where a layer's forward+backward spends its time: each stage of tiga_numba.layers (the
fused attention forward / backward, the edge sums, the linear products, the elementwise steps)
timed (on the GPU with a device synchronise around it), summed over --reps calls, next to the
whole call. The synchronisations serialise the stages, so the stage sum is a little above the
call's own time; the split is what it is for.

    PYTHONPATH=. python benchmarks/gpu/layer_profile.py [--configs gat8x8 gat4x32 tconv8x8]
    CUDA_LAUNCH_BLOCKING=1 PYTHONPATH=. python benchmarks/gpu/layer_profile.py --cprofile 25
        # every launch waits for its kernel, so cProfile's per-function time includes the GPU's
    PYTHONPATH=. python benchmarks/gpu/layer_profile.py --device cpu   # numpy arrays, CPU kernels
"""
import argparse
import collections
import functools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tiga_numba as tg  # noqa: E402
import tiga_numba.layers as layers  # noqa: E402
from bench_layers import CONFIGS, make_graph  # noqa: E402

TIMES = collections.defaultdict(float)
ON = [False]
XP = [np]


def sync():
    if XP[0] is not np:
        XP[0].cuda.Device().synchronize()


def timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        if not ON[0]:
            return fn(*a, **kw)
        sync()
        t = time.perf_counter()
        out = fn(*a, **kw)
        sync()
        TIMES[name] += time.perf_counter() - t
        return out
    return wrapper


def instrument():
    from tiga_numba.layers import _edges, _module, gat, gatv2, transformer
    for mod in (gat, gatv2, transformer):
        for name in ("run_forward", "run_backward", "linear_grads", "leaky_relu_grad", "gather"):
            if hasattr(mod, name):
                setattr(mod, name, timed(f"{name}", getattr(mod, name)))
    for name in ("sum_by_src", "sum_by_dst", "adjacency", "edge_matrix"):
        setattr(_edges.EdgeSet, name, timed(f"EdgeSet.{name}", getattr(_edges.EdgeSet, name)))
    _module.linear_grads = timed("linear_grads", _module.linear_grads)


def per_call(conv, x, g, dout, reps):
    """ms per forward+backward call of the layer, over `reps` calls after a synchronise."""
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        conv.vjp(x, g)[1](dout)
    sync()
    return (time.perf_counter() - t) / reps * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("--edges", type=int, default=1_600_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="also print the N functions with the most own time (cProfile) per config")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    a = ap.parse_args()
    if a.device == "cuda":
        import cupy
        XP[0] = cupy
    xp = XP[0]
    instrument()
    src, dst = make_graph("random", a.nodes, a.edges)
    g = tg.Graph.from_coo(src, dst, a.nodes, a.nodes)
    for config in a.configs:
        name, f_in, c, h = CONFIGS[config]
        conv = getattr(layers, name)(f_in, c, heads=h)
        if a.device == "cuda":
            conv.to("cuda")
        x = xp.asarray(np.random.default_rng(1).standard_normal((a.nodes, f_in)).astype(np.float32))
        out, vjp = conv.vjp(x, g)
        dout = xp.asarray(np.random.default_rng(2).standard_normal(out.shape).astype(np.float32))
        vjp(dout)
        whole = per_call(conv, x, g, dout, a.reps)
        TIMES.clear()
        ON[0] = True
        inst = per_call(conv, x, g, dout, a.reps)
        ON[0] = False
        print(f"{config}: fwd+bwd {whole:.2f} ms (instrumented {inst:.2f} ms); stages, ms per call:")
        for k, v in sorted(TIMES.items(), key=lambda kv: -kv[1]):
            print(f"  {k:28s} {v / a.reps * 1e3:8.3f}")
        print(f"  {'rest (outside the stages)':28s} {inst - sum(TIMES.values()) / a.reps * 1e3:8.3f}")
        if a.cprofile:
            import cProfile
            import pstats
            prof = cProfile.Profile()
            prof.enable()
            per_call(conv, x, g, dout, a.reps)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(a.cprofile)


if __name__ == "__main__":
    main()
