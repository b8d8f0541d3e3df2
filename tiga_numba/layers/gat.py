"""GATConv (Velickovic et al.) with PyG's arguments, parameters and results.

    alpha_ij = softmax_j( leaky_relu(a_src . x_src[j] + a_dst . x_dst[i] [+ a_edge . W_e e_ij]) )
    out_i    = sum_j alpha_ij x_src[j]          (per head; heads concatenated or averaged)

The score is a per-edge, per-head additive term, so the attention runs on the fused kernels as
an edge score ((E, H), no dot product: q and k of head dim 0) over values x_src (N, H, C); the
backward returns the score's gradient (E, H), from which the attention vectors, the node
features, the edge features and W_e get theirs. Temporaries: the (E, H) score (the
pre-activation is overwritten by it) and its gradient; nothing (E, H, C)-sized.
"""
from __future__ import annotations

import numpy as np

from .. import interop
from ..functional import run_backward, run_forward
from ._edges import edge_set, gather, xp_of
from ._module import (Layer, column_sums, glorot, head_dots,
                      head_weighted_sums, heads_grad, heads_out, linear_grads)

__all__ = ["GATConv", "check_fill_value"]


FILL_REDUCTIONS = ("mean", "add", "sum", "max", "min", "mul", "any")


def check_fill_value(fill_value, edge_dim=None):
    """PyG's `fill_value` of the added self loops' edge attributes: a number, an array of
    edge_dim numbers (PyG's Tensor fill: one value per edge feature; numpy, cupy or torch, kept as
    a float64 host array and moved to the layer's device when used), or the name of the
    reduction of the node's incoming attributes (torch_geometric.utils.scatter's: "mean",
    "add" / "sum", "max", "min", "mul", "any"; "any" is accepted here and refused where it
    would be used, see layers._edges.EdgeSet.edge_attr)."""
    if isinstance(fill_value, str):
        if fill_value not in FILL_REDUCTIONS:
            raise ValueError(f"fill_value must be a number or one of {FILL_REDUCTIONS}, "
                             f"got {fill_value!r}")
        return fill_value
    if isinstance(fill_value, (int, float, np.integer, np.floating)) and not isinstance(fill_value, bool):
        return float(fill_value)
    if hasattr(fill_value, "shape") and hasattr(fill_value, "dtype"):   # an array or tensor
        host = interop.to_host(fill_value, "fill_value")
        if host.dtype.kind not in "iuf" or host.ndim > 1:
            raise ValueError(f"fill_value as an array must hold real numbers in at most one "
                             f"dimension (edge_dim values), got dtype {host.dtype} and shape "
                             f"{tuple(host.shape)}")
        if host.ndim == 0:
            return float(host)
        if edge_dim is not None and host.shape[0] not in (1, edge_dim):
            raise ValueError(f"fill_value has {host.shape[0]} values, expected 1 or edge_dim={edge_dim}")
        return host.astype(np.float64)
    raise TypeError(f"fill_value must be a number, an array of edge_dim numbers or one of "
                    f"{FILL_REDUCTIONS}, got {type(fill_value).__name__}")


def leaky_relu(xp, pre, slope):
    """leaky_relu(pre), in place when 0 <= slope <= 1 (then it is max(pre, slope * pre))."""
    s = pre.dtype.type(slope)
    if 0 <= slope <= 1:
        return xp.maximum(pre, pre * s, out=pre)
    return xp.where(pre > 0, pre, pre * s)


def leaky_relu_grad(xp, out, grad, slope):
    """Gradient through leaky_relu given its output (torch's rule: slope where the input is
    <= 0). For slope >= 0 the output is > 0 exactly where the input is, so the input need not
    be kept; a negative slope flips the sign, handled by the caller keeping the input.
    Overwrites `grad` (the caller's own (E, H) buffer): no new (E, H) float array."""
    s = grad.dtype.type(slope)
    if xp is np:
        if grad.flags.c_contiguous and out.flags.c_contiguous and out.shape == grad.shape:
            from ..cpu.threads import run, useful
            from ._cpu import leaky_relu_grad_inplace
            run(leaky_relu_grad_inplace, useful(work=grad.size), out, grad, s)
            return grad
        return np.multiply(grad, s, out=grad, where=~(out > 0))
    grad *= xp.where(out > 0, grad.dtype.type(1), s)
    return grad


