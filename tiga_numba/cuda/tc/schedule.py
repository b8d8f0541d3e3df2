"""Work tables: one int32 row per CTA, built on the host from a BlockRelation's offsets.

A row is (row0, rows, col0, cols, diag, causal) (generator.WORK_FIELDS): the CTA owns rows
[row0, row0 + min(rows, BM)) of the streamed-over relation and faces the block's columns
[col0, col0 + cols); `diag` is the local index of its first row inside the block (the causal
diagonal is column diag + r for tile row r). Forward and dQ tile the destinations (rows =
queries, columns = keys); dK/dV tile the sources (rows = keys, columns = queries).
Segments are tiled per block: no padding, length-0 blocks give no rows, a block with no
columns still gets rows (their output is written as zeros / empty). Rows are ordered by
decreasing work so the long causal tiles start first (tail effect).
"""
from __future__ import annotations

import numpy as np


def _tiles(row_off, col_off, causal, BM, work_of):
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
    cz = causal[b]
    tab = np.stack([row_off[b] + diag, rows, col_off[b], cols, diag, cz], 1)
    if len(tab) and (tab.max() >= 2 ** 31 or tab.min() < 0):
        raise ValueError("relation too large for 32-bit work tables")
    order = np.argsort(-work_of(rows, cols, diag, cz), kind="stable")
    return np.ascontiguousarray(tab[order].astype(np.int32))


def query_tiles(dst_offsets, src_offsets, causal, BM):
    """forward / dQ: BM destination rows per CTA."""
    return _tiles(dst_offsets, src_offsets, causal, BM,
                  lambda r, c, d, cz: np.where(cz != 0, np.minimum(c, d + np.minimum(r, BM)), c))


def key_tiles(dst_offsets, src_offsets, causal, BM):
    """dK / dV: BM source rows per CTA."""
    return _tiles(src_offsets, dst_offsets, causal, BM,
                  lambda r, c, d, cz: np.where(cz != 0, c - d, c))


def tile_counts(dst_offsets, src_offsets, causal, BM, BN):
    """(visited, total) (BM x BN) tiles of the forward: `total` = all tiles of the blocks' rectangles,
    `visited` = those a causal block does not skip above its diagonal."""
    nr = np.diff(np.asarray(dst_offsets, np.int64))
    nc = np.diff(np.asarray(src_offsets, np.int64))
    cz = np.asarray(causal).astype(bool)
    nt = -(-nr // BM)
    total = int(np.sum(nt * -(-nc // BN)))
    b = np.repeat(np.arange(len(nr)), nt)                 # one entry per query tile
    d = (np.arange(len(b)) - np.repeat(np.cumsum(nt) - nt, nt)) * BM
    keys = np.where(cz[b], np.minimum(nc[b], d + np.minimum(nr[b] - d, BM)), nc[b])
    return int(np.sum(-(-keys // BN))), total


def rows_without_keys(dst_offsets, src_offsets, nd):
    """bool (nd,): destination rows no key tile visits (outside every block, or in a block without
    sources). The fused backward writes dQ only where a key tile visits, so these are zero-filled."""
    dst = np.asarray(dst_offsets, np.int64)
    nc = np.diff(np.asarray(src_offsets, np.int64))
    out = np.ones(nd, bool)
    for b in np.nonzero(nc > 0)[0]:
        out[dst[b]:dst[b + 1]] = False
    return out
