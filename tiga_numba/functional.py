"""Functional API: tg.attention and tg.attention_backward.

    out = tg.attention(q, k, v, graph, scale=None, block_prune_threshold=None, return_stats=False)
    dq, dk, dv = tg.attention_backward(dout, q, k, v, out, stats, graph, scale=None)

numpy arrays run on the CPU backend, cupy arrays on the CUDA backend; results come back in
the caller's library and q's dtype. `run_forward` / `run_backward` are the same calls with
the plan returned and per-edge scores (`edge_bias`) allowed; the program front end uses them.
"""
from __future__ import annotations

import functools

import numpy as np

from . import arrays, dispatch
from .kernel_cache import KERNELS
from .merge import log_sum_exp
from . import run_options as _options
from .interop import foreign_arrays
from .graph import Graph

_last_plan = None
# what the most recent call raised, when it raised after the last plan was recorded: explain()
# says so instead of passing the call before it off as the most recent one
_last_failure = None


class AttentionStats:
    """Per-row softmax state of a forward, returned by `attention(..., return_stats=True)`.

    Both arrays are in the accumulation dtype (float32; float64 for float64 inputs) and the
    caller's array library; `(num_dst,)` for 2-D one-head inputs. Unpacks as `m, l = stats`;
    `lse` = m + log(l) is flash-attn's `softmax_lse` (-inf for an empty row), and
    `tg.attention_merge` combines results through these stats.

    Attributes
    ----------
    m : array (num_dst, H)
        Max scaled score of each row and head; -inf for a row with no edges.
    l : array (num_dst, H)
        Sum of exp(s - m) over the row's edges; 0 for a row with no edges.
    block_prune_threshold : float or None
        The forward's tile-pruning threshold; `attention_backward` refuses pruned stats.
    plan : Plan
        The forward's plan (what `explain()` reports).
    graph : Graph
        The forward's relation: `attention_backward` refuses stats of another call (other
        graph, shapes, scale or score).
    m_kernel : array or None
        The row max in the units of the backend's kernels exactly as they found it (the CPU
        kernels work in base 2); the backward uses it instead of converting `m` back, which
        keeps gradients exact at large scores. Stats built by hand have none of these and are
        checked by shape only; merged stats keep `m_kernel` when every part has it.
    score_values : dict or None
        What the forward's score read besides q and k (soft-cap, ALiBi slopes, a program's
        fields): `attention_backward` refuses stats whose forward read other values."""

    __slots__ = ("m", "l", "block_prune_threshold", "plan", "graph", "m_kernel", "score_values")

    def __init__(self, m, l, block_prune_threshold=None, plan=None, *, graph=None,
                 m_kernel=None, score_values=None):
        self.m = m
        self.l = l
        self.block_prune_threshold = block_prune_threshold
        self.plan = plan
        self.graph = graph
        self.m_kernel = m_kernel
        # the values the forward's score modifier read besides q and k (soft-cap, ALiBi slopes, a
        # program's fields): a backward with other values would rebuild other probabilities
        self.score_values = score_values

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
    """The plan of the most recent call that ran (forward or backward, functional or program),
    or None. A call that raised made none (`explain()` names it).

    Its `run_info` dict holds what the backend did: kernel, tiles, copies, cache, pruning."""
    return _last_plan


def note_failure(call, error):
    """Record that `call` (a name, e.g. "tiga_numba.attention") raised `error`: until the
    next call completes, explain() reports it first. Returns the record's text."""
    global _last_failure
    text = str(error).splitlines()[0] if str(error) else ""
    _last_failure = f"{call} raised {type(error).__name__}" + (f": {text}" if text else "")
    return _last_failure


class noting_failure:
    """An exception raised inside (or, used as a decorator, by the function) is recorded by
    note_failure and given to `keep` (a program keeps it for its own explain()), then
    re-raised. A class, not a contextlib generator: the entry points run it on every call,
    and entering a generator-based context costs a generator and its frame each time."""
    __slots__ = ("call", "keep")

    def __init__(self, call, keep=None):
        self.call = call
        self.keep = keep

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if isinstance(error, Exception):
            text = note_failure(self.call, error)
            if self.keep is not None:
                self.keep(text)
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def noted(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)
        return noted


