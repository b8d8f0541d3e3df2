"""MessagePassing programs run the functional kernels: output == functional == float64
oracle; vjp gradients == oracle gradients; explain()/ir(); fail-closed pruning."""
import numpy as np
import pytest

import tiga_numba as tg
from tiga_numba import reference

RNG = np.random.default_rng(2026)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


class Attention(tg.MessagePassing):
    reducer = tg.online_softmax()

    def edge(self, src, dst, edge, scale):
        score = (src.key * dst.query).sum(dim=-1) * scale
        return self.reducer(score, src.value)


class BiasedAttention(tg.MessagePassing):
    reducer = tg.online_softmax()

    def edge(self, src, dst, edge, scale):
        return self.reducer(scale * (dst.query * src.key).sum(axis=-1) + edge.bias, src.value)


class EdgeScore(tg.MessagePassing):
    reducer = tg.online_softmax()

    def edge(self, src, dst, edge):
        return self.reducer(edge.score, src.value)


class SelfValue(tg.MessagePassing):
    """The key field is also the value: its gradient is the sum of both uses."""
    reducer = tg.online_softmax()

    def edge(self, src, dst, edge):
        return self.reducer((src.x * dst.q).sum(-1) / 2.0, src.x)


def random_csr(num_dst, num_src, p=0.4, empty_rows=(1,)):
    mask = RNG.random((num_dst, num_src)) < p
    for r in empty_rows:
        mask[r] = False
    mask[0, 0] = True
    import scipy.sparse as sp
    return tg.Graph.from_scipy(sp.csr_array(mask))


TOL = {np.float32: 2e-5, np.float64: 1e-10}


