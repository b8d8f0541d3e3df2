"""Score modifiers on the tensor cores, on the GPU (marked gpu): flash-attn's softcap= and
alibi_slopes= through tg.attention / tg.attention_backward with cupy float16 / bfloat16 inputs,
causal and rectangular cu_seqlens relations, GQA, against the float64 oracle of
tests/test_tc_modifiers.py; the registry picks cuda.tc for them and sends a modifier whose params
want gradients to the CUDA cores."""
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")   # without cupy: nothing to test; without a device: conftest skips

pytestmark = pytest.mark.gpu

from test_cuda_gpu import _shield  # noqa: E402

_shield()
import tiga_numba as tg  # noqa: E402
from tiga_numba import functional, score_mod as sm  # noqa: E402

import test_tc_modifiers as ttm  # noqa: E402

TOL = {"float16": 4e-3, "bfloat16": 3e-2}


def _relation(kind):
    """(graph, num_dst, num_src): causal; causal segments of lengths 1, 0, 69, 80, 150; a dense
    rectangular block (ALiBi bottom-right aligned through its shift field); bottom-right causal
    rectangular segments (aligned, ordered: the forward splits ALiBi's distance)."""
    if kind == "causal":
        return tg.Graph.triangular(300), 300, 300
    if kind == "segments":
        return tg.Graph.cu_seqlens(np.array([0, 1, 1, 70, 150, 300])), 300, 300
    if kind == "rect_causal":
        return tg.Graph.cu_seqlens([0, 30, 100, 260], cu_seqlens_k=[0, 50, 90, 400]), 260, 400
    return tg.Graph.dense(230, 150), 150, 230


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kind", ["causal", "segments", "rect", "rect_causal"])
@pytest.mark.parametrize("which", ["softcap", "alibi"])
def test_functional_modifiers_run_on_the_tensor_cores(dtype, D, kind, which):
    graph, nd, ns = _relation(kind)
    rng = np.random.default_rng(D + len(kind) + len(which))
    H, Hkv = 4, 2
    q, k, v, do = ttm._inputs(rng, nd, ns, H, Hkv, D, dtype)
    slopes = rng.uniform(0.05, 0.5, H)
    kw = dict(softcap=2.0) if which == "softcap" else dict(alibi_slopes=cupy.asarray(slopes, cupy.float32))
    if dtype == "float16":
        to = lambda x: cupy.asarray(x.astype(np.float16))  # noqa: E731
    else:
        ml_dtypes = pytest.importorskip("ml_dtypes")
        to = lambda x: cupy.asarray(x.astype(ml_dtypes.bfloat16))  # noqa: E731
    qd, kd, vd, dod = (to(x) for x in (q, k, v, do))
    out, stats = tg.attention(qd, kd, vd, graph, return_stats=True, **kw)
    assert "kernel family: cuda.tc" in tg.explain()
    assert ("taken as the exponent scale" in tg.explain()) == (which == "softcap")   # modifier.Fold
    # ALiBi on a relation that keeps sources at or before the destination's position: modifier.Split
    assert ("taken as the signed distance" in tg.explain()) == (which == "alibi" and kind != "rect")
    dq, dk, dv = tg.attention_backward(dod, qd, kd, vd, out, stats, graph, **kw)
    bound = functional.flash_modifier(q, graph, kw.get("softcap"), slopes if which == "alibi" else None)
    values = {x: (np.asarray(val) if not isinstance(val, float) else val) for x, val in bound.values.items()}
    # the oracle's blocks: one per segment (rectangular, bottom-right causal via the relation's own mask)
    ref = _masked_oracle(bound.tree, values, q, k, v, do, graph.to_scipy().toarray() != 0, D ** -0.5)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref):
        got = cupy.asnumpy(got).astype(np.float32)
        assert np.isfinite(got).all(), name
        assert ttm.rel(got, want) < TOL[dtype] * (1 if name == "out" else 3), (name, ttm.rel(got, want))
    assert "kernel family: cuda.tc" in tg.explain()


