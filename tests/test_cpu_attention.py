"""CPU backend (tiga_numba/cpu): forward and fused backward against the float64 oracle.

Shapes are small and reused (the compile cache is shared by every test of one dtype):
the kernels compile once per accumulation dtype and kernel family.
"""
import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiga_numba as tg
from tiga_numba import functional, reference
from tiga_numba.cpu import api
from tiga_numba.graph import BlockRelation, Graph

TOL = {np.float16: 3e-3, np.float32: 3e-5, np.float64: 1e-11}
DTYPES = [np.float16, np.float32, np.float64]


def _graphs():
    indptr = np.array([0, 3, 3, 5, 5, 9, 9], np.int64)  # empty rows 1, 3, 5; a repeated edge
    indices = np.array([0, 2, 5, 1, 1, 0, 3, 4, 6], np.int32)
    return {
        # sizes chosen to cross the CPU tiles (BM = 64 rows, BN = 128 columns)
        "dense_rect": Graph.dense(300, 37),  # 37 queries x 300 keys: three key tiles
        "triangular": Graph.triangular(150),  # three query tiles, two key tiles, diagonal masks
        "segments_causal": Graph.cu_seqlens(np.array([0, 0, 1, 70, 71, 141, 341]), causal=True),
        "segments_full": Graph.cu_seqlens(np.array([0, 5, 5, 100]), causal=False),
        "csr": Graph.from_csr(indptr, indices, num_src=7),
    }


GRAPHS = _graphs()


def _inputs(rng, g, dt, H, Hkv, D=16, Dv=8):
    q = rng.standard_normal((g.num_dst, H, D)).astype(dt)
    k = rng.standard_normal((g.num_src, Hkv, D)).astype(dt)
    v = rng.standard_normal((g.num_src, Hkv, Dv)).astype(dt)
    do = rng.standard_normal((g.num_dst, H, Dv)).astype(dt)
    return q, k, v, do


def _close(got, want, dt, name):
    got = np.asarray(got, np.float64)
    tol = TOL[dt] * max(1.0, float(np.abs(want).max()) if want.size else 1.0)
    err = float(np.abs(got - want).max()) if want.size else 0.0
    assert np.isfinite(got).all(), f"{name}: non-finite values"
    assert err <= tol, f"{name}: max abs err {err:.3g} > {tol:.3g}"


def _check_stats(m, l, rm, rl, dt):
    fin = np.isfinite(rm)
    assert np.array_equal(np.isfinite(m), fin), "m must be -inf exactly on empty rows"
    assert np.all(np.asarray(m)[~fin] == -np.inf)
    assert np.all(np.asarray(l)[~fin] == 0)
    if fin.any():
        _close(np.asarray(m)[fin], rm[fin], dt, "m")
        _close(l, rl, dt, "l")


def _check_all(g, q, k, v, do, dt):
    out, stats = tg.attention(q, k, v, g, return_stats=True)
    assert out.dtype == q.dtype and out.shape == (g.num_dst, q.shape[1], v.shape[2])
    acc = np.float64 if dt == np.float64 else np.float32
    assert stats.m.dtype == acc and stats.l.dtype == acc
    ro, rm, rl = reference.attention(q, k, v, g, return_stats=True)
    _close(out, ro, dt, "out")
    _check_stats(stats.m, stats.l, rm, rl, dt)
    dq, dk, dv = tg.attention_backward(do, q, k, v, out, stats, g)
    # the oracle differentiates the same function at the same (rounded) inputs
    rdq, rdk, rdv, _ = reference.attention_backward(do, q, k, v, g)
    for got, want, name in ((dq, rdq, "dq"), (dk, rdk, "dk"), (dv, rdv, "dv")):
        assert got.dtype == q.dtype and got.shape == want.shape, name
        _close(got, want, dt, name)
    return out, stats


