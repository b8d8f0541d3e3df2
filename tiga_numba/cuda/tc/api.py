"""Tensor-core attention entry points for the CUDA backend (docs/INTERNALS.md contract).

The other jobs live beside this module: tuning.py (the shipped tile shapes), admission.py
(`supports`), device.py (device and stream), build.py (compiled kernels and the cubin cache),
generator/ (the kernel texts).

supports(plan, q, k, v, relation) -> bool      this path can run the request exactly
forward(plan, q, k, v, relation, edge_bias=None) -> (out, m, l, m_kernel)
backward(plan, dout, q, k, v, out, m, l, relation, transpose, edge_bias=None, m_kernel=None)
    -> (dq, dk, dv, None)

m_kernel is the row max in the kernels' base-2 units (scores times scale log2(e)), float32,
exactly as the forward's softmax used it. The backward's P = exp2((s sc - m2) - log2 l) reads
m2 = m_kernel and log2 l as two floats (the Delta pre-pass writes the pair): from m log2(e)
rounded back from the natural-log m, the one-ulp error would become a factor of up to 2^ulp(m)
on P at large scores, and one float32 lse2 = m2 + log2 l would round away the forward's own
rounding error of m2 that l carries (generator/backward.py gen_delta). Stats without m_kernel
(built by hand, or from a CUDA-core forward) are converted: m log2(e) in float32.

Scope: BlockRelation (dense rectangular, triangular, segments / cu_seqlens, bands: sliding
windows, bottom-right causal rectangular blocks; cat of those; schedule.py's work rows carry each
tile's band, so only key blocks inside it are visited and only its edge blocks are masked),
float16, bfloat16 and float32 inputs, head dims 64 and 128 with Dv == D (on compute capability
9.0, the wgmma kernels: also 32 and 96), any H % Hkv == 0, any
strides (16-byte aligned rows are read in place, anything else is copied once and the copy
recorded), no edge bias (the CUDA-core kernels take that); tile pruning in the forward.
Kernels take raw device addresses and scalars only, so a bfloat16 array needs no numba dtype:
anything with __cuda_array_interface__ whose dtype is named "bfloat16" (ml_dtypes) works.

Accuracy policy. float16 / bfloat16: operands in their own precision, products and the softmax
in float32. float32: fp32-class results, never plain TF32 or bf16. On compute capability 9.0
every product runs on wgmma with each operand split into three bfloat16 parts (x = hi + mid + lo
to ~2^-24, six part products per product, smallest first); elsewhere (or TIGA_NUMBA_WGMMA=0) as
3xTF32 on mma.m16n8k8.tf32 (x = big + small, both tf32 by cvt.rna; C += a_big b_small + a_small
b_big + a_big b_big). Both accumulate in fp32 and sum the P.B products per streamed block in
fresh tiles added in ordinary fp32, because the tensor cores' accumulation truncates. Relative
error against a float64 oracle on the emulator: ~3e-7 (bf16 x 3) and ~1e-6 (3xTF32) forward, a few
times that for gradients; tests hold both to the CUDA-core float32 tolerances, which plain TF32
(~5e-4) and plain bf16 fail. m and l are float32 as the contract says; ex2.approx (2 ulp) is the
only other approximation, but for a score modifier's tanh in the 16-bit kernels: the hardware
tanh.approx.f32, as flash-attn's soft-cap (generator/modifier.py: TANH; float32 kernels take an
ex2 / rcp tanh good to ~2e-7). run_info["precision"] says which ran.
TIGA_NUMBA_FP32_TENSOR_CORES=0 keeps float32 on the CUDA-core kernels (plain fp32 FMA), e.g. to
reproduce earlier bits; it is read on every call.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ... import score_mod as sm
from ...arrays import _is_cupy_ndarray
from ...kernel_cache import KERNELS
from ...plan import defer_counts
from . import generator as G
from . import schedule, tuning
from .admission import _dtype_name, supports
from .build import delta_kernel, kernel
from .device import current_device, current_stream, use_wgmma
from .tuning import _engine, backward_variants, deterministic, precision, variant

__all__ = ["supports", "forward", "backward", "launch_forward", "launch_backward", "relation_record"]


# ----------------------------------------------------------------------------- operands
def _cai(x):
    return x.__cuda_array_interface__


def _operand(x, name, copies):
    """(array, address, row stride, head stride) in bytes, reading x in place when every row of
    every head starts on a 16-byte boundary with unit element stride; else one contiguous copy."""
    if _is_cupy_ndarray(x):   # its own attributes: no interface dict built per call
        ptr, shape, item, strides = x.data.ptr, x.shape, x.itemsize, x.strides
    else:
        cai = _cai(x)
        ptr = int(cai["data"][0])
        shape = tuple(cai["shape"])
        item = int(np.dtype(cai["typestr"]).itemsize)
        strides = cai.get("strides") or (shape[1] * shape[2] * item, shape[2] * item, item)
    ok = (strides[2] == item or shape[2] <= 1) and ptr % 16 == 0 and strides[0] % 16 == 0 \
        and strides[1] % 16 == 0 and strides[0] >= 0 and strides[1] >= 0
    if not ok:
        import cupy
        x = cupy.ascontiguousarray(x)
        copies.append(f"{name}: copied to a contiguous array (strides {tuple(strides)} bytes, "
                      f"address % 16 = {ptr % 16}): tensor-core tiles load 16-byte row chunks")
        cai = _cai(x)
        ptr = int(cai["data"][0])
        strides = cai.get("strides") or (shape[1] * shape[2] * item, shape[2] * item, item)
    return x, ptr, int(strides[0]), int(strides[1])


def _ptr(x):
    return int(_cai(x)["data"][0])


# ----------------------------------------------------------------------------- schedules (cached)
def _host_relation(relation):
    """the relation's offsets on the host and its per-tile-shape schedules, made once per relation
    object (KERNELS.derived: kept while the relation lives, dropped with it)."""
    return KERNELS.derived(relation, "tc-relation", lambda: _host_record(relation))


def _host_record(relation):
    def host(a):
        return a.get() if hasattr(a, "get") else np.asarray(a)
    return dict(dst=host(relation.dst_offsets).astype(np.int64), src=host(relation.src_offsets).astype(np.int64),
                causal=host(relation.causal).astype(np.uint8), lo=host(relation.lo).astype(np.int64),
                hi=host(relation.hi).astype(np.int64), standard=bool(relation.standard), tables={})


def _work(rec, which, BM):
    import cupy
    key = (which, BM)
    t = rec["tables"].get(key)
    if t is None:
        f = schedule.query_tiles if which == "q" else schedule.key_tiles
        host = f(rec["dst"], rec["src"], rec["causal"], BM, rec["lo"], rec["hi"])
        t = rec["tables"][key] = (cupy.asarray(host), len(host))
    return t


def _band_keys(rec):
    """keys per row of a banded relation's widest band (hi - lo + 1 over its non-empty blocks; 0
    when every block is empty); None for full / causal blocks (tuning.narrow keeps their shape:
    what it was measured on is a sliding window). Memoised on the relation record."""
    if rec["standard"]:
        return None
    hit = rec["tables"].get("band_keys")
    if hit is None:
        width = rec["hi"] - rec["lo"] + 1
        hit = rec["tables"]["band_keys"] = int(width.max(initial=0))
    return hit


def _covers(rec, which, n):
    """True when the relation's blocks tile [0, n) of `which` ("dst"/"src") without gaps, so every
    output row is written by a kernel (no zero-fill needed); memoised on the relation record."""
    key = ("covers", which, n)
    hit = rec["tables"].get(key)
    if hit is None:
        offsets = rec[which]
        hit = rec["tables"][key] = bool(len(offsets) > 0 and offsets[0] == 0 and offsets[-1] == n
                                        and np.all(np.diff(offsets) >= 0))
    return hit


# ----------------------------------------------------------------------------- raw launches
def relation_record(dst_offsets, src_offsets, causal, lo=None, hi=None):
    """host-side relation (numpy offsets; lo / hi: the blocks' bands as BlockRelation holds them,
    else full or square-causal blocks) for launch_forward / launch_backward callers."""
    lo_b, hi_b = schedule.block_bands(dst_offsets, src_offsets, causal, lo, hi)
    return dict(dst=np.asarray(dst_offsets, np.int64), src=np.asarray(src_offsets, np.int64),
                causal=np.asarray(causal, np.uint8), lo=lo_b, hi=hi_b, standard=lo is None and hi is None,
                tables={})


def launch_forward(vr, rec, H, Hkv, q, k, v, outp, mp, lp, scale, stream=None, rho=None, mkp=0, mod=()):
    """Launch the forward on raw operands: q, k, v = (address, row stride, head stride) in bytes;
    out (num_dst, H, Dv) contiguous, m, l (num_dst, H) float32 contiguous; mkp, when not 0, the
    address of a (num_dst, H) float32 array that receives m in the kernel's base-2 units (what
    the backward reads, see the module text). Returns (kernel, cache,
    tile counts): vr.prune (admission threshold `rho`) also returns the device array of per-CTA
    (pruned, visited) tile counts, else None. vr.mod: `mod` holds the device addresses of the
    modifier's packed values (mv, mnd, mns: cuda/score_codegen.pack)."""
    launch = _ForwardLaunch(rec, vr)
    counts = _run_forward(launch, H, Hkv, q, k, v, outp, mp, lp, mkp, scale, stream, rho, mod)
    return launch.kern, launch.cache, counts


