"""float16 and bfloat16 inputs on the CPU: widened to float32 inside the head-major copy that
every input gets, float32 accumulation, results in the input dtype, float32 stats; compared
with the float64 oracle on the rounded inputs, forward and backward, on every relation kind."""
import numpy as np
import pytest
import scipy.sparse as sp

import tiga_numba as tg
from conftest import attention_oracle

ml_dtypes = pytest.importorskip("ml_dtypes")
RNG = np.random.default_rng(11)
HALF = {"float16": (np.float16, 4e-3), "bfloat16": (ml_dtypes.bfloat16, 3e-2)}


def _relations():
    mask = RNG.random((21, 17)) < 0.3
    mask[4] = False          # an empty row
    mask[:, 3] = True        # a hub source
    return {
        "dense-rect": tg.Graph.dense(17, 21),
        "triangular": tg.Graph.triangular(21),
        "segments": tg.Graph.cu_seqlens(np.array([0, 6, 6, 7, 21]), causal=True),
        "band": tg.Graph.band(21, left=5, right=2),
        "csr": tg.Graph.from_scipy(sp.csr_matrix(mask.astype(np.float64))),
    }


RELATIONS = _relations()


@pytest.mark.parametrize("dtype", sorted(HALF))
@pytest.mark.parametrize("rel", sorted(RELATIONS))
def test_half_inputs_forward_and_backward_match_the_oracle(rel, dtype):
    g = RELATIONS[rel]
    dt, tol = HALF[dtype]
    H, Hkv, D, DV = 4, 2, 8, 6
    q = RNG.standard_normal((g.num_dst, H, D)).astype(dt)
    k = RNG.standard_normal((g.num_src, Hkv, D)).astype(dt)
    v = RNG.standard_normal((g.num_src, Hkv, DV)).astype(dt)
    dout = RNG.standard_normal((g.num_dst, H, DV)).astype(dt)
    mask = g.to_scipy().toarray() != 0
    want, wm, wl, wdq, wdk, wdv = attention_oracle(q, k, v, mask, dout=dout)
    out, stats = tg.attention(q, k, v, g, return_stats=True)
    assert out.dtype == np.dtype(dt) and out.shape == want.shape
    assert stats.m.dtype == np.float32 and stats.l.dtype == np.float32
    np.testing.assert_allclose(out.astype(np.float64), want, atol=tol, rtol=tol)
    np.testing.assert_allclose(stats.l, wl, rtol=1e-4 if dtype == "float16" else 2e-3)
    assert np.isneginf(stats.m[~mask.any(axis=1)]).all()
    grads = tg.attention_backward(dout, q, k, v, out, stats, g)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, (wdq, wdk, wdv)):
        assert got.dtype == np.dtype(dt), name
        scale = max(1.0, float(np.abs(ref).max()))
        err = float(np.abs(got.astype(np.float64) - ref).max())
        assert err <= 4 * tol * scale, (name, err)


def test_half_inputs_name_their_widening_copy():
    g = RELATIONS["triangular"]
    q = RNG.standard_normal((g.num_dst, 2, 8)).astype(ml_dtypes.bfloat16)
    assert "inputs bfloat16, accumulation float32" in tg.make_plan(q, q, q, g).explain()
    out, st = tg.attention(q, q, q, g, return_stats=True)
    assert out.dtype == q.dtype
    assert any("bfloat16 -> float32" in c for c in st.plan.run_info["copies"]), st.plan.run_info["copies"]


def test_mixed_half_dtypes_are_refused():
    g = RELATIONS["dense-rect"]
    q = np.zeros((g.num_dst, 1, 4), np.float16)
    k = np.zeros((g.num_src, 1, 4), ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match="k"):
        tg.attention(q, k, k, g)
