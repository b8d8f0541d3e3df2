"""Head dim 256 on the GPU (marked gpu): on compute capability 9.0 both passes of a float16 /
bfloat16 call run on the wgmma tensor-core kernels (tuning.WGMMA_PLAIN_DIMS: the dK/dV kernel keeps
half of the dK and dV columns per CTA), through tg.attention / tg.attention_backward, against the
float64 edge oracle (tiga_numba.reference): dense rectangular with tails, causal, varlen with
length-0/1 segments, a sliding window, GQA; float32 (and everything off sm_90) takes the CUDA cores.
The CUDA cores have no bfloat16 kernels: there a bfloat16 backward at D = 256 raises
NotImplementedError."""
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")   # without cupy: nothing to test; without a device: conftest skips

pytestmark = pytest.mark.gpu

from test_cuda_gpu import _shield  # noqa: E402

_shield()
import tiga_numba as tg  # noqa: E402
from tiga_numba import reference  # noqa: E402

import test_tc_emulator as tte  # noqa: E402
from test_tc_bands_gpu import _to  # noqa: E402

TOL = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 2e-5}

GRAPHS = {
    "dense_rect": lambda: tg.Graph.dense(211, 300),
    "causal": lambda: tg.Graph.triangular(333),
    "segments": lambda: tg.Graph.cu_seqlens([0, 1, 1, 64, 190, 191, 460]),
    "window": lambda: tg.Graph.band(400, left=100),
}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("name", list(GRAPHS))
def test_head_dim_256(dtype, name):
    graph = GRAPHS[name]()
    rng = np.random.default_rng(256 + len(name) + len(dtype))
    H, Hkv, D = 4, 2, 256
    q, k, v, do = tte._inputs(rng, graph.num_dst, graph.num_src, H, Hkv, D, dtype)
    qd, kd, vd, dod = (_to(x, dtype) for x in (q, k, v, do))
    on_tc = dtype != "float32" and cupy.cuda.Device().compute_capability == "90"
    out, stats = tg.attention(qd, kd, vd, graph, return_stats=True)
    text = tg.explain()
    assert ("kernel family: cuda.tc" in text) == on_tc, text
    want = reference.attention(q, k, v, graph)
    if dtype == "bfloat16" and not on_tc:
        assert tte.rel(cupy.asnumpy(out).astype(np.float32), want) < TOL[dtype]
        with pytest.raises(NotImplementedError, match="bfloat16"):
            tg.attention_backward(dod, qd, kd, vd, out, stats, graph)
        return
    dq, dk, dv = tg.attention_backward(dod, qd, kd, vd, out, stats, graph)
    text = tg.explain()
    assert ("kernel family: cuda.tc" if on_tc else "kernel family: cuda.blocks") in text, text
    if on_tc:
        assert "dK and dV columns in 2 parts" in text, text
        again = tg.attention_backward(dod, qd, kd, vd, out, stats, graph)   # deterministic: same bits
        for a, b in zip((dq, dk, dv), again):
            assert bool(cupy.array_equal(a, b))
    wdq, wdk, wdv, _ = reference.attention_backward(do, q, k, v, graph)
    for what, got, ref in (("out", out, want), ("dq", dq, wdq), ("dk", dk, wdk), ("dv", dv, wdv)):
        got = cupy.asnumpy(got).astype(np.float32)
        assert np.isfinite(got).all(), what
        assert tte.rel(got, ref) < TOL[dtype] * (1 if what == "out" else 3), (what, tte.rel(got, ref))
