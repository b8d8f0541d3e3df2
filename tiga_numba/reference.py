"""Float64 numpy oracle: materialises every edge of the relation and computes attention,
its gradients, and the tile-pruning rule the slow obvious way. For tests and examples only.

Inputs may be numpy or cupy (copied to the host); results are float64 numpy arrays.
"""
from __future__ import annotations

import numpy as np

from .graph import Graph, _rows_of


def _host64(a):
    if a is None:
        return None
    if not isinstance(a, np.ndarray) and hasattr(a, "get"):
        a = a.get()
    return np.asarray(a, dtype=np.float64)


def _as3(q, k, v):
    squeezed = q.ndim == 2
    if squeezed:
        q, k, v = q[:, None], k[:, None], v[:, None]
    return q, k, v, squeezed


def _edges(graph: Graph):
    indptr, indices = graph._host_csr()
    return _rows_of(indptr), indices.astype(np.int64)


def _scores(q, k, graph, scale, edge_bias):
    H, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
    if scale is None:
        scale = D ** -0.5 if D else 1.0
    rows, cols = _edges(graph)
    kv_head = np.arange(H) // (H // Hkv)
    s = np.einsum("ehd,ehd->eh", q[rows], k[cols][:, kv_head]) * scale
    if edge_bias is not None:
        s = s + (edge_bias[:, None] if edge_bias.ndim == 1 else edge_bias)
    return s, rows, cols, kv_head, scale


def _softmax_stats(s, rows, num_dst):
    H = s.shape[1]
    m = np.full((num_dst, H), -np.inf)
    np.maximum.at(m, rows, s)
    p_unnorm = np.exp(s - m[rows])
    l = np.zeros((num_dst, H))
    np.add.at(l, rows, p_unnorm)
    return m, l, p_unnorm


def attention(q, k, v, graph, *, scale=None, edge_bias=None, return_stats=False):
    """out (num_dst, H, Dv) float64 [, m, l (num_dst, H)]; empty rows: 0, -inf, 0."""
    q, k, v, edge_bias = (_host64(a) for a in (q, k, v, edge_bias))
    q, k, v, squeezed = _as3(q, k, v)
    s, rows, cols, kv_head, _ = _scores(q, k, graph, scale, edge_bias)
    m, l, p_unnorm = _softmax_stats(s, rows, graph.num_dst)
    num = np.zeros((graph.num_dst, q.shape[1], v.shape[2]))
    np.add.at(num, rows, p_unnorm[:, :, None] * v[cols][:, kv_head])
    safe_l = np.where(l > 0, l, 1.0)
    out = num / safe_l[:, :, None]
    if squeezed:
        out, m, l = out[:, 0], m[:, 0], l[:, 0]
    return (out, m, l) if return_stats else out


def attention_backward(dout, q, k, v, graph, *, scale=None, edge_bias=None):
    """Analytic gradients (dq, dk, dv, dbias) in float64; dbias is (E, H) (whatever the bias
    shape) or None."""
    dout, q, k, v, eb = (_host64(a) for a in (dout, q, k, v, edge_bias))
    q, k, v, squeezed = _as3(q, k, v)
    if squeezed:
        dout = dout[:, None]
    s, rows, cols, kv_head, scale = _scores(q, k, graph, scale, eb)
    m, l, p_unnorm = _softmax_stats(s, rows, graph.num_dst)
    p = p_unnorm / l[rows]
    vg = v[cols][:, kv_head]  # (E, H, Dv)
    out = np.zeros((graph.num_dst, q.shape[1], v.shape[2]))
    np.add.at(out, rows, p[:, :, None] * vg)
    delta = np.einsum("nhd,nhd->nh", dout, out)
    dp = np.einsum("ehd,ehd->eh", dout[rows], vg)
    ds = p * (dp - delta[rows])
    dq = np.zeros_like(q)
    np.add.at(dq, rows, ds[:, :, None] * k[cols][:, kv_head] * scale)
    dk_h = ds[:, :, None] * q[rows] * scale  # (E, H, D) per query head
    dv_h = p[:, :, None] * dout[rows]
    dk = np.zeros_like(k)
    dv = np.zeros_like(v)
    for h in range(q.shape[1]):
        np.add.at(dk[:, kv_head[h]], cols, dk_h[:, h])
        np.add.at(dv[:, kv_head[h]], cols, dv_h[:, h])
    dbias = ds if edge_bias is not None else None  # (E, H): sum over heads for a (E,) bias
    if squeezed:
        dq, dk, dv = dq[:, 0], dk[:, 0], dv[:, 0]
    return dq, dk, dv, dbias


