"""Tensor-core kernels on a real GPU (skipped without cupy + a CUDA device): forward and
backward against a float64 oracle on fresh random inputs with poisoned outputs, over dense
rectangular, causal, segments with length-0/1 blocks, tails, GQA, D 64/128, fp16 (and bf16
when cupy can hold it), float32 (bf16 x 3 on wgmma on sm_90, 3xTF32 elsewhere, held to
fp32-class tolerances that plain TF32 and plain bf16 fail),
strided inputs, and the supports() admission rules."""
import types

import numpy as np
import pytest

from conftest import set_run_option

from test_tc_emulator import oracle, rel  # also tames numba-cuda's import redirector

cupy = pytest.importorskip("cupy")
try:
    if cupy.cuda.runtime.getDeviceCount() < 1:
        raise RuntimeError
except Exception:  # noqa: BLE001
    pytest.skip("no CUDA device", allow_module_level=True)

from tiga_numba.cuda import tc  # noqa: E402
from tiga_numba.graph import BlockRelation  # noqa: E402

pytestmark = pytest.mark.gpu

RELS = {
    "dense_rect": ([0, 300], [0, 211], [0]),
    "causal": ([0, 333], [0, 333], [1]),
    "segments": ([0, 1, 1, 64, 190, 191, 460], [0, 1, 1, 64, 190, 191, 460], [1, 1, 1, 0, 1, 1]),
    "empty_src_block": ([0, 7, 40], [0, 0, 50], [0, 0]),
}
#: relations used by some tests only: no key anywhere (no dK/dV work tile at all)
NO_KEYS = ([0, 9, 20], [0, 0, 0], [0, 1])


def relation(name):
    d, s, c = NO_KEYS if name == "no_keys" else RELS[name]
    d, s = np.array(d, np.int64), np.array(s, np.int64)
    return BlockRelation(cupy.asarray(d), cupy.asarray(s), cupy.asarray(np.array(c, np.uint8)),
                         int(np.diff(d).max()), int(np.diff(s).max())), (d, s, np.array(c))


def plan(scale):
    return types.SimpleNamespace(scale=scale, prune_threshold=None, score="dot", run_info={})


def bf16():
    try:
        import ml_dtypes
        cupy.zeros(2, dtype=ml_dtypes.bfloat16)
        return ml_dtypes.bfloat16
    except Exception:  # noqa: BLE001
        return None


def _poison(monkeypatch):
    """every output buffer the path allocates starts as NaN garbage, so unwritten rows show."""
    real_empty = cupy.empty

    def empty(shape, dtype=float, *a, **kw):
        x = real_empty(shape, dtype, *a, **kw)
        try:
            x.fill(np.nan)
        except Exception:  # noqa: BLE001
            x.view(np.uint16).fill(0x7E00)
        return x
    monkeypatch.setattr(cupy, "empty", empty)


CASES = [(D, H, Hkv, name, "float16") for D, H, Hkv in ((64, 4, 2), (128, 2, 1)) for name in RELS]
CASES += [(64, 3, 3, "segments", "bfloat16"), (64, 2, 1, "dense_rect", "bfloat16")]
CASES += [(D, H, Hkv, name, "float32") for D, H, Hkv in ((64, 4, 2), (128, 2, 1)) for name in RELS]
#: D = 256 (16-bit, compute capability 9.0: tuning.WGMMA_PLAIN_DIMS; dK / dV in two column parts)
CASES += [(256, 4, 2, name, "float16") for name in RELS] + [(256, 2, 1, "segments", "bfloat16")]

#: forward relative L2 error bound (backward: 3x). float32 is the CUDA-core float32 bound: bf16 x 3
#: measures ~3e-7, 3xTF32 ~1e-6, plain TF32 ~5e-4 and plain bf16 ~3e-3
#: (tests/test_tc_emulator.py::test_plain_tf32_is_caught, ::test_split_needs_every_pass)
TOL = {"float16": 4e-3, "bfloat16": 2e-2, "float32": 2e-5}


