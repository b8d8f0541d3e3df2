"""Attention and its backward over dask arrays chunked along the node axis.

    import tiga_numba.dask as tgd
    out, stats = tgd.attention(q, k, v, graph, return_stats=True)      # dask arrays in, dask arrays out
    dq, dk, dv = tgd.attention_backward(dout, q, k, v, out, stats, graph)

q's chunks along axis 0 are the destination partitions, k's (and v's) the source chunks; the
other axes must be one chunk. Every task is a call of the single-process kernels on one piece:

* CSR relations: one task per destination partition. It receives q's chunk and, from every
  source chunk that holds a source of its edges, only those rows (a *halo*, gathered by a small
  task next to the source chunk). Its local relation is the partition's rows with the source ids
  renumbered into the halo, so the forward needs no merge. The backward computes dq locally and
  the halo's partial dk/dv, which are scattered back to their source chunks and summed there in
  increasing partition order.
* Implicit relations (dense, triangular, segments, band): one task per (query chunk, key chunk) block
  that the relation touches (blocks without edges are never created). The partial results of a
  query chunk are combined by the exact online-softmax merge in a fixed-order tree; the backward
  runs per block with the merged (full-row) statistics and sums dq per query chunk and dk/dv per
  key chunk, again in a fixed-order tree.

flash-attn's ``softcap`` and ``alibi_slopes`` apply in every task; ALiBi's distance is taken in the
whole relation's positions (a block task is told its chunks' first rows, a CSR partition its
halo's source ids).

The index plan (halos, local relations, touched blocks) is computed once per graph and chunking
and kept on the graph. With a dask.distributed Client as the default scheduler, the CSR local
relations are submitted to it once per plan and the tasks refer to those futures (a call then
ships no relation); otherwise they travel inside each call's task graph. With such a Client and
inputs in worker memory, the implicit relations' tasks are annotated with the worker that holds
their query (or key) chunk, which dask keeps when its low-level fusion is off
(``optimization.fuse.active: False``). Tasks hold no state outside their results, so any dask
scheduler may recompute a lost one. See docs/dask.md.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import operator
import threading
import uuid

import dask.array as da
import numpy as np
from dask.base import tokenize
from dask.core import flatten, keys_in_tasks
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from .functional import AttentionStats
from .functional import attention as _attention
from .functional import attention_backward as _attention_backward
from .functional import run_backward as _run_backward
from .functional import run_forward as _run_forward
from .graph import Graph
from .merge import attention_merge, log_sum_exp
from .scratch import ScratchPool

__all__ = ["attention", "attention_backward", "DaskAttentionStats", "plan_summary", "release_halo_buffers"]

# Fan-in of the merge and sum trees: at most this many partial results meet in one task.
TREE_FAN_IN = 4
# Per worker process, local relations of recent tasks are kept (with the realisations and the
# transpose the kernels derive from them) up to about this many bytes, so that a repeated call
# does not rebuild them; a pure memo: results never depend on it, and a new worker starts empty.
WARM_GRAPH_BYTES = 1 << 30
# A CSR partition that needs at least this fraction of a source chunk's rows receives the whole
# chunk instead of a gathered copy of those rows (a random graph needs nearly every row).
WHOLE_CHUNK_FRACTION = 15 / 16
# Per worker process, the host buffers that CSR tasks assemble their k and v halos in are kept
# for the next task up to this many idle bytes: a halo is up to all of k and v, and writing it
# into fresh memory costs a page fault per page on every call (cupy chunks use cupy's pool).
HALO_SCRATCH_BYTES = 2 << 30
_halo_scratch = ScratchPool(lambda: HALO_SCRATCH_BYTES)   # the setting as it is at each return


class DaskAttentionStats:
    """Per-row softmax statistics of :func:`attention`, as dask arrays chunked like q's rows:
    ``m`` (max scaled score), ``l`` (sum of exp(s - m)) and ``lse`` (m + log l, -inf for an
    empty row). Pass it to :func:`attention_backward`."""

    __slots__ = ("m", "l")
    block_prune_threshold = None  # dask attention is always exact

    def __init__(self, m, l):
        self.m = m
        self.l = l

    def __iter__(self):
        return iter((self.m, self.l))

    @property
    def lse(self):
        return da.map_blocks(log_sum_exp, self.m, self.l, dtype=self.m.dtype)

    def __repr__(self):
        return (f"DaskAttentionStats(m shape={tuple(self.m.shape)}, chunks={self.m.chunks[0]}, "
                f"dtype={self.m.dtype})")


# --------------------------------------------------------------------------- validation
def _check_dask(name, array):
    if not isinstance(array, da.Array):
        raise TypeError(f"{name} must be a dask array, got {type(array).__name__}; wrap it with "
                        f"dask.array.from_array({name}, chunks=(rows_per_chunk,) + {name}.shape[1:])")
    meta = array._meta
    if not (isinstance(meta, np.ndarray) or type(meta).__module__.partition(".")[0] == "cupy"):
        raise TypeError(f"{name} must have numpy or cupy chunks, got a dask array of "
                        f"{type(meta).__module__}.{type(meta).__name__} chunks (its _meta)")
    if any(np.isnan(c) for axis in array.chunks for c in axis):
        raise ValueError(f"{name} has unknown chunk sizes {array.chunks}; call "
                         f"{name}.compute_chunk_sizes() first")
    for axis in range(1, array.ndim):
        if len(array.chunks[axis]) > 1:
            raise ValueError(
                f"{name} is chunked along axis {axis} (chunks {array.chunks[axis]}); only the node "
                f"axis (0) may be chunked: use {name}.rechunk({{{axis}: -1}})")
    return array


def _check_rows_like(name, array, q):
    _check_dask(name, array)
    if array.chunks[0] != q.chunks[0]:
        raise ValueError(f"{name} is chunked {array.chunks[0]} along axis 0 but q is chunked "
                         f"{q.chunks[0]}; the chunk boundaries must agree")
    return array


def _check_inputs(q, k, v, graph, scale=None):
    for name, a in (("q", q), ("k", k), ("v", v)):
        _check_dask(name, a)
    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be a tiga_numba.Graph, got {type(graph).__name__}")
    if v.chunks[0] != k.chunks[0]:
        raise ValueError(f"v is chunked {v.chunks[0]} along axis 0 but k is chunked {k.chunks[0]}; "
                         "k and v must share their chunk boundaries")
    if q.shape[0] != graph.num_dst:
        raise ValueError(f"graph has num_dst={graph.num_dst} but q has {q.shape[0]} rows (axis 0)")
    if k.shape[0] != graph.num_src:
        raise ValueError(f"graph has num_src={graph.num_src} but k has {k.shape[0]} rows (axis 0)")
    if v.shape[0] != graph.num_src:
        raise ValueError(f"graph has num_src={graph.num_src} but v has {v.shape[0]} rows (axis 0)")
    # The single-process checks (library, dtype, heads, dims) on zero-row stand-ins: they run
    # no kernel and give the result dtypes.
    mq, mk, mv = (_empty_rows(a) for a in (q, k, v))
    out, stats = _attention(mq, mk, mv, Graph.dense(0, 0), scale=scale, return_stats=True)
    return out, stats


def _empty_rows(array, dtype=None):
    meta = array._meta
    xp = _xp_of(meta)
    return xp.zeros((0,) + tuple(array.shape[1:]), dtype=dtype or array.dtype)


def _xp_of(array):
    if isinstance(array, np.ndarray):
        return np
    import cupy
    return cupy


def _bounds(chunks):
    return tuple(int(b) for b in np.concatenate([[0], np.cumsum(chunks)]))


def _chunk_key(array, i):
    return (array.name, i) + (0,) * (array.ndim - 1)


# --------------------------------------------------------------------------- index plans
class _CSRPart:
    """One destination partition: rows [d0, d1), its local relation over the halo, and per
    source chunk c the rows of chunk c it needs (local to the chunk) with their slice of the
    halo."""
    __slots__ = ("d0", "d1", "graph", "pieces")

    def __init__(self, d0, d1, graph, pieces):
        self.d0, self.d1, self.graph, self.pieces = d0, d1, graph, pieces

    def halo_ids(self, src_bounds):
        """The global source id of each halo row (int64, increasing): what the halo's local
        position j stands for."""
        ids = [src_bounds[c] + rows for c, rows, _, _ in self.pieces]
        return np.concatenate(ids) if ids else np.zeros(0, np.int64)


class _Plan:
    __slots__ = ("token", "kind", "parts", "blocks", "src_bounds", "uploaded", "lock")

    def __init__(self, kind, src_bounds, parts=None, blocks=None):
        self.token = uuid.uuid4().hex
        self.kind = kind
        self.parts = parts      # CSR: list of _CSRPart, one per destination partition
        self.blocks = blocks    # implicit: per query chunk, list of (key chunk, block Graph)
        self.src_bounds = tuple(int(b) for b in src_bounds)
        self.uploaded = {}      # CSR on dask.distributed: (client id, what) -> futures per partition
        self.lock = threading.Lock()


def _default_client():
    """The dask.distributed Client that computes dask collections by default, else None."""
    import sys
    if "distributed" not in sys.modules:   # never imports distributed itself
        return None
    import distributed
    from dask.base import get_scheduler
    try:
        client = getattr(get_scheduler(), "__self__", None)
    except Exception:   # pragma: no cover - a misconfigured scheduler: graphs carry the data
        return None
    if isinstance(client, distributed.Client) and client.status == "running":
        return client
    return None


def _identity(x):
    return x


def _held(keys, dask_scheduler=None):
    """(runs on the scheduler) {key: sorted addresses of the workers holding it} for the keys in
    memory; reads the scheduler's state, computes nothing."""
    out = {}
    for key in keys:
        ts = dask_scheduler.tasks.get(key)
        if ts is not None and ts.who_has:
            out[key] = sorted(ws.address for ws in ts.who_has)
    return out


