"""Geometry probe of the CUDA-core CSR forward on the graphs of bench_split_gpu.py (1M nodes,
16M edges, float32; H=4, D=32 unless told): lanes per (row, head) G, threads per CTA NT, edges
per step UE and a register cap, each variant timed with CUDA events over back-to-back calls and
compared with the first variant's output (max |diff|).

    python benchmarks/gpu/csr_probe.py [--reps 20] [--dim 64] [--heads 4]
        [--graphs uniform,power-law,hub-3/4] [--variants G:NT:UE:REGS,...]
    python benchmarks/gpu/csr_probe.py --bwd-regs 0,64,48 [--graphs ...]   # the backward's kernels
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_split_gpu import copy_bandwidth, csr_graphs  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--graphs", default="uniform", help="comma-separated: uniform, power-law, hub-3/4")
    ap.add_argument("--variants", default="8:128:1:40,8:128:4:0,8:128:1:0,8:128:2:0,16:128:2:0",
                    help="comma-separated G:NT:UE:max_registers (0: no cap) of the forward")
    ap.add_argument("--bwd-regs", default="",
                    help="comma-separated register caps of the backward's dq and dk/dv kernels (0: "
                         "none): then the shipped forward and fwd+bwd timed per cap instead")
    args = ap.parse_args()
    if args.bwd_regs:
        return backward_probe(args)
    import cupy

    import tiga_numba as tg
    from tiga_numba.cuda import api
    from tiga_numba.kernel_cache import KERNELS

    n, e, H, D = 1 << 20, 1 << 24, args.heads, args.dim
    rng = np.random.default_rng(0)
    q, k, v = (cupy.asarray(rng.standard_normal((n, H, D), dtype=np.float32)) for _ in range(3))
    indices = cupy.asarray(rng.integers(0, n, e, dtype=np.int32))
    bw = copy_bandwidth()
    gathered = e * H * D * 4 * 2
    print(f"CSR {n} x {e} edges, H={H}, D={D}, float32; copy {bw / 1e12:.2f} TB/s")
    shipped_tiles = api._csr_tiles
    variants = [tuple(int(x) for x in item.split(":")) for item in args.variants.split(",")]
    for name, indptr in csr_graphs(n, e, rng).items():
        if name not in args.graphs.split(","):
            continue
        indptr = cupy.asarray(indptr)
        ref = None
        for G, NT, UE, R in variants:
            def tiles(kind, dtype, D_, DV_, G=G, NT=NT, UE=UE, R=R):
                t = shipped_tiles(kind, dtype, D_, DV_)
                return dataclasses.replace(t, G=G, NT=NT, UE=UE, REGS=R) if kind == "fwd" else t
            api._csr_tiles = tiles
            KERNELS._kernels.clear()
            g = tg.Graph.from_csr(indptr, indices, num_src=n)   # fresh: no launch record kept
            out = tg.attention(q, k, v, g)
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            for _ in range(args.reps):
                tg.attention(q, k, v, g)
            stop.record()
            stop.synchronize()
            t = cupy.cuda.get_elapsed_time(start, stop) / 1e3 / args.reps
            if ref is None:
                ref = out
            diff = float(cupy.abs(out - ref).max())
            print(f"{name:<9} G={G:<2} NT={NT:<3} UE={UE:<2} regs<={R or '-':<4} fwd {t * 1e3:7.3f} ms  "
                  f"gather {gathered / t / 1e12:5.2f} TB/s ({100 * gathered / t / bw:4.0f}% of copy)  "
                  f"max|diff| {diff:.1e}", flush=True)
            g = out = None
            cupy.get_default_memory_pool().free_all_blocks()
    api._csr_tiles = shipped_tiles


def backward_probe(args):
    """fwd+bwd per register cap of the CSR backward kernels (dq, dk/dv), shipped forward."""
    import cupy

    import tiga_numba as tg
    from tiga_numba.cuda import api
    from tiga_numba.kernel_cache import KERNELS

    n, e, H, D = 1 << 20, 1 << 24, args.heads, args.dim
    rng = np.random.default_rng(0)
    q, k, v, do = (cupy.asarray(rng.standard_normal((n, H, D), dtype=np.float32)) for _ in range(4))
    indices = cupy.asarray(rng.integers(0, n, e, dtype=np.int32))
    print(f"CSR {n} x {e} edges, H={H}, D={D}, float32: backward register caps")
    shipped_tiles = api._csr_tiles
    for name, indptr in csr_graphs(n, e, rng).items():
        if name not in args.graphs.split(","):
            continue
        indptr = cupy.asarray(indptr)
        ref = None
        for R in (int(x) for x in args.bwd_regs.split(",")):
            def tiles(kind, dtype, D_, DV_, R=R):
                t = shipped_tiles(kind, dtype, D_, DV_)
                return dataclasses.replace(t, REGS=R) if kind == "bwd" else t
            api._csr_tiles = tiles
            KERNELS._kernels.clear()
            g = tg.Graph.from_csr(indptr, indices, num_src=n)

            def fb():
                out, st = tg.attention(q, k, v, g, return_stats=True)
                return tg.attention_backward(do, q, k, v, out, st, g)
            grads = fb()
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            for _ in range(args.reps):
                fb()
            stop.record()
            stop.synchronize()
            t = cupy.cuda.get_elapsed_time(start, stop) / 1e3 / args.reps
            ref = ref or grads
            diff = max(float(cupy.abs(a - b).max()) for a, b in zip(grads, ref))
            print(f"{name:<9} bwd regs<={R or '-':<4} fwd+bwd {t * 1e3:8.3f} ms  max|diff| {diff:.1e}",
                  flush=True)
            g = grads = None
            cupy.get_default_memory_pool().free_all_blocks()
    api._csr_tiles = shipped_tiles


if __name__ == "__main__":
    main()
