"""Relations: the attention pattern as an immutable graph.

Edge (j -> i): j is the source (supplies key and value), i the destination (supplies the
query); rows of the relation are destinations. Implicit kinds (dense, triangular, segments)
store only block offsets; the general kind stores CSR. Kernels see one of two records,
`BlockRelation` or `CSRRelation` (see docs/INTERNALS.md), realised per device and cached.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import IndexDtypeError

__all__ = ["Graph", "BlockRelation", "CSRRelation", "CSRTranspose"]

_DEVICES = ("cpu", "cuda")


def _read_only(array):
    """A read-only view of a numpy array (None stays None): what a property hands out of an
    immutable Graph's own arrays."""
    if array is None:
        return None
    view = array.view()
    view.flags.writeable = False
    return view


# --------------------------------------------------------------------------- kernel-facing records
@dataclass(frozen=True)
class BlockRelation:
    """Block-diagonal relation of S banded blocks. Block b pairs the destinations
    [dst_offsets[b], dst_offsets[b+1]) with the sources [src_offsets[b], src_offsets[b+1]); in
    block-local positions (r, c) it holds the edge when lo[b] <= c - r <= hi[b]. Full blocks
    have lo = -(rows-1), hi = cols-1; square causal blocks hi = 0 (their `causal` flag is set);
    bottom-right-aligned causal blocks hi = cols - rows; sliding windows bound both sides.
    `lo`/`hi` are clipped to the block, so lo > hi means an empty block."""
    dst_offsets: Any  # int64 (S+1,)
    src_offsets: Any  # int64 (S+1,)
    causal: Any  # uint8 (S,): 1 where the block is square with hi == 0 and no lower bound
    max_block_dst: int
    max_block_src: int
    lo: Any = None  # int64 (S,); None: -(rows - 1), i.e. no lower bound
    hi: Any = None  # int64 (S,); None: 0 for causal blocks, cols - 1 for the others
    # every block is full or square-causal (what the CUDA kernels take today)
    standard: bool = True

    def __post_init__(self):
        # records built from (offsets, causal) alone: full or causal blocks, in any array library
        if self.lo is None or self.hi is None:
            nd = self.dst_offsets[1:] - self.dst_offsets[:-1]
            ns = self.src_offsets[1:] - self.src_offsets[:-1]
            if self.lo is None:
                object.__setattr__(self, "lo", 1 - nd)
            if self.hi is None:
                object.__setattr__(self, "hi", (ns - 1) * (1 - (self.causal != 0)))

    @property
    def num_blocks(self):
        return int(self.causal.shape[0])

    @functools.cached_property
    def band_width(self):
        """keys per row of the widest band (hi - lo + 1 over the non-empty blocks; 0 when every
        block is empty), computed once per record."""
        def host(a):
            return np.asarray(a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else a, np.int64)
        lo, hi = host(self.lo), host(self.hi)
        live = hi >= lo
        return int((hi[live] - lo[live] + 1).max()) if live.any() else 0


@dataclass(frozen=True)
class CSRRelation:
    indptr: Any  # int64 (num_dst+1,)
    indices: Any  # int32 (E,) source ids
    num_src: int


@dataclass(frozen=True)
class CSRTranspose:
    """Rows = sources. `indices` are destination ids, `perm` the original edge id of each
    entry (increasing within a row, which keeps the backward's summation order fixed)."""
    indptr: Any  # int64 (num_src+1,)
    indices: Any  # int32 (E,)
    perm: Any  # int64 (E,)


# --------------------------------------------------------------------------- validation
def _check_device(device):
    if device is None:
        return "cpu"
    if device not in _DEVICES:
        raise ValueError(f"device must be one of {_DEVICES}, got {device!r}")
    return device


def _flag(name, value):
    """A yes/no argument (causal=): bool, numpy bool, or the ints 0 / 1; anything else (a string,
    which would be truthy) is a TypeError."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {value!r}")


#: how from_coo and from_edge_index name the COO arrays and sizes in their errors
_COO_NAMES = {"src": "src", "dst": "dst", "num_src": "num_src", "num_dst": "num_dst"}
_EDGE_INDEX_NAMES = {"src": "edge_index[0] (sources)", "dst": "edge_index[1] (destinations)",
                     "num_src": "num_nodes", "num_dst": "num_nodes"}


def _count(name, value):
    if isinstance(value, (bool, np.bool_)):   # operator.index(True) is 1: a flag, not a count
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")
    return int(n)


def _refuse_non_numbers(name, array, given, what="an integer array (numpy, cupy or a sequence of ints)"):
    """TypeError naming `name` when np.asarray made `array` of objects or strings (None, a
    string, a mapping...: the type is wrong, not the shape); `given`: the caller's type name."""
    if array.dtype.kind in "OUSV":
        raise TypeError(f"{name} must be {what}, got {given}" + (f" of dtype {array.dtype}" if array.ndim else ""))


def _to_host(name, array):
    """numpy view of a 1-D integer array given as numpy, cupy, or a sequence."""
    if hasattr(array, "__cuda_array_interface__") and not isinstance(array, np.ndarray):
        array = array.get() if hasattr(array, "get") else np.asarray(array)
    try:
        out = np.asarray(array)
    except Exception as exc:  # pragma: no cover - exotic inputs
        raise TypeError(f"{name} must be array-like, got {type(array).__name__}") from exc
    _refuse_non_numbers(name, out, type(array).__name__)
    if out.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {out.shape}")
    if out.size and not np.issubdtype(out.dtype, np.integer):
        raise IndexDtypeError(f"{name} must have an integer dtype, got {out.dtype}")
    if not out.size:
        return np.zeros(0, np.int64)
    if out.dtype.kind == "u" and out.dtype.itemsize >= 8:
        # uint64 values >= 2**63 would wrap to negative int64 and be reported as such
        too_big = out > np.iinfo(np.int64).max
        if too_big.any():
            bad = int(np.argmax(too_big))
            raise ValueError(f"{name}[{bad}]={int(out[bad])} is out of range: indices, offsets "
                             "and lengths must be below 2**63")
    return out.astype(np.int64, copy=False)


