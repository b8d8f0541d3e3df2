"""Score modifiers: tracing to one expression tree, generated code and its derivatives, and the
compiled kernels (dense, triangular, segments, band, CSR) forward and backward against a
float64 oracle that evaluates the same Python function on numpy arrays."""
import math
import zlib

import numpy as np
import pytest
import hypothesis
from hypothesis import strategies as st

import tiga_numba as tg
from tiga_numba import score_mod as sm
from tiga_numba.cpu import score_codegen as cg
from tiga_numba.graph import _rows_of

RNG = np.random.default_rng(7)


@pytest.fixture(autouse=True)
def _inputs_of_this_test(request):
    """RNG restarted from the test's own id: a test draws the same inputs whichever tests ran
    before it in the process (pytest-xdist's order included), so a failure reproduces alone."""
    seed = zlib.crc32(request.node.nodeid.split("::", 1)[-1].encode())
    RNG.bit_generator.state = np.random.default_rng(seed).bit_generator.state


# --------------------------------------------------------------------------- generated code
def _leaf(op, attr):
    return sm.Expr(op, (), attr)


C = _leaf("scalar", "c")
SLOPES = _leaf("head", "slopes")
DA = _leaf("node", ("dst", "a"))
SA = _leaf("node", ("src", "a"))
EB = _leaf("edge", "b")
I = _leaf("index", "dst")
J = _leaf("index", "src")
S = sm.SCORE


def E(op, *args):
    return sm.make(op, *args) if op in ("add", "sub", "mul", "div", "neg", "where") else sm.Expr(op, args)


TREES = {
    "softcap": E("mul", C, E("tanh", E("div", S, C))),
    "alibi": E("sub", S, E("mul", SLOPES, E("abs", E("sub", I, J)))),
    "gat": E("leaky_relu", E("add", SA, DA), sm.const(0.2)),
    "mix": E("add", E("where", E("gt", S, sm.ZERO), E("exp", E("mul", sm.const(0.3), S)),
                      E("minimum", S, E("mul", EB, DA))),
             E("maximum", E("log", E("add", SA, sm.const(2.0))),
                E("sqrt", E("add", E("mul", DA, DA), sm.const(0.5))))),
    "ratio": E("div", E("add", S, SA), E("add", sm.const(3.0), E("abs", DA))),
}


def _env(tree, H=3, N=6, Ne=5):
    lay = sm.Layout(tree)
    sc = RNG.uniform(1.0, 3.0, len(lay.scalars))
    hp = RNG.uniform(0.1, 1.0, (len(lay.heads), H))
    nd = RNG.uniform(-1.0, 1.0, (len(lay.dst), N, H))
    ns = RNG.uniform(-1.0, 1.0, (len(lay.src), N, H))
    ef = RNG.uniform(-1.0, 1.0, (len(lay.edges), Ne, H))
    return lay, [sc, hp, nd, ns, ef]


def _point_env(lay, arrays, s, i, j, e, h):
    sc, hp, nd, ns, ef = arrays
    env = {S: s, I: float(i), J: float(j)}
    for x in lay.scalars:
        env[x] = sc[lay.slot[x]]
    for x in lay.heads:
        env[x] = hp[lay.slot[x], h]
    for x in lay.dst:
        env[x] = nd[lay.slot[x], i, h]
    for x in lay.src:
        env[x] = ns[lay.slot[x], j, h]
    for x in lay.edges:
        env[x] = ef[lay.slot[x], e, h]
    return env


@pytest.mark.parametrize("name", sorted(TREES))
def test_generated_value_and_derivatives_match_the_tree(name):
    tree = TREES[name]
    lay, arrays = _env(tree)
    g = cg.generated(tree, lay.differentiable(), "float64")
    grad = g.grad(cg.TARGETS)
    for _ in range(12):
        s = RNG.uniform(-2, 2)
        i, j, e, h = (int(RNG.integers(0, n)) for n in (6, 6, 5, 3))
        want = sm.evaluate(tree, _point_env(lay, arrays, s, i, j, e, h))
        assert g.value(s, i, j, e, h, *arrays) == pytest.approx(want, rel=1e-12, abs=1e-12)
        bufs = [np.zeros_like(a) for a in arrays[1:]]
        dF = RNG.uniform(0.5, 1.5)
        ds = grad(s, i, j, e, h, *arrays, dF, bufs[0], bufs[1], i, bufs[2], j, bufs[3])
        eps = 1e-6
        fd = (g.value(s + eps, i, j, e, h, *arrays) - g.value(s - eps, i, j, e, h, *arrays)) / (2 * eps)
        assert ds == pytest.approx(dF * fd, rel=1e-6, abs=1e-7)
        # every differentiable leaf: central difference on its packed cell
        for group, buf, idx in ((1, bufs[0], lambda k: (k, h)), (2, bufs[1], lambda k: (k, i, h)),
                                (3, bufs[2], lambda k: (k, j, h)), (4, bufs[3], lambda k: (k, e, h))):
            a = arrays[group]
            for k in range(a.shape[0]):
                cell = idx(k)
                old = a[cell]
                a[cell] = old + eps
                up = g.value(s, i, j, e, h, *arrays)
                a[cell] = old - eps
                dn = g.value(s, i, j, e, h, *arrays)
                a[cell] = old
                # dst and src fields share a cell when i == j only through different arrays
                assert buf[cell] == pytest.approx(dF * (up - dn) / (2 * eps), rel=1e-6, abs=1e-7), (name, group, k)


def test_float32_code_uses_fast_tanh_and_exp_within_float32_accuracy():
    tree = E("add", TREES["softcap"], E("exp", E("mul", sm.const(0.1), S)))
    lay, arrays = _env(tree)
    g32 = cg.generated(tree, (), "float32")
    a32 = [a.astype(np.float32) for a in arrays]
    for s in np.linspace(-40, 40, 81):
        want = sm.evaluate(tree, _point_env(lay, a32, float(np.float32(s)), 0, 0, 0, 0))
        got = g32.value(np.float32(s), 0, 0, 0, 0, *a32)
        assert abs(got - want) <= 2e-6 * max(1.0, abs(want))


def test_value_never_returns_non_finite():
    tree = E("log", S)  # log of a negative score: NaN -> the masked value; log(0) -> -inf
    g = cg.generated(tree, (), "float64")
    empty = [np.zeros(0), np.zeros((0, 1)), np.zeros((0, 1, 1)), np.zeros((0, 1, 1)), np.zeros((0, 1, 1))]
    for s in (-1.0, 0.0):
        v = g.value(s, 0, 0, 0, 0, *empty)
        assert np.isfinite(v) and v <= -1e29
    big = cg.generated(E("exp", S), (), "float64")
    assert np.isfinite(big.value(1e4, 0, 0, 0, 0, *empty))


def test_generated_code_is_memoised_per_tree():
    a = cg.generated(TREES["softcap"], (), "float64")
    assert cg.generated(E("mul", C, E("tanh", E("div", S, C))), (), "float64") is a
    assert cg.generated(TREES["alibi"], (), "float64") is not a
    assert cg.generated(TREES["softcap"], (), "float32") is not a


