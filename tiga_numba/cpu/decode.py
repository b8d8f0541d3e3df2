"""Split-key forward and backward for few-query block relations on the CPU (decode, short
queries over long contexts).

A block with a handful of query rows and a long key range is a poor fit for the tiled kernel of
blocks.py: a query tile of one row turns every score product into a matrix-vector product, and
that kernel first copies k and v into head-major order, which for one query row costs more than
the attention itself. Here each work item is one (block, chunk of CHUNK keys): it reads each
key's rows of every kv head together (contiguous in the caller's node-major arrays, read in
place), once for all the block's query rows and heads (the `group` query heads that share a kv
head read its row from L1, as flash-decoding packs them), and writes an unnormalised partial
(acc, m, l) per (query row, head). A second pass merges the chunks of each block in key order:

    M = max_c m_c,   l = sum_c l_c 2^(m_c - M),   out = sum_c acc_c 2^(m_c - M) / l

Weights are taken with the vectorisable exp2 (`_weight`, libm's NaN / -inf values). An item
whose every cell lies inside its band (a decode step over the whole cache: every item) takes its
scores four keys at a time (`_score4`: q's row loaded once per four keys; one key per loop was
bound by its loads from L1, not by K's bytes), and its second pass takes the chunk's weights at
once and adds four V rows per accumulator update (`_accumulate_inside`): updated once per V row,
the accumulator's loads and stores cost as much as the row's multiply-adds. Both passes then read
near the rate at which this machine streams K and V (docs/cpu_backend.md, "Split-key forward and
backward").

Scores are in base 2 (q pre-scaled by scale log2(e)), as the other CPU kernels keep them, so
m is the kernels' row maximum (`m_kernel`). The backward walks the same items: per key it
recomputes the scores with the forward's loop (the same bits, so the row's largest score has
exponent exactly 0 at any magnitude), P = 2^(s - m2) / l, dP, dS = P (dP - Delta), writes the
key's dk and dv (a key belongs to one item) and adds to a per-item partial dq, merged per block
in key order. Fixed orders everywhere: the bits do not depend on
the thread count. Bands (lo <= c - r <= hi, block-local) are honoured cell by cell; a masked
cell gets no score and its V row is not read for that row, so a non-finite value outside a
row's relation never reaches it. The dot products are summed with reassociation allowed (so
that they vectorise); the order is fixed by the compiled code, not by the thread schedule.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .blocks import exp2_any
from .layout import kv_heads
from .threads import run, useful

#: keys per work item: enough items to share a long key range among the threads, few enough
#: that the partials and their merge stay small; each K and V row is read once per item
CHUNK = 1024


def work_items(relation, chunk=CHUNK):
    """items (n, 3) int64 rows (block, first key, end key), keys block-local and clipped to the
    columns some row of the block sees, in key order within each block; groups (g + 1,) int64:
    the items of the i-th block with work are items[groups[i]:groups[i + 1]]. Vectorised: a
    batched decode can have a block per sequence."""
    dst, src = np.asarray(relation.dst_offsets, np.int64), np.asarray(relation.src_offsets, np.int64)
    lo, hi = np.asarray(relation.lo, np.int64), np.asarray(relation.hi, np.int64)
    rows, cols = np.diff(dst), np.diff(src)
    c0 = np.maximum(0, lo)                         # row 0's first column
    c1 = np.minimum(cols, rows - 1 + hi + 1)       # one past the last row's last column
    live = (rows > 0) & (cols > 0) & (lo <= hi) & (c0 < c1)
    blocks = np.flatnonzero(live)
    n = -(-(c1[blocks] - c0[blocks]) // chunk)
    groups = np.zeros(blocks.shape[0] + 1, np.int64)
    np.cumsum(n, out=groups[1:])
    owner = np.repeat(np.arange(blocks.shape[0]), n)
    first = c0[blocks][owner] + (np.arange(int(groups[-1])) - groups[owner]) * chunk
    items = np.empty((int(groups[-1]), 3), np.int64)
    items[:, 0] = blocks[owner]
    items[:, 1] = first
    items[:, 2] = np.minimum(first + chunk, c1[blocks][owner])
    return items, groups


@njit(inline="always", cache=True)
def _outside(c, r, lb, hb):
    """whether block-local cell (row r, column c) lies outside the band lb <= c - r <= hb."""
    return c - r < lb or c - r > hb


@njit(inline="always", cache=True)
def _item_inside(c0, c1, nr, lb, hb):
    """whether every cell of an item (block-local columns c0 .. c1 - 1, rows 0 .. nr - 1) lies
    inside the band lb <= c - r <= hb."""
    return c0 - (nr - 1) >= lb and c1 - 1 <= hb


@njit(inline="always", cache=True)
def _grouped_keys(c0, c1, nr, lb, hb):
    """How many of an item's keys take their scores four at a time (_score4): all but the last
    (c1 - c0) % 4 of an item inside its band, none otherwise. Forward and backward both ask here,
    so a key's score comes from the same loop in both."""
    n = c1 - c0
    return n - n % 4 if _item_inside(c0, c1, nr, lb, hb) else 0


