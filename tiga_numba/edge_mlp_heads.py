"""Score networks with H > 1 outputs: one softmax per head.

    s_e   = net(concat(args_e))             (E, H): one score per edge and head
    out_i = sum_e softmax_{e into i}(s[:, h])_e * value[j, h // (H // Hv)]     (num_dst, H, F)

This is the mechanism the GNN layers (tiga_numba.layers) use for their per-head scores: the
score is computed per edge with array operations (numpy or cupy), kept as one (E, H) array in
CSR edge order, and the softmax-weighted sum runs on the attention kernels as a per-edge score
with zero-width q and k (`layers.gat.edge_attention`), which also give its gradient (E, H).
The network then runs backward from that gradient.

As in the fused single-score kernels (tiga_numba.edge_mlp), the first Linear is split per
argument: W_src x_j and W_dst x_i + b are computed once per node ((N, hidden)); the edge
columns (explicit edge fields, displacement / distance from the graph's positions) and the
rest of the network run per edge, in edge chunks of bounded size, so no (E, hidden) array is
formed. Kept between forward and backward: the (E, H) scores and the (N, hidden) node
products. The backward recomputes each chunk's activations and sums the per-edge gradients
into nodes with sparse products (deterministic on the CPU).

A value of shape (num_src, F) is shared by all heads (output (num_dst, H, F)); (num_src, Hv, F)
with H % Hv == 0 gives head h the value head h // (H // Hv).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .edge_mlp_records import finish_grads, make_plan, row_width
from .nn import LeakyReLU, Linear, ReLU

__all__ = ["net_heads", "HeadScoreState", "forward", "backward"]

CHUNK_ELEMENTS = 1 << 22  # per-chunk activations hold at most this many elements per layer


def net_heads(net):
    """Number of outputs of a traced score network's last Linear (its heads)."""
    for layer in reversed(net.layers()):
        if isinstance(layer, Linear):
            return int(layer.out_features)
    return 1


@dataclass
class HeadScoreState:
    prep: Any
    score: Any  # (E, H) accumulation dtype, CSR edge order
    As: Any  # (num_src, hidden)
    Ad: Any  # (num_dst, hidden), first bias included
    WeT: Any  # (edge columns, hidden)
    values: Any  # (num_src, Hv, F) accumulation dtype, what the attention read
    attention_backward: Any
    plans: dict


def _xp(prep):
    if prep.library == "numpy":
        return np
    import cupy
    return cupy


def _chunk(prep, net):
    widths = [prep.spec.h1] + [layer.out_features for layer in net.layers()[1:]
                               if isinstance(layer, Linear)] + [max(prep.spec.fe, 1)]
    return max(1, CHUNK_ELEMENTS // max(widths))


def _edge_features(xp, prep, rows, cols, e0, e1):
    """(chunk, fe) edge-column inputs of the first Linear, in prep.edge_items order, and the
    chunk's displacements (for the positions' gradient) when the network reads geometry."""
    parts, disp = [], None
    for item in prep.edge_items:
        if item[0] in ("disp", "dist"):
            if disp is None:
                disp = xp.take(prep.pos, cols, axis=0) - xp.take(prep.pos, rows, axis=0)
            if item[0] == "disp":
                parts.append(disp)
            else:
                parts.append(xp.sqrt((disp * disp).sum(axis=1, keepdims=True)))
        else:
            _, _, width, xcol = item
            parts.append(prep.EX[e0:e1, xcol:xcol + width])
    if not parts:
        return None, None
    return (xp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]), disp


def _activations(xp, prep, layers, params, As, Ad, WeT, rows, cols, e0, e1):
    """The chunk's per-layer activations [h0, h1, ...] (h0: the first Linear's output) and its
    edge features."""
    h = xp.take(As, cols, axis=0) + xp.take(Ad, rows, axis=0)
    ef, disp = _edge_features(xp, prep, rows, cols, e0, e1)
    if ef is not None:
        h = h + ef @ WeT
    acts = [h]
    for idx, layer in enumerate(layers[1:], 1):
        if isinstance(layer, Linear):
            h = h @ params[f"{idx}.weight"].T + params[f"{idx}.bias"]
        elif isinstance(layer, LeakyReLU):
            h = xp.where(h > 0, h, h * layer.negative_slope)
        elif isinstance(layer, ReLU):
            h = xp.maximum(h, 0)
        else:
            h = xp.tanh(h)
        acts.append(h)
    return acts, ef, disp


