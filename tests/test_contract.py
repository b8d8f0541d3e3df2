"""Acceptance tests of the public contract (docs/design.md), written as an outside QA engineer would.

Only documented names are used. Every number is compared with a float64 numpy oracle written
here (tiga_numba.reference is deliberately not used). CPU only: numpy arrays. Shapes are small
and reused so that the numba compile caches hit; the whole file should run in well under 60 s.
"""
import math
import re

import numpy as np
import pytest
import scipy.sparse as sp

import tiga_numba as tg

DTYPES = [np.float16, np.float32, np.float64]
# forward / backward tolerances relative to max(1, max|reference|)
FWD_TOL = {np.float16: 4e-3, np.float32: 2e-5, np.float64: 1e-11}
BWD_TOL = {np.float16: 2e-2, np.float32: 1e-4, np.float64: 1e-10}


# ----------------------------------------------------------------------------- oracle
def rng(seed=0):
    return np.random.default_rng(seed)


def qkv(nd, ns, h=4, hkv=2, d=8, dv=8, dtype=np.float32, seed=0, strided=False):
    """Random q (nd,h,d), k (ns,hkv,d), v (ns,hkv,dv); strided=True returns (H,N,D) permuted views."""
    r = rng(seed)
    if strided:
        q = r.standard_normal((h, nd, d)).astype(dtype).transpose(1, 0, 2)
        k = r.standard_normal((hkv, ns, d)).astype(dtype).transpose(1, 0, 2)
        v = r.standard_normal((hkv, ns, dv)).astype(dtype).transpose(1, 0, 2)
        assert min(h, nd) <= 1 or not q.flags.c_contiguous
    else:
        q = r.standard_normal((nd, h, d)).astype(dtype)
        k = r.standard_normal((ns, hkv, d)).astype(dtype)
        v = r.standard_normal((ns, hkv, dv)).astype(dtype)
    return q, k, v


def mask_dense(ns, nd=None):
    return np.ones((ns if nd is None else nd, ns), dtype=bool)


def mask_tri(n):
    return np.tril(np.ones((n, n), dtype=bool))


def mask_segments(cu, causal=True):
    n = int(cu[-1])
    m = np.zeros((n, n), dtype=bool)
    for a, b in zip(cu[:-1], cu[1:]):
        blk = np.ones((b - a, b - a), dtype=bool)
        m[a:b, a:b] = np.tril(blk) if causal else blk
    return m


def mask_block_diag(masks):
    nd = sum(x.shape[0] for x in masks)
    ns = sum(x.shape[1] for x in masks)
    out = np.zeros((nd, ns), dtype=bool)
    i = j = 0
    for x in masks:
        out[i:i + x.shape[0], j:j + x.shape[1]] = x
        i += x.shape[0]
        j += x.shape[1]
    return out


def mask_csr(indptr, indices, ns):
    nd = len(indptr) - 1
    m = np.zeros((nd, ns), dtype=bool)
    for i in range(nd):
        m[i, indices[indptr[i]:indptr[i + 1]]] = True
    return m


def oracle_forward(q, k, v, mask, scale=None):
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    nd, h, d = q.shape
    g = h // k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # head hh reads kv head hh // g
    s = np.einsum("ihd,jhd->hij", q, kk) * scale
    s = np.where(mask[None], s, -np.inf)
    m = s.max(axis=-1) if s.shape[-1] else np.full(s.shape[:2], -np.inf)
    msafe = np.where(np.isfinite(m), m, 0.0)
    p = np.where(mask[None], np.exp(s - msafe[..., None]), 0.0)
    l = p.sum(axis=-1)
    P = p / np.where(l > 0, l, 1.0)[..., None]
    out = np.einsum("hij,jhd->ihd", P, vv)
    return out, m.T, l.T, P


def oracle_backward(dout, q, k, v, mask, scale=None):
    q, k, v, dout = (np.asarray(x, dtype=np.float64) for x in (q, k, v, dout))
    nd, h, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    scale = d ** -0.5 if scale is None else scale
    out, _, _, P = oracle_forward(q, k, v, mask, scale)
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    dvv = np.einsum("hij,ihd->jhd", P, dout)
    dp = np.einsum("ihd,jhd->hij", dout, vv)
    delta = np.einsum("ihd,ihd->hi", dout, out)
    ds = P * (dp - delta[..., None])
    dq = scale * np.einsum("hij,jhd->ihd", ds, kk)
    dkk = scale * np.einsum("hij,ihd->jhd", ds, q)
    ns = k.shape[0]
    dk = dkk.reshape(ns, hkv, g, d).sum(axis=2)
    dv = dvv.reshape(ns, hkv, g, v.shape[2]).sum(axis=2)
    return dq, dk, dv


def assert_close(got, ref, tol, what=""):
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert np.all(np.isfinite(got)), f"{what}: non-finite values"
    err = np.max(np.abs(got - ref)) if ref.size else 0.0
    bound = tol * max(1.0, float(np.max(np.abs(ref))) if ref.size else 1.0)
    assert err <= bound, f"{what}: max abs err {err:.3e} > {bound:.3e}"


def stats_dtype(dtype):
    return np.float64 if dtype == np.float64 else np.float32


def check_forward(q, k, v, graph, mask, scale=None, **kw):
    out, stats = tg.attention(q, k, v, graph, scale=scale, return_stats=True, **kw)
    ref, m, l, _ = oracle_forward(q, k, v, mask, scale)
    assert type(out) is np.ndarray and out.dtype == q.dtype
    assert out.shape == (q.shape[0], q.shape[1], v.shape[2])
    assert_close(out, ref, FWD_TOL[q.dtype.type], "out")
    sd = stats_dtype(q.dtype.type)
    assert stats.m.shape == (q.shape[0], q.shape[1]) and stats.m.dtype == sd
    assert stats.l.shape == (q.shape[0], q.shape[1]) and stats.l.dtype == sd
    empty = ~mask.any(axis=1)
    assert np.all(np.isneginf(stats.m[empty])), "m of an empty row must be -inf"
    assert np.all(stats.l[empty] == 0), "l of an empty row must be 0"
    assert np.all(out[empty] == 0), "out of an empty row must be 0"
    assert not np.isnan(stats.m).any() and not np.isnan(stats.l).any()
    full = ~empty
    stol = 1e-10 if q.dtype == np.float64 else 1e-4
    # m and l together define p = exp(s - m) / l; check both against the oracle on non-empty rows
    assert_close(stats.m[full], m[full], stol, "m")
    np.testing.assert_allclose(stats.l[full], l[full], rtol=stol * 10)
    return out, stats


def check_backward(q, k, v, graph, mask, scale=None, seed=1):
    out, stats = tg.attention(q, k, v, graph, scale=scale, return_stats=True)
    dout = rng(seed).standard_normal(out.shape).astype(q.dtype)
    grads = tg.attention_backward(dout, q, k, v, out, stats, graph, scale=scale)
    assert len(grads) == 3
    refs = oracle_backward(dout, q, k, v, mask, scale)
    for name, got, ref, x in zip("dq dk dv".split(), grads, refs, (q, k, v)):
        assert type(got) is np.ndarray and got.dtype == x.dtype and got.shape == x.shape, name
        assert_close(got, ref, BWD_TOL[q.dtype.type], name)
    return dout, out, stats, grads


# ----------------------------------------------------------------------------- Graph
def pairs_of(matrix):
    coo = sp.coo_matrix(matrix)
    return sorted(zip(coo.row.tolist(), coo.col.tolist()))


def pairs_of_mask(mask):
    r, c = np.nonzero(mask)
    return sorted(zip(r.tolist(), c.tolist()))


def check_graph(g, mask):
    assert g.num_dst == mask.shape[0] and g.num_src == mask.shape[1]
    assert type(g.num_edges) is int and g.num_edges == int(mask.sum())
    assert type(g.num_src) is int and type(g.num_dst) is int
    assert isinstance(g.kind, str) and g.kind
    text = g.explain()
    assert isinstance(text, str) and text.strip() and "\n" not in text.strip()
    s = g.to_scipy()
    assert sp.issparse(s) and s.shape == mask.shape
    assert pairs_of(s) == pairs_of_mask(mask)


def test_dense_square_and_rectangular():
    check_graph(tg.Graph.dense(5), mask_dense(5))
    check_graph(tg.Graph.dense(3, 7), mask_dense(3, 7))
    check_graph(tg.Graph.dense(num_src=7, num_dst=3), mask_dense(7, 3))


def test_triangular():
    check_graph(tg.Graph.triangular(6), mask_tri(6))
    check_graph(tg.Graph.triangular(1), mask_tri(1))


@pytest.mark.parametrize("causal", [True, False])
def test_cu_seqlens_with_zero_length_segments(causal):
    cu = np.array([0, 3, 3, 4, 8, 8], dtype=np.int32)
    g = tg.Graph.cu_seqlens(cu, causal=causal)
    check_graph(g, mask_segments(cu, causal))
    assert g.num_edges == (6 + 0 + 1 + 10 if causal else 9 + 0 + 1 + 16)


def test_cu_seqlens_default_is_causal_and_accepts_int64():
    cu = np.array([0, 2, 5], dtype=np.int64)
    check_graph(tg.Graph.cu_seqlens(cu), mask_segments(cu, True))


