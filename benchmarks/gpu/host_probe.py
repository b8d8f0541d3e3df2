"""Host work per call of the GPU entry points: for a sliding window, a small causal call (where
the host bounds the call) and a decode shape, the host's seconds to issue one call (perf_counter
over back-to-back calls, no synchronisation inside the loop), the latency of one synchronised
call, and (--profile) the host functions that take the time (cProfile over 200 calls).

    python benchmarks/gpu/host_probe.py [--profile] [--calls 200]
"""
import argparse
import cProfile
import pstats
import time

import cupy
import numpy as np

import tiga_numba as tg


def cases():
    rng = np.random.default_rng(0)

    def arrays(nq, nk, H, Hkv, D):
        return tuple(cupy.asarray(rng.standard_normal(s).astype(np.float16))
                     for s in ((nq, H, D), (nk, Hkv, D), (nk, Hkv, D)))
    yield "window 16384 W=1024", tg.Graph.band(16384, left=1023), arrays(16384, 16384, 16, 16, 128)
    yield "causal 1024", tg.Graph.triangular(1024), arrays(1024, 1024, 16, 16, 128)
    yield "decode 1 x 131072", tg.Graph.dense(131072, 1), arrays(1, 131072, 32, 8, 128)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", action="store_true")
    p.add_argument("--calls", type=int, default=200)
    a = p.parse_args()
    print(f"# {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, tiga_numba from {tg.__file__}")
    for name, g, (q, k, v) in cases():
        for _ in range(3):
            tg.attention(q, k, v, g)
        cupy.cuda.Device().synchronize()
        lat = []
        for _ in range(20):
            t = time.perf_counter()
            tg.attention(q, k, v, g)
            cupy.cuda.Device().synchronize()
            lat.append(time.perf_counter() - t)
        n = 50
        t = time.perf_counter()
        for _ in range(n):
            tg.attention(q, k, v, g)
        host = (time.perf_counter() - t) / n
        cupy.cuda.Device().synchronize()
        print(f"{name:<22} host/call {host * 1e3:6.3f} ms  synchronised call {np.median(lat) * 1e3:6.3f} ms  "
              f"[{tg.functional.last_plan().family}]", flush=True)
        if a.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.calls):
                tg.attention(q, k, v, g)
            prof.disable()
            cupy.cuda.Device().synchronize()
            st = pstats.Stats(prof)
            print(f"-- cProfile, {a.calls} calls: {st.total_tt * 1e3 / a.calls:.3f} ms per call under the profiler")
            st.sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
