"""Tuning data of the tensor-core kernels: the shipped tile shapes per (kernel kind, head dim)
for each engine (mma.sync, wgmma) and dtype class, the head dims each engine serves, and the
Variant each table entry names. The tables are the measured choices (the results files named
at each table); everything that picks a kernel for a call reads them through `variant()` and
`backward_variants()`."""
from __future__ import annotations

import dataclasses

from ... import run_options as _options
from . import device
from . import generator as G

TC_DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIMS = (64, 128)
#: head dims served on compute capability 9.0 by the wgmma kernels, every dtype (rows padded to
#: whole 128-byte sub-tile rows, Variant.row_bytes); elsewhere 32 / 96 go to the CUDA-core kernels
WGMMA_HEAD_DIMS = (32, 64, 96, 128)
#: head dims the 16-bit wgmma kernels serve for plain dot-product scores without pruning, forward and
#: backward (float32, score modifiers and tile pruning stay on the CUDA cores there: those kernels
#: have not run on a GPU at these dims). D = 256: the dK/dV kernel keeps half of the dK and dV
#: columns per CTA (Variant.col_parts = 2; whole, they would take 256 accumulator registers per
#: thread: ptxas 255 registers and ~2.7 KB spilled at every block width), a float32 split forward's
#: bf16 x 3 tiles do not fit shared memory
WGMMA_PLAIN_DIMS = (256,)
#: head dims whose float32 calls come here off sm_90 (3xTF32): only where it measured faster than
#: the CUDA-core float32 kernels (bench_tc.py fp32 section, H200, 2026-11-29); the rest stay on CUDA cores
F32_HEAD_DIMS = (64, 128)

#: per (kernel kind, head dim): warps, m16 tiles per warp, streamed block width, resident operand
#: in shared memory. Chosen by benchmarks/bench_tc.py's sweep on the H200 (2026-11-29); the
#: D = 128 shapes use dynamic shared memory (64-96 KB). Other head dims are not served here.
TUNING = {
    ("fwd", 64): dict(NW=4, MT=2, BN=64),
    ("fwd", 128): dict(NW=4, MT=2, BN=32, a_smem=True),
    ("dq", 64): dict(NW=4, MT=1, BN=64),
    ("dq", 128): dict(NW=4, MT=1, BN=64, a_smem=True),
    ("dkdv", 64): dict(NW=4, MT=1, BN=64),
    ("dkdv", 128): dict(NW=4, MT=1, BN=32, a_smem=True),
}
#: shapes of the fused dK/dV/dQ kernel (Variant.fuse_dq: 5 products, ordered dQ accumulation) per
#: (16-bit or float32, D). Not shipped: on the H200 (benchmarks/results/tc-bwd-h200-2026-11-29.txt)
#: the two-kernel backward was faster in every cell; benchmarks/tuning/bench_tc_bwd.py runs the A/B.
FUSED_DKDV = {
    ("float16", 64): dict(NW=4, MT=1, BN=64, a_smem=True), ("float16", 128): dict(NW=4, MT=1, BN=32, a_smem=True),
    ("float32", 64): dict(NW=4, MT=1, BN=32, a_smem=True), ("float32", 128): dict(NW=4, MT=1, BN=16, a_smem=True),
}


#: opt-in, not deterministic (TIGA_NUMBA_DETERMINISTIC=0): the fused dK/dV/dQ kernel adding dQ with
#: float atomics, for the (dtype, D) where it beat the deterministic two-kernel backward in every
#: cell on the H200 (benchmarks/results/tc-bwd-h200-2026-11-29.txt; final kernels: float32 D=64
#: 16-33 %, D=128 2-25 % faster). 16-bit: within 2 % at D=64 but for one cell, slower at D=128: not offered.
ATOMIC_DQ = {("float32", 64): dict(NW=4, MT=1, BN=32, a_smem=True),
             ("float32", 128): dict(NW=4, MT=1, BN=16, a_smem=True)}
#: the same opt-in on sm_90a (16-bit; D -> shape, the whole wgmma Variant fields as in TUNING_WGMMA):
#: the fused wgmma kernel with dQ added by red.global. Empty: it was not faster than the overlapped
#: two-kernel backward (results/wgmma-fused-bwd-h200-2026-11-30.txt)
ATOMIC_DQ_WGMMA = {}