def pruned_attention(q, k, v, graph, *, rho, block_m, block_n, scale=None, return_stats=False):
    """The tile-pruning admission rule, applied literally on an implicit relation.

    Query blocks of `block_m` rows and key tiles of `block_n` columns are aligned to the start
    of each relation block; key tiles are visited in increasing order (banded blocks: only
    the tiles the band touches). Per head, a tile is admitted iff max(its valid scores) >=
    m_run_block + ln(rho), m_run_block being the running max over the whole query block
    (admitted tiles only; a rejected tile's max is below it anyway). Returns out (and m, l,
    and the (pruned, total) tile counts with return_stats=True)."""
    if not graph.is_implicit:
        raise NotImplementedError("tile pruning is defined for implicit relations only")
    q, k, v = (_host64(a) for a in (q, k, v))
    q, k, v, squeezed = _as3(q, k, v)
    H, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
    if scale is None:
        scale = D ** -0.5 if D else 1.0
    rel = graph.realize("cpu")
    out = np.zeros((graph.num_dst, H, v.shape[2]))
    m_all = np.full((graph.num_dst, H), -np.inf)
    l_all = np.zeros((graph.num_dst, H))
    log_rho = np.log(rho)
    pruned = total = 0
    for b in range(rel.num_blocks):
        d0, d1 = int(rel.dst_offsets[b]), int(rel.dst_offsets[b + 1])
        s0, s1 = int(rel.src_offsets[b]), int(rel.src_offsets[b + 1])
        lo, hi = int(rel.lo[b]), int(rel.hi[b])
        for h in range(H):
            hk = h // (H // Hkv)
            for i0 in range(d0, d1, block_m):
                i1 = min(i0 + block_m, d1)
                m_run = np.full(i1 - i0, -np.inf)
                l_run = np.zeros(i1 - i0)
                acc = np.zeros((i1 - i0, v.shape[2]))
                block_max = -np.inf
                # key tiles stay aligned to the block start; those left of the band's first
                # key or right of its last one are never visited
                first = s0 + (max(0, i0 - d0 + lo) // block_n) * block_n
                last = min(s1, s0 + (i1 - 1 - d0) + hi + 1)
                for j0 in range(first, last, block_n):
                    j1 = min(j0 + block_n, last)
                    s = q[i0:i1, h] @ k[j0:j1, hk].T * scale
                    qi = np.arange(i0 - d0, i1 - d0)[:, None]
                    kj = np.arange(j0 - s0, j1 - s0)[None, :]
                    s = np.where((kj - qi >= lo) & (kj - qi <= hi), s, -np.inf)
                    total += 1
                    tile_max = s.max()
                    if tile_max < block_max + log_rho:
                        pruned += 1
                        continue
                    block_max = max(block_max, tile_max)
                    m_new = np.maximum(m_run, s.max(axis=1))
                    alpha = np.where(np.isfinite(m_run), np.exp(m_run - m_new), 0.0)
                    p = np.where(np.isfinite(s), np.exp(s - m_new[:, None]), 0.0)
                    l_run = l_run * alpha + p.sum(axis=1)
                    acc = acc * alpha[:, None] + p @ v[j0:j1, hk]
                    m_run = m_new
                safe = np.where(l_run > 0, l_run, 1.0)
                out[i0:i1, h] = acc / safe[:, None]
                m_all[i0:i1, h] = m_run
                l_all[i0:i1, h] = l_run
    if squeezed:
        out, m_all, l_all = out[:, 0], m_all[:, 0], l_all[:, 0]
    if return_stats:
        return out, m_all, l_all, (pruned, total)
    return out