def explain():
    """A multi-line report of the most recent call's plan: backend, kernel, relation and its
    realisation, score, heads, dtypes, tiles, copies made, what was not materialised, tile
    pruning, and where the kernel came from (memory hit / disk hit / compiled).

    Returns
    -------
    str
        The report, or "no attention call has run yet". When the most recent call raised, the
        report says so first, then gives the plan of the last call that completed."""
    report = _last_plan.explain() if _last_plan is not None else "no attention call has run yet"
    if _last_failure is None:
        return report
    return (f"the most recent call failed: {_last_failure}\n"
            + ("the last call that completed:\n" + report if _last_plan is not None else report))


def _remember(plan):
    """The call of `plan` is done: its record is fixed now (where its kernel came from and the
    cache totals, as they were after this call: a later call compiling a new signature of the
    same kernel must not change what this plan says), and it becomes the last plan."""
    global _last_plan, _last_failure
    info = plan.run_info
    if "cache" in info and not isinstance(info["cache"], str):
        info["cache"] = str(info["cache"])
    info["cache_totals"] = KERNELS.stats()
    _last_plan = plan
    _last_failure = None


def run_forward(q, k, v, graph, *, scale=None, block_prune_threshold=None, edge_bias=None,
                score_mod=None):
    """Validated forward. Returns (out, stats, plan). `score_mod` is a
    score_mod.BoundModifier applied to the scaled score in the kernels."""
    options = _options.resolve()
    memo, key, hit = _validated_before("forward", q, k, v, graph, scale, block_prune_threshold, edge_bias,
                                       score_mod, options)
    if hit is not None:
        # the same graph, array types, shapes, dtypes, scale, threshold, score and options as a
        # call that passed validation: its checks and its plan hold again (a fresh run_info)
        (q, k, v), (shape, scale, rho, template) = hit
        bias = None
        _check_modifier(score_mod, shape, graph)   # the modifier's values are this call's own
        plan = template.fresh()
    else:
        q, k, v, shape, scale = arrays.check_attention_inputs(q, k, v, graph, scale)
        rho = arrays.check_prune_threshold(block_prune_threshold)
        bias = arrays.check_edge_bias(edge_bias, shape, graph)
        _check_modifier(score_mod, shape, graph)
        plan = dispatch.make_plan("forward", graph, shape, scale, prune_threshold=rho, edge_bias=bias,
                                  arrays=(q, k, v), options=options, score_mod=score_mod)
        _remember_call(memo, key, (shape, scale, rho, plan.fresh()))
    if shape.num_dst == 0 or graph.num_edges == 0 or shape.heads == 0:
        xp = _xp(shape.library)
        # Nothing to reduce: the contract's empty-row values, no kernel launch.
        out = xp.zeros((shape.num_dst, shape.heads, shape.value_dim), dtype=shape.dtype)
        m = xp.full((shape.num_dst, shape.heads), -np.inf, dtype=shape.accum_dtype)
        l = xp.zeros((shape.num_dst, shape.heads), dtype=shape.accum_dtype)
        m_kernel = []
        plan.run_info.update(kernel="none (relation has no edges)", copies=[], cache="n/a",
                             pruned_tiles=0, total_tiles=0)
    else:
        backend = dispatch.backend_module(plan.backend)
        kw = {} if score_mod is None else {"score_mod": score_mod}
        out, m, l, *m_kernel = backend.forward(plan, q, k, v, graph.realize(plan.backend), bias,
                                               **kw)
    _remember(plan)
    m_kernel = m_kernel[0] if m_kernel else None
    if shape.squeezed:
        out, m, l = out[:, 0, :], m[:, 0], l[:, 0]
        m_kernel = None if m_kernel is None else m_kernel[:, 0]
    return out, AttentionStats(m, l, rho, plan, graph=graph, m_kernel=m_kernel,
                               score_values=_score_values(score_mod, bias)), plan


#: call shapes remembered per graph (the memo is dropped with the graph; cleared when full)
_CALL_MEMO_SIZE = 64


