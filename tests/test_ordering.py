"""tg.locality_order: a node order that keeps neighbours near each other in id (reverse
Cuthill-McKee), the renumbered graph it returns, and the calls on it (tests/test_dask.py checks
the halos it shrinks)."""
import numpy as np
import pytest

import tiga_numba as tg
from tiga_numba.layers import GATConv


def shuffled_mesh(side, rng):
    """a side x side 4-neighbour mesh whose node ids are a random permutation, as from_coo
    edges in a random order: locality that the numbering hides"""
    n = side * side
    ids = rng.permutation(n)
    r, c = np.divmod(np.arange(n), side)
    src, dst = [], []
    for dr, dc in ((0, 1), (1, 0), (0, -1), (-1, 0)):
        rr, cc = r + dr, c + dc
        ok = (rr >= 0) & (rr < side) & (cc >= 0) & (cc < side)
        src.append(ids[rr[ok] * side + cc[ok]])
        dst.append(ids[np.arange(n)[ok]])
    order = rng.permutation(sum(len(s) for s in src))
    return np.concatenate(src)[order], np.concatenate(dst)[order]


def test_single_process_calls_on_the_reordered_graph_equal_the_original():
    """attention and its backward on the renumbered graph and permuted arrays, put back in the
    old order, give the original call's results (same edges per row, in the same order)"""
    rng = np.random.default_rng(6)
    side = 20
    n = side * side
    src, dst = shuffled_mesh(side, rng)
    g = tg.Graph.from_coo(src, dst, n, n)
    perm, g2 = tg.locality_order(g)
    assert sorted(perm) == list(range(n))
    inverse = np.argsort(perm)
    np.testing.assert_array_equal(g2.to_scipy().toarray(), g.to_scipy().toarray()[np.ix_(perm, perm)])
    # the order is a banded one: every edge within a few mesh rows of its destination
    rows, cols = g2.to_scipy().nonzero()
    assert np.abs(rows - cols).max() < 3 * side < np.abs(np.subtract(*g.to_scipy().nonzero())).max()
    q, k, v, dout = (rng.standard_normal((n, 2, 8)) for _ in range(4))
    out, st = tg.attention(q, k, v, g, return_stats=True)
    grads = tg.attention_backward(dout, q, k, v, out, st, g)
    out2, st2 = tg.attention(q[perm], k[perm], v[perm], g2, return_stats=True)
    grads2 = tg.attention_backward(dout[perm], q[perm], k[perm], v[perm], out2, st2, g2)
    for a, b in zip((out2, *grads2), (out, *grads)):
        np.testing.assert_allclose(a[inverse], b, rtol=1e-12, atol=1e-12)


def test_locality_order_keeps_the_input_edge_order():
    """per-edge fields in the original graph's input order go to the reordered graph as they
    are: a GAT layer with edge_attr gives the same rows"""
    rng = np.random.default_rng(8)
    side = 9
    n = side * side
    src, dst = shuffled_mesh(side, rng)
    conv = GATConv(5, 3, heads=2, edge_dim=2, dtype=np.float64, seed=1)
    x = rng.standard_normal((n, 5))
    g = tg.Graph.from_coo(src, dst, n, n)
    # a from_coo graph (input order: the caller's) and a from_scipy one (input order: CSR)
    for graph in (g, tg.Graph.from_scipy(g.to_scipy())):
        perm, reordered = tg.locality_order(graph)
        ea = rng.standard_normal((graph.num_edges, 2))
        np.testing.assert_allclose(conv(x[perm], reordered, ea)[np.argsort(perm)], conv(x, graph, ea),
                                   rtol=1e-12, atol=1e-12)


def test_locality_order_refusals():
    with pytest.raises(TypeError, match="graph must be a tiga_numba.Graph"):
        tg.locality_order(np.eye(3))
    with pytest.raises(ValueError, match="CSR relation"):
        tg.locality_order(tg.Graph.triangular(5))
    with pytest.raises(ValueError, match="square"):
        tg.locality_order(tg.Graph.from_coo([0, 1], [1, 0], num_src=3, num_dst=2))
    with pytest.raises(ValueError, match="node positions"):
        tg.locality_order(tg.Graph.radius(np.random.default_rng(0).random((20, 2)), 0.3))
