"""CPU tile shapes for a narrow band, A/B in one process: each round times every shape and the
dense call back to back, so the machine's drift cancels in the paired ratios.

    python benchmarks/bench_band_tiles.py [--n 4096] [--window 256] [--rounds 12]
        [--tiles rule 64x128 64x64]

"rule" is the package's own choice (cpu/tiles.py: span tiles for a narrow band, forward and backward
each their own); a BMxBN shape runs both directions on it (tg.options(cpu_tiles=...)).

Prints each shape's median forward and forward+backward ms, its paired forward+backward ratio to
the first shape (median, min, max) and dense / band for the first shape. N=4096, H=4, D=64, fp32.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tiga_numba as tg  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--tiles", nargs="+", default=["rule", "64x128", "64x64"])
    a = ap.parse_args()
    H, D = 4, 64
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((a.n, H, D)).astype(np.float32) for _ in range(4))
    band, dense = tg.Graph.band(a.n, left=a.window - 1), tg.Graph.dense(a.n, a.n)
    shapes = [None if t == "rule" else tuple(int(x) for x in t.split("x")) for t in a.tiles]
    name = {s: "rule" if s is None else f"{s[0]}x{s[1]}" for s in shapes}

    def timed(g, tiles):
        with tg.options(cpu_tiles=tiles):
            t0 = time.perf_counter()
            out, st = tg.attention(q, k, v, g, return_stats=True)
            t1 = time.perf_counter()
            tg.attention_backward(do, q, k, v, out, st, g)
            return t1 - t0, time.perf_counter() - t0

    for s in shapes:   # compile and warm every shape first
        timed(band, s)
    timed(dense, None)
    got = {s: [] for s in shapes}
    dn = []
    for i in range(a.rounds):
        for s in shapes:
            got[s].append(timed(band, s))
        if i % 3 == 0:
            dn.append(timed(dense, None))
    print(f"band W={a.window}, N={a.n}, H={H}, D={D}, float32; {a.rounds} interleaved rounds")
    base = np.array(got[shapes[0]])
    for s in shapes:
        t = np.array(got[s])
        r = t[:, 1] / base[:, 1]
        print(f"tiles {name[s]}: fwd {np.median(t[:, 0]) * 1e3:.1f} ms, fwd+bwd {np.median(t[:, 1]) * 1e3:.1f} ms;"
              f" paired fwd+bwd ratio to {name[shapes[0]]}: {np.median(r):.3f} ({r.min():.3f}-{r.max():.3f})")
    d = np.array(dn)
    print(f"dense / band ({name[shapes[0]]}): fwd {np.median(d[:, 0]) / np.median(base[:, 0]):.2f}x, "
          f"fwd+bwd {np.median(d[:, 1]) / np.median(base[:, 1]):.2f}x")


if __name__ == "__main__":
    main()
