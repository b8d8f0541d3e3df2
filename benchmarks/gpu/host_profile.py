"""Where the host's time goes in one tensor-core call (H200; fp16, N = 16384, H = 16, D = 128).

    python benchmarks/gpu/host_profile.py [--calls 200] [--top 25] [--cases causal,window,decode]

Per case (causal, soft-cap 30 causal, a causal window of 1024 keys (Graph.band), their
backwards, and decode: one query row over 131,072 keys, Hq = 32, Hkv = 8): the host's
microseconds per call (perf_counter around --calls back-to-back calls, one synchronisation at
the end, so the host never waits for the GPU inside the loop unless its queue is full), the GPU
time per call from CUDA events around one synchronised call, then cProfile of --calls calls
sorted by own time and by cumulative time. The host work before a kernel's launch is GPU idle
time in a call timed alone (what bench_score_mods_gpu.py's per-call figures include).
"""
import argparse
import cProfile
import io
import os
import pstats
import sys
import time


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import tiga_numba as tg  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--cases", default="causal,softcap,window,decode",
                    help="comma-separated subset of causal, softcap, window, decode")
    a = ap.parse_args()
    import cupy
    N, H, D = 16384, 16, 128
    rng = cupy.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((N, H, D), dtype=cupy.float32).astype(cupy.float16) for _ in range(4))
    tri = tg.Graph.triangular(N)
    band = tg.Graph.band(N, left=1023, right=0)
    L = 131072
    dq1 = rng.standard_normal((1, 32, D), dtype=cupy.float32).astype(cupy.float16)
    dk, dv = (rng.standard_normal((L, 8, D), dtype=cupy.float32).astype(cupy.float16) for _ in range(2))
    dec = tg.Graph.dense(L, 1)
    cases = []
    wanted = a.cases.split(",")
    for name, graph, kw in (("causal", tri, {}), ("softcap", tri, dict(softcap=30.0)), ("window", band, {})):
        if name not in wanted:
            continue
        out, st = tg.attention(q, k, v, graph, return_stats=True, **kw)
        cases.append((name + " fwd", lambda graph=graph, kw=kw: tg.attention(q, k, v, graph, return_stats=True, **kw)))
        cases.append((name + " bwd", lambda graph=graph, kw=kw, out=out, st=st:
                      tg.attention_backward(do, q, k, v, out, st, graph, **kw)))
    if "decode" in wanted:
        cases.append(("decode fwd", lambda: tg.attention(dq1, dk, dv, dec)))
    dev = cupy.cuda.Device()
    print(f"# {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, cupy {cupy.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {a.calls} calls per case")
    for name, fn in cases:
        fn()
        dev.synchronize()
        t = time.perf_counter()
        for _ in range(a.calls):
            fn()
        host = (time.perf_counter() - t) / a.calls
        dev.synchronize()
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        gpu = cupy.cuda.get_elapsed_time(e0, e1)
        print(f"\n## {name}: host {host * 1e6:.1f} us per call (back to back); one synchronised call "
              f"{gpu * 1e3:.1f} us of GPU time; {tg.explain().splitlines()[0]}")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.calls):
            fn()
        pr.disable()
        dev.synchronize()
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats(key).print_stats(a.top)
            body = s.getvalue()
            print(f"### sorted by {key}\n" + body[body.find("   ncalls"):].rstrip())


if __name__ == "__main__":
    main()