def _validated_before(op, q, k, v, graph, scale, rho, edge_bias, score_mod, options):
    """(the graph's memo of validated calls, this call's key, hit): hit is ((q, k, v) as the
    kernels take them, the remembered (shape, scale, threshold, plan)) when a call with this key
    passed validation, else None. Memo and key are None when the call is not one the memo serves:
    arrays other than plain numpy / cupy ndarrays, a per-edge bias, or an unhashable scale or
    threshold (a 0-d array). The key holds everything validation and planning read: the array
    types, shapes and dtypes, the scale and threshold with their types (True is not 1 here), the
    score modifier's tree and gradient leaves, the run options and, for GPU arrays, the current
    device (the tensor-core admission reads it)."""
    tq = type(q)
    if edge_bias is not None or (tq is not np.ndarray and not arrays._is_cupy_ndarray(q)) \
            or type(k) is not tq or type(v) is not tq or not isinstance(graph, Graph):
        return None, None, None
    device = None
    if tq is not np.ndarray:
        from .cuda.tc.device import current_device
        device = current_device()
    key = (op, tq, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, type(scale), scale,
           type(rho), rho, None if score_mod is None else (score_mod.tree, score_mod.grad_leaves), options,
           device)
    memo = graph._cached(("validated calls",), dict)
    try:
        entry = memo.get(key)
    except TypeError:
        return None, None, None
    if entry is None:
        return memo, key, None
    if entry[0].squeezed:   # one-head 2-D inputs, as check_attention_inputs views them
        q, k, v = q[:, None, :], k[:, None, :], v[:, None, :]
    return memo, key, ((q, k, v), entry)


def _remember_call(memo, key, entry):
    """Keep a validated call's facts and plan under its key (nothing when the call has no memo)."""
    if memo is None:
        return
    if len(memo) >= _CALL_MEMO_SIZE:
        memo.clear()
    memo[key] = entry


def _score_values(score_mod, bias):
    """{name: value} of what a call's score modifier reads besides q and k (see
    AttentionStats). An edge bias is not among them: only a program's own vjp passes one to the
    backward, and always its forward's."""
    if score_mod is None:
        return {}
    from .score_mod import leaf_name
    values = {}
    for x, v in score_mod.values.items():
        if x in score_mod.gathers:   # a per-row gather (per-sequence slopes): the user's array,
            user, _, v = score_mod.gathers[x]   # small, compared instead of its per-call gather
            x = user
        values[leaf_name(x)] = v
    return values


def _value_difference(fwd_values, values):
    """None when a backward's score values are the forward's, else what differs (a string).
    Arrays are compared by identity first, then by content (small in the functional API:
    per-head slopes; a program's vjp passes the forward's own arrays)."""
    for name in sorted(set(fwd_values) | set(values)):
        a, b = fwd_values.get(name), values.get(name)
        if a is b:
            continue
        if a is None or b is None:
            return f"{name} is {'absent' if a is None else 'given'} in the forward, " \
                   f"{'absent' if b is None else 'given'} here"
        if not hasattr(a, "shape") or not hasattr(b, "shape"):
            if a != b:
                return f"{name} = {a!r} in the forward, {b!r} here"
            continue
        if tuple(a.shape) != tuple(b.shape) or str(a.dtype) != str(b.dtype):
            return f"{name} has shape {tuple(a.shape)} {a.dtype} in the forward, {tuple(b.shape)} {b.dtype} here"
        if arrays.library_of(name, b) != arrays.library_of(name, a) or \
                not bool(((a == b) | ((a != a) & (b != b))).all()):   # NaN matches NaN
            return f"{name} holds other values than in the forward"
    return None


def _check_modifier(score_mod, shape, graph):
    if score_mod is not None:
        score_mod.check(shape.heads, shape.num_dst, shape.num_src, graph.num_edges,
                        graph.is_implicit)


