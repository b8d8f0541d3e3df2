"""Neighbour graphs from point positions: radius and k-nearest, in O(N) expected time.

Both builders bin the points into a uniform grid of cells (cell lists) and only look at
nearby cells, so the work is proportional to N times the local density, never N**2.
numpy positions are built here, on the host, with numba parallel loops; cupy positions are
built on the GPU by `tiga_numba.cuda.neighbors` and the CSR stays on the device. The two
builders produce the same graph bit for bit: the same grid (`radius_grid`, `knn_grid`),
the same float64 distance arithmetic (no fused multiply-add), the same canonical order.

Conventions (those of `Graph`): rows are destinations, `indices` are source ids, sorted
within a row by increasing source id; `indptr` int64 (N+1,), `indices` int32 (E,).
Positions of shape (N, 1|2|3) are padded with zero coordinates to 3-D and read as float64.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .cpu.threads import run, serialised, useful
from .neighbor_grid import RING_SLACK, cell_grid, knn_grid, knn_row_length, radius_grid

__all__ = ["radius_graph", "knn_graph", "last_build_info", "spatial_order"]

_LAST = {}

def last_build_info():
    """What the last radius_graph/knn_graph call did (builder, grid, copies), for explain()."""
    return dict(_LAST)


def _record(**info):
    _LAST.clear()
    _LAST.update(info)


# --------------------------------------------------------------------------- input handling
def on_device(array):
    """True for a GPU array (anything with __cuda_array_interface__ that is not numpy)."""
    return hasattr(array, "__cuda_array_interface__") and not isinstance(array, np.ndarray)


def check_positions(positions):
    """Validate positions (numpy, cupy, or a nested sequence); returns the array in its own
    library. Raises TypeError/ValueError naming `positions`."""
    arr = positions
    from .interop import is_foreign, to_native
    if is_foreign(arr):   # a torch / JAX / DLPack array: viewed as numpy or cupy (detached)
        arr = to_native(arr, "positions")
    if not on_device(arr):
        try:
            arr = np.asarray(arr)
        except Exception as exc:  # pragma: no cover - exotic inputs
            raise TypeError(f"positions must be an array, got {type(positions).__name__}") from exc
    if not np.issubdtype(np.dtype(arr.dtype), np.floating):   # the type first: None, "abc", ints
        raise TypeError(f"positions must be a floating-point array, got {type(positions).__name__} "
                        f"of dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[1] not in (1, 2, 3):
        raise ValueError(f"positions must have shape (N, 1|2|3), got {tuple(arr.shape)}")
    if arr.shape[0] >= 2**31:
        raise ValueError(f"positions must hold fewer than 2**31 points, got {arr.shape[0]}")
    if arr.size:
        xp = np
        if on_device(arr):
            import cupy as xp
        if not bool(xp.isfinite(arr).all()):
            raise ValueError("positions must be finite (found NaN or inf)")
        # the cell grid works on float64 extents: finite points whose span overflows float64
        # (e.g. -1e308 and 1e308) would make the grid loop forever
        with np.errstate(over="ignore"):   # the overflow is what is being tested for
            span = arr.max(axis=0).astype(np.float64) - arr.min(axis=0).astype(np.float64)
        if not bool(xp.isfinite(span).all()):
            raise ValueError("positions span more than the float64 range in some axis "
                             "(max - min overflows); rescale them")
    return arr


def _family(positions):
    """The registry's neighbour-builder family for these positions (cpu or cuda)."""
    from . import registry
    backend = "cuda" if on_device(positions) else "cpu"
    return registry.choose(registry.Request(op="neighbors", backend=backend)).family.name


def _gpu_builder():
    try:
        from .cuda import neighbors as gpu
    except ImportError as exc:
        raise ImportError("building a graph from GPU (cupy) positions needs numba-cuda: "
                          "pip install 'tiga-numba[cuda]'") from exc
    return gpu