#: float32 (3xTF32) shapes, same keys: fp32 tiles take twice the shared memory and each A/B
#: fragment twice the registers (big and small halves), so MT = 1; the CTA's own operand stays in
#: shared memory but for the D = 64 forward. 8 warps (BM = 128: each streamed block feeds twice the
#: warps) won for the forwards and the D = 128 backward in the --wide sweep on the H200
#: (2026-11-29, benchmarks/results/tc-fp32-h200-2026-11-29.txt, --wide sweep: fwd D=128 5.45 -> 5.08 ms,
#: bwd D=128 25.7 -> 22.2 ms, fwd D=64 2.52 -> 2.49 ms; bwd D=64 stayed with 4 warps: 10.7 vs 11.2).
TUNING_F32 = {
    ("fwd", 64): dict(NW=8, MT=1, BN=64),
    ("fwd", 128): dict(NW=8, MT=1, BN=32, a_smem=True),
    ("dq", 64): dict(NW=4, MT=1, BN=32, a_smem=True),
    ("dq", 128): dict(NW=8, MT=1, BN=32, a_smem=True),
    ("dkdv", 64): dict(NW=4, MT=1, BN=32, a_smem=True),
    ("dkdv", 128): dict(NW=8, MT=1, BN=16, a_smem=True),
}
# dq D = 128: BN = 64 was 3% faster in the first sweep (before per-block partials) but then
# spilled and did not finish compiling within 190 s on the H200 in the second sweep; BN = 32 did.


#: 16-bit shapes on compute capability 9.0 (H100 / H200): warpgroup wgmma products, compiled
#: for sm_90a (generator "wgmma"); each warpgroup owns 64 rows (NW = 4: one group, 8: two).
#: Chosen by benchmarks/tuning/bench_wgmma.py's sweep on the H200 (2026-11-29, results/wgmma-h200-2026-11-29.txt;
#: sum over N = 4096 / 16384 x causal 0 / 1): fwd D=64 4.35 ms (NW=4 BN=64: 4.36,
#: NW=8 BN=128: 5.51), fwd D=128 8.27 (NW=4 BN=64 8.54, NW=4 BN=128 11.0), bwd D=64 18.1 (BN=64: 20.4;
#: 8 warps 18.6-30.4), bwd D=128 29.4 (dK/dV with 8 warps: 31.2; 4 warps BN=64 / 32 throughout: 37.1).
TUNING_WGMMA = {
    # overlap=False: the D = 64 forward keeps its serial key loop (forward.pipelined_key_blocks not
    # used): pipelined, ptxas gives it 252 registers instead of 166, two CTAs per SM instead of three
    # (capped at three, 144 B spilled: benchmarks/tuning/tc_registers.py --overlap 1 [--min-ctas 3]),
    # and it measured 6-11 % slower on the H200 (bench_hopper.py, results/hopper-h200-2026-12-04.txt
    # §1, two barriers per block; not re-measured with one); at D = 128 / 256 the pipelined loop
    # measured 1.20-1.36x / 1.15-1.17x the serial one (§7)
    ("fwd", 64): dict(NW=4, MT=1, BN=128, a_smem=True, wgmma=True, overlap=False),
    # pingpong: the two warpgroups take turns on the tensor cores through the mbarrier ring
    # (forward.pipelined_key_blocks): 0.93-0.96x the CTA-barrier pipeline's time non-causal, 0.94-1.00x
    # causal (fp16 / bf16, N = 4096 / 16384; results/hopper-h200-2026-12-04b.txt §5), 0.85-0.96x in a
    # second run (§10); with two V slots instead of three within 2 % either way (§10); with whole
    # blocks copied without row tests 0.83-0.94x (§11: 557-584 TF/s at N = 16384 non-causal)
    ("fwd", 128): dict(NW=8, MT=1, BN=128, a_smem=True, wgmma=True, pingpong=True),
    ("dq", 64): dict(NW=4, MT=1, BN=128, a_smem=True, wgmma=True),
    ("dq", 128): dict(NW=8, MT=1, BN=128, a_smem=True, wgmma=True),
    ("dkdv", 64): dict(NW=4, MT=1, BN=128, a_smem=True, wgmma=True),
    ("dkdv", 128): dict(NW=4, MT=1, BN=64, a_smem=True, wgmma=True),
    # D = 256 (WGMMA_PLAIN_DIMS): two warpgroups share each 64-key block (ptxas:
    # 244 registers, no spills, 197 KB of shared memory; one warpgroup: 254 registers, 165 KB;
    # benchmarks/gpu/head256_probe.py compares them on the H200); in ping-pong 242 registers and
    # 230 KB, 0.88-0.92x the CTA-barrier pipeline's time causal at N = 16384, 0.99-1.01x non-causal
    # (results/hopper-h200-2026-12-04b.txt §9)
    ("fwd", 256): dict(NW=8, MT=1, BN=64, a_smem=True, wgmma=True, pingpong=True),
    # D = 256 backward (ptxas, bench_tc_bwd.py --spills sm_90a --wgmma --no-fused --dims 256: dQ 223
    # registers, no spills, 197 KB of shared memory; dK/dV in two column parts with its statistics in
    # shared memory 237 registers, no spills, 198 KB): the fastest of bench_tc_bwd.py's WG_PAIRS on the H100
    # (results/hopper-h100-2026-12-06.txt §1; the dQ kernel with NW = 4 took 0.99-1.03x the time at BN = 64,
    # 1.05-1.10x at BN = 32; the one-warpgroup dK/dV kernels 1.09-1.48x: one CTA per SM either way, and two
    # warpgroups share each streamed block)
    ("dq", 256): dict(NW=8, MT=1, BN=32, a_smem=True, wgmma=True),
    ("dkdv", 256): dict(NW=8, MT=1, BN=32, a_smem=True, wgmma=True, col_parts=2),
}


