"""Shared set-up for the examples: array library (cupy on a GPU, else numpy), sizes, checks.

The seed's programs are unchanged; only the storage differs: numpy's Generator makes the
inputs on the host, and they are moved to the GPU when cupy and a device are present.
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
    numpy), and whether to run the seed's full sizes (--full, or always on a GPU)."""
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
    """The seed's layout: build (H, N, D), hand over the (N, H, D) view (strided, no copy)."""
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

    The oracle materialises every edge (E x H x D float64); for the seed's 1024-node runs
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


def finish(ok):
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    sys.exit(0 if ok else 1)
