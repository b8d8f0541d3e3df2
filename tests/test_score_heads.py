"""Score networks with H > 1 outputs (one softmax per head), directly (tiga_numba.edge_mlp)
and through a `tg.MessagePassing` program, against a float64 numpy oracle that materializes
everything per edge: forward and every gradient (node fields as src and as dst, explicit edge
fields, positions through displacement / distance, the value, every network parameter), on
graphs with a hub row, empty rows and self loops."""
import numpy as np
import pytest

import tiga_numba as tg
import tiga_numba.nn as nn
from tiga_numba import edge_mlp, edge_mlp_heads
from tiga_numba.edge_mlp import FieldArg
from tiga_numba.graph import Graph

from test_gat import net_backward  # the network half of the oracle's backward


# --------------------------------------------------------------------------- the oracle
def _edges(graph):
    rel = graph.realize("cpu")
    dst = np.repeat(np.arange(graph.num_dst), np.diff(rel.indptr))
    return dst, rel.indices.astype(np.int64)


def oracle(graph, net, args, value, dout):
    """float64: concat per edge, MLP -> (E, H), per-head segment softmax, weighted sum of the
    value head h // (H // Hv); hand-derived backward. Returns out and the gradients."""
    dst, src = _edges(graph)
    pos = None if graph.positions is None else np.asarray(graph.positions, np.float64)
    cols = []
    for role, name, arr in args:
        if role == "src":
            cols.append(np.asarray(arr, np.float64).reshape(graph.num_src, -1)[src])
        elif role == "dst":
            cols.append(np.asarray(arr, np.float64).reshape(graph.num_dst, -1)[dst])
        elif arr is not None:
            cols.append(np.asarray(arr, np.float64).reshape(graph.num_edges, -1))
        else:
            disp = pos[src] - pos[dst]
            cols.append(disp if name == "displacement"
                        else np.sqrt((disp ** 2).sum(-1, keepdims=True)))
    acts = [np.concatenate(cols, axis=1)]
    layers = net.layers()
    for layer in layers:
        h = acts[-1]
        if isinstance(layer, nn.Linear):
            acts.append(h @ np.asarray(layer.weight, np.float64).T
                        + np.asarray(layer.bias, np.float64))
        elif isinstance(layer, nn.LeakyReLU):
            acts.append(np.where(h > 0, h, h * layer.negative_slope))
        elif isinstance(layer, nn.ReLU):
            acts.append(np.maximum(h, 0))
        else:
            acts.append(np.tanh(h))
    s = acts[-1]  # (E, H)
    E, H = s.shape
    nd, ns = graph.num_dst, graph.num_src
    V = np.asarray(value, np.float64)
    V = V[:, None, :] if V.ndim == 2 else V
    grp = H // V.shape[1]
    Vh = V[:, np.arange(H) // grp, :]  # (ns, H, F): each head's value
    m = np.full((nd, H), -np.inf)
    np.maximum.at(m, dst, s)
    w = np.exp(s - m[dst])
    l = np.zeros((nd, H))
    np.add.at(l, dst, w)
    p = w / l[dst]
    out = np.zeros((nd, H, V.shape[2]))
    np.add.at(out, dst, p[:, :, None] * Vh[src])
    D = np.asarray(dout, np.float64)
    dVh = np.zeros_like(Vh)
    np.add.at(dVh, src, p[:, :, None] * D[dst])
    dV = np.zeros_like(V)
    for h in range(H):
        dV[:, h // grp] += dVh[:, h]
    ds = p * ((D[dst] * Vh[src]).sum(-1) - (D * out).sum(-1)[dst])
    g = ds
    params, g = net_backward(layers, acts, g)
    arg_grads, c0 = [], 0
    dpos = np.zeros_like(pos) if pos is not None else None
    for (role, name, arr), c in zip(args, cols):
        gc = g[:, c0:c0 + c.shape[1]]
        c0 += c.shape[1]
        if role in ("src", "dst"):
            a = np.zeros((ns if role == "src" else nd, c.shape[1]))
            np.add.at(a, src if role == "src" else dst, gc)
            arg_grads.append(a.reshape(np.shape(arr)))
        elif arr is not None:
            arg_grads.append(gc.reshape(np.shape(arr)))
        else:
            disp = pos[src] - pos[dst]
            if name == "distance":
                dist = np.sqrt((disp ** 2).sum(-1, keepdims=True))
                gc = gc * np.where(dist > 0, disp / np.where(dist > 0, dist, 1), 0)
            np.add.at(dpos, src, gc)
            np.add.at(dpos, dst, -gc)
            arg_grads.append(None)
    return out, {"args": arg_grads, "value": dV.reshape(np.shape(value)), "params": params,
                 "positions": dpos}


def assert_close(name, got, want, tol):
    got = np.asarray(got)
    assert got.shape == np.shape(want), (name, got.shape, np.shape(want))
    assert np.all(np.isfinite(got)), name
    scale = max(1.0, float(np.max(np.abs(want)))) if np.size(want) else 1.0
    err = float(np.max(np.abs(got.astype(np.float64) - want))) if np.size(want) else 0.0
    assert err <= tol * scale, f"{name}: max err {err:.3g} (scale {scale:.3g})"


def check_all(graph, net, args, value, rng, tol=1e-10):
    out, state, plan = edge_mlp.forward(graph, net, args, value)
    dout = rng.standard_normal(out.shape)
    ref, grads = oracle(graph, net, args, value, dout)
    assert out.dtype == value.dtype
    assert_close("out", out, ref, tol)
    res = edge_mlp.backward(graph, net, args, value, state, dout.astype(value.dtype))
    for k, (a, want) in enumerate(zip(res["args"], grads["args"])):
        if want is None:
            assert a is None
        else:
            assert_close(f"args[{k}] ({args[k][0]}.{args[k][1]})", a, want, tol)
    assert_close("value", res["value"], grads["value"], tol)
    assert set(res["params"]) == set(grads["params"]) == {n for n, _ in net.named_parameters()}
    for name, want in grads["params"].items():
        assert_close(f"param {name}", res["params"][name], want, tol)
    if grads["positions"] is None:
        assert res["positions"] is None
    else:
        assert_close("positions", res["positions"], grads["positions"], tol)
    return out, res, plan


def random_csr(rng, ns, nd, density=0.3):
    """A CSR graph with a hub row (every source), empty rows and self loops (i -> i)."""
    dense = rng.random((nd, ns)) < density
    dense[1] = True           # hub
    dense[[3, nd - 1]] = False  # empty rows
    for i in range(min(ns, nd)):
        if i % 3 == 0:
            dense[i, i] = True  # self loops
    dense[3] = False
    indptr = np.concatenate([[0], np.cumsum(dense.sum(1))])
    return Graph.from_csr(indptr, np.nonzero(dense)[1], num_src=ns)


def mlp(sizes, acts, dtype=np.float64, seed=0):
    layers = []
    for k, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b, seed=seed + k, dtype=dtype))
        if k < len(acts):
            layers.append(acts[k])
    return nn.trace(nn.Sequential(*layers))


