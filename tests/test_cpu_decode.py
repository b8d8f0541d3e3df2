"""The CPU split-key kernels (cpu.decode) for few-query block relations, forward and backward,
against the float64 oracle on fresh random inputs: one query over a long key range, rectangular
cu_seqlens with bottom-right causal masks and windows, empty segments and rows without keys,
grouped-query heads, several key chunks per block, float32 and float64, strided k / v read in
place; values outside every row's relation set to NaN / inf; same bits for any thread count;
exact gradients at scores up to 1e8; routing (more than 8 query rows per block, float16,
modifiers: cpu.blocks)."""
import numpy as np
import pytest

import tiga_numba as tg
from tiga_numba import functional
from tiga_numba.cpu import decode

from conftest import attention_oracle, numba_threads

TOL = {np.float32: (3e-6, 2e-5), np.float64: (1e-12, 1e-10)}


def _mask(g):
    return np.asarray(g.to_scipy().toarray() != 0)


def _graphs():
    cq = [0, 1, 1, 4, 9, 10]
    ck = [0, 1500, 1510, 3000, 3003, 3100]   # long, short, Lq > Lk, a segment with no queries
    return {
        "one_query": lambda: tg.Graph.dense(2 * decode.CHUNK + 37, 1),
        "varlen": lambda: tg.Graph.cu_seqlens(cq, cu_seqlens_k=ck, causal=False),
        "varlen_causal": lambda: tg.Graph.cu_seqlens(cq, cu_seqlens_k=ck, causal=True),
        "varlen_window": lambda: tg.Graph.cu_seqlens(cq, cu_seqlens_k=ck, causal=True, window=(700, 0)),
        "rows_without_keys": lambda: tg.Graph.cu_seqlens([0, 3, 6], cu_seqlens_k=[0, 1, 1300], causal=True),
    }


def _inputs(g, H, Hkv, D, Dv, dtype, seed):
    r = np.random.default_rng(seed)
    q = r.standard_normal((g.num_dst, H, D)).astype(dtype)
    k = r.standard_normal((g.num_src, Hkv, D)).astype(dtype)
    v = r.standard_normal((g.num_src, Hkv, Dv)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("name", list(_graphs()))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("H, Hkv", [(4, 4), (6, 2)])
def test_decode_forward_vs_oracle(name, dtype, H, Hkv):
    g = _graphs()[name]()
    q, k, v = _inputs(g, H, Hkv, 40, 24, dtype, seed=hash((name, H)) % 2**32)
    mask = _mask(g)
    # values no row's relation reaches: NaN / inf must not reach any output (the oracle gets the
    # clean values: it multiplies every cell, masked ones by 0)
    unreached = ~mask.any(axis=0)
    kd, vd = k.copy(), v.copy()
    kd[unreached], vd[unreached] = np.nan, np.inf
    out, st = tg.attention(q, kd, vd, g, scale=0.2, return_stats=True)
    plan = functional.last_plan()
    assert plan.family == "cpu.decode", plan.explain()
    assert plan.run_info["copies"] == [f"q -> contiguous (N, H, D) {np.dtype(dtype).name} "
                                       "(pre-scaled by scale*log2(e))"]   # k, v read in place
    ro, rm, rl = attention_oracle(q, k, v, mask, scale=0.2)
    atol, _ = TOL[dtype]
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ro, atol=atol, rtol=atol)
    live = np.isfinite(rm)
    np.testing.assert_allclose(st.m[live], rm[live], rtol=atol, atol=atol)
    assert np.all(st.m[~live] == -np.inf) and np.all(st.l[~live] == 0)
    np.testing.assert_allclose(st.l, rl, rtol=atol * 10)
    assert np.all(out[~mask.any(axis=1)] == 0)


def test_decode_reads_strided_kv_in_place_and_any_thread_count_gives_the_same_bits():
    g = tg.Graph.dense(3 * decode.CHUNK + 5, 2)
    r = np.random.default_rng(7)
    q = r.standard_normal((2, 8, 64)).astype(np.float32)
    kv = r.standard_normal((g.num_src, 2, 2, 64)).astype(np.float32)   # k and v interleaved
    k, v = kv[:, 0], kv[:, 1]
    out = tg.attention(q, k, v, g)
    assert functional.last_plan().run_info["copies"][1:] == []   # only q is copied (pre-scaled)
    ro, _, _ = attention_oracle(q, k, v, _mask(g))
    np.testing.assert_allclose(out, ro, atol=3e-6, rtol=3e-6)
    with numba_threads(1):
        one = tg.attention(q, k, v, g)
    assert np.array_equal(out, one)


