"""tiga_numba.dask with cupy chunks (marked gpu; skipped without dask, cupy and a CUDA device):
results stay cupy, chunked like the inputs, and equal the single-process GPU call."""
import numpy as np
import pytest
import scipy.sparse as sp

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")
cupy = pytest.importorskip("cupy")   # without cupy: nothing to test; without a device: conftest skips

pytestmark = pytest.mark.gpu

import tiga_numba as tg  # noqa: E402
import tiga_numba.dask as tgd  # noqa: E402


def _csr():
    a = sp.random(300, 250, density=0.05, random_state=np.random.RandomState(5), format="lil")
    a.rows[7], a.data[7] = [], []
    a.rows[20], a.data[20] = list(range(250)), [1.0] * 250
    return tg.Graph.from_scipy(a.tocsr())


@pytest.mark.parametrize("name,build,nd,ns,qc,kc", [
    ("csr", _csr, 300, 250, 70, 64),
    # every destination reads every source: the halos are whole chunks, the dk / dv sums add
    # whole pieces (three per chunk)
    ("csr-complete", lambda: tg.Graph.from_csr(np.arange(0, 200 * 90 + 1, 90), np.tile(np.arange(90), 200),
                                               num_src=90), 200, 90, 70, 40),
    ("triangular", lambda: tg.Graph.triangular(256), 256, 256, 64, 64),
    ("segments", lambda: tg.Graph.cu_seqlens([0, 30, 30, 200, 256], causal=False), 256, 256, 64, 50),
    ("segments-causal", lambda: tg.Graph.cu_seqlens([0, 30, 30, 200, 256]), 256, 256, 64, 64),
    ("dense-rect", lambda: tg.Graph.dense(190, 256), 256, 190, 100, 64),
])
@pytest.mark.parametrize("dtype,tol", [(np.float32, 2e-5), (np.float64, 1e-11)])
@pytest.mark.parametrize("mods", ["none", "softcap+alibi"])
def test_cupy_chunks_equal_the_single_process_call(name, build, nd, ns, qc, kc, dtype, tol, mods):
    expected, (O, S, grads) = _attention_problem(build(), nd, ns, qc, kc, dtype, mods != "none", seed=0)
    assert isinstance(O._meta, cupy.ndarray) and isinstance(grads[1]._meta, cupy.ndarray)
    _check_attention(dask.compute(O, S.lse, *grads, scheduler="threads"), expected, tol, tol * 10)


def _attention_problem(g, nd, ns, qc, kc, dtype, modified, seed):
    """(single-process GPU results (out, stats, grads), the same call over dask arrays of cupy
    chunks (out, stats, grads), lazy); `modified`: with soft-cap and ALiBi."""
    rng = np.random.default_rng(seed)
    q, k, v, dout = (cupy.asarray(rng.standard_normal(s).astype(dtype))
                     for s in ((nd, 4, 32), (ns, 2, 32), (ns, 2, 16), (nd, 4, 16)))
    kw = dict(softcap=2.0, alibi_slopes=cupy.asarray([0.5, 0.25, 0.1, 0.05], dtype)) if modified else {}
    out, st = tg.attention(q, k, v, g, return_stats=True, **kw)
    ref = tg.attention_backward(dout, q, k, v, out, st, g, **kw)
    Q, DO = (da.from_array(a, chunks=(qc, -1, -1), asarray=False) for a in (q, dout))
    K, V = (da.from_array(a, chunks=(kc, -1, -1), asarray=False) for a in (k, v))
    O, S = tgd.attention(Q, K, V, g, return_stats=True, **kw)
    return (out, st, ref), (O, S, tgd.attention_backward(DO, Q, K, V, O, S, g, **kw))


def _check_attention(got, expected, tol, grad_tol):
    """computed (out, lse, dq, dk, dv) against the single-process (out, stats, grads)."""
    out, st, ref = expected
    assert all(isinstance(a, cupy.ndarray) for a in got)
    fin = cupy.isfinite(st.lse)
    cupy.testing.assert_allclose(got[0], out, rtol=tol, atol=tol)
    cupy.testing.assert_allclose(got[1][fin], st.lse[fin], rtol=tol, atol=tol)
    for a, b in zip(got[2:], ref):
        cupy.testing.assert_allclose(a, b, rtol=grad_tol, atol=grad_tol)


def test_band_blocks_are_refused_when_the_graph_is_built():
    q = da.from_array(cupy.zeros((64, 2, 8), np.float32), chunks=(16, -1, -1), asarray=False)
    k = da.from_array(cupy.zeros((64, 2, 8), np.float32), chunks=(20, -1, -1), asarray=False)
    with pytest.raises(NotImplementedError, match="same chunk boundaries"):
        tgd.attention(q, k, k, tg.Graph.triangular(64))