def _homes(arrays, work=None):
    """Where a dask.distributed Client (the default scheduler) holds the node-axis chunks of
    `arrays` (chunked alike): {chunk index: worker address}, the worker chosen among those holding
    chunk i of every array (else of the first) so that the chunks' `work` (list, one number per
    chunk; None: equal) is spread evenly, the largest first; a chunk held by one worker goes there.
    {} without such a client; nothing for chunks not in memory (a lazy array). Replicas are why a
    choice is needed: a task that read a chunk on another worker leaves a copy there."""
    client = _default_client()
    if client is None:
        return {}
    n = len(arrays[0].chunks[0])
    keys = [_chunk_key(a, i) for a in arrays for i in range(n)]
    try:
        held = client.run_on_scheduler(_held, keys=keys)
    except Exception:   # pragma: no cover - a scheduler that cannot answer: no placement hints
        return {}
    work = [1] * n if work is None else list(work)
    load, homes = collections.Counter(), {}
    for i in sorted(range(n), key=lambda i: -work[i]):
        sets = [set(held.get(_chunk_key(a, i), ())) for a in arrays]
        both = set.intersection(*sets) or sets[0]
        if both:
            homes[i] = min(sorted(both), key=lambda w: load[w])
            load[homes[i]] += work[i]
    return homes


