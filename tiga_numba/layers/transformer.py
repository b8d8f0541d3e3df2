"""TransformerConv (Shi et al., "UniMP") with PyG's arguments, parameters and results.

    q = W_q x_dst + b_q,  k = W_k x_src + b_k,  v = W_v x_src + b_v      (N, H, C)
    s_ij  = q_i . (k_j [+ W_e e_ij]) / sqrt(C)
    out_i = sum_j softmax_j(s_ij) (v_j [+ W_e e_ij])
    then heads concatenated or averaged, plus the root weight W_skip x_dst (or PyG's beta gate).

Without edge features this is exactly the fused attention (dot product, scale 1/sqrt(C)).
With edge features the edge term is split so nothing (E, H, C)-sized is formed:
  * score:  q_i . W_e e_ij = (W_e^T q_i) . e_ij, an (E, H) edge bias from the (N, H, edge_dim)
    projections q'_i = W_e^T q_i;
  * value:  sum_j alpha_ij W_e e_ij = W_e (sum_j alpha_ij e_ij): the attention weights alpha
    (E, H) are rebuilt from the forward's (m, l) and the per-edge scores (computed in edge chunks
    of bounded size) and the edge features are summed per destination with sparse products.
The backward adds the edge value term's share of the score gradient to the kernel's, and routes
it through the same sparse products. Temporaries with edge features: alpha, the score bias and
their gradients, (E, H) each.
"""
from __future__ import annotations

import math

import numpy as np

from ..functional import run_backward, run_forward
from ._edges import edge_set, gather, xp_of
from ._module import Layer, column_sums, heads_grad, heads_out, kaiming_linear
from .gat import attention_weights, row_stats

__all__ = ["TransformerConv"]

CHUNK_ELEMENTS = 1 << 22


