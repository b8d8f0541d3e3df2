"""Array layouts the CPU kernels read, and work-item ordering.

The kernels want contiguous arrays in the accumulation dtype (float32, or float64 for
float64 inputs; float16 is widened once here, not per use).  Block kernels read head-major
``(H, N, D)`` so that a (tile x D) slice of one head is a contiguous BLAS operand; CSR kernels
read node-major ``(N, H, D)`` so that one gathered source row brings every head.  Each copy
made is recorded (``copies``) for ``explain()``; q is always copied because it is
pre-multiplied by ``scale * log2(e)``.  The copies of float32 / float64 inputs are numba loops
split over the threads (conversion, re-layout and scaling in one pass); other input dtypes
(float16, bfloat16) are converted by numpy.  Grouped-query heads: ``kv_heads`` maps each query
head to the key/value head it reads.
"""
import numpy as np
from numba import njit, prange

from ..arrays import dtype_name
from .threads import run, useful


def acc_dtype_of(dtype):
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def c_strides(x):
    """A C-contiguous `x` with the strides numpy gives a new array of its shape. numpy calls an
    array C-contiguous whatever the strides of its length-1 axes (a one-row view with a negative
    or odd row stride is one), while a BLAS takes a row stride as the leading dimension and
    refuses one that is negative or smaller than a row: the kernels read such arrays through
    these strides, which address the same elements (a view: flattening a C-contiguous array and
    reshaping it back gives numpy's own strides for the shape, without a copy)."""
    if x.size == 0 or not x.flags.c_contiguous:
        return x
    return x.reshape(-1).reshape(x.shape)


def _why(x, acc):
    reasons = []
    if x.dtype != acc:
        reasons.append(f"{dtype_name(x.dtype)} -> {dtype_name(acc)}")
    return reasons


@njit(parallel=True, cache=True)
def _scaled_copy(x, out, scale):
    """out[n] = x[n] * scale for (N, H, D) arrays of one dtype, any strides (out may be a transposed
    view of a head-major array), rows split over the threads: one pass where numpy's assignment
    and in-place multiply made two on one thread. x * scale is rounded once, as numpy's was, so
    the forward and the backward pre-scale q to the same bits either way; scale 1 copies exactly."""
    for n in prange(x.shape[0]):
        xn = x[n]
        on = out[n]
        for h in range(xn.shape[0]):
            for d in range(xn.shape[1]):
                on[h, d] = xn[h, d] * scale


def copy_into(out, x, acc, scale=None):
    """out[...] = x * scale (scale None: x), converted to ``acc``; out and x (N, H, D) views."""
    if x.dtype == acc and acc in (np.float32, np.float64) and x.size:
        run(_scaled_copy, useful(x.shape[0], x.size), x, out, acc.type(1.0 if scale is None else scale))
        return
    out[...] = x   # other input dtypes (float16, bfloat16): numpy converts
    if scale is not None:
        out *= acc.type(scale)


def contiguous(x, dtype):
    """x as a C-contiguous (N, H, D) array of `dtype`: itself when it is one, else a copy (threaded
    when no conversion is needed, e.g. the block backward's head-major dk / dv back to (N, H, D))."""
    dtype = np.dtype(dtype)
    if x.dtype == dtype and x.flags.c_contiguous:
        return x
    if x.ndim != 3 or x.dtype != dtype or dtype not in (np.float32, np.float64):
        return np.ascontiguousarray(x, dtype=dtype)
    out = np.empty(x.shape, dtype)
    copy_into(out, x, dtype)
    return out


@njit(parallel=True, cache=True)
def _nonfinite_rows(x):
    """rows of a C-contiguous 2-D array holding a non-finite value (x - x is NaN exactly for inf
    and NaN, 0 otherwise; counting the cells where it is not 0 is an integer sum LLVM vectorises)."""
    bad = 0
    for n in prange(x.shape[0]):
        z = 0
        row = x[n]
        for j in range(row.shape[0]):
            z += 0 if row[j] - row[j] == 0 else 1
        if z != 0:
            bad += 1
    return bad


def all_finite(x):
    """whether every element of the contiguous float array x is finite (threads share the rows)."""
    if x.size == 0:
        return True
    if not x.flags.c_contiguous or x.dtype not in (np.float32, np.float64):
        return bool(np.isfinite(x).all())
    return run(_nonfinite_rows, useful(x.shape[0], x.size), x.reshape(x.shape[0], -1)) == 0


