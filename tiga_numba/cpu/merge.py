"""The online-softmax merge of partial attention results on numpy arrays, in one pass per part.

Two results (out_a, m_a, l_a), (out_b, m_b, l_b) over disjoint edge subsets of the same rows
combine, per (row, head), as::

    m = max(m_a, m_b);  w_a = l_a exp(m_a - m);  w_b = l_b exp(m_b - m);  l = w_a + w_b
    out = (w_a / l) out_a + (w_b / l) out_b

with an empty part (l = 0, m = -inf) contributing nothing (its out is not read) and a row
empty in both giving out 0, m = -inf, l = 0. The kernel reads each part once and writes the
result once, in the accumulation dtype, split over numba's threads by rows, where numpy
expressions of the same formula allocate a temporary the size of `out` per operation: 6.4-6.9x
faster at 500k rows, H=4, Dv=32 (benchmarks/bench_merge.py;
results/merge-cpu-zen4-2core-2026-12-06.txt). Parts are folded left to right, so the same parts
in the same order give the same bits for any thread count.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..arrays import accumulation_dtype
from ..scratch import output_empty
from .threads import run, serialised, useful


@njit(parallel=True, cache=True, nogil=True)
def _merge_pair(out_a, m_a, l_a, out_b, m_b, l_b, out, m, l):
    rows, width = out.shape
    for r in prange(rows):
        la, lb = l_a[r], l_b[r]
        # (a weight of `l * 0` rather than 0.0 keeps each branch's types those of the inputs)
        if la > 0 and lb > 0:
            mr = max(m_a[r], m_b[r])
            wa, wb = la * np.exp(m_a[r] - mr), lb * np.exp(m_b[r] - mr)
        elif la > 0:
            mr, wa, wb = m_a[r], la, lb * 0
        elif lb > 0:
            mr, wa, wb = m_b[r], la * 0, lb
        else:
            mr, wa, wb = -np.inf, la * 0, lb * 0
        lr = wa + wb
        # a part of weight 0 is left out, not multiplied by 0: an empty part is neutral whatever
        # its out holds (a hand-made part's NaN or inf, np.empty's garbage)
        if lr > 0 and wb == 0:
            for j in range(width):
                out[r, j] = out_a[r, j]
        elif lr > 0 and wa == 0:
            for j in range(width):
                out[r, j] = out_b[r, j]
        elif lr > 0:
            ca, cb = wa / lr, wb / lr
            for j in range(width):
                out[r, j] = ca * out_a[r, j] + cb * out_b[r, j]
        else:
            for j in range(width):
                out[r, j] = 0
        m[r], l[r] = mr, lr


def _rows(a, shape, acc=None):
    """`a` as a C-contiguous array of `shape` (in `acc` if given): a view where it already is one."""
    a = np.ascontiguousarray(a) if acc is None else np.ascontiguousarray(a, dtype=acc)
    return a.reshape(shape)


@serialised
def merge(parts):
    """(out, m, l) of the left-to-right merge of `parts` = [(out, m, l), ...] (two or more, numpy,
    shapes and dtypes checked by the caller): out in the parts' shape and dtype, m and l in the
    accumulation dtype of the first part's m. float16 / bfloat16 outs are widened once per part."""
    out0, m0, _ = parts[0]
    acc = accumulation_dtype(m0.dtype)
    rows = int(np.prod(m0.shape))
    width = int(np.prod(out0.shape[m0.ndim:]))
    # folded in the accumulation dtype (a float16 out is rounded once, at the end)
    result = output_empty((rows, width), acc)
    m_run, l_run = output_empty(rows, acc), output_empty(rows, acc)

    def wide(o):   # float16 outs widened once; float32 / float64 read as they are
        return _rows(o, (rows, width), None if o.dtype in (np.float32, np.float64) else acc)

    o_run, m_prev, l_prev = wide(out0), _rows(m0, rows, acc), _rows(parts[0][2], rows, acc)
    threads = useful(rows, rows * width)
    for o, m, l in parts[1:]:
        run(_merge_pair, threads, o_run, m_prev, l_prev, wide(o), _rows(m, rows, acc), _rows(l, rows, acc),
            result, m_run, l_run)
        o_run, m_prev, l_prev = result, m_run, l_run
    out = result.reshape(out0.shape).astype(out0.dtype, copy=False)
    return out, m_run.reshape(m0.shape), l_run.reshape(m0.shape)
