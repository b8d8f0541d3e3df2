"""GAT-MLP edge attention (tiga_numba.edge_mlp, CPU kernels) against a float64 numpy oracle
of the same model, materialized per edge: forward, stats and every gradient (x as src and as
dst, value, positions, explicit edge fields, every score-network parameter)."""
import tracemalloc

import numpy as np
import pytest

import tiga_numba.nn as nn  # submodule import: the lazy package attribute is not involved
from tiga_numba import edge_mlp
from tiga_numba.edge_mlp import FieldArg
from tiga_numba.graph import Graph


# --------------------------------------------------------------------------- the oracle
def net_backward(layers, acts, g):
    """Chain the scores' gradient g (E, outputs) back through a score network's layers, given
    each layer's input and output (acts): the parameters' gradients by name, and the gradient
    at the network's input (E, inputs)."""
    params = {}
    for idx in range(len(layers) - 1, -1, -1):
        layer, h_in, h_out = layers[idx], acts[idx], acts[idx + 1]
        if isinstance(layer, nn.Linear):
            params[f"{idx}.weight"] = g.T @ h_in
            params[f"{idx}.bias"] = g.sum(0)
            g = g @ np.asarray(layer.weight, np.float64)
        elif isinstance(layer, nn.LeakyReLU):
            g = g * np.where(h_in > 0, 1.0, layer.negative_slope)
        elif isinstance(layer, nn.ReLU):
            g = g * (h_in > 0)
        else:
            g = g * (1 - h_out ** 2)
    return params, g


def oracle(graph, net, args, value, dout=None):
    """Materialized float64 model: concat per edge, MLP, segment softmax, weighted sum;
    hand-derived backward. Returns out, (m, l) and, with dout, the gradients."""
    rel = graph.realize("cpu")
    dst = np.repeat(np.arange(graph.num_dst), np.diff(rel.indptr))
    src = rel.indices.astype(np.int64)
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
            cols.append(disp if name == "displacement" else np.sqrt((disp ** 2).sum(-1, keepdims=True)))
    acts = [np.concatenate(cols, axis=1)]
    layers = net.layers()
    for layer in layers:
        h = acts[-1]
        if isinstance(layer, nn.Linear):
            acts.append(h @ np.asarray(layer.weight, np.float64).T + np.asarray(layer.bias, np.float64))
        elif isinstance(layer, nn.LeakyReLU):
            acts.append(np.where(h > 0, h, h * layer.negative_slope))
        elif isinstance(layer, nn.ReLU):
            acts.append(np.maximum(h, 0))
        else:
            acts.append(np.tanh(h))
    s = acts[-1][:, 0]
    nd = graph.num_dst
    m = np.full(nd, -np.inf)
    np.maximum.at(m, dst, s)
    w = np.exp(s - m[dst])
    l = np.zeros(nd)
    np.add.at(l, dst, w)
    p = w / l[dst]
    V = np.asarray(value, np.float64).reshape(graph.num_src, -1)
    out = np.zeros((nd, V.shape[1]))
    np.add.at(out, dst, p[:, None] * V[src])
    out_shaped = out.reshape((nd,) + tuple(value.shape[1:]))
    if dout is None:
        return out_shaped, (m, l)
    D = np.asarray(dout, np.float64).reshape(nd, -1)
    dV = np.zeros_like(V)
    np.add.at(dV, src, p[:, None] * D[dst])
    ds = p * ((D[dst] * V[src]).sum(1) - (D * out).sum(1)[dst])
    g = ds[:, None]
    params, g = net_backward(layers, acts, g)
    arg_grads, c0 = [], 0
    dpos = np.zeros_like(pos) if pos is not None else None
    for (role, name, arr), c in zip(args, cols):
        gc = g[:, c0:c0 + c.shape[1]]
        c0 += c.shape[1]
        if role in ("src", "dst"):
            n_role = graph.num_src if role == "src" else graph.num_dst
            a = np.zeros((n_role, c.shape[1]))
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
    return out_shaped, (m, l), {"args": arg_grads, "value": dV.reshape(value.shape),
                                "params": params, "positions": dpos}


# --------------------------------------------------------------------------- inputs and oracle
def random_cloud(rng, n, dim=3, isolated=3):
    """Uniform points plus a few far-away ones (isolated nodes: empty rows and columns)."""
    pos = rng.random((n, dim))
    if isolated:
        pos[-isolated:] = 10.0 + 5.0 * np.arange(isolated)[:, None]
    return pos


