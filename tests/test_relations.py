"""Banded relations (Graph.band, cu_seqlens with cu_seqlens_k / window), Graph.restrict,
from_edge_index and exact edge counts, against a float64 dense-mask oracle."""
import itertools
import tracemalloc

import numpy as np
import pytest

import tiga_numba as tg
from conftest import attention_oracle


def band_mask(nd, ns, lo, hi):
    r = np.arange(nd)[:, None]
    c = np.arange(ns)[None, :]
    return (c - r >= lo) & (c - r <= hi)


def segments_mask(cu_q, cu_k, causal, window):
    M = np.zeros((cu_q[-1], cu_k[-1]), bool)
    for b in range(len(cu_q) - 1):
        lq, lk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        off = lk - lq
        lo = -10**9 if window is None or window[0] is None else off - window[0]
        hi = 10**9 if not causal else off
        if window is not None and window[1] is not None:
            hi = min(hi, off + window[1])
        M[cu_q[b]:cu_q[b + 1], cu_k[b]:cu_k[b + 1]] = band_mask(lq, lk, lo, hi)
    return M


def check(graph, M, seed, dtype=np.float32, h=4, hkv=2, d=16, tol=3e-5, poison=True):
    rng = np.random.default_rng(seed)
    nd, ns = M.shape
    q = rng.standard_normal((nd, h, d)).astype(dtype)
    k = rng.standard_normal((ns, hkv, d)).astype(dtype)
    v = rng.standard_normal((ns, hkv, d + 3)).astype(dtype)
    dout = rng.standard_normal((nd, h, d + 3)).astype(dtype)
    assert graph.num_edges == int(M.sum())
    assert np.array_equal(graph.to_scipy().toarray(), M)
    ref = attention_oracle(q, k, v, M)[0]
    out, st = tg.attention(q, k, v, graph, return_stats=True)
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)
    empty = ~M.any(1)
    assert np.all(out[empty] == 0) and np.all(st.m[empty] == -np.inf) and np.all(st.l[empty] == 0)
    dq, dk, dv = tg.attention_backward(dout, q, k, v, out, st, graph)
    for got, want in zip((dq, dk, dv), attention_oracle(q, k, v, M, dout=dout)[3:]):
        np.testing.assert_allclose(got, want, atol=tol * 10, rtol=tol * 10)
    if poison:
        # a non-finite key / value outside a row's band never reaches that row
        j = int(rng.integers(ns)) if ns else None
        if j is not None:
            kp, vp = k.copy(), v.copy()
            kp[j] = np.inf
            vp[j] = np.nan
            o2, s2 = tg.attention(q, kp, vp, graph, return_stats=True)
            clean = ~M[:, j]
            np.testing.assert_allclose(o2[clean], out[clean], atol=tol, rtol=tol)
            g2 = tg.attention_backward(dout, q, kp, vp, o2, s2, graph)
            assert np.isfinite(g2[0][clean]).all()
            np.testing.assert_allclose(g2[0][clean], dq[clean], atol=tol * 10, rtol=tol * 10)
            # dk/dv of the other keys do not see the poisoned key's rows' NaN either
            others = np.ones(ns, bool)
            others[j] = False
            rows_j = M[:, j]
            untouched = others & ~M[rows_j].any(0)
            np.testing.assert_allclose(g2[1][untouched], dk[untouched], atol=tol * 10, rtol=tol * 10)
            np.testing.assert_allclose(g2[2][untouched], dv[untouched], atol=tol * 10, rtol=tol * 10)


@pytest.mark.parametrize("nd,ns,left,right", [
    (200, 200, 37, 0), (200, 200, None, 0), (150, 260, 40, 5), (260, 150, 3, None),
    (130, 130, 0, 0), (97, 300, -20, 60), (300, 97, 200, -150)])
def test_band_forward_backward_poison(nd, ns, left, right):
    g = tg.Graph.band(ns, nd, left=left, right=right)
    assert g.kind == "band" and g.is_implicit
    lo = -10**9 if left is None else -left
    hi = 10**9 if right is None else right
    check(g, band_mask(nd, ns, lo, hi), seed=nd + ns)


