"""CPU benchmark of score modifiers and sliding windows, side by side in one run.

    python benchmarks/bench_score_mods.py              # N = 4096, H = 4, D = 64, float32
    python benchmarks/bench_score_mods.py --n 1024     # quicker

Rows: plain causal (Graph.triangular), causal + tanh soft-cap 30 (softcap=), ALiBi causal
(alibi_slopes=), sliding window of W keys (Graph.band(n, left=W - 1), causal), dense. Each row
reports forward and forward+backward ms (best of --reps after a warm-up call that compiles) and
its ratio to plain causal; the window row also its speed-up over dense. Targets: every modifier
within 20% of plain causal (ratio <= 1.2) and the window at least (N / W) / 2 times faster than
dense. Then varlen rows (--sequences B causal sequences of N / B rows, Graph.cu_seqlens): plain,
ALiBi with one slope per head (H,), and flash-attn's per-sequence slopes (B, H), with their
ratio to the plain varlen call.

    python benchmarks/bench_score_mods.py --rounds 9   # + per-round ratios

--rounds R adds R rounds after the table: each round times every row once (forward, then
forward+backward; the rows' order reversed every other round) and takes each row's ratio to its
base (plain causal, dense for the window, the plain varlen call) within that round. On a machine
whose speed drifts between minutes (a shared VM) the median of those per-round ratios is the
firmer figure: each ratio compares calls made seconds apart, where a ratio of two bests may
compare different minutes.
"""
import argparse
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tiga_numba as tg  # noqa: E402


def best(fn, reps):
    fn()  # warm-up: compiles on first use
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=0,
                    help="rounds of per-round ratios after the table (0: none)")
    args = ap.parse_args()
    n, H, D, W = args.n, args.heads, args.dim, args.window
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((n, H, D)).astype(np.float32) for _ in range(4))
    slopes = (2.0 ** (-8.0 * np.arange(1, H + 1) / H)).astype(np.float32)  # ALiBi's slopes
    causal = tg.Graph.triangular(n)
    B = args.sequences
    varlen = tg.Graph.cu_seqlens(np.linspace(0, n, B + 1).astype(np.int64))
    per_sequence = (slopes[None, :] * rng.uniform(0.5, 2.0, (B, 1))).astype(np.float32)
    rows = [
        ("plain causal", causal, {}),
        ("causal + softcap 30", causal, {"softcap": 30.0}),
        ("ALiBi causal", causal, {"alibi_slopes": slopes}),
        (f"sliding window W={W} (band)", tg.Graph.band(n, left=W - 1), {}),
        ("dense", tg.Graph.dense(n), {}),
        (f"varlen causal, {B} sequences", varlen, {}),
        ("varlen ALiBi, slopes (H,)", varlen, {"alibi_slopes": slopes}),
        (f"varlen ALiBi, slopes ({B}, H)", varlen, {"alibi_slopes": per_sequence}),
    ]
    print(f"CPU score modifiers: N={n}, H={H}, D={D}, float32, {os.cpu_count()} cores "
          f"({platform.processor() or platform.machine()}), NUMBA_NUM_THREADS="
          f"{os.environ.get('NUMBA_NUM_THREADS', 'default')}; best of {args.reps}")
    results = {}
    calls = {}
    for name, g, kw in rows:
        def fwd(g=g, kw=kw):
            return tg.attention(q, k, v, g, **kw)

        def fwd_bwd(g=g, kw=kw):
            out, st = tg.attention(q, k, v, g, return_stats=True, **kw)
            return tg.attention_backward(dout, q, k, v, out, st, g, **kw)

        calls[name] = (fwd, fwd_bwd)
        results[name] = (best(fwd, args.reps), best(fwd_bwd, args.reps))
    base = results["plain causal"]
    dense = results["dense"]
    print(f"{'relation / score':32s} {'fwd ms':>9s} {'fwd+bwd ms':>11s} {'fwd ratio':>10s} "
          f"{'f+b ratio':>10s}")
    for name, (f, fb) in results.items():
        if name.startswith("varlen"):
            continue
        print(f"{name:32s} {f * 1e3:9.1f} {fb * 1e3:11.1f} {f / base[0]:10.2f} {fb / base[1]:10.2f}")
    wf, wfb = results[f"sliding window W={W} (band)"]
    print("ratios are to plain causal (target for modifiers: <= 1.20)")
    print(f"sliding window vs dense: forward {dense[0] / wf:.1f}x, forward+backward "
          f"{dense[1] / wfb:.1f}x faster (target >= (N/W)/2 = {n / W / 2:.1f}x)")
    vbase = results[f"varlen causal, {B} sequences"]
    for name, (f, fb) in results.items():
        if name.startswith("varlen"):
            print(f"{name:32s} {f * 1e3:9.1f} {fb * 1e3:11.1f} {f / vbase[0]:10.2f} {fb / vbase[1]:10.2f}")
    print("varlen ratios are to the plain varlen call")
    if args.rounds:
        per_round(calls, args.rounds, B)


def per_round(calls, rounds, B):
    """Each row's ratio to its base within each round: median (min-max) over the rounds."""
    names = list(calls)
    base_of = {name: ("dense" if name.startswith("sliding") else
                      f"varlen causal, {B} sequences" if name.startswith("varlen") else "plain causal")
               for name in names}
    ratios = {name: ([], []) for name in names}
    for r in range(rounds):
        times = {}
        for name in (names if r % 2 == 0 else names[::-1]):
            fwd, fwd_bwd = calls[name]
            ts = []
            for fn in (fwd, fwd_bwd):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            times[name] = ts
        for name in names:
            for i in range(2):
                num, den = times[name][i], times[base_of[name]][i]
                # the window's figure is its speed-up over dense, the others' their cost over the base
                ratios[name][i].append(den / num if name.startswith("sliding") else num / den)
    print(f"per-round ratios, median (min-max) of {rounds} rounds; the window: its speed-up over dense")
    print(f"{'relation / score':32s} {'fwd':>20s} {'fwd+bwd':>20s}  base")
    for name in names:
        if name == base_of[name]:
            continue
        cells = []
        for i in range(2):
            x = np.asarray(ratios[name][i])
            cells.append(f"{np.median(x):5.2f} ({x.min():.2f}-{x.max():.2f})")
        print(f"{name:32s} {cells[0]:>20s} {cells[1]:>20s}  {base_of[name]}")


if __name__ == "__main__":
    main()