def _dia_structure(dia):
    """COO of every in-bounds position of a DIA matrix's stored diagonals, values ignored
    (ones): scipy's DIA conversions drop zero values, which would drop stored entries."""
    import scipy.sparse as sp
    nrows, ncols = dia.shape
    width = min(dia.data.shape[1], ncols)
    cols = np.arange(width, dtype=np.int64)
    rows = cols[None, :] - np.asarray(dia.offsets, np.int64)[:, None]
    keep = (rows >= 0) & (rows < nrows)
    r, c = rows[keep], np.broadcast_to(cols, rows.shape)[keep]
    return sp.coo_matrix((np.ones(r.shape[0], np.int8), (r, c)), shape=dia.shape)


def _rows_of(indptr):
    """Destination id of every CSR entry."""
    return np.repeat(np.arange(indptr.shape[0] - 1, dtype=np.int64), np.diff(indptr))


def _blocks_to_csr(rel: BlockRelation, num_dst):
    """Materialise a block relation as CSR (for to_scipy and mixed Graph.cat); rows list their
    sources in increasing order."""
    counts = np.zeros(num_dst, np.int64)
    pieces = []
    for b in range(rel.num_blocks):
        d0, d1 = int(rel.dst_offsets[b]), int(rel.dst_offsets[b + 1])
        s0, s1 = int(rel.src_offsets[b]), int(rel.src_offsets[b + 1])
        nd, ns = d1 - d0, s1 - s0
        lo, hi = int(rel.lo[b]), int(rel.hi[b])
        if nd == 0 or ns == 0 or lo > hi:
            continue
        r = np.arange(nd, dtype=np.int64)
        first = np.clip(r + lo, 0, ns)
        last = np.clip(r + hi + 1, 0, ns)
        row_len = np.maximum(last - first, 0)
        counts[d0:d1] = row_len
        # row r holds columns first[r] .. last[r]-1: a running index minus each row's start
        starts = np.cumsum(row_len) - row_len
        cols = np.arange(int(row_len.sum()), dtype=np.int64) - np.repeat(starts - first, row_len)
        pieces.append((d0, cols + s0))
    indptr = np.zeros(num_dst + 1, np.int64)
    np.cumsum(counts, out=indptr[1:])
    indices = np.zeros(int(indptr[-1]), np.int32)
    for d0, cols in pieces:
        start = int(indptr[d0])
        indices[start:start + cols.shape[0]] = cols
    return indptr, indices


def _cells_at_or_below(nd, ns, x):
    """Number of cells (r, c) of an nd x ns block with c - r <= x (exact for Python ints and
    elementwise for int64/object arrays)."""
    t = x + 1
    zero = 0 * nd
    lo_r = np.minimum(nd, np.maximum(zero, -t))
    hi_r = np.minimum(nd, np.maximum(zero, ns - t))
    hi_r = np.maximum(hi_r, lo_r)
    width = hi_r - lo_r
    return width * t + (lo_r + hi_r - 1) * width // 2 + (nd - hi_r) * ns


def _band_edges(nd, ns, lo, hi):
    """Edges of blocks (nd x ns, lo <= c - r <= hi), elementwise, exact."""
    return np.where(lo > hi, 0, _cells_at_or_below(nd, ns, hi) - _cells_at_or_below(nd, ns, lo - 1))


def _block_edges(rel: BlockRelation):
    """Exact edge count (a Python int, whatever the sizes)."""
    nd = np.diff(np.asarray(rel.dst_offsets))
    ns = np.diff(np.asarray(rel.src_offsets))
    lo = np.asarray(rel.lo)
    hi = np.asarray(rel.hi)
    # every block's count is at most nd * ns, so the total is at most sum(nd) * max(ns): where
    # that may pass int64 (one large block, or many blocks), count in Python integers
    big = bool(nd.size) and int(nd.sum()) * int(ns.max()) >= 2**62
    if big:
        nd, ns, lo, hi = (x.astype(object) for x in (nd, ns, lo, hi))
    return int(sum(int(e) for e in _band_edges(nd, ns, lo, hi))) if big else \
        int(np.sum(_band_edges(nd, ns, lo, hi), dtype=np.int64))


UNBOUNDED = None


def _make_blocks(dst_sizes, src_sizes, lo=None, hi=None):
    """BlockRelation from per-block sizes and diagonal bounds (None = unbounded on that side),
    clipped to each block."""
    dst_sizes = np.asarray(dst_sizes, np.int64).reshape(-1)
    src_sizes = np.asarray(src_sizes, np.int64).reshape(-1)
    S = dst_sizes.shape[0]
    full_lo = -(dst_sizes - 1)
    full_hi = src_sizes - 1
    lo = full_lo if lo is None else np.maximum(np.asarray(lo, np.int64).reshape(-1), full_lo)
    hi = full_hi if hi is None else np.minimum(np.asarray(hi, np.int64).reshape(-1), full_hi)
    lo = np.broadcast_to(lo, (S,)).astype(np.int64)
    hi = np.broadcast_to(hi, (S,)).astype(np.int64)
    empty = (dst_sizes == 0) | (src_sizes == 0) | (lo > hi)
    lo = np.where(empty, 0, lo)
    hi = np.where(empty, -1, hi)
    nonempty = ~empty
    full = nonempty & (lo == full_lo) & (hi == full_hi)
    causal = nonempty & (dst_sizes == src_sizes) & (lo == full_lo) & (hi == 0)
    dst_offsets = np.zeros(S + 1, np.int64)
    src_offsets = np.zeros(S + 1, np.int64)
    np.cumsum(dst_sizes, out=dst_offsets[1:])
    np.cumsum(src_sizes, out=src_offsets[1:])
    return BlockRelation(
        dst_offsets=dst_offsets,
        src_offsets=src_offsets,
        causal=causal.astype(np.uint8),
        max_block_dst=int(dst_sizes.max()) if S else 0,
        max_block_src=int(src_sizes.max()) if S else 0,
        lo=lo,
        hi=hi,
        standard=bool(np.all(full | causal | empty)),
    )