def _padded_dims(table):
    """D = 32 / 96 run the shapes of D = 64 / 128 (rows padded to whole 128-byte sub-tile rows)."""
    table.update({(kind, d): dict(table[(kind, like)]) for kind in ("fwd", "dq", "dkdv")
                  for d, like in ((32, 64), (96, 128))})


# 16-bit: a sweep of their own candidates (results/wgmma-h200-2026-11-29.txt) chose the same ones (no spills at 159-253 /
# 176-246 registers, ptxas report)
_padded_dims(TUNING_WGMMA)


#: float32 on compute capability 9.0: the same wgmma kernels on bf16 x 3 operand parts
#: (generator "split": 6 passes per product, per-block partials). Three bf16 parts take 1.5x the
#: shared memory of a float32 tile and a float32 staging tile is added, so blocks are narrower
#: than the 16-bit ones; D = 128 backward kernels hold one warpgroup (two would not fit).
#: Chosen by benchmarks/tuning/bench_fp32_wgmma.py's sweep on the H200 (2026-11-30,
#: results/fp32-wgmma-h200-2026-11-30.txt; sum over N = 4096 / 16384 x causal 0 / 1): fwd D=64
#: 19.5 ms (NW=4 BN=64: 23.2, BN=128: 31.1), fwd D=128 43.8 (NW=4 BN=64: 59.1, BN=32: 66.6), bwd D=64
#: 86.4 (4 warps: 88.3-96.5), bwd D=128 225 (dK/dV BN=16: 296); a later sweep: dK/dV D=128 with 32-column
#: P B chains (pb_cols, fewer partial registers: 236 B of spills instead of 328) 220.3.
TUNING_WGMMA_F32 = {
    ("fwd", 64): dict(NW=8, MT=1, BN=64, a_smem=True, wgmma=True),
    ("fwd", 128): dict(NW=8, MT=1, BN=32, a_smem=True, wgmma=True),
    ("dq", 64): dict(NW=8, MT=1, BN=32, a_smem=True, wgmma=True),
    ("dq", 128): dict(NW=4, MT=1, BN=32, a_smem=True, wgmma=True),
    ("dkdv", 64): dict(NW=8, MT=1, BN=32, a_smem=True, wgmma=True),
    ("dkdv", 128): dict(NW=4, MT=1, BN=32, a_smem=True, wgmma=True, pb_cols=32),
}
_padded_dims(TUNING_WGMMA_F32)   # not swept separately