def test_band_left_none_right_zero_is_triangular():
    a = tg.Graph.band(70, left=None, right=0).to_scipy().toarray()
    assert np.array_equal(a, tg.Graph.triangular(70).to_scipy().toarray())


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (5, None)),
                                           (False, (4, 3)), (True, (0, 0)), (False, (None, 2))])
def test_rectangular_cu_seqlens(causal, window):
    # Lq > Lk, Lq < Lk, empty query / key segments, one long segment
    cu_q = [0, 9, 9, 12, 140, 141, 141]
    cu_k = [0, 4, 7, 7, 100, 250, 250]
    g = tg.Graph.cu_seqlens(cu_q, causal, cu_seqlens_k=cu_k, window=window)
    assert g.kind == "segments" and g.num_dst == 141 and g.num_src == 250
    check(g, segments_mask(cu_q, cu_k, causal, window), seed=7)


def test_cu_seqlens_window_takes_a_negative_side_as_unbounded():
    # flash-attn's window_size=(-1, -1) is "no window"; (-1, 0) without causal is causal
    cu_q, cu_k = [0, 9, 9, 12, 140], [0, 4, 7, 7, 100]
    edges = lambda g: g.to_scipy().toarray()
    plain = tg.Graph.cu_seqlens(cu_q, False, cu_seqlens_k=cu_k)
    assert np.array_equal(edges(tg.Graph.cu_seqlens(cu_q, False, cu_seqlens_k=cu_k, window=(-1, -1))), edges(plain))
    assert np.array_equal(edges(tg.Graph.cu_seqlens(cu_q, False, cu_seqlens_k=cu_k, window=(-1, 0))),
                          edges(tg.Graph.cu_seqlens(cu_q, True, cu_seqlens_k=cu_k)))
    assert np.array_equal(edges(tg.Graph.cu_seqlens(cu_q, True, cu_seqlens_k=cu_k, window=(3, -2))),
                          edges(tg.Graph.cu_seqlens(cu_q, True, cu_seqlens_k=cu_k, window=(3, None))))
    assert np.array_equal(edges(tg.Graph.cu_seqlens(cu_q, True, cu_seqlens_k=cu_k, window=(3, None))),
                          segments_mask(cu_q, cu_k, True, (3, None)))


def test_causal_nan_in_v_does_not_cross_the_diagonal():
    n = 150
    rng = np.random.default_rng(3)
    for g in (tg.Graph.triangular(n), tg.Graph.cu_seqlens([0, 70, n])):
        for dtype in (np.float16, np.float32, np.float64):
            q = rng.standard_normal((n, 2, 8)).astype(dtype)
            k = rng.standard_normal((n, 2, 8)).astype(dtype)
            v = rng.standard_normal((n, 2, 8)).astype(dtype)
            v[120] = np.nan
            out, st = tg.attention(q, k, v, g, return_stats=True)
            M = g.to_scipy().toarray()
            assert np.isfinite(out[~M[:, 120]]).all()
            dq, dk, dv = tg.attention_backward(np.ones_like(out), q, k, v, out, st, g)
            assert np.isfinite(dq[~M[:, 120]]).all()


def test_restrict_tiles_partition_the_relation():
    rng = np.random.default_rng(5)
    graphs = [tg.Graph.band(40, 33, left=6, right=2), tg.Graph.triangular(40),
              tg.Graph.cu_seqlens([0, 5, 5, 21, 40], cu_seqlens_k=[0, 9, 10, 10, 30], window=(3, 1)),
              tg.Graph.dense(30, 25),
              tg.Graph.from_coo(*np.divmod(rng.choice(30 * 25, 200, replace=False), 25), 30, 25)]
    for g in graphs:
        M = g.to_scipy().toarray()
        for d0, d1, s0, s1 in [(0, 7, 0, 9), (3, 20, 5, 30), (10, 10, 0, 5), (0, g.num_dst, 0, g.num_src)]:
            s1 = min(s1, g.num_src)
            d1 = min(d1, g.num_dst)
            sub = g.restrict(d0, d1, s0, s1)
            assert sub.is_implicit == g.is_implicit
            assert sub.num_edges == int(M[d0:d1, s0:s1].sum())
            assert np.array_equal(sub.to_scipy().toarray(), M[d0:d1, s0:s1])
    with pytest.raises(ValueError, match="dst range"):
        graphs[0].restrict(0, 34, 0, 1)


