"""Tracing of MessagePassing.edge(): every recognised form, every refused form's message.

These tests only trace (program.traced_form), so no kernel is compiled here."""
import math

import numpy as np
import pytest

import tiga_numba as tg

N, H, D = 5, 2, 4
RNG = np.random.default_rng(11)


def arr(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def qkv(n=N, h=H, d=D):
    return arr(n, h, d), arr(n, h, d), arr(n, h, d)


def program_of(edge_fn, reducer=None, **attrs):
    ns = {"reducer": reducer if reducer is not None else tg.online_softmax(), "edge": edge_fn}
    ns.update(attrs)
    return type("P", (tg.MessagePassing,), ns)()


def trace(edge_fn, graph=None, src=None, dst=None, edge=None, **params):
    q, k, v = qkv()
    graph = graph if graph is not None else tg.Graph.dense(N)
    src = src if src is not None else {"key": k, "value": v}
    dst = dst if dst is not None else {"query": q}
    return program_of(edge_fn).traced_form(graph, src=src, dst=dst, edge=edge, **params)


def sig_formula(t):
    return t.score.formula()


# --------------------------------------------------------------------------- recognised forms
RECOGNISED_SCALED = {
    "sum_axis_times": lambda self, src, dst, edge, scale: self.reducer(
        (src.key * dst.query).sum(axis=-1) * scale, src.value),
    "sum_dim_times": lambda self, src, dst, edge, scale: self.reducer(
        (src.key * dst.query).sum(dim=-1) * scale, src.value),
    "swapped_operands": lambda self, src, dst, edge, scale: self.reducer(
        (dst.query * src.key).sum(-1) * scale, src.value),
    "scale_first": lambda self, src, dst, edge, scale: self.reducer(
        scale * (src.key * dst.query).sum(axis=-1), src.value),
    "scale_inside": lambda self, src, dst, edge, scale: self.reducer(
        (src.key * dst.query * scale).sum(axis=-1), src.value),
    "np_sum": lambda self, src, dst, edge, scale: self.reducer(
        np.sum(src.key * dst.query, axis=-1) * scale, src.value),
    "positive_axis": lambda self, src, dst, edge, scale: self.reducer(
        (src.key * dst.query).sum(axis=2) * scale, src.value),
}


@pytest.mark.parametrize("name", sorted(RECOGNISED_SCALED))
def test_dot_forms_with_scale_param(name):
    t = trace(RECOGNISED_SCALED[name], scale=0.5)
    (s, d) = t.score.dot
    assert (s.ref, d.ref) == ("src.key", "dst.query")
    assert t.value.ref == "src.value"
    assert t.score.dot_factor.evaluate({"scale": 0.5}) == 0.5
    assert t.param_names() == {"scale"}


@pytest.mark.parametrize("fn, expect", [
    (lambda self, src, dst, edge, scale: self.reducer((src.key * dst.query).sum(-1) / scale, src.value), 1 / 3.0),
    (lambda self, src, dst, edge, scale: self.reducer((src.key * dst.query).sum(-1) * scale * 2, src.value), 6.0),
    (lambda self, src, dst, edge, scale: self.reducer((src.key * dst.query).sum(-1) * (scale ** -0.5), src.value), 3.0 ** -0.5),
    (lambda self, src, dst, edge, scale: self.reducer((src.key * dst.query).sum(-1) / np.sqrt(scale), src.value), 3.0 ** -0.5),
    (lambda self, src, dst, edge, scale: self.reducer(np.float32(2) * (src.key * dst.query).sum(-1), src.value), 2.0),
    (lambda self, src, dst, edge, scale: self.reducer(-(src.key * dst.query).sum(-1) * scale, src.value), -3.0),
])
def test_scalar_factor_algebra(fn, expect):
    t = trace(fn, scale=3.0)
    assert t.score.dot_factor.evaluate({"scale": 3.0}) == pytest.approx(expect)


def test_python_constant_and_no_factor():
    def const(self, src, dst, edge):
        return self.reducer((src.key * dst.query).sum(axis=-1) / math.sqrt(D), src.value)

    def plain(self, src, dst, edge):
        return self.reducer((src.key * dst.query).sum(axis=-1), src.value)

    assert trace(const).score.dot_factor.evaluate({}) == pytest.approx(D ** -0.5)
    t = trace(plain)
    assert t.score.dot_factor.evaluate({}) == 1.0
    assert t.param_names() == set()


def test_value_may_be_the_key_field():
    t = trace(lambda self, src, dst, edge: self.reducer((src.x * dst.x).sum(-1), src.x),
              src={"x": arr(N, H, D)}, dst={"x": arr(N, H, D)})
    assert t.reaching_fields() == [("src", "x"), ("dst", "x")]


def test_edge_bias_and_edge_score_forms():
    g = tg.Graph.from_coo(np.array([0, 1, 2, 3]), np.array([1, 1, 0, 4]), num_src=N, num_dst=N)
    E = g.num_edges
    bias = {"bias": arr(E)}

    def with_bias(self, src, dst, edge, scale):
        return self.reducer((src.key * dst.query).sum(-1) * scale + edge.bias, src.value)

    def bias_first(self, src, dst, edge, scale):
        return self.reducer(edge.bias + scale * (src.key * dst.query).sum(-1), src.value)

    def minus_bias(self, src, dst, edge, scale):
        return self.reducer(((src.key * dst.query).sum(-1) - edge.bias) * scale, src.value)

    for fn in (with_bias, bias_first):
        t = trace(fn, graph=g, edge=bias, scale=0.5)
        assert t.score.dot is not None and [f.ref for f, _ in t.score.biases] == ["edge.bias"]
        assert t.score.biases[0][1].evaluate({"scale": 0.5}) == 1.0
    t = trace(minus_bias, graph=g, edge=bias, scale=0.5)
    assert t.score.biases[0][1].evaluate({"scale": 0.5}) == -0.5

    def precomputed(self, src, dst, edge):
        return self.reducer(edge.score, src.value)

    q, k, v = qkv()
    t = program_of(precomputed).traced_form(g, src={"value": v}, edge={"score": arr(E, H)})
    assert t.score.dot is None and t.score.formula() == "edge.score"


def test_score_network_call_is_recorded():
    class FakeNet:
        __tiga_score_net__ = True

    class GAT(tg.MessagePassing):
        reducer = tg.online_softmax()

        def __init__(self, net):
            super().__init__()
            self.attn = net

        def edge(self, src, dst, edge):
            assert isinstance(self, GAT)  # the tracing stand-in is a real instance
            return self.reducer(self.attn(edge.displacement, src.x, dst.x), src.x)

    pos = RNG.random((12, 3))
    g = tg.Graph.radius(pos, 0.6)
    x = arr(12, 3)
    net = FakeNet()
    t = GAT(net).traced_form(g, src={"x": x}, dst={"x": x})
    call = t.score.net
    assert call.attr == "attn" and call.net is net
    assert [(a.role, a.name) for a in call.args] == [("edge", "displacement"), ("src", "x"), ("dst", "x")]
    assert t.kind == "net"


def test_edge_is_traced_once_per_signature_never_on_data():
    calls = []

    class P(tg.MessagePassing):
        reducer = tg.online_softmax()

        def edge(self, src, dst, edge, scale):
            calls.append(type(src.key).__name__)
            return self.reducer((src.key * dst.query).sum(-1) * scale, src.value)

    p = P()
    q, k, v = qkv()
    g = tg.Graph.dense(N)
    p.traced_form(g, src={"key": k, "value": v}, dst={"query": q}, scale=1.0)
    p.traced_form(g, src={"key": k + 1, "value": v}, dst={"query": q}, scale=2.0)
    assert calls == ["Field"]
    q2, k2, v2 = qkv(n=7)  # new sizes, same ranks: same signature
    p.traced_form(tg.Graph.dense(7), src={"key": k2, "value": v2}, dst={"query": q2}, scale=2.0)
    assert len(calls) == 1
    p.traced_form(g, src={"key": k[:, 0], "value": v[:, 0]}, dst={"query": q[:, 0]}, scale=1.0)
    assert len(calls) == 2  # 2-D fields: a new signature
    p.traced_form(g, src={"key": k.astype(np.float64), "value": v.astype(np.float64)},
                  dst={"query": q.astype(np.float64)}, scale=1.0)
    assert len(calls) == 3  # new dtypes: traced afresh


# --------------------------------------------------------------------------- refused forms
REFUSED = [
    ("sin of score", lambda self, src, dst, edge: self.reducer(np.sin((src.key * dst.query).sum(-1)), src.value),
     "np.sin"),
    ("arctan of score", lambda self, src, dst, edge: self.reducer(np.arctan((src.key * dst.query).sum(-1)), src.value),
     "np.arctan"),
    # another library's ufunc, named as such (not "np.expit"), even where numpy has one of the
    # same name (scipy.special.exp2 is not np.exp2)
    ("scipy ufunc", lambda self, src, dst, edge: self.reducer(
        __import__("scipy.special").special.expit((src.key * dst.query).sum(-1)), src.value),
     "the ufunc expit (not one of numpy's)"),
    ("math.exp", lambda self, src, dst, edge: self.reducer(math.exp((src.key * dst.query).sum(-1)), src.value),
     "float()"),
    ("score to a fractional power", lambda self, src, dst, edge: self.reducer(
        (src.key * dst.query).sum(-1) ** 1.5, src.value), "power"),
    ("score times another score", lambda self, src, dst, edge: self.reducer(
        (src.key * dst.query).sum(-1) * (src.value * dst.query).sum(-1), src.value), "two dot scores"),
    ("method on score", lambda self, src, dst, edge: self.reducer((src.key * dst.query).sum(-1).exp(), src.value),
     ".exp"),
    ("max reduction", lambda self, src, dst, edge: self.reducer((src.key * dst.query).max(axis=-1), src.value),
     ".max"),
    ("sum over other axis", lambda self, src, dst, edge: self.reducer((src.key * dst.query).sum(axis=1), src.value),
     "axis=1"),
    ("sum of three fields", lambda self, src, dst, edge: self.reducer(
        (src.key * dst.query * src.value).sum(-1), src.value), "3 field(s)"),
    ("src with src", lambda self, src, dst, edge: self.reducer((src.key * src.value).sum(-1), src.value),
     "pairs one src field with one dst field"),
    ("unsummed product", lambda self, src, dst, edge: self.reducer(src.key * dst.query, src.value),
     "forget .sum"),
    ("node field as score", lambda self, src, dst, edge: self.reducer(src.key, src.value), "forget .sum"),
    ("dst value", lambda self, src, dst, edge: self.reducer((src.key * dst.query).sum(-1), dst.query),
     "dst field dst.query as the reducer's value"),
    ("scaled value", lambda self, src, dst, edge: self.reducer((src.key * dst.query).sum(-1), src.value * 2),
     "plain src field"),
    ("two reducer calls", lambda self, src, dst, edge: (
        self.reducer((src.key * dst.query).sum(-1), src.value), self.reducer((src.key * dst.query).sum(-1), src.value))[1],
     "second reducer call"),
    ("no reducer", lambda self, src, dst, edge: (src.key * dst.query).sum(-1), "never calls the reducer"),
    ("post-processing", lambda self, src, dst, edge: self.reducer((src.key * dst.query).sum(-1), src.value) * 2,
     "reducer output"),
    ("control flow", lambda self, src, dst, edge: self.reducer(
        (src.key * dst.query).sum(-1) if (src.key * dst.query).sum(-1) > 0 else 0, src.value),
     "data-dependent control flow"),
    ("indexing", lambda self, src, dst, edge: self.reducer((src.key[..., :2] * dst.query[..., :2]).sum(-1), src.value),
     "indexing or slicing"),
    ("array in edge()", lambda self, src, dst, edge: self.reducer(
        (src.key * dst.query).sum(-1) * np.ones(3), src.value), "ndarray"),
    ("matmul", lambda self, src, dst, edge: self.reducer(src.key @ dst.query, src.value), "matrix product"),
    ("shape inside edge", lambda self, src, dst, edge: self.reducer(
        (src.key * dst.query).sum(-1) * src.key.shape[-1] ** -0.5, src.value), "sizes and dtypes are not traced"),
    ("two dot scores", lambda self, src, dst, edge: self.reducer(
        (src.key * dst.query).sum(-1) + (src.value * dst.query).sum(-1), src.value), "two dot scores"),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_forms_name_the_construct(case):
    _, fn, needle = case
    with pytest.raises(NotImplementedError, match=None) as info:
        trace(fn)
    assert needle in str(info.value), str(info.value)


def test_score_squared_is_a_product_of_the_score():
    t = trace(lambda self, src, dst, edge: self.reducer((src.key * dst.query).sum(-1) ** 2, src.value))
    assert t.kind == "modified" and str(t.score.expr) == "s * s"


def test_node_field_bias_is_a_score_modifier():
    def node_bias(self, src, dst, edge):
        return self.reducer((src.key * dst.query).sum(-1) + dst.b, src.value)

    t = trace(node_bias, dst={"query": arr(N, H, D), "b": arr(N, H)})
    assert t.kind == "modified" and str(t.score.expr) == "s + dst.b"


def test_reducer_outside_edge_is_a_type_error():
    with pytest.raises(TypeError, match="tg.attention"):
        tg.online_softmax()(np.ones(3), np.ones(3))


# --------------------------------------------------------------------------- call errors
def _full(self, src, dst, edge, scale):
    return self.reducer((src.key * dst.query).sum(-1) * scale, src.value)


def test_missing_field_is_value_error_naming_role_and_field():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"src\.value.*given src fields: key"):
        trace(_full, src={"key": k}, scale=1.0)
    with pytest.raises(ValueError, match=r"dst\.query"):
        trace(_full, dst={"q": q}, scale=1.0)


def test_extra_field_is_value_error():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"never reads .*src\['extra'\]"):
        trace(_full, src={"key": k, "value": v, "extra": v}, scale=1.0)


