"""CPU backend entry points (docs/INTERNALS.md, "Backend entry points").

    forward(plan, q, k, v, relation, edge_bias=None) -> (out, m, l, m_kernel)
    backward(plan, dout, q, k, v, out, m, l, relation, transpose, edge_bias=None,
             m_kernel=None) -> (dq, dk, dv, dbias)

``m_kernel`` is the row max in the kernels' units (base 2: ``m * log2(e)``), exactly as the
forward's kernels found it.  The backward subtracts it from scores it recomputes bit for bit
like the forward did, so ``exp2(s2 - m2)`` of the row's largest score is exactly 1 at any score
magnitude; going through the natural-log ``m`` instead would exponentiate that conversion's
rounding error (``|m| * 2**-24`` in float32: already 0.3 % at |m| = 5e4).  Without
``m_kernel`` (stats built by the caller, merged stats) the backward converts ``m``.

Arrays arrive validated (numpy, any strides, one dtype in float16/32/64).  This module
makes the layouts the kernels want (``layout.py``), picks the compiled specialisation from
``tiga_numba.kernel_cache.KERNELS`` and records what it did in ``plan.run_info``.
"""
import math
import warnings

import numpy as np
import numba

from ..kernel_cache import KERNELS, source as kernel_source
from . import blocks as _blocks
from . import microgemm as _microgemm
from . import csr as _csr
from . import decode as _decode
from . import score_codegen as _codegen
from . import split as _split
from .blas import single_threaded_blas
from ..scratch import output_empty, output_zeros   # outputs: plain arrays, or a Dask task's pool
from ..arrays import dtype_name
from .layout import (acc_dtype_of, all_finite, contiguous, head_major, in_place, node_major,
                     order_balanced, transposed_heads)
from . import threads as _threads
from .threads import serialised
from . import tiles as _tile_rule
from .. import run_options as _run_options

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)

# Tile sizes (query rows x key columns) of the block kernels come from tiles.py (the machine's
# rule, or options.cpu_tiles); the plan's options carry the choice and run_info shows it.
# dq partitions of the block backward.  A constant, not the thread count: the summation order
# of dq (partition by partition) then depends on the problem only, so the backward gives the
# same bits with any number of threads.  4 keeps 2-4 cores busy and balanced; memory is
# N_PARTS x (H, Nq, D) in the accumulation dtype.
N_PARTS = 4


_name = dtype_name   # memoised dtype.name (cpu/layout.py)


# --------------------------------------------------------------------------- thread count
# Each launch runs on the threads its work can keep busy (cpu/threads.py: no more than its work
# items, no more than one per threads.GRAIN scalar operations).


def _work(plan, H, D, Dv, passes=1):
    """a call's scalar multiply-adds, `passes` times the forward's E H (D + Dv) (None: unknown,
    e.g. a bare plan built by hand)."""
    edges = getattr(plan, "num_edges", None)
    return None if edges is None else passes * int(edges) * H * (D + Dv)


def _run(kernel, items, work, *args):
    """kernel(*args) on the threads `items` work items and `work` scalar operations keep busy."""
    return _threads.run(kernel, _threads.useful(items, work), *args)


def _products(acc, plan):
    """(own, why): whether the float32 block kernels multiply their tiles with cpu/microgemm.py's
    kernel (run option cpu_products; "auto": the machine's choice, microgemm.choice()) or the
    BLAS; float64 always the BLAS."""
    if acc != np.float32:
        return False, "BLAS (float64)"
    opts = getattr(plan, "options", None) or _run_options.current()
    which, why = _microgemm.choice(opts.cpu_products)
    return which == "own", why


def _kernel(key, build):
    """(kernel, where it came from: "memory hit" / "disk hit" / "compiled", read after the launch)."""
    kern = KERNELS.get(key, build)
    return kern, kernel_source(kern, KERNELS.last_was_hit)



def _ir(kernel):
    """{"llvm", "asm"} -> zero-arg callables returning the compiled kernel's text.

    numba cannot show the IR of a kernel loaded from its on-disk cache; in that case the
    kernel is recompiled once, uncached, just for inspection."""
    def stage(name):
        def text():
            sigs = kernel.signatures
            if not sigs:
                return ""
            sig = sigs[-1]

            def build():
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    res = _inspect(kernel, name, sig)
                if any("cached code" in str(w.message) for w in caught) or not res:
                    opts = {k: v for k, v in kernel.targetoptions.items() if k not in ("cache", "nopython")}
                    fresh = numba.njit(**opts)(kernel.py_func)
                    fresh.compile(sig)
                    res = _inspect(fresh, name, sig)
                return res
            # recompiling takes seconds: once per kernel and stage, kept while the kernel lives
            return KERNELS.derived(kernel, ("cpu.ir.text", name), build)
        return text
    return {"llvm": stage("llvm"), "asm": stage("asm")}


