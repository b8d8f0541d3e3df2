"""Work tables: one int32 row per CTA, built on the host from a BlockRelation's offsets and bands.

A row is (row0, rows, col0, cols, diag, causal, lo, hi) (generator.WORK_FIELDS): the CTA owns rows
[row0, row0 + min(rows, BM)) of the streamed-over relation and faces the block's columns
[col0, col0 + cols); tile row t sees the block-local columns c with t + lo <= c <= t + hi (and
0 <= c < cols). Forward and dQ tile the destinations (rows = queries, columns = keys); dK/dV
tile the sources (rows = keys, columns = queries). A block's band lo_b <= c - r <= hi_b
(BlockRelation: full, causal, bottom-right causal, sliding window) becomes, for the tile whose
first row is the block's row `diag`: lo = diag + lo_b, hi = diag + hi_b (query tiles) or
lo = diag - hi_b, hi = diag - lo_b (key tiles). A full block's limits lie outside [0, cols) for
every row, so its tiles mask only their tail; the kernels visit only the column blocks between
the first row's lower limit and the last row's upper one (query tiles: col0 is moved to that
lower limit on the host, so the kernel's key loop starts at block 0 and holds no start). `diag` (the tile's first row inside
the block) and `causal` (a square causal block) are what the fused dK/dV/dQ kernel orders its
turns by. Segments are tiled per block: no padding, length-0 blocks give no rows, a block with
no columns still gets rows (their output is written as zeros / empty). Rows are ordered by
decreasing work so the long tiles start first (tail effect).
"""
from __future__ import annotations

import numpy as np


def block_bands(dst_offsets, src_offsets, causal, lo=None, hi=None):
    """(lo_b, hi_b) int64 per block: the given band, or full / square-causal blocks from `causal`."""
    nr = np.diff(np.asarray(dst_offsets, np.int64))
    nc = np.diff(np.asarray(src_offsets, np.int64))
    cz = np.asarray(causal).astype(bool)
    lo = 1 - nr if lo is None else np.asarray(lo, np.int64)
    hi = np.where(cz, 0, nc - 1) if hi is None else np.asarray(hi, np.int64)
    return lo, hi


def visited_columns(rows, cols, lo, hi, BM):
    """(first, end) per work row: the columns from its first row's lower limit to its last row's
    upper limit (below cols), which is what the kernels stream."""
    return np.clip(lo, 0, None), np.minimum(cols, hi + np.minimum(rows, BM))


def check_ordered_fused(v, standard):
    """the ordered fused dK/dV/dQ kernel counts turns from each query block's first key tile,
    which a band shifts: refuse it on banded relations (the two-kernel backward serves them)."""
    if v.fuse_dq and not v.dq_atomic and not standard:
        raise ValueError(f"{v.name()}: the ordered fused dK/dV/dQ kernel takes full and square-causal "
                         "blocks only; banded relations take the two-kernel backward")


def _tiles(row_off, col_off, causal, BM, lo_r, hi_r, shift):
    """work rows of BM-row tiles over `row_off` blocks; lo_r / hi_r: each block's band in the
    tile's own orientation (row r sees columns r + lo_r .. r + hi_r). shift: start each row's
    columns at its first row's lower limit (col0, cols, diag, lo, hi moved together), so that
    the kernel's loop starts at column block 0 and holds no start index."""
    row_off = np.asarray(row_off, np.int64)
    col_off = np.asarray(col_off, np.int64)
    causal = np.asarray(causal).astype(np.int64)
    nr = np.diff(row_off)
    nc = np.diff(col_off)
    nt = (nr + BM - 1) // BM
    b = np.repeat(np.arange(len(nr)), nt)
    first = np.repeat(np.cumsum(nt) - nt, nt)
    ti = np.arange(len(b)) - first
    diag = ti * BM
    rows = nr[b] - diag
    cols = nc[b]
    lo, hi = diag + lo_r[b], diag + hi_r[b]
    s = np.clip(lo, 0, cols) if shift else np.zeros_like(lo)
    # an empty band (lo_b > hi_b) has no column to visit: its rows are written as empty rows
    empty = lo_r[b] > hi_r[b]
    tab = np.stack([row_off[b] + diag, rows, col_off[b] + s, np.where(empty, 0, cols - s), diag - s,
                    causal[b], lo - s, hi - s], 1)
    if len(tab) and (np.abs(tab).max() >= 2 ** 31):
        raise ValueError("relation too large for 32-bit work tables")
    first, end = visited_columns(rows, cols, lo, hi, BM)
    order = np.argsort(-np.where(empty, 0, end - first), kind="stable")
    return np.ascontiguousarray(tab[order].astype(np.int32))