#: the wgmma backward overlaps its dP chain (16-bit dK/dV: and dV) with the softmax / dS work
#: (Variant.overlap), measured per kernel against the serial twin on the H200 (bench_tc_bwd.py
#: --wgmma --no-fused). With one CTA barrier per streamed block (StreamedPair.advance;
#: results/hopper-h200-2026-12-04.txt §10, float16, N = 4096 / 16384, causal and not): the 16-bit
#: dK/dV kernel at D = 128 overlapped took 0.77-0.85x the serial one's backward time (19.9 against
#: 25.0 ms at N = 16384 non-causal), where with two barriers it had been up to 16 % slower
#: (wgmma-fused-bwd-h200-2026-11-30.txt §2-3), and beside the overlapped dK/dV kernel the serial dQ
#: kernel beat its overlapped twin in all 8 cells (D = 64 by 0.1-2.6 %, D = 128 by 3-8 %; beside the
#: serial dK/dV kernel at D = 64: 2 of 4, within 1 %). So the 16-bit D = 64 / 128 dQ kernels keep every
#: chain serial and every 16-bit dK/dV kernel overlaps. D = 256 (H100, results/hopper-h100-2026-12-06.txt
#: §1): the serial dQ kernel 0.4-2.4 % faster in all 4 cells beside the overlapped dK/dV kernel in column
#: parts, whose serial twin took 1.19-1.50x as long. float32 (not re-measured): the D = 128
#: dK/dV kernels stay serial (slower overlapped before, up to 16 %), the rest overlap (2-6 % faster).
TUNING_WGMMA_F32[("dkdv", 128)]["overlap"] = False
for _d in (64, 128, 256):
    TUNING_WGMMA[("dq", _d)]["overlap"] = False


#: shape changes for kernels with a score modifier compiled in, per (engine, kind, D), e.g.
#: {("wgmma", "fwd", 128): dict(BN=64)}. Empty: the modifier's cell values need registers the
#: unmodified D = 128 wgmma forward (246 of 255) has few of (ptxas, benchmarks/tuning/tc_registers.py
#: --modifier: soft-cap 254, ALiBi 251, bottom-right aligned ALiBi 255 with 48 B spilled), but on the
#: H200 a key block of 64 was slower for soft-cap and ALiBi alike (4.91 / 4.18 ms against 4.73 /
#: 4.00 ms, benchmarks/gpu/mods_probe.py; results/gpu-h200-2026-12-03b.txt).
MODIFIED = {}


#: shape changes for the forward over a narrow band, per (engine, kind, D): a banded relation
#: (Graph.band, window=) whose every block's band is at most NARROW_KEYS keys wide gives each
#: query tile a few key blocks only, so a CTA's prologue (its Q tile, the first K / V block) and
#: epilogue weigh as much as its loop; one warpgroup with 64-key blocks (158 registers, 83 KB of
#: shared memory, benchmarks/tuning/tc_registers.py --narrow: two CTAs per SM) lets one CTA's loop
#: run while the other loads or stores. H200, fp16, N = 16384,
#: H = 16, D = 128, the forward kernel alone (benchmarks/gpu/window_probe.py; results/
#: gpu-h200-2026-12-03c.txt): window of 1024 keys 0.456 ms (shipped NW=8 BN=128) -> 0.397 ms
#: (NW=4 BN=64); causal, which visits 64 blocks per tile on average, 2.69 -> 2.86 ms (not used there).
#: The backward's dQ kernel over the same window, dK / dV at its shipped shape
#: (benchmarks/gpu/window_probe.py --kind dq; results/gpu-h200-2026-12-03g.txt): NW = 8 BN = 128
#: 1.700 ms -> NW = 4 BN = 64 1.620 ms for the whole backward, causal unchanged (10.83 / 10.86 ms).
NARROW = {("wgmma", "fwd", 128): dict(NW=4, BN=64), ("wgmma", "dq", 128): dict(NW=4, BN=64)}
#: the widest band (keys per row) NARROW serves: the measured window
NARROW_KEYS = 1024
#: the dtypes NARROW serves: those whose narrow-band kernel has run on the H200 (tests/
#: test_tc_bands_gpu.py at D = 128 and compute-sanitizer on it, float16 and bfloat16: results/
#: gpu-h200-2026-12-03d.txt); the float32 splits were not measured and keep the shipped shape
NARROW_DTYPES = ("float16", "bfloat16")


