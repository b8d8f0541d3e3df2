"""numba kernels for the layers' per-edge steps on numpy arrays.

The GPU path writes these steps with cupy / cuSPARSE; on the CPU, numpy's masked multiply and
scipy's sparse products run on one core and stream their (E, H) operands at random, which after
the fused attention kernels became the larger part of a layer's backward. These loops use
numba's threads and visit rows in a fixed order (the same bits on every run and thread count).
(Prefetching the gathered rows, as the attention kernels do, measured no faster here: a row's
~17 entries of 32 bytes leave too little work to hide a miss behind.)
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..cpu.threads import run, useful


@njit(parallel=True, cache=True)
def leaky_relu_grad_inplace(out, grad, slope):
    """grad *= 1 where out > 0 else slope, elementwise over two C-contiguous arrays."""
    g = grad.reshape(-1)
    o = out.reshape(-1)
    for i in prange(g.shape[0]):
        if not o[i] > 0:
            g[i] *= slope


@njit(parallel=True, cache=True)
def _segment_sums(values, order, indptr, out):
    """out[r] = sum of values[order[t]] (values[t] when `order` is empty) over indptr[r]:indptr[r+1]."""
    gathered = order.shape[0] > 0
    f = values.shape[1]
    for r in prange(indptr.shape[0] - 1):
        row = out[r]
        row[:] = 0
        for t in range(indptr[r], indptr[r + 1]):
            v = values[order[t] if gathered else t]
            for c in range(f):
                row[c] += v[c]


def segment_sums(values, indptr, order=None):
    """(len(indptr) - 1, F): out[r] = sum of values[order[t]] (values[t] without `order`) for t
    in indptr[r]:indptr[r + 1], in that order. values (E, F) is made C-contiguous."""
    values = np.ascontiguousarray(values)
    out = np.empty((indptr.shape[0] - 1, values.shape[1]), values.dtype)
    run(_segment_sums, useful(out.shape[0], values.size), values,
        np.zeros(0, np.int64) if order is None else order, indptr, out)
    return out