class _Launch:
    """A launch record's bookkeeping: explain()'s words for its calls (`info`), the kernel-cache
    outcome of the call that made it (`cache`), how many calls it served (`uses`) and the
    tuning-table entries it was made from (`entries`, see _launch_memo)."""

    __slots__ = ("info", "cache", "uses", "entries")

    def __init__(self):
        self.info, self.cache, self.uses, self.entries = {}, "hit", 0, None

    def record(self, plan, copies):
        """This call's run_info: the record's words, the call's copies, and where its kernels
        came from (the call that made the record: its kernel-cache outcome; later ones: hits)."""
        info = getattr(plan, "run_info", None)
        if info is not None:
            info.update(self.info)
            info["copies"] = copies
            info["cache"] = self.cache if self.uses == 1 else "hit"


class _ForwardLaunch(_Launch):
    """What launching forward variant `vr` over relation record `rec` needs besides the call's
    arrays: the kernel, the query-tile schedule and its tile counts. `forward` keeps one per call
    shape (see _launch_memo), so a repeated call only reads its operands, allocates and launches."""

    __slots__ = ("vr", "kern", "W", "workp", "visited", "total")

    def __init__(self, rec, vr):
        super().__init__()
        self.vr = vr
        self.kern, self.cache = kernel(vr)
        work, self.W = _work(rec, "q", vr.BM)
        self.workp = _ptr(work)
        key = ("counts", vr.BM, vr.BN)
        if key not in rec["tables"]:
            rec["tables"][key] = schedule.tile_counts(rec["dst"], rec["src"], rec["causal"], vr.BM, vr.BN,
                                                       rec["lo"], rec["hi"])
        self.visited, self.total = rec["tables"][key]


