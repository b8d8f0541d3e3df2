"""Work divided by edges on the CPU: a call's time should follow its edge count, not its degree
distribution; decode (one query row, a long key range) should use every core.

    python benchmarks/bench_split.py                    # the sizes below (a few minutes, 2 cores)
    python benchmarks/bench_split.py --nodes 20000 --edges 320000 --keys 16384   # smaller

CSR part: N nodes, E edges, H=4, D=32, float32, three graphs with the same edge count:
  uniform    every destination receives E/N edges from random sources
  power-law  in-degrees drawn from a Zipf law (max in-degree printed)
  hub        one destination receives 3/4 of the edges (and one source is read by
             a quarter of them: the backward's transpose has a hub too)
Times: forward, forward+backward (min of --reps runs after a warm-up), and the ratio to the
uniform graph. The anchor is the eager torch version of the same computation (gather, PyG-style
segment softmax with torch_scatter-free index ops, weighted scatter-add), when torch is installed.

Decode part: one sequence of --keys keys, H=8 query heads (Hkv=8), D=128, float32:
Graph.dense(keys, 1) vs torch CPU scaled_dot_product_attention, same thread count
(bench_cpu.table_decode: torch gets contiguous copies in its own layout).
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

import tiga_numba as tg
from run import best_seconds as best  # noqa: E402  (benchmarks/run.py: the benchmarks' CPU timer)


def graphs(n, e, rng):
    out = {}
    dst = np.repeat(np.arange(n), e // n)
    out["uniform"] = (rng.integers(0, n, dst.shape[0]), dst)
    deg = rng.zipf(1.8, n).astype(np.float64)
    deg = np.maximum(1, np.round(deg / deg.sum() * e)).astype(np.int64)
    deg[np.argmax(deg)] += e - deg.sum()
    dst = np.repeat(np.arange(n), deg)
    out["power-law"] = (rng.integers(0, n, dst.shape[0]), rng.permutation(n)[dst])
    hub_e = 3 * e // 4
    dst = np.concatenate([np.full(hub_e, 7), rng.integers(0, n, e - hub_e)])
    src = rng.integers(0, n, e)
    src[: e // 4] = 11
    out["hub"] = (src, dst)
    return {k: tg.Graph.from_coo(s, d, n, n) for k, (s, d) in out.items()}


def gather_ceiling(k, v, indptr, indices, reps):
    """This machine's random-gather time for the forward's reads: the k and v rows of every edge,
    in CSR order, summed (so nothing is optimised away) and nothing else, on numba's threads;
    once as a plain loop and once with the kernels' software prefetch. The forward's time over
    this is how near it runs to what the memory system allows for its access pattern."""
    from numba import njit, prange

    from tiga_numba.cpu.prefetch import prefetch_row

    def make(prefetch):
        @njit(parallel=True)
        def gather(k, v, indptr, indices, out):
            n = indptr.shape[0] - 1
            for i in prange(n):
                acc = np.float32(0.0)
                for e in range(indptr[i], indptr[i + 1]):
                    if prefetch and e + 16 < indices.shape[0]:
                        prefetch_row(k, indices[e + 16])
                        prefetch_row(v, indices[e + 16])
                    j = indices[e]
                    kj, vj = k[j], v[j]
                    for h in range(kj.shape[0]):
                        for d in range(kj.shape[1]):
                            acc += kj[h, d] + vj[h, d]
                out[i] = acc
        return gather
    out = np.empty(indptr.shape[0] - 1, np.float32)
    return [best(lambda: g(k, v, indptr, indices, out), reps) for g in (make(False), make(True))]


def torch_version(q, k, v, src, dst, n):
    import torch
    qt, kt, vt = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    s_idx = torch.from_numpy(src)
    d_idx = torch.from_numpy(dst)

    def run(backward):
        s = (qt[d_idx] * kt[s_idx]).sum(-1) * q.shape[-1] ** -0.5           # (E, H)
        mx = torch.full((n, q.shape[1]), -torch.inf).scatter_reduce(0, d_idx[:, None].expand_as(s), s, "amax")
        p = torch.exp(s - mx[d_idx])
        den = torch.zeros(n, q.shape[1]).index_add(0, d_idx, p)
        p = p / den[d_idx]
        out = torch.zeros(n, q.shape[1], v.shape[2]).index_add(0, d_idx, p[..., None] * vt[s_idx])
        if backward:
            out.backward(torch.ones_like(out))
        return out
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("--edges", type=int, default=1_600_000)
    ap.add_argument("--keys", type=int, default=131_072)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    import numba
    print(f"# {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus, numba threads {numba.get_num_threads()}, numba {numba.__version__}")
    try:
        import torch
        torch.set_num_threads(numba.get_num_threads())
        print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads")
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    n, e, H, D = args.nodes, args.edges, 4, 32
    q = rng.standard_normal((n, H, D), dtype=np.float32)
    k = rng.standard_normal((n, H, D), dtype=np.float32)
    v = rng.standard_normal((n, H, D), dtype=np.float32)
    print(f"\n## CSR: {n} nodes, {e} edges, H={H}, D={D}, float32")
    print("| graph | max in-degree | max out-degree | fwd ms | fwd+bwd ms | fwd / uniform | fwd+bwd / uniform | torch fwd+bwd ms | torch / tiga |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = None
    for name, g in graphs(n, e, rng).items():
        ip, ix = g._host_csr()
        indeg = int(np.diff(ip).max())
        outdeg = int(np.bincount(ix, minlength=n).max())

        def fwd():
            return tg.attention(q, k, v, g, return_stats=True)

        def fb():
            out, st = tg.attention(q, k, v, g, return_stats=True)
            tg.attention_backward(out, q, k, v, out, st, g)
        tf, tb = best(fwd, args.reps), best(fb, args.reps)
        if base is None:
            base = (tf, tb)
            plain, pref = gather_ceiling(k, v, ip, ix, args.reps)
            ceiling = (f"# gather ceiling (uniform graph: k and v rows of every edge, {2 * H * D * 4} B per "
                       f"edge, nothing else): {plain * 1e3:.1f} ms plain, {pref * 1e3:.1f} ms with prefetch "
                       f"({2 * H * D * 4 * e / min(plain, pref) / 1e9:.1f} GB/s); uniform forward / best "
                       f"ceiling = {tf / min(plain, pref):.2f}")
        anchor = ""
        if torch is not None:
            rows = np.repeat(np.arange(n), np.diff(ip))
            ta = best(lambda: torch_version(q, k, v, ix.astype(np.int64), rows, n)(True), args.reps)
            anchor = f"{ta * 1e3:.1f} | {ta / tb:.2f}x"
        else:
            anchor = "- | -"
        print(f"| {name} | {indeg} | {outdeg} | {tf * 1e3:.1f} | {tb * 1e3:.1f} | {tf / base[0]:.2f} | "
              f"{tb / base[1]:.2f} | {anchor} |")

    print(ceiling)

    # the decode table of bench_cpu.py: torch reads contiguous (1, H, L, D) copies, its own best
    # layout (a transposed view of the node-major arrays made torch ~1.6x slower)
    from bench_cpu import table_decode
    table_decode(args.keys, max(args.reps, 7))

if __name__ == "__main__":
    main()