def query_tiles(dst_offsets, src_offsets, causal, BM, lo=None, hi=None):
    """forward / dQ: BM destination rows per CTA."""
    lo_b, hi_b = block_bands(dst_offsets, src_offsets, causal, lo, hi)
    return _tiles(dst_offsets, src_offsets, causal, BM, lo_b, hi_b, shift=True)


def key_tiles(dst_offsets, src_offsets, causal, BM, lo=None, hi=None):
    """dK / dV: BM source rows per CTA (key c sees the queries c - hi_b .. c - lo_b)."""
    lo_b, hi_b = block_bands(dst_offsets, src_offsets, causal, lo, hi)
    # not shifted: the fused dK/dV/dQ kernel identifies query blocks by their position in the block
    return _tiles(src_offsets, dst_offsets, causal, BM, -hi_b, -lo_b, shift=False)


def tile_counts(dst_offsets, src_offsets, causal, BM, BN, lo=None, hi=None):
    """(visited, total) (BM x BN) tiles of the forward: `total` = all tiles of the blocks' rectangles,
    `visited` = those between each query tile's first lower and last upper band limit."""
    nc = np.diff(np.asarray(src_offsets, np.int64))
    nr = np.diff(np.asarray(dst_offsets, np.int64))
    total = int(np.sum(-(-nr // BM) * -(-nc // BN)))
    tab = query_tiles(dst_offsets, src_offsets, causal, BM, lo, hi).astype(np.int64)
    if not len(tab):
        return 0, total
    first, end = visited_columns(tab[:, 1], tab[:, 3], tab[:, 6], tab[:, 7], BM)
    return int(np.sum(np.clip(-(-end // BN) - first // BN, 0, None))), total


def row_spans(dst_offsets, src_offsets, lo=None, hi=None):
    """(rows, blocks, first, last) over every destination row of the blocks: its global position,
    its block, and the block-local first and last column its band admits (row r of block b sees max(0, r + lo_b) ..
    min(nc_b - 1, r + hi_b); first > last: no column). Bands default to full blocks."""
    dst = np.asarray(dst_offsets, np.int64)
    nr, nc = np.diff(dst), np.diff(np.asarray(src_offsets, np.int64))
    lo = 1 - nr if lo is None else np.asarray(lo, np.int64)
    hi = nc - 1 if hi is None else np.asarray(hi, np.int64)
    b = np.repeat(np.arange(nr.size), nr)
    r = np.arange(b.size, dtype=np.int64) - np.repeat(np.cumsum(nr) - nr, nr)   # row inside its block
    return np.repeat(dst[:-1], nr) + r, b, np.maximum(0, r + lo[b]), np.minimum(nc[b] - 1, r + hi[b])


def rows_without_keys(dst_offsets, src_offsets, nd, lo=None, hi=None):
    """bool (nd,): destination rows no key tile visits (outside every block, in a block without
    sources, or with an empty band). The fused backward writes dQ only where a key tile visits, so
    these are zero-filled."""
    rows, _, first, last = row_spans(dst_offsets, src_offsets, lo, hi)
    out = np.ones(nd, bool)
    out[rows[first <= last]] = False
    return out


def last_sources(dst_offsets, src_offsets, lo=None, hi=None):
    """(rows, last): the destination rows that hold an edge (int64, increasing) and the global
    position of the last source each one's band admits. What a score modifier's order check
    compares the rows' positions with (api.ordered)."""
    rows, blocks, first, last = row_spans(dst_offsets, src_offsets, lo, hi)
    live = first <= last
    return rows[live], (np.asarray(src_offsets, np.int64)[blocks] + last)[live]
