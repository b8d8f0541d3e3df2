"""Sums of consecutive runs of rows in a fixed order, on numpy arrays.

A per-sequence parameter (flash-attn's (batch, H) ALiBi slopes) is read by every row of its
sequence, so its gradient is the sum of its rows' per-row gradients. Each run is summed on its
own, in float64, from its first row onward: the bits depend neither on the other runs (a
running-sum difference would round each run relative to the total before it) nor on numpy's
reduction order (its reduce and reduceat sum pairwise, in blocks whose shape is numpy's
choice). The CUDA form (score_mod._SUM_RUNS_SOURCE) adds in the same order, so a cupy call
gives the same bits as a numpy call.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _sum_runs(g, starts, ends, out):
    n, width = out.shape
    for b in range(n):
        s, e = starts[b], ends[b]
        for c in range(width):
            acc = 0.0
            if s < e:
                acc = g[s, c]
                for r in range(s + 1, e):
                    acc += g[r, c]
            out[b, c] = acc


def sum_runs(g, starts, ends):
    """(len(starts),) + g.shape[1:] float64: row b adds rows starts[b] .. ends[b] - 1 of g in
    order, starting from the first (an empty run gives 0)."""
    n = len(starts)
    trailing = g.shape[1:]
    width = int(np.prod(trailing, dtype=np.int64))
    out = np.empty((n, width), np.float64)
    flat = np.ascontiguousarray(g, np.float64).reshape(g.shape[0], width)
    _sum_runs(flat, np.asarray(starts, np.int64), np.asarray(ends, np.int64), out)
    return out.reshape((n,) + trailing)
