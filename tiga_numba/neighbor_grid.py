"""The cell grid both neighbour builders share (host: tiga_numba.neighbors, GPU:
tiga_numba.cuda.neighbors): the cell size and cells per axis for a radius or knn build, the
slack that keeps boundary distances in the right cell, and a knn graph's row length. Equal
inputs give equal grids on both sides, which is what makes the two builders agree bit for bit."""
from __future__ import annotations

import numpy as np

__all__ = ["cell_grid", "radius_grid", "knn_grid", "knn_row_length"]

# A cell a hair wider than the cutoff: a pair at distance exactly `cutoff` can then never land
# two cells apart through the rounding of (p - lo) / cell.
CELL_SLACK = 1.0 + 2.0 ** -40
# The ring bound a hair smaller than r * cell, for the same reason (knn termination).
RING_SLACK = 1.0 - 2.0 ** -40


def knn_row_length(n, k, exclude_self):
    """Edges per row of a knn graph: k, or every candidate when fewer than k exist."""
    if n == 0:
        return 0
    kk = max(min(k, n - 1 if exclude_self else n), 0)
    if n * kk >= 2**31:
        raise ValueError(f"knn graph would hold {n * kk} edges (>= 2**31); lower k")
    return kk


def cell_grid(lo, extent, n, cell):
    """Cell size and cells per axis; the cell grows when the point cloud is sparse so that the
    grid never holds more than ~2 cells per point (memory O(N) however far apart they are)."""
    cell = max(float(cell), 1e-300)
    cap = max(2 * n, 64)
    with np.errstate(over="ignore"):
        while True:
            dims = np.floor(extent / cell) + 1.0
            if float(np.prod(dims)) <= cap:
                break
            cell *= 1.25
    return cell, dims.astype(np.int64)


def radius_grid(lo, extent, n, cutoff):
    """(cell, dims) of the radius builders: cells at least `cutoff` wide, so every neighbour
    of a point lies in its own or one of the 3**3 surrounding cells."""
    return cell_grid(lo, extent, n, cutoff * CELL_SLACK if cutoff > 0 else 1.0)


def knn_grid(lo, extent, n, kk):
    """(cell, dims) of the knn builders: about max(2, k/4) points per cell, so that a few
    rings of cells find the k best."""
    live = extent[extent > 0]
    if live.size:
        per_cell = max(2.0, kk / 4.0)
        cell = float(np.prod(live) * per_cell / n) ** (1.0 / live.size)
        cell = max(cell, float(live.max()) * 1e-9)
    else:
        cell = 1.0
    return cell_grid(lo, extent, n, cell)
