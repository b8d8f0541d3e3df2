"""Functional API: tg.attention and tg.attention_backward.

    out = tg.attention(q, k, v, graph, scale=None, block_prune_threshold=None, return_stats=False)
    dq, dk, dv = tg.attention_backward(dout, q, k, v, out, stats, graph, scale=None)

numpy arrays run on the CPU backend, cupy arrays on the CUDA backend; results come back in
the caller's library and q's dtype. `run_forward` / `run_backward` are the same calls with
the plan returned and per-edge scores (`edge_bias`) allowed; the program front end uses them.
"""
from __future__ import annotations

import numpy as np

from . import arrays, dispatch
from .merge import log_sum_exp

_last_plan = None


class AttentionStats:
    """Per-row softmax state of a forward: m = max scaled score, l = sum exp(s - m), both
    (num_dst, H) in the accumulation dtype ((num_dst,) for 2-D one-head inputs), and
    lse = m + log(l) (flash-attn's softmax_lse; -inf for an empty row)."""

    __slots__ = ("m", "l", "block_prune_threshold", "plan")

    def __init__(self, m, l, block_prune_threshold=None, plan=None):
        self.m = m
        self.l = l
        self.block_prune_threshold = block_prune_threshold
        self.plan = plan

    def __iter__(self):
        return iter((self.m, self.l))

    @property
    def lse(self):
        """m + log(l) per (destination, head); -inf where the row has no edges."""
        return log_sum_exp(self.m, self.l)

    def __repr__(self):
        return f"AttentionStats(m shape={tuple(self.m.shape)}, l shape={tuple(self.l.shape)}, dtype={self.m.dtype})"


def _xp(library):
    if library == "numpy":
        return np
    import cupy
    return cupy


def last_plan():
    """The plan of the most recent functional call (for explain())."""
    return _last_plan


def explain():
    return _last_plan.explain() if _last_plan is not None else "no attention call has run yet"


def _remember(plan):
    global _last_plan
    _last_plan = plan


def run_forward(q, k, v, graph, *, scale=None, block_prune_threshold=None, edge_bias=None,
                score_mod=None):
    """Validated forward. Returns (out, stats, plan). `score_mod` is a
    score_mod.BoundModifier applied to the scaled score in the kernels."""
    q, k, v, shape, scale = arrays.check_attention_inputs(q, k, v, graph, scale)
    rho = arrays.check_prune_threshold(block_prune_threshold)
    bias = arrays.check_edge_bias(edge_bias, shape, graph)
    _check_modifier(score_mod, shape, graph)
    plan = dispatch.make_plan("forward", graph, shape, scale, prune_threshold=rho, edge_bias=bias,
                              score_mod=score_mod)
    if shape.num_dst == 0 or graph.num_edges == 0 or shape.heads == 0:
        xp = _xp(shape.library)
        # Nothing to reduce: the contract's empty-row values, no kernel launch.
        out = xp.zeros((shape.num_dst, shape.heads, shape.value_dim), dtype=shape.dtype)
        m = xp.full((shape.num_dst, shape.heads), -np.inf, dtype=shape.accum_dtype)
        l = xp.zeros((shape.num_dst, shape.heads), dtype=shape.accum_dtype)
        plan.run_info.update(kernel="none (relation has no edges)", copies=[], cache="n/a",
                             pruned_tiles=0, total_tiles=0)
    else:
        backend = dispatch.backend_module(plan.backend)
        if score_mod is None:
            out, m, l = backend.forward(plan, q, k, v, graph.realize(plan.backend), bias)
        else:
            out, m, l = backend.forward(plan, q, k, v, graph.realize(plan.backend), bias,
                                        score_mod=score_mod)
    _remember(plan)
    if shape.squeezed:
        out, m, l = out[:, 0, :], m[:, 0], l[:, 0]
    return out, AttentionStats(m, l, rho, plan), plan


def _check_modifier(score_mod, shape, graph):
    if score_mod is not None:
        score_mod.check(shape.heads, shape.num_dst, shape.num_src, graph.num_edges,
                        graph.is_implicit)


