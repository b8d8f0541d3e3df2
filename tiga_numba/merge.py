"""Merging partial attention results: the online-softmax monoid.

A forward over a set of edges leaves, per (destination, head), the normalised output ``o``, the
running maximum ``m`` and the sum ``l = sum exp(s - m)``. Two results over DISJOINT edge subsets
of the same destination rows combine into the result over their union::

    m   = max(m_a, m_b)
    l   = l_a * exp(m_a - m) + l_b * exp(m_b - m)
    out = (l_a * exp(m_a - m) * out_a + l_b * exp(m_b - m) * out_b) / l

The operation is associative and commutative (up to rounding), and a part whose row is empty
(``l = 0``, ``m = -inf``) is its neutral element. ``lse = m + log(l)`` (flash-attn's
``softmax_lse``) carries the same information in one number; ``m`` is kept as well so that the
merged statistics feed :func:`tiga_numba.attention_backward` for the union exactly as a single
forward's would.

Parts are folded left to right in the order given, so the same parts in the same order give the
same bits on every run.
"""
from __future__ import annotations

import sys

import numpy as np

from . import interop
from .arrays import FLOAT_DTYPES, accepted_dtypes, accumulation_dtype

__all__ = ["attention_merge", "log_sum_exp"]


def _xp_of(array, name="array"):
    """numpy or cupy, whichever `array` belongs to; TypeError naming it otherwise."""
    if isinstance(array, np.ndarray):
        return np
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(array, cupy.ndarray):
        return cupy
    raise TypeError(f"{name} must be a numpy or cupy array (or a tensor with __dlpack__), got "
                    f"{type(array).__name__}")


def log_sum_exp(m, l):
    """``m + log(l)`` per row, ``-inf`` where the row is empty (``l == 0``), in m's library
    (numpy, cupy, or the foreign library m and l were handed back in, e.g. torch)."""
    lib = interop.library_name(m)
    if lib is not None:
        return interop.to_library(log_sum_exp(interop.to_native(m, "stats.m"),
                                              interop.to_native(l, "stats.l")), lib)
    xp = _xp_of(m, "stats.m")
    with np.errstate(divide="ignore", invalid="ignore"):
        return xp.where(l > 0, m + xp.log(xp.where(l > 0, l, 1)), -xp.inf).astype(m.dtype, copy=False)


def _check_part(i, part):
    try:
        out, stats = part
    except (TypeError, ValueError):
        raise TypeError(f"parts[{i}] must be an (out, stats) pair, got {type(part).__name__}") from None
    if not (hasattr(stats, "m") and hasattr(stats, "l")):
        raise TypeError(f"parts[{i}][1] must be the stats of attention(..., return_stats=True) "
                        f"(with .m and .l), got {type(stats).__name__}")
    if getattr(stats, "block_prune_threshold", None) is not None:
        raise NotImplementedError(
            f"parts[{i}] comes from a tile-pruned (approximate) forward; merging it would hide the "
            "approximation: merge exact results only")
    return out, stats.m, stats.l


def attention_merge(parts):
    """Combine attention results of the same destination rows over disjoint edge subsets.

    Parameters
    ----------
    parts : sequence of ``(out, stats)`` pairs
        ``out`` of shape ``(num_dst, H, Dv)`` (or ``(num_dst, Dv)`` for one-head 2-D calls) and the
        :class:`AttentionStats` returned with it (``m``, ``l`` of shape ``(num_dst, H)``). All parts
        share shapes and array library (numpy, cupy, or a library with DLPack such as torch:
        the result comes back in it).

    Returns
    -------
    out, stats
        ``out`` in the parts' dtype and library; ``stats`` an :class:`AttentionStats` (``m``, ``l``,
        ``lse``) that :func:`attention_backward` accepts for the union of the edge subsets.
    """
    if isinstance(parts, tuple) and len(parts) == 2 and hasattr(parts[1], "m") and hasattr(parts[1], "l"):
        raise TypeError("parts must be a sequence of (out, stats) pairs, got one pair; "
                        "pass [(out, stats), ...]")
    try:
        parts = list(parts)
    except TypeError:
        raise TypeError(f"parts must be a sequence of (out, stats) pairs, got "
                        f"{type(parts).__name__}") from None
    return _merge(parts)


