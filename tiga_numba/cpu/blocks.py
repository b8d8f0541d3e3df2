"""Blocked streaming attention over a BlockRelation (dense, triangular, segments).

Layout the kernels expect (made by ``layout.py``): head-major contiguous tiles in the
accumulation dtype, ``qh (H, Nq, D)`` already multiplied by ``scale * log2(e)`` so every score
tile is in base 2 (``exp(s - m) == exp2(s2 - m2)``, see ``fastexp.py``), ``kh (Hkv, Nk, D)``,
``vh (Hkv, Nk, Dv)``; with the own tile products (microgemm.py) the B operands of the products
also as column panels (api._pack, api._row_panels).  Score and value products go through the own
product or the BLAS into preallocated buffers (no allocation per tile); the softmax between them
is a vectorised loop. The forward walks each tile in strips of STRIP_ROWS query rows, each
computing only the key columns its rows' band reaches.

Blocks are banded (``lo <= c - r <= hi`` in block-local positions: full, causal, bottom-right
causal, sliding window). Forward: one work item = (head, block, query tile, key-tile range); it walks only the
key tiles of its range that its rows' band touches, with the FlashAttention-2 recurrence, and
writes per-row (out, m, l). Few query tiles over long key ranges (decode, cross-attention to a
long context) would leave cores idle, so such items are cut into key ranges (api.py) whose
partial states land in slots that a second parallel loop merges in slot order. In a tile the band
cuts, cells outside it are masked before the softmax (a non-finite key outside a row's relation
is overwritten there) and, unless every element of V is finite (``v_finite``: one
``np.isfinite`` pass per call, ~0.1 ms for 4 MB), the value product reads only band cells
(``band_rows_mm``), so a non-finite value outside a row's relation never reaches that row
(0 * inf would be NaN); with finite values the masked cells hold exactly 0 and one gemm serves
the whole tile. The backward does the same with ``finite`` (Q, K and dO all finite). Blocks
narrower than a quarter tile are not packed: their score gemm reads the K rows directly, so
memory stays O(N) however many short segments there are; nor are blocks whose band spans at
most one key tile per query tile, whose tiles then start at each query tile's first band key.
The row max is written in base 2 (m2) exactly as the kernel found it (the backward subtracts it
from the same recomputed scores, so it must not go through a rounded unit conversion;
``api.py`` derives the natural m).
Optional tile pruning (``PRUNE``): after the score tile is computed it is admitted only if
``max(tile) >= m_run_block + log(rho)`` (in base 2: ``+ log2(rho)``), ``m_run_block`` the
running max over every row of the query tile; a rejected tile skips its value product and
softmax update.

Backward (deterministic, no atomics, no N x N scratch): work items = (kv head, block, key tile),
cut into ``P`` = api.N_PARTS contiguous runs of about equal cost run in parallel (api._deal).
Each item owns its dk/dv rows (summing over the query heads of its GQA group) and adds ``dS @ K``
into its partition's private dq buffer ``(P, H, Nq, D)`` (O(N) memory), within the partition's
box (heads x rows its items reach; only the box is zeroed); a second parallel loop sums the boxes
holding each (row, head) in partition order.  The partition an item lands in depends only on the
problem (P is a constant, not the thread count), so the bits are the same on every run and any
thread count.
"""
import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .fastexp import denormals_off, exp2f, fmax, restore_mxcsr, wide_vectors
from .gemm import mm
from .microgemm import NR, panel_tiles, product, product_panels, whole_blocks
from .score_codegen import jit_driver, jit_kernel, no_grad, no_slope, no_value

# the modifier hooks of the kernels (score_codegen.jit_kernel rebinds them per modifier)
MOD_VALUE = no_value
MOD_GRAD = no_grad
MOD_SLOPE = no_slope
# the per-item functions the kernels' parallel drivers call (score_codegen.jit_driver binds them
# per kernel; a kernel's body is compiled without numba's parallel passes, its driver with them)
FORWARD_ITEM = MERGE_ITEM = BACKWARD_PART = None

LOG2E = 1.0 / math.log(2.0)

LN2 = math.log(2.0)
# The kernels never form infinities: fastmath=True lets LLVM assume there are none ('ninf')
# and fold comparisons with -inf, so masked scores and empty running maxima use NEG, a finite
# "minus infinity" (exp2 of anything near it flushes to 0), and -inf is only written to m on
# output (for rows with l == 0).  Any m at or below EMPTY means "no key seen yet".
NEG = -1e30
EMPTY = -1e29
#: query rows of a forward strip (a multiple of the own product's MR = 6 rows): 48 rows x BN = 256
#: keys of float32 scores are 48 KiB, which stay in L1 / L2 between the passes over them
STRIP_ROWS = 48
#: elements past BN in each row of the backward's P and dS tiles (one 64-byte line of float32)
ROW_PAD = 16


