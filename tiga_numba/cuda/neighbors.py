"""Radius and knn graphs built on the GPU for cupy positions (cell lists, numba.cuda kernels).

The CSR never leaves the device, and it is the host builder's graph (tiga_numba.neighbors)
bit for bit: the same grid (`radius_grid` / `knn_grid`, computed on the host from six
floats: the bounding box), the same float64 arithmetic for squared distances -- products go
through `dmul_rn`, which NVVM never fuses into an FMA, so a pair at distance exactly
`cutoff` (or a knn tie) is decided as on the CPU -- and the same canonical order: rows are
destinations, sources increase within a row.

Steps, all on cupy's current stream:
1. positions -> (N, 3) float64 (zero-padded); cell id of every point; `order` = argsort of
   the unique keys cell * N + id (the host builder's stable counting sort); cell starts by
   bincount + cumsum. One thread per point in cell order from here on, so that the threads
   of a warp read the same neighbouring cells.
2. radius: a count pass over the 3**3 surrounding cells -> indptr (cumsum); a fill pass
   writes key = i * N + j for every edge (j -> i) into row i's slots; one sort of the keys
   orders every row by source id without moving any row (the keys of row i lie in
   [i * N, (i + 1) * N)); indices = key % N. One sort of E int64 keys instead of a per-row
   insertion sort keeps the cost O(E) even for a row of thousands of neighbours.
   knn: one pass keeps each point's k best (distance, id) in a global scratch row while the
   search grows shells of cells around the point's cell; it stops once every unvisited
   point is provably farther than the k-th best. Rows are then sorted by id.
Under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) the same kernel bodies run on numpy arrays.
"""
from __future__ import annotations

import hashlib
import os

import numba
import numpy as np
from numba import cuda

from .. import neighbor_grid as host
from ..kernel_cache import KERNELS
from .launch import SIM, Kernel, array_view, current_stream

__all__ = ["radius_graph", "knn_graph", "make_radius_pass", "make_knn_pass"]

U = numba.uint64  # index cast: unsigned indices skip numba's negative-index wraparound code
NT = 32 if SIM else 128
RING_SLACK = host.RING_SLACK


def _source_tag():
    # the cubin cache (launch._cache_path) keys on a fixed list of sources: name the kernels
    # after this file's hash so an edit here never loads a stale cubin
    with open(os.path.abspath(__file__), "rb") as f:
        return hashlib.sha1(f.read()).hexdigest()[:10]


_TAG = _source_tag()


def _dmul():
    if SIM:
        def mul(a, b):
            return a * b
        return mul
    from numba.cuda import libdevice
    return libdevice.dmul_rn


# --------------------------------------------------------------------------- kernels
def make_radius_pass(fill):
    """fill=False: counts[i + 1] = number of sources of row i (counts zeroed by the caller).
    fill=True: keys[indptr[i] + c] = i * n + j for the c-th source j found for row i."""
    FILL = bool(fill)
    AF, AI = array_view(numba.float64), array_view(numba.int64)
    MUL = _dmul()

    def radius_pass(order_p, scid_p, cstart_p, spos_p, indptr_p, keys_p, n, d0, d1, d2, r2,
                    excl):
        order = AI(order_p)
        scid = AI(scid_p)
        cstart = AI(cstart_p)
        spos = AF(spos_p)
        indptr = AI(indptr_p)
        keys = AI(keys_p)
        t = cuda.grid(1)
        if t < n:
            i = order[U(t)]
            k = scid[U(t)]
            cx = k % d0
            rest = k // d0
            cy = rest % d1
            cz = rest // d1
            px = spos[U(3 * t)]
            py = spos[U(3 * t + 1)]
            pz = spos[U(3 * t + 2)]
            base = indptr[U(i)] if FILL else 0
            cnt = 0
            for z in range(max(cz - 1, 0), min(cz + 2, d2)):
                for y in range(max(cy - 1, 0), min(cy + 2, d1)):
                    row = (z * d1 + y) * d0
                    # cells x0..x1-1 of one (y, z) row are contiguous in the sorted order
                    u0 = cstart[U(row + max(cx - 1, 0))]
                    u1 = cstart[U(row + min(cx + 2, d0))]
                    for u in range(u0, u1):
                        dx = spos[U(3 * u)] - px
                        dy = spos[U(3 * u + 1)] - py
                        dz = spos[U(3 * u + 2)] - pz
                        if MUL(dx, dx) + MUL(dy, dy) + MUL(dz, dz) <= r2:
                            j = order[U(u)]
                            if excl != 0 and j == i:
                                continue
                            if FILL:
                                keys[U(base + cnt)] = i * n + j
                            cnt += 1
            if not FILL:
                indptr[U(i + 1)] = cnt

    i64, f64 = numba.int64, numba.float64
    spec = [("order", "a", i64), ("scid", "a", i64), ("cstart", "a", i64), ("spos", "a", f64),
            ("indptr", "a", i64), ("keys", "a", i64), ("n", "s", i64), ("d0", "s", i64),
            ("d1", "s", i64), ("d2", "s", i64), ("r2", "s", f64), ("excl", "s", i64)]
    return Kernel(f"nbr_radius_{'fill' if FILL else 'count'}_{_TAG}", radius_pass, spec)