def close(a, b, dtype=np.float32, scale=1.0):
    a = np.asarray(a, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    err = np.max(np.abs(a - b)) if a.size else 0.0
    assert err <= TOL[dtype] * max(1.0, scale * np.max(np.abs(b)) if b.size else 1.0), err


GRAPHS = {
    "dense": lambda: tg.Graph.dense(37),
    "cross": lambda: tg.Graph.dense(29, 37),
    "triangular": lambda: tg.Graph.triangular(37),
    "varlen": lambda: tg.Graph.cat([tg.Graph.triangular(n) for n in (17, 1, 0, 19)]),
    "csr": lambda: random_csr(37, 29),
}


@pytest.mark.parametrize("kind", sorted(GRAPHS))
def test_program_equals_functional_and_oracle(kind):
    g = GRAPHS[kind]()
    H, Hkv, D, Dv = 4, 2, 8, 5  # grouped-query attention
    q = rand(g.num_dst, H, D)
    k, v = rand(g.num_src, Hkv, D), rand(g.num_src, Hkv, Dv)
    scale = 0.3
    out = Attention()(graph=g, src={"key": k, "value": v}, dst={"query": q}, scale=scale)
    assert out.dtype == np.float32 and out.shape == (g.num_dst, H, Dv)
    func = tg.attention(q, k, v, g, scale=scale)
    np.testing.assert_array_equal(out, func)  # the very same plan and kernel
    close(out, reference.attention(q, k, v, g, scale=scale))


def test_one_head_fields_and_float64_and_strides():
    g = random_csr(23, 23)
    x = rand(23, 6, dtype=np.float64)
    qh = rand(6, 23, dtype=np.float64).T  # non-contiguous
    out = SelfValue()(graph=g, src={"x": x}, dst={"q": qh})
    assert out.shape == (23, 6) and out.dtype == np.float64
    close(out, reference.attention(qh, x, x, g, scale=0.5), np.float64)


def test_edge_bias_and_edge_score():
    g = random_csr(31, 31)
    E, H, D = g.num_edges, 2, 8
    q, k, v = rand(31, H, D), rand(31, H, D), rand(31, H, 3)
    for bias in (rand(E), rand(E, H)):
        out = BiasedAttention()(graph=g, src={"key": k, "value": v}, dst={"query": q},
                                edge={"bias": bias}, scale=0.4)
        close(out, reference.attention(q, k, v, g, scale=0.4, edge_bias=bias))
    s = rand(E, H)
    out = EdgeScore()(graph=g, src={"value": v}, edge={"score": s})
    q0, k0 = np.zeros((31, H, 0)), np.zeros((31, H, 0))
    close(out, reference.attention(q0, k0, v, g, edge_bias=s))
    out1 = EdgeScore()(graph=g, src={"value": v[:, 0]}, edge={"score": s[:, 0]})
    assert out1.shape == (31, 3)
    close(out1, reference.attention(q0[:, 0], k0[:, 0], v[:, 0], g, edge_bias=s[:, 0]))


def test_edge_fields_on_implicit_relations_fail_closed():
    g = tg.Graph.dense(6)
    v = rand(6, 2, 3)
    with pytest.raises(NotImplementedError, match="CSR"):
        EdgeScore()(graph=g, src={"value": v}, edge={"score": rand(36, 2)})


def _oracle_grads(dout, q, k, v, g, scale, bias=None):
    return reference.attention_backward(dout, q, k, v, g, scale=scale, edge_bias=bias)


class WeightedBias(tg.MessagePassing):
    reducer = tg.online_softmax()

    def edge(self, src, dst, edge, scale, b, n):
        return self.reducer((dst.query * src.key).sum(axis=-1) * (scale * n) + edge.bias * b / n,
                            src.value)


@pytest.mark.parametrize("scale", [0.45, 0.0])
def test_vjp_gives_float_scalar_params_their_gradient(scale):
    """The dot product's factor (scale * n) and an edge bias's coefficient (b / n): the float
    params scale and b get d loss / d param against the float64 oracle's central differences
    (scale = 0 included, where <q, dq> / scale is undefined); the int param n gets none."""
    g = random_csr(23, 17)
    H, D = 3, 6
    q, k, v = rand(23, H, D, dtype=np.float64), rand(17, H, D, dtype=np.float64), rand(17, H, 4, dtype=np.float64)
    bias = rand(g.num_edges, H, dtype=np.float64)
    dout = rand(23, H, 4, dtype=np.float64)
    fields = dict(graph=g, src={"key": k, "value": v}, dst={"query": q}, edge={"bias": bias})
    params = dict(scale=scale, b=0.8, n=2)
    out, vjp = WeightedBias().vjp(**fields, **params)
    grads = vjp(dout)
    assert set(grads["params"]) == {"scale", "b"}

    def loss(**kw):
        p = dict(params, **kw)
        return float((reference.attention(q, k, v, g, scale=p["scale"] * p["n"],
                                          edge_bias=bias * p["b"] / p["n"]) * dout).sum())
    for name in ("scale", "b"):
        x = params[name]
        want = (loss(**{name: x + 1e-6}) - loss(**{name: x - 1e-6})) / 2e-6
        assert np.ndim(grads["params"][name]) == 0 and grads["params"][name].dtype == np.float64
        assert abs(float(grads["params"][name]) - want) <= 1e-6 * max(1.0, abs(want)), (name, want)


@pytest.mark.parametrize("kind", ["triangular", "csr"])
def test_vjp_matches_oracle(kind):
    g = GRAPHS[kind]()
    H, Hkv, D = 4, 2, 8
    q = rand(g.num_dst, H, D)
    k, v = rand(g.num_src, Hkv, D), rand(g.num_src, Hkv, 6)
    out, vjp = Attention().vjp(graph=g, src={"key": k, "value": v}, dst={"query": q}, scale=0.35)
    dout = rand(*out.shape)
    grads = vjp(dout)
    dq, dk, dv, _ = _oracle_grads(dout, q, k, v, g, 0.35)
    assert set(grads) == {"src", "dst", "edge", "params", "positions"}
    assert set(grads["src"]) == {"key", "value"} and set(grads["dst"]) == {"query"}
    assert grads["edge"] == {} and set(grads["params"]) == {"scale"} and grads["positions"] is None
    # the float scalar param's gradient against the float64 oracle's central difference
    def loss(scale):
        return float((reference.attention(q, k, v, g, scale=scale) * dout).sum())
    assert np.ndim(grads["params"]["scale"]) == 0
    close(grads["params"]["scale"], np.asarray((loss(0.35 + 1e-5) - loss(0.35 - 1e-5)) / 2e-5))
    close(grads["dst"]["query"], dq)
    close(grads["src"]["key"], dk)
    close(grads["src"]["value"], dv)
    again = vjp(dout)  # the vjp can be called again; deterministic kernels: same bits
    np.testing.assert_array_equal(again["src"]["key"], grads["src"]["key"])


def test_vjp_field_used_twice_adds_up():
    g = random_csr(19, 19)
    x, qf = rand(19, 5, dtype=np.float64), rand(19, 5, dtype=np.float64)
    out, vjp = SelfValue().vjp(graph=g, src={"x": x}, dst={"q": qf})
    dout = rand(19, 5, dtype=np.float64)
    grads = vjp(dout)
    dq, dk, dv, _ = _oracle_grads(dout, qf, x, x, g, 0.5)
    close(grads["src"]["x"], dk + dv, np.float64)
    close(grads["dst"]["q"], dq, np.float64)


def test_vjp_edge_fields():
    g = random_csr(21, 21)
    E, H = g.num_edges, 2
    q, k, v = rand(21, H, 4), rand(21, H, 4), rand(21, H, 3)
    bias = rand(E)
    out, vjp = BiasedAttention().vjp(graph=g, src={"key": k, "value": v}, dst={"query": q},
                                     edge={"bias": bias}, scale=0.5)
    dout = rand(*out.shape)
    grads = vjp(dout)
    dq, dk, dv, dbias = _oracle_grads(dout, q, k, v, g, 0.5, bias)
    assert grads["edge"]["bias"].shape == (E,) and grads["edge"]["bias"].dtype == np.float32
    close(grads["edge"]["bias"], dbias.sum(axis=1))
    close(grads["dst"]["query"], dq)

    s = rand(E, H)
    out, vjp = EdgeScore().vjp(graph=g, src={"value": v}, edge={"score": s})
    grads = vjp(dout)
    q0 = np.zeros((21, H, 0))
    _, _, dv, dbias = _oracle_grads(dout, q0, q0, v, g, 1.0, s)
    assert set(grads["src"]) == {"value"} and set(grads["edge"]) == {"score"}
    assert grads["dst"] == {}
    close(grads["edge"]["score"], dbias)
    close(grads["src"]["value"], dv)


class ModifiedEdgeScore(tg.MessagePassing):
    """A per-edge field inside a modified score (compiled modifier path)."""
    reducer = tg.online_softmax()

    def edge(self, src, dst, edge, scale):
        s = (dst.query * src.key).sum(axis=-1) * scale
        return self.reducer(np.tanh(s) + edge.w * edge.w, src.value)


@pytest.mark.parametrize("program", [BiasedAttention, ModifiedEdgeScore])
def test_edge_fields_follow_the_constructors_edge_order(program):
    """Per-edge fields of a from_coo / from_edge_index graph are given, and their gradients
    returned, in the order of the edges given to the constructor (as the layers' edge_attr, PyG's
    convention): the same call over the CSR-ordered graph with the fields reordered gives the
    same outputs and the reordered gradients."""
    rng = np.random.default_rng(4)
    n, E, H = 17, 60, 2
    src, dst = rng.integers(0, n, E), rng.integers(0, n, E)
    coo = tg.Graph.from_coo(src, dst, n, n)
    perm = coo.edge_permutation
    assert perm is not None and not np.array_equal(perm, np.arange(E))   # unsorted input
    csr = tg.Graph.from_csr(*coo._host_csr(), num_src=n)
    q, k, v = rand(n, H, 4), rand(n, H, 4), rand(n, H, 3)
    w = rand(E)
    name = "bias" if program is BiasedAttention else "w"
    kw = dict(src={"key": k, "value": v}, dst={"query": q}, scale=0.5)
    out_coo, vjp_coo = program().vjp(graph=coo, edge={name: w}, **kw)
    out_csr, vjp_csr = program().vjp(graph=csr, edge={name: w[perm]}, **kw)
    np.testing.assert_array_equal(out_coo, out_csr)
    dout = rand(*out_coo.shape)
    g_coo, g_csr = vjp_coo(dout), vjp_csr(dout)
    np.testing.assert_array_equal(g_coo["edge"][name][perm], g_csr["edge"][name])
    np.testing.assert_array_equal(g_coo["dst"]["query"], g_csr["dst"]["query"])
    np.testing.assert_array_equal(program()(graph=coo, edge={name: w}, **kw), out_coo)


def test_scaled_edge_score_gradient_carries_the_factor():
    class Scaled(tg.MessagePassing):
        reducer = tg.online_softmax()

        def edge(self, src, dst, edge, t):
            return self.reducer(edge.score / t, src.value)

    g = random_csr(15, 15)
    s, v = rand(g.num_edges, dtype=np.float64), rand(15, 4, dtype=np.float64)
    out, vjp = Scaled().vjp(graph=g, src={"value": v}, edge={"score": s}, t=2.0)
    z = np.zeros((15, 0))
    close(out, reference.attention(z, z, v, g, edge_bias=s / 2.0), np.float64)
    dout = rand(15, 4, dtype=np.float64)
    _, _, _, dbias = _oracle_grads(dout, z, z, v, g, 1.0, s / 2.0)
    close(vjp(dout)["edge"]["score"], dbias[:, 0] / 2.0, np.float64)


def test_functional_errors_name_the_fields():
    g = tg.Graph.dense(6)
    q, k, v = rand(6, 2, 4), rand(6, 2, 4), rand(6, 2, 4)
    with pytest.raises(TypeError, match=r"dtype.*q = dst.query, k = src.key, v = src.value"):
        Attention()(graph=g, src={"key": k.astype(np.float64), "value": v}, dst={"query": q}, scale=1.0)
    with pytest.raises(ValueError, match=r"head dim.*q = dst.query"):
        Attention()(graph=g, src={"key": k[..., :3], "value": v}, dst={"query": q}, scale=1.0)
    csr = random_csr(6, 6)
    with pytest.raises(TypeError, match=r"edge.score .*floating point"):
        EdgeScore()(graph=csr, src={"value": v}, edge={"score": np.ones((csr.num_edges, 2), np.int32)})


def test_dout_is_checked():
    g = tg.Graph.triangular(9)
    q, k, v = rand(9, 2, 4), rand(9, 2, 4), rand(9, 2, 4)
    _, vjp = Attention().vjp(graph=g, src={"key": k, "value": v}, dst={"query": q}, scale=1.0)
    with pytest.raises(ValueError, match="dout"):
        vjp(rand(8, 2, 4))


# --------------------------------------------------------------------------- pruning
class Pruned(tg.MessagePassing):
    def __init__(self, rho):
        super().__init__()
        self.reducer = tg.online_softmax(block_prune_threshold=rho)

    def edge(self, src, dst, edge, scale):
        return self.reducer((src.key * dst.query).sum(dim=-1) * scale, src.value)


def test_pruned_program_runs_the_pruned_kernel_and_refuses_vjp():
    g = tg.Graph.dense(150)
    q, k, v = rand(150, 2, 8), rand(150, 2, 8), rand(150, 2, 8)
    p = Pruned(0.5)
    out = p(graph=g, src={"key": k, "value": v}, dst={"query": q}, scale=2.0)
    func, stats = tg.attention(q, k, v, g, scale=2.0, block_prune_threshold=0.5, return_stats=True)
    np.testing.assert_array_equal(out, func)
    text = p.explain()
    assert "block_prune_threshold=0.5" in text and "tiles pruned" in text
    with pytest.raises(NotImplementedError, match="block_prune_threshold"):
        p.vjp(graph=g, src={"key": k, "value": v}, dst={"query": q}, scale=2.0)
    with pytest.raises(NotImplementedError):
        Pruned(0.5)(graph=random_csr(8, 8), src={"key": k[:8], "value": v[:8]},
                    dst={"query": q[:8]}, scale=1.0)


# --------------------------------------------------------------------------- explain / ir
def test_explain_and_ir():
    p = Attention()
    assert "not called yet" in p.explain()
    with pytest.raises(KeyError, match="not run yet"):
        p.ir("llvm")
    g = tg.Graph.triangular(12)
    q, k, v = rand(12, 2, 4), rand(12, 2, 4), rand(12, 2, 4)
    p(graph=g, src={"key": k, "value": v}, dst={"query": q}, scale=0.5)
    text = p.explain()
    for needle in ("Attention", "scale * <src.key, dst.query>", "backend: cpu", "kernel:",
                   "implicit", "float32", "accumulation", "tiles", "no score or probability tensor",
                   "kernel cache", "tile pruning: off"):
        assert needle in text, needle
    llvm = p.ir("llvm")
    assert isinstance(llvm, str) and "define" in llvm
    assert isinstance(p.ir("asm"), str)
    with pytest.raises(KeyError, match=r"available: \['asm', 'llvm'\]"):
        p.ir("ptx")
    with pytest.raises(KeyError, match=r"available: \['asm', 'llvm'\]"):   # not TypeError: unhashable
        p.ir(["llvm"])
    csr = random_csr(12, 12)
    p(graph=csr, src={"key": k, "value": v}, dst={"query": q}, scale=0.5)
    assert "CSR" in p.explain()
    assert "reused a trace" in p.explain() or "traced edge()" in p.explain()


# --------------------------------------------------------------------------- score networks
class _FakePlan:
    run_info = {"ir": {"llvm": lambda: "; fake llvm"}}

    def explain(self):
        return "backend: cpu\nkernel: fake.edge_mlp"


def _fake_edge_mlp(record):
    """Stands in for tiga_numba.edge_mlp (the fused score-network kernels): records what the front end
    passes and returns recognisable gradients, so the mapping onto grads is checked exactly."""
    import collections
    import types

    mod = types.ModuleType("tiga_numba.edge_mlp")
    mod.FieldArg = collections.namedtuple("FieldArg", "role name array")

    def forward(graph, net, args, value, return_state=False, value_name="value"):
        record.update(graph=graph, net=net, args=list(args), value=value)
        return value * 2.0, {"state": 1}, _FakePlan()

    def backward(graph, net, args, value, state, dout):
        record.update(state=state, dout=dout)
        return {"args": [None, value * 3.0, value * 5.0], "value": dout * 7.0,
                "params": {"0.weight": np.ones((2, 2)), "2.bias": np.zeros(1)},
                "positions": np.full((value.shape[0], 3), 11.0), "plan": _FakePlan()}

    mod.forward, mod.backward = forward, backward
    return mod


def test_a_called_program_pickles_without_its_caches():
    """A program that has run (traces, plans and explain() records with compiled kernels'
    closures on it) pickles as its definition; the copy starts fresh and computes the same."""
    import pickle
    p = Attention()
    g = tg.Graph.triangular(12)
    q, k, v = rand(12, 2, 4), rand(12, 2, 4), rand(12, 2, 4)
    p.extra = 3   # the program's own attributes travel
    out = p(graph=g, src={"key": k, "value": v}, dst={"query": q}, scale=0.5)
    p.ir("llvm")
    copy = pickle.loads(pickle.dumps(p))
    assert copy.extra == 3 and "not called yet" in copy.explain()
    np.testing.assert_array_equal(copy(graph=g, src={"key": k, "value": v}, dst={"query": q}, scale=0.5), out)
    assert "Attention" in p.explain()   # the original keeps its records


def test_score_network_lowering_and_gradient_names(monkeypatch):
    import sys
    record = {}
    fake = _fake_edge_mlp(record)
    monkeypatch.setitem(sys.modules, "tiga_numba.edge_mlp", fake)
    monkeypatch.setattr(tg, "edge_mlp", fake, raising=False)

    class Net:
        __tiga_score_net__ = True

    class GAT(tg.MessagePassing):
        reducer = tg.online_softmax()

        def __init__(self, attn):
            super().__init__()
            self.attn = attn

        def edge(self, src, dst, edge):
            return self.reducer(self.attn(edge.displacement, src.x, dst.x), src.x)

    pos = RNG.random((10, 3))
    g = tg.Graph.radius(pos, 0.5)
    x = rand(10, 4)
    net = Net()
    prog = GAT(net)
    out, vjp = prog.vjp(graph=g, src={"x": x}, dst={"x": x})
    np.testing.assert_array_equal(out, x * 2.0)
    assert record["net"] is net and record["value"] is x
    assert [(a.role, a.name) for a in record["args"]] == [("edge", "displacement"), ("src", "x"), ("dst", "x")]
    assert record["args"][0].array is None  # geometric fields are computed in the kernel
    assert record["args"][1].array is x and record["args"][2].array is x
    dout = rand(10, 4)
    grads = vjp(dout)
    np.testing.assert_allclose(grads["src"]["x"], x * 3.0 + dout * 7.0)  # score arg + value
    np.testing.assert_allclose(grads["dst"]["x"], x * 5.0)
    assert grads["edge"] == {}
    assert sorted(grads["params"]) == ["attn.0.weight", "attn.2.bias"]
    assert grads["positions"].shape == (10, 3)
    text = prog.explain()
    assert "attn(edge.displacement, src.x, dst.x)" in text and "fake.edge_mlp" in text
    assert prog.ir("llvm") == "; fake llvm"

    class PrunedGAT(GAT):
        reducer = tg.online_softmax(block_prune_threshold=0.1)

    with pytest.raises(NotImplementedError, match="score-network"):
        PrunedGAT(net)(graph=g, src={"x": x}, dst={"x": x})


def test_score_network_program_with_the_real_edge_mlp():
    """End to end through tiga_numba.edge_mlp: output == materialized eager model + oracle."""
    import tiga_numba.nn as tnn  # submodule import: the lazy package attribute is not involved

    class GAT(tg.MessagePassing):
        reducer = tg.online_softmax()

        def __init__(self, attn):
            super().__init__()
            self.attn = tnn.trace(attn)

        def edge(self, src, dst, edge):
            return self.reducer(self.attn(edge.displacement, src.x, dst.x), src.x)

    # float32 positions and features, f = 6, hidden 16: the network shape and dtypes of
    # tests/test_gat.py::test_float32_within_tolerance, so the two share their kernels
    n, f = 30, 6
    pos = RNG.random((n, 3)).astype(np.float32)
    x = rand(n, f)
    g = tg.Graph.radius(pos, 0.4)
    attn = tnn.Sequential(tnn.Linear(3 + 2 * f, 16, seed=1), tnn.LeakyReLU(0.2), tnn.Linear(16, 1, seed=2))
    prog = GAT(attn)
    out, vjp = prog.vjp(graph=g, src={"x": x}, dst={"x": x})
    indptr = g.to_scipy().indptr
    cols = g.to_scipy().indices
    rows = np.repeat(np.arange(n), np.diff(indptr))
    s = prog.attn(g.edge_field("displacement").astype(np.float32), x[cols], x[rows])
    z = np.zeros((n, 0))
    close(out, reference.attention(z, z, x, g, edge_bias=np.asarray(s).reshape(-1)))
    grads = vjp(rand(n, f))
    assert set(grads["src"]) == {"x"} and set(grads["dst"]) == {"x"}
    assert {"attn.0.weight", "attn.0.bias", "attn.2.weight", "attn.2.bias"} <= set(grads["params"])
    assert grads["positions"].shape == pos.shape
    assert "attn(edge.displacement, src.x, dst.x)" in prog.explain()


# --------------------------------------------------------------------------- GPU (cupy)
def _cupy():
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:  # noqa: BLE001
        pass
    pytest.skip("needs cupy and a CUDA device")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "triangular", "varlen", "csr"])