@njit(parallel=True, cache=True)
def _transpose_heads(xh, out):
    """out[h] = xh[h].T for (H, N, D) -> (H, D, N), in blocks of 64 rows so that the rows read and
    the 64-element pieces of the columns written stay in cache."""
    H, N, D = xh.shape
    nb = (N + 63) // 64
    for t in prange(H * nb):
        h = t // nb
        n0 = (t % nb) * 64
        n1 = min(N, n0 + 64)
        for d in range(D):
            od = out[h, d]
            for n in range(n0, n1):
                od[n] = xh[h, n, d]


def transposed_heads(xh, pad=0):
    """(H, N, D) contiguous -> (H, D, N + pad) contiguous, same dtype, zeros in the `pad` columns
    past N (a product over whole column blocks may read them; its extra columns are not used)."""
    out = np.empty((xh.shape[0], xh.shape[2], xh.shape[1] + pad), xh.dtype)
    out[:, :, xh.shape[1]:] = 0
    if xh.size:   # writes columns [0, N) of each row
        run(_transpose_heads, useful(work=xh.size), xh, out)
    return out


def head_major(x, acc, name, copies, scale=None):
    """(N, H, D) -> contiguous (H, N, D) in ``acc`` (times ``scale`` when given)."""
    t = x.transpose(1, 0, 2)
    if scale is None and x.dtype == acc and t.flags.c_contiguous:
        return c_strides(t)  # e.g. one kv head stored contiguously: read in place
    out = np.empty(t.shape, acc)
    copy_into(out.transpose(1, 0, 2), x, acc, scale)
    why = _why(x, acc) + (["head-major"] if not t.flags.c_contiguous else [])
    if scale is not None:
        why.append("pre-scaled by scale*log2(e)")
    copies.append(f"{name} -> (H, N, D) {dtype_name(acc)} ({', '.join(why)})")
    return out


def node_major(x, acc, name, copies, scale=None):
    """(N, H, D) -> C-contiguous (N, H, D) in ``acc`` (times ``scale`` when given)."""
    if scale is None and x.dtype == acc and x.flags.c_contiguous:
        return c_strides(x)
    out = np.empty(x.shape, acc)
    copy_into(out, x, acc, scale)
    why = _why(x, acc) + (["contiguous"] if not x.flags.c_contiguous else [])
    if scale is not None:
        why.append("pre-scaled by scale*log2(e)")
    copies.append(f"{name} -> contiguous (N, H, D) {dtype_name(acc)} ({', '.join(why)})")
    return out


def in_place(x, acc, name, copies):
    """x itself when it already holds `acc` elements, whatever its strides (a kernel that reads
    rows where they are: the split-key decode); else a converted copy, recorded in `copies`."""
    if x.dtype == acc:
        return x
    copies.append(f"{name} -> {dtype_name(acc)} copy (read in place otherwise)")
    return x.astype(acc)


def order_balanced(costs, threads):
    """Permutation of work items such that numba's static prange schedule over `threads`
    threads (equal contiguous counts of items, one run per thread) gives every thread about the
    same work: the items, most expensive first, are dealt in snake order (0, 1, .., T-1, T-1, ..,
    0, ...) to T lists of equal length, which are then laid end to end. Pairing the most and
    least expensive items instead left one thread with every long piece of a power-law graph
    (1.7x the uniform graph's time on 2 threads, 1.02x with this). The order never changes a
    result's bits: items write disjoint rows or slots, merged in slot order."""
    costs = np.asarray(costs)
    n = costs.shape[0]
    t = max(1, int(threads))
    if t == 1 or n <= 1:
        return np.arange(n, dtype=np.int64)
    order = np.argsort(-costs, kind="stable")
    rank = np.arange(n)
    lap = rank % (2 * t)
    owner = np.where(lap < t, lap, 2 * t - 1 - lap)
    return order[np.lexsort((rank, owner))].astype(np.int64)


@njit(cache=True)
def kv_heads(H, group):
    """The key/value head of each query head (h // group), computed once per call: the kernels
    index k and v per edge and head, and an integer division there cost about as much as the
    arithmetic of a small head (H = 8, C = 8: forward ~20% faster without it)."""
    out = np.empty(H, np.int64)
    for h in range(H):
        out[h] = h // group
    return out