@pytest.mark.parametrize("D,H,Hkv,name,dt", CASES)
def test_forward_backward_vs_oracle(D, H, Hkv, name, dt, monkeypatch):
    if dt == "bfloat16" and bf16() is None:
        pytest.skip("cupy cannot hold bfloat16 arrays here")
    if D == 256 and cupy.cuda.Device().compute_capability != "90":
        pytest.skip("D = 256 runs on the tensor cores on compute capability 9.0 only")
    npdt = {"float16": np.float16, "float32": np.float32}.get(dt) or bf16()
    _poison(monkeypatch)
    rel_, (d, s, c) = relation(name)
    nd, ns = int(d[-1]), int(s[-1])
    rng = np.random.default_rng()
    mk = lambda sh, f=1.0: (rng.standard_normal(sh) * f).astype(npdt)  # noqa: E731
    q, k, v, do = mk((nd, H, D), 1.5), mk((ns, Hkv, D)), mk((ns, Hkv, D)), mk((nd, H, D))
    qg, kg, vg, dog = (cupy.asarray(x) for x in (q, k, v, do))
    scale = D ** -0.5
    p = plan(scale)
    assert tc.supports(p, qg, kg, vg, rel_)
    out, m, l, m_kern = tc.forward(p, qg, kg, vg, rel_)
    f = lambda x: np.asarray(x).astype(np.float64)  # noqa: E731
    ro, rm, rl, rdq, rdk, rdv = oracle(f(q), f(k), f(v), f(do), d, s, c, scale)
    o = f(out.get())
    tol = TOL[dt]
    assert out.dtype == qg.dtype and np.isfinite(o).all() and rel(o, ro) < tol
    live = np.isfinite(rm)
    mh, lh = m.get(), l.get()
    ml_tol = 1e-5 if dt == "float32" else 1e-3
    np.testing.assert_allclose(mh[live], rm[live], rtol=ml_tol, atol=ml_tol)
    np.testing.assert_allclose(lh[live], rl[live], rtol=2 * ml_tol)
    assert (mh[~live] == -np.inf).all() and (lh[~live] == 0).all() and (o[~live] == 0).all()
    assert "tensor-core" in p.run_info["kernel"]
    assert ("fp32-class" in p.run_info["precision"]) == (dt == "float32")
    dq, dk, dv, db = tc.backward(p, dog, qg, kg, vg, out, m, l, rel_, None, m_kernel=m_kern)
    assert db is None
    for got, want in ((dq, rdq), (dk, rdk), (dv, rdv)):
        g = f(got.get())
        assert got.dtype == qg.dtype and np.isfinite(g).all() and rel(g, want) < 3 * tol


@pytest.mark.parametrize("dt", [np.float16, np.float32], ids=["float16", "float32"])
def test_strided_inputs_are_copied_or_read_in_place(dt):
    rel_, (d, s, c) = relation("causal")
    nd = int(d[-1])
    rng = np.random.default_rng()
    base = cupy.asarray(rng.standard_normal((nd, 3, 2, 64)).astype(dt))
    q = base[:, :, 0, :]           # head stride 2 rows of 64, row stride 6: 16-byte aligned, read in place
    k = base[:, :1, 1, :]
    v = cupy.asarray(rng.standard_normal((nd, 1, 65)).astype(dt))[:, :, 1:]  # misaligned: copied
    p = plan(0.125)
    out, m, l, m_kern = tc.forward(p, q, k, v, rel_)
    copies = p.run_info["copies"]
    assert len(copies) == 1 and copies[0].startswith("v:")
    f = lambda x: x.get().astype(np.float64)  # noqa: E731
    ro, *_ = oracle(f(q), f(k), f(v), f(q), d, s, c, 0.125)
    assert rel(f(out), ro) < (4e-3 if dt == np.float16 else 2e-5)


def test_supports_refuses_what_it_cannot_do(monkeypatch):
    set_run_option(monkeypatch, "wgmma", "0")   # D = 96 below: served by wgmma only
    rel_, _ = relation("causal")
    x = cupy.zeros((333, 2, 64), np.float16)
    assert tc.supports(plan(0.1), x, x, x, rel_)
    p = plan(0.1)
    p.prune_threshold = 0.5
    assert tc.supports(p, x, x, x, rel_)                                       # pruned forward
    assert not tc.supports(plan(0.1), x.astype(np.float32), x, x, rel_)       # mixed dtypes
    x32 = x.astype(np.float32)
    assert tc.supports(plan(0.1), x32, x32, x32, rel_)                         # 3xTF32
    x64 = x.astype(np.float64)
    assert not tc.supports(plan(0.1), x64, x64, x64, rel_)
    y = cupy.zeros((333, 2, 96), np.float16)
    assert not tc.supports(plan(0.1), y, y, y, rel_)
    assert not tc.supports(plan(0.1), x, x, x, object())


