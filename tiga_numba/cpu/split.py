"""Work divided by edges, not by rows: the pieces a CSR or block kernel runs in parallel.

A row (a destination's in-edges, a source's out-edges over the transpose, or the key range of
a query tile) longer than a piece is cut into near-equal pieces; each piece leaves a partial
online-softmax state (or a partial gradient sum) in its own slot, and a second pass merges the
slots of each row in slot order (tiga_numba.merge has the algebra). Short rows are grouped into
runs of at most ``RB`` rows and about one piece of edges, so they keep their one-pass path.

The piece length depends on the relation only (its total work and the longest rows), never on
the thread count: the same relation gives the same pieces, and so the same bits, on any machine
and number of threads. The decomposition is a cheap pass over indptr, memoised per relation
record by the backends.
"""
import numpy as np
from numba import njit

# A piece never holds fewer edges than this (shorter pieces cost more in merging than they
# gain), and the pieces of a call number about TARGET_PIECES when its rows are long: enough to
# balance any core count up to a few dozen, few enough that the partial states stay small.
MIN_PIECE = 2048
TARGET_PIECES = 256
NO_SLOT = -1


def piece_length(total_work):
    return max(MIN_PIECE, -(-int(total_work) // TARGET_PIECES))


@njit(cache=True)
def _decompose(indptr, rb, piece):
    n = indptr.shape[0] - 1
    # upper bounds on the number of items and slots
    items = np.empty((n + indptr[n] // piece + 1, 5), np.int64)
    splits = np.empty((n if n > 0 else 1, 3), np.int64)
    n_items = 0
    n_split = 0
    n_slots = 0
    i = 0
    while i < n:
        deg = indptr[i + 1] - indptr[i]
        if deg > piece:
            k = (deg + piece - 1) // piece
            e0 = indptr[i]
            splits[n_split, 0] = i
            splits[n_split, 1] = n_slots
            splits[n_split, 2] = k
            n_split += 1
            for p in range(k):
                a = e0 + (deg * p) // k
                b = e0 + (deg * (p + 1)) // k
                items[n_items, 0] = i
                items[n_items, 1] = i + 1
                items[n_items, 2] = a
                items[n_items, 3] = b
                items[n_items, 4] = n_slots
                n_slots += 1
                n_items += 1
            i += 1
            continue
        # a run of short rows: at most rb rows and about one piece of edges
        r0 = i
        work = 0
        while i < n and i - r0 < rb:
            d = indptr[i + 1] - indptr[i]
            if d > piece or (work + d > piece and i > r0):
                break
            work += d
            i += 1
        items[n_items, 0] = r0
        items[n_items, 1] = i
        items[n_items, 2] = 0
        items[n_items, 3] = indptr[n]
        items[n_items, 4] = NO_SLOT
        n_items += 1
    return items[:n_items].copy(), splits[:n_split].copy(), n_slots


def row_pieces(indptr, rb, threads=1):
    """Work items of a CSR pass over the rows of ``indptr``.

    Returns ``(items, splits, n_slots)``: ``items`` (n, 5) int64 rows ``(r0, r1, e0, e1, slot)``
    -- rows [r0, r1), each restricted to edges [e0, e1); ``slot`` = -1 for a run of whole rows
    written directly, else the partial-state slot of one piece of one long row. ``splits``
    (s, 3) rows ``(row, first slot, number of slots)`` of the rows that were cut. Items are
    ordered so that numba's static prange chunks over `threads` threads carry about equal work
    (layout.order_balanced); the order never changes the bits."""
    from .layout import order_balanced
    indptr = np.ascontiguousarray(indptr, dtype=np.int64)
    total = int(indptr[-1]) + indptr.shape[0] - 1
    items, splits, n_slots = _decompose(indptr, rb, piece_length(total))
    rows = items[:, 1] - items[:, 0]
    edges = np.where(items[:, 4] >= 0, items[:, 3] - items[:, 2],
                     indptr[items[:, 1]] - indptr[items[:, 0]])
    return items[order_balanced(edges + rows, threads)], splits, int(n_slots)


def describe(splits, n_slots, n_items):
    if splits.shape[0] == 0:
        return f"{n_items} work items, no row split"
    return (f"{n_items} work items; {splits.shape[0]} long row(s) split into {n_slots} pieces, "
            "merged in fixed order")
