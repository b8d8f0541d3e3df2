"""Banded relations on the tensor cores, on the GPU (marked gpu): sliding windows, two-sided bands,
bottom-right causal rectangular varlen batches (rows without keys) and varlen windows through
tg.attention / tg.attention_backward with cupy float16 / bfloat16 / float32 inputs, GQA, against
the float64 edge oracle (tiga_numba.reference); the registry picks cuda.tc for them; soft-cap
composes with a window."""
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")   # without cupy: nothing to test; without a device: conftest skips

pytestmark = pytest.mark.gpu

from test_cuda_gpu import _shield  # noqa: E402

_shield()
import tiga_numba as tg  # noqa: E402
from tiga_numba import reference  # noqa: E402

import test_tc_emulator as tte  # noqa: E402

TOL = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 2e-5}

GRAPHS = {
    "window": lambda: tg.Graph.band(600, left=127),
    "two_sided": lambda: tg.Graph.band(333, left=40, right=9),
    "rect_causal": lambda: tg.Graph.cu_seqlens([0, 30, 230, 231], cu_seqlens_k=[0, 150, 250, 400]),
    "varlen_window": lambda: tg.Graph.cu_seqlens([0, 1, 170, 500], window=(65, 0)),
}


def _to(x, dtype):
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return cupy.asarray(x.astype(ml_dtypes.bfloat16))
    return cupy.asarray(x.astype(dtype))


@pytest.mark.parametrize("dtype,D", [("float16", 64), ("float16", 128), ("bfloat16", 128), ("float32", 64)])
@pytest.mark.parametrize("name", list(GRAPHS))
def test_bands_run_on_the_tensor_cores(dtype, D, name):
    graph = GRAPHS[name]()
    rng = np.random.default_rng(D + len(name) + len(dtype))
    H, Hkv = 4, 2
    q, k, v, do = tte._inputs(rng, graph.num_dst, graph.num_src, H, Hkv, D, dtype)
    qd, kd, vd, dod = (_to(x, dtype) for x in (q, k, v, do))
    out, stats = tg.attention(qd, kd, vd, graph, return_stats=True)
    assert "kernel family: cuda.tc" in tg.explain()
    dq, dk, dv = tg.attention_backward(dod, qd, kd, vd, out, stats, graph)
    assert "kernel family: cuda.tc" in tg.explain()
    want = reference.attention(q, k, v, graph)
    wdq, wdk, wdv, _ = reference.attention_backward(do, q, k, v, graph)
    for what, got, ref in (("out", out, want), ("dq", dq, wdq), ("dk", dk, wdk), ("dv", dv, wdv)):
        got = cupy.asnumpy(got).astype(np.float32)
        assert np.isfinite(got).all(), what
        assert tte.rel(got, ref) < TOL[dtype] * (1 if what == "out" else 3), (what, tte.rel(got, ref))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_softcap_on_a_window_runs_on_the_tensor_cores(dtype):
    graph = GRAPHS["window"]()
    rng = np.random.default_rng(3)
    H, D = 2, 64
    q, k, v, do = tte._inputs(rng, graph.num_dst, graph.num_src, H, H, D, dtype)
    qd, kd, vd, dod = (_to(x, dtype) for x in (q, k, v, do))
    out, stats = tg.attention(qd, kd, vd, graph, return_stats=True, softcap=2.0)
    assert "kernel family: cuda.tc" in tg.explain()
    dq, dk, dv = tg.attention_backward(dod, qd, kd, vd, out, stats, graph, softcap=2.0)
    # the CPU kernels (float64) are the oracle of the same modified call
    cpu = tg.attention(*(x.astype(np.float64) for x in (q, k, v)), graph, return_stats=True, softcap=2.0)
    ref = tg.attention_backward(do.astype(np.float64), *(x.astype(np.float64) for x in (q, k, v)), cpu[0], cpu[1],
                                graph, softcap=2.0)
    for what, got, want in (("out", out, cpu[0]),) + tuple(zip(("dq", "dk", "dv"), (dq, dk, dv), ref)):
        got = cupy.asnumpy(got).astype(np.float32)
        assert tte.rel(got, want) < TOL[dtype] * (1 if what == "out" else 3), (what, tte.rel(got, want))