# --------------------------------------------------------------------------- direct calls
@pytest.mark.parametrize("value_heads", [None, 1, 2, 4])
def test_heads_general_csr_matches_oracle(value_heads):
    rng = np.random.default_rng(value_heads or 0)
    ns, nd, H, F = 17, 12, 4, 3
    g = random_csr(rng, ns, nd)
    xs = rng.standard_normal((ns, 3))
    xd = rng.standard_normal((nd, 2))
    ew = rng.standard_normal((g.num_edges, 2))
    shape = (ns, F) if value_heads is None else (ns, value_heads, F)
    v = rng.standard_normal(shape)
    net = mlp([3 + 2 + 2, 6, 5, H], [nn.Tanh(), nn.LeakyReLU(0.1)])
    args = [FieldArg("src", "k", xs), FieldArg("dst", "q", xd), FieldArg("edge", "w", ew)]
    out, _, plan = check_all(g, net, args, v, rng)
    assert out.shape == (nd, H, F)
    assert np.all(out[3] == 0) and np.all(out[nd - 1] == 0)  # destinations without edges
    text = plan.explain()
    assert "one softmax per head" in text and f"(E, {H})" in text


def test_heads_radius_graph_geometry_and_positions():
    rng = np.random.default_rng(5)
    n, f, H = 35, 3, 3
    pos = rng.random((n, 3))
    pos[-2:] = 10.0 + np.arange(2)[:, None] * 5.0  # isolated nodes
    g = Graph.radius(pos, 0.4)
    x = rng.standard_normal((n, f))
    net = mlp([1 + 3 + 2 * f, 8, H], [nn.ReLU()])
    args = [FieldArg("edge", "distance", None), FieldArg("edge", "displacement", None),
            FieldArg("src", "x", x), FieldArg("dst", "x", x)]
    check_all(g, net, args, rng.standard_normal((n, H, 2)), rng)


def test_heads_single_linear_and_small_chunks(monkeypatch):
    """A single Linear with H outputs, and edge chunks of a few edges (every chunk boundary
    path of the forward and the backward)."""
    rng = np.random.default_rng(6)
    g = random_csr(rng, 20, 15, density=0.4)
    xs = rng.standard_normal((20, 4))
    net = nn.trace(nn.Linear(4 + 1, 2, seed=3, dtype=np.float64))
    args = [FieldArg("src", "k", xs), FieldArg("edge", "w", rng.standard_normal(g.num_edges))]
    monkeypatch.setattr(edge_mlp_heads, "CHUNK_ELEMENTS", 7)
    check_all(g, net, args, rng.standard_normal((20, 2, 3)), rng)


