"""How often a GNN layer's forward runs in one tiga_numba.dask.layer_vjp computation, and the task
stream of that computation, on a LocalCluster of 2 single-thread worker processes.

    python benchmarks/dask_layer_probe.py [--nodes 200000] [--grads-only]

GATConv(32, 8, heads=4) over a random graph (16 in-edges per node), x and dout in two chunks placed
on the workers. Each worker counts its calls of the layer's forward (GATConv._run, patched in the
worker); printed: the calls per worker (rows of the partition, want_grad) and each attention task's
computes and transfers with their durations. With the forward state kept for the backward tasks, out
and the gradients computed together run one forward per partition (--grads-only: the gradients alone,
which also run one). The package is imported from the environment (an installed checkout, or
PYTHONPATH): `PYTHONPATH=build/base` times a copy made by benchmarks/ab_base.sh.
"""
import argparse

import numpy as np


def _count_forwards():
    """In a worker: count GATConv._run calls in tiga_numba.layers.gat.CALLS."""
    import tiga_numba.layers.gat as gat
    run = gat.GATConv._run
    gat.CALLS = []

    def counted(self, x, graph, *args, **kwargs):
        gat.CALLS.append((graph.num_dst, kwargs.get("want_grad")))
        return run(self, x, graph, *args, **kwargs)
    gat.GATConv._run = counted


def _calls():
    import tiga_numba.layers.gat as gat
    return gat.CALLS


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=200000)
    ap.add_argument("--grads-only", action="store_true")
    a = ap.parse_args()
    import dask.array as da
    import distributed

    import tiga_numba as tg
    import tiga_numba.dask as tgd
    from tiga_numba.layers import GATConv
    rng = np.random.default_rng(0)
    n = a.nodes
    g = tg.Graph.from_csr(np.arange(0, 16 * n + 1, 16), rng.integers(0, n, 16 * n), num_src=n)
    conv = GATConv(32, 8, heads=4, seed=0).eval()
    x = rng.standard_normal((n, 32), dtype=np.float32)
    dout = rng.standard_normal((n, 32), dtype=np.float32)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                                  silence_logs=40) as cluster, distributed.Client(cluster) as client:
        client.run(_count_forwards)
        X = client.persist(da.from_array(x, chunks=(-(-n // 2), 32)))
        D = client.persist(da.from_array(dout, chunks=(-(-n // 2), 32)))
        out, vjp = tgd.layer_vjp(conv, X, g)
        grads = vjp(D)
        with distributed.get_task_stream(client) as stream:
            client.compute([grads["x"]] if a.grads_only else [out, grads["x"]], sync=True)
        print("layer forwards per worker (rows, want_grad):", client.run(_calls))
        for rec in stream.data:
            key = str(rec["key"])
            if "-tasks-" in key:
                for ss in rec["startstops"]:
                    print(f"{rec['worker'][-5:]} {ss['action']:<8} {ss['stop'] - ss['start']:6.3f} s  {key[:90]}")


if __name__ == "__main__":
    main()
