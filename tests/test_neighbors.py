"""Radius and knn graphs (cell lists) against scipy.spatial.cKDTree."""
import numpy as np
import pytest
from scipy.spatial import cKDTree

from tiga_numba import neighbors
from tiga_numba.graph import Graph


def _rows(indptr, indices):
    return [indices[indptr[i]:indptr[i + 1]].tolist() for i in range(len(indptr) - 1)]


def _check_csr(indptr, indices, n):
    assert indptr.dtype == np.int64 and indices.dtype == np.int32
    assert indptr.shape == (n + 1,) and indptr[0] == 0 and indptr[-1] == indices.shape[0]
    assert np.all(np.diff(indptr) >= 0)
    for row in _rows(indptr, indices):
        assert row == sorted(row)


@pytest.mark.parametrize("n,dim,cutoff,exclude", [
    (0, 3, 0.1, True), (1, 3, 0.5, True), (1, 3, 0.5, False), (2, 3, 10.0, True),
    (257, 3, 0.15, True), (300, 3, 0.2, False), (200, 2, 0.12, True), (150, 1, 0.02, True),
    (400, 3, 0.0, True),
])
def test_radius_graph_matches_ckdtree(n, dim, cutoff, exclude):
    rng = np.random.default_rng(n + dim)
    pos = rng.random((n, dim))
    if n > 10:
        pos[:5] = pos[5]  # duplicated points: distance 0, distinct ids
        pos[-3:] += 50.0 * np.arange(1, 4)[:, None]  # isolated points
    indptr, indices = neighbors.radius_graph(pos, cutoff, exclude_self=exclude)
    _check_csr(indptr, indices, n)
    if n == 0:
        return
    tree = cKDTree(pos)
    ref = [sorted(j for j in tree.query_ball_point(pos[i], cutoff) if not (exclude and j == i))
           for i in range(n)]
    assert _rows(indptr, indices) == ref


def test_radius_graph_sparse_cloud_and_float32():
    """Points spread over a huge box (the grid must not allocate a cell per cutoff^3)."""
    rng = np.random.default_rng(3)
    pos = (rng.random((500, 3)) * 1e6).astype(np.float32)
    pos[1] = pos[0] + 0.5
    indptr, indices = neighbors.radius_graph(pos, 1.0)
    assert _rows(indptr, indices)[0] == [1] and _rows(indptr, indices)[1] == [0]
    assert indices.shape[0] == 2
    assert neighbors.last_build_info()["cells"] <= 2 * 500 + 64


@pytest.mark.parametrize("n,dim,k,exclude", [
    (1, 3, 3, True), (5, 3, 10, True), (5, 3, 10, False), (200, 3, 7, True),
    (300, 2, 16, True), (120, 1, 4, False), (64, 3, 0, True),
])
def test_knn_graph_matches_ckdtree(n, dim, k, exclude):
    rng = np.random.default_rng(10 * n + k)
    pos = rng.random((n, dim))
    indptr, indices = neighbors.knn_graph(pos, k, exclude_self=exclude)
    _check_csr(indptr, indices, n)
    kk = min(k, n - 1 if exclude else n)
    assert np.all(np.diff(indptr) == kk)
    if kk == 0:
        return
    tree = cKDTree(pos)
    _, nb = tree.query(pos, kk + (1 if exclude else 0))
    nb = nb.reshape(n, -1)
    for i, row in enumerate(_rows(indptr, indices)):
        want = [j for j in nb[i] if not (exclude and j == i)][:kk]
        assert row == sorted(want), i


def test_knn_clustered_points():
    """Two far clusters: rings must keep growing until k neighbours are proven."""
    rng = np.random.default_rng(4)
    pos = np.concatenate([rng.random((50, 3)) * 0.01, 100 + rng.random((6, 3)) * 0.01])
    indptr, indices = neighbors.knn_graph(pos, 8)
    tree = cKDTree(pos)
    _, nb = tree.query(pos, 9)
    for i, row in enumerate(_rows(indptr, indices)):
        assert row == sorted(j for j in nb[i] if j != i)[:8]


def test_graph_radius_uses_cell_lists_and_keeps_positions():
    rng = np.random.default_rng(5)
    pos = rng.random((100, 3))
    g = Graph.radius(pos, 0.2)
    ip, ix = neighbors.radius_graph(pos, 0.2)
    assert g.num_edges == ix.shape[0] and g.positions is pos
    assert np.array_equal(g.realize("cpu").indices, ix)


def test_bad_inputs():
    with pytest.raises(ValueError, match="positions must have shape"):
        neighbors.radius_graph(np.zeros((4, 4)), 0.1)
    with pytest.raises(TypeError, match="positions must be a floating-point array"):
        neighbors.radius_graph(np.zeros((4, 3), np.int64), 0.1)
    with pytest.raises(ValueError, match="cutoff must be finite and >= 0"):
        neighbors.radius_graph(np.zeros((4, 3)), -1.0)
    with pytest.raises(ValueError, match="finite"):
        neighbors.radius_graph(np.array([[0.0, np.nan, 0.0]]), 1.0)
    with pytest.raises(ValueError, match="k must be >= 0"):
        neighbors.knn_graph(np.zeros((4, 3)), -2)
    with pytest.raises(TypeError, match="k must be an int"):
        neighbors.knn_graph(np.zeros((4, 3)), 2.5)


def test_spatial_order_is_a_permutation():
    rng = np.random.default_rng(6)
    pos = rng.random((1000, 3))
    order = neighbors.spatial_order(pos)
    assert np.array_equal(np.sort(order), np.arange(1000))


def test_knn_ties_go_to_the_lower_index():
    """On a lattice many distances tie exactly: brute force with (distance, id) order."""
    g = np.stack(np.meshgrid(np.arange(5.0), np.arange(4.0), np.arange(3.0), indexing="ij"), -1)
    pos = g.reshape(-1, 3)
    rng = np.random.default_rng(7)
    pos = pos[rng.permutation(pos.shape[0])]
    k = 6
    indptr, indices = neighbors.knn_graph(pos, k)
    d2 = ((pos[:, None, :] - pos[None, :, :]) ** 2).sum(-1)
    for i, row in enumerate(_rows(indptr, indices)):
        cand = sorted((d2[i, j], j) for j in range(pos.shape[0]) if j != i)[:k]
        assert row == sorted(j for _, j in cand), i
