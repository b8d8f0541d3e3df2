"""Geometry probe of the CUDA-core CSR kernels on the graphs of bench_split_gpu.py (1M nodes,
16M edges, float32; H=4, D=32 unless told). Forward: lanes per (row, head) G, threads per CTA
NT, edges per step UE and a register cap per variant, timed alone. Backward (--bwd-regs): a
register cap of the dq and dk/dv kernels per variant, the shipped forward, timed as fwd+bwd.
Each variant is timed with CUDA events over back-to-back calls (benchmarks/run.py:
gpu_seconds) and compared with the first variant's results (max |diff|).

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
from run import gpu_seconds  # noqa: E402


def sweep(args, rng, kind, variants, fields, call, label):
    """For every selected graph (sources drawn from `rng`, then the graphs' degrees) and variant:
    the `kind` ("fwd" / "bwd") tiles with `fields(variant)` replaced, kernels rebuilt on a fresh
    Graph, `call(graph)` timed; prints `label(variant, seconds)`."""
    import cupy

    import tiga_numba as tg
    from tiga_numba.cuda import api
    from tiga_numba.kernel_cache import KERNELS

    shipped = api._csr_tiles
    indices = cupy.asarray(rng.integers(0, args.n, args.e, dtype=np.int32))
    try:
        for name, indptr in csr_graphs(args.n, args.e, rng).items():
            if name not in args.graphs.split(","):
                continue
            indptr = cupy.asarray(indptr)
            ref = None
            for variant in variants:
                def tiles(k, dtype, D, DV, variant=variant):
                    t = shipped(k, dtype, D, DV)
                    return dataclasses.replace(t, **fields(variant)) if k == kind else t
                api._csr_tiles = tiles
                KERNELS._kernels.clear()
                g = tg.Graph.from_csr(indptr, indices, num_src=args.n)   # fresh: no launch record
                got = call(g)
                seconds = gpu_seconds(lambda: call(g), args.reps)
                ref = got if ref is None else ref
                diff = max(float(cupy.abs(a - b).max()) for a, b in zip(got, ref))
                print(f"{name:<9} {label(variant, seconds)}  max|diff| {diff:.1e}", flush=True)
                g = got = None
                cupy.get_default_memory_pool().free_all_blocks()
    finally:
        api._csr_tiles = shipped


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
    import cupy

    import tiga_numba as tg

    args.n, args.e = 1 << 20, 1 << 24
    H, D = args.heads, args.dim
    rng = np.random.default_rng(0)
    q, k, v = (cupy.asarray(rng.standard_normal((args.n, H, D), dtype=np.float32)) for _ in range(3))
    if args.bwd_regs:
        do = cupy.asarray(rng.standard_normal((args.n, H, D), dtype=np.float32))
        print(f"CSR {args.n} x {args.e} edges, H={H}, D={D}, float32: backward register caps")

        def fwd_bwd(g):
            out, st = tg.attention(q, k, v, g, return_stats=True)
            return tg.attention_backward(do, q, k, v, out, st, g)
        sweep(args, rng, "bwd", [int(x) for x in args.bwd_regs.split(",")], lambda r: {"REGS": r},
              fwd_bwd, lambda r, s: f"bwd regs<={r or '-':<4} fwd+bwd {s * 1e3:8.3f} ms")
        return
    bw = copy_bandwidth()
    gathered = args.e * H * D * 4 * 2
    print(f"CSR {args.n} x {args.e} edges, H={H}, D={D}, float32; copy {bw / 1e12:.2f} TB/s")
    variants = [tuple(int(x) for x in item.split(":")) for item in args.variants.split(",")]

    def label(variant, s):
        G, NT, UE, R = variant
        return (f"G={G:<2} NT={NT:<3} UE={UE:<2} regs<={R or '-':<4} fwd {s * 1e3:7.3f} ms  "
                f"gather {gathered / s / 1e12:5.2f} TB/s ({100 * gathered / s / bw:4.0f}% of copy)")
    sweep(args, rng, "fwd", variants, lambda x: dict(zip(("G", "NT", "UE", "REGS"), x)),
          lambda g: (tg.attention(q, k, v, g),), label)


if __name__ == "__main__":
    main()