def edge_attention(values, score, es, plans=None, weights=None):
    """Per-head softmax of `score` (E, H) over each destination's edges, weighting
    `values` (num_src, Hv, C) with H % Hv == 0 (head h reads value head h // (H // Hv), as in
    grouped-query attention). Returns (out (num_dst, H, C), backward(dout) -> (dvalues,
    dscore)). The score runs on the fused kernels as a per-edge bias with zero-width q and k.
    `plans`, a dict when given, receives the kernels' plans under "forward" and "backward";
    `weights`, a dict when given, receives the attention weights (E, H) under "alpha"."""
    xp = xp_of(values)
    Hv = values.shape[1]
    H = score.shape[1] if score.ndim == 2 else Hv
    q = xp.empty((es.num_dst, H, 0), dtype=values.dtype)
    k = xp.empty((es.num_src, Hv, 0), dtype=values.dtype)
    out, stats, plan = run_forward(q, k, values, es.graph, scale=1.0, edge_bias=score)
    if plans is not None:
        plans["forward"] = plan
    if weights is not None:
        weights["alpha"] = attention_weights(xp, score if score.ndim == 2 else score[:, None], es.rows,
                                             *row_stats(xp, stats))

    def backward(dout):
        _, _, dv, dscore, bplan = run_backward(dout, q, k, values, out, stats, es.graph,
                                               scale=1.0, edge_bias=score)
        if plans is not None:
            plans["backward"] = bplan
        if dscore is None:  # no edges
            dscore = xp.zeros((es.num_edges, H), dtype=values.dtype)
        return dv, dscore.astype(values.dtype, copy=False)

    return out, backward


def row_stats(xp, stats):
    """(m, 1 / l) per (row, head) of a forward's stats, what attention_weights reads (1 / l is
    taken as 1 for a row without edges: no edge reads it)."""
    return xp.asarray(stats.m), 1.0 / xp.where(stats.l > 0, stats.l, 1)


def attention_weights(xp, score, rows, m, linv):
    """The softmax weights exp(score - m[row]) / l[row] of per-edge scores `score` (E, H) (or
    (E, 1): one score for every head) of edges ending in `rows`, from row_stats."""
    return (xp.exp(score - gather(xp, m, rows)) * gather(xp, linv, rows)).astype(score.dtype, copy=False)


