"""attention_merge and stats.lse: partial results over disjoint edge subsets merge exactly."""
import numpy as np
import pytest
import scipy.sparse as sp

import tiga_numba as tg


def _random_csr(nd, ns, density, rng, empty_rows=()):
    a = sp.random(nd, ns, density=density, random_state=np.random.RandomState(int(rng.integers(1 << 30))),
                  format="csr")
    a = a.tolil()
    for r in empty_rows:
        a.rows[r] = []
        a.data[r] = []
    return a.tocsr()


def _split_edges(full, rng, count):
    """`full`'s edges dealt at random into `count` disjoint relations of its shape."""
    coo = full.tocoo()
    part_of = rng.integers(0, count, coo.nnz)
    return [tg.Graph.from_scipy(sp.csr_matrix((coo.data[part_of == p], (coo.row[part_of == p],
                                              coo.col[part_of == p])), shape=full.shape))
            for p in range(count)]


def _qkv(nd, ns, h, hkv, d, rng, dtype=np.float64):
    q = rng.standard_normal((nd, h, d)).astype(dtype)
    k = rng.standard_normal((ns, hkv, d)).astype(dtype)
    v = rng.standard_normal((ns, hkv, d + 1)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-6)])
def test_merge_of_disjoint_edge_subsets_equals_the_union(dtype, tol):
    rng = np.random.default_rng(1)
    nd, ns, h, hkv, d = 37, 29, 4, 2, 8
    full = _random_csr(nd, ns, 0.3, rng, empty_rows=(3, 17))
    # split every row's edges at random into three disjoint parts (some rows empty in a part)
    graphs = _split_edges(full, rng, 3)
    g = tg.Graph.from_scipy(full)
    q, k, v = _qkv(nd, ns, h, hkv, d, rng, dtype)
    out, st = tg.attention(q, k, v, g, return_stats=True)
    parts = [tg.attention(q, k, v, gp, return_stats=True) for gp in graphs]
    mo, ms = tg.attention_merge(parts)
    assert mo.dtype == out.dtype and mo.shape == out.shape
    np.testing.assert_allclose(mo, out, atol=tol, rtol=tol)
    np.testing.assert_allclose(ms.l * np.exp(ms.m - np.where(np.isfinite(st.m), st.m, 0)),
                               np.where(st.l > 0, st.l, 0), rtol=tol * 10, atol=0)
    fin = np.isfinite(st.lse)
    assert np.array_equal(fin, np.isfinite(ms.lse))
    np.testing.assert_allclose(ms.lse[fin], st.lse[fin], rtol=tol, atol=tol)
    assert np.all(ms.lse[~fin] == -np.inf) and np.all(mo[3] == 0) and not np.isnan(mo).any()
    # merged stats feed the backward of the union
    dout = rng.standard_normal(out.shape).astype(dtype)
    ref = tg.attention_backward(dout, q, k, v, out, st, g)
    got = tg.attention_backward(dout, q, k, v, mo, ms, g)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, atol=tol * 50, rtol=tol * 50)
    # same parts, same order: same bits; other order: equal within rounding
    again, _ = tg.attention_merge(parts)
    assert np.array_equal(again, mo)
    rev, _ = tg.attention_merge(parts[::-1])
    np.testing.assert_allclose(rev, mo, atol=tol, rtol=tol)


