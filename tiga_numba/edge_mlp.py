"""GAT-style edge attention with an MLP score network, fused (no per-edge tensors).

    s_e   = net(concat(args_e))            one scalar per edge e = (j -> i)
    out_i = sum_e softmax_{e into i}(s)_e * value[j]

`args` are the fields the user's edge() passed to the traced network, in order: source
node fields (read at j), destination node fields (read at i) and edge fields; the
geometric edge fields of a radius/knn graph (`displacement` = pos[j] - pos[i], (E, D);
`distance`, (E,)) arrive as None and are computed per edge from `graph.positions`.

Exact structure used: the first Linear over the concatenation is a sum of per-argument
products, so W_src x_j and W_dst x_i + b are computed once per node ((N, hidden) arrays,
O(N)); only the edge-feature columns and the rest of the network run per edge, inside the
row-centric kernel, in per-thread scratch. The forward keeps (m, l) per row; the backward
recomputes every edge's score and never writes an (E,)- or (E, hidden)-sized buffer
(explicit, user-given edge fields do get an (E, F) gradient: that is their gradient).

Heads: a network whose last Linear has one output gives one scalar per edge; a value of shape
(N, H, F) is then combined with the same weights for every head (out (num_dst, H, F)). A
network with H > 1 outputs gives one softmax per head; that runs in tiga_numba.edge_mlp_heads
(per-edge scores (E, H), the mechanism of the GNN layers), entered from forward() / backward()
here.

Entry points (used by tiga_numba.program, also usable directly):
    forward(graph, net, args, value, return_state=True, unroll=None) -> (out, state, plan)
    backward(graph, net, args, value, state, dout, unroll=None) -> {"args", "value", "params",
                                                                    "positions", "plan"}
`unroll` picks the CPU kernels' code: None unrolls small networks and loops over larger ones
(cpu/gat.py: get_kernels); True / False force one (results agree within rounding).

Under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) numpy inputs run the CUDA kernels,
simulated on host arrays, so their logic can be checked without a GPU.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from .cpu.threads import run, serialised, useful
from .edge_mlp_records import FieldArg, GATPlan, GATState, finish_grads, make_plan, row_width
# `from .nn import ...` imports the submodule directly: the package's lazy __getattr__ (which
# would import this module again while it is being imported) is not involved
from .nn import LeakyReLU, Linear, ReLU, Tanh

__all__ = ["FieldArg", "GATState", "GATPlan", "forward", "backward"]


# --------------------------------------------------------------------------- preparation
_GEOMETRIC = ("displacement", "distance")


def _library(name, a):
    if isinstance(a, np.ndarray):
        return "numpy"
    if hasattr(a, "__cuda_array_interface__"):
        return "cupy"
    raise TypeError(f"{name} must be a numpy or cupy array, got {type(a).__name__}")


def _check_dout(dout, library):
    """dout's type before its shape is read: an array of the inputs' library, floating point."""
    if _library("dout", dout) != library:
        raise TypeError(f"dout must be a {library} array like the inputs, got {type(dout).__name__}")
    if np.dtype(dout.dtype).kind != "f":
        raise TypeError(f"dout must be floating point, got {np.dtype(dout.dtype)}")


def _is_net(net):
    return getattr(net, "__tiga_score_net__", False) is True


@dataclass
class _Prep:
    library: str
    dtype: Any  # output dtype (value's)
    acc: Any  # accumulation dtype
    num_src: int
    num_dst: int
    num_edges: int
    layers: list
    node_cols: list  # (arg index, role, array (2-D, acc dtype), column slice of W1)
    edge_items: list  # kernel spec items
    edge_cols: list  # column indices of W1 for the edge features, in ef order
    explicit: list  # (arg index, width, xcol) for user-given edge arrays
    geometric: bool
    pos: Any  # (N, D) acc dtype or empty
    pd: int
    EX: Any
    V: Any  # (num_src, Fv) acc dtype, contiguous
    value_shape: tuple
    P: Any  # packed parameters of layers >= 1
    p_index: list  # (name, offset, shape) inside P
    spec: Any
    copies: list
    arg_desc: str
    key: Any = None  # (graph, net, value, args) this preparation was made for


def _prepare(graph, net, args, value, value_name="value"):
    if not _is_net(net):
        raise TypeError(f"net must be a traced score network (tiga_numba.nn.trace(module)), "
                        f"got {type(net).__name__}")
    layers = net.layers()
    args = [FieldArg(*a) for a in args]
    if not args:
        raise ValueError("args must name at least one field for the score network")
    if graph.kind != "csr":
        raise NotImplementedError(f"score-network attention runs over CSR relations "
                                  f"(Graph.radius/knn/from_csr/...), got a {graph.kind!r} graph")
    num_src, num_dst, num_edges = graph.num_src, graph.num_dst, graph.num_edges
    libs = {}
    libs[value_name] = _library(value_name, value)
    for k, a in enumerate(args):
        if a.role not in ("src", "dst", "edge"):
            raise ValueError(f"args[{k}].role must be 'src', 'dst' or 'edge', got {a.role!r}")
        if a.array is not None:
            libs[f"{a.role}.{a.name}"] = _library(f"{a.role}.{a.name}", a.array)
    # the graph's own array: the public property hands out a copy of a cupy one
    positions = getattr(graph, "_positions", None)
    needs_geo = any(a.role == "edge" and a.array is None for a in args)
    if needs_geo:
        if positions is None:
            bad = next(a for a in args if a.role == "edge" and a.array is None)
            raise ValueError(f"edge.{bad.name} has no array and the graph has no positions "
                             "(geometric edge fields need Graph.radius/knn)")
        libs["graph.positions"] = _library("graph.positions", positions)
    for lname, p in net.named_parameters():
        libs[f"net.{lname}"] = _library(f"net parameter {lname}", p)
    kinds = set(libs.values())
    if len(kinds) > 1:
        raise TypeError("mixed numpy and cupy arrays: " +
                        ", ".join(f"{k}: {v}" for k, v in libs.items()))
    library = kinds.pop()
    xp = np
    if library == "cupy":
        import cupy as xp  # noqa: F811

    dtypes = [value.dtype] + [a.array.dtype for a in args if a.array is not None]
    for nm, d in [(value_name, value.dtype)] + [(f"{a.role}.{a.name}", a.array.dtype)
                                               for a in args if a.array is not None]:
        if np.dtype(d) not in (np.float16, np.float32, np.float64):
            raise TypeError(f"{nm} must be float16, float32 or float64, got {d}")
    params = dict(net.named_parameters())
    any64 = any(np.dtype(d) == np.float64 for d in dtypes) or any(
        p.dtype == np.float64 for p in params.values())
    acc = np.dtype(np.float64) if any64 else np.dtype(np.float32)
    copies = []

    # value
    if value.ndim not in (2, 3) or value.shape[0] != num_src:
        raise ValueError(f"{value_name} must have shape (num_src={num_src}, F) or (num_src, H, F), "
                         f"got {tuple(value.shape)}")
    V = xp.ascontiguousarray(value.reshape(num_src, row_width(value)), dtype=acc)
    if V is not value and V.base is not value:
        copies.append(f"value -> contiguous {acc}")

    # first Linear split by argument columns
    W1 = params["0.weight"]
    h1 = W1.shape[0]
    col = 0
    node_cols, edge_items, edge_cols, explicit = [], [], [], []
    fe = 0
    xcol = 0
    pd = positions.shape[1] if (needs_geo and positions is not None) else 0
    descs = []
    for k, a in enumerate(args):
        if a.role == "edge" and a.array is None:
            if a.name == "displacement":
                edge_items.append(("disp", fe, pd))
                width = pd
            elif a.name == "distance":
                edge_items.append(("dist", fe))
                width = 1
            else:
                raise ValueError(f"edge.{a.name} has no array; only 'displacement' and 'distance' "
                                 "are computed from the graph's positions")
            edge_cols.extend(range(col, col + width))
            fe += width
            descs.append(f"edge.{a.name}[{width}, from positions]")
        else:
            arr = a.array
            n_expected = {"src": num_src, "dst": num_dst, "edge": num_edges}[a.role]
            if arr.ndim not in (1, 2) or arr.shape[0] != n_expected:
                what = {"src": "num_src", "dst": "num_dst", "edge": "num_edges"}[a.role]
                raise ValueError(f"{a.role}.{a.name} must have shape ({what}={n_expected}, F) or "
                                 f"({n_expected},), got {tuple(arr.shape)}")
            arr2 = arr.reshape(n_expected, row_width(arr))
            width = arr2.shape[1]
            if a.role == "edge":
                edge_items.append(("x", fe, width, xcol))
                explicit.append((k, width, xcol, arr2))
                edge_cols.extend(range(col, col + width))
                fe += width
                xcol += width
            else:
                node_cols.append((k, a.role, arr2, slice(col, col + width)))
            descs.append(f"{a.role}.{a.name}[{width}]")
        col += width
    if col != W1.shape[1]:
        raise ValueError(f"the score network's first Linear takes {W1.shape[1]} inputs but the "
                         f"fields concatenate to {col} ({', '.join(descs)})")

    pos = np.zeros((0, 0), acc) if library == "numpy" else xp.zeros((0, 0), acc)
    if needs_geo:
        if positions.ndim != 2 or positions.shape[0] != num_src or positions.shape[0] != num_dst:
            raise ValueError(f"graph.positions must have shape (num_nodes, D) with num_nodes = "
                             f"num_src = num_dst = {num_src} for geometric edge fields, got "
                             f"{tuple(positions.shape)} for a {num_dst} x {num_src} graph")
        if np.dtype(positions.dtype).itemsize > np.dtype(acc).itemsize and positions.shape[0]:
            # the kernels only take differences of positions: translated to the origin (in their
            # own precision) before rounding to `acc`, coordinates far from the origin keep the
            # digits their displacements need
            pos = xp.ascontiguousarray(positions - positions.min(axis=0), dtype=acc)
            copies.append(f"positions -> translated to the origin, {acc} (N x {pd}, O(N))")
        else:
            pos = xp.ascontiguousarray(positions, dtype=acc)
            if pos is not positions:
                copies.append(f"positions -> contiguous {acc} (N x {pd}, O(N))")
    if explicit:
        EX = xp.ascontiguousarray(xp.concatenate([x for *_, x in explicit], axis=1)
                                  if len(explicit) > 1 else explicit[0][3], dtype=acc)
        copies.append(f"explicit edge fields -> one contiguous ({num_edges}, {xcol}) {acc} array")
    else:
        EX = xp.zeros((0, 0), acc)

    # layers >= 1: pack parameters into one flat array with literal offsets
    klayers, p_index, chunks, off = [], [], [], 0
    for idx, layer in enumerate(layers[1:], 1):
        if isinstance(layer, Linear):
            w = params[f"{idx}.weight"]
            b = params[f"{idx}.bias"]
            klayers.append(("linear", w.shape[1], w.shape[0], off, off + w.size))
            p_index.append((f"{idx}.weight", off, tuple(w.shape)))
            p_index.append((f"{idx}.bias", off + w.size, tuple(b.shape)))
            chunks += [w.reshape(-1), b.reshape(-1)]
            off += w.size + b.size
        elif isinstance(layer, LeakyReLU):
            klayers.append(("leaky_relu", float(layer.negative_slope)))
        elif isinstance(layer, ReLU):
            klayers.append(("relu",))
        elif isinstance(layer, Tanh):
            klayers.append(("tanh",))
        else:  # nn.trace refuses these already
            raise NotImplementedError(f"layer {idx}: {type(layer).__name__}")
    P = (xp.concatenate([c.astype(acc, copy=False) for c in chunks]) if chunks else xp.zeros(1, acc))
    fv = V.shape[1]
    from .score_net_source import Spec
    spec = Spec(klayers, h1, edge_items, fe, pd, fv)
    return _Prep(library=library, dtype=value.dtype, acc=acc, num_src=num_src, num_dst=num_dst,
                 num_edges=num_edges, layers=layers, node_cols=node_cols,
                 edge_items=edge_items, edge_cols=edge_cols, explicit=explicit,
                 geometric=needs_geo, pos=pos, pd=pd, EX=EX, V=V, value_shape=tuple(value.shape),
                 P=P, p_index=p_index, spec=spec, copies=copies,
                 arg_desc=", ".join(descs), key=(graph, net, value, tuple(args)))


def _same_call(prep, graph, net, args, value):
    """True when backward() gets the very objects the forward prepared (then the forward's
    preparation -- validation, packed parameters -- is reused instead of redone)."""
    key = prep.key
    if key is None or len(args) != len(key[3]):
        return False
    if key[0] is not graph or key[1] is not net or key[2] is not value:
        return False
    return all(tuple(FieldArg(*a))[:2] == k[:2] and FieldArg(*a).array is k[2]
               for a, k in zip(args, key[3]))


def _node_products(prep, params, xp):
    """As = sum_src W1[:, cols] x, Ad = sum_dst W1[:, cols] x + b1 ((N, hidden), acc dtype)."""
    W1 = params["0.weight"].astype(prep.acc)
    b1 = params["0.bias"].astype(prep.acc)
    h1 = W1.shape[0]
    As = xp.zeros((prep.num_src, h1), prep.acc)
    Ad = xp.empty((prep.num_dst, h1), prep.acc)
    Ad[...] = b1
    for _, role, arr, cols in prep.node_cols:
        Wt = xp.ascontiguousarray(W1[:, cols].T)  # (F, hidden)
        target = As if role == "src" else Ad
        if xp is np:
            from .cpu.gat import node_matmul_add
            x = np.ascontiguousarray(arr, dtype=prep.acc)
            run(node_matmul_add, useful(x.shape[0], x.size * Wt.shape[1]), x, Wt, target)
        else:
            target += arr.astype(prep.acc, copy=False) @ Wt
    # transposed (fe, hidden): the kernels' inner loops then run along contiguous memory
    WeT = xp.ascontiguousarray(W1[:, prep.edge_cols].T) if prep.edge_cols else xp.zeros((0, h1), prep.acc)
    return As, Ad, WeT


# Geometric graphs above this many rows are relabelled into spatial cell order for the
# kernels: a row's neighbours then sit at nearby addresses (cache lines and TLB entries are
# shared by consecutive rows). It changes no result: only the ids the kernels see.
_RELABEL_MIN_ROWS = 4096


@dataclass
class _Layout:
    """How the kernels see the nodes: either the caller's ids (order None) or relabelled
    ids, where kernel node r is caller node order[r]."""
    order: Any
    inv: Any
    indptr: Any
    indices: Any
    graph: Any
    note: str

    # np.take along axis 0 is the fastest numpy row gather (fancy indexing is ~2x slower)
    def gather(self, a):
        return a if self.order is None else np.take(a, self.order, axis=0)

    def scatter(self, a_k):
        return a_k if self.order is None else np.take(a_k, self.inv, axis=0)

    def rows(self, n):
        return np.arange(n, dtype=np.int64)

    def transpose(self):
        """(indptr, indices, perm) of the transposed relation in kernel ids."""
        tr = self.graph.realize_transpose("cpu")
        if self.order is None:
            return tr.indptr, tr.indices, tr.perm

        def build():
            from .cpu.gat import relabel_csr
            return relabel_csr(self.order, self.inv, tr.indptr, tr.indices)
        tip, tix = _graph_cached(self.graph, ("gat-relabel-transpose", "cpu"), build)
        return tip, tix, np.zeros(0, np.int64)  # perm unused without explicit edge fields


def _edge_work(prep, hidden):
    """scalar operations of one pass over the edges (the score network's first layer over the
    edge fields, its hidden units, the value row): how many threads the kernels get
    (cpu/threads.py)."""
    return prep.num_edges * (hidden * (1 + len(prep.edge_cols)) + prep.spec.fv)


def _inverse(order):
    inv = np.empty_like(order)
    inv[order] = np.arange(order.shape[0], dtype=order.dtype)
    return inv


def _graph_cached(graph, key, build):
    # Graph keeps per-device realisations in a private cache; the relabelled CSR is one more
    # realisation of the same relation, built once per graph and key.
    cached = getattr(graph, "_cached", None)
    return cached(key, build) if callable(cached) else build()


def _layout(graph, prep):
    rel = graph.realize("cpu")
    pos = getattr(graph, "_positions", None)
    if (pos is None or not prep.geometric or prep.explicit or prep.num_src != prep.num_dst
            or prep.num_dst < _RELABEL_MIN_ROWS):
        return _Layout(None, None, rel.indptr, rel.indices, graph, "nodes in caller order")

    def build():
        from .cpu.gat import relabel_csr
        from .neighbors import spatial_order
        order = spatial_order(pos)
        inv = _inverse(order)
        ip, ix = relabel_csr(order, inv, rel.indptr, rel.indices)
        return order, inv, ip, ix
    order, inv, ip, ix = _graph_cached(graph, ("gat-relabel", "cpu"), build)
    return _Layout(order, inv, ip, ix, graph,
                   "nodes relabelled into spatial cell order for the kernels (O(N) gathers; "
                   "relabelled CSR cached on the graph)")


def _cuda_simulator():
    """True when numba.cuda is numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)."""
    from numba.core import config
    return bool(config.ENABLE_CUDASIM)


def _decide(op, graph, prep):
    """The registry's choice of score-network kernel family for this call: the CUDA kernels
    for cupy inputs, and for numpy inputs under the CUDA simulator."""
    from . import registry
    backend = "cuda" if (prep.library == "cupy" or _cuda_simulator()) else "cpu"
    return registry.choose(registry.Request(op=f"gat.{op}", backend=backend,
                                            relation_kind=graph.kind, dtype=str(prep.dtype)))


def _csr(graph, library):
    device = "cpu" if library == "numpy" else "cuda"
    rel = graph.realize(device)
    return rel.indptr, rel.indices


def _ir_stages(kernel):
    """"llvm"/"asm" of a CPU kernel. numba refuses to show code it loaded from its on-disk
    cache (a warning and a placeholder); then the same function is compiled once more, without
    the cache, for the same signatures, and that code is shown (identical source and flags)."""
    import warnings

    def fresh():
        import numba
        opts = {k: v for k, v in kernel.targetoptions.items()
                if k in ("parallel", "fastmath", "boundscheck")}
        d = numba.njit(**opts)(kernel.py_func)
        for sig in kernel.signatures:
            d.compile(sig)
        return d

    def stage(kind):
        def show():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                text = "\n".join(getattr(kernel, f"inspect_{kind}")().values())
            if any("Inspection disabled" in str(w.message) for w in caught):
                text = "\n".join(getattr(fresh(), f"inspect_{kind}")().values())
            return text
        return show
    return {"llvm": stage("llvm"), "asm": stage("asm")}


# --------------------------------------------------------------------------- forward
def _recorded(plan_of):
    """Decorator: the call's plan becomes the package's last plan (tg.explain(), last_plan()),
    as functional.run_forward / run_backward make theirs; `plan_of` finds it in the result."""
    def wrap(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            result = fn(*args, **kwargs)
            from .functional import _remember
            _remember(plan_of(result))
            return result
        return wrapper
    return wrap


@_recorded(lambda result: result[2])
@serialised
def forward(graph, net, args, value, return_state=True, unroll=None, value_name="value"):
    """out (num_dst, F) or (num_dst, H, F) in value's dtype and library; state for backward;
    plan with explain()/run_info. `unroll`: the CPU kernels' code (module docstring);
    `value_name`: what errors call `value` (a program's field, src.<name>)."""
    prep = _prepare(graph, net, args, value, value_name)
    from . import edge_mlp_heads
    if edge_mlp_heads.net_heads(net) > 1:
        return edge_mlp_heads.forward(graph, net, prep, _node_products, return_state)
    decision = _decide("forward", graph, prep)
    if decision.family.name == "cuda.gat":
        from .cuda import gat as cuda_gat
        if prep.library == "numpy":   # the CUDA simulator, on host arrays
            return cuda_gat.forward(graph, net, prep, return_state, decision, xp=np, device="cpu")
        return cuda_gat.forward(graph, net, prep, return_state, decision)
    from .cpu import gat as cpu_gat
    params = dict(net.named_parameters())
    As, Ad, WeT = _node_products(prep, params, np)
    kern, cache, variant = cpu_gat.get_kernels(prep.spec, prep.P.shape[0], prep.acc, unroll)
    lay = _layout(graph, prep)
    As, Ad = lay.gather(As), lay.gather(Ad)  # kernel layout; kept so for the backward
    out = np.empty((prep.num_dst, prep.spec.fv), prep.acc)
    M = np.empty(prep.num_dst, prep.acc)
    L = np.empty(prep.num_dst, prep.acc)
    threads = useful(prep.num_dst, _edge_work(prep, As.shape[1]))
    run(kern.gat_forward, threads, lay.rows(prep.num_dst), lay.indptr, lay.indices, As, Ad, WeT,
        lay.gather(prep.pos) if prep.geometric else prep.pos, prep.EX, prep.P, lay.gather(prep.V),
        out, M, L)
    out_k = out
    out, M, L = lay.scatter(out), lay.scatter(M), lay.scatter(L)
    order_note = lay.note
    plan = make_plan("forward", prep, net, decision)
    plan.run_info.update(kernel=f"cpu.gat_forward[{variant}] (fused score MLP + online softmax, "
                                "one destination row per iteration)",
                         cache=cache, copies=list(prep.copies), order=order_note,
                         ir=_ir_stages(kern.gat_forward),
                         geometry=("displacement/distance computed per edge from positions"
                                   if prep.geometric else None))
    result = out.astype(prep.dtype, copy=False).reshape((prep.num_dst,) + prep.value_shape[1:])
    state = GATState(m=M, l=L, out=out_k, As=As, Ad=Ad) if return_state else None
    return result, state, plan


# --------------------------------------------------------------------------- backward
@_recorded(lambda result: result["plan"])
@serialised
def backward(graph, net, args, value, state, dout, unroll=None):
    """Gradients of sum(out * dout): {"args": [grad or None per arg], "value": grad,
    "params": {"0.weight": ..., ...}, "positions": grad or None, "plan": plan}. `unroll`: the
    CPU kernels' code (module docstring)."""
    if state is None:
        raise ValueError("state must be the state returned by forward(..., return_state=True)")
    from . import edge_mlp_heads
    if isinstance(state, edge_mlp_heads.HeadScoreState):
        _check_dout(dout, state.prep.library)
        return edge_mlp_heads.backward(graph, net, args, value, state, dout)
    prep = getattr(state, "prep", None)
    if prep is None or not _same_call(prep, graph, net, args, value):
        prep = _prepare(graph, net, args, value)
    _check_dout(dout, prep.library)
    expected = (prep.num_dst,) + prep.value_shape[1:]
    if tuple(dout.shape) != expected:
        raise ValueError(f"dout must have shape {expected}, got {tuple(dout.shape)}")
    decision = _decide("backward", graph, prep)
    if decision.family.name == "cuda.gat":
        from .cuda import gat as cuda_gat
        if prep.library == "numpy":   # the CUDA simulator, on host arrays
            return cuda_gat.backward(graph, net, prep, state, dout, args, value, decision, xp=np, device="cpu")
        return cuda_gat.backward(graph, net, prep, state, dout, args, value, decision)
    from .cpu import gat as cpu_gat
    params = dict(net.named_parameters())
    acc = prep.acc
    As, Ad = state.As, state.Ad
    W1 = params["0.weight"].astype(acc)
    h1 = W1.shape[0]
    WeT = np.ascontiguousarray(W1[:, prep.edge_cols].T) if prep.edge_cols else np.zeros((0, h1), acc)
    kern, cache, variant = cpu_gat.get_kernels(prep.spec, prep.P.shape[0], acc, unroll)
    lay = _layout(graph, prep)
    order_note = lay.note
    t_indptr, t_indices, t_perm = lay.transpose()
    D = lay.gather(np.ascontiguousarray(dout.reshape(prep.num_dst, row_width(dout)), dtype=acc))
    Vk = lay.gather(prep.V)
    posk = lay.gather(prep.pos) if prep.geometric else prep.pos
    Mk, Lk = lay.gather(state.m), lay.gather(state.l)
    nd = prep.num_dst
    Delta = np.empty(nd, acc)
    dAd = np.empty((nd, h1), acc)
    pd = max(prep.pd, 0)
    dposA = np.zeros((nd if prep.geometric else 0, pd), acc)
    dEX = np.zeros(prep.EX.shape, acc) if prep.explicit else np.zeros((0, 0), acc)
    nch = min(nd, cpu_gat.NUM_CHUNKS)
    n_pg = prep.P.shape[0] + h1 * prep.spec.fe
    PG = np.zeros((max(nch, 0), max(n_pg, 1)), acc)
    run(kern.gat_backward_rows, useful(nch, 2 * _edge_work(prep, h1)), lay.rows(nd), lay.indptr,
        lay.indices, As, Ad, WeT, posk, prep.EX, prep.P, Vk, state.out, D, Mk, Lk, Delta, dAd, dposA,
        dEX, PG)
    ns = prep.num_src
    dAs = np.empty((ns, h1), acc)
    dV = np.empty((ns, prep.spec.fv), acc)
    dposB = np.zeros((ns if prep.geometric else 0, pd), acc)
    run(kern.gat_backward_cols, useful(ns, 2 * _edge_work(prep, h1)), lay.rows(ns), t_indptr, t_indices,
        t_perm, As, Ad, WeT, posk, prep.EX, prep.P, Vk, D, Mk, Lk, Delta, dAs, dV, dposB)
    pg = PG.sum(axis=0)  # fixed chunk order: same bits every run
    dAd, dAs, dV = lay.scatter(dAd), lay.scatter(dAs), lay.scatter(dV)
    if prep.geometric:
        dposA, dposB = lay.scatter(dposA), lay.scatter(dposB)

    res = _assemble_grads(prep, params, args, value, W1, dAs, dAd, pg, dEX, dV,
                          (dposA + dposB) if prep.geometric else None, graph)
    plan = make_plan("backward", prep, net, decision)
    plan.run_info.update(kernel=f"cpu.gat_backward_rows + cpu.gat_backward_cols [{variant}] "
                                "(score MLP recomputed per edge, softmax adjoint in locals)",
                         cache=cache, copies=list(prep.copies), order=order_note,
                         ir=_ir_stages(kern.gat_backward_rows),
                         geometry=("displacement/distance gradients routed to positions per edge"
                                   if prep.geometric else None))
    res["plan"] = plan
    return res


def _assemble_grads(prep, params, args, value, W1, dAs, dAd, pg, dEX, dV, dpos, graph):
    """CPU: per-node and per-parameter gradients from the kernels' outputs (caller's node order):
    node columns of the first Linear from the (N, hidden) gradients (numba node kernels), the rest
    in finish_grads."""
    from .cpu.gat import node_matmul_add, node_outer_sum
    acc = prep.acc
    dW1 = np.zeros(W1.shape, acc)
    arg_grads = [None] * len(args)
    for k, role, arr, cols in prep.node_cols:
        g_node = dAs if role == "src" else dAd
        Wb = np.ascontiguousarray(W1[:, cols])  # (hidden, F)
        x = np.ascontiguousarray(arr, dtype=acc)
        chunks = max(1, min(g_node.shape[0], 256))
        dW1[:, cols] = run(node_outer_sum, useful(chunks, g_node.size * x.shape[1]), g_node, x, chunks)
        g = np.zeros((g_node.shape[0], Wb.shape[1]), acc)
        run(node_matmul_add, useful(g.shape[0], g_node.size * Wb.shape[1]), g_node, Wb, g)
        orig = args[k][2]
        arg_grads[k] = g.reshape(orig.shape).astype(orig.dtype, copy=False)
    return finish_grads(prep, params, args, value, dW1, dAd, pg, dEX, dV, dpos, graph, arg_grads)