@pytest.mark.parametrize("name", ["one_query", "varlen_causal", "varlen_window", "rows_without_keys"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_decode_backward_vs_oracle(name, dtype):
    """The split-key backward (cpu.decode) from the split-key forward's stats: dq, dk, dv against
    the oracle, NaN / inf in k / v rows no relation reaches, same bits with one thread."""
    g = _graphs()[name]()
    q, k, v = _inputs(g, 6, 2, 32, 24, dtype, seed=hash(name) % 2**32)
    dout = np.random.default_rng(4).standard_normal((g.num_dst, 6, 24)).astype(dtype)
    mask = _mask(g)
    unreached = ~mask.any(axis=0)
    kd, vd = k.copy(), v.copy()
    kd[unreached], vd[unreached] = np.nan, np.inf
    out, st = tg.attention(q, kd, vd, g, return_stats=True)
    assert functional.last_plan().family == "cpu.decode"
    grads = tg.attention_backward(dout, q, kd, vd, out, st, g)
    assert functional.last_plan().family == "cpu.decode", functional.last_plan().explain()
    _, _, _, rdq, rdk, rdv = attention_oracle(q, k, v, mask, dout=dout)
    _, btol = TOL[dtype]
    for nm, got, want in zip(("dq", "dk", "dv"), grads, (rdq, rdk, rdv)):
        assert np.all(np.isfinite(got)), nm
        np.testing.assert_allclose(got, want, atol=btol, rtol=btol, err_msg=nm)
    with numba_threads(1):
        grads1 = tg.attention_backward(dout, q, kd, vd, out, st, g)
    for a, b in zip(grads, grads1):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("max_score", [5e4, 1e6, 1e8])
def test_decode_backward_exact_at_large_scores(max_score):
    """The backward recomputes each score with the forward's own loop, so exp2(s - m2) of a row's
    largest score is exactly 1 at any magnitude (test_robustness's bounds)."""
    from test_robustness import assert_large_score_accuracy
    r = np.random.default_rng(int(np.log10(max_score)))
    g = tg.Graph.cu_seqlens([0, 2, 4], cu_seqlens_k=[0, 1400, 3000], causal=True)
    mask = _mask(g)
    q, k, v, do = (r.standard_normal(s) for s in ((4, 2, 16), (3000, 1, 16), (3000, 1, 16), (4, 2, 16)))
    raw = np.abs(np.einsum("ihd,jhd->hij", q, np.repeat(k, 2, 1)) * 0.3)
    amp = np.sqrt(max_score / raw[:, mask].max())
    q, k, v, do = (x.astype(np.float32) for x in (q * amp, k * amp, v, do))
    out, st = tg.attention(q, k, v, g, scale=0.3, return_stats=True)
    dq, dk, dv = tg.attention_backward(do, q, k, v, out, st, g, scale=0.3)
    assert functional.last_plan().family == "cpu.decode"
    assert_large_score_accuracy(q, k, v, do, mask, 0.3, out, st.m, dq, dk, dv)


def test_work_items_cover_each_block_once_in_key_order():
    g = tg.Graph.cu_seqlens([0, 2, 2, 5], cu_seqlens_k=[0, 2500, 2600, 2700], causal=True)
    rel = g.realize("cpu")
    items, groups = decode.work_items(rel, chunk=1000)
    # block 0: 2 rows over 2500 keys (causal bottom-right: both see nearly all); block 1 has no rows
    assert items[:, 0].tolist() == [0, 0, 0, 2] and groups.tolist() == [0, 3, 4]
    assert items[:3, 1:].tolist() == [[0, 1000], [1000, 2000], [2000, 2500]]


@pytest.mark.parametrize("why", ["rows", "float16", "modifier"])
def test_other_requests_go_to_the_block_kernels(why):
    g = tg.Graph.dense(500, 9) if why == "rows" else tg.Graph.dense(500, 3)
    dtype = np.float16 if why == "float16" else np.float32
    q, k, v = _inputs(g, 2, 2, 16, 16, dtype, seed=1)
    kw = {"softcap": 5.0} if why == "modifier" else {}
    out = tg.attention(q, k, v, g, **kw)
    plan = functional.last_plan()
    assert plan.family == "cpu.blocks"
    assert "cpu.decode" in plan.explain()   # considered, and why refused
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_non_finite_scores_inside_a_row_as_the_math_gives(dtype):
    """Scores inside a row's relation that are not finite: -inf adds nothing (the row's result is
    that of the other keys), NaN or +inf makes the row NaN (m, l and out), as libm's exp2 gives
    them; other heads stay finite. One query over several key chunks, so the odd keys sit in the
    middle of a chunk's weights and of its four-row accumulation."""
    g = tg.Graph.dense(2 * decode.CHUNK + 37, 1)
    q, k, v = _inputs(g, 3, 3, 8, 8, dtype, seed=5)
    q = np.abs(q) + dtype(0.1)   # positive: a key row of -inf / +inf gives a score of -inf / +inf
    k[1500, 0] = -np.inf
    k[700, 1, 3] = np.nan
    k[2050, 2] = np.inf
    out, st = tg.attention(q, k, v, g, return_stats=True)
    assert functional.last_plan().family == "cpu.decode"
    keep = np.ones(g.num_src, bool)
    keep[1500] = False
    want = attention_oracle(q[:, :1], k[keep][:, :1], v[keep][:, :1], np.ones((1, keep.sum()), bool), 8 ** -0.5)
    np.testing.assert_allclose(out[:, 0], want[0][:, 0], rtol=TOL[dtype][0] * 10, atol=TOL[dtype][1])
    for h in (1, 2):
        assert np.isnan(out[0, h]).all() and np.isnan(st.l[0, h]), h
