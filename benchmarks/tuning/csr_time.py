"""The CSR kernels alone on a uniform random graph: forward and forward+backward wall time,
best and median of --reps (no torch, no other table: for A/B pairs of two trees, each run with
its root first on sys.path).

    python benchmarks/tuning/csr_time.py [--nodes 100000] [--edges 1600000] [--heads 4] [--dim 32] [--reps 9]
"""
import argparse
import os
import sys

import numpy as np
import scipy.sparse as sp

import tiga_numba as tg

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from run import wall_times  # noqa: E402  (benchmarks/run.py: the benchmarks' CPU timer)


def timed(f, reps):
    """best and median ms of `reps` calls after a warm-up."""
    ts = wall_times(f, reps)
    return min(ts) * 1e3, float(np.median(ts)) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("--edges", type=int, default=1_600_000)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    N, E, H, D = a.nodes, a.edges, a.heads, a.dim
    rng = np.random.default_rng(0)
    rows = np.repeat(np.arange(N), E // N)
    cols = rng.integers(0, N, rows.shape[0])
    g = tg.Graph.from_scipy(sp.csr_array((np.ones(rows.shape[0], np.float32), (rows, cols)), shape=(N, N)))
    q, k, v, do = (rng.standard_normal((N, H, D)).astype(np.float32) for _ in range(4))

    def fb():
        out, st = tg.attention(q, k, v, g, return_stats=True)
        tg.attention_backward(do, q, k, v, out, st, g)
    f_best, f_med = timed(lambda: tg.attention(q, k, v, g), a.reps)
    b_best, b_med = timed(fb, a.reps)
    print(f"csr {N} nodes {g.num_edges} edges H={H} D={D} float32: fwd {f_best:.1f} ms (median {f_med:.1f}), "
          f"fwd+bwd {b_best:.1f} ms (median {b_med:.1f})")


if __name__ == "__main__":
    main()