@njit(inline="always", cache=True, fastmath={"reassoc", "contract"})
def _score(q, k, i, h, j, hk, zero):
    """The base-2 score of query row i, head h against key j, kv head hk (q pre-scaled). The
    forward and the backward both call this one loop, which is what makes the backward's
    exp2(s - m2) of a row's largest score exactly 1 at any magnitude."""
    t = zero
    for x in range(q.shape[2]):
        t += q[i, h, x] * k[j, hk, x]
    return t


@njit(inline="always", cache=True, fastmath={"reassoc", "contract"})
def _score4(q, k, i, h, j, hk, zero):
    """The base-2 scores of query row i, head h against keys j .. j + 3 (kv head hk): q's row is
    loaded once for four keys, which the one-key loop (two loads per multiply-add) could not
    do at the rate K streams in. Forward and backward call it alike: for the keys of an item
    inside its band, four at a time from the item's first key, the last n % 4 through _score,
    so each key's score has the same bits in both."""
    t0 = t1 = t2 = t3 = zero
    for x in range(q.shape[2]):
        a = q[i, h, x]
        t0 += a * k[j, hk, x]
        t1 += a * k[j + 1, hk, x]
        t2 += a * k[j + 2, hk, x]
        t3 += a * k[j + 3, hk, x]
    return t0, t1, t2, t3


@njit(inline="always", cache=True)
def _keep(s, mx, jj, r, h, t):
    """s[jj, r, h] = t and the running row maximum (a NaN score leaves the maximum alone)."""
    s[jj, r, h] = t
    if t > mx[r, h]:
        mx[r, h] = t


@njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def _chunks(q, k, v, dst, src, lo, hi, items, group, zero, part_acc, part_m, part_l):
    """One partial (acc, m, l) per (item, query row of the block, query head); q is pre-scaled;
    zero: 0 in the accumulation dtype (the dot products' type). A key's rows of every kv head
    are read together (contiguous in node-major k and v)."""
    Dv = v.shape[2]
    H = q.shape[1]
    kvh = kv_heads(H, group)
    for it in prange(items.shape[0]):
        b, c0, c1 = items[it, 0], items[it, 1], items[it, 2]
        r0 = dst[b]
        nr = dst[b + 1] - r0
        s0 = src[b]
        n = c1 - c0
        lb, hb = lo[b], hi[b]
        s = np.empty((n, nr, H), q.dtype)
        mx = np.full((nr, H), -np.inf, q.dtype)
        inside = _item_inside(c0, c1, nr, lb, hb)
        n4 = _grouped_keys(c0, c1, nr, lb, hb)
        for jj in range(0, n4, 4):
            j = s0 + c0 + jj
            for r in range(nr):
                for h in range(H):
                    t0, t1, t2, t3 = _score4(q, k, r0 + r, h, j, kvh[h], zero)
                    _keep(s, mx, jj, r, h, t0)
                    _keep(s, mx, jj + 1, r, h, t1)
                    _keep(s, mx, jj + 2, r, h, t2)
                    _keep(s, mx, jj + 3, r, h, t3)
        for jj in range(n4, n):
            j = s0 + c0 + jj
            for r in range(nr):
                if _outside(c0 + jj, r, lb, hb):
                    continue
                for h in range(H):
                    _keep(s, mx, jj, r, h, _score(q, k, r0 + r, h, j, kvh[h], zero))
        pa = part_acc[it]
        pl = part_l[it]
        for r in range(nr):
            for h in range(H):
                part_m[it, r, h] = mx[r, h]
                pl[r, h] = 0.0
                for x in range(Dv):
                    pa[r, h, x] = 0.0
        if inside:
            _accumulate_inside(v, s, mx, kvh, s0 + c0, zero, pa, pl)
            continue
        for jj in range(n):
            j = s0 + c0 + jj
            for r in range(nr):
                if _outside(c0 + jj, r, lb, hb):
                    continue
                for h in range(H):
                    hk = kvh[h]  # a register: the store to pa below could alias a table read
                    p = _weight(s[jj, r, h] - mx[r, h], zero)
                    pl[r, h] += p
                    for x in range(Dv):
                        pa[r, h, x] += p * v[j, hk, x]


