"""Per-call host overhead of tg.attention / tg.attention_backward on a tiny problem
(target: under 50 us of host time per call on a tiny problem), CPU and GPU.

    PYTHONPATH=$PWD python benchmarks/tuning/bench_overhead.py [--gpu] [--profile] [--out FILE]

Tiny problem: N = 16, H = 1, D = 16, triangular relation, float32. Each line is the best of
5 rounds of n calls (us per call); the minimum, because the machine may be shared.
  * front end only: validation + plan + dispatch with the backend stubbed out (what every
    call pays before a kernel is picked);
  * tg.attention / tg.attention_backward: the public calls;
  * backend entry: cpu.api / cuda.api forward and backward called with a ready plan.
GPU (--gpu, needs cupy and a device): "pipelined" = n calls then one synchronize (host
cost per call while the GPU keeps up), "synced" = a synchronize after every call (host +
launch latency + tiny kernel). Before timing, each output is checked against the float64
oracle (tiga_numba.reference). Also: the launch paths of cuda/launch.py side by side, the
host time of a tensor-core-routed call (fp16, N = 4096, H = 16, D = 64) split into its
parts, and with --profile a cProfile of 1000 tiny calls sorted by own time.
"""
import argparse
import cProfile
import io
import os
import pstats
import sys
import time
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

LINES = []


def emit(s=""):
    print(s, flush=True)
    LINES.append(s)