def flash_modifier(q, graph, softcap, alibi_slopes, want_slopes_grad=False):
    """The score modifier of flash-attn's `softcap=` / `alibi_slopes=` (None when neither is
    given): ``softcap * tanh(s / softcap)``, then ``- slopes[h] * |i - j|`` with the distance
    bottom-right aligned in each rectangular block of a dense or cu_seqlens relation
    (``|r + Lk - Lq - c|`` in block-local positions, as flash-attn); triangular, band and CSR
    relations use the node positions as they are."""
    if softcap is None and alibi_slopes is None:
        return None
    from . import score_mod as sm
    tree = sm.SCORE
    values = {}
    if softcap is not None:
        if isinstance(softcap, (bool, np.bool_)) or not isinstance(
                softcap, (int, float, np.integer, np.floating)):
            raise TypeError(f"softcap must be a real number or None, got {type(softcap).__name__}")
        softcap = float(softcap)
        if not (softcap > 0 and np.isfinite(softcap)):
            raise ValueError(f"softcap must be a finite number > 0, got {softcap}")
        tree = sm.softcap_tree(tree)
        values[sm.Expr("scalar", (), "softcap")] = softcap
    want = ()
    if alibi_slopes is not None:
        lib = arrays.library_of("alibi_slopes", alibi_slopes)
        qlib = arrays.library_of("q", q)
        if lib != qlib:
            raise TypeError(f"alibi_slopes is a {lib} array but q is {qlib} (mixed numpy/cupy)")
        slopes = arrays.as_library_array(alibi_slopes, lib, "alibi_slopes")
        heads = 1 if q.ndim == 2 else q.shape[1]
        if slopes.ndim != 1 or slopes.shape[0] != heads:
            raise ValueError(f"alibi_slopes must have shape ({heads},) (one slope per query "
                             f"head), got {tuple(slopes.shape)}")
        if not np.issubdtype(np.dtype(slopes.dtype), np.floating):
            raise TypeError(f"alibi_slopes must be floating point, got {slopes.dtype}")
        shift = _alibi_shift(graph)
        tree = sm.alibi_tree(tree, aligned=shift is not None)
        head = sm.Expr("head", (), "alibi_slopes")
        values[head] = slopes
        if shift is not None:
            xp = _xp(lib)
            values[sm.Expr("node", (), ("dst", "_alibi_shift"))] = xp.asarray(shift)
        if want_slopes_grad:
            want = (head,)
    return sm.BoundModifier(tree, values, want)


def _alibi_shift(graph):
    """Per destination row, Lk - Lq of its block (dense / segments relations), or None where
    every shift is 0 (nothing to align)."""
    if graph.kind not in ("dense", "segments"):
        return None
    rel = graph.realize("cpu")
    nd = np.diff(np.asarray(rel.dst_offsets))
    ns = np.diff(np.asarray(rel.src_offsets))
    # the shift is applied to i - j with global positions: (i - d0) + (ns - nd) - (j - s0)
    per_block = (ns - nd) - np.asarray(rel.dst_offsets[:-1]) + np.asarray(rel.src_offsets[:-1])
    if not np.any(per_block):
        return None
    return np.repeat(per_block, nd).astype(np.int64)


def attention(q, k, v, graph, *, scale=None, block_prune_threshold=None, return_stats=False,
              softcap=None, alibi_slopes=None):
    """Attention of q (num_dst, H, D) over k (num_src, Hkv, D), v (num_src, Hkv, Dv) along the
    edges of `graph`. Returns out (num_dst, H, Dv) [, stats with .m, .l].

    `softcap` (c > 0) replaces the scaled score s by ``c * tanh(s / c)``; `alibi_slopes` (H,)
    subtracts ``slopes[h] * |i - j|`` (flash-attn's conventions, docs/score_mods.md)."""
    mod = flash_modifier(q, graph, softcap, alibi_slopes)
    out, stats, _ = run_forward(q, k, v, graph, scale=scale,
                                block_prune_threshold=block_prune_threshold, score_mod=mod)
    return (out, stats) if return_stats else out