def test_launches_take_the_driver_path_and_match_the_fallback(monkeypatch):
    """the default launcher (cuLaunchKernel on a cubin from the cubin cache, dynamic shared memory
    raised on that function) gives the same bits as numba's own launch of its own compile; D = 128
    (> 48 KB of dynamic shared memory) only, to keep the extra NVVM compile to one kernel. mma.sync
    kernels: numba's own compile targets sm_90, which has no wgmma."""
    set_run_option(monkeypatch, "wgmma", "0")
    rng = np.random.default_rng()
    for D in (128,):
        rel_, (d, s, c) = relation("segments")
        nd = int(d[-1])
        q, k, v = (cupy.asarray(rng.standard_normal((nd, 2, D)).astype(np.float16)) for _ in range(3))
        out, m, l, m_kern = tc.forward(plan(D ** -0.5), q, k, v, rel_)
        kern, _ = tc.build.kernel(tc.tuning.variant("fwd", D, D, "float16"))
        assert kern.launch_path == "driver"
        dev = cupy.cuda.runtime.getDevice()
        saved = kern._paths[dev]
        try:
            kern._paths[dev] = ("numba",)
            out2, m2, l2, _ = tc.forward(plan(D ** -0.5), q, k, v, rel_)
        finally:
            kern._paths[dev] = saved
        for a, b in ((out, out2), (m, m2), (l, l2)):
            assert cupy.array_equal(a, b)
        f = lambda x: x.get().astype(np.float64)  # noqa: E731
        ro, *_ = oracle(f(q), f(k), f(v), f(q), d, s, c, D ** -0.5)
        assert rel(f(out), ro) < 4e-3


@pytest.mark.parametrize("dt", ["float16", "float32"])
def test_fused_backward_is_bitwise_repeatable(dt, monkeypatch):
    """The fused backward (tuning.FUSED_DKDV routed in for this test) adds each key tile's dQ block in
    a fixed order (turn counters), not with atomics: the same bits on every run, with many key tiles
    racing for each query block (N = 2048: 16-32 key tiles per block), GQA, causal and not; and the
    same values as the two-kernel backward."""
    from tiga_numba.cuda.tc import tuning
    set_run_option(monkeypatch, "wgmma", "0")   # the fused kernel is an mma.sync one
    N, H, Hkv, D = 2048, 8, 2, 64
    table = tuning.tuning_table(dt, wgmma=False)
    rng = np.random.default_rng()
    mk = lambda sh: cupy.asarray(rng.standard_normal(sh).astype(dt))  # noqa: E731
    q, k, v, do = mk((N, H, D)), mk((N, Hkv, D)), mk((N, Hkv, D)), mk((N, H, D))
    for causal in (0, 1):
        rel_ = BlockRelation(cupy.asarray(np.array([0, N])), cupy.asarray(np.array([0, N])),
                             cupy.asarray(np.array([causal], np.uint8)), N, N)
        p = plan(D ** -0.5)
        out, m, l, m_kern = tc.forward(p, q, k, v, rel_)
        two_kernel = tc.backward(p, do, q, k, v, out, m, l, rel_, None, m_kernel=m_kern)[:3]
        with monkeypatch.context() as mp:
            mp.setitem(table, ("dkdv", D), dict(tuning.FUSED_DKDV[("float32" if dt == "float32" else "float16", D)],
                                                 fuse_dq=True))
            runs = [tc.backward(p, do, q, k, v, out, m, l, rel_, None, m_kernel=m_kern)[:3] for _ in range(3)]
            assert "fixed key-tile order" in p.run_info["kernel"]
        for other in runs[1:]:
            for a, b in zip(runs[0], other):
                assert bool(cupy.all(a.view(f"u{a.itemsize}") == b.view(f"u{b.itemsize}")))
        for a, b in zip(runs[0], two_kernel):
            assert rel(a.astype(np.float64).get(), b.astype(np.float64).get()) < (1e-5 if dt == "float32" else 2e-3)


@pytest.mark.parametrize("D,name", [(64, "segments"), (64, "causal"), (128, "empty_src_block"), (128, "dense_rect"),
                                    (64, "no_keys")])
