"""CUDA backend entry points (docs/INTERNALS.md, "Backend entry points").

    forward(plan, q, k, v, relation, edge_bias=None, score_mod=None) -> (out, m, l[, m_kernel])
    backward(plan, dout, q, k, v, out, m, l, relation, transpose, edge_bias=None,
             score_mod=None, m_kernel=None) -> (dq, dk, dv, dbias) [+ ({leaf: gradient},) with score_mod]

Row statistics at large scores. The CUDA-core kernels (blocks, csr, decode and their merges)
compute scores and the softmax in natural-log units, so the m they store is the row max exactly
as their backward recomputes it (blocks.py, csr.py: exp(s - m) * (1 / l), exp((s - m) - log l));
they return no m_kernel and their backward reads m. The tensor-core kernels work in base 2
(scores times scale log2(e)): their forward also returns m_kernel, the base-2 row max as the
softmax used it, which their backward reads instead of converting m back (cuda/tc/api.py). The
backend's m_kernel is therefore always in base-2 units; a CUDA-core backward ignores it.

Score modifiers (score_mod.BoundModifier) run on the CUDA-core kernels (cuda.blocks, cuda.csr):
the tree is compiled into them (cuda/score_codegen.py; kernels and launch records are keyed on
the tree and its gradient leaves), its per-call values packed once per call (`pack`), and the
modifier's gradients come back from row-owned buffers (no float atomics, see blocks.py /
csr.py).

cupy arrays in, cupy arrays out, on cupy's current stream. Inputs are read in place with
their strides (the kernels take element strides); only arrays with negative or
non-element-multiple strides, and non-contiguous per-row stats / edge bias, are copied,
and each copy is recorded in plan.run_info["copies"].

Routing is the registry's (tiga_numba/registry.py: cuda.decode, cuda.tc, cuda.blocks,
cuda.csr); this module runs the family the plan names. cuda.decode: block relations whose
blocks have at most DECODE_MAX_ROWS query rows (decode, few queries over long key ranges),
float16/float32/float64 without pruning: the split-key forward of decode.py. cuda.tc: what the
tensor-core `supports()` accepts (every block relation, bands included; pruning of full and
square-causal blocks). Everything else (float64, CSR, pruning on banded blocks, edge bias, other
head dims) runs on the CUDA-core kernels of blocks.py / csr.py. CSR passes over skewed degrees run on a work-item table: long rows cut into pieces merged
in fixed order, items ordered by length (_csr_split).

Per-call cost: everything that depends only on the relation and the call's sizes (kernel
objects, tiles, grids, the relation's device addresses, the run_info text) is a *launch
record*, built on the first call and memoised on the relation record
(`KERNELS.derived`); a later call allocates its outputs, reads the operands' addresses and
strides, and launches. No host synchronisation and no device-to-host copy (except the
two pruning counters of a pruned forward, which explain() reports).
"""
from __future__ import annotations

import functools
import math

import cupy
import numpy as np

from ..kernel_cache import KERNELS
from ..plan import defer_counts
from . import blocks as _blocks
from . import csr as _csr
from . import decode as _decode
from . import score_codegen as _mods
from . import tiles as _tiles
from .common import make_delta, make_stats
from .launch import current_stream

try:  # the tensor-core kernels (cuda/tc); absent or partial -> CUDA-core kernels only
    from . import tc as _tc
except ImportError:  # pragma: no cover
    _tc = None


# the split-key (decode) path: block relations whose blocks have at most this many query rows
from ..registry import DECODE_MAX_ROWS  # noqa: E402,F401  (the cuda.decode family's bound)


def _poisoned(shape, dtype):
    return cupy.full(shape, np.nan, dtype)


def _allocator(plan):
    """How this call allocates its outputs (and the backward's per-row Delta): cupy.empty, or
    NaN-filled arrays when the plan's run options ask for them (run option ``poison_outputs``,
    a debugging aid: an element that no kernel writes then shows as NaN)."""
    options = getattr(plan, "options", None)
    return _poisoned if options is not None and options.poison_outputs else cupy.empty


class _Asked:
    """The plan facts the tensor-core admission reads (the plan itself is made afterwards)."""
    __slots__ = ("score", "scale", "op", "prune_threshold")

    def __init__(self, score, scale, op, pruned):
        self.score, self.scale, self.op = score, scale, op
        self.prune_threshold = 1.0 if pruned else None   # only whether it is set is read


def tensor_core_probe(graph, arrays, scale, score):
    """The registry's device-level check for the ``cuda.tc`` family: None when the generated
    tensor-core kernels compute this request on this device exactly, else the reason."""
    supports = getattr(_tc, "supports", None) if _tc is not None else None
    if supports is None or not hasattr(_tc, "forward"):
        return None

    def check(req):
        if req.op == "backward" and not hasattr(_tc, "backward"):
            return "no tensor-core backward"
        q, k, v = arrays
        if not supports(_Asked(score, scale, req.op, req.pruned), q, k, v, graph.realize("cuda")):
            return ("dtype, head dim, strides or device outside the tensor-core tables "
                    "(tiga_numba.cuda.tc.api.supports)")
        return None
    return check


