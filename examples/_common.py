"""Shared set-up for the examples: array library (cupy on a GPU, else numpy), sizes, checks.

The programs are the same on both libraries; only the storage differs: numpy's Generator
makes the inputs on the host, and they are moved to the GPU when cupy and a device are present.
"""
from __future__ import annotations

import os
import re
import sys

try:
    import tiga_numba  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np


def array_library(argv=None):
    """(xp, on_gpu, full): cupy when it imports and sees a device (TIGA_EXAMPLES_CPU=1 forces
    numpy), and whether to run the full sizes (--full, or always on a GPU)."""
    argv = sys.argv[1:] if argv is None else argv
    full = "--full" in argv
    if os.environ.get("TIGA_EXAMPLES_CPU") != "1":
        try:
            import cupy
            if cupy.cuda.runtime.getDeviceCount() > 0:
                return cupy, True, True
        except Exception:  # noqa: BLE001 - no cupy, no driver, no device: use the CPU
            pass
    return np, False, full


def to_library(xp, host_array):
    return host_array if xp is np else xp.asarray(host_array)


def to_host(a):
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def lane_major(xp, gen, heads, nodes, width, dtype):
    """Head-major storage: build (H, N, D), hand over the (N, H, D) view (strided, no copy)."""
    host = gen.standard_normal((heads, nodes, width), dtype=np.float32).astype(dtype)
    return to_library(xp, host).transpose(1, 0, 2)


def tolerance(dtype):
    """Max abs error allowed against the float64 oracle, relative to max(1, |oracle|)."""
    return {np.dtype(np.float16): 2e-2, np.dtype(np.float32): 1e-4,
            np.dtype(np.float64): 1e-10}[np.dtype(dtype)]


def max_error(out, oracle):
    out = to_host(out).astype(np.float64)
    return float(np.max(np.abs(out - oracle))) if out.size else 0.0


def check(label, out, oracle, dtype):
    """Print one check line; return True when within tolerance."""
    err = max_error(out, oracle)
    bound = tolerance(dtype) * max(1.0, float(np.max(np.abs(oracle))) if oracle.size else 1.0)
    ok = err <= bound
    print(f"check {label}: max |out - oracle| = {err:.3e} (bound {bound:.1e}) -> "
          f"{'OK' if ok else 'FAILED'}")
    return ok


def dense_oracle(q, k, v, scale, budget=1 << 24):
    """float64 oracle of dense attention for a prefix of the query rows.

    The oracle materialises every edge (E x H x D float64); for the full 1024-node runs
    that is gigabytes, so large runs are checked on the first rows that fit `budget`
    elements per array. Rows of dense attention are independent, so the prefix is checked
    exactly (a rectangular relation)."""
    import tiga_numba as tg
    from tiga_numba import reference
    per_row = k.shape[0] * q.shape[1] * max(q.shape[-1], v.shape[-1])
    rows = max(1, min(q.shape[0], budget // per_row))
    oracle = reference.attention(q[:rows], k, v, tg.Graph.dense(k.shape[0], rows), scale=scale)
    return oracle, rows


def tile_sizes(plan):
    """(block_m, block_n) of the last kernel, from its run_info ("BM=64 BN=64")."""
    m = re.search(r"BM=(\d+)\s+BN=(\d+)", str(plan.run_info.get("tiles", "")))
    return (int(m.group(1)), int(m.group(2))) if m else None


def same_rule_oracle(q, k, v, graph, rho, scale, plan):
    """float64 replay of the tile-admission rule with the backend's tile sizes and visiting
    order: (out, pruned, total). The rule's outcome depends on both (docs/cpu_backend.md):
    the CPU kernels visit key tiles in increasing order (tiga_numba.reference.pruned_attention);
    the CUDA kernels start at the diagonal tile (causal blocks, then backwards) or at the key
    tile facing the query tile (then wrapping), so a local score pattern sets the running max
    first (same replay as tests/test_cuda_sim.py)."""
    from tiga_numba import reference
    bm, bn = tile_sizes(plan)
    if plan.backend == "cpu":
        out, _, _, (pruned, total) = reference.pruned_attention(
            q, k, v, graph, rho=rho, block_m=bm, block_n=bn, scale=scale, return_stats=True)
        return out, pruned, total
    return _cuda_order_replay(q, k, v, graph, rho, scale, bm, bn)


@np.errstate(invalid="ignore")  # -inf - -inf in fully masked rows; np.where picks 0 there
def _cuda_order_replay(q, k, v, graph, rho, scale, bm, bn):
    q, k, v = (to_host(a).astype(np.float64) for a in (q, k, v))
    rel = graph.realize("cpu")
    H, grp, DV = q.shape[1], q.shape[1] // k.shape[1], v.shape[2]
    out = np.zeros((q.shape[0], H, DV))
    total = pruned = 0
    log_rho = np.log(rho)
    for h in range(H):
        for b in range(len(rel.causal)):
            d0, d1 = int(rel.dst_offsets[b]), int(rel.dst_offsets[b + 1])
            s0, s1 = int(rel.src_offsets[b]), int(rel.src_offsets[b + 1])
            causal = bool(rel.causal[b])
            for qt in range(d0, d1, bm):
                rows = np.arange(qt, min(qt + bm, d1))
                kend = min(s1 - s0, qt - d0 + bm) if causal else s1 - s0
                ntl = -(-kend // bn)
                if causal:
                    order = list(range(ntl - 1, -1, -1))
                else:
                    t0 = min(ntl - 1, ((qt - d0 + bm // 2) * (s1 - s0) // max(d1 - d0, 1)) // bn)
                    order = [(t0 + i) % ntl for i in range(ntl)]
                m = np.full(len(rows), -np.inf)
                l = np.zeros(len(rows))
                acc = np.zeros((len(rows), DV))
                for kt in (x * bn for x in order):
                    cols = np.arange(kt, min(kt + bn, kend))
                    sc = q[rows, h] @ k[s0 + cols, h // grp].T * scale
                    if causal:
                        sc = np.where(cols[None, :] <= (rows - d0)[:, None], sc, -np.inf)
                    total += 1
                    if np.isfinite(m.max()) and sc.max() < m.max() + log_rho:
                        pruned += 1
                        continue
                    mn = np.maximum(m, sc.max(axis=1))
                    alpha = np.where(np.isfinite(m), np.exp(m - mn), 0.0)
                    p = np.where(np.isfinite(sc), np.exp(sc - mn[:, None]), 0.0)
                    l = l * alpha + p.sum(axis=1)
                    acc = acc * alpha[:, None] + p @ v[s0 + cols, h // grp]
                    m = mn
                out[rows, h] = acc / np.where(l > 0, l, 1.0)[:, None]
    return out, pruned, total


def finish(ok):
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    sys.exit(0 if ok else 1)