@njit(inline="always", cache=True)
def _weight(x, zero):
    """2^x of a score minus its row maximum, vectorisable (blocks.exp2_any: the float32
    polynomial), with libm's edge values: NaN stays NaN (a NaN or inf score makes its row NaN),
    far below (-inf included) 0. Every item's weights, banded or not."""
    if x != x:
        return x
    if x < -1100.0:
        return zero
    return exp2_any(x)


@njit(inline="always", cache=True, fastmath={"reassoc", "contract"})
def _accumulate_inside(v, s, mx, kvh, j0, zero, pa, pl):
    """The second pass of an item whose every cell is inside its band (decode over a whole key
    range): the weights of the whole chunk at once (s becomes P, vectorised over heads), then
    acc += P V four keys at a time, so that each accumulator row is loaded and stored once per
    four V rows instead of once per row (the pass is bound by those loads and stores when V
    comes from cache). The order of the additions is the compiled code's (reassociation allowed),
    never the thread schedule's, as everywhere here."""
    n, nr, H = s.shape
    Dv = v.shape[2]
    for jj in range(n):
        for r in range(nr):
            for h in range(H):
                p = _weight(s[jj, r, h] - mx[r, h], zero)
                s[jj, r, h] = p
                pl[r, h] += p
    jj = 0
    while jj + 3 < n:
        j = j0 + jj
        for r in range(nr):
            for h in range(H):
                hk = kvh[h]  # a register: the store to pa below could alias a table read
                p0, p1, p2, p3 = s[jj, r, h], s[jj + 1, r, h], s[jj + 2, r, h], s[jj + 3, r, h]
                for x in range(Dv):
                    pa[r, h, x] += ((p0 * v[j, hk, x] + p1 * v[j + 1, hk, x])
                                    + (p2 * v[j + 2, hk, x] + p3 * v[j + 3, hk, x]))
        jj += 4
    while jj < n:
        j = j0 + jj
        for r in range(nr):
            for h in range(H):
                hk = kvh[h]
                p = s[jj, r, h]
                for x in range(Dv):
                    pa[r, h, x] += p * v[j, hk, x]
        jj += 1


#: the per-chunk kernel (the merge is small and compiled alongside)
chunk_kernel = _chunks


@njit(parallel=True, cache=True)
def _merge(items, groups, dst, part_acc, part_m, part_l, out, m, l):
    """Chunks of each block merged in key order into (out, m, l)."""
    Dv = out.shape[2]
    H = out.shape[1]
    for g in prange(groups.shape[0] - 1):
        i0, i1 = groups[g], groups[g + 1]
        b = items[i0, 0]
        r0 = dst[b]
        for r in range(dst[b + 1] - r0):
            for h in range(H):
                mx = -np.inf
                for it in range(i0, i1):
                    if part_m[it, r, h] > mx:
                        mx = part_m[it, r, h]
                m[r0 + r, h] = mx
                if mx == -np.inf:   # no key in this row's relation: out 0, l 0
                    continue
                tot = 0.0
                for it in range(i0, i1):
                    if part_m[it, r, h] == -np.inf:
                        continue
                    w = math.exp2(part_m[it, r, h] - mx)
                    tot += part_l[it, r, h] * w
                    for x in range(Dv):
                        out[r0 + r, h, x] += part_acc[it, r, h, x] * w
                l[r0 + r, h] = tot
                for x in range(Dv):
                    out[r0 + r, h, x] /= tot


@njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def _backward_chunks(q, k, v, do, qu, m2, linv, delta, dst, src, lo, hi, items, group, zero,
                     part_dq, dk, dv):
    """Per item: dk, dv of its keys (each key belongs to one item: written, not added across
    items) and a partial dq of its block's rows. The scores are recomputed with the forward's
    loop on the same pre-scaled q, so the row's largest score minus m2 is exactly 0 at any
    magnitude; qu: q unscaled (dk = scale * sum ds q, applied by the caller)."""
    D = q.shape[2]
    H = q.shape[1]
    kvh = kv_heads(H, group)
    for it in prange(items.shape[0]):
        b, c0, c1 = items[it, 0], items[it, 1], items[it, 2]
        r0 = dst[b]
        nr = dst[b + 1] - r0
        s0 = src[b]
        lb, hb = lo[b], hi[b]
        pq = part_dq[it]
        for r in range(nr):
            for h in range(H):
                for x in range(D):
                    pq[r, h, x] = 0.0
        n = c1 - c0
        # the forward's scores: four keys at a time from the item's first where every cell is
        # inside the band (_score4), the rest one by one
        n4 = _grouped_keys(c0, c1, nr, lb, hb)
        for jj in range(0, n4, 4):
            j = s0 + c0 + jj
            for r in range(nr):
                for h in range(H):
                    hk = kvh[h]  # a register: the stores below could alias a table read
                    t0, t1, t2, t3 = _score4(q, k, r0 + r, h, j, hk, zero)
                    _backward_cell(t0, k, v, do, qu, m2, linv, delta, r0 + r, h, j, hk, zero, pq, r, dk, dv)
                    _backward_cell(t1, k, v, do, qu, m2, linv, delta, r0 + r, h, j + 1, hk, zero, pq, r, dk, dv)
                    _backward_cell(t2, k, v, do, qu, m2, linv, delta, r0 + r, h, j + 2, hk, zero, pq, r, dk, dv)
                    _backward_cell(t3, k, v, do, qu, m2, linv, delta, r0 + r, h, j + 3, hk, zero, pq, r, dk, dv)
        for jj in range(n4, n):
            j = s0 + c0 + jj
            for r in range(nr):
                if _outside(c0 + jj, r, lb, hb):
                    continue
                for h in range(H):
                    hk = kvh[h]
                    t = _score(q, k, r0 + r, h, j, hk, zero)
                    _backward_cell(t, k, v, do, qu, m2, linv, delta, r0 + r, h, j, hk, zero, pq, r, dk, dv)


@njit(inline="always", cache=True, fastmath={"reassoc", "contract"})
def _backward_cell(t, k, v, do, qu, m2, linv, delta, i, h, j, hk, zero, pq, r, dk, dv):
    """One cell's share of the backward from its recomputed score t: P = 2^(t - m2) / l,
    dP = dO . V_j, dS = P (dP - Delta); adds P dO to dv[j], dS q to dk[j] and dS K_j to the
    item's partial dq (row r)."""
    p = math.exp2(t - m2[i, h]) * linv[i, h]
    dp = zero
    for x in range(v.shape[2]):
        dp += do[i, h, x] * v[j, hk, x]
    ds = p * (dp - delta[i, h])
    for x in range(v.shape[2]):
        dv[j, hk, x] += p * do[i, h, x]
    for x in range(k.shape[2]):
        dk[j, hk, x] += ds * qu[i, h, x]
        pq[r, h, x] += ds * k[j, hk, x]