def flash_modifier(q, graph, softcap, alibi_slopes, grad_slopes=False):
    """The score modifier of flash-attn's `softcap=` / `alibi_slopes=` (None when neither is
    given): ``softcap * tanh(s / softcap)``, then ``- slopes[h] * |i - j|`` with the distance
    bottom-right aligned in each rectangular block of a dense or cu_seqlens relation
    (``|r + Lk - Lq - c|`` in block-local positions, as flash-attn); triangular, band and CSR
    relations use the node positions as they are."""
    if softcap is None and alibi_slopes is None:
        return None
    from . import score_mod as sm
    slopes = shift = rows = None
    if softcap is not None:
        softcap = arrays.scalar_value(softcap)
        if isinstance(softcap, (bool, np.bool_)) or not isinstance(
                softcap, (int, float, np.integer, np.floating)):
            raise TypeError(f"softcap must be a real number or None, got {type(softcap).__name__}")
        softcap = float(softcap)
        if softcap == 0:   # flash-attn's default: 0 turns the soft-cap off
            softcap = None
        elif not (softcap > 0 and np.isfinite(softcap)):
            raise ValueError(f"softcap must be a finite number > 0 (or 0: no soft-cap), got {softcap}")
    if softcap is None and alibi_slopes is None:
        return None
    if alibi_slopes is not None:
        lib = arrays.library_of("alibi_slopes", alibi_slopes)
        qlib = arrays.library_of("q", q)
        if lib != qlib:
            raise TypeError(f"alibi_slopes is a {lib} array but q is {qlib} (mixed numpy/cupy)")
        slopes = arrays.as_library_array(alibi_slopes, lib, "alibi_slopes")
        heads = 1 if q.ndim == 2 else q.shape[1]
        if slopes.ndim == 2 and slopes.shape[1] == heads:   # flash-attn's (batch, H) form
            if slopes.shape[0] == 1:
                slopes = slopes[0]
            else:
                rows = _sequence_of_rows_on(graph, lib, slopes.shape)
        if not (slopes.ndim == 1 or rows is not None) or slopes.shape[-1] != heads:
            raise ValueError(f"alibi_slopes must have shape ({heads},) (one slope per query "
                             f"head) or (batch, {heads}) (one set per sequence of a cu_seqlens "
                             f"relation), got {tuple(slopes.shape)}")
        if not np.issubdtype(np.dtype(slopes.dtype), np.floating):
            raise TypeError(f"alibi_slopes must be floating point, got {slopes.dtype}")
        shift = _alibi_shift_on(graph, lib)
    # the functional API gives no gradients besides q, k, v (the program API and the torch
    # adapter ask for the slopes' with `grad_slopes`)
    return sm.bind_flash(softcap, slopes, shift, grad_slopes, row_sequence=rows)


def _sequence_of_rows_on(graph, lib, shape):
    """The sequence of each query row (int64, (num_dst,)) for flash-attn's per-sequence
    (batch, H) slopes: the relation must be made of `batch` implicit blocks (Graph.cu_seqlens,
    or Graph.cat of implicit relations), a block being a sequence; `shape`: the slopes' (batch,
    H). Made once per graph and device (_on_device)."""
    batch = shape[0]
    blocks = graph._blocks
    if graph.kind != "segments" or blocks is None or len(blocks.dst_offsets) - 1 != batch:
        what = (f"has {len(blocks.dst_offsets) - 1} sequences" if graph.kind == "segments"
                and blocks is not None else f"is a {graph.kind} relation")
        raise ValueError(f"alibi_slopes of shape {tuple(shape)} gives one set of slopes per "
                         f"sequence and needs a cu_seqlens relation of {batch} sequences "
                         f"(Graph.cu_seqlens, or Graph.cat of implicit relations); the graph "
                         f"{what}")
    return _on_device(graph, "alibi-rows", lib,
                      lambda: sequence_of_rows(blocks.dst_offsets, 0, graph.num_dst))


def sequence_of_rows(offsets, row0, row1):
    """The block (sequence) of each row in [row0, row1), from the blocks' first rows `offsets`
    (num_blocks + 1 increasing offsets; an empty block holds no row): int64, host."""
    return np.searchsorted(np.asarray(offsets), np.arange(row0, row1), "right").astype(np.int64) - 1


def _on_device(graph, name, lib, build):
    """build() (a host array, or None) as an array of library `lib` (on cupy's current device),
    made once per graph and device: a call must not copy it to the device again (a host-to-device
    copy from pageable memory waits for the stream, so the host would stall on every call)."""
    device = None
    if lib == "cupy":
        import cupy
        device = cupy.cuda.Device().id

    def on_device():
        host = build()
        return None if host is None else _xp(lib).asarray(host)
    return graph._cached((name, lib, device), on_device)


def _alibi_shift_on(graph, lib):
    """_alibi_shift as an array of library `lib`, made once per graph and device (_on_device)."""
    return _on_device(graph, "alibi-shift", lib, lambda: _alibi_shift(graph))


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