def _pin(pins, key):
    """the `workers` annotation of task `key`: [its worker] where the graph pins it, else None
    (no restriction)."""
    home = pins.get(key)
    return None if home is None else [home]


def _per_partition(plan, what, make):
    """Per CSR partition, what its tasks get as `what` (`make(part)`: the local relation, or the
    halo's source ids): the object itself (it then travels inside every call's task graph), or,
    when a dask.distributed Client is the default scheduler, a future of it uploaded once per
    plan and client. The upload is a task holding the object (not a scatter), so the scheduler
    recomputes it if the worker holding it is lost; the futures live as long as the graph's
    plan."""
    client = _default_client()
    if client is None:
        return [make(part) for part in plan.parts]
    with plan.lock:
        futures = plan.uploaded.get((client.id, what))
        if futures is None or any(f.status in ("cancelled", "error", "lost") for f in futures):
            futures = [client.submit(_identity, make(part), pure=False,
                                     key=f"tiga-attention-{what}-{plan.token}-{p}")
                       for p, part in enumerate(plan.parts)]
            plan.uploaded[(client.id, what)] = futures
    return futures


def _relations(plan):
    """Per CSR partition, the local relation its tasks read (see _per_partition)."""
    return _per_partition(plan, "relation", lambda part: part.graph)


def _csr_positions(plan, score):
    """Per CSR partition, the extra task arguments of a score modifier that reads node
    positions (ALiBi): the global ids of its halo rows (see _per_partition), else none."""
    if score is None or score.slopes is None:
        return [()] * len(plan.parts)
    return [(ids,) for ids in _per_partition(plan, "source-ids",
                                             lambda part: part.halo_ids(plan.src_bounds))]


def _csr_plan(graph, dst_bounds, src_bounds):
    indptr, indices = graph._host_csr()
    src_bounds = np.asarray(src_bounds, np.int64)
    sizes = np.diff(src_bounds)
    chunk_of = np.repeat(np.arange(sizes.shape[0]), sizes)   # source id -> its chunk
    parts = []
    for d0, d1 in zip(dst_bounds[:-1], dst_bounds[1:]):
        e0, e1 = int(indptr[d0]), int(indptr[d1])
        sources = indices[e0:e1]
        # the halo: every needed source once, in increasing id, so it is grouped by source chunk
        # (a mask over the sources: O(E_p + N_s), where sorting the edges' sources was
        # O(E_p log E_p) and most of the plan's time)
        used = np.zeros(graph.num_src, np.bool_)
        used[sources] = True
        # a chunk of which the partition needs at least WHOLE_CHUNK_FRACTION of the rows is
        # taken whole: no gather task and no copy at the source, for at most
        # 1 / WHOLE_CHUNK_FRACTION - 1 more bytes moved
        counts = np.bincount(chunk_of[used], minlength=sizes.shape[0]) if sizes.shape[0] else sizes
        whole = counts >= WHOLE_CHUNK_FRACTION * sizes
        used |= whole[chunk_of] & (counts > 0)[chunk_of]
        needed = np.flatnonzero(used)
        local = (np.cumsum(used, dtype=np.int64) - 1)[sources]
        sub = Graph.from_csr(indptr[d0:d1 + 1] - e0, local.astype(np.int32), num_src=int(needed.shape[0]))
        cuts = np.searchsorted(needed, src_bounds)
        pieces = [(c, (needed[cuts[c]:cuts[c + 1]] - src_bounds[c]).astype(np.int64),
                   int(cuts[c]), int(cuts[c + 1]))
                  for c in range(len(src_bounds) - 1) if cuts[c + 1] > cuts[c]]
        parts.append(_CSRPart(d0, d1, sub, pieces))
    return _Plan("csr", src_bounds, parts=parts)


def _block_plan(graph, dst_bounds, src_bounds):
    """Per query chunk, the key chunks whose block holds an edge, with the block's relation
    (implicit: dense, triangular, band or segments, renumbered from 0)."""
    blocks = []
    for d0, d1 in zip(dst_bounds[:-1], dst_bounds[1:]):
        row_blocks = []
        for c, (s0, s1) in enumerate(zip(src_bounds[:-1], src_bounds[1:])):
            sub = graph.restrict(d0, d1, s0, s1)
            if sub.num_edges:
                row_blocks.append((c, sub))
        blocks.append(row_blocks)
    return _Plan("blocks", src_bounds, blocks=blocks)


def _plan(graph, q, k):
    """The index plan for this graph and chunking, computed once and kept on the graph (it is
    dropped with the graph, and never pickled with it)."""
    dst_bounds, src_bounds = _bounds(q.chunks[0]), _bounds(k.chunks[0])
    build = _block_plan if graph.is_implicit else _csr_plan
    plan = graph._cached(("dask plan", dst_bounds, src_bounds),
                         lambda: build(graph, dst_bounds, src_bounds))
    if plan.kind == "blocks" and not isinstance(q._meta, np.ndarray):
        _check_cuda_blocks(graph, plan)
    return plan