def _run_forward(launch, H, Hkv, q, k, v, outp, mp, lp, mkp, scale, stream=None, rho=None, mod=()):
    """Launch a _ForwardLaunch (arguments as launch_forward); returns the pruned forward's
    per-CTA tile counts (a device array) or None."""
    vr, W = launch.vr, launch.W
    counts = None
    if W and H:
        args = (q[0], k[0], v[0], outp, mp, lp, mkp, launch.workp, q[1], q[2], k[1], k[2], v[1], v[2],
                H * vr.Dv * vr.GB, H // Hkv)
        if vr.prune:
            import cupy
            counts = cupy.empty((W * H, 2), cupy.int32)   # every CTA writes its slot (the emulator poisons it)
            args += (counts.data.ptr, scale * G.LOG2E, -math.inf, math.log2(rho))
        else:
            args += (_score_units(vr, scale), -math.inf) + _mod_args(vr, scale, H, mod)
        launch.kern((W, H), (vr.NT,), stream or current_stream(), *args)
    return counts


def _score_units(v, scale):
    """`sc`, what the kernels multiply a cell by before exp2: scale log2(e), or 1 where a score
    modifier has already made the cell f(scale s) log2(e) (generator/modifier.py)."""
    return 1.0 if v.mod is not None else scale * G.LOG2E


def _mod_args(v, scale, H, mod):
    """the trailing arguments of a modified kernel (generator/modifier.ARGS)."""
    return () if v.mod is None else (scale, H) + tuple(mod)


def launch_backward(vq, vk, rec, nd, H, Hkv, q, k, v, do, o, mp, lp, deltap, lse2p, dqp, dkp, dvp, scale,
                    stream=None, mod=()):
    """Delta pre-pass, then dQ and dK/dV on raw operands ((address, row stride, head stride) tuples;
    outputs contiguous; mp: the row max in the kernels' base-2 units (m_kernel); float32 scratch:
    delta (num_dst, H), lse2 (num_dst, H, 2) for the (m2, log2 l) pairs): two kernels, or one when
    vk.fuse_dq (vq is None then; dQ rows no key tile visits are left as they are: zero them).
    Returns (the main kernel, the kernels' cache state)."""
    launch = _BackwardLaunch(rec, vq, vk)
    _run_backward(launch, nd, H, Hkv, q, k, v, do, o, mp, lp, deltap, lse2p, dqp, dkp, dvp, scale, stream, mod)
    return launch.main, launch.cache


class _BackwardLaunch(_Launch):
    """What launching the backward variants (vq, vk) over relation record `rec` needs besides
    the call's arrays: the Delta, dQ and dK/dV kernels and their tile schedules. `backward` keeps
    one per call shape (see _launch_memo)."""

    __slots__ = ("vq", "vk", "kd", "kq", "kk", "main", "Wq", "workq", "Wk", "workk")

    def __init__(self, rec, vq, vk):
        super().__init__()
        schedule.check_ordered_fused(vk, rec.get("standard", True))
        self.vq, self.vk = vq, vk
        self.kd = delta_kernel(vk.dtype, vk.Dv)
        states = []
        self.kq = self.Wq = self.workq = None
        if vq is not None:
            self.kq, c = kernel(vq)
            states.append(c)
            work, self.Wq = _work(rec, "q", vq.BM)
            self.workq = _ptr(work)
        self.kk, c = kernel(vk)
        states.append(c)
        work, self.Wk = _work(rec, "k", vk.BM)
        self.workk = _ptr(work)
        self.main = self.kk if vq is None else self.kq
        self.cache = "hit" if all(x == "hit" for x in states) else "miss"


def _run_backward(launch, nd, H, Hkv, q, k, v, do, o, mp, lp, deltap, lse2p, dqp, dkp, dvp, scale,
                  stream=None, mod=()):
    """Launch a _BackwardLaunch (arguments as launch_backward)."""
    vq, vk = launch.vq, launch.vk
    st = stream or current_stream()
    sc = _score_units(vk, scale)
    if nd * H:
        ctas, threads = G.delta_grid(vk.dtype, vk.Dv, nd * H)
        launch.kd((ctas,), (threads,), st, o[0], do[0], mp, lp, deltap, lse2p, nd, H, o[1], o[2], do[1], do[2])
    if vq is not None and launch.Wq and H:
        launch.kq((launch.Wq, H), (vq.NT,), st, q[0], k[0], v[0], do[0], lse2p, deltap, dqp, launch.workq,
                  q[1], q[2], k[1], k[2], v[1], v[2], do[1], do[2], H * vq.D * vq.GB, H // Hkv, sc, scale,
                  *_mod_args(vq, scale, H, mod))
    W, kk = launch.Wk, launch.kk
    if not (W and Hkv) and not vk.dq_atomic:   # atomic: the convert pass still writes dQ (zeros)
        return
    strides = (q[1], q[2], k[1], k[2], v[1], v[2], do[1], do[2], Hkv * vk.D * vk.GB, Hkv * vk.Dv * vk.GB)
    if vq is not None:
        kk((W, Hkv, vk.col_parts), (vk.NT,), st, q[0], k[0], v[0], do[0], lse2p, deltap, dkp, dvp, launch.workk, *strides,
           H // Hkv, H, sc, scale, *_mod_args(vk, scale, H, mod))
        return
    import contextlib

    import cupy
    with (cupy.cuda.ExternalStream(st.ptr) if stream is not None else contextlib.nullcontext()):
        # ordered: float32 running sums (the first visitor of a block writes before anyone reads)
        # and one turn counter per (query row, head), zeroed; atomic: zeroed sums, no counters
        acc = (cupy.zeros if vk.dq_atomic else cupy.empty)(max(nd * H * vk.D, 1), cupy.float32)
        turns = acc if vk.dq_atomic else cupy.zeros(max(nd * H, 1), cupy.int32)   # atomic: not read
        # flat grid, heads interleaved: block b = (key tile b // Hkv, kv head b % Hkv)
        if W and Hkv:
            kk((W * Hkv,), (vk.NT,), st, q[0], k[0], v[0], do[0], lse2p, deltap, dkp, dvp, dqp, _ptr(acc),
               _ptr(turns), launch.workk, *strides, H * vk.D * vk.GB, H // Hkv, H, sc, scale)
        if vk.dq_atomic:
            _dq_from_accumulator(acc, dqp, nd * H * vk.D, vk.dtype, scale)


def _launch_memo(rec, key, entries, build):
    """The launch record `build()` makes for this call shape, made once per relation record and
    `key` (which holds everything the variants are chosen from besides the tuning tables), and made
    again when `entries` (tuning.table_entries: what the tables say now) differ from what it was
    made from: a table edited at run time (the tuning probes) is read again. Counts the reuse of its
    kernels as cache hits."""
    launch = rec["tables"].get(key)
    if launch is None or launch.entries != entries:
        launch = rec["tables"][key] = build()
        launch.entries = tuple(dict(e) if isinstance(e, dict) else e for e in entries)
    launch.uses += 1
    if launch.uses > 1:
        KERNELS.count_hits(1)
    return launch


def _dq_from_accumulator(acc, dqp, n, dtype, scale):
    """dq_atomic's last pass: dQ = scale * float32 accumulator, in q's dtype, at raw address dqp."""
    import cupy
    if n == 0:
        return
    store = {"float16": "float16", "float32": "float32", "bfloat16": "uint16"}[dtype]
    mem = cupy.cuda.UnownedMemory(dqp, n * np.dtype(store).itemsize, None)
    out = cupy.ndarray((n,), dtype=store, memptr=cupy.cuda.MemoryPointer(mem, 0))
    if dtype == "bfloat16":   # round to nearest even on the bits (no bf16 dtype needed)
        k = KERNELS.derived(None, "tc.dq_bf16", lambda: cupy.ElementwiseKernel(
            "float32 a, float32 s", "uint16 d",
            "unsigned int b = __float_as_uint(a * s); d = (unsigned short)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16)",
            "tiga_dq_bf16"))
    else:
        k = KERNELS.derived(None, "tc.dq_cast", lambda: cupy.ElementwiseKernel(
            "float32 a, float32 s", "T d", "d = (T)(a * s)", "tiga_dq_cast"))
    k(acc[:n], np.float32(scale), out)


def _dq_zero_fill(rec, nd, fused):
    """True when some dQ row is written by no kernel: outside every block, or (fused backward: only
    key tiles write dQ) in a block without sources."""
    if not _covers(rec, "dst", nd):
        return True
    if not fused:
        return False
    key = ("dq-unvisited", nd)
    hit = rec["tables"].get(key)
    if hit is None:
        hit = rec["tables"][key] = bool(schedule.rows_without_keys(rec["dst"], rec["src"], nd, rec["lo"],
                                                                     rec["hi"]).any())
    return hit



def _modifier_for(score_mod, dtype, scale):
    """The generator Modifier of a bound modifier's tree for kernels of `dtype`: the one with the
    value's factor folded into the exponent scale (modifier.Fold) where the call's scalars and
    `scale` let the fold hold, else the unfolded one. Memoised: the lowering and its text are
    made once per tree, tanh and fold, the fold's check once per (scalar values, scale)."""
    tanh = G.modifier.TANH[dtype]
    mod = _modifier(score_mod.tree, tanh, True)
    if mod.fold is None:
        return mod
    values = [score_mod.values.get(x) for x in mod.fold.scalars]
    if not all(_host_number(v) for v in values):
        # a scalar held on the device (a cupy 0-d param): reading it would wait for the stream
        return _modifier(score_mod.tree, tanh, False)
    values = tuple(float(v) for v in values)
    key = (mod, values, float(scale))
    holds = _FOLDS.get(key)
    if holds is None:
        if len(_FOLDS) >= _FOLDS_KEPT:   # a soft-cap that changes every call (a learned one)
            _FOLDS.clear()
        holds = _FOLDS[key] = mod.fold.holds(dict(zip(mod.fold.scalars, values)), scale)
    return mod if holds else _modifier(score_mod.tree, tanh, False)


def _host_number(v):
    """whether v is a number the host holds (a Python / numpy scalar or 0-d numpy array)."""
    return isinstance(v, (int, float, np.integer, np.floating)) or (isinstance(v, np.ndarray) and v.ndim == 0)


def _modifier(tree, tanh, fold, ordered=False):
    mod = _MODIFIERS.get((tree, tanh, fold, ordered))
    if mod is None:
        mod = _MODIFIERS[tree, tanh, fold, ordered] = G.Modifier(tree, tanh, fold, ordered)
    return mod


def _ordered_modifier(score_mod, rec, gmod):
    """the forward's Modifier: `gmod` (_modifier_for's), or where its tree takes |P - src.index|
    (ALiBi's distance) and every edge of the relation has P >= src.index (ordered()), the one
    that takes the distance signed and splits it (modifier.Split). The backward keeps gmod: a dQ
    kernel with the split measured slower (it spilled 160 B where the kernel as written spills
    32 B; benchmarks/results/mods-split-h100-2026-12-06.txt)."""
    if not gmod.distances or not ordered(rec, score_mod, gmod.distances):
        return gmod
    return _modifier(gmod.tree, gmod.tanh, gmod.fold is not None, True)


def ordered(rec, score_mod, distances):
    """whether every edge (i, j) of the relation record has P(i) >= j for each distance
    P - src.index (P: the destination's position and the package's bottom-right shift,
    modifier.SHIFT; its per-head values, if any, must all hold) and every position is below 2^24
    (exact in float32: Split's precision). Memoised on the relation record for the shift array of
    the call (the same object: functional caches it per graph, and nothing writes it), so a call
    pays the check once per graph."""
    fields = tuple(dict.fromkeys(x for d in distances for x in sm.leaves(d.args[0], "node")))
    arrays = tuple(score_mod.values.get(x) for x in fields)
    key = ("ordered", distances)   # the distances name the fields: the same number of arrays
    hit = rec["tables"].get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], arrays)):
        return hit[1]
    rows, last = schedule.last_sources(rec["dst"], rec["src"], rec["lo"], rec["hi"])
    env = {x: _rows_of(a, rows) for x, a in zip(fields, arrays)}
    env[sm.Expr("index", (), "dst")] = rows.astype(np.float64)[:, None]
    ok = bool(rec["src"][-1] <= 2 ** 24)
    for d in distances:
        with np.errstate(invalid="ignore"):
            P = np.asarray(sm.evaluate(d.args[0], env), np.float64)
        P = np.broadcast_to(P, np.broadcast_shapes(P.shape, (rows.size, 1)))
        # a NaN fails both tests
        ok = ok and bool(np.all(P.min(1, initial=np.inf) >= last)) and bool(np.all(np.abs(P) < 2.0 ** 24))
    rec["tables"][key] = (arrays, ok)
    return ok


