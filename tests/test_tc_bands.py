"""Banded blocks on the tensor-core kernels (warp emulator, no GPU): sliding windows, two-sided
and shifted bands, bottom-right aligned causal blocks of rectangular varlen batches (rows with no
key at all included) and windows narrower than one key block, forward and two-kernel backward
against a float64 oracle, on mma.sync and wgmma, float16 / bfloat16 / float32, GQA; a NaN value
outside a row's band never reaches it; a score modifier composes with the band; the work tables
visit only the key blocks inside each tile's band."""
import numpy as np
import pytest

import tiga_numba as tg
from tiga_numba import score_mod as sm
from tiga_numba.cuda.tc import emulator as E
from tiga_numba.cuda.tc import generator as G
from tiga_numba.cuda.tc import schedule as S
from tiga_numba.cuda.tc.generator.modifier import TANH, Modifier

from test_tc_emulator import TOL, _inputs, rel, rounded

GRAPHS = {
    "window": lambda: tg.Graph.band(150, left=40),                                  # causal, W = 41
    "two_sided": lambda: tg.Graph.band(130, left=20, right=7),
    "shifted": lambda: tg.Graph.band(120, 90, left=30, right=-4),                   # rows 0..3: no key
    "narrow": lambda: tg.Graph.band(200, left=3, right=2),                          # 6 keys per row
    "rect_causal": lambda: tg.Graph.cu_seqlens([0, 30, 100, 101], cu_seqlens_k=[0, 50, 90, 97]),
    "varlen_window": lambda: tg.Graph.cu_seqlens([0, 1, 70, 200], window=(33, 0)),
}


def _bands(graph):
    b = graph._blocks
    return (np.asarray(b.dst_offsets), np.asarray(b.src_offsets), np.asarray(b.causal, np.uint8),
            np.asarray(b.lo), np.asarray(b.hi))