def _check_cuda_blocks(graph, plan):
    # Banded sub-blocks (chunk boundaries that cut a causal diagonal or a window) run on the CUDA
    # kernels of a single process, but the dask path over cupy chunks has been tested on full and
    # square-causal blocks only: refuse the others when the dask graph is built (fail closed)
    # rather than in a task on a worker.
    for p, row_blocks in enumerate(plan.blocks):
        for c, sub in row_blocks:
            if not sub._blocks.standard:
                raise NotImplementedError(
                    f"block (query chunk {p}, key chunk {c}) of this {graph.kind} relation is a band "
                    f"({sub.kind}), which tiga_numba.dask does not run on cupy chunks yet; give q "
                    "and k the same chunk boundaries (causal diagonal blocks are then triangles), "
                    "or use a CSR relation: Graph.from_scipy(graph.to_scipy())")


def plan_summary(graph, q, k):
    """What the tasks of this graph and chunking read, without running anything.

    Returns a dict with ``kind`` ('csr' or 'blocks'), ``tasks`` (forward tasks) and ``edges``
    (per destination partition), and

    * CSR: ``halo`` per destination partition, ``{source chunk: rows gathered from it}``
      (``halo_rows`` their sum): a partition's task receives exactly these rows of k and v;
    * implicit: ``blocks`` per destination partition, the key chunks it meets."""
    _check_dask("q", q)
    _check_dask("k", k)
    plan = _plan(graph, q, k)
    if plan.kind == "csr":
        return {"kind": "csr", "tasks": len(plan.parts),
                "halo": [{c: int(r.shape[0]) for c, r, _, _ in p.pieces} for p in plan.parts],
                "halo_rows": [p.graph.num_src for p in plan.parts],
                "edges": [p.graph.num_edges for p in plan.parts]}
    return {"kind": "blocks", "tasks": sum(len(b) for b in plan.blocks),
            "blocks": [[c for c, _ in b] for b in plan.blocks],
            "edges": [sum(g.num_edges for _, g in b) for b in plan.blocks]}


# --------------------------------------------------------------------------- task functions
_warm_graphs = collections.OrderedDict()   # (plan token, task) -> (Graph, bytes), newest last
_warm_lock = threading.Lock()


def _warm(graph, key):
    """The local relation of task `key` as a previous task in this process left it (realised,
    transposed), else `graph`, remembered for the next call."""
    with _warm_lock:
        hit = _warm_graphs.get(key)
        if hit is not None:
            _warm_graphs.move_to_end(key)
            return hit[0]
        _warm_graphs[key] = (graph, 24 * graph.num_edges + 16 * graph.num_dst)
        total = sum(b for _, b in _warm_graphs.values())
        while total > WARM_GRAPH_BYTES and len(_warm_graphs) > 1:
            total -= _warm_graphs.popitem(last=False)[1][1]
    return graph


# Module-level functions (they pickle by reference); every literal they need is bound with
# functools.partial so that the scheduler never mistakes it for a key or a task.
def _take(chunk, rows):
    if not isinstance(chunk, np.ndarray):
        rows = _xp_of(chunk).asarray(rows)
    return chunk[rows]


def release_halo_buffers():
    """Drop the idle halo buffers this process keeps (see HALO_SCRATCH_BYTES). With the threaded
    or synchronous scheduler that is the calling process; on dask.distributed workers, run it
    there: ``client.run(tiga_numba.dask.release_halo_buffers)``. Returns the bytes released."""
    released = _halo_scratch.idle_bytes
    _halo_scratch.clear()
    return released


@contextlib.contextmanager
def _halo(parts):
    """A task's halo pieces as one array, for the task's kernel call only (nothing it returns
    views the halo): a single piece itself; numpy pieces copied into a buffer of the worker's
    pool (the kernels read a node-major array, so the copy cannot be avoided); cupy pieces
    concatenated (cupy pools device memory)."""
    if len(parts) == 1:
        yield parts[0]
        return
    if _xp_of(parts[0]) is not np:
        yield _xp_of(parts[0]).concatenate(parts, axis=0)
        return
    shape = (sum(p.shape[0] for p in parts),) + parts[0].shape[1:]
    with _halo_scratch.borrow(shape, np.result_type(*parts)) as halo:
        np.concatenate(parts, axis=0, out=halo)
        yield halo


def _csr_forward(q_p, k_parts, v_parts, graph, positions=None, *, warm, scale, score=None, offset=0):
    mod = _task_modifier(score, q_p, offset=offset, src_positions=positions)
    with _halo(k_parts) as k, _halo(v_parts) as v:
        out, stats, _ = _run_forward(q_p, k, v, _warm(graph, warm), scale=scale, score_mod=mod)
    return out, stats.m, stats.l


def _csr_backward(dout_p, q_p, k_parts, v_parts, out_p, m_p, l_p, graph, positions=None, *, warm,
                  scale, score=None, offset=0):
    mod = _task_modifier(score, q_p, offset=offset, src_positions=positions)
    with _halo(k_parts) as k, _halo(v_parts) as v:
        return _run_backward(dout_p, q_p, k, v, out_p, AttentionStats(m_p, l_p),
                             _warm(graph, warm), scale=scale, score_mod=mod)[:3]


class _FlashScore:
    """flash-attn's score modifiers of one call as its tasks need them (small and picklable):
    the soft-cap (a float or None) and the ALiBi slopes (a host array or None) with the
    relation's per-row bottom-right shift (functional._alibi_shift, host, or None)."""
    __slots__ = ("softcap", "slopes", "shift")

    def __init__(self, softcap, slopes, shift):
        self.softcap, self.slopes, self.shift = softcap, slopes, shift

    def __dask_tokenize__(self):
        return (self.softcap, self.slopes, self.shift)