def _rows_of(values, rows):
    """a destination field's host values at `rows`, as (rows, 1) or (rows, H) float64."""
    a = np.asarray(values.get() if hasattr(values, "get") else values, np.float64)
    a = a[rows]
    return a[:, None] if a.ndim == 1 else a


def _modifier_values(score_mod, H, nd, ns, copies):
    """(device addresses of a bound modifier's values, the arrays that keep them alive): packed
    on every call, since the values (per-head slopes, node fields) are the call's own."""
    if score_mod is None:
        return (), ()
    import cupy

    from ..score_codegen import pack
    arrays = pack(score_mod, cupy, np.float32, H, nd, ns, 0)[:3]
    if any(a.size > 1 for a in arrays[1:]):
        copies.append("score-modifier fields -> packed float32 (N, n, H) arrays")
    return tuple(a.data.ptr for a in arrays), arrays


_MODIFIERS = {}
_FOLDS = {}
_FOLDS_KEPT = 4096   # the fold checks remembered (per (scalar values, scale)); cleared when full


def forward(plan, q, k, v, relation, edge_bias=None, score_mod=None):
    if edge_bias is not None:
        raise NotImplementedError("edge_bias: the tensor-core path serves BlockRelation dot scores only")
    import cupy
    copies = []
    dt = _dtype_name(q)
    nd, H, D = (int(s) for s in q.shape)
    Hkv, Dv = int(v.shape[1]), int(v.shape[2])
    rec = _host_relation(relation)
    rho = getattr(plan, "prune_threshold", None)
    wg = use_wgmma(dt)
    gmod = None if score_mod is None else _ordered_modifier(score_mod, rec, _modifier_for(score_mod, dt, plan.scale))
    key = ("fwd-launch", dt, nd, H, D, Dv, wg, current_device(), gmod, rho is not None)
    launch = _launch_memo(rec, key, tuning.table_entries(dt, wg, ("fwd",), D),
                          lambda: _forward_call(rec, dt, D, Dv, wg, score_mod, gmod, rho is not None))
    vr = launch.vr
    mod, keep = _modifier_values(score_mod, H, nd, int(k.shape[0]), copies)
    q, qp, q_rs, q_hs = _operand(q, "q", copies)
    k, kp, k_rs, k_hs = _operand(k, "k", copies)
    v, vp, v_rs, v_hs = _operand(v, "v", copies)
    if _covers(rec, "dst", nd):
        out = cupy.empty((nd, H, Dv), dtype=q.dtype)
        m, l, m2 = (cupy.empty((nd, H), cupy.float32) for _ in range(3))
    else:
        out = cupy.zeros((nd, H, Dv), dtype=q.dtype)
        m = cupy.full((nd, H), -np.inf, cupy.float32)
        l = cupy.zeros((nd, H), cupy.float32)
        m2 = cupy.full((nd, H), -np.inf, cupy.float32)
    counts = _run_forward(launch, H, Hkv, (qp, q_rs, q_hs), (kp, k_rs, k_hs), (vp, v_rs, v_hs), out.data.ptr,
                          m.data.ptr, l.data.ptr, m2.data.ptr, float(plan.scale), rho=rho, mod=mod)
    if vr.prune and getattr(plan, "run_info", None) is not None:
        # explain()'s tile counts, summed and read back only when asked (RunInfo), on the
        # stream that wrote them
        defer_counts(plan.run_info, lambda s=cupy.cuda.get_current_stream(): _tile_totals(counts, s))
    launch.record(plan, copies)
    return out, m, l, m2