def _ir_of(kernel):
    """_ir(kernel), made once per kernel object."""
    return KERNELS.derived(kernel, "cpu.ir", lambda: _ir(kernel))


def _inspect(kernel, name, sig):
    return kernel.inspect_llvm(sig) if name == "llvm" else kernel.inspect_asm(sig)


def _pieces(owner, indptr):
    """Edge-balanced work items of a CSR pass (split.row_pieces), memoised per relation record
    and thread count (the items' order balances numba's static schedule over the threads)."""
    threads = _threads.current()
    return KERNELS.derived(owner, ("cpu.csr_pieces", _csr.RB, threads),
                           lambda: _split.row_pieces(indptr, _csr.RB, threads))


def _family(plan, relation):
    """The family the plan was made for; direct backend calls without a registry decision
    (tests of this module) name it by the relation record they pass."""
    return getattr(plan, "family", "") or ("cpu.blocks" if _is_blocks(relation) else "cpu.csr")


def _tiles_of(plan, prune):
    """(BM, BN, why) the plan was made with; direct backend calls with a bare plan (tests of
    this module) take the rule under the options in force."""
    tiles = getattr(plan, "tiles", ())
    return tiles if tiles else _tile_rule.choose(_run_options.current(), prune)


def _is_blocks(relation):
    return hasattr(relation, "dst_offsets")


# --------------------------------------------------------------------------- forward
def _modifier(score_mod, acc, grads, H, Nq, Nk, E, copies):
    """(generated functions, packed context) of a score modifier; (None, empty context)
    without one. Modified kernels take q scaled by `scale` alone (natural units)."""
    if score_mod is None:
        return None, _codegen.empty_context(acc)
    gen = _codegen.generated(score_mod.tree, score_mod.grad_leaves if grads else (), _name(acc))
    ctx = score_mod.pack(np, acc, H, Nq, Nk, E)
    if any(a.size for a in ctx[1:]):
        copies.append(f"score-modifier inputs -> packed {_name(acc)} (n, N, H) arrays")
    return gen, ctx


def _mod_key(gen):
    return None if gen is None else gen.key


def _index_bits(gen, num_rows, num_keys):
    """Width of the node indices a block kernel passes its score modifier (32 unless a relation
    is too large for it); without a modifier the kernels pass none (one variant)."""
    return 32 if gen is None else _blocks.index_width(num_rows, num_keys)