def test_opt_in_float_atomic_backward(D, name, monkeypatch):
    """TIGA_NUMBA_DETERMINISTIC=0 routes float32 to the fused kernel that adds dQ with float atomics
    (tuning.ATOMIC_DQ: measured faster): same oracle bounds, dQ rows without keys zero, explain() says
    it is not deterministic; without the variable the deterministic two-kernel path runs."""
    from tiga_numba.cuda.tc import tuning
    assert ("float32", D) in tuning.ATOMIC_DQ
    set_run_option(monkeypatch, "wgmma", "0")   # the fused atomic kernel is a 3xTF32 mma.sync one
    _poison(monkeypatch)
    rel_, (d, s, c) = relation(name)
    nd, ns, H, Hkv = int(d[-1]), int(s[-1]), 4, 2
    rng = np.random.default_rng()
    mk = lambda sh: rng.standard_normal(sh).astype(np.float32)  # noqa: E731
    q, k, v, do = mk((nd, H, D)), mk((ns, Hkv, D)), mk((ns, Hkv, D)), mk((nd, H, D))
    qg, kg, vg, dog = (cupy.asarray(x) for x in (q, k, v, do))
    p = plan(D ** -0.5)
    out, m, l, m_kern = tc.forward(p, qg, kg, vg, rel_)
    f = lambda x: np.asarray(x).astype(np.float64)  # noqa: E731
    *_, rdq, rdk, rdv = oracle(f(q), f(k), f(v), f(do), d, s, c, D ** -0.5)
    set_run_option(monkeypatch, "deterministic", "0")
    got = tc.backward(p, dog, qg, kg, vg, out, m, l, rel_, None, m_kernel=m_kern)[:3]
    assert "NOT deterministic" in p.run_info["kernel"]
    for g, want in zip(got, (rdq, rdk, rdv)):
        gh = f(g.get())
        assert g.dtype == np.float32 and gh.shape == want.shape and np.isfinite(gh).all()
        assert gh.size == 0 or rel(gh, want) < 3 * TOL["float32"]
    if name == "no_keys":
        assert not np.any(f(got[0].get()))   # no key anywhere: dQ is exactly zero
    set_run_option(monkeypatch, "deterministic", "1")
    tc.backward(p, dog, qg, kg, vg, out, m, l, rel_, None, m_kernel=m_kern)
    assert "NOT deterministic" not in p.run_info["kernel"]


#: fused wgmma backward shapes under test (16-bit): one and two warpgroups, one and two dQ row
#: units, D = 32 / 64 / 128 (D = 96: atomic only, its float32 rows do not split into whole passes)
WG_FUSED = [(32, dict(NW=8, BN=128)), (64, dict(NW=8, BN=64)), (64, dict(NW=4, BN=128)),
            (128, dict(NW=8, BN=64)), (96, dict(NW=4, BN=64))]


