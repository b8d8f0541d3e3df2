"""GPU tests of the CUDA-core backend (marked gpu; skipped without cupy and a CUDA device).

Every relation kind x dtype x GQA, forward and backward through the public API, against a
float64 oracle on fresh random inputs (computed from the same, dtype-rounded inputs), with
every backend output poisoned with NaN before the kernels run. Also: determinism of the
backward (same bits twice), any strides (no copy recorded), a non-default cupy stream,
edge bias / precomputed scores (D = 0) on CSR, D = Dv = 256, tile pruning (counts exposed,
rule replayed by the oracle with the GPU's tile sizes, rho -> 0 exact).
The tensor-core path is switched off here (tg.options(tensor_cores=False)): its own tests cover it.
"""
import sys

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")   # without cupy: nothing to test; without a device: conftest skips

pytestmark = pytest.mark.gpu


def _shield():
    """numba-cuda's import redirector matches any module name containing "numba.cuda"."""
    for finder in sys.meta_path:
        if type(finder).__name__ == "NumbaCudaFinder" and not getattr(finder, "_tiga_shielded", False):
            original = finder.find_spec

            def find_spec(name, path=None, target=None, _original=original):
                if name == "tiga_numba.cuda" or name.startswith("tiga_numba.cuda."):
                    return None
                return _original(name, path, target)
            finder.find_spec = find_spec
            finder._tiga_shielded = True


_shield()
import tiga_numba as tg  # noqa: E402
from tiga_numba import functional  # noqa: E402

from test_cuda_sim import oracle, pruned_oracle  # noqa: E402

RNG = np.random.default_rng(1129)
TOL = {"float16": (4e-3, 1e-2), "float32": (2e-5, 2e-4), "float64": (1e-11, 1e-10)}


@pytest.fixture(autouse=True)
def _cuda_core_only_poisoned():
    """every call on the CUDA-core kernels, outputs filled with NaN first (run options)."""
    from tiga_numba.cuda import api
    with tg.options(tensor_cores=False, poison_outputs=True):
        yield api


def rel_err(got, want):
    got = np.asarray(cupy.asnumpy(got) if isinstance(got, cupy.ndarray) else got, np.float64)
    assert not np.isnan(got).any(), "NaN in output (unwritten element or bad arithmetic)"
    want = np.asarray(want, np.float64)
    den = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / (den if den > 0 else 1.0))


def graphs():
    """name -> (graph, dense mask builder)"""
    cu = np.array([0, 37, 37, 38, 150, 211], np.int64)  # an empty and a length-1 segment
    return {
        "dense_rect": (lambda: tg.Graph.dense(173, 97)),
        "triangular": (lambda: tg.Graph.triangular(203)),
        "segments_causal": (lambda: tg.Graph.cu_seqlens(cu, causal=True)),
        "segments_full": (lambda: tg.Graph.cu_seqlens(cu, causal=False)),
        "csr": (lambda: _random_csr(151, 89)),
    }


def _random_csr(nq, ns, max_deg=40):
    deg = RNG.integers(0, max_deg, nq)
    deg[3] = 0
    deg[7] = 1
    indptr = np.zeros(nq + 1, np.int64)
    np.cumsum(deg, out=indptr[1:])
    indices = np.concatenate([np.sort(RNG.choice(ns, d, replace=False)) for d in deg]).astype(np.int32)
    return tg.Graph.from_csr(indptr, indices, num_src=ns)


def _mask(g):
    sp = g.to_scipy()
    return np.asarray(sp.toarray() != 0)


def _inputs(g, dtype, H, Hkv, D, DV):
    q = RNG.standard_normal((g.num_dst, H, D)).astype(dtype)
    k = RNG.standard_normal((g.num_src, Hkv, D)).astype(dtype)
    v = RNG.standard_normal((g.num_src, Hkv, DV)).astype(dtype)
    dout = RNG.standard_normal((g.num_dst, H, DV)).astype(dtype)
    return q, k, v, dout


@pytest.mark.parametrize("kind", list(graphs()))
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("Hkv", [4, 2])
def test_forward_backward_vs_oracle(kind, dtype, Hkv):
    g = graphs()[kind]()
    H, D, DV = 4, 64, 64
    q, k, v, dout = _inputs(g, dtype, H, Hkv, D, DV)
    scale = D ** -0.5
    ro, rm, rl, rdq, rdk, rdv, _ = oracle(q, k, v, _mask(g), scale, dout=dout)
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, dout))
    out, stats = tg.attention(qd, kd, vd, g, return_stats=True)
    assert isinstance(out, cupy.ndarray) and out.dtype == np.dtype(dtype)
    plan = functional.last_plan()
    assert plan.run_info["kernel"].startswith("cuda.")
    assert plan.run_info["copies"] == []
    ftol, btol = TOL[dtype]
    assert rel_err(out, ro) < ftol
    m, l = cupy.asnumpy(stats.m), cupy.asnumpy(stats.l)
    fin = np.isfinite(rm)
    assert np.array_equal(np.isfinite(m), fin) and (l[~fin] == 0).all()
    assert rel_err(m[fin], rm[fin]) < ftol and rel_err(l, rl) < ftol
    dq, dk, dv = tg.attention_backward(dod, qd, kd, vd, out, stats, g)
    for name, got, want in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        assert got.dtype == np.dtype(dtype)
        assert rel_err(got, want) < btol, name
    # deterministic: same bits on a second run
    dq2, dk2, dv2 = tg.attention_backward(dod, qd, kd, vd, out, stats, g)
    for a, b in ((dq, dq2), (dk, dk2), (dv, dv2)):
        assert bool(cupy.all(a == b))