@njit(parallel=True, cache=True)
def _merge_dq(items, groups, dst, part_dq, scale, dq):
    """dq of each block's rows: its items' partials added in key order, times scale."""
    D = dq.shape[2]
    H = dq.shape[1]
    for g in prange(groups.shape[0] - 1):
        i0, i1 = groups[g], groups[g + 1]
        b = items[i0, 0]
        r0 = dst[b]
        for r in range(dst[b + 1] - r0):
            for h in range(H):
                for x in range(D):
                    t = part_dq[i0, r, h, x]
                    for it in range(i0 + 1, i1):
                        t += part_dq[it, r, h, x]
                    dq[r0 + r, h, x] = t * scale


#: the backward's per-chunk kernel
backward_kernel = _backward_chunks


def _work(items, rows, H, D, Dv):
    """scalar multiply-adds of the chunk kernel, at most: every item a whole chunk of keys for
    every query row of its block (threads.useful's estimate; shorter chunks only do less)."""
    return items.shape[0] * CHUNK * max(rows, 1) * H * (D + Dv)


def backward(q, k, v, do, qu, m2, linv, delta, relation, group, acc, scale, kernel=None,
             work=None):
    """(dq, dk, dv) in `acc`: q pre-scaled by scale log2(e) exactly as the forward's, qu the
    unscaled q, m2 the forward's base-2 row max (finite sentinel for empty rows), linv = 1 / l
    (0 for empty rows), delta = rowsum(dO * O). Returns them with the item and block counts."""
    kernel = backward_kernel if kernel is None else kernel
    Nq, H, D = q.shape
    items, groups = work_items(relation) if work is None else work
    dst = np.asarray(relation.dst_offsets, np.int64)
    rmax = int(np.diff(dst).max()) if dst.shape[0] > 1 else 0
    dq = np.zeros((Nq, H, D), acc)
    dk = np.zeros(k.shape, acc)
    dv = np.zeros(v.shape, acc)
    if items.shape[0]:
        part_dq = np.empty((items.shape[0], rmax, H, D), acc)
        run(kernel, useful(items.shape[0], 2 * _work(items, rmax, H, D, v.shape[2])), q, k, v, do, qu,
            m2, linv, delta, dst, np.asarray(relation.src_offsets, np.int64),
            np.asarray(relation.lo, np.int64), np.asarray(relation.hi, np.int64), items, group,
            acc.type(0), part_dq, dk, dv)
        run(_merge_dq, useful(groups.shape[0], part_dq.size), items, groups, dst, part_dq, acc.type(scale), dq)
        dk *= acc.type(scale)
    return dq, dk, dv, items.shape[0], groups.shape[0] - 1


def forward(q, k, v, relation, group, acc, kernel=None, work=None):
    """(out, m, l) in `acc`, m in base 2; q pre-scaled by scale log2(e); k, v read in place.
    Returns them with the number of work items and of blocks with work. kernel: the chunk
    kernel (`chunk_kernel`, as the caller's kernel cache handed it out)."""
    kernel = chunk_kernel if kernel is None else kernel
    Nq, H = q.shape[0], q.shape[1]
    items, groups = work_items(relation) if work is None else work
    dst = np.asarray(relation.dst_offsets, np.int64)
    rmax = int(np.diff(dst).max()) if dst.shape[0] > 1 else 0
    out = np.zeros((Nq, H, v.shape[2]), acc)
    m = np.full((Nq, H), -np.inf, acc)
    l = np.zeros((Nq, H), acc)
    if items.shape[0]:
        part_acc = np.empty((items.shape[0], rmax, H, v.shape[2]), acc)
        part_m = np.empty((items.shape[0], rmax, H), acc)
        part_l = np.empty((items.shape[0], rmax, H), acc)
        run(kernel, useful(items.shape[0], _work(items, rmax, H, q.shape[2], v.shape[2])), q, k, v, dst,
            np.asarray(relation.src_offsets, np.int64), np.asarray(relation.lo, np.int64),
            np.asarray(relation.hi, np.int64), items, group, acc.type(0), part_acc, part_m, part_l)
        run(_merge, useful(groups.shape[0], part_acc.size), items, groups, dst, part_acc, part_m, part_l,
            out, m, l)
    return out, m, l, items.shape[0], groups.shape[0] - 1