def seed_net(f, hidden, dtype=np.float64, slope=0.2, dim=3):
    return nn.trace(nn.Sequential(nn.Linear(dim + 2 * f, hidden, seed=11, dtype=dtype),
                                  nn.LeakyReLU(slope), nn.Linear(hidden, 1, seed=12, dtype=dtype)))


def assert_close(name, got, want, rtol, atol):
    assert got is not None, name
    assert got.shape == np.shape(want), (name, got.shape, np.shape(want))
    assert np.all(np.isfinite(got)), name
    scale = max(1.0, float(np.max(np.abs(want)))) if np.size(want) else 1.0
    err = float(np.max(np.abs(np.asarray(got, np.float64) - want))) if np.size(want) else 0.0
    assert err <= atol * scale + rtol * scale, f"{name}: max err {err:.3g} (scale {scale:.3g})"


def check_all(graph, net, args, value, rng, rtol=1e-10, atol=1e-10, unroll=None):
    out, state, plan = edge_mlp.forward(graph, net, args, value, unroll=unroll)
    dout = rng.standard_normal(out.shape)
    ref, (m, l), grads = oracle(graph, net, args, value, dout)
    assert out.dtype == value.dtype and out.shape == ref.shape
    assert_close("out", out, ref, rtol, atol)
    nonempty = l > 0
    assert np.all(state.l[~nonempty] == 0) and np.all(np.isneginf(state.m[~nonempty]))
    assert_close("m", state.m[nonempty], m[nonempty], rtol, atol)
    assert_close("l", state.l[nonempty], l[nonempty], rtol, atol)
    res = edge_mlp.backward(graph, net, args, value, state, dout.astype(value.dtype), unroll=unroll)
    for k, (a, want) in enumerate(zip(res["args"], grads["args"])):
        if want is None:
            assert a is None, f"args[{k}] is geometric: its gradient goes to positions"
        else:
            assert_close(f"args[{k}] ({args[k][0]}.{args[k][1]})", a, want, rtol, atol)
    assert_close("value", res["value"], grads["value"], rtol, atol)
    assert set(res["params"]) == set(grads["params"]) == {n for n, _ in net.named_parameters()}
    for name, want in grads["params"].items():
        assert_close(f"param {name}", res["params"][name], want, rtol, atol)
    if grads["positions"] is None:
        assert res["positions"] is None
    else:
        assert_close("positions", res["positions"], grads["positions"], rtol, atol)
    return out, res, plan


@pytest.fixture(params=["unrolled", "loops"])
def variant(request):
    """the CPU kernels' code, forced both ways (edge_mlp's `unroll`)."""
    return request.param


UNROLL = {"unrolled": True, "loops": False}


@pytest.fixture(params=["relabel", "caller-order"])
def relabel(request, monkeypatch):
    """Geometric graphs above a size are relabelled into spatial order for the kernels;
    force both layouts on small graphs."""
    monkeypatch.setattr(edge_mlp, "_RELABEL_MIN_ROWS", 0 if request.param == "relabel" else 10**9)
    return request.param


# --------------------------------------------------------------------------- tests
def test_seed_model_radius_graph_all_gradients(variant, relabel):
    rng = np.random.default_rng(0)
    n, f = 67, 5
    pos = random_cloud(rng, n)
    g = Graph.radius(pos, 0.3)
    assert g.num_edges > 0
    x = rng.standard_normal((n, f))
    net = seed_net(f, 8)
    args = [FieldArg("edge", "displacement", None), FieldArg("src", "x", x), FieldArg("dst", "x", x)]
    out, res, plan = check_all(g, net, args, x, rng, unroll=UNROLL[variant])
    # isolated destinations: output exactly zero, no NaN anywhere
    assert np.all(out[-3:] == 0)
    assert variant in plan.run_info["kernel"]
    assert ("relabelled" in plan.explain()) == (relabel == "relabel")
    text = plan.explain()
    assert "backend: cpu" in text and "not materialized" in text
    assert "tiles: none (the network is evaluated per edge" in text
    assert "asm" in plan.run_info["ir"] and "llvm" in plan.run_info["ir"]
    if variant == "unrolled" and relabel == "relabel":  # once: it recompiles when cached
        assert "gat_forward" in plan.ir("llvm") and len(plan.ir("asm")) > 2000
        with pytest.raises(KeyError):
            plan.ir("ptx")


