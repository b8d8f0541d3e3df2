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
    n = indptr.shape[0] - 1
    f = values.shape[1]
    for r in prange(n):
        row = out[r]
        row[:] = 0
        for t in range(indptr[r], indptr[r + 1]):
            v = values[order[t]]
            for c in range(f):
                row[c] += v[c]


@njit(parallel=True, cache=True)
def _contiguous_segment_sums(values, indptr, out):
    n = indptr.shape[0] - 1
    f = values.shape[1]
    for r in prange(n):
        row = out[r]
        row[:] = 0
        for t in range(indptr[r], indptr[r + 1]):
            v = values[t]
            for c in range(f):
                row[c] += v[c]


def segment_sums(values, indptr, order=None):
    """(len(indptr) - 1, F): out[r] = sum of values[order[t]] (values[t] without `order`) for t
    in indptr[r]:indptr[r + 1], in that order. values (E, F) is made C-contiguous."""
    values = np.ascontiguousarray(values)
    out = np.empty((indptr.shape[0] - 1, values.shape[1]), values.dtype)
    if order is None:
        _contiguous_segment_sums(values, indptr, out)
    else:
        _segment_sums(values, order, indptr, out)
    return out