def test_modified_kernels_are_disk_cached_under_a_digest_of_their_generated_code():
    """A kernel compiled with a modifier is named after a digest of the generated functions'
    texts, constant values and dtype, so numba's on-disk cache never hands one modifier's
    kernel to another (two trees that differ only in a constant generate the same text)."""
    from tiga_numba.cpu import blocks
    t3 = E("mul", sm.const(0.3), S)
    t4 = E("mul", sm.const(0.4), S)

    def digest(tree, dt="float64", grads=False):
        g = cg.generated(tree, sm.Layout(tree).differentiable() if grads else (), dt)
        hooks = {"MOD_VALUE": g.value}
        if grads:
            hooks["MOD_GRAD"] = g.grad(("dst",))
        return cg.hooks_digest(g, hooks)

    assert cg.generated(t3, (), "float64").sources == cg.generated(t4, (), "float64").sources
    assert digest(t3) == digest(E("mul", sm.const(0.3), S))
    assert len({digest(t3), digest(t4), digest(t3, "float32"), digest(TREES["softcap"]),
                digest(TREES["mix"]), digest(TREES["mix"], grads=True)}) == 6
    g = cg.generated(t3, (), "float64")
    kern = blocks.make_forward("float64", 64, 128, False, g)  # not compiled until called
    assert type(kern._cache).__name__ == "FunctionCache"  # numba's on-disk cache (cache=True)
    assert kern.py_func.__qualname__.endswith("_mod_" + digest(t3))


def test_trees_are_structural_and_print_as_written():
    assert TREES["softcap"] == E("mul", C, E("tanh", E("div", S, C)))
    assert hash(TREES["softcap"]) == hash(E("mul", C, E("tanh", E("div", S, C))))
    assert TREES["softcap"] != TREES["alibi"]
    assert str(TREES["softcap"]) == "c * tanh(s / c)"
    assert str(TREES["alibi"]) == "s - slopes[h] * abs(dst.index - src.index)"
    assert str(E("sub", S, E("sub", I, J))) == "s - (dst.index - src.index)"


# --------------------------------------------------------------------------- tracing
class ModProgram(tg.MessagePassing):
    """score = fn(scale * <src.key, dst.query>, src, dst, edge, params)."""
    reducer = tg.online_softmax()

    def __init__(self, fn, dot=True):
        self.fn = fn
        self.dot = dot

    def edge(self, src, dst, edge, scale, **params):
        s = (src.key * dst.query).sum(-1) * scale if self.dot else None
        return self.reducer(self.fn(s, src, dst, edge, params), src.value)


def _trace(fn, n=6, H=2, D=4, dot=True, src=None, dst=None, edge=None, graph=None, **params):
    src = dict(src or {})
    dst = dict(dst or {})
    if dot:
        src.setdefault("key", RNG.standard_normal((n, H, D)))
        dst.setdefault("query", RNG.standard_normal((n, H, D)))
    src.setdefault("value", RNG.standard_normal((n, H, D)))
    graph = graph or tg.Graph.dense(n)
    return ModProgram(fn, dot).traced_form(graph, src=src, dst=dst, edge=edge, scale=0.5, **params)


def test_trace_lowers_flash_style_modifiers_to_one_tree():
    t = _trace(lambda s, src, dst, edge, p: p["c"] * np.tanh(s / p["c"]), c=30.0)
    assert t.kind == "modified"
    assert str(t.score.expr) == "c * tanh(s)"  # the 1 / c folds into the dot's scale
    assert "(scale * (1 / c)) * <src.key, dst.query>" in t.describe()
    t = _trace(lambda s, src, dst, edge, p: s - p["slopes"] * np.abs(dst.index - src.index),
               slopes=np.ones(2))
    assert str(t.score.expr) == "s - slopes[h] * abs(dst.index - src.index)"


def test_one_dot_product_with_several_factors_is_one_score_leaf():
    t = _trace(lambda s, src, dst, edge, p: np.tanh(s) + (src.key * dst.query).sum(-1) * 2.0)
    assert str(t.score.expr) == "tanh(scale * s) + 2 * s"  # s: the unscaled dot product
    assert t.score.dot[2].is_one()


def test_trace_classic_gat_has_no_dot_product():
    t = _trace(lambda s, src, dst, edge, p: tg.leaky_relu(src.a + dst.a, 0.2), dot=False,
               src={"a": RNG.standard_normal((6, 2))}, dst={"a": RNG.standard_normal((6, 2))})
    assert t.score.dot is None
    assert str(t.score.expr) == "leaky_relu(src.a + dst.a, 0.2)"


def test_every_listed_construct_traces():
    def fn(s, src, dst, edge, p):
        x = np.where(s > 0.5, np.exp(s), np.log(np.abs(s) + 1.0)) + np.minimum(s, dst.a)
        x = x - np.maximum(src.a, 0.1) * np.sqrt(dst.a * dst.a + 1.0) + abs(s) / 3.0
        x = x + (s >= src.a) * 1.0 - (s <= 2) + (s < p["c"]) * (dst.index != src.index)
        return tg.leaky_relu(x, 0.1) * p["w"] + 0.5 * np.tanh(s) / (1.0 + s * s) - (s == 0)

    t = _trace(fn, src={"a": RNG.standard_normal(6)}, dst={"a": RNG.standard_normal((6, 2))},
               c=1.0, w=np.ones(2))
    ops = {x.op for x in sm.walk(t.score.expr)}
    assert {"where", "exp", "log", "abs", "minimum", "maximum", "sqrt", "tanh", "leaky_relu",
            "gt", "ge", "le", "lt", "ne", "eq", "div", "mul", "add", "sub", "head", "node",
            "index", "scalar", "score"} <= ops


