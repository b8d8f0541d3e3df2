"""tiga_numba.dask: attention and its backward over dask arrays equal the single-process call."""
import os

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")

import tiga_numba as tg  # noqa: E402
import tiga_numba.dask as tgd  # noqa: E402
import tiga_numba.layers as tgl  # noqa: E402
from test_ordering import shuffled_mesh  # noqa: E402

# One xdist worker runs this module, in file order (README command: --dist loadgroup): the
# dask.distributed tests at the end then find on disk the kernels that the threaded tests of the
# same calls compiled, where two worker processes of the cluster would each compile them again.
pytestmark = pytest.mark.xdist_group("dask")

H, HKV, D = 4, 2, 8   # grouped-query attention in every case


def _csr_graph():
    """60 destinations x 50 sources: an empty row, a hub row (every source), a whole empty
    partition (rows 26..38 with the chunks below) and a source chunk no edge reads (44..49)."""
    a = sp.random(60, 50, density=0.15, random_state=np.random.RandomState(3), format="lil")
    for r in [3] + list(range(26, 39)):
        a.rows[r], a.data[r] = [], []
    for r in range(a.shape[0]):
        a.rows[r] = [j for j in a.rows[r] if j < 44]
        a.data[r] = [1.0] * len(a.rows[r])
    a.rows[10], a.data[10] = list(range(44)), [1.0] * 44
    return tg.Graph.from_scipy(a.tocsr())


CASES = {
    # name: (graph builder, num_dst, num_src, q rows per chunk, k rows per chunk)
    "csr": (_csr_graph, 60, 50, 13, 11),
    "triangular": (lambda: tg.Graph.triangular(45), 45, 45, 12, 12),
    "triangular-uneven": (lambda: tg.Graph.triangular(45), 45, 45, 12, 7),
    "segments": (lambda: tg.Graph.cu_seqlens([0, 5, 5, 20, 21, 45]), 45, 45, 12, 10),
    "segments-full": (lambda: tg.Graph.cu_seqlens([0, 7, 7, 30, 45], causal=False), 45, 45, 9, 16),
    "dense-rect": (lambda: tg.Graph.dense(37, 50), 50, 37, 16, 10),
    "band": (lambda: tg.Graph.band(50, 45, left=6, right=2), 45, 50, 12, 10),
    "varlen-kv-causal": (lambda: tg.Graph.cu_seqlens([0, 5, 5, 20, 30], cu_seqlens_k=[0, 9, 12, 12, 40]),
                         30, 40, 7, 9),
    "window": (lambda: tg.Graph.cu_seqlens([0, 20, 45], window=(4, 1)), 45, 45, 10, 10),
    "empty-rows-cat": (lambda: tg.Graph.cat([tg.Graph.dense(0, 10), tg.Graph.triangular(20)]),
                       30, 20, 8, 6),
}


def _problem(name, dtype=np.float64, seed=0):
    build, nd, ns, qc, kc = CASES[name]
    g = build()
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((nd, H, D)).astype(dtype)
    k = rng.standard_normal((ns, HKV, D)).astype(dtype)
    v = rng.standard_normal((ns, HKV, D + 3)).astype(dtype)
    dout = rng.standard_normal((nd, H, D + 3)).astype(dtype)
    return (g, *_solved(g, (q, k, v, dout), qc, kc))


def _solved(g, arrays, qc, kc, mods=None):
    """((out, stats, grads) of the single-process call with `mods` on arrays (q, k, v, dout), and
    those arrays as dask arrays: q and dout in chunks qc, k and v in chunks kc)."""
    q, k, v, dout = arrays
    mods = mods or {}
    out, st = tg.attention(q, k, v, g, return_stats=True, **mods)
    ref = tg.attention_backward(dout, q, k, v, out, st, g, **mods)
    chunked = {n: da.from_array(x, chunks=(qc if n in ("q", "dout") else kc, -1, -1))
               for n, x in zip(("q", "k", "v", "dout"), arrays)}
    return (out, st, ref), chunked


def _lazy(g, c, mods=None):
    mods = mods or {}
    out, stats = tgd.attention(c["q"], c["k"], c["v"], g, return_stats=True, **mods)
    grads = tgd.attention_backward(c["dout"], c["q"], c["k"], c["v"], out, stats, g, **mods)
    return out, stats, grads


def _flat(lazy):
    out, stats, grads = lazy
    return (out, stats.m, stats.l, stats.lse, *grads)