def test_lse_matches_float64_oracle_and_empty_part_is_neutral():
    rng = np.random.default_rng(2)
    n, h, d = 20, 2, 4
    q, k, v = _qkv(n, n, h, h, d, rng)
    g = tg.Graph.triangular(n)
    out, st = tg.attention(q, k, v, g, return_stats=True)
    s = np.einsum("ihd,jhd->hij", q, k) * d ** -0.5
    s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
    lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    np.testing.assert_allclose(st.lse, lse.T, rtol=1e-12, atol=1e-12)
    empty = (np.zeros_like(out), tg.AttentionStats(np.full(st.m.shape, -np.inf), np.zeros(st.l.shape)))
    mo, ms = tg.attention_merge([empty, (out, st), empty])
    np.testing.assert_allclose(mo, out, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(ms.lse, st.lse, rtol=1e-13, atol=1e-13)
    # one part alone is returned as it is (a copy: the same bits)
    alone, ast = tg.attention_merge([(out, st)])
    assert alone is not out and np.array_equal(alone, out)
    assert np.array_equal(ast.m, st.m) and np.array_equal(ast.l, st.l)


@pytest.mark.parametrize("junk", [np.nan, np.inf, -np.inf])
def test_an_empty_part_is_neutral_whatever_its_out_holds(junk):
    """A part with l = 0 contributes nothing even when its out holds NaN or inf (a hand-made
    part, np.empty's memory): its out is never read, not multiplied by 0. Rows empty in every
    part give 0. Both merge paths: the CPU kernel and the array expressions cupy runs."""
    from tiga_numba import merge as tm
    rng = np.random.default_rng(5)
    n, h, d = 9, 2, 3
    q, k, v = _qkv(n, n, h, h, d, rng)
    rows = np.ones(n, bool)
    rows[[2, 6]] = False   # rows with no edges at all
    mask = np.tril(np.ones((n, n), bool)) & rows[:, None]
    g = tg.Graph.from_scipy(sp.csr_matrix(mask * 1.0))
    out, st = tg.attention(q, k, v, g, return_stats=True)
    empty = (np.full_like(out, junk), tg.AttentionStats(np.full(st.m.shape, -np.inf), np.zeros(st.l.shape)))
    # an empty part's m is not read either (a finite or non-finite m far above the real rows')
    far = (np.full_like(out, junk), tg.AttentionStats(np.full(st.m.shape, 900.0 if junk != junk else junk),
                                                      np.zeros(st.l.shape)))
    for parts in ([(out, st), empty], [empty, (out, st)], [empty, (out, st), empty], [far, (out, st)],
                  [(out, st), far]):
        mo, ms = tg.attention_merge(parts)
        assert np.array_equal(mo, out) and np.array_equal(ms.l, st.l)
        ao, am, al = tm._merge_arrays(np, [(o, s.m, s.l) for o, s in parts])
        np.testing.assert_allclose(ao, out, rtol=1e-14, atol=1e-15)
        np.testing.assert_allclose(al, st.l, rtol=1e-14)
        assert np.array_equal(am, np.asarray(ms.m))
        assert (ao[~rows] == 0).all() and np.isfinite(ao).all()
    both, _ = tg.attention_merge([empty, empty])
    assert (both == 0).all()


def test_merge_rejects_bad_parts():
    o = np.zeros((3, 2, 4))
    st = tg.AttentionStats(np.zeros((3, 2)), np.ones((3, 2)))
    with pytest.raises(ValueError, match="parts"):
        tg.attention_merge([])
    with pytest.raises(TypeError, match=r"parts\[1\]"):
        tg.attention_merge([(o, st), o])
    with pytest.raises(ValueError, match=r"parts\[1\] out"):
        tg.attention_merge([(o, st), (np.zeros((4, 2, 4)), st)])
    pruned = tg.AttentionStats(st.m, st.l, block_prune_threshold=0.5)
    with pytest.raises(NotImplementedError, match="pruned"):
        tg.attention_merge([(o, st), (o, pruned)])
    with pytest.raises(TypeError, match=r"parts\[1\] out is float16"):
        tg.attention_merge([(o, st), (o.astype(np.float16), st)])
    # dtypes attention never returns: refused, not cast (an int out would be truncated, a complex
    # one would lose its imaginary part)
    for bad in (np.int32, np.complex64, np.bool_):
        with pytest.raises(TypeError, match=r"parts\[0\] out has dtype .*expected float16, float32(,| or) float64"):
            tg.attention_merge([(o.astype(bad), st), (o.astype(bad), st)])
    ist = tg.AttentionStats(np.zeros((3, 2), np.int64), np.ones((3, 2), np.int64))
    with pytest.raises(TypeError, match=r"parts\[1\] stats.m has dtype int64"):
        tg.attention_merge([(o, st), (o, ist)])


def test_merge_argument_errors_name_parts():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 1, 3))
    pair = tg.attention(q, q, q, tg.Graph.dense(2), return_stats=True)
    for bad in (None, 3):
        with pytest.raises(TypeError, match="parts must be a sequence of \\(out, stats\\) pairs"):
            tg.attention_merge(bad)
    with pytest.raises(TypeError, match="got one pair"):
        tg.attention_merge(pair)
    with pytest.raises(ValueError, match=r"edge_index\[0\] \(sources\) holds index 6, out of range \[0, num_nodes=4\)"):
        tg.Graph.from_edge_index(np.array([[6, 0], [1, 2]]), num_nodes=4)