def test_restricted_key_chunks_merge_to_the_whole_row():
    rng = np.random.default_rng(6)
    g = tg.Graph.band(300, 280, left=90, right=10)
    q = rng.standard_normal((280, 4, 16))
    k = rng.standard_normal((300, 2, 16))
    v = rng.standard_normal((300, 2, 16))
    out, st = tg.attention(q, k, v, g, return_stats=True)
    parts = [tg.attention(q, k[a:b], v[a:b], g.restrict(0, 280, a, b), return_stats=True)
             for a, b in ((0, 64), (64, 200), (200, 300))]
    mo, ms = tg.attention_merge(parts)
    np.testing.assert_allclose(mo, out, atol=1e-12)
    np.testing.assert_allclose(ms.lse, st.lse, atol=1e-12)


def test_exact_edge_counts():
    assert tg.Graph.dense(2**32).num_edges == 2**64
    assert tg.Graph.dense(2**61, 8).num_edges == 2**64
    assert tg.Graph.cu_seqlens([0, 2**33]).num_edges == 2**33 * (2**33 + 1) // 2
    assert tg.Graph.band(2**40, left=3, right=1).num_edges == 5 * 2**40 - 6 - 1
    assert isinstance(tg.Graph.triangular(5).num_edges, int)
    for nd, ns, lo, hi in itertools.product([0, 1, 5], [0, 1, 7], [-6, -1, 0, 3], [-2, 0, 4, 9]):
        if lo > hi:
            continue
        g = tg.Graph.band(ns, nd, left=-lo, right=hi)
        assert g.num_edges == int(band_mask(nd, ns, lo, hi).sum())


def test_from_edge_index_is_from_coo():
    rng = np.random.default_rng(8)
    ei = rng.integers(0, 12, (2, 40))
    a = tg.Graph.from_edge_index(ei, num_nodes=15)
    b = tg.Graph.from_coo(ei[0], ei[1], 15, 15)
    assert a.num_src == a.num_dst == 15
    assert np.array_equal(a.to_scipy().toarray(), b.to_scipy().toarray())
    assert np.array_equal(a.edge_permutation, b.edge_permutation)
    with pytest.raises(ValueError, match="edge_index"):
        tg.Graph.from_edge_index(np.zeros((3, 4), int))
    with pytest.raises(ValueError, match=r"dst\[2\] = -3"):
        tg.Graph.from_coo(np.array([0, 1, 2]), np.array([0, 1, -3]))


def test_many_short_segments_memory_is_linear():
    n_seg, d = 20000, 64
    cu = np.arange(0, 5 * n_seg + 1, 5)
    g = tg.Graph.cu_seqlens(cu)
    rng = np.random.default_rng(9)
    q = rng.standard_normal((cu[-1], 4, d)).astype(np.float32)
    k = rng.standard_normal((cu[-1], 4, d)).astype(np.float32)
    v = rng.standard_normal((cu[-1], 4, d)).astype(np.float32)
    tg.attention(q[:10], k[:10], v[:10], tg.Graph.cu_seqlens(cu[:3]))  # compile outside the trace
    inputs = q.nbytes * 3
    tracemalloc.start()
    out, st = tg.attention(q, k, v, g, return_stats=True)
    tg.attention_backward(out, q, k, v, out, st, g)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 12 * inputs, (peak, inputs)
    ref = attention_oracle(q[:10], k[:10], v[:10], segments_mask([0, 5, 10], [0, 5, 10], True, None))[0]
    np.testing.assert_allclose(out[:10], ref, atol=3e-5)