def make_knn_pass():
    """best_i[i * kk + a] = a-th nearest source of row i (by distance, then id), for the
    point at sorted position t; best_d (scratch, rows by t) holds the squared distances."""
    AF, AI, AJ = array_view(numba.float64), array_view(numba.int64), array_view(numba.int32)
    MUL = _dmul()
    SLACK = RING_SLACK

    def knn_pass(order_p, scid_p, cstart_p, spos_p, bd_p, bi_p, n, d0, d1, d2, kk, excl,
                 cell, maxr):
        order = AI(order_p)
        scid = AI(scid_p)
        cstart = AI(cstart_p)
        spos = AF(spos_p)
        bd = AF(bd_p)
        bi = AJ(bi_p)
        t = cuda.grid(1)
        if t < n:
            i = order[U(t)]
            k = scid[U(t)]
            cx = k % d0
            rest = k // d0
            cy = rest % d1
            cz = rest // d1
            px = spos[U(3 * t)]
            py = spos[U(3 * t + 1)]
            pz = spos[U(3 * t + 2)]
            db = t * kk
            ib = i * kk
            found = 0
            r = 0
            while r <= maxr:
                for z in range(max(cz - r, 0), min(cz + r + 1, d2)):
                    for y in range(max(cy - r, 0), min(cy + r + 1, d1)):
                        shell = abs(z - cz) == r or abs(y - cy) == r
                        row = (z * d1 + y) * d0
                        for x in range(max(cx - r, 0), min(cx + r + 1, d0)):
                            if not shell and abs(x - cx) != r:
                                continue  # inside the shell: visited by an earlier ring
                            for u in range(cstart[U(row + x)], cstart[U(row + x + 1)]):
                                j = order[U(u)]
                                if excl != 0 and j == i:
                                    continue
                                dx = spos[U(3 * u)] - px
                                dy = spos[U(3 * u + 1)] - py
                                dz = spos[U(3 * u + 2)] - pz
                                dd = MUL(dx, dx) + MUL(dy, dy) + MUL(dz, dz)
                                # keep the kk best by (distance, id): ties go to the lower id
                                if found == kk:
                                    wd = bd[U(db + kk - 1)]
                                    if dd > wd or (dd == wd and j > bi[U(ib + kk - 1)]):
                                        continue
                                    p = kk - 1
                                else:
                                    p = found
                                    found += 1
                                while p > 0:
                                    qd = bd[U(db + p - 1)]
                                    qj = bi[U(ib + p - 1)]
                                    if qd > dd or (qd == dd and qj > j):
                                        bd[U(db + p)] = qd
                                        bi[U(ib + p)] = qj
                                        p -= 1
                                    else:
                                        break
                                bd[U(db + p)] = dd
                                bi[U(ib + p)] = numba.int32(j)
                if found == kk:
                    # every unvisited point lies more than r * cell away
                    bound = r * cell * SLACK
                    if bd[U(db + kk - 1)] < bound * bound:
                        break
                r += 1

    i64, f64 = numba.int64, numba.float64
    spec = [("order", "a", i64), ("scid", "a", i64), ("cstart", "a", i64), ("spos", "a", f64),
            ("bd", "a", f64), ("bi", "a", numba.int32), ("n", "s", i64), ("d0", "s", i64),
            ("d1", "s", i64), ("d2", "s", i64), ("kk", "s", i64), ("excl", "s", i64),
            ("cell", "s", f64), ("maxr", "s", i64)]
    return Kernel(f"nbr_knn_{_TAG}", knn_pass, spec)


# --------------------------------------------------------------------------- host glue
def _xp():
    if SIM:
        return np
    import cupy
    return cupy


def _arg(a):
    """What a kernel receives for an array: a device address, or the array in the simulator."""
    return a if SIM else a.data.ptr