REFUSED = [
    ("np.sin", lambda s, src, dst, edge, p: np.sin(s)),
    ("power (**)", lambda s, src, dst, edge, p: s ** 2.5),
    ("power (**)", lambda s, src, dst, edge, p: s ** -1),
    ("power (**)", lambda s, src, dst, edge, p: 2.0 ** s),
    ("power (**)", lambda s, src, dst, edge, p: np.power(s, 0.25)),
    ("float()", lambda s, src, dst, edge, p: math.tanh(s)),
    ("np.arctan2", lambda s, src, dst, edge, p: np.arctan2(s, 1.0)),
    ("bool()", lambda s, src, dst, edge, p: s if s > 0 else -s),
    ("modulo", lambda s, src, dst, edge, p: s % 2.0),
    ("np.where with other than three", lambda s, src, dst, edge, p: np.where(s > 0)),
    ("two dot scores", lambda s, src, dst, edge, p: np.tanh(s) + (src.value * dst.query).sum(-1)),
    ("np.clip", lambda s, src, dst, edge, p: np.clip(s, 0, 1)),
    ("bitwise and (&)", lambda s, src, dst, edge, p: (s > 0) & (s < 1)),
    ("bitwise or (|)", lambda s, src, dst, edge, p: s | 1),
    ("bitwise xor (^)", lambda s, src, dst, edge, p: 1 ^ s),
    ("bitwise not (~)", lambda s, src, dst, edge, p: ~(s > 0)),
    ("shift (<<)", lambda s, src, dst, edge, p: s + (dst.index << 1)),
    ("shift (>>)", lambda s, src, dst, edge, p: s + (dst.index >> 1)),
    ("round()", lambda s, src, dst, edge, p: round(s)),
    ("divmod()", lambda s, src, dst, edge, p: divmod(s, 2.0)[0]),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_constructs_outside_the_grammar_name_themselves(case):
    needle, fn = case
    with pytest.raises(NotImplementedError) as info:
        _trace(fn)
    assert needle in str(info.value), str(info.value)


def test_input_errors_of_a_modified_program_keep_their_type():
    """A modified score's program reports bad inputs as the functional API does (TypeError for a
    dtype, ValueError for shapes and heads), with the fields named; never as the score
    expression's refusal of an attribute."""
    rng = np.random.default_rng(11)
    g = tg.Graph.triangular(9)
    prog = ModProgram(lambda s, src, dst, edge, p: 2.0 * np.tanh(s / 2.0))
    v = rng.standard_normal((9, 2, 4)).astype(np.float32)
    k = rng.standard_normal((9, 2, 4)).astype(np.float32)
    q = rng.standard_normal((9, 2, 4)).astype(np.float32)
    for exc, match, kk, qq in ((TypeError, "dtype", k.astype(np.float64), q),
                               (ValueError, "head dim", k, q[:, :, :3]),
                               (ValueError, "multiple", k, np.concatenate([q, q[:, :1]], axis=1))):
        with pytest.raises(exc, match=match) as info:
            prog(graph=g, src={"key": kk, "value": v}, dst={"query": qq}, scale=0.5)
        assert "q = dst.query, k = src.key" in str(info.value)
    slopes = ModProgram(lambda s, src, dst, edge, p: s - p["sl"] * np.abs(dst.index - src.index))
    with pytest.raises(ValueError, match=r"param 'sl' must be .* shape \(H,\).* got an array of shape \(2, 1\)"):
        slopes(graph=g, src={"key": k, "value": v}, dst={"query": q}, scale=0.5, sl=np.ones((2, 1)))
    # per-head values as a Python list: said to need a number or an (H,) array, not "a scalar"
    with pytest.raises(TypeError, match=r"param 'sl' must be a real number \(a scalar param\) or a numpy / cupy "
                                        r"array of shape \(H,\) \(a per-head param\), got list"):
        slopes(graph=g, src={"key": k, "value": v}, dst={"query": q}, scale=0.5, sl=[0.5, 0.25])
    capped = ModProgram(lambda s, src, dst, edge, p: p["cap"] * np.tanh(s / p["cap"]))
    for bad in (0.0, np.nan):   # the factor scale / cap is not finite: named, not called a bad scale
        with pytest.raises(ValueError, match=r"factor .*cap.* evaluates to .*cap="):
            capped(graph=g, src={"key": k, "value": v}, dst={"query": q}, scale=0.5, cap=bad)


def test_leaky_relu_is_eager_on_arrays():
    x = np.array([-2.0, 0.0, 3.0])
    np.testing.assert_array_equal(tg.leaky_relu(x, 0.2), [-0.4, 0.0, 3.0])
    assert tg.leaky_relu(-1.0, 0.5) == -0.5
    got = tg.leaky_relu(np.array([-3, -1, 0, 2]), 0.2)   # integers: the slope is not cast to int
    np.testing.assert_allclose(got, [-0.6, -0.2, 0.0, 2.0])
    assert tg.leaky_relu(np.float32([-1.0]), 0.2).dtype == np.float32


# --------------------------------------------------------------------------- kernels vs oracle
class _NS:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _edges(graph):
    indptr, indices = graph._host_csr()
    return _rows_of(indptr), indices.astype(np.int64)


class _NearKink(Exception):
    """Random inputs put an edge within a step of a kink of fn (leaky_relu at 0, minimum at a
    tie, a comparison's threshold): the oracle's central difference is meaningless there."""


def _central_differences(diff, masked=False, eps=1e-6):
    """Central differences diff(eps) / (2 eps) and with a step four times smaller, compared so
    that a kink inside the step is caught instead of giving an averaged slope (cells in `masked`
    are not checked: the caller zeroes them), then combined by Richardson extrapolation: both
    carry an error c h^2, which (16 d2 - d1) / 15 cancels. Near the edge of a function's domain
    (log(x) at x ~ 1e-3: a slope of 1000 and a step error of eps^2 / 3x^2 of it) the plain
    difference was off by more than the tests' 1e-6."""
    d1 = diff(eps) / (2 * eps)
    d2 = diff(eps / 4) / (eps / 2)
    d1, d2 = np.where(masked, 0.0, d1), np.where(masked, 0.0, d2)
    if not np.allclose(d1, d2, rtol=1e-4, atol=1e-6):
        raise _NearKink
    return (16 * d2 - d1) / 15


def oracle(fn, graph, q, k, v, dout, scale, src, dst, edge, params, dot=True):
    """float64 forward and gradients of attention with score fn(s, src, dst, edge, params),
    evaluated on numpy arrays; derivatives of fn by central differences per edge."""
    rows, cols = _edges(graph)
    E = rows.shape[0]
    H = v.shape[1] if q is None else q.shape[1]
    Hkv = v.shape[1]
    kvh = np.arange(H) // (H // Hkv) if H >= Hkv else np.zeros(H, np.int64)
    s = scale * np.einsum("ehd,ehd->eh", q[rows], k[cols][:, kvh]) if dot else None

    def gather(a, idx):
        return a[idx][:, None] if a.ndim == 1 else a[idx]

    base = {"src": {n: gather(a, cols) for n, a in src.items()},
            "dst": {n: gather(a, rows) for n, a in dst.items()},
            "edge": {n: (a[:, None] if a.ndim == 1 else a) for n, a in edge.items()},
            "params": dict(params)}

    def F(s, vals):
        out = fn(s, _NS(index=cols[:, None], **vals["src"]), _NS(index=rows[:, None], **vals["dst"]),
                 _NS(**vals["edge"]), vals["params"])
        return np.broadcast_to(np.asarray(out, np.float64), (E, H))

    f = F(s, base)
    # a NaN or -inf value masks its edge (docs/score_mods.md): p = 0 and no gradient through it;
    # a row whose every edge is masked is an empty row (out 0), as the CPU kernels give
    masked = ~(f > -np.inf)
    f = np.where(masked, -np.inf, f)

    def _central(diff):
        with np.errstate(invalid="ignore"):
            return np.where(masked, 0.0, _central_differences(diff, masked))
    m = np.full((graph.num_dst, H), -np.inf)
    np.maximum.at(m, rows, f)
    pu = np.where(masked, 0.0, np.exp(f - np.where(np.isfinite(m), m, 0.0)[rows]))
    l = np.zeros((graph.num_dst, H))
    np.add.at(l, rows, pu)
    p = pu / np.where(l > 0, l, 1.0)[rows]
    vg = v[cols][:, kvh]
    out = np.zeros((graph.num_dst, H, v.shape[2]))
    np.add.at(out, rows, p[:, :, None] * vg)
    dp = np.einsum("ehd,ehd->eh", dout[rows], vg)
    delta = np.einsum("nhd,nhd->nh", dout, out)[rows]
    dF = p * (dp - delta)
    grads = {"src": {}, "dst": {}, "edge": {}, "params": {}}
    dv = np.zeros((v.shape[0], H, v.shape[2]))
    np.add.at(dv, cols, p[:, :, None] * dout[rows])
    grads["src"]["value"] = dv.reshape(v.shape[0], Hkv, -1, v.shape[2]).sum(axis=2) if H >= Hkv else dv
    if dot:
        dS = dF * _central(lambda eps: F(s + eps, base) - F(s - eps, base))
        dq = np.zeros_like(q)
        np.add.at(dq, rows, scale * dS[:, :, None] * k[cols][:, kvh])
        dkf = np.zeros((k.shape[0], H, k.shape[2]))
        np.add.at(dkf, cols, scale * dS[:, :, None] * q[rows])
        grads["dst"]["query"] = dq
        grads["src"]["key"] = dkf.reshape(k.shape[0], Hkv, -1, k.shape[2]).sum(axis=2)
        # the program's `scale` is a float scalar param too: s = scale <q, k>
        grads["params"]["scale"] = np.asarray((dS * s).sum() / scale)
    for role, given, idx in (("src", src, cols), ("dst", dst, rows), ("edge", edge, None),
                             ("params", params, None)):
        for n, a in given.items():
            scalar = isinstance(a, float)   # a float scalar param (an int gets no gradient)
            if not (scalar or (isinstance(a, np.ndarray) and a.dtype.kind == "f")):
                continue
            def diff(eps, role=role, n=n):
                up = {r: dict(d) for r, d in base.items()}
                dn = {r: dict(d) for r, d in base.items()}
                up[role][n] = base[role][n] + eps
                dn[role][n] = base[role][n] - eps
                return F(s, up) - F(s, dn)
            d = dF * _central(diff)  # (E, H)
            if role == "params":
                g = np.asarray(d.sum()) if scalar else d.sum(axis=0)
            elif role == "edge":
                g = d if a.ndim == 2 and a.shape[1] == H else d.sum(axis=1).reshape(a.shape)
            else:
                g = np.zeros((a.shape[0], H))
                np.add.at(g, idx, d)
                g = g.sum(axis=1).reshape(a.shape) if a.ndim == 1 or a.shape[1] == 1 else g
            grads[role][n] = g
    return out, grads


def _relations(n):
    cu = np.array([0, 5, 5, 12, n])           # an empty segment
    cu_k = np.array([0, 7, 9, 12, n + 3])     # rectangular segments (bottom-right causal)
    mask = RNG.random((n, n)) < 0.3
    mask[3] = False                           # an empty row
    mask[:, 2] = True                         # a hub source
    import scipy.sparse as sp
    return {
        "dense": tg.Graph.dense(n),
        "dense-rect": tg.Graph.dense(n + 4, n),
        "triangular": tg.Graph.triangular(n),
        "segments": tg.Graph.cu_seqlens(cu, causal=True),
        "segments-rect": tg.Graph.cu_seqlens(cu, causal=False, cu_seqlens_k=cu_k),
        "band": tg.Graph.band(n, left=4, right=1),
        "csr": tg.Graph.from_scipy(sp.csr_matrix(mask.astype(np.float64))),
    }


N_NODES = 19
RELATIONS = _relations(N_NODES)


def _full_mod(s, src, dst, edge, p):
    x = p["c"] * np.tanh(s / p["c"]) - p["slopes"] * np.abs(dst.index - src.index) * 0.1
    x = np.where(x > 0.2, x, 0.5 * x) + np.minimum(src.a, dst.a) * np.maximum(s, -1.0)
    return x + tg.leaky_relu(src.a + dst.a, 0.2) + np.sqrt(dst.a * dst.a + 1.0) * np.exp(0.1 * s) \
        - np.log(np.abs(src.a) + 1.0) / 2.0 + (s >= 0.3) * 0.25


def _scalar_fn_mod(s, src, dst, edge, p):
    """the listed functions and comparisons applied to scalar params themselves"""
    c, d = p["c"], p["d"]
    x = s * np.tanh(c) + np.minimum(c, 2.0) * np.maximum(c, d) * 0.1 + abs(d) * s * 0.5
    return np.where(c > 1.0, x, -x) + (d < 2.0) * s - np.where(d >= c, 0.3, s)


def _masking_mod(s, src, dst, edge, p):
    """log and sqrt of a negative number: NaN, which masks the edge; log(0) would be -inf."""
    with np.errstate(invalid="ignore"):   # the oracle evaluates it on numpy arrays
        return np.log(s + 0.6) + 0.5 * np.sqrt(s + dst.a * src.a + 0.3)


def _gat_mod(s, src, dst, edge, p):
    return tg.leaky_relu(src.a + dst.a, 0.2)


def _edge_mod(s, src, dst, edge, p):
    return np.tanh(s + edge.b) * 2.0 - edge.w * np.abs(s)


def _run_program(fn, graph, dtype, **kw):
    """Fresh random inputs through the compiled program and the oracle; inputs that put an edge
    on a kink of fn are drawn again (the kernel's one-sided derivative is right there, the
    oracle's central difference is not)."""
    for _ in range(8):
        try:
            return _run_program_once(fn, graph, dtype, **kw)
        except _NearKink:
            continue
    raise AssertionError("eight draws of random inputs all put an edge on a kink of fn")


def _run_program_once(fn, graph, dtype, H=4, Hkv=2, D=5, dot=True, node_shapes=("N", "NH"),
                      edge_fields=(), **params):
    n_dst, n_src = graph.num_dst, graph.num_src
    src, dst, edge = {}, {}, {}
    if dot:
        dst["query"] = RNG.standard_normal((n_dst, H, D))
        src["key"] = RNG.standard_normal((n_src, Hkv, D))
    src["value"] = RNG.standard_normal((n_src, Hkv if dot else H, 3))
    if "a" in (fn.__code__.co_names + fn.__code__.co_varnames) or fn in (_full_mod, _gat_mod):
        shp_d, shp_s = node_shapes
        dst["a"] = RNG.standard_normal((n_dst,) if shp_d == "N" else (n_dst, H))
        src["a"] = RNG.standard_normal((n_src,) if shp_s == "N" else (n_src, H))
    for name in edge_fields:
        edge[name] = RNG.standard_normal((graph.num_edges, H) if name == "b" else graph.num_edges)
    cast = {r: {n: a.astype(dtype) for n, a in d.items()} for r, d in
            (("src", src), ("dst", dst), ("edge", edge))}
    prog = ModProgram(fn, dot)
    out, vjp = prog.vjp(graph=graph, src=cast["src"], dst=cast["dst"], edge=cast["edge"],
                        scale=0.4, **params)
    dout = RNG.standard_normal(out.shape)
    grads = vjp(dout.astype(dtype))
    want, wgrads = oracle(fn, graph, dst.get("query"), src.get("key"), src["value"], dout, 0.4,
                          {n: a for n, a in src.items() if n not in ("key", "value")},
                          {n: a for n, a in dst.items() if n != "query"}, edge,
                          {n: (np.asarray(v, np.float64) if isinstance(v, np.ndarray) else v)
                           for n, v in params.items()}, dot=dot)
    return prog, out, grads, want, wgrads


def _close(got, want, tol, what):
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = np.max(np.abs(got - want)) if want.size else 0.0
    assert err <= tol * max(1.0, np.max(np.abs(want)) if want.size else 1.0), (what, err)


def _check_all(out, grads, want, wgrads, tol):
    _close(out, want, tol, "out")
    for role in ("src", "dst", "edge", "params"):
        for n, w in wgrads[role].items():
            assert n in grads[role], (role, n, sorted(grads[role]))
            _close(grads[role][n], w, tol, f"{role}.{n}")


def _head_cap_mod(s, src, dst, edge, p):
    return p["cap"] * np.tanh(s / p["cap"])


def test_a_scalar_learned_as_a_per_head_param():
    """docs/score_mods.md's way to learn a scalar of the score: the soft-cap as a per-head param
    holding one value; its (H,) gradient against the oracle, and summed over the heads against
    the central difference of the scalar itself."""
    g = RELATIONS["triangular"]
    prog, out, grads, want, wgrads = _run_program(_head_cap_mod, g, np.float64, cap=np.full(4, 2.0))
    _check_all(out, grads, want, wgrads, 1e-6)
    assert grads["params"]["cap"].shape == (4,)
    rng = np.random.default_rng(13)
    q, k, v = (rng.standard_normal((g.num_dst, 4, 5)) for _ in range(3))
    dout = rng.standard_normal((g.num_dst, 4, 5))
    run = ModProgram(_head_cap_mod, True)
    fields = dict(graph=g, src={"key": k, "value": v}, dst={"query": q}, scale=0.4)
    out, vjp = run.vjp(**fields, cap=np.full(4, 2.0))
    summed = vjp(dout)["params"]["cap"].sum()

    def loss(c):
        return float((run(**fields, cap=np.full(4, c)) * dout).sum())
    assert abs(summed - (loss(2.0 + 1e-6) - loss(2.0 - 1e-6)) / 2e-6) <= 1e-6 * max(1.0, abs(summed))


@pytest.mark.parametrize("rel", sorted(RELATIONS))
def test_modifier_forward_and_gradients_on_every_relation(rel):
    g = RELATIONS[rel]
    prog, out, grads, want, wgrads = _run_program(
        _full_mod, g, np.float64, c=2.5, slopes=RNG.uniform(0.2, 1.0, 4))
    _check_all(out, grads, want, wgrads, 1e-6)
    assert "compiled score modifier: f = " in prog.explain()


@pytest.mark.parametrize("rel", ["csr"])   # the block kernels share the generated slope / grad
def test_a_value_masked_by_nan_has_no_gradient(rel):
    """np.log / np.sqrt of a negative score: the edge is masked in the forward, and the backward
    gives it no gradient (its p = 0 times f' = NaN made dq, dk and the fields NaN)."""
    g = RELATIONS[rel]
    prog, out, grads, want, wgrads = _run_program(_masking_mod, g, np.float64)
    for role in ("src", "dst"):
        for n, a in grads[role].items():
            assert np.isfinite(a).all(), (role, n)
    _check_all(out, grads, want, wgrads, 1e-6)


@pytest.mark.parametrize("rel", ["triangular", "csr"])
def test_listed_functions_and_comparisons_of_scalar_params(rel):
    for c, d in ((2.5, -0.75), (0.5, 3.0)):   # each branch of every condition taken once
        prog, out, grads, want, wgrads = _run_program(_scalar_fn_mod, RELATIONS[rel], np.float64, c=c, d=d)
        _check_all(out, grads, want, wgrads, 1e-6)


@pytest.mark.parametrize("rel", ["dense", "segments-rect", "band", "csr"])
def test_classic_gat_score_without_dot_product(rel):
    g = RELATIONS[rel]
    prog, out, grads, want, wgrads = _run_program(_gat_mod, g, np.float64, dot=False,
                                                  node_shapes=("NH", "NH"))
    _check_all(out, grads, want, wgrads, 1e-6)
    text = prog.explain()
    assert "gather-only" in text and "leaky_relu(src.a + dst.a, 0.2)" in text


def _power_mod(s, src, dst, edge, p):
    return (0.3 * s ** 2 - np.tanh(s) ** 3 + (np.abs(s) + 1.0) ** 0.5 + dst.a ** 2 * src.a
            + 0.1 * np.square(s) - 0.05 * np.power(src.a, 3))


@pytest.mark.parametrize("rel", ["triangular", "csr"])
def test_whole_and_half_powers_are_written_out(rel):
    """x ** n (n = 1..8; also np.square, np.power) is traced as the product x * x * ...,
    x ** 0.5 as np.sqrt(x): the kernels and gradients of those operations, checked against the
    float64 oracle."""
    prog, out, grads, want, wgrads = _run_program(_power_mod, RELATIONS[rel], np.float64,
                                                  node_shapes=("NH", "N"))
    _check_all(out, grads, want, wgrads, 1e-6)
    t = _trace(lambda s, src, dst, edge, p: s ** 3)
    assert [x.op for x in sm.walk(t.score.expr)].count("mul") == 2


def _field_product_mod(s, src, dst, edge, p):
    return src.a * dst.a


@pytest.mark.parametrize("fn, rel", [(_field_product_mod, "csr")])   # edge fields: the same as_score path
def test_a_product_of_fields_is_a_score_of_its_own(fn, rel):
    """src.a * dst.a of (N, H) node fields, edge.b * edge.w of edge fields: an elementwise
    expression of fields (the contract's modifier grammar) needs no `+ 0` to be a score; an
    unsummed product of (N, H, D) fields stays refused (tests/test_tracing.py)."""
    prog, out, grads, want, wgrads = _run_program(fn, RELATIONS[rel], np.float64, dot=False,
                                                  node_shapes=("NH", "NH"))
    g = RELATIONS["csr"]   # a product of edge fields traces to a modifier too (no kernel run here)
    t = _trace(lambda s, src, dst, edge, p: edge.b * edge.w, dot=False, graph=g, n=g.num_dst,
               edge={"b": RNG.standard_normal(g.num_edges), "w": RNG.standard_normal(g.num_edges)})
    assert "edge.b" in t.describe() and "edge.w" in t.describe()
    _check_all(out, grads, want, wgrads, 1e-6)


def test_edge_fields_in_a_modifier_on_csr():
    prog, out, grads, want, wgrads = _run_program(_edge_mod, RELATIONS["csr"], np.float64,
                                                  edge_fields=("b", "w"))
    _check_all(out, grads, want, wgrads, 1e-6)


def test_edge_fields_in_a_modifier_refuse_implicit_relations():
    with pytest.raises(NotImplementedError, match="need a CSR relation"):
        _run_program(_edge_mod, RELATIONS["dense"], np.float64, edge_fields=("b", "w"))


def test_float32_modifier_matches_the_float64_oracle():
    g = RELATIONS["segments-rect"]
    prog, out, grads, want, wgrads = _run_program(
        _full_mod, g, np.float32, c=2.5, slopes=RNG.uniform(0.2, 1.0, 4))
    _check_all(out, grads, want, wgrads, 2e-4)


# --------------------------------------------------------------------------- functional API
def _flash_shift(rel, graph):
    """flash-attn's bottom-right ALiBi shift (global positions): i + shift - j is
    r + Lk - Lq - c in block-local positions; 0 where the relation has no blocks to align."""
    n = graph.num_dst
    if rel == "dense-rect":
        return np.full(n, graph.num_src - n)
    if rel.startswith("segments"):
        cu = np.array([0, 5, 5, 12, N_NODES])
        return _segments_shift(cu, np.array([0, 7, 9, 12, N_NODES + 3]) if rel == "segments-rect" else cu)
    return np.zeros(n, np.int64)


def _segments_shift(cu, cu_k):
    """_flash_shift of cu_seqlens segments: (Lk - Lq) - cu[b] + cu_k[b] on every row of segment b."""
    cu, cu_k = np.asarray(cu, np.int64), np.asarray(cu_k, np.int64)
    return np.repeat(np.diff(cu_k) - np.diff(cu) - cu[:-1] + cu_k[:-1], np.diff(cu))


@pytest.mark.parametrize("rel, dtype", [("dense-rect", np.float64), ("segments-rect", np.float64),
                                        ("triangular", np.float64), ("csr", np.float64),
                                        ("segments-rect", np.float32)])
def test_functional_softcap_and_alibi_match_flash_attn_conventions(rel, dtype):
    g = RELATIONS[rel]
    H, Hkv, D = 4, 2, 6
    q = RNG.standard_normal((g.num_dst, H, D)) * 2
    k = RNG.standard_normal((g.num_src, Hkv, D)) * 2
    v = RNG.standard_normal((g.num_src, Hkv, 3))
    dout = RNG.standard_normal((g.num_dst, H, 3))
    slopes = RNG.uniform(0.1, 0.6, H)
    cap = 1.5
    shift = _flash_shift(rel, g)

    def fn(s, src, dst, edge, p):
        i = dst.index + shift[dst.index]
        return cap * np.tanh(s / cap) - slopes * np.abs(i - src.index)

    want, wg = oracle(fn, g, q, k, v, dout, D ** -0.5, {}, {}, {}, {})
    c = [x.astype(dtype) for x in (q, k, v)]
    out, stats = tg.attention(*c, g, softcap=cap, alibi_slopes=slopes.astype(dtype),
                              return_stats=True)
    dq, dk, dv = tg.attention_backward(dout.astype(dtype), *c, out, stats, g, softcap=cap,
                                       alibi_slopes=slopes.astype(dtype))
    tol = 1e-9 if dtype == np.float64 else 2e-4
    _close(out, want, tol, "out")
    _close(dq, wg["dst"]["query"], max(tol, 1e-6), "dq")
    _close(dk, wg["src"]["key"], max(tol, 1e-6), "dk")
    _close(dv, wg["src"]["value"], tol, "dv")


def test_block_kernels_pass_64_bit_indices_for_huge_relations(monkeypatch):
    # the block kernels hand a modifier int32 node indices (vectorised int -> float); a relation
    # with 2**31 rows or keys gets the int64 variant, which must compute the same
    from tiga_numba.cpu import blocks
    assert blocks.index_width(2 ** 31 - 1, 7) == 32
    assert blocks.index_width(7, 2 ** 31) == 64
    g = RELATIONS["segments-rect"]
    q = RNG.standard_normal((g.num_dst, 2, 5))
    k, v = (RNG.standard_normal((g.num_src, 2, 5)) for _ in range(2))
    dout = RNG.standard_normal((g.num_dst, 2, 5))
    kw = dict(softcap=1.5, alibi_slopes=np.array([0.3, 0.9]))

    def run():
        out, st = tg.attention(q, k, v, g, return_stats=True, **kw)
        return (out,) + tuple(tg.attention_backward(dout, q, k, v, out, st, g, **kw))

    narrow = run()
    asked = []
    monkeypatch.setattr(blocks, "index_width", lambda rows, keys: asked.append((rows, keys)) or 64)
    wide = run()
    assert asked == [(g.num_dst, g.num_src)] * 2   # forward and backward chose the width
    for a, b, what in zip(narrow, wide, ("out", "dq", "dk", "dv")):
        _close(b, a, 1e-12, what)


def test_per_sequence_gradient_sums_each_sequence_on_its_own():
    """The per-sequence slopes' gradient sums each sequence's rows by themselves: a sequence
    whose per-row gradients are tiny keeps its own accuracy next to one whose are huge (a
    running-sum difference rounds it relative to the total before it: 1e10 before 3e-3 leaves
    about 2e-6 of error); empty sequences get 0; the same bits on every call."""
    rng = np.random.default_rng(11)
    index = np.array([0, 0, 0, 2, 2, 4], np.int64)    # sequences 1 and 3 empty
    g = np.concatenate([rng.uniform(1e9, 1e10, (3, 2)), rng.uniform(1e-4, 1e-3, (3, 2))])
    got = sm._sum_runs(g, index, 5)
    want = np.zeros((5, 2))
    for r, b in enumerate(index):
        want[b] += g[r]
    assert got.shape == (5, 2) and got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)
    assert (got[[1, 3]] == 0).all()
    assert np.array_equal(got, sm._sum_runs(g, index, 5))


