"""GPU tests of banded block relations, masked non-finite values and the split-key decode path
(marked gpu; skipped without cupy and a CUDA device).

Against a float64 oracle on fresh random inputs, outputs poisoned with NaN first: bands
(Graph.band, windows, rectangular cu_seqlens with bottom-right-aligned causal masks, Lq > Lk,
Lq < Lk, empty segments) forward and backward on the CUDA-core kernels, with NaN / inf in
every row that no destination reaches; decode shapes (Graph.dense(num_keys, 1), cu_seqlens
with one query per segment, grouped-query heads) on the split-key kernel; same bits on a
second run; CSR hub rows (one destination with every source, one source read by every
destination) split into pieces, against the oracle and the unsplit kernels. NaN / inf outside a causal row's relation (inside its diagonal tile) on
the CUDA-core and the tensor-core kernels, forward and backward.
"""
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")   # without cupy: nothing to test; without a device: conftest skips

pytestmark = pytest.mark.gpu

from test_cuda_gpu import _inputs, _shield, rel_err  # noqa: E402

_shield()
import tiga_numba as tg  # noqa: E402
from tiga_numba import functional  # noqa: E402

from test_cuda_sim import oracle  # noqa: E402

RNG = np.random.default_rng(20261201)
TOL = {"float16": (4e-3, 1e-2), "float32": (2e-5, 2e-4), "float64": (1e-11, 1e-10)}


@pytest.fixture(autouse=True)
def _poisoned():
    """every call runs with outputs filled with NaN first (run option poison_outputs)."""
    from tiga_numba.cuda import api
    with tg.options(poison_outputs=True):
        yield api


def _mask(g):
    return np.asarray(g.to_scipy().toarray() != 0)


def banded():
    cq = [0, 40, 40, 45, 150, 151]
    ck = [0, 20, 33, 45, 200, 260]  # Lq > Lk, an empty query segment, Lq = Lk, Lq < Lk, 1 query
    return {
        "band": lambda: tg.Graph.band(230, 150, left=37, right=5),
        "band_right_only": lambda: tg.Graph.band(97, 160, left=None, right=3),
        "varlen_causal_br": lambda: tg.Graph.cu_seqlens(cq, cu_seqlens_k=ck, causal=True),
        "varlen_window": lambda: tg.Graph.cu_seqlens(cq, cu_seqlens_k=ck, causal=True,
                                                     window=(17, 0)),
        "segments_window": lambda: tg.Graph.cu_seqlens([0, 70, 70, 201], window=(9, 4)),
    }


def _run(g, q, k, v, dout, tensor_cores=None):
    """tensor_cores None: as the current options say; True / False: that family for this call."""
    import contextlib
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, dout))
    with (contextlib.nullcontext() if tensor_cores is None else tg.options(tensor_cores=tensor_cores)):
        out, stats = tg.attention(qd, kd, vd, g, return_stats=True)
        kern = functional.last_plan().run_info["kernel"]
        dq, dk, dv = tg.attention_backward(dod, qd, kd, vd, out, stats, g)
    return out, stats, kern, (dq, dk, dv)