@pytest.mark.parametrize("kind", list(GRAPHS))
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
def test_forward_backward_vs_oracle(kind, dt, heads):
    rng = np.random.default_rng(hash((kind, np.dtype(dt).name, heads)) % 2**32)
    g = GRAPHS[kind]
    q, k, v, do = _inputs(rng, g, dt, *heads)
    _check_all(g, q, k, v, do, dt)
    info = functional.last_plan().run_info
    assert info["kernel"].startswith("cpu.")
    assert isinstance(info["copies"], list) and info["cache"] in ("memory hit", "disk hit", "compiled")


def test_empty_rows_csr_no_nan():
    g = GRAPHS["csr"]
    rng = np.random.default_rng(1)
    q, k, v, do = _inputs(rng, g, np.float32, 2, 1)
    out, stats = tg.attention(q, k, v, g, return_stats=True)
    empty = np.diff(np.array([0, 3, 3, 5, 5, 9, 9])) == 0
    assert np.all(out[empty] == 0) and np.all(stats.m[empty] == -np.inf)
    assert np.all(stats.l[empty] == 0)
    dq, dk, dv = tg.attention_backward(do, q, k, v, out, stats, g)
    assert np.all(dq[empty] == 0)
    assert all(np.isfinite(x).all() for x in (out, dq, dk, dv))


def _plan(scale, prune=None):
    return SimpleNamespace(scale=scale, prune_threshold=prune, run_info={})


def test_block_with_no_sources_gives_empty_rows():
    # a rectangular block with 3 destinations and no sources, then a 5 x 6 dense block
    rel = BlockRelation(dst_offsets=np.array([0, 3, 8], np.int64),
                        src_offsets=np.array([0, 0, 6], np.int64),
                        causal=np.zeros(2, np.uint8), max_block_dst=5, max_block_src=6)
    rng = np.random.default_rng(2)
    q = rng.standard_normal((8, 2, 16)).astype(np.float32)
    k = rng.standard_normal((6, 2, 16)).astype(np.float32)
    v = rng.standard_normal((6, 2, 8)).astype(np.float32)
    out, m, l, m2 = api.forward(_plan(0.25), q, k, v, rel)  # m2: the kernels' base-2 row max
    assert np.all(out[:3] == 0) and np.all(m[:3] == -np.inf) and np.all(l[:3] == 0)
    assert np.all(m2[:3] == -np.inf)
    want = reference.attention(q[3:], k, v, Graph.dense(6, 5), scale=0.25)
    _close(out[3:], want, np.float32, "out")
    do = rng.standard_normal(out.shape).astype(np.float32)
    dq, dk, dv, db = api.backward(_plan(0.25), do, q, k, v, out, m, l, rel, None, m_kernel=m2)
    assert db is None and np.all(dq[:3] == 0)
    rdq, rdk, rdv, _ = reference.attention_backward(do[3:], q[3:], k, v, Graph.dense(6, 5),
                                                     scale=0.25)
    _close(dq[3:], rdq, np.float32, "dq")
    _close(dk, rdk, np.float32, "dk")
    _close(dv, rdv, np.float32, "dv")


@pytest.mark.parametrize("kind", ["triangular", "csr"])
def test_strided_inputs(kind):
    g = GRAPHS[kind]
    rng = np.random.default_rng(3)
    big = rng.standard_normal((g.num_dst, 4, 40)).astype(np.float32)
    q = big[:, ::2, 3:35:2]  # (N, 2, 16), strided in every axis
    kb = rng.standard_normal((2, g.num_src, 2, 16)).astype(np.float32)
    k = kb[1].transpose(0, 1, 2)[:, ::-1]  # negative head stride
    v = np.asfortranarray(rng.standard_normal((g.num_src, 2, 8)).astype(np.float32))
    do = rng.standard_normal((g.num_dst, 2, 8)).astype(np.float32)[::-1].copy()[::-1]
    assert not q.flags.c_contiguous and not k.flags.c_contiguous
    _check_all(g, q, k, v, do, np.float32)
    assert any("q ->" in c for c in functional.last_plan().run_info["copies"])