def oracle(q, k, v, do, graph, scale, f=None, df=None):
    """float64 over each block's band lo <= c - r <= hi (every edge materialised per block), with an
    optional elementwise score f(z) and its derivative df(z): out, m, dq, dk, dv."""
    dst, src, _, lo, hi = _bands(graph)
    nd, H, _ = q.shape
    Hkv = v.shape[1]
    g = H // Hkv
    out = np.zeros((nd, H, v.shape[2]))
    m = np.full((nd, H), -np.inf)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(len(lo)):
        i0, i1, j0, j1 = dst[b], dst[b + 1], src[b], src[b + 1]
        r = np.arange(i1 - i0)[:, None]
        c = np.arange(j1 - j0)[None, :]
        keep = (c - r >= lo[b]) & (c - r <= hi[b])
        rows = keep.any(1)
        if not rows.any():
            continue
        for h in range(H):
            qq, kk, vv = (x.astype(np.float64) for x in (q[i0:i1, h], k[j0:j1, h // g], v[j0:j1, h // g]))
            z = qq @ kk.T * scale
            y = z if f is None else f(z)
            y = np.where(keep, y, -np.inf)
            mm = np.where(rows, y.max(1), -np.inf)
            with np.errstate(invalid="ignore", over="ignore"):
                p = np.where(keep, np.exp(y - np.where(rows, mm, 0)[:, None]), 0.0)
                p /= np.where(rows, p.sum(1), 1.0)[:, None]
            o = _masked_dot(p, keep, vv)
            out[i0:i1, h], m[i0:i1, h] = o, mm
            dO = do[i0:i1, h].astype(np.float64)
            dv[j0:j1, h // g] += _masked_dot(p.T, keep.T, dO)
            d = 1.0 if df is None else df(z)
            with np.errstate(invalid="ignore"):
                ds = np.where(keep, p * (dO @ np.nan_to_num(vv).T - (dO * o).sum(1)[:, None]) * d, 0.0)
            dq[i0:i1, h] = _masked_dot(ds, keep, kk) * scale
            dk[j0:j1, h // g] += _masked_dot(ds.T, keep.T, qq) * scale
    return out, m, dq, dk, dv


def _masked_dot(p, keep, vv):
    """P V where only kept cells multiply V (a non-finite row of V reaches exactly the rows that
    see it); also the backward's products, with the transposed mask."""
    out = np.zeros((p.shape[0], vv.shape[1]))
    for i in range(p.shape[0]):
        out[i] = p[i, keep[i]] @ vv[keep[i]]
    return out


CASES = [  # (D, H, Hkv, dtype, forward shape, dq shape, dkdv shape)
    (64, 2, 1, "float16", dict(NW=4, MT=2, BN=64), dict(NW=4, MT=1, BN=64), dict(NW=4, MT=1, BN=64)),
    (128, 1, 1, "bfloat16", dict(NW=4, MT=2, BN=32, a_smem=True), dict(NW=4, MT=1, BN=64, a_smem=True),
     dict(NW=4, MT=1, BN=32, a_smem=True)),
    (64, 2, 2, "float32", dict(NW=8, MT=1, BN=64), dict(NW=4, MT=1, BN=32, a_smem=True),
     dict(NW=4, MT=1, BN=32, a_smem=True)),
    (64, 2, 1, "float16", dict(NW=4, MT=1, BN=128, a_smem=True, wgmma=True),
     dict(NW=4, MT=1, BN=64, a_smem=True, wgmma=True), dict(NW=4, MT=1, BN=64, a_smem=True, wgmma=True)),
    (64, 3, 3, "float32", dict(NW=4, MT=1, BN=64, a_smem=True, wgmma=True),
     dict(NW=4, MT=1, BN=32, a_smem=True, wgmma=True), dict(NW=4, MT=1, BN=32, a_smem=True, wgmma=True)),
]


def _run(case, graph, q, k, v, do, scale, mod=None, packed=None):
    D, H, Hkv, dtype, sf, sq, sk = CASES[case]
    dst, src, causal, lo, hi = _bands(graph)
    extra = dict(mod=mod) if mod is not None else {}
    vf = G.Variant("fwd", D, D, dtype=dtype, **extra, **sf).check()
    st = {}
    o, m, l = E.forward(vf, q, k, v, dst, src, causal, scale, stats=st, mod=packed, lo=lo, hi=hi)
    if mod is not None:
        extra["overlap"] = False
    vq = G.Variant("dq", D, D, dtype=dtype, **extra, **sq).check()
    vk = G.Variant("dkdv", D, D, dtype=dtype, **extra, **sk).check()
    return (o, m, l), (vq, vk, st["m_kernel"], dst, src, causal, lo, hi)


#: (case, graph) pairs: every band kind on mma.sync and on wgmma, every dtype on several kinds
PAIRS = [(0, "window"), (0, "rect_causal"), (1, "two_sided"), (1, "varlen_window"), (2, "narrow"),
         (2, "shifted"), (3, "window"), (3, "shifted"), (3, "rect_causal"), (4, "narrow"),
         (4, "two_sided"), (4, "varlen_window")]


@pytest.mark.parametrize("case,name", PAIRS)
def test_banded_forward_backward_emulated(case, name):
    D, H, Hkv, dtype = CASES[case][:4]
    graph = GRAPHS[name]()
    nd, ns = graph.num_dst, graph.num_src
    rng = np.random.default_rng(hash((case, name)) % 2 ** 32)
    q, k, v, do = _inputs(rng, nd, ns, H, Hkv, D, dtype)
    scale = D ** -0.5
    ro, rm, rdq, rdk, rdv = oracle(q, k, v, do, graph, scale)
    (o, m, l), (vq, vk, mk, dst, src, causal, lo, hi) = _run(case, graph, q, k, v, do, scale)
    assert np.isfinite(o).all() and rel(o, ro) < TOL[dtype]
    live = np.isfinite(rm)
    np.testing.assert_allclose(m[live], rm[live], rtol=1e-5, atol=1e-5)
    assert (m[~live] == -np.inf).all() and (l[~live] == 0).all() and (o[~live] == 0).all()
    if name in ("shifted", "rect_causal"):
        assert (~live).any()   # the relation has rows without keys: they are part of the check
    out = rounded(ro.astype(np.float32), dtype)
    grads = E.backward(vq, vk, do, q, k, v, out, m, l, dst, src, causal, scale, m_kernel=mk, lo=lo, hi=hi)
    for what, got, want in zip(("dq", "dk", "dv"), grads, (rdq, rdk, rdv)):
        assert np.isfinite(got).all(), what
        assert rel(got, want) < 3 * TOL[dtype], (what, rel(got, want))


@pytest.mark.parametrize("case", [0, 3])
def test_nan_outside_the_band_never_reaches_a_row(case):
    """v[j] = NaN for one key: exactly the rows whose band holds j become NaN (forward and dq;
    dk / dv of the keys that share a query with j stay finite only where no such query is)."""
    D, H, Hkv, dtype = CASES[case][:4]
    graph = GRAPHS["window"]()
    rng = np.random.default_rng(5)
    q, k, v, do = _inputs(rng, graph.num_dst, graph.num_src, H, Hkv, D, dtype)
    v[70] = np.nan
    scale = D ** -0.5
    ro, rm, *_ = oracle(q, k, v, do, graph, scale)
    (o, m, l), _ = _run(case, graph, q, k, v, do, scale)
    bad = np.isnan(ro).any((1, 2))
    assert bad.sum() == 41 and np.array_equal(np.isnan(o).any((1, 2)), bad)   # rows 70 .. 110
    assert rel(o[~bad], ro[~bad]) < TOL[dtype]


def test_modifier_composes_with_the_band():
    """soft-cap 2 on a sliding window: f before the mask in the forward, f' in dS, only band cells."""
    case = 3
    D, H, Hkv, dtype = CASES[case][:4]
    graph = GRAPHS["window"]()
    nd, ns = graph.num_dst, graph.num_src
    rng = np.random.default_rng(9)
    q, k, v, do = _inputs(rng, nd, ns, H, Hkv, D, dtype)
    tree = sm.softcap_tree(sm.SCORE)
    values = {sm.Expr("scalar", (), "softcap"): 2.0}
    from tiga_numba.cuda.score_codegen import pack
    mod = Modifier(tree, TANH[dtype])
    packed = (mod,) + tuple(pack(sm.BoundModifier(tree, values), np, np.float32, H, nd, ns, 0)[:3])
    scale = D ** -0.5
    f = lambda z: 2.0 * np.tanh(z / 2.0)  # noqa: E731
    df = lambda z: 1.0 - np.tanh(z / 2.0) ** 2  # noqa: E731
    ro, rm, rdq, rdk, rdv = oracle(q, k, v, do, graph, scale, f, df)
    (o, m, l), (vq, vk, mk, dst, src, causal, lo, hi) = _run(case, graph, q, k, v, do, scale, mod, packed)
    assert rel(o, ro) < TOL[dtype]
    grads = E.backward(vq, vk, do, q, k, v, rounded(ro.astype(np.float32), dtype), m, l, dst, src, causal,
                       scale, m_kernel=mk, mod=packed, lo=lo, hi=hi)
    for got, want in zip(grads, (rdq, rdk, rdv)):
        assert rel(got, want) < 3 * TOL[dtype]


def test_work_tables_visit_only_the_band():
    """a causal window of W keys over N rows: each BM-row tile visits the BN-blocks from its first
    row's lower limit to its last row's diagonal, not the whole prefix."""
    N, W, BM, BN = 4096, 256, 128, 64
    dst, src, causal, lo, hi = _bands(tg.Graph.band(N, left=W - 1))
    visited, total = S.tile_counts(dst, src, causal, BM, BN, lo, hi)
    assert total == (N // BM) * (N // BN)
    # tile t: keys [t BM - W + 1, t BM + BM - 1] -> (W + BM) / BN blocks (+1 where misaligned)
    assert visited <= (N // BM) * ((W + BM) // BN + 1)
    causal_only = S.tile_counts(dst, src, np.array([1], np.uint8), BM, BN)[0]
    assert visited < causal_only / 4
    q = S.query_tiles(dst, src, causal, BM, lo, hi)
    k = S.key_tiles(dst, src, causal, BM, lo, hi)
    for tab in (q, k):
        assert tab.shape[1] == len(G.variant.WORK_FIELDS) and len(tab) == N // BM
    # query tiles start at their first row's lower limit: the kernel's loop starts at block 0
    assert (q[:, 6] <= 0).all() and (q[:, 2] == np.maximum(0, q[:, 0] - (W - 1))).all()
    # key tile of rows (keys) j: queries j .. j + W - 1
    row = k[np.argsort(k[:, 0])][5]
    assert row[6] == row[4] and row[7] == row[4] + W - 1
    # an empty band visits nothing
    dst, src, causal, lo, hi = _bands(tg.Graph.band(1000, left=-20, right=-30))
    assert S.tile_counts(dst, src, causal, BM, BN, lo, hi)[0] == 0
    # rows without keys in a shifted band are found
    dst, src, causal, lo, hi = _bands(GRAPHS["shifted"]())
    assert np.array_equal(np.nonzero(S.rows_without_keys(dst, src, 90, lo, hi))[0], np.arange(4))


@pytest.mark.parametrize("case", [0, 3])
def test_several_non_finite_rows_in_one_block_reach_exactly_their_rows(case, monkeypatch):
    """Two bad keys / queries in one streamed block: a row's band is an interval of the block, so
    the row that sees only the second one must still get NaN, and rows that see neither stay exact
    (forward: v[10], v[60]; dK/dV: q[10], q[60], whose B tiles are queries)."""
    monkeypatch.setattr(E, "NAN_DATA", True)
    D, H, Hkv, dtype = CASES[case][:4]
    graph = tg.Graph.band(150, left=40)
    rng = np.random.default_rng(2)
    q, k, v, do = _inputs(rng, 150, 150, H, Hkv, D, dtype)
    scale = D ** -0.5
    vb = v.copy()
    vb[[10, 60]] = np.nan
    ro, *_ = oracle(q, k, vb, do, graph, scale)
    (o, m, l), _ = _run(case, graph, q, k, vb, do, scale)
    want = np.isnan(ro).any((1, 2))
    assert want[60:101].all() and not want[51:60].any()          # rows 60..100 see v[60] only
    assert np.array_equal(np.isnan(o).any((1, 2)), want)
    assert rel(o[~want], ro[~want]) < TOL[dtype]
    qb = q.copy()
    qb[[10, 60]] = np.nan
    ro, rm, rdq, rdk, rdv = oracle(qb, k, v, do, graph, scale)
    (o, m, l), (vq, vk, mk, dst, src, causal, lo, hi) = _run(case, graph, qb, k, v, do, scale)
    grads = E.backward(vq, vk, do, qb, k, v, o, m, l, dst, src, causal, scale, m_kernel=mk, lo=lo, hi=hi)
    for what, got, ref in zip(("dk", "dv"), grads[1:], (rdk, rdv)):
        bad = np.isnan(ref).any((1, 2))
        assert bad[20:61].all() and not bad[11:20].any(), what   # keys 20..60 see q[60] only
        assert np.array_equal(~np.isfinite(got).all((1, 2)), bad), what
        assert rel(got[~bad], ref[~bad]) < 3 * TOL[dtype], what


def test_the_ordered_fused_backward_refuses_bands():
    """its turn counters assume every key tile visits every query block of a block relation"""
    D, H, Hkv, dtype = CASES[0][:4]
    graph = GRAPHS["window"]()
    rng = np.random.default_rng(4)
    q, k, v, do = _inputs(rng, graph.num_dst, graph.num_src, H, Hkv, D, dtype)
    dst, src, causal, lo, hi = _bands(graph)
    vk = G.Variant("dkdv", D, D, dtype=dtype, NW=4, MT=1, BN=64, a_smem=True, fuse_dq=True).check()
    z = np.zeros((graph.num_dst, H), np.float32)
    with pytest.raises(ValueError, match="ordered fused dK/dV/dQ kernel takes full and square-causal"):
        E.backward(None, vk, do, q, k, v, q, z, z + 1, dst, src, causal, 1.0, lo=lo, hi=hi)


@pytest.mark.parametrize("name", ["window", "varlen_window"])
def test_the_narrow_band_forward_shape_emulated(name):
    """the shape tuning.narrow() gives a forward over a narrow band (one warpgroup, 64-key blocks
    at D = 128) computes the oracle's rows; a relation with a wider band keeps the shipped shape."""
    from tiga_numba.cuda.tc import tuning
    graph = GRAPHS[name]()
    dst, src, causal, lo, hi = _bands(graph)
    shipped = tuning.variant("fwd", 128, 128, "float16", wgmma=True)
    vr = tuning.narrow(shipped, int((hi - lo + 1).max()))
    assert (vr.NW, vr.BN) != (shipped.NW, shipped.BN)
    assert tuning.narrow(shipped, tuning.NARROW_KEYS + 1) is shipped
    rng = np.random.default_rng(11)
    q, k, v, do = _inputs(rng, graph.num_dst, graph.num_src, 2, 1, 128, "float16")
    scale = 128 ** -0.5
    ro, rm = oracle(q, k, v, do, graph, scale)[:2]
    o, m, l = E.forward(vr.check(), q, k, v, dst, src, causal, scale, lo=lo, hi=hi)
    live = np.isfinite(rm)
    assert np.isfinite(o).all() and rel(o, ro) < TOL["float16"]
    np.testing.assert_allclose(m[live], rm[live], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_narrow_band_dq_shape_emulated(dtype):
    """the backward over a narrow band runs tuning.narrow()'s dQ shape (one warpgroup, 64-key
    blocks at D = 128) beside the shipped dK/dV kernel: every gradient matches the oracle, with
    GQA and the window's first rows (fewer keys than the band)."""
    from tiga_numba.cuda.tc import tuning
    graph = GRAPHS["varlen_window"]()
    dst, src, causal, lo, hi = _bands(graph)
    keys = int((hi - lo + 1).max())
    vq_s, vk = (tuning.variant(kind, 128, 128, dtype, wgmma=True) for kind in ("dq", "dkdv"))
    vq = tuning.narrow(vq_s, keys)
    assert (vq.NW, vq.BN) == (4, 64) != (vq_s.NW, vq_s.BN) and tuning.narrow(vk, keys) is vk
    rng = np.random.default_rng(12)
    q, k, v, do = _inputs(rng, graph.num_dst, graph.num_src, 2, 1, 128, dtype)
    scale = 128 ** -0.5
    ro, rm, rdq, rdk, rdv = oracle(q, k, v, do, graph, scale)
    st = {}
    vf = tuning.narrow(tuning.variant("fwd", 128, 128, dtype, wgmma=True), keys)
    o, m, l = E.forward(vf.check(), q, k, v, dst, src, causal, scale, stats=st, lo=lo, hi=hi)
    grads = E.backward(vq.check(), vk, do, q, k, v, o, m, l, dst, src, causal, scale,
                       m_kernel=st["m_kernel"], lo=lo, hi=hi)
    for what, got, ref in zip(("dq", "dk", "dv"), grads, (rdq, rdk, rdv)):
        assert np.isfinite(got).all() and rel(got, ref) < 3 * TOL[dtype], what


def test_only_banded_relations_take_the_narrow_band_shape():
    """the forward's shape follows the relation's widest band (tc/api._band_keys): full and causal
    blocks keep the shipped shape whatever their size; a window up to tuning.NARROW_KEYS keys, or
    an empty band, takes the narrow one."""
    from tiga_numba.cuda.tc import api, tuning
    shipped = tuning.variant("fwd", 128, 128, "float16", wgmma=True)

    def shape(graph):
        keys = api._band_keys(api._host_record(graph._blocks))
        return keys, tuning.narrow(shipped, keys)
    for graph in (tg.Graph.triangular(300), tg.Graph.dense(40, 50), tg.Graph.cu_seqlens([0, 30, 90])):
        assert shape(graph) == (None, shipped)
    keys, vr = shape(tg.Graph.band(600, left=127))
    assert keys == 128 and (vr.NW, vr.BN) == (4, 64)
    keys, vr = shape(tg.Graph.cu_seqlens([0, 100, 3000], window=(1500, 0)))
    assert keys == 1501 and vr is shipped
    other = tuning.variant("fwd", 128, 128, "bfloat16", wgmma=True)
    assert (tuning.narrow(other, 128).NW, tuning.narrow(other, 128).BN) == (4, 64)
    other = tuning.variant("fwd", 128, 128, "float32", wgmma=True)   # not in NARROW_DTYPES
    assert tuning.narrow(other, 128) is other
