"""Whether a process that compiles the CPU kernels gets the same bits as the processes that
load them from numba's disk cache afterwards: runs this file's calls (a CSR graph with a hub
destination and a hub source, decode, causal, rectangular dense; plain and soft-capped; forward
and backward) in three processes with one fresh cache (the first compiles, the next two load)
and prints each array's digest per process. (The committed results of 2026-12-07 ran with a
fresh numba cache and the user's own package cache.)

    python benchmarks/tuning/cache_bits_probe.py [--threads 2]
"""
import argparse
import hashlib
import os
import subprocess
import sys
import tempfile


def calls():
    import numpy as np
    import tiga_numba as tg
    rng = np.random.default_rng(0)
    n, e = 3000, 40000
    src = np.where(rng.random(e) < 0.3, 11, rng.integers(0, n, e))
    dst = np.where(rng.random(e) < 0.5, 7, rng.integers(0, n, e))
    graphs = (tg.Graph.from_coo(src, dst, n, n), tg.Graph.dense(4000, 2), tg.Graph.triangular(1500),
              tg.Graph.dense(30000, 40))
    for g in graphs:
        q = rng.standard_normal((g.num_dst, 2, 16)).astype(np.float32)
        k, v = (rng.standard_normal((g.num_src, 2, 16)).astype(np.float32) for _ in range(2))
        for mods in ({}, {"softcap": 3.0}):
            out, st = tg.attention(q, k, v, g, return_stats=True, **mods)
            grads = tg.attention_backward(np.ones_like(out), q, k, v, out, st, g, **mods)
            digests = [hashlib.sha1(np.ascontiguousarray(x).tobytes()).hexdigest()[:8]
                       for x in (out, st.m, st.l, *grads)]
            print(f"{g.kind:10s} {'+'.join(mods) or 'plain':8s} out m l dq dk dv: {' '.join(digests)}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        calls()
        return
    with tempfile.TemporaryDirectory() as cache:
        # both caches fresh: numba's (compiled kernels) and the package's (generated modules, the
        # timed CPU tile-product choice, made by the first process and read by the others)
        env = dict(os.environ, NUMBA_CACHE_DIR=os.path.join(cache, "numba"),
                   TIGA_NUMBA_CACHE_DIR=os.path.join(cache, "tiga"), NUMBA_NUM_THREADS=str(args.threads),
                   TIGA_NUMBA_QUIET="1")
        runs = []
        for i in range(3):
            out = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                                 check=True).stdout
            runs.append(out.splitlines())
            print(f"== process {i + 1} ({'compiles' if i == 0 else 'loads the cache'})")
            print(out, end="")
        same = [a == b for a, b in zip(runs[0], runs[1])]
        print(f"== lines equal, process 1 vs 2: {sum(same)} of {len(same)}; process 2 vs 3: "
              f"{sum(a == b for a, b in zip(runs[1], runs[2]))} of {len(runs[1])}")


if __name__ == "__main__":
    main()