def _is_blocks(relation):
    return hasattr(relation, "dst_offsets")


@functools.lru_cache(maxsize=None)
def _block_tiles(kind, dtype, D, DV):
    return _tiles.block_tiles(kind, dtype, D, DV)


@functools.lru_cache(maxsize=None)
def _csr_tiles(kind, dtype, D, DV):
    return _tiles.csr_tiles(kind, dtype, D, DV)


def _ir(kernels):
    """run_info["ir"]: stage -> zero-arg callable joining the kernels' text."""
    def stage(name):
        def text():
            parts = []
            for kern in kernels:
                body = kern.llvm() if name == "llvm" else kern.ptx()
                parts.append(f"// ---- {kern.name}\n{body}")
            return "\n".join(parts)
        return text
    return {"llvm": stage("llvm"), "ptx": stage("ptx")}


class _Record:
    """What one (relation, sizes, dtype, options) call shape launches: built once, read by
    every later call. `cache` is the kernel-cache outcome of the call that built it."""

    __slots__ = ("kernels", "cache", "uses", "info", "geo")

    def __init__(self):
        self.kernels = []
        self.cache = "hit"
        self.uses = 0
        self.info = {}
        self.geo = {}

    def kernel(self, key, build):
        kern = KERNELS.get(("cuda",) + key, build)
        if not KERNELS.last_was_hit:
            self.cache = "miss"
        self.kernels.append(kern)
        return kern

    def finish(self, **info):
        info["ir"] = _ir(list(self.kernels))
        self.info = info
        return self


def _record(relation, key, build):
    """The memoised launch record for this call shape, and its cache outcome for run_info."""
    rec = KERNELS.derived(relation, key, lambda: build(relation, *key[1:]))
    rec.uses += 1
    if rec.uses == 1:
        return rec, rec.cache
    KERNELS.count_hits(len(rec.kernels))
    return rec, "hit"


def _view(x, name, copies):
    """(array kept alive, device address, element strides) of a 3-D array."""
    item = x.itemsize
    s0, s1, s2 = x.strides
    if s0 < 0 or s1 < 0 or s2 < 0 or s0 % item or s1 % item or s2 % item:
        copies.append(f"{name}: strides {x.strides} (negative or not a multiple of the item "
                      "size) -> contiguous copy")
        x = cupy.ascontiguousarray(x)
        s0, s1, s2 = x.strides
    return x, x.data.ptr, s0 // item, s1 // item, s2 // item


def _contig(x, dtype, name, copies):
    if x is None:
        return None
    if x.dtype != dtype or not x.flags.c_contiguous:
        copies.append(f"{name}: {x.dtype} {'contiguous' if x.flags.c_contiguous else 'strided'} "
                      f"-> contiguous {np.dtype(dtype).name} copy")
        x = cupy.ascontiguousarray(x, dtype=dtype)
    return x


def _ptr(x):
    return 0 if x is None else x.data.ptr


_DUMMY = {}


def _dummy(dtype):
    """A 2-element device array passed where a kernel takes an unused array argument."""
    key = (cupy.cuda.runtime.getDevice(), dtype)
    d = _DUMMY.get(key)
    if d is None:
        d = _DUMMY[key] = cupy.zeros(2, dtype)
    return d


_DTYPES = {}


def _dtypes(dt):
    """(input dtype, its name, accumulation dtype, its name), memoised: dtype.name is slow."""
    r = _DTYPES.get(dt)
    if r is None:
        d = np.dtype(dt)
        aname = _tiles.acc_of(d.name)
        r = _DTYPES[dt] = (d, d.name, np.dtype(aname), aname)
    return r


