"""Neighbour-graph construction: tiga cell lists against scipy's cKDTree (CPU) and the GPU
builder against the host builder with its transfers (and torch_cluster when importable).

    PYTHONPATH=$PWD python benchmarks/bench_neighbors.py --part cpu [--n 100000] [--reps 5]
    PYTHONPATH=$PWD python benchmarks/bench_neighbors.py --part gpu [--n 100000] [--reps 5]
    compute-sanitizer --tool memcheck python benchmarks/bench_neighbors.py --part sanitize

Problem: N points uniform in the unit cube (3-D), radius cutoff chosen for an expected
degree of 16 away from the walls (the printed E/N is the real mean, a little lower); knn with
k = 16. Every row is timed `reps` times after a warm-up call (compile / load excluded) and
printed as min (median) milliseconds. CPU: wall time of the call. GPU: wall time of the call
followed by a device synchronize (what a caller waits for). Each table checks that the
compared builders agree before it prints a ratio.
"""
import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np


def problem(n, degree=16.0, seed=0):
    rng = np.random.default_rng(seed)
    pos = rng.random((n, 3))
    cutoff = (3.0 * degree / (4.0 * np.pi * n)) ** (1.0 / 3.0)
    return pos, float(cutoff)


def timed(fn, reps, sync=None):
    """(min, median) milliseconds of `reps` calls after one warm-up call."""
    fn()
    if sync:
        sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return min(out), statistics.median(out)


def row(name, t, anchor=None):
    ratio = f"{t[0] / anchor[0]:8.2f}" if anchor else "  anchor"
    print(f"{name:68s} {t[0]:9.2f} ({t[1]:9.2f})  {ratio}")


def header(title):
    print(f"\n## {title}")
    print(f"{'method':68s} {'ms min':>9s} ({'median':>9s})  {'time / anchor (min)':>8s}")


# --------------------------------------------------------------------------- CPU
def cpu_part(n, reps, k):
    import numba
    import scipy
    from scipy.spatial import cKDTree

    from tiga_numba import neighbors

    pos, cutoff = problem(n)
    print(f"# CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} logical cores, "
          f"numba {numba.__version__} ({numba.get_num_threads()} threads), scipy {scipy.__version__}")
    indptr, indices = neighbors.radius_graph(pos, cutoff)
    pairs = cKDTree(pos).query_pairs(cutoff, output_type="ndarray")
    assert indices.shape[0] == 2 * pairs.shape[0], "edge counts differ from cKDTree"
    header(f"radius graph N={n} cutoff={cutoff:.5f} E={indices.shape[0]} (E/N={indices.shape[0] / n:.1f})")
    kd_pairs = timed(lambda: cKDTree(pos).query_pairs(cutoff, output_type="ndarray"), reps)
    kd_csr = timed(lambda: cKDTree(pos).sparse_distance_matrix(
        cKDTree(pos), cutoff, output_type="coo_matrix").tocsr(), reps)
    ours = timed(lambda: neighbors.radius_graph(pos, cutoff), reps)
    row("cKDTree build + query_pairs (ndarray, each pair once)", kd_pairs)
    row("cKDTree build + sparse_distance_matrix -> CSR", kd_csr)
    row("tiga cell lists (numba parallel) -> CSR, vs query_pairs", ours, kd_pairs)
    row("tiga cell lists (numba parallel) -> CSR, vs sparse_distance_matrix", ours, kd_csr)

    indptr, indices = neighbors.knn_graph(pos, k)
    _, nb = cKDTree(pos).query(pos, k + 1)
    assert np.array_equal(np.sort(nb[:, 1:], axis=1), indices.reshape(n, k)), "knn differs"
    header(f"knn graph N={n} k={k} E={indices.shape[0]}")
    kd1 = timed(lambda: cKDTree(pos).query(pos, k + 1, workers=1), reps)
    kda = timed(lambda: cKDTree(pos).query(pos, k + 1, workers=-1), reps)
    ours = timed(lambda: neighbors.knn_graph(pos, k), reps)
    row("cKDTree build + query(k+1, workers=1)", kd1)
    row(f"cKDTree build + query(k+1, workers=-1: {os.cpu_count()} threads)", kda)
    row("tiga cell lists (numba parallel) -> CSR, vs workers=1", ours, kd1)
    row("tiga cell lists (numba parallel) -> CSR, vs workers=-1", ours, kda)