def check_cutoff(cutoff):
    # float() would also parse a string ("0.3"): only numbers and numeric 0-d arrays are cutoffs
    if isinstance(cutoff, (str, bytes, bytearray, bool, np.bool_)) or (
            isinstance(cutoff, np.ndarray) and cutoff.dtype.kind not in "iuf"):
        raise TypeError(f"cutoff must be a real number, got {type(cutoff).__name__}")
    try:
        value = float(cutoff)
    except (TypeError, ValueError):
        raise TypeError(f"cutoff must be a real number, got {type(cutoff).__name__}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"cutoff must be finite and >= 0, got {value}")
    return value


def check_k(k):
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    k = int(k)
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return k


def _host_positions(positions):
    """(N, 3) float64 host copy (padded), plus the copies made, for the host builder."""
    copies = []
    arr = check_positions(positions)
    if on_device(arr):
        arr = arr.get() if hasattr(arr, "get") else np.asarray(arr)
        copies.append("positions copied device->host")
    pos = np.zeros((arr.shape[0], 3), np.float64)
    pos[:, : arr.shape[1]] = arr
    return pos, copies


def _bounds(pos):
    lo = pos.min(axis=0)
    return lo, pos.max(axis=0) - lo


@njit(cache=True)
def _bin(pos, lo, cell, dims):
    """Counting sort of the points by cell: (order, cell_start, sorted positions)."""
    n = pos.shape[0]
    ncell = dims[0] * dims[1] * dims[2]
    cid = np.empty(n, np.int64)
    counts = np.zeros(ncell + 1, np.int64)
    for i in range(n):
        c = _cell_of(pos[i], lo, cell, dims)
        k = (c[2] * dims[1] + c[1]) * dims[0] + c[0]
        cid[i] = k
        counts[k + 1] += 1
    for k in range(ncell):
        counts[k + 1] += counts[k]
    start = counts.copy()
    order = np.empty(n, np.int64)
    for i in range(n):  # stable: ids ascend within a cell
        k = cid[i]
        order[start[k]] = i
        start[k] += 1
    spos = np.empty((n, 3), np.float64)
    for t in range(n):
        for a in range(3):
            spos[t, a] = pos[order[t], a]
    return order, counts, spos


@njit(cache=True, inline="always")
def _cell_of(p, lo, cell, dims):
    # a tuple, not an array: no heap allocation per point inside the parallel loops
    cx = min(max(int((p[0] - lo[0]) / cell), 0), dims[0] - 1)
    cy = min(max(int((p[1] - lo[1]) / cell), 0), dims[1] - 1)
    cz = min(max(int((p[2] - lo[2]) / cell), 0), dims[2] - 1)
    return (cx, cy, cz)


@njit(cache=True)
def _sort_row(idx, lo_, hi_):
    for a in range(lo_ + 1, hi_):
        v = idx[a]
        b = a - 1
        while b >= lo_ and idx[b] > v:
            idx[b + 1] = idx[b]
            b -= 1
        idx[b + 1] = v


# --------------------------------------------------------------------------- radius
@njit(parallel=True, cache=True)
def _radius_pass(order, cstart, spos, lo, cell, dims, r2, exclude_self, indptr, indices, fill):
    """One sweep over the points in cell order (neighbouring iterations touch neighbouring
    cells, which keeps the cell data in cache). fill=False counts into indptr[i+1];
    fill=True writes the sources of row i at indptr[i] and sorts them by id."""
    n = order.shape[0]
    for t in prange(n):
        i = order[t]
        px, py, pz = spos[t, 0], spos[t, 1], spos[t, 2]
        c = _cell_of(spos[t], lo, cell, dims)
        cnt = 0
        base = indptr[i] if fill else 0
        for cz in range(max(c[2] - 1, 0), min(c[2] + 2, dims[2])):
            for cy in range(max(c[1] - 1, 0), min(c[1] + 2, dims[1])):
                row = (cz * dims[1] + cy) * dims[0]
                x0 = max(c[0] - 1, 0)
                x1 = min(c[0] + 2, dims[0])
                # cells x0..x1-1 of one (cy, cz) row are contiguous in the sorted order
                for u in range(cstart[row + x0], cstart[row + x1]):
                    dx = spos[u, 0] - px
                    dy = spos[u, 1] - py
                    dz = spos[u, 2] - pz
                    if dx * dx + dy * dy + dz * dz <= r2:
                        j = order[u]
                        if exclude_self and j == i:
                            continue
                        if fill:
                            indices[base + cnt] = j
                        cnt += 1
        if fill:
            _sort_row(indices, base, base + cnt)
        else:
            indptr[i + 1] = cnt


@serialised
def radius_graph(positions, cutoff, exclude_self=True):
    """CSR of every pair with |pos[j] - pos[i]| <= cutoff (inclusive, like
    scipy.spatial.cKDTree.query_ball_point). positions: (N, 1|2|3) float array; numpy in,
    numpy out (host builder), cupy in, cupy out (GPU builder, no host copy)."""
    cutoff = check_cutoff(cutoff)
    if _family(positions) == "cuda.neighbors":
        gpu = _gpu_builder()
        indptr, indices, info = gpu.radius_graph(check_positions(positions), cutoff,
                                                 bool(exclude_self))
        _record(**info)
        return indptr, indices
    pos, copies = _host_positions(positions)
    n = pos.shape[0]
    indptr = np.zeros(n + 1, np.int64)
    if n == 0:
        _record(kind="radius", builder="cpu", cells=0, cell_size=0.0, copies=copies)
        return indptr, np.zeros(0, np.int32)
    lo, extent = _bounds(pos)
    cell, dims = radius_grid(lo, extent, n, cutoff)
    order, cstart, spos = _bin(pos, lo, cell, dims)
    r2 = cutoff * cutoff
    dummy = np.zeros(0, np.int32)
    # about 27 cells of a few points each per point: the threads such a pass keeps busy
    threads = useful(n, n * 27 * 4 * pos.shape[1])
    run(_radius_pass, threads, order, cstart, spos, lo, cell, dims, r2, bool(exclude_self), indptr, dummy, False)
    np.cumsum(indptr, out=indptr)
    if indptr[-1] >= 2**31:
        raise ValueError(f"radius graph would hold {int(indptr[-1])} edges (>= 2**31); lower cutoff")
    indices = np.empty(int(indptr[-1]), np.int32)
    run(_radius_pass, threads, order, cstart, spos, lo, cell, dims, r2, bool(exclude_self), indptr, indices, True)
    _record(kind="radius", builder="cpu", cells=int(np.prod(dims)), cell_size=cell, copies=copies)
    return indptr, indices


# --------------------------------------------------------------------------- knn
@njit(parallel=True, cache=True)
def _knn_kernel(order, cstart, spos, lo, cell, dims, kk, exclude_self, indices):
    """Ring search around each point's cell: after ring r every unvisited point lies at
    least r*cell away, so the search stops once the k-th best distance is below that."""
    n = order.shape[0]
    nchunks = min(n, 256)
    maxr = max(dims[0], max(dims[1], dims[2]))
    for ch in prange(nchunks):
        bd = np.empty(kk, np.float64)
        bi = np.empty(kk, np.int64)
        t0 = ch * n // nchunks
        t1 = (ch + 1) * n // nchunks
        for t in range(t0, t1):
            i = order[t]
            px, py, pz = spos[t, 0], spos[t, 1], spos[t, 2]
            c = _cell_of(spos[t], lo, cell, dims)
            found = 0
            r = 0
            while r <= maxr:
                for cz in range(max(c[2] - r, 0), min(c[2] + r + 1, dims[2])):
                    for cy in range(max(c[1] - r, 0), min(c[1] + r + 1, dims[1])):
                        shell = abs(cz - c[2]) == r or abs(cy - c[1]) == r
                        row = (cz * dims[1] + cy) * dims[0]
                        for cx in range(max(c[0] - r, 0), min(c[0] + r + 1, dims[0])):
                            if not shell and abs(cx - c[0]) != r:
                                continue
                            for u in range(cstart[row + cx], cstart[row + cx + 1]):
                                j = order[u]
                                if exclude_self and j == i:
                                    continue
                                dx = spos[u, 0] - px
                                dy = spos[u, 1] - py
                                dz = spos[u, 2] - pz
                                d2 = dx * dx + dy * dy + dz * dz
                                # keep the kk best by (distance, id): ties go to the lower id
                                if found == kk:
                                    if d2 > bd[kk - 1] or (d2 == bd[kk - 1] and j > bi[kk - 1]):
                                        continue
                                    pos_ = kk - 1
                                else:
                                    pos_ = found
                                    found += 1
                                while pos_ > 0 and (bd[pos_ - 1] > d2 or (bd[pos_ - 1] == d2 and bi[pos_ - 1] > j)):
                                    bd[pos_] = bd[pos_ - 1]
                                    bi[pos_] = bi[pos_ - 1]
                                    pos_ -= 1
                                bd[pos_] = d2
                                bi[pos_] = j
                if found == kk:
                    bound = r * cell * RING_SLACK
                    if bd[kk - 1] < bound * bound:
                        break
                r += 1
            base = i * kk
            for a in range(kk):
                indices[base + a] = bi[a]
            _sort_row(indices, base, base + kk)


@serialised
def knn_graph(positions, k, exclude_self=True):
    """CSR where destination i receives edges from its k nearest sources (Euclidean; ties
    by lower index; self excluded unless exclude_self=False). With fewer than k candidates
    every row gets all of them (N - 1 or N). numpy in, numpy out; cupy in, cupy out."""
    k = check_k(k)
    if _family(positions) == "cuda.neighbors":
        gpu = _gpu_builder()
        indptr, indices, info = gpu.knn_graph(check_positions(positions), k, bool(exclude_self))
        _record(**info)
        return indptr, indices
    pos, copies = _host_positions(positions)
    n = pos.shape[0]
    kk = knn_row_length(n, k, bool(exclude_self))
    indptr = np.arange(n + 1, dtype=np.int64) * kk
    indices = np.empty(n * kk, np.int32)
    if kk == 0:
        _record(kind="knn", builder="cpu", cells=0, cell_size=0.0, copies=copies)
        return indptr, indices
    lo, extent = _bounds(pos)
    cell, dims = knn_grid(lo, extent, n, kk)
    order, cstart, spos = _bin(pos, lo, cell, dims)
    run(_knn_kernel, useful(n, n * 27 * kk * pos.shape[1]), order, cstart, spos, lo, cell, dims, kk,
        bool(exclude_self), indices)
    _record(kind="knn", builder="cpu", cells=int(np.prod(dims)), cell_size=cell, copies=copies)
    return indptr, indices


# --------------------------------------------------------------------------- locality order
@serialised
def spatial_order(positions, points_per_cell=4.0):
    """A permutation of the points sorted by grid cell (row-major cells of ~points_per_cell
    points). Kernels that visit rows in this order find the neighbours' data of consecutive
    rows already in cache; it changes no result, only the visiting order."""
    pos, _ = _host_positions(positions)
    n = pos.shape[0]
    if n == 0:
        return np.zeros(0, np.int64)
    lo, extent = _bounds(pos)
    live = extent[extent > 0]
    if live.size == 0:
        return np.arange(n, dtype=np.int64)
    cell = float(np.prod(live) * points_per_cell / n) ** (1.0 / live.size)
    cell = max(cell, float(live.max()) * 1e-9)
    cell, dims = cell_grid(lo, extent, n, cell)
    order, _, _ = _bin(pos, lo, cell, dims)
    return order