def run_backward(dout, q, k, v, out, stats, graph, *, scale=None, edge_bias=None, score_mod=None):
    """Validated fused backward. Returns (dq, dk, dv, dbias, plan), and with `score_mod`
    (dq, dk, dv, dbias, {leaf: gradient}, plan)."""
    q, k, v, shape, scale = arrays.check_attention_inputs(q, k, v, graph, scale)
    if getattr(stats, "block_prune_threshold", None) is not None:
        raise NotImplementedError(
            "attention_backward of a tile-pruned forward is not implemented: the pruned "
            f"forward (block_prune_threshold={stats.block_prune_threshold:g}) is approximate and "
            "has no exact gradient; rerun the forward without block_prune_threshold")
    if not (hasattr(stats, "m") and hasattr(stats, "l")):
        raise TypeError(f"stats must be the AttentionStats returned by attention(..., "
                        f"return_stats=True), got {type(stats).__name__}")
    lead = (shape.num_dst,) if shape.squeezed else (shape.num_dst, shape.heads)
    out_shape = lead + (shape.value_dim,)
    dout = arrays.check_like("dout", dout, shape.library, expected_shape=out_shape)
    out = arrays.check_like("out", out, shape.library, expected_shape=out_shape)
    m = arrays.check_like("stats.m", stats.m, shape.library, expected_shape=lead)
    l = arrays.check_like("stats.l", stats.l, shape.library, expected_shape=lead)
    if shape.squeezed:
        dout, out, m, l = dout[:, None, :], out[:, None, :], m[:, None], l[:, None]
    for name, a in (("dout", dout), ("out", out)):
        if a.dtype != shape.dtype and np.dtype(a.dtype).kind != "f":  # bf16 is kind "V"
            raise TypeError(f"{name} must be floating point, got {a.dtype}")
    acc = shape.accum_dtype
    if m.dtype != acc or l.dtype != acc:
        xp = _xp(shape.library)
        m = xp.asarray(m, dtype=acc)
        l = xp.asarray(l, dtype=acc)
    bias = arrays.check_edge_bias(edge_bias, shape, graph)
    _check_modifier(score_mod, shape, graph)
    plan = dispatch.make_plan("backward", graph, shape, scale, edge_bias=bias, score_mod=score_mod)
    mod_grads = {}
    if shape.num_dst == 0 or graph.num_edges == 0 or shape.heads == 0:
        xp = _xp(shape.library)
        dq = xp.zeros(q.shape, dtype=shape.dtype)
        dk = xp.zeros(k.shape, dtype=shape.dtype)
        dv = xp.zeros(v.shape, dtype=shape.dtype)
        dbias = None if bias is None else xp.zeros(bias.shape, dtype=acc)
        if score_mod is not None:
            mod_grads = {x: xp.zeros(score_mod.values[x].shape, dtype=score_mod.values[x].dtype)
                         for x in score_mod.grad_leaves}
        plan.run_info.update(kernel="none (relation has no edges)", copies=[], cache="n/a")
    else:
        backend = dispatch.backend_module(plan.backend)
        args = (plan, dout, q, k, v, out, m, l, graph.realize(plan.backend),
                graph.realize_transpose(plan.backend), bias)
        if score_mod is None:
            dq, dk, dv, dbias = backend.backward(*args)
        else:
            dq, dk, dv, dbias, mod_grads = backend.backward(*args, score_mod=score_mod)
    _remember(plan)
    if shape.squeezed:
        dq, dk, dv = dq[:, 0, :], dk[:, 0, :], dv[:, 0, :]
    if score_mod is not None:
        return dq, dk, dv, dbias, mod_grads, plan
    return dq, dk, dv, dbias, plan


def attention_backward(dout, q, k, v, out, stats, graph, *, scale=None, softcap=None,
                       alibi_slopes=None):
    """Fused backward: rebuilds p = exp(s - m) / l from the forward's stats; returns dq, dk, dv.
    Pass the forward's `softcap` / `alibi_slopes` again (the score is recomputed)."""
    mod = flash_modifier(q, graph, softcap, alibi_slopes)
    res = run_backward(dout, q, k, v, out, stats, graph, scale=scale, score_mod=mod)
    return res[0], res[1], res[2]