def test_backward_is_deterministic():
    for kind in ("triangular", "csr"):
        g = GRAPHS[kind]
        rng = np.random.default_rng(4)
        q, k, v, do = _inputs(rng, g, np.float32, 4, 2)
        out, stats = tg.attention(q, k, v, g, return_stats=True)
        first = tg.attention_backward(do, q, k, v, out, stats, g)
        for _ in range(3):
            again = tg.attention_backward(do, q, k, v, out, stats, g)
            for a, b in zip(first, again):
                assert np.array_equal(a, b), kind


@pytest.mark.parametrize("D", [0, 16])
def test_csr_edge_bias_and_edge_score(D):
    """edge_bias (E, H) is added to the scaled score; D == 0 is a precomputed edge score."""
    g = GRAPHS["csr"]
    rng = np.random.default_rng(5 + D)
    q, k, v, do = _inputs(rng, g, np.float32, 2, 1, D=D)
    bias = rng.standard_normal((g.num_edges, 2)).astype(np.float32)
    scale = 0.5
    out, stats, plan = functional.run_forward(q, k, v, g, scale=scale, edge_bias=bias)
    ro, rm, rl = reference.attention(q, k, v, g, scale=scale, edge_bias=bias, return_stats=True)
    _close(out, ro, np.float32, "out")
    _check_stats(stats.m, stats.l, rm, rl, np.float32)
    dq, dk, dv, dbias, _ = functional.run_backward(do, q, k, v, out, stats, g, scale=scale,
                                                   edge_bias=bias)
    rdq, rdk, rdv, rdb = reference.attention_backward(do, q, k, v, g, scale=scale,
                                                      edge_bias=bias)
    assert dbias.shape == (g.num_edges, 2) and dbias.dtype == np.float32
    for got, want, name in ((dq, rdq, "dq"), (dk, rdk, "dk"), (dv, rdv, "dv"),
                            (dbias, rdb, "dbias")):
        _close(got, want, np.float32, name)


def test_run_info_and_ir():
    g = GRAPHS["csr"]
    rng = np.random.default_rng(6)
    q, k, v, _ = _inputs(rng, g, np.float64, 2, 2)
    tg.attention(q, k, v, g)
    info = functional.last_plan().run_info
    assert info["kernel"].startswith("cpu.csr")
    text = info["ir"]["llvm"]()
    assert "define" in text and len(text) > 1000


# ---------------------------------------------------------------- property-based graphs
@st.composite
def csr_graphs(draw):
    num_src = draw(st.integers(1, 12))
    degrees = draw(st.lists(st.integers(0, 5), min_size=1, max_size=12))
    indices = [draw(st.integers(0, num_src - 1)) for _ in range(sum(degrees))]
    indptr = np.concatenate([[0], np.cumsum(degrees)]).astype(np.int64)
    return Graph.from_csr(indptr, np.array(indices, np.int32), num_src=num_src)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(g=csr_graphs(), seed=st.integers(0, 2**31 - 1))
def test_random_csr_graphs(g, seed):
    rng = np.random.default_rng(seed)
    q, k, v, do = _inputs(rng, g, np.float32, 2, 1)
    if g.num_edges == 0:
        return  # the front end answers without a kernel; covered by test_api_errors / test_contract
    _check_all(g, q, k, v, do, np.float32)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.sampled_from([0, 1, 2, 3, 17, 64, 65, 90]), min_size=1, max_size=5),
       causal=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_random_segments(lengths, causal, seed):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    g = Graph.cu_seqlens(cu, causal=causal)
    if g.num_edges == 0:
        return
    rng = np.random.default_rng(seed)
    q, k, v, do = _inputs(rng, g, np.float32, 2, 1)
    _check_all(g, q, k, v, do, np.float32)