@pytest.mark.parametrize("kind", list(banded()))
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("path", ["cuda_cores", "tensor_cores"])
def test_banded_vs_oracle_and_nan_outside_the_band(kind, dtype, path):
    """both block families take bands: the CUDA cores (tensor_cores=False) and the tensor cores."""
    tc = path == "tensor_cores"
    g = banded()[kind]()
    H, Hkv, D = 4, 2, 64
    q = RNG.standard_normal((g.num_dst, H, D)).astype(dtype)
    k = RNG.standard_normal((g.num_src, Hkv, D)).astype(dtype)
    v = RNG.standard_normal((g.num_src, Hkv, D)).astype(dtype)
    dout = RNG.standard_normal((g.num_dst, H, D)).astype(dtype)
    M = _mask(g)
    ro, rm, rl, rdq, rdk, rdv, _ = oracle(q, k, v, M, D ** -0.5, dout=dout)
    out, stats, kern, grads = _run(g, q, k, v, dout, tc)
    if tc:
        assert kern.startswith("tensor-core FA2 forward"), kern
    else:
        assert kern.startswith("cuda.blocks.forward (CUDA cores") and "banded" in kern, kern
    ftol, btol = TOL[dtype]
    assert rel_err(out, ro) < ftol
    assert rel_err(stats.l, rl) < ftol
    for name, got, want in zip(("dq", "dk", "dv"), grads, (rdq, rdk, rdv)):
        assert rel_err(got, want) < btol, name
    # same bits on a second run
    out2, _, _, grads2 = _run(g, q, k, v, dout, tc)
    assert bool(cupy.all(out == out2))
    for a, b in zip(grads, grads2):
        assert bool(cupy.all(a == b))
    # non-finite values where no row reaches (keys) / in rows that reach nothing
    dead_k, dead_q = ~M.any(axis=0), ~M.any(axis=1)
    if not dead_k.any() and not dead_q.any():
        # every key is reached: poison the key just past each row's band instead, per row
        # block -- covered by the dead rows / keys of the other kinds
        pytest.skip("every key and row is reached")
    kp, vp, qp, dp = k.copy(), v.copy(), q.copy(), dout.copy()
    kp[dead_k] = np.nan
    vp[dead_k] = np.inf
    qp[dead_q] = np.nan
    dp[dead_q] = np.inf
    out3, _, _, grads3 = _run(g, qp, kp, vp, dp, tc)
    assert rel_err(out3, ro) < ftol
    for name, got, want in zip(("dq", "dk", "dv"), grads3, (rdq, rdk, rdv)):
        got = cupy.asnumpy(got)
        if name != "dq":
            got, want = got[~dead_k], want[~dead_k]
        assert np.isfinite(got).all(), f"non-finite value outside the band reached {name}"
        assert rel_err(got, want) < btol, name


def _causal_poisoned(dtype, kind):
    """v[120] = NaN, k[120] = inf, q[60] = NaN, dout[60] = inf in one causal segment of 200 rows:
    rows i < 120 keep the clean out and dq (row 60 aside), keys j > 60 the clean dk / dv; the
    rows that do reach a bad row get a non-finite value. `kind` is the kernel family the call
    must take (in run_info: "cuda.blocks" or "tensor-core")."""
    g = tg.Graph.cu_seqlens([0, 200], causal=True)
    q, k, v, dout = (RNG.standard_normal((200, 2, 64)).astype(dtype) for _ in range(4))
    M = _mask(g)
    ro, _, _, rdq, rdk, rdv, _ = oracle(q, k, v, M, 64 ** -0.5, dout=dout)
    v[120] = np.nan
    k[120] = np.inf
    out, _, kern, (dq, _, _) = _run(g, q, k, v, dout)
    assert kind in kern, kern
    out, dq = cupy.asnumpy(out), cupy.asnumpy(dq)
    ftol, btol = TOL[dtype]
    assert np.isfinite(out[:120]).all() and np.isfinite(dq[:120]).all()
    assert rel_err(out[:120], ro[:120]) < ftol and rel_err(dq[:120], rdq[:120]) < btol
    assert (~np.isfinite(out[120:])).any(axis=(1, 2)).all(), "v[120] must reach the rows that attend to it"
    # NaN / inf in one query row: keys j > 60 do not see it
    k[120], v[120] = RNG.standard_normal((2, 2, 64)).astype(dtype)
    ro, _, _, rdq, rdk, rdv, _ = oracle(q, k, v, M, 64 ** -0.5, dout=dout)
    q[60] = np.nan
    dout[60] = np.inf
    _, _, _, (dq, dk, dv) = _run(g, q, k, v, dout)
    dq, dk, dv = (cupy.asnumpy(x) for x in (dq, dk, dv))
    keep = np.arange(200) != 60
    assert np.isfinite(dq[keep]).all() and rel_err(dq[keep], rdq[keep]) < btol
    for name, got, want in (("dk", dk, rdk), ("dv", dv, rdv)):
        assert np.isfinite(got[61:]).all(), f"a NaN in q / dout of row 60 reached {name} of a later key"
        assert rel_err(got[61:], want[61:]) < btol, name
        assert (~np.isfinite(got[:61])).any(axis=(1, 2)).all(), name


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_nan_does_not_cross_the_causal_mask_on_cuda_cores(dtype):
    """CUDA-core block kernels (tensor cores switched off by the run option)."""
    with tg.options(tensor_cores=False):
        _causal_poisoned(dtype, "cuda.blocks")