def test_deep_net_distance_explicit_edge_field_and_heads(variant):
    rng = np.random.default_rng(1)
    n, f, h, fv = 41, 3, 2, 4
    pos = random_cloud(rng, n, isolated=2)
    g = Graph.radius(pos, 0.35)
    xs = rng.standard_normal((n, f))
    xd = rng.standard_normal((n, 2))
    ew = rng.standard_normal((g.num_edges, 2))
    value = rng.standard_normal((n, h, fv))
    net = nn.trace(nn.Sequential(nn.Linear(1 + f + 2 + 2 + 3, 6, seed=1, dtype=np.float64), nn.Tanh(),
                                 nn.Linear(6, 5, seed=2, dtype=np.float64), nn.ReLU(),
                                 nn.Linear(5, 4, seed=3, dtype=np.float64), nn.LeakyReLU(0.1),
                                 nn.Linear(4, 1, seed=4, dtype=np.float64)))
    args = [FieldArg("edge", "distance", None), FieldArg("src", "a", xs), FieldArg("dst", "b", xd),
            FieldArg("edge", "w", ew), FieldArg("edge", "displacement", None)]
    out, res, _ = check_all(g, net, args, value, rng, unroll=UNROLL[variant])
    assert out.shape == (n, h, fv)


def test_knn_graph_2d_positions_and_src_only_args(variant, relabel):
    rng = np.random.default_rng(2)
    n, f = 30, 4
    pos = rng.random((n, 2))
    g = Graph.knn(pos, 5)
    x = rng.standard_normal((n, f))
    net = nn.trace(nn.Sequential(nn.Linear(2 + f, 7, seed=5, dtype=np.float64), nn.ReLU(),
                                 nn.Linear(7, 1, seed=6, dtype=np.float64)))
    args = [FieldArg("edge", "displacement", None), FieldArg("src", "x", x)]
    check_all(g, net, args, x, rng, unroll=UNROLL[variant])


def test_general_csr_graph_rectangular_no_geometry(variant):
    rng = np.random.default_rng(3)
    ns, nd = 13, 9
    dense = rng.random((nd, ns)) < 0.4
    dense[2] = False  # an empty row
    indptr = np.concatenate([[0], np.cumsum(dense.sum(1))])
    indices = np.nonzero(dense)[1]
    g = Graph.from_csr(indptr, indices, num_src=ns)
    xs = rng.standard_normal((ns, 3))
    xd = rng.standard_normal((nd, 2))
    v = rng.standard_normal((ns, 5))
    net = nn.trace(nn.Sequential(nn.Linear(5, 4, seed=7, dtype=np.float64), nn.LeakyReLU(),
                                 nn.Linear(4, 1, seed=8, dtype=np.float64)))
    args = [FieldArg("src", "k", xs), FieldArg("dst", "q", xd)]
    out, _, _ = check_all(g, net, args, v, rng, unroll=UNROLL[variant])
    assert np.all(out[2] == 0)


def test_single_linear_score_network(variant):
    rng = np.random.default_rng(4)
    n = 25
    pos = random_cloud(rng, n, isolated=1)
    g = Graph.radius(pos, 0.4)
    x = rng.standard_normal((n, 2))
    net = nn.trace(nn.Linear(3 + 2, 1, seed=9, dtype=np.float64))
    args = [FieldArg("edge", "displacement", None), FieldArg("dst", "x", x)]
    check_all(g, net, args, x, rng, unroll=UNROLL[variant])


def test_float32_within_tolerance():
    rng = np.random.default_rng(5)
    n, f = 80, 6
    pos = random_cloud(rng, n).astype(np.float32)
    g = Graph.radius(pos, 0.3)
    x = rng.standard_normal((n, f)).astype(np.float32)
    net = seed_net(f, 16, dtype=np.float32)
    args = [FieldArg("edge", "displacement", None), FieldArg("src", "x", x), FieldArg("dst", "x", x)]
    out, state, plan = edge_mlp.forward(g, net, args, x)
    assert out.dtype == np.float32 and state.m.dtype == np.float32
    assert "accumulation float32" in plan.explain()
    check_all(g, net, args, x, rng, rtol=2e-4, atol=2e-4)


def test_graph_without_edges():
    rng = np.random.default_rng(6)
    n, f = 7, 4
    pos = rng.random((n, 3)) * 100
    g = Graph.radius(pos, 1e-3)
    assert g.num_edges == 0
    x = rng.standard_normal((n, f))
    net = seed_net(f, 16)   # test_nothing_edge_sized_is_materialized's network: the same kernels
    args = [FieldArg("edge", "displacement", None), FieldArg("src", "x", x), FieldArg("dst", "x", x)]
    out, state, _ = edge_mlp.forward(g, net, args, x)
    assert np.all(out == 0) and np.all(state.l == 0)
    res = edge_mlp.backward(g, net, args, x, state, np.ones_like(out))
    assert np.all(res["value"] == 0) and np.all(res["positions"] == 0)
    assert all(np.all(v == 0) for v in res["params"].values())