def _acc_params(net, acc):
    return {name: p.astype(acc, copy=False) for name, p in net.named_parameters()}


def forward(graph, net, prep, node_products, return_state=True):
    """out (num_dst, H, F) in value's dtype and library; state for backward; plan."""
    from .layers._edges import edge_set
    from .layers.gat import edge_attention
    xp = _xp(prep)
    acc = prep.acc
    H = net_heads(net)
    value_shape = prep.value_shape
    hv = 1 if len(value_shape) == 2 else int(value_shape[1])
    if H % hv:
        raise ValueError(f"the score network has {H} outputs (heads) but the value has {hv} "
                         f"heads; value heads must divide the score's (value shape "
                         f"{tuple(value_shape)})")
    params = _acc_params(net, acc)
    As, Ad, WeT = node_products(prep, params, xp)
    es = edge_set(graph, False, xp)
    layers = net.layers()
    E = prep.num_edges
    score = xp.empty((E, H), acc)
    chunk = _chunk(prep, net)
    for e0 in range(0, E, chunk):
        e1 = min(E, e0 + chunk)
        acts, _, _ = _activations(xp, prep, layers, params, As, Ad, WeT, es.rows[e0:e1],
                                  es.cols[e0:e1], e0, e1)
        score[e0:e1] = acts[-1]
    values = prep.V.reshape(prep.num_src, hv, prep.V.shape[1] // hv)
    plans = {}
    out, att_backward = edge_attention(values, score, es, plans)
    att = plans["forward"]
    plan = _plan("forward", prep, net, att, H, chunk,
                 f"per-edge score network in chunks of {chunk} edges ({prep.library}), then "
                 f"{att.run_info.get('kernel', att.family)}",
                 "displacement/distance computed per edge chunk from positions")
    result = out.astype(prep.dtype, copy=False)
    state = (HeadScoreState(prep=prep, score=score, As=As, Ad=Ad, WeT=WeT, values=values,
                            attention_backward=att_backward, plans=plans)
             if return_state else None)
    return result, state, plan


def backward(graph, net, args, value, state, dout):
    """Gradients of sum(out * dout), as edge_mlp.backward returns them."""
    from .layers._edges import edge_set, scatter_rows
    prep = state.prep
    xp = _xp(prep)
    acc = prep.acc
    H = state.score.shape[1]
    expected = (prep.num_dst, H, prep.V.shape[1] // state.values.shape[1])
    if tuple(dout.shape) != expected:
        raise ValueError(f"dout must have shape {expected}, got {tuple(dout.shape)}")
    dv, dscore = state.attention_backward(xp.asarray(dout, dtype=acc))
    dscore = dscore.astype(acc, copy=False)
    params = _acc_params(net, acc)
    layers = net.layers()
    es = edge_set(graph, False, xp)
    h1 = prep.spec.h1
    E = prep.num_edges
    dAs = xp.zeros((prep.num_src, h1), acc)
    dAd = xp.zeros((prep.num_dst, h1), acc)
    dWeT = xp.zeros(state.WeT.shape, acc)
    dEX = xp.zeros(prep.EX.shape, acc) if prep.explicit else None
    dpos = xp.zeros(prep.pos.shape, acc) if prep.geometric else None
    g_layers = {name: xp.zeros(p.shape, acc) for name, p in params.items()
                if not name.startswith("0.")}
    chunk = _chunk(prep, net)
    for e0 in range(0, E, chunk):
        e1 = min(E, e0 + chunk)
        rows, cols = es.rows[e0:e1], es.cols[e0:e1]
        acts, ef, disp = _activations(xp, prep, layers, params, state.As, state.Ad,
                                      state.WeT, rows, cols, e0, e1)
        g = dscore[e0:e1]
        for idx in range(len(layers) - 1, 0, -1):
            layer, h_in, h_out = layers[idx], acts[idx - 1], acts[idx]
            if isinstance(layer, Linear):
                g_layers[f"{idx}.weight"] += g.T @ h_in
                g_layers[f"{idx}.bias"] += g.sum(axis=0)
                g = g @ params[f"{idx}.weight"]
            elif isinstance(layer, LeakyReLU):
                g = g * xp.where(h_in > 0, acc.type(1), acc.type(layer.negative_slope))
            elif isinstance(layer, ReLU):
                g = g * (h_in > 0)
            else:
                g = g * (1 - h_out * h_out)
        # g: gradient of the first Linear's output, (chunk, hidden)
        dAs += scatter_rows(xp, cols, g, prep.num_src)
        dAd += scatter_rows(xp, rows, g, prep.num_dst)
        if ef is not None:
            dWeT += ef.T @ g
            d_ef = g @ state.WeT.T  # (chunk, fe)
            for item in prep.edge_items:
                if item[0] == "x":
                    _, off, width, xcol = item
                    dEX[e0:e1, xcol:xcol + width] = d_ef[:, off:off + width]
                    continue
                if item[0] == "disp":
                    g_disp = d_ef[:, item[1]:item[1] + prep.pd]
                else:  # d|d|/dd = d / |d|, 0 at d = 0
                    dist = xp.sqrt((disp * disp).sum(axis=1, keepdims=True))
                    g_disp = d_ef[:, item[1]:item[1] + 1] * disp / xp.where(dist > 0, dist, 1)
                # displacement = pos[src] - pos[dst]
                dpos += scatter_rows(xp, cols, g_disp, prep.num_src)
                dpos -= scatter_rows(xp, rows, g_disp, prep.num_dst)
    # the first Linear's node columns and the node arguments' gradients
    W1 = params["0.weight"]
    dW1 = xp.zeros(W1.shape, acc)
    arg_grads = [None] * len(args)
    for k, role, arr, cols_w in prep.node_cols:
        g_node = dAs if role == "src" else dAd
        x = arr.astype(acc, copy=False)
        dW1[:, cols_w] = g_node.T @ x
        orig = args[k][2]
        arg_grads[k] = (g_node @ W1[:, cols_w]).reshape(orig.shape).astype(orig.dtype, copy=False)
    # finish_grads reads the later layers and the first Linear's edge columns from one packed
    # array, laid out as the fused kernels write it
    pg = xp.zeros(prep.P.shape[0] + dWeT.size, acc)
    for name, off, shape in prep.p_index:
        pg[off:off + int(np.prod(shape))] = g_layers[name].reshape(-1)
    pg[prep.P.shape[0]:] = dWeT.reshape(-1)
    res = finish_grads(prep, dict(net.named_parameters()), args, value, dW1, dAd, pg,
                       dEX, dv.reshape(prep.num_src, row_width(dv)), dpos, graph, arg_grads)
    att = state.plans["backward"]
    plan = _plan("backward", prep, net, att, H, chunk,
                 f"{att.run_info.get('kernel', att.family)}, then the score network backward "
                 f"in chunks of {chunk} edges ({prep.library})",
                 "displacement/distance gradients routed to positions per edge chunk")
    res["plan"] = plan
    return res


FAMILY = "score network per edge (array ops) + attention over an (E, H) edge score"


def _plan(op, prep, net, att, H, chunk, kernel, geometry):
    """The plan of one per-head call: what ran (`kernel`), and the attention plan's cache / IR."""
    plan = make_plan(op, prep, net, family=FAMILY)
    plan.run_info.update(
        kernel=kernel, heads=H, chunk=chunk, copies=list(prep.copies),
        cache=att.run_info.get("cache"), ir=att.run_info.get("ir"),
        geometry=geometry if prep.geometric else None)
    return plan