@foreign_arrays
def make_plan(q, k, v, graph, *, op="forward", scale=None, block_prune_threshold=None,
              deterministic=None, softcap=None, alibi_slopes=None):
    """The plan a call would run, made without running it: ``make_plan(...).explain()``
    says which kernel family the registry chose for these inputs and why every other one was
    refused (`op` "forward" or "backward"; the other arguments as for `attention` /
    `attention_backward`)."""
    if op not in ("forward", "backward"):
        raise ValueError(f"op must be 'forward' or 'backward', got {op!r}")
    mod = flash_modifier(q, graph, softcap, alibi_slopes)
    q, k, v, shape, scale = arrays.check_attention_inputs(q, k, v, graph, scale)
    # a threshold for the backward reaches make_plan, which refuses it (never dropped silently)
    rho = arrays.check_prune_threshold(block_prune_threshold)
    _check_modifier(mod, shape, graph)
    return dispatch.make_plan(op, graph, shape, scale, prune_threshold=rho, arrays=(q, k, v),
                              options=_options.resolve(deterministic=deterministic), score_mod=mod)


@noting_failure("tiga_numba.attention")
@foreign_arrays
def attention(q, k, v, graph, *, scale=None, block_prune_threshold=None, return_stats=False,
              softcap=None, alibi_slopes=None):
    """Attention along the edges of `graph`: out_i = sum_j softmax_j(scale * q_i . k_j) v_j.

    Parameters
    ----------
    q : array (num_dst, H, D)
        Queries, one row per destination. numpy arrays run on the CPU kernels, cupy arrays
        (anything with `__cuda_array_interface__`) on the CUDA kernels. float16, bfloat16
        (``ml_dtypes`` on the CPU), float32 or float64; any strides. 2-D `(num_dst, D)` is one
        head.
    k : array (num_src, Hkv, D)
        Keys, one row per source; same dtype and library as q. `H % Hkv == 0`: query head h
        reads key/value head `h // (H // Hkv)` (grouped-query attention).
    v : array (num_src, Hkv, Dv)
        Values; Dv may differ from D.
    graph : Graph
        The relation; `graph.num_dst == len(q)`, `graph.num_src == len(k) == len(v)`.
    scale : float, optional
        Score scale; default `D ** -0.5`.
    block_prune_threshold : float, optional
        `0 < rho <= 1`: approximate tile pruning (a key tile whose max score is below the
        query tile's running max + ln(rho) is skipped). Block relations only; None = exact.
    return_stats : bool
        Also return the per-row softmax state needed by `attention_backward`.
    softcap : float, optional
        c > 0: the scaled score s becomes ``c * tanh(s / c)`` (flash-attn's soft-cap); None or
        0 (flash-attn's default): no soft-cap.
    alibi_slopes : array (H,) or (batch, H), optional
        ALiBi: ``slopes[h] * |i - j|`` is subtracted from the score (bottom-right aligned in
        rectangular dense / cu_seqlens blocks, as flash-attn). Shape (1, H) is taken as (H,);
        flash-attn's per-sequence form (batch, H) gives sequence b of a cu_seqlens relation of
        batch sequences the slopes ``slopes[b]`` (any other relation: ValueError). See
        docs/score_mods.md.

    Returns
    -------
    out : array (num_dst, H, Dv)
        In q's dtype and array library. A destination with no edges gets 0.
    stats : AttentionStats
        Only with `return_stats=True`.

    Raises
    ------
    TypeError
        Wrong array type, mixed libraries, unsupported or mixed dtypes.
    ValueError
        Shape, head or graph-size mismatch; threshold out of range.
    NotImplementedError
        A valid request this backend cannot do (e.g. pruning on a CSR relation)."""
    mod = flash_modifier(q, graph, softcap, alibi_slopes)
    out, stats, _ = run_forward(q, k, v, graph, scale=scale,
                                block_prune_threshold=block_prune_threshold, score_mod=mod)
    return (out, stats) if return_stats else out


