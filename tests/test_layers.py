"""tiga_numba.layers: GATConv, GATv2Conv, TransformerConv against PyG's layers (same weights,
outputs and every gradient) and against float64 oracles; the per-head edge-score attention
they are built on against a float64 softmax oracle."""
import zlib

import numpy as np
import pytest

import tiga_numba as tg
from tiga_numba.layers import GATConv, GATv2Conv, TransformerConv
from tiga_numba.layers._edges import edge_set
from tiga_numba.layers.gat import edge_attention

LAYERS = {"GATConv": GATConv, "GATv2Conv": GATv2Conv, "TransformerConv": TransformerConv}


def random_edges(rng, num_src, num_dst, num_edges, self_loops=4, isolated=3):
    """Random (src, dst) with a hub destination, some existing self loops, duplicate edges and
    `isolated` destinations that receive no edge."""
    dst = rng.integers(0, num_dst - isolated, num_edges)
    dst[: num_edges // 5] = 1  # a hub row
    src = rng.integers(0, num_src, num_edges)
    n = min(self_loops, num_src, num_dst - isolated)
    src[-n:] = dst[-n:]  # self loops (i -> i)
    src[-n - 2], dst[-n - 2] = src[-n - 1], dst[-n - 1]  # a duplicate edge
    return src, dst


# --------------------------------------------------------------------------- edge-score oracle
def softmax_oracle(score, values, rows, cols, num_dst, dout):
    """float64 per-head softmax over each destination's edges; (out, dvalues, dscore)."""
    score, values, dout = (np.asarray(a, np.float64) for a in (score, values, dout))
    E, H = score.shape
    out = np.zeros((num_dst, H, values.shape[2]))
    dvalues = np.zeros_like(values)
    dscore = np.zeros_like(score)
    for i in range(num_dst):
        e = np.nonzero(rows == i)[0]
        if e.size == 0:
            continue
        s = score[e]
        p = np.exp(s - s.max(0))
        p /= p.sum(0)
        out[i] = np.einsum("eh,ehc->hc", p, values[cols[e]])
        dp = np.einsum("hc,ehc->eh", dout[i], values[cols[e]])
        dscore[e] = p * (dp - (dout[i] * out[i]).sum(-1))
        np.add.at(dvalues, cols[e], p[:, :, None] * dout[i][None])
    return out, dvalues, dscore


@pytest.mark.parametrize("heads", [1, 3])
def test_per_head_edge_scores_match_float64_oracle(heads):
    rng = np.random.default_rng(heads)
    ns, nd = 23, 17
    src, dst = random_edges(rng, ns, nd, 90)
    g = tg.Graph.from_coo(src, dst, ns, nd)
    es = edge_set(g, False, np)
    score = rng.normal(size=(g.num_edges, heads)).astype(np.float32) * 3
    values = rng.normal(size=(ns, heads, 5)).astype(np.float32)
    dout = rng.normal(size=(nd, heads, 5)).astype(np.float32)
    out, backward = edge_attention(values, score, es)
    dv, ds = backward(dout)
    ref_out, ref_dv, ref_ds = softmax_oracle(score, values, es.rows, es.cols, nd, dout)
    np.testing.assert_allclose(out, ref_out, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(dv, ref_dv, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(ds, ref_ds, rtol=2e-5, atol=2e-6)
    assert np.all(out[nd - 3:] == 0)  # destinations without edges


def test_self_loop_rule_and_edge_order():
    """PyG's rule: existing loops dropped, one loop per node i < min(num_src, num_dst), the
    edge map back to the caller's (COO) order, 'mean' fill of the loop's attribute."""
    src = np.array([2, 0, 1, 1, 3, 0])
    dst = np.array([0, 1, 1, 2, 0, 0])
    g = tg.Graph.from_coo(src, dst, 4, 3)
    es = edge_set(g, True, np)
    pairs = sorted(zip(es.rows.tolist(), es.cols.tolist(), es.source.tolist()))
    assert pairs == [(0, 0, -1), (0, 2, 0), (0, 3, 4), (1, 0, 1), (1, 1, -1), (2, 1, 3), (2, 2, -1)]
    ea = np.arange(12, dtype=np.float64).reshape(6, 2)
    got = es.edge_attr(ea, "mean")
    for k, (r, c, s) in enumerate(zip(es.rows, es.cols, es.source)):
        if s >= 0:
            np.testing.assert_array_equal(got[k], ea[s])
    loops = {int(r): got[k] for k, (r, s) in enumerate(zip(es.rows, es.source)) if s < 0}
    np.testing.assert_allclose(loops[0], (ea[0] + ea[4]) / 2)   # mean of the kept edges into 0
    np.testing.assert_allclose(loops[1], ea[1])                   # (1 -> 1) itself was dropped
    np.testing.assert_allclose(loops[2], ea[3])


# --------------------------------------------------------------------------- float64 oracles
def _numeric_grad(f, x, eps=1e-6):
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        idx = it.multi_index
        old = x[idx]
        x[idx] = old + eps
        fp = f()
        x[idx] = old - eps
        fm = f()
        x[idx] = old
        g[idx] = (fp - fm) / (2 * eps)
    return g


@pytest.mark.parametrize("name,kwargs", [
    ("GATConv", dict(heads=2, edge_dim=2)),
    ("GATv2Conv", dict(heads=2, edge_dim=2, concat=False)),
    ("TransformerConv", dict(heads=2, edge_dim=2, beta=True)),
])
def test_gradients_match_finite_differences_float64(name, kwargs):
    """Every gradient (x, edge_attr, each parameter) against central differences in float64
    (runs without torch)."""
    rng = np.random.default_rng(7)
    n, f = 7, 3
    src, dst = random_edges(rng, n, n, 16, self_loops=2, isolated=1)
    g = tg.Graph.from_coo(src, dst, n, n)
    layer = LAYERS[name](f, 2, dtype=np.float64, seed=3, **kwargs)
    x = rng.normal(size=(n, f))
    ea = rng.normal(size=(g.num_edges, 2))
    w = rng.normal(size=layer(x, g, ea).shape)
    loss = lambda: float((layer(x, g, ea) * w).sum())  # noqa: E731
    _, vjp = layer.vjp(x, g, ea)
    grads = vjp(w)
    np.testing.assert_allclose(grads["x"], _numeric_grad(loss, x), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grads["edge_attr"], _numeric_grad(loss, ea), rtol=1e-5, atol=1e-7)
    for pname, p in layer.state_dict().items():
        np.testing.assert_allclose(grads["params"][pname], _numeric_grad(loss, p), rtol=1e-5,
                                   atol=1e-7, err_msg=pname)


# --------------------------------------------------------------------------- against PyG
CASES = [
    # (layer, kwargs, bipartite)
    ("GATConv", dict(heads=4, concat=True), False),
    ("GATConv", dict(heads=3, concat=False, edge_dim=3), False),
    ("GATConv", dict(heads=2, edge_dim=2, fill_value="add", residual=True), False),
    ("GATConv", dict(heads=2, add_self_loops=False, edge_dim=2), True),
    ("GATConv", dict(heads=2, edge_dim=2), True),                 # loops on min(Ns, Nd) nodes
    ("GATConv", dict(heads=2, negative_slope=0.1, bias=False, fill_value=0.5, edge_dim=1), False),
    ("GATConv", dict(heads=2, negative_slope=-0.3), False),      # sign-flipping slope
    ("GATConv", dict(heads=2, negative_slope=1.5, edge_dim=2), False),
    ("GATv2Conv", dict(heads=3), False),
    ("GATv2Conv", dict(heads=2, concat=False, edge_dim=3, share_weights=True), False),
    ("GATv2Conv", dict(heads=2, edge_dim=2, residual=True, add_self_loops=False), True),
    ("TransformerConv", dict(heads=3), False),
    ("TransformerConv", dict(heads=2, concat=False, edge_dim=3, beta=True), False),
    ("TransformerConv", dict(heads=2, edge_dim=2, root_weight=False, bias=False), True),
    ("TransformerConv", dict(heads=2, edge_dim=2, beta=True), True),
]


def _seed(*case):
    """A seed of its own for each case, the same in every process (str hashes are salted)."""
    return zlib.crc32(repr(case).encode())


@pytest.mark.parametrize("name,kwargs,bipartite", CASES)
def test_matches_pyg(name, kwargs, bipartite):
    torch = pytest.importorskip("torch")
    pyg_nn = pytest.importorskip("torch_geometric.nn")
    rng = np.random.default_rng(_seed(name, kwargs, bipartite))
    torch.manual_seed(int(rng.integers(1 << 30)))
    ns, nd = (29, 21) if bipartite else (25, 25)
    fs, fd = (6, 4) if bipartite else (5, 5)
    src, dst = random_edges(rng, ns, nd, 110)
    graph = tg.Graph.from_coo(src, dst, ns, nd)
    edge_index = torch.from_numpy(np.stack([src, dst]))
    in_ch = (fs, fd) if bipartite else fs
    pyg = getattr(pyg_nn, name)(in_ch, 4, **kwargs)
    ours = LAYERS[name](in_ch, 4, **kwargs)
    assert list(ours.state_dict()) == list(pyg.state_dict())
    ours.load_state_dict({k: v.detach().numpy() for k, v in pyg.state_dict().items()})
    xs = torch.randn(ns, fs, requires_grad=True)
    xd = torch.randn(nd, fd, requires_grad=True) if bipartite else None
    ed = kwargs.get("edge_dim")
    ea = torch.randn(len(src), ed, requires_grad=True) if ed else None
    x_t = (xs, xd) if bipartite else xs
    out_t = pyg(x_t, edge_index, ea)
    dout = torch.randn_like(out_t)
    out_t.backward(dout)
    x_n = (xs.detach().numpy(), xd.detach().numpy()) if bipartite else xs.detach().numpy()
    out, vjp = ours.vjp(x_n, graph, None if ea is None else ea.detach().numpy())
    grads = vjp(dout.numpy())
    tol = dict(rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(out, out_t.detach().numpy(), **tol)
    if bipartite:
        np.testing.assert_allclose(grads["x"][0], xs.grad.numpy(), **tol)
        np.testing.assert_allclose(grads["x"][1], xd.grad.numpy(), **tol)
    else:
        np.testing.assert_allclose(grads["x"], xs.grad.numpy(), **tol)
    if ea is not None:
        np.testing.assert_allclose(grads["edge_attr"], ea.grad.numpy(), **tol)
    else:
        assert grads["edge_attr"] is None
    named = dict(pyg.named_parameters())
    for pname in pyg.state_dict():
        p = named.get(pname)
        if p is None:  # a shared parameter listed under a second name (share_weights)
            p = named[pname.replace("lin_r", "lin_l")]
        want = p.grad.numpy() if p.grad is not None else np.zeros(tuple(p.shape), np.float32)
        np.testing.assert_allclose(grads["params"][pname], want, err_msg=pname, **tol)
    assert np.setdiff1d(np.arange(nd), dst).size > 0  # the graph has isolated destinations


@pytest.mark.parametrize("name,kwargs,bipartite", CASES)
def test_attention_weights_match_pyg(name, kwargs, bipartite):
    """return_attention_weights=True gives PyG's (out, (edge_index, alpha)): the same edge_index,
    edge for edge (the caller's edges, removed self loops left out, added loops last), and the
    same weights, on a graph with existing self loops, a duplicate edge and isolated nodes; in
    the layer's dtype (float16: computed in float32)."""
    torch = pytest.importorskip("torch")
    pyg_nn = pytest.importorskip("torch_geometric.nn")
    rng = np.random.default_rng(_seed("weights", name, kwargs, bipartite))
    torch.manual_seed(int(rng.integers(1 << 30)))
    ns, nd = (29, 21) if bipartite else (25, 25)
    fs, fd = (6, 4) if bipartite else (5, 5)
    src, dst = random_edges(rng, ns, nd, 110)
    graph = tg.Graph.from_coo(src, dst, ns, nd)
    in_ch = (fs, fd) if bipartite else fs
    pyg = getattr(pyg_nn, name)(in_ch, 4, **kwargs).double().eval()
    xs, xd = torch.randn(ns, fs, dtype=torch.float64), torch.randn(nd, fd, dtype=torch.float64)
    ed = kwargs.get("edge_dim")
    ea = torch.randn(len(src), ed, dtype=torch.float64) if ed else None
    x_t = (xs, xd) if bipartite else xs
    with torch.no_grad():
        out_t, (ei_t, alpha_t) = pyg(x_t, torch.from_numpy(np.stack([src, dst])), ea,
                                     return_attention_weights=True)
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 1e-5), (np.float16, 3e-3)):
        ours = LAYERS[name](in_ch, 4, dtype=dtype, **kwargs)
        ours.load_state_dict({k: v.numpy() for k, v in pyg.state_dict().items()})
        ours.eval()
        x_n = (xs.numpy().astype(dtype), xd.numpy().astype(dtype)) if bipartite else xs.numpy().astype(dtype)
        got = ours(x_n, graph, None if ea is None else ea.numpy().astype(dtype), return_attention_weights=True)
        out, (edge_index, alpha) = got
        assert edge_index.dtype == np.int64 and np.array_equal(edge_index, ei_t.numpy())
        assert alpha.dtype == dtype and out.dtype == dtype and alpha.shape == tuple(alpha_t.shape)
        np.testing.assert_allclose(alpha.astype(np.float64), alpha_t.numpy(), rtol=0, atol=tol)
        np.testing.assert_array_equal(out, ours(x_n, graph, None if ea is None else ea.numpy().astype(dtype)))


@pytest.mark.parametrize("name", list(LAYERS))
def test_attention_weights_of_an_empty_edge_set(name):
    """No edges (no loops added) and a bipartite graph without destinations: PyG's shapes, (2, 0)
    int64 edge_index and (0, H) weights, next to the plain call's output."""
    e = np.zeros(0, np.int64)
    x = np.random.default_rng(0).standard_normal((6, 5)).astype(np.float32)
    kw = {} if name == "TransformerConv" else dict(add_self_loops=False)
    layer = LAYERS[name](5, 3, heads=2, **kw).eval()
    g = tg.Graph.from_coo(e, e, 6, 6)
    out, (edge_index, alpha) = layer(x, g, return_attention_weights=True)
    np.testing.assert_array_equal(out, layer(x, g))
    assert edge_index.shape == (2, 0) and edge_index.dtype == np.int64
    assert alpha.shape == (0, 2) and alpha.dtype == np.float32
    layer = LAYERS[name]((5, 5), 3, heads=2).eval()
    out, (edge_index, alpha) = layer((x, np.zeros((0, 5), np.float32)), tg.Graph.from_coo(e, e, 6, 0),
                                     return_attention_weights=True)
    assert out.shape == (0, 6) and edge_index.shape == (2, 0) and alpha.shape == (0, 2)


def test_torch_layer_returns_attention_weights_without_autograd():
    """tiga_numba.torch's layers take PyG's return_attention_weights=True under torch.no_grad()
    (the weights carry no gradient here) and refuse it where autograd would need one."""
    torch = pytest.importorskip("torch")
    pyg_nn = pytest.importorskip("torch_geometric.nn")
    import tiga_numba.torch as tgt
    rng = np.random.default_rng(3)
    src, dst = random_edges(rng, 20, 20, 70)
    edge_index = torch.from_numpy(np.stack([src, dst]))
    torch.manual_seed(0)
    pyg = pyg_nn.GATConv(5, 3, heads=2).eval()
    ours = tgt.GATConv(5, 3, heads=2)
    ours.load_state_dict(pyg.state_dict())
    ours.eval()
    x = torch.randn(20, 5)
    with torch.no_grad():
        want = pyg(x, edge_index, return_attention_weights=True)
        got = ours(x, edge_index, return_attention_weights=True)
    assert torch.equal(got[1][0], want[1][0])
    torch.testing.assert_close(got[1][1], want[1][1], rtol=0, atol=1e-6)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)
    with pytest.raises(NotImplementedError, match="no gradient flows through the attention weights"):
        ours(x.requires_grad_(), edge_index, return_attention_weights=True)


@pytest.mark.parametrize("name", list(LAYERS))
def test_float64_pyg_state_dict_loads_as_float64(name):
    """A float64 PyG layer's state dict, with weights that float32 cannot hold, loads as
    float64: state_dict() gives back the same arrays' values and dtype, and out, dx and every
    parameter gradient agree with PyG's float64 autograd to float64 rounding."""
    torch = pytest.importorskip("torch")
    pyg_nn = pytest.importorskip("torch_geometric.nn")
    rng = np.random.default_rng(9)
    n, f = 17, 5
    src, dst = random_edges(rng, n, n, 60)
    pyg = getattr(pyg_nn, name)(f, 3, heads=2).double()
    with torch.no_grad():   # float64 values, not float32 ones widened
        for p in pyg.parameters():
            p.copy_(torch.from_numpy(rng.normal(size=tuple(p.shape))))
    sd = {k: v.detach().numpy().copy() for k, v in pyg.state_dict().items()}
    ours = LAYERS[name](f, 3, heads=2)
    ours.load_state_dict(sd)
    # the widest dtype wins: a float64 layer given float32 arrays stays float64 (exact values)
    wide = LAYERS[name](f, 3, heads=2, dtype=np.float64)
    wide.load_state_dict({k: v.astype(np.float32) for k, v in sd.items()})
    assert wide.dtype == np.float64 and all(a.dtype == np.float64 for a in wide.state_dict().values())
    back = ours.state_dict()
    assert ours.dtype == np.float64
    for k, v in sd.items():
        assert back[k].dtype == np.float64 and np.array_equal(back[k], v), k
    x = torch.from_numpy(rng.normal(size=(n, f))).requires_grad_(True)
    out_t = pyg(x, torch.from_numpy(np.stack([src, dst])))
    dout = torch.from_numpy(rng.normal(size=tuple(out_t.shape)))
    out_t.backward(dout)
    out, vjp = ours.vjp(x.detach().numpy(), tg.Graph.from_coo(src, dst, n, n))
    grads = vjp(dout.numpy())
    tol = dict(rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out, out_t.detach().numpy(), **tol)
    np.testing.assert_allclose(grads["x"], x.grad.numpy(), **tol)
    for pname, p in pyg.named_parameters():
        assert grads["params"][pname].dtype == np.float64
        np.testing.assert_allclose(grads["params"][pname], p.grad.numpy(), err_msg=pname, **tol)


@pytest.mark.parametrize("name", ["GATConv", "GATv2Conv"])
def test_array_fill_value_matches_pyg(name):
    """PyG's Tensor fill_value: one value per edge feature for the added loops' edge_attr"""
    torch = pytest.importorskip("torch")
    pyg_nn = pytest.importorskip("torch_geometric.nn")
    rng = np.random.default_rng(31 + (name == "GATv2Conv"))
    n = 17
    src, dst = random_edges(rng, n, n, 60)
    fill = torch.tensor([0.5, -2.0, 1.25], dtype=torch.float64)
    pyg = getattr(pyg_nn, name)(5, 3, heads=2, edge_dim=3, fill_value=fill).double()
    ours = LAYERS[name](5, 3, heads=2, edge_dim=3, fill_value=fill, dtype=np.float64)
    ours.load_state_dict({k: v.detach().numpy() for k, v in pyg.state_dict().items()})
    x = torch.randn(n, 5, dtype=torch.float64, requires_grad=True)
    ea = torch.randn(len(src), 3, dtype=torch.float64, requires_grad=True)
    ref = pyg(x, torch.from_numpy(np.stack([src, dst])), ea)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    out, vjp = ours.vjp(x.detach().numpy(), tg.Graph.from_coo(src, dst, n, n), ea.detach().numpy())
    g = vjp(dout.numpy())
    np.testing.assert_allclose(out, ref.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(g["x"], x.grad.numpy(), rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(g["edge_attr"], ea.grad.numpy(), rtol=1e-9, atol=1e-11)
    # the same fill as numpy gives the same layer output; a constant fill differs from it
    ours_np = LAYERS[name](5, 3, heads=2, edge_dim=3, fill_value=fill.numpy(), dtype=np.float64)
    ours_np.load_state_dict(ours.state_dict())
    g1 = tg.Graph.from_coo(src, dst, n, n)
    np.testing.assert_array_equal(ours_np(x.detach().numpy(), g1, ea.detach().numpy()), out)
    ours_c = LAYERS[name](5, 3, heads=2, edge_dim=3, fill_value=0.5, dtype=np.float64)
    ours_c.load_state_dict(ours.state_dict())
    assert not np.allclose(ours_c(x.detach().numpy(), g1, ea.detach().numpy()), out)


@pytest.mark.parametrize("name", ["GATConv", "GATv2Conv"])
@pytest.mark.parametrize("fill_value", ["sum", "max", "min", "mul"])
def test_reduction_fill_values_match_pyg_with_ties_and_zeros(name, fill_value):
    """The self loops' attribute as PyG's scatter reduces the node's incoming attributes, and its
    gradient as torch differentiates that: attributes drawn from {-1, 0, 1, 2} so that maxima and
    minima tie (the gradient is shared), some are 0 (torch then counts the zero it starts from),
    and products hold zeros; float64 on both sides."""
    torch = pytest.importorskip("torch")
    pyg_nn = pytest.importorskip("torch_geometric.nn")
    rng = np.random.default_rng(["sum", "max", "min", "mul"].index(fill_value) + 10 * (name == "GATv2Conv"))
    torch.manual_seed(int(rng.integers(1 << 30)))
    n = 23
    src, dst = random_edges(rng, n, n, 90)
    pyg = getattr(pyg_nn, name)(5, 3, heads=2, edge_dim=3, fill_value=fill_value).double()
    ours = LAYERS[name](5, 3, heads=2, edge_dim=3, fill_value=fill_value, dtype=np.float64)
    ours.load_state_dict({k: v.detach().numpy() for k, v in pyg.state_dict().items()})
    x = torch.randn(n, 5, dtype=torch.float64, requires_grad=True)
    ea = torch.tensor(rng.integers(-1, 3, (len(src), 3)), dtype=torch.float64, requires_grad=True)
    out_t = pyg(x, torch.from_numpy(np.stack([src, dst])), ea)
    dout = torch.randn_like(out_t)
    out_t.backward(dout)
    out, vjp = ours.vjp(x.detach().numpy(), tg.Graph.from_edge_index(np.stack([src, dst]), n),
                        ea.detach().numpy())
    grads = vjp(dout.numpy())
    tol = dict(rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(out, out_t.detach().numpy(), **tol)
    np.testing.assert_allclose(grads["x"], x.grad.numpy(), **tol)
    np.testing.assert_allclose(grads["edge_attr"], ea.grad.numpy(), **tol)
    np.testing.assert_allclose(grads["params"]["lin_edge.weight"],
                               dict(pyg.named_parameters())["lin_edge.weight"].grad.numpy(), **tol)


def test_from_csr_graph_edge_attr_in_csr_order():
    """A graph without an edge permutation takes edge_attr in its own (CSR) order; the same
    edges through from_coo in another order give the same result with edge_attr permuted."""
    rng = np.random.default_rng(3)
    n = 12
    pairs = rng.choice(n * n, 40, replace=False)  # unique edges (scipy would merge duplicates)
    src, dst = pairs % n, pairs // n
    coo = tg.Graph.from_coo(src, dst, n, n)
    rel = coo.realize("cpu")
    csr = tg.Graph.from_csr(rel.indptr, rel.indices, num_src=n)  # coo's own CSR order
    order = coo.edge_permutation  # CSR edge e of coo (and of csr) is input edge order[e]
    ea = rng.normal(size=(len(src), 2)).astype(np.float32)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    for cls in (GATConv, GATv2Conv, TransformerConv):
        layer = cls(4, 3, heads=2, edge_dim=2, seed=1)
        a = layer(x, coo, ea)
        b = layer(x, csr, ea[order])
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        _, vjp = layer.vjp(x, csr, ea[order])
        _, vjp_coo = layer.vjp(x, coo, ea)
        w = np.ones_like(a)
        np.testing.assert_allclose(vjp(w)["edge_attr"], vjp_coo(w)["edge_attr"][order],
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", ["coo", "csr_unsorted", "csc"])
def test_from_scipy_edge_attr_is_the_matrix_data(fmt):
    """from_scipy reads edge_attr in the matrix's stored order: a matrix's data, given as
    edge_attr, lines up with its edges as the same edges listed for from_coo do."""
    import scipy.sparse as sp
    rng = np.random.default_rng(4)
    n = 11
    pairs = rng.choice(n * n, 35, replace=False)   # distinct edges, in no particular order
    src, dst = pairs % n, pairs // n
    ea = rng.normal(size=len(src))
    m = sp.coo_matrix((ea, (dst, src)), shape=(n, n))
    if fmt == "csr_unsorted":   # rows in order, columns within a row as listed (unsorted)
        order = np.lexsort((np.arange(len(src)), dst))
        indptr = np.concatenate([[0], np.cumsum(np.bincount(dst, minlength=n))])
        m = sp.csr_matrix((ea[order], src[order], indptr), shape=(n, n))
        assert not m.has_canonical_format
    elif fmt == "csc":
        m = m.tocsc()
    stored = m.tocoo()
    ref = tg.Graph.from_coo(stored.col, stored.row, n, n)
    g = tg.Graph.from_scipy(m)
    assert g.edge_permutation is not None
    x = rng.normal(size=(n, 4))
    for cls in (GATConv, TransformerConv):
        layer = cls(4, 3, heads=2, edge_dim=1, seed=2, dtype=np.float64)
        np.testing.assert_allclose(layer(x, g, m.data), layer(x, ref, stored.data), rtol=1e-12, atol=1e-13)


class PointerReadSparse:
    """scipy.sparse as cuSPARSE sees a cupyx.scipy.sparse matrix: cupyx keeps a strided view as
    the matrix's values and cuSPARSE reads them from the view's first element on as if they were
    contiguous. Running the numpy path with this in place of scipy.sparse shows, on the CPU,
    what the cupy path computes from the same calls."""

    @staticmethod
    def _as_read_from_pointer(a):
        a = np.asarray(a)
        owner = a
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        _, end = np.lib.array_utils.byte_bounds(owner)
        start = a.__array_interface__["data"][0]
        assert start + a.shape[0] * a.itemsize <= end  # the read stays inside the buffer
        return np.lib.stride_tricks.as_strided(a, shape=a.shape, strides=(a.itemsize,)).copy()

    @classmethod
    def csr_matrix(cls, arg, shape=None):
        import scipy.sparse as sp
        data, rest = arg[0], arg[1:]
        return sp.csr_matrix((cls._as_read_from_pointer(data), *rest), shape=shape)


@pytest.mark.parametrize("name,kwargs", [
    ("GATConv", dict(heads=3, edge_dim=2)),
    ("GATv2Conv", dict(heads=3, edge_dim=2)),
    ("TransformerConv", dict(heads=3, edge_dim=2, beta=True)),
    ("TransformerConv", dict(heads=2, edge_dim=3, concat=False, root_weight=False)),
])
def test_sparse_values_are_read_as_cusparse_reads_them(name, kwargs, monkeypatch):
    """The layers' sparse products give the same results when the sparse library reads a
    matrix's values from its pointer, as cuSPARSE does under cupyx: every per-head column of
    an (E, H) array goes in contiguous (a view alpha[:, h] would be read as
    alpha.flat[h:h + E], wrong for h > 0 and for h = 0 with H > 1)."""
    from tiga_numba.layers import _edges
    rng = np.random.default_rng(21)
    n = 30
    src, dst = random_edges(rng, n, n, 200)
    g = tg.Graph.from_coo(src, dst, n, n)
    layer = LAYERS[name](5, 4, seed=2, **kwargs)
    x = rng.normal(size=(n, 5)).astype(np.float32)
    ea = rng.normal(size=(len(src), kwargs["edge_dim"])).astype(np.float32)
    out, vjp = layer.vjp(x, g, ea)
    dout = rng.normal(size=out.shape).astype(np.float32)
    ref = vjp(dout)
    real = _edges.sparse_of
    monkeypatch.setattr(_edges, "sparse_of",
                        lambda xp: PointerReadSparse if xp is np else real(xp))
    out2, vjp2 = layer.vjp(x, g, ea)
    got = vjp2(dout)
    tol = dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out2, out, **tol)
    np.testing.assert_allclose(got["x"], ref["x"], **tol)
    np.testing.assert_allclose(got["edge_attr"], ref["edge_attr"], **tol)
    for k, v in ref["params"].items():
        np.testing.assert_allclose(got["params"][k], v, err_msg=k, **tol)


def test_isolated_nodes_without_self_loops_get_bias_only():
    rng = np.random.default_rng(5)
    n = 10
    src, dst = random_edges(rng, n, n, 30, self_loops=0, isolated=3)
    g = tg.Graph.from_coo(src, dst, n, n)
    layer = GATConv(4, 3, heads=2, add_self_loops=False, seed=0)
    layer.load_state_dict({**layer.state_dict(), "bias": np.arange(6, dtype=np.float32)})
    out = layer(rng.normal(size=(n, 4)).astype(np.float32), g)
    iso = np.setdiff1d(np.arange(n), dst)
    np.testing.assert_array_equal(out[iso], np.broadcast_to(np.arange(6, dtype=np.float32), (iso.size, 6)))


# --------------------------------------------------------------------------- errors
def test_errors_name_the_argument():
    g = tg.Graph.from_coo(np.array([0, 1]), np.array([1, 0]), 2, 2)
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="edge_attr"):
        GATConv(3, 2)(x, g, np.ones((2, 1), np.float32))
    with pytest.raises(ValueError, match="edge_attr"):
        GATConv(3, 2, edge_dim=2)(x, g, np.ones((3, 2), np.float32))
    with pytest.raises(ValueError, match="in_channels"):
        GATConv(4, 2)(x, g)
    with pytest.raises(ValueError, match="num_src"):
        GATConv(3, 2)(np.ones((3, 3), np.float32), g)
    with pytest.raises(TypeError, match="graph"):
        GATConv(3, 2)(x, np.array([[0, 1], [1, 0]]))
    with pytest.raises(NotImplementedError, match="dropout"):
        GATConv(3, 2, dropout=0.5)(x, g)
    GATConv(3, 2, dropout=0.5).eval()(x, g)  # inactive in eval mode, as in PyG
    with pytest.raises(ValueError, match="edge_attr is required"):
        TransformerConv(3, 2, edge_dim=2)(x, g)
    with pytest.raises(ValueError, match="missing"):
        GATConv(3, 2).load_state_dict({"bias": np.zeros(2)})
    with pytest.raises(ValueError, match="shape"):
        GATConv(3, 2).load_state_dict({**GATConv(3, 2).state_dict(), "bias": np.zeros(3)})
    with pytest.raises(ValueError, match="fill_value"):
        GATConv(3, 2, fill_value="median")
    with pytest.raises(TypeError, match="fill_value"):
        GATConv(3, 2, fill_value=None)
    with pytest.raises(ValueError, match="fill_value has 3 values, expected 1 or edge_dim=2"):
        GATConv(3, 2, edge_dim=2, fill_value=np.ones(3))
    with pytest.raises(ValueError, match="fill_value as an array"):
        GATConv(3, 2, edge_dim=2, fill_value=np.ones((2, 2)))
    for lazy in (-1, (-1, 3), (3, -1)):   # PyG's lazy sizes: valid there, not done here
        for layer in LAYERS.values():
            with pytest.raises(NotImplementedError, match="lazy sizes"):
                layer(lazy, 2)
    with pytest.raises(ValueError, match="in_channels must be a positive int, got -2"):
        GATConv(-2, 2)
    ea = np.ones((2, 1), np.float32)
    with pytest.raises(NotImplementedError, match="fill_value='any'"):
        GATConv(3, 2, edge_dim=1, fill_value="any")(x, g, ea)
    GATConv(3, 2, edge_dim=1, fill_value="any", add_self_loops=False)(x, g, ea)   # unused, as in PyG
    with pytest.raises(NotImplementedError, match="return_attention_weights"):
        TransformerConv(3, 2).vjp(x, g, return_attention_weights=True)
    np.testing.assert_array_equal(GATConv(3, 2, seed=1)(x, g, return_attention_weights=False),
                                  GATConv(3, 2, seed=1)(x, g))
    _, vjp = GATConv(3, 2).vjp(x, g)
    with pytest.raises(ValueError, match="dout"):
        vjp(np.ones((2, 3), np.float32))
    # integer, bool and complex edge features or dout would change value in a cast: refused
    for layer in LAYERS.values():
        for bad in (np.ones((2, 2), np.int64), np.ones((2, 2), bool), np.ones((2, 2), np.complex128)):
            with pytest.raises(TypeError, match=f"edge_attr has unsupported dtype {bad.dtype}"):
                layer(3, 2, edge_dim=2)(x, g, edge_attr=bad)
            with pytest.raises(TypeError, match="edge_attr has unsupported dtype"):
                layer(3, 2, edge_dim=2).vjp(x, g, edge_attr=bad)
        out, vjp = layer(3, 2, edge_dim=2).vjp(x, g, edge_attr=np.ones((2, 2), np.float64))
        assert out.dtype == np.float32   # another float dtype is cast to x's
        with pytest.raises(TypeError, match="dout has unsupported dtype int64"):
            vjp(np.ones(out.shape, np.int64))


def test_gat_source_features_only_matches_pyg():
    """x = (x_src, None): PyG drops the destination term of the score; "x" is (dx_src, None)."""
    torch = pytest.importorskip("torch")
    pyg_nn = pytest.importorskip("torch_geometric.nn")
    rng = np.random.default_rng(11)
    n = 15
    src, dst = random_edges(rng, n, n, 50)
    pyg = pyg_nn.GATConv(4, 3, heads=2)
    ours = GATConv(4, 3, heads=2)
    ours.load_state_dict({k: v.detach().numpy() for k, v in pyg.state_dict().items()})
    x = torch.randn(n, 4, requires_grad=True)
    ref = pyg((x, None), torch.from_numpy(np.stack([src, dst])))
    ref.sum().backward()
    out, vjp = ours.vjp((x.detach().numpy(), None), tg.Graph.from_coo(src, dst, n, n))
    grads = vjp(np.ones(out.shape, np.float32))
    np.testing.assert_allclose(out, ref.detach().numpy(), rtol=1e-4, atol=2e-5)
    assert grads["x"][1] is None
    np.testing.assert_allclose(grads["x"][0], x.grad.numpy(), rtol=1e-4, atol=2e-5)


def test_cpu_segment_sums_and_leaky_relu_grad_kernels():
    """The layers' numba kernels: segment sums in fixed order (with and without a gather order;
    empty rows, a hub row) equal float64 sums and do not depend on the thread count; the
    leaky_relu gradient scales exactly where the output is not positive (NaN included)."""
    import numba

    from tiga_numba.layers._cpu import leaky_relu_grad_inplace, segment_sums
    r = np.random.default_rng(7)
    deg = r.integers(0, 5, 300)
    deg[[3, 50]] = 0
    deg[17] = 5000
    indptr = np.concatenate([[0], np.cumsum(deg)]).astype(np.int64)
    e = int(indptr[-1])
    values = r.standard_normal((e, 6)).astype(np.float32)
    order = r.permutation(e).astype(np.int64)
    rows = np.repeat(np.arange(300), deg)
    for idx in (None, order):
        gathered = values if idx is None else values[idx]
        ref = np.zeros((300, 6))
        np.add.at(ref, rows, gathered.astype(np.float64))
        got = segment_sums(values, indptr, idx)
        assert got.dtype == np.float32 and got.shape == (300, 6)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-3)
        assert np.all(got[[3, 50]] == 0)
        before = numba.get_num_threads()
        try:
            numba.set_num_threads(1)
            one = segment_sums(values, indptr, idx)
        finally:
            numba.set_num_threads(before)
        assert np.array_equal(one, got)
    out = np.array([[1.0, -2.0, 0.0, np.nan]], np.float32)
    grad = np.array([[3.0, 3.0, 3.0, 3.0]], np.float32)
    leaky_relu_grad_inplace(out, grad, np.float32(0.2))
    np.testing.assert_array_equal(grad, np.float32([[3.0, 0.6, 0.6, 0.6]]))


@pytest.mark.parametrize("cls", [GATConv, GATv2Conv, TransformerConv])
@pytest.mark.parametrize("edge_dim", [None, 2])
def test_float16_layers_run_in_float32_and_answer_in_float16(cls, edge_dim):
    """float16 x, edge_attr and parameters on the CPU: the layer computes in float32 (scipy.sparse
    and the numba helpers take no float16) and returns its output and every gradient in float16,
    equal to the float32 layer on the same (float16-valued) inputs up to float16 rounding."""
    rng = np.random.default_rng(3)
    n, e = 12, 40
    g = tg.Graph.from_coo(rng.integers(0, n, e), rng.integers(0, n, e), n, n)
    x = rng.standard_normal((n, 5)).astype(np.float16)
    ea = None if edge_dim is None else rng.standard_normal((e, edge_dim)).astype(np.float16)
    dout = None
    results = {}
    weights = cls(5, 4, heads=2, edge_dim=edge_dim, dtype=np.float16, seed=1).state_dict()
    for dt in (np.float16, np.float32):
        layer = cls(5, 4, heads=2, edge_dim=edge_dim, dtype=dt)
        layer.load_state_dict({k: v.astype(dt) for k, v in weights.items()})   # the same weights
        out, vjp = layer.vjp(x.astype(dt), g, None if ea is None else ea.astype(dt))
        if dout is None:
            dout = rng.standard_normal(out.shape).astype(np.float16)
        results[dt] = (out, vjp(dout.astype(dt)))
    out16, g16 = results[np.float16]
    out32, g32 = results[np.float32]
    assert out16.dtype == np.float16 and g16["x"].dtype == np.float16
    np.testing.assert_allclose(out16.astype(np.float32), out32, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(g16["x"].astype(np.float32), g32["x"], rtol=2e-3, atol=2e-3)
    if edge_dim is not None:
        assert g16["edge_attr"].dtype == np.float16
        np.testing.assert_allclose(g16["edge_attr"].astype(np.float32), g32["edge_attr"], rtol=2e-3, atol=2e-3)
    for name, grad in g16["params"].items():
        assert grad.dtype == np.float16, name
        np.testing.assert_allclose(grad.astype(np.float32), g32["params"][name], rtol=3e-3, atol=3e-3,
                                   err_msg=name)


def test_shared_projection_is_one_parameter():
    """GATv2Conv(share_weights=True): state_dict() keeps PyG's two names of the one projection,
    named_parameters() / parameters() list it once (torch's rule), so a gradient step over them
    moves the shared array by one step: lr times the gradient the vjp gives under either name."""
    rng = np.random.default_rng(3)
    conv = GATv2Conv(5, 3, heads=2, share_weights=True, dtype=np.float64, seed=4)
    assert conv.state_dict()["lin_r.weight"] is conv.state_dict()["lin_l.weight"]
    names = [n for n, _ in conv.named_parameters()]
    assert "lin_l.weight" in names and "lin_r.weight" not in names and "lin_r.bias" not in names
    assert len(conv.parameters()) == len(names) == len(set(map(id, conv.parameters())))
    g = tg.Graph.from_coo(rng.integers(0, 9, 30), rng.integers(0, 9, 30), 9, 9)
    x = rng.standard_normal((9, 5))
    _, vjp = conv.vjp(x, g)
    grads = vjp(rng.standard_normal((9, 6)))["params"]
    np.testing.assert_array_equal(grads["lin_l.weight"], grads["lin_r.weight"])
    before = conv.state_dict()["lin_l.weight"].copy()
    for name, p in conv.named_parameters():
        p -= 0.1 * grads[name]
    np.testing.assert_allclose(conv.state_dict()["lin_r.weight"], before - 0.1 * grads["lin_l.weight"],
                               rtol=1e-15, atol=1e-15)
    unshared = GATv2Conv(5, 3, heads=2, dtype=np.float64, seed=4)
    assert [n for n, _ in unshared.named_parameters()] == list(unshared.state_dict())