@serialised
def forward(plan, q, k, v, relation, edge_bias=None, score_mod=None):
    acc = acc_dtype_of(q.dtype)
    copies = []
    Nq, H, D = q.shape
    Hkv = k.shape[1]
    group = H // Hkv
    c = float(plan.scale) * (LOG2E if score_mod is None else 1.0)
    info = plan.run_info
    gen, mctx = _modifier(score_mod, acc, False, H, Nq, k.shape[0],
                          0 if _is_blocks(relation) else int(relation.indices.shape[0]), copies)
    if _family(plan, relation) == "cpu.decode":
        qn = node_major(q, acc, "q", copies, scale=c)
        kn = in_place(k, acc, "k", copies)   # any strides; a copy only to change dtype
        vn = in_place(v, acc, "v", copies)
        # the dispatcher is memoised under its key like every kernel: explain() reports memory
        # hit / disk hit / compiled, and the first compile is announced
        kern, hit = _kernel(("cpu", "decode.forward", _name(acc)), lambda: _decode.chunk_kernel)
        work = KERNELS.derived(relation, ("cpu.decode_items",), lambda: _decode.work_items(relation))
        out, m, l, n_items, n_pairs = _decode.forward(qn, kn, vn, relation, group, acc, kern, work)
        info.update(kernel="cpu.decode.forward (split-key: K / V read in place, chunks merged in "
                           "fixed order)",
                    tiles=f"{n_items} chunk(s) of <= {_decode.CHUNK} keys over {n_pairs} "
                          "block(s), every head of a key read together",
                    cache=hit, ir=_ir_of(kern))
    elif _family(plan, relation) == "cpu.blocks":
        if edge_bias is not None:
            raise NotImplementedError("edge_bias: the CPU block kernels take no per-edge bias "
                                      "(use a CSR relation)")
        prune = plan.prune_threshold is not None
        BM, BN, tiles_why = _tiles_of(plan, prune)
        log2_rho = math.log2(plan.prune_threshold) if prune else 0.0
        qh = head_major(q, acc, "q", copies, scale=c)
        own, products = _products(acc, plan)
        kh, kT, tile_base, ktt = _key_operands(k, acc, relation, own, copies, BM, BN)
        vh = head_major(v, acc, "v", copies)
        vpan = _row_panels(vh, own, "v", copies)
        # work items depend on the relation, the tiles and H only: built once per relation record
        items, splits, n_slots = KERNELS.derived(
            relation, ("cpu.forward_items", BM, BN, H, prune, _threads.current()),
            lambda: _forward_items(relation, H, BM, BN, split=not prune))   # order: per thread count
        bits = _index_bits(gen, Nq, k.shape[0])
        kern, hit = _kernel(("cpu", "blocks.forward", _name(acc), BM, BN, prune, own, bits, _mod_key(gen)),
                            lambda: _blocks.make_forward(acc.name, BM, BN, prune, gen, own, bits))
        if _blocks_cover(relation, Nq, "dst"):   # every row has its work item: written by the kernel
            out, m, l = (output_empty((Nq, H, v.shape[2]), acc), output_empty((Nq, H), acc),
                         output_empty((Nq, H), acc))
        else:
            out, m, l = (output_zeros((Nq, H, v.shape[2]), acc), output_empty((Nq, H), acc),
                         output_zeros((Nq, H), acc))
            m.fill(-np.inf)
        total = np.zeros(items.shape[0], np.int64)
        pruned = np.zeros(items.shape[0], np.int64)
        part_acc = np.empty((n_slots, BM, v.shape[2]), acc)
        part_m = np.empty((n_slots, BM), acc)
        part_l = np.empty((n_slots, BM), acc)
        with single_threaded_blas():
            _run(kern, items.shape[0], _work(plan, H, D, v.shape[2]), qh, ktt, kh, kT, vh, vpan,
                 _finite(relation, vh), items, relation.dst_offsets, relation.src_offsets, relation.lo,
                 relation.hi, tile_base, group, log2_rho, splits, part_acc, part_m, part_l, out, m, l,
                 total, pruned, mctx)
        split_note = (f"; {splits.shape[0]} query tile(s) split into {n_slots} key ranges, "
                      "merged in fixed order" if n_slots else "")
        info.update(kernel="cpu.blocks.forward (tiled online softmax)",
                    tiles=f"BM={BM} BN={BN} ({tiles_why}){split_note}", cache=hit,
                    ir=_ir_of(kern), products=products)
        if prune:
            info.update(pruned_tiles=int(pruned.sum()), total_tiles=int(total.sum()))
    else:
        qn = node_major(q, acc, "q", copies)   # the kernel scales each dot product by c
        kn = node_major(k, acc, "k", copies)
        vn = node_major(v, acc, "v", copies)
        bias = _bias(edge_bias, acc, H, copies)
        kern, hit = _kernel(("cpu", "csr.forward", _name(acc), _mod_key(gen)),
                            lambda: _csr.make_forward(acc.name, gen))
        items, splits, n_slots = _pieces(relation, relation.indptr)
        Dv = v.shape[2]
        out = output_empty((Nq, H, Dv), acc)
        m = output_empty((Nq, H), acc)
        l = output_empty((Nq, H), acc)
        part_acc = np.empty((n_slots, H, Dv), acc)
        part_m = np.empty((n_slots, H), acc)
        part_l = np.empty((n_slots, H), acc)
        _run(kern, items.shape[0], _work(plan, H, D, Dv), qn, kn, vn, relation.indptr, relation.indices, bias,
             group, acc.type(c), items, splits, part_acc, part_m, part_l, out, m, l, mctx)
        info.update(kernel="cpu.csr.forward (edge-balanced online softmax, long rows split "
                           "and merged)",
                    tiles=f"edge chunk={_csr.CH}; " + _split.describe(splits, n_slots, items.shape[0]),
                    cache=hit, ir=_ir_of(kern))
    info["copies"] = copies
    if out.dtype != q.dtype:
        out = out.astype(q.dtype)
    m2 = m  # the kernels wrote base-2 maxima (-inf for empty rows)
    m_nat = (m2 * LN2).astype(acc) if acc == np.float32 else m2 * LN2  # rounded once
    return out, m_nat, l, m2


def _ranges(sizes, step):
    """For blocks of the given sizes: (block id, start) of every step-sized tile, vectorised
    (segment relations can have many thousands of blocks)."""
    counts = (sizes + step - 1) // step
    n = int(counts.sum())
    blk = np.repeat(np.arange(sizes.shape[0], dtype=np.int64), counts)
    first = np.zeros(sizes.shape[0], np.int64)
    if sizes.shape[0] > 1:
        np.cumsum(counts[:-1], out=first[1:])
    starts = (np.arange(n, dtype=np.int64) - first[blk]) * step
    return blk, starts


# Key-range splitting of the forward: an item whose key tiles exceed twice the piece length is
# cut into pieces of about that length. The piece length follows the relation's total work (see
# split.py: never the thread count, so the bits do not depend on it).
MIN_PIECE_TILES = 16