def _check(got, expected, tol):
    (o, m, l, lse, *grads), (out, st, ref) = got, expected
    np.testing.assert_allclose(o, out, rtol=tol, atol=tol)
    fin = np.isfinite(st.m)
    assert np.array_equal(np.isfinite(m), fin) and np.array_equal(np.isfinite(lse), fin)
    np.testing.assert_allclose(m[fin], st.m[fin], rtol=tol, atol=tol)
    np.testing.assert_allclose(l, st.l, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse[fin], st.lse[fin], rtol=tol, atol=tol)
    assert not any(np.isnan(a).any() for a in (o, *grads))
    for name, a, b in zip(("dq", "dk", "dv"), grads, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_allclose(a, b, rtol=tol * 10, atol=tol * 10, err_msg=name)


@pytest.mark.parametrize("name", list(CASES))
def test_threaded_equals_single_process(name):
    g, expected, c = _problem(name)
    out, stats, grads = _lazy(g, c)
    assert out.chunks == c["q"].chunks[:1] + ((H,), (D + 3,))
    assert stats.m.chunks == c["q"].chunks[:2] and stats.l.chunks == c["q"].chunks[:2]
    assert grads[0].chunks == c["q"].chunks and grads[1].chunks == c["k"].chunks
    assert grads[2].chunks == c["v"].chunks
    for x in (out, stats.m, stats.l, *grads):   # every layer declares the layers it reads
        x.__dask_graph__().validate()
    got = dask.compute(out, stats.m, stats.l, stats.lse, *grads, scheduler="threads")
    _check(got, expected, 1e-12)
    # the backward sums partial gradients in a fixed order: the same bits on every run
    again = dask.compute(*grads, scheduler="threads")
    assert all(np.array_equal(a, b) for a, b in zip(again, got[4:]))


SLOPES = np.array([0.5, 0.25, 0.125, 0.0625])   # one per query head (H = 4)


def _modified_problem(name, mods, seed=7):
    """A problem whose scores pass the soft-cap (scaled inputs), with the single-process
    results of tiga_numba.attention(..., **mods) and its chunked dask arrays."""
    build, nd, ns, qc, kc = CASES[name]
    g = build()
    rng = np.random.default_rng(seed)
    q, dout = (3 * rng.standard_normal((nd, H, D)) for _ in range(2))
    k, v = (3 * rng.standard_normal((ns, HKV, D)) for _ in range(2))
    return (g, *_solved(g, (q, k, v, dout), qc, kc, mods))


MODS = {"softcap": dict(softcap=2.0), "alibi": dict(alibi_slopes=SLOPES),
        "softcap+alibi": dict(softcap=2.0, alibi_slopes=SLOPES),
        # flash-attn's per-sequence (batch, H) slopes, for the 4 sequences of "varlen-kv-causal"
        "softcap+alibi-rows": dict(softcap=2.0, alibi_slopes=np.outer([1.0, 0.5, 2.0, 0.75], SLOPES))}


# one case per kind of position handling (each modifier tree compiles its own kernels, so the
# suite stays short): CSR halos (source ids), unaligned blocks with uneven chunks, bottom-right
# aligned rectangular segments
@pytest.mark.parametrize("name,mods", [("csr", "softcap+alibi"), ("triangular-uneven", "softcap+alibi"),
                                       ("varlen-kv-causal", "softcap+alibi"),
                                       ("varlen-kv-causal", "softcap+alibi-rows")])
def test_score_modifiers_equal_single_process(name, mods):
    """softcap= and alibi_slopes=: forward, stats and gradients as tiga_numba.attention(...)
    gives them, whatever the chunks. ALiBi reads node positions: a block or partition computes
    the distance of the whole relation (bottom-right aligned in the dense and cu_seqlens
    blocks), not of its own renumbered rows."""
    g, expected, c = _modified_problem(name, MODS[mods])
    _check(dask.compute(*_flat(_lazy(g, c, MODS[mods])), scheduler="threads"), expected, 1e-12)
    plain = tgd.attention(c["q"], c["k"], c["v"], g).compute(scheduler="sync")
    rows = np.isfinite(expected[1].m[:, 0])
    assert np.abs(plain - expected[0])[rows].max() > 1e-3   # the modifier changed the result


def test_score_modifier_errors_at_the_call():
    g, (out, st, _), c = _modified_problem("csr", {})
    lout, lst = tgd.attention(c["q"], c["k"], c["v"], g, return_stats=True)
    with pytest.raises(ValueError, match="softcap"):
        tgd.attention(c["q"], c["k"], c["v"], g, softcap=-1.0)
    # 0 is flash-attn's "no soft-cap": the plain call's graph (same keys, same bits); (1, H) slopes
    # are the (H,) slopes: the same tasks
    assert tgd.attention(c["q"], c["k"], c["v"], g, softcap=0.0).name == tgd.attention(c["q"], c["k"], c["v"], g).name
    assert tgd.attention(c["q"], c["k"], c["v"], g, alibi_slopes=SLOPES[None]).name == \
        tgd.attention(c["q"], c["k"], c["v"], g, alibi_slopes=SLOPES).name
    with pytest.raises(TypeError, match="softcap"):
        tgd.attention_backward(c["dout"], c["q"], c["k"], c["v"], lout, lst, g, softcap="2")
    with pytest.raises(ValueError, match="alibi_slopes"):
        tgd.attention(c["q"], c["k"], c["v"], g, alibi_slopes=SLOPES[:3])
    with pytest.raises(ValueError, match=r"alibi_slopes of shape \(2, 4\) .* the graph is a csr relation"):
        tgd.attention(c["q"], c["k"], c["v"], g, alibi_slopes=np.stack([SLOPES, SLOPES]))
    with pytest.raises(TypeError, match="alibi_slopes"):
        tgd.attention_backward(c["dout"], c["q"], c["k"], c["v"], lout, lst, g,
                               alibi_slopes=np.arange(4))


class ModifiedScore(tg.MessagePassing):
    """A dot product, a soft-cap, per-node fields on both sides, a per-head param and the node
    positions: what a program's tasks must place in the whole relation."""
    reducer = tg.online_softmax()

    def edge(self, src, dst, edge, scale, slopes):
        s = (src.key * dst.query).sum(axis=-1) * scale
        s = 2.0 * np.tanh(s / 2.0) + src.a * dst.b - slopes * np.abs(dst.index - src.index)
        return self.reducer(s, src.value)


class ClassicGAT(tg.MessagePassing):
    """No dot product: the score is built from per-node logits only."""
    reducer = tg.online_softmax()

    def edge(self, src, dst, edge):
        return self.reducer(tg.leaky_relu(src.a + dst.a, 0.2), src.x)


def _program_problem(name, kind, seed=5):
    build, nd, ns, qc, kc = CASES[name]
    g = build()
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((ns, H, D + 3))
    if kind == "modified":
        prog, params = ModifiedScore(), {"scale": 0.5, "slopes": np.array([0.4, 0.2, 0.1, 0.05])}
        src = {"key": rng.standard_normal((ns, HKV, D)), "value": v[:, :HKV], "a": rng.standard_normal((ns, H))}
        dst = {"query": rng.standard_normal((nd, H, D)), "b": rng.standard_normal(nd)}
    else:
        prog, params = ClassicGAT(), {}
        src = {"a": rng.standard_normal((ns, H)), "x": v}
        dst = {"a": rng.standard_normal((nd, H))}
    out, vjp = prog.vjp(graph=g, src=src, dst=dst, **params)
    dout = rng.standard_normal(out.shape)
    chunked = {"src": {n: da.from_array(a, chunks=(kc,) + a.shape[1:]) for n, a in src.items()},
               "dst": {n: da.from_array(a, chunks=(qc,) + a.shape[1:]) for n, a in dst.items()},
               "dout": da.from_array(dout, chunks=(qc,) + dout.shape[1:])}
    return prog, g, params, (out, vjp(dout)), chunked


def _check_program(got_out, got_grads, out, grads, tol=1e-12):
    np.testing.assert_allclose(got_out, out, rtol=tol, atol=tol)
    for role in ("src", "dst", "params", "edge"):
        assert set(got_grads[role]) == set(grads[role]), role
        for n, g in grads[role].items():
            assert got_grads[role][n].dtype == g.dtype and got_grads[role][n].shape == g.shape
            np.testing.assert_allclose(got_grads[role][n], g, rtol=tol * 10, atol=tol * 10,
                                       err_msg=f"{role}[{n!r}]")


@pytest.mark.parametrize("name,kind", [("csr", "modified"), ("varlen-kv-causal", "modified"),
                                       ("empty-rows-cat", "gat"), ("csr", "gat")])
def test_program_vjp_equals_single_process(name, kind):
    """tiga_numba.dask.program_vjp: the program's output and the gradients of every field and
    per-head param as program.vjp gives them; node positions are the whole relation's."""
    prog, g, params, (out, grads), c = _program_problem(name, kind)
    lout, vjp = tgd.program_vjp(prog, g, src=c["src"], dst=c["dst"], **params)
    assert lout.chunks[0] == c["dout"].chunks[0]
    lgrads = vjp(c["dout"])
    for role in ("src", "dst"):
        for n, a in lgrads[role].items():
            assert a.chunks[0] == c[role][n].chunks[0]
    got = dask.compute(lout, lgrads, scheduler="threads")
    _check_program(*got, out, grads)
    again = dask.compute(lgrads, scheduler="threads")[0]   # a fixed order of sums: the same bits
    for role in ("src", "dst", "params"):
        for n in grads[role]:
            assert np.array_equal(again[role][n], got[1][role][n])
    np.testing.assert_array_equal(tgd.program(prog, g, src=c["src"], dst=c["dst"], **params).compute(),
                                  got[0])


class EdgeTermGAT(tg.MessagePassing):
    """GAT's score with a per-edge term (GATConv's edge_attr projection, precomputed)."""
    reducer = tg.online_softmax()

    def edge(self, src, dst, edge):
        return self.reducer(tg.leaky_relu(src.a + dst.a + edge.w, 0.2), src.x)


class EdgeBiased(tg.MessagePassing):
    """A dot product plus a per-edge bias (the bias kind of score, not a modifier)."""
    reducer = tg.online_softmax()

    def edge(self, src, dst, edge, scale):
        return self.reducer(scale * (dst.query * src.key).sum(axis=-1) + edge.bias, src.value)


@pytest.mark.parametrize("order", ["coo", "csr"])
def test_program_per_edge_fields_equal_single_process(order):
    """Per-edge fields are dask arrays in the graph constructor's edge order (any chunks): each
    partition reads its edges in CSR order, and their gradients come back in the constructor's
    order. A COO-built graph's order differs from its CSR order (the test can fail)."""
    rng = np.random.default_rng(12)
    src_ids, dst_ids = rng.integers(0, 50, 500), rng.integers(0, 60, 500)
    dst_ids[:120] = 10   # a hub row
    g = tg.Graph.from_coo(src_ids, dst_ids, 50, 60)
    if order == "csr":
        g = tg.Graph.from_scipy(g.to_scipy())
    else:
        assert not np.array_equal(g.edge_permutation, np.arange(g.num_edges))
    E = g.num_edges
    v = rng.standard_normal((50, H, D))
    dout = rng.standard_normal((60, H, D))
    for prog, src, dst, edge, params in [
            (EdgeTermGAT(), {"a": rng.standard_normal((50, H)), "x": v}, {"a": rng.standard_normal((60, H))},
             {"w": rng.standard_normal((E, H))}, {}),
            (EdgeBiased(), {"key": rng.standard_normal((50, H, D)), "value": v},
             {"query": rng.standard_normal((60, H, D))}, {"bias": rng.standard_normal(E)}, {"scale": 0.3})]:
        out, vjp = prog.vjp(graph=g, src=src, dst=dst, edge=edge, **params)
        grads = vjp(dout)
        lout, lvjp = tgd.program_vjp(
            prog, g, src={n: da.from_array(a, chunks=(11,) + a.shape[1:]) for n, a in src.items()},
            dst={n: da.from_array(a, chunks=(13,) + a.shape[1:]) for n, a in dst.items()},
            edge={n: da.from_array(a, chunks=(97,) + a.shape[1:]) for n, a in edge.items()}, **params)
        got = dask.compute(lout, lvjp(da.from_array(dout, chunks=(13, H, D))), scheduler="threads")
        _check_program(*got, out, grads)
        assert set(got[1]["edge"]) == set(edge)


class NetScore(tg.MessagePassing):
    """A score network over a source field, a destination field and a per-edge field."""
    reducer = tg.online_softmax()

    def __init__(self, heads, edge_field=True):
        super().__init__()
        import tiga_numba.nn as tnn
        self.edge_field = edge_field
        self.attn = tnn.trace(tnn.Sequential(tnn.Linear(3 + 2 + edge_field, 8, seed=1, dtype=np.float64),
                                             tnn.LeakyReLU(0.2),
                                             tnn.Linear(8, heads, seed=2, dtype=np.float64)))

    def edge(self, src, dst, edge):
        if self.edge_field:
            return self.reducer(self.attn(src.x, dst.y, edge.w), src.v)
        return self.reducer(self.attn(src.x, dst.y), src.v)


@pytest.mark.parametrize("heads", [1, 2])
def test_program_score_network_equals_single_process(heads):
    """Score networks (tg.nn.trace): one score (a single softmax) or one per head, over node
    fields of both sides and a per-edge field in constructor order; the parameters' gradients
    are summed over the partitions in a fixed order."""
    rng = np.random.default_rng(12)
    g = _layer_graph(rng, 41, 37, "coo")
    x, y = rng.standard_normal((37, 3)), rng.standard_normal((41, 2))
    w, v = rng.standard_normal((g.num_edges, 1)), rng.standard_normal((37, 2, 4))
    prog = NetScore(heads)
    out, vjp = prog.vjp(graph=g, src={"x": x, "v": v}, dst={"y": y}, edge={"w": w})
    dout = rng.standard_normal(out.shape)
    ref = vjp(dout)
    S = {"x": da.from_array(x, chunks=(10, -1)), "v": da.from_array(v, chunks=(10, -1, -1))}
    D = {"y": da.from_array(y, chunks=((13, 0, 28), (2,)))}
    lout, lvjp = tgd.program_vjp(prog, g, src=S, dst=D, edge={"w": da.from_array(w, chunks=70)})
    grads = lvjp(da.from_array(dout, chunks=((13, 0, 28),) + dout.shape[1:]))
    got_out, got = dask.compute(lout, grads, scheduler="threads")
    np.testing.assert_allclose(got_out, out, rtol=1e-12, atol=1e-12)
    for role in ("src", "dst", "edge", "params"):
        assert set(got[role]) == set(ref[role]), role
        for name, b in ref[role].items():
            np.testing.assert_allclose(got[role][name], b, rtol=1e-12, atol=1e-12, err_msg=f"{role}[{name}]")
    again = dask.compute(grads, scheduler="threads")[0]
    assert all(np.array_equal(again["params"][n], got["params"][n]) for n in got["params"])


def test_program_score_network_refusals():
    """What the partitions cannot run is refused at the call: geometric edge fields (computed
    from node positions, which the partitions do not carry; the message says how to pass them
    as a per-edge field, which then gives the single-process result) and implicit relations
    (as the single-process call)."""
    import tiga_numba.nn as tnn

    class Geometric(tg.MessagePassing):
        reducer = tg.online_softmax()

        def __init__(self):
            super().__init__()
            self.attn = tnn.trace(tnn.Sequential(tnn.Linear(1 + 3 + 3, 4, seed=1, dtype=np.float64),
                                                 tnn.ReLU(), tnn.Linear(4, 1, seed=2, dtype=np.float64)))

        def edge(self, src, dst, edge):
            return self.reducer(self.attn(edge.distance, src.x, dst.x), src.x)

    rng = np.random.default_rng(3)
    g = tg.Graph.radius(rng.random((30, 3)), 0.4)
    x = rng.standard_normal((30, 3))
    X = da.from_array(x, chunks=10)
    with pytest.raises(NotImplementedError, match=r"^edge.distance is computed from the graph's node positions"):
        tgd.program(Geometric(), g, src={"x": X}, dst={"x": X})
    given = tgd.program(Geometric(), g, src={"x": X}, dst={"x": X},
                        edge={"distance": da.from_array(g.edge_field("distance"), chunks=100)})
    np.testing.assert_allclose(given.compute(), Geometric()(graph=g, src={"x": x}, dst={"x": x}),
                               rtol=1e-12, atol=1e-12)
    t = tg.Graph.triangular(30)
    with pytest.raises(NotImplementedError, match="score-network attention runs over CSR relations"):
        tgd.program(NetScore(1, edge_field=False), t, src={"x": X, "v": da.ones((30, 2, 4), chunks=10)},
                    dst={"y": da.ones((30, 2), chunks=10)})


def test_program_errors_at_the_call():
    prog, g, params, _, c = _program_problem("csr", "modified")
    with pytest.raises(TypeError, match=r"edge\['w'\] must be a dask array"):
        tgd.program(prog, g, src=c["src"], dst=c["dst"], edge={"w": np.ones(g.num_edges)}, **params)
    with pytest.raises(ValueError, match=r"edge\['w'\] has"):
        tgd.program(prog, g, src=c["src"], dst=c["dst"], edge={"w": da.ones(g.num_edges - 1, chunks=50)},
                    **params)
    pt, gt, pp, _, ct = _program_problem("triangular-uneven", "modified")
    with pytest.raises(ValueError, match="per-edge fields"):
        tgd.program(pt, gt, src=ct["src"], dst=ct["dst"], edge={"w": da.ones(gt.num_edges, chunks=50)}, **pp)
    with pytest.raises(ValueError, match="dst field"):
        tgd.program(prog, g, src=c["src"], dst={}, **params)
    with pytest.raises(ValueError, match=r"src\['a'\] is chunked"):
        tgd.program(prog, g, src={**c["src"], "a": c["src"]["a"].rechunk(7)}, dst=c["dst"], **params)
    with pytest.raises(ValueError, match=r"dst\['b'\] has"):
        tgd.program(prog, g, src=c["src"], dst={**c["dst"], "b": c["dst"]["b"][:-1]}, **params)
    with pytest.raises(TypeError, match="slopes"):
        tgd.program(prog, g, src=c["src"], dst=c["dst"], scale=0.5, slopes=da.ones(4, chunks=2))
    with pytest.raises(TypeError, match="MessagePassing"):
        tgd.program(object(), g, src=c["src"], dst=c["dst"])
    with pytest.raises(ValueError, match="slopes"):   # the program's own check, at the call
        tgd.program(prog, g, src=c["src"], dst=c["dst"], scale=0.5, slopes=np.ones(3))
    pruned = ModifiedScore()
    pruned.reducer = tg.online_softmax(block_prune_threshold=0.5)
    with pytest.raises(NotImplementedError, match="tile pruning"):
        tgd.program(pruned, g, src=c["src"], dst=c["dst"], **params)
    _, vjp = tgd.program_vjp(prog, g, src=c["src"], dst=c["dst"], **params)
    with pytest.raises(ValueError, match="dout"):
        vjp(c["dout"][:, :2])
    with pytest.raises(ValueError, match="dout"):
        vjp(c["dout"].rechunk(9))


def test_blocks_outside_the_relation_are_never_created():
    g, _, c = _problem("triangular")
    summary = tgd.plan_summary(g, c["q"], c["k"])
    assert summary["blocks"] == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]
    assert sum(summary["edges"]) == g.num_edges
    g, _, c = _problem("csr")
    summary = tgd.plan_summary(g, c["q"], c["k"])
    assert summary["kind"] == "csr" and sum(summary["edges"]) == g.num_edges
    assert summary["halo_rows"][2] == 0   # the partition without edges reads no source row