def _check_score(q, graph, softcap, alibi_slopes):
    """softcap and alibi_slopes checked as tiga_numba.attention checks them (on a zero-row
    stand-in of q: the library, the heads), before any task is built, so that a bad value
    fails at the call, not inside a worker. None when neither is given."""
    if softcap is None and alibi_slopes is None:
        return None
    from .arrays import scalar_value
    from .functional import _alibi_shift, flash_modifier
    if softcap is not None:
        softcap = scalar_value(softcap)   # a 0-d array or tensor: its number
    stand_in = _empty_rows(q)
    mod = flash_modifier(stand_in, Graph.dense(0, 0), softcap, alibi_slopes)
    slopes = shift = None
    if alibi_slopes is not None:
        slopes = next(v for x, v in mod.values.items() if x.op == "head")
        if not isinstance(slopes, np.ndarray):
            slopes = slopes.get()   # cupy: tasks convert back to their chunks' library
        shift = graph._cached("dask alibi shift", lambda: _alibi_shift(graph))
    return _FlashScore(None if softcap is None else float(softcap), slopes, shift)


def _task_modifier(score, q, *, shift_rows=None, offset=0, src_positions=None):
    """The score modifier of a task's kernel call, with the task's rows and sources at their
    positions in the whole relation: ALiBi's distance |i + shift(i) - j| (shift: the relation's
    bottom-right alignment, 0 where it has none) is computed as |i_task + shift_task(i) - j_task|
    with shift_task = shift + offset. Blocks: j_task is the key's row in its chunk and offset =
    q0 - k0 (rows q0 and k0 start the task's query and key chunks). CSR partitions: the halo's
    local position is no affine map of the source id, so the tree reads j as the node field
    src._alibi_source (`src_positions`, the halo's ids) and offset = d0."""
    if score is None:
        return None
    from . import score_mod as sm
    xp = _xp_of(q)
    alibi = score.slopes is not None
    tree = sm.flash_tree(score.softcap is not None, alibi, alibi)
    values = {}
    if score.softcap is not None:
        values[sm.Expr("scalar", (), "softcap")] = score.softcap
    if alibi:
        values[sm.Expr("head", (), "alibi_slopes")] = xp.asarray(score.slopes)
        n = int(q.shape[0])
        shift = (np.full(n, offset, np.int64) if shift_rows is None
                 else np.asarray(shift_rows, np.int64) + offset)
        values[sm.Expr("node", (), ("dst", "_alibi_shift"))] = xp.asarray(shift)
        if src_positions is not None:
            source = sm.Expr("node", (), ("src", "_alibi_source"))
            tree = sm.substitute(tree, {sm.Expr("index", (), "src"): source})
            values[source] = xp.asarray(src_positions)
    return sm.BoundModifier(tree, values)


def _halo_piece(result, which, start, stop):
    return result[which][start:stop]


def _scatter_sum(like, pieces, *, rows, dtype, acc):
    """Sum the partial gradients of one source chunk, in the order given (increasing
    destination partition); `rows` holds, per piece, the chunk's rows it covers (None: all)."""
    xp = _xp_of(like)
    whole = [r is None for r in rows]   # a piece that covers the whole chunk, in order
    # The sum starts from the leading whole pieces, 0 + piece being piece: two are added into a
    # new array in one pass (the same bits as a copy and an add); one alone is passed on without
    # a copy when nothing follows (a chunk covered by one partition: 1 GB of dk and dv not copied
    # at 1M rows, H=4, D=32); otherwise from zeros.
    if whole[:2] == [True, True]:
        total, start = xp.add(pieces[0], pieces[1], dtype=acc), 2
    elif whole[:1] == [True]:
        total, start = pieces[0].astype(acc, copy=len(pieces) > 1), 1
    else:
        total, start = xp.zeros(like.shape, dtype=acc), 0
    for r, piece in zip(rows[start:], pieces[start:]):
        if r is None:
            total += piece
        else:
            total[xp.asarray(r) if xp is not np else r] += piece.astype(acc, copy=False)
    return total.astype(dtype, copy=False)


def _block_forward(q_p, k_c, v_c, *, graph, warm, scale, acc, score=None, shift_rows=None, offset=0):
    mod = _task_modifier(score, q_p, shift_rows=shift_rows, offset=offset)
    out, stats, _ = _run_forward(q_p, k_c, v_c, _warm(graph, warm), scale=scale, score_mod=mod)
    return out.astype(acc, copy=False), stats.m, stats.l   # partials merge in the accumulation dtype


def _merge(*parts):
    out, stats = attention_merge([(o, AttentionStats(m, l)) for o, m, l in parts])
    return out, stats.m, stats.l


def _empty_forward(q_p, *, value_dim, acc):
    xp = _xp_of(q_p)
    row_shape = tuple(q_p.shape[:-1])
    return (xp.zeros(row_shape + (value_dim,), dtype=acc), xp.full(row_shape, -np.inf, dtype=acc),
            xp.zeros(row_shape, dtype=acc))


def _block_backward(dout_p, q_p, k_c, v_c, out_p, m_p, l_p, *, graph, warm, scale, acc, score=None,
                    shift_rows=None, offset=0):
    mod = _task_modifier(score, q_p, shift_rows=shift_rows, offset=offset)
    grads = _run_backward(dout_p, q_p, k_c, v_c, out_p, AttentionStats(m_p, l_p),
                          _warm(graph, warm), scale=scale, score_mod=mod)[:3]
    return tuple(g.astype(acc, copy=False) for g in grads)


def _block_score(score, plan, dst_bounds, p, c):
    """The partial's keyword arguments of block (p, c) for _task_modifier."""
    if score is None or score.slopes is None:
        return {"score": score}
    q0, q1 = dst_bounds[p], dst_bounds[p + 1]
    return {"score": score, "offset": q0 - plan.src_bounds[c],
            "shift_rows": None if score.shift is None else score.shift[q0:q1]}