def run_backward(dout, q, k, v, out, stats, graph, *, scale=None, edge_bias=None,
                 deterministic=None, score_mod=None):
    """Validated fused backward. Returns (dq, dk, dv, dbias, plan), and with `score_mod`
    (dq, dk, dv, dbias, {leaf: gradient}, plan)."""
    options = _options.resolve(deterministic=deterministic)
    memo, key, hit = _validated_before("backward", q, k, v, graph, scale, None, edge_bias, score_mod, options)
    if hit is not None:   # as in run_forward: the same validated facts, the same plan
        (q, k, v), (shape, scale, _, template) = hit
    else:
        q, k, v, shape, scale = arrays.check_attention_inputs(q, k, v, graph, scale)
    if getattr(stats, "block_prune_threshold", None) is not None:
        raise NotImplementedError(
            "attention_backward of a tile-pruned forward is not implemented: the pruned "
            f"forward (block_prune_threshold={stats.block_prune_threshold:g}) is approximate and "
            "has no exact gradient; rerun the forward without block_prune_threshold")
    if not (hasattr(stats, "m") and hasattr(stats, "l")):
        raise TypeError(f"stats must be the AttentionStats returned by attention(..., "
                        f"return_stats=True), got {type(stats).__name__}")
    row_shape = (shape.num_dst,) if shape.squeezed else (shape.num_dst, shape.heads)
    out_shape = row_shape + (shape.value_dim,)
    dout = arrays.check_like("dout", dout, shape.library, expected_shape=out_shape)
    out = arrays.check_like("out", out, shape.library, expected_shape=out_shape)
    m = arrays.check_like("stats.m", stats.m, shape.library, expected_shape=row_shape)
    l = arrays.check_like("stats.l", stats.l, shape.library, expected_shape=row_shape)
    if shape.squeezed:
        dout, out, m, l = dout[:, None, :], out[:, None, :], m[:, None], l[:, None]
    for name, a in (("dout", dout), ("out", out)):
        if a.dtype != shape.dtype and np.dtype(a.dtype).kind != "f":  # bf16 is kind "V"
            raise TypeError(f"{name} must be floating point, got {a.dtype}")
    for name, a in (("stats.m", m), ("stats.l", l)):   # float32 / float64 as the forward made them
        if np.dtype(a.dtype).kind != "f":
            raise TypeError(f"{name} must be floating point ({np.dtype(shape.accum_dtype)} as the "
                            f"forward returns it), got {np.dtype(a.dtype)}")
    acc = shape.accum_dtype
    if m.dtype != acc or l.dtype != acc:
        xp = _xp(shape.library)
        m = xp.asarray(m, dtype=acc)
        l = xp.asarray(l, dtype=acc)
    bias = arrays.check_edge_bias(edge_bias, shape, graph)
    _check_modifier(score_mod, shape, graph)
    if hit is not None:
        plan = template.fresh()
    else:
        plan = dispatch.make_plan("backward", graph, shape, scale, edge_bias=bias,
                                  arrays=(q, k, v), options=options, score_mod=score_mod)
        _remember_call(memo, key, (shape, scale, None, plan.fresh()))
    mod_grads = {}
    per_edge = bias is not None or (score_mod is not None and bool(score_mod.layout.edges))
    m_kernel = _check_stats_belong(stats, graph, plan, row_shape, edge_order=per_edge,
                                   score_values=_score_values(score_mod, bias))
    if shape.squeezed and m_kernel is not None:
        m_kernel = m_kernel[:, None]
    if shape.num_dst == 0 or graph.num_edges == 0 or shape.heads == 0:
        xp = _xp(shape.library)
        dq = xp.zeros(q.shape, dtype=shape.dtype)
        dk = xp.zeros(k.shape, dtype=shape.dtype)
        dv = xp.zeros(v.shape, dtype=shape.dtype)
        dbias = None if bias is None else xp.zeros(bias.shape, dtype=acc)
        if score_mod is not None:
            mod_grads = score_mod.zero_grads(xp)
        plan.run_info.update(kernel="none (relation has no edges)", copies=[], cache="n/a")
    else:
        backend = dispatch.backend_module(plan.backend)
        args = (plan, dout, q, k, v, out, m, l, graph.realize(plan.backend),
                graph.realize_transpose(plan.backend), bias)
        kw = {} if m_kernel is None else {"m_kernel": m_kernel}
        if score_mod is None:
            dq, dk, dv, dbias = backend.backward(*args, **kw)
        else:
            dq, dk, dv, dbias, mod_grads = backend.backward(*args, score_mod=score_mod, **kw)
    _remember(plan)
    if shape.squeezed:
        dq, dk, dv = dq[:, 0, :], dk[:, 0, :], dv[:, 0, :]
    if score_mod is not None:
        return dq, dk, dv, dbias, mod_grads, plan
    return dq, dk, dv, dbias, plan