@pytest.mark.parametrize("atomic", [False, True], ids=["ordered", "atomic"])
@pytest.mark.parametrize("D,shape", WG_FUSED, ids=lambda x: str(x) if isinstance(x, int) else "nw{NW}bn{BN}".format(**x))
def test_wgmma_fused_backward(D, shape, atomic, monkeypatch):
    """compute capability 9.0: the fused dK/dV/dQ wgmma kernel (dS staged in shared memory, dQ = dS K
    as st chains), routed in through the tables: ordered (the shipped deterministic table entry) or
    float-atomic (TIGA_NUMBA_DETERMINISTIC=0 with ATOMIC_DQ_WGMMA), against the oracle on every
    relation incl. no keys at all, GQA, poisoned outputs; the ordered one is bitwise repeatable with
    16 key tiles racing per query block, causal and not."""
    from tiga_numba.cuda.tc import tuning
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("wgmma kernels need sm_90")
    if D == 96 and not atomic:
        pytest.skip("ordered: a 96-wide float32 row is not whole 16-byte passes of 128 threads")
    set_run_option(monkeypatch, "wgmma", "1")
    fields = dict(shape, MT=1, a_smem=True, wgmma=True)
    if atomic:
        monkeypatch.setitem(tuning.ATOMIC_DQ_WGMMA, D, fields)
        set_run_option(monkeypatch, "deterministic", "0")
    else:
        monkeypatch.setitem(tuning.TUNING_WGMMA, ("dkdv", D), dict(fields, fuse_dq=True))
    _poison(monkeypatch)
    rng = np.random.default_rng()
    f = lambda x: x.get().astype(np.float64)  # noqa: E731
    for name in list(RELS) + ["no_keys"]:
        rel_, (d, s, c) = relation(name)
        nd, ns = int(d[-1]), int(s[-1])
        mk = lambda sh, sc=1.0: cupy.asarray((rng.standard_normal(sh) * sc).astype(np.float16))  # noqa: E731
        q, k, v, do = mk((nd, 4, D), 1.5), mk((ns, 2, D)), mk((ns, 2, D)), mk((nd, 4, D))
        p = plan(D ** -0.5)
        out, m, l, m_kern = tc.forward(p, q, k, v, rel_)
        dq, dk, dv, _ = tc.backward(p, do, q, k, v, out, m, l, rel_, None, m_kernel=m_kern)
        assert ("NOT deterministic" if atomic else "fixed key-tile order") in p.run_info["kernel"], p.run_info["kernel"]
        assert "wgmma" in p.run_info["kernel"]
        *_, rdq, rdk, rdv = oracle(f(q), f(k), f(v), f(do), d, s, c, D ** -0.5)
        for got, want in ((dq, rdq), (dk, rdk), (dv, rdv)):
            g = f(got)
            assert got.dtype == q.dtype and np.isfinite(g).all(), name
            assert g.size == 0 or rel(g, want) < 3 * TOL["float16"], name   # rel: max |g| where want is 0
    if atomic:
        return
    N = 2048
    q, k, v, do = (cupy.asarray(rng.standard_normal((N, h, D)).astype(np.float16)) for h in (8, 2, 2, 8))
    for causal in (0, 1):
        rel_ = BlockRelation(cupy.asarray(np.array([0, N])), cupy.asarray(np.array([0, N])),
                             cupy.asarray(np.array([causal], np.uint8)), N, N)
        p = plan(D ** -0.5)
        out, m, l, m_kern = tc.forward(p, q, k, v, rel_)
        runs = [tc.backward(p, do, q, k, v, out, m, l, rel_, None, m_kernel=m_kern)[:3] for _ in range(3)]
        for other in runs[1:]:
            for a, b in zip(runs[0], other):
                assert bool(cupy.all(a.view(np.uint16) == b.view(np.uint16)))


def test_wgmma_routing_and_agreement(monkeypatch):
    """compute capability 9.0: 16-bit calls run the sm_90a warpgroup kernels and explain() says so;
    TIGA_NUMBA_WGMMA=0 (read per call) runs the mma.sync kernels; both meet the oracle bound and
    agree with each other. Elsewhere: mma.sync, whatever the variable says."""
    rel_, (d, s, c) = relation("segments")
    nd = int(d[-1])
    rng = np.random.default_rng()
    q, k, v, do = (cupy.asarray((rng.standard_normal((nd, 4 if i in (0, 3) else 2, 128)) * (1.5 if i == 0 else 1))
                                .astype(np.float16)) for i in range(4))
    sm90 = cupy.cuda.Device().compute_capability == "90"
    res = {}
    for flag in ("1", "0"):
        set_run_option(monkeypatch, "wgmma", flag)
        p = plan(128 ** -0.5)
        out, m, l, m_kern = tc.forward(p, q, k, v, rel_)
        assert ("wgmma" in p.run_info["kernel"]) == (sm90 and flag == "1")
        grads = tc.backward(p, do, q, k, v, out, m, l, rel_, None, m_kernel=m_kern)[:3]
        assert ("wgmma" in p.run_info["kernel"]) == (sm90 and flag == "1")
        res[flag] = [x.get().astype(np.float64) for x in (out, *grads)]
    f = lambda x: x.get().astype(np.float64)  # noqa: E731
    ro, _, _, rdq, rdk, rdv = oracle(f(q), f(k), f(v), f(do), d, s, c, 128 ** -0.5)
    for flag in ("1", "0"):
        for got, want, tol in zip(res[flag], (ro, rdq, rdk, rdv), (4e-3, 1.2e-2, 1.2e-2, 1.2e-2)):
            assert rel(got, want) < tol
    for a_, b_ in zip(res["1"], res["0"]):
        assert rel(a_, b_) < 5e-3