def _sum(*parts):
    return functools.reduce(operator.add, parts)   # left to right: a fixed order


def _zeros_like(like, *, dtype):
    return _xp_of(like).zeros(like.shape, dtype=dtype)


def _cast(part, *, dtype, which=None):
    x = part if which is None else part[which]
    return x.astype(dtype, copy=False)


def _tree(dsk, prefix, leaves, combine):
    """Combine `leaves` (keys, in order) in a tree of fan-in TREE_FAN_IN; returns the root key.
    The tree's shape depends only on the number of leaves: the same bits on every run."""
    level = 0
    while len(leaves) > 1:
        nxt = []
        for i in range(0, len(leaves), TREE_FAN_IN):
            group = leaves[i:i + TREE_FAN_IN]
            if len(group) == 1:
                nxt.append(group[0])
                continue
            key = prefix + (level, i // TREE_FAN_IN)
            dsk[key] = (combine,) + tuple(group)
            nxt.append(key)
        leaves = nxt
        level += 1
    return leaves[0]


# --------------------------------------------------------------------------- graph assembly
def _collect(core_name, core, inputs, outputs, pins=None):
    """dask arrays for `outputs` = [(name, layer dict, chunks, meta)], all reading the tasks of
    layer `core`, which reads the `inputs` collections. `pins` {task key: worker address}: where
    dask.distributed should run those tasks (an annotation; other workers stay allowed)."""
    layers, deps = {}, {}
    for a in inputs:
        g = a.__dask_graph__()
        layers.update(g.layers)
        deps.update(g.dependencies)
    annotations = ({"workers": functools.partial(_pin, pins), "allow_other_workers": True}
                   if pins else None)
    layers[core_name] = MaterializedLayer(core, annotations=annotations)
    deps[core_name] = {a.name for a in inputs}
    # an output task may read an input chunk directly (a chunk's gradient shaped like k's chunk,
    # zeros for a chunk no block touches): a HighLevelGraph must declare exactly the layers its
    # tasks read (dask's graph validation, dask.array.utils.assert_eq, checks it)
    readable = set(core) | {key for a in inputs for key in flatten(a.__dask_keys__())}
    for name, layer, _, _ in outputs:
        layers[name] = MaterializedLayer(layer)
        deps[name] = {key[0] for key in keys_in_tasks(readable, layer.values())}
    graph = HighLevelGraph(layers, deps)
    return [da.Array(graph, name, chunks, meta=meta) for name, _, chunks, meta in outputs]


def _row_outputs(name, q, nparts, source, ndim_tail):
    """Layer for an output chunked like q's rows: key (name, p, 0, ...) <- source(p)."""
    return {(name, p) + (0,) * ndim_tail: source(p) for p in range(nparts)}


def attention(q, k, v, graph, *, scale=None, return_stats=False, softcap=None, alibi_slopes=None):
    """Attention of q over k, v along `graph`, with dask arrays chunked along the node axis.

    Parameters
    ----------
    q : dask array ``(num_dst, H, D)`` (or ``(num_dst, D)``), numpy or cupy chunks; its chunks
        along axis 0 are the destination partitions.
    k, v : dask arrays ``(num_src, Hkv, D)`` / ``(num_src, Hkv, Dv)`` with the same chunks along
        axis 0. Only axis 0 may be chunked.
    graph : tiga_numba.Graph with ``num_dst == q.shape[0]`` and ``num_src == k.shape[0]``.
    scale : float, optional
        The score scale, ``D ** -0.5`` by default (checked at the call, as every argument).
    return_stats : bool
        Also return the per-row softmax state (``m``, ``l``) that ``attention_backward`` takes.
    softcap : float, optional
        flash-attn's soft-cap, as in :func:`tiga_numba.attention`.
    alibi_slopes : array ``(H,)``, optional
        flash-attn's ALiBi slopes, as in :func:`tiga_numba.attention` (a numpy array for numpy
        chunks, cupy for cupy chunks): the distance is the one of the whole relation (node
        positions, bottom-right aligned in dense and cu_seqlens blocks), whatever the chunks.

    Returns
    -------
    out : dask array ``(num_dst, H, Dv)`` in q's dtype, chunked like q.
    stats : :class:`DaskAttentionStats` (``return_stats=True``), ``m``/``l``/``lse`` chunked like
        q's rows. Equal to the single-process call within rounding, on any dask scheduler.
    """
    meta_out, meta_stats = _check_inputs(q, k, v, graph, scale)
    score = _check_score(q, graph, softcap, alibi_slopes)
    plan = _plan(graph, q, k)
    dtype, acc = meta_out.dtype, meta_stats.m.dtype
    value_dim = int(v.shape[-1])
    token = tokenize(plan.token, q.name, k.name, v.name, scale, score)
    core_name = f"tiga-attention-tasks-{token}"
    core = {}
    nparts = len(q.chunks[0])
    roots = []
    if plan.kind == "csr":
        relations, positions = _relations(plan), _csr_positions(plan, score)
        for p, part in enumerate(plan.parts):
            k_parts, v_parts = _gather_halo(core, plan, p, part, k, v)
            key = (core_name, "forward", p)
            core[key] = (functools.partial(_csr_forward, warm=(plan.token, p), scale=scale, score=score,
                                           offset=part.d0),
                         _chunk_key(q, p), k_parts, v_parts, relations[p], *positions[p])
            roots.append(key)
        cast_out = functools.partial(_cast, dtype=dtype, which=0)
    else:
        dst_bounds = _bounds(q.chunks[0])
        for p, row_blocks in enumerate(plan.blocks):
            leaves = []
            for c, sub in row_blocks:
                key = (core_name, "block", p, c)
                core[key] = (functools.partial(_block_forward, graph=sub, warm=(plan.token, p, c),
                                               scale=scale, acc=acc,
                                               **_block_score(score, plan, dst_bounds, p, c)),
                             _chunk_key(q, p), _chunk_key(k, c), _chunk_key(v, c))
                leaves.append(key)
            if not leaves:
                key = (core_name, "empty", p)
                core[key] = (functools.partial(_empty_forward, value_dim=value_dim, acc=acc),
                             _chunk_key(q, p))
                leaves.append(key)
            roots.append(_tree(core, (core_name, "merge", p), leaves, _merge))
        cast_out = functools.partial(_cast, dtype=dtype, which=0)
    tail = q.ndim - 1
    rows = q.chunks[0]
    out_name, m_name, l_name = (f"tiga-attention-{w}-{token}" for w in ("out", "m", "l"))
    outputs = [(out_name, _row_outputs(out_name, q, nparts, lambda p: (cast_out, roots[p]), tail),
                (rows,) + tuple((s,) for s in meta_out.shape[1:]), meta_out)]
    if return_stats:
        for name, which in ((m_name, 1), (l_name, 2)):
            outputs.append((name, _row_outputs(name, q, nparts,
                                               lambda p, w=which: (operator.getitem, roots[p], w),
                                               tail - 1),
                            (rows,) + tuple((s,) for s in meta_stats.m.shape[1:]), meta_stats.m))
    pins = {}
    if plan.kind == "blocks":
        # a query chunk's merge runs on the worker holding the chunk, so its out / m / l are there
        # for the backward, whose block tasks of that chunk read them next to q and dout
        homes = _homes([q], [sum(g.num_edges for _, g in b) for b in plan.blocks])
        for key in core:
            home = homes.get(key[2]) if key[1] in ("merge", "empty") else None
            if home is not None:
                pins[key] = home
    else:
        # a partition's forward task runs where its q chunk is: by input bytes alone (q and the k / v
        # halo pieces, which on a random graph are whole chunks from every worker) the scheduler ran
        # both partitions of the two-worker benchmark on one worker in 2 of 4 runs; the backward's
        # tasks are left to the scheduler (pinned like the forward's they measured slower:
        # benchmarks/results/dask-cpu-zen4-2core-2026-12-04b.txt)
        homes = _homes([q], [part.graph.num_edges for part in plan.parts])
        for p in range(nparts):
            if homes.get(p) is not None:
                pins[(core_name, "forward", p)] = homes[p]
    arrays = _collect(core_name, core, [q, k, v], outputs, pins)
    if return_stats:
        return arrays[0], DaskAttentionStats(arrays[1], arrays[2])
    return arrays[0]


def _gather_halo(core, plan, p, part, k, v):
    """Tasks that take, from each source chunk, the rows partition p needs (next to the chunk,
    so only those rows travel). A partition without edges takes zero rows of chunk 0. The
    forward and the backward name them alike, so one computation of both gathers once."""
    halo_name = f"tiga-attention-halo-{tokenize(plan.token, k.name, v.name)}"
    k_parts, v_parts = [], []
    for c, local_rows, _, _ in part.pieces or [(0, np.zeros(0, np.int64), 0, 0)]:
        whole = local_rows.shape[0] == k.chunks[0][c]   # sorted and unique: the chunk itself
        for src, parts, tag in ((k, k_parts, "k-halo"), (v, v_parts, "v-halo")):
            if whole:
                parts.append(_chunk_key(src, c))
                continue
            key = (halo_name, tag, p, c)
            core[key] = (functools.partial(_take, rows=local_rows), _chunk_key(src, c))
            parts.append(key)
    return k_parts, v_parts


def attention_backward(dout, q, k, v, out, stats, graph, *, scale=None, softcap=None, alibi_slopes=None):
    """Backward of :func:`attention` over dask arrays: returns ``dq`` (chunked like q) and
    ``dk``, ``dv`` (chunked like k, v), in q's dtype. ``softcap``, ``alibi_slopes``: the forward's.

    ``out`` and ``stats`` are the forward's (``attention(..., return_stats=True)``); ``dout``,
    ``out``, ``stats.m`` and ``stats.l`` must be chunked like q along axis 0. The partial
    gradients of a source chunk are summed in a fixed order: the same bits on every run."""
    meta_out, meta_stats = _check_inputs(q, k, v, graph)
    score = _check_score(q, graph, softcap, alibi_slopes)
    if not (hasattr(stats, "m") and hasattr(stats, "l")):
        raise TypeError(f"stats must be the stats returned by tiga_numba.dask.attention(..., "
                        f"return_stats=True), got {type(stats).__name__}")
    row_shape = tuple(q.shape[:-1])   # (num_dst, H), or (num_dst,) for one head given as 2-D
    for name, a, want in (("dout", dout, row_shape + (v.shape[-1],)), ("out", out, row_shape + (v.shape[-1],)),
                          ("stats.m", stats.m, row_shape), ("stats.l", stats.l, row_shape)):
        _check_rows_like(name, a, q)
        if tuple(a.shape) != want:   # with the true row count (the stand-ins below have none)
            raise ValueError(f"{name} must have shape {want}, got {tuple(a.shape)}")
    # the single-process checks of dout/out/stats dtypes and libraries, on zero-row stand-ins
    mq, mk, mv = (_empty_rows(a) for a in (q, k, v))
    _attention_backward(_empty_rows(dout), mq, mk, mv, _empty_rows(out),
                        AttentionStats(_empty_rows(stats.m), _empty_rows(stats.l)),
                        Graph.dense(0, 0), scale=scale)
    plan = _plan(graph, q, k)
    dtype, acc = meta_out.dtype, meta_stats.m.dtype
    token = tokenize(plan.token, dout.name, q.name, k.name, v.name, out.name, stats.m.name,
                     stats.l.name, scale, score)
    core_name = f"tiga-attention-backward-tasks-{token}"
    core = {}
    nq, nk = len(q.chunks[0]), len(k.chunks[0])
    dq_src, dk_src, dv_src = {}, {}, {}

    def row_inputs(p):
        return (_chunk_key(dout, p), _chunk_key(q, p))

    def stat_inputs(p):
        return (_chunk_key(out, p), _chunk_key(stats.m, p), _chunk_key(stats.l, p))

    if plan.kind == "csr":
        # per source chunk: (partition rows, key of the halo piece) in increasing partition
        incoming = {c: ([], [], []) for c in range(nk)}
        relations, positions = _relations(plan), _csr_positions(plan, score)
        for p, part in enumerate(plan.parts):
            k_parts, v_parts = _gather_halo(core, plan, p, part, k, v)
            key = (core_name, "backward", p)
            core[key] = (functools.partial(_csr_backward, warm=(plan.token, p), scale=scale,
                                           score=score, offset=part.d0),
                         *row_inputs(p), k_parts, v_parts,
                         *stat_inputs(p), relations[p], *positions[p])
            dq_src[p] = (functools.partial(_cast, dtype=dtype, which=0), key)
            for c, local_rows, start, stop in part.pieces:
                rows_c, dk_c, dv_c = incoming[c]
                # a whole chunk's rows are all of them, in order: say so rather than ship them
                rows_c.append(None if local_rows.shape[0] == k.chunks[0][c] else local_rows)
                for which, dst in ((1, dk_c), (2, dv_c)):
                    piece = (core_name, "piece", which, p, c)
                    core[piece] = (_halo_piece, key, which, start, stop)
                    dst.append(piece)
        for c in range(nk):
            rows_c, dk_c, dv_c = incoming[c]
            summ = functools.partial(_scatter_sum, rows=rows_c, dtype=dtype, acc=acc)
            dk_src[c] = (summ, _chunk_key(k, c), dk_c)
            dv_src[c] = (summ, _chunk_key(v, c), dv_c)
    else:
        dq_leaves = {p: [] for p in range(nq)}
        dk_leaves = {c: [] for c in range(nk)}
        dv_leaves = {c: [] for c in range(nk)}
        dst_bounds = _bounds(q.chunks[0])
        for p, row_blocks in enumerate(plan.blocks):
            for c, sub in row_blocks:
                key = (core_name, "block", p, c)
                core[key] = (functools.partial(_block_backward, graph=sub, warm=(plan.token, p, c),
                                               scale=scale, acc=acc,
                                               **_block_score(score, plan, dst_bounds, p, c)),
                             *row_inputs(p), _chunk_key(k, c), _chunk_key(v, c), *stat_inputs(p))
                for which, leaves, i in ((0, dq_leaves, p), (1, dk_leaves, c), (2, dv_leaves, c)):
                    part = (core_name, "part", which, p, c)
                    core[part] = (operator.getitem, key, which)
                    leaves[i].append(part)

        def summed(tag, leaves, like_key, i):
            if not leaves:
                return (functools.partial(_zeros_like, dtype=dtype), like_key)
            return (functools.partial(_cast, dtype=dtype),
                    _tree(core, (core_name, tag, i), leaves, _sum))

        for p in range(nq):
            dq_src[p] = summed("dq", dq_leaves[p], _chunk_key(q, p), p)
        for c in range(nk):
            dk_src[c] = summed("dk", dk_leaves[c], _chunk_key(k, c), c)
            dv_src[c] = summed("dv", dv_leaves[c], _chunk_key(v, c), c)

    pins = {}
    if plan.kind == "blocks":
        # block (p, c) and the sum of dq_p on the worker holding dout_p, q_p and out_p (more bytes
        # than k_c and v_c; dout, read by no forward task, has no stray replicas), the sums of
        # dk_c / dv_c on the worker holding k_c. Without this the scheduler placed blocks by where
        # the forward's results happened to be and loaded one worker with twice the other's
        # blocks (benchmarks/results/dask-cpu-zen4-2core-2026-12-04.txt).
        rows = _homes([dout, q, out], [sum(g.num_edges for _, g in b) for b in plan.blocks])
        cols = _homes([k, v])
        for key in core:
            tag = key[1]
            if tag in ("block", "dq"):
                home = rows.get(key[2])
            elif tag == "part":
                home = rows.get(key[3])
            elif tag in ("dk", "dv"):
                home = cols.get(key[2])
            else:
                home = None
            if home is not None:
                pins[key] = home
    outputs = []
    for tag, like, src in (("dq", q, dq_src), ("dk", k, dk_src), ("dv", v, dv_src)):
        name = f"tiga-attention-backward-{tag}-{token}"
        layer = {(name, i) + (0,) * (like.ndim - 1): task for i, task in src.items()}
        meta = _empty_rows(like, dtype=dtype)
        outputs.append((name, layer, like.chunks, meta))
    return tuple(_collect(core_name, core, [dout, q, k, v, out, stats.m, stats.l], outputs, pins))