def exp2_any(x):
    """exp2 for the kernels: the vectorisable polynomial for float32, libm for float64."""
    raise NotImplementedError  # only callable from jitted code


@overload(exp2_any)
def _exp2_any(x):
    if x == types.float32:
        return lambda x: exp2f(x)
    return lambda x: _exp2d(x)


@njit(inline="always", cache=True)
def _exp2d(x):
    if x > -1100.0:
        return math.exp2(x)
    return 0.0  # NEG (masked / empty) -> 0


def index_width(num_rows, num_keys):
    """The width of the node indices the block kernels pass to a score modifier: 32 bits where
    every index fits (AVX2 converts a vector of int32 to float in one instruction, a vector of
    int64 one lane at a time), else 64."""
    return 32 if max(num_rows, num_keys) <= np.iinfo(np.int32).max else 64


@njit(inline="always", cache=True)
def _row_span(r, lo_rel, hi_rel, cols):
    """Columns [first, last) of tile row r inside the band lo_rel <= c - r <= hi_rel."""
    return max(0, r + lo_rel), min(cols, r + hi_rel + 1)


@njit(inline="always", cache=True)
def common_span(rows, lo_rel, hi_rel, cols):
    """Columns [ca, cb) inside the band for every row of the tile (ca = cb when none)."""
    ca = max(0, rows - 1 + lo_rel)
    cb = min(cols, hi_rel + 1)
    if cb < ca:
        cb = ca
    return ca, cb


@njit(inline="always", cache=True)
def band_rows_mm(A, X, acc, rows, cols, lo_rel, hi_rel, ca, cb):
    """acc[r] += sum_c A[r, c] X[c] over the band cells of a tile. The columns [ca, cb) that
    every row keeps go through one gemm; the rest of each row's span is added with loops that
    touch only its own cells, so a value outside a row's band is never read for that row
    (0 * inf would be NaN)."""
    if cb > ca:
        mm(A[:rows, ca:cb], X[ca:cb], acc, 1.0, False, False)
    n = X.shape[1]
    for r in range(rows):
        first, last = _row_span(r, lo_rel, hi_rel, cols)
        ar = acc[r]
        for c in range(first, min(last, ca)):
            a = A[r, c]
            xc = X[c]
            for d in range(n):
                ar[d] += a * xc[d]
        for c in range(max(first, cb), last):
            a = A[r, c]
            xc = X[c]
            for d in range(n):
                ar[d] += a * xc[d]


@njit(inline="always", cache=True)
def band_cols_mm(A, X, acc, rows, cols, lo_rel, hi_rel, ca, cb):
    """acc[c] += sum_r A[r, c] X[r] over the band cells of a tile (the transposed product of
    band_rows_mm, same cells)."""
    if cb > ca:
        mm(A[:rows, ca:cb], X, acc[ca:cb], 1.0, True, False)
    n = X.shape[1]
    for r in range(rows):
        first, last = _row_span(r, lo_rel, hi_rel, cols)
        xr = X[r]
        for c in range(first, min(last, ca)):
            a = A[r, c]
            ac = acc[c]
            for d in range(n):
                ac[d] += a * xr[d]
        for c in range(max(first, cb), last):
            a = A[r, c]
            ac = acc[c]
            for d in range(n):
                ac[d] += a * xr[d]