@pytest.mark.parametrize("D,causal", [(64, 1), (128, 0)])
def test_float32_engines_agree_on_long_rows(D, causal, monkeypatch):
    """float32 on compute capability 9.0: the wgmma kernels on bf16 x 3 splits (default) and the
    3xTF32 mma.sync ones (TIGA_NUMBA_WGMMA=0) both stay fp32-class on 4096-key rows, where a
    truncating accumulation fed back across blocks would not (per-block partials), and agree."""
    N, H, Hkv = 4096, 2, 1
    rng = np.random.default_rng()
    mk = lambda sh: cupy.asarray(rng.standard_normal(sh).astype(np.float32))  # noqa: E731
    q, k, v, do = mk((N, H, D)), mk((N, Hkv, D)), mk((N, Hkv, D)), mk((N, H, D))
    rel_ = BlockRelation(cupy.asarray(np.array([0, N])), cupy.asarray(np.array([0, N])),
                         cupy.asarray(np.array([causal], np.uint8)), N, N)
    f = lambda x: x.get().astype(np.float64)  # noqa: E731
    ro, _, _, rdq, rdk, rdv = oracle(f(q), f(k), f(v), f(do), np.array([0, N]), np.array([0, N]),
                                     np.array([causal]), D ** -0.5)
    sm90 = cupy.cuda.Device().compute_capability == "90"
    res = {}
    for flag in ("1", "0"):
        set_run_option(monkeypatch, "wgmma", flag)
        p = plan(D ** -0.5)
        out, m, l, m_kern = tc.forward(p, q, k, v, rel_)
        assert ("bf16 x 3" in p.run_info["precision"]) == (sm90 and flag == "1")
        grads = tc.backward(p, do, q, k, v, out, m, l, rel_, None, m_kernel=m_kern)[:3]
        assert ("bf16 x 3" in p.run_info["kernel"]) == (sm90 and flag == "1")
        res[flag] = [f(x) for x in (out, *grads)]
        for got, want in zip(res[flag], (ro, rdq, rdk, rdv)):
            assert rel(got, want) < 1e-5
    for a_, b_ in zip(res["1"], res["0"]):
        assert rel(a_, b_) < 1e-5


@pytest.mark.parametrize("dt", ["float16", "float32"])
@pytest.mark.parametrize("D", [32, 96])
def test_wgmma_head_dims_32_and_96(D, dt, monkeypatch):
    """compute capability 9.0: D = 32 and 96 run on the wgmma kernels (rows padded in shared
    memory; float32 on bf16 x 3 splits) against the oracle, poisoned outputs, GQA, segments with
    length-0/1 blocks; elsewhere supports() refuses them (the CUDA-core kernels take them)."""
    set_run_option(monkeypatch, "wgmma", "1")
    rel_, (d, s, c) = relation("segments")
    nd = int(d[-1])
    rng = np.random.default_rng()
    mk = lambda sh, f=1.0: cupy.asarray((rng.standard_normal(sh) * f).astype(dt))  # noqa: E731
    q, k, v, do = mk((nd, 4, D), 1.5), mk((nd, 2, D)), mk((nd, 2, D)), mk((nd, 4, D))
    p = plan(D ** -0.5)
    if cupy.cuda.Device().compute_capability != "90":
        assert not tc.supports(p, q, k, v, rel_)
        return
    assert tc.supports(p, q, k, v, rel_)
    _poison(monkeypatch)
    out, m, l, m_kern = tc.forward(p, q, k, v, rel_)
    assert "wgmma" in p.run_info["kernel"]
    dq, dk, dv, _ = tc.backward(p, do, q, k, v, out, m, l, rel_, None, m_kernel=m_kern)
    f = lambda x: x.get().astype(np.float64)  # noqa: E731
    ro, rm, *_, rdq, rdk, rdv = oracle(f(q), f(k), f(v), f(do), d, s, c, D ** -0.5)
    tol = TOL[dt]
    assert out.dtype == q.dtype and rel(f(out), ro) < tol
    for got, want in ((dq, rdq), (dk, rdk), (dv, rdv)):
        assert np.isfinite(f(got)).all() and rel(f(got), want) < 3 * tol
    set_run_option(monkeypatch, "wgmma", "0")
    assert not tc.supports(p, q, k, v, rel_)


