"""Where the CPU split-key decode forward's time goes: its two passes alone, each against the
rate this machine reads the same bytes at (no GPU needed).

    python benchmarks/tuning/cpu_decode_passes.py [--keys 131072] [--reps 9]

One query row, H = 8, D = 128, float32, items of 1024 keys over both threads, as the kernel
(tiga_numba/cpu/decode.py) runs them: pass 1 (scores of a key's rows against q, row maximum)
with one key per dot-product loop and with four (q's row loaded once per four keys, what
decode._score4 does), pass 2 (acc += P V, four V rows per accumulator update), a loop that only
touches every 64-byte line of K (the read ceiling of a pass), and the whole tg.attention call.
"""
import argparse
import time

import numpy as np
from numba import njit, prange

import tiga_numba as tg

CHUNK = 1024


@njit(parallel=True, fastmath={"reassoc", "contract"})
def pass1_one_key(q, k, n_items, out_m):
    H, D = q.shape[1], q.shape[2]
    for it in prange(n_items):
        mx = np.full(H, -np.inf, np.float32)
        for jj in range(CHUNK):
            j = it * CHUNK + jj
            for h in range(H):
                t = np.float32(0)
                for x in range(D):
                    t += q[0, h, x] * k[j, h, x]
                mx[h] = max(mx[h], t)
        out_m[it] = mx


@njit(parallel=True, fastmath={"reassoc", "contract"})
def pass1_four_keys(q, k, n_items, out_m):
    H, D = q.shape[1], q.shape[2]
    for it in prange(n_items):
        mx = np.full(H, -np.inf, np.float32)
        for j4 in range(0, CHUNK, 4):
            j = it * CHUNK + j4
            for h in range(H):
                t0 = t1 = t2 = t3 = np.float32(0)
                for x in range(D):
                    a = q[0, h, x]
                    t0 += a * k[j, h, x]
                    t1 += a * k[j + 1, h, x]
                    t2 += a * k[j + 2, h, x]
                    t3 += a * k[j + 3, h, x]
                mx[h] = max(mx[h], max(max(t0, t1), max(t2, t3)))
        out_m[it] = mx


@njit(parallel=True, fastmath={"reassoc", "contract"})
def pass2(p, v, n_items, acc):
    H, Dv = v.shape[1], v.shape[2]
    for it in prange(n_items):
        pa = acc[it]
        pa[:] = 0.0
        for j4 in range(0, CHUNK, 4):
            j = it * CHUNK + j4
            for h in range(H):
                p0, p1, p2, p3 = p[j, h], p[j + 1, h], p[j + 2, h], p[j + 3, h]
                for x in range(Dv):
                    pa[h, x] += ((p0 * v[j, h, x] + p1 * v[j + 1, h, x])
                                 + (p2 * v[j + 2, h, x] + p3 * v[j + 3, h, x]))


@njit(parallel=True)
def touch_lines(k, n_items, out):
    H, D = k.shape[1], k.shape[2]
    for it in prange(n_items):
        s = np.float32(0)
        for jj in range(CHUNK):
            j = it * CHUNK + jj
            for h in range(H):
                for x in range(0, D, 16):
                    s += k[j, h, x]
        out[it] = s


def best(f, reps):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return min(ts) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=131072)
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    N, H, D = a.keys - a.keys % CHUNK, 8, 128
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, H, D)).astype(np.float32)
    k, v = (rng.standard_normal((N, H, D)).astype(np.float32) for _ in range(2))
    p = rng.random((N, H)).astype(np.float32)
    n = N // CHUNK
    m, acc, o = np.empty((n, H), np.float32), np.empty((n, H, D), np.float32), np.empty(n, np.float32)
    g = tg.Graph.dense(N, 1)
    runs = [("pass 1, one key per loop", lambda: pass1_one_key(q, k, n, m)),
            ("pass 1, four keys per loop", lambda: pass1_four_keys(q, k, n, m)),
            ("pass 2 (acc += P V)", lambda: pass2(p, v, n, acc)),
            ("touch every line of K", lambda: touch_lines(k, n, o)),
            ("tg.attention (both passes, merge)", lambda: tg.attention(q, k, v, g))]
    for _, f in runs:
        f()
    mb = N * H * D * 4 / 1e6
    print(f"# {N} keys, H={H}, D={D}, float32; K and V {mb:.0f} MB each; best of {a.reps}")
    for name, f in runs:
        t = best(f, a.reps)
        print(f"{name:36s} {t:7.1f} ms  ({mb / t:5.1f} GB/s of one of K / V)")


if __name__ == "__main__":
    main()