# --------------------------------------------------------------------------- GPU
def gpu_part(n, reps, k):
    import cupy

    import tiga_numba as tg
    from tiga_numba import neighbors

    dev = cupy.cuda.Device()
    sync = dev.synchronize
    name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    print(f"# GPU: {name}, cupy {cupy.__version__}; host builder on {os.cpu_count()} logical cores")
    pos, cutoff = problem(n)
    dpos = cupy.asarray(pos)
    sync()
    try:
        import torch
        import torch_cluster  # noqa: F401
        tpos = torch.as_tensor(pos, device="cuda")
    except Exception as exc:  # noqa: BLE001
        torch_cluster = None
        print(f"# torch_cluster: not importable on this machine ({type(exc).__name__}: {exc})")

    def via_host_radius():
        ip, ix = neighbors.radius_graph(dpos.get(), cutoff)
        return cupy.asarray(ip), cupy.asarray(ix)

    def via_host_knn():
        ip, ix = neighbors.knn_graph(dpos.get(), k)
        return cupy.asarray(ip), cupy.asarray(ix)

    for kind, arg, on_gpu, via_host, graph in (
            ("radius", cutoff, lambda: neighbors.radius_graph(dpos, cutoff), via_host_radius,
             lambda: tg.Graph.radius(dpos, cutoff)),
            ("knn", k, lambda: neighbors.knn_graph(dpos, k), via_host_knn,
             lambda: tg.Graph.knn(dpos, k))):
        t0 = time.perf_counter()
        gi, gx = on_gpu()
        sync()
        first = (time.perf_counter() - t0) * 1e3
        hi, hx = neighbors.radius_graph(pos, cutoff) if kind == "radius" else neighbors.knn_graph(pos, k)
        same = bool(np.array_equal(gi.get(), hi) and np.array_equal(gx.get(), hx))
        assert same, f"{kind}: GPU builder differs from the host builder"
        header(f"{kind} graph on the GPU, N={n} {'cutoff' if kind == 'radius' else 'k'}={arg:.5g} "
               f"E={gx.shape[0]} (GPU CSR == host CSR: {same}; first call incl. compile {first:.0f} ms)")
        host_t = timed(via_host, reps, sync)
        gpu_t = timed(on_gpu, reps, sync)
        graph_t = timed(graph, reps, sync)
        row("tiga host builder incl. transfers (positions D->H, CSR H->D)", host_t)
        row("tiga GPU builder (neighbors.%s_graph, CSR stays on device)" % kind, gpu_t, host_t)
        row("tiga Graph.%s(cupy positions) incl. validation" % kind, graph_t, host_t)
        if torch_cluster is not None:
            import torch_cluster as tc
            if kind == "radius":
                fn = lambda: tc.radius_graph(tpos, r=cutoff, max_num_neighbors=1 << 10)  # noqa: E731
            else:
                fn = lambda: tc.knn_graph(tpos, k=k)  # noqa: E731
            row(f"torch_cluster.{kind}_graph (COO, unsorted)", timed(fn, reps, torch.cuda.synchronize),
                host_t)


def sanitize_part():
    """Small GPU builds for compute-sanitizer: every kernel, the edge cases, checked against
    the host builder."""
    import cupy

    from tiga_numba import neighbors
    rng = np.random.default_rng(3)
    cases = [rng.random((300, 3)), rng.random((200, 2)).astype(np.float32), rng.random((1, 3)),
             np.repeat(rng.random((40, 3)), 2, axis=0), rng.random((100, 3)) * 1e6,
             rng.random((150, 1))]
    for pos in cases:
        for cutoff in (0.0, 0.15):
            gi, gx = neighbors.radius_graph(cupy.asarray(pos), cutoff)
            hi, hx = neighbors.radius_graph(pos, cutoff)
            assert np.array_equal(gi.get(), hi) and np.array_equal(gx.get(), hx)
        for k in (1, 7):
            gi, gx = neighbors.knn_graph(cupy.asarray(pos), k)
            hi, hx = neighbors.knn_graph(pos, k)
            assert np.array_equal(gi.get(), hi) and np.array_equal(gx.get(), hx)
    cupy.cuda.Device().synchronize()
    print(f"sanitize cases OK ({len(cases)} inputs x radius/knn)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["cpu", "gpu", "sanitize"], default="cpu")
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"# command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    if args.part == "sanitize":
        sanitize_part()
    else:
        (cpu_part if args.part == "cpu" else gpu_part)(args.n, args.reps, args.k)


if __name__ == "__main__":
    main()