@pytest.mark.parametrize("dt,wgmma", [("float16", "1"), ("float16", "0"), ("float32", "1")])
@pytest.mark.parametrize("causal", [1, 0])
def test_pruned_forward_on_the_tensor_cores(dt, wgmma, causal, monkeypatch):
    """tile pruning on the tensor-core path (wgmma, mma.sync, 3xTF32): a local workload (far tiles
    fall below the threshold) against the float64 replay of the rule with the kernel's own tiles
    and order; explain()'s counts are the replay's; the backward of a pruned call refuses."""
    from test_tc_emulator import _local_inputs, prune_oracle
    from tiga_numba.cuda.tc import tuning
    set_run_option(monkeypatch, "wgmma", wgmma)
    n, D, rho = 1000, 64, 0.05
    q, k, v = _local_inputs(np.random.default_rng(), n, 4, 2, D, dt)
    qg, kg, vg = (cupy.asarray(x.astype(dt)) for x in (q, k, v))
    d = s = np.array([0, n])
    rel_ = BlockRelation(cupy.asarray(d), cupy.asarray(s), cupy.asarray(np.array([causal], np.uint8)), n, n)
    p = types.SimpleNamespace(scale=0.125, prune_threshold=rho, score="dot", run_info={})
    assert tc.supports(p, qg, kg, vg, rel_)
    out, m, l, m_kern = tc.forward(p, qg, kg, vg, rel_)
    vr = tuning.variant("fwd", D, D, dt)
    ro, pruned, visited = prune_oracle(q, k, v, d, s, [causal], 0.125, rho, vr.BM, vr.BN)
    assert "tile pruning" in p.run_info["kernel"]
    assert (p.run_info["pruned_tiles"], p.run_info["total_tiles"]) == (pruned, visited) and pruned > 0
    assert rel(out.get().astype(np.float64), ro) < (2e-5 if dt == "float32" else 4e-3)
    with pytest.raises(NotImplementedError):
        tc.backward(p, qg, qg, kg, vg, out, m, l, rel_, None, m_kernel=m_kern)


def test_pruned_call_defers_its_counter_read():
    """through tg.attention the pruned call's tile counts are a deferred read (plan.RunInfo): nothing
    blocks the call, and the first look at run_info / explain() gives the same counts as a direct
    call with a plain dict (same kernel, same data)."""
    import tiga_numba as tg
    from tiga_numba import functional
    from test_tc_emulator import _local_inputs
    n = 700
    q, k, v = (cupy.asarray(x.astype(np.float16)) for x in _local_inputs(np.random.default_rng(), n, 2, 2, 64, "float16"))
    out = tg.attention(q, k, v, tg.Graph.triangular(n), scale=0.125, block_prune_threshold=0.05)
    plan_ = functional.last_plan()
    assert "tensor-core" in plan_.run_info["kernel"]
    from tiga_numba.plan import RunInfo
    assert isinstance(dict.__getitem__(plan_.run_info, "pruned_tiles"), RunInfo._Pending)   # not read yet
    text = plan_.explain()
    pruned, total = plan_.run_info["pruned_tiles"], plan_.run_info["total_tiles"]
    assert isinstance(pruned, int) and f"{pruned}/{total} tiles pruned" in text and pruned > 0
    p = types.SimpleNamespace(scale=0.125, prune_threshold=0.05, score="dot", run_info={})
    d = np.array([0, n])
    rel_ = BlockRelation(cupy.asarray(d), cupy.asarray(d), cupy.asarray(np.array([1], np.uint8)), n, n)
    direct = tc.forward(p, q, k, v, rel_)[0]
    assert (p.run_info["pruned_tiles"], p.run_info["total_tiles"]) == (pruned, total)
    assert bool(cupy.array_equal(direct, out))


def _wgmma_case(D, dt, name, monkeypatch):
    """a wgmma (sm_90a) case of relation `name`: skips elsewhere or without bfloat16 arrays; poisons
    the outputs; fresh random q, k, v, dout (4 query heads, 2 kv heads) on the host and the device,
    the relation and its host offsets."""
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("a wgmma (sm_90a) kernel")
    npdt = np.float16 if dt == "float16" else bf16()
    if npdt is None:
        pytest.skip("cupy cannot hold bfloat16 arrays here")
    _poison(monkeypatch)
    rel_, (d, s, c) = relation(name)
    nd, ns = int(d[-1]), int(s[-1])
    rng = np.random.default_rng()
    host = [rng.standard_normal(sh).astype(npdt) for sh in ((nd, 4, D), (ns, 2, D), (ns, 2, D), (nd, 4, D))]
    return host, [cupy.asarray(x) for x in host], rel_, (d, s, c)