@pytest.mark.parametrize("fp32_tc", [True, False])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_nan_does_not_cross_the_causal_mask_on_tensor_cores(dtype, fp32_tc):
    """tensor-core kernels (float32: bf16 x 3 on wgmma / 3xTF32 on mma.sync): the masked blocks'
    B tiles are guarded (generator/guard.py)."""
    if dtype == "float32" and not fp32_tc:
        pytest.skip("float32 without fp32 tensor cores runs on the CUDA cores")
    with tg.options(fp32_tensor_cores=fp32_tc):
        _causal_poisoned(dtype, "tensor-core")


@pytest.mark.parametrize("wgmma", [True, False])
def test_nan_does_not_cross_the_causal_mask_on_mma_sync_and_wgmma(wgmma):
    """the same on both tensor-core engines (wgmma=False: mma.sync on an sm_90 device too)."""
    with tg.options(wgmma=wgmma):
        _causal_poisoned("float16", "tensor-core")
        _causal_poisoned("float32", "tensor-core")


def decode_graphs():
    return {
        "dense_1": lambda: tg.Graph.dense(3000, 1),
        "dense_4": lambda: tg.Graph.dense(777, 4),
        "varlen_1q": lambda: tg.Graph.cu_seqlens(np.arange(6), cu_seqlens_k=[0, 1, 300, 300, 2000, 2100],
                                                 causal=True),
        "varlen_3q_causal": lambda: tg.Graph.cu_seqlens([0, 3, 6, 8], cu_seqlens_k=[0, 900, 905, 1405],
                                                        causal=True),
    }


@pytest.mark.parametrize("kind", list(decode_graphs()))
@pytest.mark.parametrize("dtype,D,H,Hkv", [("float16", 128, 8, 2), ("float32", 64, 4, 4),
                                           ("float64", 32, 6, 2)])
def test_decode_split_key_vs_oracle(kind, dtype, D, H, Hkv):
    g = decode_graphs()[kind]()
    q = RNG.standard_normal((g.num_dst, H, D)).astype(dtype)
    k = RNG.standard_normal((g.num_src, Hkv, D)).astype(dtype)
    v = RNG.standard_normal((g.num_src, Hkv, D)).astype(dtype)
    dout = RNG.standard_normal((g.num_dst, H, D)).astype(dtype)
    M = _mask(g)
    ro, rm, rl, rdq, rdk, rdv, _ = oracle(q, k, v, M, D ** -0.5, dout=dout)
    out, stats, kern, grads = _run(g, q, k, v, dout)
    assert kern.startswith("cuda.decode.forward"), kern
    ftol, btol = TOL[dtype]
    assert rel_err(out, ro) < ftol
    m, l = cupy.asnumpy(stats.m), cupy.asnumpy(stats.l)
    fin = np.isfinite(rm)
    assert np.array_equal(np.isfinite(m), fin) and (l[~fin] == 0).all()
    assert rel_err(m[fin], rm[fin]) < ftol and rel_err(l, rl) < ftol
    for name, got, want in zip(("dq", "dk", "dv"), grads, (rdq, rdk, rdv)):
        assert rel_err(got, want) < btol, name
    out2, _, _, _ = _run(g, q, k, v, dout)
    assert bool(cupy.all(out == out2)), "split-key forward not bitwise repeatable"
    dead = ~M.any(axis=0)
    if dead.any():
        kp, vp = k.copy(), v.copy()
        kp[dead] = np.nan
        vp[dead] = np.inf
        out3, _, _, _ = _run(g, q, kp, vp, dout)
        assert rel_err(out3, ro) < ftol