def _forward_call(rec, dt, D, Dv, wgmma, score_mod, gmod, pruned):
    """The _ForwardLaunch of a forward call shape: the shipped variant for the relation's band,
    the score modifier (`gmod`, score_mod's generator Modifier) and tile pruning compiled in, and
    explain()'s words for it."""
    shipped = variant("fwd", D, Dv, dt, wgmma)
    vr = tuning.narrow(shipped, _band_keys(rec))
    why = "" if vr is shipped else tuning.NARROW_WORDS
    if score_mod is not None:
        vr = tuning.with_modifier(vr, gmod)
    if pruned:   # the admission rule compiled in (a separate kernel; exact calls never see it)
        vr = dataclasses.replace(vr, prune=True)
    launch = _ForwardLaunch(rec, vr)
    launch.info = dict(
        kernel=f"tensor-core FA2 forward ({dt}, {_engine(vr)}, cp.async double buffer"
               + (", tile pruning: near key blocks first)" if vr.prune else ")")
               + (f"; score modifier compiled in: f = {score_mod.tree}{vr.mod.tanh_words}{vr.mod.fold_words}"
                  f"{vr.mod.split_words}"
                  if score_mod is not None else ""),
        precision=precision(vr),
        tiles=f"BM={vr.BM} BN={vr.BN} warps={vr.NW}{why}; {launch.visited} of {launch.total} tiles visited "
              f"(tiles outside each block's band skipped, masks only on band-edge / tail tiles)",
        ir={"llvm": launch.kern.llvm, "ptx": launch.kern.ptx})
    return launch


