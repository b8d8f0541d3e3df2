"""The Dask CSR benchmark's kernel work without Dask: the single-process forward (default 1M
nodes, 16M edges with random sources, H=4, D=32, float32) on every row with the machine's threads
and with one thread; the first half of the rows (one partition of two, every source row in its
halo) with one thread, as a single-thread Dask worker runs it; and both halves at once in two
processes, each on its own copy of k and v, as two single-thread Dask workers run them. Best of
three after a warm call.

    python benchmarks/tuning/csr_partition_probe.py [--nodes N]

Reading: when the half-rows kernel on one thread takes about what the whole call takes on two,
the kernels split perfectly and a Dask worker's extra task time lies outside them (halo
concatenation, task and memory overheads). When the two processes at once take longer than one
alone, they slow each other down: two private copies of k and v (2 x 2 N H D 4 bytes) compete for
the memory bandwidth and the last-level cache that one shared copy used. The gathers read k and v
at random: in memory without transparent huge pages (numpy asks for them; a buffer that a network
layer allocated may not have them) they also pay TLB misses, which the line "without huge pages"
measures.
"""
import argparse
import functools
import multiprocessing as mp
import time

import numpy as np

DEG, H, D = 16, 4, 32


def best(fn):
    fn()
    t = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def inputs(n):
    import tiga_numba as tg
    rng = np.random.default_rng(0)
    indptr = np.arange(0, n * DEG + 1, DEG, dtype=np.int64)
    idx = rng.integers(0, n, n * DEG).astype(np.int64)
    q, k, v = (rng.standard_normal((n, H, D)).astype(np.float32) for _ in range(3))
    return tg, indptr, idx, q, k, v


def half_call(tg, indptr, idx, q, k, v, part):
    n, half = q.shape[0], q.shape[0] // 2
    r0, r1 = (0, half) if part == 0 else (half, n)
    gh = tg.Graph.from_csr(indptr[r0:r1 + 1] - indptr[r0], idx[indptr[r0]:indptr[r1]], num_src=n)
    return functools.partial(tg.attention, q[r0:r1], k, v, gh)


def worker(n, part, barrier, results):
    import numba
    numba.set_num_threads(1)
    call = half_call(*inputs(n), part)
    call()   # warm: compiled or loaded, the relation realised
    t = float("inf")
    for _ in range(3):
        barrier.wait()   # both processes start each timed call together
        t0 = time.perf_counter()
        call()
        t = min(t, time.perf_counter() - t0)
    results[part] = t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1_000_000)
    n = ap.parse_args().nodes
    import numba
    tg, indptr, idx, q, k, v = inputs(n)
    g = tg.Graph.from_csr(indptr, idx, num_src=n)
    threads = numba.get_num_threads()
    copy_mb = 2 * k.nbytes / 2**20
    print(f"# CSR forward, {n} nodes, {n * DEG} edges (random sources), H={H}, D={D}, float32; "
          f"k and v {copy_mb:.0f} MiB per copy")
    print(f"all rows, {threads} threads: {best(functools.partial(tg.attention, q, k, v, g)):.2f} s")
    numba.set_num_threads(1)
    print(f"all rows, 1 thread:  {best(functools.partial(tg.attention, q, k, v, g)):.2f} s")
    print(f"half the rows, 1 thread: {best(half_call(tg, indptr, idx, q, k, v, 0)):.2f} s")
    # numpy asks the kernel for transparent huge pages on its large allocations (madvise); memory
    # without them (e.g. buffers a network layer allocated) costs the random gathers TLB misses
    from numpy._core import multiarray
    multiarray._set_madvise_hugepage(False)
    k4, v4 = k.copy(), v.copy()
    multiarray._set_madvise_hugepage(True)
    print(f"half the rows, 1 thread, k and v in memory without huge pages: "
          f"{best(half_call(tg, indptr, idx, q, k4, v4, 0)):.2f} s")
    del k4, v4
    del q, k, v
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Manager().dict()
    procs = [ctx.Process(target=worker, args=(n, p, barrier, results)) for p in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    print(f"both halves at once, two processes of 1 thread, each its own k and v: "
          f"{results[0]:.2f} / {results[1]:.2f} s")


if __name__ == "__main__":
    main()