def test_per_sequence_gradient_sums_add_each_run_in_row_order():
    """Each run is added from its first row onward (the order the device's sums use too, so a
    cupy call has the same bits): bit for bit a plain Python loop, on runs of 1, 7, 200 and
    1000 rows (numpy's own reduction sums pairwise past 8 rows and differs in the last bits),
    a run of -0.0 only keeping its sign, and (N,) rows."""
    rng = np.random.default_rng(5)
    lengths = [1, 0, 7, 200, 1000, 3]
    index = np.repeat(np.arange(len(lengths)), lengths)
    for shape in ((index.size, 3), (index.size,)):
        g = rng.standard_normal(shape) * rng.choice([1e-7, 1.0, 1e7], shape)
        g[-3:] = -0.0
        got = sm._sum_runs(g.astype(np.float32), index, len(lengths) + 1)
        g = g.astype(np.float32).astype(np.float64)
        want = np.zeros((len(lengths) + 1,) + shape[1:])
        r = 0
        for b, n in enumerate(lengths):
            if n:
                acc = g[r].copy()
                for x in g[r + 1:r + n]:
                    acc = acc + x
                want[b] = acc
            r += n
        assert np.array_equal(got.view(np.int64), want.view(np.int64))
        assert np.signbit(got[5]).all() and (got[[1, 6]] == 0).all()