@pytest.mark.parametrize("kind", ["triangular", "csr"])
def test_strided_inputs_no_copy_and_side_stream(kind):
    g = graphs()[kind]()
    H, Hkv, D, DV = 4, 2, 32, 48
    q, k, v, dout = _inputs(g, "float32", H, Hkv, D, DV)
    ro, _, _, rdq, rdk, rdv, _ = oracle(q, k, v, _mask(g), D ** -0.5, dout=dout)

    def strided(x):  # a view inside a wider, NaN-padded buffer: not contiguous
        big = cupy.full(x.shape[:-1] + (x.shape[-1] + 5,), np.nan, x.dtype)
        big[..., 2:2 + x.shape[-1]] = cupy.asarray(x)
        return big[..., 2:2 + x.shape[-1]]
    qd, kd, vd, dod = (strided(x) for x in (q, k, v, dout))
    assert not qd.flags.c_contiguous
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        out, stats = tg.attention(qd, kd, vd, g, return_stats=True)
        assert functional.last_plan().run_info["copies"] == []
        dq, dk, dv = tg.attention_backward(dod, qd, kd, vd, out, stats, g)
    s.synchronize()
    assert rel_err(out, ro) < 2e-5
    assert rel_err(dq, rdq) < 2e-4 and rel_err(dk, rdk) < 2e-4 and rel_err(dv, rdv) < 2e-4


@pytest.mark.parametrize("D", [0, 16])
def test_csr_edge_bias(D):
    g = _random_csr(120, 77)
    H, DV = 2, 24
    q, k, v, dout = _inputs(g, "float32", H, H, D, DV)
    bias = RNG.standard_normal((g.num_edges, H)).astype(np.float32)
    indptr = g.to_scipy().indptr
    rows = np.repeat(np.arange(g.num_dst), np.diff(indptr))
    cols = g.to_scipy().indices
    dense_bias = np.zeros((g.num_dst, g.num_src, H))
    dense_bias[rows, cols] = bias
    scale = D ** -0.5 if D else 1.0
    ro, _, _, rdq, rdk, rdv, dS = oracle(q, k, v, _mask(g), scale, dense_bias, dout)
    qd, kd, vd, dod, bd = (cupy.asarray(x) for x in (q, k, v, dout, bias))
    out, stats, plan = functional.run_forward(qd, kd, vd, g, scale=scale, edge_bias=bd)
    assert rel_err(out, ro) < 2e-5
    dq, dk, dv, dbias, _ = functional.run_backward(dod, qd, kd, vd, out, stats, g, scale=scale,
                                                   edge_bias=bd)
    assert rel_err(dv, rdv) < 2e-4
    assert rel_err(dbias, dS.transpose(1, 2, 0)[rows, cols]) < 2e-4
    if D:
        assert rel_err(dq, rdq) < 2e-4 and rel_err(dk, rdk) < 2e-4


def test_head_dim_256():
    g = tg.Graph.triangular(70)
    q, k, v, dout = _inputs(g, "float32", 2, 1, 256, 256)
    ro, _, _, rdq, rdk, rdv, _ = oracle(q, k, v, _mask(g), 256 ** -0.5, dout=dout)
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, dout))
    out, stats = tg.attention(qd, kd, vd, g, return_stats=True)
    dq, dk, dv = tg.attention_backward(dod, qd, kd, vd, out, stats, g)
    assert rel_err(out, ro) < 2e-5
    assert rel_err(dq, rdq) < 2e-4 and rel_err(dk, rdk) < 2e-4 and rel_err(dv, rdv) < 2e-4


