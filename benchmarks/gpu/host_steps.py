"""Microseconds per step of the host's work in one GPU attention call (no profiler: each step
timed alone with timeit over many repetitions), for a sliding-window forward (fp16, N = 2048,
H = 16, D = 128, window 256) and a decode forward (1 x 8,192 keys, Hq = 32, Hkv = 8): sizes
whose kernels take less GPU time than the host takes to issue them, so that back-to-back calls
measure the host (the host path is the same as at the benchmarks' sizes).

    PYTHONPATH=. python benchmarks/gpu/host_steps.py [--reps 2000]

(the package is the one on PYTHONPATH, so that two versions can be compared in one run)
"""
import argparse
import timeit

import tiga_numba as tg
from tiga_numba import arrays, dispatch, functional
from tiga_numba import run_options as _options


def _segments(q, k, v, g, reps, dev):
    """run_forward's time split among its callees: each is replaced by a wrapper that adds its
    own duration to a total (about 0.2 us of wrapper per callee and call)."""
    import gc
    import time
    import cupy
    from tiga_numba.cuda.tc import api as tapi, tuning
    backend = dispatch.backend_module("cuda")
    top = [(arrays, "check_attention_inputs"), (dispatch, "make_plan"), (backend, "forward"),
           (functional, "_remember"), (functional, "AttentionStats"), (functional, "_score_values")]
    # inside the backend's forward (not part of 'rest')
    inner = [(tapi, "_operand"), (tapi, "_host_relation"), (tapi, "_launch_memo"), (tapi, "_run_forward"),
             (tapi, "launch_forward"), (tapi, "variant"), (tuning, "narrow"), (tapi, "_covers"),
             (cupy, "empty"), (backend, "_view"), (backend, "_record")]
    inner = [(o, n) for o, n in inner if hasattr(o, n)]   # the names this version of the package has
    patched = top + inner
    totals = {f"{o.__name__}.{n}": 0 for o, n in patched}
    saved = [(o, n, getattr(o, n)) for o, n in patched]

    def wrap(label, fn):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                totals[label] += time.perf_counter() - t0
        return timed
    for (o, n), label in zip(patched, totals):
        setattr(o, n, wrap(label, getattr(o, n)))
    try:
        for _ in range(50):
            functional.run_forward(q, k, v, g)
        dev.synchronize()
        for key in totals:
            totals[key] = 0
        t0 = time.perf_counter()
        for _ in range(reps):
            functional.run_forward(q, k, v, g)
        whole = time.perf_counter() - t0
        first = dict(totals)
        gc.disable()
        t0 = time.perf_counter()
        for _ in range(reps):
            functional.run_forward(q, k, v, g)
        nogc = time.perf_counter() - t0
        gc.enable()
        dev.synchronize()
    finally:
        for o, n, fn in saved:
            setattr(o, n, fn)
    out = {key: t / reps for key, t in first.items()}
    out["whole run_forward (wrapped)"] = whole / reps
    out["rest"] = (whole - sum(first[f"{o.__name__}.{n}"] for o, n in top)) / reps
    out["whole run_forward (wrapped), gc disabled"] = nogc / reps
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2000)
    a = ap.parse_args()
    import cupy
    from tiga_numba.cuda import api as capi
    from tiga_numba.cuda.tc import api as tapi, tuning
    rng = cupy.random.default_rng(0)

    def arr(*s):
        return rng.standard_normal(s, dtype=cupy.float32).astype(cupy.float16)
    cases = (("window", arr(2048, 16, 128), arr(2048, 16, 128), arr(2048, 16, 128),
              tg.Graph.band(2048, left=255)),
             ("decode", arr(1, 32, 128), arr(8192, 8, 128), arr(8192, 8, 128), tg.Graph.dense(8192, 1)))
    dev = cupy.cuda.Device()
    for name, q, k, v, g in cases:
        tg.attention(q, k, v, g)
        dev.synchronize()
        qq, kk, vv, shape, scale = arrays.check_attention_inputs(q, k, v, g, None)
        opts = _options.resolve()
        plan = dispatch.make_plan("forward", g, shape, scale, arrays=(qq, kk, vv), options=opts)
        rel = g.realize("cuda")
        out, st = tg.attention(q, k, v, g, return_stats=True)
        tg.attention_backward(out, q, k, v, out, st, g)
        steps = {
            "whole call tg.attention": lambda: tg.attention(q, k, v, g),
            "whole call tg.attention_backward": lambda: tg.attention_backward(out, q, k, v, out, st, g),
            "functional.run_forward": lambda: functional.run_forward(q, k, v, g),
            "check_attention_inputs": lambda: arrays.check_attention_inputs(q, k, v, g, None),
            "run_options.resolve": lambda: _options.resolve(),
            "dispatch.make_plan": lambda: dispatch.make_plan("forward", g, shape, scale, arrays=(qq, kk, vv),
                                                             options=opts),
            "backend forward (cuda.api.forward)": lambda: capi.forward(plan, qq, kk, vv, rel),
            "cupy.empty (2048, 16) f32": lambda: cupy.empty((2048, 16), cupy.float32),
            "q.__cuda_array_interface__": lambda: q.__cuda_array_interface__,
            "q.data.ptr, q.strides": lambda: (q.data.ptr, q.strides),
            "tc _operand(q)": lambda: tapi._operand(q, "q", []),
            "tc variant('fwd')": lambda: tuning.variant("fwd", 128, 128, "float16"),
            "current_stream": lambda: tapi.current_stream(),
            "graph.realize": lambda: g.realize("cuda"),
            "AttentionStats(...)": lambda: functional.AttentionStats(None, None, None, plan, graph=g),
            "functional._remember": lambda: functional._remember(plan),
        }
        print(f"## {name}: family {plan.family}")
        print("  inside run_forward (each callee wrapped in a timer; 'rest' is run_forward's own code):")
        for label, t in _segments(q, k, v, g, a.reps, dev).items():
            print(f"    {label:<38} {t * 1e6:8.2f} us")
        for label, fn in steps.items():
            n = a.reps
            t = min(timeit.repeat(fn, number=n, repeat=3)) / n
            dev.synchronize()
            print(f"  {label:<40} {t * 1e6:8.2f} us")


if __name__ == "__main__":
    main()