def test_params_missing_or_extra_are_type_errors():
    with pytest.raises(TypeError, match="needs the param 'scale'"):
        trace(_full)
    with pytest.raises(TypeError, match="takes no param 'temperature'"):
        trace(_full, scale=1.0, temperature=2.0)


def test_param_default_is_used():
    def with_default(self, src, dst, edge, scale=0.25):
        return self.reducer((src.key * dst.query).sum(-1) * scale, src.value)

    t = trace(with_default)
    assert t.param_names() == {"scale"}


def test_field_row_count_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"src\['key'\] has 4 rows .*graph.num_src is 5"):
        trace(_full, src={"key": k[:4], "value": v}, scale=1.0)


def test_bad_types():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"src\['key'\] must be a numpy or cupy array"):
        trace(_full, src={"key": k.tolist(), "value": v}, scale=1.0)
    with pytest.raises(TypeError, match="graph must be a tiga_numba.Graph"):
        program_of(_full).traced_form("dense", src={"key": k, "value": v}, dst={"query": q}, scale=1.0)
    with pytest.raises(TypeError, match="src= must be a dict"):
        trace(_full, src=[k, v], scale=1.0)


def test_mixed_libraries_are_type_errors():
    class FakeCuda:
        """Pretends to be a device array: the library check runs before any conversion, so
        this is a TypeError even where cupy is not installed."""
        __cuda_array_interface__ = {"shape": (N, H, D), "typestr": "<f4", "data": (0, False), "version": 3}
        shape = (N, H, D)
        ndim = 3
        dtype = np.dtype(np.float32)

    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"mixed numpy/cupy.*src\['value'\] is cupy"):
        trace(_full, src={"key": k, "value": FakeCuda()}, scale=1.0)


def test_online_softmax_threshold_validation():
    for bad in (0, 0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="block_prune_threshold") as info:
            tg.online_softmax(block_prune_threshold=bad)
        assert str(bad if bad == bad else "nan") in str(info.value)
    with pytest.raises(TypeError, match="block_prune_threshold"):
        tg.online_softmax(block_prune_threshold="0.1")
    assert tg.online_softmax(block_prune_threshold=1).block_prune_threshold == 1.0
    assert tg.online_softmax().block_prune_threshold is None