def test_large_scores_do_not_overflow():
    """Scores far from 0 (|s| ~ 1e3): the running max keeps exp in range."""
    g = GRAPHS["triangular"]
    rng = np.random.default_rng(7)
    q, k, v, do = _inputs(rng, g, np.float32, 2, 2)
    q = q * 40
    out, stats = tg.attention(q, k, v, g, return_stats=True)
    ro, rm, rl = reference.attention(q, k, v, g, return_stats=True)
    assert np.isfinite(out).all()
    _close(out, ro, np.float32, "out")
    assert math.isfinite(float(np.abs(stats.m).max()))


def test_csr_minus_inf_bias_masks_edges():
    """An edge_bias of -inf removes the edge; a row whose edges are all removed is empty."""
    g = GRAPHS["csr"]
    rng = np.random.default_rng(8)
    q, k, v, do = _inputs(rng, g, np.float32, 2, 1)
    bias = rng.standard_normal((g.num_edges, 2)).astype(np.float32)
    bias[1] = -np.inf  # row 0 keeps edges 0 and 2
    bias[3:5] = -np.inf  # row 2 (edges 3, 4) loses everything
    out, stats, _ = functional.run_forward(q, k, v, g, edge_bias=bias)
    assert np.all(out[2] == 0) and np.all(stats.m[2] == -np.inf) and np.all(stats.l[2] == 0)
    keep = np.isfinite(bias[:, 0])
    indptr = np.array([0, 3, 3, 5, 5, 9, 9])
    rows = np.repeat(np.arange(6), np.diff(indptr))
    kept = Graph.from_coo(np.array([0, 2, 5, 1, 1, 0, 3, 4, 6])[keep], rows[keep],
                          num_src=7, num_dst=6)
    want = reference.attention(q, k, v, kept, edge_bias=bias[keep])
    _close(out, want, np.float32, "out")
    dq, dk, dv, dbias, _ = functional.run_backward(do, q, k, v, out, stats, g, edge_bias=bias)
    rdq, rdk, rdv, rdb = reference.attention_backward(do, q, k, v, kept, edge_bias=bias[keep])
    for got, want_, name in ((dq, rdq, "dq"), (dk, rdk, "dk"), (dv, rdv, "dv"),
                             (dbias[keep], rdb, "dbias")):
        _close(got, want_, np.float32, name)
    assert np.all(dbias[~keep] == 0)


def test_subnormal_mode_is_restored():
    """The kernels flush subnormals while they run (speed) and must leave every thread's
    floating-point mode as they found it."""
    from numba import njit, prange

    @njit(parallel=True)
    def tiny(x, out):
        for i in prange(out.shape[0]):
            out[i] = x[i] * x[i]

    g = GRAPHS["triangular"]
    rng = np.random.default_rng(9)
    q, k, v, do = _inputs(rng, g, np.float32, 2, 2)
    out, stats = tg.attention(q, k, v, g, return_stats=True)
    tg.attention_backward(do, q, k, v, out, stats, g)
    x = np.full(64, 1e-20, np.float32)
    res = np.empty(64, np.float32)
    tiny(x, res)
    assert np.all(res > 0), "a numba worker thread was left in flush-to-zero mode"
    assert x[0] * x[0] > 0, "the calling thread was left in flush-to-zero mode"


def test_same_bits_with_any_thread_count():
    """dq is summed over a fixed number of partitions (api.N_PARTS), not over threads."""
    import numba
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs two numba threads")
    before = numba.get_num_threads()
    try:
        for kind in ("dense_rect", "segments_causal", "csr"):
            g = GRAPHS[kind]
            rng = np.random.default_rng(10)
            q, k, v, do = _inputs(rng, g, np.float32, 4, 2)
            runs = []
            for threads in (1, 2):
                numba.set_num_threads(threads)
                out, stats = tg.attention(q, k, v, g, return_stats=True)
                grads = tg.attention_backward(do, q, k, v, out, stats, g)
                runs.append([x.tobytes() for x in (out, stats.m, stats.l) + tuple(grads)])
            assert runs[0] == runs[1], kind
    finally:
        numba.set_num_threads(before)