@njit(inline="always", cache=True)
def tile_product(a, tiles, hk, t, x0, width, c, pb, own):
    """c = a @ B, B the columns [x0, x0 + width) of packed key tile t of kv head hk (api._pack):
    pb > 0: the tiles are held as column panels, pb per tile (x0 and width whole panels);
    pb == 0: as (D, BN) rows, multiplied by the own product where it fits, else the BLAS."""
    if pb > 0:
        p0 = t * pb + x0 // NR
        product_panels(a, tiles[hk, p0:p0 + width // NR], c, 0.0, False)
    else:
        product(a, tiles[hk, t, :, x0:x0 + width], c, 0.0, False, False, own)


@njit(inline="always", cache=True)
def panels_of_columns(xT, c0, width, out):
    """out[p, d, j] = xT[d, c0 + p NR + j] for the `width` (whole panels) columns from c0: a key
    tile of K^T read in place, whose rows lie a whole K^T row apart (the 16 columns a micro-kernel
    walks down k then share a few L1 sets and evict each other), as the own product's column
    panels, copied once per tile for every strip and head that reads it."""
    for p in range(width // NR):
        o = out[p]
        for d in range(xT.shape[0]):
            src = xT[d, c0 + p * NR:c0 + p * NR + NR]
            od = o[d]
            for j in range(NR):
                od[j] = src[j]


@njit(inline="always", cache=True)
def panels_of_rows(x, r0, rows, width, out):
    """out[p, d, j] = x[r0 + p W + j, d], 0 past `rows` (W = out.shape[2]): rows r0.. of x as
    column panels of x^T (`width` columns, whole panels), for a product with x^T as its B operand
    (W = NR: the own product's panels; W = BN: the BLAS's (D, BN) tile)."""
    Dx = x.shape[1]
    W = out.shape[2]
    for p in range(width // W):
        o = out[p]
        for j in range(W):
            r = p * W + j
            if r < rows:
                xr = x[r0 + r]
                for d in range(Dx):
                    o[d, j] = xr[d]
            else:
                for d in range(Dx):
                    o[d, j] = 0.0


@njit(inline="always", cache=True)
def merge_parts(pm, pl, pacc, o):
    """o = the merged output of partial states (pm[p], pl[p], pacc[p]) in p order (the
    online-softmax merge, base 2; deterministic); returns (m, l), m = -inf when l = 0."""
    dt = o.dtype.type
    mx = dt(NEG)
    for p in range(pm.shape[0]):
        mx = fmax(mx, pm[p])
    ms = mx if mx > EMPTY else dt(0.0)
    tot = dt(0.0)
    for d in range(o.shape[0]):
        o[d] = 0.0
    for p in range(pm.shape[0]):
        a = exp2_any(pm[p] - ms)
        tot += pl[p] * a
        pa = pacc[p]
        for d in range(o.shape[0]):
            o[d] += a * pa[d]
    inv = dt(1.0) / tot if tot > 0 else dt(0.0)
    for d in range(o.shape[0]):
        o[d] *= inv
    return (mx if tot > 0 else -np.inf), tot


def make_forward(acc, BM, BN, prune, mod=None, own=False, index_bits=32):
    """Kernel for accumulation dtype name ``acc``, tile (BM, BN), pruning on/off, and an
    optional score modifier ``mod`` (score_codegen.Generated): q then arrives scaled by
    ``scale`` only and each score s of a tile inside the band becomes
    ``mod.value(s, i, j, ...) * log2(e)`` right after the score gemm (without it the hook is
    compiled out); the modifier sees the node indices i, j as ``index_bits``-bit integers
    (`index_width`). ``own``: float32 tile products through cpu/microgemm.py's kernel where
    they fit it, else the BLAS."""
    dt = np.float32 if acc == "float32" else np.float64
    OWN = bool(own)   # microgemm.product takes only float32 products (4-byte unit strides)
    # packed K tiles are held as the own product's column panels (api._pack) where every tile
    # is whole panels; otherwise as (D, BN) rows, which the BLAS reads too
    PANELS = panel_tiles(own, BN)
    PB = BN // NR if PANELS else 0   # panels per packed tile (0: tiles held as rows)
    TRIM = PANELS   # score products cover only the band's columns of a strip (see the loop)
    SR = BM if prune else min(BM, STRIP_ROWS)   # pruning admits whole tiles: one strip
    MOD = mod is not None
    hooks = {} if not MOD else {"MOD_VALUE": mod.value}
    # the index type, a numpy scalar type: a closure value numba's disk cache can key on (a jitted
    # function there pickles with a per-process id, so the kernel would never load from the cache)
    IX = np.int32 if index_bits == 32 else np.int64
    log2e = dt(LOG2E)

    def forward_item(w, qh, ktt, kh, kT, vh, vpan, v_finite, items, dst_off, src_off, band_lo, band_hi, tile_base,
                     group, log2_rho, splits, part_acc, part_m, part_l, out, m_out, l_out, tiles_total,
                     tiles_pruned, mctx):
        """work item w (a query tile of one head and block, or one key range of a split one)."""
        sc, hp, nd_f, ns_f, ef = mctx
        D = qh.shape[2]
        Dv = vh.shape[2]
        wide_vectors()
        mxcsr = denormals_off()
        h = items[w, 0]
        b = items[w, 1]
        q0 = items[w, 2]
        slot = items[w, 5]
        hk = h // group
        d0 = dst_off[b]
        s0 = src_off[b]
        nd = dst_off[b + 1] - d0
        ns = src_off[b + 1] - s0
        lo = band_lo[b]
        hi = band_hi[b]
        tb = tile_base[b]
        rows = min(BM, nd - q0)
        sbuf = np.empty((SR, BN), dt)
        # an unpacked block's key tile as column panels (copied per tile; PANELS: whole panels)
        unpacked = PANELS and tb < 0 and D > 0 and kT.shape[0] > 0
        kbuf = np.empty((PB if unpacked else 0, D if unpacked else 0, NR), dt)
        acc_ = np.zeros((rows, Dv), dt)
        m = np.full(rows, NEG, dt)
        l = np.zeros(rows, dt)
        rmax = np.empty(rows, dt)
        alph = np.empty(rows, dt)
        mref = np.empty(rows, dt)
        qt = qh[h, d0 + q0:d0 + q0 + rows]
        # keys of the band for these rows: [kbeg, kend) (a piece of a split item covers key
        # tiles [items[w, 3], items[w, 4]) only); packed tiles stay aligned to the block, a
        # block read in place starts at the band
        kbeg = max(0, q0 + lo, items[w, 3] * BN)
        kend = min(ns, q0 + rows - 1 + hi + 1, items[w, 4] * BN)
        m_blk = dt(NEG)
        n_total = 0
        n_pruned = 0
        for c0 in range((kbeg // BN) * BN if tb >= 0 else kbeg, kend, BN):
            cols = min(BN, kend - c0)
            n_total += 1
            if unpacked:   # K^T in place -> panels
                panels_of_columns(kT[hk], s0 + c0, whole_blocks(cols, BN), kbuf)
            # the tile in strips of SR rows: a strip's scores stay in L1 / L2 from their product
            # through the softmax to the value product, and a strip visits only the columns its
            # rows' band reaches (the upper half of a causal diagonal tile is never computed)
            for r0 in range(0, rows, SR):
                rr = min(SR, rows - r0)
                lo_rel = q0 + r0 + lo - c0   # band of strip row r: lo_rel <= c - r <= hi_rel
                hi_rel = q0 + r0 + hi - c0
                ca = max(0, lo_rel)                  # the strip's columns: [ca, cb)
                cb = min(cols, rr - 1 + hi_rel + 1)
                if cb <= ca:   # no cell of the band (the state of its rows is unchanged)
                    continue
                # product columns [xa, xa + wide): whole NR blocks with the own products (every
                # score one fused multiply-add chain whatever the product's shape, as the backward
                # rebuilds it), the whole tile with the BLAS (its bits depend on the shape)
                xa = ca - ca % NR if TRIM else 0
                xb = cb if TRIM else cols
                sq = qt[r0:r0 + rr]
                if D == 0:
                    sbuf[:rr, xa:xb] = 0.0
                elif tb >= 0:
                    wide = whole_blocks(xb - xa, BN - xa) if OWN else xb - xa
                    tile_product(sq, ktt, hk, tb + c0 // BN, xa, wide, sbuf[:rr, xa:xa + wide], PB, OWN)
                elif kT.shape[0] > 0:  # narrow block, not packed, K^T at hand (own products)
                    # whole column blocks, as the backward (kT is zero-padded past the last key; the
                    # extra columns are not read)
                    wide = whole_blocks(xb - xa, BN - xa)
                    if unpacked:
                        product_panels(sq, kbuf[xa // NR:], sbuf[:rr, xa:xa + wide], 0.0, False)
                    else:
                        product(sq, kT[hk, :, s0 + c0 + xa:s0 + c0 + xa + wide], sbuf[:rr, xa:xa + wide], 0.0,
                                False, False, OWN)
                else:  # narrow block, not packed: K rows as the BLAS's transposed operand
                    mm(sq, kh[hk, s0 + c0 + xa:s0 + c0 + xb], sbuf[:rr, xa:xb], 0.0, False, True)
                # element loops run over views of the strip's columns from index 0: LLVM vectorises
                # them (from a runtime start, numba's negative-index wraparound stays in the loop)
                nc = cb - ca
                # columns every row of the strip keeps: [ka, kb); cells of [ca, cb) outside a
                # row's band are masked before the softmax
                ka, kb = common_span(rr, lo_rel, hi_rel, cols)
                banded = ka > ca or kb < cb
                tmax = dt(NEG)
                if MOD:
                    # natural-unit scores -> modified scores in base 2, the mask and the row's
                    # maximum in one pass over each row (three passes read the strip twice more);
                    # the modifier runs on band cells only
                    for r in range(rr):
                        first, last = _row_span(r, lo_rel, hi_rel, cols)
                        first = min(max(first, ca), cb)
                        last = max(min(last, cb), first)
                        Sr = sbuf[r, ca:cb]
                        for c in range(first - ca):
                            Sr[c] = NEG
                        for c in range(last - ca, nc):
                            Sr[c] = NEG
                        Sm = sbuf[r, first:last]
                        i = IX(d0 + q0 + r0 + r)
                        j0 = s0 + c0 + first
                        mx = dt(NEG)
                        for c in range(last - first):
                            x = MOD_VALUE(Sm[c], i, IX(j0 + c), -1, h, sc, hp, nd_f, ns_f, ef) * log2e
                            Sm[c] = x
                            mx = fmax(mx, x)
                        rmax[r0 + r] = mx
                        tmax = fmax(tmax, mx)
                else:
                    if banded:
                        for r in range(rr):
                            Sr = sbuf[r, ca:cb]
                            first, last = _row_span(r, lo_rel, hi_rel, cols)
                            for c in range(0, min(first, cb) - ca):
                                Sr[c] = NEG
                            for c in range(max(last, ca) - ca, nc):
                                Sr[c] = NEG
                    for r in range(rr):
                        Sr = sbuf[r, ca:cb]
                        mx = dt(NEG)
                        for c in range(nc):
                            mx = fmax(mx, Sr[c])
                        rmax[r0 + r] = mx
                        tmax = fmax(tmax, mx)
                if prune:   # one strip per tile (SR = BM): tmax is the tile's
                    if tmax < m_blk + log2_rho:
                        n_pruned += 1
                        continue
                    m_blk = fmax(m_blk, tmax)
                for r in range(r0, r0 + rr):  # per-row new max and rescale factor, vectorised
                    mnew = fmax(m[r], rmax[r])
                    ms = mnew if mnew > EMPTY else dt(0.0)  # row still empty: p = 0, no NaN
                    alph[r] = exp2_any(m[r] - ms)
                    mref[r] = ms
                    m[r] = mnew
                for r in range(rr):
                    ms = mref[r0 + r]
                    s = dt(0.0)
                    Sr = sbuf[r, ca:cb]
                    for c in range(nc):
                        p = exp2_any(Sr[c] - ms)
                        Sr[c] = p
                        s += p
                    alpha = alph[r0 + r]
                    l[r0 + r] = l[r0 + r] * alpha + s
                    if alpha != 1.0:
                        ar = acc_[r0 + r]
                        for d in range(Dv):
                            ar[d] *= alpha
                if Dv > 0:  # acc += P @ V over the strip's columns, accumulated by the gemm itself
                    sa = acc_[r0:r0 + rr]
                    if banded and not v_finite:
                        band_rows_mm(sbuf, vh[hk, s0 + c0:s0 + c0 + cols], sa, rr, cols, lo_rel, hi_rel, ka, kb)
                    elif vpan.shape[0] > 0:   # V as column panels (api: own products, Dv whole panels)
                        product_panels(sbuf[:rr, ca:cb], vpan[hk, :, s0 + c0 + ca:s0 + c0 + cb], sa, 1.0, False)
                    else:
                        product(sbuf[:rr, ca:cb], vh[hk, s0 + c0 + ca:s0 + c0 + cb], sa, 1.0, False, False, OWN)
        tiles_total[w] = n_total
        tiles_pruned[w] = n_pruned
        if slot >= 0:  # one key range of a split item: its partial state, merged below
            part_m[slot, :rows] = m
            part_l[slot, :rows] = l
            part_acc[slot, :rows] = acc_
            restore_mxcsr(mxcsr)
            return
        for r in range(rows):
            i = d0 + q0 + r
            inv = dt(1.0) / l[r] if l[r] > 0 else dt(0.0)
            for d in range(Dv):
                out[i, h, d] = acc_[r, d] * inv
            m_out[i, h] = m[r] if l[r] > 0 else -np.inf  # base 2, as the kernel found it
            l_out[i, h] = l[r]
        restore_mxcsr(mxcsr)

    def merge_item(t, splits, dst_off, part_m, part_l, part_acc, out, m_out, l_out):
        """the key ranges of split item t, merged in slot order (deterministic)."""
        h = splits[t, 0]
        b = splits[t, 1]
        q0 = splits[t, 2]
        first = splits[t, 3]
        last = first + splits[t, 4]
        rows = min(BM, dst_off[b + 1] - dst_off[b] - q0)
        for r in range(rows):
            i = dst_off[b] + q0 + r
            m_out[i, h], l_out[i, h] = merge_parts(part_m[first:last, r], part_l[first:last, r],
                                                   part_acc[first:last, r], out[i, h])

    def forward(qh, ktt, kh, kT, vh, vpan, v_finite, items, dst_off, src_off, band_lo, band_hi, tile_base,
                group, log2_rho, splits, part_acc, part_m, part_l, out, m_out, l_out, tiles_total,
                tiles_pruned, mctx):
        for w in prange(items.shape[0]):
            # int64: the parallel loop's index is unsigned in its outlined body, signed where the
            # driver is typed; one signature means one compile of the item
            FORWARD_ITEM(np.int64(w), qh, ktt, kh, kT, vh, vpan, v_finite, items, dst_off, src_off, band_lo, band_hi,
                         tile_base, group, log2_rho, splits, part_acc, part_m, part_l, out, m_out, l_out,
                         tiles_total, tiles_pruned, mctx)
        # merge the key ranges of every split item, after every piece is written
        for t in prange(splits.shape[0]):
            MERGE_ITEM(np.int64(t), splits, dst_off, part_m, part_l, part_acc, out, m_out, l_out)

    item = jit_kernel(forward_item, mod, parallel=False, **hooks)
    return jit_driver(forward, mod, hooks, FORWARD_ITEM=item,
                      MERGE_ITEM=jit_kernel(merge_item, None, parallel=False, exact=True))


def make_backward(acc, BM, BN, mod=None, own=False, index_bits=32):
    """Fused backward; with a score modifier ``mod`` (q scaled by ``scale`` only) the score
    cells are rebuilt as ``mod.value(s) * log2(e)`` and dS = dF * df/ds (``mod.grad``), which
    also accumulates the modifier's gradients into ``mgrad`` = (per-partition per-head params
    (P, n, H), per-partition dst fields (P, n, Nq, H), src fields (n, Nk, H), owned by the key
    tile's item); node indices reach it as ``index_bits``-bit integers, as in make_forward."""
    dt = np.float32 if acc == "float32" else np.float64
    OWN = bool(own)   # tile products as in make_forward
    PANELS = panel_tiles(own, BN)   # packed tiles as column panels, as in make_forward
    PB = BN // NR if PANELS else 0
    ln2 = LN2
    MOD = mod is not None
    # no leaf wants a gradient: f' may run over whole rows too (cells outside the band are
    # zeroed afterwards); with leaves only band cells may reach their sums
    LEAFLESS = MOD and not mod.grad_leaves
    hooks = {} if not MOD else {"MOD_VALUE": mod.value,
                                "MOD_GRAD": mod.grad(("head", "dst", "src"))}
    if LEAFLESS:   # value and df/ds in one call: their shared work (a soft-cap's tanh) done once
        hooks["MOD_SLOPE"] = mod.slope()
    IX = np.int32 if index_bits == 32 else np.int64   # as in make_forward
    log2e = dt(LOG2E)
    kmul = 1.0 if MOD else ln2  # dk = dS^T (q * scale * [log2 e]) * [ln 2]

    def backward_part(part, qh, kh, vh, ktt, vtt, kT, pans, doh, finite, m2, linv, delta, kitems, dst_off, src_off,
                      band_lo, band_hi, tile_base, group, n_parts, boxes, dq_part, dk, dv, mctx, mgrad):
        """partition `part`: its key-tile items (api._deal), its box of dq_part."""
        sc, hp, nd_f, ns_f, ef = mctx
        # rows of q, k and dout as column panels (api._row_panels; empty without the own products
        # or where D / Dv is not whole panels): the B operands of dk, dq and dv's products
        qpan, kpan, dopan = pans
        ghp_part, gnd_part, gns = mgrad
        D = qh.shape[2]
        Dv = doh.shape[2]
        n_items = kitems.shape[0]
        wide_vectors()
        mxcsr = denormals_off()
        # each partition zeroes the box of dq its items write (api._deal): the rest is never read
        dq_part[part, boxes[part, 0]:boxes[part, 1], boxes[part, 2]:boxes[part, 3], :] = 0.0
        # P and dS rows one cache line longer than BN: dv's and dk's products read them
        # transposed, one row per k step, and rows a power-of-two apart (1 KiB at BN = 256) fall
        # into a few L1 sets and evict each other (P^T dO: 71 -> 82 GFLOP/s on a Zen 3 core)
        pbuf = np.empty((BM, BN + ROW_PAD), dt)
        sbuf = np.empty((BM, BN + ROW_PAD), dt)
        xbuf = np.empty((BM if MOD else 1, BN if MOD else 1), dt)   # raw scores (modifier)
        dk_acc = np.empty((BN, D), dt)
        dv_acc = np.empty((BN, Dv), dt)
        # an unpacked block's K^T and V^T tiles as column panels (copied once per key tile for
        # every head and query tile that reads them; PANELS: whole panels)
        kbuf = np.empty((PB if PANELS else 0, D if PANELS else 0, NR), dt)
        vbuf = np.empty((PB if PANELS else 0, Dv if PANELS else 0, NR), dt)
        ghp = ghp_part[part]
        gnd = gnd_part[part]
        for w in range(part, n_items, n_parts):
            hk = kitems[w, 0]
            b = kitems[w, 1]
            c0 = kitems[w, 2]
            if hk < 0:  # padding slot of the round-robin deal
                continue
            d0 = dst_off[b]
            s0 = src_off[b]
            nd = dst_off[b + 1] - d0
            ns = src_off[b + 1] - s0
            lo = band_lo[b]
            hi = band_hi[b]
            tb = tile_base[b]
            cols = min(BN, ns - c0)
            dka = dk_acc[:cols]
            dva = dv_acc[:cols]
            dka[:, :] = 0.0
            dva[:, :] = 0.0
            kt = kh[hk, s0 + c0:s0 + c0 + cols]  # (cols, D)
            vt = vh[hk, s0 + c0:s0 + c0 + cols]  # (cols, Dv)
            unpacked = PANELS and tb < 0 and kT.shape[0] > 0
            if unpacked:
                panels_of_columns(kT[hk], s0 + c0, whole_blocks(cols, BN), kbuf)
                panels_of_rows(vh[hk], s0 + c0, cols, whole_blocks(cols, BN), vbuf)
            # query rows that reach this key tile: c0 - hi <= r <= c0 + cols - 1 - lo
            qbeg = max(0, c0 - hi)
            qend = min(nd, c0 + cols - lo)
            for h in range(hk * group, (hk + 1) * group):
                # query rows are read in place: tiles start at the first row the band lets
                # in and end at the last (rows past qend hold no cell of this key tile)
                for q0 in range(qbeg, qend, BM):
                    rows = min(BM, qend - q0)
                    qt = qh[h, d0 + q0:d0 + q0 + rows]
                    dot = doh[h, d0 + q0:d0 + q0 + rows]
                    P = pbuf[:rows, :cols]
                    dP = sbuf[:rows, :cols]
                    if D == 0:
                        P[:, :] = 0.0
                    elif tb >= 0:   # the scores as the forward made them (whole column blocks)
                        wide = whole_blocks(cols, BN) if OWN else cols
                        tile_product(qt, ktt, hk, tb + c0 // BN, 0, wide, pbuf[:rows, :wide], PB, OWN)
                    elif kT.shape[0] > 0:   # unpacked, own products: as the forward, from K^T
                        wide = whole_blocks(cols, BN)
                        if unpacked:
                            product_panels(qt, kbuf, pbuf[:rows, :wide], 0.0, False)
                        else:
                            product(qt, kT[hk, :, s0 + c0:s0 + c0 + wide], pbuf[:rows, :wide], 0.0, False, False,
                                    OWN)
                    else:   # K rows as the BLAS's transposed operand
                        mm(qt, kt, P, 0.0, False, True)
                    if Dv == 0:
                        dP[:, :] = 0.0
                    elif tb >= 0:
                        # panels: whole ones (zero past the keys; those columns are not read)
                        wv = whole_blocks(cols, BN) if PANELS else cols
                        tile_product(dot, vtt, hk, tb + c0 // BN, 0, wv, sbuf[:rows, :wv], PB, OWN)
                    elif unpacked:
                        wv = whole_blocks(cols, BN)
                        product_panels(dot, vbuf, sbuf[:rows, :wv], 0.0, False)
                    else:
                        mm(dot, vt, dP, 0.0, False, True)
                    lo_rel = q0 + lo - c0
                    hi_rel = q0 + hi - c0
                    ca, cb = common_span(rows, lo_rel, hi_rel, cols)
                    banded = ca > 0 or cb < cols
                    for r in range(rows):
                        i = d0 + q0 + r
                        mr = m2[h, i]
                        ms = mr if mr > EMPTY else dt(0.0)
                        li = linv[h, i]
                        de = delta[h, i]
                        Pr = pbuf[r]
                        dPr = sbuf[r]
                        if MOD:  # only band cells reach the modifier's gradients
                            # three plain loops over whole rows (value; P and dS; f'), as the
                            # forward's: they vectorise, where one band-limited loop doing all
                            # three per cell ran scalar (soft-cap backward ~2x plain -> ~1.03x).
                            # Cells outside the band are zeroed below; f' stays band-limited
                            # when some leaf accumulates a gradient.
                            first, last = _row_span(r, lo_rel, hi_rel, cols)
                            cf, cl = max(first, 0), min(last, cols)
                            Xr = xbuf[r]
                            ix = IX(i)
                            j0 = s0 + c0
                            if LEAFLESS:   # Xr holds df/ds: f' over whole rows, zeroed below
                                for c in range(cols):
                                    f, g = MOD_SLOPE(Pr[c], ix, IX(j0 + c), -1, h, sc, hp, nd_f, ns_f, ef)
                                    Pr[c] = f * log2e
                                    Xr[c] = g
                                for c in range(cols):
                                    p = exp2_any(Pr[c] - ms) * li
                                    Pr[c] = p
                                    dPr[c] = (p * (dPr[c] - de)) * Xr[c]
                            else:   # Xr holds the raw scores for the leaves' gradients
                                for c in range(cols):
                                    Xr[c] = Pr[c]
                                    Pr[c] = MOD_VALUE(Pr[c], ix, IX(j0 + c), -1, h, sc, hp, nd_f, ns_f, ef) * log2e
                                for c in range(cols):
                                    p = exp2_any(Pr[c] - ms) * li
                                    Pr[c] = p
                                    dPr[c] = p * (dPr[c] - de)
                                for c in range(cf, cl):
                                    dPr[c] = MOD_GRAD(Xr[c], ix, IX(j0 + c), -1, h, sc, hp, nd_f, ns_f, ef,
                                                      dPr[c], ghp, gnd, i, gns, j0 + c, ef)
                        else:
                            for c in range(cols):
                                p = exp2_any(Pr[c] - ms) * li
                                Pr[c] = p
                                dPr[c] = p * (dPr[c] - de)
                        if banded:
                            first, last = _row_span(r, lo_rel, hi_rel, cols)
                            for c in range(0, min(first, cols)):
                                Pr[c] = 0.0
                                dPr[c] = 0.0
                            for c in range(max(last, 0), cols):
                                Pr[c] = 0.0
                                dPr[c] = 0.0
                    # dv += P^T dO ; dk += dS^T Q2 ; dq_part += dS K   (dS lives in dP)
                    dqt = dq_part[part, h, d0 + q0:d0 + q0 + rows]
                    if banded and not finite:  # only band cells: nothing outside a row's band is read
                        if Dv > 0:
                            band_cols_mm(pbuf, dot, dva, rows, cols, lo_rel, hi_rel, ca, cb)
                        if D > 0:
                            band_cols_mm(sbuf, qt, dka, rows, cols, lo_rel, hi_rel, ca, cb)
                            band_rows_mm(sbuf, kt, dqt, rows, cols, lo_rel, hi_rel, ca, cb)
                    else:
                        if Dv > 0:
                            if dopan.shape[0] > 0:
                                product_panels(P, dopan[h, :, d0 + q0:d0 + q0 + rows], dva, 1.0, True)
                            else:
                                product(P, dot, dva, 1.0, True, False, OWN)
                        if D > 0:
                            if qpan.shape[0] > 0:
                                product_panels(dP, qpan[h, :, d0 + q0:d0 + q0 + rows], dka, 1.0, True)
                                product_panels(dP, kpan[hk, :, s0 + c0:s0 + c0 + cols], dqt, 1.0, False)
                            else:
                                product(dP, qt, dka, 1.0, True, False, OWN)
                                product(dP, kt, dqt, 1.0, False, False, OWN)
            for c in range(cols):
                for d in range(D):
                    dk[hk, s0 + c0 + c, d] = dka[c, d] * kmul
                for d in range(Dv):
                    dv[hk, s0 + c0 + c, d] = dva[c, d]
        restore_mxcsr(mxcsr)

    def backward(qh, kh, vh, ktt, vtt, kT, pans, doh, finite, m2, linv, delta, kitems, dst_off, src_off,
                 band_lo, band_hi, tile_base, group, n_parts, boxes, dq_part, dk, dv, mctx, mgrad):
        for part in prange(n_parts):
            # int64: one signature of the item in the driver and in its outlined loop body
            BACKWARD_PART(np.int64(part), qh, kh, vh, ktt, vtt, kT, pans, doh, finite, m2, linv, delta, kitems,
                          dst_off, src_off, band_lo, band_hi, tile_base, group, n_parts, boxes, dq_part,
                          dk, dv, mctx, mgrad)

    return jit_driver(backward, mod, hooks,
                      BACKWARD_PART=jit_kernel(backward_part, mod, parallel=False, **hooks))


@njit(parallel=True, cache=True, nogil=True)
def row_dots(a, b, out):
    """out[n, h] = sum_d a[n, h, d] b[n, h, d] (the backward's Delta = rowsum(dO * O)), rows over
    the threads, each summed in d order (the same bits with any thread count)."""
    for n in prange(a.shape[0]):
        for h in range(a.shape[1]):
            s = out.dtype.type(0.0)
            for d in range(a.shape[2]):
                s += a[n, h, d] * b[n, h, d]
            out[n, h] = s


@njit(parallel=True, cache=True, nogil=True)
def pack_transposed_tiles(xh, tile_start, tile_cols, BN, out):
    """Key tile t (`tile_cols[t]` keys from `tile_start[t]`) of every head, transposed, in column
    panels of W = out.shape[3] keys: out[h, t BN / W + c // W, d, c % W] = xh[h, start + c, d],
    zero past the tile's keys. W = BN: one (D, BN) tile each, the BLAS's fast A @ B operand
    (not A @ B.T on a strided view); W = NR: the own tile product's column panels
    (microgemm.product_panels)."""
    H = xh.shape[0]
    nt = tile_start.shape[0]
    pb = BN // out.shape[3]
    for w in prange(H * nt):
        h = w // nt
        t = w % nt
        panels_of_rows(xh[h], tile_start[t], tile_cols[t], BN, out[h, t * pb:(t + 1) * pb])


@njit(parallel=True, cache=True, nogil=True)
def pack_row_panels(xh, out):
    """out[h, p, n, j] = xh[h, n, p W + j] (W = out.shape[3]): the rows of a head-major array
    as column panels of the own tile product, so that a product reading rows n0..n1 of it as
    its B operand walks contiguous memory (microgemm.product_panels)."""
    H, N, Dd = xh.shape
    W = out.shape[3]
    for w in prange(H * N):
        h = w // N
        n = w % N
        for p in range(Dd // W):
            for j in range(W):
                out[h, p, n, j] = xh[h, n, p * W + j]


@njit(parallel=True, fastmath=False, cache=True, nogil=True)
def reduce_dq(dq_part, boxes, scale, dq):
    """dq[i, h] = scale * sum over the partitions whose box (h from, to, row from, to) holds
    (h, i), in partition order (deterministic); 0 where none does."""
    P, H, N, D = dq_part.shape
    for i in prange(N):
        for h in range(H):
            o = dq[i, h]
            for d in range(D):
                o[d] = 0.0
            for p in range(P):
                if boxes[p, 0] <= h < boxes[p, 1] and boxes[p, 2] <= i < boxes[p, 3]:
                    src = dq_part[p, h, i]
                    for d in range(D):
                        o[d] += src[d]
            for d in range(D):
                o[d] *= scale