def narrow(vr, band_keys):
    """Variant vr as it runs over a banded relation whose widest band is `band_keys` keys per row
    (None: not banded): NARROW's shape change for its table entry when the band is narrow enough
    and vr's dtype is in NARROW_DTYPES, else vr itself."""
    if band_keys is None or band_keys > NARROW_KEYS or vr.dtype not in NARROW_DTYPES:
        return vr
    return _changed(vr, NARROW)


#: what explain()'s tiles line adds when a kernel took NARROW's shape
NARROW_WORDS = f" (bands of at most {NARROW_KEYS} keys: the narrow-band shape)"


def narrow_kinds(dtype):
    """[(wgmma, kind, D)] of the narrow-band kernels of `dtype` (prebuild)."""
    return [(engine == "wgmma", kind, D) for engine, kind, D in NARROW] if dtype in NARROW_DTYPES else []


def _changed(vr, table):
    """Variant vr with `table`'s shape change for its (engine, kind, D), if the table has one
    (memoised per table: dataclasses.replace costs microseconds on every call)."""
    change = table.get(("wgmma" if vr.wgmma else "mma", vr.kind, vr.D))
    if not change:
        return vr
    key = (id(table), vr)
    hit = _CHANGED.get(key)
    if hit is None or hit[0] != change:   # a table edited at run time (the probes) is re-read
        hit = _CHANGED[key] = (dict(change), dataclasses.replace(vr, **change))
    return hit[1]


_CHANGED = {}


def modified(vr):
    """Variant vr as it runs with a score modifier (mod set by the caller): MODIFIED's shape
    change for its table entry, if any."""
    return _changed(vr, MODIFIED)


def with_modifier(vr, mod):
    """Variant vr with the generator Modifier `mod` compiled in, as every modified call runs it:
    the backward's two-kernel variants without overlap (Variant.check), then MODIFIED's shape.
    The modified backward stays serial because overlapping it does not pay: a 16-bit dK/dV kernel
    with a modifier that keeps dP in flight while the cells make P and P f'(z) spills 228 B at
    D = 128 (80 B serial) and is slower on an H100 (soft-cap / ALiBi forward+backward at N = 16384:
    17.6 / 17.5 ms against 14.2 / 14.1 ms; benchmarks/results/gpu-h100-2026-12-05c.txt). With the
    block statistics in shared memory (Variant.stats_smem) the serial soft-cap kernel spills
    40 / 32 B (stores / loads) with its fold (modifier.Fold), 28 / 20 B without, the ALiBi one none
    (ptxas, D = 128, fp16: benchmarks/tuning/tc_registers.py --kinds dkdv --dims 128 --modifier
    softcap [--no-fold])."""
    extra = {} if vr.kind == "fwd" else dict(fuse_dq=False, dq_atomic=False, overlap=False)
    return modified(dataclasses.replace(vr, mod=mod, **extra))


def head_dims(dtype, wgmma, op=None):
    """the head dims (D == Dv) the tensor-core kernels of `dtype` serve, on wgmma or mma.sync, for
    every call of both passes; op="forward" / "backward": a plain call's (dot-product scores, no
    pruning), which on wgmma adds WGMMA_PLAIN_DIMS (16-bit)."""
    if wgmma:
        if op in ("forward", "backward") and dtype != "float32":
            return WGMMA_HEAD_DIMS + WGMMA_PLAIN_DIMS
        return WGMMA_HEAD_DIMS
    return F32_HEAD_DIMS if dtype == "float32" else HEAD_DIMS


def tuning_table(dtype, wgmma=None):
    """the shape table for a dtype and engine: mma.sync (16-bit, or float32 as 3xTF32) or wgmma on
    sm_90 (16-bit, or float32 as bf16 x 3 splits); wgmma None: the table this call's routing uses
    (device.use_wgmma)."""
    if wgmma is None:
        wgmma = device.use_wgmma(dtype)
    if dtype == "float32":
        return TUNING_WGMMA_F32 if wgmma else TUNING_F32
    return TUNING_WGMMA if wgmma else TUNING


_VARIANTS = {}


def _entry_variant(key, shape, kind, D, Dv, dtype, **fixed):
    """the Variant of one table entry (`shape`: its Variant fields), memoised per entry object:
    asked several times per call, and a sweep that assigns a new shape dict gets a new Variant."""
    hit = _VARIANTS.get(key)
    if hit is None or hit[0] is not shape:
        hit = _VARIANTS[key] = (shape, G.Variant(kind, D, Dv, dtype=dtype, **fixed, **shape))
    return hit[1]


