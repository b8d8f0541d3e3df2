"""Attention and its backward over dask arrays chunked along the node axis.

    import tiga_numba.dask as tgd
    out, stats = tgd.attention(q, k, v, graph, return_stats=True)      # dask arrays in, dask arrays out
    dq, dk, dv = tgd.attention_backward(dout, q, k, v, out, stats, graph)
    out, vjp = tgd.program_vjp(prog, graph, src={...}, dst={...}, **params)   # a tg.MessagePassing
    out, vjp = tgd.layer_vjp(conv, x, graph, edge_attr)                       # a tiga_numba.layers layer

q's chunks along axis 0 are the destination partitions, k's (and v's) the source chunks; the
other axes must be one chunk. Every task is a call of the single-process kernels on one piece:

* CSR relations: one task per destination partition. It receives q's chunk and, from every
  source chunk that holds a source of its edges, only those rows (a *halo*, gathered by a small
  task next to the source chunk). Its local relation is the partition's rows with the source ids
  renumbered into the halo, so the forward needs no merge. The backward computes dq locally and
  the halo's partial dk/dv, which are scattered back to their source chunks and summed there in
  increasing partition order. ``locality_order(graph)`` renumbers a graph's nodes once so that
  these contiguous partitions read small halos (meshes and other graphs with locality).
* Implicit relations (dense, triangular, segments, band): one task per (query chunk, key chunk) block
  that the relation touches (blocks without edges are never created). The partial results of a
  query chunk are combined by the exact online-softmax merge in a fixed-order tree; the backward
  runs per block with the merged (full-row) statistics and sums dq per query chunk and dk/dv per
  key chunk, again in a fixed-order tree.

Programs (``tg.MessagePassing``) run the same way (``program``, ``program_vjp``): their dst fields
play q's part and their src fields k's and v's; per-edge fields (CSR) are put in CSR order and
rechunked by destination partition. flash-attn's ``softcap`` and ``alibi_slopes`` apply
in every task; node positions (ALiBi's distance, a program's ``src.index`` / ``dst.index``) are the
whole relation's (a block task is told its chunks' first rows, a CSR partition its halo's source
ids). Score networks (``tg.nn.trace``) run per CSR partition too. GNN layers (``layer``,
``layer_vjp``) run per CSR partition on the layer's edge set (self loops included) with x_src's
halo.

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
import warnings

import dask.array as da
import numpy as np
from dask.base import tokenize
from dask.core import flatten, keys_in_tasks
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from .arrays import accumulation_dtype
from .functional import AttentionStats
from .functional import attention as _attention
from .functional import attention_backward as _attention_backward
from .functional import run_backward as _run_backward
from .functional import run_forward as _run_forward
from .graph import Graph
from .merge import attention_merge, log_sum_exp
from .ordering import locality_order  # noqa: F401  (part of this module's API, as tg.locality_order)
from .scratch import OutputPool, ScratchPool, output_empty, output_zeros, outputs_from

__all__ = ["attention", "attention_backward", "program", "program_vjp", "layer", "layer_vjp", "DaskAttentionStats",
           "plan_summary", "locality_order", "keep_freed_memory_config", "keep_freed_memory",
           "release_halo_buffers"]

# Fan-in of the merge and sum trees: at most this many partial results meet in one task.
TREE_FAN_IN = 4
# With a dask.distributed Client as the default scheduler, CSR local relations of at least this
# many bytes (all partitions together) are submitted to it once per plan and the tasks refer to
# the futures (a dask graph then tied to that client); smaller ones travel inside every call's
# dask graph, which any scheduler can compute (_per_partition).
UPLOAD_MIN_BYTES = 1 << 20
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
# Per worker process, the host buffers of the CSR and block tasks' results (outputs, statistics,
# gradients, partial gradients and their sums) are kept up to this many bytes, lent again once
# nothing refers to them (scratch.OutputPool): a 1M-row partition's dk / dv partials are 1 GB, and
# written into fresh memory every call they cost a page fault per page, many times a copy's time
# on virtual machines whose host reclaims memory a process frees (docs/dask.md).
RESULT_BUFFER_BYTES = 3 << 30


def _result_buffer_limit():
    """RESULT_BUFFER_BYTES, and in a dask.distributed worker with a memory limit at most a
    quarter of it: the kept buffers count as the worker's unmanaged memory."""
    limit = RESULT_BUFFER_BYTES
    try:
        from distributed import get_worker
        worker_limit = get_worker().memory_manager.memory_limit
    except Exception:   # not in a worker (threads, processes, synchronous), or no such attribute
        return limit
    return min(limit, int(worker_limit) // 4) if worker_limit else limit


_result_pool = OutputPool(_result_buffer_limit)


def _pooled(task):
    """The task with its numpy results taken from this process's result pool (cupy results
    come from cupy's own pool)."""
    @functools.wraps(task)
    def pooled(*args, **kwargs):
        with outputs_from(_result_pool):
            return task(*args, **kwargs)
    return pooled


class DaskAttentionStats:
    """Per-row softmax statistics of :func:`attention`, as dask arrays chunked like q's rows:
    ``m`` (max scaled score), ``l`` (sum of exp(s - m)) and ``lse`` (m + log l, -inf for an
    empty row). Pass it to :func:`attention_backward`."""

    __slots__ = ("m", "l", "_forward")
    block_prune_threshold = None  # dask attention is always exact

    def __init__(self, m, l):
        self.m = m
        self.l = l
        # set by attention(): (the forward's call: scale as given, soft-cap, slopes; its graph;
        # q's head dim), so that attention_backward refuses stats of another scale, modifier or
        # relation, as the single-process backward does; None for stats made by hand
        self._forward = None

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
    # sizes before chunk boundaries: a v with a row too few is a size error, not a chunking one
    if q.shape[0] != graph.num_dst:
        raise ValueError(f"graph has num_dst={graph.num_dst} but q has {q.shape[0]} rows (axis 0)")
    if k.shape[0] != graph.num_src:
        raise ValueError(f"graph has num_src={graph.num_src} but k has {k.shape[0]} rows (axis 0)")
    if v.shape[0] != graph.num_src:
        raise ValueError(f"graph has num_src={graph.num_src} but v has {v.shape[0]} rows (axis 0)")
    if v.chunks[0] != k.chunks[0]:
        raise ValueError(f"v is chunked {v.chunks[0]} along axis 0 but k is chunked {k.chunks[0]}; "
                         "k and v must share their chunk boundaries")
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


class _EdgeLayout:
    """Per-edge fields, given in the graph constructor's order (`num_in` rows), reach the CSR
    tasks as `field[order]` (order None: as given) chunked by `counts`, one chunk per partition."""
    __slots__ = ("order", "counts", "num_in", "_inverse")

    def __init__(self, order, counts, num_in):
        self.order, self.counts, self.num_in = order, tuple(int(c) for c in counts), int(num_in)
        self._inverse = None

    @property
    def inverse(self):
        """For each constructor edge, its row in the tasks' order; sum(counts) (one row past the
        end) for an edge no task reads."""
        if self._inverse is None:
            read = sum(self.counts)
            inv = np.full(self.num_in, read, np.int64)
            inv[np.asarray(self.order, np.int64)] = np.arange(read, dtype=np.int64)
            self._inverse = inv
        return self._inverse


class _Plan:
    __slots__ = ("token", "kind", "parts", "blocks", "src_bounds", "uploaded", "lock", "_cache")

    def __init__(self, kind, src_bounds, parts=None, blocks=None):
        self.token = uuid.uuid4().hex
        self.kind = kind
        self.parts = parts      # CSR: list of _CSRPart, one per destination partition
        self.blocks = blocks    # implicit: per query chunk, list of (key chunk, block Graph)
        self.src_bounds = tuple(int(b) for b in src_bounds)
        self.uploaded = {}      # CSR on dask.distributed: (client id, what) -> futures per partition
        self.lock = threading.Lock()
        self._cache = {}

    def cached(self, key, make):
        """make(), computed once per plan under `key`."""
        with self.lock:
            if key not in self._cache:
                self._cache[key] = make()
            return self._cache[key]


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
    when a dask.distributed Client is the default scheduler and the relations hold at least
    UPLOAD_MIN_BYTES, a future of it uploaded once per plan and client. The upload is a task
    holding the object (not a scatter), so the scheduler recomputes it if the worker holding it
    is lost; the futures live as long as the graph's plan."""
    client = _default_client()
    if client is None or _relation_bytes(plan) < UPLOAD_MIN_BYTES:
        return [make(part) for part in plan.parts]
    with plan.lock:
        futures = plan.uploaded.get((client.id, what))
        if futures is None or any(f.status in ("cancelled", "error", "lost") for f in futures):
            with warnings.catch_warnings():
                # distributed warns of a large graph and advises futures: these are those
                # futures, sent once per plan (a million-row partition's relation is ~12 MB)
                warnings.filterwarnings("ignore", message="Sending large graph", category=UserWarning)
                futures = [client.submit(_identity, make(part), pure=False,
                                         key=f"tiga-attention-{what}-{plan.token}-{p}")
                           for p, part in enumerate(plan.parts)]
            plan.uploaded[(client.id, what)] = futures
    return futures


def _relation_bytes(plan):
    """Bytes of a CSR plan's local relations: 8 (rows + 1) + 4 edges per partition (once per plan)."""
    return plan.cached("relation bytes", lambda: sum(8 * (part.d1 - part.d0 + 1) + 4 * part.graph.num_edges
                                                     for part in plan.parts))


def _relations(plan):
    """Per CSR partition, the local relation its tasks read (see _per_partition)."""
    return _per_partition(plan, "relation", lambda part: part.graph)


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
    """Drop the idle halo buffers this process keeps (see HALO_SCRATCH_BYTES) and forget its
    result buffers (RESULT_BUFFER_BYTES; a result still in use keeps its own, and its memory is
    freed with it). With the threaded or synchronous scheduler that is the calling process; on
    dask.distributed workers, run it there:
    ``client.run(tiga_numba.dask.release_halo_buffers)``. Returns the bytes the pools held."""
    released = _halo_scratch.idle_bytes + _result_pool.held_bytes
    _halo_scratch.clear()
    _result_pool.clear()
    return released


#: glibc malloc settings, read when a process starts, that keep the memory a process frees for
#: its next allocations: one arena (a worker's task thread would otherwise allocate large arrays
#: with mmap and unmap them when freed, whatever the other settings), large chunks from the heap
#: instead of mmap, and no trimming of the heap's top (distributed's own default trims at 64 KiB)
KEEP_FREED_MEMORY = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}