def test_per_sequence_alibi_slopes():
    """flash-attn's (batch, H) alibi_slopes: sequence b of a cu_seqlens relation (rectangular,
    bottom-right aligned, one of them empty) takes slopes[b]; forward and backward against the
    float64 oracle, and the same rows as the call of each sequence on its own with its (H,)
    slopes. (Every call here shares its kernels with another test's: one tree compiled.)"""
    g = RELATIONS["segments-rect"]
    cu, cu_k = np.array([0, 5, 5, 12, N_NODES]), np.array([0, 7, 9, 12, N_NODES + 3])
    H, Hkv, D = 4, 2, 6
    q = RNG.standard_normal((g.num_dst, H, D)) * 2
    k = RNG.standard_normal((g.num_src, Hkv, D)) * 2
    v = RNG.standard_normal((g.num_src, Hkv, 3))
    dout = RNG.standard_normal((g.num_dst, H, 3))
    slopes = RNG.uniform(0.1, 0.9, (4, H))
    shift = _flash_shift("segments-rect", g)
    cap = 1.5
    out, stats = _check_flash_call(g, q, k, v, dout, cap, slopes,
                                   slopes[np.repeat(np.arange(4), np.diff(cu))], shift)
    # the stats keep the (batch, H) slopes (not their per-row gather) and refuse other ones
    assert stats.score_values["param 'alibi_slopes'"] is slopes
    with pytest.raises(ValueError, match="alibi_slopes' holds other values"):
        tg.attention_backward(dout, q, k, v, out, stats, g, softcap=cap, alibi_slopes=slopes[::-1])
    for b in range(4):
        if cu[b + 1] == cu[b]:
            continue
        one = tg.Graph.cu_seqlens([0, cu[b + 1] - cu[b]], causal=False, cu_seqlens_k=[0, cu_k[b + 1] - cu_k[b]])
        rows, keys = slice(cu[b], cu[b + 1]), slice(cu_k[b], cu_k[b + 1])
        np.testing.assert_allclose(tg.attention(q[rows], k[keys], v[keys], one, softcap=cap,
                                                alibi_slopes=slopes[b]), out[rows], rtol=1e-12, atol=1e-12)
    # Graph.cat of implicit relations: a block is a sequence
    two = tg.Graph.cat([tg.Graph.triangular(6), tg.Graph.dense(4, 3)])
    q2, k2, v2 = (RNG.standard_normal((n, 2, 4)) for n in (9, 10, 10))
    s2 = np.array([[0.2, 0.5], [0.7, 0.1]])
    got = tg.attention(q2, k2, v2, two, softcap=cap, alibi_slopes=s2)
    np.testing.assert_allclose(got[:6], tg.attention(q2[:6], k2[:6], v2[:6], tg.Graph.triangular(6),
                                                     softcap=cap, alibi_slopes=s2[0]), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[6:], tg.attention(q2[6:], k2[6:], v2[6:], tg.Graph.dense(4, 3),
                                                     softcap=cap, alibi_slopes=s2[1]), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"alibi_slopes of shape \(3, 4\) .* the graph has 4 sequences"):
        tg.attention(q, k, v, g, alibi_slopes=slopes[:3])
    with pytest.raises(ValueError, match=r"the graph is a band relation"):
        tg.attention(q[:20], k[:20], v[:20], tg.Graph.band(20, left=2, right=0), alibi_slopes=slopes[:2])


