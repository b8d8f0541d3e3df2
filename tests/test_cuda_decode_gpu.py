"""GPU tests of the split-key decode kernel's load geometries (marked gpu; skipped without
cupy and a CUDA device): 16-byte vector loads when the k / v rows are 16-byte aligned with unit
stride along D, scalar loads otherwise. All against the float64 oracle on fresh random inputs (GQA, an empty
key range, several splits, non-finite values outside a row's band), and against each other."""
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")   # without cupy: nothing to test; without a device: conftest skips

pytestmark = pytest.mark.gpu

from test_cuda_gpu import _shield, rel_err  # noqa: E402

_shield()
import tiga_numba as tg  # noqa: E402
from tiga_numba import functional  # noqa: E402

from test_cuda_sim import oracle  # noqa: E402

RNG = np.random.default_rng(20261202)


def _mask(g):
    return np.asarray(g.to_scipy().toarray() != 0)


GRAPHS = {
    "dense_1": lambda: tg.Graph.dense(5003, 1),
    "varlen_1q": lambda: tg.Graph.cu_seqlens(np.arange(5), cu_seqlens_k=[0, 1, 2000, 2000, 4100],
                                             causal=True),
    "varlen_3q": lambda: tg.Graph.cu_seqlens([0, 3, 6], cu_seqlens_k=[0, 1500, 1533], causal=True),
}


@pytest.mark.parametrize("kind", list(GRAPHS))
@pytest.mark.parametrize("D,H,Hkv", [(128, 8, 2), (64, 4, 4)])
def test_vector_and_scalar_loads_match_the_oracle(kind, D, H, Hkv):
    g = GRAPHS[kind]()
    q = RNG.standard_normal((g.num_dst, H, D)).astype(np.float16)
    k = RNG.standard_normal((g.num_src, Hkv, D)).astype(np.float16)
    v = RNG.standard_normal((g.num_src, Hkv, D)).astype(np.float16)
    M = _mask(g)
    ro = oracle(q, k, v, M, D ** -0.5)[0]
    qd = cupy.asarray(q)
    # aligned: plain contiguous arrays
    kd, vd = cupy.asarray(k), cupy.asarray(v)
    out_a = tg.attention(qd, kd, vd, g)
    kern_a = functional.last_plan().run_info["kernel"]
    assert kern_a.startswith("cuda.decode.forward") and "16-byte K/V loads" in kern_a, kern_a
    # unaligned: the same values at an odd element offset inside a wider buffer
    kb = cupy.zeros((g.num_src, Hkv, D + 1), np.float16)
    vb = cupy.zeros((g.num_src, Hkv, D + 1), np.float16)
    kb[:, :, 1:] = kd
    vb[:, :, 1:] = vd
    out_s = tg.attention(qd, kb[:, :, 1:], vb[:, :, 1:], g)
    kern_s = functional.last_plan().run_info["kernel"]
    assert "scalar K/V loads" in kern_s, kern_s
    for out in (out_a, out_s):
        assert rel_err(cupy.asnumpy(out), ro) < 4e-3
    assert rel_err(cupy.asnumpy(out_a), cupy.asnumpy(out_s)) < 1e-3
    out_a2 = tg.attention(qd, kd, vd, g)
    assert bool(cupy.all(out_a == out_a2)), "vector-load decode not bitwise repeatable"
    if kind == "varlen_3q":
        # the last key of the first segment is outside the band of its first two query rows:
        # non-finite there, it must not reach them (rows that see it may turn non-finite)
        assert not M[0, 1499] and not M[1, 1499] and M[2, 1499]
        kp, vp = k.copy(), v.copy()
        kp[1499], vp[1499] = np.nan, np.inf
        out_p = cupy.asnumpy(tg.attention(qd, cupy.asarray(kp), cupy.asarray(vp), g))
        keep = [0, 1, 3, 4, 5]
        assert np.isfinite(out_p[keep]).all(), "a non-finite key outside a row's band reached it"
        assert rel_err(out_p[keep], ro[keep]) < 4e-3