@pytest.mark.parametrize("heads", [1, 2])
def test_graph_without_nodes(heads):
    """Zero nodes (e.g. a zero-row stand-in): empty results of the right shapes, zero parameter
    gradients (reshape(0, -1) cannot tell a width; the widths come from the shapes)."""
    g = Graph.from_csr(np.zeros(1, np.int64), np.zeros(0, np.int32), num_src=0)
    net = nn.trace(nn.Sequential(nn.Linear(5, 8, seed=1, dtype=np.float64), nn.LeakyReLU(0.2),
                                 nn.Linear(8, heads, seed=2, dtype=np.float64)))
    x, y, v = np.zeros((0, 3)), np.zeros((0, 2)), np.zeros((0, 2, 4))
    args = [FieldArg("src", "x", x), FieldArg("dst", "y", y)]
    out, state, _ = edge_mlp.forward(g, net, args, v)
    assert out.shape == (0, 2, 4)
    res = edge_mlp.backward(g, net, args, v, state, np.zeros(out.shape))
    assert res["value"].shape == (0, 2, 4) and [a.shape for a in res["args"]] == [(0, 3), (0, 2)]
    assert {k: a.shape for k, a in res["params"].items()} == {k: p.shape for k, p in net.named_parameters()}
    assert all(np.all(a == 0) for a in res["params"].values())


def test_backward_is_deterministic(relabel):
    rng = np.random.default_rng(7)
    n, f = 300, 6   # the network, dtypes and unroll choice of test_float32_within_tolerance: its kernels
    pos = rng.random((n, 3)).astype(np.float32)
    g = Graph.radius(pos, 0.2)
    x = rng.standard_normal((n, f)).astype(np.float32)
    net = seed_net(f, 16, dtype=np.float32)
    args = [FieldArg("edge", "displacement", None), FieldArg("src", "x", x), FieldArg("dst", "x", x)]
    dout = rng.standard_normal((n, f)).astype(np.float32)
    runs = []
    for _ in range(2):
        out, st, _ = edge_mlp.forward(g, net, args, x)
        runs.append((out, edge_mlp.backward(g, net, args, x, st, dout)))
    (o1, r1), (o2, r2) = runs
    assert np.array_equal(o1, o2)
    assert np.array_equal(r1["value"], r2["value"]) and np.array_equal(r1["positions"], r2["positions"])
    for k in r1["params"]:
        assert np.array_equal(r1["params"][k], r2["params"][k]), k


def test_nothing_edge_sized_is_materialized():
    """Peak numpy memory of forward+backward stays far below one (E, hidden) float64 buffer
    (the eager model needs several) and within a small multiple of the O(N x (hidden + F))
    per-node state; numba's per-thread scratch is O(threads x hidden)."""
    rng = np.random.default_rng(8)
    n, f, hidden = 6000, 4, 16
    pos = rng.random((n, 3))
    g = Graph.radius(pos, (64 * 3 / (4 * np.pi * n)) ** (1 / 3))
    E = g.num_edges
    assert E > 300_000
    x = rng.standard_normal((n, f))
    net = seed_net(f, hidden)
    args = [FieldArg("edge", "displacement", None), FieldArg("src", "x", x), FieldArg("dst", "x", x)]
    out, st, _ = edge_mlp.forward(g, net, args, x)  # compile outside the measurement
    edge_mlp.backward(g, net, args, x, st, np.ones_like(out))
    g.realize_transpose("cpu")
    tracemalloc.start()
    out, st, _ = edge_mlp.forward(g, net, args, x)
    edge_mlp.backward(g, net, args, x, st, np.ones_like(out))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    per_node = n * (hidden + f + 3) * 8
    assert peak < E * hidden * 8 / 4, f"peak {peak} B vs one (E, hidden) float64 = {E * hidden * 8} B"
    assert peak < 10 * per_node, f"peak {peak} B vs per-node state {per_node} B"