class _Scored(tg.MessagePassing):
    reducer = tg.online_softmax()

    def edge(self, src, dst, edge, scale, slopes):
        s = (src.key * dst.query).sum(axis=-1) * scale + src.a * dst.b
        return self.reducer(s - slopes * np.abs(dst.index - src.index), src.value)


@pytest.mark.parametrize("name,build,qc,kc", [("csr", _csr, 70, 64),
                                              ("dense-rect", lambda: tg.Graph.dense(250, 300), 100, 64)])
def test_cupy_chunks_program_vjp_equals_the_single_process_call(name, build, qc, kc):
    g = build()
    rng = np.random.default_rng(1)
    nd, ns = g.num_dst, g.num_src
    src = {"key": rng.standard_normal((ns, 2, 16)), "value": rng.standard_normal((ns, 2, 8)),
           "a": rng.standard_normal((ns, 2))}
    dst = {"query": rng.standard_normal((nd, 2, 16)), "b": rng.standard_normal((nd, 2))}
    src, dst = ({n: cupy.asarray(a, np.float32) for n, a in d.items()} for d in (src, dst))
    slopes = cupy.asarray([0.3, 0.1], np.float32)
    prog = _Scored()
    out, vjp = prog.vjp(graph=g, src=src, dst=dst, scale=0.25, slopes=slopes)
    dout = cupy.asarray(rng.standard_normal(out.shape), np.float32)
    ref = vjp(dout)
    S = {n: da.from_array(a, chunks=(kc,) + a.shape[1:], asarray=False) for n, a in src.items()}
    D = {n: da.from_array(a, chunks=(qc,) + a.shape[1:], asarray=False) for n, a in dst.items()}
    lout, lvjp = tgd.program_vjp(prog, g, src=S, dst=D, scale=0.25, slopes=slopes)
    got_out, got = dask.compute(lout, lvjp(da.from_array(dout, chunks=(qc,) + dout.shape[1:], asarray=False)),
                                scheduler="threads")
    assert isinstance(got_out, cupy.ndarray)
    tol = dict(rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(cupy.asnumpy(got_out), cupy.asnumpy(out), **tol)
    for role in ("src", "dst", "params"):
        for n, a in ref[role].items():
            np.testing.assert_allclose(cupy.asnumpy(got[role][n]), cupy.asnumpy(a), err_msg=n, **tol)


class _EdgeTermGAT(tg.MessagePassing):
    reducer = tg.online_softmax()

    def edge(self, src, dst, edge):
        return self.reducer(tg.leaky_relu(src.a + dst.a + edge.w, 0.2), src.x)


class _NetGAT(tg.MessagePassing):
    reducer = tg.online_softmax()

    def __init__(self, heads):
        super().__init__()
        import tiga_numba.nn as tnn
        self.attn = tnn.trace(tnn.Sequential(tnn.Linear(2 + 2 + 2, 16, seed=1), tnn.LeakyReLU(0.2),
                                             tnn.Linear(16, heads, seed=2)).to("cuda"))

    def edge(self, src, dst, edge):
        return self.reducer(self.attn(src.a, dst.a, edge.w), src.x)


@pytest.mark.parametrize("make", [_EdgeTermGAT, lambda: _NetGAT(1), lambda: _NetGAT(2)],
                         ids=["edge-term", "net-1-score", "net-per-head"])
def test_cupy_chunks_program_per_edge_fields(make):
    """Per-edge fields of a COO-built graph (constructor order differs from CSR order) as dask
    arrays of cupy chunks: gathered to CSR order per partition and back for the gradients; with
    an elementwise score and with score networks (one softmax, or one per head), whose parameter
    gradients are summed over the partitions."""
    rng = np.random.default_rng(2)
    s, d = rng.integers(0, 250, 3000), rng.integers(0, 300, 3000)
    g = tg.Graph.from_coo(s, d, 250, 300)
    src = {"a": cupy.asarray(rng.standard_normal((250, 2)), np.float32),
           "x": cupy.asarray(rng.standard_normal((250, 2, 8)), np.float32)}
    dst = {"a": cupy.asarray(rng.standard_normal((300, 2)), np.float32)}
    edge = {"w": cupy.asarray(rng.standard_normal((g.num_edges, 2)), np.float32)}
    prog = make()
    out, vjp = prog.vjp(graph=g, src=src, dst=dst, edge=edge)
    dout = cupy.asarray(rng.standard_normal(out.shape), np.float32)
    ref = vjp(dout)
    lift = lambda a, c: da.from_array(a, chunks=(c,) + a.shape[1:], asarray=False)   # noqa: E731
    lout, lvjp = tgd.program_vjp(prog, g, src={n: lift(a, 64) for n, a in src.items()},
                                 dst={n: lift(a, 70) for n, a in dst.items()},
                                 edge={n: lift(a, 1000) for n, a in edge.items()})
    got_out, got = dask.compute(lout, lvjp(lift(dout, 70)), scheduler="threads")
    tol = dict(rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(cupy.asnumpy(got_out), cupy.asnumpy(out), **tol)
    for role in ("src", "dst", "edge", "params"):
        assert set(got[role]) == set(ref[role]), role
        for n, a in ref[role].items():
            np.testing.assert_allclose(cupy.asnumpy(got[role][n]), cupy.asnumpy(a), err_msg=n, **tol)


def _layer_problem(which, seed):
    """((out, grads) of a layer's single-process GPU call, the same as lazy dask results over cupy
    chunks): a hub row, self loops, COO edge order, edge features, parameters on the GPU."""
    import tiga_numba.layers as tgl
    rng = np.random.default_rng(seed)
    n, e = 300, 2400
    src, dst = rng.integers(0, n, e), rng.integers(0, n, e)
    dst[:200] = 3
    src[200:210] = dst[200:210]
    g = tg.Graph.from_coo(src, dst, num_src=n, num_dst=n)
    conv = (tgl.GATConv(16, 8, heads=4, edge_dim=3, seed=1) if which == "gat"
            else tgl.TransformerConv(16, 8, heads=4, edge_dim=3, root_weight=True, seed=1)).eval().to("cuda")
    x = cupy.asarray(rng.standard_normal((n, 16)).astype(np.float32))
    ea = cupy.asarray(rng.standard_normal((e, 3)).astype(np.float32))
    out, vjp = conv.vjp(x, g, ea)
    dout = cupy.asarray(rng.standard_normal(out.shape).astype(np.float32))
    ref = vjp(dout)
    cx = da.from_array(x, chunks=(70, -1), asarray=False)
    lout, lvjp = tgd.layer_vjp(conv, cx, g, da.from_array(ea, chunks=500, asarray=False))
    return (out, ref), (lout, lvjp(da.from_array(dout, chunks=(70, -1), asarray=False)))


def _check_layer(got, expected):
    (got_out, got), (out, ref) = got, expected
    assert isinstance(got_out, cupy.ndarray) and isinstance(got["x"], cupy.ndarray)
    cupy.testing.assert_allclose(got_out, out, rtol=2e-5, atol=2e-5)
    cupy.testing.assert_allclose(got["x"], ref["x"], rtol=2e-4, atol=2e-4)
    cupy.testing.assert_allclose(got["edge_attr"], ref["edge_attr"], rtol=2e-4, atol=2e-4)
    for k, b in ref["params"].items():
        cupy.testing.assert_allclose(got["params"][k], b, rtol=2e-4, atol=2e-4, err_msg=k)


@pytest.mark.parametrize("which", ["gat", "transformer"])
def test_cupy_chunks_layer_vjp(which):
    """A layer over cupy chunks equals the single-process GPU call; results stay cupy."""
    expected, lazy = _layer_problem(which, seed=4)
    _check_layer(dask.compute(*lazy, scheduler="threads"), expected)


@pytest.fixture(scope="module")
def cuda_client():
    """dask_cuda's LocalCUDACluster: one worker process per visible GPU (one here), each with its
    own CUDA context; chunks travel between client and worker as device buffers."""
    dask_cuda = pytest.importorskip("dask_cuda")
    distributed = pytest.importorskip("distributed")
    with dask_cuda.LocalCUDACluster(threads_per_worker=1, dashboard_address=None, silence_logs=40) as cluster, \
            distributed.Client(cluster) as c:
        yield c


@pytest.mark.parametrize("name,build,nd,ns,qc,kc", [
    ("csr", _csr, 300, 250, 70, 64),
    ("triangular", lambda: tg.Graph.triangular(256), 256, 256, 64, 64),
])
def test_local_cuda_cluster_equals_the_single_process_call(cuda_client, name, build, nd, ns, qc, kc):
    """attention and its backward with soft-cap and ALiBi, computed by a dask_cuda worker
    process: results come back as cupy arrays equal to the single-process GPU call."""
    expected, (O, S, grads) = _attention_problem(build(), nd, ns, qc, kc, np.float32, True, seed=6)
    _check_attention(cuda_client.compute((O, S.lse, *grads), sync=True), expected, 2e-5, 2e-4)


def test_local_cuda_cluster_layer_vjp(cuda_client):
    """A GATConv layer (parameters on the GPU) shipped to a dask_cuda worker process."""
    expected, lazy = _layer_problem("gat", seed=7)
    _check_layer(cuda_client.compute(lazy, sync=True), expected)
