"""The package at two git revisions in one process, timed in alternating rounds: a code change's
speed-up measured where the machine's drift cancels (each round times both, back to back; the
median of the rounds' own ratios is the figure to quote).

The base revision's ``tiga_numba`` is exported (``git archive``) into a temporary folder under the
name ``tiga_base`` (its backend-module names rewritten to match) and imported beside the working
tree's package; each keeps its own compiled kernels. CPU only: the two packages would share one
CUDA context.

    python benchmarks/tuning/ab_revisions.py --base HEAD~1 [--n 4096] [--mask dense causal]
        [--what fwd fb] [--score plain softcap alibi] [--rounds 7]

--mask window: a causal sliding window of 256 keys (Graph.band(N, left=255)).
--score: the plain score, flash-attn's soft-cap 30 (softcap=30) or ALiBi (alibi_slopes=, the
slopes 2^(-8 h / H)).

Prints, per case: best time of each, and the median (min-max) over rounds of base time / new time
(> 1: the working tree is faster), and the largest difference between the two results.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def export_base(rev, folder):
    """tiga_numba at `rev` as package ``tiga_base`` under `folder`."""
    tar = os.path.join(folder, "base.tar")
    subprocess.run(["git", "-C", ROOT, "archive", "-o", tar, rev, "tiga_numba"], check=True)
    with tarfile.open(tar) as t:
        t.extractall(folder, filter="data")
    os.rename(os.path.join(folder, "tiga_numba"), os.path.join(folder, "tiga_base"))
    dispatch = os.path.join(folder, "tiga_base", "dispatch.py")
    with open(dispatch) as f:
        text = f.read()
    with open(dispatch, "w") as f:   # the dispatcher imports its backends by absolute name
        f.write(text.replace('"tiga_numba.cpu.api"', '"tiga_base.cpu.api"')
                    .replace('"tiga_numba.cuda.api"', '"tiga_base.cuda.api"'))


def score_options(score, heads):
    if score == "softcap":
        return {"softcap": 30.0}
    if score == "alibi":
        return {"alibi_slopes": (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)}
    return {}


def case(tg, q, k, v, mask, what, score="plain"):
    N = q.shape[0]
    g = (tg.Graph.triangular(N) if mask == "causal" else tg.Graph.band(N, left=255) if mask == "window"
         else tg.Graph.dense(N, N))
    kw = score_options(score, q.shape[1])

    def run():
        if what == "fwd":
            return (tg.attention(q, k, v, g, **kw),)
        out, stats = tg.attention(q, k, v, g, return_stats=True, **kw)
        return tuple(tg.attention_backward(np.ones_like(out), q, k, v, out, stats, g, **kw))
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="git revision to compare the working tree with")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--mask", nargs="+", default=["dense", "causal"], choices=["dense", "causal", "window"])
    ap.add_argument("--what", nargs="+", default=["fwd", "fb"], choices=["fwd", "fb"])
    ap.add_argument("--score", nargs="+", default=["plain"], choices=["plain", "softcap", "alibi"])
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        export_base(a.base, folder)
        sys.path.insert(0, folder)
        sys.path.insert(0, ROOT)
        import tiga_base
        import tiga_numba
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", a.base], capture_output=True,
                             text=True).stdout.strip()
        print(f"# working tree against {a.base} ({rev}); N={a.n}, H={a.heads}, D={a.dim}, float32, "
              f"{a.rounds} alternating rounds")
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((a.n, a.heads, a.dim), dtype=np.float32) for _ in range(3))
        for mask, score, what in ((m, s, w) for m in a.mask for s in a.score for w in a.what):
            new, base = (case(tiga_numba, q, k, v, mask, what, score),
                         case(tiga_base, q, k, v, mask, what, score))
            diff = max(float(np.abs(x - y).max()) for x, y in zip(new(), base()))
            new(), base()
            tn, tb = [], []
            for _ in range(a.rounds):
                for f, ts in ((new, tn), (base, tb)):
                    t = time.perf_counter()
                    f()
                    ts.append(time.perf_counter() - t)
            r = [b / n for n, b in zip(tn, tb)]
            print(f"{mask:6} {score:7} {what:3}: new best {min(tn) * 1e3:8.1f} ms, base best {min(tb) * 1e3:8.1f} ms; "
                  f"base / new per round: median {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f}); "
                  f"max |new - base| {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