def test_num_edges_exact_python_int_for_huge_implicit_relations():
    g = tg.Graph.dense(100_000, 300_000)
    assert type(g.num_edges) is int and g.num_edges == 30_000_000_000
    n = 3_000_000
    t = tg.Graph.triangular(n)
    assert type(t.num_edges) is int and t.num_edges == n * (n + 1) // 2
    cu = np.array([0, 2_000_000, 2_000_001, 5_000_000], dtype=np.int64)
    c = tg.Graph.cu_seqlens(cu)
    assert type(c.num_edges) is int
    assert c.num_edges == sum(L * (L + 1) // 2 for L in (2_000_000, 1, 2_999_999))


def test_cat_implicit_and_csr():
    blocks = [tg.Graph.triangular(3), tg.Graph.dense(2), tg.Graph.triangular(1), tg.Graph.dense(2, 3)]
    g = tg.Graph.cat(blocks)
    mask = mask_block_diag([mask_tri(3), mask_dense(2), mask_tri(1), mask_dense(2, 3)])
    check_graph(g, mask)
    indptr = np.array([0, 1, 1, 3], dtype=np.int64)
    indices = np.array([1, 0, 1], dtype=np.int32)
    csr = tg.Graph.from_csr(indptr, indices, num_src=2)
    gc = tg.Graph.cat([tg.Graph.triangular(2), csr])
    check_graph(gc, mask_block_diag([mask_tri(2), mask_csr(indptr, indices, 2)]))
    # a composition holding a general block is realised as CSR, one of dense/triangular blocks is not
    assert gc.kind == csr.kind
    assert g.kind != csr.kind


def test_from_csr_and_validation():
    indptr = np.array([0, 2, 2, 5, 6], dtype=np.int64)
    indices = np.array([0, 3, 1, 2, 4, 0], dtype=np.int32)
    g = tg.Graph.from_csr(indptr, indices, num_src=6)
    check_graph(g, mask_csr(indptr, indices, 6))
    g2 = tg.Graph.from_csr(indptr, indices)
    assert g2.num_src >= 5 and g2.num_dst == 4 and g2.num_edges == 6
    g3 = tg.Graph.from_csr(indptr, indices, num_src=5, validate="full")
    check_graph(g3, mask_csr(indptr, indices, 5))
    # structural errors are found by the basic validation already
    for bad_indptr in ([0, 2, 1, 5, 6], [1, 2, 2, 5, 6], [0, 2, 2, 5, 7]):
        with pytest.raises(ValueError):
            tg.Graph.from_csr(np.array(bad_indptr, dtype=np.int64), indices, num_src=6)
    with pytest.raises(ValueError):
        tg.Graph.from_csr(np.array([[0, 2, 2, 5, 6]]), indices, num_src=6)
    # every index is checked by the full validation
    with pytest.raises(ValueError, match="indices"):
        tg.Graph.from_csr(indptr, np.array([0, 3, 1, 2, 6, 0], dtype=np.int32), num_src=6,
                          validate="full")
    with pytest.raises(ValueError, match="indices"):
        tg.Graph.from_csr(indptr, np.array([0, 3, -1, 2, 4, 0], dtype=np.int32), num_src=6,
                          validate="full")


SCIPY_KINDS = ["csr_matrix", "coo_matrix", "csc_matrix", "csr_array", "coo_array", "csc_array"]


def random_pattern(nd, ns, density=0.35, seed=3, empty_rows=(1, 4)):
    m = rng(seed).random((nd, ns)) < density
    for r in empty_rows:
        m[r] = False
    m[0, 0] = True
    return m


@pytest.mark.parametrize("kind", SCIPY_KINDS)
def test_from_scipy_matrices_and_arrays(kind):
    mask = random_pattern(9, 7)
    mat = getattr(sp, kind)(mask.astype(np.float64) * 2.5)
    g = tg.Graph.from_scipy(mat)
    check_graph(g, mask)


def test_from_coo_rows_are_destinations():
    src = np.array([2, 0, 1, 3, 0], dtype=np.int64)
    dst = np.array([1, 2, 1, 0, 1], dtype=np.int64)
    g = tg.Graph.from_coo(src, dst, num_src=5, num_dst=4)
    mask = np.zeros((4, 5), dtype=bool)
    mask[dst, src] = True
    check_graph(g, mask)
    # rows of the realised relation are destinations, so the CSR row pointer counts in-degrees
    csr = sp.csr_matrix(g.to_scipy())
    assert np.array_equal(np.diff(csr.indptr), [1, 3, 1, 0])
    g2 = tg.Graph.from_coo(src, dst)
    assert g2.num_src >= 4 and g2.num_dst >= 3 and g2.num_edges == 5


def radius_mask(pos, cutoff, exclude_self=True):
    dist = np.linalg.norm(pos[None, :, :] - pos[:, None, :], axis=-1)  # [dst, src]
    m = dist <= cutoff
    if exclude_self:
        np.fill_diagonal(m, False)
    return m


def test_radius_edges():
    pos = rng(5).random((30, 3))
    cutoff = 0.35
    d = np.linalg.norm(pos[None] - pos[:, None], axis=-1)
    assert np.min(np.abs(d - cutoff)) > 1e-6  # no pair on the boundary
    check_graph(tg.Graph.radius(pos, cutoff), radius_mask(pos, cutoff))
    check_graph(tg.Graph.radius(pos, cutoff, exclude_self=False), radius_mask(pos, cutoff, False))


def test_device_keyword_accepted():
    for dev in ("cpu", "cuda"):
        assert tg.Graph.dense(4, device=dev).num_edges == 16
        assert tg.Graph.triangular(4, device=dev).num_edges == 10
        assert tg.Graph.cu_seqlens(np.array([0, 2, 4]), device=dev).num_edges == 6
    indptr = np.array([0, 1, 3], dtype=np.int64)
    indices = np.array([0, 0, 1], dtype=np.int32)
    assert tg.Graph.from_csr(indptr, indices, num_src=2, device="cpu").num_edges == 3
    assert tg.Graph.from_scipy(sp.csr_matrix(np.eye(3)), device="cpu").num_edges == 3
    assert tg.Graph.from_coo(np.array([0, 1]), np.array([1, 0]), device="cpu").num_edges == 2
    assert tg.Graph.radius(rng(1).random((6, 3)), 0.5, device="cpu").num_src == 6
    assert tg.Graph.cat([tg.Graph.dense(2), tg.Graph.dense(1)], device="cpu").num_edges == 5
    # implicit relations need no storage: a graph built for "cuda" still runs numpy arrays
    q, k, v = qkv(5, 5, dtype=np.float32)
    check_forward(q, k, v, tg.Graph.triangular(5, device="cuda"), mask_tri(5))


def test_graph_is_immutable():
    g = tg.Graph.dense(3)
    with pytest.raises((AttributeError, TypeError)):
        g.num_src = 5
    assert g.num_src == 3


def test_bad_cu_seqlens():
    with pytest.raises(ValueError, match="cu_seqlens"):
        tg.Graph.cu_seqlens(np.array([1, 3, 5]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        tg.Graph.cu_seqlens(np.array([0, 3, 2]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        tg.Graph.cu_seqlens(np.array([[0, 3, 5]]))


# ----------------------------------------------------------------------------- attention
@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_gqa_all_dtypes(dtype):
    q, k, v = qkv(13, 13, dtype=dtype)
    check_forward(q, k, v, tg.Graph.dense(13), mask_dense(13))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_permuted_views_like_the_seed(dtype):
    q, k, v = qkv(13, 13, dtype=dtype, strided=True)
    check_forward(q, k, v, tg.Graph.dense(13), mask_dense(13))
    check_forward(q, k, v, tg.Graph.triangular(13), mask_tri(13), scale=0.3)


def test_other_strides():
    r = rng(9)
    q = r.standard_normal((13, 4, 16)).astype(np.float32)[:, :, ::2]   # last axis strided
    k = r.standard_normal((26, 2, 8)).astype(np.float32)[::2]           # node axis strided
    v = np.asfortranarray(r.standard_normal((13, 2, 8)).astype(np.float32))
    check_forward(q, k, v, tg.Graph.dense(13), mask_dense(13))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rectangular_dense_and_value_width(dtype):
    q, k, v = qkv(11, 7, dv=5, dtype=dtype)
    check_forward(q, k, v, tg.Graph.dense(7, 11), mask_dense(7, 11))
    q, k, v = qkv(5, 70, dtype=dtype)  # more keys than queries: several key tiles
    check_forward(q, k, v, tg.Graph.dense(70, 5), mask_dense(70, 5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_and_varlen(dtype):
    q, k, v = qkv(37, 37, dtype=dtype)
    check_forward(q, k, v, tg.Graph.triangular(37), mask_tri(37))
    cu = np.array([0, 5, 5, 6, 29, 37], dtype=np.int32)
    check_forward(q, k, v, tg.Graph.cu_seqlens(cu), mask_segments(cu, True))
    check_forward(q, k, v, tg.Graph.cu_seqlens(cu, causal=False), mask_segments(cu, False))


def test_cu_seqlens_shorter_than_arrays_is_an_error_and_trailing_empty_rows():
    cu = np.array([0, 4, 9, 9], dtype=np.int32)
    q, k, v = qkv(9, 9)
    check_forward(q, k, v, tg.Graph.cu_seqlens(cu), mask_segments(cu))
    q2, k2, v2 = qkv(10, 10)
    with pytest.raises(ValueError):
        tg.attention(q2, k2, v2, tg.Graph.cu_seqlens(cu))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cat_attention(dtype):
    blocks = [tg.Graph.triangular(9), tg.Graph.dense(1), tg.Graph.dense(4), tg.Graph.triangular(3)]
    mask = mask_block_diag([mask_tri(9), mask_dense(1), mask_dense(4), mask_tri(3)])
    q, k, v = qkv(17, 17, dtype=dtype)
    check_forward(q, k, v, tg.Graph.cat(blocks), mask)


@pytest.mark.parametrize("dtype", DTYPES)
def test_csr_with_empty_rows(dtype):
    mask = random_pattern(13, 11)
    g = tg.Graph.from_scipy(sp.csr_matrix(mask.astype(np.float32)))
    q, k, v = qkv(13, 11, dtype=dtype)
    check_forward(q, k, v, g, mask)


def test_csr_without_any_edge_and_dense_without_sources():
    q, k, v = qkv(6, 4)
    g = tg.Graph.from_csr(np.zeros(7, dtype=np.int64), np.zeros(0, dtype=np.int32), num_src=4)
    out, _ = check_forward(q, k, v, g, np.zeros((6, 4), dtype=bool))
    assert not out.any()
    q, k, v = qkv(3, 0)
    check_forward(q, k, v, tg.Graph.dense(0, 3), np.zeros((3, 0), dtype=bool))


def test_scale_default_and_explicit():
    q, k, v = qkv(13, 13, d=8)
    g = tg.Graph.dense(13)
    out_default = tg.attention(q, k, v, g)
    ref, *_ = oracle_forward(q, k, v, mask_dense(13), 8 ** -0.5)
    assert_close(out_default, ref, FWD_TOL[np.float32], "default scale")
    out_none = tg.attention(q, k, v, g, scale=None)
    assert np.array_equal(out_none, out_default)
    check_forward(q, k, v, g, mask_dense(13), scale=1.7)


def test_return_stats_false_returns_array_only():
    q, k, v = qkv(13, 13)
    out = tg.attention(q, k, v, tg.Graph.dense(13))
    assert type(out) is np.ndarray
    res = tg.attention(q, k, v, tg.Graph.dense(13), return_stats=True)
    assert isinstance(res, tuple) and len(res) == 2
    out2, stats = res
    assert np.array_equal(out, out2)
    assert hasattr(stats, "m") and hasattr(stats, "l")


def test_large_scores_do_not_overflow():
    q, k, v = qkv(13, 13, dtype=np.float16)
    q = (q * 8).astype(np.float16)
    k = (k * 8).astype(np.float16)
    check_forward(q, k, v, tg.Graph.dense(13), mask_dense(13))


# ----------------------------------------------------------------------------- backward
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_dense_gqa(dtype):
    q, k, v = qkv(13, 13, dtype=dtype)
    check_backward(q, k, v, tg.Graph.dense(13), mask_dense(13))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_strided_causal_varlen_rectangular(dtype):
    q, k, v = qkv(37, 37, dtype=dtype, strided=True)
    check_backward(q, k, v, tg.Graph.triangular(37), mask_tri(37), scale=0.4)
    cu = np.array([0, 5, 5, 6, 29, 37], dtype=np.int32)
    check_backward(q, k, v, tg.Graph.cu_seqlens(cu), mask_segments(cu, True))
    q, k, v = qkv(11, 7, dv=5, dtype=dtype)
    check_backward(q, k, v, tg.Graph.dense(7, 11), mask_dense(7, 11))


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_csr_empty_rows_and_sources_without_edges(dtype):
    mask = random_pattern(13, 11)
    mask[:, 5] = False  # a source that feeds nobody: dk = dv = 0 there
    g = tg.Graph.from_scipy(sp.csr_array(mask.astype(np.float64)))
    q, k, v = qkv(13, 11, dtype=dtype)
    _, _, _, (dq, dk, dv) = check_backward(q, k, v, g, mask)
    assert not dq[[1, 4]].any()
    assert not dk[5].any() and not dv[5].any()


def test_backward_is_deterministic():
    mask = random_pattern(40, 40, density=0.5)
    graphs = [(tg.Graph.dense(40), None), (tg.Graph.from_scipy(sp.csr_matrix(mask * 1.0)), None),
              (tg.Graph.triangular(40), None)]
    q, k, v = qkv(40, 40, dtype=np.float32)
    for g, _ in graphs:
        out, stats = tg.attention(q, k, v, g, return_stats=True)
        dout = rng(4).standard_normal(out.shape).astype(np.float32)
        a = tg.attention_backward(dout, q, k, v, out, stats, g)
        b = tg.attention_backward(dout, q, k, v, out, stats, g)
        for x, y in zip(a, b):
            assert x.tobytes() == y.tobytes()


def test_backward_reads_dout_and_out_of_another_float_dtype_at_the_kernels_precision():
    """dout / out in another float dtype than q (float64 or float16 with float32 q) are taken
    as the CPU kernels' float32 (docs/design.md, Arrays): the same bits as the caller's own cast,
    and q's dtype out; an integer dout is refused by name."""
    q, k, v = qkv(30, 30, dtype=np.float32)
    for g in (tg.Graph.triangular(30), tg.Graph.from_coo(np.arange(30), np.arange(30)[::-1], 30, 30)):
        out, stats = tg.attention(q, k, v, g, return_stats=True)
        dout = rng(7).standard_normal(out.shape)
        want = tg.attention_backward(dout.astype(np.float32), q, k, v, out, stats, g)
        for dt in (np.float64, np.float16):
            d = dout.astype(dt)
            ref = tg.attention_backward(d.astype(np.float32), q, k, v, out, stats, g)
            got = tg.attention_backward(d, q, k, v, out, stats, g)
            for x, y in zip(got, ref):
                assert x.dtype == np.float32 and x.tobytes() == y.tobytes()
        got = tg.attention_backward(dout.astype(np.float32), q, k, v, out.astype(np.float64), stats, g)
        for x, y in zip(got, want):   # float32 out held exactly in float64: the same bits
            assert x.dtype == np.float32 and x.tobytes() == y.tobytes()
        assert all(np.abs(a - b).max() <= 2e-3 * np.abs(b).max() + 1e-5 for a, b in zip(ref, want))  # fp16 dout
        with pytest.raises(TypeError, match="dout"):
            tg.attention_backward(dout.astype(np.int32), q, k, v, out, stats, g)
    # float16 q: a float64 dout is read at the accumulation dtype (float32), not at q's float16
    q16, k16, v16 = (a.astype(np.float16) for a in (q, k, v))
    g = tg.Graph.triangular(30)
    out, stats = tg.attention(q16, k16, v16, g, return_stats=True)
    dout = rng(8).standard_normal(out.shape)
    got = tg.attention_backward(dout, q16, k16, v16, out, stats, g)
    want = tg.attention_backward(dout.astype(np.float32), q16, k16, v16, out, stats, g)
    coarse = tg.attention_backward(dout.astype(np.float16), q16, k16, v16, out, stats, g)
    assert all(x.dtype == np.float16 and x.tobytes() == y.tobytes() for x, y in zip(got, want))
    assert any(x.tobytes() != y.tobytes() for x, y in zip(got, coarse))


def test_backward_default_scale_matches_forward_default():
    q, k, v = qkv(13, 13, d=8)
    g = tg.Graph.dense(13)
    out, stats = tg.attention(q, k, v, g, return_stats=True)
    dout = rng(2).standard_normal(out.shape).astype(np.float32)
    got = tg.attention_backward(dout, q, k, v, out, stats, g)
    refs = oracle_backward(dout, q, k, v, mask_dense(13), 8 ** -0.5)
    for x, r in zip(got, refs):
        assert_close(x, r, BWD_TOL[np.float32])


# ----------------------------------------------------------------------------- errors
def test_type_errors():
    q, k, v = qkv(5, 5)
    g = tg.Graph.dense(5)
    with pytest.raises(TypeError, match=r"\bq\b"):
        tg.attention(q.tolist(), k, v, g)
    with pytest.raises(TypeError, match=r"\bk\b"):
        tg.attention(q, k.tolist(), v, g)
    for bad in (np.int32, np.complex128):
        qb, kb, vb = (x.astype(bad) for x in (q, k, v))
        with pytest.raises(TypeError):
            tg.attention(qb, kb, vb, g)
    with pytest.raises(TypeError):
        tg.attention(q, k, v, "not a graph")


class FakeCupyArray:
    """Looks like a device array (cupy exposes __cuda_array_interface__)."""

    def __init__(self, a):
        self.shape, self.dtype, self.ndim = a.shape, a.dtype, a.ndim
        self.strides = a.strides
        self.__cuda_array_interface__ = {"shape": a.shape, "typestr": a.dtype.str,
                                         "data": (0, False), "version": 3, "strides": None}


def test_mixed_numpy_and_device_arrays_is_a_type_error():
    q, k, v = qkv(5, 5)
    with pytest.raises(TypeError, match="mixed|library|cupy"):
        tg.attention(q, FakeCupyArray(k), v, tg.Graph.dense(5))
    with pytest.raises(TypeError, match="mixed|library|cupy"):
        tg.attention(FakeCupyArray(q), FakeCupyArray(k), v, tg.Graph.dense(5))


def test_value_errors_name_the_argument():
    q, k, v = qkv(13, 13)
    g = tg.Graph.dense(13)
    cases = [
        ((q[:12], k, v, g), r"\bq\b|num_dst|graph"),
        ((q, k[:12], v[:12], g), r"\bk\b|num_src|graph"),
        ((q, k, v[:12], g), r"\bv\b"),
        ((q, k[:, :1].repeat(3, axis=1), v[:, :1].repeat(3, axis=1), g), r"head|\bH"),  # 4 % 3
        ((q, k[..., :6], v, g), r"\bk\b|\bD\b|width|dim"),
        ((q, k, v[:, :1], g), r"\bv\b|head"),
        ((q[:, :, None], k, v, g), r"\bq\b"),
    ]
    for args, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            tg.attention(*args)


@pytest.mark.parametrize("rho", [0.0, -0.5, 1.5, float("nan")])
def test_threshold_out_of_range(rho):
    with pytest.raises(ValueError, match="block_prune_threshold|rho|threshold"):
        tg.online_softmax(block_prune_threshold=rho)
    q, k, v = qkv(13, 13)
    with pytest.raises(ValueError, match="block_prune_threshold|rho|threshold"):
        tg.attention(q, k, v, tg.Graph.dense(13), block_prune_threshold=rho)


def test_backward_argument_errors():
    q, k, v = qkv(13, 13)
    g = tg.Graph.dense(13)
    out, stats = tg.attention(q, k, v, g, return_stats=True)
    with pytest.raises(ValueError):
        tg.attention_backward(out[:12], q, k, v, out, stats, g)
    with pytest.raises(ValueError):
        tg.attention_backward(out, q, k, v, out, stats, tg.Graph.dense(12))


# ----------------------------------------------------------------------------- programs
class DotAxis(tg.MessagePassing):
    reducer = tg.online_softmax()

    def edge(self, src, dst, edge, scale):
        score = (src.key * dst.query).sum(axis=-1) * scale
        return self.reducer(score, src.value)


class DotDim(tg.MessagePassing):
    def __init__(self):
        super().__init__()
        self.reducer = tg.online_softmax()

    def edge(self, src, dst, edge, scale):
        score = (src.key * dst.query).sum(dim=-1) * scale
        return self.reducer(score, src.value)


class Pruned(tg.MessagePassing):
    def __init__(self, rho):
        super().__init__()
        self.reducer = tg.online_softmax(block_prune_threshold=rho)

    def edge(self, src, dst, edge, scale):
        score = (src.key * dst.query).sum(dim=-1) * scale
        return self.reducer(score, src.value)


@pytest.mark.parametrize("cls", [DotAxis, DotDim])
@pytest.mark.parametrize("dtype", DTYPES)
def test_program_matches_oracle(cls, dtype):
    q, k, v = qkv(13, 13, dtype=dtype, strided=True)
    prog = cls()
    for g, mask in ((tg.Graph.dense(13), mask_dense(13)), (tg.Graph.triangular(13), mask_tri(13))):
        out = prog(graph=g, src={"key": k, "value": v}, dst={"query": q}, scale=8 ** -0.5)
        ref, *_ = oracle_forward(q, k, v, mask, 8 ** -0.5)
        assert type(out) is np.ndarray and out.dtype == dtype
        assert_close(out, ref, FWD_TOL[dtype], "program out")


def test_program_csr_and_explain_and_ir():
    mask = random_pattern(13, 11)
    g = tg.Graph.from_scipy(sp.coo_array(mask.astype(np.float32)))
    q, k, v = qkv(13, 11)
    prog = DotAxis()
    out = prog(graph=g, src={"key": k, "value": v}, dst={"query": q}, scale=0.5)
    assert_close(out, oracle_forward(q, k, v, mask, 0.5)[0], FWD_TOL[np.float32])
    text = prog.explain()
    assert isinstance(text, str) and text.strip()
    assert "cpu" in text.lower() and "float32" in text
    for stage in ("llvm", "asm"):
        ir = prog.ir(stage)
        assert isinstance(ir, str) and len(ir) > 100
    for stage in ("ptx", "ttir", "bogus"):
        with pytest.raises(KeyError):
            prog.ir(stage)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_program_vjp(dtype):
    q, k, v = qkv(13, 13, dtype=dtype)
    cu = np.array([0, 5, 5, 6, 13], dtype=np.int32)
    g = tg.Graph.cu_seqlens(cu)
    mask = mask_segments(cu)
    prog = DotDim()
    res = prog.vjp(graph=g, src={"key": k, "value": v}, dst={"query": q}, scale=0.6)
    assert isinstance(res, tuple) and len(res) == 2
    out, vjp = res
    assert_close(out, oracle_forward(q, k, v, mask, 0.6)[0], FWD_TOL[dtype], "vjp out")
    dout = rng(8).standard_normal(out.shape).astype(dtype)
    grads = vjp(dout)
    assert set(grads) >= {"src", "dst", "edge", "params", "positions"}
    dq, dk, dv = oracle_backward(dout, q, k, v, mask, 0.6)
    assert_close(grads["dst"]["query"], dq, BWD_TOL[dtype], "dst.query")
    assert_close(grads["src"]["key"], dk, BWD_TOL[dtype], "src.key")
    assert_close(grads["src"]["value"], dv, BWD_TOL[dtype], "src.value")
    for name, ref in (("query", q), ("key", k), ("value", v)):
        part = grads["dst"] if name == "query" else grads["src"]
        assert part[name].dtype == ref.dtype and part[name].shape == ref.shape
    # "gradients for every float field and param that reaches the score": the scale is one
    assert set(grads["params"]) == {"scale"} and np.ndim(grads["params"]["scale"]) == 0

    def loss(scale):
        return float((oracle_forward(q, k, v, mask, scale)[0] * dout).sum())
    want = (loss(0.6 + 1e-5) - loss(0.6 - 1e-5)) / 2e-5
    assert abs(float(grads["params"]["scale"]) - want) <= max(BWD_TOL[dtype], 1e-7) * max(1.0, abs(want))


def test_edge_traced_once_per_signature_never_on_data():
    seen = []

    class Counting(tg.MessagePassing):
        reducer = tg.online_softmax()

        def edge(self, src, dst, edge, scale):
            seen.append(type(src.key))
            score = (src.key * dst.query).sum(axis=-1) * scale
            return self.reducer(score, src.value)

    q, k, v = qkv(13, 13)
    prog = Counting()
    for _ in range(3):
        prog(graph=tg.Graph.dense(13), src={"key": k, "value": v}, dst={"query": q}, scale=0.3)
    assert len(seen) == 1
    assert seen[0] is not np.ndarray


def _unsupported_max(self, src, dst, edge, scale):
    return self.reducer((src.key * dst.query).max(axis=-1) * scale, src.value)


def _unsupported_no_reducer(self, src, dst, edge, scale):
    return src.value


def _unsupported_branch(self, src, dst, edge, scale):
    score = (src.key * dst.query).sum(axis=-1) * scale
    if score > 0:
        score = score * 2
    return self.reducer(score, src.value)


@pytest.mark.parametrize("body", [_unsupported_max, _unsupported_no_reducer, _unsupported_branch])
def test_unsupported_edge_forms_raise_not_implemented(body):
    Bad = type("Bad", (tg.MessagePassing,), {"reducer": tg.online_softmax(), "edge": body})
    q, k, v = qkv(13, 13)
    with pytest.raises(NotImplementedError):
        Bad()(graph=tg.Graph.dense(13), src={"key": k, "value": v}, dst={"query": q}, scale=0.3)


# ----------------------------------------------------------------------------- pruning
def test_pruning_tiny_rho_is_exact_and_rho_one_is_valid():
    q, k, v = qkv(13, 13)
    ref, *_ = oracle_forward(q, k, v, mask_dense(13))
    out = tg.attention(q, k, v, tg.Graph.dense(13), block_prune_threshold=1e-30)
    assert_close(out, ref, FWD_TOL[np.float32])
    out1 = tg.attention(q, k, v, tg.Graph.dense(13), block_prune_threshold=1.0)
    assert np.all(np.isfinite(out1)) and out1.shape == ref.shape
    prog = Pruned(1e-30)
    out2 = prog(graph=tg.Graph.dense(13), src={"key": k, "value": v}, dst={"query": q},
                scale=8 ** -0.5)
    assert_close(out2, ref, FWD_TOL[np.float32])


def pruning_workload(ns=1024, nd=8):
    """Key 0 scores 0 for every query, every other key scores ln(0.3); values are e_0 at key 0.

    Any key tile after the one holding key 0 has max score ln(0.3) < 0 + ln(0.5): with rho = 0.5
    it must be skipped, whatever the tile sizes, so out[..., 0] rises above the exact value.
    """
    d = 4
    q = np.zeros((nd, 1, d), np.float32)
    q[:, 0, 0] = 1.0
    k = np.zeros((ns, 1, d), np.float32)
    k[1:, 0, 0] = math.log(0.3)
    v = np.zeros((ns, 1, d), np.float32)
    v[0, 0, 0] = 1.0
    v[1:, 0, 1] = rng(0).random(ns - 1).astype(np.float32)
    return q, k, v


def test_pruning_really_prunes_and_explain_reports_it():
    q, k, v = pruning_workload()
    g = tg.Graph.dense(k.shape[0], q.shape[0])
    exact = oracle_forward(q, k, v, mask_dense(k.shape[0], q.shape[0]), 1.0)[0]
    prog = Pruned(1e-30)
    out_exact = prog(graph=g, src={"key": k, "value": v}, dst={"query": q}, scale=1.0)
    assert_close(out_exact, exact, FWD_TOL[np.float32])
    text_none = prog.explain()
    prog = Pruned(0.5)
    out = prog(graph=g, src={"key": k, "value": v}, dst={"query": q}, scale=1.0)
    assert np.all(np.isfinite(out))
    # the approximation is real: tiles without key 0 were skipped, raising key 0's weight
    assert np.all(out[:, 0, 0] > exact[:, 0, 0] * 1.5)
    text = prog.explain()
    assert re.search(r"prun", text, re.I)
    assert text != text_none
    # functional path: same rule
    out_f = tg.attention(q, k, v, g, scale=1.0, block_prune_threshold=0.5)
    np.testing.assert_allclose(out_f, out, rtol=1e-5, atol=1e-6)


def test_pruning_refused_where_not_implemented():
    q, k, v = qkv(13, 13)
    mask = random_pattern(13, 13)
    csr = tg.Graph.from_scipy(sp.csr_matrix(mask * 1.0))
    with pytest.raises(NotImplementedError):
        tg.attention(q, k, v, csr, block_prune_threshold=0.5)
    cat_csr = tg.Graph.cat([tg.Graph.triangular(6), tg.Graph.from_scipy(sp.csr_matrix(np.eye(7)))])
    with pytest.raises(NotImplementedError):
        tg.attention(q, k, v, cat_csr, block_prune_threshold=0.5)
    prog = Pruned(0.5)
    with pytest.raises(NotImplementedError):
        prog(graph=csr, src={"key": k, "value": v}, dst={"query": q}, scale=0.3)
    with pytest.raises(NotImplementedError):
        prog.vjp(graph=tg.Graph.dense(13), src={"key": k, "value": v}, dst={"query": q},
                 scale=0.3)


# ----------------------------------------------------------------------------- tg.nn and GAT
def test_nn_modules():
    lin = tg.nn.Linear(5, 3, seed=0)
    assert isinstance(lin.weight, np.ndarray) and lin.weight.shape == (3, 5)
    assert isinstance(lin.bias, np.ndarray) and lin.bias.shape == (3,)
    assert np.any(lin.weight != 0)
    same = tg.nn.Linear(5, 3, seed=0)
    assert np.array_equal(lin.weight, same.weight) and np.array_equal(lin.bias, same.bias)
    other = tg.nn.Linear(5, 3, seed=1)
    assert not np.array_equal(lin.weight, other.weight)
    tg.nn.Linear(5, 3)  # seed defaults to None
    assert tg.nn.LeakyReLU().negative_slope == 0.01
    assert tg.nn.LeakyReLU(0.2).negative_slope == 0.2
    assert tg.nn.LeakyReLU(negative_slope=0.3).negative_slope == 0.3
    relu, tanh = tg.nn.ReLU(), tg.nn.Tanh()
    seq = tg.nn.Sequential(lin, relu, tg.nn.Linear(3, 1, seed=2), tanh)
    assert seq[0] is lin and seq[1] is relu and seq[3] is tanh


ACT = {
    "leaky": lambda z, a: np.where(z > 0, z, a * z),
    "relu": lambda z, a: np.maximum(z, 0),
    "tanh": lambda z, a: np.tanh(z),
}


def gat_oracle(pos, xs, xd, src, dst, layers, num_dst):
    """layers: list of (W, b) or (act_name, slope). Scores e = (src -> dst); softmax per dst."""
    pos, xs, xd = (np.asarray(a, np.float64) for a in (pos, xs, xd))
    h = np.concatenate([pos[src] - pos[dst], xs[src], xd[dst]], axis=1)
    for layer in layers:
        if isinstance(layer[0], str):
            h = ACT[layer[0]](h, layer[1])
        else:
            h = h @ np.asarray(layer[0], np.float64).T + np.asarray(layer[1], np.float64)
    s = h[:, 0]
    out = np.zeros((num_dst, xs.shape[1]))
    for i in range(num_dst):
        e = np.nonzero(dst == i)[0]
        if len(e):
            w = np.exp(s[e] - s[e].max())
            out[i] = (w / w.sum()) @ xs[src[e]]
    return out


def make_gat(act="leaky", f=3, hidden=6, seed=0):
    layers = [tg.nn.Linear(3 + 2 * f, hidden, seed=seed)]
    layers.append({"leaky": lambda: tg.nn.LeakyReLU(0.2), "relu": tg.nn.ReLU,
                   "tanh": tg.nn.Tanh}[act]())
    layers.append(tg.nn.Linear(hidden, 1, seed=seed + 1))
    attn = tg.nn.Sequential(*layers)

    class GAT(tg.MessagePassing):
        reducer = tg.online_softmax()

        def __init__(self, attn):
            super().__init__()
            self.attn = tg.nn.trace(attn)

        def edge(self, src, dst, edge):
            return self.reducer(self.attn(edge.displacement, src.x, dst.x), src.x)

    def oracle_layers():
        slope = 0.2 if act == "leaky" else None
        return [(attn[0].weight, attn[0].bias), (act, slope), (attn[2].weight, attn[2].bias)]

    return GAT(attn), attn, oracle_layers


def gat_inputs(n=24, f=3, seed=11, cutoff=0.4):
    r = rng(seed)
    pos = r.random((n, 3)).astype(np.float32)
    pos[-1] = 5.0  # an isolated node: empty row
    xs = r.standard_normal((n, f)).astype(np.float32)
    xd = r.standard_normal((n, f)).astype(np.float32)
    g = tg.Graph.radius(pos, cutoff)
    coo = sp.coo_matrix(g.to_scipy())
    return pos, xs, xd, g, coo.col.astype(np.int64), coo.row.astype(np.int64)


@pytest.mark.parametrize("act", ["leaky", "relu", "tanh"])
def test_gat_forward(act):
    pos, xs, xd, g, src, dst = gat_inputs()
    prog, attn, layers = make_gat(act)
    out = prog(graph=g, src={"x": xs}, dst={"x": xd})
    ref = gat_oracle(pos, xs, xd, src, dst, layers(), len(pos))
    assert out.shape == xs.shape and out.dtype == np.float32
    assert_close(out, ref, 1e-4, "gat out")
    assert not out[-1].any()


def numeric_grad(f, x, eps=1e-6):
    x = x.astype(np.float64).copy()
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        idx = it.multi_index
        old = x[idx]
        x[idx] = old + eps
        fp = f(x)
        x[idx] = old - eps
        fm = f(x)
        x[idx] = old
        g[idx] = (fp - fm) / (2 * eps)
    return g


def test_gat_vjp_against_finite_differences():
    n, f, hidden = 14, 3, 6  # the shapes of make_gat's default: its compiled kernels are reused
    pos, xs, xd, g, src, dst = gat_inputs(n=n, f=f, seed=12, cutoff=0.5)
    prog, attn, layers = make_gat("leaky", f=f, hidden=hidden, seed=3)
    out, vjp = prog.vjp(graph=g, src={"x": xs}, dst={"x": xd})
    base = layers()
    ref = gat_oracle(pos, xs, xd, src, dst, base, n)
    assert_close(out, ref, 1e-4, "gat vjp out")
    dout = rng(13).standard_normal(out.shape).astype(np.float32)
    grads = vjp(dout)
    assert set(grads) >= {"src", "dst", "edge", "params", "positions"}

    def loss(pos_=pos, xs_=xs, xd_=xd, layers_=base):
        return float(np.sum(gat_oracle(pos_, xs_, xd_, src, dst, layers_, n) * dout))

    checks = [
        (grads["positions"], numeric_grad(lambda p: loss(pos_=p), pos), "positions"),
        (grads["src"]["x"], numeric_grad(lambda x: loss(xs_=x), xs), "src.x"),
        (grads["dst"]["x"], numeric_grad(lambda x: loss(xd_=x), xd), "dst.x"),
    ]
    W0, b0 = base[0]
    W2, b2 = base[2]
    checks += [
        (grads["params"]["attn.0.weight"],
         numeric_grad(lambda w: loss(layers_=[(w, b0), base[1], (W2, b2)]), W0), "attn.0.weight"),
        (grads["params"]["attn.0.bias"],
         numeric_grad(lambda b: loss(layers_=[(W0, b), base[1], (W2, b2)]), b0), "attn.0.bias"),
        (grads["params"]["attn.2.weight"],
         numeric_grad(lambda w: loss(layers_=[(W0, b0), base[1], (w, b2)]), W2), "attn.2.weight"),
    ]
    for got, ref, name in checks:
        assert np.asarray(got).shape == ref.shape, name
        assert_close(got, ref, 2e-4, name)
    # the bias of the last layer shifts every score of a row equally: softmax-invariant
    assert abs(float(np.asarray(grads["params"]["attn.2.bias"]).sum())) < 1e-4


# ----------------------------------------------------------------------------- harder shapes
# odd head width, value width != head width, 3:1 grouped heads, sizes that cross any tile grid
@pytest.mark.parametrize("dtype", DTYPES)
def test_tile_crossing_odd_sizes_forward(dtype):
    q, k, v = qkv(150, 300, h=3, hkv=1, d=3, dv=5, dtype=dtype, seed=21)
    check_forward(q, k, v, tg.Graph.dense(300, 150), mask_dense(300, 150))
    q, k, v = qkv(150, 150, h=3, hkv=1, d=3, dv=5, dtype=dtype, seed=22, strided=True)
    check_forward(q, k, v, tg.Graph.triangular(150), mask_tri(150))
    cu = np.array([0, 1, 70, 70, 150], dtype=np.int32)
    check_forward(q, k, v, tg.Graph.cu_seqlens(cu), mask_segments(cu))
    mask = random_pattern(150, 150, density=0.1)
    check_forward(q, k, v, tg.Graph.from_scipy(sp.csr_matrix(mask * 1.0)), mask)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tile_crossing_odd_sizes_backward(dtype):
    q, k, v = qkv(150, 300, h=3, hkv=1, d=3, dv=5, dtype=dtype, seed=23)
    check_backward(q, k, v, tg.Graph.dense(300, 150), mask_dense(300, 150))
    q, k, v = qkv(150, 150, h=3, hkv=1, d=3, dv=5, dtype=dtype, seed=24, strided=True)
    check_backward(q, k, v, tg.Graph.triangular(150), mask_tri(150))
    cu = np.array([0, 1, 70, 70, 150], dtype=np.int32)
    check_backward(q, k, v, tg.Graph.cu_seqlens(cu, causal=False), mask_segments(cu, False))
    mask = random_pattern(150, 150, density=0.1)
    check_backward(q, k, v, tg.Graph.from_scipy(sp.csr_matrix(mask * 1.0)), mask)


def test_messages_carry_expected_and_received_values():
    q, k, v = qkv(13, 13)
    with pytest.raises(ValueError) as e:
        tg.attention(q[:12], k, v, tg.Graph.dense(13))
    assert "12" in str(e.value) and "13" in str(e.value)
    with pytest.raises(ValueError) as e:
        tg.attention(q, k[:11], v[:11], tg.Graph.dense(13))
    assert "11" in str(e.value) and "13" in str(e.value)
    with pytest.raises(TypeError) as e:
        tg.attention(*(x.astype(np.int32) for x in (q, k, v)), tg.Graph.dense(13))
    assert "int32" in str(e.value)
    with pytest.raises(ValueError) as e:
        tg.online_softmax(block_prune_threshold=2.5)
    assert "2.5" in str(e.value)


def test_graph_argument_errors():
    indptr = np.array([0, 1, 2], dtype=np.int64)
    indices = np.array([0, 1], dtype=np.int32)
    with pytest.raises(ValueError, match="validate"):
        tg.Graph.from_csr(indptr, indices, num_src=2, validate="bogus")
    with pytest.raises(TypeError, match="matrix"):
        tg.Graph.from_scipy(np.eye(3))
    with pytest.raises(ValueError):
        tg.Graph.from_coo(np.array([0, 1]), np.array([1, 2, 0]))
    with pytest.raises(ValueError, match="dst"):
        tg.Graph.from_coo(np.array([0, 1]), np.array([1, 5]), num_dst=3)
    with pytest.raises(ValueError, match="src"):
        tg.Graph.from_coo(np.array([0, 7]), np.array([1, 0]), num_src=3)
    # an index past num_src never reaches a kernel, whatever the validation level
    bad = tg.Graph.from_csr(indptr, np.array([0, 9], dtype=np.int32), num_src=2) \
        if _basic_accepts_oob() else None
    if bad is not None:
        q, k, v = qkv(2, 2)
        with pytest.raises(ValueError):
            tg.attention(q, k, v, bad)


def _basic_accepts_oob():
    try:
        tg.Graph.from_csr(np.array([0, 1, 2]), np.array([0, 9], dtype=np.int32), num_src=2)
    except ValueError:
        return False
    return True


def test_kinds_distinguish_relations():
    kinds = {tg.Graph.dense(3).kind, tg.Graph.triangular(3).kind,
             tg.Graph.from_scipy(sp.csr_matrix(np.eye(3))).kind}
    assert len(kinds) == 3
    assert tg.Graph.from_coo(np.array([0]), np.array([0])).kind == \
        tg.Graph.from_scipy(sp.csr_matrix(np.eye(3))).kind
    assert tg.Graph.radius(rng(0).random((5, 3)), 0.5).kind == \
        tg.Graph.from_scipy(sp.csr_matrix(np.eye(3))).kind


def test_gat_deeper_network_distance_field_and_float64_fields():
    pos, xs, xd, g, src, dst = gat_inputs()
    f = xs.shape[1]
    net = tg.nn.Sequential(tg.nn.Linear(1 + 2 * f, 5, seed=1), tg.nn.Tanh(),
                           tg.nn.Linear(5, 4, seed=2), tg.nn.LeakyReLU(0.1),
                           tg.nn.Linear(4, 1, seed=3))

    class GD(tg.MessagePassing):
        reducer = tg.online_softmax()

        def __init__(self, attn):
            super().__init__()
            self.attn = tg.nn.trace(attn)

        def edge(self, src, dst, edge):
            return self.reducer(self.attn(edge.distance, src.x, dst.x), src.x)

    layers = [(net[0].weight, net[0].bias), ("tanh", None), (net[2].weight, net[2].bias),
              ("leaky", 0.1), (net[4].weight, net[4].bias)]
    p64 = np.asarray(pos, np.float64)
    dist = np.linalg.norm(p64[src] - p64[dst], axis=1)[:, None]
    h = np.concatenate([dist, xs[src].astype(np.float64), xd[dst].astype(np.float64)], axis=1)
    for layer in layers:
        h = ACT[layer[0]](h, layer[1]) if isinstance(layer[0], str) else \
            h @ np.asarray(layer[0], np.float64).T + np.asarray(layer[1], np.float64)
    s = h[:, 0]
    ref = np.zeros(xs.shape)
    for i in range(len(pos)):
        e = np.nonzero(dst == i)[0]
        if len(e):
            w = np.exp(s[e] - s[e].max())
            ref[i] = (w / w.sum()) @ xs[src[e]].astype(np.float64)
    prog = GD(net)
    out = prog(graph=g, src={"x": xs}, dst={"x": xd})
    assert out.dtype == np.float32
    assert_close(out, ref, 1e-4, "distance gat")
    out64 = prog(graph=g, src={"x": xs.astype(np.float64)}, dst={"x": xd.astype(np.float64)})
    assert out64.dtype == np.float64
    assert_close(out64, ref, 1e-5, "distance gat float64")


def test_gat_vjp_deterministic():
    pos, xs, xd, g, src, dst = gat_inputs()
    prog, _, _ = make_gat("leaky")
    dout = rng(3).standard_normal(xs.shape).astype(np.float32)
    a = prog.vjp(graph=g, src={"x": xs}, dst={"x": xd})[1](dout)
    b = prog.vjp(graph=g, src={"x": xs}, dst={"x": xd})[1](dout)
    for key in ("attn.0.weight", "attn.0.bias", "attn.2.weight"):
        assert a["params"][key].tobytes() == b["params"][key].tobytes()
    assert np.asarray(a["positions"]).tobytes() == np.asarray(b["positions"]).tobytes()
    assert a["src"]["x"].tobytes() == b["src"]["x"].tobytes()


@pytest.mark.parametrize("graph", ["triangular", "cu_seqlens", "cat"])
def test_pruning_on_other_implicit_relations_exact_or_refused(graph):
    q, k, v = qkv(37, 37)
    cu = np.array([0, 5, 5, 6, 29, 37], dtype=np.int32)
    g, mask = {"triangular": (tg.Graph.triangular(37), mask_tri(37)),
               "cu_seqlens": (tg.Graph.cu_seqlens(cu), mask_segments(cu)),
               "cat": (tg.Graph.cat([tg.Graph.triangular(30), tg.Graph.dense(7)]),
                       mask_block_diag([mask_tri(30), mask_dense(7)]))}[graph]
    try:
        out = tg.attention(q, k, v, g, block_prune_threshold=1e-30)
    except NotImplementedError:
        return  # allowed: a path without pruning refuses instead of dropping it
    assert_close(out, oracle_forward(q, k, v, mask)[0], FWD_TOL[np.float32])


# ----------------------------------------------------------------------------- more edges of the contract
def test_negative_strides():
    q, k, v = qkv(13, 13)
    check_forward(q, k[::-1], v[:, ::-1], tg.Graph.dense(13), mask_dense(13))
    check_backward(q[:, ::-1], k[::-1], v[::-1, :, ::-1], tg.Graph.triangular(13), mask_tri(13))


def test_backward_accepts_strided_dout_and_out():
    q, k, v = qkv(13, 13)
    g = tg.Graph.triangular(13)
    out, stats = tg.attention(q, k, v, g, return_stats=True)
    dout = rng(5).standard_normal((4, 13, 8)).astype(np.float32).transpose(1, 0, 2)
    out_view = np.ascontiguousarray(out.transpose(1, 0, 2)).transpose(1, 0, 2)
    got = tg.attention_backward(dout, q, k, v, out_view, stats, g)
    for x, r in zip(got, oracle_backward(dout, q, k, v, mask_tri(13))):
        assert_close(x, r, BWD_TOL[np.float32])


def test_no_destinations_at_all():
    q, k, v = qkv(0, 0)
    for g in (tg.Graph.dense(0), tg.Graph.cu_seqlens(np.array([0, 0, 0]))):
        out, stats = tg.attention(q, k, v, g, return_stats=True)
        assert out.shape == (0, 4, 8) and stats.m.shape == (0, 4)
        dq, dk, dv = tg.attention_backward(out, q, k, v, out, stats, g)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_multi_head_and_sharp_scores():
    q, k, v = qkv(13, 13, h=2, hkv=2)
    check_backward(q, k, v, tg.Graph.dense(13), mask_dense(13))
    q, k, v = qkv(13, 13, dtype=np.float16)
    check_forward(q, k, v, tg.Graph.dense(13), mask_dense(13), scale=40.0)
    check_backward(q, k, v, tg.Graph.triangular(13), mask_tri(13), scale=40.0)


def test_backward_of_a_pruned_forward_is_refused():
    q, k, v = pruning_workload()
    g = tg.Graph.dense(k.shape[0], q.shape[0])
    out, stats = tg.attention(q, k, v, g, scale=1.0, block_prune_threshold=0.5, return_stats=True)
    with pytest.raises(NotImplementedError):
        tg.attention_backward(out, q, k, v, out, stats, g, scale=1.0)


def test_program_input_errors():
    q, k, v = qkv(13, 13)
    prog = DotAxis()
    with pytest.raises(ValueError, match="key|num_src"):
        prog(graph=tg.Graph.dense(12, 13), src={"key": k, "value": v}, dst={"query": q}, scale=0.3)
    with pytest.raises(TypeError, match="key"):
        prog(graph=tg.Graph.dense(13), src={"key": k.tolist(), "value": v}, dst={"query": q},
             scale=0.3)
    with pytest.raises(TypeError):
        prog(graph=tg.Graph.dense(13), src={"key": k.astype(np.int64), "value": v},
             dst={"query": q}, scale=0.3)


def test_threshold_types():
    assert tg.online_softmax(block_prune_threshold=1) is not None
    assert tg.online_softmax() is not None and tg.online_softmax(block_prune_threshold=None)
    # not a real number: a TypeError, and a ValueError as the contract's "0 < rho <= 1
    # (ValueError otherwise)" has it, in the reducer and in the functional call alike
    for bad in ("0.5", True, np.array([0.5]), 1j):
        for err in (TypeError, ValueError):
            with pytest.raises(err, match="block_prune_threshold"):
                tg.online_softmax(block_prune_threshold=bad)
    q, k, v = qkv(6, 7, seed=3)
    with pytest.raises(ValueError, match="block_prune_threshold"):
        tg.attention(q, k, v, tg.Graph.dense(7, 6), block_prune_threshold="0.5")


def test_wide_heads_and_many_heads():
    for d, dv in ((64, 64), (128, 40)):
        q, k, v = qkv(20, 33, h=8, hkv=2, d=d, dv=dv, seed=d)
        check_forward(q, k, v, tg.Graph.dense(33, 20), mask_dense(33, 20))
        check_backward(q, k, v, tg.Graph.dense(33, 20), mask_dense(33, 20))


def test_program_single_head_node_fields():
    q, k, v = qkv(13, 13, h=1, hkv=1)
    prog = DotAxis()
    g = tg.Graph.triangular(13)
    fields = dict(graph=g, src={"key": k[:, 0], "value": v[:, 0]}, dst={"query": q[:, 0]},
                  scale=0.3)
    out = prog(**fields)
    ref = oracle_forward(q, k, v, mask_tri(13), 0.3)[0][:, 0]
    assert out.shape == (13, 8)
    assert_close(out, ref, FWD_TOL[np.float32])
    out2, vjp = prog.vjp(**fields)
    dout = rng(6).standard_normal(out2.shape).astype(np.float32)
    grads = vjp(dout)
    dq, dk, dv = oracle_backward(dout[:, None], q, k, v, mask_tri(13), 0.3)
    assert_close(grads["dst"]["query"], dq[:, 0], BWD_TOL[np.float32])
    assert_close(grads["src"]["key"], dk[:, 0], BWD_TOL[np.float32])
    assert_close(grads["src"]["value"], dv[:, 0], BWD_TOL[np.float32])


def test_graph_constructor_argument_errors():
    with pytest.raises(ValueError):
        tg.Graph.triangular(-1)
    with pytest.raises(TypeError):
        tg.Graph.dense(2.5)
    with pytest.raises((TypeError, ValueError), match="cu_seqlens"):
        tg.Graph.cu_seqlens(np.array([0.0, 2.0, 4.0]))
    assert type(tg.Graph.dense(np.int64(5)).num_edges) is int


def test_gat_errors():
    pos, xs, xd, g, src, dst = gat_inputs()
    prog, _, _ = make_gat("leaky")
    _, vjp = prog.vjp(graph=g, src={"x": xs}, dst={"x": xd})
    with pytest.raises(ValueError, match="dout"):
        vjp(np.ones((3, 3), np.float32))
    # a relation without geometry has no displacement field
    with pytest.raises((ValueError, KeyError), match="displacement"):
        prog(graph=tg.Graph.dense(len(pos)), src={"x": xs}, dst={"x": xd})


# ----------------------------------------------------------------------------- the admission rule, tile by tile
def emulate_pruning(q, k, v, mask, scale, rho, bm, bn):
    """docs/design.md's rule on a (bm, bn) grid from (0, 0), key tiles visited in increasing order (the
    natural reading for a single block; the grid is the one explain() reports): a tile is admitted iff
    max(its scores) >= m_run_block + ln(rho), m_run_block = running max of the query block (per head).
    Returns the output over admitted edges, the pruned and visited tile counts, and the smallest
    distance of a tile max to its threshold (to keep the test away from rounding ties)."""
    qf, kf, vf = (np.asarray(x, np.float64) for x in (q, k, v))
    nd, h, _ = q.shape
    g = h // k.shape[1]
    kk, vv = np.repeat(kf, g, axis=1), np.repeat(vf, g, axis=1)
    s = np.einsum("ihd,jhd->hij", qf, kk) * scale
    adm = np.zeros((h,) + mask.shape, dtype=bool)
    pruned = total = 0
    margin = np.inf
    for hh in range(h):
        for i0 in range(0, nd, bm):
            rows = slice(i0, min(i0 + bm, nd))
            m_run = -np.inf
            for j0 in range(0, k.shape[0], bn):
                cols = slice(j0, min(j0 + bn, k.shape[0]))
                mk = mask[rows, cols]
                if not mk.any():
                    continue
                total += 1
                tmax = s[hh, rows, cols][mk].max()
                thr = m_run + math.log(rho)
                if np.isfinite(thr):
                    margin = min(margin, abs(tmax - thr))
                if tmax >= thr:
                    m_run = max(m_run, tmax)
                    adm[hh, rows, cols] = mk
                else:
                    pruned += 1
    ss = np.where(adm, s, -np.inf)
    m = ss.max(axis=-1, keepdims=True)
    p = np.where(adm, np.exp(ss - np.where(np.isfinite(m), m, 0)), 0.0)
    l = p.sum(axis=-1, keepdims=True)
    return np.einsum("hij,jhd->ihd", p / np.where(l > 0, l, 1), vv), pruned, total, margin


def tiered_workload(nd, ns, h, hkv, seed):
    """Random scores plus a per-128-key offset in {0, -2, -4, -7}: some key tiles fall below the
    running max by more than ln(1/rho), others do not, depending on the data."""
    r = rng(seed)
    q, k, v = qkv(nd, ns, h=h, hkv=hkv, d=8, seed=seed)
    q, k = q * 0.3, k * 0.3
    q[..., -1] = 1.0
    offsets = r.choice([0.0, -2.0, -4.0, -7.0], size=(ns + 127) // 128)
    k[..., -1] = np.repeat(offsets, 128)[:ns, None]
    return q.astype(np.float32), k.astype(np.float32), v


@pytest.mark.parametrize("case", ["dense", "dense_gqa", "triangular"])
def test_pruning_follows_the_admission_rule(case):
    nd, ns, h, hkv = {"dense": (150, 700, 1, 1), "dense_gqa": (150, 700, 2, 1),
                      "triangular": (300, 300, 1, 1)}[case]
    g = tg.Graph.triangular(nd) if case == "triangular" else tg.Graph.dense(ns, nd)
    mask = mask_tri(nd) if case == "triangular" else mask_dense(ns, nd)
    q, k, v = tiered_workload(nd, ns, h, hkv, seed=1)
    exact = oracle_forward(q, k, v, mask, 1.0)[0]
    for rho in (0.05, 0.3):
        prog = Pruned(rho)
        out = prog(graph=g, src={"key": k, "value": v}, dst={"query": q}, scale=1.0)
        text = prog.explain()
        tiles = re.search(r"BM\s*=\s*(\d+)\D+BN\s*=\s*(\d+)", text)
        assert tiles, "explain() must report the tiles: " + text
        bm, bn = map(int, tiles.groups())
        ref, pruned, total, margin = emulate_pruning(q, k, v, mask, 1.0, rho, bm, bn)
        assert margin > 1e-3
        assert pruned > 0 and np.max(np.abs(ref - exact)) > 1e-4  # the workload really prunes
        assert_close(out, ref, 1e-5, f"pruned rho={rho}")
        # "reports the fraction of tiles pruned": as counts or as a percentage
        pct = 100.0 * pruned / total
        assert (re.search(rf"\b{pruned}\s*/\s*{total}\b", text)
                or f"{pct:.1f}%" in text or f"{pct:.0f}%" in text), text
        out_f = tg.attention(q, k, v, g, scale=1.0, block_prune_threshold=rho)
        assert_close(out_f, ref, 1e-5, f"functional pruned rho={rho}")


# ----------------------------------------------------------------------------- per-edge fields
class BiasedAttention(tg.MessagePassing):
    reducer = tg.online_softmax()

    def edge(self, src, dst, edge, scale):
        score = (src.key * dst.query).sum(axis=-1) * scale + edge.bias
        return self.reducer(score, src.value)


def test_program_edge_bias_field_and_its_gradient():
    mask = random_pattern(13, 11)
    csr = sp.csr_matrix(mask.astype(np.float64))
    csr.sort_indices()
    g = tg.Graph.from_scipy(csr)
    rows = np.repeat(np.arange(13), np.diff(csr.indptr))
    cols = csr.indices
    q, k, v = qkv(13, 11, dtype=np.float64)
    bias = rng(14).standard_normal((g.num_edges, 4))
    dense_bias = np.zeros((4, 13, 11))
    dense_bias[:, rows, cols] = bias.T
    scale = 0.45

    # oracle: the biased scores, its softmax, and ds = p * (dp - Delta) = d score
    qf, kk, vv = q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    s = np.where(mask[None], np.einsum("ihd,jhd->hij", qf, kk) * scale + dense_bias, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.where(mask[None], np.exp(s - m), 0)
    P = p / np.maximum(p.sum(axis=-1, keepdims=True), 1e-300)
    ref = np.einsum("hij,jhd->ihd", P, vv)

    prog = BiasedAttention()
    out, vjp = prog.vjp(graph=g, src={"key": k, "value": v}, dst={"query": q},
                        edge={"bias": bias}, scale=scale)
    assert_close(out, ref, FWD_TOL[np.float64], "biased out")
    dout = rng(15).standard_normal(out.shape)
    grads = vjp(dout)
    dp = np.einsum("ihd,jhd->hij", dout, vv)
    delta = np.einsum("ihd,ihd->hi", dout, ref)
    ds = P * (dp - delta[..., None])
    assert_close(grads["edge"]["bias"], ds[:, rows, cols].T, BWD_TOL[np.float64], "edge.bias")
    assert_close(grads["dst"]["query"], scale * np.einsum("hij,jhd->ihd", ds, kk),
                 BWD_TOL[np.float64], "biased dq")


# ----------------------------------------------------------------------------- randomised sweep
def _random_case(r):
    kind = r.choice(["dense", "tri", "cu", "cuN", "cat", "csr"])
    if kind == "dense":
        ns, nd = int(r.choice([1, 63, 64, 65, 129, 200])), int(r.choice([1, 63, 64, 65, 129]))
        return tg.Graph.dense(ns, nd), mask_dense(ns, nd)
    if kind == "tri":
        n = int(r.choice([1, 63, 64, 65, 127, 128, 129, 200]))
        return tg.Graph.triangular(n), mask_tri(n)
    if kind in ("cu", "cuN"):
        lens = r.choice([0, 1, 63, 64, 65, 128, 129], size=r.integers(1, 5))
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        return tg.Graph.cu_seqlens(cu, causal=kind == "cu"), mask_segments(cu, kind == "cu")
    if kind == "cat":
        blocks, masks = [], []
        for _ in range(r.integers(1, 4)):
            if r.random() < 0.5:
                a, b = int(r.integers(1, 140)), int(r.integers(1, 140))
                blocks.append(tg.Graph.dense(a, b))
                masks.append(mask_dense(a, b))
            else:
                a = int(r.integers(1, 140))
                blocks.append(tg.Graph.triangular(a))
                masks.append(mask_tri(a))
        return tg.Graph.cat(blocks), mask_block_diag(masks)
    nd, ns = int(r.integers(1, 150)), int(r.integers(1, 150))
    mask = r.random((nd, ns)) < r.choice([0.02, 0.3, 0.9])
    return tg.Graph.from_scipy(sp.csr_matrix(mask * 1.0)), mask


def test_randomised_relations_forward_and_backward():
    r = rng(123)
    for it in range(40):
        dtype = DTYPES[r.integers(3)]
        hkv = int(r.choice([1, 2]))
        h = hkv * int(r.choice([1, 2, 3]))
        g, mask = _random_case(r)
        nd, ns = mask.shape
        q, k, v = qkv(nd, ns, h=h, hkv=hkv, dtype=dtype, seed=it, strided=bool(r.integers(2)))
        check_forward(q, k, v, g, mask)
        check_backward(q, k, v, g, mask)


# ----------------------------------------------------------------------------- geometry corner cases
class DistanceGAT(tg.MessagePassing):
    reducer = tg.online_softmax()

    def __init__(self, attn):
        super().__init__()
        self.attn = tg.nn.trace(attn)

    def edge(self, src, dst, edge):
        return self.reducer(self.attn(edge.distance, src.x, dst.x), src.x)


def test_gat_zero_distances_and_edgeless_graph_give_no_nan():
    r = rng(30)
    pos = r.random((20, 3)).astype(np.float32)
    pos[1] = pos[0]  # coincident points: distance 0 on a real edge
    xs = r.standard_normal((20, 3)).astype(np.float32)
    net = tg.nn.Sequential(tg.nn.Linear(7, 5, seed=1), tg.nn.Tanh(), tg.nn.Linear(5, 1, seed=3))
    prog = DistanceGAT(net)
    for g in (tg.Graph.radius(pos, 0.3), tg.Graph.radius(pos, 0.3, exclude_self=False)):
        out, vjp = prog.vjp(graph=g, src={"x": xs}, dst={"x": xs})
        grads = vjp(np.ones_like(out))
        for name, arr in (("out", out), ("positions", grads["positions"]),
                          ("src.x", grads["src"]["x"]), ("attn.0.weight", grads["params"]["attn.0.weight"])):
            assert np.all(np.isfinite(np.asarray(arr))), name
    g = tg.Graph.radius(pos + np.arange(20, dtype=np.float32)[:, None], 1e-3)
    assert g.num_edges == 0
    gat, _, _ = make_gat("leaky")
    out, vjp = gat.vjp(graph=g, src={"x": xs}, dst={"x": xs})
    grads = vjp(np.ones_like(out))
    assert not out.any() and not np.asarray(grads["positions"]).any()
    assert not grads["params"]["attn.0.weight"].any()


def _cupy_missing():
    try:
        import cupy  # noqa: F401
    except ImportError:
        return True
    return False


@pytest.mark.skipif(not _cupy_missing(), reason="only meaningful where cupy is not installed")
def test_device_arrays_without_cupy_give_a_clear_error():
    # docs/design.md: anything with __cuda_array_interface__ takes the GPU path; where that path cannot
    # run, the error must still name the argument and say what is missing, not leak an import.
    q, k, v = qkv(5, 5)
    with pytest.raises((ImportError, NotImplementedError, TypeError)) as e:
        tg.attention(*(FakeCupyArray(x) for x in (q, k, v)), tg.Graph.dense(5))
    msg = str(e.value)
    assert re.search(r"\bq\b", msg) and "cupy" in msg, msg


def test_nn_argument_errors_name_the_argument():
    with pytest.raises((TypeError, ValueError), match="negative_slope"):
        tg.nn.LeakyReLU("steep")
    with pytest.raises(ValueError, match="in_features"):
        tg.nn.Linear(0, 3)
    with pytest.raises(TypeError):
        tg.nn.trace(lambda x: x)


# ----------------------------------------------------------------------------- array hygiene
def test_inputs_are_not_modified_and_read_only_or_broadcast_inputs_work():
    q, k, v = qkv(70, 70)
    saved = [x.copy() for x in (q, k, v)]
    for g in (tg.Graph.dense(70), tg.Graph.triangular(70)):
        out, stats = tg.attention(q, k, v, g, return_stats=True)
        m_saved = stats.m.copy()
        dout = rng(1).standard_normal(out.shape).astype(np.float32)
        out_saved, dout_saved = out.copy(), dout.copy()
        tg.attention_backward(dout, q, k, v, out, stats, g)
        assert all(np.array_equal(a, b) for a, b in zip(saved, (q, k, v)))
        assert np.array_equal(out, out_saved) and np.array_equal(dout, dout_saved)
        assert np.array_equal(stats.m, m_saved)
    for x in (q, k, v):
        x.setflags(write=False)
    check_forward(q, k, v, tg.Graph.dense(70), mask_dense(70))
    # stride-0 node axis ("any strides"): every source shares one key / value row
    kb, vb = np.broadcast_to(k[:1], k.shape), np.broadcast_to(v[:1], v.shape)
    check_forward(q, kb, vb, tg.Graph.dense(70), mask_dense(70))
    check_backward(q, kb, vb, tg.Graph.triangular(70), mask_tri(70))


def test_results_do_not_depend_on_the_thread_count():
    # stronger than docs/design.md's "same bits every run": also the same bits for 1 and 2 threads
    numba = pytest.importorskip("numba")
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs two numba threads")
    q, k, v = qkv(150, 150)
    mask = random_pattern(150, 150)
    before = numba.get_num_threads()
    try:
        for g in (tg.Graph.dense(150), tg.Graph.triangular(150),
                  tg.Graph.from_scipy(sp.csr_matrix(mask * 1.0))):
            runs = []
            for threads in (1, 2):
                numba.set_num_threads(threads)
                out, stats = tg.attention(q, k, v, g, return_stats=True)
                grads = tg.attention_backward(out, q, k, v, out, stats, g)
                runs.append([x.tobytes() for x in (out,) + tuple(grads)])
            assert runs[0] == runs[1], g.kind
    finally:
        numba.set_num_threads(before)


def test_cu_seqlens_equals_cat_of_triangles_and_program_explain_details():
    lengths = [5, 1, 0, 9, 2]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    a = tg.Graph.cu_seqlens(cu)
    b = tg.Graph.cat([tg.Graph.triangular(n) for n in lengths])
    assert pairs_of(a.to_scipy()) == pairs_of(b.to_scipy()) and a.num_edges == b.num_edges
    q, k, v = qkv(17, 17)
    prog = DotAxis()
    outs = [prog(graph=g, src={"key": k, "value": v}, dst={"query": q}, scale=0.3) for g in (a, b, a)]
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    text = prog.explain().lower()
    # docs/design.md: backend, kernel, relation realization, dtypes, tiles, what was NOT materialized,
    # cache hits/misses
    for word in ("cpu", "float32", "materializ", "hit", "miss"):
        assert word in text, word


def test_gat_distance_field_gradients_against_finite_differences():
    n, f = 14, 3  # the network of test_gat_zero_distances...: compiled kernels are reused
    r = rng(40)
    pos = r.random((n, 3)).astype(np.float32)
    xs = r.standard_normal((n, f)).astype(np.float32)
    g = tg.Graph.radius(pos, 0.5)
    coo = sp.coo_matrix(g.to_scipy())
    src, dst = coo.col.astype(np.int64), coo.row.astype(np.int64)
    net = tg.nn.Sequential(tg.nn.Linear(1 + 2 * f, 5, seed=5), tg.nn.Tanh(),
                           tg.nn.Linear(5, 1, seed=6))
    W0, b0, W2, b2 = (np.asarray(a, np.float64) for a in
                      (net[0].weight, net[0].bias, net[2].weight, net[2].bias))
    dout = r.standard_normal((n, f))

    def loss(p, x):
        d = np.linalg.norm(p[src] - p[dst], axis=1)[:, None]
        hid = np.tanh(np.concatenate([d, x[src], x[dst]], axis=1) @ W0.T + b0)
        s = (hid @ W2.T + b2)[:, 0]
        out = np.zeros((n, f))
        for i in range(n):
            e = np.nonzero(dst == i)[0]
            if len(e):
                w = np.exp(s[e] - s[e].max())
                out[i] = (w / w.sum()) @ x[src[e]]
        return float(np.sum(out * dout))

    prog = DistanceGAT(net)
    out, vjp = prog.vjp(graph=g, src={"x": xs}, dst={"x": xs})
    grads = vjp(dout.astype(np.float32))
    p64, x64 = pos.astype(np.float64), xs.astype(np.float64)
    assert_close(grads["positions"], numeric_grad(lambda p: loss(p, x64), p64), 2e-4, "positions")
    # x is both src.x and dst.x here: the two roles' gradients add up to d loss / d x
    total = np.asarray(grads["src"]["x"], np.float64) + np.asarray(grads["dst"]["x"], np.float64)
    assert_close(total, numeric_grad(lambda x: loss(p64, x), x64), 2e-4, "x")


def test_many_tiny_segments_hub_sources_and_unusual_scales():
    r = rng(50)
    lens = r.integers(0, 4, size=200)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    n = int(cu[-1])
    q, k, v = qkv(n, n)
    for causal in (True, False):
        g = tg.Graph.cu_seqlens(cu, causal=causal)
        check_forward(q, k, v, g, mask_segments(cu, causal))
        check_backward(q, k, v, g, mask_segments(cu, causal))
    mask = np.zeros((150, 300), dtype=bool)
    mask[:, 5] = True      # every destination reads source 5
    mask[::2, 7] = True
    mask[3] = True         # one destination reads everything
    q, k, v = qkv(150, 300)
    g = tg.Graph.from_scipy(sp.csr_matrix(mask * 1.0))
    check_forward(q, k, v, g, mask)
    check_backward(q, k, v, g, mask)
    q, k, v = qkv(13, 13)
    for scale in (0.0, -0.7):
        check_forward(q, k, v, tg.Graph.triangular(13), mask_tri(13), scale=scale)
        check_backward(q, k, v, tg.Graph.triangular(13), mask_tri(13), scale=scale)