def test_heads_float32_within_tolerance():
    rng = np.random.default_rng(7)
    g = random_csr(rng, 25, 25)
    x = rng.standard_normal((25, 4)).astype(np.float32)
    net = mlp([8, 8, 3], [nn.LeakyReLU(0.2)], dtype=np.float32)
    args = [FieldArg("src", "x", x), FieldArg("dst", "x", x)]
    out, res, _ = check_all(g, net, args, x, rng, tol=2e-5)
    assert out.dtype == np.float32 and res["params"]["0.weight"].dtype == np.float32


def test_heads_graph_without_edges():
    g = Graph.from_csr(np.zeros(5, np.int64), np.zeros(0, np.int64), num_src=3)
    rng = np.random.default_rng(8)
    net = mlp([2, 4, 2], [nn.ReLU()])
    x = rng.standard_normal((3, 2))
    out, state, _ = edge_mlp.forward(g, net, [FieldArg("src", "x", x)], x)
    assert out.shape == (4, 2, 2) and np.all(out == 0)
    res = edge_mlp.backward(g, net, [FieldArg("src", "x", x)], x, state, np.ones((4, 2, 2)))
    assert np.all(res["value"] == 0) and np.all(res["args"][0] == 0)
    assert all(np.all(v == 0) for v in res["params"].values())


def test_heads_value_heads_must_divide():
    rng = np.random.default_rng(9)
    g = random_csr(rng, 6, 6)
    x = rng.standard_normal((6, 2))
    with pytest.raises(ValueError, match="value heads must divide"):
        edge_mlp.forward(g, mlp([2, 3], []), [FieldArg("src", "x", x)],
                         rng.standard_normal((6, 2, 2)))


# --------------------------------------------------------------------------- program API
class HeadGAT(tg.MessagePassing):
    reducer = tg.online_softmax()

    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def edge(self, src, dst, edge):
        return self.reducer(self.attn(src.x, dst.x, edge.w), src.value)


def test_program_with_head_score_network_matches_oracle():
    rng = np.random.default_rng(11)
    ns, nd, H, F = 19, 14, 4, 3
    g = random_csr(rng, ns, nd)
    xs = rng.standard_normal((ns, 3))
    xd = rng.standard_normal((nd, 3))
    ew = rng.standard_normal((g.num_edges, 2))
    v = rng.standard_normal((ns, H, F))
    net = mlp([3 + 3 + 2, 8, H], [nn.LeakyReLU(0.2)], seed=20)
    prog = HeadGAT(net)
    out, vjp = prog.vjp(graph=g, src={"x": xs, "value": v}, dst={"x": xd}, edge={"w": ew})
    dout = rng.standard_normal(out.shape)
    args = [("src", "x", xs), ("dst", "x", xd), ("edge", "w", ew)]
    ref, grads = oracle(g, net, args, v, dout)
    assert_close("out", out, ref, 1e-10)
    got = vjp(dout)
    assert_close("src.x", got["src"]["x"], grads["args"][0], 1e-10)
    assert_close("dst.x", got["dst"]["x"], grads["args"][1], 1e-10)
    assert_close("edge.w", got["edge"]["w"], grads["args"][2], 1e-10)
    assert_close("src.value", got["src"]["value"], grads["value"], 1e-10)
    assert set(got["params"]) == {f"attn.{n}" for n in grads["params"]}
    for name, want in grads["params"].items():
        assert_close(name, got["params"][f"attn.{name}"], want, 1e-10)
    text = prog.explain()
    assert "one softmax per head" in text
    np.testing.assert_allclose(prog(graph=g, src={"x": xs, "value": v}, dst={"x": xd},
                                    edge={"w": ew}), out, rtol=0, atol=0)