def _bound(name, value):
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    try:
        v = int(operator.index(value))
    except TypeError:
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}") from None
    # beyond +-2**62 a bound reaches past every relation that int64 offsets can describe: clip
    # it there (the same edge set), so that the int64 block arithmetic cannot overflow
    return max(-BOUND_LIMIT, min(BOUND_LIMIT, v))


BOUND_LIMIT = 2**62


def _check_cu(name, cu_seqlens):
    cu = _to_host(name, cu_seqlens)
    if cu.shape[0] == 0:
        raise ValueError(f"{name} must hold at least one entry (0), got an empty array")
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0]={int(cu[0])}")
    lengths = np.diff(cu)
    if np.any(lengths < 0):
        bad = int(np.argmax(lengths < 0))
        raise ValueError(
            f"{name} must be non-decreasing, got {name}[{bad}]={int(cu[bad])} > "
            f"{name}[{bad + 1}]={int(cu[bad + 1])}")
    return cu, lengths


def _window(window):
    if window is None:
        return None, None
    try:
        left, right = window
    except (TypeError, ValueError):
        raise TypeError(f"window must be a (left, right) pair of ints or None, got {window!r}") from None
    left, right = _bound("window[0]", left), _bound("window[1]", right)
    # flash-attn's convention: a negative side (its default window_size=(-1, -1)) is unbounded
    return (None if left is None or left < 0 else left), (None if right is None or right < 0 else right)