def test_gpu_program_matches_oracle_and_stays_on_device(kind):
    cp = _cupy()
    g = GRAPHS[kind]()
    H, Hkv, D = 4, 2, 16
    q = cp.asarray(rand(g.num_dst, H, D))
    k, v = cp.asarray(rand(g.num_src, Hkv, D)), cp.asarray(rand(g.num_src, Hkv, 8))
    prog = Attention()
    out, vjp = prog.vjp(graph=g, src={"key": k, "value": v}, dst={"query": q}, scale=0.3)
    assert isinstance(out, cp.ndarray) and out.dtype == np.float32
    close(out.get(), reference.attention(q, k, v, g, scale=0.3), scale=10)
    dout = cp.asarray(rand(*out.shape))
    grads = vjp(dout)
    dq, dk, dv, _ = _oracle_grads(dout, q, k, v, g, 0.3)
    for got, want in ((grads["dst"]["query"], dq), (grads["src"]["key"], dk), (grads["src"]["value"], dv)):
        assert isinstance(got, cp.ndarray)
        close(got.get(), want, scale=10)
    assert "backend: cuda" in prog.explain()
    assert isinstance(prog.ir("ptx"), str)


@pytest.mark.gpu
def test_gpu_edge_fields():
    cp = _cupy()
    g = random_csr(33, 33)
    E, H = g.num_edges, 2
    q, k, v = (cp.asarray(rand(33, H, 8)) for _ in range(3))
    bias = cp.asarray(rand(E))
    out, vjp = BiasedAttention().vjp(graph=g, src={"key": k, "value": v}, dst={"query": q},
                                     edge={"bias": bias}, scale=0.5)
    close(out.get(), reference.attention(q, k, v, g, scale=0.5, edge_bias=bias), scale=10)
    dout = cp.asarray(rand(*out.shape))
    grads = vjp(dout)
    _, _, _, dbias = _oracle_grads(dout, q, k, v, g, 0.5, bias)
    close(grads["edge"]["bias"].get(), dbias.sum(axis=1), scale=10)
    s = cp.asarray(rand(E, H))
    out = EdgeScore()(graph=g, src={"value": v}, edge={"score": s})
    z = np.zeros((33, H, 0))
    close(out.get(), reference.attention(z, z, v, g, edge_bias=s), scale=10)