class GATConv(Layer):
    """PyG's GATConv. Parameters (PyG names): `lin.weight` (H*C, F) (or `lin_src.weight`,
    `lin_dst.weight` for in_channels=(F_src, F_dst)), `att_src`, `att_dst` (1, H, C),
    `lin_edge.weight` (H*C, edge_dim) and `att_edge` (1, H, C) with edge_dim, `res.weight`
    with residual, `bias` (H*C or C).

    `layer(x, graph, edge_attr=None)`; `x` is (N, F) or a pair (x_src, x_dst) for a bipartite
    graph (rows of graph = destinations). `edge_attr` (E, edge_dim) is in the order of the
    edges given to the graph's constructor."""

    def __init__(self, in_channels, out_channels, heads=1, concat=True, negative_slope=0.2,
                 dropout=0.0, add_self_loops=True, edge_dim=None, fill_value="mean", bias=True,
                 residual=False, *, dtype=np.float32, seed=None):
        super().__init__(dtype)
        self._common_args(in_channels, out_channels, heads, concat, dropout, edge_dim)
        self.negative_slope = float(negative_slope)
        self.add_self_loops = bool(add_self_loops)
        self.fill_value = check_fill_value(fill_value, self.edge_dim)
        self.residual = bool(residual)
        self.bias = bool(bias)
        shared = isinstance(self.in_channels, int)
        self._shared = shared
        self._in_pair = (self.in_channels,) * 2 if shared else self.in_channels
        fs, fd = self._in_pair
        H, C, dt = self.heads, self.out_channels, self.dtype
        rng = np.random.default_rng(seed)
        total = C * (H if self.concat else 1)
        # PyG's state_dict order: own parameters, then submodules
        self._add("att_src", glorot(rng, (1, H, C), H, C, dt))
        self._add("att_dst", glorot(rng, (1, H, C), H, C, dt))
        if self.edge_dim is not None:
            self._add("att_edge", glorot(rng, (1, H, C), H, C, dt))
        if self.bias:
            self._add("bias", np.zeros(total, dt))
        if shared:
            self._add("lin.weight", glorot(rng, (H * C, fs), fs, H * C, dt))
        else:
            self._add("lin_src.weight", glorot(rng, (H * C, fs), fs, H * C, dt))
            self._add("lin_dst.weight", glorot(rng, (H * C, fd), fd, H * C, dt))
        if self.edge_dim is not None:
            self._add("lin_edge.weight", glorot(rng, (H * C, self.edge_dim), self.edge_dim, H * C, dt))
        if self.residual:
            self._add("res.weight", glorot(rng, (total, fd), fd, total, dt))

    def _apply(self, p, x_src, x_dst, single, graph, edge_attr, weights=None):
        xp = xp_of(x_src)
        H, C, slope = self.heads, self.out_channels, self.negative_slope
        ns = x_src.shape[0]
        w_src = p["lin.weight"] if self._shared else p["lin_src.weight"]
        w_dst = p["lin.weight"] if self._shared else p["lin_dst.weight"]
        xs = (x_src @ w_src.T).reshape(ns, H, C)
        same = single and self._shared  # one projection serves both ends
        if x_dst is None:
            xd = None
        elif same:
            xd = xs
        else:
            xd = (x_dst @ w_dst.T).reshape(x_dst.shape[0], H, C)
        att_src, att_dst = p["att_src"][0], p["att_dst"][0]
        a_src = head_dots(xs, att_src)
        a_dst = None if xd is None else head_dots(xd, att_dst)
        es = edge_set(graph, self.add_self_loops, xp)
        pre = gather(xp, a_src, es.cols)
        if a_dst is not None:
            pre += gather(xp, a_dst, es.rows)
        ea = w_att = None
        if edge_attr is not None:
            ea = es.edge_attr(edge_attr, self.fill_value)
            w_e3 = p["lin_edge.weight"].reshape(H, C, self.edge_dim)
            w_att = xp.einsum("hcd,hc->dh", w_e3, p["att_edge"][0])  # (edge_dim, H)
            pre += ea @ w_att
        keep = pre.copy() if slope < 0 else None  # only a negative slope needs the input
        score = leaky_relu(xp, pre, slope)  # (may reuse pre's memory)
        sign_of = score if keep is None else keep
        out_h, attn_backward = edge_attention(xs, score, es, weights=weights)
        if weights is not None:
            weights["edges"] = es
        out = heads_out(out_h, self.concat)
        res_in = x_dst if x_dst is not None else None
        if self.residual and res_in is not None:
            out = out + res_in @ p["res.weight"].T
        if self.bias:
            out = out + p["bias"]

        def backward(dout):
            g = {}
            dxd_in = None
            if self.bias:
                g["bias"] = column_sums(dout)
            if self.residual and res_in is not None:
                g["res.weight"], dxd_in = linear_grads(dout, res_in, p["res.weight"])
            dxs, dscore = attn_backward(heads_grad(xp, dout, H, C, self.concat))
            dpre = leaky_relu_grad(xp, sign_of, dscore, slope)
            da_src = es.sum_by_src(dpre)
            dxs = dxs + da_src[:, :, None] * att_src
            g["att_src"] = head_weighted_sums(da_src, xs)[None]
            dxd = None
            if a_dst is not None:
                da_dst = es.sum_by_dst(dpre)
                dxd = da_dst[:, :, None] * att_dst
                g["att_dst"] = head_weighted_sums(da_dst, xd)[None]
            d_edge_attr = None
            if ea is not None:
                gsum = ea.T @ dpre  # (edge_dim, H): sum_e ea_e dpre_e
                g["att_edge"] = xp.einsum("hcd,dh->hc", w_e3, gsum)[None]
                g["lin_edge.weight"] = (p["att_edge"][0][:, :, None] * gsum.T[:, None, :]).reshape(
                    H * C, self.edge_dim)
                d_edge_attr = es.edge_attr_grad(dpre @ w_att.T, self.fill_value, es.num_in, ea)
            dxs2 = dxs.reshape(ns, H * C)
            if same:
                dxs2 = dxs2 + dxd.reshape(ns, H * C)
                g["lin.weight"], dx_src = linear_grads(dxs2, x_src, w_src)
                dx_dst = dxd_in
            else:
                gw_src, dx_src = linear_grads(dxs2, x_src, w_src)
                dx_dst = dxd_in
                gw_dst = None
                if dxd is not None:
                    dxd2 = dxd.reshape(x_dst.shape[0], H * C)
                    gw_dst, dxx = linear_grads(dxd2, x_dst, w_dst)
                    dx_dst = dxx if dx_dst is None else dx_dst + dxx
                if self._shared:
                    g["lin.weight"] = gw_src if gw_dst is None else gw_src + gw_dst
                else:
                    g["lin_src.weight"] = gw_src
                    g["lin_dst.weight"] = gw_dst
            return dx_src, dx_dst, d_edge_attr, g

        return out, backward