def table_entries(dtype, wgmma, kinds, D):
    """What the tables hold now for the kernels of `kinds` at head dim D on one engine: per kind,
    the shipped shape (tuning_table) and the NARROW and MODIFIED changes (None where there is
    none), then the narrow-band limits (NARROW_KEYS, NARROW_DTYPES). The tensor-core launch memos (api._launch_memo) compare it with what a launch was made
    from, so that a table edited at run time is read again."""
    table = tuning_table(dtype, wgmma)
    engine = "wgmma" if wgmma else "mma"
    out = ()
    for kind in kinds:
        out += (table.get((kind, D)), NARROW.get((engine, kind, D)), MODIFIED.get((engine, kind, D)))
    return out + (NARROW_KEYS, NARROW_DTYPES)


def variant(kind, D, Dv, dtype, wgmma=None):
    """the shipped Variant of (kind, D, dtype); wgmma None: as use_wgmma(dtype) decides now."""
    table = tuning_table(dtype, wgmma)
    return _entry_variant((kind, D, Dv, dtype, id(table)), table[(kind, D)], kind, D, Dv, dtype)


def precision(v):
    """run_info["precision"]: what the tensor cores of Variant v computed in."""
    if v.split:
        return ("bf16 x 3 splits (fp32-class: x = hi + mid + lo bfloat16 parts, 6 wgmma passes per product, "
                "fp32 accumulation, value products summed per block)")
    if v.tf32:
        return ("3xTF32 (fp32-class: x = big + small tf32 halves, 3 mma.m16n8k8.tf32 passes per product, "
                "fp32 accumulation)")
    return f"{v.dtype} operands, fp32 accumulation and softmax (mma.m16n8k16 or, on sm_90, wgmma m64nNk16)"


def backward_variants(D, Dv, dtype, deterministic=True, wgmma=None):
    """(dQ variant, dK/dV variant) of the shipped tuning: (None, fused) when the dK/dV kernel also
    computes dQ (Variant.fuse_dq). deterministic=False picks the float-atomic fused kernel where
    the engine's atomic table (ATOMIC_DQ, ATOMIC_DQ_WGMMA) has a shape (it measured faster there),
    else the same as True. wgmma None: as use_wgmma(dtype) decides now."""
    if wgmma is None:
        wgmma = device.use_wgmma(dtype)
    if not deterministic and Dv == D:
        va = atomic_variant(D, dtype, wgmma)
        if va is not None:
            return None, va
    vk = variant("dkdv", D, Dv, dtype, wgmma)
    return (None if vk.fuse_dq else variant("dq", D, Dv, dtype, wgmma)), vk


def atomic_shape(D, dtype, wgmma):
    """the opt-in float-atomic backward's tile shape for (D, dtype) on an engine, or None."""
    if wgmma:
        return None if dtype == "float32" else ATOMIC_DQ_WGMMA.get(D)
    return ATOMIC_DQ.get((dtype, D))


def atomic_variant(D, dtype, wgmma=False):
    """the opt-in float-atomic backward's Variant, or None where none is offered."""
    shape = atomic_shape(D, dtype, wgmma)
    if shape is None:
        return None
    return _entry_variant(("dkdv_atomic", D, dtype, wgmma), shape, "dkdv", D, D, dtype, fuse_dq=True, dq_atomic=True)


def deterministic(plan=None):
    """False when the call opted out of bit-reproducible backward passes
    (attention_backward(..., deterministic=False), tg.options, or the TIGA_NUMBA_DETERMINISTIC=0
    default; like torch.use_deterministic_algorithms(False))."""
    opts = getattr(plan, "options", None) or _options.current()
    return opts.deterministic


def _engine(v):
    """which tensor-core instruction a Variant's products use (explain())."""
    if v.split:
        return "wgmma m64nNk16 warpgroups on bf16 x 3 splits, 6 passes per product, sm_90a"
    if v.wgmma:
        return "wgmma m64nNk16 warpgroups, sm_90a"
    return "mma.sync m16n8k8 tf32 x3" if v.tf32 else "mma.sync m16n8k16"