def _check_stats_belong(stats, graph, plan, row_shape, edge_order=False, score_values=None):
    """ValueError naming `stats` when a forward's stats come from another graph, other
    shapes, another scale or another score; returns the forward's kernel-unit row max when
    it can be used. Stats without a forward plan (built by hand, merged) pass: their shape
    was checked already. `edge_order`: per-edge values (an edge bias, per-edge fields) are in
    the graph's edge order, so the forward's graph must list its edges in the same order."""
    fwd = getattr(stats, "plan", None)
    if not isinstance(fwd, type(plan)):
        # merged stats (attention_merge) know only the backend of their parts' kernel maxima
        m_kernel = getattr(stats, "m_kernel", None)
        if m_kernel is not None and getattr(fwd, "backend", None) == plan.backend and \
                tuple(m_kernel.shape) == row_shape:
            return m_kernel
        return None
    got = (fwd.num_dst, fwd.num_src, fwd.heads, fwd.kv_heads, fwd.head_dim, fwd.value_dim)
    want = (plan.num_dst, plan.num_src, plan.heads, plan.kv_heads, plan.head_dim, plan.value_dim)
    if got != want:
        names = "(num_dst, num_src, heads, kv_heads, head_dim, value_dim)"
        raise ValueError(f"stats belong to a forward of other shapes: {names} = {got} in the "
                         f"forward, {want} here")
    if fwd.scale != plan.scale:
        raise ValueError(f"stats belong to a forward with scale={fwd.scale!r}, but this "
                         f"backward has scale={plan.scale!r}; pass the forward's scale")
    if fwd.score != plan.score:
        raise ValueError(f"stats belong to a forward with score {fwd.score!r}, but this "
                         f"backward computes {plan.score!r}")
    fwd_values = getattr(stats, "score_values", None)
    if fwd_values is not None:
        why = _value_difference(fwd_values, score_values)
        if why is not None:
            raise ValueError(f"stats belong to a forward whose score read other values: {why}; "
                             "pass the forward's values")
    fwd_graph = getattr(stats, "graph", None)
    if fwd_graph is not None and fwd_graph is not graph:
        why = _relation_difference(fwd_graph, graph, edge_order)
        if why is not None:
            raise ValueError(f"stats belong to a forward over another graph than this backward's: "
                             f"{why} (forward: {fwd_graph.explain()}; backward: {graph.explain()})")
    m_kernel = getattr(stats, "m_kernel", None)
    if m_kernel is None or fwd.backend != plan.backend or tuple(m_kernel.shape) != row_shape:
        return None
    return m_kernel


#: the most edges _same_relation compares through scipy CSR when one graph is implicit and the
#: other CSR (beyond it such a pair is refused: an implicit relation may hold billions of edges)
SAME_RELATION_MAX_EDGES = 1 << 26


def _same_relation(a, b, edge_order=False):
    """Whether two Graph objects hold the same relation (the same edge set, each edge as often),
    whatever their kinds and constructors: band(n, left=None, right=0) is triangular(n), so is
    cu_seqlens([0, n]); zero-length segments add nothing; a CSR relation's edges may be listed
    in any order within a row. With `edge_order`, two CSR relations must also list their edges
    in the same order (per-edge values follow it)."""
    return _relation_difference(a, b, edge_order) is None


def _relation_difference(a, b, edge_order=False):
    """None when `a` and `b` hold the same relation (_same_relation), else what differs, in
    words. Cheap facts first, then the kernel-facing arrays: O(blocks) for implicit relations
    (their block bands are stored clipped to each block, so once the blocks without edges are
    dropped one relation has one form), O(edges) for CSR; an implicit relation against a CSR
    one through their sorted scipy CSR (up to SAME_RELATION_MAX_EDGES edges)."""
    for name in ("num_src", "num_dst", "num_edges"):
        x, y = getattr(a, name), getattr(b, name)
        if x != y:
            return f"{name} {x} in the forward, {y} here"
    ra, rb = a.realize("cpu"), b.realize("cpu")
    if type(ra) is not type(rb):
        if a.num_edges > SAME_RELATION_MAX_EDGES:
            return (f"an implicit and a CSR relation of {a.num_edges} edges (more than "
                    f"{SAME_RELATION_MAX_EDGES} are not compared edge by edge)")
        sa, sb = _sorted_csr(a.to_scipy()), _sorted_csr(b.to_scipy())
        same = np.array_equal(sa.indptr, sb.indptr) and np.array_equal(sa.indices, sb.indices)
        return None if same else "their edge sets differ"
    if hasattr(ra, "dst_offsets"):
        if all(np.array_equal(x, y) for x, y in zip(_nonempty_blocks(ra), _nonempty_blocks(rb))):
            return None
        if a.num_edges > SAME_RELATION_MAX_EDGES:
            return "their blocks differ"
        # one edge set may still be cut into blocks two ways (rows without edges in a block)
        sa, sb = _sorted_csr(a.to_scipy()), _sorted_csr(b.to_scipy())
        same = np.array_equal(sa.indptr, sb.indptr) and np.array_equal(sa.indices, sb.indices)
        return None if same else "their edge sets differ"
    if not np.array_equal(np.asarray(ra.indptr), np.asarray(rb.indptr)):
        return "their in-degrees (indptr) differ"
    if np.array_equal(np.asarray(ra.indices), np.asarray(rb.indices)):
        return None
    if edge_order:
        return "their edges are listed in another order, and per-edge values follow that order"
    sa = _sorted_csr(a.to_scipy())
    sb = _sorted_csr(b.to_scipy())
    return None if np.array_equal(sa.indices, sb.indices) else "their edge sets differ"