def test_tile_pruning_rule_and_counts(monkeypatch):
    """the CUDA-core kernels' pruning (float32 pinned there: block relations with D 64/128 would
    otherwise take the tensor-core path, whose tiles and order tests/test_tc_gpu.py replays)."""
    monkeypatch.setenv("TIGA_NUMBA_FP32_TENSOR_CORES", "0")
    from tiga_numba.cuda import tiles
    n, H, D, DV = 256, 2, 64, 64
    g = tg.Graph.triangular(n)
    # locality: each query close to keys near it -> far tiles provably below threshold
    pos = np.arange(n)[:, None] / 8.0
    q = (np.cos(pos * np.arange(D)[None, :] * 0.05) * 3)[:, None, :].repeat(H, 1).astype(np.float32)
    k = q.copy() + 0.01 * RNG.standard_normal(q.shape).astype(np.float32)
    v = RNG.standard_normal((n, H, DV)).astype(np.float32)
    scale = 1.0
    t = tiles.block_tiles("fwd", "float32", D, DV)
    rel = (np.array([0, n]), np.array([0, n]), np.array([1], np.uint8))
    for rho in (1e-2, 1e-4):
        out = tg.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), g, scale=scale,
                           block_prune_threshold=rho)
        info = functional.last_plan().run_info
        ro, _, _, pruned, total = pruned_oracle(q, k, v, *rel, scale, t.BM, t.BN, rho)
        assert (info["pruned_tiles"], info["total_tiles"]) == (pruned, total)
        assert rel_err(out, ro) < 2e-5
    exact = tg.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), g, scale=scale)
    tiny = tg.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), g, scale=scale,
                        block_prune_threshold=1e-300)
    assert functional.last_plan().run_info["pruned_tiles"] == 0
    assert rel_err(tiny, cupy.asnumpy(exact)) < 1e-6
    with pytest.raises(NotImplementedError):
        _, st = tg.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), g,
                             block_prune_threshold=1e-2, return_stats=True)
        tg.attention_backward(cupy.asarray(v), cupy.asarray(q), cupy.asarray(k), cupy.asarray(v),
                              cupy.asarray(v), st, g)


def test_explain_and_ir():
    g = tg.Graph.triangular(64)
    q, k, v, _ = _inputs(g, "float32", 2, 2, 32, 32)
    tg.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), g)
    plan = functional.last_plan()
    text = plan.explain()
    assert "cuda.blocks.forward" in text and "BM=" in text
    assert ".entry" in plan.ir("ptx")
    assert "define" in plan.ir("llvm")


def test_launch_records_follow_each_graph_and_fast_path():
    """Memoised launch records (cuda/api.py) belong to one relation: graphs of the same sizes
    made one after the other (the old one freed, its id and memory free for reuse) each get
    their own; results stay exact. And the kernels launch through the fast path
    (cuLaunchKernel with a packed parameter buffer) where cupy's driver binding exists."""
    import gc

    from tiga_numba.cuda import launch
    from tiga_numba.kernel_cache import KERNELS
    H, Hkv, D = 2, 1, 32
    for trial in range(4):
        g = _random_csr(61, 61, max_deg=9) if trial % 2 else tg.Graph.cu_seqlens(
            np.array([0, int(RNG.integers(1, 60)), 61]), causal=bool(trial % 3))
        q, k, v, dout = _inputs(g, "float32", H, Hkv, D, D)
        ro, _, _, rdq, rdk, rdv, _ = oracle(q, k, v, _mask(g), D ** -0.5, dout=dout)
        qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, dout))
        for _ in range(2):  # second call: from the record
            out, st = tg.attention(qd, kd, vd, g, return_stats=True)
            dq, dk, dv = tg.attention_backward(dod, qd, kd, vd, out, st, g)
            assert rel_err(out, ro) < 2e-5
            for got, want in ((dq, rdq), (dk, rdk), (dv, rdv)):
                assert rel_err(got, want) < 2e-4
        del g, out, st, dq, dk, dv
        gc.collect()
    if hasattr(cupy.cuda, "driver") and hasattr(cupy.cuda.driver, "launchKernel"):
        kernels = [k for k in KERNELS._kernels.values() if isinstance(k, launch.Kernel)]
        assert "driver" in {k.launch_path for k in kernels}
        # every kernel this process launched, and why a slower path was taken (Kernel.fallbacks)
        slower = {k.name: (k.launch_path, k.fallbacks) for k in kernels if k.launch_path not in (None, "driver")}
        assert not slower, slower


@pytest.mark.parametrize("tensor_cores", [False, True])
def test_calls_from_a_fresh_thread(tensor_cores):
    """A thread that never called the CUDA runtime has no current context; cupy's memory pool
    hands it cached blocks without one (dask's threaded scheduler runs tasks on such threads).
    The kernels' driver launches must still run there, forward and backward."""
    import threading
    rng = np.random.default_rng(3)
    g = tg.Graph.triangular(200)
    q, k, v, do = (cupy.asarray(rng.standard_normal((200, 4, 64)).astype(np.float16)) for _ in range(4))
    with tg.options(tensor_cores=tensor_cores):
        out, st = tg.attention(q, k, v, g, return_stats=True)   # warm: kernels loaded, pool filled
        ref = [out] + list(tg.attention_backward(do, q, k, v, out, st, g))
        cupy.cuda.Device().synchronize()
    got, errors = [], []

    def work():
        try:
            with tg.options(tensor_cores=tensor_cores):
                o, s = tg.attention(q, k, v, g, return_stats=True)
                got.extend([o] + list(tg.attention_backward(do, q, k, v, o, s, g)))
            cupy.cuda.Device().synchronize()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    for a, b in zip(got, ref):
        assert cupy.array_equal(a, b)