@interop.foreign_arrays
def _merge(parts):
    from .functional import AttentionStats
    if not parts:
        raise ValueError("parts must hold at least one (out, stats) pair, got an empty sequence")
    checked = [_check_part(i, p) for i, p in enumerate(parts)]
    out0, m0, l0 = checked[0]
    xp = _xp_of(out0, "parts[0] out")
    out_dtypes = accepted_dtypes("numpy" if xp is np else "cupy")   # any out attention returns
    for i, (o, m, l) in enumerate(checked):
        for name, a, ref in (("out", o, out0), ("stats.m", m, m0), ("stats.l", l, l0)):
            if _xp_of(a, f"parts[{i}] {name}") is not xp:
                raise TypeError(f"parts[{i}] {name} is a {type(a).__name__}, parts[0]'s out is a "
                                f"{type(out0).__name__}: all parts must use one array library")
            if tuple(a.shape) != tuple(ref.shape):
                raise ValueError(f"parts[{i}] {name} has shape {tuple(a.shape)}, parts[0]'s has "
                                 f"{tuple(ref.shape)}: parts must cover the same destination rows")
        if tuple(l.shape) != tuple(m.shape):
            raise ValueError(f"parts[{i}] stats.l has shape {tuple(l.shape)}, which does not match its "
                             f"stats.m of shape {tuple(m.shape)}")
        if tuple(o.shape[:m.ndim]) != tuple(m.shape):
            raise ValueError(f"parts[{i}] out has shape {tuple(o.shape)}, which does not match its "
                             f"stats.m of shape {tuple(m.shape)}")
        for name, a, allowed in (("out", o, out_dtypes), ("stats.m", m, FLOAT_DTYPES), ("stats.l", l, FLOAT_DTYPES)):
            if np.dtype(a.dtype) not in allowed:   # what attention returns; never a silent cast
                names = [str(d) for d in allowed]
                raise TypeError(f"parts[{i}] {name} has dtype {np.dtype(a.dtype)}, expected "
                                f"{', '.join(names[:-1])} or {names[-1]}")
        if o.dtype != out0.dtype:   # the merged out takes one dtype: never a silent down-cast
            raise TypeError(f"parts[{i}] out is {o.dtype}, parts[0]'s is {out0.dtype}: all parts "
                            "must have one dtype (cast them first)")
        for name, a in (("stats.m", m), ("stats.l", l)):   # likewise the merged statistics
            if a.dtype != m0.dtype:
                raise TypeError(f"parts[{i}] {name} is {a.dtype}, parts[0]'s stats.m is {m0.dtype}: "
                                "all parts' statistics must have one dtype (cast them first)")
    if xp is np and len(checked) > 1:   # one pass per part, no temporaries
        from .cpu.merge import merge as cpu_merge
        out, m_run, l_run = cpu_merge(checked)
    else:
        out, m_run, l_run = _merge_arrays(xp, checked)
    # The kernels' own row maxima (exact, in their units) merge by max like m; kept only when
    # every part has them from one backend, so the backward of the union stays as exact as a
    # single forward's.
    kernel_ms = [getattr(p[1], "m_kernel", None) for p in parts]
    plans = [getattr(p[1], "plan", None) for p in parts]
    m_kernel = None
    if all(mk is not None and tuple(mk.shape) == tuple(m0.shape) for mk in kernel_ms) and \
            len({getattr(pl, "backend", None) for pl in plans}) == 1 and plans[0] is not None:
        m_kernel = kernel_ms[0]
        for mk in kernel_ms[1:]:
            m_kernel = xp.maximum(m_kernel, mk)
    stats = AttentionStats(m_run, l_run, m_kernel=m_kernel)
    if m_kernel is not None:
        stats.plan = _BackendOnly(plans[0].backend)
    return out, stats


def _merge_arrays(xp, checked):
    """The merge of checked parts [(out, m, l), ...] in array expressions (cupy, or one numpy
    part): (out in the parts' dtype, m and l in the accumulation dtype)."""
    out0, m0, l0 = checked[0]
    acc = accumulation_dtype(m0.dtype)

    # an empty row's out and m are never read (a part of weight 0 is left out, as in the CPU
    # kernel): a NaN or inf out there is not 0 * NaN, and its m does not move the reference
    def held(o, l):
        return xp.where((l > 0)[..., None], xp.asarray(o, dtype=acc), 0)

    def held_m(m, l):
        return xp.where(l > 0, xp.asarray(m, dtype=acc), -xp.inf)

    l_run = xp.asarray(l0, dtype=acc)
    m_run = held_m(m0, l_run)
    if len(checked) == 1:   # the part itself (a copy), its empty rows in the canonical form
        return held(out0, l_run).astype(out0.dtype, copy=False), m_run, l_run
    o_run = held(out0, l_run) * l_run[..., None]   # unnormalised accumulator
    for o, m, l in checked[1:]:
        l = xp.asarray(l, dtype=acc)
        m = held_m(m, l)
        o = held(o, l)
        m_new = xp.maximum(m_run, m)
        # empty rows have m = -inf; use 0 as the reference there so that no -inf - -inf appears
        ref = xp.where(xp.isfinite(m_new), m_new, 0)
        a = xp.where(l_run > 0, xp.exp(xp.where(l_run > 0, m_run, ref) - ref), 0).astype(acc)
        b = xp.where(l > 0, xp.exp(xp.where(l > 0, m, ref) - ref), 0).astype(acc)
        o_run = o_run * a[..., None] + o * (l * b)[..., None]
        l_run = l_run * a + l * b
        m_run = m_new
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = xp.where(l_run > 0, 1 / xp.where(l_run > 0, l_run, 1), 0).astype(acc)
    out = (o_run * inv[..., None]).astype(out0.dtype, copy=False)
    return out, xp.where(l_run > 0, m_run, -xp.inf).astype(acc), l_run


class _BackendOnly:
    """What merged stats know of the forwards they came from: the backend whose kernel units
    their m_kernel is in (no single plan, graph or scale)."""

    __slots__ = ("backend",)

    def __init__(self, backend):
        self.backend = backend