def _forward_items(rel, H, BM, BN, split=True):
    """(head, block, query-tile start, first key tile, end key tile, slot) work items ordered
    so equal prange chunks balance, the split table (head, block, query-tile start, first slot,
    slots) and the number of slots."""
    nd = np.diff(np.asarray(rel.dst_offsets))
    ns = np.diff(np.asarray(rel.src_offsets))
    lo = np.asarray(rel.lo)
    hi = np.asarray(rel.hi)
    blk, starts = _ranges(nd, BM)
    none = np.zeros((0, 5), np.int64)
    if blk.shape[0] == 0:
        return np.zeros((0, 6), np.int64), none, 0
    rows = np.minimum(BM, nd[blk] - starts)
    kbeg = np.maximum(0, starts + lo[blk])
    kend = np.minimum(ns[blk], starts + rows - 1 + hi[blk] + 1)
    t0 = kbeg // BN
    t1 = np.where(kend > kbeg, (kend + BN - 1) // BN, t0)
    n = blk.shape[0]
    base = np.empty((H * n, 5), np.int64)
    base[:, 0] = np.repeat(np.arange(H, dtype=np.int64), n)
    base[:, 1] = np.tile(blk, H)
    base[:, 2] = np.tile(starts, H)
    base[:, 3] = np.tile(t0, H)
    base[:, 4] = np.tile(t1, H)
    tiles = base[:, 4] - base[:, 3]
    piece = max(MIN_PIECE_TILES, -(-int(tiles.sum()) // _split.TARGET_PIECES))
    cut = (tiles > 2 * piece) if split else np.zeros(tiles.shape[0], bool)
    whole = np.concatenate([base[~cut], np.full((int((~cut).sum()), 1), -1, np.int64)], axis=1)
    parts = [whole]
    splits = none
    n_slots = 0
    if cut.any():
        cb = base[cut]
        k = -(-(cb[:, 4] - cb[:, 3]) // piece)
        n_slots = int(k.sum())
        first = np.zeros(k.shape[0], np.int64)
        np.cumsum(k[:-1], out=first[1:])
        splits = np.concatenate([cb[:, :3], first[:, None], k[:, None]], axis=1)
        owner = np.repeat(np.arange(k.shape[0]), k)
        p = np.arange(n_slots) - first[owner]
        width = cb[owner, 4] - cb[owner, 3]
        pieces = np.empty((n_slots, 6), np.int64)
        pieces[:, :3] = cb[owner, :3]
        pieces[:, 3] = cb[owner, 3] + (width * p) // k[owner]
        pieces[:, 4] = cb[owner, 3] + (width * (p + 1)) // k[owner]
        pieces[:, 5] = np.arange(n_slots)
        parts.append(pieces)
    items = np.concatenate(parts)
    costs = items[:, 4] - items[:, 3] + 1  # + 1: the per-item fixed work
    return items[order_balanced(costs, _threads.current())], splits, n_slots


# Blocks with at most BN / PACK_MIN_FRACTION keys are not packed into (D, BN) tiles: their score
# gemm reads the K rows in place. Packing pads every block to whole BN-wide tiles, which for many
# short segments would cost segments x D x BN memory instead of O(N D). Blocks with at most BM
# query rows are not packed either: each of their key tiles is read by one query tile only, so
# the copy would cost as much as the reads it speeds up (decode: one query row over 131,072 keys
# spent more time packing K than attending). Nor are blocks whose band spans at most one key tile
# per query tile (hi - lo + BM <= BN: the forward's span tiles over a narrow band, tiles.py): a
# packed tile must start at a multiple of BN, so a query tile's band would straddle two of them,
# while a tile read in place starts where the band does (blocks.py); each K row is read by a few
# query tiles only.
PACK_MIN_FRACTION = 4


def _tiles(rel, BM, BN):
    """Packed key tiles of the blocks wider than BN / PACK_MIN_FRACTION keys, taller than BM
    query rows and with a band wider than one key tile per query tile: (tile_base per block, -1
    for blocks read in place; start and width of every tile)."""
    ns = np.diff(np.asarray(rel.src_offsets))
    nd = np.diff(np.asarray(rel.dst_offsets))
    spans = np.asarray(rel.hi, np.int64) - np.asarray(rel.lo, np.int64) + BM
    packed = (ns > BN // PACK_MIN_FRACTION) & (nd > BM) & (spans > BN)
    counts = np.where(packed, (ns + BN - 1) // BN, 0)
    tile_base = np.zeros(ns.shape[0], np.int64)
    if ns.shape[0] > 1:
        np.cumsum(counts[:-1], out=tile_base[1:])
    tile_base = np.where(packed, tile_base, -1)
    nt = int(counts.sum())
    first = np.repeat(np.where(packed, tile_base, 0), counts)
    starts = np.repeat(np.asarray(rel.src_offsets[:-1], np.int64), counts) \
        + (np.arange(nt, dtype=np.int64) - first) * BN
    ends = np.repeat(np.asarray(rel.src_offsets[1:], np.int64), counts)
    return tile_base, starts, np.minimum(BN, ends - starts)


def _pack(xh, rel, name, copies, BM, BN, own=False):
    """(tile_base, packed transposed tiles of xh): (H, tiles, D, BN) rows, or with the own tile
    products and BN whole panels (H, tiles BN / NR, D, NR) column panels (blocks.make_forward)."""
    tile_base, starts, cols = KERNELS.derived(rel, ("cpu.key_tiles", BM, BN),
                                              lambda: _tiles(rel, BM, BN))
    W = _microgemm.NR
    panels = _microgemm.panel_tiles(own, BN)
    shape = (xh.shape[0], starts.shape[0] * (BN // W), xh.shape[2], W) if panels \
        else (xh.shape[0], starts.shape[0], xh.shape[2], BN)
    out = np.empty(shape, xh.dtype)
    if starts.shape[0]:
        _run(_blocks.pack_transposed_tiles, xh.shape[0] * starts.shape[0], out.size, xh, starts, cols, BN, out)
        copies.append(f"{name} -> transposed ({xh.shape[2]}, BN={BN}) tiles"
                      + (f" in {W}-column panels (own tile products)" if panels else " (fast BLAS operand)"))
    return tile_base, out


def _row_panels(xh, own, name, copies):
    """xh (H, N, D) as (H, D / NR, N, NR) column panels when the own tile products take rows of
    it as a product's B operand and D is whole panels; else an empty array (the kernels then read
    xh itself)."""
    W = _microgemm.NR
    H, N, Dd = xh.shape
    if not own or Dd == 0 or Dd % W:
        return np.empty((0, 0, 0, 0), xh.dtype)
    out = np.empty((H, Dd // W, N, W), xh.dtype)
    _run(_blocks.pack_row_panels, H * N, out.size, xh, out)
    copies.append(f"{name} -> ({H}, {Dd // W}, N, {W}) column panels (own tile products)")
    return out


def _key_operands(k, acc, rel, own, copies, BM, BN):
    """The forward's K operands: (kh (Hkv, Nk, D) head-major, kT, tile_base, packed tiles).
    Packed blocks read the packed transposed tiles (made from kh). Unpacked blocks (narrow bands,
    short segments) read K^T (key_transpose) when the own tile products run: their score products
    then take the own kernel, as the backward's do; kh is then made only if some block is packed
    (K^T comes straight from k). Without the own products unpacked blocks read kh rows as the
    BLAS's transposed operand and kT is empty."""
    tile_base, starts, _ = KERNELS.derived(rel, ("cpu.key_tiles", BM, BN), lambda: _tiles(rel, BM, BN))
    empty = np.empty((0, 0, 0), acc)
    want_kT = _reads_kT(own, tile_base)
    direct = want_kT and starts.shape[0] == 0 and k.dtype == acc   # no packed tile: no head-major copy
    kh = empty if direct else head_major(k, acc, "k", copies)
    tile_base, ktt = _pack(kh, rel, "k", copies, BM, BN, own)
    if not want_kT:
        return kh, empty, tile_base, ktt
    return kh, key_transpose(k.transpose(1, 0, 2) if direct else kh, acc, copies), tile_base, ktt


def _reads_kT(own, tile_base):
    """whether the block kernels read K^T: the own tile products run and some block is unpacked
    (the forward and the backward decide alike, so both build each score with one product)."""
    return own and bool(np.any(tile_base < 0))


def key_transpose(kh, acc, copies):
    """K^T (Hkv, D, Nk + NR) of unpacked blocks' score products, forward and backward alike: the
    own product covers whole column blocks of NR, so a tile may read up to NR - 1 columns past
    the last key (zeros; those columns are computed and not used). The forward and the backward
    must build each score with the same product: the backward rebuilds P = exp2(S - m2) / l from
    the forward's stats, and at large scores (|s| ~ 1e4 and up) an ulp of s is a visible change
    of P (dv 1e-2 off at |s| = 5e4 on an AVX2 box when the backward took the BLAS here)."""
    copies.append(f"k -> (Hkv, D, N + {_microgemm.NR}) {_name(acc)} (K^T: unpacked key tiles' score "
                  "products; zero columns past the last key)")
    return transposed_heads(kh, pad=_microgemm.NR)


def _blocks_cover(rel, n, side):
    """whether the relation's blocks tile [0, n) on `side` ("dst" / "src") without gaps, so that
    the block kernels write every row of that side (a query tile of every block with rows is a
    work item; on the source side, every block with keys must also have rows). Memoised."""
    def compute():
        off = np.asarray(rel.dst_offsets if side == "dst" else rel.src_offsets, np.int64)
        sizes = np.diff(off)
        ok = bool(off.shape[0] > 0 and off[0] == 0 and off[-1] == n and np.all(sizes >= 0))
        if side == "src":
            ok = ok and not np.any((sizes > 0) & (np.diff(np.asarray(rel.dst_offsets, np.int64)) == 0))
        return ok
    return KERNELS.derived(rel, ("cpu.blocks_cover", side, n), compute)


def _finite(relation, *arrays):
    """whether every element of the kernels' operands is finite: then a tile the band cuts may
    take its products as one gemm, its masked cells being exact zeros (blocks.py). Asked only of
    relations with a causal or banded block (a full block's tiles are never cut: the answer would
    go unread)."""
    cut = KERNELS.derived(relation, ("cpu.cut_tiles",),
                          lambda: not relation.standard or bool(np.any(np.asarray(relation.causal))))
    return cut and all(all_finite(x) for x in arrays)


def _bias(edge_bias, acc, H, copies):
    if edge_bias is None:
        return np.zeros((0, H), acc)
    b = np.asarray(edge_bias)
    if b.dtype != acc or not b.flags.c_contiguous:
        copies.append(f"edge_bias -> contiguous {_name(acc)}")
        b = np.ascontiguousarray(b, dtype=acc)
    if not np.isfinite(b).all():  # -inf masks an edge: the kernels' finite NEG does the same
        b = np.maximum(b, acc.type(_blocks.NEG))
    return b


# --------------------------------------------------------------------------- backward
@serialised
def backward(plan, dout, q, k, v, out, m, l, relation, transpose, edge_bias=None,
             m_kernel=None, score_mod=None):
    if plan.prune_threshold is not None:  # dispatch refuses this first; fail closed anyway
        raise NotImplementedError("block_prune_threshold: the backward of a pruned forward "
                                  "is not implemented")
    acc = acc_dtype_of(q.dtype)
    copies = []
    Nq, H, D = q.shape
    Nk, Hkv, _ = k.shape
    Dv = v.shape[2]
    group = H // Hkv
    scale = float(plan.scale)
    c = scale * (LOG2E if score_mod is None else 1.0)
    info = plan.run_info
    E = 0 if _is_blocks(relation) else int(relation.indices.shape[0])
    gen, mctx = _modifier(score_mod, acc, True, H, Nq, Nk, E, copies)
    if gen is None:  # no modifier: the kernels' gradient buffers are empty stand-ins
        n_hp = n_nd = n_ns = 0
        _, ghp, gnd, gns, gef = mctx
    else:
        lay = gen.layout
        n_hp, n_nd, n_ns = len(lay.heads), len(lay.dst), len(lay.src)
        ghp = np.zeros((n_hp, H), acc)
        gnd = np.zeros((n_nd, Nq, H), acc)
        gns = np.zeros((n_ns, Nk, H), acc)
        gef = np.zeros((len(lay.edges), E, H), acc)
    m = np.asarray(m, acc)
    l = np.asarray(l, acc)
    # Delta_i = sum(dO_i * O_i), per (row, head), in the accumulation dtype: O(N H D) work
    delta = np.empty((Nq, H), acc)
    _threads.run(_blocks.row_dots, _threads.useful(work=delta.size * Dv), np.asarray(dout, acc),
                 np.asarray(out, acc), delta)
    # 1 / l; 0 for an empty row (l = 0: p = 0); NaN where the forward's l is NaN (a NaN or inf
    # score inside the row): its probabilities are NaN, and so are their gradients' shares
    with np.errstate(divide="ignore"):
        linv = np.where(l > 0, 1.0 / np.where(l > 0, l, 1), np.where(np.isnan(l), np.nan, 0)).astype(acc)
    # base-2 maxima for the kernels: the forward's own when given (exact), else converted from
    # m; -inf (empty rows) -> the kernels' finite NEG sentinel
    m2 = np.asarray(m_kernel, acc) if m_kernel is not None else m * acc.type(LOG2E)
    m2 = np.where(np.isfinite(m2), m2, acc.type(_blocks.NEG)).astype(acc)
    dbias = None
    if _family(plan, relation) == "cpu.decode":
        qn = node_major(q, acc, "q", copies, scale=c)   # the forward's pre-scaled q, bit for bit
        qu = node_major(q, acc, "q (unscaled, for dk)", copies)
        kn = in_place(k, acc, "k", copies)
        vn = in_place(v, acc, "v", copies)
        don = in_place(np.asarray(dout), acc, "dout", copies)
        kern, hit = _kernel(("cpu", "decode.backward", _name(acc)), lambda: _decode.backward_kernel)
        work = KERNELS.derived(relation, ("cpu.decode_items",), lambda: _decode.work_items(relation))
        dq, dk, dv, n_items, n_pairs = _decode.backward(qn, kn, vn, don, qu, m2, linv, delta,
                                                        relation, group, acc, scale, kern, work)
        info.update(kernel="cpu.decode.backward (split-key: scores recomputed as the forward's, "
                           "dk / dv per key, dq partials merged in fixed order)",
                    tiles=f"{n_items} chunk(s) of <= {_decode.CHUNK} keys over {n_pairs} block(s)",
                    cache=hit, ir=_ir_of(kern))
    elif _family(plan, relation) == "cpu.blocks":
        if edge_bias is not None:
            raise NotImplementedError("edge_bias: the CPU block kernels take no per-edge bias "
                                      "(use a CSR relation)")
        qh = head_major(q, acc, "q", copies, scale=c)
        kh = head_major(k, acc, "k", copies)
        vh = head_major(v, acc, "v", copies)
        doh = head_major(dout, acc, "dout", copies)
        BM, BN, tiles_why = _tiles_of(plan, False)
        own, products = _products(acc, plan)
        tile_base, ktt = _pack(kh, relation, "k", copies, BM, BN, own)
        _, vtt = _pack(vh, relation, "v", copies, BM, BN, own)
        pans = (_row_panels(qh, own, "q", copies), _row_panels(kh, own, "k", copies),
                _row_panels(doh, own, "dout", copies))
        m2h = np.ascontiguousarray(m2.T)
        linvh = np.ascontiguousarray(linv.T)
        deltah = np.ascontiguousarray(delta.T)
        kitems, boxes, n_parts = KERNELS.derived(relation, ("cpu.backward_items", BM, BN, Hkv, group),
                                          lambda: _dealt_backward_items(relation, Hkv, group, BM, BN))
        kT = key_transpose(kh, acc, copies) if _reads_kT(own, tile_base) else np.empty((0, 0, 0), acc)
        bits = _index_bits(gen, Nq, Nk)
        kern, hit = _kernel(("cpu", "blocks.backward", _name(acc), BM, BN, own, bits, _mod_key(gen)),
                            lambda: _blocks.make_backward(acc.name, BM, BN, gen, own, bits))
        dq_part = np.empty((n_parts, H, Nq, D), acc)   # each partition zeroes its box in the kernel
        fill = output_empty if _blocks_cover(relation, Nk, "src") else output_zeros
        dkh = fill((Hkv, Nk, D), acc)
        dvh = fill((Hkv, Nk, Dv), acc)
        # modifier gradients: per-head params and dst fields per dq partition (summed in
        # partition order below), src fields owned by their key tile's item
        ghp_part = np.zeros((n_parts, n_hp, H), acc)
        gnd_part = np.zeros((n_parts, n_nd, Nq if n_nd else 0, H), acc)
        with single_threaded_blas():
            _run(kern, n_parts, _work(plan, H, D, Dv, 2), qh, kh, vh, ktt, vtt, kT, pans, doh,
                 _finite(relation, qh, kh, doh), m2h, linvh, deltah, kitems, relation.dst_offsets,
                 relation.src_offsets, relation.lo, relation.hi, tile_base, group, n_parts, boxes, dq_part,
                 dkh, dvh, mctx, (ghp_part, gnd_part, gns))
        if n_hp:
            np.sum(ghp_part, axis=0, out=ghp)
        if n_nd:
            np.sum(gnd_part, axis=0, out=gnd)
        dq = output_empty((Nq, H, D), acc)
        _run(_blocks.reduce_dq, Nq, dq_part.size, dq_part, boxes, acc.type(scale), dq)
        dk = dkh.transpose(1, 0, 2)
        dv = dvh.transpose(1, 0, 2)
        copies.append(f"dq partials: {n_parts} x (H, Nq, D) {_name(acc)} (one per partition, "
                      "summed in order)")
        info.update(kernel="cpu.blocks.backward (fused, key-tile parallel)",
                    tiles=f"BM={BM} BN={BN} ({tiles_why})", cache=hit, ir=_ir_of(kern),
                    products=products)
    else:
        qn = node_major(q, acc, "q", copies)   # the kernels scale each dot product by c
        kn = node_major(k, acc, "k", copies)
        vn = node_major(v, acc, "v", copies)
        don = node_major(dout, acc, "dout", copies)
        bias = _bias(edge_bias, acc, H, copies)
        k_dst, k_src = None, None
        (k_dst, k_src), hit = _kernel(("cpu", "csr.backward", _name(acc), _mod_key(gen)),
                                      lambda: _csr.make_backward(acc.name, gen))
        dq = output_empty((Nq, H, D), acc)
        E = int(relation.indices.shape[0])
        dbias = np.empty((E, H), acc) if edge_bias is not None else np.zeros((0, H), acc)
        items, splits, n_slots = _pieces(relation, relation.indptr)
        part_dq = np.empty((n_slots, H, D), acc)
        ghp_items = np.zeros((items.shape[0], n_hp, H), acc)
        part_gnd = np.zeros((n_slots, n_nd, H), acc)
        _run(k_dst, items.shape[0], _work(plan, H, D, Dv), qn, kn, vn, don, m2, linv, delta, relation.indptr,
             relation.indices, bias, group, acc.type(c), acc.type(scale), items, splits, part_dq, dq, dbias,
             mctx, (ghp_items, gnd, part_gnd, gef))
        if n_hp:
            # per work item, summed in the items' row order (their array order follows the thread
            # count, the sum must not)
            np.sum(ghp_items[np.lexsort((items[:, 2], items[:, 0]))], axis=0, out=ghp)
        dk = output_empty((Nk, Hkv, D), acc)
        dv = output_empty((Nk, Hkv, Dv), acc)
        t_items, t_splits, t_slots = _pieces(transpose, transpose.indptr)
        part_dk = np.empty((t_slots, Hkv, D), acc)
        part_dv = np.empty((t_slots, Hkv, Dv), acc)
        part_gns = np.zeros((t_slots, n_ns, H), acc)
        _run(k_src, t_items.shape[0], _work(plan, H, D, Dv), qn, kn, vn, don, m2, linv, delta, transpose.indptr,
             transpose.indices, transpose.perm, bias, group, acc.type(c), acc.type(scale), t_items, t_splits, part_dk,
             part_dv, dk, dv, mctx, (gns, part_gns))
        if edge_bias is None:
            dbias = None
        info.update(kernel="cpu.csr.backward (dq by destination rows, dk/dv by source rows "
                           "over the transpose, long rows split and summed in order)",
                    tiles="dq: " + _split.describe(splits, n_slots, items.shape[0]) + "; dk/dv: "
                    + _split.describe(t_splits, t_slots, t_items.shape[0]), cache=hit,
                    ir=_ir_of(k_src))
    info["copies"] = copies
    dt = q.dtype
    res = (contiguous(dq, dt), contiguous(dk, dt), contiguous(dv, dt), dbias)
    if score_mod is None:
        return res
    return res + (score_mod.grads_to_user((ghp, gnd, gns, gef)),)


def _backward_items(rel, Hkv, group, BM, BN, rows=False):
    """(kv head, block, key-tile start) work items and their costs (query tiles visited); with
    `rows`, also each item's global query rows [first, last) (those that reach its key tile)."""
    nd = np.diff(np.asarray(rel.dst_offsets))
    ns = np.diff(np.asarray(rel.src_offsets))
    lo = np.asarray(rel.lo)
    hi = np.asarray(rel.hi)
    blk, starts = _ranges(np.where(nd > 0, ns, 0), BN)
    if blk.shape[0] == 0:
        none = np.zeros(0, np.int64)
        return (np.zeros((0, 3), np.int64), none) + ((none, none) if rows else ())
    cols = np.minimum(BN, ns[blk] - starts)
    qbeg = np.maximum(0, starts - hi[blk])
    qend = np.minimum(nd[blk], starts + cols - lo[blk])
    q_tiles = np.where(qend > qbeg, (qend + BM - 1) // BM - qbeg // BM, 0)
    costs = (q_tiles + 1) * group
    n = blk.shape[0]
    items = np.empty((Hkv * n, 3), np.int64)
    items[:, 0] = np.repeat(np.arange(Hkv, dtype=np.int64), n)
    items[:, 1] = np.tile(blk, Hkv)
    items[:, 2] = np.tile(starts, Hkv)
    if not rows:
        return items, np.tile(costs, Hkv)
    d0 = np.asarray(rel.dst_offsets, np.int64)[blk]
    return items, np.tile(costs, Hkv), np.tile(d0 + qbeg, Hkv), np.tile(d0 + np.maximum(qend, qbeg), Hkv)


def _dealt_backward_items(rel, Hkv, group, BM, BN):
    """(work items dealt over the dq partitions, number of partitions, each partition's dq box)."""
    kitems, costs, first, last = _backward_items(rel, Hkv, group, BM, BN, rows=True)
    n_parts = max(1, min(N_PARTS, kitems.shape[0]))
    return _deal(kitems, costs, first, last, n_parts, group) + (n_parts,)


def _deal(items, costs, first, last, n_parts, group):
    """Give each partition a contiguous run of the items (in their (kv head, block, key tile)
    order) of about equal total cost, laid out for the kernel's round-robin (slot w -> partition
    w % n_parts; unused slots hold -1, skipped), and the box of dq each partition writes:
    (query head from, to, row from, to). Contiguous runs keep a partition to few heads and,
    on banded relations, to the rows near its keys, so the kernel zeroes and the reduction
    reads only the boxes, not n_parts whole copies of dq. Items and costs depend on the problem
    only, so the split (and the summation order of dq) does not depend on the thread count."""
    n = items.shape[0]
    boxes = np.zeros((n_parts, 4), np.int64)
    if n == 0:
        return items, boxes
    cum = np.cumsum(costs)
    cuts = np.searchsorted(cum, cum[-1] * np.arange(1, n_parts) / n_parts, side="left")
    bounds = np.concatenate([[0], np.minimum(cuts + 1, n), [n]])
    bounds = np.maximum.accumulate(bounds)
    width = int(np.max(np.diff(bounds))) if n else 0
    out = np.full((max(width, 1) * n_parts, 3), -1, np.int64)
    for p in range(n_parts):
        a, b = int(bounds[p]), int(bounds[p + 1])
        if b <= a:
            continue
        out[p + n_parts * np.arange(b - a)] = items[a:b]
        live = last[a:b] > first[a:b]
        if live.any():
            boxes[p] = (items[a:b, 0].min() * group, (items[a:b, 0].max() + 1) * group,
                        first[a:b][live].min(), last[a:b][live].max())
    return out, boxes