@pytest.mark.gpu
@pytest.mark.parametrize("program", [BiasedAttention, ModifiedEdgeScore])
def test_gpu_edge_fields_follow_the_constructors_edge_order(program):
    """cupy fields of a from_coo graph: the same results as numpy, gradients in input order."""
    cp = _cupy()
    rng = np.random.default_rng(6)
    n, E, H = 19, 70, 2
    g = tg.Graph.from_coo(rng.integers(0, n, E), rng.integers(0, n, E), n, n)
    q, k, v = rand(n, H, 8), rand(n, H, 8), rand(n, H, 4)
    w = rand(E)
    name = "bias" if program is BiasedAttention else "w"
    out, vjp = program().vjp(graph=g, src={"key": k, "value": v}, dst={"query": q}, edge={name: w}, scale=0.5)
    out_d, vjp_d = program().vjp(graph=g, src={"key": cp.asarray(k), "value": cp.asarray(v)},
                                 dst={"query": cp.asarray(q)}, edge={name: cp.asarray(w)}, scale=0.5)
    close(out_d.get(), out, scale=10)
    dout = rand(*out.shape)
    got, want = vjp_d(cp.asarray(dout)), vjp(dout)
    close(got["edge"][name].get(), want["edge"][name], scale=10)


def test_geometric_bias_gradient_reaches_positions():
    """score + c * edge.distance on a radius graph: grads["positions"] == finite differences."""
    class Dist(tg.MessagePassing):
        reducer = tg.online_softmax()

        def edge(self, src, dst, edge, scale):
            return self.reducer((src.k * dst.q).sum(-1) * scale - 2.0 * edge.distance, src.v)

    rng = np.random.default_rng(5)
    pos = rng.random((25, 3))
    q, k, v = (rng.standard_normal((25, 2, 4)) for _ in range(3))

    def run(p):
        g = tg.Graph.radius(p, 0.45)
        return g, Dist().vjp(graph=g, src={"k": k, "v": v}, dst={"q": q}, scale=0.5)

    g, (out, vjp) = run(pos)
    dout = rng.standard_normal(out.shape)
    grads = vjp(dout)
    assert grads["positions"].shape == pos.shape and grads["edge"]["distance"].shape == (g.num_edges,)
    h = 1e-6
    for i, d in zip(rng.integers(0, 25, 8), rng.integers(0, 3, 8)):
        hi, lo = pos.copy(), pos.copy()
        hi[i, d] += h
        lo[i, d] -= h
        (g1, (o1, _)), (g2, (o2, _)) = run(hi), run(lo)
        assert g1.num_edges == g2.num_edges == g.num_edges  # the step crosses no cutoff
        fd = ((o1 - o2) * dout).sum() / (2 * h)
        assert abs(grads["positions"][i, d] - fd) <= 1e-6 * max(1.0, abs(fd))