def _hub_csr(nq=1500, ns=3000, hub=7):
    """Row `hub` holds every source; every other row holds source 0 and a few random ones, so
    source 0 is read by every destination (the transposed pass's hub)."""
    rows, cols = [], []
    for i in range(nq):
        cs = np.arange(ns) if i == hub else np.unique(np.concatenate([[0], RNG.choice(ns, 5)]))
        if i == 11:
            cs = np.zeros(0, np.int64)  # an empty row
        rows.append(np.full(len(cs), i))
        cols.append(cs)
    rows, cols = np.concatenate(rows), np.concatenate(cols)
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=nq))]).astype(np.int64)
    return tg.Graph.from_csr(indptr, cols.astype(np.int32), num_src=ns)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_csr_hub_rows_split_vs_oracle(dtype, _poisoned, monkeypatch):
    g = _hub_csr()
    H, Hkv, D = 4, 2, 32
    q = RNG.standard_normal((g.num_dst, H, D)).astype(dtype)
    k = RNG.standard_normal((g.num_src, Hkv, D)).astype(dtype)
    v = RNG.standard_normal((g.num_src, Hkv, D)).astype(dtype)
    dout = RNG.standard_normal((g.num_dst, H, D)).astype(dtype)
    ro, rm, rl, rdq, rdk, rdv, _ = oracle(q, k, v, _mask(g), D ** -0.5, dout=dout)
    out, stats, kern, grads = _run(g, q, k, v, dout)
    assert "split into" in kern, kern
    bk = functional.last_plan().run_info["kernel"]
    assert "dq:" in bk and "dk/dv:" in bk, bk
    ftol, btol = TOL[dtype]
    assert rel_err(out, ro) < ftol and rel_err(stats.l, rl) < ftol
    for name, got, want in zip(("dq", "dk", "dv"), grads, (rdq, rdk, rdv)):
        assert rel_err(got, want) < btol, name
    out2, _, _, grads2 = _run(g, q, k, v, dout)
    assert bool(cupy.all(out == out2))
    for a, b in zip(grads, grads2):
        assert bool(cupy.all(a == b)), "split backward not bitwise repeatable"
    # equal, within rounding, to the unsplit kernels (no row cut: the one-pass kernels)
    with monkeypatch.context() as m:
        m.setattr(_poisoned, "_csr_split", lambda owner, indptr: None)
        out3, _, kern3, grads3 = _run(tg.Graph.from_scipy(g.to_scipy()), q, k, v, dout)
    assert "split" not in kern3
    assert rel_err(out, cupy.asnumpy(out3)) < ftol
    for a, b in zip(grads, grads3):
        assert rel_err(a, cupy.asnumpy(b)) < btol


def test_csr_skewed_rows_shorter_than_a_piece(_poisoned):
    """A row far above the mean degree but shorter than one piece: the pass is scheduled by
    pieces yet no row is cut, so the merges have no rows (a launch of no blocks). After a
    graph whose rows are cut (the merge kernels already launched on their fast path), forward
    and backward against the oracle."""
    hub = _hub_csr()
    _run(hub, *(RNG.standard_normal(s).astype(np.float32) for s in
                ((hub.num_dst, 4, 32), (hub.num_src, 2, 32), (hub.num_src, 2, 32), (hub.num_dst, 4, 32))))
    import scipy.sparse as sp
    a = sp.random(300, 250, density=0.05, random_state=np.random.RandomState(5), format="lil")
    a.rows[20], a.data[20] = list(range(250)), [1.0] * 250   # 250 edges; mean ~13; piece >= 1024
    g = tg.Graph.from_scipy(a.tocsr())
    q, dout = (RNG.standard_normal((300, 4, 32)).astype(np.float32) for _ in range(2))
    k, v = (RNG.standard_normal((250, 2, 32)).astype(np.float32) for _ in range(2))
    ro, rm, rl, rdq, rdk, rdv, _ = oracle(q, k, v, _mask(g), 32 ** -0.5, dout=dout)
    out, stats, kern, grads = _run(g, q, k, v, dout)
    ftol, btol = TOL["float32"]
    assert rel_err(out, ro) < ftol
    for name, got, want in zip(("dq", "dk", "dv"), grads, (rdq, rdk, rdv)):
        assert rel_err(got, want) < btol, name