def keep_freed_memory_config():
    """The dask config under which dask.distributed starts worker processes that keep the memory
    they free (KEEP_FREED_MEMORY added to ``distributed.nanny.pre-spawn-environ``)::

        with dask.config.set(tiga_numba.dask.keep_freed_memory_config()):
            cluster = LocalCluster(n_workers=2, threads_per_worker=1)

    Every kernel call allocates its outputs afresh; a worker that hands freed memory back to the
    system gets it again page by page at its next call, which on a virtual machine that returns
    free memory to its host costs up to seconds per GiB (docs/dask.md, "Memory returned to the
    host"). The price: a worker keeps what it freed up to its peak (dask counts it as unmanaged
    memory) and its threads share one malloc arena. Only processes started under the config get
    it: set it before the cluster starts (``dask worker`` processes started by hand read the same
    variables from their environment)."""
    import dask
    pre = dict(dask.config.get("distributed.nanny.pre-spawn-environ", {}) or {})
    pre.update(KEEP_FREED_MEMORY)
    return {"distributed.nanny.pre-spawn-environ": pre}


#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def _keep_freed_memory_here():
    """From now on this process's glibc malloc keeps what it frees: no chunk gets a mapping of
    its own where an arena's heap can hold it, and the main heap's top is not trimmed below
    2 GiB. True where both settings took effect, False where the process has no glibc (nothing
    changed) or glibc refused one of them."""
    import ctypes
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):   # no glibc by that name, or no mallopt
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = [mallopt(_M_MMAP_MAX, 0), mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)]
    return all(done)


def keep_freed_memory(client=None):
    """Make running processes keep the memory they free, now, without restarting them (glibc's
    malloc, changed through ``mallopt``): with `client` (a ``dask.distributed.Client``) every
    worker of its cluster, without it this process (the threaded and synchronous schedulers).
    Returns ``{worker address: bool}`` (or one bool): False where a process has no glibc
    (nothing changed) or glibc refused a setting.

    What it changes: the memory a worker receives chunks into (its event loop's allocations) and
    everything else its main malloc arena hands out is then reused from one call to the next
    instead of being mapped afresh and handed back when freed, which on a virtual machine that
    returns freed memory to its host costs up to seconds per GiB (docs/dask.md, "Memory returned
    to the host"). Unlike :func:`keep_freed_memory_config` it cannot merge the task threads'
    arenas into the main one (glibc reads that at start): a task thread's arrays larger than its
    arena's heap (64 MiB) are still mapped separately (the kernels' outputs come from this
    module's result pool anyway). A worker that starts later (a restart, a scale-up) needs the
    call again, or the config. The price is the config's: a worker keeps what it freed up to its
    peak, which dask counts as unmanaged memory."""
    if client is None:
        return _keep_freed_memory_here()
    return client.run(_keep_freed_memory_here)


@contextlib.contextmanager
def _halo(parts, kept=False):
    """A task's halo pieces as one array: a single piece itself; numpy pieces copied into a
    buffer of the worker's halo pool, lent for the task's kernel call only (the kernels read a
    node-major array, so the copy cannot be avoided); cupy pieces concatenated (cupy pools
    device memory). `kept`: the task's result holds the halo (a layer's backward state,
    _LayerCall.keeps_state), so the buffer comes from the result pool instead, which lends a
    buffer again only once nothing refers to it; the halo pool's would go back, to be written
    by another task, before the backward reads it."""
    if len(parts) == 1:
        yield parts[0]
        return
    if _xp_of(parts[0]) is not np:
        yield _xp_of(parts[0]).concatenate(parts, axis=0)
        return
    shape = (sum(p.shape[0] for p in parts),) + parts[0].shape[1:]
    dtype = np.result_type(*parts)
    buffer = (contextlib.nullcontext(output_empty(shape, dtype)) if kept   # the task's result pool (_pooled)
              else _halo_scratch.borrow(shape, dtype))
    with buffer as halo:
        np.concatenate(parts, axis=0, out=halo)
        yield halo


# --------------------------------------------------------------------------- what a task computes
class _Where:
    """Where a task's local rows and sources sit in the whole relation: destination rows
    [row0, row1); sources from row `col0` on (a block's key chunk), or, for a CSR partition,
    the halo's global source ids (`source_ids`, the halo's local positions being no offset of
    them)."""
    __slots__ = ("row0", "row1", "col0", "source_ids")

    def __init__(self, row0, row1, col0=0, source_ids=None):
        self.row0, self.row1, self.col0, self.source_ids = int(row0), int(row1), int(col0), source_ids

    def with_ids(self, source_ids):
        return self if source_ids is None else _Where(self.row0, self.row1, self.col0, source_ids)


def _global_positions(mod, xp, graph, where):
    """`mod` (a score_mod.BoundModifier) reading node positions at the task's place in the whole
    relation: dst.index becomes dst.index + row0, src.index becomes src.index + col0 (a block)
    or the halo's source id (a CSR partition), through integer node fields (exact at any size).
    The rewrite does not depend on the offsets' values (0 for a relation's first chunk), so
    every task of a call compiles one tree per kernel family. A tree that reads no position is
    returned as it is."""
    from . import score_mod as sm
    if mod is None:
        return None
    leaves = set(sm.leaves(mod.tree))
    dst, src = sm.Expr("index", (), "dst"), sm.Expr("index", (), "src")
    mapping, values = {}, dict(mod.values)
    if dst in leaves:
        field = sm.Expr("node", (), ("dst", "_dask_row0"))
        mapping[dst] = sm.make("add", dst, field)
        values[field] = xp.full(graph.num_dst, where.row0, np.int64)
    if src in leaves and where.source_ids is not None:
        field = sm.Expr("node", (), ("src", "_dask_source"))
        mapping[src] = field
        values[field] = xp.asarray(where.source_ids)
    elif src in leaves:
        field = sm.Expr("node", (), ("src", "_dask_col0"))
        mapping[src] = sm.make("add", src, field)
        values[field] = xp.full(graph.num_src, where.col0, np.int64)
    if not mapping:
        return mod
    return sm.BoundModifier(sm.substitute(mod.tree, mapping), values, mod.grad_leaves, mod.gathers)


class _Call:
    """What every task recipe shares: the extra arguments of a CSR partition's tasks and the
    order of the per-edge fields. A recipe names its fields (`dst_names`, `src_names`,
    `edge_names`) and computes one task: forward(dst, src, edge, graph, where, *extras) ->
    (out, m, l) and backward(dout, saved, dst, src, edge, graph, where, *extras) -> (dst grads,
    src grads, param grads, edge grads), with `saved` the forward results the backward reads."""
    __slots__ = ()
    reads_source_positions = False
    keeps_state = False   # whether a forward task's result holds its inputs (_LayerCall's backward state)

    def partition_args(self, plan):
        """Per CSR partition, the extra arguments of its tasks: the global ids of its halo rows
        when the score reads source positions (see _per_partition), else none."""
        if not self.reads_source_positions:
            return [()] * len(plan.parts)
        return [(ids,) for ids in _per_partition(plan, "source-ids",
                                                 lambda part: part.halo_ids(plan.src_bounds))]

    def edge_layout(self, graph, plan):
        """How per-edge fields reach this recipe's CSR tasks: every edge of the relation, in CSR
        order (see _EdgeLayout)."""
        return plan.cached("edge layout", lambda: _EdgeLayout(
            graph.edge_permutation, tuple(part.graph.num_edges for part in plan.parts), graph.num_edges))