def _masked_oracle(tree, values, q, k, v, do, keep, scale):
    nd, H, D = q.shape
    ns, Hkv, Dv = v.shape
    g = H // Hkv
    S = sm.SCORE
    dtree = sm.diff(tree, S)
    ii = np.arange(nd, dtype=np.float64)[:, None]
    jj = np.arange(ns, dtype=np.float64)[None, :]
    out = np.zeros((nd, H, Dv))
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    live = keep.any(1)
    for h in range(H):
        qq, kk, vv = (x.astype(np.float64) for x in (q[:, h], k[:, h // g], v[:, h // g]))
        z = qq @ kk.T * scale
        env = {S: z, ttm.DST: ii, ttm.SRC: jj}
        for x, val in values.items():
            if x.op == "scalar":
                env[x] = np.float64(val)
            elif x.op == "head":
                env[x] = np.float64(np.asarray(val)[h])
            else:
                a = np.asarray(val, np.float64)
                env[x] = (a[:, h] if a.ndim == 2 else a)[:, None]
        y = np.clip(sm.evaluate(tree, env), -1e30, 1e30)
        d = np.broadcast_to(sm.evaluate(dtree, env), z.shape)
        y = np.where(keep, y, -np.inf)
        mm = np.where(live, y.max(1), 0.0)
        p = np.where(keep, np.exp(y - mm[:, None]), 0.0)
        p /= np.where(live, p.sum(1), 1.0)[:, None]
        o = p @ vv
        out[:, h] = o
        dO = do[:, h].astype(np.float64)
        dv[:, h // g] += p.T @ dO
        ds = np.where(keep, p * (dO @ vv.T - (dO * o).sum(1)[:, None]) * d, 0.0)
        dq[:, h] = ds @ kk * scale
        dk[:, h // g] += ds.T @ qq * scale
    return out, dq, dk, dv


def test_the_cell_clamp_masks_nan_and_minus_inf_on_the_device():
    """clampf (max.f32 then min.f32), which every modified cell goes through with the masked
    value as its floor: NaN, -inf and values below give the masked value (the edge is masked),
    +inf the ceiling, values in between pass unchanged (as the emulator's fmax / fmin)."""
    from numba import cuda

    from tiga_numba.cuda.tc import emulator, ptx
    from tiga_numba.cuda.tc.generator.modifier import CEIL
    from tiga_numba.cuda.tc.generator.variant import MASKED as FLOOR
    clampf = ptx.intrinsics("float16")["clampf"]

    @cuda.jit
    def clamp_all(x, out, lo, hi):
        i = cuda.grid(1)
        if i < x.shape[0]:
            out[i] = clampf(x[i], lo, hi)

    x = np.array([np.nan, -np.inf, np.inf, -3e38, 3e38, -1.5, 0.0, 2.5e29, -2e29, 7e29, -2e30], np.float32)
    xd = cupy.asarray(x)
    out = cupy.empty_like(xd)
    clamp_all[1, 32](xd, out, np.float32(FLOOR), np.float32(CEIL))
    got = cupy.asnumpy(out)
    want = np.array([FLOOR, FLOOR, CEIL, FLOOR, CEIL, -1.5, 0.0, 2.5e29, -2e29, 7e29, FLOOR], np.float32)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(emulator._clampf(x, FLOOR, CEIL), want)


def test_a_soft_cap_too_large_for_the_fold_runs_unfolded():
    """softcap=1e5 (c log2(e) above modifier.FOLD_LIMIT): the kernels without the fold, and the
    right answer; the soft-cap of 2 beside it takes the folded ones."""
    rng = np.random.default_rng(11)
    nd = ns = 200
    H, D = 2, 64
    graph = tg.Graph.triangular(nd)
    q, k, v, do = ttm._inputs(rng, nd, ns, H, H, D, "float16")
    qd, kd, vd, dod = (cupy.asarray(x.astype(np.float16)) for x in (q, k, v, do))
    for cap in (1e5, 2.0):
        out, stats = tg.attention(qd, kd, vd, graph, return_stats=True, softcap=cap)
        assert ("taken as the exponent scale" in tg.explain()) == (cap == 2.0)
        dq, dk, dv = tg.attention_backward(dod, qd, kd, vd, out, stats, graph, softcap=cap)
        assert ("taken as the exponent scale" in tg.explain()) == (cap == 2.0)
        bound = functional.flash_modifier(q, graph, cap, None)
        ref = _masked_oracle(bound.tree, dict(bound.values), q, k, v, do, graph.to_scipy().toarray() != 0, D ** -0.5)
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref):
            got = cupy.asnumpy(got).astype(np.float32)
            assert np.isfinite(got).all(), name
            assert ttm.rel(got, want) < TOL["float16"] * (1 if name == "out" else 3), (cap, name, ttm.rel(got, want))


def test_the_one_bound_clamp_on_the_device():
    """clamps.atleast (max.f32), the folded modifier's clamp: NaN, -inf and values below the floor
    give the floor, everything else passes unchanged (as the emulator's fmax)."""
    from numba import cuda

    from tiga_numba.cuda.tc import clamps, emulator
    from tiga_numba.cuda.tc.generator.variant import MASKED as FLOOR
    atleast = clamps.intrinsics()["atleast"]

    @cuda.jit
    def floor_all(x, out, lo):
        i = cuda.grid(1)
        if i < x.shape[0]:
            out[i] = atleast(x[i], lo)

    x = np.array([np.nan, -np.inf, np.inf, -3e38, 3e38, -1.5, 0.0, -2e30, 1.0], np.float32)
    xd = cupy.asarray(x)
    out = cupy.empty_like(xd)
    floor_all[1, 32](xd, out, np.float32(FLOOR))
    want = np.array([FLOOR, FLOOR, np.inf, FLOOR, 3e38, -1.5, 0.0, FLOOR, 1.0], np.float32)
    np.testing.assert_array_equal(cupy.asnumpy(out), want)
    np.testing.assert_array_equal(emulator._atleast(x, FLOOR), want)