def test_a_chunk_needed_almost_whole_travels_whole():
    """A partition that reads at least WHOLE_CHUNK_FRACTION of a source chunk's rows takes the
    whole chunk (no gather copy); one that reads fewer takes only those rows. Same results."""
    assert tgd.WHOLE_CHUNK_FRACTION == 15 / 16
    # 2 destination partitions of 4 rows, 2 source chunks of 16 rows. Partition 0 reads 15 rows
    # of chunk 0 (whole) and 3 of chunk 1 (gathered); partition 1 reads 14 rows of chunk 1.
    rows = [list(range(0, 8)), list(range(8, 15)) + [16], [20, 30], [],
            list(range(16, 23)), list(range(23, 30)), [], [16]]
    a = sp.lil_matrix((8, 32))
    for r, cols in enumerate(rows):
        a.rows[r], a.data[r] = cols, [1.0] * len(cols)
    g = tg.Graph.from_scipy(a.tocsr())
    rng = np.random.default_rng(5)
    q, dout = (rng.standard_normal((8, H, D)) for _ in range(2))
    k, v = (rng.standard_normal((32, HKV, D)) for _ in range(2))
    Q, DO = (da.from_array(x, chunks=(4, -1, -1)) for x in (q, dout))
    K, V = (da.from_array(x, chunks=(16, -1, -1)) for x in (k, v))
    summary = tgd.plan_summary(g, Q, K)
    assert summary["halo"] == [{0: 16, 1: 3}, {1: 14}]
    out, st = tg.attention(q, k, v, g, return_stats=True)
    ref = tg.attention_backward(dout, q, k, v, out, st, g)
    O, S = tgd.attention(Q, K, V, g, return_stats=True)
    got = dask.compute(O, *tgd.attention_backward(DO, Q, K, V, O, S, g), scheduler="threads")
    np.testing.assert_array_equal(got[0], out)   # the CSR forward sums what the single call sums
    for a_, b_ in zip(got[1:], ref):
        np.testing.assert_allclose(a_, b_, rtol=1e-12, atol=1e-12)