def per_call_us(fn, n, rounds=5, sync=None):
    """Best over `rounds` of the mean wall time of n calls (+ one sync at the end)."""
    for _ in range(min(n, 50)):
        fn()
    if sync:
        sync()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if sync:
            sync()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def profile_text(fn, n=1000, top=25):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def tiny(xp, dtype="float32", N=16, H=1, D=16, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, do = (xp.asarray(rng.standard_normal((N, H, D)).astype(dtype)) for _ in range(4))
    return q, k, v, do


def check(out, stats, grads, q, k, v, do, g, what):
    """Output, stats and gradients against the float64 oracle; raises on a mismatch."""
    import tiga_numba as tg
    ref, m, l = tg.reference.attention(q, k, v, g, return_stats=True)
    rq, rk, rv, _ = tg.reference.attention_backward(do, q, k, v, g)
    host = (lambda a: a.get()) if hasattr(out, "get") else np.asarray
    for name, got, want in (("out", out, ref), ("m", stats.m, m), ("l", stats.l, l),
                            ("dq", grads[0], rq), ("dk", grads[1], rk), ("dv", grads[2], rv)):
        got = host(got).astype(np.float64)
        if not np.allclose(got, want.reshape(got.shape), rtol=2e-4, atol=2e-5):
            raise AssertionError(f"{what}: {name} differs from the float64 oracle "
                                 f"(max abs err {np.abs(got - want.reshape(got.shape)).max():.3g})")


def frontend_only(tg, q, k, v, do, g, out, st, n):
    """tg.attention / attention_backward with the backend replaced by a stub returning
    preallocated results: the cost of validation + plan + dispatch alone."""
    from tiga_numba import dispatch, plan as plan_mod
    backend = plan_mod.BACKEND_OF_LIBRARY["numpy" if isinstance(q, np.ndarray) else "cupy"]
    real = dispatch._LOADED.get(backend)
    m, l = st.m, st.l
    dispatch._LOADED[backend] = types.SimpleNamespace(
        forward=lambda plan, *a, **kw: (out, m, l),
        backward=lambda plan, *a, **kw: (q, k, v, None))
    try:
        f = per_call_us(lambda: tg.attention(q, k, v, g), n)
        b = per_call_us(lambda: tg.attention_backward(do, q, k, v, out, st, g), n)
    finally:
        if real is None:
            dispatch._LOADED.pop(backend, None)
        else:
            dispatch._LOADED[backend] = real
    return f, b


def cpu_part(profile):
    import tiga_numba as tg
    from tiga_numba import functional
    from tiga_numba.cpu import api
    import numba
    emit(f"== CPU (numpy -> numba CPU kernels, {numba.get_num_threads()} threads), tiny problem "
         "N=16 H=1 D=16 triangular fp32: us per call (best of 5 rounds)")
    g = tg.Graph.triangular(16)
    q, k, v, do = tiny(np)
    out, st = tg.attention(q, k, v, g, return_stats=True)
    grads = tg.attention_backward(do, q, k, v, out, st, g)
    check(out, st, grads, q, k, v, do, g, "cpu")
    n = 2000
    f, b = frontend_only(tg, q, k, v, do, g, out, st, n)
    emit(f"  front end only (validation + plan + dispatch, backend stubbed): fwd {f:7.1f}   bwd {b:7.1f}")
    rel = g.realize("cpu")
    fwd = per_call_us(lambda: tg.attention(q, k, v, g), n)
    bwd = per_call_us(lambda: tg.attention_backward(do, q, k, v, out, st, g), n)
    m3, l3 = st.m, st.l
    fplan = functional.run_forward(q, k, v, g)[2]
    bplan = functional.run_backward(do, q, k, v, out, st, g)[4]
    bfe = per_call_us(lambda: api.forward(fplan, q, k, v, rel), n)
    bbe = per_call_us(lambda: api.backward(bplan, do, q, k, v, out, m3, l3, rel, None), n)
    emit(f"  tg.attention {fwd:7.1f} | tg.attention_backward {bwd:7.1f}")
    emit(f"  cpu.api.forward (backend entry) {bfe:7.1f} | cpu.api.backward (backend entry) {bbe:7.1f}")
    if profile:
        emit("-- cProfile, 1000 tiny tg.attention calls (CPU), sorted by own time")
        emit(profile_text(lambda: tg.attention(q, k, v, g), top=15))


def gpu_part(profile, launchers=True, tc_route=True):
    import cupy
    import tiga_numba as tg
    from tiga_numba import functional
    from tiga_numba.kernel_cache import KERNELS
    from tiga_numba.cuda import api
    sync = cupy.cuda.Device().synchronize
    dev = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    emit(f"== GPU ({dev}; cupy {cupy.__version__}), tiny problem N=16 H=1 D=16 triangular fp32, "
         "CUDA-core kernels: us per call (best of 5 rounds)")
    g = tg.Graph.triangular(16)
    q, k, v, do = tiny(cupy)
    with tg.options(tensor_cores=False):  # the CUDA-core kernels
        out, st = tg.attention(q, k, v, g, return_stats=True)
        grads = tg.attention_backward(do, q, k, v, out, st, g)
        check(out, st, grads, q, k, v, do, g, "gpu")
        n = 2000
        f, b = frontend_only(tg, q, k, v, do, g, out, st, n)
        emit(f"  front end only (validation + plan + dispatch, backend stubbed): fwd {f:6.1f}   bwd {b:6.1f}")
        fplan = functional.run_forward(q, k, v, g)[2]
        bplan = functional.run_backward(do, q, k, v, out, st, g)[4]
        rel = g.realize("cuda")
        m3, l3 = st.m, st.l
        rows = [
            ("tg.attention (validation + plan + launch)", lambda: tg.attention(q, k, v, g)),
            ("cuda.api.forward (backend entry)", lambda: api.forward(fplan, q, k, v, rel)),
            ("tg.attention_backward (validation + plan + 3 launches)",
             lambda: tg.attention_backward(do, q, k, v, out, st, g)),
            ("cuda.api.backward (backend entry, 3 launches)",
             lambda: api.backward(bplan, do, q, k, v, out, m3, l3, rel, None)),
        ]
        for name, fn in rows:
            pipe = per_call_us(fn, n, sync=sync)
            synced = per_call_us(lambda: (fn(), sync()), 500)
            emit(f"  {name:56s} {pipe:6.1f} pipelined | {synced:6.1f} synced")
        emit(f"  launch path: {fplan.run_info['kernel'].split(' (')[0]} via "
             f"{[kk.launch_path for kk in KERNELS._kernels.values() if hasattr(kk, 'launch_path')]}")
        if launchers:
            launcher_table(q, k, v, g, out)
        if profile:
            emit("-- cProfile, 1000 tiny tg.attention calls (GPU), sorted by own time")
            emit(profile_text(lambda: tg.attention(q, k, v, g)))
            emit("-- cProfile, 1000 tiny tg.attention_backward calls (GPU), sorted by own time")
            emit(profile_text(lambda: tg.attention_backward(do, q, k, v, out, st, g), top=15))
    if tc_route:
        tc_host_time(profile)


def launcher_table(q, k, v, g, ref_out):
    """Each launch path of cuda/launch.py on the backend entry (kernel objects rebuilt per
    path; cubins come from the disk cache, cuda.core / numba compile with numba)."""
    import cupy
    from tiga_numba import functional
    from tiga_numba.kernel_cache import KERNELS
    from tiga_numba.cuda import api
    sync = cupy.cuda.Device().synchronize
    old = os.environ.get("TIGA_NUMBA_LAUNCHER")
    emit("-- launch paths (cuda.api.forward, backend entry)")
    try:
        for launcher in ("driver", "cupy", "cuda.core", "numba"):
            os.environ["TIGA_NUMBA_LAUNCHER"] = launcher
            KERNELS.clear()
            try:
                out, _, plan = functional.run_forward(q, k, v, g)
                sync()
                rel = g.realize("cuda")
                used = [kk.launch_path for kk in KERNELS._kernels.values() if hasattr(kk, "launch_path")]
                same = bool(cupy.array_equal(out, ref_out))
                pipe = per_call_us(lambda: api.forward(plan, q, k, v, rel), 2000, sync=sync)
                emit(f"  {launcher:9s} -> {','.join(map(str, used))}: {pipe:6.1f} us/call pipelined; "
                     f"output bit-identical to the default path: {same}")
            except Exception as exc:  # report and go on: the table compares what works here
                emit(f"  {launcher:9s} failed: {exc!r}"[:200])
    finally:
        if old is None:
            os.environ.pop("TIGA_NUMBA_LAUNCHER", None)
        else:
            os.environ["TIGA_NUMBA_LAUNCHER"] = old
        KERNELS.clear()


def tc_host_time(profile):
    """Host time of a call routed to the tensor-core kernels (fp16, N=4096, H=16, D=64, dense):
    the time until the call returns, with the GPU busy (so no wait is included)."""
    import cupy
    import tiga_numba as tg
    from tiga_numba import functional
    from tiga_numba.cuda import api
    sync = cupy.cuda.Device().synchronize
    N, H, D = 4096, 16, 64
    g = tg.Graph.dense(N)
    rng = cupy.random.default_rng(7)
    q, k, v = (rng.standard_normal((N, H, D), dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
    out, _, plan = functional.run_forward(q, k, v, g)
    sync()
    kname = plan.run_info.get("kernel", "?")
    emit(f"== host time of a routed call, fp16 N={N} H={H} D={D} dense -> {kname.split(' (')[0]}: "
         "us until the call returns (GPU kept busy, 50 calls per round, best of 5)")
    if plan.family != "cuda.tc":
        emit(f"  (the registry chose {plan.family}, not the tensor cores; nothing to split)")
        return
    from tiga_numba.cuda import tc
    rel = g.realize("cuda")
    parts = [("tg.attention", lambda: tg.attention(q, k, v, g)),
             ("tg.make_plan (validation + registry choice)", lambda: tg.make_plan(q, k, v, g)),
             ("tc.forward (backend entry)", lambda: tc.forward(plan, q, k, v, rel))]
    for name, fn in parts:
        best = float("inf")
        for _ in range(5):
            sync()
            t0 = time.perf_counter()
            for _ in range(50):
                fn()
            best = min(best, (time.perf_counter() - t0) / 50 * 1e6)
            sync()
        emit(f"  {name:34s} {best:7.1f} us")
    if profile:
        emit("-- cProfile, 200 routed fp16 calls, sorted by own time")
        emit(profile_text(lambda: tg.attention(q, k, v, g), n=200, top=20))
    sync()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", action="store_true", help="also measure the cupy path (needs a GPU)")
    ap.add_argument("--no-cpu", action="store_true", help="skip the numpy path")
    ap.add_argument("--profile", action="store_true", help="print cProfile tables")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import tiga_numba  # noqa: F401  (shields tiga_numba.cuda from numba-cuda's redirector)
    emit(f"# bench_overhead.py ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}), "
         f"python {sys.version.split()[0]}, numpy {np.__version__}, {os.cpu_count()} CPUs")
    if not a.no_cpu:
        cpu_part(a.profile)
    if a.gpu:
        gpu_part(a.profile)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