class _AttentionCall(_Call):
    """The tasks of tiga_numba.dask.attention: q over k, v with flash-attn's soft-cap and ALiBi
    (the slopes a host array, (H,) or flash-attn's per-sequence (batch, H) with `starts` the
    sequences' first rows (batch + 1 offsets; a task finds its rows' sequences there); the
    relation's bottom-right shift per row: functional._alibi_shift, host, or None). Picklable."""
    dst_names, src_names, edge_names = ("q",), ("k", "v"), ()
    __slots__ = ("scale", "softcap", "slopes", "shift", "starts")

    def __init__(self, scale, softcap=None, slopes=None, shift=None, starts=None):
        self.scale, self.softcap, self.slopes, self.shift, self.starts = scale, softcap, slopes, shift, starts

    @property
    def reads_source_positions(self):
        return self.slopes is not None

    def __dask_tokenize__(self):
        return ("attention", self.scale, self.softcap, self.slopes, self.shift, self.starts)

    def _modifier(self, q, graph, where):
        if self.softcap is None and self.slopes is None:
            return None
        from . import score_mod as sm
        from .functional import sequence_of_rows
        xp = _xp_of(q)
        slopes = None if self.slopes is None else xp.asarray(self.slopes)
        shift = None if self.shift is None else xp.asarray(self.shift[where.row0:where.row1])
        rows = None if self.starts is None else xp.asarray(
            sequence_of_rows(self.starts, where.row0, where.row1))
        return _global_positions(sm.bind_flash(self.softcap, slopes, shift, row_sequence=rows),
                                 xp, graph, where)

    def forward(self, dst, src, edge, graph, where, source_ids=None):
        mod = self._modifier(dst["q"], graph, where.with_ids(source_ids))
        out, stats, _ = _run_forward(dst["q"], src["k"], src["v"], graph, scale=self.scale,
                                     score_mod=mod)
        return out, stats.m, stats.l

    def backward(self, dout, saved, dst, src, edge, graph, where, source_ids=None):
        out, m, l = saved
        mod = self._modifier(dst["q"], graph, where.with_ids(source_ids))
        dq, dk, dv = _run_backward(dout, dst["q"], src["k"], src["v"], out, AttentionStats(m, l),
                                   graph, scale=self.scale, score_mod=mod)[:3]
        return {"q": dq}, {"k": dk, "v": dv}, {}, {}


def _attention_call(q, graph, scale, softcap, alibi_slopes):
    """The _AttentionCall of these arguments, checked as tiga_numba.attention checks them (on a
    zero-row stand-in of q: the library, the heads) before any task is built, so that a bad
    value fails at the call, not inside a worker."""
    if softcap is None and alibi_slopes is None:
        return _AttentionCall(scale)
    from . import score_mod as sm
    from .functional import _alibi_shift, flash_modifier
    # checked and normalised once, by the single-process call's own code (softcap=0: none;
    # (1, H) slopes: the (H,) slopes; (batch, H) slopes: checked against the relation's
    # sequences); the tasks take the values it bound
    per_sequence = np.ndim(alibi_slopes) == 2 and np.shape(alibi_slopes)[0] != 1
    mod = flash_modifier(_empty_rows(q), graph if per_sequence else Graph.dense(0, 0),
                         softcap, alibi_slopes)
    if mod is None:
        return _AttentionCall(scale)
    softcap = mod.values.get(sm.SOFTCAP)
    slopes = mod.values.get(sm.ALIBI_SLOPES)
    shift = starts = None
    if sm.ALIBI_ROW_SLOPES in mod.gathers:   # checked against the graph's sequences above
        slopes = mod.gathers[sm.ALIBI_ROW_SLOPES][2]
        starts = np.asarray(graph._blocks.dst_offsets, np.int64)
    if slopes is not None:
        slopes = _host(slopes)   # cupy: tasks convert back to their chunks' library
        shift = graph._cached("dask alibi shift", lambda: _alibi_shift(graph))
    return _AttentionCall(scale, softcap, slopes, shift, starts)


def _host(array):
    return array if isinstance(array, np.ndarray) else array.get()


class _ProgramCall(_Call):
    """The tasks of a tg.MessagePassing program: edge() lowered on each task's local arrays
    (the program's own lowering and kernels), its node positions moved to the whole relation's
    (_global_positions)."""
    __slots__ = ("program", "dst_names", "src_names", "edge_names", "params", "reads_source_positions",
                 "program_kind")

    def __init__(self, program, dst_names, src_names, edge_names, params, reads_source_positions,
                 program_kind):
        self.program, self.dst_names, self.src_names = program, tuple(dst_names), tuple(src_names)
        self.edge_names = tuple(edge_names)
        self.params, self.reads_source_positions = dict(params), reads_source_positions
        self.program_kind = program_kind   # the traced form's kind: "net", "modified", ...

    def __dask_tokenize__(self):
        return ("program", id(self.program), type(self.program).__qualname__, self.dst_names,
                self.src_names, self.edge_names, tokenize(self.params))

    def _lower(self, dst, src, edge, graph, where, for_grad=False):
        # per-edge fields arrive in the local relation's (CSR) order, which is its input order
        lowered = self.program._lower(graph, dict(src), dict(dst), dict(edge) or None,
                                      dict(self.params), for_grad=for_grad)
        if getattr(lowered, "modifier", None) is not None:
            lowered.modifier = _global_positions(lowered.modifier, _xp_of(lowered.value), graph, where)
        return lowered

    @property
    def saves_stats(self):
        """Whether the backward reads the forward's (out, m, l): a score network's backward
        reads what its forward kept besides (the first layer's node products, the per-edge
        scores of a per-head network), so its task runs the forward again instead."""
        return self.program_kind != "net"

    def forward(self, dst, src, edge, graph, where, source_ids=None):
        lowered = self._lower(dst, src, edge, graph, where.with_ids(source_ids))
        out, _ = lowered.forward()
        if not self.saves_stats:
            return out, None, None
        return out, lowered.stats.m, lowered.stats.l

    def backward(self, dout, saved, dst, src, edge, graph, where, source_ids=None):
        lowered = self._lower(dst, src, edge, graph, where.with_ids(source_ids), for_grad=True)
        if self.saves_stats:
            out, m, l = saved
            lowered.out, lowered.stats = out, AttentionStats(m, l)
        else:
            lowered.forward()
        grads, _ = lowered.backward(dout)
        return grads["dst"], grads["src"], grads["params"], grads["edge"]


@contextlib.contextmanager
def _halos(src_parts, kept=False):
    """_halo of each source array's pieces, all held for the task's kernel call (`kept`: for
    its result too)."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(_halo(parts, kept)) for parts in src_parts]


@_pooled
def _csr_forward(dst_p, src_parts, edge_p, graph, *extras, recipe, warm, where):
    with _halos(src_parts, kept=recipe.keeps_state) as src:
        return recipe.forward(dict(zip(recipe.dst_names, dst_p)), dict(zip(recipe.src_names, src)),
                              dict(zip(recipe.edge_names, edge_p)), _warm(graph, warm), where, *extras)


@_pooled
def _csr_backward(dout_p, dst_p, src_parts, edge_p, saved_p, graph, *extras, recipe, warm, where):
    with _halos(src_parts) as src:
        return recipe.backward(dout_p, saved_p, dict(zip(recipe.dst_names, dst_p)),
                               dict(zip(recipe.src_names, src)), dict(zip(recipe.edge_names, edge_p)),
                               _warm(graph, warm), where, *extras)


@_pooled
def _block_forward(dst_p, src_c, *, recipe, graph, warm, where, acc):
    out, m, l = recipe.forward(dict(zip(recipe.dst_names, dst_p)), dict(zip(recipe.src_names, src_c)),
                               {}, _warm(graph, warm), where)
    return out.astype(acc, copy=False), m, l   # partials merge in the accumulation dtype


@_pooled
def _block_backward(dout_p, dst_p, src_c, saved_p, *, recipe, graph, warm, where, acc):
    grads = recipe.backward(dout_p, saved_p, dict(zip(recipe.dst_names, dst_p)),
                            dict(zip(recipe.src_names, src_c)), {}, _warm(graph, warm), where)
    # partial gradients are summed in the accumulation dtype (integer fields get none)
    return tuple({n: g.astype(acc, copy=False) for n, g in part.items()} for part in grads)


def _grad(result, part, name):
    return result[part][name]


def _halo_piece(result, name, start, stop):
    return result[1][name][start:stop]


@_pooled
def _scatter_sum(like, pieces, *, rows, dtype, acc):
    """Sum the partial gradients of one source chunk, in the order given (increasing
    destination partition); `rows` holds, per piece, the chunk's rows it covers (None: all)."""
    xp = _xp_of(like)
    whole = [r is None for r in rows]   # a piece that covers the whole chunk, in order
    # The sum starts from the leading whole pieces, 0 + piece being piece: two are added into a
    # new array in one pass (the same bits as a copy and an add); one alone is passed on without
    # a copy when nothing follows (a chunk covered by one partition: 1 GB of dk and dv not copied
    # at 1M rows, H=4, D=32); otherwise from zeros.
    empty, zeros = (output_empty, output_zeros) if xp is np else (xp.empty, xp.zeros)
    if whole[:2] == [True, True]:
        total, start = xp.add(pieces[0], pieces[1], out=empty(pieces[0].shape, acc), dtype=acc), 2
    elif whole[:1] == [True] and len(pieces) > 1:
        total, start = empty(pieces[0].shape, acc), 1
        total[...] = pieces[0]
    elif whole[:1] == [True]:
        total, start = pieces[0].astype(acc, copy=False), 1
    else:
        total, start = zeros(like.shape, dtype=acc), 0
    for r, piece in zip(rows[start:], pieces[start:]):
        if r is None:
            total += piece
        else:
            total[xp.asarray(r) if xp is not np else r] += piece.astype(acc, copy=False)
    return total.astype(dtype, copy=False)