# --------------------------------------------------------------------------- the Graph
class Graph:
    """An immutable attention relation: which sources j each destination i attends.

    An edge (j -> i) goes from source j (the row of `k` and `v`) to destination i (the row of
    `q` and of the output); rows of the relation are destinations. Build a Graph with one of
    the constructors (`dense`, `triangular`, `band`, `cu_seqlens`, `cat`, `from_csr`,
    `from_scipy`, `from_coo`, `from_edge_index`, `radius`, `knn`). Implicit relations (dense,
    triangular, band, segments) store
    no per-edge data; a CSR relation keeps one copy of its indices per device, made on first
    use and cached. The `device=` keyword ("cpu" / "cuda") is accepted by every constructor
    and only says where the relation is expected to be used first."""

    __slots__ = ("_kind", "_num_src", "_num_dst", "_num_edges", "_blocks", "_indptr",
                 "_indices", "_device", "_positions", "_cache", "_edge_perm", "_dev_csr")

    def __init__(self, *, kind, num_src, num_dst, blocks=None, indptr=None, indices=None,
                 device="cpu", positions=None, dev_csr=None):
        # Private: use the constructors, which validate their inputs. A CSR lives on the host
        # (indptr/indices, numpy) or, when a GPU builder made it, on the device (dev_csr =
        # (indptr, indices) cupy arrays); the other copy is made on first use and kept.
        self._kind = kind
        self._num_src = int(num_src)
        self._num_dst = int(num_dst)
        self._blocks = blocks
        self._indptr = indptr
        self._indices = indices
        self._dev_csr = dev_csr
        self._device = device
        self._positions = positions
        if blocks is not None:
            self._num_edges = _block_edges(blocks)
        else:
            self._num_edges = int((indices if dev_csr is None else dev_csr[1]).shape[0])
        self._cache = {}
        self._edge_perm = None

    def __getstate__(self):
        # Pickles (to dask workers, other processes) carry the relation, not its realisations:
        # the per-device cache is rebuilt on first use where the graph lands.
        return {name: ({} if name == "_cache" else getattr(self, name)) for name in self.__slots__}

    def __setstate__(self, state):
        for name, value in state.items():
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def dense(cls, num_src, num_dst=None, *, device=None):
        """All pairs; `num_dst` defaults to `num_src` (rectangular is cross-attention;
        `Graph.dense(num_keys, 1)` is one decode step)."""
        num_src = _count("num_src", num_src)
        num_dst = num_src if num_dst is None else _count("num_dst", num_dst)
        return cls(kind="dense", num_src=num_src, num_dst=num_dst,
                   blocks=_make_blocks([num_dst], [num_src]), device=_check_device(device))

    @classmethod
    def triangular(cls, n, *, device=None):
        """Causal attention: edge (j -> i) for every j <= i."""
        n = _count("n", n)
        return cls(kind="triangular", num_src=n, num_dst=n,
                   blocks=_make_blocks([n], [n], hi=[0]), device=_check_device(device))

    @classmethod
    def band(cls, num_src, num_dst=None, *, left=None, right=0, device=None):
        """Banded (sliding-window) relation: edge (j -> i) when i - left <= j <= i + right.

        flash-attn's ``window_size=(left, right)``; ``None`` leaves that side unbounded, so
        ``band(n, left=None, right=0)`` is ``triangular(n)`` and ``band(n, left=W - 1)`` is causal
        attention over the last W keys. Positions are global (no alignment for rectangular
        shapes); negative bounds shift the band off the diagonal. Stays implicit: key tiles
        outside the band are never visited."""
        num_src = _count("num_src", num_src)
        num_dst = num_src if num_dst is None else _count("num_dst", num_dst)
        left, right = _bound("left", left), _bound("right", right)
        lo = None if left is None else [-left]
        hi = None if right is None else [right]
        return cls(kind="band", num_src=num_src, num_dst=num_dst,
                   blocks=_make_blocks([num_dst], [num_src], lo, hi), device=_check_device(device))

    @classmethod
    def cu_seqlens(cls, cu_seqlens=None, causal=True, *, cu_seqlens_k=None, window=None, device=None,
                   cu_seqlens_q=None):
        """Block-diagonal relation from cumulative sequence lengths (flash-attn varlen).

        Segment b pairs queries ``[cu_seqlens[b], cu_seqlens[b+1])`` with keys
        ``[cu_seqlens_k[b], cu_seqlens_k[b+1])`` (``cu_seqlens_k=None``: the same as the
        queries). ``causal`` is bottom-right aligned as in flash-attn >= 2.1: query r of a
        segment with Lq queries and Lk keys attends key c when ``c <= r + Lk - Lq``.
        ``window=(left, right)`` keeps keys ``r + Lk - Lq - left <= c <= r + Lk - Lq + right``
        (``None`` or a negative number = unbounded side, as flash-attn's ``window_size=(-1, -1)``).
        Zero-length segments are legal. The query offsets may
        also be passed as ``cu_seqlens_q=`` (flash-attn's name), not both."""
        if cu_seqlens_q is not None:
            if cu_seqlens is not None:
                raise TypeError("Graph.cu_seqlens takes the query offsets once: cu_seqlens or "
                                "cu_seqlens_q, not both")
            cu_seqlens = cu_seqlens_q
        elif cu_seqlens is None:
            raise TypeError("Graph.cu_seqlens needs the query offsets: cu_seqlens (or "
                            "cu_seqlens_q), a 1-D integer array starting at 0")
        causal = _flag("causal", causal)
        cu, lengths = _check_cu("cu_seqlens", cu_seqlens)
        if cu_seqlens_k is None:
            cu_k, lengths_k = cu, lengths
        else:
            cu_k, lengths_k = _check_cu("cu_seqlens_k", cu_seqlens_k)
            if cu_k.shape != cu.shape:
                raise ValueError(f"cu_seqlens_k must have the length of cu_seqlens "
                                 f"({cu.shape[0]}), got {cu_k.shape[0]}")
        left, right = _window(window)
        offset = lengths_k - lengths  # bottom-right alignment
        hi = offset if causal else None
        if right is not None:
            hi = offset + right if hi is None else np.minimum(hi, offset + right)
        lo = None if left is None else offset - left
        blocks = _make_blocks(lengths, lengths_k, lo, hi)
        return cls(kind="segments", num_src=int(cu_k[-1]), num_dst=int(cu[-1]), blocks=blocks,
                   device=_check_device(device))

    @classmethod
    def cat(cls, graphs, *, device=None):
        """Block-diagonal composition: graph b's sources and destinations follow graph b-1's.
        Stays implicit when every block is implicit (dense/triangular/segments/band), else
        becomes CSR."""
        graphs = list(graphs)
        if not graphs:
            raise ValueError("graphs must hold at least one Graph, got an empty sequence")
        for i, g in enumerate(graphs):
            if not isinstance(g, Graph):
                raise TypeError(f"graphs[{i}] must be a tiga_numba.Graph, got {type(g).__name__}")
        num_src = sum(g.num_src for g in graphs)
        num_dst = sum(g.num_dst for g in graphs)
        device = _check_device(device) if device is not None else (
            graphs[0].device if graphs else "cpu")
        if all(g._blocks is not None for g in graphs):
            if len(graphs) == 1:
                return graphs[0] if device == graphs[0].device else cls(
                    kind=graphs[0].kind, num_src=num_src, num_dst=num_dst,
                    blocks=graphs[0]._blocks, device=device)
            cat = np.concatenate
            blocks = _make_blocks(cat([np.diff(g._blocks.dst_offsets) for g in graphs]),
                                  cat([np.diff(g._blocks.src_offsets) for g in graphs]),
                                  cat([g._blocks.lo for g in graphs]),
                                  cat([g._blocks.hi for g in graphs]))
            return cls(kind="segments", num_src=num_src, num_dst=num_dst, blocks=blocks,
                       device=device)
        indptrs, indices, perms = [np.zeros(1, np.int64)], [], []
        edge_offset = src_offset = 0
        for g in graphs:
            ip, ix = g._host_csr()
            indptrs.append(ip[1:] + edge_offset)
            indices.append(ix.astype(np.int64) + src_offset)
            n_edges = int(ip[-1])
            perms.append((np.arange(n_edges, dtype=np.int64) if g._edge_perm is None
                          else g._edge_perm) + edge_offset)
            edge_offset += n_edges
            src_offset += g.num_src
        indptr = np.concatenate(indptrs)
        idx = np.concatenate(indices).astype(np.int32) if indices else np.zeros(0, np.int32)
        graph = cls(kind="csr", num_src=num_src, num_dst=num_dst, indptr=indptr, indices=idx,
                    device=device)
        # the input edge order of a composition is its parts' input orders one after the other
        # (PyG's Batch of edge_attr): kept when a part was built from COO, so that per-edge fields
        # given in that order reach the right edges
        if any(g._edge_perm is not None for g in graphs):
            graph._edge_perm = np.concatenate(perms)
        return graph

    @classmethod
    def from_csr(cls, indptr, indices, num_src=None, validate="basic", *, device=None):
        """General relation from CSR arrays (rows = destinations, indices = sources).

        `num_src` defaults to max(num_dst, max(indices) + 1): square for self-attention
        graphs, wider only when an index needs it. validate="basic" checks structure and the
        index range (vectorised, always on: kernels must never read out of bounds);
        "full" also walks every index and reports the first bad one with its row."""
        if validate not in ("basic", "full"):
            raise ValueError(f"validate must be 'basic' or 'full', got {validate!r}")
        indptr = _to_host("indptr", indptr)
        indices = _to_host("indices", indices)
        if indptr.shape[0] == 0:
            raise ValueError("indptr must have length num_dst + 1 >= 1, got an empty array")
        if indptr[0] != 0:
            raise ValueError(f"indptr must start at 0, got indptr[0]={int(indptr[0])}")
        steps = np.diff(indptr)
        if np.any(steps < 0):
            bad = int(np.argmax(steps < 0))
            raise ValueError(f"indptr must be non-decreasing, got indptr[{bad}]={int(indptr[bad])} > "
                             f"indptr[{bad + 1}]={int(indptr[bad + 1])}")
        if indptr[-1] != indices.shape[0]:
            raise ValueError(f"indptr[-1] must equal len(indices)={indices.shape[0]}, "
                             f"got {int(indptr[-1])}")
        num_dst = indptr.shape[0] - 1
        needed = int(indices.max()) + 1 if indices.size else 0
        if num_src is None:
            num_src = max(num_dst, needed)
        num_src = _count("num_src", num_src)
        if num_src >= 2**31:
            raise ValueError(f"num_src must be < 2**31, got {num_src}")
        if validate == "full":
            for e in range(indices.shape[0]):
                j = int(indices[e])
                if j < 0 or j >= num_src:
                    row = int(np.searchsorted(indptr, e, side="right") - 1)
                    raise ValueError(f"indices[{e}]={j} (row {row}) is out of range [0, num_src={num_src})")
        elif indices.size and (indices.min() < 0 or needed > num_src):
            bad = int(np.argmax((indices < 0) | (indices >= num_src)))
            raise ValueError(f"indices[{bad}]={int(indices[bad])} is out of range [0, num_src={num_src})")
        return cls(kind="csr", num_src=num_src, num_dst=num_dst, indptr=indptr.copy(),
                   indices=indices.astype(np.int32), device=_check_device(device))

    @classmethod
    def from_scipy(cls, matrix, *, device=None):
        """Any scipy.sparse matrix/array; rows = destinations, columns = sources.

        Every stored position is an edge and the values are ignored, in every format: explicit
        zeros are edges (CSR, CSC, COO; LIL and DOK do not store assigned zeros), every element of a stored block is an edge
        (BSR, zeros inside the block included), every in-bounds position of a stored diagonal
        is an edge (DIA, zeros included: scipy's own DIA -> CSR conversion would drop them).
        Duplicate entries (COO, repeated DIA offsets) are one edge. To make zero values mean
        "no edge", drop them first: ``m = m.tocsr(); m.eliminate_zeros()``.

        Per-edge fields (a layer's ``edge_attr``, a program's edge fields) are read in the
        matrix's stored order, as ``matrix.tocoo()`` lists the entries (so ``matrix.data`` of a
        COO, CSR or CSC matrix lines up with its edges; DIA: diagonal by diagonal as stored,
        every in-bounds position, zeros included, where scipy's tocoo drops zeros), an edge given
        twice at its first entry: the fields of a matrix with duplicates have one row per
        distinct edge.
        `edge_permutation` maps the CSR edges to that order (None where it is the CSR order)."""
        import scipy.sparse as sp
        if not sp.issparse(matrix):
            raise TypeError(f"matrix must be a scipy.sparse matrix or array, got {type(matrix).__name__}")
        if len(matrix.shape) != 2:   # scipy's sparse arrays may be 1-D (or n-D COO)
            raise ValueError(f"matrix must be 2-D (num_dst, num_src), got shape {tuple(matrix.shape)}")
        if matrix.format == "csr" and matrix.has_canonical_format:   # already the CSR order
            return cls.from_csr(matrix.indptr, matrix.indices, num_src=matrix.shape[1], device=device)
        num_dst, num_src = (int(n) for n in matrix.shape)
        for name, n in (("rows (num_dst)", num_dst), ("columns (num_src)", num_src)):
            if n >= 2**31:   # before the keys below, which would overflow int64
                raise ValueError(f"matrix {name} must be < 2**31 for a CSR relation (int32 indices), "
                                 f"got shape {tuple(matrix.shape)}")
        coo = _dia_structure(matrix) if matrix.format == "dia" else matrix.tocoo()
        # stored entries in stored order; key = row * num_src + col is the CSR order (< 2**62)
        key = coo.row.astype(np.int64) * num_src + coo.col.astype(np.int64)
        perm = None
        if key.size and not bool(np.all(key[1:] > key[:-1])):
            key, first = np.unique(key, return_index=True)   # distinct edges, CSR order
            perm = np.empty(key.size, np.int64)   # CSR edge e -> rank of its first entry
            perm[np.argsort(first, kind="stable")] = np.arange(key.size, dtype=np.int64)
            if np.array_equal(perm, np.arange(key.size)):
                perm = None
        rows = key // max(num_src, 1)
        indptr = np.zeros(num_dst + 1, np.int64)
        np.cumsum(np.bincount(rows, minlength=num_dst), out=indptr[1:])
        graph = cls.from_csr(indptr, key - rows * num_src, num_src=num_src, device=device)
        graph._edge_perm = perm
        return graph

    @classmethod
    def from_coo(cls, src, dst, num_src=None, num_dst=None, *, device=None):
        """Edges (src[e] -> dst[e]), stably sorted by destination (edge order within a row is
        the input order). Missing sizes follow PyG's num_nodes: max index + 1 over both
        arrays, or the other size when it is given and large enough."""
        return cls._coo(src, dst, num_src, num_dst, device, _COO_NAMES)

    @classmethod
    def _coo(cls, src, dst, num_src, num_dst, device, names):
        """from_coo, its errors naming the arguments as the caller's constructor calls them
        (`names`: src, dst, num_src, num_dst -> the words for them)."""
        n_src, n_dst, n_ns, n_nd = (names[k] for k in ("src", "dst", "num_src", "num_dst"))
        src = _to_host(n_src, src)
        dst = _to_host(n_dst, dst)
        if src.shape != dst.shape:
            raise ValueError(f"{n_src} and {n_dst} must have the same length, got {src.shape[0]} "
                             f"and {dst.shape[0]}")
        for name, a in ((n_src, src), (n_dst, dst)):
            if a.size and a.min() < 0:
                e = int(np.argmax(a < 0))
                raise ValueError(f"{name} must hold node indices >= 0, got {name}[{e}] = {int(a[e])}")
        need_src = int(src.max()) + 1 if src.size else 0
        need_dst = int(dst.max()) + 1 if dst.size else 0
        if num_src is None and num_dst is None:
            num_src = num_dst = max(need_src, need_dst)
        elif num_src is None:
            num_dst = _count(n_nd, num_dst)
            num_src = max(num_dst, need_src)
        elif num_dst is None:
            num_src = _count(n_ns, num_src)
            num_dst = max(num_src, need_dst)
        num_src, num_dst = _count(n_ns, num_src), _count(n_nd, num_dst)
        # before any (num_dst + 1)-sized array: a stray index of 2**31 would ask for 16 GiB
        for name, n, given in ((n_ns, num_src, n_src), (n_nd, num_dst, n_dst)):
            if n >= 2**31:
                raise ValueError(f"{name} must be < 2**31 for a CSR relation (int32 indices), got "
                                 f"{n} (from {name}= or the largest index in {given})")
        if need_dst > num_dst:
            raise ValueError(f"{n_dst} holds index {need_dst - 1}, out of range [0, {n_nd}={num_dst})")
        if need_src > num_src:
            raise ValueError(f"{n_src} holds index {need_src - 1}, out of range [0, {n_ns}={num_src})")
        order = np.argsort(dst, kind="stable")
        indptr = np.zeros(num_dst + 1, np.int64)
        np.cumsum(np.bincount(dst, minlength=num_dst), out=indptr[1:])
        graph = cls.from_csr(indptr, src[order], num_src=num_src, device=device)
        graph._edge_perm = order.astype(np.int64)
        return graph

    @classmethod
    def from_edge_index(cls, edge_index, num_nodes=None, *, device=None):
        """PyG's convention: ``edge_index`` of shape (2, E), row 0 the sources, row 1 the
        destinations; the same relation (and edge order) as
        ``from_coo(edge_index[0], edge_index[1], num_nodes, num_nodes)``."""
        shape = getattr(edge_index, "shape", None)
        if shape is None:
            given = type(edge_index).__name__
            edge_index = np.asarray(edge_index)
            shape = edge_index.shape
            _refuse_non_numbers("edge_index", edge_index, given, "an integer array of shape (2, E)")
        if len(shape) != 2 or shape[0] != 2:
            raise ValueError(f"edge_index must have shape (2, E), got {tuple(shape)}")
        n = None if num_nodes is None else _count("num_nodes", num_nodes)
        return cls._coo(edge_index[0], edge_index[1], n, n, device, _EDGE_INDEX_NAMES)

    @classmethod
    def radius(cls, positions, cutoff, exclude_self=True, *, device=None):
        """Edges (j -> i) for every pair with `|pos[j] - pos[i]| <= cutoff` (cell lists; on the
        GPU for cupy positions, the CSR then stays there). Rows list their sources in
        increasing id. Edge fields: `displacement` = pos[src] - pos[dst] and `distance`."""
        from . import neighbors
        positions = neighbors.check_positions(positions)
        indptr, indices = neighbors.radius_graph(positions, cutoff, exclude_self=exclude_self)
        return cls._geometric(positions, indptr, indices, device)

    @classmethod
    def knn(cls, positions, k, exclude_self=True, *, device=None):
        """Each destination receives edges from its k nearest sources (ties by index; all
        N - 1 (or N) when fewer exist); built on the GPU for cupy positions, like radius."""
        from . import neighbors
        positions = neighbors.check_positions(positions)
        indptr, indices = neighbors.knn_graph(positions, k, exclude_self=exclude_self)
        return cls._geometric(positions, indptr, indices, device)

    @classmethod
    def _geometric(cls, positions, indptr, indices, device):
        # a builder's CSR is correct by construction: no validation pass. The graph keeps its
        # own copy of the positions (a Graph is immutable: a later change of the caller's array
        # must not move its edge fields away from the edges it was built with)
        positions = positions.copy()
        n = int(positions.shape[0])
        on_gpu = _is_device_array(indptr)
        device = _check_device(device) if device is not None else ("cuda" if on_gpu else "cpu")
        if on_gpu:
            return cls(kind="csr", num_src=n, num_dst=n, dev_csr=(indptr, indices),
                       device=device, positions=positions)
        return cls(kind="csr", num_src=n, num_dst=n, indptr=indptr, indices=indices,
                   device=device, positions=positions)

    # ------------------------------------------------------------------ properties
    @property
    def kind(self):
        """The relation's kind, one of 'dense', 'triangular', 'segments' (cu_seqlens, and cat
        of implicit blocks), 'band' (all four implicit) or 'csr'."""
        return self._kind

    @property
    def num_src(self):
        """Number of source nodes (rows of `k` and `v`), a Python int."""
        return self._num_src

    @property
    def num_dst(self):
        """Number of destination nodes (rows of `q` and of the output), a Python int."""
        return self._num_dst

    @property
    def num_edges(self):
        """Exact number of edges (j -> i), a Python int (computed, not stored, for implicit
        relations)."""
        return self._num_edges

    @property
    def device(self):
        """Where the relation was built or first meant to be used, 'cpu' or 'cuda'. Calls
        realise it on the device of their arrays whatever this says."""
        return self._device

    @property
    def is_implicit(self):
        """True for dense, triangular, band and segment relations (no index arrays), False for CSR."""
        return self._blocks is not None

    @property
    def positions(self):
        """Node positions `(N, dim)` of a geometric (radius / knn) graph in the array library they
        were given in, else None. The graph is immutable: a numpy array comes back as a
        read-only view of the graph's own copy, a cupy array (which has no read-only flag) as a
        fresh copy, so that writing into it cannot change the graph's edge fields."""
        pos = self._positions
        if pos is None or isinstance(pos, np.ndarray):
            return _read_only(pos)
        return pos.copy()

    @property
    def edge_permutation(self):
        """For a graph built by from_coo (or from_edge_index), or by from_scipy from a matrix whose
        stored order is not the CSR order, an int64 array `(num_edges,)`: edge e in CSR order
        (the order the kernels read per-edge values in) is input edge `edge_permutation[e]`.
        Programs and layers take per-edge fields in the input order and convert with it
        (`field[graph.edge_permutation]`); None where the input order is the CSR order.
        Read-only: it is the graph's own array."""
        return _read_only(self._edge_perm)

    @property
    def edge_field_names(self):
        """Names of the per-edge fields a program's `edge.<name>` can read, ('displacement',
        'distance') for radius / knn graphs and () otherwise."""
        return ("displacement", "distance") if self._positions is not None else ()

    def __repr__(self):
        return self.explain()

    def explain(self):
        """One line: kind, sizes, edges, how the relation is stored."""
        if self._blocks is not None:
            nb = self._blocks.num_blocks
            store = (f"implicit ({nb} block{'s' if nb != 1 else ''}, "
                     f"{int(self._blocks.causal.sum())} causal; no index arrays)")
        else:
            store = f"CSR (indptr int64, indices int32; cached on {sorted(self._cache_devices()) or ['cpu']})"
        geo = ", edge fields: displacement, distance" if self._positions is not None else ""
        return (f"Graph(kind={self._kind}, num_dst={self._num_dst}, num_src={self._num_src}, "
                f"num_edges={self._num_edges}, storage={store}{geo})")

    # ------------------------------------------------------------------ realisations
    def _cached(self, key, build):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def _cache_devices(self):
        devices = {k[1] for k in self._cache if k[0] == "realize"}
        if self._indptr is not None or self._blocks is not None:
            devices.add("cpu")
        if self._dev_csr is not None:
            devices.add("cuda")
        return devices

    def _host_csr(self):
        if self._indptr is None and self._dev_csr is not None:
            # a GPU-built graph: the host copy is made only when a host consumer asks
            indptr, indices = self._dev_csr
            self._indptr, self._indices = indptr.get(), indices.get()
        if self._indptr is not None:
            return self._indptr, self._indices
        return self._cached(("csr", "cpu"), lambda: _blocks_to_csr(self._blocks, self._num_dst))

    def realize(self, device="cpu"):
        """The kernel-facing record (BlockRelation or CSRRelation) on `device`."""
        device = _check_device(device)

        def build():
            if self._blocks is not None:
                return _on_device(self._blocks, device)
            if device == "cuda" and self._dev_csr is not None:
                indptr, indices = self._dev_csr
                return CSRRelation(indptr=indptr, indices=indices, num_src=self._num_src)
            indptr, indices = self._host_csr()
            return CSRRelation(indptr=_array_on(indptr, device),
                               indices=_array_on(indices, device), num_src=self._num_src)
        return self._cached(("realize", device), build)

    def realize_transpose(self, device="cpu"):
        """CSR of the transposed relation (rows = sources) with the edge permutation."""
        device = _check_device(device)
        if self._blocks is not None:
            return None
        if device == "cuda" and self._dev_csr is not None:
            return self._cached(("transpose", device),
                                lambda: _device_transpose(*self._dev_csr, self._num_src))

        def host():
            indptr, indices = self._host_csr()
            rows = _rows_of(indptr)
            perm = np.argsort(indices, kind="stable").astype(np.int64)
            t_indptr = np.zeros(self._num_src + 1, np.int64)
            np.cumsum(np.bincount(indices, minlength=self._num_src), out=t_indptr[1:])
            return CSRTranspose(indptr=t_indptr, indices=rows[perm].astype(np.int32), perm=perm)

        t = self._cached(("transpose", "cpu"), host)
        if device == "cpu":
            return t
        return self._cached(("transpose", device), lambda: _on_device(t, device))

    def edge_field(self, name):
        """Materialise a geometric edge field (`displacement` (E, dim) or `distance` (E,))
        in the positions' array library. Fused kernels compute these per edge instead."""
        if self._positions is None:
            raise ValueError(f"edge field {name!r} needs a geometric graph (Graph.radius/knn)")
        if name not in ("displacement", "distance"):
            raise ValueError(f"unknown edge field {name!r}; this graph has 'displacement', 'distance'")
        pos = self._positions
        xp = _xp_of(pos)
        if xp is not np:
            rel = self.realize("cuda")
            rows = _device_rows(rel.indptr, int(rel.indices.shape[0]))
            indices = rel.indices
        else:
            indptr, indices = self._host_csr()
            rows = _rows_of(indptr)
        disp = pos[indices] - pos[rows]
        return disp if name == "displacement" else xp.sqrt((disp * disp).sum(axis=-1))

    def to_scipy(self):
        """The relation as a scipy.sparse.csr_array of booleans, shape (num_dst, num_src)."""
        import scipy.sparse as sp
        indptr, indices = self._host_csr()
        data = np.ones(indices.shape[0], dtype=bool)
        return sp.csr_array((data, indices.copy(), indptr.copy()), shape=(self._num_dst, self._num_src))

    def restrict(self, dst_start, dst_stop, src_start, src_stop):
        """The sub-relation between destinations [dst_start, dst_stop) and sources
        [src_start, src_stop), renumbered from 0 on both sides (a tile of the relation, e.g. a
        (query chunk, key chunk) block of a partitioned call). Implicit relations stay implicit
        (a band of the block); CSR keeps each row's edge order. ``num_edges`` is exact, so an
        empty block can be skipped without touching it."""
        d0, d1 = _count("dst_start", dst_start), _count("dst_stop", dst_stop)
        s0, s1 = _count("src_start", src_start), _count("src_stop", src_stop)
        if not (d0 <= d1 <= self._num_dst):
            raise ValueError(f"dst range [{d0}, {d1}) must lie within [0, num_dst={self._num_dst}]")
        if not (s0 <= s1 <= self._num_src):
            raise ValueError(f"src range [{s0}, {s1}) must lie within [0, num_src={self._num_src}]")
        if self._blocks is None:
            indptr, indices = self._host_csr()
            lo_e, hi_e = int(indptr[d0]), int(indptr[d1])
            idx = indices[lo_e:hi_e].astype(np.int64)
            keep = (idx >= s0) & (idx < s1)
            rows = _rows_of(indptr[d0:d1 + 1] - lo_e)
            counts = np.bincount(rows[keep], minlength=d1 - d0)
            sub_indptr = np.zeros(d1 - d0 + 1, np.int64)
            np.cumsum(counts, out=sub_indptr[1:])
            return Graph(kind="csr", num_src=s1 - s0, num_dst=d1 - d0, indptr=sub_indptr,
                         indices=(idx[keep] - s0).astype(np.int32), device=self._device)
        rel = self._blocks
        doff, soff = np.asarray(rel.dst_offsets), np.asarray(rel.src_offsets)
        # blocks overlapping either range form one contiguous run (offsets increase in both)
        first = min(int(np.searchsorted(doff, d0, "right")) - 1, int(np.searchsorted(soff, s0, "right")) - 1)
        last = max(int(np.searchsorted(doff, d1, "left")), int(np.searchsorted(soff, s1, "left")))
        first = max(first, 0)
        last = min(last, rel.num_blocks)
        b = np.arange(first, last)
        a0 = np.clip(doff[b], d0, d1)
        a1 = np.clip(doff[b + 1], d0, d1)
        c0 = np.clip(soff[b], s0, s1)
        c1 = np.clip(soff[b + 1], s0, s1)
        # local positions shift by the clipped starts: c - r keeps its meaning
        shift = (c0 - soff[b]) - (a0 - doff[b])
        blocks = _make_blocks(a1 - a0, c1 - c0, np.asarray(rel.lo)[b] - shift,
                              np.asarray(rel.hi)[b] - shift)
        if blocks.num_blocks == 1:
            nd, ns = d1 - d0, s1 - s0
            kind = ("dense" if int(blocks.lo[0]) == -(nd - 1) and int(blocks.hi[0]) == ns - 1
                    else "triangular" if bool(blocks.causal[0]) else "band")
        else:
            kind = "segments"
        return Graph(kind=kind, num_src=s1 - s0, num_dst=d1 - d0, blocks=blocks, device=self._device)