def _tile_totals(counts, stream):
    """(pruned, visited) tiles of a pruned forward from its per-CTA counts (None: no CTA ran)."""
    if counts is None:
        return 0, 0
    with stream:   # the sum runs on the stream that wrote the counts, after the kernel
        totals = counts.sum(0, dtype="int64")
    return tuple(int(x) for x in totals.get(stream=stream))


# ----------------------------------------------------------------------------- backward
def backward(plan, dout, q, k, v, out, m, l, relation, transpose=None, edge_bias=None, m_kernel=None,
             score_mod=None):
    if getattr(plan, "prune_threshold", None) is not None:
        raise NotImplementedError("tile pruning is forward-only (approximation is never dropped)")
    if edge_bias is not None:
        raise NotImplementedError("edge_bias: the tensor-core path serves BlockRelation dot scores only")
    if score_mod is not None and score_mod.grad_leaves:   # the registry routes these to the CUDA cores
        raise NotImplementedError("gradients of score-modifier fields and params are computed on the CUDA cores")
    import cupy
    copies = []
    dt = _dtype_name(q)
    nd, H, D = (int(s) for s in q.shape)
    ns, Hkv, Dv = int(v.shape[0]), int(v.shape[1]), int(v.shape[2])
    rec = _host_relation(relation)
    det = deterministic(plan)
    wg = use_wgmma(dt)
    gmod = None if score_mod is None else _modifier_for(score_mod, dt, plan.scale)
    key = ("bwd-launch", dt, nd, ns, H, Hkv, D, Dv, wg, det, current_device(), gmod)
    entries = tuning.table_entries(dt, wg, ("dq", "dkdv"), D) + (None if det else tuning.atomic_shape(D, dt, wg),)
    launch = _launch_memo(rec, key, entries,
                          lambda: _backward_call(rec, dt, nd, ns, D, Dv, wg, det, score_mod, gmod))
    vq, vk = launch.vq, launch.vk
    mod, keep = _modifier_values(score_mod, H, nd, ns, copies)
    q, qp, q_rs, q_hs = _operand(q, "q", copies)
    k, kp, k_rs, k_hs = _operand(k, "k", copies)
    v, vp, v_rs, v_hs = _operand(v, "v", copies)
    for name, x in (("dout", dout), ("out", out)):
        if _dtype_name(x) != dt:   # the kernels read dO and O in q's element type
            copies.append(f"{name}: {_dtype_name(x)} -> {dt} copy (the kernels read q's element type)")
    dout = dout if _dtype_name(dout) == dt else dout.astype(q.dtype)
    out = out if _dtype_name(out) == dt else out.astype(q.dtype)
    dout, dop, do_rs, do_hs = _operand(dout, "dout", copies)
    out, op, o_rs, o_hs = _operand(out, "out", copies)
    if m_kernel is None:   # natural-log stats only: the conversion the forward's m_kernel avoids
        m2 = cupy.ascontiguousarray(m, dtype=cupy.float32) * np.float32(G.LOG2E)
    else:
        m2 = cupy.ascontiguousarray(m_kernel, dtype=cupy.float32)
    l = cupy.ascontiguousarray(l, dtype=cupy.float32)
    zq = not vk.dq_atomic and _dq_zero_fill(rec, nd, vq is None)   # atomic: the convert pass writes every row
    zk = not _covers(rec, "src", ns)
    dq = (cupy.zeros if zq else cupy.empty)((nd, H, D), dtype=q.dtype)
    dk = (cupy.zeros if zk else cupy.empty)((ns, Hkv, D), dtype=q.dtype)
    dv = (cupy.zeros if zk else cupy.empty)((ns, Hkv, Dv), dtype=q.dtype)
    delta = cupy.empty((nd, H), cupy.float32)
    lse2 = cupy.empty((nd, H, 2), cupy.float32)   # (m2, log2 l) pairs
    _run_backward(launch, nd, H, Hkv, (qp, q_rs, q_hs), (kp, k_rs, k_hs), (vp, v_rs, v_hs), (dop, do_rs, do_hs),
                  (op, o_rs, o_hs), m2.data.ptr, l.data.ptr, delta.data.ptr, lse2.data.ptr, dq.data.ptr,
                  dk.data.ptr, dv.data.ptr, float(plan.scale), mod=mod)
    launch.record(plan, copies)
    return dq, dk, dv, None