def _cdiv(a, b):
    return -(-a // b)


def _mod_key(gen):
    """What a modified kernel is cached under: the tree and its gradient leaves (None: plain)."""
    return None if gen is None else gen.key


def _modifier(score_mod, aname, grads, edge_bias):
    """The compiled device functions of a call's modifier (None without one)."""
    if score_mod is None:
        return None
    if edge_bias is not None:
        raise NotImplementedError("a score modifier and an edge_bias in one call: express the "
                                  "bias as a per-edge field of the modifier (edge.<name>)")
    return _mods.generated(score_mod.tree, score_mod.grad_leaves if grads else (), aname)


def _mod_values(score_mod, acc, H, Nq, Nk, E, copies):
    """Device addresses of the modifier's packed values (mv, mnd, mns, mef) and the arrays
    that keep them alive; the accumulation-dtype dummy four times without a modifier."""
    if score_mod is None:
        d = _dummy(acc).data.ptr
        return (d, d, d, d), ()
    arrays = _mods.pack(score_mod, cupy, acc, H, Nq, Nk, E)
    if any(a.size > 1 for a in arrays[1:]):
        copies.append(f"score-modifier fields -> packed {np.dtype(acc).name} (N, n, H) arrays")
    return tuple(a.data.ptr for a in arrays), arrays


# --------------------------------------------------------------------------- launch records
def _forward_blocks(rel, dname, D, DV, H, prune, mod=None):
    rec = _Record()
    t = _block_tiles("fwd", dname, D, DV)
    rec.geo["kern"] = rec.kernel(("blocks.fwd", t, prune, _mod_key(mod)),
                                 lambda: _blocks.make_forward(t, prune, mod))
    tpb = _cdiv(int(rel.max_block_dst), t.BM)
    S = int(rel.causal.shape[0])
    rec.geo.update(grid=(S * tpb, H, 1), block=(t.NT, 1, 1), tpb=tpb,
                   rel=_block_rel(rel, rec.geo), dummy=_dummy("int64").data.ptr)
    return rec.finish(
        kernel=("cuda.blocks.forward (CUDA cores, streaming online softmax"
                + (", tile pruning" if prune else "") + _mod_note(mod) + ")" + _banded_note(rel)),
        tiles=t.describe())


# rows longer than a piece are cut into pieces (one lane group each) merged in slot order; a
# piece holds at least CSR_MIN_PIECE edges and about E / (CSR_PIECES_PER_SM * SMs): the rows
# then carry about equal work, and a graph whose rows are all shorter keeps the one-pass kernels
CSR_MIN_PIECE = 1024
CSR_PIECES_PER_SM = 64
# degrees this skewed (longest row > SKEW x the mean, plus a margin) take the work-item path
# even without a row to cut: rows ordered by length keep the lanes of a warp equally busy
CSR_SKEW = 8


class _Split:
    """Work items of one CSR pass whose long rows were cut (None when no row is)."""
    __slots__ = ("items", "splits", "n_items", "n_split", "n_slots", "piece", "longest")


def _csr_split(owner, indptr):
    """The pieces of a CSR pass over `indptr` (device array), memoised on its relation record:
    one device-to-host copy of indptr the first time, none after."""
    def build():
        host = cupy.asnumpy(indptr).astype(np.int64)
        deg = np.diff(host)
        sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        piece = max(CSR_MIN_PIECE, _cdiv(int(host[-1]) if host.size else 0, CSR_PIECES_PER_SM * sms))
        longest = int(deg.max()) if deg.size else 0
        mean = float(host[-1]) / max(1, deg.size)
        if longest <= piece and longest <= CSR_SKEW * mean + 32:
            return None
        items, splits, n_slots = _csr.row_pieces(host, piece)
        sp = _Split()
        sp.items, sp.splits = cupy.asarray(items), cupy.asarray(splits)
        sp.n_items, sp.n_split, sp.n_slots = int(items.shape[0]), int(splits.shape[0]), n_slots
        sp.piece, sp.longest = piece, longest
        return sp
    return KERNELS.derived(owner, ("cuda.csr.split", indptr.data.ptr), build)


def _split_note(sp, what):
    if sp is None:
        return ""
    cut = (f"{sp.n_split} row(s) longer than {sp.piece} edges (longest {sp.longest}) split into "
           f"{sp.n_slots} pieces, merged in fixed order" if sp.n_split else
           f"no row longer than {sp.piece} edges (longest {sp.longest})")
    return f"; {what}: rows ordered by length, {cut}"


def _forward_csr(rel, dname, D, DV, H, has_bias, mod=None):
    rec = _Record()
    t = _csr_tiles("fwd", dname, D, DV)
    sp = _csr_split(rel, rel.indptr)
    items = sp is not None
    rec.geo["kern"] = rec.kernel(("csr.fwd", t, has_bias, items, _mod_key(mod)),
                                 lambda: _csr.make_forward(t, has_bias, items, mod))
    nrows = sp.n_items if items else int(rel.indptr.shape[0]) - 1
    threads = nrows * H * t.G
    rec.geo.update(grid=(_cdiv(threads, t.NT), 1, 1), block=(t.NT, 1, 1),
                   rel=(rel.indptr.data.ptr, rel.indices.data.ptr), split=sp, nrows=nrows)
    if items:
        acc = _tiles.acc_of(dname)
        rec.geo["merge"] = rec.kernel(("csr.softmax_merge", dname, acc, DV),
                                      lambda: _csr.make_softmax_merge(dname, acc, DV))
    return rec.finish(
        kernel=("cuda.csr.forward (CUDA cores, online softmax per edge"
                + (", edge bias" if has_bias else "") + _mod_note(mod)
                + _split_note(sp, "split rows") + ")"),
        tiles=t.describe_csr() + f", {t.UE} edge(s) per step" + _cap_note(t, mod))


def _cap_note(t, mod):
    """run_info's words for the register cap the CSR kernels are built with (csr.register_cap)."""
    cap = _csr.register_cap(t, mod)[1].get("max_registers")
    return f", <= {cap} registers per thread" if cap else ""


def _split_keys(longest, base, step, resident):
    """(splits, chunk) of flash-decoding's rule: `base` CTAs (blocks x kv heads x row groups)
    times `splits` key chunks fill whole waves of the `resident` CTAs the GPU holds at once (a
    partly filled last wave leaves SMs idle while it runs), and a chunk is at least 4 steps of
    `step` keys; the chunk is a multiple of `step`."""
    most = max(1, _cdiv(longest, 4 * step))
    splits = max(1, min(most, _cdiv(base, resident) * resident // base))
    chunk = max(step, _cdiv(_cdiv(max(longest, 1), splits), step) * step)
    return max(1, _cdiv(longest, chunk)), chunk


def _forward_decode(rel, dname, D, DV, H, Hkv):
    """Split-key launches, read once from the relation: the scalar-load geometry, and where k
    and v rows are 16-byte aligned (checked per call) the tensor-core kernel or the CUDA-core
    16-byte-load one. Each has its rows per CTA and its CTAs per SM, so its own grid and key
    chunks (_split_keys over the longest band of any block)."""
    rec = _Record()
    grp = H // Hkv
    S = int(rel.causal.shape[0])
    rows = int(rel.max_block_dst) * grp
    doff, soff, lo, hi = (cupy.asnumpy(x).astype(np.int64) for x in
                          (rel.dst_offsets, rel.src_offsets, rel.lo, rel.hi))
    nd, ns = np.diff(doff), np.diff(soff)
    kbeg = np.maximum(0, lo)
    kend = np.minimum(ns, nd - 1 + hi + 1)
    span = np.where((lo <= hi) & (nd > 0), np.maximum(kend - kbeg, 0), 0)
    longest = int(span.max()) if S else 0
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]

    def launch(t, kern, what):
        nrg = max(1, _cdiv(rows, t.ROWS))
        splits, chunk = _split_keys(longest, max(1, S * Hkv * nrg), t.step, t.ctas_per_sm * sms)
        return dict(kern=kern, grid=(S, splits, Hkv * nrg), block=(t.NT, 1, 1), nrg=nrg,
                    splits=splits, chunk=chunk,
                    what=(f"{what}: {splits} key chunk{'s' if splits > 1 else ''} of <= {chunk} "
                          f"keys per block"))

    t = _decode.decode_tiles(dname, D, DV, rows)
    rec.geo["scalar"] = launch(t, rec.kernel(("decode", t), lambda: _decode.make_decode(t)),
                               "CUDA cores")
    rec.geo["aligned"] = None
    if not _decode.SIM and _decode.mma_fits(dname, D, DV):
        tv = _decode.mma_tiles(dname, D, DV, rows)
        rec.geo["aligned"] = launch(tv, rec.kernel(("decode.mma", tv), lambda: _decode.make_decode_mma(tv)),
                                    "tensor cores")
    elif not _decode.SIM and _decode.vector_loads_fit(dname, D, DV):
        tv = _decode.decode_tiles(dname, D, DV, rows, vec=True)
        rec.geo["aligned"] = launch(tv, rec.kernel(("decode", tv), lambda: _decode.make_decode(tv)),
                                    "CUDA cores, 16-byte K/V loads")
    if max(g["splits"] for g in (rec.geo["scalar"], rec.geo["aligned"]) if g) > 1:
        rec.geo["merge"] = rec.kernel(("decode.merge", dname, t.acc, DV),
                                      lambda: _decode.make_merge(dname, t.acc, DV))
    lo_d, hi_d = rec.geo["band"] = _band_arrays(rel)
    rec.geo["rel"] = (rel.dst_offsets.data.ptr, rel.src_offsets.data.ptr, lo_d.data.ptr, hi_d.data.ptr)
    return rec.finish(
        kernel=(f"cuda.decode.forward (split-key flash-decoding: the {grp} query heads of a kv "
                "head read each K/V row once; a block cut into several key chunks has its "
                "partials merged in split order)"
                + _banded_note(rel).replace("only key tiles inside the band are visited; ", "")),
        tiles=t.describe() + (f"; where k and v rows are 16-byte aligned: {tv.describe()}"
                              if rec.geo["aligned"] is not None else ""))


def _forward_record(rel, dname, D, DV, H, prune, has_bias, mod=None):
    if _is_blocks(rel):
        return _forward_blocks(rel, dname, D, DV, H, prune, mod)
    return _forward_csr(rel, dname, D, DV, H, has_bias, mod)


def _mod_note(mod):
    return "" if mod is None else f", compiled score modifier f = {mod.tree}"


def _backward_record(rel, dname, aname, D, DV, Nq, H, Hkv, has_bias, mod=None, transpose=None):
    rec = _Record()
    g = rec.geo
    if not _is_blocks(rel):  # CSR: (m, log l, Delta) records, one per gathered (row, head)
        g["pre"] = rec.kernel(("stats", dname, aname), lambda: make_stats(dname, aname))
    else:
        g["pre"] = rec.kernel(("delta", dname, aname), lambda: make_delta(dname, aname))
    g["pre_grid"] = (_cdiv(Nq * H, g["pre"].rows_per_cta), 1, 1)
    g["pre_block"] = (g["pre"].NT, 1, 1)
    if _is_blocks(rel):
        S = int(rel.causal.shape[0])
        tq = _block_tiles("dq", dname, D, DV)
        tk = _block_tiles("dkdv", dname, D, DV)
        g["kq"] = rec.kernel(("blocks.dq", tq, _mod_key(mod)), lambda: _blocks.make_dq(tq, mod))
        g["kk"] = rec.kernel(("blocks.dkdv", tk, _mod_key(mod)),
                             lambda: _blocks.make_dkdv(tk, mod))
        g["tpb"] = _cdiv(int(rel.max_block_dst), tq.BM)
        g["tpbk"] = _cdiv(int(rel.max_block_src), tk.BM)
        g.update(q_grid=(S * g["tpb"], H, 1), q_block=(tq.NT, 1, 1),
                 k_grid=(S * g["tpbk"], Hkv, 1), k_block=(tk.NT, 1, 1),
                 rel=_block_rel(rel, g))
        return rec.finish(
            kernel=("cuda.blocks.backward (CUDA cores, deterministic: dq by query tiles, "
                    "dk/dv by key tiles" + _mod_note(mod) + ")" + _banded_note(rel)),
            tiles=f"dq: {tq.describe()}; dk/dv: {tk.describe()}")
    Ns = int(rel.num_src)
    t = _csr_tiles("bwd", dname, D, DV)
    sq = _csr_split(rel, rel.indptr)
    sk = _csr_split(transpose, transpose.indptr)
    grp = H // Hkv
    g["kq"] = rec.kernel(("csr.dq", t, has_bias, sq is not None, _mod_key(mod)),
                         lambda: _csr.make_dq(t, has_bias, sq is not None, mod))
    g["kk"] = rec.kernel(("csr.dkdv", t, has_bias, sk is not None, _mod_key(mod), grp),
                         lambda: _csr.make_dkdv(t, has_bias, sk is not None, mod, grp))
    if mod is not None:  # modifier gradient sums of split rows: pieces merged in slot order
        for side, targets, sp in (("mgq", ("head", "dst", "edge"), sq), ("mgk", ("src",), sk)):
            width = len(mod.grad(targets)[1]) * H
            if sp is not None and width:
                g[side] = rec.kernel(("csr.sum_merge", aname, aname, width),
                                     lambda w=width: _csr.make_sum_merge(aname, aname, w))
    nq_items = sq.n_items if sq is not None else Nq
    nk_items = sk.n_items if sk is not None else Ns
    g.update(q_grid=(_cdiv(nq_items * H * t.G, t.NT), 1, 1),
             k_grid=(_cdiv(nk_items * Hkv * t.G, t.NT), 1, 1), nq_items=nq_items,
             nk_items=nk_items, sq=sq, sk=sk,
             block=(t.NT, 1, 1), rel=(rel.indptr.data.ptr, rel.indices.data.ptr))
    if sq is not None:
        g["mq"] = rec.kernel(("csr.sum_merge", dname, aname, D),
                             lambda: _csr.make_sum_merge(dname, aname, D))
    if sk is not None:
        g["mk"] = rec.kernel(("csr.sum_merge", dname, aname, D),
                             lambda: _csr.make_sum_merge(dname, aname, D))
        g["mv"] = rec.kernel(("csr.sum_merge", dname, aname, DV),
                             lambda: _csr.make_sum_merge(dname, aname, DV))
    return rec.finish(
        kernel=("cuda.csr.backward (CUDA cores, deterministic: dq"
                + (" and dbias" if has_bias else "")
                + " by destination rows, dk/dv by source rows of the transposed CSR"
                + _mod_note(mod) + _split_note(sq, "dq") + _split_note(sk, "dk/dv") + ")"),
        tiles=f"{t.G} lanes per (row, head), {t.NT} threads per CTA")


def _band_arrays(rel):
    """lo, hi of a block relation as contiguous int64 device arrays (what the kernels read);
    kept alive by the launch record that holds their addresses."""
    return tuple(cupy.ascontiguousarray(cupy.asarray(x), dtype=np.int64) for x in (rel.lo, rel.hi))


def _block_rel(rel, geo):
    """Device addresses of a block relation, in the block kernels' argument order."""
    lo, hi = geo["band"] = _band_arrays(rel)
    return (rel.dst_offsets.data.ptr, rel.src_offsets.data.ptr, rel.causal.data.ptr,
            lo.data.ptr, hi.data.ptr)


def _banded_note(rel):
    """explain()'s word on a banded relation in the CUDA-core kernels."""
    if rel.standard:
        return ""
    return "; banded blocks (lo <= c - r <= hi): only key tiles inside the band are visited"


# --------------------------------------------------------------------------- forward
def forward(plan, q, k, v, relation, edge_bias=None, score_mod=None):
    info = plan.run_info
    if plan.family == "cuda.decode":
        return _decode_forward(plan, q, k, v, relation)
    if plan.family == "cuda.tc":
        info["kernel"] = "cuda.tc (tensor cores)"
        return _tc.forward(plan, q, k, v, relation, edge_bias, score_mod=score_mod)
    empty = _allocator(plan)

    blocks = _is_blocks(relation)
    if blocks and edge_bias is not None:
        raise NotImplementedError("edge_bias needs a CSR relation; the CUDA block kernels "
                                  "take no per-edge fields")
    copies = []
    Nq, H, D = q.shape
    Hkv = k.shape[1]
    DV = v.shape[2]
    dtype, dname, acc, aname = _dtypes(q.dtype)
    rho = plan.prune_threshold
    prune = rho is not None
    gen = _modifier(score_mod, aname, False, edge_bias)
    bias = _contig(edge_bias, acc, "edge_bias", copies)
    rec, cache = _record(relation, ("cuda.fwd", dname, D, DV, H, prune, bias is not None, gen),
                         _forward_record)
    mptrs, mkeep = _mod_values(score_mod, acc, H, Nq, k.shape[0],
                               0 if blocks else int(relation.indices.shape[0]), copies)
    da = _dummy(acc).data.ptr
    margs = mptrs + (da, da, da)
    g = rec.geo
    stream = current_stream()
    q, qp, qs0, qs1, qs2 = _view(q, "q", copies)
    k, kp, ks0, ks1, ks2 = _view(k, "k", copies)
    v, vp, vs0, vs1, vs2 = _view(v, "v", copies)
    out = empty((Nq, H, DV), dtype)
    m = empty((Nq, H), acc)
    l = empty((Nq, H), acc)
    scale = float(plan.scale)
    grp = H // Hkv
    info.update(rec.info)
    if blocks:
        cnt = cupy.zeros(2, np.int64) if prune else None
        if g["grid"][0] == 0:
            out.fill(0)
            m.fill(-np.inf)
            l.fill(0)
        else:
            g["kern"](g["grid"], g["block"], stream, qp, kp, vp, out.data.ptr, m.data.ptr,
                      l.data.ptr, *g["rel"], cnt.data.ptr if prune else g["dummy"],
                      qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, g["tpb"], H, grp, scale,
                      math.log(rho) if prune else 0.0, *margs)
        if prune:  # the one device-to-host read of the backend: explain()'s pruning counts, when asked
            defer_counts(info, lambda s=cupy.cuda.get_current_stream(): tuple(int(x) for x in cnt.get(stream=s)))
    elif g["grid"][0]:
        sp = g["split"]
        if sp is None:
            d = _dummy(acc).data.ptr
            tail = (_dummy("int64").data.ptr, d, d, d)
        else:
            pacc = cupy.empty((sp.n_slots * H * max(DV, 1),), acc)
            pm = cupy.empty((sp.n_slots * H,), acc)
            pl = cupy.empty((sp.n_slots * H,), acc)
            tail = (sp.items.data.ptr, pacc.data.ptr, pm.data.ptr, pl.data.ptr)
        g["kern"](g["grid"], g["block"], stream, qp, kp, vp, out.data.ptr, m.data.ptr,
                  l.data.ptr, *g["rel"], _ptr(bias), qs0, qs1, qs2, ks0, ks1, ks2,
                  vs0, vs1, vs2, g["nrows"], H, grp, scale, *tail, *margs)
        if sp is not None:
            mk = g["merge"]
            mk((sp.n_split * H, 1, 1), (mk.NT, 1, 1), stream, *tail[1:], sp.splits.data.ptr,
               out.data.ptr, m.data.ptr, l.data.ptr, sp.n_split, H)
    info["copies"] = copies
    info["cache"] = cache
    return out, m, l


def _decode_forward(plan, q, k, v, relation):
    """The split-key forward. Everything the decode kernel does not read is done after its
    launch, while it runs: with several key chunks the kernel writes only the partials, so
    out, m and l are allocated after it (before the merge kernel that writes them), and the
    explain() words are set last. The kernel's start waits on the host only for the views,
    the launch record and the partials' one allocation."""
    info = plan.run_info
    empty = _allocator(plan)
    copies = []
    Nq, H, D = q.shape
    Hkv = k.shape[1]
    DV = v.shape[2]
    dtype, dname, acc, _ = _dtypes(q.dtype)
    rec, cache = _record(relation, ("cuda.decode", dname, D, DV, H, Hkv), _forward_decode)
    g = rec.geo
    stream = current_stream()
    q, qp, qs0, qs1, qs2 = _view(q, "q", copies)
    k, kp, ks0, ks1, ks2 = _view(k, "k", copies)
    v, vp, vs0, vs1, vs2 = _view(v, "v", copies)
    lg, misaligned = g["scalar"], False
    if g["aligned"] is not None:
        if _decode.vector_loads_aligned((kp, vp), ((ks0, ks1, ks2), (vs0, vs1, vs2))):
            lg = g["aligned"]
        else:
            misaligned = True
    kern, splits = lg["kern"], lg["splits"]

    def outputs():
        return empty((Nq, H, DV), dtype), empty((Nq, H), acc), empty((Nq, H), acc)

    if lg["grid"][0] == 0 or Nq * H == 0:
        out, m, l = outputs()
        out.fill(0)
        m.fill(-np.inf)
        l.fill(0)
    else:
        d = _dummy(acc).data.ptr
        if splits > 1:
            # the partial (acc, m, l) of every split, one allocation; the kernel does not touch
            # out, m and l (they get the unused-argument array) and they are allocated after it
            n = Nq * H * splits
            part = cupy.empty((n * (max(DV, 1) + 2),), acc)
            p0, item = part.data.ptr, part.itemsize
            parts = (p0, p0 + n * max(DV, 1) * item, p0 + n * (max(DV, 1) + 1) * item)
            written = (d, d, d)
        else:
            out, m, l = outputs()
            parts, written = (d, d, d), (out.data.ptr, m.data.ptr, l.data.ptr)
        kern(lg["grid"], lg["block"], stream, qp, kp, vp, *written, *parts, *g["rel"],
             qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2,
             H, H // Hkv, lg["nrg"], splits, lg["chunk"], float(plan.scale))
        if splits > 1:
            out, m, l = outputs()
            mk = g["merge"]
            mk((Nq * H, 1, 1), (mk.NT, 1, 1), stream, *parts, _dummy(np.int64).data.ptr,
               out.data.ptr, m.data.ptr, l.data.ptr, Nq * H, splits)
    info.update(rec.info)
    if misaligned:
        info["kernel"] += ("; scalar K/V loads (k or v rows not 16-byte aligned or not "
                           "unit-stride along D)")
    info["kernel"] += "; " + lg["what"]
    info["copies"] = copies
    info["cache"] = cache
    return out, m, l


# --------------------------------------------------------------------------- backward
def backward(plan, dout, q, k, v, out, m, l, relation, transpose, edge_bias=None,
             score_mod=None, m_kernel=None):
    info = plan.run_info
    if plan.family == "cuda.tc":
        info["kernel"] = "cuda.tc (tensor cores)"
        grads = _tc.backward(plan, dout, q, k, v, out, m, l, relation, transpose, edge_bias,
                             m_kernel=m_kernel, score_mod=score_mod)
        # the registry sends a modifier whose fields / params want gradients to the CUDA cores
        return grads if score_mod is None else grads + ({},)
    # the CUDA-core kernels work in natural-log units: m is their exact row max (module text)
    empty = _allocator(plan)

    blocks = _is_blocks(relation)
    if blocks and edge_bias is not None:
        raise NotImplementedError("edge_bias needs a CSR relation")
    copies = []
    Nq, H, D = q.shape
    Ns, Hkv, _ = k.shape
    DV = v.shape[2]
    dtype, dname, acc, aname = _dtypes(q.dtype)
    scale = float(plan.scale)
    grp = H // Hkv
    gen = _modifier(score_mod, aname, True, edge_bias)
    bias = _contig(edge_bias, acc, "edge_bias", copies)
    has_bias = bias is not None
    rec, cache = _record(relation, ("cuda.bwd", dname, aname, D, DV, Nq, H, Hkv, has_bias, gen),
                         lambda rel, *a: _backward_record(rel, *a, transpose=transpose))
    # the modifier: packed values, and its gradients' buffers (rows of the dq pass, rows of
    # the dk/dv pass, edges), zeroed: a row no kernel visits keeps gradient 0
    E = 0 if blocks else int(relation.indices.shape[0])
    mptrs, mkeep = _mod_values(score_mod, acc, H, Nq, Ns, E, copies)
    da = _dummy(acc).data.ptr
    mgq = mgk = mge = None
    if gen is not None:
        _, rows_q, edges_q = gen.grad(("head", "dst", "edge"))
        _, rows_k, _ = gen.grad(("src",))
        mgq = cupy.zeros((Nq, len(rows_q), H), acc) if rows_q else None
        mgk = cupy.zeros((Ns, len(rows_k), H), acc) if rows_k else None
        mge = cupy.zeros((E, len(edges_q), H), acc) if edges_q else None
    mq_args = mptrs + (mgq.data.ptr if mgq is not None else da, da, da)
    mk_args = mptrs + (mgk.data.ptr if mgk is not None else da, da, da)
    g = rec.geo
    stream = current_stream()
    q, qp, qs0, qs1, qs2 = _view(q, "q", copies)
    k, kp, ks0, ks1, ks2 = _view(k, "k", copies)
    v, vp, vs0, vs1, vs2 = _view(v, "v", copies)
    if dout.dtype != dtype:
        copies.append(f"dout: {dout.dtype} -> {dname} copy")
        dout = dout.astype(dtype)
    if out.dtype != dtype:
        copies.append(f"out: {out.dtype} -> {dname} copy")
        out = out.astype(dtype)
    dout, dop, os0, os1, os2 = _view(dout, "dout", copies)
    out, outp, oo0, oo1, oo2 = _view(out, "out", copies)
    m = _contig(m, acc, "stats.m", copies)
    l = _contig(l, acc, "stats.l", copies)

    # Delta_i = sum(dO_i * O_i): one pass, read by both gradient kernels (the CSR kernels get
    # it interleaved with m and log(l), one record per gathered (row, head))
    if blocks:
        delta = empty((Nq, H), acc)
        pre_args = (dop, outp, delta.data.ptr)
    else:
        delta = empty((Nq, H, 3), acc)
        pre_args = (dop, outp, m.data.ptr, l.data.ptr, delta.data.ptr)
    if Nq * H:
        g["pre"](g["pre_grid"], g["pre_block"], stream, *pre_args,
                 os0, os1, os2, oo0, oo1, oo2, Nq * H, H, DV)

    dq = empty((Nq, H, D), dtype)
    dk = empty((Ns, Hkv, D), dtype)
    dv = empty((Ns, Hkv, DV), dtype)
    dbias = None
    strides = (qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, os0, os1, os2)
    if blocks:
        if g["q_grid"][0]:
            g["kq"](g["q_grid"], g["q_block"], stream, qp, kp, vp, dop, m.data.ptr, l.data.ptr,
                    delta.data.ptr, dq.data.ptr, *g["rel"], *strides, g["tpb"], H, grp, scale,
                    *mq_args)
        else:
            dq.fill(0)
        if g["k_grid"][0]:
            g["kk"](g["k_grid"], g["k_block"], stream, qp, kp, vp, dop, m.data.ptr, l.data.ptr,
                    delta.data.ptr, dk.data.ptr, dv.data.ptr, *g["rel"], *strides,
                    g["tpbk"], H, grp, scale, *mk_args)
        else:
            dk.fill(0)
            dv.fill(0)
    else:
        if has_bias:
            dbias = empty((int(relation.indices.shape[0]), H), acc)
        di, da = _dummy("int64").data.ptr, _dummy(acc).data.ptr
        sq, sk = g["sq"], g["sk"]
        if Nq * H:
            tail = (di, da, da, da)
            mpart = None
            if sq is not None:
                pdq = cupy.empty((sq.n_slots * H * max(D, 1),), acc)
                tail = (sq.items.data.ptr, pdq.data.ptr, da, da)
                if mgq is not None:
                    mpart = cupy.empty((sq.n_slots, mgq.shape[1], H), acc)
            g["kq"](g["q_grid"], g["block"], stream, qp, kp, vp, dop, delta.data.ptr,
                    dq.data.ptr, _ptr(dbias), *g["rel"], _ptr(bias), *strides, g["nq_items"],
                    H, grp, scale, *tail, *mptrs, mq_args[4], _ptr(mpart) or da,
                    _ptr(mge) or da)
            if sq is not None:
                mk = g["mq"]
                mk((sq.n_split * H, 1, 1), (mk.NT, 1, 1), stream, pdq.data.ptr,
                   sq.splits.data.ptr, dq.data.ptr, sq.n_split, H, scale)
                if mpart is not None:
                    mk = g["mgq"]
                    mk((sq.n_split, 1, 1), (mk.NT, 1, 1), stream, mpart.data.ptr,
                       sq.splits.data.ptr, mgq.data.ptr, sq.n_split, 1, 1.0)
        if Ns * Hkv:
            tail = (di, da, da, da)
            mpart = None
            if sk is not None:
                pdk = cupy.empty((sk.n_slots * Hkv * max(D, 1),), acc)
                pdv = cupy.empty((sk.n_slots * Hkv * max(DV, 1),), acc)
                tail = (sk.items.data.ptr, pdk.data.ptr, pdv.data.ptr, da)
                if mgk is not None:
                    mpart = cupy.empty((sk.n_slots, mgk.shape[1], H), acc)
            g["kk"](g["k_grid"], g["block"], stream, qp, kp, vp, dop, delta.data.ptr,
                    dk.data.ptr, dv.data.ptr, transpose.indptr.data.ptr,
                    transpose.indices.data.ptr, transpose.perm.data.ptr, _ptr(bias), *strides,
                    g["nk_items"], H, grp, scale, *tail, *mptrs, mk_args[4],
                    _ptr(mpart) or da, da)
            if sk is not None:
                for mk, part, dst in ((g["mk"], pdk, dk), (g["mv"], pdv, dv)):
                    mk((sk.n_split * Hkv, 1, 1), (mk.NT, 1, 1), stream, part.data.ptr,
                       sk.splits.data.ptr, dst.data.ptr, sk.n_split, Hkv, 1.0)
                if mpart is not None:
                    mk = g["mgk"]
                    mk((sk.n_split, 1, 1), (mk.NT, 1, 1), stream, mpart.data.ptr,
                       sk.splits.data.ptr, mgk.data.ptr, sk.n_split, 1, 1.0)
    info.update(rec.info)
    info["copies"] = copies
    info["cache"] = cache
    if score_mod is None:
        return dq, dk, dv, dbias
    return dq, dk, dv, dbias, _mods.unpack(score_mod, gen, cupy, acc, H, Nq, Ns, E,
                                           dst_rows=mgq, src_rows=mgk, edges=mge)