# --------------------------------------------------------------------------- device plumbing
def _xp_of(array):
    if isinstance(array, np.ndarray):
        return np
    import cupy
    return cupy


def _array_on(array, device):
    if device == "cpu":
        return array
    import cupy
    return cupy.asarray(array)


def _on_device(record, device):
    if device == "cpu":
        return record
    fields = {k: (_array_on(v, device) if isinstance(v, np.ndarray) else v)
              for k, v in record.__dict__.items()}
    return type(record)(**fields)


def _is_device_array(array):
    return hasattr(array, "__cuda_array_interface__") and not isinstance(array, np.ndarray)


def _device_rows(indptr, num_edges):
    """Destination id of every CSR entry, computed on the device (cupy indptr)."""
    import cupy
    entries = cupy.arange(num_edges, dtype=np.int64)
    return cupy.searchsorted(indptr, entries, side="right") - 1


def _device_transpose(indptr, indices, num_src):
    """realize_transpose on the device, for a CSR that lives there: the host version's
    result (entries of a source row in increasing edge id)."""
    import cupy
    num_edges = int(indices.shape[0])
    t_indptr = cupy.zeros(num_src + 1, np.int64)
    if num_edges == 0:
        return CSRTranspose(indptr=t_indptr, indices=cupy.zeros(0, np.int32),
                            perm=cupy.zeros(0, np.int64))
    edge = cupy.arange(num_edges, dtype=np.int64)
    # unique keys (source, edge id): any sort gives the host's stable argsort of the sources
    perm = cupy.argsort(indices.astype(np.int64) * num_edges + edge).astype(np.int64)
    t_indptr[1:] = cupy.cumsum(cupy.bincount(indices, minlength=num_src))
    rows = cupy.searchsorted(indptr, edge, side="right") - 1
    return CSRTranspose(indptr=t_indptr, indices=rows[perm].astype(np.int32), perm=perm)