@pytest.mark.parametrize("two_d", [False, True], ids=["heads", "one-head-2d"])
def test_merge_in_half_precision_and_any_thread_count(two_d):
    """float16 parts (float32 stats) merge in float32 and round once: within float16 rounding of
    the float64 union; 2-D one-head parts keep their shape; the same bits on 1 and 2 threads."""
    import numba
    rng = np.random.default_rng(4)
    nd, ns, d = 41, 33, 8
    full = _random_csr(nd, ns, 0.4, rng, empty_rows=(0, 9))
    graphs = _split_edges(full, rng, 2)
    q, k, v = _qkv(nd, ns, 2, 1, d, rng)
    if two_d:
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
    ref = tg.attention(q, k, v, tg.Graph.from_scipy(full))
    parts = [tg.attention(*(x.astype(np.float16) for x in (q, k, v)), g, return_stats=True)
             for g in graphs]
    with_threads = []
    for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
        numba.set_num_threads(threads)
        try:
            with_threads.append(tg.attention_merge(parts))
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    (mo, ms), (again, _) = with_threads
    assert mo.dtype == np.float16 and mo.shape == ref.shape and ms.m.shape == ref.shape[:-1]
    assert ms.m.dtype == np.float32 and ms.l.dtype == np.float32
    assert np.array_equal(mo, again)
    np.testing.assert_allclose(mo.astype(np.float64), ref, atol=4e-3, rtol=4e-3)
    assert np.all(mo[0] == 0) and np.all(ms.m[0] == -np.inf) and np.all(ms.l[0] == 0)


@pytest.mark.parametrize("shape", [(0, 4, 8), (5, 3, 0), (6, 8)], ids=["no-rows", "no-columns", "one-head-2d"])
def test_merge_of_empty_shapes_and_strided_views(shape):
    """Parts with no rows or no value columns merge to their shape; strided (non-contiguous)
    views merge like their copies."""
    rng = np.random.default_rng(6)
    out = rng.standard_normal(shape)
    m, l = rng.standard_normal(shape[:-1]), rng.uniform(0.5, 2, shape[:-1])
    mo, ms = tg.attention_merge([(out, tg.AttentionStats(m, l)), (out, tg.AttentionStats(m, l))])
    assert mo.shape == shape and ms.m.shape == shape[:-1]
    np.testing.assert_allclose(mo, out, rtol=1e-15, atol=1e-15)
    np.testing.assert_allclose(ms.l, 2 * l, rtol=1e-15)
    wide = rng.standard_normal((2 * max(shape[0], 1),) + shape[1:])[::2][:shape[0]]
    wm = rng.standard_normal((2 * max(shape[0], 1),) + shape[1:-1])[::2][:shape[0]]
    parts = [(wide, tg.AttentionStats(wm, l)), (out, tg.AttentionStats(m, l))]
    got, _ = tg.attention_merge(parts)
    want, _ = tg.attention_merge([(np.ascontiguousarray(o), s) for o, s in parts])
    assert np.array_equal(got, want)


def test_merge_refuses_inconsistent_statistics():
    """A part whose stats.l does not match its stats.m in shape, and parts whose statistics differ
    in dtype (the merged stats would take one part's dtype silently), are refused by name."""
    o = np.zeros((3, 2, 4), np.float32)
    st = tg.AttentionStats(np.zeros((3, 2), np.float32), np.ones((3, 2), np.float32))
    bad = tg.AttentionStats(st.m, st.l[:, 0])
    for parts in ([(o, bad)], [(o, bad), (o, bad)]):
        with pytest.raises(ValueError, match=r"parts\[0\] stats.l has shape \(3,\), which does not match its stats.m"):
            tg.attention_merge(parts)
    with pytest.raises(ValueError, match=r"parts\[1\] stats.l has shape \(3,\), parts\[0\]'s has \(3, 2\)"):
        tg.attention_merge([(o, st), (o, bad)])
    wide = tg.AttentionStats(st.m.astype(np.float64), st.l.astype(np.float64))
    for parts, bad in (([(o, st), (o, wide)], r"parts\[1\] stats.m is float64, parts\[0\]'s stats.m is float32"),
                       ([(o, wide), (o, st)], r"parts\[1\] stats.m is float32, parts\[0\]'s stats.m is float64"),
                       ([(o, tg.AttentionStats(st.m, wide.l))], r"parts\[0\] stats.l is float64")):
        with pytest.raises(TypeError, match=bad):
            tg.attention_merge(parts)


def test_merge_of_bfloat16_results():
    """attention returns bfloat16 on the CPU (ml_dtypes): its parts merge in float32 and round once,
    within bfloat16 rounding of the float64 union."""
    bf16 = pytest.importorskip("ml_dtypes").bfloat16
    rng = np.random.default_rng(8)
    full = _random_csr(30, 26, 0.4, rng, empty_rows=(2,))
    q, k, v = _qkv(30, 26, 2, 1, 8, rng)
    ref = tg.attention(q, k, v, tg.Graph.from_scipy(full))
    parts = [tg.attention(*(x.astype(bf16) for x in (q, k, v)), g, return_stats=True)
             for g in _split_edges(full, rng, 2)]
    mo, ms = tg.attention_merge(parts)
    assert mo.dtype == np.dtype(bf16) and ms.m.dtype == np.float32
    np.testing.assert_allclose(mo.astype(np.float64), ref, atol=3e-2, rtol=3e-2)
    assert np.all(mo.astype(np.float32)[2] == 0) and np.all(ms.l[2] == 0)