def test_errors_name_the_argument():
    rng = np.random.default_rng(9)
    n = 10
    pos = rng.random((n, 3))
    g = Graph.radius(pos, 0.5)
    x = rng.standard_normal((n, 2))
    net = seed_net(2, 4)
    good = [FieldArg("edge", "displacement", None), FieldArg("src", "x", x), FieldArg("dst", "x", x)]
    with pytest.raises(ValueError, match="first Linear takes 7 inputs"):
        edge_mlp.forward(g, net, good[:2], x)
    with pytest.raises(TypeError, match="net must be a traced score network"):
        edge_mlp.forward(g, object(), good, x)
    with pytest.raises(ValueError, match="src.x must have shape"):
        edge_mlp.forward(g, net, [good[0], FieldArg("src", "x", x[:5]), good[2]], x)
    with pytest.raises(ValueError, match="value must have shape"):
        edge_mlp.forward(g, net, good, x[:4])
    with pytest.raises(TypeError, match="dst.x must be float16, float32 or float64"):
        edge_mlp.forward(g, net, [good[0], good[1], FieldArg("dst", "x", x.astype(np.int64))], x)
    plain = Graph.from_csr(g.realize("cpu").indptr, g.realize("cpu").indices)
    with pytest.raises(ValueError, match="edge.displacement has no array and the graph has no positions"):
        edge_mlp.forward(plain, net, good, x)
    with pytest.raises(NotImplementedError, match="CSR"):
        edge_mlp.forward(Graph.dense(n), net, good, x)
    out, st, _ = edge_mlp.forward(g, net, good, x)
    with pytest.raises(ValueError, match="dout must have shape"):
        edge_mlp.backward(g, net, good, x, st, out[:3])
    # dout's type and dtype before its shape; a program's value named as its field
    with pytest.raises(TypeError, match="dout must be a numpy or cupy array, got list"):
        edge_mlp.backward(g, net, good, x, st, out.tolist())
    for bad in (out.astype(np.complex128), out.astype(np.int64)):
        with pytest.raises(TypeError, match="dout must be floating point"):
            edge_mlp.backward(g, net, good, x, st, bad)
    with pytest.raises(TypeError, match="src.v must be float16, float32 or float64"):
        edge_mlp.forward(g, net, good, x.astype(np.int32), value_name="src.v")


def test_positions_far_from_the_origin_keep_float32_displacements():
    """float64 positions far from the origin with float32 features and weights: the kernels take
    differences of positions in float32, after translating them to the origin, so the result
    does not depend on where the cloud sits (rounding the positions themselves to float32 moved
    the outputs of a cloud 1e4 away by more than this test allows)."""
    rng = np.random.default_rng(12)
    n, f = 30, 3
    pos = rng.random((n, 3)) * 0.5
    x = rng.standard_normal((n, f)).astype(np.float32)
    net = nn.trace(nn.Sequential(nn.Linear(3 + 2 * f, 8, seed=3), nn.Tanh(), nn.Linear(8, 1, seed=4)))
    outs = []
    for shift in (0.0, 1e4):
        g = Graph.radius(pos + shift, 0.25)
        args = [FieldArg("edge", "displacement", None), FieldArg("src", "x", x), FieldArg("dst", "x", x)]
        outs.append(edge_mlp.forward(g, net, args, x)[0])
    assert outs[0].dtype == np.float32
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6, atol=1e-6)


def test_front_end_program_uses_fused_kernel():
    """The GAT example's program through tg.MessagePassing (when the front end is present)."""
    program = pytest.importorskip("tiga_numba.program")
    rng = np.random.default_rng(10)
    n, f = 40, 5   # the network shape of seed_net(5, 8) (test_seed_model_radius_graph_all_gradients)

    class GAT(program.MessagePassing):
        reducer = program.online_softmax()

        def __init__(self, attn):
            super().__init__()
            self.attn = nn.trace(attn)

        def edge(self, src, dst, edge):
            return self.reducer(self.attn(edge.displacement, src.x, dst.x), src.x)

    pos = random_cloud(rng, n, isolated=1)
    g = Graph.radius(pos, 0.35)
    x = rng.standard_normal((n, f))
    attn = nn.Sequential(nn.Linear(3 + 2 * f, 8, seed=1, dtype=np.float64), nn.LeakyReLU(0.2),
                         nn.Linear(8, 1, seed=2, dtype=np.float64))
    prog = GAT(attn)
    out, vjp = prog.vjp(graph=g, src={"x": x}, dst={"x": x})
    args = [("edge", "displacement", None), ("src", "x", x), ("dst", "x", x)]
    dout = rng.standard_normal(out.shape)
    ref, _, grads = oracle(g, nn.trace(attn), args, x, dout)
    assert_close("out", out, ref, 1e-10, 1e-10)
    got = vjp(dout)
    # src.x collects its score-argument and value gradients; dst.x its score-argument one
    assert_close("src.x", got["src"]["x"], grads["args"][1] + grads["value"], 1e-10, 1e-10)
    assert_close("dst.x", got["dst"]["x"], grads["args"][2], 1e-10, 1e-10)
    assert_close("positions", got["positions"], grads["positions"], 1e-10, 1e-10)
    for name, want in grads["params"].items():
        assert_close(name, got["params"][f"attn.{name}"], want, 1e-10, 1e-10)