@_pooled
def _merge(*parts):
    out, stats = attention_merge([(o, AttentionStats(m, l)) for o, m, l in parts])
    return out, stats.m, stats.l


def _empty_forward(like_p, *, head_shape, value_dim, acc):
    """The partial result of a query chunk that meets no block: every row empty."""
    xp = _xp_of(like_p)
    row_shape = (int(like_p.shape[0]),) + tuple(head_shape)
    return (xp.zeros(row_shape + (value_dim,), dtype=acc), xp.full(row_shape, -np.inf, dtype=acc),
            xp.zeros(row_shape, dtype=acc))


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
    kind = _HintedArray if pins else da.Array
    return [kind(graph, name, chunks, meta=meta) for name, _, chunks, meta in outputs]


def _optimize_keeping_hints(dsk, keys, **kwargs):
    """dask.array's graph optimisation without its low-level fusion, unless the caller's config
    asks for fusion explicitly: fusion flattens the graph into a dict, which drops every layer's
    annotations, the placement hints among them (the rest is the same culling and blockwise
    fusion; what is lost is the merging of single-dependent chains into one task, such as a
    partition's task with the cast of its output)."""
    import dask
    from dask.array.optimization import optimize
    if dask.config.get("optimization.fuse.active", None) is None:
        with dask.config.set({"optimization.fuse.active": False}):
            return optimize(dsk, keys, **kwargs)
    return optimize(dsk, keys, **kwargs)


class _HintedArray(da.Array):
    """A dask array whose tasks carry placement hints (`workers=` annotations): a plain dask
    array, except that computing or persisting it keeps the hints with dask's default config.
    An array derived from it (``out + 1``, ``out[:10]``) is a plain dask array again: computed
    by itself it runs where dask puts it, with the same results."""
    __slots__ = ()
    __dask_optimize__ = staticmethod(_optimize_keeping_hints)


def _row_outputs(name, nparts, source, ndim_tail):
    """Layer for an output chunked like the destination rows: key (name, p, 0, ...) <- source(p)."""
    return {(name, p) + (0,) * ndim_tail: source(p) for p in range(nparts)}


def _gather_halo(core, plan, p, part, arrays):
    """Per array of `arrays` (chunked like the sources), the keys of the rows partition p needs
    from each source chunk: the chunk itself when the partition needs it whole, else a task
    that takes those rows next to the chunk (so only they travel). A partition without edges
    takes zero rows of chunk 0. The forward and the backward name them alike, so one
    computation of both gathers once."""
    halos = []
    for src in arrays:
        name = f"tiga-attention-halo-{tokenize(plan.token, src.name)}"
        parts = []
        for c, local_rows, _, _ in part.pieces or [(0, np.zeros(0, np.int64), 0, 0)]:
            if local_rows.shape[0] == src.chunks[0][c]:   # sorted and unique: the chunk itself
                parts.append(_chunk_key(src, c))
                continue
            key = (name, p, c)
            core[key] = (functools.partial(_take, rows=local_rows), _chunk_key(src, c))
            parts.append(key)
        halos.append(parts)
    return halos


def _edge_partitions(edge, recipe, graph, plan):
    """Per-edge dask arrays (in the graph constructor's edge order, any chunks along axis 0) in
    the order the tasks read them (recipe.edge_layout: the relation's CSR order), chunked by
    destination partition: chunk p holds partition p's edges."""
    if not edge:
        return []
    layout = recipe.edge_layout(graph, plan)
    return [(a if layout.order is None else a[layout.order]).rechunk(
        (layout.counts,) + tuple((s,) for s in a.shape[1:])) for a in edge]


def _edges_in_constructor_order(grads, recipe, graph, plan):
    """Per-edge gradients from the tasks' order (chunked by partition) back to the graph
    constructor's order; an edge no task reads (a self loop a layer removes) gets 0."""
    if not grads:   # (also: implicit relations have no per-edge fields)
        return grads
    layout = recipe.edge_layout(graph, plan)
    if layout.order is None:
        return grads
    moved = {}
    for n, a in grads.items():
        if sum(layout.counts) < layout.num_in:   # one zero row, read by the edges no task has
            a = da.concatenate([a, da.zeros((1,) + a.shape[1:], dtype=a.dtype, meta=a._meta)])
        moved[n] = a[layout.inverse]
    return moved


def _forward_arrays(recipe, dst, src, graph, meta_out, meta_m, return_stats, edge=None, keep_state=False):
    """The dask arrays [out] (+ [m, l] with return_stats) of `recipe` over `dst` / `src`
    ({name: dask array}, chunked alike along the destination / source axis) and `edge` (per-edge
    dask arrays of a CSR relation, constructor order); with `keep_state` (a layer recipe that
    keeps its state, CSR) also the partitions' states: an object array of one element per
    partition, the second item of each forward task's result."""
    dst_list, src_list = [dst[n] for n in recipe.dst_names], [src[n] for n in recipe.src_names]
    rows_like = dst_list[0]
    plan = _plan(graph, rows_like, src_list[0])
    edge_list = _edge_partitions([edge[n] for n in recipe.edge_names], recipe, graph, plan)
    acc = meta_m.dtype
    token = tokenize(plan.token, [a.name for a in dst_list + src_list + edge_list], recipe)
    core_name = f"tiga-attention-tasks-{token}"
    core = {}
    nparts = len(rows_like.chunks[0])
    dst_bounds = _bounds(rows_like.chunks[0])
    roots = []
    if plan.kind == "csr":
        relations, extras = _relations(plan), recipe.partition_args(plan)
        for p, part in enumerate(plan.parts):
            key = (core_name, "forward", p)
            core[key] = (functools.partial(_csr_forward, recipe=recipe, warm=(plan.token, p),
                                           where=_Where(part.d0, part.d1)),
                         [_chunk_key(a, p) for a in dst_list],
                         _gather_halo(core, plan, p, part, src_list),
                         [_chunk_key(a, p) for a in edge_list], relations[p], *extras[p])
            roots.append(key)
    else:
        for p, row_blocks in enumerate(plan.blocks):
            leaves = []
            for c, sub in row_blocks:
                key = (core_name, "block", p, c)
                where = _Where(dst_bounds[p], dst_bounds[p + 1], plan.src_bounds[c])
                core[key] = (functools.partial(_block_forward, recipe=recipe, graph=sub,
                                               warm=(plan.token, p, c), where=where, acc=acc),
                             [_chunk_key(a, p) for a in dst_list], [_chunk_key(a, c) for a in src_list])
                leaves.append(key)
            if not leaves:
                key = (core_name, "empty", p)
                core[key] = (functools.partial(_empty_forward, head_shape=tuple(meta_out.shape[1:-1]),
                                               value_dim=int(meta_out.shape[-1]), acc=acc),
                             _chunk_key(rows_like, p))
                leaves.append(key)
            roots.append(_tree(core, (core_name, "merge", p), leaves, _merge))
    cast_out = functools.partial(_cast, dtype=meta_out.dtype, which=0)
    rows = rows_like.chunks[0]
    tail = meta_out.ndim - 1
    out_name, m_name, l_name = (f"tiga-attention-{w}-{token}" for w in ("out", "m", "l"))
    outputs = [(out_name, _row_outputs(out_name, nparts, lambda p: (cast_out, roots[p]), tail),
                (rows,) + tuple((s,) for s in meta_out.shape[1:]), meta_out)]
    if return_stats:
        for name, which in ((m_name, 1), (l_name, 2)):
            outputs.append((name, _row_outputs(name, nparts,
                                               lambda p, w=which: (operator.getitem, roots[p], w),
                                               tail - 1),
                            (rows,) + tuple((s,) for s in meta_m.shape[1:]), meta_m))
    if keep_state:
        name = f"tiga-layer-state-{token}"
        outputs.append((name, {(name, p): (operator.getitem, roots[p], 1) for p in range(nparts)},
                        ((1,) * nparts,), np.empty(0, object)))
    pins = {}
    if plan.kind == "blocks":
        # a query chunk's merge runs on the worker holding the chunk, so its out / m / l are there
        # for the backward, whose block tasks of that chunk read them next to q and dout
        homes = _homes([rows_like], [sum(g.num_edges for _, g in b) for b in plan.blocks])
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
        homes = _homes([rows_like], [part.graph.num_edges for part in plan.parts])
        for p in range(nparts):
            if homes.get(p) is not None:
                pins[(core_name, "forward", p)] = homes[p]
    return _collect(core_name, core, dst_list + src_list + edge_list, outputs, pins)