def test_float32_and_one_head_2d_inputs():
    g, (out, st, ref), c = _problem("csr", dtype=np.float32, seed=1)
    o, m = dask.compute(*(lambda r: (r[0], r[1].m))(tgd.attention(c["q"], c["k"], c["v"], g,
                                                                  return_stats=True)),
                        scheduler="threads")
    assert o.dtype == np.float32 and m.dtype == np.float32
    np.testing.assert_allclose(o, out, rtol=2e-6, atol=2e-6)
    rng = np.random.default_rng(2)
    g = tg.Graph.triangular(30)
    q, k, v, dout = (rng.standard_normal((30, 5)) for _ in range(4))
    out, st = tg.attention(q, k, v, g, return_stats=True)
    ref = tg.attention_backward(dout, q, k, v, out, st, g)
    Q, K, V, DO = (da.from_array(a, chunks=(8, -1)) for a in (q, k, v, dout))
    O, S = tgd.attention(Q, K, V, g, return_stats=True)
    assert S.m.ndim == 1
    got = dask.compute(O, *tgd.attention_backward(DO, Q, K, V, O, S, g), scheduler="threads")
    for a, b in zip(got, (out,) + tuple(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_processes_scheduler():
    g, expected, c = _problem("segments")
    out, stats, grads = _lazy(g, c)
    got = dask.compute(out, stats.m, stats.l, stats.lse, *grads, scheduler="processes",
                       num_workers=2)
    _check(got, expected, 1e-12)


@pytest.mark.parametrize("name", ["csr", "segments"])
def test_task_results_come_from_reused_buffers(name, monkeypatch):
    """CSR and block tasks write their results (outputs, statistics, gradients, partial
    gradients, their sums) into buffers of the process's result pool. A result still held keeps
    its buffer: a second call never overwrites the first call's arrays; once they are dropped
    the next call reuses the buffers instead of new memory. With the limit 0 nothing is kept."""
    import gc
    g, expected, c = _problem(name)
    tgd.release_halo_buffers()
    with dask.config.set(scheduler="threads", num_workers=4):
        first = dask.compute(*_flat(_lazy(g, c)))
        held = tgd._result_pool.held_bytes
        assert held > 0
        kept = [a.copy() for a in first]
        second = dask.compute(*_flat(_lazy(g, c)))
        for a, b in zip(first, kept):   # still the first call's values
            np.testing.assert_array_equal(a, b)
        _check(second, expected, 1e-12)
        assert not any(np.shares_memory(a, b) for a in first for b in second)
        grown = tgd._result_pool.held_bytes
        result_bytes = sum(a.nbytes for a in second)
        del first, second
        gc.collect()
        third = dask.compute(*_flat(_lazy(g, c)))
        _check(third, expected, 1e-12)
        # reused: without reuse every result would be a new buffer (the threads' timing may
        # still need a few small new ones)
        assert tgd._result_pool.held_bytes - grown < result_bytes / 2
        del third
    monkeypatch.setattr(tgd, "RESULT_BUFFER_BYTES", 0)
    tgd.release_halo_buffers()
    with dask.config.set(scheduler="threads", num_workers=4):
        _check(dask.compute(*_flat(_lazy(g, c))), expected, 1e-12)
    assert tgd._result_pool.held_bytes == 0


def test_csr_halos_are_assembled_in_reused_buffers(monkeypatch):
    """A CSR task copies its halo pieces into a buffer of the process's pool, which the next
    task of the same size reuses; concurrent tasks (threads) each hold their own. Results equal
    the single-process call with the pool on and with it off (limit 0: nothing kept)."""
    g, expected, c = _problem("csr")
    tgd._halo_scratch.clear()
    with dask.config.set(scheduler="threads", num_workers=4):   # graphs built and run threaded
        got = dask.compute(*_flat(_lazy(g, c)))
    _check(got, expected, 1e-12)
    kept = tgd._halo_scratch.idle_bytes
    assert kept > 0
    held = tgd._result_pool.held_bytes
    assert tgd.release_halo_buffers() == kept + held and tgd._halo_scratch.idle_bytes == 0
    assert tgd._result_pool.held_bytes == 0
    with dask.config.set(scheduler="threads", num_workers=4):
        dask.compute(*_flat(_lazy(g, c)))
    assert tgd._halo_scratch.idle_bytes > 0   # as many buffers as tasks overlapped this time
    monkeypatch.setattr(tgd, "HALO_SCRATCH_BYTES", 0)
    with dask.config.set(scheduler="threads", num_workers=4):
        off = dask.compute(*_flat(_lazy(g, c)))
    assert tgd._halo_scratch.idle_bytes == 0
    assert all(np.array_equal(a, b) for a, b in zip(off, got))


def test_csr_chunks_read_whole_by_every_partition():
    """Every destination reads every source (a complete CSR): each source chunk is taken whole
    by all three partitions, so its dk / dv sum adds three whole pieces (the first two in one
    pass); equal to the single-process call, the same bits on every run."""
    nd, ns = 30, 22
    g = tg.Graph.from_csr(np.arange(0, nd * ns + 1, ns), np.tile(np.arange(ns), nd), num_src=ns)
    rng = np.random.default_rng(9)
    q, dout = (rng.standard_normal((nd, H, D)) for _ in range(2))
    k, v = (rng.standard_normal((ns, HKV, D)) for _ in range(2))
    out, st = tg.attention(q, k, v, g, return_stats=True)
    ref = tg.attention_backward(dout, q, k, v, out, st, g)
    Q, DO = (da.from_array(x, chunks=(10, -1, -1)) for x in (q, dout))
    K, V = (da.from_array(x, chunks=(11, -1, -1)) for x in (k, v))
    assert tgd.plan_summary(g, Q, K)["halo"] == [{0: 11, 1: 11}] * 3
    with dask.config.set(scheduler="threads"):
        O, S = tgd.attention(Q, K, V, g, return_stats=True)
        got = dask.compute(*tgd.attention_backward(DO, Q, K, V, O, S, g))
        again = dask.compute(*tgd.attention_backward(DO, Q, K, V, O, S, g))
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    assert all(np.array_equal(a, b) for a, b in zip(again, got))


def _cuts(rng, n):
    """random chunk sizes of n rows: 1 to 5 chunks, one of them possibly empty."""
    if n == 0:
        return (0,)
    inner = np.sort(rng.integers(0, n + 1, int(rng.integers(0, 5))))
    return tuple(int(x) for x in np.diff(np.concatenate([[0], inner, [n]])))


def _random_relation(rng, kind):
    if kind == "csr":
        nd, ns = int(rng.integers(1, 40)), int(rng.integers(1, 40))
        a = sp.random(nd, ns, density=rng.uniform(0, 0.3), random_state=int(rng.integers(1 << 30)), format="lil")
        a.rows[0], a.data[0] = list(range(ns)), [1.0] * ns   # a hub row
        return tg.Graph.from_scipy(a.tocsr())
    if kind == "triangular":
        return tg.Graph.triangular(int(rng.integers(1, 50)))
    if kind == "band":
        n = int(rng.integers(1, 50))
        return tg.Graph.band(n, left=int(rng.integers(0, 8)), right=int(rng.integers(0, 3)))
    if kind == "dense":
        return tg.Graph.dense(int(rng.integers(1, 40)), int(rng.integers(1, 40)))
    lq, lk = rng.integers(0, 12, 3), rng.integers(0, 12, 3)
    lq[0] = max(lq[0], 1)
    cu_q = np.concatenate([[0], np.cumsum(lq)])
    cu_k = np.concatenate([[0], np.cumsum(lk)]) if kind == "varlen" else None
    window = (int(rng.integers(0, 5)), int(rng.integers(0, 2))) if rng.integers(0, 2) else None
    return tg.Graph.cu_seqlens(cu_q, causal=bool(rng.integers(0, 2)), cu_seqlens_k=cu_k, window=window)


# the two score trees the tests above compile (a new tree compiles its own kernels: a cold
# suite would pay for each)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["csr", "triangular", "band", "dense", "segments", "varlen"]),
       mods=st.sampled_from(["none", "softcap+alibi"]), seed=st.integers(0, 2**31 - 1))
def test_random_relations_and_chunks_equal_single_process(kind, mods, seed):
    """Any relation, any chunk boundaries of q and of k / v (empty chunks included), with or
    without the flash modifiers: forward, stats and gradients as the single-process call."""
    rng = np.random.default_rng(seed)
    g = _random_relation(rng, kind)
    kw = {} if mods == "none" else MODS[mods]
    arrays = tuple(rng.standard_normal(s) for s in ((g.num_dst, H, D), (g.num_src, HKV, D),
                                                    (g.num_src, HKV, D + 3), (g.num_dst, H, D + 3)))
    expected, c = _solved(g, arrays, _cuts(rng, g.num_dst), _cuts(rng, g.num_src), kw)
    _check(dask.compute(*_flat(_lazy(g, c, kw)), scheduler="threads"), expected, 1e-12)


# --------------------------------------------------------------------------- GNN layers
def _layer_graph(rng, nd, ns, order):
    """A COO graph (constructor order != CSR order) or its CSR, with a hub row, an empty row,
    a few self loops and repeated edges."""
    e = 260
    dst, src = rng.integers(0, nd, e), rng.integers(0, ns, e)
    dst[:25] = 4                              # a hub row
    src[30:36] = dst[30:36] % ns              # self loops, which PyG's layers remove and re-add
    dst[40:44], src[40:44] = 9, 2             # one edge four times
    keep = dst != 7                           # an empty row (it gets only its added loop)
    dst, src = dst[keep], src[keep]
    if order == "csr":
        a = sp.csr_matrix((np.ones(dst.shape[0]), (dst, src)), shape=(nd, ns))
        a.sum_duplicates()
        return tg.Graph.from_scipy(a)
    return tg.Graph.from_coo(src, dst, num_src=ns, num_dst=nd)


LAYER_CASES = {
    # name: (layer factory, bipartite, edge_dim or None, 1-D edge_attr, edge order)
    "gat-mean": (lambda: tgl.GATConv(6, 4, heads=3, edge_dim=3, seed=1), False, 3, False, "coo"),
    "gat-max-residual": (lambda: tgl.GATConv(6, 4, heads=2, concat=False, edge_dim=1, fill_value="max",
                                                   residual=True, seed=2), False, 1, True, "coo"),
    "gat-bipartite": (lambda: tgl.GATConv((6, 5), 4, heads=2, edge_dim=2, fill_value="mul", seed=3),
                      True, 2, False, "coo"),
    "gatv2-no-loops": (lambda: tgl.GATv2Conv(6, 4, heads=2, add_self_loops=False, seed=4),
                       False, None, False, "csr"),
    "gatv2-shared": (lambda: tgl.GATv2Conv(6, 4, heads=2, share_weights=True, edge_dim=3,
                                                 fill_value=0.5, seed=5), False, 3, False, "coo"),
    "transformer": (lambda: tgl.TransformerConv((6, 5), 4, heads=2, edge_dim=3, beta=True, seed=6),
                    True, 3, False, "coo"),
}


def _layer_problem(name, dtype=np.float64, seed=11):
    make, bipartite, edge_dim, flat, order = LAYER_CASES[name]
    rng = np.random.default_rng(seed)
    nd, ns = (41, 37) if bipartite else (41, 41)
    g = _layer_graph(rng, nd, ns, order)
    conv = make().eval()
    conv.load_state_dict({k: v.astype(dtype) for k, v in conv.state_dict().items()})
    x_src = rng.standard_normal((ns, 6)).astype(dtype)
    x_dst = rng.standard_normal((nd, 5)).astype(dtype) if bipartite else x_src
    x = (x_src, x_dst) if bipartite else x_src
    ea = None
    if edge_dim is not None:
        ea = rng.standard_normal((g.num_edges,) if flat else (g.num_edges, edge_dim)).astype(dtype)
    out, vjp = conv.vjp(x, g, ea)
    dout = rng.standard_normal(out.shape).astype(dtype)
    ref = vjp(dout)
    cx = (da.from_array(x_src, chunks=(10, -1)), da.from_array(x_dst, chunks=(13, -1))) if bipartite \
        else da.from_array(x_src, chunks=((9, 0, 20, 12), (6,)))
    rows = (cx[1] if bipartite else cx).chunks[0]
    chunked = dict(x=cx, edge_attr=None if ea is None else da.from_array(ea, chunks=70),
                   dout=da.from_array(dout, chunks=(rows, -1)))
    return conv, g, (out, ref), chunked


def _check_layer(got_out, got, out, ref, tol):
    np.testing.assert_allclose(got_out, out, rtol=tol, atol=tol)
    xs = got["x"] if isinstance(got["x"], tuple) else (got["x"],)
    xr = ref["x"] if isinstance(ref["x"], tuple) else (ref["x"],)
    for a, b in zip(xs, xr):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
    if ref["edge_attr"] is None:
        assert got["edge_attr"] is None
    else:
        assert got["edge_attr"].shape == ref["edge_attr"].shape
        np.testing.assert_allclose(got["edge_attr"], ref["edge_attr"], rtol=tol, atol=tol)
    assert set(got["params"]) == set(ref["params"])
    for k, b in ref["params"].items():
        assert got["params"][k].dtype == b.dtype, k
        np.testing.assert_allclose(got["params"][k], b, rtol=tol, atol=tol, err_msg=k)


@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_layer_vjp_equals_single_process(name):
    conv, g, (out, ref), c = _layer_problem(name)
    lout, vjp = tgd.layer_vjp(conv, c["x"], g, c["edge_attr"])
    rows = (c["x"][1] if isinstance(c["x"], tuple) else c["x"]).chunks[0]
    assert lout.chunks[0] == rows
    grads = vjp(c["dout"])
    got_out, got = dask.compute(lout, grads, scheduler="threads")
    _check_layer(got_out, got, out, ref, 1e-12)
    # the forward alone, and the partial sums in a fixed order: the same bits on every run
    assert np.array_equal(tgd.layer(conv, c["x"], g, c["edge_attr"]).compute(), got_out)
    again = dask.compute(grads, scheduler="threads")[0]

    def arrays(grads):
        x = grads["x"] if isinstance(grads["x"], tuple) else (grads["x"],)
        return [*x, grads["edge_attr"], *grads["params"].values()]
    assert all(a is b is None or np.array_equal(a, b) for a, b in zip(arrays(again), arrays(got)))


def test_layer_vjp_backward_takes_its_forward_state(monkeypatch):
    """Computed together, out and the gradients run each partition's layer forward once (the
    backward task takes the forward task's closure); where the state crossed a process boundary
    (pickled: a scheduler that serialises every result) it is empty and the backward task runs
    the forward again, with the same bits."""
    import cloudpickle
    from dask.local import get_async, synchronous_executor
    conv, g, (out, ref), c = _layer_problem("gat-mean")
    lout, vjp = tgd.layer_vjp(conv, c["x"], g, c["edge_attr"])
    grads = vjp(c["dout"])
    nparts = len(c["x"].chunks[0])
    calls = []
    run = type(conv)._run

    def counted(self, x, graph, *args, **kwargs):
        calls.append(graph.num_dst)
        return run(self, x, graph, *args, **kwargs)
    monkeypatch.setattr(type(conv), "_run", counted)
    got_out, got = dask.compute(lout, grads, scheduler="threads")
    _check_layer(got_out, got, out, ref, 1e-12)
    assert len(calls) == nparts, calls
    # out in a collection optimised apart from the gradients (dask.distributed's placement-hinted
    # out is one): the gradients' graph is fused on its own, and still shares the forward tasks
    calls.clear()
    parts = dask.compute(*lout.to_delayed().ravel(), grads, scheduler="threads")
    assert len(calls) == nparts, calls
    assert np.array_equal(np.concatenate(parts[:-1]), got_out) and np.array_equal(parts[-1]["x"], got["x"])

    def pickling(dsk, keys, **kwargs):   # every task's result serialised, as between processes
        return get_async(synchronous_executor.submit, 1, dsk, keys, dumps=cloudpickle.dumps,
                         loads=cloudpickle.loads, **kwargs)
    calls.clear()
    again_out, again = dask.compute(lout, grads, scheduler=pickling)
    assert len(calls) == 2 * nparts, calls
    assert np.array_equal(again_out, got_out) and np.array_equal(again["x"], got["x"])
    assert all(np.array_equal(again["params"][k], v) for k, v in got["params"].items())
    # dask counts a kept state by the arrays its closure holds (here 8 MB), not as a small object
    from dask.sizeof import sizeof
    held = np.zeros((1000, 1000))
    state = tgd._state_holder(lambda dout: dout * held[0, 0])
    assert sizeof(state) >= held.nbytes and state[0].nbytes == held.nbytes


@pytest.mark.parametrize("cls", [tgl.GATConv, tgl.TransformerConv])
def test_layer_vjp_state_keeps_its_halo_under_threads(cls):
    """The forward state a layer's backward task takes holds its partition's halo of x: with
    one-row chunks many partitions' halos have one size, and under the threaded scheduler
    another task must not get (and write) that halo's buffer before the backward reads it. The
    source projections' gradients (lin.weight; lin_key, lin_value) read the halo."""
    rng = np.random.default_rng(2)
    n = 31
    src, dst = rng.integers(0, n, 200), rng.integers(0, n, 200)
    dst[:30] = 3   # a hub row
    g = tg.Graph.from_edge_index(np.stack([src, dst]), n)
    x = rng.standard_normal((n, 6)).astype(np.float32)
    conv = cls(6, 4, heads=2, seed=2, dtype=np.float32)
    out, vjp = conv.vjp(x, g)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    ref = vjp(dout)
    for _ in range(3):   # the tasks' interleaving differs between runs
        lout, lvjp = tgd.layer_vjp(conv, da.from_array(x, chunks=(1, -1)), g)
        got_out, got = dask.compute(lout, lvjp(da.from_array(dout, chunks=(1, -1))), scheduler="threads")
        _check_layer(got_out, got, out, ref, 2e-5)


@pytest.mark.parametrize("dtype,tol", [(np.float32, 2e-5), (np.float16, 2e-2)])
def test_layer_lower_precision(dtype, tol):
    conv, g, (out, ref), c = _layer_problem("gat-mean", dtype=dtype)
    lout, vjp = tgd.layer_vjp(conv, c["x"], g, c["edge_attr"])
    got_out, got = dask.compute(lout, vjp(c["dout"]), scheduler="threads")
    assert got_out.dtype == dtype and got["x"].dtype == dtype
    _check_layer(got_out, got, out, ref, tol)


def test_layer_on_an_implicit_relation():
    """An implicit relation (here cu_seqlens with an empty segment) runs as its CSR listing, as
    the single-process layer runs it; self loops added on it."""
    rng = np.random.default_rng(13)
    g = tg.Graph.cu_seqlens([0, 10, 10, 30])
    conv = tgl.GATConv(5, 3, heads=2, seed=0, dtype=np.float64).eval()
    x = rng.standard_normal((30, 5))
    out, vjp = conv.vjp(x, g)
    dout = rng.standard_normal(out.shape)
    ref = vjp(dout)
    lout, lvjp = tgd.layer_vjp(conv, da.from_array(x, chunks=7), g)
    got_out, got = dask.compute(lout, lvjp(da.from_array(dout, chunks=(7, -1))), scheduler="threads")
    _check_layer(got_out, got, out, ref, 1e-12)


def test_layer_errors_at_the_call():
    conv, g, _, c = _layer_problem("gat-mean")
    x, ea = c["x"], c["edge_attr"]
    with pytest.raises(TypeError, match=r"^layer must be a tiga_numba.layers layer"):
        tgd.layer(object(), x, g, ea)
    with pytest.raises(TypeError, match=r"^x must be a dask array"):
        tgd.layer(conv, x.compute(), g, ea)
    with pytest.raises(ValueError, match=r"^x is chunked along axis 1"):
        tgd.layer(conv, x.rechunk((9, 3)), g, ea)
    with pytest.raises(ValueError, match=r"num_src=41 but x has 40 rows"):
        tgd.layer(conv, x[:40], g, ea)
    with pytest.raises(ValueError, match=r"^x_dst is None"):
        tgd.layer(conv, (x, None), g, ea)
    with pytest.raises(ValueError, match=r"num_edges=\d+ but edge_attr has"):
        tgd.layer(conv, x, g, ea[:-1])
    with pytest.raises(ValueError, match=r"x must have 6 features"):   # the layer's own check
        tgd.layer(conv, x[:, :5], g, ea)
    with pytest.raises(ValueError, match=r"edge_attr was given but GATConv was built with edge_dim=None"):
        tgd.layer(tgl.GATConv(6, 4), x, g, ea)
    with pytest.raises(NotImplementedError, match=r"dropout"):
        tgd.layer(tgl.GATConv(6, 4, dropout=0.5, edge_dim=3), x, g, ea)
    out, vjp = tgd.layer_vjp(conv, x, g, ea)
    with pytest.raises(ValueError, match=r"^dout is chunked"):
        vjp(c["dout"].rechunk((20, -1)))
    with pytest.raises(ValueError, match=r"^dout must have the shape of out"):
        vjp(c["dout"][:, :5])


def test_locality_order_shrinks_the_halos_and_keeps_the_results():
    rng = np.random.default_rng(7)
    side = 24
    n = side * side
    src, dst = shuffled_mesh(side, rng)
    g = tg.Graph.from_coo(src, dst, n, n)
    perm, g2 = tgd.locality_order(g)   # the same function as tg.locality_order
    assert sorted(perm) == list(range(n))
    inverse = np.argsort(perm)
    # the same relation on the new ids: edge (j -> i) is (inverse[j] -> inverse[i])
    a, b = g.to_scipy().toarray(), g2.to_scipy().toarray()
    np.testing.assert_array_equal(b, a[np.ix_(perm, perm)])
    q, k, v, dout = (rng.standard_normal((n, H if i != 1 and i != 2 else HKV, D)) for i in range(4))
    chunks = n // 4

    def run(graph, order):
        qd, kd, vd, dd = (da.from_array(x[order], chunks=(chunks,) + x.shape[1:]) for x in (q, k, v, dout))
        halo = tgd.plan_summary(graph, qd, kd)["halo_rows"]
        out, st = tgd.attention(qd, kd, vd, graph, return_stats=True)
        grads = tgd.attention_backward(dd, qd, kd, vd, out, st, graph)
        return halo, dask.compute(out, *grads, scheduler="threads")

    halo0, res0 = run(g, np.arange(n))
    halo1, res1 = run(g2, perm)
    # a partition of n / 4 mesh rows needs its rows and a boundary strip, not most of the mesh
    assert max(halo1) < chunks + 3 * side < min(halo0), (halo0, halo1)
    ref = tg.attention(q, k, v, g, return_stats=True)
    ref_grads = tg.attention_backward(dout, q, k, v, ref[0], ref[1], g)
    for got, want in zip(res1, (ref[0], *ref_grads)):
        np.testing.assert_allclose(got[inverse], want, rtol=1e-12, atol=1e-12)
    for got, want in zip(res0, (ref[0], *ref_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- dask.distributed
@pytest.fixture(scope="module")
def client():
    distributed = pytest.importorskip("distributed")
    # dashboard on a free port (":0"): None still binds the default 8787, which the other xdist
    # worker's cluster may hold. No work stealing: the placement tests check where the scheduler
    # puts tasks by their hints, which stealing may override when the box is busy (the hints
    # allow other workers, so results never depend on it)
    with dask.config.set({"distributed.scheduler.work-stealing": False}), \
            distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                     dashboard_address=":0", silence_logs=40) as cluster, \
            distributed.Client(cluster) as c:
        yield c


def test_keep_freed_memory_config_reaches_the_workers_started_under_it():
    """keep_freed_memory_config(): distributed's pre-spawn environment with the glibc settings that
    keep freed memory added; a worker process started under it has them (distributed's own default
    trims at 64 KiB), and the config is as it was outside the `with`."""
    import os

    import dask
    distributed = pytest.importorskip("distributed")
    key = "distributed.nanny.pre-spawn-environ"
    before = dict(dask.config.get(key, {}) or {})
    pre = tgd.keep_freed_memory_config()[key]
    assert {k: pre[k] for k in tgd.KEEP_FREED_MEMORY} == tgd.KEEP_FREED_MEMORY
    assert all(pre[k] == v for k, v in before.items() if k not in tgd.KEEP_FREED_MEMORY)
    names = tuple(tgd.KEEP_FREED_MEMORY)
    environ = dict(os.environ)
    try:
        with dask.config.set(tgd.keep_freed_memory_config()):
            with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                          dashboard_address=":0", silence_logs=40) as cluster, \
                    distributed.Client(cluster) as c:
                seen = c.run(lambda: {k: os.environ.get(k) for k in names})
    finally:   # distributed leaves the pre-spawn variables in this process's environment too
        os.environ.clear()
        os.environ.update(environ)
    assert list(seen.values()) == [tgd.KEEP_FREED_MEMORY]
    assert dict(dask.config.get(key, {}) or {}) == before


def test_keep_freed_memory_keeps_large_chunks_in_the_heap():
    """keep_freed_memory() in a fresh process (glibc Linux): a 64 MiB array allocated before it is
    a separate mapping (glibc's mmap counters go up), one allocated after it comes from the heap
    (they do not), and it is still there once freed (the heap is not trimmed)."""
    import ast
    import os
    import platform
    import subprocess
    import sys
    import textwrap
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc malloc only")
    code = textwrap.dedent("""
        import ctypes, numpy as np, tiga_numba.dask as tgd
        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                       "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = Info
        def big():
            before = libc.mallinfo2()
            a = np.ones(64 << 20, np.uint8)
            during = libc.mallinfo2()
            del a
            return during.hblkhd - before.hblkhd, libc.mallinfo2().arena - before.arena
        print(repr((big(), tgd.keep_freed_memory(), big())))
    """)
    try:
        # glibc's defaults in the child (distributed may leave its worker settings in this
        # process's environment)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             check=True, env=env).stdout
    except subprocess.CalledProcessError as err:
        if "mallinfo2" in err.stderr:   # glibc before 2.33: nothing to read the counters with
            pytest.skip("no mallinfo2")
        raise
    (mapped_before, _), kept, (mapped_after, heap_after) = ast.literal_eval(out.strip())
    assert mapped_before >= 64 << 20 and kept is True
    assert mapped_after == 0 and heap_after >= 32 << 20   # (the heap had some free room already)


def test_keep_freed_memory_runs_on_every_worker(client):
    import platform
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc malloc only")
    done = tgd.keep_freed_memory(client)
    assert sorted(done) == sorted(client.scheduler_info()["workers"]) and all(done.values()), done


def test_local_cluster_equals_single_process(client):
    names = ["csr", "triangular", "segments", "dense-rect"]
    problems = [_problem(n) for n in names]
    lazy = [_lazy(g, c) for g, _, c in problems]
    computed = client.compute([(o, s.m, s.l, s.lse, *gr) for o, s, gr in lazy], sync=True)
    for got, (_, expected, _) in zip(computed, problems):
        _check(got, expected, 1e-12)


def test_local_cluster_alibi_reads_the_uploaded_source_ids(client, monkeypatch):
    """ALiBi over CSR partitions on worker processes: the halos' source ids are uploaded once
    per plan, like the relations, and the results are the single-process call's."""
    monkeypatch.setattr(tgd, "UPLOAD_MIN_BYTES", 0)   # this small graph's relations uploaded too
    from distributed import futures_of
    g, expected, c = _modified_problem("csr", MODS["softcap+alibi"], seed=8)
    out, stats = tgd.attention(c["q"], c["k"], c["v"], g, return_stats=True, **MODS["softcap+alibi"])
    grads = tgd.attention_backward(c["dout"], c["q"], c["k"], c["v"], out, stats, g,
                                   **MODS["softcap+alibi"])
    ids = {f.key for a in (out, *grads) for f in futures_of(a)
           if str(f.key).startswith("tiga-attention-source-ids-")}
    assert len(ids) == len(c["q"].chunks[0])
    _check(client.compute((out, stats.m, stats.l, stats.lse, *grads), sync=True), expected, 1e-12)


def test_local_cluster_program_vjp(client):
    """A program sent to worker processes (without its caches) over CSR partitions, whose
    positions come from the uploaded halo source ids."""
    for name in ("csr",):
        prog, g, params, (out, grads), c = _program_problem(name, "modified", seed=9)
        lout, vjp = tgd.program_vjp(prog, g, src=c["src"], dst=c["dst"], **params)
        _check_program(*client.compute((lout, vjp(c["dout"])), sync=True), out, grads)


def test_local_cluster_layer_vjp(client, monkeypatch):
    """A layer (with its parameters, without the host edge set) on worker processes; the
    partitions' loop marks are uploaded once per plan."""
    monkeypatch.setattr(tgd, "UPLOAD_MIN_BYTES", 0)   # this small graph's relations uploaded too
    from distributed import futures_of
    conv, g, (out, ref), c = _layer_problem("gat-bipartite")
    lout, vjp = tgd.layer_vjp(conv, c["x"], g, c["edge_attr"])
    grads = vjp(c["dout"])
    loops = {f.key for f in futures_of(lout) if str(f.key).startswith("tiga-attention-loops-")}
    assert len(loops) == len(c["x"][1].chunks[0])
    got_out, got = client.compute((lout, grads), sync=True)
    _check_layer(got_out, got, out, ref, 1e-12)


def test_local_cluster_uploads_csr_relations_once(client, monkeypatch):
    """With a distributed Client as the default scheduler the CSR tasks refer to relations
    submitted once per graph and chunking: every call holds the same futures."""
    monkeypatch.setattr(tgd, "UPLOAD_MIN_BYTES", 0)   # this small graph's relations uploaded too
    from distributed import futures_of
    g, expected, c = _problem("csr", seed=6)

    def relation_keys(*arrays):
        return sorted({f.key for a in arrays for f in futures_of(a)
                       if str(f.key).startswith("tiga-attention-relation-")})

    out, stats, grads = _lazy(g, c)
    first = relation_keys(out)
    assert len(first) == len(c["q"].chunks[0])
    assert relation_keys(*grads) == first
    again, _ = tgd.attention(c["q"], c["k"], c["v"], g, return_stats=True)
    assert relation_keys(again) == first
    got = client.compute((out, stats.m, stats.l, stats.lse, *grads), sync=True)
    _check(got, expected, 1e-12)
    np.testing.assert_array_equal(client.compute(again, sync=True), got[0])


def test_local_cluster_small_relations_travel_in_the_graph(client):
    """Below UPLOAD_MIN_BYTES the relations travel inside the call's dask graph, even with a
    distributed Client as the default scheduler: no futures, and another scheduler can compute
    the arrays (a larger graph's uploaded relations tie its arrays to the client)."""
    from distributed import futures_of
    g, expected, c = _problem("csr", seed=6)
    assert tgd._relation_bytes(tgd._plan(g, c["q"], c["k"])) < tgd.UPLOAD_MIN_BYTES
    out, stats, grads = _lazy(g, c)
    assert not [f for a in (out, *grads) for f in futures_of(a)]
    _check(dask.compute(out, stats.m, stats.l, stats.lse, *grads, scheduler="threads"), expected, 1e-12)
    _check(client.compute((out, stats.m, stats.l, stats.lse, *grads), sync=True), expected, 1e-12)


def test_local_cluster_upload_is_not_reported_as_a_large_graph(client, monkeypatch):
    """The relations are uploaded once per plan as futures, which is what distributed's "large
    graph" warning advises: building a call (where they are submitted) warns of nothing, even
    with the warning's threshold at one byte."""
    monkeypatch.setattr(tgd, "UPLOAD_MIN_BYTES", 0)   # this small graph's relations uploaded too
    import warnings
    g, _, c = _problem("csr", seed=9)
    with dask.config.set({"distributed.admin.large-graph-warning-threshold": "1B"}), \
            warnings.catch_warnings():
        warnings.simplefilter("error")
        out = tgd.attention(c["q"], c["k"], c["v"], g)
    assert out.shape == c["q"].shape[:2] + c["v"].shape[2:]


@pytest.mark.parametrize("fuse", [None, False], ids=["default-config", "fusion-off"])
@pytest.mark.parametrize("name", ["triangular", "csr"])
def test_local_cluster_runs_a_query_chunks_tasks_where_it_is_held(client, name, fuse):
    """With inputs held by the workers, a query chunk's tasks run on the worker holding that chunk
    (annotations, which the returned arrays keep through their own graph optimisation with
    dask's default config, where low-level fusion would drop them): implicit relations, the
    forward merge and the backward blocks (dK / dV sums where the key chunk is); CSR, the
    partition's forward task. Results unchanged."""
    from dask.base import collections_to_expr
    import distributed
    g, expected, c = _problem(name, seed=8)
    addrs = sorted(client.scheduler_info()["workers"])
    owner = [0, 1, 1, 0, 0]   # q / dout / k / v chunk i on this worker (zigzag)
    placed = {}
    for arr in ("q", "k", "v", "dout"):
        x = c[arr].compute()
        rows = c[arr].chunks[0]
        parts, s0 = [], 0
        for i, n in enumerate(rows):
            fut = client.scatter(x[s0:s0 + n], workers=[addrs[owner[i]]])
            parts.append(da.from_delayed(fut, x[s0:s0 + n].shape, dtype=x.dtype))
            s0 += n
        placed[arr] = client.persist(da.concatenate(parts))
    distributed.wait(list(placed.values()))
    with dask.config.set({"optimization.fuse.active": fuse}), distributed.get_task_stream(client) as ts:
        out, stats = tgd.attention(placed["q"], placed["k"], placed["v"], g, return_stats=True)
        hints = collections_to_expr(out).__dask_annotations__().get("workers", {})
        assert any(str(key[0]).startswith("tiga-attention-tasks-") for key in hints), hints
        out, m, l = client.persist([out, stats.m, stats.l])
        distributed.wait([out, m, l])
        stats = tgd.DaskAttentionStats(m, l)
        grads = client.persist(list(tgd.attention_backward(placed["dout"], placed["q"], placed["k"], placed["v"],
                                                           out, stats, g)))
        distributed.wait(grads)
    fwd_merge, bwd_blocks = {}, {}
    for rec in ts.data:
        key = rec["key"]
        if not (isinstance(key, tuple) and len(key) > 2):
            continue
        w = addrs.index(rec["worker"])
        fwd_tag, bwd_tag = ("merge", "block") if name == "triangular" else ("forward", "backward")
        if str(key[0]).startswith("tiga-attention-tasks-") and key[1] == fwd_tag:
            fwd_merge[key[2]] = w
        elif str(key[0]).startswith("tiga-attention-backward-tasks-") and key[1] == bwd_tag:
            bwd_blocks[key[2:]] = w
    if name == "csr":   # one forward task per partition; the backward's run where dask puts them
        # (unpinned, so with the default config dask may fuse one into the task that reads it)
        assert len(fwd_merge) == len(c["q"].chunks[0])
        assert len(bwd_blocks) == len(c["q"].chunks[0]) or fuse is None
    else:   # (a query chunk with a single block has no merge task)
        assert fwd_merge and len(bwd_blocks) == 10
        assert all(w == owner[key[0]] for key, w in bwd_blocks.items()), bwd_blocks
    assert all(w == owner[p] for p, w in fwd_merge.items()), fwd_merge
    got = client.compute((out, stats.m, stats.l, stats.lse, *grads), sync=True)
    _check(got, expected, 1e-12)


def test_a_worker_lost_mid_run_is_recomputed(client, tmp_path):
    g, expected, c = _problem("csr", seed=4)
    marker = str(tmp_path / "killed")

    def kill_worker_once(block, block_info=None):
        # the first task to get here takes down its worker process (with the forward results it
        # holds); dask reschedules everything lost on the other, and the restarted, worker
        if block_info[0]["chunk-location"][0] == 1:
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
                os._exit(1)
            except FileExistsError:
                pass
        return block

    out, stats = tgd.attention(c["q"], c["k"], c["v"], g, return_stats=True)
    passed_on = out.map_blocks(kill_worker_once, dtype=out.dtype)
    grads = tgd.attention_backward(c["dout"], c["q"], c["k"], c["v"], passed_on, stats, g)
    got = client.compute((passed_on, stats.m, stats.l, stats.lse, *grads), sync=True)
    assert os.path.exists(marker)
    _check(got, expected, 1e-12)


# --------------------------------------------------------------------------- errors
def test_errors_name_the_argument():
    g, _, c = _problem("csr")
    q, k, v, dout = c["q"], c["k"], c["v"], c["dout"]
    with pytest.raises(ValueError, match=r"^q is chunked along axis 1"):
        tgd.attention(q.rechunk((13, 2, -1)), k, v, g)
    with pytest.raises(ValueError, match=r"^k is chunked along axis 2"):
        tgd.attention(q, k.rechunk((11, -1, 4)), v, g)
    with pytest.raises(ValueError, match=r"^v is chunked"):
        tgd.attention(q, k, v.rechunk((7, -1, -1)), g)
    with pytest.raises(ValueError, match=r"num_dst=60 but q has 59 rows"):
        tgd.attention(q[:59], k, v, g)
    with pytest.raises(ValueError, match=r"num_src=50 but k has 49 rows"):
        tgd.attention(q, k[:49], v[:49], g)
    with pytest.raises(ValueError, match=r"num_src=50 but v has 49 rows"):   # not a chunking error
        tgd.attention(q, k, v[:49], g)
    with pytest.raises(TypeError, match=r"^k must be a dask array"):
        tgd.attention(q, np.zeros(k.shape), v, g)
    with pytest.raises(TypeError, match=r"graph must be a tiga_numba.Graph"):
        tgd.attention(q, k, v, g.to_scipy())
    with pytest.raises(ValueError, match=r"heads"):
        tgd.attention(q[:, :3], k, v, g)
    with pytest.raises(ValueError, match=r"scale must be finite"):   # at the call, not in a task
        tgd.attention(q, k, v, g, scale=float("nan"))
    with pytest.raises(TypeError, match=r"scale must be a real number"):
        tgd.attention(q, k, v, g, scale="x")
    out, stats = tgd.attention(q, k, v, g, return_stats=True)
    with pytest.raises(ValueError, match=r"^dout is chunked \(20, 20, 20\)"):
        tgd.attention_backward(dout.rechunk((20, -1, -1)), q, k, v, out, stats, g)
    with pytest.raises(ValueError, match=r"^stats.m is chunked"):
        tgd.attention_backward(dout, q, k, v, out, tgd.DaskAttentionStats(stats.m.rechunk(30), stats.l), g)
    with pytest.raises(ValueError, match=r"^out is chunked along axis 2"):
        tgd.attention_backward(dout, q, k, v, out.rechunk((13, -1, 5)), stats, g)
    with pytest.raises(ValueError, match=rf"^dout must have shape \({q.shape[0]}, {q.shape[1]}, {v.shape[2]}\), got"):
        tgd.attention_backward(dout[..., :5], q, k, v, out, stats, g)
    with pytest.raises(ValueError, match=rf"^stats.l must have shape \({q.shape[0]}, {q.shape[1]}\), got"):
        tgd.attention_backward(dout, q, k, v, out, tgd.DaskAttentionStats(stats.m, stats.l[:, :1]), g)

    class Chunk:   # an array-like that is neither numpy nor cupy
        def __init__(self, a):
            self.a, self.shape, self.ndim, self.dtype = a, a.shape, a.ndim, a.dtype

        def __getitem__(self, index):
            return Chunk(self.a[index])
    foreign = q.map_blocks(Chunk, meta=Chunk(np.empty((0, 0, 0), q.dtype)))
    with pytest.raises(TypeError, match=r"^q must have numpy or cupy chunks"):
        tgd.attention(foreign, k, v, g)
    with pytest.raises(TypeError, match=r"^stats must be"):
        tgd.attention_backward(dout, q, k, v, out, (stats.m, stats.l), g)


def test_backward_refuses_stats_of_another_forward():
    """As the single-process backward: stats of a forward with another scale, soft-cap, slopes or
    relation are a ValueError naming stats; the same relation built again, or stats made by hand
    (no forward), pass."""
    g, _, c = _problem("csr")
    q, k, v, dout = c["q"], c["k"], c["v"], c["dout"]
    out, stats = tgd.attention(q, k, v, g, scale=0.3, return_stats=True)
    with pytest.raises(ValueError, match=r"^stats belong to a forward with scale=0.3, but this backward has scale="):
        tgd.attention_backward(dout, q, k, v, out, stats, g)
    with pytest.raises(ValueError, match=r"^stats belong to a forward whose score read other values: softcap is absent"):
        tgd.attention_backward(dout, q, k, v, out, stats, g, scale=0.3, softcap=5.0)
    with pytest.raises(ValueError, match=r"^stats belong to a forward over another graph than this backward's: num_edges"):
        tgd.attention_backward(dout, q, k, v, out, stats, tg.Graph.dense(g.num_src, g.num_dst), scale=0.3)
    s = g.to_scipy().tocoo()
    again = tg.Graph.from_coo(s.col, s.row, g.num_src, g.num_dst)
    # the default scheduler: in this module a dask.distributed client may be it (the `client`
    # fixture), and a CSR graph built under it is computed by it (docs/dask.md)
    want = dask.compute(*tgd.attention_backward(dout, q, k, v, out, stats, g, scale=0.3))
    for other, st in ((again, stats), (g, tgd.DaskAttentionStats(stats.m, stats.l))):
        got = dask.compute(*tgd.attention_backward(dout, q, k, v, out, st, other, scale=0.3))
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    hs = np.ones(q.shape[1])
    out2, stats2 = tgd.attention(q, k, v, g, softcap=4.0, alibi_slopes=hs, return_stats=True)
    with pytest.raises(ValueError, match=r"^stats belong to a forward whose score read other values: alibi_slopes"):
        tgd.attention_backward(dout, q, k, v, out2, stats2, g, softcap=4.0, alibi_slopes=2 * hs)
    with pytest.raises(ValueError, match=r"^stats belong to a forward whose score read other values: softcap = 4.0"):
        tgd.attention_backward(dout, q, k, v, out2, stats2, g, softcap=3.0, alibi_slopes=hs)
    tgd.attention_backward(dout, q, k, v, out2, stats2, g, softcap=4.0, alibi_slopes=hs)
    # the single-process rules: NaN slopes match NaN; a bad scale is the scale's own error;
    # head dim 0 takes scale 1
    nan_slopes = np.array([np.nan] + [0.5] * (q.shape[1] - 1))
    out3, stats3 = tgd.attention(q, k, v, g, alibi_slopes=nan_slopes, return_stats=True)
    tgd.attention_backward(dout, q, k, v, out3, stats3, g, alibi_slopes=nan_slopes.copy())
    with pytest.raises(TypeError, match=r"^scale must be a real number"):
        tgd.attention_backward(dout, q, k, v, out, stats, g, scale="x")
    with pytest.raises(ValueError, match=r"^scale must be finite"):
        tgd.attention_backward(dout, q, k, v, out, stats, g, scale=float("nan"))
    q0, k0 = q[..., :0], k[..., :0]
    out0, stats0 = tgd.attention(q0, k0, v, g, return_stats=True)
    tgd.attention_backward(dout, q0, k0, v, out0, stats0, g)


def test_importing_the_package_does_not_import_dask():
    import subprocess
    import sys
    code = "import sys, tiga_numba; assert 'dask' not in sys.modules, 'dask imported'"
    subprocess.run([sys.executable, "-c", code], check=True)



def test_result_buffers_stay_under_a_quarter_of_a_workers_memory_limit(monkeypatch):
    """in a dask.distributed worker with a memory limit the result pool keeps at most a quarter
    of it (the kept buffers are the worker's unmanaged memory); elsewhere RESULT_BUFFER_BYTES"""
    import types
    import distributed
    assert tgd._result_buffer_limit() == tgd.RESULT_BUFFER_BYTES   # not in a worker
    for memory_limit, want in ((8 << 30, 2 << 30), (64 << 30, tgd.RESULT_BUFFER_BYTES), (0, tgd.RESULT_BUFFER_BYTES),
                               (None, tgd.RESULT_BUFFER_BYTES)):
        fake = types.SimpleNamespace(memory_manager=types.SimpleNamespace(memory_limit=memory_limit))
        monkeypatch.setattr(distributed, "get_worker", lambda: fake)
        assert tgd._result_buffer_limit() == want, memory_limit
