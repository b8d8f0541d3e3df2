"""Where a Dask worker's extra time goes: the same CSR forward (1M nodes, 16M edges, H=4, D=32,
float32, NUMBA_NUM_THREADS=2) in a plain process, with the environment dask's nanny gives its
workers (OMP_NUM_THREADS=1, MALLOC_TRIM_THRESHOLD_=65536), called from a non-main thread, and
inside a LocalCluster worker with and without that environment. Each in a fresh process: three
timed calls after a warm one; two rounds.

    python benchmarks/dask_worker_probe.py
"""
import os
import subprocess
import sys
import time

import numpy as np
import scipy.sparse as sp


def make(n=1_000_000, deg=16, seed=0):
    import tiga_numba as tg
    rng = np.random.default_rng(seed)
    rows = np.repeat(np.arange(n), deg)
    cols = rng.integers(0, n, n * deg)
    g = tg.Graph.from_scipy(sp.csr_matrix((np.ones(n * deg, np.float32), (rows, cols)), shape=(n, n)))
    q, k, v = (rng.standard_normal((n, 4, 32), dtype=np.float32) for _ in range(3))
    return g, q, k, v


def timed(tag):
    import numba

    import tiga_numba as tg
    g, q, k, v = make()
    tg.attention(q, k, v, g, return_stats=True)
    wall, cpu = [], []
    for _ in range(3):
        c0, t0 = time.process_time(), time.perf_counter()
        tg.attention(q, k, v, g, return_stats=True)
        wall.append(round(time.perf_counter() - t0, 2))
        cpu.append(round(time.process_time() - c0, 2))
    return (f"{tag}: wall {wall} cpu {cpu} layer {numba.threading_layer()} threads "
            f"{numba.get_num_threads()} load {os.getloadavg()[0]:.1f}")


def in_cluster(nanny_environment):
    import dask
    import distributed
    cfg = {} if nanny_environment else {"distributed.nanny.pre-spawn-environ": {}}
    with dask.config.set(cfg), \
            distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                     dashboard_address=":0", silence_logs=40,
                                     env={"NUMBA_NUM_THREADS": "2"}) as cluster, \
            distributed.Client(cluster) as client:
        return client.submit(timed, "worker").result()


def main():
    how = sys.argv[1] if len(sys.argv) > 1 else "driver"
    if how == "plain":
        print(timed("plain"))
    elif how == "thread":
        import threading
        res = []
        t = threading.Thread(target=lambda: res.append(timed("thread")))
        t.start()
        t.join()
        print(res[0])
    elif how in ("worker", "worker-no-env"):
        print(in_cluster(how == "worker"))
    else:
        base = dict(os.environ, NUMBA_NUM_THREADS="2")
        runs = [("plain", {}, "plain"),
                ("nanny env", {"OMP_NUM_THREADS": "1", "MALLOC_TRIM_THRESHOLD_": "65536"}, "plain"),
                ("thread", {}, "thread"), ("worker", {}, "worker"),
                ("worker, no nanny env", {}, "worker-no-env")]
        for _ in range(2):
            for name, extra, mode in runs:
                out = subprocess.run([sys.executable, __file__, mode], env=dict(base, **extra),
                                     capture_output=True, text=True)
                line = [x for x in out.stdout.splitlines() if "wall" in x]
                print(f"{name:<22}", line[-1] if line else out.stderr[-300:], flush=True)


if __name__ == "__main__":
    main()