class TransformerConv(Layer):
    """PyG's TransformerConv. Parameters: `lin_key`, `lin_query`, `lin_value` (`.weight`
    (H*C, F), `.bias` (H*C,) when bias), `lin_edge.weight` (H*C, edge_dim), `lin_skip`
    (root_weight; (H*C or C, F_dst)), `lin_beta.weight` (1, 3*H*C or 3*C) with beta."""

    def __init__(self, in_channels, out_channels, heads=1, concat=True, beta=False, dropout=0.0,
                 edge_dim=None, bias=True, root_weight=True, *, dtype=np.float32, seed=None):
        super().__init__(dtype)
        self._common_args(in_channels, out_channels, heads, concat, dropout, edge_dim)
        self.root_weight = bool(root_weight)
        self.beta = bool(beta) and self.root_weight  # PyG: beta only with the root weight
        self.bias = bool(bias)
        self._in_pair = (self.in_channels,) * 2 if isinstance(self.in_channels, int) else self.in_channels
        fs, fd = self._in_pair
        H, C, dt = self.heads, self.out_channels, self.dtype
        rng = np.random.default_rng(seed)

        def linear(name, out_f, in_f, bias):
            w, b = kaiming_linear(rng, out_f, in_f, dt, bias)
            self._add(f"{name}.weight", w)
            if b is not None:
                self._add(f"{name}.bias", b)

        linear("lin_key", H * C, fs, self.bias)
        linear("lin_query", H * C, fd, self.bias)
        linear("lin_value", H * C, fs, self.bias)
        if self.edge_dim is not None:
            linear("lin_edge", H * C, self.edge_dim, False)
        total = C * (H if self.concat else 1)
        # PyG builds lin_skip also with root_weight=False (unused then: its gradient is 0)
        linear("lin_skip", total, fd, self.bias)
        if self.beta:
            linear("lin_beta", 1, 3 * total, False)

    def _lin(self, p, name, x):
        y = x @ p[f"{name}.weight"].T
        if self.bias and f"{name}.bias" in p:
            y = y + p[f"{name}.bias"]
        return y

    def _apply(self, p, x_src, x_dst, single, graph, edge_attr, weights=None):
        xp = xp_of(x_src)
        H, C = self.heads, self.out_channels
        if x_dst is None:
            raise ValueError("TransformerConv needs x_dst: pass (x_src, x_dst)")
        if self.edge_dim is not None and edge_attr is None:
            raise ValueError("edge_attr is required: TransformerConv was built with "
                             f"edge_dim={self.edge_dim}")
        ns, nd = x_src.shape[0], x_dst.shape[0]
        q = self._lin(p, "lin_query", x_dst).reshape(nd, H, C)
        k = self._lin(p, "lin_key", x_src).reshape(ns, H, C)
        v = self._lin(p, "lin_value", x_src).reshape(ns, H, C)
        scale = 1.0 / math.sqrt(C)
        es = edge_set(graph, False, xp)
        E = es.num_edges
        ea = bias = q_e = alpha = out_a = None
        if edge_attr is not None:
            ea = es.edge_attr(edge_attr, 0.0)
            w_e3 = p["lin_edge.weight"].reshape(H, C, self.edge_dim)
            q_e = xp.einsum("nhc,hcd->nhd", q, w_e3)  # (nd, H, edge_dim)
            bias = self._edge_dot(xp, q_e, ea, es) * q.dtype.type(scale)
        out_v, stats, _ = run_forward(q, k, v, es.graph, scale=scale, edge_bias=bias)
        out_h = out_v
        if ea is not None or weights is not None:
            alpha = self._alpha(xp, q, k, bias, stats, es, scale)
        if weights is not None:
            weights["alpha"], weights["edges"] = alpha, es
        if ea is not None:
            out_a = xp.stack([xp.asarray(es.edge_matrix(alpha[:, h]) @ ea) for h in range(H)], axis=1)
            out_h = out_v + xp.einsum("nhd,hcd->nhc", out_a, w_e3)
        o = heads_out(out_h, self.concat)
        x_r = gate = None
        if self.root_weight:
            x_r = self._lin(p, "lin_skip", x_dst)
            if self.beta:
                w_b = p["lin_beta.weight"][0]
                logit = xp.concatenate([o, x_r, o - x_r], axis=-1) @ w_b
                gate = (1.0 / (1.0 + xp.exp(-logit)))[:, None]
                out = gate * x_r + (1 - gate) * o
            else:
                out = o + x_r
        else:
            out = o

        def backward(dout):
            g = {}
            dx_dst = None
            if self.root_weight:
                if self.beta:
                    d_o = (1 - gate) * dout
                    d_xr = gate * dout
                    d_gate = ((x_r - o) * dout).sum(axis=-1)
                    d_logit = d_gate * (gate[:, 0] * (1 - gate[:, 0]))
                    cat = xp.concatenate([o, x_r, o - x_r], axis=-1)
                    g["lin_beta.weight"] = (d_logit @ cat)[None]
                    f = o.shape[1]
                    w1, w2, w3 = w_b[:f], w_b[f:2 * f], w_b[2 * f:]
                    d_o = d_o + d_logit[:, None] * (w1 + w3)
                    d_xr = d_xr + d_logit[:, None] * (w2 - w3)
                else:
                    d_o, d_xr = dout, dout
                g["lin_skip.weight"] = d_xr.T @ x_dst
                if self.bias:
                    g["lin_skip.bias"] = column_sums(d_xr)
                dx_dst = d_xr @ p["lin_skip.weight"]
            else:
                d_o = dout
            d_h = heads_grad(xp, d_o, H, C, self.concat)
            dq, dk, dv, dbias, _ = run_backward(d_h, q, k, v, out_v, stats, es.graph, scale=scale,
                                                edge_bias=bias)
            if ea is not None:
                dq, dk = dq.copy(), dk.copy()
                dbias = (xp.zeros((E, H), q.dtype) if dbias is None else dbias).astype(q.dtype)
                g_e = xp.einsum("nhc,hcd->nhd", d_h, w_e3)  # d out_a
                d_we3 = xp.einsum("nhc,nhd->hcd", d_h, out_a)
                # the edge value term's share of the score gradient:
                # alpha_e (g_i . e_ij - g_i . out_a_i)
                extra = alpha * (self._edge_dot(xp, g_e, ea, es)
                                 - gather(xp, xp.einsum("nhd,nhd->nh", g_e, out_a), es.rows))
                d_ea = xp.zeros((E, self.edge_dim), dtype=q.dtype)
                sc = q.dtype.type(scale)
                for h in range(H):
                    m_alpha = es.edge_matrix(alpha[:, h])
                    d_ea += xp.asarray(m_alpha.T @ g_e[:, h, :])
                    adj = es.adjacency(extra[:, h])
                    dq[:, h, :] += sc * xp.asarray(adj @ k[:, h, :])
                    dk[:, h, :] += sc * xp.asarray(adj.T @ q[:, h, :])
                dbias = dbias + extra
                # bias_e = scale * q'_i . e_ij
                d_qe = xp.empty_like(q_e)
                for h in range(H):
                    m_b = es.edge_matrix(dbias[:, h])
                    d_qe[:, h, :] = sc * xp.asarray(m_b @ ea)
                    d_ea += sc * xp.asarray(m_b.T @ q_e[:, h, :])
                dq += xp.einsum("nhd,hcd->nhc", d_qe, w_e3)
                d_we3 = d_we3 + xp.einsum("nhc,nhd->hcd", q, d_qe)
                g["lin_edge.weight"] = d_we3.reshape(H * C, self.edge_dim)
                d_edge_attr = es.edge_attr_grad(d_ea, 0.0, es.num_in)
            else:
                d_edge_attr = None
            dq2, dk2, dv2 = (a.reshape(a.shape[0], H * C) for a in (dq, dk, dv))
            dx_src = 0
            for name, d, x in (("lin_key", dk2, x_src), ("lin_value", dv2, x_src),
                               ("lin_query", dq2, x_dst)):
                g[f"{name}.weight"] = d.T @ x
                if self.bias:
                    g[f"{name}.bias"] = column_sums(d)
                dx = d @ p[f"{name}.weight"]
                if name == "lin_query":
                    dx_dst = dx if dx_dst is None else dx_dst + dx
                else:
                    dx_src = dx_src + dx
            return dx_src, dx_dst, d_edge_attr, g

        return out, backward

    @staticmethod
    def _edge_dot(xp, node, ea, es):
        """(E, H): node[rows[e], h, :] . ea[e, :], in edge chunks."""
        E, H, d = es.num_edges, node.shape[1], node.shape[2]
        out = xp.empty((E, H), dtype=node.dtype)
        chunk = max(1, CHUNK_ELEMENTS // max(1, H * d))
        for e0 in range(0, E, chunk):
            e1 = min(E, e0 + chunk)
            out[e0:e1] = xp.einsum("ehd,ed->eh", gather(xp, node, es.rows[e0:e1]), ea[e0:e1])
        return out

    @staticmethod
    def _alpha(xp, q, k, bias, stats, es, scale):
        """Attention weights (E, H) rebuilt from the forward's (m, l) and the edge scores."""
        E, H, C = es.num_edges, q.shape[1], q.shape[2]
        alpha = xp.empty((E, H), dtype=q.dtype)
        m, linv = row_stats(xp, stats)
        chunk = max(1, CHUNK_ELEMENTS // max(1, H * C))
        for e0 in range(0, E, chunk):
            e1 = min(E, e0 + chunk)
            r = es.rows[e0:e1]
            s = xp.einsum("ehc,ehc->eh", gather(xp, q, r), gather(xp, k, es.cols[e0:e1]))
            s = s * scale if bias is None else s * scale + bias[e0:e1]
            alpha[e0:e1] = attention_weights(xp, s, r, m, linv)
        return alpha
