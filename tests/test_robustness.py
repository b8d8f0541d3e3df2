"""Robustness: accuracy at large scores, stats that belong to their call, rejected array
subclasses, index overflow, scipy formats, threading layers, and a bounded fuzz test of
non-finite values outside every row's relation. Every result is compared with a float64
numpy oracle written here. Shapes are small and shared so that compiled kernels are reused."""
import os
import re
import subprocess
import sys
import textwrap
import types

import numba
import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiga_numba as tg
from tiga_numba import AttentionStats
from tiga_numba import functional

EPS32 = float(np.finfo(np.float32).eps)


# ----------------------------------------------------------------------------- oracles
def dense_mask(graph):
    return graph.to_scipy().toarray().astype(bool)


def oracle(q, k, v, dout, mask, scale, dtype=np.float64):
    """Materialised attention forward and backward in `dtype` (float64: the reference;
    float32: what a materialised float32 numpy backward achieves). Also returns the float32
    rounding-error bounds of dq and dk (Delta cancels p * dp for one-hot rows)."""
    q, k, v, dout = (np.asarray(x, dtype) for x in (q, k, v, dout))
    g = q.shape[1] // k.shape[1]
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = np.einsum("ihd,jhd->hij", q, kk) * dtype(scale)
    s = np.where(mask[None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True) if s.shape[-1] else np.full(s.shape[:2] + (1,), -np.inf)
    ms = np.where(np.isfinite(m), m, 0)
    p = np.where(mask[None], np.exp(s - ms), 0)
    l = p.sum(-1, keepdims=True)
    p = p / np.where(l > 0, l, 1)
    o = np.einsum("hij,jhd->ihd", p, vv)
    dp = np.einsum("ihd,jhd->hij", dout, vv)
    delta = np.einsum("ihd,ihd->hi", dout, o)[..., None]
    ds = p * (dp - delta)
    ns, hkv = k.shape[:2]
    dq = np.einsum("hij,jhd->ihd", ds, kk) * dtype(scale)
    d, dv_ = q.shape[2], v.shape[2]
    dk = (np.einsum("hij,ihd->jhd", ds, q) * dtype(scale)).reshape(ns, hkv, g, d).sum(2)
    dv = np.einsum("hij,ihd->jhd", p, dout).reshape(ns, hkv, g, dv_).sum(2)
    a = np.abs
    # |ds| computed with every product taken in absolute value: what rounding can leave of it
    dsa = p * (np.einsum("ihd,jhd->hij", a(dout), a(vv)) + np.einsum("ihd,ihd->hi", a(dout), a(o))[..., None])
    bq = np.einsum("hij,jhd->ihd", dsa, a(kk)) * scale
    bk = (np.einsum("hij,ihd->jhd", dsa, a(q)) * scale).reshape(ns, hkv, g, d).sum(2)
    return dict(out=o, m=m[..., 0].T, dq=dq, dk=dk, dv=dv, bound_dq=bq, bound_dk=bk)


def rel_err(got, ref):
    got = np.asarray(got, np.float64)
    if not ref.size:
        return 0.0
    return float(np.max(np.abs(got - ref)) / max(1.0, float(np.max(np.abs(ref)))))


def graph_of(kind, n):
    if kind == "dense":
        return tg.Graph.dense(n)
    if kind == "triangular":
        return tg.Graph.triangular(n)
    if kind == "cu_seqlens":
        return tg.Graph.cu_seqlens(np.array([0, 1, 1, 70, n]), causal=True)
    # CSR: random in-degrees 0..9 plus a hub row, duplicates-free
    r = np.random.default_rng(n)
    rows = []
    for i in range(n):
        deg = n if i == 3 else int(r.integers(0, 10))
        rows.append(np.sort(r.choice(n, size=min(deg, n), replace=False)))
    indptr = np.concatenate([[0], np.cumsum([len(x) for x in rows])])
    return tg.Graph.from_csr(indptr, np.concatenate(rows), num_src=n)


# ----------------------------------------------------------------------------- large scores
N_BIG, H_BIG, HKV_BIG, D_BIG = 150, 2, 1, 16


LARGE_SCORE_CASES = [(np.float32, 1e2), (np.float32, 5e4), (np.float32, 1e6), (np.float32, 1e8),
                     (np.float16, 3e4)]


def _large_score_inputs(kind, dtype, max_score, d=D_BIG):
    r = np.random.default_rng(int(np.log10(max_score)) + 10 * (dtype == np.float16))
    g = graph_of(kind, N_BIG)
    mask = dense_mask(g)
    q = r.standard_normal((N_BIG, H_BIG, d))
    k = r.standard_normal((N_BIG, HKV_BIG, d))
    raw = np.abs(np.einsum("ihd,jhd->hij", q, np.repeat(k, H_BIG // HKV_BIG, 1)) * 0.3)
    amp = np.sqrt(max_score / raw[:, mask].max())
    q, k = (x * amp for x in (q, k))
    if kind == "csr":
        # exact ties (rows holding both copies have l = 2 at any magnitude): only where every
        # score is computed by the same instructions; a BLAS tile may round its columns
        # differently, which at |s| ~ 1e8 breaks a tie in the forward already
        k[20:40] = k[0:20]
    v = r.standard_normal((N_BIG, HKV_BIG, d))
    dout = r.standard_normal((N_BIG, H_BIG, d))
    return g, mask, [x.astype(dtype) for x in (q, k, v, dout)]


def check_large_scores(kind, dtype, max_score, to_dev=lambda x: x, to_host=lambda x: x):
    """The backward's error against float64 stays that of a materialised float32 numpy
    backward at any score magnitude where the forward is finite."""
    g, mask, (q, k, v, dout) = _large_score_inputs(kind, dtype, max_score)
    scale = 0.3  # not a power of two: scaling q or k rounds differently
    qd, kd, vd, dd = (to_dev(x) for x in (q, k, v, dout))
    out, stats = tg.attention(qd, kd, vd, g, scale=scale, return_stats=True)
    dq, dk, dv = tg.attention_backward(dd, qd, kd, vd, out, stats, g, scale=scale)
    out, dq, dk, dv, m = (to_host(x) for x in (out, dq, dk, dv, stats.m))
    assert_large_score_accuracy(q, k, v, dout, mask, scale, out, m, dq, dk, dv)


#: the rounding unit of the mma.sync engine's float32 products (3xTF32): x = big + small tf32
#: halves holds x to 2^-22 |x|, so a product carries three 2^-22 terms (each operand's remainder
#: and the dropped small * small), and mma's fp32 accumulation truncates instead of rounding;
#: 2^-20 where float32's is 2^-24, so the dq / dk bound uses that unit (docs/tensor_cores.md)
EPS_3XTF32 = 2.0 ** -20


def assert_large_score_accuracy(q, k, v, dout, mask, scale, out, m, dq, dk, dv, eps=None):
    """out, m, dq, dk, dv (host arrays) of an attention over `mask` against float64: m to
    rtol 1e-5 d, out and dv within 20x a materialised float32 backward's error, dq and dk
    within the rounding bound of p (dp - Delta) in units of `eps` (default: float32's, or the
    input dtype's when coarser)."""
    dtype = q.dtype
    d = q.shape[2]
    ref = oracle(q, k, v, dout, mask, scale)
    f32 = oracle(q, k, v, dout, mask, scale, np.float32)
    for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert np.all(np.isfinite(x)), name
    live = np.isfinite(ref["m"])
    np.testing.assert_allclose(m[live], ref["m"][live], rtol=1e-5 * d, atol=1e-5)
    tol_in = float(np.finfo(dtype).eps)  # out and dv are stored in the input dtype
    for name in ("out", "dv"):
        got = {"out": out, "dv": dv}[name]
        assert rel_err(got, ref[name]) <= 20 * rel_err(f32[name], ref[name]) + 4 * tol_in, \
            (name, rel_err(got, ref[name]), rel_err(f32[name], ref[name]))
    # dq, dk: the float32 rounding bound of p * (dp - Delta) (summation orders differ from
    # numpy's, so exact cancellation in one-hot rows is not reproduced, nor required)
    for name, got in (("dq", dq), ("dk", dk)):
        err = np.abs(np.asarray(got, np.float64) - ref[name])
        # (Delta uses `out` as returned, rounded to the input dtype)
        eps = max(EPS32, tol_in) if eps is None else eps
        bound = 4 * d * eps * ref["bound_" + name] + 4 * tol_in * max(1.0, np.abs(ref[name]).max())
        assert np.all(err <= bound), (name, float((err / np.maximum(bound, 1e-300)).max()))


@pytest.mark.parametrize("kind", ["dense", "triangular", "cu_seqlens", "csr"])
@pytest.mark.parametrize("dtype, max_score", LARGE_SCORE_CASES)
def test_backward_accurate_at_large_scores(kind, dtype, max_score):
    check_large_scores(kind, dtype, max_score)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "triangular", "cu_seqlens", "csr"])
@pytest.mark.parametrize("dtype, max_score", LARGE_SCORE_CASES)
def test_cuda_core_backward_accurate_at_large_scores(kind, dtype, max_score, monkeypatch):
    """The same on the CUDA-core kernels (D = 16: no tensor-core kernel takes it)."""
    cupy = _need_cuda()
    with tg.options(tensor_cores=False):
        check_large_scores(kind, dtype, max_score, cupy.asarray, cupy.asnumpy)


def _need_cuda():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("no CUDA device")
    except Exception:
        pytest.skip("no CUDA device")
    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, max_score", LARGE_SCORE_CASES)
def test_cuda_csr_split_rows_backward_accurate_at_large_scores(dtype, max_score, monkeypatch):
    """CUDA-core CSR with the hub row (150 edges) cut into pieces and merged by the softmax
    merge kernel: the merged m is the max of the pieces' exact maxima."""
    cupy = _need_cuda()
    from tiga_numba.cuda import api as cuda_api
    monkeypatch.setattr(cuda_api, "CSR_MIN_PIECE", 16)
    with tg.options(tensor_cores=False):
        check_large_scores("csr", dtype, max_score, cupy.asarray, cupy.asnumpy)
    assert "split into" in functional.last_plan().run_info["kernel"]


@pytest.mark.gpu
@pytest.mark.xfail(reason="the split-key decode forward sums the score dot product over its lane "
                          "groups in another order than the blocks backward recomputes it: P off "
                          "by e^(rounding of the score) at large scores (test_cuda_sim "
                          "large_scores_decode)", strict=False)
@pytest.mark.parametrize("dtype, max_score", LARGE_SCORE_CASES)
def test_cuda_decode_backward_accurate_at_large_scores(dtype, max_score):
    """Decode-shaped blocks (at most DECODE_MAX_ROWS query rows each): cuda.decode forward,
    CUDA-core blocks backward."""
    cupy = _need_cuda()
    r = np.random.default_rng(int(np.log10(max_score)))
    n, ns, d, scale = 4, 300, D_BIG, 0.3
    g = tg.Graph.cu_seqlens(np.array([0, 2, 4]), cu_seqlens_k=np.array([0, 140, ns]))
    mask = dense_mask(g)
    q, k = r.standard_normal((n, H_BIG, d)), r.standard_normal((ns, HKV_BIG, d))
    raw = np.abs(np.einsum("ihd,jhd->hij", q, np.repeat(k, H_BIG // HKV_BIG, 1)) * scale)
    amp = np.sqrt(max_score / raw[:, mask].max())
    q, k, v, dout = (x.astype(dtype) for x in (q * amp, k * amp, r.standard_normal((ns, HKV_BIG, d)),
                                                r.standard_normal((n, H_BIG, d))))
    qd, kd, vd, dd = (cupy.asarray(x) for x in (q, k, v, dout))
    out, stats = tg.attention(qd, kd, vd, g, scale=scale, return_stats=True)
    assert functional.last_plan().family == "cuda.decode"
    dq, dk, dv = tg.attention_backward(dd, qd, kd, vd, out, stats, g, scale=scale)
    assert_large_score_accuracy(q, k, v, dout, mask, scale, *(cupy.asnumpy(x) for x in
                                                               (out, stats.m, dq, dk, dv)))


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["wgmma", "mma"])
@pytest.mark.parametrize("kind", ["dense", "triangular", "cu_seqlens"])
@pytest.mark.parametrize("dtype, max_score", LARGE_SCORE_CASES)
def test_tensor_core_backward_accurate_at_large_scores(kind, dtype, max_score, engine):
    """The tensor-core kernels (D = 64; wgmma on compute capability 9.0, mma.sync with
    TIGA_NUMBA_WGMMA=0): the forward's base-2 row max (stats.m_kernel) reaches the backward's
    Delta pre-pass unconverted."""
    cupy = _need_cuda()
    with tg.options(wgmma=engine == "wgmma"):
        _tensor_core_large_scores(cupy, kind, dtype, max_score,
                                  EPS_3XTF32 if engine == "mma" and dtype == np.float32 else None)


def _tensor_core_large_scores(cupy, kind, dtype, max_score, eps=None):
    g, mask, (q, k, v, dout) = _large_score_inputs(kind, dtype, max_score, d=64)
    scale = 0.3
    qd, kd, vd, dd = (cupy.asarray(x) for x in (q, k, v, dout))
    out, stats = tg.attention(qd, kd, vd, g, scale=scale, return_stats=True)
    assert functional.last_plan().family == "cuda.tc" and stats.m_kernel is not None
    dq, dk, dv = tg.attention_backward(dd, qd, kd, vd, out, stats, g, scale=scale)
    assert functional.last_plan().family == "cuda.tc"
    assert_large_score_accuracy(q, k, v, dout, mask, scale, *(cupy.asnumpy(x) for x in
                                                               (out, stats.m, dq, dk, dv)), eps=eps)


def test_stats_keep_the_kernel_row_max_exactly():
    """stats.m is the contract's natural-log row max; the kernels' own row max travels with it
    so that the backward needs no rounded unit conversion."""
    q, k, v = (np.random.default_rng(1).standard_normal((40, 2, 8)).astype(np.float32) * 300
               for _ in range(3))
    g = tg.Graph.triangular(40)
    out, stats = tg.attention(q, k, v, g, return_stats=True)
    assert stats.m.dtype == np.float32 and stats.m.shape == (40, 2)
    assert stats.m_kernel is not None and stats.m_kernel.shape == (40, 2)
    np.testing.assert_allclose(stats.m, stats.m_kernel * np.log(2.0), rtol=1e-7)
    # 2-D (one head) inputs: every stat squeezed alike
    out2, st2 = tg.attention(q[:, 0], k[:, 0], v[:, 0], g, return_stats=True)
    assert st2.m.shape == st2.l.shape == st2.m_kernel.shape == (40,)
    dq, dk, dv = tg.attention_backward(out2, q[:, 0], k[:, 0], v[:, 0], out2, st2, g)
    assert dq.shape == (40, 8)


# ----------------------------------------------------------------------------- stats belong
def _small(seed=0, n=33, dtype=np.float32):
    r = np.random.default_rng(seed)
    q = r.standard_normal((n, 2, 8)).astype(dtype)
    k = r.standard_normal((n, 1, 8)).astype(dtype)
    v = r.standard_normal((n, 1, 8)).astype(dtype)
    return q, k, v, r.standard_normal((n, 2, 8)).astype(dtype)


def test_backward_refuses_stats_of_another_graph():
    q, k, v, do = _small()
    tri, dense = tg.Graph.triangular(33), tg.Graph.dense(33)
    out, st = tg.attention(q, k, v, tri, return_stats=True)
    with pytest.raises(ValueError, match="stats"):
        tg.attention_backward(do, q, k, v, out, st, dense)
    csr_a = tg.Graph.from_scipy(sp.csr_matrix(np.tril(np.ones((33, 33)))))
    csr_b = tg.Graph.from_scipy(sp.csr_matrix(np.triu(np.ones((33, 33)))))
    assert csr_a.num_edges == csr_b.num_edges
    out, st = tg.attention(q, k, v, csr_a, return_stats=True)
    with pytest.raises(ValueError, match="stats"):
        tg.attention_backward(do, q, k, v, out, st, csr_b)
    # the same edges under another kind are the same relation: the stats serve it
    want = tg.attention_backward(do, q, k, v, *tg.attention(q, k, v, tri, return_stats=True), tri)
    for got in (tg.attention_backward(do, q, k, v, out, st, tri),
                tg.attention_backward(do, q, k, v, *tg.attention(q, k, v, tri, return_stats=True), csr_a)):
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_stats_serve_every_graph_of_the_same_relation():
    """band(n, left=None, right=0), cu_seqlens([0, n]) and triangular(n) are one relation (and
    band(n, left=None, right=None) is dense(n)): a forward over one gives stats for a backward
    over another; a band that differs in one diagonal does not."""
    q, k, v, do = _small(seed=3)
    n = q.shape[0]
    for a, b in ((tg.Graph.triangular(n), tg.Graph.band(n, left=None, right=0)),
                 (tg.Graph.band(n, left=None, right=0), tg.Graph.cu_seqlens(cu_seqlens_q=[0, n])),
                 (tg.Graph.dense(n), tg.Graph.band(n, left=None, right=None))):
        out, st = tg.attention(q, k, v, a, return_stats=True)
        want = tg.attention_backward(do, q, k, v, out, st, a)
        got = tg.attention_backward(do, q, k, v, out, st, b)
        for x, y in zip(got, want):
            np.testing.assert_array_equal(x, y)
    out, st = tg.attention(q, k, v, tg.Graph.triangular(n), return_stats=True)
    with pytest.raises(ValueError, match="stats"):
        tg.attention_backward(do, q, k, v, out, st, tg.Graph.band(n, left=n - 2, right=0))
    with pytest.raises(TypeError, match="not both"):
        tg.Graph.cu_seqlens([0, n], cu_seqlens_q=[0, n])
    with pytest.raises(TypeError, match="query offsets"):
        tg.Graph.cu_seqlens()


def test_stats_serve_the_same_edges_in_another_order_or_with_empty_segments():
    """A row's edges listed in another order, zero-length segments and a block cut that leaves
    rows without edges do not change the relation: the stats serve the backward, which gives
    what it gives over the forward's own graph (up to the order of a row's sums). An edge that moves to another row is refused, and the
    message says what differs."""
    q, k, v, do = _small(seed=5)
    n = q.shape[0]
    r = np.random.default_rng(7)
    src, dst = r.integers(0, n, 200), r.integers(0, n, 200)
    perm = r.permutation(200)
    pairs = [(tg.Graph.from_coo(src, dst, n, n), tg.Graph.from_coo(src[perm], dst[perm], n, n)),
             (tg.Graph.cu_seqlens([0, 10, 10, n], causal=True), tg.Graph.cu_seqlens([0, 10, n], causal=True)),
             (tg.Graph.cu_seqlens([0, 10, n], causal=False),
              tg.Graph.cu_seqlens([0, 10, 10, n], cu_seqlens_k=[0, 10, 10, n], causal=False))]
    for a, b in pairs:
        assert a.num_edges == b.num_edges
        out, st = tg.attention(q, k, v, a, return_stats=True)
        want = tg.attention_backward(do, q, k, v, out, st, a)
        got = tg.attention_backward(do, q, k, v, out, st, b)
        for x, y in zip(got, want):   # equal up to the order the edges of a row are summed in
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    moved = dst.copy()
    moved[0] = (dst[0] + 1) % n
    out, st = tg.attention(q, k, v, pairs[0][0], return_stats=True)
    with pytest.raises(ValueError, match="indptr|edge sets differ"):
        tg.attention_backward(do, q, k, v, out, st, tg.Graph.from_coo(src, moved, n, n))
    swapped = src.copy()
    same_row = np.flatnonzero(dst == dst[0])
    swapped[same_row[0]] = (src[same_row[0]] + 1) % n
    with pytest.raises(ValueError, match="edge sets differ"):
        tg.attention_backward(do, q, k, v, out, st, tg.Graph.from_coo(swapped, dst, n, n))


def test_stats_of_a_reordered_graph_are_refused_where_edge_values_follow_the_order():
    from tiga_numba import functional
    n = 12
    r = np.random.default_rng(2)
    src, dst = r.integers(0, n, 40), r.integers(0, n, 40)
    perm = np.argsort(-src, kind="stable")
    a, b = tg.Graph.from_coo(src, dst, n, n), tg.Graph.from_coo(src[perm], dst[perm], n, n)
    assert not np.array_equal(a.realize("cpu").indices, b.realize("cpu").indices)
    assert functional._same_relation(a, b)
    assert not functional._same_relation(a, b, edge_order=True)
    assert "order" in functional._relation_difference(a, b, edge_order=True)


def test_num_edges_is_exact_for_many_large_blocks():
    assert tg.Graph.cat([tg.Graph.dense(2**29)] * 64).num_edges == 2**64
    assert tg.Graph.cu_seqlens(np.arange(41) * 2**29, causal=False).num_edges == 40 * 2**58
    assert tg.Graph.cu_seqlens(np.arange(41) * 2**29, causal=True).num_edges == 40 * (2**29 * (2**29 + 1) // 2)
    n, left, right = 2**31, 2**20, 5   # rows lose left(left+1)/2 cells at the top, right(right+1)/2 at the bottom
    per_block = n * (left + right + 1) - left * (left + 1) // 2 - right * (right + 1) // 2
    assert tg.Graph.cat([tg.Graph.band(n, left=left, right=right)] * 2**10).num_edges == 2**10 * per_block
    assert str(2**64) in tg.Graph.cat([tg.Graph.dense(2**29)] * 64).explain()


def test_band_bounds_beyond_int64_mean_unbounded():
    """A bound larger than any relation (even beyond int64) reaches every key: the same edges as
    None; a hugely negative one reaches none."""
    n = 10
    assert tg.Graph.band(n, left=2**70).to_scipy().nnz == tg.Graph.triangular(n).num_edges
    assert tg.Graph.band(n, left=2**70, right=2**63).num_edges == n * n
    assert tg.Graph.band(n, left=-2**70, right=2**70).num_edges == 0
    assert tg.Graph.cu_seqlens([0, 4, n], window=(2**64, 0)).num_edges == tg.Graph.cu_seqlens([0, 4, n]).num_edges


def test_from_scipy_leaves_the_callers_matrix_as_it_was():
    m = sp.csr_matrix(([1.0, 2.0, 3.0], [2, 0, 2], [0, 3, 3]), shape=(2, 3))   # duplicate (0, 2), unsorted
    g = tg.Graph.from_scipy(m)
    assert g.num_edges == 2
    np.testing.assert_array_equal(m.data, [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(m.indices, [2, 0, 2])
    assert m.nnz == 3
    a = sp.csr_array(([1.0, 2.0, 3.0], [2, 0, 2], [0, 3, 3]), shape=(2, 3))
    tg.Graph.from_scipy(a)
    np.testing.assert_array_equal(a.indices, [2, 0, 2])


@pytest.mark.parametrize("shape", [(3,), (2, 2, 2)])
def test_from_scipy_refuses_arrays_that_are_not_2d(shape):
    """scipy's sparse arrays may be 1-D (csr, coo, dok) or n-D (coo): a relation needs rows
    and columns, and the error says so, naming the argument"""
    m = sp.coo_array(np.arange(1.0, 1.0 + np.prod(shape)).reshape(shape))
    with pytest.raises(ValueError, match=r"matrix must be 2-D .*" + re.escape(str(shape))):
        tg.Graph.from_scipy(m)
    if len(shape) == 1:
        with pytest.raises(ValueError, match="matrix must be 2-D"):
            tg.Graph.from_scipy(sp.csr_array(np.array([1.0, 0.0, 2.0])))


def test_backward_refuses_stats_of_another_scale():
    q, k, v, do = _small()
    g = tg.Graph.triangular(33)
    out, st = tg.attention(q, k, v, g, scale=0.5, return_stats=True)
    with pytest.raises(ValueError, match="stats.*scale"):
        tg.attention_backward(do, q, k, v, out, st, g)  # default scale 8 ** -0.5
    tg.attention_backward(do, q, k, v, out, st, g, scale=0.5)


def test_backward_refuses_stats_of_other_shapes():
    q, k, v, do = _small()
    g = tg.Graph.dense(33)
    out, st = tg.attention(q, k, v, g, return_stats=True)
    with pytest.raises(ValueError, match="stats"):  # same q/out shapes, other key width
        k2, v2 = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
        tg.attention_backward(do, q, k2, v2, out, st, g)
    with pytest.raises(ValueError, match="stats.m"):
        tg.attention_backward(do[:, :1], q[:, :1], k, v, out[:, :1], st, g)


def test_backward_accepts_equal_graphs_and_hand_built_stats():
    """An equal relation built again, stats as a plain object with .m/.l, and an
    AttentionStats without a forward plan (e.g. merged partial results) are accepted and
    give the same gradients."""
    q, k, v, do = _small(3)
    for make in (lambda: tg.Graph.triangular(33),
                 lambda: tg.Graph.cu_seqlens(np.array([0, 5, 5, 33])),
                 lambda: tg.Graph.from_scipy(sp.csr_matrix(np.tril(np.ones((33, 33)))))):
        g = make()
        out, st = tg.attention(q, k, v, g, return_stats=True)
        ref = tg.attention_backward(do, q, k, v, out, st, g)
        again = tg.attention_backward(do, q, k, v, out, st, make())
        plain = tg.attention_backward(do, q, k, v, out, types.SimpleNamespace(m=st.m, l=st.l), g)
        bare = tg.attention_backward(do, q, k, v, out, AttentionStats(st.m.copy(), st.l.copy()), g)
        for a, b, c, d in zip(ref, again, plain, bare):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(c, d)


# ----------------------------------------------------------------------------- array subclasses
@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")
def test_numpy_matrix_and_masked_inputs_are_refused_at_validation():
    r = np.random.default_rng(0)
    x = r.standard_normal((6, 4)).astype(np.float32)
    g = tg.Graph.dense(6)
    for name, args in (("q", (np.matrix(x), x, x)), ("k", (x, np.matrix(x), x)),
                       ("v", (x, x, np.matrix(x)))):
        with pytest.raises(TypeError, match=f"{name} is a numpy.matrix"):
            tg.attention(*args, g)
    with pytest.raises(TypeError, match="masked"):
        tg.attention(np.ma.masked_array(x, mask=x > 0), x, x, g)
    out, st = tg.attention(x, x, x, g, return_stats=True)
    with pytest.raises(TypeError, match="dout is a numpy.matrix"):
        tg.attention_backward(np.matrix(out), x, x, x, out, st, g)


# ----------------------------------------------------------------------------- graph inputs
@pytest.mark.parametrize("ctor", ["csr_indices", "csr_indptr", "coo", "cu_seqlens"])
def test_uint64_index_beyond_int64_is_reported_as_given(ctor):
    big = np.uint64(2**64 - 1)
    with pytest.raises(ValueError, match=str(2**64 - 1)):
        if ctor == "csr_indices":
            tg.Graph.from_csr(np.array([0, 1], np.uint64), np.array([big], np.uint64))
        elif ctor == "csr_indptr":
            tg.Graph.from_csr(np.array([0, big], np.uint64), np.array([0], np.uint64))
        elif ctor == "coo":
            tg.Graph.from_coo(np.array([0, big], np.uint64), np.array([0, 1], np.uint64))
        else:
            tg.Graph.cu_seqlens(np.array([0, big], np.uint64))


def _edges(graph):
    return set(zip(*graph.to_scipy().nonzero()))


def test_from_scipy_every_stored_position_is_an_edge():
    # DIA: offsets 0 and 1 with a zero stored on each diagonal: every in-bounds stored
    # position is an edge (scipy's own DIA -> CSR conversion would drop the zeros)
    data = np.array([[1.0, 0.0, 2.0, 3.0], [9.0, 4.0, 0.0, 5.0]])
    dia = sp.dia_matrix((data, [0, 1]), shape=(4, 4))
    want = {(i, i) for i in range(4)} | {(i, i + 1) for i in range(3)}
    assert _edges(tg.Graph.from_scipy(dia)) == want
    assert tg.Graph.from_scipy(dia).num_edges == 7
    # a negative offset and a rectangular shape
    dia2 = sp.dia_matrix((np.zeros((1, 5)), [-2]), shape=(4, 5))
    assert _edges(tg.Graph.from_scipy(dia2)) == {(2, 0), (3, 1)}
    # BSR: every element of a stored block, zeros included
    bsr = sp.bsr_matrix((np.array([[[1.0, 0.0], [0.0, 0.0]]]), [1], [0, 1, 1]), shape=(4, 4))
    assert _edges(tg.Graph.from_scipy(bsr)) == {(0, 2), (0, 3), (1, 2), (1, 3)}
    # COO / CSR / CSC: explicit zeros are edges, duplicates one edge
    coo = sp.coo_matrix(([1.0, 0.0, 0.0], ([0, 0, 2], [1, 1, 0])), shape=(3, 3))
    for m in (coo, coo.tocsr(), coo.tocsc(), sp.coo_array(coo)):
        g = tg.Graph.from_scipy(m)
        assert _edges(g) == {(0, 1), (2, 0)} and g.num_edges == 2
    # to drop zero values first, as the docstring says
    c = coo.tocsr()
    c.eliminate_zeros()
    assert _edges(tg.Graph.from_scipy(c)) == {(0, 1)}


def test_dia_graph_attention_matches_oracle():
    n = 20
    dia = sp.dia_matrix((np.zeros((3, n)), [-1, 0, 4]), shape=(n, n))
    g = tg.Graph.from_scipy(dia)
    q, k, v, do = _small(5, n=n)
    mask = np.zeros((n, n), bool)
    for off in (-1, 0, 4):
        i = np.arange(n)
        ok = (i - off >= 0) & (i - off < n)
        mask[(i - off)[ok], i[ok]] = True
    assert np.array_equal(dense_mask(g), mask)
    out = tg.attention(q, k, v, g)
    np.testing.assert_allclose(out, oracle(q, k, v, do, mask, 8 ** -0.5)["out"], atol=2e-6)


# ----------------------------------------------------------------------------- threading layers
def test_launch_lock_is_a_lock_only_where_the_layer_needs_one():
    from tiga_numba.cpu import threads
    layer = threads.active_layer()
    lock = threads.launch_lock()
    if layer in threads.THREAD_SAFE_LAYERS:
        assert lock is threads._NO_LOCK
    else:
        assert lock is threads._LOCK


def test_threads_per_launch_follow_items_and_work():
    from tiga_numba.cpu import threads
    g = threads.GRAIN
    assert threads.useful() >= 1
    assert threads.useful(items=0) == 1 and threads.useful(work=0) == 1
    assert threads.useful(items=3) == 3
    assert threads.useful(work=g) == 1 and threads.useful(work=g + 1) == 2
    assert threads.useful(items=5, work=100 * g) == 5
    assert threads.useful(items=50, work=3 * g) == 3


@numba.njit(parallel=True)
def _thread_ids(out):
    for i in numba.prange(out.shape[0]):
        out[i] = numba.get_thread_id()


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs two numba threads")
def test_a_small_launch_runs_on_the_calling_thread_and_restores_the_count():
    from tiga_numba.cpu import threads
    before = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        out = np.full(4096, -1, np.int64)
        threads.run(_thread_ids, threads.useful(out.shape[0], out.size), out)
        assert (out == 0).all()                   # one thread: the caller's
        assert numba.get_num_threads() == 2       # the caller's count is back
        threads.run(_thread_ids, 2, out)          # two threads asked and available
        assert numba.get_num_threads() == 2
        assert set(np.unique(out)) == {0, 1}
    finally:
        numba.set_num_threads(before)


_THREADS_SCRIPT = textwrap.dedent("""
    import threading
    import numpy as np
    import numba
    import scipy.sparse as sp
    import tiga_numba as tg
    r = np.random.default_rng(0)
    q, k, v = (r.standard_normal((150, 2, 16)).astype(np.float32) for _ in range(3))
    graphs = [tg.Graph.triangular(150),
              tg.Graph.from_scipy(sp.random(150, 150, density=0.05, random_state=0, format="csr"))]
    refs = [tg.attention(q, k, v, g, return_stats=True) for g in graphs]
    grads = [tg.attention_backward(q, q, k, v, o, s, g) for g, (o, s) in zip(graphs, refs)]
    bad = []
    def work(t):
        for it in range(12):
            g = graphs[(t + it) % 2]
            o, s = tg.attention(q, k, v, g, return_stats=True)
            d = tg.attention_backward(q, q, k, v, o, s, g)
            ok = np.array_equal(o, refs[(t + it) % 2][0]) and all(
                np.array_equal(a, b) for a, b in zip(d, grads[(t + it) % 2]))
            if not ok:
                bad.append((t, it))
    ts = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in ts: t.start()
    for t in ts: t.join()
    print("layer", numba.threading_layer(), "bad", bad)
""")


def test_concurrent_calls_on_the_workqueue_layer(tmp_path):
    """numba's workqueue layer terminates the process on concurrent parallel launches; the
    CPU entry points take turns on it, with the same results as one thread."""
    env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue", NUMBA_NUM_THREADS="2")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "layer workqueue bad []" in res.stdout, res.stdout + res.stderr[-2000:]


# ----------------------------------------------------------------------------- fuzz

FUZZ_FWD_TOL = {np.float16: 4e-3, np.float32: 2e-5, np.float64: 1e-11}
FUZZ_BWD_TOL = {np.float16: 2e-2, np.float32: 1e-4, np.float64: 1e-10}


@st.composite
def fuzz_case(draw):
    """A relation with sources that no destination attends and destinations with no edges,
    and the inputs: non-finite values only in those sources' k/v rows and those
    destinations' q/dout rows."""
    kind = draw(st.sampled_from(["dense", "triangular", "cu_seqlens", "csr"]))
    dtype = draw(st.sampled_from([np.float16, np.float32, np.float64]))
    h, hkv = draw(st.sampled_from([(1, 1), (2, 1), (4, 2)]))
    d = draw(st.sampled_from([1, 4, 16]))
    dv = draw(st.sampled_from([1, 8]))
    mag = draw(st.sampled_from([1e-2, 1.0, 4.0]))
    vmag = draw(st.sampled_from([1.0, 100.0]))
    seed = draw(st.integers(0, 2**16))
    r = np.random.default_rng(seed)
    if kind == "csr":
        nd, ns = draw(st.integers(1, 40)), draw(st.integers(1, 40))
        deg = r.integers(0, min(ns, 6) + 1, size=nd)
        deg[r.random(nd) < 0.2] = 0
        live_src = r.random(ns) < 0.7  # the other sources get no edge at all
        cand = np.flatnonzero(live_src)
        rows = [np.sort(r.choice(cand, size=min(int(k), cand.size), replace=False)) for k in deg]
        indptr = np.concatenate([[0], np.cumsum([x.size for x in rows])])
        idx = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        g = tg.Graph.from_csr(indptr, idx, num_src=ns)
    else:
        if kind == "dense":
            base = tg.Graph.dense(draw(st.integers(1, 70)), draw(st.integers(1, 70)))
        elif kind == "triangular":
            base = tg.Graph.triangular(draw(st.integers(1, 140)))
        else:
            lens = draw(st.lists(st.integers(0, 70), min_size=1, max_size=4))
            base = tg.Graph.cu_seqlens(np.concatenate([[0], np.cumsum(lens)]),
                                       causal=draw(st.booleans()))
        parts = [base]
        if draw(st.booleans()):  # keys no destination attends
            parts.insert(draw(st.integers(0, len(parts))), tg.Graph.dense(draw(st.integers(1, 9)), 0))
        if draw(st.booleans()):  # destinations with no edges
            parts.insert(draw(st.integers(0, len(parts))), tg.Graph.dense(0, draw(st.integers(1, 9))))
        g = parts[0] if len(parts) == 1 else tg.Graph.cat(parts)
    mask = dense_mask(g)
    q = r.standard_normal((g.num_dst, h, d)) * mag
    k = r.standard_normal((g.num_src, hkv, d)) * mag
    v = r.standard_normal((g.num_src, hkv, dv)) * vmag
    dout = r.standard_normal((g.num_dst, h, dv))
    q, k, v, dout = (x.astype(dtype) for x in (q, k, v, dout))
    bad_src = np.flatnonzero(~mask.any(axis=0))
    bad_dst = np.flatnonzero(~mask.any(axis=1))
    poison = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    for arr, rows in ((k, bad_src), (v, bad_src), (q, bad_dst), (dout, bad_dst)):
        if rows.size and draw(st.booleans()):
            i = rows[r.integers(rows.size)]
            arr[i, r.integers(arr.shape[1]), r.integers(arr.shape[2])] = poison
    return g, mask, q, k, v, dout, bad_src, bad_dst


def _zero_rows(x, rows):
    x = np.array(x, np.float64)
    x[rows] = 0.0
    return x


@settings(max_examples=30, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(fuzz_case())
def test_fuzz_against_float64_with_non_finite_values_outside_the_relation(case):
    g, mask, q, k, v, dout, bad_src, bad_dst = case
    dt = q.dtype.type
    scale = q.shape[2] ** -0.5
    # the oracle sees the poisoned rows as zeros: they are outside every row's relation
    ref = oracle(_zero_rows(q, bad_dst), _zero_rows(k, bad_src), _zero_rows(v, bad_src),
                 _zero_rows(dout, bad_dst), mask, scale)
    out, stats = tg.attention(q, k, v, g, return_stats=True)
    dq, dk, dv = tg.attention_backward(dout, q, k, v, out, stats, g)
    eps_acc = float(np.finfo(np.float64 if dt == np.float64 else np.float32).eps)
    # Delta = rowsum(dout * out) is formed from the stored output, which float16 rounds (as
    # flash-attn's backward does): that rounding, not the accumulator's, bounds the
    # cancellation in p * (dp - Delta) there (seen: float16 segments, |v| ~ 100, dk off by 0.15)
    eps_delta = max(eps_acc, float(np.finfo(dt).eps))
    for name, got, tol in (("out", out, FUZZ_FWD_TOL[dt]), ("dq", dq, FUZZ_BWD_TOL[dt]),
                           ("dk", dk, FUZZ_BWD_TOL[dt]), ("dv", dv, FUZZ_BWD_TOL[dt])):
        assert got.dtype == dt and got.shape == ref[name].shape, name
        assert np.all(np.isfinite(got)), f"{name}: non-finite values ({g.explain()})"
        err = np.abs(np.asarray(got, np.float64) - ref[name])
        bound = tol * max(1.0, float(np.abs(ref[name]).max(initial=0.0)))
        if name in ("dq", "dk"):  # plus the rounding bound of p * (dp - Delta)
            bound = bound + 4 * max(q.shape[2], v.shape[2]) * eps_delta * ref["bound_" + name]
        assert np.all(err <= bound), (name, float(err.max(initial=0)), g.explain())
    empty = ~mask.any(axis=1)
    assert np.all(np.isneginf(stats.m[empty])) and np.all(stats.l[empty] == 0)
    assert np.all(out[empty] == 0) and np.all(dq[empty] == 0)
    assert np.all(dk[bad_src] == 0) and np.all(dv[bad_src] == 0)


@pytest.mark.parametrize("make", [lambda: tg.Graph.triangular(130),
                                  lambda: tg.Graph.cu_seqlens(np.array([0, 130])),
                                  lambda: tg.Graph.band(130, left=40, right=0)],
                         ids=["triangular", "cu_seqlens", "window"])
def test_nan_beyond_causal_diagonal_does_not_leak(make):
    """A NaN value right of the causal diagonal reaches no earlier row of its query tile
    (a masked entry contributes nothing, not 0 * value; the CPU kernels' one-gemm path for
    band-cut tiles is taken only when every value is finite)."""
    g = make()
    q, k, v, dout = _small(7, n=130)
    v[120, 0, 3] = np.nan
    mask = dense_mask(g)
    out, stats = tg.attention(q, k, v, g, return_stats=True)
    dq, dk, dv = tg.attention_backward(dout, q, k, v, out, stats, g)
    clean = v.copy()
    clean[120, 0, 3] = 0.0
    ref = oracle(q, k, clean, dout, mask, 8 ** -0.5)
    rows = slice(0, 120)  # rows that do not attend key 120
    np.testing.assert_allclose(out[rows], ref["out"][rows], atol=2e-5)
    np.testing.assert_allclose(dq[rows], ref["dq"][rows], atol=1e-4)


def test_one_row_arrays_with_odd_strides_are_read_as_any_other(dtype=np.float64):
    """numpy calls a one-row view with a negative (or odd) row stride C-contiguous; the kernels
    read it through canonical strides, so a BLAS never sees a negative leading dimension: the
    gradients equal those of the plain array, with soft-cap and ALiBi (modifier kernels) too.
    (One dtype, one modifier, one relation: float32, ALiBi and the cu_seqlens form took the same
    path, and each adds kernels to compile.)"""
    rng = np.random.default_rng(11)
    q, dout = (rng.standard_normal((1, 1, 8)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((40, 1, 8)).astype(dtype) for _ in range(2))
    for g in (tg.Graph.dense(40, 1),):
        for kw in ({}, {"softcap": 5.0}):
            out, st = tg.attention(q, k, v, g, return_stats=True, **kw)
            want = tg.attention_backward(dout, q, k, v, out, st, g, **kw)
            for name, flipped in (("dout", dout[::-1]), ("q", q[::-1]), ("out", out[::-1])):
                assert flipped.flags.c_contiguous and flipped.strides[0] < 0
                args = dict(dout=dout, q=q, out=out)
                args[name] = flipped
                got = tg.attention_backward(args["dout"], args["q"], k, v, args["out"], st, g, **kw)
                for a, b in zip(got, want):
                    np.testing.assert_array_equal(a, b, err_msg=f"{name} {kw}")


def test_a_nan_score_inside_a_row_makes_that_rows_gradient_shares_nan():
    """A NaN key inside a row makes the row's probabilities NaN (l = NaN): every gradient that row
    contributes to is NaN, as the math gives, never a finite value missing the row's share; rows
    without the NaN key keep finite results."""
    f = np.float32
    q = np.ones((2, 1, 2), f)
    k = np.ones((3, 1, 2), f)
    v = np.arange(6, dtype=f).reshape(3, 1, 2)
    dout = np.ones((2, 1, 2), f)
    k[0, 0, 0] = np.nan
    g = tg.Graph.from_csr(np.array([0, 2, 4]), np.array([0, 1, 1, 2]), num_src=3)  # 0 <- {0, 1}, 1 <- {1, 2}
    out, st = tg.attention(q, k, v, g, return_stats=True)
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all() and np.isnan(st.l[0, 0])
    dq, dk, dv = tg.attention_backward(dout, q, k, v, out, st, g)
    assert np.isnan(dv[0]).all() and np.isnan(dv[1]).all()   # row 0 reads keys 0 and 1
    np.testing.assert_allclose(dv[2], 0.5)                     # key 2: row 1's half only
    assert np.isnan(dq[0]).all() and np.isfinite(dq[1]).all()
