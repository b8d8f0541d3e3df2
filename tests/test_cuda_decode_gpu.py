"""GPU tests of the split-key decode kernels (marked gpu; skipped without cupy and a CUDA
device): where the k / v rows are 16-byte aligned with unit stride along D, the tensor-core
kernel (float16, D 64 or 128) or the CUDA-core kernel with 16-byte loads; scalar loads
otherwise. All against the float64 oracle on fresh random inputs (GQA, up to 16 rows per CTA,
an empty segment, several splits, non-finite values outside a row's band), and against each
other."""
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
    "varlen_4q": lambda: tg.Graph.cu_seqlens([0, 4, 4, 8], cu_seqlens_k=[0, 2100, 2100, 2171],
                                             causal=True),
}
# (the last key of the first segment, the rows that do not see it, the row that does)
EDGE_KEY = {"varlen_3q": (1499, [0, 1], 2), "varlen_4q": (2099, [0, 1, 2], 3)}


@pytest.fixture(params=["tensor-cores", "tensor-cores-other-step", "cuda-cores"])
def aligned_kernel(request, monkeypatch):
    """which kernel takes aligned rows: the tensor-core one (the default for these shapes; also
    with the other number of keys per warp step, 16 or 32, and one warp per CTA) or the CUDA-core
    one with 16-byte loads (what other head dims take)"""
    from tiga_numba.cuda import decode
    if request.param == "cuda-cores":
        monkeypatch.setattr(decode, "mma_fits", lambda *a: False)
    elif request.param == "tensor-cores-other-step":
        monkeypatch.setattr(decode, "MMA_KEYS", 48 - decode.MMA_KEYS)
        monkeypatch.setattr(decode, "MMA_WARPS", 1)
    return request.param


@pytest.mark.parametrize("kind", list(GRAPHS))
@pytest.mark.parametrize("D,H,Hkv", [(128, 8, 2), (64, 4, 4), (128, 16, 4)])
def test_aligned_and_scalar_loads_match_the_oracle(kind, D, H, Hkv, aligned_kernel):
    g = GRAPHS[kind]()
    q = RNG.standard_normal((g.num_dst, H, D)).astype(np.float16)
    k = RNG.standard_normal((g.num_src, Hkv, D)).astype(np.float16)
    v = RNG.standard_normal((g.num_src, Hkv, D)).astype(np.float16)
    M = _mask(g)
    ro = oracle(q, k, v, M, D ** -0.5)[0]
    qd = cupy.asarray(q)
    # aligned: plain contiguous arrays
    kd, vd = cupy.asarray(k), cupy.asarray(v)
    out_a, st_a = tg.attention(qd, kd, vd, g, return_stats=True)
    kern_a = functional.last_plan().run_info["kernel"]
    want = "tensor cores" if aligned_kernel.startswith("tensor-cores") else "16-byte K/V loads"
    assert kern_a.startswith("cuda.decode.forward") and want in kern_a, kern_a
    # unaligned: the same values at an odd element offset inside a wider buffer
    kb = cupy.zeros((g.num_src, Hkv, D + 1), np.float16)
    vb = cupy.zeros((g.num_src, Hkv, D + 1), np.float16)
    kb[:, :, 1:] = kd
    vb[:, :, 1:] = vd
    out_s, st_s = tg.attention(qd, kb[:, :, 1:], vb[:, :, 1:], g, return_stats=True)
    kern_s = functional.last_plan().run_info["kernel"]
    assert "scalar K/V loads" in kern_s, kern_s
    for out in (out_a, out_s):
        assert rel_err(cupy.asnumpy(out), ro) < 4e-3
    assert rel_err(cupy.asnumpy(out_a), cupy.asnumpy(out_s)) < 2e-3
    # the row statistics agree too (the backward takes them as they are)
    ma, ms = cupy.asnumpy(st_a.m), cupy.asnumpy(st_s.m)
    assert np.array_equal(np.isfinite(ma), np.isfinite(ms))
    fin = np.isfinite(ma)
    assert np.allclose(ma[fin], ms[fin], rtol=1e-5, atol=1e-5)
    assert np.allclose(cupy.asnumpy(st_a.l), cupy.asnumpy(st_s.l), rtol=2e-3)
    out_a2 = tg.attention(qd, kd, vd, g)
    assert bool(cupy.all(out_a == out_a2)), "aligned-load decode not bitwise repeatable"
    if kind in EDGE_KEY:
        # non-finite K / V at a key outside some rows' band must not reach them (the row that
        # sees it may turn non-finite); rows of the other segments stay as they were
        last, blind, sees = EDGE_KEY[kind]
        assert not M[blind, last].any() and M[sees, last]
        keep = [r for r in range(g.num_dst) if r not in (sees,) and (r in blind or not M[r, :last + 1].any())]
        kp, vp = k.copy(), v.copy()
        kp[last], vp[last] = np.nan, np.inf
        out_p = cupy.asnumpy(tg.attention(qd, cupy.asarray(kp), cupy.asarray(vp), g))
        assert np.isfinite(out_p[keep]).all(), "a non-finite key outside a row's band reached it"
        assert rel_err(out_p[keep], ro[keep]) < 4e-3


def test_split_merge_on_two_streams_at_once():
    """A long decode row cut into key chunks and merged, issued on two streams in turn without
    waiting: every call keeps its partials in its own allocation (on its own stream), so all of
    them give the bits of one call on its own."""
    g = tg.Graph.dense(40000, 1)
    q = RNG.standard_normal((1, 8, 128)).astype(np.float16)
    k = RNG.standard_normal((40000, 2, 128)).astype(np.float16)
    v = RNG.standard_normal((40000, 2, 128)).astype(np.float16)
    qd, kd, vd = cupy.asarray(q), cupy.asarray(k), cupy.asarray(v)
    ref = tg.attention(qd, kd, vd, g)
    kern = functional.last_plan().run_info["kernel"]
    assert "tensor cores" in kern and "key chunks of" in kern, kern
    assert rel_err(cupy.asnumpy(ref), oracle(q, k, v, _mask(g), 128 ** -0.5)[0]) < 4e-3
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    outs = []
    for i in range(24):
        with streams[i % 2]:
            outs.append(tg.attention(qd, kd, vd, g))
    for s in streams:
        s.synchronize()
    assert all(bool(cupy.all(o == ref)) for o in outs), "a call on two streams at once changed the bits"