def _random_flash_relation(rng, kind):
    """(graph, per-row ALiBi shift in global positions, as _flash_shift, the sequence of each
    row or None where the relation is not made of sequences) of a random relation."""
    if kind == "band":
        n = int(rng.integers(1, 30))
        return (tg.Graph.band(n, left=int(rng.integers(0, 6)), right=int(rng.integers(0, 3))),
                np.zeros(n, np.int64), None)
    if kind == "dense-rect":
        ns, nd = int(rng.integers(1, 25)), int(rng.integers(1, 25))
        return tg.Graph.dense(ns, nd), np.full(nd, ns - nd), None
    lq, lk = rng.integers(0, 9, 3), rng.integers(0, 9, 3)
    cu, cu_k = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)])
    window = (int(rng.integers(0, 4)), int(rng.integers(0, 3))) if rng.integers(0, 2) else None
    g = tg.Graph.cu_seqlens(cu, causal=bool(rng.integers(0, 2)), cu_seqlens_k=cu_k, window=window)
    return g, _segments_shift(cu, cu_k), np.repeat(np.arange(3), lq)


@hypothesis.settings(max_examples=15, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(kind=st.sampled_from(["band", "dense-rect", "segments"]), seed=st.integers(0, 2**31 - 1))
def test_flash_modifiers_on_random_relations(kind, seed):
    """softcap= with alibi_slopes= against the float64 oracle on random bands, rectangular dense
    relations and varlen segments (Lq != Lk, causal or not, with or without a window),
    grouped-query heads: bottom-right aligned distances wherever the relation has blocks; on
    segments also flash-attn's per-sequence (batch, H) slopes (each row its sequence's)."""
    rng = np.random.default_rng(seed)
    g, shift, sequence = _random_flash_relation(rng, kind)
    if g.num_edges == 0:
        return   # the front end answers without a kernel (test_api_errors)
    H, Hkv = [(1, 1), (4, 2), (3, 1)][int(rng.integers(0, 3))]
    D = int(rng.integers(1, 9))
    q, k = rng.standard_normal((g.num_dst, H, D)) * 2, rng.standard_normal((g.num_src, Hkv, D)) * 2
    v, dout = rng.standard_normal((g.num_src, Hkv, 3)), rng.standard_normal((g.num_dst, H, 3))
    cap = float(rng.uniform(0.5, 4.0))
    if sequence is not None and rng.integers(0, 2):
        slopes = rng.uniform(0.0, 0.8, (3, H))
        row_slopes = slopes[sequence]
    else:
        slopes = rng.uniform(0.0, 0.8, H)
        row_slopes = np.broadcast_to(slopes, (g.num_dst, H))
    _check_flash_call(g, q, k, v, dout, cap, slopes, row_slopes, shift)


def _check_flash_call(g, q, k, v, dout, cap, slopes, row_slopes, shift):
    """tg.attention and its backward with softcap=cap, alibi_slopes=slopes (float64) against the
    oracle of the score cap tanh(s / cap) - row_slopes[i] |i + shift[i] - j|; returns (out, stats)."""
    def fn(s, src, dst, edge, p):
        return cap * np.tanh(s / cap) - dst.slope * np.abs(dst.index + shift[dst.index] - src.index)

    want, wg = oracle(fn, g, q, k, v, dout, q.shape[2] ** -0.5, {}, {"slope": row_slopes}, {}, {})
    out, stats = tg.attention(q, k, v, g, softcap=cap, alibi_slopes=slopes, return_stats=True)
    dq, dk, dv = tg.attention_backward(dout, q, k, v, out, stats, g, softcap=cap, alibi_slopes=slopes)
    _close(out, want, 1e-9, "out")
    _close(dq, wg["dst"]["query"], 1e-6, "dq")
    _close(dk, wg["src"]["key"], 1e-6, "dk")
    _close(dv, wg["src"]["value"], 1e-9, "dv")
    return out, stats


def test_softcap_alone_and_alibi_alone():
    # causal: the kernels test_kernel_cache_is_keyed_on_the_tree compiles for these two trees
    # (the dense full-block kernels take the modifiers in the functional tests above)
    g = RELATIONS["triangular"]
    q, k, v = (RNG.standard_normal((g.num_dst, 2, 4)) for _ in range(3))
    for kw, fn in (({"softcap": 0.7}, lambda s, src, dst, edge, p: 0.7 * np.tanh(s / 0.7)),
                   ({"alibi_slopes": np.array([0.3, 0.9])},
                    lambda s, src, dst, edge, p: s - np.array([0.3, 0.9]) * np.abs(dst.index - src.index))):
        want, _ = oracle(fn, g, q, k, v, np.zeros((g.num_dst, 2, 4)), 0.5, {}, {}, {}, {})
        _close(tg.attention(q, k, v, g, scale=0.5, **kw), want, 1e-10, str(kw))
    # flash-attn's (1, H) slopes are the (H,) slopes
    np.testing.assert_array_equal(tg.attention(q, k, v, g, scale=0.5, alibi_slopes=np.array([[0.3, 0.9]])),
                                  tg.attention(q, k, v, g, scale=0.5, alibi_slopes=np.array([0.3, 0.9])))


def test_functional_modifier_errors():
    g = RELATIONS["dense"]
    q, k, v = (RNG.standard_normal((g.num_dst, 2, 4)) for _ in range(3))
    with pytest.raises(ValueError, match="softcap"):
        tg.attention(q, k, v, g, softcap=-1.0)
    with pytest.raises(TypeError, match="softcap"):
        tg.attention(q, k, v, g, softcap="30")
    with pytest.raises(TypeError, match="softcap"):
        tg.attention(q, k, v, g, softcap=np.array(True))
    with pytest.raises(TypeError, match="softcap"):
        tg.attention(q, k, v, g, softcap=np.array([2.0]))
    # make_plan takes the modifiers as attention does (the plan names the compiled score)
    assert tg.make_plan(q, k, v, g).score == "dot"
    assert "tanh" in tg.make_plan(q, k, v, g, softcap=2.0).score
    assert "alibi" in tg.make_plan(q, k, v, g, alibi_slopes=np.ones(2), op="backward").score
    with pytest.raises(ValueError, match="softcap"):
        tg.make_plan(q, k, v, g, softcap=-0.5)
    # 0 is flash-attn's default, no soft-cap: the plain score and the plain kernel's bits
    assert tg.make_plan(q, k, v, g, softcap=0.0).score == "dot"
    np.testing.assert_array_equal(tg.attention(q, k, v, g, softcap=0.0), tg.attention(q, k, v, g))
    out0, st0 = tg.attention(q, k, v, g, softcap=0, return_stats=True)
    np.testing.assert_array_equal(tg.attention_backward(out0, q, k, v, out0, st0, g),
                                  tg.attention_backward(out0, q, k, v, out0, st0, g, softcap=0.0))
    # a 0-d array (e.g. a torch scalar tensor) is its number
    np.testing.assert_array_equal(tg.attention(q, k, v, g, softcap=np.array(2.0)),
                                  tg.attention(q, k, v, g, softcap=2.0))
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(2,\)"):
        tg.attention(q, k, v, g, alibi_slopes=np.ones(3))
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(2,\)"):
        tg.attention(q, k, v, g, alibi_slopes=np.ones((2, 3)))
    # flash-attn's (batch, H) form: one row is the (H,) slopes; several rows need as many
    # sequences (test_per_sequence_alibi_slopes)
    with pytest.raises(ValueError, match=r"alibi_slopes of shape \(3, 2\) .* the graph is a dense relation"):
        tg.attention(q, k, v, g, alibi_slopes=np.ones((3, 2)))
    out, stats = tg.attention(q, k, v, g, softcap=2.0, return_stats=True)
    with pytest.raises(ValueError, match="score"):  # stats of another score
        tg.attention_backward(out, q, k, v, out, stats, g)


def test_kernel_cache_is_keyed_on_the_tree():
    from tiga_numba import functional
    g = RELATIONS["triangular"]
    q, k, v = (RNG.standard_normal((g.num_dst, 2, 4)) for _ in range(3))
    tg.attention(q, k, v, g, softcap=3.0)
    tg.attention(q, k, v, g, softcap=5.0)  # same tree, other value: the same kernel
    assert "hit" in str(functional.last_plan().run_info["cache"])
    a = tg.attention(q, k, v, g, alibi_slopes=np.array([0.5, 0.5]))
    b = tg.attention(q, k, v, g, softcap=3.0, alibi_slopes=np.array([0.5, 0.5]))
    assert not np.allclose(a, b)  # two different expressions never share a kernel
    from tiga_numba.kernel_cache import KERNELS
    keys = [key for key in KERNELS._kernels if key[:2] == ("cpu", "blocks.forward") and key[-1]]
    trees = {str(key[-1][0]) for key in keys}
    assert {"softcap * tanh(s / softcap)", "s - alibi_slopes[h] * abs(dst.index - src.index)",
            "softcap * tanh(s / softcap) - alibi_slopes[h] * abs(dst.index - src.index)"} <= trees


@pytest.mark.parametrize("rel", ["csr", "segments-rect"])
def test_modifier_bits_do_not_depend_on_the_thread_count(rel):
    import numba
    g = RELATIONS[rel]
    res = []
    for threads in (1, numba.config.NUMBA_NUM_THREADS):
        numba.set_num_threads(threads)
        try:
            rng = np.random.default_rng(5)
            src = {"key": rng.standard_normal((g.num_src, 2, 5)),
                   "value": rng.standard_normal((g.num_src, 2, 3)), "a": rng.standard_normal(g.num_src)}
            dst = {"query": rng.standard_normal((g.num_dst, 4, 5)),
                   "a": rng.standard_normal((g.num_dst, 4))}
            out, vjp = ModProgram(_full_mod).vjp(graph=g, src=src, dst=dst, scale=0.4, c=2.5,
                                                 slopes=np.linspace(0.2, 1.0, 4))
            res.append((out, vjp(rng.standard_normal(out.shape))))
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    np.testing.assert_array_equal(res[0][0], res[1][0])
    for role in ("src", "dst", "params"):
        for n in res[0][1][role]:
            np.testing.assert_array_equal(res[0][1][role][n], res[1][1][role][n])


def test_cuda_plans_say_why_a_modifier_is_not_on_the_tensor_cores():
    from tiga_numba import dispatch
    from tiga_numba.arrays import AttentionShape
    shape = AttentionShape("cupy", np.dtype(np.float16), 4, 4, 2, 2, 64, 64, False)
    tree = sm.softcap_tree(sm.SCORE)
    mod = sm.BoundModifier(tree, {sm.Expr("scalar", (), "softcap"): 3.0})
    plan = dispatch.make_plan("forward", tg.Graph.dense(4), shape, 0.5, score_mod=mod)
    assert plan.family == "cuda.blocks" and plan.modifier == tree
    text = plan.explain()
    assert "cuda.tc refused (no tensor-core kernels on this device)" in text   # no arrays: no device probe
    assert "softcap * tanh(s / softcap)" in text
    import scipy.sparse as sps
    csr = tg.Graph.from_scipy(sps.csr_matrix(np.ones((4, 4))))
    plan = dispatch.make_plan("backward", csr, shape, 0.5, score_mod=mod)
    assert plan.family == "cuda.csr" and plan.modifier == tree


def test_a_huge_softcap_is_the_plain_kernel_to_float32_rounding():
    """cap * tanh(s / cap) with cap = 1e9 is s: the float32 tanh must be accurate relative to its
    value near 0 (an absolute-error tanh would be off by cap * 1e-7 = 100 here)."""
    rng = np.random.default_rng(31)
    n, H, Hkv, D = 150, 4, 2, 16
    q, dout = (rng.standard_normal((n, H, D)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((n, Hkv, D)).astype(np.float32) for _ in range(2))
    g = tg.Graph.band(n, left=40)
    out, st = tg.attention(q, k, v, g, return_stats=True)
    plain = (out,) + tuple(tg.attention_backward(dout, q, k, v, out, st, g))
    out2, st2 = tg.attention(q, k, v, g, return_stats=True, softcap=1e9)
    capped = (out2,) + tuple(tg.attention_backward(dout, q, k, v, out2, st2, g, softcap=1e9))
    for name, a, b in zip(("out", "dq", "dk", "dv"), capped, plain):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5, err_msg=name)


def test_cpu_float32_tanh_is_accurate_relative_to_its_value_everywhere():
    """The float32 kernels' tanh (a rational function on |x| <= 9): relative error < 4e-7 from
    1e-30 to beyond saturation, odd, NaN kept, infinities to +-1."""
    from numba import njit
    from tiga_numba.cpu.score_codegen import tanh_f32

    @njit
    def run(x, out):
        for i in range(x.size):
            out[i] = tanh_f32(x[i])
    grid = np.concatenate([np.linspace(-12, 12, 400_001), np.logspace(-30, 0.5, 4000),
                           -np.logspace(-30, 0.5, 4000)]).astype(np.float32)
    got = np.empty_like(grid)
    run(grid, got)
    want = np.tanh(grid.astype(np.float64))
    nz = want != 0
    assert np.all(got[~nz] == 0)
    assert np.max(np.abs(got[nz] - want[nz]) / np.abs(want[nz])) < 4e-7
    special = np.array([np.nan, np.inf, -np.inf, 0.0], np.float32)
    out = np.empty_like(special)
    run(special, out)
    assert np.isnan(out[0]) and out[1] == 1.0 and out[2] == -1.0 and out[3] == 0.0