def _backward_call(rec, dt, nd, ns, D, Dv, wgmma, det, score_mod, gmod):
    """The _BackwardLaunch of a backward call shape: the shipped variants for the relation's band
    (deterministic or not), the score modifier (`gmod`, score_mod's generator Modifier) compiled
    in, and explain()'s words for them."""
    shipped = backward_variants(D, Dv, dt, det, wgmma)
    band = _band_keys(rec)
    vq, vk = (None if vr is None else tuning.narrow(vr, band) for vr in shipped)
    narrowed = (vq, vk) != shipped
    if score_mod is not None:
        vq, vk = (tuning.with_modifier(vr, gmod) for vr in (vq or variant("dq", D, Dv, dt, wgmma), vk))
    launch = _BackwardLaunch(rec, vq, vk)
    if vq is None and vk.dq_atomic:
        how = ("Delta pre-pass, one kernel per key tile: dK/dV (GQA heads summed in-CTA) and dQ (5 products; "
               "dQ blocks added with float atomics: NOT deterministic, opted in by TIGA_NUMBA_DETERMINISTIC=0), "
               "float32 -> dtype pass")
        tiles = f"dK/dV/dQ BM={vk.BM} BN={vk.BN} warps={vk.NW}"
    elif vq is None:
        how = ("Delta pre-pass, one kernel per key tile: dK/dV (GQA heads summed in-CTA) and dQ (5 products; "
               "dQ blocks added to a float32 accumulator in a fixed key-tile order: deterministic, no atomics)")
        tiles = f"dK/dV/dQ BM={vk.BM} BN={vk.BN} warps={vk.NW}"
    else:
        how = "Delta pre-pass, dQ by query tiles, dK/dV by key tiles (GQA heads summed in-CTA, no atomics)"
        tiles = f"dQ BM={vq.BM} BN={vq.BN} warps={vq.NW}; dK/dV BM={vk.BM} BN={vk.BN} warps={vk.NW}"
        if vk.col_parts > 1:
            tiles += (f", dK and dV columns in {vk.col_parts} parts (one CTA per part; each recomputes "
                      "S^T and dP^T)")
    if narrowed:
        tiles += tuning.NARROW_WORDS
    if score_mod is not None:
        how += f"; score modifier compiled in: f = {score_mod.tree}{vk.mod.tanh_words}{vk.mod.fold_words}, dS scaled by f'"
    main = launch.main
    launch.info = dict(kernel=f"tensor-core FA2 backward ({dt}, {_engine(vk)}): {how}",
                       precision=precision(vk), tiles=tiles, ir={"llvm": main.llvm, "ptx": main.ptx})
    return launch