def test_merge_and_lse_of_cupy_parts_stay_on_the_device():
    """attention_merge of cupy parts over two disjoint bands equals the causal call; stats.lse
    and the merged stats are cupy; the merged stats feed the backward of the union."""
    n = 96
    q, k, v, dout = (cupy.asarray(RNG.standard_normal((n, 2, 16)).astype(np.float32)) for _ in range(4))
    parts = [tg.attention(q, k, v, g, return_stats=True)
             for g in (tg.Graph.band(n, left=None, right=-5), tg.Graph.band(n, left=4, right=0))]
    assert isinstance(parts[0][1].lse, cupy.ndarray)
    out, st = tg.attention_merge(parts)
    assert isinstance(out, cupy.ndarray) and isinstance(st.lse, cupy.ndarray)
    full = tg.Graph.triangular(n)
    want, wst = tg.attention(q, k, v, full, return_stats=True)
    assert rel_err(out.get(), want.get()) < 1e-5
    np.testing.assert_allclose(st.lse.get(), wst.lse.get(), rtol=1e-5, atol=1e-6)
    for got, ref in zip(tg.attention_backward(dout, q, k, v, out, st, full),
                        tg.attention_backward(dout, q, k, v, want, wst, full)):
        assert rel_err(got.get(), ref.get()) < 1e-4
    # an empty part (l = 0) is neutral whatever its out and m hold: neither is read
    for junk in (np.nan, np.inf):
        empty = (cupy.full_like(out, junk), tg.AttentionStats(cupy.full(st.m.shape, 900.0, st.m.dtype),
                                                              cupy.zeros(st.l.shape, st.l.dtype)))
        for order in ([empty] + parts, parts[:1] + [empty] + parts[1:]):
            got, gst = tg.attention_merge(order)
            assert cupy.isfinite(got).all() and rel_err(got.get(), want.get()) < 1e-5
            np.testing.assert_allclose(gst.lse.get(), wst.lse.get(), rtol=1e-5, atol=1e-6)


def _nan_graphs():
    return {
        # three causal segments, the NaN key in the middle one: the other two stay exact
        "segments_causal": (lambda: tg.Graph.cu_seqlens([0, 200, 333, 520], causal=True), 250),
        # the hub row is cut into pieces; the NaN key is one of its sources (and of a few short rows)
        "csr_hub": (lambda: _hub_csr(), 5),
        # one query per segment: the split-key decode kernel and its merge of key chunks
        "decode": (lambda: tg.Graph.cu_seqlens(np.arange(4), cu_seqlens_k=[0, 1500, 1600, 4000],
                                               causal=True), 1550),
    }


@pytest.mark.parametrize("kind", list(_nan_graphs()))
@pytest.mark.parametrize("dtype,tensor_cores", [("float16", True), ("float16", False), ("float32", False)])
def test_a_nan_score_inside_rows_gives_what_the_cpu_gives(kind, dtype, tensor_cores, _poisoned):
    """One NaN in a key: every row that reads it is NaN (out and l), and so is each gradient
    share of such a row (dq of the row, dk / dv of every key it reads), on every GPU family
    (CUDA-core blocks, tensor cores, CSR split rows and their merges, the decode kernel) exactly
    as on the CPU; every other entry equals the CPU's result within rounding."""
    make, bad_key = _nan_graphs()[kind]
    g = make()
    q, k, v, dout = _inputs(g, dtype, 4, 2, 64, 64)
    k[bad_key, 1, 3] = np.nan
    want_out, want_stats = tg.attention(q, k, v, g, return_stats=True)
    want_grads = tg.attention_backward(dout, q, k, v, want_out, want_stats, g)
    nan_rows = np.isnan(want_stats.l)
    assert nan_rows.any() and not nan_rows.all(), "the case needs NaN rows and clean rows"
    out, stats, kern, grads = _run(g, q, k, v, dout, tensor_cores=tensor_cores)
    ftol, btol = TOL[dtype]
    for name, got, want, tol in (("out", out, want_out, ftol), ("l", stats.l, want_stats.l, ftol),
                                 ("dq", grads[0], want_grads[0], btol), ("dk", grads[1], want_grads[1], btol),
                                 ("dv", grads[2], want_grads[2], btol)):
        got = cupy.asnumpy(got)
        bad = np.isnan(want)
        where = np.argwhere(np.isnan(got) != bad)
        assert where.size == 0, f"{kind} [{kern}] {name}: NaN differs from the CPU at {where[:4].tolist()}"
        assert rel_err(got[~bad], want[~bad]) < tol, f"{kind} [{kern}] {name}"
