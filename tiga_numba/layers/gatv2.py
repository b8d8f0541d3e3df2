"""GATv2Conv (Brody et al.) with PyG's arguments, parameters and results.

    s_ij  = att . leaky_relu(x_l[j] + x_r[i] [+ W_e e_ij])      (per head)
    out_i = sum_j softmax_j(s_ij) x_l[j]

The score is not a sum of per-node terms, so it is computed per edge (all heads at once) in
chunks of edges: the (chunk, H, C) temporaries stay bounded (about 4M elements), never
(E, H, C). The attention itself runs on the fused kernels with the (E, H) score as an edge
score; its gradient (E, H) flows back through the same chunks to x_l, x_r, att and W_e.
"""
from __future__ import annotations

import numpy as np

from ._edges import edge_set, gather, scatter_rows, xp_of
from ._module import (Layer, column_sums, glorot, heads_grad, heads_out,
                      linear_grads)
from .gat import check_fill_value, edge_attention

__all__ = ["GATv2Conv"]

CHUNK_ELEMENTS = 1 << 22  # edges per chunk * H * C


class GATv2Conv(Layer):
    """PyG's GATv2Conv. Parameters: `lin_l.weight`, `lin_l.bias`, `lin_r.weight`, `lin_r.bias`
    ((H*C, F); share_weights=True keeps one projection, listed under both names as in PyG),
    `att` (1, H, C), `lin_edge.weight` (H*C, edge_dim), `res.weight`, `bias`."""

    def __init__(self, in_channels, out_channels, heads=1, concat=True, negative_slope=0.2,
                 dropout=0.0, add_self_loops=True, edge_dim=None, fill_value="mean", bias=True,
                 share_weights=False, residual=False, *, dtype=np.float32, seed=None):
        super().__init__(dtype)
        self._common_args(in_channels, out_channels, heads, concat, dropout, edge_dim)
        self.negative_slope = float(negative_slope)
        self.add_self_loops = bool(add_self_loops)
        self.fill_value = check_fill_value(fill_value, self.edge_dim)
        self.bias = bool(bias)
        self.share_weights = bool(share_weights)
        self.residual = bool(residual)
        self._in_pair = (self.in_channels,) * 2 if isinstance(self.in_channels, int) else self.in_channels
        fs, fd = self._in_pair
        if self.share_weights and fs != fd:
            raise ValueError(f"share_weights=True needs equal source and destination features, "
                             f"got in_channels={self.in_channels}")
        H, C, dt = self.heads, self.out_channels, self.dtype
        rng = np.random.default_rng(seed)
        total = C * (H if self.concat else 1)
        self._add("att", glorot(rng, (1, H, C), H, C, dt))
        if self.bias:
            self._add("bias", np.zeros(total, dt))
        self._add("lin_l.weight", glorot(rng, (H * C, fs), fs, H * C, dt))
        if self.bias:
            self._add("lin_l.bias", np.zeros(H * C, dt))
        if self.share_weights:
            self._add("lin_r.weight", self._params["lin_l.weight"])
            if self.bias:
                self._add("lin_r.bias", self._params["lin_l.bias"])
        else:
            self._add("lin_r.weight", glorot(rng, (H * C, fd), fd, H * C, dt))
            if self.bias:
                self._add("lin_r.bias", np.zeros(H * C, dt))
        if self.edge_dim is not None:
            self._add("lin_edge.weight", glorot(rng, (H * C, self.edge_dim), self.edge_dim, H * C, dt))
        if self.residual:
            self._add("res.weight", glorot(rng, (total, fd), fd, total, dt))

    def load_state_dict(self, state_dict, strict=True):
        super().load_state_dict(state_dict, strict)
        if self.share_weights:  # one projection under two names
            self._params["lin_r.weight"] = self._params["lin_l.weight"]
            if self.bias:
                self._params["lin_r.bias"] = self._params["lin_l.bias"]
        return self

    def _project(self, p, side, x):
        y = x @ p[f"lin_{side}.weight"].T
        if self.bias:
            y = y + p[f"lin_{side}.bias"]
        return y.reshape(x.shape[0], self.heads, self.out_channels)

    def _apply(self, p, x_src, x_dst, single, graph, edge_attr, weights=None):
        xp = xp_of(x_src)
        H, C, slope = self.heads, self.out_channels, self.negative_slope
        xl = self._project(p, "l", x_src)
        if x_dst is None:
            raise ValueError("GATv2Conv needs x_dst (PyG asserts it): pass (x_src, x_dst)")
        xr = xl if (single and self.share_weights) else self._project(p, "r", x_dst)
        es = edge_set(graph, self.add_self_loops, xp)
        E = es.num_edges
        ea = None
        if edge_attr is not None:
            ea = es.edge_attr(edge_attr, self.fill_value)
        w_e = p.get("lin_edge.weight")
        att = p["att"][0]
        chunk = max(1, CHUNK_ELEMENTS // (H * C))
        dt = xl.dtype.type

        def pre_activation(e0, e1):
            z = gather(xp, xl, es.cols[e0:e1])
            z += gather(xp, xr, es.rows[e0:e1])
            if ea is not None:
                z += (ea[e0:e1] @ w_e.T).reshape(e1 - e0, H, C)
            return z

        score = xp.empty((E, H), dtype=xl.dtype)
        for e0 in range(0, E, chunk):
            e1 = min(E, e0 + chunk)
            z = pre_activation(e0, e1)
            score[e0:e1] = xp.einsum("ehc,hc->eh", xp.where(z > 0, z, z * dt(slope)), att)
        out_h, attn_backward = edge_attention(xl, score, es, weights=weights)
        if weights is not None:
            weights["edges"] = es
        out = heads_out(out_h, self.concat)
        if self.residual:
            out = out + x_dst @ p["res.weight"].T
        if self.bias:
            out = out + p["bias"]

        def backward(dout):
            g = {}
            dxd_in = None
            if self.bias:
                g["bias"] = column_sums(dout)
            if self.residual:
                g["res.weight"], dxd_in = linear_grads(dout, x_dst, p["res.weight"])
            dxl, dscore = attn_backward(heads_grad(xp, dout, H, C, self.concat))
            dxl = dxl.reshape(-1, H * C).copy()
            dxr = xp.zeros((xr.shape[0], H * C), dtype=xl.dtype)
            d_att = xp.zeros((H, C), dtype=xl.dtype)
            d_we = xp.zeros((H * C, self.edge_dim), dtype=xl.dtype) if ea is not None else None
            d_ea = xp.empty((E, self.edge_dim), dtype=xl.dtype) if ea is not None else None
            for e0 in range(0, E, chunk):
                e1 = min(E, e0 + chunk)
                z = pre_activation(e0, e1)
                pos = z > 0
                ds = dscore[e0:e1]
                d_att += xp.einsum("eh,ehc->hc", ds, xp.where(pos, z, z * dt(slope)))
                dz = ds[:, :, None] * att
                dz = xp.where(pos, dz, dz * dt(slope)).reshape(e1 - e0, H * C)
                dxl += scatter_rows(xp, es.cols[e0:e1], dz, xl.shape[0])
                dxr += scatter_rows(xp, es.rows[e0:e1], dz, xr.shape[0])
                if ea is not None:
                    d_we += dz.T @ ea[e0:e1]
                    d_ea[e0:e1] = dz @ w_e
            g["att"] = d_att[None]
            if ea is not None:
                g["lin_edge.weight"] = d_we
            d_edge_attr = None if ea is None else es.edge_attr_grad(d_ea, self.fill_value, es.num_in, ea)
            gwl, dx_src = linear_grads(dxl, x_src, p["lin_l.weight"])
            gbl = column_sums(dxl)
            if single and self.share_weights:
                gwl2, dx2 = linear_grads(dxr, x_src, p["lin_l.weight"])
                gwl, gbl, dx_src = gwl + gwl2, gbl + column_sums(dxr), dx_src + dx2
                gwr, gbr, dx_dst = gwl, gbl, dxd_in
            else:
                gwr, dx_dst = linear_grads(dxr, x_dst, p["lin_r.weight"])
                gbr = column_sums(dxr)
                if dxd_in is not None:
                    dx_dst = dx_dst + dxd_in
                if self.share_weights:  # one parameter: its gradient under both names
                    gwl = gwr = gwl + gwr
                    gbl = gbr = gbl + gbr
            g["lin_l.weight"], g["lin_r.weight"] = gwl, gwr
            if self.bias:
                g["lin_l.bias"], g["lin_r.bias"] = gbl, gbr
            return dx_src, dx_dst, d_edge_attr, g

        return out, backward
