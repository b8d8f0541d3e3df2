"""Time tg.attention_merge of partial results on numpy arrays (the CPU merge), with the machine's copy
bandwidth beside it: the merge reads every part once and writes the result once, so its floor is about
one copy of (parts + 1) outputs.

    python benchmarks/bench_merge.py [--rows 500000] [--heads 4] [--dv 32] [--parts 2 4] [--reps 5]
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tiga_numba as tg  # noqa: E402


def parts_of(rng, rows, heads, dv, count, dtype):
    parts = []
    for _ in range(count):
        out = rng.standard_normal((rows, heads, dv)).astype(dtype)
        m = rng.standard_normal((rows, heads)).astype(np.float32)
        l = rng.uniform(0.5, 4.0, (rows, heads)).astype(np.float32)
        l[:: 7] = 0          # some rows empty in this part
        m[:: 7] = -np.inf
        parts.append((out, tg.AttentionStats(m, l)))
    return parts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dv", type=int, default=32)
    ap.add_argument("--parts", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dtypes", default="float32,float16")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    big = np.ones(1 << 26, np.float32)   # 256 MiB
    dst = np.empty_like(big)
    np.copyto(dst, big)
    t0 = time.perf_counter()
    np.copyto(dst, big)
    copy_gbs = 2 * big.nbytes / (time.perf_counter() - t0) / 1e9
    print(f"# rows={args.rows} H={args.heads} Dv={args.dv}; copy bandwidth {copy_gbs:.1f} GB/s (read + write)")
    print("| dtype | parts | MB read + written | median s | GB/s |")
    print("|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for count in args.parts:
            parts = parts_of(rng, args.rows, args.heads, args.dv, count, np.dtype(dtype))
            tg.attention_merge(parts)   # compile / warm
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                tg.attention_merge(parts)
                times.append(time.perf_counter() - t0)
            nbytes = sum(o.nbytes + s.m.nbytes + s.l.nbytes for o, s in parts) + parts[0][0].nbytes + 2 * parts[0][1].m.nbytes
            med = float(np.median(times))
            print(f"| {dtype} | {count} | {nbytes / 1e6:.0f} | {med:.3f} | {nbytes / med / 1e9:.1f} |")


if __name__ == "__main__":
    main()
