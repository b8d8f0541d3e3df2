"""Small CPU calls: time per call of the public API on problems of a few hundred edges, idle or
next to busy processes.

    python benchmarks/bench_small_calls.py                  # this machine as it is
    python benchmarks/bench_small_calls.py --load 2         # with 2 busy-looping processes beside it
    python benchmarks/bench_small_calls.py --seconds 3 --json FILE

A script that calls attention on many small graphs (molecules, mini-batches of subgraphs, a
decode loop) pays each call's fixed costs, and each parallel kernel's wake-up of numba's worker
threads: microseconds on an idle machine, up to a scheduler time slice when other processes
hold the cores (a test runner with one worker per core, a shared workstation). `--load K` starts
K processes that spin for the duration, to measure the second case. Rows: causal attention
forward+backward (N = 64, H = 4, D = 32), a CSR forward+backward (200 nodes, 1,600 edges), a
GATConv layer forward+backward on a 30-node graph (16 -> 4 x 8), decode (1 query over 2,048 keys,
H = 8, D = 64), and a radius graph of 500 points. Each: mean and median of the per-call times over --seconds
after a warm-up call (compiles are not timed); the mean is what a loop of such calls takes.
"""
import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _spin(stop):
    x = 0
    while not stop.is_set():
        for _ in range(100000):
            x += 1


def cases():
    import scipy.sparse as sp

    import tiga_numba as tg
    from tiga_numba.layers import GATConv
    rng = np.random.default_rng(0)
    q = rng.standard_normal((64, 4, 32), dtype=np.float32)
    tri = tg.Graph.triangular(64)

    def causal():
        out, st = tg.attention(q, q, q, tri, return_stats=True)
        tg.attention_backward(out, q, q, q, out, st, tri)

    a = sp.random(200, 200, density=0.04, random_state=0, format="csr")
    csr = tg.Graph.from_scipy(a)
    qc = rng.standard_normal((200, 4, 32), dtype=np.float32)

    def graph_attention():
        out, st = tg.attention(qc, qc, qc, csr, return_stats=True)
        tg.attention_backward(out, qc, qc, qc, out, st, csr)

    ei = rng.integers(0, 30, (2, 64))
    g30 = tg.Graph.from_edge_index(ei, num_nodes=30)
    x = rng.standard_normal((30, 16), dtype=np.float32)
    layer = GATConv(16, 8, heads=4)

    def gat_layer():
        out, vjp = layer.vjp(x, g30)
        vjp(np.ones_like(out))

    dq = rng.standard_normal((1, 8, 64), dtype=np.float32)
    dk = rng.standard_normal((2048, 8, 64), dtype=np.float32)
    dec = tg.Graph.dense(2048, 1)

    def decode():
        tg.attention(dq, dk, dk, dec)

    pos = rng.random((500, 3))

    def radius():
        tg.Graph.radius(pos, 0.1)

    return [("causal N=64 fwd+bwd", causal), ("CSR 200 nodes / 1.6k edges fwd+bwd", graph_attention),
            ("GATConv 30 nodes fwd+bwd", gat_layer), ("decode 1 x 2048 fwd", decode),
            ("radius graph 500 points", radius)]


def per_call_us(fn, seconds):
    fn()
    ts = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.mean(ts)) * 1e6, float(np.median(ts)) * 1e6, len(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--load", type=int, default=0, help="busy-looping processes to run beside")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import numba

    import tiga_numba as tg
    rows = cases()
    for _, fn in rows:   # compile before the load starts
        fn()
    stop = mp.Event()
    busy = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(a.load)]
    for p in busy:
        p.start()
    try:
        print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cpus, numba {numba.__version__} ({numba.get_num_threads()} threads), "
              f"tiga_numba from {os.path.dirname(tg.__file__)}, {a.load} busy process(es) beside, "
              f"load average {os.getloadavg()[0]:.2f}")
        res = {}
        for name, fn in rows:
            mean, median, n = per_call_us(fn, a.seconds)
            res[name] = {"mean_us": mean, "median_us": median, "calls": n}
            print(f"{name:36s} mean {mean:9.1f} us, median {median:8.1f} us per call ({n} calls)", flush=True)
    finally:
        stop.set()
        for p in busy:
            p.join()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"load": a.load, "us": res}, f, indent=1)


if __name__ == "__main__":
    main()
