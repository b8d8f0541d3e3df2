"""The Dask CSR benchmark's kernel work without Dask: the single-process forward (1M nodes, 16M
edges with random sources, H=4, D=32, float32) on every row with the machine's threads and with
one thread, and on the first half of the rows (one partition of two, every source row in its
halo) with one thread, as a single-thread Dask worker runs it. Best of three after a warm call.

    python benchmarks/tuning/csr_partition_probe.py

Reading: when the half-rows kernel on one thread takes about what the whole call takes on two,
the kernels split perfectly and a Dask worker's extra task time lies outside them (halo
concatenation, task and memory overheads).
"""
import time

import numba
import numpy as np

import tiga_numba as tg


def best(fn):
    fn()
    t = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def main():
    n, deg, H, D = 1_000_000, 16, 4, 32
    rng = np.random.default_rng(0)
    indptr = np.arange(0, n * deg + 1, deg, dtype=np.int64)
    idx = rng.integers(0, n, n * deg).astype(np.int64)
    g = tg.Graph.from_csr(indptr, idx, num_src=n)
    half = n // 2
    gh = tg.Graph.from_csr(indptr[:half + 1], idx[:half * deg], num_src=n)
    q, k, v = (rng.standard_normal((n, H, D)).astype(np.float32) for _ in range(3))
    threads = numba.get_num_threads()
    print(f"# CSR forward, {n} nodes, {n * deg} edges (random sources), H={H}, D={D}, float32")
    print(f"all rows, {threads} threads: {best(lambda: tg.attention(q, k, v, g)):.2f} s")
    numba.set_num_threads(1)
    print(f"all rows, 1 thread:  {best(lambda: tg.attention(q, k, v, g)):.2f} s")
    print(f"half the rows, 1 thread: {best(lambda: tg.attention(q[:half], k, v, gh)):.2f} s")


if __name__ == "__main__":
    main()
