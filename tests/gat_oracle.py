"""Float64 numpy oracle of the GAT-MLP edge attention model, materialized per edge, with a
hand-derived backward (every intermediate of shape (E, .) is kept: this is the reference,
not the implementation)."""
import numpy as np

import tiga_numba.nn as nn


def _edge_inputs(graph, args):
    indptr, indices = graph.realize("cpu").indptr, graph.realize("cpu").indices
    dst = np.repeat(np.arange(graph.num_dst), np.diff(indptr))
    src = indices.astype(np.int64)
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
            cols.append(disp if name == "displacement" else
                        np.sqrt((disp ** 2).sum(-1, keepdims=True)))
    return src, dst, pos, cols


def forward_backward(graph, net, args, value, dout=None):
    """out and (if dout given) grads in the layout of edge_mlp.backward."""
    src, dst, pos, cols = _edge_inputs(graph, args)
    X = np.concatenate(cols, axis=1)
    layers = net.layers()
    acts = [X]
    for layer in layers:
        h = acts[-1]
        if isinstance(layer, nn.Linear):
            out = h @ np.asarray(layer.weight, np.float64).T + np.asarray(layer.bias, np.float64)
        elif isinstance(layer, nn.LeakyReLU):
            out = np.where(h > 0, h, h * layer.negative_slope)
        elif isinstance(layer, nn.ReLU):
            out = np.maximum(h, 0)
        else:
            out = np.tanh(h)
        acts.append(out)
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
        return out_shaped, m, l
    D = np.asarray(dout, np.float64).reshape(nd, -1)
    dV = np.zeros_like(V)
    np.add.at(dV, src, p[:, None] * D[dst])
    dp = (D[dst] * V[src]).sum(1)
    delta = (D * out).sum(1)
    ds = p * (dp - delta[dst])
    g = ds[:, None]
    params = {}
    for idx in range(len(layers) - 1, -1, -1):
        layer = layers[idx]
        h_in, h_out = acts[idx], acts[idx + 1]
        if isinstance(layer, nn.Linear):
            W = np.asarray(layer.weight, np.float64)
            params[f"{idx}.weight"] = g.T @ h_in
            params[f"{idx}.bias"] = g.sum(0)
            g = g @ W
        elif isinstance(layer, nn.LeakyReLU):
            g = g * np.where(h_in > 0, 1.0, layer.negative_slope)
        elif isinstance(layer, nn.ReLU):
            g = g * (h_in > 0)
        else:
            g = g * (1 - h_out ** 2)
    arg_grads = []
    dpos = np.zeros_like(pos) if pos is not None else None
    c0 = 0
    for (role, name, arr), c in zip(args, cols):
        gc = g[:, c0:c0 + c.shape[1]]
        c0 += c.shape[1]
        if role == "src":
            a = np.zeros((graph.num_src, c.shape[1]))
            np.add.at(a, src, gc)
            arg_grads.append(a.reshape(np.shape(arr)))
        elif role == "dst":
            a = np.zeros((graph.num_dst, c.shape[1]))
            np.add.at(a, dst, gc)
            arg_grads.append(a.reshape(np.shape(arr)))
        elif arr is not None:
            arg_grads.append(gc.reshape(np.shape(arr)))
        else:
            disp = pos[src] - pos[dst]
            if name == "displacement":
                gd = gc
            else:
                dist = np.sqrt((disp ** 2).sum(-1, keepdims=True))
                gd = gc * np.where(dist > 0, disp / np.where(dist > 0, dist, 1), 0)
            np.add.at(dpos, src, gd)
            np.add.at(dpos, dst, -gd)
            arg_grads.append(None)
    return out_shaped, {"args": arg_grads, "value": dV.reshape(value.shape), "params": params,
                        "positions": dpos}