#: (the Variant field flipped, D, dtype): overlap = the pipelined loop (as shipped: in ping-pong where
#: it applies) against the serial one; pingpong = the ping-pong loop against the CTA-barrier pipeline
FORWARD_TWINS = ([("overlap", D, dt) for D, dt in ((64, "float16"), (128, "float16"), (128, "bfloat16"), (256, "float16"))]
                 + [("pingpong", D, dt) for D, dt in ((128, "float16"), (128, "bfloat16"), (96, "float16"), (256, "float16"))])


@pytest.mark.parametrize("field,D,dt", FORWARD_TWINS)
@pytest.mark.parametrize("name", ["causal", "segments", "dense_rect"])
def test_forward_key_loops_match_bitwise(field, D, dt, name, monkeypatch):
    """sm_90a: the wgmma forward's key loops give the same bits on the device and meet the float64
    oracle: the pipelined loop (P V of one key block in flight during the next block's softmax,
    Variant.fwd_pipelined) against its serial twin (overlap=False: every chain waited for at once),
    and the loop whose two warpgroups take turns through the mbarrier ring (Variant.pingpong)
    against the CTA-barrier pipeline. Outputs poisoned, GQA, tails, empty rows, the shipped tile
    shapes (D = 128: two warpgroups, 128-key blocks)."""
    from tiga_numba.cuda.tc import tuning
    (q, k, v, _), (qg, kg, vg, _), rel_, (d, s, c) = _wgmma_case(D, dt, name, monkeypatch)
    shape = dict(tuning.TUNING_WGMMA[("fwd", D)])
    if field == "pingpong":
        shape["overlap"] = True
        assert shape["NW"] == 8
    monkeypatch.setattr(tuning, "NARROW_KEYS", -1)   # these small relations: the shipped shape, not the narrow-band one
    outs = []
    for on in (True, False):
        monkeypatch.setitem(tuning.TUNING_WGMMA, ("fwd", D), dict(shape, **{field: on}))
        vr = tuning.variant("fwd", D, D, dt, wgmma=True)
        assert (vr.pingpong_loop if field == "pingpong" else vr.fwd_pipelined) == on
        p = plan(D ** -0.5)
        outs.append([x.get() for x in tc.forward(p, qg, kg, vg, rel_)[:3]])
        assert "wgmma" in p.run_info["kernel"]
    for a, b in zip(*outs):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    f = lambda x: np.asarray(x).astype(np.float64)  # noqa: E731
    ro, rm, *_ = oracle(f(q), f(k), f(v), f(q), d, s, c, D ** -0.5)
    o = f(outs[0][0])
    assert np.isfinite(o).all() and rel(o, ro) < TOL[dt]


@pytest.mark.parametrize("D,dt", [(64, "float16"), (128, "float16"), (128, "bfloat16"), (256, "float16")])
@pytest.mark.parametrize("name", ["causal", "segments", "dense_rect", "empty_src_block"])
def test_dkdv_statistics_copy_matches_global_loads_bitwise(D, dt, name, monkeypatch):
    """sm_90a: the wgmma dK/dV kernel that copies each query block's statistics to shared memory
    (Variant.stats_smem, copies.py's cp.async) gives the bits of its twin that loads them from global
    memory, and both meet the float64 oracle. Outputs poisoned, GQA, tails, empty rows, shipped shapes."""
    from tiga_numba.cuda.tc import tuning
    (q, k, v, do), (qg, kg, vg, dog), rel_, (d, s, c) = _wgmma_case(D, dt, name, monkeypatch)
    p = plan(D ** -0.5)
    out, m, l, m_kern = tc.forward(p, qg, kg, vg, rel_)
    grads = []
    shape = dict(tuning.TUNING_WGMMA[("dkdv", D)])
    for on in (True, False):
        monkeypatch.setitem(tuning.TUNING_WGMMA, ("dkdv", D), dict(shape, stats_smem=on))
        assert tuning.variant("dkdv", D, D, dt, wgmma=True).stats_in_smem == on
        grads.append([x.get() for x in tc.backward(p, dog, qg, kg, vg, out, m, l, rel_, None, m_kernel=m_kern)[:3]])
    for a, b in zip(*grads):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    f = lambda x: np.asarray(x).astype(np.float64)  # noqa: E731
    *_, rdq, rdk, rdv = oracle(f(q), f(k), f(v), f(do), d, s, c, D ** -0.5)
    for got, want in zip(grads[0], (rdq, rdk, rdv)):
        assert np.isfinite(f(got)).all() and rel(f(got), want) < 3 * TOL[dt]