def _sorted_csr(m):
    """scipy CSR with each row's column indices sorted, duplicates kept (a multiset per row)."""
    m = m.tocsr(copy=True)
    m.has_sorted_indices = False
    m.sort_indices()
    return m


def _nonempty_blocks(rel):
    """(dst start, dst end, src start, src end, lo, hi) of the blocks of a BlockRelation that hold
    at least one edge, as int64 arrays: zero-length segments and blocks whose band is empty
    are not part of the relation's edge set."""
    dst = np.asarray(rel.dst_offsets, np.int64)
    src = np.asarray(rel.src_offsets, np.int64)
    lo, hi = np.asarray(rel.lo, np.int64), np.asarray(rel.hi, np.int64)
    # lo / hi are clipped to the block: a block with rows and columns and lo <= hi holds an edge
    keep = (np.diff(dst) > 0) & (np.diff(src) > 0) & (lo <= hi)
    return dst[:-1][keep], dst[1:][keep], src[:-1][keep], src[1:][keep], lo[keep], hi[keep]


@noting_failure("tiga_numba.attention_backward")
@foreign_arrays(primary="q")
def attention_backward(dout, q, k, v, out, stats, graph, *, scale=None, deterministic=None,
                       softcap=None, alibi_slopes=None):
    """Fused backward of `attention`: gradients of the loss with respect to q, k and v.

    Rebuilds p = exp(s - m) / l from the forward's stats, uses Delta_i = sum(dout_i * out_i)
    and ds = p * (dp - Delta_i); writes no (num_edges,)-sized buffer. Deterministic by default:
    the same bits on every run (dq by destination rows, dk / dv by source rows over the
    transposed relation, no float atomics).

    Parameters
    ----------
    dout : array (num_dst, H, Dv)
        Gradient of the loss with respect to `out`.
    q, k, v : arrays
        The forward's inputs (shapes as in `attention`).
    out : array (num_dst, H, Dv)
        The forward's output.
    stats : AttentionStats
        From `attention(..., return_stats=True)` of an exact (not tile-pruned) forward.
    graph : Graph
        The forward's relation.
    scale : float, optional
        The forward's scale; default `D ** -0.5`.
    deterministic : bool, optional
        ``True`` (the default, see `tiga_numba.run_options`): same bits on every run. ``False``
        allows a faster float-atomic backward where one is registered for the device (as
        flash-attn's ``deterministic=False``); results then differ in the last bits.
    softcap, alibi_slopes : optional
        The forward's score modifiers (the score is recomputed with them).

    Returns
    -------
    dq : array (num_dst, H, D)
    dk : array (num_src, Hkv, D)
    dv : array (num_src, Hkv, Dv)
        In q's dtype and array library.

    Raises
    ------
    NotImplementedError
        The stats come from a tile-pruned forward (it has no exact gradient).
    TypeError, ValueError
        As for `attention`; also for stats without ``m`` and ``l`` (any object holding them
        is taken, e.g. merged stats), stats of another graph, shape, scale or score, and dout /
        out of the wrong shape."""
    mod = flash_modifier(q, graph, softcap, alibi_slopes)
    res = run_backward(dout, q, k, v, out, stats, graph, scale=scale,
                       deterministic=deterministic, score_mod=mod)
    return res[0], res[1], res[2]
