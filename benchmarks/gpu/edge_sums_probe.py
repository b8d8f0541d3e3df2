"""The per-edge sums and per-head products of the GPU layers, each way they can be written,
timed alone (CUDA events around 20 calls) on a 100k-node / 1.6M-edge graph, 8 heads x 8:
cupyx's `incidence @ values` (column-major copy of values first) against cuSPARSE reading
values.T as op(B) = transpose; einsum against the elementwise / GEMM forms in layers._module.

    PYTHONPATH=. python benchmarks/gpu/edge_sums_probe.py
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import cupy  # noqa: E402
from cupyx import cusparse  # noqa: E402

import tiga_numba as tg  # noqa: E402
from tiga_numba.layers import _edges, _module  # noqa: E402
from bench_layers import make_graph  # noqa: E402
from run import gpu_seconds  # noqa: E402


def ms(fn, reps=20):
    return gpu_seconds(fn, reps) * 1e3


def main():
    n, e, h, c = 100_000, 1_600_000, 8, 8
    src, dst = make_graph("random", n, e)
    g = tg.Graph.from_coo(src, dst, n, n)
    es = _edges.edge_set(g, True, cupy)
    rng = np.random.default_rng(0)
    vals = cupy.asarray(rng.standard_normal((es.num_edges, h)).astype(np.float32))
    x3 = cupy.asarray(rng.standard_normal((n, h, c)).astype(np.float32))
    w = cupy.asarray(rng.standard_normal((n, h)).astype(np.float32))
    att = cupy.asarray(rng.standard_normal((h, c)).astype(np.float32))
    for side in ("dst", "src"):
        mat = es._incidence(side, vals.dtype)
        ref = mat @ vals
        got = cusparse.spmm(mat, vals.T, transb=True)
        err = float(cupy.abs(ref - got).max() / cupy.abs(ref).max())
        print(f"sum_by_{side}: mat @ values {ms(lambda: mat @ vals):.3f} ms | spmm(values.T, transb) "
              f"{ms(lambda: cusparse.spmm(mat, vals.T, transb=True)):.3f} ms | rel diff {err:.1e}")
    r1, r2 = cupy.einsum("nhc,hc->nh", x3, att), _module.head_dots(x3, att)
    print(f"head_dots: einsum {ms(lambda: cupy.einsum('nhc,hc->nh', x3, att)):.3f} ms | "
          f"elementwise {ms(lambda: _module.head_dots(x3, att)):.3f} ms | "
          f"rel diff {float(cupy.abs(r1 - r2).max() / cupy.abs(r1).max()):.1e}")
    r1, r2 = cupy.einsum("nh,nhc->hc", w, x3), _module.head_weighted_sums(w, x3)
    print(f"head_weighted_sums: einsum {ms(lambda: cupy.einsum('nh,nhc->hc', w, x3)):.3f} ms | "
          f"GEMM {ms(lambda: _module.head_weighted_sums(w, x3)):.3f} ms | "
          f"rel diff {float(cupy.abs(r1 - r2).max() / cupy.abs(r1).max()):.1e}")


if __name__ == "__main__":
    main()