def _backward_arrays(recipe, dout, dst, src, saved, graph, acc, grad_meta, edge=None):
    """The gradients of `recipe`'s call as dask arrays: {"dst", "src", "params", "edge": {name:
    array}}, for the gradients `grad_meta` lists ({role: {name: meta}}, from the call on zero-row
    stand-ins); `saved`: the forward's results the backward reads (dask arrays chunked like the
    destination rows: out, m, l for attention). Destination gradients sum per query chunk, source
    gradients per source chunk, param gradients over every task, all in a fixed order."""
    dst_list, src_list = [dst[n] for n in recipe.dst_names], [src[n] for n in recipe.src_names]
    rows_like, cols_like = dst_list[0], src_list[0]
    plan = _plan(graph, rows_like, cols_like)
    edge_list = _edge_partitions([edge[n] for n in recipe.edge_names], recipe, graph, plan)
    token = tokenize(plan.token, dout.name, [a.name for a in dst_list + src_list + edge_list + saved],
                     recipe)
    core_name = f"tiga-attention-backward-tasks-{token}"
    core = {}
    nq, nk = len(rows_like.chunks[0]), len(cols_like.chunks[0])
    dst_bounds = _bounds(rows_like.chunks[0])
    sources = {"dst": {n: {} for n in grad_meta["dst"]}, "src": {n: {} for n in grad_meta["src"]}}
    task_keys = []

    def row_inputs(p):
        return (_chunk_key(dout, p), [_chunk_key(a, p) for a in dst_list])

    def saved_inputs(p):
        return [_chunk_key(a, p) for a in saved]

    def summed(role, name, leaves, like_key, i):
        dtype = grad_meta[role][name].dtype
        if not leaves:
            return (functools.partial(_zeros_like, dtype=dtype), like_key)
        return (functools.partial(_cast, dtype=dtype),
                _tree(core, (core_name, "sum", role, name, i), leaves, _sum))

    if plan.kind == "csr":
        # per source chunk: (partition rows, {name: keys of the halo pieces}) in increasing partition
        incoming = {c: ([], {n: [] for n in grad_meta["src"]}) for c in range(nk)}
        relations, extras = _relations(plan), recipe.partition_args(plan)
        for p, part in enumerate(plan.parts):
            key = (core_name, "backward", p)
            core[key] = (functools.partial(_csr_backward, recipe=recipe, warm=(plan.token, p),
                                           where=_Where(part.d0, part.d1)),
                         *row_inputs(p), _gather_halo(core, plan, p, part, src_list),
                         [_chunk_key(a, p) for a in edge_list], saved_inputs(p), relations[p], *extras[p])
            task_keys.append(key)
            for n, meta in grad_meta["dst"].items():
                sources["dst"][n][p] = (functools.partial(_cast, dtype=meta.dtype), (_grad, key, 0, n))
            for c, local_rows, start, stop in part.pieces:
                rows_c, pieces = incoming[c]
                # a whole chunk's rows are all of them, in order: say so rather than ship them
                rows_c.append(None if local_rows.shape[0] == cols_like.chunks[0][c] else local_rows)
                for n in grad_meta["src"]:
                    piece = (core_name, "piece", n, p, c)
                    core[piece] = (_halo_piece, key, n, start, stop)
                    pieces[n].append(piece)
        for c in range(nk):
            rows_c, pieces = incoming[c]
            for n, meta in grad_meta["src"].items():
                sources["src"][n][c] = (functools.partial(_scatter_sum, rows=rows_c, dtype=meta.dtype, acc=acc),
                                        _chunk_key(src[n], c), pieces[n])
    else:
        leaves = {"dst": {n: {p: [] for p in range(nq)} for n in grad_meta["dst"]},
                  "src": {n: {c: [] for c in range(nk)} for n in grad_meta["src"]}}
        for p, row_blocks in enumerate(plan.blocks):
            for c, sub in row_blocks:
                key = (core_name, "block", p, c)
                where = _Where(dst_bounds[p], dst_bounds[p + 1], plan.src_bounds[c])
                core[key] = (functools.partial(_block_backward, recipe=recipe, graph=sub,
                                               warm=(plan.token, p, c), where=where, acc=acc),
                             *row_inputs(p), [_chunk_key(a, c) for a in src_list], saved_inputs(p))
                task_keys.append(key)
                for which, role, i in ((0, "dst", p), (1, "src", c)):
                    for n in grad_meta[role]:
                        part = (core_name, "part", role, n, p, c)
                        core[part] = (_grad, key, which, n)
                        leaves[role][n][i].append(part)
        for role, like, count in (("dst", dst, nq), ("src", src, nk)):
            for n in grad_meta[role]:
                for i in range(count):
                    sources[role][n][i] = summed(role, n, leaves[role][n][i], _chunk_key(like[n], i), i)
    param_roots = {}
    for n in grad_meta["params"]:
        parts = []
        for t, key in enumerate(task_keys):
            part = (core_name, "param", n, t)
            core[part] = (_grad, key, 2, n)
            parts.append(part)
        param_roots[n] = _tree(core, (core_name, "psum", n), parts, _sum)

    pins = {}
    if plan.kind == "blocks":
        # block (p, c) and the sum of a query chunk's gradients on the worker holding dout_p, q_p and
        # out_p (more bytes than the key chunk; dout, read by no forward task, has no stray
        # replicas), the sums of a source chunk's gradients on the worker holding it. Without this
        # the scheduler placed blocks by where the forward's results happened to be and loaded one
        # worker with twice the other's blocks (benchmarks/results/dask-cpu-zen4-2core-2026-12-04.txt).
        rows = _homes([dout, rows_like] + saved[:1], [sum(g.num_edges for _, g in b) for b in plan.blocks])
        cols = _homes(src_list)
        for key in core:
            tag = key[1]
            if tag == "block":
                home = rows.get(key[2])
            elif tag == "part":
                home = rows.get(key[4])
            elif tag == "sum":
                home = (rows if key[2] == "dst" else cols).get(key[4])
            else:
                home = None
            if home is not None:
                pins[key] = home
    outputs, order = [], []
    for role, like in (("dst", dst), ("src", src)):
        for n, meta in grad_meta[role].items():
            a = like[n]
            name = f"tiga-attention-backward-{role}-{n}-{token}"
            layer = {(name, i) + (0,) * (a.ndim - 1): task for i, task in sources[role][n].items()}
            outputs.append((name, layer, a.chunks, _empty_rows(a, dtype=meta.dtype)))
            order.append((role, n))
    for n, meta in grad_meta["edge"].items():   # CSR only: one piece per partition, CSR order
        name = f"tiga-attention-backward-edge-{n}-{token}"
        layer = {(name, p) + (0,) * (meta.ndim - 1): (functools.partial(_cast, dtype=meta.dtype),
                                                       (_grad, key, 3, n))
                 for p, key in enumerate(task_keys)}
        chunks = (recipe.edge_layout(graph, plan).counts,) + tuple((s,) for s in meta.shape[1:])
        outputs.append((name, layer, chunks, meta[:0]))
        order.append(("edge", n))
    for n, meta in grad_meta["params"].items():
        name = f"tiga-attention-backward-param-{n}-{token}"
        layer = {(name,) + (0,) * meta.ndim: (functools.partial(_cast, dtype=meta.dtype), param_roots[n])}
        outputs.append((name, layer, tuple((s,) for s in meta.shape), meta[:0] if meta.ndim else meta))
        order.append(("params", n))
    arrays = _collect(core_name, core, [dout, *dst_list, *src_list, *edge_list, *saved], outputs, pins)
    grads = {"dst": {}, "src": {}, "params": {}, "edge": {}}
    for (role, n), a in zip(order, arrays):
        grads[role][n] = a
    grads["edge"] = _edges_in_constructor_order(grads["edge"], recipe, graph, plan)
    return grads


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
    alibi_slopes : array ``(H,)`` or ``(batch, H)``, optional
        flash-attn's ALiBi slopes, as in :func:`tiga_numba.attention` (a numpy array for numpy
        chunks, cupy for cupy chunks; ``(batch, H)``: one set per sequence of a cu_seqlens
        relation): the distance is the one of the whole relation (node positions, bottom-right
        aligned in dense and cu_seqlens blocks), whatever the chunks.

    Returns
    -------
    out : dask array ``(num_dst, H, Dv)`` in q's dtype, chunked like q.
    stats : :class:`DaskAttentionStats` (``return_stats=True``), ``m``/``l``/``lse`` chunked like
        q's rows. Equal to the single-process call within rounding, on any dask scheduler.
    """
    meta_out, meta_stats = _check_inputs(q, k, v, graph, scale)
    recipe = _attention_call(q, graph, scale, softcap, alibi_slopes)
    arrays = _forward_arrays(recipe, {"q": q}, {"k": k, "v": v}, graph, meta_out, meta_stats.m,
                             return_stats)
    if return_stats:
        stats = DaskAttentionStats(arrays[1], arrays[2])
        stats._forward = (recipe, graph, q.shape[-1])
        return arrays[0], stats
    return arrays[0]


def _check_stats_forward(stats, recipe, graph, head_dim):
    """ValueError naming `stats` when the forward that made them had another scale, soft-cap,
    ALiBi slopes or relation than this backward, by the single-process backward's rules
    (functional._check_stats_belong). Stats made by hand carry no forward and pass."""
    fwd = getattr(stats, "_forward", None)
    if fwd is None:
        return
    from .arrays import resolve_scale
    from .functional import _relation_difference, _value_difference
    call, fwd_graph, fwd_dim = fwd
    a, b = resolve_scale(call.scale, fwd_dim), resolve_scale(recipe.scale, head_dim)
    if a != b:
        raise ValueError(f"stats belong to a forward with scale={a!r}, but this backward has "
                         f"scale={b!r}; pass the forward's scale")
    why = _value_difference({"softcap": call.softcap, "alibi_slopes": call.slopes},
                            {"softcap": recipe.softcap, "alibi_slopes": recipe.slopes})
    if why is not None:
        raise ValueError(f"stats belong to a forward whose score read other values: {why}; "
                         "pass the forward's softcap / alibi_slopes")
    if fwd_graph is not graph:
        why = _relation_difference(fwd_graph, graph)
        if why is not None:
            raise ValueError(f"stats belong to a forward over another graph than this backward's: {why}")


def _check_forward_results(rows_like, out, stats, value_shape, stats_shape):
    """out and stats as the forward over rows chunked like `rows_like` made them."""
    if not (hasattr(stats, "m") and hasattr(stats, "l")):
        raise TypeError(f"stats must be the stats returned by tiga_numba.dask (return_stats=True / "
                        f"program_vjp), got {type(stats).__name__}")
    for name, a, want in (("out", out, value_shape), ("stats.m", stats.m, stats_shape),
                          ("stats.l", stats.l, stats_shape)):
        _check_rows_like(name, a, rows_like)
        if tuple(a.shape) != want:   # with the true row count (the stand-ins have none)
            raise ValueError(f"{name} must have shape {want}, got {tuple(a.shape)}")


def attention_backward(dout, q, k, v, out, stats, graph, *, scale=None, softcap=None, alibi_slopes=None):
    """Backward of :func:`attention` over dask arrays: returns ``dq`` (chunked like q) and
    ``dk``, ``dv`` (chunked like k, v), in q's dtype. ``softcap``, ``alibi_slopes``: the forward's.

    ``out`` and ``stats`` are the forward's (``attention(..., return_stats=True)``); ``dout``,
    ``out``, ``stats.m`` and ``stats.l`` must be chunked like q along axis 0. The partial
    gradients of a source chunk are summed in a fixed order: the same bits on every run."""
    meta_out, meta_stats = _check_inputs(q, k, v, graph)
    recipe = _attention_call(q, graph, scale, softcap, alibi_slopes)
    row_shape = tuple(q.shape[:-1])   # (num_dst, H), or (num_dst,) for one head given as 2-D
    _check_rows_like("dout", dout, q)
    if tuple(dout.shape) != row_shape + (v.shape[-1],):
        raise ValueError(f"dout must have shape {row_shape + (v.shape[-1],)}, got {tuple(dout.shape)}")
    _check_forward_results(q, out, stats, row_shape + (v.shape[-1],), row_shape)
    # the single-process checks of dout/out/stats dtypes and libraries, on zero-row stand-ins
    mq, mk, mv = (_empty_rows(a) for a in (q, k, v))
    _attention_backward(_empty_rows(dout), mq, mk, mv, _empty_rows(out),
                        AttentionStats(_empty_rows(stats.m), _empty_rows(stats.l)),
                        Graph.dense(0, 0), scale=scale)
    _check_stats_forward(stats, recipe, graph, q.shape[-1])
    meta = {"dst": {"q": _empty_rows(q, dtype=meta_out.dtype)}, "edge": {},
            "src": {"k": _empty_rows(k, dtype=meta_out.dtype), "v": _empty_rows(v, dtype=meta_out.dtype)},
            "params": {}}
    grads = _backward_arrays(recipe, dout, {"q": q}, {"k": k, "v": v}, [out, stats.m, stats.l], graph,
                             meta_stats.m.dtype, meta)
    return grads["dst"]["q"], grads["src"]["k"], grads["src"]["v"]


# --------------------------------------------------------------------------- programs
def _program_call(program, graph, src, dst, edge, params, for_grad=False):
    """Checks a program call over dask arrays and lowers it on zero-row stand-ins (which runs
    the program's own checks: the traced form, fields, params). Returns (recipe, stand-in
    output, stand-in stats, stand-in vjp)."""
    from .program import MessagePassing
    from . import score_mod as sm
    if not isinstance(program, MessagePassing):
        raise TypeError(f"program must be a tiga_numba.MessagePassing instance, got "
                        f"{type(program).__name__}")
    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be a tiga_numba.Graph, got {type(graph).__name__}")
    src, dst, edge = dict(src or {}), dict(dst or {}), dict(edge or {})
    if edge and graph.is_implicit:
        raise ValueError(f"per-edge fields ({', '.join(f'edge[{n!r}]' for n in edge)}) need a CSR "
                         f"relation; this graph is {graph.kind} (implicit: it has no edge list)")
    for name, a in edge.items():
        _check_dask(f"edge[{name!r}]", a)
        if a.shape[0] != graph.num_edges:
            raise ValueError(f"graph has num_edges={graph.num_edges} but edge[{name!r}] has "
                             f"{a.shape[0]} rows (axis 0)")
    if not dst:
        raise ValueError("tiga_numba.dask runs a program over the chunks of its dst fields: pass "
                         "at least one dst field (dask array chunked along the destinations)")
    if not src:
        raise ValueError("tiga_numba.dask needs the program's src fields (dask arrays chunked "
                         "along the sources)")
    for role, fields, n_rows in (("dst", dst, graph.num_dst), ("src", src, graph.num_src)):
        first = None
        for name, a in fields.items():
            _check_dask(f"{role}[{name!r}]", a)
            if a.shape[0] != n_rows:
                raise ValueError(f"graph has num_{role}={n_rows} but {role}[{name!r}] has "
                                 f"{a.shape[0]} rows (axis 0)")
            if first is None:
                first = name
            elif a.chunks[0] != fields[first].chunks[0]:
                raise ValueError(f"{role}[{name!r}] is chunked {a.chunks[0]} along axis 0 but "
                                 f"{role}[{first!r}] is chunked {fields[first].chunks[0]}; the "
                                 "chunk boundaries must agree")
    for name, value in params.items():
        if isinstance(value, da.Array):
            raise TypeError(f"param {name!r} is a dask array; pass params as numbers or (H,) "
                            "numpy / cupy arrays")
    stand_src = {n: _empty_rows(a) for n, a in src.items()}
    stand_dst = {n: _empty_rows(a) for n, a in dst.items()}
    stand_edge = {n: _empty_rows(a) for n, a in edge.items()} or None
    empty = Graph.from_csr(np.zeros(1, np.int64), np.zeros(0, np.int32), num_src=0)
    if graph.edge_field_names:   # a geometric graph: a stand-in with the same edge fields
        pos = graph._positions
        empty = Graph.radius(_xp_of(pos).zeros((0, pos.shape[1]), pos.dtype), 1.0)
    # the program's own lowering (not program.vjp, which would record the stand-in call as the
    # program's last one for its explain())
    lowered = program._lower(empty, stand_src, stand_dst, stand_edge, params, for_grad=for_grad)
    traced = lowered.traced
    geometric = sorted({f.name for f in traced.score.fields()
                        if f.role == "edge" and f.name in lowered.call.graph_fields})
    if geometric:
        name = geometric[0]
        raise NotImplementedError(
            f"edge.{name} is computed from the graph's node positions, which the partitions of "
            f"tiga_numba.dask do not carry; pass it as a per-edge field instead, "
            f"edge={{{name!r}: dask.array.from_array(graph.edge_field({name!r}))}} (its gradient "
            "then goes to that field, not to the positions)")
    if traced.kind == "net" and graph.is_implicit:   # as the single-process call (its message)
        raise NotImplementedError(f"score-network attention runs over CSR relations "
                                  f"(Graph.radius/knn/from_csr/...), got a {graph.kind!r} graph")
    if traced.reducer.block_prune_threshold is not None:
        raise NotImplementedError("tile pruning (block_prune_threshold) is approximate and not "
                                  "offered by tiga_numba.dask (always exact)")
    out, _ = lowered.forward()
    reads = traced.kind == "modified" and sm.Expr("index", (), "src") in set(sm.leaves(traced.score.expr))
    recipe = _ProgramCall(program, list(dst), list(src), list(edge), params, reads, traced.kind)
    meta_m = lowered.stats.m if recipe.saves_stats else np.zeros((0,), accumulation_dtype(out.dtype))
    return recipe, out, meta_m, lambda dout: lowered.backward(dout)[0]


def program(program, graph, *, src=None, dst=None, edge=None, **params):
    """A tg.MessagePassing program over dask arrays: ``program(graph=g, src=..., dst=...,
    **params)`` with the node fields given as dask arrays chunked along the node axis (every
    src field chunked alike, every dst field chunked alike; numpy or cupy chunks). Params are
    numbers or (H,) numpy / cupy arrays. Returns the output as a dask array chunked like the dst
    fields' rows. Per-edge fields (CSR relations) are dask arrays of ``num_edges`` rows in the graph
    constructor's edge order (any chunks). Positions (``src.index``, ``dst.index``) are those of
    the whole relation. Score networks (``tg.nn.trace``) run too (their backward runs each task's
    forward again); geometric edge fields (``edge.distance``, ``edge.displacement``) must be passed
    as per-edge fields. Tile pruning is not supported."""
    out, _ = _program_forward(program, graph, src, dst, edge, params, return_stats=False)
    return out


def _program_forward(program, graph, src, dst, edge, params, return_stats):
    recipe, meta_out, meta_m, vjp = _program_call(program, graph, src, dst, edge, params,
                                                  for_grad=return_stats)
    arrays = _forward_arrays(recipe, dict(dst), dict(src), graph, meta_out, meta_m,
                             return_stats and recipe.saves_stats, dict(edge or {}))
    return arrays[0], (arrays[1:], recipe, vjp, meta_m.dtype)


def program_vjp(program, graph, *, src=None, dst=None, edge=None, **params):
    """Forward plus a function from the output cotangent to gradients, over dask arrays (see
    :func:`program`):

        out, vjp = tiga_numba.dask.program_vjp(prog, graph=g, src=..., dst=..., scale=s)
        grads = vjp(dout)   # {"src": {...}, "dst": {...}, "edge": {...}, "params": {...}}

    ``dout`` is a dask array chunked like ``out``. Node field gradients are chunked like their
    fields, per-edge ones by destination partition (in the constructor's edge order); a per-head
    param's gradient is one (H,) chunk, and a score network's parameter gradient one chunk of
    the parameter's shape, each summed over the tasks in a fixed order; a float scalar param's
    gradient is a 0-d array, summed likewise (as ``program.vjp`` gives it)."""
    out, (saved, recipe, stand_vjp, acc) = _program_forward(program, graph, src, dst, edge, params,
                                                            return_stats=True)
    saved = [out, *saved] if recipe.saves_stats else []
    dst, src = dict(dst), dict(src)
    rows_like = dst[recipe.dst_names[0]]

    def vjp(dout):
        _check_dask("dout", dout)
        _check_rows_like("dout", dout, rows_like)
        if tuple(dout.shape) != tuple(out.shape):
            raise ValueError(f"dout must have the shape of out {tuple(out.shape)}, got {tuple(dout.shape)}")
        grads = stand_vjp(_empty_rows(dout))   # the single-process checks, on zero-row stand-ins
        meta = {role: grads[role] for role in ("dst", "src", "params", "edge")}
        return _backward_arrays(recipe, dout, dst, src, saved, graph, acc, meta, dict(edge or {}))

    return out, vjp


# --------------------------------------------------------------------------- GNN layers
class _LayerCall(_Call):
    """The tasks of a GNN layer (tiga_numba.layers) over a CSR relation: partition p runs the
    layer on its destination rows of x_dst, the halo of x_src its edges read and its share of
    the layer's edge set (PyG's self loops included, marked so that the partition's edge set
    knows them: a loop's source is renumbered into the halo like every other). The layer's
    backward needs its forward's intermediate arrays ((E, H) and (N, H, C) per partition), no
    per-row statistics: the backward task takes them from its forward task (keeps_state) or
    runs the partition's forward again.

    `edges` (the layer's edge set of the whole graph, host arrays) is read when the dask graph
    is built and is not pickled into the tasks. With `keeps_state` (layer_vjp) the forward task
    also returns its backward closure (a _LayerState), which the backward task of the same
    partition takes instead of running the forward again when both run in one process."""
    __slots__ = ("layer", "edge_names", "edges", "compute", "keeps_state")
    dst_names, src_names = ("x_dst",), ("x_src",)

    def __init__(self, layer, edges, edge_names, compute, keeps_state=False):
        self.layer, self.edges, self.edge_names = layer, edges, tuple(edge_names)
        self.compute = None if compute is None else np.dtype(compute)
        self.keeps_state = bool(keeps_state)

    def __reduce__(self):
        return (_LayerCall, (self.layer, None, self.edge_names, self.compute, self.keeps_state))

    def __dask_tokenize__(self):
        layer = self.layer
        config = {k: v for k, v in vars(layer).items() if k != "_params"}
        return ("layer", type(layer).__qualname__, tokenize(config), tokenize(layer.state_dict()),
                self.edge_names, str(self.compute), self.keeps_state)

    def partition_args(self, plan):
        """Per partition: its edges' loop marks (CSR order), None when the edge set has no
        loops; uploaded once per plan to a dask.distributed client, like the relations."""
        es = self.edges
        if not es.has_loops:
            return [(None,)] * len(plan.parts)
        is_loop, indptr = np.asarray(es.source) < 0, np.asarray(es.indptr)
        return [(m,) for m in _per_partition(plan, "loops",
                                             lambda part: is_loop[indptr[part.d0]:indptr[part.d1]])]

    def edge_layout(self, graph, plan):
        """The caller's edges the layer keeps (all but removed self loops), in CSR order."""
        es = self.edges

        def make():   # the edge set's kept edges (host arrays): positions and caller ids
            order, indptr = es.kept_source, np.asarray(es.indptr)
            ends = np.searchsorted(es.kept_pos, indptr[[p.d1 for p in plan.parts]])
            counts = np.diff(np.concatenate([[0], ends]))
            if order.shape[0] == es.num_in and np.array_equal(order, np.arange(es.num_in)):
                order = None
            return _EdgeLayout(order, counts, es.num_in)

        return plan.cached("layer edge layout", make)

    def _run(self, dst, src, edge, graph, loops, want_grad):
        x_src, x_dst = src["x_src"], dst["x_dst"]
        ea = edge.get("edge_attr")
        if self.compute is not None:   # float16 on the CPU: computed (and summed) in float32
            x_src, x_dst = x_src.astype(self.compute), x_dst.astype(self.compute)
            ea = None if ea is None else ea.astype(self.compute)
        from .layers._edges import marked_edge_set
        edges = marked_edge_set(graph, loops, _xp_of(x_dst))
        return self.layer._run((x_src, x_dst), edges, ea, None, want_grad=want_grad)

    def forward(self, dst, src, edge, graph, where, loops=None):
        out, backward = self._run(dst, src, edge, graph, loops, want_grad=self.keeps_state)
        return out, (_state_holder(backward) if self.keeps_state else None), None

    def backward(self, dout, saved, dst, src, edge, graph, where, loops=None):
        # the forward task's closure when it was made in this process (see _LayerState), else
        # the partition's forward again
        backward = saved[1][0].backward if saved else None   # saved: out, the kept state
        if backward is None:
            _, backward = self._run(dst, src, edge, graph, loops, want_grad=True)
        if self.compute is not None:
            dout = dout.astype(self.compute)
        dx_src, dx_dst, d_ea, dparams = backward(dout)
        return ({"x_dst": dx_dst}, {"x_src": dx_src}, dparams,
                {"edge_attr": d_ea} if self.edge_names else {})


class _LayerState:
    """A partition's layer backward (the closure its forward task made, holding the layer's
    intermediate arrays), handed from the forward task to the backward task of the same call so
    that the backward does not run the partition's forward again. It lives only in the process
    that made it: pickling it (a result moved to another process or worker, or spilled to disk)
    keeps nothing, and the backward task that receives an empty state runs the forward itself,
    as it would without one. `nbytes` (the arrays it holds, as far as they can be found) is what
    dask counts for it."""
    __slots__ = ("backward", "nbytes")

    def __init__(self, backward=None, nbytes=0):
        self.backward, self.nbytes = backward, int(nbytes)

    def __reduce__(self):
        return (_LayerState, ())


def _held_bytes(fn):
    """The bytes of the arrays a closure holds: its cells, the closures, containers and package
    objects they hold, each array counted once (views as their own size)."""
    seen, total, todo = set(), 0, [fn]
    while todo:
        x = todo.pop()
        if id(x) in seen or x is None or isinstance(x, type):
            continue
        seen.add(id(x))
        nbytes = getattr(x, "nbytes", None)
        if isinstance(nbytes, (int, np.integer)) and hasattr(x, "shape"):   # numpy, cupy
            total += int(nbytes)
        elif getattr(x, "__closure__", None):
            for cell in x.__closure__:
                try:
                    todo.append(cell.cell_contents)
                except ValueError:   # an empty cell
                    pass
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif type(x).__module__.startswith("tiga_numba"):
            todo.extend(getattr(x, "__dict__", {}).values())
            todo.extend(getattr(x, a, None) for a in getattr(type(x), "__slots__", ()))
    return total


class _StateChunk(np.ndarray):
    """A chunk of the dask array of layer states (one element per partition, each a
    _LayerState): an object array that dask sizes by the arrays its states hold, where a plain
    object array counts 8 bytes a pointer."""
    __slots__ = ()


def _state_holder(backward):
    """The partition's _LayerState in a one-element _StateChunk: what the backward task reads."""
    holder = np.empty(1, object).view(_StateChunk)
    holder[0] = _LayerState(backward, _held_bytes(backward))
    return holder


def _register_state_size():
    from dask.sizeof import sizeof
    sizeof.register(_StateChunk)(lambda chunk: sum(state.nbytes + 64 for state in chunk.tolist()))


_register_state_size()


def _layer_call(conv, x, graph, edge_attr, keeps_state=False):
    """Checks a layer call over dask arrays and runs the layer's own checks on zero-row
    stand-ins. Returns (recipe, x_src, x_dst, single, relation of the tasks, stand-in out,
    stand-in backward)."""
    from .layers._edges import edge_set
    from .layers._module import Layer
    if not isinstance(conv, Layer):
        raise TypeError(f"layer must be a tiga_numba.layers layer (GATConv, GATv2Conv, TransformerConv), "
                        f"got {type(conv).__name__}")
    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be a tiga_numba.Graph, got {type(graph).__name__}")
    single = not isinstance(x, (tuple, list))
    if single:
        x_src = x_dst = _check_dask("x", x)
    else:
        if len(x) != 2:
            raise ValueError(f"x must be a dask array or a pair (x_src, x_dst), got {len(x)} items")
        x_src, x_dst = x
        if x_dst is None:
            raise ValueError("x_dst is None: tiga_numba.dask runs a layer over the chunks of its "
                             "destination features; pass x_dst as a dask array")
        _check_dask("x_src", x_src)
        _check_dask("x_dst", x_dst)
    names = ("x", "x") if single else ("x_src", "x_dst")
    for name, a, n_rows, side in ((names[0], x_src, graph.num_src, "src"),
                                  (names[1], x_dst, graph.num_dst, "dst")):
        if a.shape[0] != n_rows:
            raise ValueError(f"graph has num_{side}={n_rows} but {name} has {a.shape[0]} rows (axis 0)")
    if edge_attr is not None:
        _check_dask("edge_attr", edge_attr)
        if edge_attr.shape[0] != graph.num_edges:
            raise ValueError(f"graph has num_edges={graph.num_edges} but edge_attr has "
                             f"{edge_attr.shape[0]} rows (axis 0)")
    # the layer's own checks (features, dtypes, libraries, edge_dim, dropout) on zero-row stand-ins
    empty = Graph.from_csr(np.zeros(1, np.int64), np.zeros(0, np.int32), num_src=0)
    stand = (_empty_rows(x_src), _empty_rows(x_dst))
    stand_ea = None if edge_attr is None else _empty_rows(edge_attr)
    out, backward = conv._run(stand if not single else stand[0], empty, stand_ea, None, want_grad=True)
    edges = edge_set(graph, getattr(conv, "add_self_loops", False), np)
    compute = (accumulation_dtype(x_src.dtype)
               if isinstance(x_src._meta, np.ndarray) and x_src.dtype == np.float16 else None)
    recipe = _LayerCall(conv, edges, ("edge_attr",) if edge_attr is not None else (), compute, keeps_state)
    return recipe, x_src, x_dst, single, edges.graph, out, backward


def layer(layer, x, graph, edge_attr=None):
    """A GNN layer of :mod:`tiga_numba.layers` (``GATConv``, ``GATv2Conv``, ``TransformerConv``)
    over dask arrays: ``layer(conv, x, graph, edge_attr=None)`` computes ``conv(x, graph,
    edge_attr)`` with ``x`` a dask array ``(N, F)`` chunked along the nodes (or a pair
    ``(x_src, x_dst)``; numpy or cupy chunks) and ``edge_attr`` a dask array of ``num_edges`` rows
    in the graph constructor's edge order (any chunks). Returns a dask array chunked like
    ``x_dst``'s rows. Each destination partition runs the layer on its rows, the source rows its
    edges read (self loops included) and its edges; see docs/dask.md."""
    return _layer_vjp(layer, x, graph, edge_attr, keep_state=False)[0]   # no state: nothing runs for the vjp


def layer_vjp(layer, x, graph, edge_attr=None):
    """Forward plus a function from the output cotangent to gradients, over dask arrays (see
    :func:`layer`), as ``conv.vjp``:

        out, vjp = tiga_numba.dask.layer_vjp(conv, x, graph, edge_attr)
        grads = vjp(dout)   # {"x": dx (or (dx_src, dx_dst)), "edge_attr": ..., "params": {name: grad}}

    ``dout`` is a dask array chunked like ``out``. ``dx`` is chunked like ``x``; ``edge_attr``'s
    gradient has its rows in the constructor's edge order (0 for a self loop the layer removes);
    each parameter's gradient is one chunk, summed over the partitions in a fixed order (the
    same bits on every run). A partition's forward task keeps the layer's intermediate arrays
    for its backward task: computed together (``dask.compute(out, grads)``, or the grads of a
    ``dout`` built from ``out``) each partition's forward runs once; a backward computed after
    ``out`` was released, or on another worker than its forward, runs the forward again."""
    return _layer_vjp(layer, x, graph, edge_attr, keep_state=True)


def _layer_vjp(layer, x, graph, edge_attr, keep_state):
    """layer_vjp; without `keep_state` (layer()) the forward tasks keep no state and a backward
    task would run its partition's forward."""
    recipe, x_src, x_dst, single, relation, meta_out, stand_backward = _layer_call(
        layer, x, graph, edge_attr, keeps_state=keep_state)
    edge = {"edge_attr": edge_attr} if edge_attr is not None else {}
    acc = accumulation_dtype(x_src.dtype)
    dst, src = {"x_dst": x_dst}, {"x_src": x_src}
    out, *state = _forward_arrays(recipe, dst, src, relation, meta_out, np.zeros((0,), acc), False, edge,
                                  keep_state=keep_state)
    params = layer.state_dict()

    def vjp(dout):
        _check_dask("dout", dout)
        _check_rows_like("dout", dout, x_dst)
        if tuple(dout.shape) != tuple(out.shape):
            raise ValueError(f"dout must have the shape of out {tuple(out.shape)}, got {tuple(dout.shape)}")
        # the layer's own checks of dout (library, dtype), on a zero-row stand-in
        dxs, dxd, d_ea, _ = stand_backward(_empty_rows(dout))
        xp = _xp_of(x_src._meta)
        meta = {"dst": {"x_dst": _empty_rows(x_dst)}, "src": {"x_src": _empty_rows(x_src)},
                "edge": {"edge_attr": d_ea} if edge_attr is not None else {},
                "params": {k: xp.zeros(v.shape, dtype=v.dtype) for k, v in params.items()}}
        # out is read too (not used): the forward tasks then have two readers in every graph of
        # the gradients, so dask's task fusion never merges one into the state's reader under a
        # new key, which computed with `out` would run the forward twice
        grads = _backward_arrays(recipe, dout, dst, src, [out, *state] if state else [], relation, acc,
                                 meta, edge)
        dx_src, dx_dst = grads["src"]["x_src"], grads["dst"]["x_dst"]
        if single:
            dx = (dx_src.astype(acc) + dx_dst.astype(acc)).astype(x_src.dtype)
        else:
            dx = (dx_src, dx_dst)
        return {"x": dx, "edge_attr": grads["edge"].get("edge_attr"), "params": grads["params"]}

    return out, vjp