# --------------------------------------------------------------------------- CUDA kernels
def _install_group_shuffles(lanes=4):
    """Simulator only: shfl_sync / shfl_xor_sync for the lanes named in `mask` (one lane
    group of a warp), as a rendezvous of exactly those simulator threads: each posts its
    value, waits for the group, reads its source lane's. The CUDA GAT kernels shuffle only
    inside a lane group whose lanes all take the same path, which is what this requires.
    With the shuffles offered, the kernel factories take `lanes` lanes per row
    (TIGA_NUMBA_GAT_LANES); without them the simulator runs the one-lane kernels."""
    import os
    import threading
    from numba.cuda.simulator import kernelapi
    lock = threading.Lock()

    def exchange(mask, value, source):
        th = threading.current_thread()
        lane = th.thread_id % 32
        mask = int(mask)
        assert (mask >> lane) & 1, f"lane {lane} shuffles outside its mask {mask:#x}"
        key = (th.thread_id // 32, mask)
        with lock:
            groups = th._manager.__dict__.setdefault("_tiga_groups", {})
            if key not in groups:
                groups[key] = (threading.Barrier(bin(mask).count("1"), timeout=60), {})
            barrier, box = groups[key]
        box[lane] = value
        barrier.wait()
        src = source(lane)
        assert (mask >> src) & 1, f"lane {lane} reads lane {src} outside the mask {mask:#x}"
        got = box[src]
        barrier.wait()
        return got

    kernelapi.FakeCUDAModule.shfl_sync = lambda self, mask, value, src: exchange(
        mask, value, lambda lane: int(src))
    kernelapi.FakeCUDAModule.shfl_xor_sync = lambda self, mask, value, lm: exchange(
        mask, value, lambda lane: lane ^ int(lm))
    os.environ["TIGA_NUMBA_GAT_LANES"] = str(lanes)   # this subprocess only


_SIM_SCRIPT = r"""
import sys, numpy as np
sys.path.insert(0, {tests!r})
import sim_support; sim_support.prepare_simulator()
import test_gat as T
from tiga_numba.edge_mlp import FieldArg
from tiga_numba.graph import Graph
import tiga_numba.nn as nn
LANES = {lanes}
if LANES > 1:
    T._install_group_shuffles(LANES)
rng = np.random.default_rng(0)
n, f = 150, 3          # several blocks, and groups that take several rows (grid-stride)
pos = T.random_cloud(rng, n, isolated=2)
g = Graph.radius(pos, 0.15)
x = rng.standard_normal((n, f))
args = [FieldArg("edge", "displacement", None), FieldArg("src", "x", x), FieldArg("dst", "x", x)]
out, res, plan = T.check_all(g, T.seed_net(f, 4), args, x, rng)
assert plan.run_info["kernel"].startswith(f"cuda.gat_forward ({{LANES}} lanes"), plan.run_info["kernel"]
assert res["plan"].run_info["kernel"].startswith(f"cuda.gat_backward_rows ({{LANES}} lanes")
m = 12
pos = T.random_cloud(rng, m, isolated=1)
g = Graph.radius(pos, 0.5)
xs = rng.standard_normal((m, 2)); ew = rng.standard_normal((g.num_edges, 1)); v = rng.standard_normal((m, 2, 2))
net2 = nn.trace(nn.Sequential(nn.Linear(1 + 2 + 1 + 3, 3, seed=1, dtype=np.float64), nn.Tanh(),
                              nn.Linear(3, 2, seed=2, dtype=np.float64), nn.ReLU(),
                              nn.Linear(2, 1, seed=3, dtype=np.float64)))
args2 = [FieldArg("edge", "distance", None), FieldArg("src", "a", xs), FieldArg("edge", "w", ew),
         FieldArg("edge", "displacement", None)]
T.check_all(g, net2, args2, v, rng)
# rectangular relation without geometry (num_src != num_dst), an empty row, value width 5
ns, nd = 13, 9
dense = rng.random((nd, ns)) < 0.5
dense[2] = False
g3 = Graph.from_csr(np.concatenate([[0], np.cumsum(dense.sum(1))]), np.nonzero(dense)[1], num_src=ns)
net3 = nn.trace(nn.Sequential(nn.Linear(5, 4, seed=7, dtype=np.float64), nn.LeakyReLU(),
                              nn.Linear(4, 1, seed=8, dtype=np.float64)))
args3 = [FieldArg("src", "k", rng.standard_normal((ns, 3))), FieldArg("dst", "q", rng.standard_normal((nd, 2)))]
out3, _, _ = T.check_all(g3, net3, args3, rng.standard_normal((ns, 5)), rng)
assert np.all(out3[2] == 0)
print("SIM OK")
"""


@pytest.mark.parametrize("lanes", [1, 4])
def test_cuda_kernels_in_simulator(lanes):
    """The generated CUDA kernels (forward, both backward passes, block reduction) run under
    NUMBA_ENABLE_CUDASIM on numpy arrays and match the oracle: one lane per row, and lane
    groups (shuffles emulated per group: butterflies, broadcasts, the reduce-scatter)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = _SIM_SCRIPT.format(tests=os.path.join(root, "tests"), lanes=lanes)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=600, cwd=root)
    assert proc.returncode == 0 and "SIM OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def _cupy_or_skip():
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception:  # noqa: BLE001
        pytest.skip("no CUDA device")
    return cp


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_cuda_forward_backward_vs_oracle(dtype):
    cp = _cupy_or_skip()
    rng = np.random.default_rng(11)
    n, f = 700, 6
    pos = random_cloud(rng, n).astype(dtype)
    x = rng.standard_normal((n, f)).astype(dtype)
    g_host = Graph.radius(pos, 0.12)
    g = Graph.radius(cp.asarray(pos), 0.12)
    net = seed_net(f, 16, dtype=dtype)
    net_gpu = seed_net(f, 16, dtype=dtype)
    net_gpu.module.to("cuda")
    xg = cp.asarray(x)
    args_g = [FieldArg("edge", "displacement", None), FieldArg("src", "x", xg), FieldArg("dst", "x", xg)]
    args_h = [FieldArg("edge", "displacement", None), FieldArg("src", "x", x), FieldArg("dst", "x", x)]
    out, st, plan = edge_mlp.forward(g, net_gpu, args_g, xg)
    assert isinstance(out, cp.ndarray) and plan.backend == "cuda"
    dout = rng.standard_normal(out.shape).astype(dtype)
    ref, _, grads = oracle(g_host, net, args_h, x, dout)
    tol = 1e-9 if dtype == np.float64 else 3e-4
    assert_close("out", cp.asnumpy(out), ref, tol, tol)
    res = edge_mlp.backward(g, net_gpu, args_g, xg, st, cp.asarray(dout))
    assert_close("src.x", cp.asnumpy(res["args"][1]), grads["args"][1], tol, tol)
    assert_close("dst.x", cp.asnumpy(res["args"][2]), grads["args"][2], tol, tol)
    assert_close("value", cp.asnumpy(res["value"]), grads["value"], tol, tol)
    assert_close("positions", cp.asnumpy(res["positions"]), grads["positions"], tol, tol)
    for name, want in grads["params"].items():
        assert_close(name, cp.asnumpy(res["params"][name]), want, tol, tol)
    res2 = edge_mlp.backward(g, net_gpu, args_g, xg, st, cp.asarray(dout))
    for name in grads["params"]:
        assert cp.array_equal(res["params"][name], res2["params"][name]), f"{name} not deterministic"
    assert cp.array_equal(res["args"][1], res2["args"][1])
    assert cp.array_equal(res["args"][2], res2["args"][2])
    assert cp.array_equal(res["value"], res2["value"])
    assert cp.array_equal(res["positions"], res2["positions"])
    assert "lanes per row" in res["plan"].run_info["kernel"]


def test_wide_value_keeps_value_loops(variant):
    """Value widths above the scalar-locals limit take the loop code for the value side."""
    from tiga_numba.cpu.gat import SMALL_VALUE
    rng = np.random.default_rng(12)
    n, f = 40, 3
    pos = random_cloud(rng, n, isolated=1)
    g = Graph.radius(pos, 0.35)
    x = rng.standard_normal((n, f))
    value = rng.standard_normal((n, SMALL_VALUE + 5))
    args = [FieldArg("edge", "displacement", None), FieldArg("src", "x", x), FieldArg("dst", "x", x)]
    check_all(g, seed_net(f, 6), args, value, rng, unroll=UNROLL[variant])


_PTX_SCRIPT = r"""
import re
import numpy as np
from tiga_numba import edge_mlp
from tiga_numba.edge_mlp import FieldArg
from tiga_numba.graph import Graph
import tiga_numba.nn as nn
from tiga_numba.cuda import gat as cg
rng = np.random.default_rng(0)
f = 5
pos = rng.random((30, 3)).astype(np.float32)
g = Graph.radius(pos, 0.4)
x = rng.standard_normal((30, f)).astype(np.float32)
net = nn.trace(nn.Sequential(nn.Linear(3 + 2 * f, 6, seed=1), nn.LeakyReLU(0.2), nn.Linear(6, 1, seed=2)))
args = [FieldArg("edge", "displacement", None), FieldArg("src", "x", x), FieldArg("dst", "x", x)]
prep = edge_mlp._prepare(g, net, args, x)
kern, _ = cg.get_kernels(prep.spec, prep.P.shape[0], prep.acc)
layout, _ = cg._node_args(prep, np)
nk = cg.get_node_kernels(layout, 6, 3 + 2 * f, prep.acc)
assert kern.G == cg.DEFAULT_LANES > 1, kern.G
for name, k in [("fwd", kern.forward), ("rows", kern.rows), ("cols", kern.cols),
                ("products", nk.products), ("grads", nk.grads)]:
    ptx = k.compile_ptx((9, 0))
    assert ".target sm_90" in ptx and ".entry" in ptx, name
    assert "ld.local" not in ptx and "st.local" not in ptx, f"{name}: local memory used"
    if name in ("fwd", "rows", "cols"):
        assert "shfl.sync.bfly" in ptx and "shfl.sync.idx" in ptx, f"{name}: no lane-group shuffles"
    if name in ("rows", "products"):
        assert "bar.sync" in ptx, f"{name}: no block barrier"
    assert not re.search(r"^\s*(@\S+\s+)?(atom|red)\.", ptx, re.M), f"{name}: atomics (determinism)"
print("PTX OK")
"""


def test_cuda_kernels_compile_for_sm90():
    """CI without a GPU: the multi-lane kernels (which the simulator runs only through the
    emulated shuffles) compile to sm_90 PTX with warp shuffles, no local memory and no
    atomics (the backward is deterministic by construction)."""
    import importlib.util
    import os
    import subprocess
    import sys
    if importlib.util.find_spec("numba_cuda") is None:
        pytest.skip("numba-cuda is not installed")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = root + os.pathsep + os.environ.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600, cwd=root)
    assert proc.returncode == 0 and "PTX OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("single", [True, False])
def test_rows_kernel_writes_every_shared_gradient_slot(single):
    """The rows kernel's block reduction reads every parameter-gradient slot of its shared array;
    slots no gradient lands in (a one-Linear score net has such) must be written (as zeros), not
    read as garbage (compute-sanitizer initcheck). Checked on the generated source, no GPU needed."""
    import re

    from tiga_numba import edge_mlp
    from tiga_numba.cuda import gat as cg
    rng = np.random.default_rng(5)
    pos = rng.random((20, 3))
    g = Graph.radius(pos, 0.5)
    x = rng.standard_normal((20, 2))
    layers = (nn.Linear(3 + 2, 1, seed=9, dtype=np.float64) if single else
              nn.Sequential(nn.Linear(3 + 2, 4, seed=1, dtype=np.float64), nn.Tanh(),
                            nn.Linear(4, 1, seed=2, dtype=np.float64)))
    prep = edge_mlp._prepare(g, nn.trace(layers), [FieldArg("edge", "displacement", None),
                                                  FieldArg("dst", "x", x)], x)
    spec, p_size = prep.spec, prep.P.shape[0]
    n_pg = p_size + spec.fe * spec.h1
    src = cg.generate_source(spec, p_size, "float64", 4, 128, False)
    written = {int(k) for k in re.findall(r"sh\[grp % \d+, (\d+)\] = ", src)}
    assert written == set(range(n_pg)), (sorted(written), n_pg)


def test_tg_explain_follows_score_network_programs():
    """tg.explain() / last_plan() report the most recent call of any front end: a score-network
    program's forward, then its backward (the functional record of an earlier call is replaced)."""
    import tiga_numba as tg
    from tiga_numba import functional
    rng = np.random.default_rng(4)
    n = 25
    pos = random_cloud(rng, n, isolated=1)
    g = Graph.radius(pos, 0.4)
    x = rng.standard_normal((n, 2))
    q = rng.standard_normal((n, 1, 4))
    tg.attention(q, q, q, tg.Graph.triangular(n))
    assert "cpu.gat" not in tg.explain()

    class Scored(tg.MessagePassing):
        reducer = tg.online_softmax()
        attn = nn.trace(nn.Linear(3 + 2, 1, seed=9, dtype=np.float64))

        def edge(self, src, dst, edge):
            return self.reducer(self.attn(edge.displacement, dst.x), src.x)

    prog = Scored()
    out, vjp = prog.vjp(graph=g, src={"x": x}, dst={"x": x})
    assert "op: forward" in tg.explain() and "cpu.gat_forward" in tg.explain()
    assert functional.last_plan().run_info["kernel"].startswith("cpu.gat_forward")
    vjp(np.ones_like(out))
    assert "op: backward" in tg.explain() and "cpu.gat_backward" in tg.explain()