def _launch(kernel, n, *args):
    stream = None if SIM else current_stream()
    kernel(((n + NT - 1) // NT, 1, 1), (NT, 1, 1), stream, *args)


class _Binned:
    """Points sorted by grid cell: order (N,) ids, scid (N,) their cell ids, cstart
    (cells + 1,) first sorted position of every cell, spos (3N,) sorted float64 positions."""

    def __init__(self, xp, pos3, lo, cell, dims):
        n = pos3.shape[0]
        self.dims = tuple(int(d) for d in dims)
        c = ((pos3 - xp.asarray(lo)) / cell).astype(np.int64)
        c = xp.minimum(xp.maximum(c, 0), xp.asarray(dims - 1))
        cid = (c[:, 2] * self.dims[1] + c[:, 1]) * self.dims[0] + c[:, 0]
        ncell = self.dims[0] * self.dims[1] * self.dims[2]
        # unique keys: any sort gives the stable order (ids ascend within a cell)
        self.order = xp.argsort(cid * n + xp.arange(n, dtype=np.int64)).astype(np.int64)
        self.scid = xp.ascontiguousarray(cid[self.order])
        self.cstart = xp.zeros(ncell + 1, np.int64)
        self.cstart[1:] = xp.cumsum(xp.bincount(cid, minlength=ncell))
        self.spos = xp.ascontiguousarray(pos3[self.order]).reshape(-1)
        self.ncell = ncell

    def args(self):
        return (_arg(self.order), _arg(self.scid), _arg(self.cstart), _arg(self.spos))


def _padded(xp, positions):
    """(N, 3) float64 on the device: the coordinates the host builder reads."""
    pos3 = xp.zeros((positions.shape[0], 3), np.float64)
    pos3[:, : positions.shape[1]] = positions
    return pos3


def _bounds(xp, pos3):
    lo = pos3.min(axis=0)
    hi = pos3.max(axis=0)
    if xp is not np:
        lo, hi = lo.get(), hi.get()  # six floats: the grid is sized on the host
    return lo, hi - lo


_COPIES = ["positions -> (N, 3) float64 on the device (O(N)); CSR built and kept on the device"]


def radius_graph(positions, cutoff, exclude_self=True):
    """Device CSR (indptr int64, indices int32) of Graph.radius, plus a build-info dict.
    positions: validated (N, 1|2|3) float cupy array (numpy under the simulator)."""
    xp = _xp()
    n = positions.shape[0]
    cutoff = float(cutoff)
    if n == 0:
        return (xp.zeros(1, np.int64), xp.zeros(0, np.int32),
                dict(kind="radius", builder="cuda", cells=0, cell_size=0.0, copies=[]))
    pos3 = _padded(xp, positions)
    lo, extent = _bounds(xp, pos3)
    cell, dims = host.radius_grid(lo, extent, n, cutoff)
    b = _Binned(xp, pos3, lo, cell, dims)
    d0, d1, d2 = b.dims
    count = KERNELS.get(("nbr_radius", False, SIM), lambda: make_radius_pass(False))
    fill = KERNELS.get(("nbr_radius", True, SIM), lambda: make_radius_pass(True))
    indptr = xp.zeros(n + 1, np.int64)
    dummy = xp.zeros(1, np.int64)
    excl = 1 if exclude_self else 0
    r2 = cutoff * cutoff
    _launch(count, n, *b.args(), _arg(indptr), _arg(dummy), n, d0, d1, d2, r2, excl)
    indptr = xp.cumsum(indptr)  # counts sit at [i + 1], indptr[0] = 0
    num_edges = int(indptr[-1])
    if num_edges >= 2**31:
        raise ValueError(f"radius graph would hold {num_edges} edges (>= 2**31); lower cutoff")
    keys = xp.empty(max(num_edges, 1), np.int64)
    _launch(fill, n, *b.args(), _arg(indptr), _arg(keys), n, d0, d1, d2, r2, excl)
    indices = (xp.sort(keys[:num_edges]) % n).astype(np.int32)
    info = dict(kind="radius", builder="cuda", cells=b.ncell, cell_size=cell, copies=list(_COPIES))
    return indptr, indices, info


def knn_graph(positions, k, exclude_self=True):
    """Device CSR of Graph.knn (k validated by the caller), plus a build-info dict."""
    xp = _xp()
    n = positions.shape[0]
    kk = host.knn_row_length(n, int(k), bool(exclude_self))
    indptr = xp.arange(n + 1, dtype=np.int64) * kk
    if kk == 0:
        return (indptr, xp.zeros(0, np.int32),
                dict(kind="knn", builder="cuda", cells=0, cell_size=0.0, copies=[]))
    pos3 = _padded(xp, positions)
    lo, extent = _bounds(xp, pos3)
    cell, dims = host.knn_grid(lo, extent, n, kk)
    b = _Binned(xp, pos3, lo, cell, dims)
    d0, d1, d2 = b.dims
    kern = KERNELS.get(("nbr_knn", SIM), make_knn_pass)
    best_d = xp.empty(n * kk, np.float64)
    best_i = xp.empty(n * kk, np.int32)
    _launch(kern, n, *b.args(), _arg(best_d), _arg(best_i), n, d0, d1, d2, kk,
            1 if exclude_self else 0, float(cell), max(d0, d1, d2))
    indices = xp.sort(best_i.reshape(n, kk), axis=1).reshape(-1)
    info = dict(kind="knn", builder="cuda", cells=b.ncell, cell_size=cell, copies=list(_COPIES))
    return indptr, indices, info