def test_program_head_network_matches_its_eager_definition():
    """The per-head network evaluated eagerly per edge (TracedNet.__call__ on gathered rows)
    and a per-head softmax written with numpy give the program's output."""
    rng = np.random.default_rng(12)
    n, H = 16, 2
    g = random_csr(rng, n, n)
    x = rng.standard_normal((n, 3))
    ew = rng.standard_normal((g.num_edges, 2))
    net = mlp([8, 5, H], [nn.Tanh()], seed=30)
    out = HeadGAT(net)(graph=g, src={"x": x, "value": x}, dst={"x": x}, edge={"w": ew})
    dst, src = _edges(g)
    s = net(x[src], x[dst], ew)
    assert s.shape == (g.num_edges, H)
    want = np.zeros((n, H, 3))
    for i in range(n):
        e = np.nonzero(dst == i)[0]
        if e.size:
            p = np.exp(s[e] - s[e].max(0))
            p /= p.sum(0)
            want[i] = np.einsum("eh,ef->hf", p, x[src[e]])
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- GPU (cupy)
def _to_host(a):
    return None if a is None else a.get()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_heads_cupy_matches_oracle(dtype, cupy_gpu):
    """cupy inputs: the per-edge network runs in cupy, the attention on the CUDA kernels;
    radius graph on device positions (displacement and distance), src and dst node fields, a grouped value (H = 4 scores, 2 value heads)."""
    cp = cupy_gpu
    rng = np.random.default_rng(13)
    n, f, H = 400, 5, 4
    pos = rng.random((n, 3)).astype(dtype)
    pos[-3:] = 10.0 + 5.0 * np.arange(3)[:, None]  # isolated nodes: empty rows
    g_host = Graph.radius(pos, 0.15)
    g = Graph.radius(cp.asarray(pos), 0.15)
    x = rng.standard_normal((n, f)).astype(dtype)
    assert g.num_edges == g_host.num_edges
    v = rng.standard_normal((n, 2, 3)).astype(dtype)
    net = mlp([1 + 3 + 2 * f, 16, 8, H], [nn.LeakyReLU(0.2), nn.Tanh()], dtype=dtype)
    net_gpu = mlp([1 + 3 + 2 * f, 16, 8, H], [nn.LeakyReLU(0.2), nn.Tanh()], dtype=dtype)
    net_gpu.module.to("cuda")
    args_h = [FieldArg("edge", "distance", None), FieldArg("edge", "displacement", None),
              FieldArg("src", "x", x), FieldArg("dst", "x", x)]
    args_g = [FieldArg(a.role, a.name, None if a.array is None else cp.asarray(a.array))
              for a in args_h]
    out, st, plan = edge_mlp.forward(g, net_gpu, args_g, cp.asarray(v))
    assert isinstance(out, cp.ndarray) and out.dtype == dtype and plan.backend == "cuda"
    dout = rng.standard_normal(out.shape).astype(dtype)
    ref, grads = oracle(g_host, net, args_h, v, dout)
    tol = 1e-9 if dtype == np.float64 else 3e-4
    assert_close("out", out.get(), ref, tol)
    res = edge_mlp.backward(g, net_gpu, args_g, cp.asarray(v), st, cp.asarray(dout))
    for k, want in enumerate(grads["args"]):
        if want is None:
            assert res["args"][k] is None
        else:
            assert_close(f"args[{k}]", _to_host(res["args"][k]), want, tol)
    assert_close("value", res["value"].get(), grads["value"], tol)
    assert_close("positions", res["positions"].get(), grads["positions"], tol)
    for name, want in grads["params"].items():
        assert isinstance(res["params"][name], cp.ndarray)
        assert_close(f"param {name}", res["params"][name].get(), want, tol)


@pytest.mark.gpu
def test_program_with_head_score_network_on_cupy(cupy_gpu):
    cp = cupy_gpu
    rng = np.random.default_rng(14)
    ns, nd, H, F = 300, 200, 4, 8
    g = random_csr(rng, ns, nd, density=0.05)
    xs = rng.standard_normal((ns, 3))
    xd = rng.standard_normal((nd, 3))
    ew = rng.standard_normal((g.num_edges, 2))
    v = rng.standard_normal((ns, H, F))
    net = mlp([3 + 3 + 2, 8, H], [nn.LeakyReLU(0.2)], seed=20)
    net_gpu = mlp([3 + 3 + 2, 8, H], [nn.LeakyReLU(0.2)], seed=20)
    net_gpu.module.to("cuda")
    prog = HeadGAT(net_gpu)
    out, vjp = prog.vjp(graph=g, src={"x": cp.asarray(xs), "value": cp.asarray(v)},
                        dst={"x": cp.asarray(xd)}, edge={"w": cp.asarray(ew)})
    assert isinstance(out, cp.ndarray)
    dout = rng.standard_normal(out.shape)
    ref, grads = oracle(g, net, [("src", "x", xs), ("dst", "x", xd), ("edge", "w", ew)], v, dout)
    assert_close("out", out.get(), ref, 1e-9)
    got = vjp(cp.asarray(dout))
    assert_close("src.x", got["src"]["x"].get(), grads["args"][0], 1e-9)
    assert_close("dst.x", got["dst"]["x"].get(), grads["args"][1], 1e-9)
    assert_close("edge.w", got["edge"]["w"].get(), grads["args"][2], 1e-9)
    assert_close("src.value", got["src"]["value"].get(), grads["value"], 1e-9)
    for name, want in grads["params"].items():
        assert_close(name, got["params"][f"attn.{name}"].get(), want, 1e-9)
    assert "backend: cuda" in prog.explain()