@pytest.mark.gpu
def test_gpu_geometric_bias_and_score_network_match_cpu():
    cp = _cupy()
    import tiga_numba.nn as tnn

    class Dist(tg.MessagePassing):
        reducer = tg.online_softmax()

        def edge(self, src, dst, edge, scale):
            return self.reducer((src.k * dst.q).sum(-1) * scale - 2.0 * edge.distance
                                + 0.5 * edge.w, src.v)

    class GAT(tg.MessagePassing):
        reducer = tg.online_softmax()

        def __init__(self, attn):
            super().__init__()
            self.attn = tnn.trace(attn)

        def edge(self, src, dst, edge):
            return self.reducer(self.attn(edge.displacement, src.x, dst.x), src.x)

    rng = np.random.default_rng(9)
    pos = rng.random((40, 3))
    q, k, v = (rng.standard_normal((40, 2, 4)) for _ in range(3))
    g_cpu = tg.Graph.radius(pos, 0.4)
    g_gpu = tg.Graph.radius(cp.asarray(pos), 0.4)
    w = rng.standard_normal((g_cpu.num_edges, 2))
    dout = rng.standard_normal((40, 2, 4))
    res = []
    for g, xp in ((g_cpu, np), (g_gpu, cp)):
        out, vjp = Dist().vjp(graph=g, src={"k": xp.asarray(k), "v": xp.asarray(v)},
                              dst={"q": xp.asarray(q)}, edge={"w": xp.asarray(w)}, scale=0.5)
        grads = vjp(xp.asarray(dout))
        res.append([out, grads["positions"], grads["edge"]["w"], grads["src"]["k"]])
    for a, b in zip(*res):
        np.testing.assert_allclose(cp.asnumpy(b), a, rtol=1e-9, atol=1e-9)

    attn = tnn.Sequential(tnn.Linear(3 + 2 * 4, 8, seed=1), tnn.LeakyReLU(0.2), tnn.Linear(8, 1, seed=2))
    x = rng.standard_normal((40, 4)).astype(np.float32)
    outs = []
    for g, xp in ((g_cpu, np), (g_gpu, cp)):
        prog = GAT(attn.to("cuda") if xp is cp else attn)
        out, vjp = prog.vjp(graph=g, src={"x": xp.asarray(x)}, dst={"x": xp.asarray(x)})
        grads = vjp(xp.asarray(dout[:, 0]))
        outs.append((out, grads["src"]["x"], grads["params"]["attn.0.weight"]))
        if xp is cp:
            assert "backend: cuda" in prog.explain()
    for a, b in zip(*outs):
        np.testing.assert_allclose(cp.asnumpy(b), a, rtol=2e-4, atol=2e-5)
